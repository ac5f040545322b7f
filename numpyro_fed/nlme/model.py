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
is fitted the same way.

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

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
from numpyro.distributions import constraints

from numpyro_fed.nlme.data import Doses, PKDataset
from numpyro_fed.nlme.diagnostics import NLMEFit
from numpyro_fed.nlme.error import ErrorModel
from numpyro_fed.nlme.transforms import TRANSFORMS
from numpyro_fed.saem import SAEM

__all__ = ["Param", "PKModel", "TRANSFORMS", "COVARIATE_KINDS"]

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
        reference (:attr:`PKModel.references`: the median over subjects of the data of the
        first fit unless given).
    """

    value: float
    random: bool = True
    omega: float = 0.3
    transform: str = "log"
    covariates: dict = field(default_factory=dict)


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
    :param references: reference values of continuous covariates (default: medians of the
        data of the first :meth:`arrays` call).
    """

    def __init__(self, structural: Callable, params: Mapping[str, Any],
                 error: ErrorModel | str = "additive", *, omega: str = "diag",
                 references: Mapping[str, float] | None = None) -> None:
        if not callable(structural):
            raise TypeError("structural must be a structural model function (e.g. "
                            "nlme.one_compartment()).")
        required = tuple(getattr(structural, "param_names", ()))
        optional = dict(getattr(structural, "optional_params", {}) or {})
        if not isinstance(params, Mapping) or not params:
            raise ValueError("params must be a non-empty dict {name: Param(...)}.")
        self.params = {n: _as_param(n, p) for n, p in params.items()}
        missing = [n for n in required if n not in self.params]
        if missing:
            raise ValueError(f"params lacks {missing}, required by the structural model "
                             f"(it needs {list(required)}; optional: {sorted(optional)}).")
        if required or optional:
            unknown = [n for n in self.params if n not in required and n not in optional]
            if unknown:
                raise ValueError(f"params has {unknown}, unknown to the structural model "
                                 f"(required {list(required)}, optional {sorted(optional)}).")
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
        self.references: dict[str, float] = dict(references or {})
        self.levels: dict[str, int] = {}
        self._bound = False
        self._bound_doses = False
        self._specialised = False
        #: whether the data have samples taken before a dose given at the same time (a
        #: trough recorded before the dose): predictions then follow the record order
        self.record_order: bool | None = None

    # ------------------------------------------------------------------ data
    @property
    def covariate_names(self) -> list[str]:
        out: list[str] = []
        for p in self.params.values():
            out += [c for c in p.covariates if c not in out]
        return out

    def _bind(self, data: PKDataset) -> None:
        """Fix the covariate references and levels from the first dataset."""
        for c in self.covariate_names:
            if c in data.time_varying and c not in data.covariates:
                raise ValueError(
                    f"covariate {c!r} varies with time within subjects; the analytic models "
                    "take constant individual parameters. Use a time-constant summary (e.g. "
                    "the baseline value) as a new column, or write the model by hand.")
            if c not in data.covariates:
                raise ValueError(f"covariate {c!r} is not in the data (covariates: "
                                 f"{sorted(data.covariates)}).")
            kinds = {p.covariates[c] for p in self.params.values() if c in p.covariates}
            x = np.asarray(data.covariates[c], np.float64)
            if "categorical" in kinds:
                if len(kinds) > 1:
                    raise ValueError(f"covariate {c!r} is categorical for one parameter and "
                                     "continuous for another: use one kind.")
                if c not in self.levels:
                    cats = data.categories.get(c)
                    self.levels[c] = len(cats) if cats is not None else int(x.max()) + 1
            else:
                if c in data.categories:
                    raise ValueError(f"covariate {c!r} is categorical in the data "
                                     f"({data.categories[c]}); use kind 'categorical'.")
                if c not in self.references:
                    self.references[c] = float(np.median(x))
                if "power" in kinds and np.any(x <= 0):
                    raise ValueError(f"covariate {c!r} has values <= 0: a power effect "
                                     "needs positive values (use 'linear').")
        self._bound = True

    def arrays(self, data: PKDataset) -> dict[str, np.ndarray]:
        """The keyword arguments of :meth:`model` for ``data`` (padded subject arrays)."""
        if not isinstance(data, PKDataset):
            raise TypeError(f"data must be a nlme.PKDataset, got {type(data).__name__}.")
        if not self._bound:
            self._bind(data)
        o, d = data.obs, data.doses
        if not self._bound_doses:
            # a structural model that can trace only the dosing routes the data use (e.g.
            # CompartmentModel.for_doses) is specialised once, for the first data
            special = getattr(self.structural, "for_doses", None)
            if special is not None:
                self.structural = special(d)
                self._specialised = True
            self._bound_doses = True
        check = getattr(self.structural, "check_doses", None)
        if check is not None:
            try:
                check(d)
            except ValueError as e:
                if not self._specialised:
                    raise
                raise ValueError(
                    f"{e} (If these data use dosing routes that the data this PKModel was first "
                    "used with did not, build a new PKModel: its structural model was "
                    "specialised to those routes.)") from e
        self.error.check_observations(o.dv, cens=o.cens, mask=o.mask, lloq=o.lloq)
        # doses at or before each sample's time, against those before it in record order
        at_or_before = np.sum(d.mask[:, None, :] & (d.time[:, None, :] <= o.time[:, :, None]),
                              -1)
        predose = bool(np.any(o.mask & (np.asarray(data.doses_before) < at_or_before)))
        if self.record_order is None:
            self.record_order = predose
        elif predose and not self.record_order:
            raise ValueError(
                "these data have samples recorded before a dose given at the same time (a "
                "trough), unlike the data this PKModel was first used with: build a new "
                "PKModel for them (its predictions then follow the record order).")
        out = {
            "obs_time": o.time, "dv": o.dv, "obs_mask": o.mask, "cens": o.cens,
            "lloq": o.lloq, "dose_time": d.time, "dose_amt": d.amt, "dose_rate": d.rate,
            "dose_cmt": d.cmt, "dose_ss": d.ss, "dose_ii": d.ii, "dose_mask": d.mask,
            "doses_before": np.asarray(data.doses_before, np.int32),
        }
        for c in self.covariate_names:
            out[f"cov_{c}"] = np.asarray(data.covariates[c])
        return out

    # ------------------------------------------------------------------ params
    def _covariate_terms(self, name: str, covs: dict):
        """``[(param site name, init, design (n,))]`` of the covariate effects of ``name``."""
        out = []
        for c, kind in self.params[name].covariates.items():
            x = jnp.asarray(covs[c])
            if kind == "linear":
                out.append((f"beta_{name}_{c}", x - self.references[c]))
            elif kind == "power":
                out.append((f"beta_{name}_{c}", jnp.log(x / self.references[c])))
            else:
                for lev in range(1, self.levels[c]):
                    out.append((f"beta_{name}_{c}_{lev}", (x == lev).astype(jnp.result_type(
                        float))))
        return out

    def typical(self, name: str, covs: dict, theta: dict | None = None):
        """Transformed typical value of ``name`` per subject (``theta``: estimates; default:
        declares the param sites)."""
        p = self.params[name]
        get = ((lambda n, v: numpyro.param(n, jnp.asarray(v, jnp.float32)))
               if theta is None else (lambda n, v: jnp.asarray(theta[n])))
        loc = get(f"mu_{name}", float(_INVERSE_NP[p.transform](float(p.value))))
        for site, x in self._covariate_terms(name, covs):
            loc = loc + get(site, 0.0) * x
        return loc

    def individual(self, phi: dict):
        """Natural-scale individual parameters from their transformed values."""
        return {n: TRANSFORMS[self.params[n].transform][0](v) for n, v in phi.items()}

    def predict(self, indiv: dict, obs_time, doses: Doses, doses_before=None):
        """Structural predictions ``(n, T)`` for individual parameters ``{name: (n,)}``.

        With ``doses_before`` ``(n, T)`` (and data that need it, :attr:`record_order`):
        each sample sees only the doses recorded before it -- NONMEM's convention for a dose
        and a sample at the same time -- at the cost of one structural evaluation per
        sample."""
        if doses_before is None or not self.record_order:
            return jax.vmap(self.structural)(indiv, obs_time, doses)

        def subject(p, t, d, nb):
            D = d.mask.shape[-1]

            def sample(tj, nj):
                dj = d._replace(mask=d.mask & (jnp.arange(D) < nj))
                return self.structural(p, tj[None], dj)[0]

            return jax.vmap(sample)(t, nb)

        return jax.vmap(subject)(indiv, obs_time, doses, doses_before)

    # ------------------------------------------------------------------ model
    def model(self, obs_time, dv=None, obs_mask=None, cens=None, lloq=None, *, dose_time,
              dose_amt, dose_rate, dose_cmt, dose_ss, dose_ii, dose_mask, doses_before=None,
              **covs):
        """The NumPyro model (keyword arguments: :meth:`arrays`); ``dv=None`` simulates."""
        n, T = obs_time.shape
        covs = {k[4:]: v for k, v in covs.items() if k.startswith("cov_")}
        doses = Doses(dose_time, dose_amt, dose_rate, dose_cmt, dose_ss, dose_ii, dose_mask)
        if obs_mask is None:
            obs_mask = jnp.ones((n, T), bool)
        errp = self.error.params()
        phi = {}
        with numpyro.plate("subject", n, dim=-1):
            locs = {nm: jnp.broadcast_to(self.typical(nm, covs), (n,)) for nm in self.names}
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
            f = self.predict(self.individual(phi), obs_time, doses, doses_before)
            d = self.error.dist(f, errp, cens=cens, lloq=lloq)
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
        arrays = self.arrays(data)
        saem = SAEM(self.model, **saem_kwargs)
        res = saem.run(rng_key, **arrays, **run_kw)
        return NLMEFit(self, data, res)
