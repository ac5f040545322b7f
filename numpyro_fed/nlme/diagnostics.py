"""After the fit: parameter table, individual estimates, shrinkage, PRED / IPRED / IWRES,
NPDE, simulation of new subjects and regimens, goodness-of-fit plots and a visual predictive
check.

Definitions (Nguyen et al. 2017, "Model evaluation of continuous data pharmacometric models:
metrics and graphics", CPT:PSP 6:87--109):

- **PRED**: the structural prediction at the typical parameters (random effects 0);
- **IPRED**: at the individual conditional modes (empirical Bayes estimates, EBE);
- **IWRES**: :math:`(y - IPRED) / g(IPRED)`, :math:`g` the residual standard deviation
  (on the log scale for the exponential error model);
- **eta-shrinkage**: :math:`1 - \\mathrm{sd}(\\hat\\eta)/\\omega` over subjects, with
  :math:`\\hat\\eta` the EBE (Savic & Karlsson 2009);
- **NPDE**: normalised prediction distribution errors (Brendel et al. 2006; Comets et al.
  2008) from ``num_sims`` simulations of the fitted model at the observed design: the
  observations and simulations of each subject are decorrelated by the simulated mean and
  covariance, the percentile of each decorrelated observation among its simulations is
  mapped by :math:`\\Phi^{-1}`; under the model they are i.i.d. N(0, 1);
- **VPC**: percentiles of the observations per time bin against the prediction interval of
  the same percentiles over simulated replicates (prediction-corrected on request, Bergstrand
  et al. 2011).

- **CWRES**: conditional weighted residuals (Hooker, Staatz & Karlsson 2007, "Conditional
  weighted residuals (CWRES): a model diagnostic for the FOCE method", Pharm. Res.
  24:2187--2197), FOCE with interaction: the model is linearised in the random effects at the
  EBE :math:`\\hat\\eta_i`, :math:`E_i = f(\\hat\\eta_i) - J_i\\hat\\eta_i`,
  :math:`C_i = J_i\\Omega J_i^T + \\mathrm{diag}\\,g(f(\\hat\\eta_i))^2`, and
  :math:`\\mathrm{CWRES}_i = C_i^{-1/2}(y_i - E_i)` (symmetric square root; the exponential
  error model on the log scale). Being a linearisation, CWRES can depart from N(0, 1) for a
  correct but strongly nonlinear model; NPDE has no such approximation (Comets et al. 2008).
"""

from __future__ import annotations

import math
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax import random

from numpyro_fed._programs import Program
from numpyro_fed._validation import check_int
from numpyro_fed.nlme.data import Doses, PKDataset
from numpyro_fed.nlme.transforms import TRANSFORMS

__all__ = ["NLMEFit", "lowess", "time_after_dose"]


def _doses(a: dict) -> Doses:
    return Doses(*(jnp.asarray(a[k]) for k in ("dose_time", "dose_amt", "dose_rate",
                                                "dose_cmt", "dose_ss", "dose_ii",
                                                "dose_mask")))


