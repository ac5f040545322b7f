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

The prediction is ``A_central(t) / V``. With ``f(params, t, doses, cmt=cmt)`` (``cmt``:
``(T,)`` compartment of each observation, 0 = central) an observation of the depot gets the
depot amount ``A_depot(t)`` (NONMEM's ``A(1)/S1`` without a scale ``S1``); peripheral
amounts are not computed (NaN; :class:`~numpyro_fed.nlme.model.PKModel` refuses such
observations on the host). ``predicted_cmts`` lists the compartments predicted.

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

**Specialisation.** The general model evaluates every route (bolus or infusion into each
compartment, steady state) for every (observation, dose) pair. Data that use a few routes --
Phenobarb: IV boluses into the central compartment; Theophylline: oral doses -- are much
faster with ``model = model.for_doses(doses)`` (host side, once per dataset; ``doses`` of one
subject or ``(n, D)``): the same model, restricted to the (bolus or infusion, compartment)
pairs of the real doses and to steady state if any dose is at steady state, whose trace
holds only the terms of those routes -- the same operations on the same values, so that it
equals the general model to round-off (float64: measured <= 3.5e-16 relative on values,
<= 1e-13 on gradients, every model, random mixes of routes). It keeps the contract and
attributes, and refuses other routes: its ``check_doses`` raises a ``ValueError`` naming the
dose and the route, and inside ``jit`` such a dose makes its subject's prediction NaN;
rebuild with ``for_doses`` on the new data. ``TLAG`` and ``F`` cost nothing when ``params``
does not have them (in every model). Measured on 59 Phenobarb subjects (6 observations, 15
doses, float32, 2-core CPU, ``benchmarks/bench_nlme_pk.py``): the specialised
``one_compartment(None)`` runs as fast as a minimal hand-written bolus sum: 1.05x its time
inside a compiled loop (as in a fit), per call 0.9-1.6x for the values and 1.1x for the
gradient (dispatch included: these ~0.1 ms calls are noisy); the general one is 4-8x slower.

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
from abc import ABC, abstractmethod
from collections.abc import Iterable, Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from numpyro_fed._validation import check_int

__all__ = [
    "DOSE_FIELDS",
    "DOSING_PARAMS",
    "ROUTE_KINDS",
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
#: Kinds of dosing route (with a compartment number, a route of
#: :meth:`CompartmentModel.specialize`): ``"bolus"`` (``rate = 0``), ``"infusion"`` (``rate > 0``).
ROUTE_KINDS = ("bolus", "infusion")

# Below _SMALL (a product rate x time) the responses use their Taylor series (truncation
# <= ~1e-14 relative), above it their closed forms (cancellation <= ~1.3 digits; derivatives
# of the closed forms lose eps / _SMALL^k, which matters in float32).
_SMALL = 0.05
_PHI1_DEGREE = 9  # of the series of phi1 below _SMALL


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


def _dose_where(idx: tuple[int, ...], field: str, locate: Any) -> str:
    """Which dose a message is about: ``locate(idx, field)`` (e.g. the subject, row and
    column of the input table), else its index in the dose arrays."""
    if locate is not None:
        return str(locate(idx, field))
    return f"dose at index {idx} of the dose arrays"


def _host_doses(doses: Any) -> dict[str, np.ndarray]:
    """The dose fields as numpy arrays of one (broadcast) shape, for host-side checks."""
    missing = [f for f in DOSE_FIELDS if not hasattr(doses, f)]
    if missing:
        raise TypeError(
            f"doses lacks the field(s) {missing}: pass an object with fields "
            f"{list(DOSE_FIELDS)} (e.g. numpyro_fed.nlme.data.Doses)."
        )
    try:
        arrays = np.broadcast_arrays(*(np.asarray(getattr(doses, f)) for f in DOSE_FIELDS))
    except ValueError as err:
        shapes = {f: np.shape(getattr(doses, f)) for f in DOSE_FIELDS}
        raise ValueError(f"the dose fields have incompatible shapes {shapes}.") from err
    return dict(zip(DOSE_FIELDS, arrays, strict=True))


# --------------------------------------------------------------------------- shared plumbing
class StructuralModel(ABC):
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

    @abstractmethod
    def __call__(
        self, params: Mapping[str, Any], t: jax.Array, doses: Any, cmt: Any = None
    ) -> jax.Array:
        """Concentrations ``(T,)`` in the observed compartment for one subject.

        :param params: parameter name -> scalar (every name of ``param_names``, any of
            ``optional_params``).
        :param t: ``(T,)`` observation times.
        :param doses: dosing record with fields ``time, amt, rate, cmt, ss, ii, mask``, each
            ``(D,)``.
        :param cmt: optional ``(T,)`` compartment of each observation (0: the observed one);
            one of ``predicted_cmts`` other than ``observed_cmt`` is predicted as its amount
            (NONMEM's ``A(n)/Sn`` without a scale), another one is NaN.
        :return: ``(T,)`` predicted concentrations.
        """

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
    def check_doses(self, doses: Any, locate: Any = None) -> None:
        """Check a dosing record on the host (numpy), for one subject ``(D,)`` or many
        ``(n, D)``: what cannot be checked inside ``jit``.

        :param doses: dosing record (fields ``time, amt, rate, cmt, ss, ii, mask``).
        :param locate: optional ``locate(index, field) -> str`` naming the dose at ``index``
            of the arrays and the column of ``field`` (``"cmt"``, ``"rate"``, ...) for the
            message (:class:`~numpyro_fed.nlme.model.PKModel` names the subject, the row of
            the input table and its column); default: the index in the dose arrays.
        :raises TypeError: a field is missing.
        :raises ValueError: a real (``mask = True``) dose goes into a compartment the model
            does not have, has a non-finite or negative ``time``/``amt``/``rate``, a zero
            amount with ``rate > 0``, or a steady-state setting the model does not support;
            the message says which dose (``locate``) and the valid values.
        """
        a = _host_doses(doses)
        mask = a["mask"].astype(bool)

        def first(bad: np.ndarray) -> tuple[int, ...]:
            return tuple(int(i) for i in np.argwhere(bad & mask)[0])

        def fail(bad: np.ndarray, what: Any, field: str = "") -> None:
            if np.any(bad & mask):
                idx = first(bad)
                raise ValueError(f"{_dose_where(idx, field, locate)}: {what(idx)}")

        cmt = a["cmt"]
        valid_cmt = np.isin(cmt, list(self.compartments))
        fail(
            ~valid_cmt,
            lambda i: (
                f"cmt={cmt[i]} is not a compartment of {self!r}; valid compartments: "
                f"{self.compartments} (dose into {self.default_dose_cmt} = "
                f"{self.compartments[self.default_dose_cmt]!r} by default)."
            ),
            "cmt",
        )
        for field in ("time", "amt", "rate"):
            v = a[field].astype(float)
            fail(
                ~np.isfinite(v),
                lambda i, v=v, field=field: f"{field}={v[i]} is not finite.",
                field,
            )
        rate = a["rate"].astype(float)
        amt = a["amt"].astype(float)
        fail(
            rate < 0,
            lambda i: (
                f"rate={rate[i]:g} < 0: modelled rates/durations (NONMEM RATE=-1/-2) are not "
                "supported; give the infusion rate (> 0) or 0 for a bolus."
            ),
            "rate",
        )
        fail(amt < 0, lambda i: f"amt={amt[i]:g} < 0: amounts must be >= 0.", "amt")
        fail(
            (rate > 0) & (amt <= 0),
            lambda i: (
                f"an infusion (rate={rate[i]:g}) with amt={amt[i]:g}: infusions need amt > 0 "
                "(a constant steady-state infusion, AMT=0 RATE>0 SS=1 II=0, is not supported)."
            ),
            "amt",
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
                "ss",
            )
            return
        fail(
            ss & ~(ii > 0),
            lambda i: (
                f"ss=True with ii={ii[i]:g}: a steady-state dose needs an interdose interval "
                "ii > 0 (constant steady-state infusions, II=0, are not supported)."
            ),
            "ii",
        )
        with np.errstate(divide="ignore", invalid="ignore"):
            dur = np.where(rate > 0, amt / np.where(rate > 0, rate, 1.0), 0.0)
        fail(
            ss & (rate > 0) & (dur > ii),
            lambda i: (
                f"steady-state infusion of duration amt/rate={dur[i]:g} longer than its "
                f"interval ii={ii[i]:g}: overlapping steady-state infusions are not supported."
            ),
            "rate",
        )


# --------------------------------------------------------------------------- response kernel
def _phi1(z: jax.Array) -> jax.Array:
    """``(1 - e^{-z}) / z`` for ``z >= 0`` (1 at 0): below ``_SMALL`` its Taylor series
    ``sum_j (-z)^j / (j + 1)!`` to degree 9 (a polynomial: no exponential; truncation
    ``z^10 / 11! < 3e-21``, and ``< 1e-16`` relative in the first and second derivatives),
    above it ``-expm1(-z) / z``; value and derivatives are accurate everywhere (the quotient
    alone loses ``eps / z^k`` in the k-th derivative, and is 0/0 at 0)."""
    # each branch sees its argument clamped to its own range: no inf/NaN (nor their
    # derivatives, which would leak through the where) in the branch not selected; with
    # where, not min/max, whose derivative is split in two at z = _SMALL
    small = z < _SMALL
    zs, zl = jnp.where(small, z, _SMALL), jnp.where(small, _SMALL, z)
    # Horner: 1/1! - z (1/2! - z (1/3! - ...)); the terms decrease fast: no cancellation
    series = 1.0 / math.factorial(_PHI1_DEGREE + 1)
    for j in range(_PHI1_DEGREE - 1, -1, -1):
        series = 1.0 / math.factorial(j + 1) - zs * series
    return jnp.where(small, series, -jnp.expm1(-zl) / zl)


class _Kernel(NamedTuple):
    r"""Unit responses at times ``x`` (``(..., n)`` arrays, one column per eigenvalue
    :math:`\lambda_i`; ``eka``/``gka`` ``(...,)``): the divided differences of
    :math:`y \mapsto e^{-y x}` over the nodes named (positive convention: the inverse
    Laplace transform of :math:`1/\prod_j (s + y_j)`). Those not asked for are ``None``."""

    e: jax.Array | None  # e^{-lam x}                                  {lam}
    g: jax.Array | None  # (1 - e^{-lam x}) / lam                      {0, lam}
    d2: jax.Array | None  # (e^{-lam x} - e^{-ka x}) / (ka - lam)       {lam, ka}
    h: jax.Array | None  # int_0^x d2                                  {0, lam, ka}
    eka: jax.Array | None  # e^{-ka x}                                   {ka}
    gka: jax.Array | None  # (1 - e^{-ka x}) / ka                        {0, ka}


_RESPONSES = _Kernel._fields


def _kernel(
    lam: jax.Array, ka: jax.Array | None, x: jax.Array, need: frozenset[str] = frozenset(_RESPONSES)
) -> _Kernel:
    """The unit responses named in ``need`` (fields of :class:`_Kernel`; the others are
    ``None`` and cost nothing) at ``x >= 0`` (``(...,)``) for eigenvalues ``lam`` ``(n,)``
    (or a scalar: one compartment, the responses have no axis of modes) and absorption rate
    ``ka`` (``None``: no depot, only ``e`` and ``g``). Each is a closed form
    without cancellation when two nodes are close or equal (``KA = lam_i``: no NaN, no inf,
    smooth derivatives). The exponentials and the ``phi1`` of all the rates needed are
    computed stacked (one op each: the compile time of Hessians grows with the number of
    ops)."""
    xc = x[..., None] if lam.ndim else x  # a scalar lam: no axis of modes
    rates = {"lam": lam}
    exp_of = ["lam"] if "e" in need else []
    phi_of = ["lam"] if "g" in need else []
    need_d2 = ka is not None and ("d2" in need or "h" in need)
    if ka is not None:
        # sort the nodes with where, not min/max: every formula below is an identity valid
        # for any order, so at a tie (KA = lam_i) where's one-sided derivatives are exact to
        # all orders (min/max would split them and give wrong second derivatives)
        lam_lo = lam <= ka
        lo, hi = jnp.where(lam_lo, lam, ka), jnp.where(lam_lo, ka, lam)
        rates.update(ka=jnp.broadcast_to(ka, lam.shape), lo=lo, diff=hi - lo)
        exp_of += ["ka"] if "eka" in need else []
        phi_of += ["ka"] if "gka" in need else []
        # e^{-lo x} and x phi1(lo x): picked from the lam and ka columns when both are
        # computed anyway (the same values), else computed at lo directly
        exp_of += ["lo"] if need_d2 and not {"lam", "ka"} <= set(exp_of) else []
        phi_of += ["lo"] if "h" in need and not {"lam", "ka"} <= set(phi_of) else []
        phi_of += ["diff"] if need_d2 else []

    def stacked(names: list[str], fn: Any) -> dict[str, jax.Array]:
        if len(names) <= 1:
            return {k: fn(rates[k] * xc) for k in names}
        z = jnp.stack([rates[k] for k in names])
        z = z.reshape((len(names),) + (1,) * x.ndim + lam.shape) * xc  # (K, ..., n)
        out = fn(z)
        return {k: out[i] for i, k in enumerate(names)}

    ex = stacked(exp_of, lambda z: jnp.exp(-z))
    ph = stacked(phi_of, lambda z: xc * _phi1(z))
    e, g, eka, gka = ex.get("lam"), ph.get("lam"), ex.get("ka"), ph.get("ka")
    d2 = h = None
    if need_d2:
        # {lam, ka}: x e^{-lo x} phi1((hi - lo) x)
        elo = ex["lo"] if "lo" in ex else jnp.where(lam_lo, e, eka)
        d2 = elo * ph["diff"]
    if ka is not None and "h" in need:
        # {0, lo, hi}: recurrence (P[0, lo] - P[lo, hi]) / hi where hi x >= _SMALL
        # (cancellation <= 1.3 digits), else the Taylor series about 0,
        # x^2 sum_m (-1)^m h_m(lo x, hi x) / (m+2)! with h_m(p, q) = sum_{i+j=m} p^i q^j
        # (truncation (M+1) 0.05^M / (M+2)! ~ 2e-14, M = 7)
        q = hi * xc
        small = q < _SMALL
        plo = ph["lo"] if "lo" in ph else jnp.where(lam_lo, g, gka)
        rec = (plo - d2) / hi  # hi > 0 (rates are positive)
        qs = jnp.minimum(q, _SMALL)  # clamped: bounded where not selected
        ps = qs * (lo / hi)
        hm = pm = total = 1.0
        for m in range(1, 7):
            pm = pm * ps
            hm = qs * hm + pm
            total = total + (-1) ** m * hm * (2.0 / math.factorial(m + 2))
        h = jnp.where(small, 0.5 * xc**2 * total, rec)
    column = lambda v: v if v is None or not lam.ndim else v[..., 0]  # noqa: E731
    return _Kernel(e, g, d2 if "d2" in need else None, h, column(eka), column(gka))


# --------------------------------------------------------------------------- static algebra
# The response weights are built from factors that are either arrays or *static*: ``None``
# is an exact zero known at trace time, a Python ``1.0`` an exact one, ``True``/``False``
# masks known at trace time. Products and sums with them drop out of the trace, so a model
# specialised to some dosing routes (:meth:`CompartmentModel.for_doses`) traces only the
# terms of those routes, with the very operations (in the same order) of the general model.
def _mul(*factors: Any) -> Any:
    """Product, left to right; ``None`` if a factor is ``None``; factors ``1.0`` skipped."""
    out: Any = 1.0
    for f in factors:
        if f is None:
            return None
        if isinstance(f, float) and f == 1.0:
            continue
        out = f if isinstance(out, float) and out == 1.0 else out * f
    return out


def _add(*terms: Any) -> Any:
    """Sum, left to right, of the terms that are not ``None`` (``None`` if none is)."""
    out = None
    for x in terms:
        if x is not None:
            out = x if out is None else out + x
    return out


def _and(a: Any, b: Any) -> Any:
    """``a & b`` for static (bool) or array masks."""
    if a is False or b is False:
        return False
    if a is True:
        return b
    return a if b is True else a & b


def _or(a: Any, b: Any) -> Any:
    """``a | b`` for static (bool) or array masks."""
    if a is True or b is True:
        return True
    if a is False:
        return b
    return a if b is False else a | b


def _not(a: Any) -> Any:
    """``~a`` for a static (bool) or array mask."""
    return (not a) if isinstance(a, bool) else ~a


def _where0(cond: Any, x: Any) -> Any:
    """``where(cond, x, 0)`` with a static or array ``cond`` (``None``: a static zero)."""
    if x is None or cond is False:
        return None
    return x if cond is True else jnp.where(cond, x, 0.0)


class _Plan(NamedTuple):
    """The dosing routes a :class:`CompartmentModel` traces (static, from its ``routes``)."""

    depot_bolus: bool
    depot_infusion: bool
    bolus_cmts: tuple[int, ...]  # disposition compartments (0 = central) receiving boluses
    infusion_cmts: tuple[int, ...]  # ... and infusions
    steady_state: bool


# --------------------------------------------------------------------------- analytic models
_ABSORPTIONS = ("first_order", None)


class CompartmentModel(StructuralModel):
    """A linear 1-, 2- or 3-compartment model with optional first-order absorption, in closed
    form (see the module docstring). Build it with :func:`compartment_model`; specialise it to
    the dosing routes of a dataset with :meth:`for_doses`.

    :ivar n_compartments: number of disposition compartments (1, 2 or 3).
    :ivar absorption: ``"first_order"`` or ``None``.
    :ivar routes: the dosing routes it computes, ``frozenset`` of ``(kind, cmt)`` with kind
        ``"bolus"`` or ``"infusion"`` and ``cmt`` a compartment number (every combination for
        the general model).
    :ivar steady_state: whether it computes steady-state doses (``True`` for the general
        model).
    """

    def __init__(self, n_compartments: int = 1, absorption: str | None = "first_order") -> None:
        """:param n_compartments: 1, 2 or 3 disposition compartments.
        :param absorption: ``"first_order"`` (a depot, compartment 1, with rate ``KA``) or
            ``None`` (doses go straight into the central compartment, compartment 1)."""
        n_compartments = check_int("n_compartments", n_compartments, minimum=1,
                                   hint=" Use 1, 2 or 3.")
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
        # the general model: every route, steady state included
        self._general = self
        self._specialized: dict[tuple[frozenset, bool], CompartmentModel] = {}
        self._set_routes(frozenset((k, c) for k in ROUTE_KINDS for c in self.compartments), True)

    def __repr__(self) -> str:
        base = (
            f"compartment_model(n_compartments={self.n_compartments}, "
            f"absorption={self.absorption!r})"
        )
        if not self.is_specialized:
            return base
        return f"{base}.specialize({sorted(self.routes)}, steady_state={self.steady_state})"

    # ---------------------------------------------------------------- specialisation
    @property
    def is_specialized(self) -> bool:
        """Whether the model computes only some dosing routes (built by :meth:`for_doses` or
        :meth:`specialize`)."""
        return self._general is not self

    def _set_routes(self, routes: frozenset, steady_state: bool) -> None:
        self.routes = routes
        self.steady_state = steady_state
        depot = self.absorption is not None
        off = 2 if depot else 1  # the number of the central compartment

        def disposition(kind: str) -> tuple[int, ...]:
            return tuple(sorted(c - off for k, c in routes if k == kind and c >= off))

        self._plan = _Plan(
            depot_bolus=depot and ("bolus", 1) in routes,
            depot_infusion=depot and ("infusion", 1) in routes,
            bolus_cmts=disposition("bolus"),
            infusion_cmts=disposition("infusion"),
            steady_state=steady_state,
        )

    def specialize(
        self, routes: Iterable[tuple[str, int]], steady_state: bool = False
    ) -> CompartmentModel:
        """The same model computing only the dosing routes given: a structural function with
        the same contract and attributes (``param_names``, ``optional_params``,
        ``compartments``, ...) whose trace holds only the code of those routes (much faster
        when the data use few routes; the values are those of the general model to float
        round-off). Doses of another route are refused by its :meth:`check_doses` and make
        the prediction of their subject NaN inside ``jit``. Usually built by
        :meth:`for_doses`; the same routes give the same object.

        :param routes: ``(kind, cmt)`` pairs, ``kind`` ``"bolus"`` (``rate = 0``; into the
            depot: first-order absorption) or ``"infusion"`` (``rate > 0``), ``cmt`` a
            compartment number of ``compartments``.
        :param steady_state: whether steady-state doses (``ss = True``) are computed.
        :return: the specialised model (this model's general one if every route and steady
            state are asked for).
        :raises ValueError: an unknown kind or compartment.
        :raises TypeError: a route that is not a ``(kind, cmt)`` pair, or a non-bool
            ``steady_state``.
        """
        general = self._general
        if not isinstance(steady_state, bool | np.bool_):
            raise TypeError(f"steady_state must be a bool, got {steady_state!r}.")
        checked = set()
        for r in routes:
            if not (isinstance(r, tuple | list) and len(r) == 2):
                raise TypeError(
                    f"routes must hold (kind, cmt) pairs such as ('bolus', 1), got {r!r}."
                )
            kind, cmt = r
            if kind not in ROUTE_KINDS:
                raise ValueError(
                    f"route {tuple(r)!r}: kind {kind!r} is not one of {list(ROUTE_KINDS)}."
                )
            if (
                isinstance(cmt, bool)
                or not isinstance(cmt, int | np.integer)
                or (int(cmt) not in self.compartments)
            ):
                raise ValueError(
                    f"route {tuple(r)!r}: cmt={cmt!r} is not a compartment of {general!r}; "
                    f"valid compartments: {self.compartments}."
                )
            checked.add((str(kind), int(cmt)))
        key = (frozenset(checked), bool(steady_state))
        if key == (general.routes, general.steady_state):
            return general
        if key not in general._specialized:
            model = CompartmentModel(self.n_compartments, self.absorption)
            model._general = general
            model._specialized = {}
            model._set_routes(*key)
            general._specialized[key] = model
        return general._specialized[key]

    def for_doses(self, doses: Any) -> CompartmentModel:
        """The model specialised (:meth:`specialize`) to the routes of the real
        (``mask = True``) doses of a dosing record: which (bolus or infusion, compartment)
        pairs occur and whether any dose is at steady state. Host side (numpy), run once per
        dataset; ``TLAG`` and ``F`` cost nothing when the parameters passed at call time do
        not have them (specialised or not). A specialised model's :meth:`check_doses` refuses
        the doses of other routes: rebuild it with ``for_doses`` for new data (from the
        general model or a specialised one alike).

        :param doses: dosing record (fields ``time, amt, rate, cmt, ss, ii, mask``), for one
            subject ``(D,)`` or many ``(n, D)`` (e.g. ``PKDataset.doses``).
        :return: the specialised model (the same object for the same routes).
        :raises TypeError: a field is missing.
        :raises ValueError: doses the general model refuses (see :meth:`check_doses`).
        """
        general = self._general
        general.check_doses(doses)
        a = _host_doses(doses)
        real = a["mask"].astype(bool)
        inf = a["rate"].astype(float) > 0
        routes = {
            ("infusion" if i else "bolus", int(c))
            for c, i in zip(a["cmt"][real].ravel(), inf[real].ravel(), strict=True)
        }
        return general.specialize(routes, bool(np.any(real & a["ss"].astype(bool))))

    def _route_ok(self, cmt: Any, inf: Any) -> Any:
        """Whether doses (``cmt`` numbers, ``inf`` = ``rate > 0``: numpy or jax arrays) take a
        route of ``routes`` (a static ``True`` for the general model)."""
        if not self.is_specialized:
            return True
        ok: Any = False
        for kind, into in (("bolus", _not(inf)), ("infusion", inf)):
            member: Any = False
            for c in sorted(c for k, c in self.routes if k == kind):
                member = _or(member, cmt == c)
            ok = _or(ok, _and(member, into))
        return ok

    def check_doses(self, doses: Any, locate: Any = None) -> None:
        """Check a dosing record on the host (numpy), for one subject ``(D,)`` or many
        ``(n, D)``: what cannot be checked inside ``jit``.

        :param doses: dosing record (fields ``time, amt, rate, cmt, ss, ii, mask``).
        :param locate: see :meth:`StructuralModel.check_doses`.
        :raises TypeError: a field is missing.
        :raises ValueError: a real (``mask = True``) dose goes into a compartment the model
            does not have, has a non-finite or negative ``time``/``amt``/``rate``, a zero
            amount with ``rate > 0``, an unsupported steady-state setting, or (a specialised
            model) takes a route the model was not specialised for; the message gives the
            dose's index and the valid values.
        """
        super().check_doses(doses, locate)
        if not self.is_specialized:
            return
        a = _host_doses(doses)
        real = a["mask"].astype(bool)
        cmt, ss = a["cmt"], a["ss"].astype(bool)
        inf = a["rate"].astype(float) > 0
        bad = _or(_not(self._route_ok(cmt, inf)), False if self.steady_state else ss)
        if bad is False or not np.any(bad & real):
            return
        idx = tuple(int(i) for i in np.argwhere(bad & real)[0])
        what = (
            f"{'a steady-state' if ss[idx] else 'an' if inf[idx] else 'a'} "
            f"{'infusion' if inf[idx] else 'bolus'} "
            f"into compartment {int(cmt[idx])} ({self.compartments[int(cmt[idx])]!r})"
        )
        routes = ", ".join(f"{k} into {c}" for k, c in sorted(self.routes)) or "none"
        raise ValueError(
            f"{_dose_where(idx, 'cmt', locate)}: {what} is not a route of {self!r}, "
            f"specialised by for_doses to the routes [{routes}]"
            f"{'' if self.steady_state else ' without steady state'}. Rebuild the structural "
            "model with model.for_doses(doses) on the new data (or use the general "
            f"{self._general!r})."
        )

    def _poison(self, d: _DoseArrays) -> jax.Array:
        """As :meth:`StructuralModel._poison`, and for a specialised model also NaN when a real
        dose takes a route it does not compute."""
        if not self.is_specialized:
            return super()._poison(d)
        bad = _or(_not(self._route_ok(d.cmt, d.rate > 0)), d.rate < 0)
        bad = _or(bad, (d.ss & ~(d.ii > 0)) if self.steady_state else d.ss)
        return jnp.where(jnp.any(d.mask & bad), jnp.nan, 0.0).astype(d.time.dtype)

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
    @property
    def predicted_cmts(self) -> tuple[int, ...]:
        """The compartments an observation may name (``cmt=`` of :meth:`__call__`): the
        central one and, with first-order absorption, the depot (its amount, NONMEM's
        ``A(1)/S1`` with ``S1 = 1``); the peripheral amounts are not computed."""
        return (1, 2) if self.absorption is not None else (1,)

    def __call__(
        self, params: Mapping[str, Any], t: jax.Array, doses: Any, cmt: Any = None
    ) -> jax.Array:
        """Concentrations ``(T,)`` in the central compartment for one subject (or, with
        ``cmt``, in the compartment each observation names).

        :param params: ``{name: scalar}`` with every name of ``param_names`` (and any of
            ``TLAG``, ``F``).
        :param t: ``(T,)`` observation times.
        :param doses: dosing record, fields ``time, amt, rate, cmt, ss, ii, mask`` ``(D,)``.
        :param cmt: optional ``(T,)`` int compartment of each observation: 0 or the central
            one give ``A_central(t) / V``; the depot (1, with first-order absorption) gives
            its amount ``A_depot(t)`` (NONMEM's prediction ``A(1)/S1`` without a scale
            ``S1``); another compartment gives NaN (checked on the host by
            :class:`~numpyro_fed.nlme.model.PKModel`).
        :return: ``(T,)`` central concentrations ``A_central(t) / V`` (see ``cmt``).
        :raises ValueError: unknown or missing parameter names, non-scalar parameters, bad
            shapes (at trace time).
        """
        p, t, d = self._prepare(params, t, doses)
        # TLAG and F are static: absent from params, their (neutral) code is not traced
        lag, bio = "TLAG" in params, "F" in params
        out = self._central_amount(p, t, d, lag=lag, bio=bio) / p["V"]
        if cmt is not None:
            cmt = jnp.asarray(cmt, jnp.int32)
            central = self.observed_cmt
            other = jnp.full(t.shape, jnp.nan, t.dtype)
            if self.absorption is not None:
                other = jnp.where(cmt == 1, self._depot_amount(p, t, d, lag, bio), other)
            out = jnp.where((cmt == 0) | (cmt == central), out, other)
        return out + self._poison(d)

    def _depot_amount(
        self, p: dict[str, jax.Array], t: jax.Array, d: _DoseArrays, lag: bool, bio: bool
    ) -> jax.Array:
        """Amount ``(T,)`` in the depot: the sum over the doses into it (bolus: ``F amt
        e^{-ka x}``; infusion: ``rate (1 - e^{-ka x}) / ka`` while it runs, then decaying;
        steady state: the geometric sum of the train), with the dose timing (``TLAG``,
        steady-state resets) of :meth:`_central_amount`."""
        ka = p["KA"]
        zero = jnp.zeros((), t.dtype)
        depot = d.mask & (d.cmt == 1)
        amt = p["F"] * d.amt if bio else d.amt
        inf = depot & (d.rate > 0)
        rate = jnp.where(inf, d.rate, 1.0)
        tau = jnp.where(inf, amt / rate, zero)
        te = d.time + p["TLAG"] if lag else d.time
        dt = t[:, None] - te[None, :]
        ss = d.ss & depot
        if self.steady_state:
            ii = jnp.where(d.ss, d.ii, 1.0)
            m0 = jnp.where(d.ss & (dt < 0), jnp.ceil(-dt / ii), 0.0)
            dt = dt + m0 * ii
            started = jnp.where(d.ss, t[:, None] >= d.time[None, :], dt >= 0)
            idx = jnp.arange(d.time.shape[0])
            later = (d.time[None, :] > d.time[:, None]) | (
                (d.time[None, :] == d.time[:, None]) & (idx[None, :] > idx[:, None])
            )
            reset = jnp.min(
                jnp.where(later & d.ss[None, :], d.time[None, :], jnp.inf), axis=1,
                initial=jnp.inf)
            active = d.mask[None, :] & started & (t[:, None] < reset[None, :])
        else:
            ii = jnp.ones_like(d.time)
            active = d.mask[None, :] & (dt >= 0)
        x = jnp.where(active, jnp.maximum(dt, 0.0), 0.0)
        running = x < tau[None, :]
        # g(y) = (1 - e^{-ka y}) / ka, without cancellation
        g = lambda y: -jnp.expm1(-ka * y) / ka  # noqa: E731
        after = jnp.where(running, 0.0, x - tau[None, :])
        single = jnp.where(
            inf[None, :],
            d.rate[None, :] * jnp.where(running, g(x), g(tau)[None, :] * jnp.exp(-ka * after)),
            amt[None, :] * jnp.exp(-ka * x),
        )
        if self.steady_state:
            # the earlier doses of the train, every ii before this one (all finished: tau <=
            # ii): bolus amt e^{-ka (x + k ii)}, infusion rate g(tau) e^{-ka (x - tau + k ii)},
            # k >= 1, summed
            iic = ii[None, :]
            train = jnp.where(
                inf[None, :],
                d.rate[None, :] * g(tau)[None, :] * jnp.exp(-ka * (x - tau[None, :] + iic)),
                amt[None, :] * jnp.exp(-ka * (x + iic)),
            ) / -jnp.expm1(-ka * iic)
            single = single + jnp.where(ss[None, :], train, 0.0)
            bad = ss & inf & (tau > ii)  # overlapping steady-state infusions: NaN
            single = jnp.where(bad[None, :], jnp.nan, single)
        return jnp.sum(jnp.where(active & depot[None, :], single, 0.0), axis=1)

    def _central_amount(
        self, p: dict[str, jax.Array], t: jax.Array, d: _DoseArrays, lag: bool, bio: bool
    ) -> jax.Array:
        """Central amount ``(T,)``: the sum over doses of their (masked) responses. Only the
        routes of ``self.routes`` are traced (static zeros and masks, see :func:`_mul`), with
        ``TLAG`` (``lag``) and ``F`` (``bio``) only when they are parameters."""
        n = self.n_compartments
        absorb = self.absorption is not None
        r = self._plan
        depot_routes = r.depot_bolus or r.depot_infusion
        disp_cmts = sorted(set(r.bolus_cmts) | set(r.infusion_cmts))
        any_inf = r.depot_infusion or bool(r.infusion_cmts)
        any_bolus = r.depot_bolus or bool(r.bolus_cmts)
        ss_on = r.steady_state
        # eigenvalues and residues (n,), (n, n): once per call (per subject), not per pair;
        # one compartment: a scalar rate and no axis of modes (C = [[1]])
        lam, C = (p["CL"] / p["V"], None) if n == 1 else self._eigen(p)
        ka = p["KA"] if absorb else None
        zero = jnp.zeros((), t.dtype)
        modes = n > 1

        def col(v: Any) -> Any:  # per-dose (D,) -> (D, 1), against the modes (n,)
            return v if v is None or isinstance(v, bool) or not modes else v[:, None]

        def msum(v: jax.Array) -> jax.Array:  # sum over the modes
            return jnp.sum(v, axis=-1) if modes else v

        # ---- per dose (D,); masks static where the routes decide them (padding doses have
        # amt = rate = 0 and are inactive below)
        depot = (d.cmt == 1) if depot_routes and disp_cmts else depot_routes
        if n == 1:
            c_sel: Any = 1.0  # C = [[1]]
        elif len(disp_cmts) == 1:
            c_sel = C[disp_cmts[0]]  # (n,)
        else:
            c_sel = C[jnp.clip(d.cmt - (2 if absorb else 1), 0, n - 1)]  # (D, n)
        amt = d.amt
        into_f = depot_routes if absorb else 0 in disp_cmts  # doses into compartment 1
        if bio and into_f:
            only_f = not disp_cmts if absorb else disp_cmts == [0]
            f_amt = p["F"] * d.amt
            amt = f_amt if only_f else jnp.where(d.cmt == self.default_dose_cmt, f_amt, d.amt)
        inf = (d.mask & (d.rate > 0)) if any_inf else False
        inf_w = inf if any_bolus else any_inf  # as a weight mask (padding weights are 0)
        bolus_w = _not(inf) if any_bolus else False
        tau = jnp.where(inf, amt / jnp.where(inf, d.rate, 1.0), zero) if any_inf else None
        ss = d.ss if ss_on else False
        bad_ss: Any = False
        if ss_on:
            ii = jnp.where(ss, d.ii, 1.0)
            if any_inf:
                bad_ss = ss & inf & (tau > ii)  # overlapping steady-state infusions: NaN
                rho = jnp.where(ss, jnp.maximum(ii - tau, 0.0), zero)  # gap after SS infusion

        # ---- per observation and dose (T, D)
        te = d.time + p["TLAG"] if lag else d.time
        dt = t[:, None] - te[None, :]
        if ss_on:
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
        else:
            active = d.mask[None, :] & (dt >= 0)
            dt = jnp.where(active, dt, 0.0)
        # evaluate every response at one time per (T, D): since the dose for a bolus or a
        # running infusion, since the end of a finished infusion (the state at the end is
        # then propagated: no difference of large terms)
        post: Any = True
        x = dt
        if any_inf:
            post = dt >= tau
            x = jnp.where(post, dt - tau, dt)

        # ---- one kernel call for the (T, D) times x and the per-dose tau, ii and rho (rows
        # T + 0, 1, 2 of those needed), for the responses the routes need (static)
        need_x = set()
        if r.bolus_cmts or r.infusion_cmts or r.depot_infusion or (r.depot_bolus and ss_on):
            need_x.add("e")
        if r.infusion_cmts:
            need_x.add("g")
        if depot_routes:
            need_x.add("d2")
        if r.depot_infusion:
            need_x |= {"h"} | ({"eka"} if ss_on else set())
        if not need_x:  # no route at all: nothing is ever dosed
            return jnp.zeros(t.shape, t.dtype)
        rows, need = [], set(need_x)
        if any_inf:
            rows.append(tau)
            need |= ({"g"} if r.infusion_cmts else set()) | (
                {"h", "gka"} if r.depot_infusion else set()
            )
        if ss_on:
            rows.append(ii)
            need |= {"g"} | ({"gka", "d2"} if depot_routes else set())
            if any_inf:
                rows.append(rho)
                need |= {"e"} | ({"d2"} if r.depot_infusion else set())
        T = t.shape[0]
        k = _kernel(lam, ka, jnp.concatenate([x, jnp.stack(rows)]) if rows else x, frozenset(need))
        at = lambda field, i: getattr(k, field)[T + i]  # noqa: E731
        i_tau, i_ii, i_rho = 0, int(any_inf), int(any_inf) + 1

        # ---- weights of the responses per dose (D, n), in two phases: "post" (after a bolus
        # or after the end of an infusion) and "run" (during an infusion). For SS, the earlier
        # doses of the train are propagated from the end of the last one: over rho' = ii
        # after it, rho = ii - tau during it.
        ss_c = col(ss) if ss_on else None
        g_lam = jnp.where(ss_c, 1.0 / (lam * at("g", i_ii)), 1.0) if ss_on else 1.0
        ssg = ss_c * g_lam if ss_on else None  # 1 / (1 - e^{-lam ii}) if SS, else 0
        e_ii = at("e", i_ii) if ss_on and any_inf else None
        e_rho = at("e", i_rho) if ss_on and any_inf else None
        disp = _not(depot)
        b_c = _where0(col(_and(bolus_w, disp)), _mul(col(amt), c_sel)) if r.bolus_cmts else None
        r_c = _where0(col(_and(inf_w, disp)), _mul(col(d.rate), c_sel)) if r.infusion_cmts else None
        g_tau = at("g", i_tau) if r.infusion_cmts else None
        post_e = _add(_mul(b_c, g_lam), _mul(r_c, g_tau, _add(1.0, _mul(ssg, e_ii))))
        run_e = _mul(r_c, g_tau, ssg, e_rho)
        post_d2 = run_d2 = r_k = post_eka = run_eka = None
        if depot_routes:
            kc = ka * C[0] if n > 1 else ka  # (n,)
            g_ka = col(jnp.where(ss, 1.0 / (ka * at("gka", i_ii)), 1.0)) if ss_on else 1.0
            d2_ii = at("d2", i_ii) if ss_on else None
            b_k = (
                _where0(col(_and(bolus_w, depot)), _mul(col(amt), g_ka, kc))
                if r.depot_bolus
                else None
            )  # depot boluses
            r_k = (
                _where0(col(_and(inf_w, depot)), _mul(col(d.rate), kc))
                if r.depot_infusion
                else None
            )
            h_tau = at("h", i_tau) if r.depot_infusion else None
            gka_tau = col(at("gka", i_tau)) if r.depot_infusion else None
            d2_rho = at("d2", i_rho) if ss_on and r.depot_infusion else None
            sse = _add(h_tau, _mul(gka_tau, g_ka, d2_ii))  # state after one SS depot infusion
            ssk = _mul(r_k, gka_tau, ss_c, g_ka)
            post_e = _add(
                post_e, _mul(b_k, ssg, d2_ii), _mul(r_k, _add(h_tau, _mul(ssg, e_ii, sse)))
            )
            run_e = _add(run_e, _mul(r_k, ssg, e_rho, sse))
            post_d2 = _add(b_k, _mul(r_k, gka_tau), _mul(ssk, e_ii))
            run_d2 = _mul(ssk, e_rho)
            if ssk is not None:  # weight of e^{-ka x} (per dose, summed over the modes)
                post_eka, run_eka = msum(ssk * d2_ii), msum(ssk * d2_rho)
        # (post weight, run weight, response) of the terms not statically zero
        terms = [(post_e, run_e, "e"), (None, r_c, "g"), (post_d2, run_d2, "d2"), (None, r_k, "h")]
        terms = [tm for tm in terms if tm[0] is not None or (any_inf and tm[1] is not None)]
        # the terms are those of need_x (checked at trace time: the two must agree)
        assert {name for *_, name in terms} | ({"eka"} if post_eka is not None else set()) == (
            need_x
        ), (terms, need_x)

        # ---- responses per observation and dose (T, D, n), weighted, summed over the modes
        shape = (d.time.shape[0], n) if modes else d.time.shape
        full = lambda w: jnp.broadcast_to(zero if w is None else w, shape)  # noqa: E731
        phase = post[..., None] if modes and any_inf else post  # against the modes
        amount = None
        for w_post, w_run, name in terms:
            w = w_post
            if any_inf:
                w = jnp.where(phase, full(w_post), full(w_run))
            amount = _add(amount, w * getattr(k, name)[:T])
        amount = msum(amount)
        if post_eka is not None:
            amount += jnp.where(post, post_eka, run_eka) * k.eka[:T]
        if bad_ss is not False:
            amount = jnp.where(bad_ss[None, :], jnp.nan, amount)
        amount = jnp.where(active, amount, 0.0)
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
