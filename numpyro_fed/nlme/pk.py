r"""Closed-form linear compartment models (NONMEM ADVAN1-4, 11, 12), as structural functions.

A *structural function* predicts, for **one** subject, the concentration in the central
compartment at the observation times::

    f(params: dict[str, scalar], t: (T,), doses) -> (T,)

where ``doses`` is any object with the fields ``time, amt, rate, cmt, ss, ii, mask``, each of
shape ``(D,)`` (:class:`numpyro_fed.nlme.data.Doses` for one subject). The caller vmaps over
subjects. Every function here is pure JAX: jit-able, vmappable, and differentiable in
``params`` by :func:`jax.grad`, :func:`jax.jacfwd` and :func:`jax.hessian` (forward over
reverse). It also carries ``param_names``, ``optional_params``, ``compartments`` (NONMEM
compartment number -> name), ``default_dose_cmt``, ``observed_cmt`` and a host-side
``check_doses(doses)``. :mod:`numpyro_fed.nlme.ode` builds the same kind of function from any
ODE.

**Models.** :func:`compartment_model` (``one_compartment``, ``two_compartment``,
``three_compartment``): 1, 2 or 3 disposition compartments (central and peripherals, linear
elimination from the central one), with or without a first-order absorption depot.

============  =================================  =======================================
absorption    compartments (``cmt``)             parameters
============  =================================  =======================================
first order   1 depot, 2 central, 3 (, 4)        ``CL, V, KA`` (``Q, V2``) (``Q3, V3``)
none          1 central, 2 (, 3)                 ``CL, V`` (``Q, V2``) (``Q3, V3``)
============  =================================  =======================================

``CL``: clearance, ``V``: central volume, ``KA``: absorption rate constant, ``Q``/``V2``:
inter-compartmental clearance and volume of the (first) peripheral compartment, ``Q3``/``V3``
those of the second one. All must be positive. Optional parameters (defaults in
``optional_params``):

- ``TLAG`` (default 0): lag time, added to the time of **every** dose (depot, central or
  peripheral);
- ``F`` (default 1): bioavailability, multiplies the amount of every dose into compartment 1
  (the depot with first-order absorption, the central compartment without: NONMEM's ``F1``).
  For an infusion the rate is kept and the duration becomes ``F * amt / rate`` (NONMEM).

The prediction is ``A_central(t) / V``.

**Dosing** (any mix, per dose): bolus (``rate = 0``) into the depot (first-order absorption),
the central compartment (IV bolus) or a peripheral one; zero-order infusion (``rate > 0``,
duration ``amt / rate``) into any compartment, the depot included. A dose at time ``t_d``
affects observations at ``t >= t_d + TLAG`` (an observation at the dose time sees the
post-dose state; :mod:`numpyro_fed.nlme.model` masks doses recorded after a sample when
record order matters). Padding doses (``mask = False``) contribute exactly 0, and so do doses
after ``t``: times before the first dose give 0.

**Steady state** (``ss = True``, interval ``ii > 0``), NONMEM's ``SS = 1``: at the dose's record
time the system is reset to the state reached by an infinite train of identical doses every
``ii`` (the dose itself being the last of the train); doses recorded before it (earlier time,
or same time and earlier in the arrays) stop contributing from that time on, and later doses
add to it. Supported for boluses and infusions into every compartment; an infusion needs a
duration ``F * amt / rate <= ii`` (``check_doses`` checks ``amt / rate <= ii``; a larger ``F``
making it longer gives NaN rather than a wrong value). With ``TLAG``, the train is lagged:
between the record time and ``t_d + TLAG`` the earlier doses of the train are present.
Not supported (``check_doses`` raises): ``ss`` with ``ii <= 0`` (NONMEM's constant infusion at
steady state, ``AMT = 0, RATE > 0, II = 0``), ``rate < 0`` (modelled rates/durations).

**Invalid doses inside jit.** What ``check_doses`` checks on the host cannot raise on traced
values: a real dose into a compartment the model lacks, with ``rate < 0`` or an unsupported
steady state makes the whole prediction of its subject NaN (never a silently wrong value).

**Method.** Superposition of the unit responses of the linear system, summed over the dose
axis (no loop over doses). The disposition matrix has real, distinct eigenvalues
:math:`\lambda_i > 0` (explicit roots: one for 1 compartment, the stable quadratic formula for
2, for 3 the trigonometric cubic solution refined by one Chebyshev step -- exact first and
second derivatives -- and the smaller roots by deflation). A unit amount put in disposition
compartment ``c`` gives a central amount :math:`\sum_i C_{ci} e^{-\lambda_i t}` (residues of
the transfer function :math:`N_c(s)/\prod_i (s+\lambda_i)`). The other routes are divided
differences of :math:`y \mapsto e^{-y t}` over the nodes :math:`\{\lambda_i, k_a\}` (depot),
:math:`\{0, \lambda_i\}` (infusion) and :math:`\{0, \lambda_i, k_a\}` (infusion into the
depot), e.g. the oral response :math:`k_a \sum_i C_{0i} (e^{-\lambda_i t} - e^{-k_a t}) /
(k_a - \lambda_i)`, written as :math:`t e^{-\min t} \varphi((\max - \min) t)` with
:math:`\varphi(z) = (1 - e^{-z})/z` evaluated from its series below 0.05 and from ``expm1``
above: no cancellation, no NaN or inf when ``KA`` equals an eigenvalue (e.g. ``KA = CL/V``),
and derivatives of every order exact there. After the end of an infusion the response is
propagated from the state at its end (never as the difference of two large terms), so late,
small concentrations keep their relative accuracy, in float32 too. Steady state sums each
term's geometric series in closed form (:math:`e^{-\lambda t}/(1 - e^{-\lambda\,ii})`, and a
divided-difference identity for the depot terms).

Example::

    f = compartment_model(2, "first_order")
    conc = f({"CL": 3.0, "V": 20.0, "KA": 1.2, "Q": 4.0, "V2": 50.0}, t, doses)
    conc_all = jax.vmap(f)(params_per_subject, t_per_subject, doses_per_subject)
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

__all__ = [
    "DOSE_FIELDS",
    "DOSING_PARAMS",
    "CompartmentModel",
    "StructuralModel",
    "compartment_model",
    "one_compartment",
    "three_compartment",
    "two_compartment",
]

#: Fields every dosing record must have (each ``(D,)`` for one subject).
DOSE_FIELDS = ("time", "amt", "rate", "cmt", "ss", "ii", "mask")
#: Optional dosing parameters of every structural model here, with their defaults.
DOSING_PARAMS = {"TLAG": 0.0, "F": 1.0}

# Below _SMALL (a product rate x time) the responses use their Taylor series (truncation
# <= ~1e-14 relative), above it their closed forms (cancellation <= ~1.3 digits; derivatives
# of the closed forms lose eps / _SMALL^k, which matters in float32).
_SMALL = 0.05


class _DoseArrays(NamedTuple):
    """Per-subject dose arrays, cast and with padding zeroed (``time``, ``amt``, ``rate``,
    ``ii`` in the model's float dtype, ``cmt`` int32, ``ss``/``mask`` bool)."""

    time: jax.Array
    amt: jax.Array
    rate: jax.Array
    cmt: jax.Array
    ss: jax.Array
    ii: jax.Array
    mask: jax.Array


# --------------------------------------------------------------------------- shared plumbing
class StructuralModel:
    """Base class of the structural functions: parameter and dose handling shared by
    :class:`CompartmentModel` and :class:`numpyro_fed.nlme.ode.ODEModel`.

    :ivar param_names: required parameter names.
    :ivar optional_params: optional parameter names -> default values.
    :ivar compartments: NONMEM compartment number (1-based) -> name.
    :ivar default_dose_cmt: the compartment a dose goes to by default (NONMEM's ``F1`` one).
    :ivar observed_cmt: the compartment whose concentration is predicted.
    """

    param_names: tuple[str, ...]
    optional_params: dict[str, float]
    compartments: dict[int, str]
    default_dose_cmt: int
    observed_cmt: int
    #: whether steady-state doses are supported (``check_doses`` refuses them otherwise)
    supports_steady_state: bool = True

    def __call__(self, params: Mapping[str, Any], t: jax.Array, doses: Any) -> jax.Array:
        """Concentrations ``(T,)`` in the observed compartment for one subject.

        :param params: parameter name -> scalar (every name of ``param_names``, any of
            ``optional_params``).
        :param t: ``(T,)`` observation times.
        :param doses: dosing record with fields ``time, amt, rate, cmt, ss, ii, mask``, each
            ``(D,)``.
        :return: ``(T,)`` predicted concentrations.
        """
        raise NotImplementedError

    # ---------------------------------------------------------------- trace-time checks
    def _resolve_params(self, params: Mapping[str, Any]) -> tuple[dict[str, jax.Array], Any]:
        """Check the parameter names and shapes; return all parameters (optional ones
        filled with their defaults) as scalars of one float dtype, and that dtype."""
        if not isinstance(params, Mapping):
            raise TypeError(
                f"params must be a dict of parameter name -> scalar, got {type(params).__name__}"
                f"; the model needs {list(self.param_names)} (optional: "
                f"{list(self.optional_params)})."
            )
        known = set(self.param_names) | set(self.optional_params)
        unknown = sorted(str(k) for k in params if k not in known)
        missing = [k for k in self.param_names if k not in params]
        if unknown:
            raise ValueError(
                f"params has unknown name(s) {unknown} for {self!r}: the model takes "
                f"{list(self.param_names)} and optionally {list(self.optional_params)}."
            )
        if missing:
            raise ValueError(
                f"params lacks the required parameter(s) {missing} of {self!r} (it needs "
                f"{list(self.param_names)}; optional: {list(self.optional_params)})."
            )
        values = {k: jnp.asarray(v) for k, v in params.items()}
        bad = {k: v.shape for k, v in values.items() if v.ndim != 0}
        if bad:
            raise ValueError(
                f"params must be scalars for one subject; got shapes {bad}. For several "
                "subjects use jax.vmap(model)(params, t, doses) with (n,) parameters."
            )
        dtype = jnp.result_type(*values.values()) if values else jnp.result_type(float)
        if not jnp.issubdtype(dtype, jnp.floating):
            dtype = jnp.result_type(float)
        full = {k: jnp.asarray(v, dtype) for k, v in self.optional_params.items()}
        full.update({k: v.astype(dtype) for k, v in values.items()})
        return full, dtype

    def _prepare(
        self, params: Mapping[str, Any], t: Any, doses: Any
    ) -> tuple[dict[str, jax.Array], jax.Array, _DoseArrays]:
        """Checked parameters, times and doses, all in one float dtype (that of the
        parameters and ``t``)."""
        p, dtype = self._resolve_params(params)
        t = jnp.asarray(t)
        if t.ndim != 1:
            raise ValueError(
                f"t must be the (T,) observation times of one subject, got shape {t.shape}; "
                "for several subjects use jax.vmap(model)(params, t, doses)."
            )
        if jnp.issubdtype(t.dtype, jnp.floating):
            dtype = jnp.promote_types(dtype, t.dtype)
            p = {k: v.astype(dtype) for k, v in p.items()}
        return p, t.astype(dtype), self._dose_arrays(doses, dtype)

    @staticmethod
    def _dose_arrays(doses: Any, dtype: Any) -> _DoseArrays:
        """The dose fields as arrays, padding (``mask = False``) zeroed so that it adds exactly
        0 and no NaN can leak into derivatives."""
        missing = [f for f in DOSE_FIELDS if not hasattr(doses, f)]
        if missing:
            raise TypeError(
                f"doses lacks the field(s) {missing}: pass an object with fields "
                f"{list(DOSE_FIELDS)} (e.g. numpyro_fed.nlme.data.Doses for one subject)."
            )
        arrays = {f: jnp.asarray(getattr(doses, f)) for f in DOSE_FIELDS}
        shapes = {f: a.shape for f, a in arrays.items()}
        if len(set(shapes.values())) != 1 or arrays["time"].ndim != 1:
            raise ValueError(
                f"the dose fields must all have the same shape (D,) for one subject, got "
                f"{shapes}; for several subjects use jax.vmap(model)(params, t, doses)."
            )
        mask = arrays["mask"].astype(bool)

        def real(name: str, kind: Any) -> jax.Array:
            return jnp.where(mask, arrays[name].astype(kind), jnp.zeros((), kind))

        return _DoseArrays(
            time=real("time", dtype),
            amt=real("amt", dtype),
            rate=real("rate", dtype),
            cmt=jnp.where(mask, arrays["cmt"].astype(jnp.int32), 0),
            ss=mask & arrays["ss"].astype(bool),
            ii=real("ii", dtype),
            mask=mask,
        )

    def _poison(self, d: _DoseArrays) -> jax.Array:
        """0, or NaN when a real dose is invalid in a way :meth:`check_doses` reports (a
        compartment the model lacks, ``rate < 0``, an unsupported steady state): inside
        ``jit`` these values are traced and cannot raise, so the whole prediction of the
        subject is made NaN rather than silently wrong."""
        bad = (d.cmt < 1) | (d.cmt > max(self.compartments)) | (d.rate < 0)
        bad |= (d.ss & ~(d.ii > 0)) if self.supports_steady_state else d.ss
        return jnp.where(jnp.any(d.mask & bad), jnp.nan, 0.0).astype(d.time.dtype)

    # ---------------------------------------------------------------- host-side checks
    def check_doses(self, doses: Any) -> None:
        """Check a dosing record on the host (numpy), for one subject ``(D,)`` or many
        ``(n, D)``: what cannot be checked inside ``jit``.

        :param doses: dosing record (fields ``time, amt, rate, cmt, ss, ii, mask``).
        :raises TypeError: a field is missing.
        :raises ValueError: a real (``mask = True``) dose goes into a compartment the model
            does not have, has a non-finite or negative ``time``/``amt``/``rate``, a zero
            amount with ``rate > 0``, or a steady-state setting the model does not support;
            the message gives the dose's index and the valid values.
        """
        missing = [f for f in DOSE_FIELDS if not hasattr(doses, f)]
        if missing:
            raise TypeError(
                f"doses lacks the field(s) {missing}: pass an object with fields "
                f"{list(DOSE_FIELDS)} (e.g. numpyro_fed.nlme.data.Doses)."
            )
        try:
            a = dict(
                zip(
                    DOSE_FIELDS,
                    np.broadcast_arrays(*(np.asarray(getattr(doses, f)) for f in DOSE_FIELDS)),
                    strict=True,
                )
            )
        except ValueError as err:
            shapes = {f: np.shape(getattr(doses, f)) for f in DOSE_FIELDS}
            raise ValueError(f"the dose fields have incompatible shapes {shapes}.") from err
        mask = a["mask"].astype(bool)

        def first(bad: np.ndarray) -> tuple[int, ...]:
            return tuple(int(i) for i in np.argwhere(bad & mask)[0])

        def fail(bad: np.ndarray, what: str) -> None:
            if np.any(bad & mask):
                idx = first(bad)
                raise ValueError(f"dose at index {idx} of the dose arrays: {what(idx)}")

        cmt = a["cmt"]
        valid_cmt = np.isin(cmt, list(self.compartments))
        fail(
            ~valid_cmt,
            lambda i: (
                f"cmt={cmt[i]} is not a compartment of {self!r}; valid compartments: "
                f"{self.compartments} (dose into {self.default_dose_cmt} = "
                f"{self.compartments[self.default_dose_cmt]!r} by default)."
            ),
        )
        for field in ("time", "amt", "rate"):
            v = a[field].astype(float)
            fail(~np.isfinite(v), lambda i, v=v, field=field: f"{field}={v[i]} is not finite.")
        rate = a["rate"].astype(float)
        amt = a["amt"].astype(float)
        fail(
            rate < 0,
            lambda i: (
                f"rate={rate[i]:g} < 0: modelled rates/durations (NONMEM RATE=-1/-2) are not "
                "supported; give the infusion rate (> 0) or 0 for a bolus."
            ),
        )
        fail(amt < 0, lambda i: f"amt={amt[i]:g} < 0: amounts must be >= 0.")
        fail(
            (rate > 0) & (amt <= 0),
            lambda i: (
                f"an infusion (rate={rate[i]:g}) with amt={amt[i]:g}: infusions need amt > 0 "
                "(a constant steady-state infusion, AMT=0 RATE>0 SS=1 II=0, is not supported)."
            ),
        )
        ss = a["ss"].astype(bool)
        ii = a["ii"].astype(float)
        if not self.supports_steady_state:
            fail(
                ss,
                lambda i: (
                    f"ss=True: steady-state doses are not supported by {self!r}; expand the "
                    "dosing history into individual doses (e.g. enough doses every ii to reach "
                    "steady state) or use an analytic compartment_model."
                ),
            )
            return
        fail(
            ss & ~(ii > 0),
            lambda i: (
                f"ss=True with ii={ii[i]:g}: a steady-state dose needs an interdose interval "
                "ii > 0 (constant steady-state infusions, II=0, are not supported)."
            ),
        )
        with np.errstate(divide="ignore", invalid="ignore"):
            dur = np.where(rate > 0, amt / np.where(rate > 0, rate, 1.0), 0.0)
        fail(
            ss & (rate > 0) & (dur > ii),
            lambda i: (
                f"steady-state infusion of duration amt/rate={dur[i]:g} longer than its "
                f"interval ii={ii[i]:g}: overlapping steady-state infusions are not supported."
            ),
        )


# --------------------------------------------------------------------------- response kernel
def _phi1(z: jax.Array) -> jax.Array:
    """``(1 - e^{-z}) / z`` for ``z >= 0`` (1 at 0): below ``_SMALL`` from the identity
    ``e^{-z/2} sinh(z/2) / (z/2)`` and four terms of the series of ``sinh(w) / w``
    (truncation ``w^8 / 9! < 1e-18``), above it ``-expm1(-z) / z``; value and derivatives
    are accurate everywhere (the quotient alone loses ``eps / z^k`` in the k-th derivative,
    and is 0/0 at 0)."""
    # each branch sees its argument clamped to its own range: no inf/NaN (nor their
    # derivatives, which would leak through the where) in the branch not selected
    zs, zl = jnp.minimum(z, _SMALL), jnp.maximum(z, _SMALL)
    w2 = 0.25 * zs * zs
    sinhc = 1.0 + w2 * (1.0 / 6.0 + w2 * (1.0 / 120.0 + w2 / 5040.0))
    return jnp.where(z < _SMALL, jnp.exp(-0.5 * zs) * sinhc, -jnp.expm1(-zl) / zl)


class _Kernel(NamedTuple):
    r"""Unit responses at times ``x`` (``(..., n)`` arrays, one column per eigenvalue
    :math:`\lambda_i`; ``eka``/``gka`` ``(...,)``): the divided differences of
    :math:`y \mapsto e^{-y x}` over the nodes named (positive convention: the inverse
    Laplace transform of :math:`1/\prod_j (s + y_j)`)."""

    e: jax.Array  # e^{-lam x}                                  {lam}
    g: jax.Array  # (1 - e^{-lam x}) / lam                      {0, lam}
    d2: jax.Array | None  # (e^{-lam x} - e^{-ka x}) / (ka - lam)       {lam, ka}
    h: jax.Array | None  # int_0^x d2                                  {0, lam, ka}
    eka: jax.Array | None  # e^{-ka x}                                   {ka}
    gka: jax.Array | None  # (1 - e^{-ka x}) / ka                        {0, ka}


def _kernel(lam: jax.Array, ka: jax.Array | None, x: jax.Array) -> _Kernel:
    """The unit responses at ``x >= 0`` (``(...,)``) for eigenvalues ``lam`` ``(n,)`` and
    absorption rate ``ka`` (``None``: no depot). Each is a closed form without cancellation
    when two nodes are close or equal (``KA = lam_i``: no NaN, no inf, smooth derivatives).
    The exponentials and the ``phi1`` of all rates are computed stacked (one op each: the
    compile time of Hessians grows with the number of ops)."""
    xc = x[..., None]
    if ka is None:
        z = lam * xc
        return _Kernel(jnp.exp(-z), xc * _phi1(z), None, None, None, None)
    # sort the nodes with where, not min/max: every formula below is an identity valid for
    # any order, so at a tie (KA = lam_i) where's one-sided derivatives are exact to all
    # orders (min/max would split them and give wrong second derivatives)
    lam_lo = lam <= ka
    lo, hi = jnp.where(lam_lo, lam, ka), jnp.where(lam_lo, ka, lam)
    rates = jnp.stack([lam, jnp.broadcast_to(ka, lam.shape), hi - lo])
    z = rates.reshape((3,) + (1,) * x.ndim + lam.shape) * xc  # (3, ..., n)
    ex = jnp.exp(-z[:2])
    ph = xc * _phi1(z)
    e, eka, g, gka = ex[0], ex[1], ph[0], ph[1]
    # {lam, ka}: x e^{-lo x} phi1((hi - lo) x)
    d2 = jnp.where(lam_lo, e, eka) * ph[2]
    # {0, lo, hi}: recurrence (P[0, lo] - P[lo, hi]) / hi where hi x >= _SMALL (cancellation
    # <= 1.3 digits), else the Taylor series about 0, x^2 sum_m (-1)^m h_m(lo x, hi x) / (m+2)!
    # with h_m(p, q) = sum_{i+j=m} p^i q^j (truncation (M+1) 0.05^M / (M+2)! ~ 2e-14, M = 7)
    q = hi * xc
    small = q < _SMALL
    rec = (jnp.where(lam_lo, g, gka) - d2) / hi  # hi > 0 (rates are positive)
    qs = jnp.minimum(q, _SMALL)  # clamped: bounded where not selected
    ps = qs * (lo / hi)
    hm = pm = total = 1.0
    for m in range(1, 7):
        pm = pm * ps
        hm = qs * hm + pm
        total = total + (-1) ** m * hm * (2.0 / math.factorial(m + 2))
    h = jnp.where(small, 0.5 * xc**2 * total, rec)
    return _Kernel(e, g, d2, h, eka[..., 0], gka[..., 0])


# --------------------------------------------------------------------------- analytic models
_ABSORPTIONS = ("first_order", None)


class CompartmentModel(StructuralModel):
    """A linear 1-, 2- or 3-compartment model with optional first-order absorption, in closed
    form (see the module docstring). Build it with :func:`compartment_model`.

    :ivar n_compartments: number of disposition compartments (1, 2 or 3).
    :ivar absorption: ``"first_order"`` or ``None``.
    """

    def __init__(self, n_compartments: int = 1, absorption: str | None = "first_order") -> None:
        """:param n_compartments: 1, 2 or 3 disposition compartments.
        :param absorption: ``"first_order"`` (a depot, compartment 1, with rate ``KA``) or
            ``None`` (doses go straight into the central compartment, compartment 1)."""
        if isinstance(n_compartments, bool) or not isinstance(n_compartments, int | np.integer):
            raise TypeError(
                f"n_compartments must be the int 1, 2 or 3, got {n_compartments!r} "
                f"({type(n_compartments).__name__})."
            )
        if n_compartments not in (1, 2, 3):
            raise ValueError(
                f"n_compartments={n_compartments} is not supported: use 1, 2 or 3 (for other "
                "systems write the ODE with numpyro_fed.nlme.ode.ode_model)."
            )
        if absorption not in _ABSORPTIONS:
            raise ValueError(
                f"absorption={absorption!r} is not supported: use 'first_order' (a depot "
                "compartment with rate KA) or None (IV: doses into the central compartment); "
                "for other absorption models write the ODE with numpyro_fed.nlme.ode.ode_model."
            )
        n = int(n_compartments)
        self.n_compartments = n
        self.absorption = absorption
        names = ["CL", "V"] + (["KA"] if absorption else [])
        names += [["Q", "V2"], ["Q", "V2", "Q3", "V3"]][n - 2] if n > 1 else []
        self.param_names = tuple(names)
        self.optional_params = dict(DOSING_PARAMS)
        disposition = ["central"] + (
            ["peripheral"] if n == 2 else ["peripheral1", "peripheral2"] if n == 3 else []
        )
        cmts = (["depot"] if absorption else []) + disposition
        self.compartments = {i + 1: name for i, name in enumerate(cmts)}
        self.default_dose_cmt = 1
        self.observed_cmt = 2 if absorption else 1

    def __repr__(self) -> str:
        return (
            f"compartment_model(n_compartments={self.n_compartments}, "
            f"absorption={self.absorption!r})"
        )

    # ---------------------------------------------------------------- disposition
    def _eigen(self, p: dict[str, jax.Array]) -> tuple[jax.Array, jax.Array]:
        """Eigenvalues ``lam`` (decreasing, ``(n,)``) of the disposition system and residues
        ``C`` ``(n, n)``: ``C[c, i]`` is the weight of ``e^{-lam_i t}`` in the central amount
        after a unit bolus into disposition compartment ``c`` (0 = central)."""
        n = self.n_compartments
        k10 = p["CL"] / p["V"]
        if n == 1:
            return k10[None], jnp.ones((1, 1), k10.dtype)
        k12, k21 = p["Q"] / p["V"], p["Q"] / p["V2"]
        if n == 2:
            total = k10 + k12 + k21
            # (k10+k12+k21)^2 - 4 k10 k21 written as a sum of non-negative terms
            disc = (k10 + k12 - k21) ** 2 + 4.0 * k12 * k21
            alpha = 0.5 * (total + jnp.sqrt(disc))
            lams = [alpha, k10 * k21 / alpha]
            exits = [k21]
        else:
            k13, k31 = p["Q3"] / p["V"], p["Q3"] / p["V3"]
            a2 = k10 + k12 + k13 + k21 + k31
            a1 = k10 * k31 + k21 * k31 + k21 * k13 + k10 * k21 + k31 * k12
            a0 = k10 * k21 * k31
            # largest root of x^3 - a2 x^2 + a1 x - a0: the trigonometric solution x0 (its
            # derivative stopped: acos' is infinite at double roots), then one Chebyshev step
            # x0 - P/P' - P'' P^2 / (2 P'^3), cubically convergent: the value is exact to
            # rounding, and so are the first and second derivatives (those of the implicit
            # root; a Newton step would get only the first right)
            pp = a1 - a2**2 / 3.0
            qq = -2.0 * a2**3 / 27.0 + a1 * a2 / 3.0 - a0
            m = jnp.sqrt(jnp.maximum(-pp / 3.0, 0.0))
            arg = jnp.clip(-qq / (2.0 * jnp.maximum(m, 1e-30) ** 3), -1.0, 1.0)
            x = jax.lax.stop_gradient(a2 / 3.0 + 2.0 * m * jnp.cos(jnp.arccos(arg) / 3.0))
            f0 = ((x - a2) * x + a1) * x - a0
            f1 = (3.0 * x - 2.0 * a2) * x + a1
            f2 = 6.0 * x - 2.0 * a2
            x = x - f0 / f1 - f2 * f0**2 / (2.0 * f1**3)
            lam1 = x
            # deflation: the two others solve y^2 - s y + r = 0 with r = a0 / lam1
            r = a0 / lam1
            s = (a1 - r) / lam1
            d = jnp.sqrt(jnp.maximum(s * s - 4.0 * r, jnp.finfo(s.dtype).tiny))
            lam2 = 0.5 * (s + d)
            lams = [lam1, lam2, r / lam2]
            exits = [k21, k31]
        lam = jnp.stack(lams)
        exit_ = jnp.stack(exits)  # (n - 1,)
        # residues of N_c(s) / prod_i (s + lam_i) at s = -lam_i, with N_central =
        # prod_j (s + E_j) and N_periph_j = E_j prod_{l != j} (s + E_l); as array ops
        off = ~np.eye(n, dtype=bool)
        denom = jnp.prod(jnp.where(off, lam[:, None] - lam[None, :], 1.0), axis=0)  # (n,)
        diff = exit_[:, None] - lam[None, :]  # (n - 1, n): E_j - lam_i
        others = jnp.where(~np.eye(n - 1, dtype=bool)[..., None], diff[None], 1.0)
        rows = jnp.concatenate(
            [jnp.prod(diff, axis=0)[None], exit_[:, None] * jnp.prod(others, axis=1)]
        )
        return lam, rows / denom

    # ---------------------------------------------------------------- prediction
    def __call__(self, params: Mapping[str, Any], t: jax.Array, doses: Any) -> jax.Array:
        """Concentrations ``(T,)`` in the central compartment for one subject.

        :param params: ``{name: scalar}`` with every name of ``param_names`` (and any of
            ``TLAG``, ``F``).
        :param t: ``(T,)`` observation times.
        :param doses: dosing record, fields ``time, amt, rate, cmt, ss, ii, mask`` ``(D,)``.
        :return: ``(T,)`` central concentrations ``A_central(t) / V``.
        :raises ValueError: unknown or missing parameter names, non-scalar parameters, bad
            shapes (at trace time).
        """
        p, t, d = self._prepare(params, t, doses)
        return self._central_amount(p, t, d) / p["V"] + self._poison(d)

    def _central_amount(
        self, p: dict[str, jax.Array], t: jax.Array, d: _DoseArrays
    ) -> jax.Array:
        """Central amount ``(T,)``: the sum over doses of their (masked) responses."""
        n = self.n_compartments
        absorb = self.absorption is not None
        lam, C = self._eigen(p)  # (n,), (n, n)
        ka = p["KA"] if absorb else None
        T = t.shape[0]
        zero = jnp.zeros((), t.dtype)

        # ---- per dose (D,)
        depot = (d.cmt == 1) if absorb else jnp.zeros(d.cmt.shape, bool)
        c_sel = C[jnp.clip(d.cmt - (2 if absorb else 1), 0, n - 1)]  # (D, n)
        amt = jnp.where(d.cmt == self.default_dose_cmt, p["F"] * d.amt, d.amt)
        inf = d.mask & (d.rate > 0)
        bolus = d.mask & ~inf
        tau = jnp.where(inf, amt / jnp.where(inf, d.rate, 1.0), zero)  # infusion duration
        ss = d.ss
        ii = jnp.where(ss, d.ii, 1.0)
        bad_ss = ss & inf & (tau > ii)  # overlapping steady-state infusions: NaN
        rho = jnp.where(ss, jnp.maximum(ii - tau, 0.0), zero)  # gap after an SS infusion

        # ---- per observation and dose (T, D)
        te = d.time + p["TLAG"]
        dt = t[:, None] - te[None, :]
        # an SS train with a lag: at record time <= t < te the earlier doses are present
        m0 = jnp.where(ss & (dt < 0), jnp.ceil(-dt / ii), 0.0)
        dt = dt + m0 * ii
        started = jnp.where(ss, t[:, None] >= d.time[None, :], dt >= 0)
        # NONMEM SS=1 reset: a dose stops at the record time of a later steady-state dose
        idx = jnp.arange(d.time.shape[0])
        later = (d.time[None, :] > d.time[:, None]) | (
            (d.time[None, :] == d.time[:, None]) & (idx[None, :] > idx[:, None])
        )  # [j, k]: dose k is recorded after dose j
        reset = jnp.min(
            jnp.where(later & ss[None, :], d.time[None, :], jnp.inf), axis=1, initial=jnp.inf
        )
        active = d.mask[None, :] & started & (t[:, None] < reset[None, :])
        dt = jnp.where(active, jnp.maximum(dt, 0.0), 0.0)
        # evaluate every response at one time per (T, D): since the dose for a bolus or a
        # running infusion, since the end of a finished infusion (the state at the end is
        # then propagated: no difference of large terms)
        post = dt >= tau
        x = jnp.where(post, dt - tau, dt)

        # one kernel call for the (T, D) times and the per-dose tau, ii and rho (rows T + 0,
        # T + 1, T + 2)
        k = _kernel(lam, ka, jnp.concatenate([x, tau[None], ii[None], rho[None]]))
        col = lambda v: v[:, None]  # (D,) -> (D, 1)
        ss_c = col(ss)
        g_tau, e_ii, e_rho = k.g[T], k.e[T + 1], k.e[T + 2]  # (D, n)
        g_lam = jnp.where(ss_c, 1.0 / (lam * k.g[T + 1]), 1.0)  # 1 / (1 - e^{-lam ii}) if SS
        ssg = ss_c * g_lam
        # weights of the responses per dose (D, n), in two phases: "post" (after a bolus or
        # after the end of an infusion) and "run" (during an infusion). For SS, the earlier
        # doses of the train are propagated from the end of the last one: over rho' = ii
        # after it, rho = ii - tau during it.
        disp = ~depot
        b_c = jnp.where(col(bolus & disp), col(amt) * c_sel, 0.0)  # disposition boluses
        r_c = jnp.where(col(inf & disp), col(d.rate) * c_sel, 0.0)  # disposition infusions
        post_e = b_c * g_lam + r_c * g_tau * (1.0 + ssg * e_ii)
        run_e = r_c * g_tau * ssg * e_rho
        post_w, run_w = [post_e, 0.0], [run_e, r_c]  # weights of e, g
        if absorb:
            kc = ka * C[0]  # (n,)
            g_ka = col(jnp.where(ss, 1.0 / (ka * k.gka[T + 1]), 1.0))  # (D, 1)
            h_tau, d2_ii, d2_rho = k.h[T], k.d2[T + 1], k.d2[T + 2]
            gka_tau = col(k.gka[T])
            b_k = jnp.where(col(bolus & depot), col(amt) * g_ka * kc, 0.0)  # depot boluses
            r_k = jnp.where(col(inf & depot), col(d.rate) * kc, 0.0)  # depot infusions
            sse = h_tau + gka_tau * g_ka * d2_ii  # state after one SS depot infusion
            ssk = r_k * gka_tau * ss_c * g_ka
            post_w[0] = post_w[0] + b_k * ssg * d2_ii + r_k * (h_tau + ssg * e_ii * sse)
            run_w[0] = run_w[0] + r_k * ssg * e_rho * sse
            post_w += [b_k + r_k * gka_tau + ssk * e_ii, 0.0]  # weights of d2, h
            run_w += [ssk * e_rho, r_k]
            # weight of e^{-ka x} (per dose, summed over the modes)
            post_eka, run_eka = jnp.sum(ssk * d2_ii, -1), jnp.sum(ssk * d2_rho, -1)
            responses = jnp.stack([k.e[:T], k.g[:T], k.d2[:T], k.h[:T]])
        else:
            responses = jnp.stack([k.e[:T], k.g[:T]])
        full = lambda w: jnp.stack([jnp.broadcast_to(v, c_sel.shape) for v in w])
        amount = jnp.sum(
            jnp.where(post[..., None], full(post_w)[:, None], full(run_w)[:, None]) * responses,
            axis=(0, -1),
        )
        if absorb:
            amount += jnp.where(post, post_eka, run_eka) * k.eka[:T]
        amount = jnp.where(active, jnp.where(bad_ss[None, :], jnp.nan, amount), 0.0)
        return jnp.sum(amount, axis=1)


def compartment_model(
    n_compartments: int = 1, absorption: str | None = "first_order"
) -> CompartmentModel:
    """A closed-form linear compartment model as a structural function
    ``f(params, t, doses) -> (T,)`` (see the module docstring for compartments, parameters,
    dosing and steady state).

    :param n_compartments: 1, 2 or 3 disposition compartments (central + peripherals).
    :param absorption: ``"first_order"`` (depot = compartment 1, rate ``KA``) or ``None``.
    :return: the structural function (a :class:`CompartmentModel`).
    :raises ValueError: unsupported ``n_compartments`` or ``absorption``.
    :raises TypeError: ``n_compartments`` not an int.
    """
    return CompartmentModel(n_compartments, absorption)


def one_compartment(absorption: str | None = "first_order") -> CompartmentModel:
    """One compartment (``CL, V`` [``KA``]); NONMEM ADVAN2 (first order) / ADVAN1 (none).

    :param absorption: ``"first_order"`` or ``None``.
    :return: the structural function.
    """
    return CompartmentModel(1, absorption)


def two_compartment(absorption: str | None = "first_order") -> CompartmentModel:
    """Two compartments (``CL, V, Q, V2`` [``KA``]); NONMEM ADVAN4 / ADVAN3.

    :param absorption: ``"first_order"`` or ``None``.
    :return: the structural function.
    """
    return CompartmentModel(2, absorption)


def three_compartment(absorption: str | None = "first_order") -> CompartmentModel:
    """Three compartments (``CL, V, Q, V2, Q3, V3`` [``KA``]); NONMEM ADVAN12 / ADVAN11.

    :param absorption: ``"first_order"`` or ``None``.
    :return: the structural function.
    """
    return CompartmentModel(3, absorption)
