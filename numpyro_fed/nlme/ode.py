r"""Structural models from any ODE system (diffrax), with NONMEM-style dosing events.

:func:`ode_model` turns a right-hand side ``rhs(t, A, params) -> dA/dt`` (``A``: the
``(n_states,)`` compartment amounts) into a structural function with the same contract as
:mod:`numpyro_fed.nlme.pk`'s closed-form models::

    f(params: dict[str, scalar], t: (T,), doses) -> (T,)

for one subject (the caller vmaps over subjects); pure JAX, jit-able, vmappable, and
differentiable in ``params`` by :func:`jax.grad`, :func:`jax.jacfwd` and :func:`jax.hessian`.

**Dosing** (fields ``time, amt, rate, cmt, ss, ii, mask``, each ``(D,)``; ``cmt`` 1-based):

- bolus (``rate = 0``): ``A[cmt-1] += amt`` at time ``time + TLAG``;
- infusion (``rate > 0``): ``rate`` added to ``dA[cmt-1]/dt`` over
  ``[time + TLAG, time + TLAG + amt / rate)``;
- optional parameters ``TLAG`` (default 0, added to every dose time) and ``F`` (default 1,
  multiplies the amount of doses into ``default_dose_cmt``, NONMEM's ``F1``; an infusion keeps
  its rate and lasts ``F * amt / rate``), as in the closed-form models;
- padding doses (``mask = False``) do nothing; an observation at a dose time sees the
  post-dose state; before the first dose the state is zero (and ``rhs`` is not integrated),
  so observations there are ``observe(0)`` (0 by default);
- steady-state doses are not supported: :meth:`ODEModel.check_doses` raises on ``ss = True``
  (expand the dosing history, or use a closed-form model); inside ``jit``, such a dose, or
  one into a compartment the model lacks or with ``rate < 0``, makes the subject's
  predictions NaN.

**Observations** are ``observe(A, params)`` (by default ``A[central-1] / V``); with
``f(params, t, doses, cmt=cmt)`` (``(T,)`` compartment of each observation, 0 = central) an
observation of another compartment ``c`` is its amount ``A[c-1]`` (NONMEM's ``A(c)/Sc``
without a scale ``Sc``).

**Method.** The dose starts, infusion ends and observation times are merged into one sorted
grid of static size ``2 D + T`` (padding sorted last and skipped); a :func:`jax.lax.scan` over
it solves the ODE from each grid point to the next with one :func:`diffrax.diffeqsolve`
(time rescaled to ``[0, 1]``: a zero-length interval has a zero vector field, and the event
times -- hence ``TLAG`` and ``F`` -- are differentiable), applies the bolus or
records ``observe(A, params)`` at observation times. The infusion input over an interval is
recomputed from the doses (no accumulated round-off). Derivatives go through the solver
with :class:`diffrax.DirectAdjoint` by default, which supports reverse mode, forward mode and
forward-over-reverse Hessians (``RecursiveCheckpointAdjoint`` does not support forward mode);
its cost grows with ``max_steps`` (steps per interval between grid points), so keep that
modest. A solve that needs more steps raises at run time (diffrax's ``throw=True``).
The derivatives are those of the numerical solution: accurate to about the solver tolerances
(an adaptive step sequence has kinks where it changes, ~rtol in size; a fixed-step solve,
``stepsize_controller=diffrax.ConstantStepSize()`` with ``dt0``, is smooth in the
parameters, e.g. to check Hessians by finite differences).

Example (one compartment, Michaelis-Menten elimination)::

    def rhs(t, A, p):
        c = A[1] / p["V"]
        return jnp.stack([-p["KA"] * A[0], p["KA"] * A[0] - p["VM"] * c / (p["KM"] + c)])

    f = ode_model(rhs, 2, central=2, param_names=("KA", "V", "VM", "KM"),
                  compartments={1: "depot", 2: "central"})
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import diffrax
import jax
import jax.numpy as jnp

from numpyro_fed._validation import check_int
from numpyro_fed.nlme.pk import DOSING_PARAMS, StructuralModel, _DoseArrays

__all__ = ["ODEModel", "ode_model"]


class ODEModel(StructuralModel):
    """A structural function solving an ODE system between dosing and observation events
    (see the module docstring). Build it with :func:`ode_model`.

    :ivar rhs: the right-hand side ``rhs(t, A, params) -> dA/dt``.
    :ivar n_states: number of states (compartments).
    :ivar solver: the diffrax solver.
    :ivar adjoint: the diffrax adjoint.
    """

    supports_steady_state = False

    def __init__(
        self,
        rhs: Callable,
        n_states: int,
        *,
        observe: Callable | None,
        central: int,
        volume: str,
        param_names: tuple[str, ...],
        optional_params: Mapping[str, float] | None,
        compartments: Mapping[int, str] | None,
        default_dose_cmt: int,
        solver: Any,
        adjoint: Any,
        stepsize_controller: Any,
        rtol: float,
        atol: float,
        dt0: float | None,
        max_steps: int,
    ) -> None:
        """See :func:`ode_model` for the arguments."""
        if not callable(rhs):
            raise TypeError(f"rhs must be a function rhs(t, A, params) -> dA/dt, got {rhs!r}.")
        n_states = check_int("n_states", n_states, minimum=1)
        n = int(n_states)
        if isinstance(param_names, str) or not all(isinstance(k, str) for k in param_names):
            raise TypeError(
                f"param_names must be a tuple of parameter names (str), got {param_names!r}."
            )
        names = tuple(param_names)
        if len(set(names)) != len(names):
            raise ValueError(f"param_names has duplicates: {names}.")
        optional = dict(DOSING_PARAMS)
        optional.update(dict(optional_params or {}))
        for k in names:
            optional.pop(k, None)  # a dosing parameter listed as required is required
        if observe is None:
            if volume not in names and volume not in optional:
                raise ValueError(
                    f"volume={volume!r} is not among param_names {list(names)} (or "
                    "optional_params): the default observation is A[central-1] / "
                    "params[volume]; add it, or pass observe=."
                )
        elif not callable(observe):
            raise TypeError(f"observe must be a function observe(A, params), got {observe!r}.")
        if compartments is None:
            compartments = {i: f"cmt{i}" for i in range(1, n + 1)}
        compartments = dict(compartments)
        if sorted(compartments) != list(range(1, n + 1)):
            raise ValueError(
                f"compartments must name the compartments 1..{n} (n_states={n}), got keys "
                f"{sorted(compartments)}."
            )
        for arg, val in (("central", central), ("default_dose_cmt", default_dose_cmt)):
            if val not in compartments:
                raise ValueError(
                    f"{arg}={val!r} is not a compartment: use one of {compartments} (1-based)."
                )
        if not (rtol > 0 and atol > 0):
            raise ValueError(f"rtol and atol must be > 0, got rtol={rtol}, atol={atol}.")
        max_steps = check_int("max_steps", max_steps, minimum=1)
        self.rhs = rhs
        self.n_states = n
        self.observe = observe
        self.central = int(central)
        self.volume = volume
        self.param_names = names
        self.optional_params = optional
        self.compartments = compartments
        self.default_dose_cmt = int(default_dose_cmt)
        self.observed_cmt = self.central
        self.solver = diffrax.Tsit5() if solver is None else solver
        self.adjoint = diffrax.DirectAdjoint() if adjoint is None else adjoint
        if stepsize_controller is None:
            stepsize_controller = diffrax.PIDController(rtol=rtol, atol=atol)
        elif isinstance(stepsize_controller, diffrax.ConstantStepSize) and dt0 is None:
            raise ValueError(
                "stepsize_controller=ConstantStepSize() needs dt0= (the step as a fraction of "
                "each interval between events, e.g. 0.05 for 20 steps per interval)."
            )
        self.stepsize_controller = stepsize_controller
        self.rtol, self.atol, self.dt0, self.max_steps = rtol, atol, dt0, max_steps
        # a nested jit: traced once per shape, then reused as a jaxpr under grad, jacfwd,
        # hessian and vmap (re-tracing diffrax's Python code under each is slow)
        self._solve_jit = jax.jit(self._solve)

    def __repr__(self) -> str:
        name = getattr(self.rhs, "__name__", repr(self.rhs))
        return f"ode_model({name}, n_states={self.n_states}, central={self.central})"

    # ---------------------------------------------------------------- pieces
    def _observe(self, A: jax.Array, p: dict[str, jax.Array]) -> jax.Array:
        if self.observe is None:
            return A[self.central - 1] / p[self.volume]
        y = jnp.asarray(self.observe(A, p))
        if y.shape != ():
            raise ValueError(f"observe(A, params) must return a scalar, got shape {y.shape}.")
        return y

    def _field(self, p: dict[str, jax.Array]) -> Callable:
        def field(s, A, args):
            t0, length, input_rate = args
            dA = jnp.asarray(self.rhs(t0 + s * length, A, p))
            if dA.shape != (self.n_states,):
                raise ValueError(
                    f"rhs(t, A, params) must return dA/dt of shape ({self.n_states},) "
                    f"(n_states), got {dA.shape}."
                )
            return length * (dA.astype(A.dtype) + input_rate)

        return field

    # ---------------------------------------------------------------- prediction
    @property
    def predicted_cmts(self) -> tuple[int, ...]:
        """The compartments an observation may name (``cmt=`` of :meth:`__call__`): all."""
        return tuple(sorted(self.compartments))

    def __call__(
        self, params: Mapping[str, Any], t: jax.Array, doses: Any, cmt: Any = None
    ) -> jax.Array:
        """Observations ``(T,)`` (``observe(A(t), params)``, by default the concentration
        ``A[central-1] / params[volume]``) for one subject.

        :param params: ``{name: scalar}`` with every name of ``param_names`` (and any of
            ``optional_params``).
        :param t: ``(T,)`` observation times.
        :param doses: dosing record, fields ``time, amt, rate, cmt, ss, ii, mask`` ``(D,)``.
        :param cmt: optional ``(T,)`` int compartment of each observation: 0 or ``central``
            give ``observe(A(t), params)``; another compartment ``c`` its amount
            ``A[c-1](t)`` (NONMEM's ``A(c)/Sc`` without a scale ``Sc``); a number beyond
            the compartments NaN.
        :return: ``(T,)`` predictions.
        :raises ValueError: unknown or missing parameter names, bad shapes (trace time).
        """
        p, t, d = self._prepare(params, t, doses)
        if d.time.shape[0] == 0:  # no dose column: one padding dose
            d = _DoseArrays(*(jnp.zeros((1,), a.dtype) for a in d))
        if cmt is not None:
            cmt = jnp.broadcast_to(jnp.asarray(cmt, jnp.int32), t.shape)
        return self._solve_jit(p, t, d, cmt) + self._poison(d)

    def _solve(self, p: dict[str, jax.Array], t: jax.Array, d: _DoseArrays,
               cmt: jax.Array | None = None) -> jax.Array:
        n, dtype = self.n_states, t.dtype
        D, T = d.time.shape[0], t.shape[0]
        amt = jnp.where(d.cmt == self.default_dose_cmt, p["F"] * d.amt, d.amt)
        inf = d.mask & (d.rate > 0)
        bolus = d.mask & ~inf
        start = d.time + p["TLAG"]
        end = start + jnp.where(inf, amt / jnp.where(inf, d.rate, 1.0), 0.0)
        onehot = jax.nn.one_hot(jnp.clip(d.cmt - 1, 0, n - 1), n, dtype=dtype)  # (D, n)

        # event grid: dose starts (kind 0), infusion ends (1), observations (2); padding
        # gets the key +inf (sorted last, skipped); ties: end, start, then observation
        big = jnp.asarray(jnp.inf, dtype)
        key = jnp.concatenate([jnp.where(d.mask, start, big), jnp.where(inf, end, big), t])
        kind = jnp.concatenate([jnp.zeros(D, jnp.int32), jnp.ones(D, jnp.int32),
                                jnp.full(T, 2, jnp.int32)])
        priority = jnp.concatenate([jnp.ones(D, jnp.int32), jnp.zeros(D, jnp.int32),
                                    jnp.full(T, 2, jnp.int32)])
        index = jnp.concatenate([jnp.arange(D), jnp.arange(D), jnp.arange(T)])
        order = jnp.lexsort((priority, key))
        times = jnp.concatenate([start, end, t])[order]
        events = (times, kind[order], index[order], (key < big)[order])
        # the state is zero until the first dose (no integration before it)
        t_first = jnp.where(
            jnp.any(d.mask), jnp.min(jnp.where(d.mask, start, big)), jnp.max(t)
        )

        term = diffrax.ODETerm(self._field(p))
        s0, s1 = jnp.zeros((), dtype), jnp.ones((), dtype)
        dt0 = None if self.dt0 is None else jnp.asarray(self.dt0, dtype)

        def step(carry, event):
            A, t_cur, out = carry
            time, kd, j, valid = event
            t_new = jnp.where(valid, jnp.maximum(time, t_cur), t_cur)
            length = t_new - t_cur
            mid = t_cur + 0.5 * length
            running = inf & (start <= mid) & (mid < end)
            input_rate = jnp.where(running, d.rate, 0.0) @ onehot  # (n,)
            sol = diffrax.diffeqsolve(
                term, self.solver, s0, s1, dt0, A, args=(t_cur, length, input_rate),
                stepsize_controller=self.stepsize_controller, adjoint=self.adjoint,
                max_steps=self.max_steps, saveat=diffrax.SaveAt(t1=True),
            )
            A = sol.ys[-1]
            jd = jnp.clip(j, 0, D - 1)
            A = A + jnp.where(valid & (kd == 0) & bolus[jd], amt[jd], 0.0) * onehot[jd]
            jo = jnp.clip(j, 0, T - 1)
            y = self._observe(A, p)
            if cmt is not None:  # the compartment the observation names
                c = cmt[jo]
                amount = jnp.where(c <= n, A[jnp.clip(c - 1, 0, n - 1)], jnp.nan)
                y = jnp.where((c == 0) | (c == self.central), y, amount)
            out = out.at[jo].set(jnp.where(valid & (kd == 2), y, out[jo]))
            return (A, t_new, out), None

        init = (jnp.zeros(n, dtype), t_first, jnp.zeros(T, dtype))
        (_, _, out), _ = jax.lax.scan(step, init, events)
        return out


def ode_model(
    rhs: Callable,
    n_states: int,
    *,
    observe: Callable | None = None,
    central: int = 1,
    volume: str = "V",
    param_names: tuple[str, ...] = (),
    optional_params: Mapping[str, float] | None = None,
    compartments: Mapping[int, str] | None = None,
    default_dose_cmt: int = 1,
    solver: Any = None,
    adjoint: Any = None,
    stepsize_controller: Any = None,
    rtol: float = 1e-6,
    atol: float = 1e-9,
    dt0: float | None = None,
    max_steps: int = 1024,
) -> ODEModel:
    """A structural function ``f(params, t, doses) -> (T,)`` from an ODE system (see the
    module docstring for dosing and the method).

    :param rhs: ``rhs(t, A, params) -> dA/dt``: ``t`` scalar time, ``A`` ``(n_states,)``
        amounts, ``params`` the dict of scalars (optional ones filled with their defaults);
        pure JAX. Infusion inputs are added to it.
    :param n_states: number of states; compartment ``i`` (NONMEM ``CMT = i``) is ``A[i-1]``.
    :param observe: ``observe(A, params) -> scalar`` prediction from the state; default
        ``A[central-1] / params[volume]``.
    :param central: the observed compartment (1-based) of the default ``observe``.
    :param volume: the parameter dividing the central amount in the default ``observe``.
    :param param_names: required parameter names (the ones ``rhs``/``observe`` use).
    :param optional_params: further optional parameters ``{name: default}``; ``TLAG`` (0)
        and ``F`` (1) are always optional (unless listed in ``param_names``).
    :param compartments: ``{1: "depot", 2: "central", ...}`` names of compartments
        ``1..n_states``; default ``cmt1, cmt2, ...``.
    :param default_dose_cmt: the compartment whose doses ``F`` multiplies (NONMEM ``F1``).
    :param solver: a diffrax solver; default :class:`diffrax.Tsit5` (use e.g.
        :class:`diffrax.Kvaerno5` for stiff systems, :class:`diffrax.Dopri8` for tight
        tolerances).
    :param adjoint: a diffrax adjoint; default :class:`diffrax.DirectAdjoint` (reverse and
        forward mode, hence Hessians); :class:`diffrax.RecursiveCheckpointAdjoint` is
        cheaper for reverse mode only, :class:`diffrax.ForwardMode` for forward mode only.
    :param stepsize_controller: a diffrax step-size controller; default
        ``diffrax.PIDController(rtol=rtol, atol=atol)`` (adaptive).
        ``diffrax.ConstantStepSize()`` with ``dt0`` gives a fixed number of steps per interval
        between events: a numerical solution that is a smooth function of the parameters (an
        adaptive one has kinks where its step sequence changes).
    :param rtol: relative tolerance of the default adaptive controller.
    :param atol: absolute tolerance of the default adaptive controller (amount units).
    :param dt0: first step, as a fraction of the interval between two events (the solve runs
        on a rescaled time in ``[0, 1]``); default: chosen by the solver.
    :param max_steps: most steps per interval between events (the cost of DirectAdjoint
        grows with it); exceeding it raises at run time.
    :return: the structural function (an :class:`ODEModel`).
    :raises ValueError: inconsistent arguments (names, compartments, tolerances).
    :raises TypeError: ``rhs``/``observe`` not callable, bad ``n_states``/``param_names``.
    """
    return ODEModel(
        rhs, n_states, observe=observe, central=central, volume=volume,
        param_names=tuple(param_names) if not isinstance(param_names, str) else param_names,
        optional_params=optional_params, compartments=compartments,
        default_dose_cmt=default_dose_cmt, solver=solver, adjoint=adjoint,
        stepsize_controller=stepsize_controller, rtol=rtol,
        atol=atol, dt0=dt0, max_steps=max_steps,
    )
