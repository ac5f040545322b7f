"""A NumPyro model from a short specification: structural model, individual parameters with
random effects and covariate effects, residual error model.

.. code-block:: python

    from numpyro_fed import nlme

    data = nlme.load_phenobarb()
    pk = nlme.PKModel(
        nlme.one_compartment(absorption=None),
        params={"CL": nlme.Param(0.005, covariates={"WT": "linear"}),
                "V": nlme.Param(1.0, covariates={"WT": "linear", "APGARIND": "categorical"})},
        error="additive",
    )
    fit = pk.fit(data, jax.random.key(0))      # SAEM with its defaults
    fit.parameter_table()

The model is an ordinary NumPyro function, ``pk.model(**pk.arrays(data))``: it can be
handed to :class:`~numpyro_fed.saem.SAEM` directly, to ``numpyro.infer.MCMC`` or
``Predictive``, and a hand-written model that calls the same structural and error functions
is fitted the same way. ``pk.arrays(data)`` holds the padded arrays and ``binding``, a
static :class:`Binding` with what the model takes from ``data`` (computed afresh for every
dataset; ``pk`` itself never changes: ``pk.bind(data)`` returns a bound copy).

Parameterisation (Monolix / saemix convention): for an individual parameter :math:`P` with
the default log transform,

.. math::

    \\log P_i = \\mu_P + \\sum_c \\beta_{P,c}\\, x_{ic} + \\eta_{P,i}, \\qquad
    \\eta_{\\cdot, i} \\sim \\mathcal N(0, \\Omega),

with :math:`x_{ic}` the covariate term: ``"linear"`` :math:`x - x_{ref}`, ``"power"``
:math:`\\log(x / x_{ref})` (:math:`P \\propto x^{\\beta}`), ``"categorical"`` one indicator
per non-reference level. The latent site of :math:`P` is ``phi_P`` (its transformed value,
:math:`\\log P_i`), a Normal whose location is linear in the params: the automatic Gaussian
M-step of SAEM updates :math:`\\mu`, :math:`\\beta` and :math:`\\Omega` in closed form.
``omega="full"`` gives one MultivariateNormal site ``phi`` with a full Cholesky factor
``L_omega``.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import inspect
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
from numpyro.distributions import constraints

from numpyro_fed.nlme.data import Doses, PKDataset
from numpyro_fed.nlme.diagnostics import NLMEFit
from numpyro_fed.nlme.error import ErrorModel, _concrete
from numpyro_fed.nlme.superposition import (
    predict_pairs,
    superposition_pairs,
    supports_superposition,
)

# imported with the layer, not at the first fit that needs it: the constants of the
# library's modules are part of a run's replay key (numpyro_fed.saem.memo), and a module
# that a fit imports changed the key of the next fit (a repeated time-varying fit was traced
# again, 39 s, instead of replayed)
from numpyro_fed.nlme.timevarying import predict_piecewise
from numpyro_fed.nlme.transforms import TRANSFORMS
from numpyro_fed.saem import SAEM

__all__ = ["Binding", "Param", "PKModel", "TRANSFORMS", "COVARIATE_KINDS", "occasion_indices"]

#: transforms of individual parameters: name -> (forward, inverse) between the latent
#: (Gaussian) scale and the natural scale
COVARIATE_KINDS = ("linear", "power", "categorical")
#: the inverse transforms on host values (initial values: constants, also under a trace)
_INVERSE_NP: dict[str, Callable] = {
    "log": np.log, "none": lambda x: x, "logit": lambda p: np.log(p) - np.log1p(-p),
}


@dataclass
class Param:
    """One individual parameter of the structural model.

    :param value: initial typical value on the natural scale (at the covariates' reference).
    :param random: whether it has a random effect.
    :param omega: initial standard deviation of its random effect (transformed scale).
    :param transform: ``"log"`` (positive parameters; default), ``"none"`` or ``"logit"``
        (a fraction, e.g. a bioavailability).
    :param covariates: ``{covariate: kind}`` with kind in ``"linear"``, ``"power"``,
        ``"categorical"``; effects on the transformed scale, continuous ones centred at the
        reference (:attr:`PKModel.references`: unless given, the median over the subjects of
        the data the model is used with -- each dataset its own -- and, for a fitted model
        ``fit.pk``, that of the fitted data).
    """

    value: float
    random: bool = True
    omega: float = 0.3
    transform: str = "log"
    covariates: dict = field(default_factory=dict)


@dataclass(frozen=True)
class Binding:
    """What a :class:`PKModel` takes from one dataset (:meth:`PKModel.arrays` returns it as
    the static argument ``binding`` of :meth:`PKModel.model`): hashable, compared by value
    (the structural model by identity), so that SAEM's compiled programs are shared by the
    data with the same binding and never by others.

    :ivar references: ``((covariate, reference value), ...)`` of the continuous covariates.
    :ivar levels: ``((covariate, number of levels), ...)`` of the categorical ones.
    :ivar structural: the structural model, specialised to the data's dosing routes where it
        can be (:meth:`~numpyro_fed.nlme.pk.CompartmentModel.for_doses`).
    :ivar record_order: whether a sample is recorded before a dose given at the same time
        (the predictions then follow the record order).
    :ivar obs_cmt: whether an observation names a compartment other than the observed one
        (the model then passes each observation's compartment to the structural model).
    :ivar time_varying: the covariates of the model that change within a subject in these
        data (their values in force at each record are used, see
        :mod:`numpyro_fed.nlme.timevarying`).
    :ivar tv_infusions: with ``time_varying``: whether a dose is an infusion.
    :ivar tv_steady_state: with ``time_varying``: whether a dose is at steady state.
    :ivar occasions: with inter-occasion variability (``PKModel(iov=...)``): the number of
        occasions over all subjects (the size of the plate ``occasion``); 0 without.
    :ivar censored: whether an observation is below its limit of quantification (M3
        likelihood); without, the observations are the error model's plain distribution (the
        same density: the censored one has ``cens = False`` everywhere), whose programs are
        smaller and faster (no normal CDF and its derivatives). ``True`` (always exact) when
        unbound.
    :ivar data: the dataset (not compared; for the messages naming its rows).
    """

    references: tuple
    levels: tuple
    structural: Any
    record_order: bool
    obs_cmt: bool = False
    time_varying: tuple = ()
    tv_infusions: bool = False
    tv_steady_state: bool = False
    occasions: int = 0
    censored: bool = True
    data: Any = field(default=None, compare=False, repr=False)

    @property
    def piecewise(self) -> bool:
        """Whether the parameters change from record to record (time-varying covariates or
        occasions): the predictions then advance the amounts record by record
        (:func:`~numpyro_fed.nlme.timevarying.predict_piecewise`)."""
        return bool(self.time_varying) or self.occasions > 0


def _py(v: Any) -> Any:
    return v.item() if isinstance(v, np.generic) else v


def _accepts(fn: Callable, name: str) -> bool:
    """Whether ``fn`` takes a keyword argument ``name``."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
    return name in params or any(p.kind is p.VAR_KEYWORD for p in params.values())


def _dose_locate(data: PKDataset, idx: tuple, item: str) -> str:
    """The dose at ``idx`` (subject, dose) of ``data``'s arrays: subject, row, column."""
    if len(idx) != 2:
        return f"dose at index {idx} of the dose arrays"
    return "dose of " + data.locate("dose", idx[0], idx[1], item or None)


def _check_obs_cmt(structural: Any, data: PKDataset) -> bool:
    """Refuse observations of a compartment the structural model lacks or does not predict
    (``obs.cmt = 0``: its observed compartment); return whether an observation names a
    compartment other than the observed one (predicted from the per-sample ``cmt``)."""
    o = data.obs
    cm = np.where(o.mask, np.asarray(o.cmt), 0)
    named = o.mask & (cm > 0)
    comps = getattr(structural, "compartments", None)
    observed = getattr(structural, "observed_cmt", None)
    col = data.column("cmt")
    if comps is None or observed is None:
        # a plain function: it predicts one value per sample, whatever CMT says
        used = sorted(set(cm[named].tolist()))
        if len(used) > 1:
            j = np.argwhere(named & (cm != used[0]))[0]
            raise ValueError(
                f"observation of {data.locate('obs', j[0], j[1], 'cmt')}: the observations "
                f"name several compartments {used} in column {col!r}, but the structural "
                f"model {structural!r} predicts one value per sample and says which "
                "compartment (attributes compartments/observed_cmt) nowhere. Keep the "
                "observations of one compartment, or use a structural model that declares "
                "them.")
        return False
    comps = dict(comps)
    predicted = tuple(getattr(structural, "predicted_cmts", (observed,)))
    bad = named & ~np.isin(cm, list(comps))
    if bad.any():
        i, j = np.argwhere(bad)[0]
        raise ValueError(
            f"observation of {data.locate('obs', i, j, 'cmt')}: CMT={int(cm[i, j])} is not a "
            f"compartment of {structural!r} (its compartments: {comps}; {int(bad.sum())} such "
            f"observation(s)). Fix the CMT of the observation (0, or empty, means the observed "
            f"compartment {observed} = {comps[observed]!r}).")
    bad = named & ~np.isin(cm, list(predicted))
    if bad.any():
        i, j = np.argwhere(bad)[0]
        c = int(cm[i, j])
        raise ValueError(
            f"observation of {data.locate('obs', i, j, 'cmt')}: CMT={c} is the {comps[c]!r} "
            f"compartment of {structural!r}, which predicts only compartment(s) "
            f"{', '.join(f'{k} ({comps[k]!r})' for k in predicted)} ({int(bad.sum())} such "
            "observation(s)). NONMEM would predict the amount in compartment "
            f"{c} divided by its scale S{c}; this model cannot: give the observation the "
            f"CMT of the compartment it measures ({observed}, or 0 / empty for the observed "
            "one), or write the system with nlme.ode_model (it predicts the amount of every "
            "compartment).")
    return bool(np.any(named & (cm != observed)))


def _check_time_varying(pk: PKModel, data: PKDataset, tv: tuple) -> None:
    """Refuse time-varying covariates where they cannot be honoured: a structural model
    other than the closed-form compartment models, or a lag time."""
    from numpyro_fed.nlme.pk import CompartmentModel

    if not isinstance(pk.structural, CompartmentModel):
        raise ValueError(
            f"covariate(s) {list(tv)} vary with time within subjects; only the compartment "
            "models (nlme.compartment_model and its one_/two_/three_compartment) take "
            "parameters that change over time (advanced record by record, "
            f"numpyro_fed.nlme.timevarying), not {pk.structural!r}. Use a compartment model, "
            "or a time-constant summary of the covariate (e.g. its baseline) as a new column.")
    if "TLAG" in pk.params:
        raise ValueError(
            f"covariate(s) {list(tv)} vary with time within subjects, which a model with a lag "
            "time TLAG does not support (the lagged doses would interleave with the records):"
            " drop TLAG, or use a time-constant summary of the covariate.")


def _check_iov_structural(pk: PKModel) -> None:
    """Refuse inter-occasion variability where the parameters cannot change between
    occasions: a structural model other than the closed-form compartment models, or a lag
    time (as for time-varying covariates)."""
    from numpyro_fed.nlme.pk import CompartmentModel

    names = list(pk.iov)
    if not isinstance(pk.structural, CompartmentModel):
        raise ValueError(
            f"iov={names}: inter-occasion variability makes the parameters change from one "
            "occasion to the next, which only the compartment models (nlme.compartment_model "
            "and its one_/two_/three_compartment) take (advanced record by record, "
            f"numpyro_fed.nlme.timevarying), not {pk.structural!r}. Use a compartment model, or "
            "drop iov.")
    if "TLAG" in pk.params:
        raise ValueError(
            f"iov={names}: inter-occasion variability is not supported with a lag time TLAG "
            "(the lagged doses would interleave with the records of the occasions): drop TLAG "
            "or iov.")


def _occasion_values(data: PKDataset, column: str) -> tuple[np.ndarray, np.ndarray]:
    """The occasion column at every observation ``(n, T)`` and dose ``(n, D)`` record."""
    if column in data.time_varying:
        return (np.asarray(data.time_varying[column]),
                np.asarray(data.dose_time_varying[column]))
    if column in data.covariates:
        v = np.asarray(data.covariates[column])
        return (np.broadcast_to(v[:, None], data.obs.time.shape),
                np.broadcast_to(v[:, None], data.doses.time.shape))
    raise ValueError(
        f"occasion={column!r}: no such column in the data (columns read as covariates: "
        f"{sorted([*data.covariates, *data.time_varying])}). Read the occasion column with "
        f"PKDataset.from_dataframe(..., covariates=[..., {column!r}]), or name the column that "
        "numbers the occasions.")


def occasion_indices(data: PKDataset, column: str) -> tuple[np.ndarray, np.ndarray, int]:
    """Occasions of every record, numbered over all subjects.

    The occasions of a subject are the distinct values of ``column`` at its observation and
    dose records (rows of ``EVID = 2`` are not records), numbered in increasing order of the
    value, subject after subject: occasion ``k`` of the whole data set is one (subject,
    value) pair. Padding records get their subject's first occasion (they are masked).

    :param data: the dataset.
    :param column: the column numbering the occasions (constant or time-varying within a
        subject; any numeric codes).
    :return: ``(occ_obs (n, T), occ_dose (n, D), number of occasions)``, int32 indices.
    :raises ValueError: the column is not in the data or holds a non-finite value at a
        record, or every subject has a single occasion (the inter-occasion variance cannot
        be told from the between-subject one).
    """
    vo, vd = _occasion_values(data, column)
    mo = np.asarray(data.obs.mask, bool)
    md = np.asarray(data.doses.mask, bool)
    for kind, v, m in (("obs", vo, mo), ("dose", vd, md)):
        with np.errstate(invalid="ignore"):
            bad = m & ~np.isfinite(np.asarray(v, np.float64))
        if bad.any():
            i, j = np.argwhere(bad)[0]
            what = "observation" if kind == "obs" else "dose"
            raise ValueError(
                f"{what} of {data.locate(kind, i, j)}: occasion column {column!r} is "
                f"{v[i, j]!r} ({int(bad.sum())} such record(s)); every dose and observation "
                "record needs its occasion.")
    n = vo.shape[0]
    occ_o = np.zeros(vo.shape, np.int32)
    occ_d = np.zeros(vd.shape, np.int32)
    start, most = 0, 0
    for i in range(n):
        levels = np.unique(np.concatenate([vo[i][mo[i]], vd[i][md[i]]]))
        occ_o[i] = start + np.where(mo[i], np.searchsorted(levels, vo[i]), 0)
        occ_d[i] = start + np.where(md[i], np.searchsorted(levels, vd[i]), 0)
        start += max(len(levels), 1)
        most = max(most, len(levels))
    if most < 2:
        raise ValueError(
            f"occasion={column!r} has one value per subject in these data (every subject has "
            "a single occasion): the inter-occasion variability cannot be told from the "
            "variability between subjects. Give a column that changes within subjects (e.g. "
            "the dosing period), or drop iov.")
    return occ_o, occ_d, start


def _max_text(big: float) -> str:
    """``3.4e38`` for the largest float32."""
    return f"{big:.2g}".replace("e+", "e")


def _check_float32(data: PKDataset, covariates: list[str]) -> None:
    """Refuse finite values that overflow the float type JAX computes in (float32 unless
    JAX's float64 is enabled): converted, they would silently become infinite."""
    if jax.config.jax_enable_x64:
        return
    big = float(np.finfo(np.float32).max)
    o, d = data.obs, data.doses

    def check(kind, values, mask, item):
        v = np.asarray(values)
        if v.dtype.kind != "f" or v.dtype.itemsize <= 4:
            return
        with np.errstate(invalid="ignore"):
            bad = np.asarray(mask, bool) & np.isfinite(v) & (np.abs(v) > big)
        if bad.any():
            i, j = np.argwhere(bad)[0]
            what = "observation" if kind == "obs" else "dose"
            raise ValueError(
                f"{what} of {data.locate(kind, i, j, item)}: {v[i, j]:g} overflows float32 "
                f"(max {_max_text(big)}), the float type JAX computes in ({int(bad.sum())} such "
                "value(s)): rescale the column (other units), or enable JAX's float64 "
                "(jax.config.update('jax_enable_x64', True)).")

    check("obs", o.time, o.mask, "time")
    check("obs", o.dv, o.mask & ~np.asarray(o.cens, bool), "dv")
    check("obs", o.lloq, o.mask & np.asarray(o.cens, bool), "lloq")
    for item in ("time", "amt", "rate", "ii"):
        check("dose", getattr(d, item), d.mask, item)
    for c in covariates:
        v = np.asarray(data.covariates.get(c, np.zeros(0)))
        if v.dtype.kind == "f" and v.dtype.itemsize > 4:
            with np.errstate(invalid="ignore"):
                bad = np.isfinite(v) & (np.abs(v) > big)
            if bad.any():
                i = int(np.flatnonzero(bad)[0])
                raise ValueError(
                    f"covariate {c!r} of subject {_py(data.ids[i])!r} is {v[i]:g}, which "
                    f"overflows float32 (max {_max_text(big)}), the float type JAX computes in: "
                    "rescale it (other units), or enable JAX's float64.")


def _as_param(name: str, p) -> Param:
    if isinstance(p, Param):
        out = p
    elif isinstance(p, int | float) and not isinstance(p, bool):
        out = Param(float(p))
    else:
        raise TypeError(f"params[{name!r}] must be a Param or a number, got "
                        f"{type(p).__name__}.")
    if out.transform not in TRANSFORMS:
        raise ValueError(f"params[{name!r}].transform={out.transform!r}: use one of "
                         f"{sorted(TRANSFORMS)}.")
    v = float(out.value)
    if not math.isfinite(v) or (out.transform == "log" and v <= 0) or (
            out.transform == "logit" and not 0 < v < 1):
        raise ValueError(f"params[{name!r}].value={out.value!r} is outside the domain of its "
                         f"'{out.transform}' transform.")
    if out.random and not (math.isfinite(out.omega) and out.omega > 0):
        raise ValueError(f"params[{name!r}].omega={out.omega!r} must be > 0.")
    for c, kind in out.covariates.items():
        if kind not in COVARIATE_KINDS:
            raise ValueError(f"params[{name!r}].covariates[{c!r}]={kind!r}: use one of "
                             f"{COVARIATE_KINDS}.")
    return out


def _as_iov(iov, occasion, params) -> dict[str, float]:
    """Check ``PKModel(iov=..., occasion=...)``; return ``{name: initial sd}``."""
    if iov is None:
        if occasion is not None:
            raise ValueError(
                f"occasion={occasion!r} is given without iov: name the parameters that vary "
                "between occasions, e.g. iov={'CL': 0.2}, or drop occasion.")
        return {}
    if isinstance(iov, Mapping):
        out = dict(iov)
    elif isinstance(iov, list | tuple):
        out = dict.fromkeys(iov, 0.3)
    else:
        raise TypeError(f"iov must be a dict {{name: initial sd}} or a list of names, got "
                        f"{type(iov).__name__}.")
    if not out:
        raise ValueError("iov is empty: name at least one parameter, e.g. iov={'CL': 0.2}, "
                         "or leave iov out.")
    if not isinstance(occasion, str) or not occasion:
        raise ValueError(
            f"iov={list(out)} needs occasion=, the name of the data column numbering the "
            f"occasions (e.g. occasion='OCC'); got occasion={occasion!r}.")
    for nm, sd in out.items():
        if nm not in params:
            raise ValueError(f"iov names {nm!r}, which is not a parameter of the model "
                             f"(params: {list(params)}).")
        if not params[nm].random:
            raise ValueError(
                f"iov names {nm!r}, which has no random effect between subjects "
                f"(Param(random=False)): inter-occasion variability is nested in the "
                f"subject's random effect; set params[{nm!r}].random=True.")
        if isinstance(sd, bool) or not isinstance(sd, int | float | np.floating | np.integer) \
                or not (math.isfinite(float(sd)) and float(sd) > 0):
            raise ValueError(f"iov[{nm!r}]={sd!r}: the initial standard deviation of the "
                             "inter-occasion effect must be a finite number > 0.")
        out[nm] = float(sd)
    return {nm: out[nm] for nm in params if nm in out}  # in the order of params


class PKModel:
    """A population model built from a structural model, parameters and an error model.

    :param structural: a structural function ``f(params, t, doses) -> (T,)`` for one subject
        (:func:`~numpyro_fed.nlme.pk.compartment_model`, :func:`~numpyro_fed.nlme.ode.ode_model`
        or any function with the same contract and attributes ``param_names`` /
        ``optional_params``).
    :param params: ``{name: Param or initial value}`` for every required parameter of the
        structural model (and any optional one to estimate, e.g. ``TLAG``, ``F``).
    :param error: an :class:`~numpyro_fed.nlme.error.ErrorModel` or its kind
        (``"additive"``, ``"proportional"``, ``"combined1"``, ``"combined2"``,
        ``"exponential"``).
    :param omega: ``"diag"`` (independent random effects) or ``"full"`` (a full covariance).
    :param references: reference values of continuous covariates (default: the medians of
        the data at hand, see :meth:`bind`).
    :param iov: inter-occasion variability: ``{name: initial standard deviation}`` (or a
        list of names, 0.3 each) of the parameters that vary between the occasions of a
        subject, :math:`\\log P_{ik} = \\mu + \\beta x_i + \\eta_i + \\kappa_{ik}`,
        :math:`\\kappa_{ik} \\sim N(0, \\omega_{\\mathrm{IOV}}^2)` independent of
        :math:`\\eta` (latent site ``kappa_P`` in the plate ``occasion``, its standard
        deviation the param ``omega_iov_P``). Each needs a random effect between subjects
        (``Param(random=True)``) and a compartment model without ``TLAG``.
    :param occasion: with ``iov``: the column of the data numbering the occasions (see
        :func:`occasion_indices`); a parameter changes value at the first record of a new
        occasion, and the amounts then present are carried over (NONMEM's convention).

    The model does not change when it meets data: :meth:`arrays` and :meth:`fit` compute
    what they take from a dataset (covariate references and levels, the structural model
    specialised to its dosing routes, the record order) afresh for that dataset, so that a
    model used on one dataset then another computes on the second exactly what a new model
    would. :meth:`bind` returns a copy bound to a dataset, whose references and levels are
    kept on other data (the fit's model, ``fit.pk``, is bound to the fitted data).

    Observations are predicted in the compartment each names (``CMT``), as NONMEM does: the
    structural model's observed one (``observed_cmt``, the central concentration; ``CMT =
    0``, empty, or no ``CMT`` column mean it), or another of its ``predicted_cmts``, whose
    amount is predicted (NONMEM's ``A(n)/Sn`` without a scale ``Sn``: the depot of the
    compartment models, any compartment of an ODE model). An observation of a compartment
    the structural model lacks, or of one it does not predict (a peripheral compartment of
    the closed forms), is refused with its subject, row and column.
    """

    def __init__(self, structural: Callable, params: Mapping[str, Any],
                 error: ErrorModel | str = "additive", *, omega: str = "diag",
                 references: Mapping[str, float] | None = None,
                 iov: Mapping[str, float] | list | tuple | None = None,
                 occasion: str | None = None) -> None:
        if not callable(structural):
            raise TypeError("structural must be a structural model function (e.g. "
                            "nlme.one_compartment()).")
        required = tuple(getattr(structural, "param_names", ()))
        optional = dict(getattr(structural, "optional_params", {}) or {})
        if not isinstance(params, Mapping) or not params:
            raise ValueError("params must be a non-empty dict {name: Param(...)}.")
        # copies, read-only: the model's definition cannot change behind it (nor behind the
        # compiled programs SAEM caches for it) when the caller's Params are edited
        self.params = MappingProxyType({
            n: dataclasses.replace(q, covariates=dict(q.covariates))
            for n, q in ((n, _as_param(n, p)) for n, p in params.items())})
        missing = [n for n in required if n not in self.params]
        unknown = ([n for n in self.params if n not in required and n not in optional]
                   if required or optional else [])
        if missing or unknown:
            # a misspelt name is both: name the one given first, with the likely intended one
            hint = ""
            if unknown and missing:
                near = difflib.get_close_matches(unknown[0], missing, n=1, cutoff=0.0)
                hint = f"; did you mean {near[0]!r} for {unknown[0]!r}?" if near else ""
            what = (f"params has {unknown}, unknown to the structural model" if unknown
                    else f"params lacks {missing}, required by the structural model")
            also = f"; it lacks {missing}" if unknown and missing else ""
            raise ValueError(f"{what}{also} (required {list(required)}, optional "
                             f"{sorted(optional)}){hint}.")
        if omega not in ("diag", "full"):
            raise ValueError(f"omega={omega!r}: use 'diag' or 'full'.")
        self.structural = structural
        self.error = error if isinstance(error, ErrorModel) else ErrorModel(error)
        self.omega = omega
        self.names = list(self.params)
        self.random_names = [n for n in self.names if self.params[n].random]
        if not self.random_names:
            raise ValueError("no parameter has a random effect: set random=True on at least "
                             "one Param (SAEM estimates mixed-effects models).")
        if omega == "full" and len(self.random_names) < 2:
            raise ValueError("omega='full' needs at least two parameters with random effects.")
        #: inter-occasion variability: name -> initial standard deviation (read-only)
        self.iov = MappingProxyType(_as_iov(iov, occasion, self.params))
        #: the column numbering the occasions (None without iov)
        self.occasion = occasion if self.iov else None
        if self.iov:
            _check_iov_structural(self)
        for c, v in dict(references or {}).items():
            if isinstance(v, bool) or not isinstance(v, int | float | np.floating | np.integer) \
                    or not math.isfinite(float(v)):
                raise ValueError(f"references[{c!r}]={v!r} must be a finite number.")
        #: the references of continuous covariates fixed on this model (given, or those of
        #: the data it is bound to); the others come from each dataset
        self._references: dict[str, float] = {c: float(v) for c, v in
                                               dict(references or {}).items()}
        self._levels: dict[str, int] = {}
        #: the binding of the data this model is bound to (None: unbound)
        self._binding: Binding | None = None

    # ------------------------------------------------------------------ data
    @property
    def covariate_names(self) -> list[str]:
        out: list[str] = []
        for p in self.params.values():
            out += [c for c in p.covariates if c not in out]
        return out

    @property
    def references(self) -> dict[str, float]:
        """Reference values of the continuous covariates fixed on this model: those given,
        and on a bound model (:meth:`bind`, ``fit.pk``) the medians of its data (a copy)."""
        return dict(self._references)

    @property
    def levels(self) -> dict[str, int]:
        """Numbers of levels of the categorical covariates fixed on this model (a bound
        model: those of its data; a copy)."""
        return dict(self._levels)

    @property
    def is_bound(self) -> bool:
        """Whether the model is bound to a dataset (:meth:`bind`): its covariate references
        and levels are fixed."""
        return self._binding is not None

    @property
    def record_order(self) -> bool | None:
        """Whether the data this model is bound to have a sample recorded before a dose given
        at the same time (its predictions then follow the record order); ``None`` unbound."""
        return None if self._binding is None else self._binding.record_order

    def bind(self, data: PKDataset) -> PKModel:
        """A new model bound to ``data``; this one is unchanged.

        Binding fixes the parameterisation that the estimates refer to: the reference value
        of each continuous covariate (the median over the subjects of ``data`` unless given
        to the constructor) and the levels of each categorical covariate. A bound model used
        with other data (e.g. :meth:`NLMEFit.simulate` on a new regimen) keeps them; what
        only concerns the computation -- the structural model specialised to the dosing
        routes, the record order of pre-dose samples -- is always taken from the data at
        hand (:meth:`arrays`), never from an earlier dataset.

        :param data: the dataset.
        :return: the bound model (:attr:`is_bound`; :attr:`references`, :attr:`levels`,
            :attr:`record_order` of ``data``).
        :raises ValueError: data this model cannot take (see :meth:`arrays`).
        """
        return self._bound(self._bind(data))

    def _bound(self, b: Binding) -> PKModel:
        out = copy.copy(self)
        out._references = dict(b.references)
        out._levels = dict(b.levels)
        out._binding = b
        return out

    def _bind(self, data: PKDataset) -> Binding:
        """Everything the model takes from ``data``, checked; computed afresh for every
        dataset (a pure function of the model's definition and ``data``)."""
        if not isinstance(data, PKDataset):
            raise TypeError(f"data must be a nlme.PKDataset, got {type(data).__name__}.")
        if data.n_subjects == 0 or data.n_obs == 0:
            raise ValueError(
                f"data has {data.n_subjects} subject(s) and {data.n_obs} observation(s): a "
                "population model needs at least one subject with an observation.")
        refs, levels = dict(self._references), dict(self._levels)
        tv = tuple(c for c in self.covariate_names
                   if c in data.time_varying and c not in data.covariates)
        if tv:
            _check_time_varying(self, data, tv)
        for c in self.covariate_names:
            if c not in data.covariates and c not in tv:
                raise ValueError(f"covariate {c!r} is not in the data (covariates: "
                                 f"{sorted([*data.covariates, *data.time_varying])}).")
            kinds = {p.covariates[c] for p in self.params.values() if c in p.covariates}
            if c in tv:  # its values at every real observation and dose
                x = np.concatenate([
                    np.asarray(data.time_varying[c], np.float64)[np.asarray(data.obs.mask)],
                    np.asarray(data.dose_time_varying[c], np.float64)[
                        np.asarray(data.doses.mask)]])
            else:
                x = np.asarray(data.covariates[c], np.float64)
            if "categorical" in kinds:
                if len(kinds) > 1:
                    raise ValueError(f"covariate {c!r} is categorical for one parameter and "
                                     "continuous for another: use one kind.")
                cats = data.categories.get(c)
                n_lev = len(cats) if cats is not None else int(x.max()) + 1
                if c not in levels:
                    levels[c] = n_lev
                elif np.any(x >= levels[c]):
                    i = int(np.flatnonzero(x >= levels[c])[0])
                    who = (f"subject {_py(data.ids[i])!r}" if c not in tv else "a record")
                    raise ValueError(
                        f"covariate {c!r} of {who} has the level code "
                        f"{int(x[i])}, beyond the {levels[c]} levels of the data this model "
                        "is bound to: its effect was not estimated. Recode the covariate as "
                        "in those data.")
            else:
                if c in data.categories:
                    raise ValueError(f"covariate {c!r} is categorical in the data "
                                     f"({data.categories[c]}); use kind 'categorical'.")
                if c not in refs:
                    refs[c] = float(np.median(x))
                if "power" in kinds and np.any(x <= 0):
                    i = int(np.flatnonzero(x <= 0)[0])
                    who = (f"subject {_py(data.ids[i])!r}" if c not in tv else
                           "a record")
                    raise ValueError(f"covariate {c!r} is {x[i]:g} <= 0 for {who}: a power "
                                     "effect needs positive values (use 'linear').")
        o, d = data.obs, data.doses
        _check_float32(data, self.covariate_names)
        general = self.structural
        check = getattr(general, "check_doses", None)
        if check is not None:
            if _accepts(check, "locate"):
                check(d, locate=lambda idx, item: _dose_locate(data, idx, item))
            else:
                check(d)
        # a structural model that can trace only the dosing routes the data use (e.g.
        # CompartmentModel.for_doses) is specialised to those of these data
        special = getattr(general, "for_doses", None)
        structural = special(d) if special is not None else general
        obs_cmt = _check_obs_cmt(general, data)
        columns = {k: data.column(k) for k in ("dv", "lloq", "cens")}
        try:
            self.error.check_observations(o.dv, cens=o.cens, mask=o.mask, lloq=o.lloq)
        except ValueError:  # again, with the subjects and rows of the input table
            self.error.check_observations(o.dv, cens=o.cens, mask=o.mask, lloq=o.lloq,
                                          labels=data.labels("obs"), columns=columns)
            raise
        # doses at or before each sample's time, against those before it in record order
        at_or_before = np.sum(d.mask[:, None, :] & (d.time[:, None, :] <= o.time[:, :, None]),
                              -1)
        predose = bool(np.any(o.mask & (np.asarray(data.doses_before) < at_or_before)))
        rm = np.asarray(d.mask, bool)
        n_occ = occasion_indices(data, self.occasion)[2] if self.iov else 0
        pw = bool(tv) or n_occ > 0
        return Binding(references=tuple(sorted(refs.items())),
                       levels=tuple(sorted(levels.items())), structural=structural,
                       record_order=predose, obs_cmt=obs_cmt, time_varying=tv,
                       tv_infusions=pw and bool(np.any(rm & (np.asarray(d.rate) > 0))),
                       tv_steady_state=pw and bool(np.any(rm & np.asarray(d.ss, bool))),
                       occasions=n_occ,
                       censored=bool(np.any(np.asarray(o.cens, bool) & np.asarray(o.mask, bool))),
                       data=data)

    def arrays(self, data: PKDataset) -> dict[str, Any]:
        """The keyword arguments of :meth:`model` for ``data``: padded subject arrays, and
        ``binding``, a static (hashable) :class:`Binding` with what the model takes from
        ``data`` (covariate references and levels -- this model's own if it is bound --, the
        structural model specialised to the data's dosing routes, the record order). Pure:
        the model is not changed, and the same data give the same arguments whatever data
        the model met before.

        :raises TypeError: ``data`` not a :class:`~numpyro_fed.nlme.data.PKDataset`.
        :raises ValueError: data the model cannot take: a covariate missing or of the wrong
            kind; a dose the structural model refuses; an observation of a compartment the
            structural model lacks or does not predict; an observation the error model
            cannot evaluate; a finite value beyond the float range of JAX; no subject. The
            message names the subject, the row of the input table and its column.
        """
        b = self._bind(data)
        return self._arrays(data, b)

    def _arrays(self, data: PKDataset, b: Binding) -> dict[str, Any]:
        o, d = data.obs, data.doses
        out: dict[str, Any] = {
            "obs_time": o.time, "dv": o.dv, "obs_mask": o.mask, "cens": o.cens,
            "lloq": o.lloq, "dose_time": d.time, "dose_amt": d.amt, "dose_rate": d.rate,
            "dose_cmt": d.cmt, "dose_ss": d.ss, "dose_ii": d.ii, "dose_mask": d.mask,
            "doses_before": np.asarray(data.doses_before, np.int32),
        }
        if b.obs_cmt:  # only then: the arguments of data without it are unchanged
            out["obs_cmt"] = np.asarray(o.cmt, np.int32)
        if supports_superposition(b.structural):
            # the (sample, dose) pairs that can contribute (see nlme.superposition)
            # (padding samples, masked in the likelihood, are predicted 0)
            out["pairs"] = superposition_pairs(
                o.time, d, data.doses_before if b.record_order else None, o.mask)
        for c in self.covariate_names:
            if c in b.time_varying:  # the values in force at each observation and dose
                out[f"tvo_{c}"] = np.asarray(data.time_varying[c])
                out[f"tvd_{c}"] = np.asarray(data.dose_time_varying[c])
            else:
                out[f"cov_{c}"] = np.asarray(data.covariates[c])
        if b.occasions:
            out["occ_obs"], out["occ_dose"], _ = occasion_indices(data, self.occasion)
        out["binding"] = b
        return out

    def _default_binding(self, doses_before=None) -> Binding:
        """The binding of a call without one: this model's own (bound), else the general
        structural model and the references given (unbound)."""
        if self._binding is not None:
            return self._binding
        return Binding(references=tuple(sorted(self._references.items())),
                       levels=tuple(sorted(self._levels.items())), structural=self.structural,
                       record_order=doses_before is not None)

    # ------------------------------------------------------------------ params
    def _covariate_terms(self, name: str, covs: dict, b: Binding | None = None):
        """``[(param site name, design (n,))]`` of the covariate effects of ``name`` (those
        of time-constant covariates; with ``time_varying=True`` those of the time-varying
        ones of ``b``, each design of the shape of ``covs[c]``)."""
        return self._terms(name, covs, b, time_varying=False)

    def _terms(self, name: str, covs: dict, b: Binding | None, *, time_varying: bool):
        b = self._default_binding() if b is None else b
        refs, levels = dict(b.references), dict(b.levels)
        out = []
        for c, kind in self.params[name].covariates.items():
            if (c in b.time_varying) != time_varying:
                continue
            if (c not in levels) if kind == "categorical" else (c not in refs):
                what = "levels are" if kind == "categorical" else "reference is"
                raise ValueError(
                    f"covariate {c!r}: its {what} not known: call the model with its data's "
                    "arguments, "
                    "pk.model(**pk.arrays(data)), or bind it, pk.bind(data).")
            x = jnp.asarray(covs[c])
            if kind == "linear":
                out.append((f"beta_{name}_{c}", x - refs[c]))
            elif kind == "power":
                out.append((f"beta_{name}_{c}", jnp.log(x / refs[c])))
            else:
                for lev in range(1, levels[c]):
                    out.append((f"beta_{name}_{c}_{lev}", (x == lev).astype(jnp.result_type(
                        float))))
        return out

    def typical(self, name: str, covs: dict, theta: dict | None = None, *,
                binding: Binding | None = None):
        """Transformed typical value of ``name`` per subject (``theta``: estimates; default:
        declares the param sites; ``binding``: the covariate references and levels, by
        default this model's own)."""
        p = self.params[name]
        get = ((lambda n, v: numpyro.param(n, jnp.asarray(v, jnp.float32)))
               if theta is None else (lambda n, v: jnp.asarray(theta[n])))
        loc = get(f"mu_{name}", float(_INVERSE_NP[p.transform](float(p.value))))
        for site, x in self._covariate_terms(name, covs, binding):
            loc = loc + get(site, 0.0) * x
        return loc

    def time_varying_offset(self, name: str, tv: dict, theta: dict | None = None, *,
                            binding: Binding | None = None):
        """The part of the transformed parameter ``name`` due to time-varying covariates,
        ``sum_c beta_c x_c(t)``, at the records whose covariate values ``tv`` holds
        (``{covariate: (n, K)}``); 0 when ``name`` has none. ``theta``: estimates (default:
        declares the param sites)."""
        get = ((lambda n, v: numpyro.param(n, jnp.asarray(v, jnp.float32)))
               if theta is None else (lambda n, v: jnp.asarray(theta[n])))
        out = 0.0
        for site, x in self._terms(name, tv, binding, time_varying=True):
            out = out + get(site, 0.0) * x
        return out

    def record_parameters(self, phi: dict, tv_obs: dict, tv_dose: dict,
                          theta: dict | None = None, *, binding: Binding | None = None,
                          kappa: dict | None = None, occ_obs=None, occ_dose=None):
        """Natural-scale parameters in force at every observation and dose record:
        ``phi`` ``{name: (n,)}`` (transformed, time-varying covariates at their reference)
        plus :meth:`time_varying_offset`; ``tv_obs`` / ``tv_dose``: the time-varying
        covariates at the observations ``(n, T)`` and doses ``(n, D)``. With
        inter-occasion variability, ``kappa`` ``{name: (K,)}`` (the occasion effects) and
        ``occ_obs`` ``(n, T)`` / ``occ_dose`` ``(n, D)`` (the occasion of each record,
        ``arrays(data)``) add :math:`\\kappa` of the record's occasion.

        :return: ``({name: (n, T)}, {name: (n, D)})`` (a dimension of 1 where a parameter
            is the same at every record).
        """
        po, pd_ = {}, {}
        kappa = kappa or {}
        for nm, v in phi.items():
            v = jnp.asarray(v)[:, None]
            po[nm] = v + self.time_varying_offset(nm, tv_obs, theta, binding=binding)
            pd_[nm] = v + self.time_varying_offset(nm, tv_dose, theta, binding=binding)
            if nm in kappa:
                k = jnp.asarray(kappa[nm])
                po[nm] = po[nm] + k[jnp.asarray(occ_obs)]
                pd_[nm] = pd_[nm] + k[jnp.asarray(occ_dose)]
        return self.individual(po), self.individual(pd_)

    def individual(self, phi: dict):
        """Natural-scale individual parameters from their transformed values."""
        return {n: TRANSFORMS[self.params[n].transform][0](v) for n, v in phi.items()}

    def predict(self, indiv: dict, obs_time, doses: Doses, doses_before=None, *,
                binding: Binding | None = None, obs_cmt=None, at_records=None, pairs=None):
        """Structural predictions ``(n, T)`` for individual parameters ``{name: (n,)}``.

        With ``doses_before`` ``(n, T)`` (and data that need it, ``binding.record_order``):
        each sample sees only the doses recorded before it -- NONMEM's convention for a dose
        and a sample at the same time -- at the cost of one structural evaluation per
        sample. ``binding`` (``arrays(data)["binding"]``) gives the structural model
        specialised to the data's dosing routes; default: this model's own binding if it is
        bound, else the general structural model. ``obs_cmt`` ``(n, T)`` (``arrays(data)``
        has it when an observation names a compartment other than the observed one): each
        observation is predicted in the compartment it names (0: the observed one).

        With time-varying covariates (``binding.time_varying``) or occasions
        (``binding.occasions``), ``at_records`` (from :meth:`record_parameters`) gives the
        parameters in force at each observation and dose, and ``indiv`` is not used: the
        amounts are advanced from record to record
        (:func:`~numpyro_fed.nlme.timevarying.predict_piecewise`).

        A structural model linear in its doses (``superposition``, the closed forms) is
        evaluated only on the (sample, dose) pairs that can contribute
        (:mod:`~numpyro_fed.nlme.superposition`): ``pairs`` (``arrays(data)["pairs"]``), or
        computed here when the times and doses are concrete arrays (then the padding samples
        of the data of ``binding``, if these are its times, are predicted 0)."""
        b = self._default_binding(doses_before) if binding is None else binding
        if b.piecewise:
            if at_records is None:
                why = (f"the covariates {list(b.time_varying)} vary with time" if
                       b.time_varying else f"the parameters {list(self.iov)} vary between "
                       "occasions")
                raise ValueError(
                    f"{why}: pass at_records=pk.record_parameters(phi, tv_obs, tv_dose, ...) "
                    "(the parameters in force at each record).")
            po, pd_ = at_records
            nb = () if doses_before is None else (jnp.asarray(doses_before),)
            cm = () if obs_cmt is None else (jnp.asarray(obs_cmt),)

            def one(p_o, p_d, t, d, *rest):
                nbi = rest[0] if doses_before is not None else None
                ci = rest[-1] if obs_cmt is not None else None
                return predict_piecewise(b.structural, p_o, p_d, t, d, nbi, ci,
                                         infusions=b.tv_infusions,
                                         steady_state=b.tv_steady_state)

            return jax.vmap(one)(po, pd_, jnp.asarray(obs_time), doses, *nb, *cm)
        structural = b.structural
        record = doses_before is not None and b.record_order
        if supports_superposition(structural):
            if pairs is None and not any(
                    isinstance(x, jax.core.Tracer)
                    for x in jax.tree.leaves((obs_time, tuple(doses), doses_before))):
                # the samples of the bound data's padding (the same times) are not listed:
                # predicted 0 there (masked in every use), at a fraction of the cost
                mask = None
                if b.data is not None and np.shape(obs_time) == b.data.obs.time.shape and \
                        np.array_equal(np.asarray(obs_time), b.data.obs.time):
                    mask = b.data.obs.mask
                pairs = superposition_pairs(obs_time, doses, doses_before if record else None,
                                            mask)
            if pairs is not None:
                return predict_pairs(structural, indiv, obs_time, doses, pairs, obs_cmt)
        if obs_cmt is None:
            call = structural
        else:
            def call(p, t, d, c):
                return structural(p, t, d, cmt=c)
        cmts = () if obs_cmt is None else (jnp.asarray(obs_cmt),)
        if doses_before is None or not b.record_order:
            return jax.vmap(call)(indiv, obs_time, doses, *cmts)

        def subject(p, t, d, nb, *c):
            D = d.mask.shape[-1]

            def sample(tj, nj, *cj):
                dj = d._replace(mask=d.mask & (jnp.arange(D) < nj))
                return call(p, tj[None], dj, *(x[None] for x in cj))[0]

            return jax.vmap(sample)(t, nb, *c)

        return jax.vmap(subject)(indiv, obs_time, doses, doses_before, *cmts)

    # ------------------------------------------------------------------ model
    def model(self, obs_time, dv=None, obs_mask=None, cens=None, lloq=None, *, dose_time,
              dose_amt, dose_rate, dose_cmt, dose_ss, dose_ii, dose_mask, doses_before=None,
              obs_cmt=None, pairs=None, occ_obs=None, occ_dose=None,
              binding: Binding | None = None, **covs):
        """The NumPyro model (keyword arguments: :meth:`arrays`, ``binding`` included);
        ``dv=None`` simulates."""
        n, T = obs_time.shape
        if n == 0:
            raise ValueError("the data have no subject: a population model needs at least "
                             "one (obs_time has shape (0, ...)).")
        b = self._default_binding(doses_before) if binding is None else binding
        if self.iov and (not b.occasions or occ_obs is None or occ_dose is None):
            raise ValueError(
                f"iov={list(self.iov)}: the model needs the occasions of its data: call it "
                "with pk.model(**pk.arrays(data)) (occ_obs, occ_dose and a binding with the "
                "number of occasions).")
        tv_o = {k[4:]: v for k, v in covs.items() if k.startswith("tvo_")}
        tv_d = {k[4:]: v for k, v in covs.items() if k.startswith("tvd_")}
        covs = {k[4:]: v for k, v in covs.items() if k.startswith("cov_")}
        doses = Doses(dose_time, dose_amt, dose_rate, dose_cmt, dose_ss, dose_ii, dose_mask)
        if obs_mask is None:
            obs_mask = jnp.ones((n, T), bool)
        errp = self.error.params()
        phi, kappa = {}, {}
        if self.iov:
            # occasions nested in subjects: kappa_P[k] of occasion k (one plate over all the
            # (subject, occasion) pairs, outside the subject plate)
            with numpyro.plate("occasion", b.occasions, dim=-1):
                for nm, sd in self.iov.items():
                    g = numpyro.param(f"omega_iov_{nm}", jnp.asarray(sd, jnp.float32),
                                      constraint=constraints.positive)
                    kappa[nm] = numpyro.sample(f"kappa_{nm}", dist.Normal(0.0, g))
        with numpyro.plate("subject", n, dim=-1):
            locs = {nm: jnp.broadcast_to(self.typical(nm, covs, binding=b), (n,))
                    for nm in self.names}
            if self.omega == "diag":
                for nm in self.random_names:
                    om = numpyro.param(f"omega_{nm}", jnp.asarray(self.params[nm].omega,
                                                                  jnp.float32),
                                       constraint=constraints.positive)
                    phi[nm] = numpyro.sample(f"phi_{nm}", dist.Normal(locs[nm], om))
            else:
                q = len(self.random_names)
                L0 = jnp.diag(jnp.asarray([self.params[m].omega for m in self.random_names],
                                          jnp.float32))
                L = numpyro.param("L_omega", L0, constraint=constraints.lower_cholesky)
                loc = jnp.stack([locs[m] for m in self.random_names], -1)
                v = numpyro.sample("phi", dist.MultivariateNormal(loc, scale_tril=L))
                for k in range(q):
                    phi[self.random_names[k]] = v[..., k]
            for nm in self.names:
                if nm not in phi:
                    phi[nm] = locs[nm]
            at = (self.record_parameters(phi, tv_o, tv_d, binding=b, kappa=kappa,
                                         occ_obs=occ_obs, occ_dose=occ_dose)
                  if b.piecewise else None)
            f = self.predict(self.individual(phi), obs_time, doses, doses_before, binding=b,
                             obs_cmt=obs_cmt, at_records=at, pairs=pairs)
            if not b.censored and cens is not None:
                c, m = _concrete(cens), _concrete(obs_mask)
                if c is not None and np.any(c.astype(bool) & (True if m is None
                                                              else m.astype(bool))):
                    raise ValueError(
                        "PKModel.model: `cens` marks observations below the LLOQ but the "
                        "binding is of data without any: call pk.model(**pk.arrays(data)) with "
                        "the arrays and binding of the same data.")
                cens = lloq = None  # no censored observation: the plain density
            # padded observation slots (subjects with fewer samples than the longest) are
            # masked out of the density below; their prediction (0 at a padded time of 0) is
            # replaced by 1, inside every error model's domain: a proportional error has
            # g(0) = 0 and an exponential one needs f > 0, which must be refused at a real
            # observation only, and a masked term must not give NaN gradients
            f = jnp.where(obs_mask, f, jnp.ones((), f.dtype))
            try:
                d = self.error.dist(f, errp, cens=cens, lloq=lloq)
            except ValueError:
                if b.data is None or b.data.obs.time.shape != (n, T):
                    raise
                # again, naming the subjects and rows of the input table
                self.error.dist(f, errp, cens=cens, lloq=lloq, labels=b.data.labels("obs"))
                raise
            if dv is not None:
                # padded entries: a value inside every support (masked out below; keeps the
                # gradients of the masked terms finite)
                dv = jnp.where(obs_mask, dv, jnp.where(jnp.isfinite(f) & (f > 0), f, 1.0))
            numpyro.sample("dv", d.mask(obs_mask).to_event(1), obs=dv)

    # ------------------------------------------------------------------ fit
    def fit(self, data: PKDataset, rng_key: jax.Array, **saem_kwargs):
        """Fit by :class:`~numpyro_fed.saem.SAEM` (its defaults unless given) and return an
        :class:`~numpyro_fed.nlme.diagnostics.NLMEFit`.

        :param saem_kwargs: passed to :class:`~numpyro_fed.saem.SAEM`; ``init_params``,
            ``progress_bar`` go to :meth:`~numpyro_fed.saem.SAEM.run`.
        """
        run_kw = {k: saem_kwargs.pop(k) for k in ("init_params", "progress_bar")
                  if k in saem_kwargs}
        b = self._bind(data)
        # this model's own ``model`` with the binding as a static argument: fits of this
        # object on data with the same binding share SAEM's compiled programs; the fit
        # holds a bound copy (this model is unchanged)
        saem = SAEM(self.model, **saem_kwargs)
        res = saem.run(rng_key, **self._arrays(data, b), **run_kw)
        return NLMEFit(self._bound(b), data, res)