class NLMEFit:
    """The result of :meth:`~numpyro_fed.nlme.model.PKModel.fit`: the SAEM result with the
    model and the data, and the diagnostics computed from them.

    :ivar pk: the :class:`~numpyro_fed.nlme.model.PKModel` bound to the fitted data
        (:meth:`~numpyro_fed.nlme.model.PKModel.bind`: the covariate references and levels
        the estimates refer to, kept by :meth:`simulate` on other data).
    :ivar result: the :class:`~numpyro_fed.saem.SAEMResult`.
    :ivar params: the constrained estimates (``{site: value}``).
    """

    def __init__(self, pk, data: PKDataset, result) -> None:
        self.pk, self.data, self.result = pk, data, result
        self.params = result.params
        self._arrays = pk.arrays(data)
        self._modes = None

    # ------------------------------------------------------------------ tables
    def omega(self) -> np.ndarray:
        """The estimated covariance of the random effects (order: ``pk.random_names``)."""
        pk, p = self.pk, self.params
        if pk.omega == "full":
            L = np.asarray(p["L_omega"], np.float64)
            return L @ L.T
        return np.diag([float(p[f"omega_{n}"]) ** 2 for n in pk.random_names])

    def parameter_table(self, standard_errors: bool = True, scale: str = "variance"):
        """Estimates with standard errors, RSE % and, for the random effects of
        log-normal parameters, the CV % :math:`100\\sqrt{e^{\\omega^2} - 1}`.

        :param scale: ``"variance"`` (default, as saemix and Monolix report them): the
            random-effect variances :math:`\\omega^2` (rows ``omega_CL^2``; with a full
            covariance, its entries ``cov(L_omega)[i,j]``) with SE and RSE by the delta
            method, the residual error parameters as written; ``"sd"``: the standard
            deviations as the model writes them (rows ``omega_CL``). See
            :meth:`SAEMResult.parameter_table <numpyro_fed.saem.SAEMResult.parameter_table>`.
        :return: a pandas DataFrame indexed by parameter name.
        """
        res, pk = self.result, self.pk
        est = res.estimates()
        df = res.parameter_table(scale=scale, standard_errors=standard_errors)
        # the residual error parameters as written whatever the M-step (with uncensored data
        # an additive error's sd is the closed-form Gaussian residual scale, which SAEMResult
        # reports as a variance): the same rows with and without censored observations
        err = [k for k in pk.error.param_names if f"{k}^2" in df.index]
        if err:
            sd = res.parameter_table(scale="sd", standard_errors=standard_errors)
            df = df.rename(index={f"{k}^2": k for k in err})
            df.loc[err] = sd.loc[err, df.columns].to_numpy()
        df = df[["estimate", "se", "rse_%"]].copy()
        df["cv_%"] = np.nan
        Om = self.omega()
        for i, n in enumerate(pk.random_names):
            key = f"omega_{n}"
            sd = math.sqrt(Om[i, i])
            cv = (100 * math.sqrt(math.expm1(sd**2)) if pk.params[n].transform == "log"
                  else np.nan)
            for k in (key, f"{key}^2"):
                if k in df.index:
                    df.loc[k, "cv_%"] = cv
            if key not in est:  # full covariance: a derived row
                df.loc[f"sd_{n}"] = {"estimate": sd, "se": np.nan, "rse_%": np.nan,
                                     "cv_%": cv}
        for n in pk.iov:  # inter-occasion variability: CV % of a log-normal parameter
            key = f"omega_iov_{n}"
            for k in (key, f"{key}^2"):  # the sd or the variance row (``scale``)
                if k in df.index and pk.params[n].transform == "log":
                    df.loc[k, "cv_%"] = 100 * math.sqrt(math.expm1(float(est[key]) ** 2))
        for n in pk.names:  # typical values on the natural scale
            f = TRANSFORMS[pk.params[n].transform][0]
            df.loc[f"typical_{n}"] = {"estimate": float(f(est[f"mu_{n}"])), "se": np.nan,
                                      "rse_%": np.nan, "cv_%": np.nan}
        # the fit's convergence verdict travels with its table (the standard errors of a fit
        # that has not converged also warn ConvergenceWarning)
        msgs = list(res.convergence_messages)
        df.attrs["converged"] = not msgs
        df.attrs["convergence_messages"] = msgs
        return df

    # ------------------------------------------------------------------ subjects
    def subject_positions(self, subjects=None, positions=None) -> np.ndarray | None:
        """Array positions of the subjects a table or plot is restricted to.

        :param subjects: subject IDs as they appear in the dataset's ID column
            (``fit.data.ids``), one or a sequence; every function of this class that takes
            ``subjects=`` takes IDs, never array positions.
        :param positions: 0-based positions in ``fit.data.ids`` instead (not with
            ``subjects``).
        :return: the positions, in the order given (``None``: neither given, all subjects).
        :raises ValueError: an ID not in the data (all such IDs are named), an ID or a
            position given twice, both arguments, or an empty selection.
        :raises IndexError: a position out of range.
        """
        if subjects is not None and positions is not None:
            raise ValueError("give subjects= (IDs) or positions= (array positions), not both.")
        ids = [v.item() if isinstance(v, np.generic) else v for v in self.data.ids]
        n = len(ids)
        if subjects is not None:
            sel = ([subjects] if isinstance(subjects, str | bytes) or np.ndim(subjects) == 0
                   else list(subjects))
            sel = [v.item() if isinstance(v, np.generic) else v for v in sel]
            where = {v: i for i, v in enumerate(ids)}
            unknown = [v for v in sel if v not in where]
            if unknown:
                shown = ", ".join(repr(v) for v in ids[:8]) + (", ..." if n > 8 else "")
                raise ValueError(
                    f"subjects={unknown!r}: no subject with ID(s) {unknown!r} in the data "
                    f"(subjects= takes IDs of the ID column, e.g. {shown}; array positions "
                    "go to positions=).")
            pos = np.asarray([where[v] for v in sel], np.int64)
        elif positions is not None:
            pos = np.atleast_1d(np.asarray(positions))
            if pos.dtype.kind not in "iu" or pos.ndim != 1:
                raise ValueError(f"positions must be integer positions, got {positions!r}.")
            bad = pos[(pos < 0) | (pos >= n)]
            if bad.size:
                raise IndexError(f"positions {bad.tolist()} out of range for {n} subjects "
                                 f"(valid: 0..{n - 1}).")
            pos = pos.astype(np.int64)
        else:
            return None
        if pos.size == 0:
            raise ValueError("the selection holds no subject.")
        if len(np.unique(pos)) != len(pos):
            dup = [ids[i] for i in pos if np.sum(pos == i) > 1]
            raise ValueError(f"subject(s) {sorted(set(dup), key=str)!r} selected twice.")
        return pos

    def _rows_of(self, df, subjects, positions):
        """``df`` (one row per observation or subject, an ``ID`` column or index) restricted
        to the selected subjects, in the order given."""
        pos = self.subject_positions(subjects, positions)
        if pos is None:
            return df
        import pandas as pd

        want = [self.data.ids[i] for i in pos]
        key = df.index if "ID" not in df.columns else df["ID"]
        parts = [df[np.asarray(key == w)] for w in want]
        return pd.concat(parts) if parts else df.iloc[:0]

    # ------------------------------------------------------------------ individual
    def _phi_sites(self, zc: dict) -> dict:
        pk = self.pk
        if pk.omega == "full":
            v = zc["phi"]
            return {n: v[..., k] for k, n in enumerate(pk.random_names)}
        return {n: zc[f"phi_{n}"] for n in pk.random_names}

    def conditional_modes(self) -> dict[str, np.ndarray]:
        """Empirical Bayes estimates: per-subject conditional modes of the transformed
        individual parameters ``{name: (n,)}`` (random ones only), by damped Newton from the
        conditional means (:meth:`numpyro_fed.saem.SAEMResult.conditional_modes`)."""
        if self._modes is None:
            zc = self.result.conditional_modes()
            self._modes = {n: np.asarray(v) for n, v in self._phi_sites(zc).items()}
            self._kappa_modes = {n: np.asarray(zc[f"kappa_{n}"]) for n in self.pk.iov}
        return self._modes

    def occasion_effects(self, kind: str = "mode") -> dict[str, np.ndarray]:
        """With inter-occasion variability (``PKModel(iov=...)``): the occasion effects
        :math:`\\kappa` ``{name: (K,)}`` (transformed scale; occasion ``k`` as numbered by
        :func:`~numpyro_fed.nlme.model.occasion_indices`, ``arrays["occ_obs"]``) at the
        conditional modes (``"mode"``, jointly with the subjects' modes), the conditional
        means (``"mean"``) or 0 (``"typical"``); ``{}`` without IOV."""
        if not self.pk.iov:
            return {}
        if kind == "mode":
            self.conditional_modes()
            return dict(self._kappa_modes)
        if kind == "mean":
            z = self.result.latent_samples()
            return {n: np.asarray(z[f"kappa_{n}"]).mean(axis=(0, 1)) for n in self.pk.iov}
        if kind == "typical":
            K = self._arrays["binding"].occasions
            return {n: np.zeros(K, np.float32) for n in self.pk.iov}
        raise ValueError(f"kind={kind!r}: use 'mode', 'mean' or 'typical'.")

    def _typical(self, arrays: dict) -> dict:
        pk = self.pk
        covs = {k[4:]: v for k, v in arrays.items() if k.startswith("cov_")}
        n = arrays["obs_time"].shape[0]
        th = {k: np.asarray(v) for k, v in self.params.items()}
        b = arrays.get("binding")
        return {nm: jnp.broadcast_to(pk.typical(nm, covs, th, binding=b), (n,))
                for nm in pk.names}

    def individual_parameters(self, kind: str = "mode") -> dict[str, np.ndarray]:
        """Natural-scale individual parameters ``{name: (n,)}`` at the conditional modes
        (``kind="mode"``), the conditional means of the transformed parameters
        (``"mean"``) or the typical values (``"typical"``, random effects 0). With
        time-varying covariates: at their references (the values in force at each record
        add ``pk.time_varying_offset``)."""
        return {k: np.asarray(v) for k, v in self.pk.individual(self._phi(kind)).items()}

    def _phi(self, kind: str) -> dict:
        """Transformed individual parameters ``{name: (n,)}`` of ``kind`` (see
        :meth:`individual_parameters`)."""
        phi = dict(self._typical(self._arrays))
        if kind == "mode":
            phi.update({k: jnp.asarray(v) for k, v in self.conditional_modes().items()})
        elif kind == "mean":
            draws = self._phi_sites(self.result.latent_samples())
            phi.update({k: jnp.asarray(v.mean(axis=(0, 1))) for k, v in draws.items()})
        elif kind != "typical":
            raise ValueError(f"kind={kind!r}: use 'mode', 'mean' or 'typical'.")
        return phi

    def individual_estimates(self, subjects=None, *, positions=None):
        """Per subject and parameter: the conditional mode (EBE), the conditional mean and
        standard deviation (from the SAEM draws at the final estimate), natural scale, and
        the random effect :math:`\\hat\\eta` at the mode: columns ``P_mode``, ``P_mean``,
        ``P_sd``, ``eta_P`` for each parameter ``P`` with a random effect. A parameter without
        one has no conditional distribution, hence no column (its value for each subject, the
        population value with the subject's covariates, is
        ``individual_parameters("typical")``). With time-varying covariates the values are at
        the covariates' references.

        :param subjects: subject IDs to keep (default: all; see :meth:`subject_positions`).
        :param positions: array positions instead of IDs.
        :return: a pandas DataFrame indexed by subject ID.
        """
        import pandas as pd

        pk = self.pk
        mode = self.individual_parameters("mode")
        typ = self._typical(self._arrays)
        modes = self.conditional_modes()
        draws = self._phi_sites(self.result.latent_samples())
        out: dict[str, np.ndarray] = {}
        for n in pk.names:
            if n in draws:  # a parameter with a random effect (no mode without one)
                out[f"{n}_mode"] = mode[n]
                fwd = TRANSFORMS[pk.params[n].transform][0]
                nat = np.asarray(fwd(jnp.asarray(draws[n])))
                out[f"{n}_mean"] = nat.mean(axis=(0, 1))
                out[f"{n}_sd"] = nat.std(axis=(0, 1))
                out[f"eta_{n}"] = modes[n] - np.asarray(typ[n])
        df = pd.DataFrame(out, index=pd.Index(self.data.ids, name="ID"))
        return self._rows_of(df, subjects, positions)

    def shrinkage(self) -> dict[str, float]:
        """eta-shrinkage (%) of each random effect: :math:`100(1 - \\mathrm{sd}(\\hat\\eta)
        /\\omega)` with :math:`\\hat\\eta` the EBEs."""
        typ = self._typical(self._arrays)
        Om = self.omega()
        modes = self.conditional_modes()
        return {n: float(100 * (1 - np.std(modes[n] - np.asarray(typ[n]))
                                / math.sqrt(Om[i, i])))
                for i, n in enumerate(self.pk.random_names)}

    # ------------------------------------------------------------------ predictions
    def _error_params(self):
        return {k: jnp.asarray(self.params[k]) for k in self.pk.error.param_names}

    def _at_records(self, phi: dict, arrays: dict, times=None, kappa=None):
        """With time-varying covariates or occasions: the parameters in force at each
        observation (or each of ``times``, the covariates and occasions carried forward
        from the records) and dose; ``kappa``: the occasion effects ``{name: (K,)}`` of the
        occasions of ``arrays`` (default 0)."""
        b = arrays.get("binding")
        if b is None or not b.piecewise:
            return None
        tv_o = {c: arrays[f"tvo_{c}"] for c in b.time_varying}
        tv_d = {c: arrays[f"tvd_{c}"] for c in b.time_varying}
        occ = {}
        if b.occasions:
            occ = {"occ_obs": arrays["occ_obs"], "occ_dose": arrays["occ_dose"]}
            if kappa is None:
                kappa = {n: jnp.zeros(b.occasions) for n in self.pk.iov}
        if times is not None:
            both = _carry_forward(arrays, {**tv_o, "@occ": occ.get("occ_obs", np.zeros(
                np.shape(arrays["obs_time"]), np.int32))}, {**tv_d, "@occ": occ.get(
                "occ_dose", np.zeros(np.shape(arrays["dose_time"]), np.int32))},
                np.asarray(times))
            if occ:
                occ["occ_obs"] = both["@occ"]
            tv_o = {c: both[c] for c in tv_o}
        th = {k: np.asarray(v) for k, v in self.params.items()}
        return self.pk.record_parameters(
            {k: jnp.asarray(v) for k, v in phi.items()},
            {k: jnp.asarray(v) for k, v in tv_o.items()},
            {k: jnp.asarray(v) for k, v in tv_d.items()}, th, binding=b,
            kappa=None if not occ else {k: jnp.asarray(v) for k, v in kappa.items()},
            **{k: jnp.asarray(v) for k, v in occ.items()})

    def _predict(self, indiv: dict, arrays: dict, times=None):
        """Predictions from natural-scale parameters ``indiv`` ``{name: (n,)}`` (see
        :meth:`_predict_phi`)."""
        b = arrays.get("binding")
        if b is None or not b.piecewise:  # as given, no round trip through phi
            return np.asarray(self.pk.predict(
                {k: jnp.asarray(v) for k, v in indiv.items()},
                jnp.asarray(arrays["obs_time"] if times is None else times), _doses(arrays),
                arrays["doses_before"] if times is None else None, binding=b,
                obs_cmt=arrays.get("obs_cmt") if times is None else None))
        inv = {k: TRANSFORMS[self.pk.params[k].transform][1] for k in indiv}
        return self._predict_phi({k: inv[k](jnp.asarray(v)) for k, v in indiv.items()},
                                 arrays, times)

    def _predict_phi(self, phi: dict, arrays: dict, times=None, kappa=None):
        """Predictions from transformed parameters ``phi`` ``{name: (n,)}`` at the
        observations, or at ``times`` ``(n, G)`` (a grid: the observed compartment);
        ``kappa``: occasion effects (:meth:`occasion_effects`; default 0)."""
        t = np.asarray(arrays["obs_time"] if times is None else times)
        nb = arrays["doses_before"] if times is None else None
        cmt = arrays.get("obs_cmt") if times is None else None  # a grid: the observed one

        def predict(phi, kappa):
            at = self._at_records(phi, arrays, times, kappa)
            return self.pk.predict(self.pk.individual(phi), jnp.asarray(t), _doses(arrays),
                                   nb, binding=arrays.get("binding"), obs_cmt=cmt,
                                   at_records=at)

        return np.asarray(_run(predict, {k: jnp.asarray(v) for k, v in phi.items()},
                               None if kappa is None else
                               {k: jnp.asarray(v) for k, v in kappa.items()}))

    def cwres(self) -> np.ndarray:
        """Conditional weighted residuals ``(n, T)`` (FOCE-I linearisation at the EBEs, see
        the module docstring); NaN at padding and censored observations."""
        pk, a = self.pk, self._arrays
        typ = self._typical(a)
        modes = self.conditional_modes()
        rn = pk.random_names
        eta = jnp.stack([jnp.asarray(modes[n]) - typ[n] for n in rn], -1)  # (n, q)
        log_scale = pk.error.kind == "exponential"
        kap = self.occasion_effects("mode") or None  # IOV: at the modes (not linearised)

        def h(e):
            phi = dict(typ)
            phi.update({n: typ[n] + e[:, k] for k, n in enumerate(rn)})
            f = pk.predict(pk.individual(phi), jnp.asarray(a["obs_time"]), _doses(a),
                           a["doses_before"], binding=a.get("binding"),
                           obs_cmt=a.get("obs_cmt"),
                           at_records=self._at_records(phi, a, kappa=kap))
            return jnp.log(f) if log_scale else f

        def lin(e):  # subject i's output depends on eta_i only: one jvp per random effect
            f = h(e)
            cols = [jax.jvp(h, (e,), (jnp.zeros_like(e).at[:, k].set(1.0),))[1]
                    for k in range(len(rn))]
            g = pk.error.scale(jnp.exp(f) if log_scale else f, self._error_params())
            return f, jnp.stack(cols, -1), g

        f, J, g = (np.asarray(x, np.float64) for x in _run(lin, eta))
        eta = np.asarray(eta, np.float64)
        y = np.asarray(a["dv"], np.float64)
        ok = np.asarray(a["obs_mask"], bool) & ~np.asarray(a["cens"], bool)
        if log_scale:
            y = np.log(np.where(ok, y, 1.0))
        Om = self.omega()
        out = np.full(y.shape, np.nan)
        for i in range(y.shape[0]):  # host-side, one subject at a time (as NPDE)
            j = np.nonzero(ok[i])[0]
            if not len(j):
                continue
            Ji = J[i, j]
            E = f[i, j] - Ji @ eta[i]
            C = Ji @ Om @ Ji.T + np.diag(g[i, j] ** 2)
            w, U = np.linalg.eigh(C)
            out[i, j] = U @ ((U.T @ (y[i, j] - E)) / np.sqrt(w))
        return out

    def predictions(self, subjects=None, *, positions=None):
        """One row per observation: ``ID, TIME, TAD, DV, CENS, PRED, IPRED, IWRES, CWRES``
        (``TAD``: :func:`time_after_dose`).

        :param subjects: subject IDs to keep (default: all; see :meth:`subject_positions`).
        :param positions: array positions instead of IDs.
        :return: a pandas DataFrame (padding removed).
        """
        import pandas as pd

        a = self._arrays
        pred = self._predict_phi(self._phi("typical"), a)
        ipred = self._predict_phi(self._phi("mode"), a,
                                  kappa=self.occasion_effects("mode") or None)
        iwres = np.asarray(self.pk.error.residuals(jnp.asarray(a["dv"]), jnp.asarray(ipred),
                                                   self._error_params(),
                                                   cens=jnp.asarray(a["cens"])))
        m = np.asarray(a["obs_mask"], bool)
        ids = np.broadcast_to(np.asarray(self.data.ids)[:, None], m.shape)
        cens = np.asarray(a["cens"], bool)
        df = pd.DataFrame({
            "ID": ids[m], "TIME": np.asarray(a["obs_time"])[m],
            "TAD": time_after_dose(self.data)[m], "DV": np.asarray(a["dv"])[m],
            "CENS": cens[m], "PRED": pred[m], "IPRED": ipred[m],
            "IWRES": np.where(cens, np.nan, iwres)[m], "CWRES": self.cwres()[m],
        })
        return self._rows_of(df, subjects, positions)

    # ------------------------------------------------------------------ simulation
    def simulate(self, rng_key: jax.Array, data: PKDataset | None = None, *,
                 num_replicates: int = 1, new_subjects: bool = True) -> dict:
        """Simulate the fitted model on the design of ``data`` (default: the fitted data;
        another :class:`~numpyro_fed.nlme.data.PKDataset` gives new subjects, new dosing
        regimens or new sampling times).

        :param new_subjects: draw new random effects from :math:`N(0, \\hat\\Omega)`
            (default); ``False`` keeps the fitted subjects' EBEs (``data`` must then be the
            fitted subjects). With inter-occasion variability, the occasion effects are drawn
            from :math:`N(0, \\hat\\omega_{\\mathrm{IOV}}^2)` for every occasion of ``data``
            (new occasions), except with ``new_subjects=False`` on the fitted data itself
            (``data=None``), which keeps their conditional modes.
        :return: ``{"f": (R, n, T) structural predictions, "dv": (R, n, T) simulated
            observations (uncensored), "mask": (n, T)}``; ``f`` and ``dv`` are NaN where
            ``mask`` is False (the padding of subjects with fewer samples than ``T``).
        """
        num_replicates = check_int("num_replicates", num_replicates, minimum=1)
        pk = self.pk
        arrays = self._arrays if data is None else pk.arrays(data)
        n = arrays["obs_time"].shape[0]
        typ = self._typical(arrays)
        R = int(num_replicates)
        k_eta, k_eps = random.split(rng_key)
        names = pk.random_names
        if new_subjects:
            L = np.linalg.cholesky(self.omega())
            eta = np.asarray(random.normal(k_eta, (R, n, len(names)))) @ L.T
        else:
            if n != len(self.data.ids):
                raise ValueError("new_subjects=False keeps the fitted subjects' EBEs: data "
                                 f"must have the {len(self.data.ids)} fitted subjects, got "
                                 f"{n}.")
            modes = self.conditional_modes()
            eta = np.broadcast_to(np.stack([modes[m] - np.asarray(typ[m]) for m in names],
                                           -1), (R, n, len(names)))
        t = jnp.asarray(arrays["obs_time"])
        doses = _doses(arrays)
        nb = jnp.asarray(arrays["doses_before"])
        kap = {}
        if pk.iov:  # occasion effects (R, K) per IOV parameter
            K = arrays["binding"].occasions
            if new_subjects or data is not None:
                keys = random.split(random.fold_in(k_eta, 1), len(pk.iov))
                kap = {m: float(self.params[f"omega_iov_{m}"]) * random.normal(kk, (R, K))
                       for kk, m in zip(keys, pk.iov, strict=True)}
            else:
                kap = {m: jnp.broadcast_to(jnp.asarray(v), (R, K))
                       for m, v in self.occasion_effects("mode").items()}

        def one(e, kp):
            phi = dict(typ)
            for k, m in enumerate(names):
                phi[m] = typ[m] + e[:, k]
            return pk.predict(pk.individual(phi), t, doses, nb, binding=arrays["binding"],
                              obs_cmt=arrays.get("obs_cmt"),
                              at_records=self._at_records(phi, arrays, kappa=kp or None))

        def replicates(e, kp, key, err):
            f = jax.vmap(one)(e, kp)
            return f, pk.error.sample(key, f, err)

        # SIM_CHUNK replicates per call of one program (bounded memory; the NPDE's and the
        # VPC's simulations share it); the last chunk padded with copies of the last replicate
        C = min(R, SIM_CHUNK)
        eta = np.asarray(eta, t.dtype)  # sliced on the host (no program per slice)
        kap = {m: np.asarray(v, t.dtype) for m, v in kap.items()}
        err = self._error_params()
        fs, ys = [], []
        for c, lo in enumerate(range(0, R, C)):
            sel = np.minimum(np.arange(lo, lo + C), R - 1)
            f, y = _run(replicates, eta[sel], {m: v[sel] for m, v in kap.items()},
                        random.fold_in(k_eps, c), err)
            keep = min(C, R - lo)
            fs.append(np.asarray(f)[:keep])
            ys.append(np.asarray(y)[:keep])
        mask = np.asarray(arrays["obs_mask"], bool)
        # the padded slots of subjects with fewer samples are no observations: NaN, not a
        # prediction at a padded time that could be read as one
        return {"f": np.where(mask, np.concatenate(fs), np.nan),
                "dv": np.where(mask, np.concatenate(ys), np.nan), "mask": mask}

    def npde(self, rng_key: jax.Array, num_sims: int = 1000, *, subjects=None,
             positions=None):
        """Normalised prediction distribution errors of every observation (censored ones:
        NaN), from ``num_sims`` simulations of the fitted model.

        :param subjects: subject IDs to keep (default: all; see :meth:`subject_positions`;
            the simulations are those of all subjects, so a subset has the values it has in
            the full table).
        :param positions: array positions instead of IDs.
        :return: a pandas DataFrame ``ID, TIME, TAD, DV, NPDE``.
        """
        self.subject_positions(subjects, positions)  # check the selection first
        import pandas as pd
        from scipy.special import ndtri

        if num_sims < 50:
            raise ValueError(f"num_sims={num_sims}: NPDE needs at least 50 simulations "
                             "(1000 is the usual choice).")
        sim = self.simulate(rng_key, num_replicates=num_sims)
        a = self._arrays
        m = sim["mask"]
        y = np.asarray(a["dv"], np.float64)
        ys = sim["dv"].astype(np.float64)  # (K, n, T)
        if self.pk.error.kind == "exponential":  # decorrelate on the scale of the error
            # padded slots (f = 0, so simulated 0) are dropped below: log of 1, not of 0
            y, ys = np.log(np.where(m, y, 1.0)), np.log(np.where(m, ys, 1.0))
        K = ys.shape[0]
        out = np.full(y.shape, np.nan)
        for i in range(y.shape[0]):  # host-side post-processing, one subject at a time
            j = np.nonzero(m[i])[0]
            Y, S = y[i, j], ys[:, i, j]
            E = S.mean(0)
            V = np.cov(S, rowvar=False).reshape(len(j), len(j))
            w, U = np.linalg.eigh(V)
            W = U @ np.diag(1 / np.sqrt(np.maximum(w, 1e-12 * w.max()))) @ U.T
            ystar, sstar = W @ (Y - E), (S - E) @ W.T
            pde = (sstar < ystar).mean(0)
            pde = np.clip(pde, 1 / (2 * K), 1 - 1 / (2 * K))
            out[i, j] = ndtri(pde)  # host side (one shape per subject: no program each)
        out = np.where(np.asarray(a["cens"], bool), np.nan, out)
        ids = np.broadcast_to(np.asarray(self.data.ids)[:, None], m.shape)
        df = pd.DataFrame({"ID": ids[m], "TIME": np.asarray(a["obs_time"])[m],
                           "TAD": time_after_dose(self.data)[m],
                           "DV": np.asarray(a["dv"])[m], "NPDE": out[m]})
        return self._rows_of(df, subjects, positions)

    def vpc_table(self, rng_key: jax.Array, *, num_sims: int = 200, bins: int | None = None,
                  quantiles=(0.05, 0.5, 0.95), pi: float = 0.9,
                  prediction_corrected: bool = False, x: str | None = None):
        """Numbers behind the VPC: per bin of the x axis, the observed quantiles and the
        ``pi`` prediction interval (and median) of the same quantiles over ``num_sims``
        simulated replicates. Censored observations are left out of the observed quantiles
        and simulated values below their LLOQ out of the simulated ones.

        :param bins: number of bins (quantiles of the x values of the observations; default:
            ``min(8, distinct values)``).
        :param prediction_corrected: pcVPC: every value multiplied by the median PRED of its
            bin over its own PRED.
        :param x: ``"time"``, ``"tad"`` (time after dose, :func:`time_after_dose`) or
            ``None``: TAD when a subject has more than one dose, else time.
        :return: a pandas DataFrame, one row per bin and quantile: ``bin, axis`` (the x
            axis used), ``x`` (median x of the bin's observations), ``time`` (their median
            time), ``quantile, observed, sim_lo, sim_median, sim_hi, n_obs``.
        """
        import pandas as pd

        axis = _x_axis(x, self.data)
        a = self._arrays
        m = np.asarray(a["obs_mask"], bool) & ~np.asarray(a["cens"], bool)
        t = np.asarray(a["obs_time"], np.float64)
        xv = t if axis == "time" else time_after_dose(self.data)
        y = np.asarray(a["dv"], np.float64)
        sim = self.simulate(rng_key, num_replicates=num_sims)["dv"].astype(np.float64)
        lloq = np.asarray(a["lloq"], np.float64)
        sim_ok = np.broadcast_to(m, sim.shape) & ~(sim < lloq)
        tu = np.unique(xv[m])
        nb = bins or min(8, len(tu))
        edges = np.unique(np.quantile(xv[m], np.linspace(0, 1, nb + 1)))
        if len(edges) < 2:
            edges = np.array([edges[0], edges[0]])
        b = np.clip(np.searchsorted(edges, np.where(m, xv, edges[0]), side="right") - 1, 0,
                    len(edges) - 2)
        if prediction_corrected:
            pred = self._predict_phi(self._phi("typical"), a)
            med = np.array([np.median(pred[m & (b == k)]) if np.any(m & (b == k)) else 1.0
                            for k in range(len(edges) - 1)])
            corr = np.where(m, med[b] / np.where(pred > 0, pred, np.nan), np.nan)
            y, sim = y * corr, sim * corr
        lo, hi = (1 - pi) / 2, 1 - (1 - pi) / 2
        rows = []
        for k in range(len(edges) - 1):
            sel = m & (b == k)
            if not np.any(sel):
                continue
            xb, tb = float(np.median(xv[sel])), float(np.median(t[sel]))
            for q in quantiles:
                obs_q = float(np.quantile(y[sel], q))
                sq = np.array([np.quantile(s[sel & ok], q) if np.any(sel & ok) else np.nan
                               for s, ok in zip(sim, sim_ok, strict=True)])
                rows.append({"bin": k, "axis": axis, "x": xb, "time": tb, "quantile": q,
                             "observed": obs_q,
                             "sim_lo": float(np.nanquantile(sq, lo)),
                             "sim_median": float(np.nanmedian(sq)),
                             "sim_hi": float(np.nanquantile(sq, hi)),
                             "n_obs": int(sel.sum())})
        return pd.DataFrame(rows)

    # ------------------------------------------------------------------ plots
    def plot_goodness_of_fit(self, path: str | Path | None = None, npde=None, *,
                             x: str | None = None, smooth: bool = True, subjects=None,
                             positions=None):
        """Observations vs PRED and vs IPRED, IWRES and CWRES vs time (or time after dose)
        and vs PRED (and NPDE vs time and vs PRED when ``npde`` -- the DataFrame of
        :meth:`npde` -- is given), each with a LOWESS trend line (:func:`lowess`, span 2/3,
        as xpose and saemix draw one) when ``smooth``. Saved as PNG to ``path`` when given;
        returns the matplotlib figure.

        :param x: the x axis of the residual panels: ``"time"``, ``"tad"`` or ``None`` (TAD
            when a subject has more than one dose, else time).
        :param subjects: subject IDs to draw (default: all; :meth:`subject_positions`).
        :param positions: array positions instead of IDs.
        """
        plt = _pyplot()
        axis = _x_axis(x, self.data)
        xcol = "TAD" if axis == "tad" else "TIME"
        df = self.predictions()
        if npde is not None:
            df = df.assign(NPDE=npde["NPDE"].to_numpy())
        df = self._rows_of(df, subjects, positions)
        ok = ~df["CENS"].to_numpy(bool)
        panels = [("PRED", "DV"), ("IPRED", "DV"), (xcol, "IWRES"), ("PRED", "IWRES"),
                  (xcol, "CWRES"), ("PRED", "CWRES")]
        if npde is not None:
            panels += [(xcol, "NPDE"), ("PRED", "NPDE")]
        ncol = len(panels) // 2
        nrow = 2
        names = {"TIME": "time", "TAD": "time after dose"}
        fig, ax = plt.subplots(nrow, ncol, figsize=(4 * ncol, 3.6 * nrow), squeeze=False)
        for k, (xc, yc) in enumerate(panels):
            axi = ax[k // ncol][k % ncol]
            xs, ys = df[xc].to_numpy(float)[ok], df[yc].to_numpy(float)[ok]
            axi.scatter(xs, ys, s=10, alpha=0.6)
            if yc == "DV":
                lim = [0, max(np.nanmax(xs, initial=0), np.nanmax(ys, initial=0)) * 1.05]
                axi.plot(lim, lim, "k--", lw=1)
            else:
                axi.axhline(0, color="k", lw=1)
                for h in (-1.96, 1.96):
                    axi.axhline(h, color="k", ls=":", lw=1)
            if smooth:
                sx, sy = lowess(xs, ys)
                if len(sx):
                    axi.plot(sx, sy, color="C3", lw=1.8, label="LOWESS")
            axi.set_xlabel(names.get(xc, xc))
            axi.set_ylabel(yc)
            axi.set_title(f"{yc} vs {names.get(xc, xc)}")
        if smooth:
            ax[0][0].legend(fontsize=7, loc="upper left")
        fig.tight_layout()
        return _save(fig, path)

    def plot_individual_fits(self, path: str | Path | None = None, subjects=None,
                             num_points: int = 200, ncols: int = 4, *, positions=None,
                             per_dose: int = 120):
        """Observations with the IPRED and PRED curves, one panel per subject (default: the
        first 12). Each curve is drawn on its subject's own time grid
        (:func:`_dose_grid`): every dose and sample time, ``num_points`` evenly spaced
        times, and ``per_dose`` times spaced geometrically after each dose up to the next
        (dense just after the dose), so that no absorption peak falls between grid points
        and a bolus shows its jump.

        :param subjects: subject IDs to draw (as in the dataset's ID column); array
            positions go to ``positions=``.
        :param num_points: evenly spaced times per subject.
        :param per_dose: geometrically spaced times after each dose.
        :raises ValueError: an unknown ID (see :meth:`subject_positions`).
        """
        num_points = check_int("num_points", num_points, minimum=2)
        per_dose = check_int("per_dose", per_dose, minimum=2)
        plt = _pyplot()
        a = self._arrays
        n = a["obs_time"].shape[0]
        idx = self.subject_positions(subjects, positions)
        idx = np.arange(min(n, 12)) if idx is None else idx
        dtype = np.asarray(a["obs_time"]).dtype
        grids = []
        for i in idx:
            mk = np.asarray(a["obs_mask"][i], bool)
            dm = np.asarray(a["dose_mask"][i], bool)
            to = np.asarray(a["obs_time"][i], np.float64)[mk]
            td = np.asarray(a["dose_time"][i], np.float64)[dm]
            tend = 1.05 * max(to.max(initial=0.0), td.max(initial=0.0))
            grids.append(_dose_grid(to, td, tend, num_points, per_dose))
        G = max(len(g) for g in grids)
        grid = np.stack([np.pad(g, (0, G - len(g)), mode="edge") for g in grids]).astype(dtype)
        sub = _subset_arrays(a, idx)
        ipred = self._predict_phi(_take(self._phi("mode"), idx), sub, grid,
                                  self.occasion_effects("mode") or None)
        pred = self._predict_phi(_take(self._phi("typical"), idx), sub, grid)
        ncols = max(1, min(int(ncols), len(idx)))  # fewer subjects: no empty columns
        nrows = -(-len(idx) // ncols)
        fig, ax = plt.subplots(nrows, ncols, figsize=(3.2 * ncols, 2.6 * nrows),
                               squeeze=False)
        for k, i in enumerate(idx):
            axi = ax[k // ncols][k % ncols]
            g = len(grids[k])
            mk = np.asarray(a["obs_mask"][i], bool)
            axi.plot(grid[k, :g], ipred[k, :g], "C0-", lw=1.2, label="IPRED")
            axi.plot(grid[k, :g], pred[k, :g], "C1--", lw=1, label="PRED")
            axi.plot(np.asarray(a["obs_time"][i])[mk], np.asarray(a["dv"][i])[mk], "ko",
                     ms=3, label="DV")
            axi.set_title(f"ID {self.data.ids[i]}", fontsize=9)
        for k in range(len(idx), nrows * ncols):
            ax[k // ncols][k % ncols].axis("off")
        ax[0][0].legend(fontsize=7)
        fig.tight_layout()
        return _save(fig, path)

    def plot_vpc(self, rng_key: jax.Array, path: str | Path | None = None, **kw):
        """Visual predictive check (:meth:`vpc_table`; keyword arguments go there, ``x``
        included: time after dose by default for multiple-dose data): the observations,
        their binned 5/50/95th percentiles (lines) and the 90 % prediction intervals of the
        same percentiles from the simulations (bands)."""
        plt = _pyplot()
        tab = self.vpc_table(rng_key, **kw)
        axis = _x_axis(kw.get("x"), self.data)
        a = self._arrays
        m = np.asarray(a["obs_mask"], bool) & ~np.asarray(a["cens"], bool)
        xv = (np.asarray(a["obs_time"]) if axis == "time" else time_after_dose(self.data))
        fig, ax = plt.subplots(figsize=(6.5, 4.2))
        if not kw.get("prediction_corrected", False):
            ax.plot(xv[m], np.asarray(a["dv"])[m], "o", color="0.6", ms=3)
        for q, col in zip(sorted(tab["quantile"].unique()), ("C0", "C3", "C0"), strict=False):
            s = tab[tab["quantile"] == q]
            ax.fill_between(s["x"], s["sim_lo"], s["sim_hi"], color=col, alpha=0.2)
            ax.plot(s["x"], s["observed"], color=col, lw=1.5,
                    label=f"observed {int(100 * q)}th")
        ax.set_xlabel("time after dose" if axis == "tad" else "time")
        ax.set_ylabel("prediction-corrected DV" if kw.get("prediction_corrected") else "DV")
        ax.legend(fontsize=8)
        ax.set_title("VPC (bands: 90% PI of simulated percentiles)")
        fig.tight_layout()
        return _save(fig, path)


#: replicates simulated together (:meth:`NLMEFit.simulate`): the superposition of every
#: dose before every sample is ``(replicates, n, T, doses)`` at once
SIM_CHUNK = 100


def _run(fn, *args):
    """``fn(*args)`` as one compiled program, cached by content (:class:`~numpyro_fed.
    _programs.Program`): the predictions, the linearisation of CWRES and the simulations of
    the diagnostics and plots of one fit reuse one executable per design and shape (the same
    program for PRED and IPRED, for ``predictions()`` called by ``plot_goodness_of_fit``)
    rather than dispatching the dose superposition one operation at a time or compiling a
    new :func:`jax.jit` closure on every call."""
    return Program(fn, tag="nlme-diagnostics")(*args)


def _take(params: dict, idx) -> dict:
    return {k: np.asarray(v)[idx] for k, v in params.items()}


def _carry_forward(a: dict, tv_o: dict, tv_d: dict, times: np.ndarray) -> dict:
    """Time-varying covariates at ``times`` ``(n, G)``: the value of the last record
    (observation or dose, in record order) at or before each time (the first record's
    before every record)."""
    t_o = np.asarray(a["obs_time"], np.float64)
    t_d = np.asarray(a["dose_time"], np.float64)
    mo, md = np.asarray(a["obs_mask"], bool), np.asarray(a["dose_mask"], bool)
    nb = np.asarray(a["doses_before"], np.int64)
    n, T = t_o.shape
    D = t_d.shape[1]
    out = {c: np.zeros(times.shape, np.asarray(v).dtype) for c, v in tv_o.items()}
    for i in range(n):
        # record order: observation j after nb[j] doses
        po = np.arange(T) + nb[i]
        pd_ = np.arange(D) + np.sum(nb[i][None, :] <= np.arange(D)[:, None], axis=1)
        E = T + D
        rt = np.empty(E)
        ok = np.empty(E, bool)
        rt[po], rt[pd_] = t_o[i], t_d[i]
        ok[po], ok[pd_] = mo[i], md[i]
        keep = np.flatnonzero(ok)
        r = np.clip(np.searchsorted(rt[keep], times[i], side="right") - 1, 0, None)
        for c in tv_o:
            v = np.empty(E, np.asarray(tv_o[c]).dtype)
            v[po], v[pd_] = np.asarray(tv_o[c])[i], np.asarray(tv_d[c])[i]
            out[c][i] = v[keep][r]
    return out


def _subset_arrays(a: dict, idx) -> dict:
    """The arrays of :meth:`PKModel.arrays` restricted to the subjects at ``idx`` (the
    binding kept: it holds no per-subject array)."""
    n = np.asarray(a["obs_time"]).shape[0]
    out = {}
    for k, v in a.items():
        if k != "binding" and np.ndim(v) >= 1 and np.shape(v)[0] == n:
            out[k] = np.asarray(v)[idx]
        else:
            out[k] = v
    return out


def time_after_dose(data: PKDataset) -> np.ndarray:
    """Time after dose (TAD) of every observation, ``(n_subjects, max_obs)``: the time since
    the most recent dose recorded before the sample (record order, :attr:`PKDataset.
    doses_before`: a pre-dose trough recorded before a dose at the same time counts from
    the dose before). A steady-state dose (``SS = 1``, interval ``II``) stands for a train of
    doses every ``II`` that *ends* with it (NONMEM), so the implied doses all precede its
    record time and the TAD after it counts from that time. Dose record times are used
    (``TLAG`` is not added), as xpose and PsN compute TAD. A sample before every dose of its
    subject gets a negative TAD (minus the time to the first dose); a subject without doses
    gets its times. Padding: NaN.

    :param data: the dataset.
    :return: float64 array of the observations' shape.
    """
    if not isinstance(data, PKDataset):
        raise TypeError(f"data must be a nlme.PKDataset, got {type(data).__name__}.")
    t = np.asarray(data.obs.time, np.float64)
    dt = np.asarray(data.doses.time, np.float64)
    dm = np.asarray(data.doses.mask, bool)
    nb = np.asarray(data.doses_before, np.int64)
    n = t.shape[0]
    last = np.take_along_axis(dt, np.clip(nb - 1, 0, dt.shape[1] - 1), axis=1)
    has = dm.any(1)
    first = np.where(has, dt[np.arange(n), np.argmax(dm, 1)], 0.0)
    tad = np.where(nb > 0, t - last, t - first[:, None])
    return np.where(np.asarray(data.obs.mask, bool), tad, np.nan)


def lowess(x, y, frac: float = 2 / 3, iterations: int = 3, num_points: int = 100):
    """Locally weighted linear regression (Cleveland 1979's LOWESS, as R's ``lowess``):
    at each point, a straight line fitted by least squares weighted by the tricube of the
    distance over the ``frac * n`` nearest observations, with ``iterations - 1`` robustness
    steps (bisquare weights of the residuals over 6 times their median absolute value).

    :param x: abscissae ``(n,)`` (non-finite pairs are dropped).
    :param y: ordinates ``(n,)``.
    :param frac: span, the fraction of the observations in each local fit (0 < frac <= 1).
    :param iterations: 1 + the number of robustness steps (R's ``iter + 1``; default 3).
    :param num_points: number of abscissae of the curve returned (evenly spaced over the
        range of ``x``).
    :return: ``(xs, ys)``, the curve (empty arrays when fewer than 3 finite pairs or a
        single abscissa).
    :raises ValueError: ``frac`` outside (0, 1], ``iterations`` < 1 or ``num_points`` < 2.
    """
    if not (isinstance(frac, int | float) and 0 < frac <= 1):
        raise ValueError(f"frac={frac!r}: the span must be in (0, 1].")
    iterations = check_int("iterations", iterations, minimum=1)
    num_points = check_int("num_points", num_points, minimum=2)
    x = np.asarray(x, np.float64).ravel()
    y = np.asarray(y, np.float64).ravel()
    ok = np.isfinite(x) & np.isfinite(y)
    x, y = x[ok], y[ok]
    n = len(x)
    if n < 3 or np.ptp(x) == 0:
        return np.zeros(0), np.zeros(0)
    k = min(n, max(3, int(math.ceil(frac * n))))

    def fit(at, robust):
        d = np.abs(at[:, None] - x[None, :])  # (m, n)
        h = np.partition(d, k - 1, axis=1)[:, k - 1]
        h = np.where(h > 0, h, 1.0)[:, None] * (1 + 1e-12)
        w = np.clip(1 - (d / h) ** 3, 0, None) ** 3 * robust[None, :]
        sw = w.sum(1)
        sw = np.where(sw > 0, sw, 1.0)
        mx = (w * x).sum(1) / sw
        my = (w * y).sum(1) / sw
        sxx = (w * (x - mx[:, None]) ** 2).sum(1)
        sxy = (w * (x - mx[:, None]) * (y - my[:, None])).sum(1)
        slope = np.where(sxx > 1e-12 * np.ptp(x) ** 2 * sw, sxy / np.where(sxx > 0, sxx, 1),
                         0.0)
        return my + slope * (at - mx)

    robust = np.ones(n)
    for _ in range(iterations - 1):
        r = y - fit(x, robust)
        s = np.median(np.abs(r))
        if s == 0:
            break
        robust = np.clip(1 - (r / (6 * s)) ** 2, 0, None) ** 2
    xs = np.linspace(x.min(), x.max(), num_points)
    return xs, fit(xs, robust)


def _dose_grid(t_obs, t_doses, t_end, num_points: int, per_dose: int) -> np.ndarray:
    """Sorted times at which one subject's curve is drawn: every sample and dose time, an
    even grid of ``num_points`` over ``[0, t_end]``, and after each dose ``per_dose``
    geometrically spaced times up to the next dose (or ``t_end``), dense just after the dose
    where the absorption peak is, plus an instant before each dose (the jump of a
    bolus)."""
    t_doses = np.unique(np.asarray(t_doses, np.float64))
    parts = [np.asarray(t_obs, np.float64), t_doses, np.linspace(0.0, t_end, num_points)]
    span = max(t_end, 1e-12)
    nxt = np.append(t_doses[1:], max(t_end, t_doses[-1] if len(t_doses) else 0.0))
    for td, tn in zip(t_doses, nxt, strict=True):
        L = tn - td
        if L <= 0:
            L = 0.05 * span
        parts.append(td + np.geomspace(1e-5 * L, L, per_dose))
        parts.append([max(td - 1e-7 * span, 0.0)])
    g = np.unique(np.concatenate(parts))
    return g[(g >= 0) & (g <= t_end)]


def _x_axis(x, data: PKDataset) -> str:
    """The x axis of the residual plots and the VPC: ``"tad"`` (time after dose) or
    ``"time"``; ``None``: TAD when a subject has more than one dose, else time."""
    if x is None:
        return "tad" if int(np.asarray(data.doses.mask).sum(1).max()) > 1 else "time"
    if x not in ("time", "tad"):
        raise ValueError(f"x={x!r}: use 'time', 'tad' (time after dose) or None (TAD when a "
                         "subject has more than one dose, else time).")
    return x


def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg", force=False)
        import matplotlib.pyplot as plt
    except ImportError as e:  # pragma: no cover - matplotlib is in the examples extra
        raise ImportError("plots need matplotlib: pip install 'numpyro_fed[examples]'.") from e
    return plt


def _save(fig, path):
    if path is not None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=110)
    return fig
