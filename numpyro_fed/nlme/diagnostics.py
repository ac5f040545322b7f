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

from numpyro_fed._validation import check_int
from numpyro_fed.nlme.data import Doses, PKDataset
from numpyro_fed.nlme.transforms import TRANSFORMS
from numpyro_fed.saem import likelihood as lik

__all__ = ["NLMEFit"]


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

    def parameter_table(self, standard_errors: bool = True):
        """Estimates with standard errors, RSE % and, for the random effects of
        log-normal parameters, the CV % :math:`100\\sqrt{e^{\\omega^2} - 1}`.

        :return: a pandas DataFrame indexed by parameter name.
        """
        import pandas as pd

        res, pk = self.result, self.pk
        est = res.estimates()
        se = res.standard_errors() if standard_errors else dict.fromkeys(est, np.nan)
        rows = []
        for k, v in est.items():
            s = se.get(k, np.nan)
            rows.append({"parameter": k, "estimate": v, "se": s,
                         "rse_%": 100 * abs(s / v) if v != 0 else np.nan, "cv_%": np.nan})
        df = pd.DataFrame(rows).set_index("parameter")
        Om = self.omega()
        for i, n in enumerate(pk.random_names):
            key = f"omega_{n}"
            sd = math.sqrt(Om[i, i])
            cv = (100 * math.sqrt(math.expm1(sd**2)) if pk.params[n].transform == "log"
                  else np.nan)
            if key in df.index:
                df.loc[key, "cv_%"] = cv
            else:  # full covariance: a derived row
                df.loc[f"sd_{n}"] = {"estimate": sd, "se": np.nan, "rse_%": np.nan,
                                     "cv_%": cv}
        for n in pk.names:  # typical values on the natural scale
            f = TRANSFORMS[pk.params[n].transform][0]
            df.loc[f"typical_{n}"] = {"estimate": float(f(est[f"mu_{n}"])), "se": np.nan,
                                      "rse_%": np.nan, "cv_%": np.nan}
        # the fit's convergence verdict travels with its table (the standard errors of a fit
        # that has not converged also warn ConvergenceWarning)
        msgs = list(getattr(res, "convergence_messages", []))
        df.attrs["converged"] = not msgs
        df.attrs["convergence_messages"] = msgs
        return df

    # ------------------------------------------------------------------ individual
    def _theta_c(self):
        return self.result.info.constrain_theta(jnp.asarray(self.result.theta))

    def _phi_sites(self, zc: dict) -> dict:
        pk = self.pk
        if pk.omega == "full":
            v = zc["phi"]
            return {n: v[..., k] for k, n in enumerate(pk.random_names)}
        return {n: zc[f"phi_{n}"] for n in pk.random_names}

    def conditional_modes(self) -> dict[str, np.ndarray]:
        """Empirical Bayes estimates: per-subject conditional modes of the transformed
        individual parameters ``{name: (n,)}`` (random ones only), by damped Newton from the
        conditional means (:func:`numpyro_fed.saem.likelihood.conditional_modes`)."""
        if self._modes is None:
            res = self.result
            info = res.info
            zs = jnp.asarray(res.z_draws)
            z0 = jnp.mean(zs.reshape(-1, zs.shape[-1]), 0)
            fn = jax.jit(lambda tc, z: lik.conditional_modes(
                info, res.layout, res.ids, tc, z, res.args, res.kwargs)[0])
            z = fn(self._theta_c(), z0)
            self._modes = {n: np.asarray(v)
                           for n, v in self._phi_sites(info.constrain_z(z)[0]).items()}
        return self._modes

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
        (``"mean"``) or the typical values (``"typical"``, random effects 0)."""
        phi = dict(self._typical(self._arrays))
        if kind == "mode":
            phi.update({k: jnp.asarray(v) for k, v in self.conditional_modes().items()})
        elif kind == "mean":
            draws = self._phi_sites(self.result.latent_samples())
            phi.update({k: jnp.asarray(v.mean(axis=(0, 1))) for k, v in draws.items()})
        elif kind != "typical":
            raise ValueError(f"kind={kind!r}: use 'mode', 'mean' or 'typical'.")
        return {k: np.asarray(v) for k, v in self.pk.individual(phi).items()}

    def individual_estimates(self):
        """Per subject and parameter: the conditional mode (EBE), the conditional mean and
        standard deviation (from the SAEM draws at the final estimate), natural scale, and
        the random effect :math:`\\hat\\eta` at the mode.

        :return: a pandas DataFrame indexed by subject ID.
        """
        import pandas as pd

        pk = self.pk
        mode = self.individual_parameters("mode")
        typ = self._typical(self._arrays)
        modes = self.conditional_modes()
        draws = self._phi_sites(self.result.latent_samples())
        out = {}
        for n in pk.names:
            out[f"{n}_mode"] = mode[n]
            if n in draws:
                fwd = TRANSFORMS[pk.params[n].transform][0]
                nat = np.asarray(fwd(jnp.asarray(draws[n])))
                out[f"{n}_mean"] = nat.mean(axis=(0, 1))
                out[f"{n}_sd"] = nat.std(axis=(0, 1))
                out[f"eta_{n}"] = modes[n] - np.asarray(typ[n])
        return pd.DataFrame(out, index=pd.Index(self.data.ids, name="ID"))

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

    def _predict(self, indiv: dict, arrays: dict, times=None):
        t = jnp.asarray(arrays["obs_time"] if times is None else times)
        nb = arrays["doses_before"] if times is None else None
        cmt = arrays.get("obs_cmt") if times is None else None  # a grid: the observed one
        return np.asarray(self.pk.predict({k: jnp.asarray(v) for k, v in indiv.items()}, t,
                                          _doses(arrays), nb, binding=arrays.get("binding"),
                                          obs_cmt=cmt))

    def cwres(self) -> np.ndarray:
        """Conditional weighted residuals ``(n, T)`` (FOCE-I linearisation at the EBEs, see
        the module docstring); NaN at padding and censored observations."""
        pk, a = self.pk, self._arrays
        typ = self._typical(a)
        modes = self.conditional_modes()
        rn = pk.random_names
        eta = jnp.stack([jnp.asarray(modes[n]) - typ[n] for n in rn], -1)  # (n, q)
        log_scale = pk.error.kind == "exponential"

        def h(e):
            phi = dict(typ)
            phi.update({n: typ[n] + e[:, k] for k, n in enumerate(rn)})
            f = pk.predict(pk.individual(phi), jnp.asarray(a["obs_time"]), _doses(a),
                           a["doses_before"], binding=a.get("binding"),
                           obs_cmt=a.get("obs_cmt"))
            return jnp.log(f) if log_scale else f

        def lin(e):  # subject i's output depends on eta_i only: one jvp per random effect
            f = h(e)
            cols = [jax.jvp(h, (e,), (jnp.zeros_like(e).at[:, k].set(1.0),))[1]
                    for k in range(len(rn))]
            g = pk.error.scale(jnp.exp(f) if log_scale else f, self._error_params())
            return f, jnp.stack(cols, -1), g

        f, J, g = (np.asarray(x, np.float64) for x in jax.jit(lin)(eta))
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

    def predictions(self):
        """One row per observation: ``ID, TIME, DV, CENS, PRED, IPRED, IWRES, CWRES``.

        :return: a pandas DataFrame (padding removed).
        """
        import pandas as pd

        a = self._arrays
        pred = self._predict(self.individual_parameters("typical"), a)
        ipred = self._predict(self.individual_parameters("mode"), a)
        iwres = np.asarray(self.pk.error.residuals(jnp.asarray(a["dv"]), jnp.asarray(ipred),
                                                   self._error_params(),
                                                   cens=jnp.asarray(a["cens"])))
        m = np.asarray(a["obs_mask"], bool)
        ids = np.broadcast_to(np.asarray(self.data.ids)[:, None], m.shape)
        cens = np.asarray(a["cens"], bool)
        return pd.DataFrame({
            "ID": ids[m], "TIME": np.asarray(a["obs_time"])[m], "DV": np.asarray(a["dv"])[m],
            "CENS": cens[m], "PRED": pred[m], "IPRED": ipred[m],
            "IWRES": np.where(cens, np.nan, iwres)[m], "CWRES": self.cwres()[m],
        })

    # ------------------------------------------------------------------ simulation
    def simulate(self, rng_key: jax.Array, data: PKDataset | None = None, *,
                 num_replicates: int = 1, new_subjects: bool = True) -> dict:
        """Simulate the fitted model on the design of ``data`` (default: the fitted data;
        another :class:`~numpyro_fed.nlme.data.PKDataset` gives new subjects, new dosing
        regimens or new sampling times).

        :param new_subjects: draw new random effects from :math:`N(0, \\hat\\Omega)`
            (default); ``False`` keeps the fitted subjects' EBEs (``data`` must then be the
            fitted subjects).
        :return: ``{"f": (R, n, T) structural predictions, "dv": (R, n, T) simulated
            observations (uncensored), "mask": (n, T)}``.
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

        def one(e):
            phi = dict(typ)
            for k, m in enumerate(names):
                phi[m] = typ[m] + e[:, k]
            return pk.predict(pk.individual(phi), t, doses, nb, binding=arrays["binding"],
                              obs_cmt=arrays.get("obs_cmt"))

        f = jax.jit(jax.vmap(one))(jnp.asarray(eta, t.dtype))
        y = pk.error.sample(k_eps, f, self._error_params())
        return {"f": np.asarray(f), "dv": np.asarray(y),
                "mask": np.asarray(arrays["obs_mask"], bool)}

    def npde(self, rng_key: jax.Array, num_sims: int = 1000):
        """Normalised prediction distribution errors of every observation (censored ones:
        NaN), from ``num_sims`` simulations of the fitted model.

        :return: a pandas DataFrame ``ID, TIME, DV, NPDE``.
        """
        import pandas as pd
        from jax.scipy.special import ndtri

        if num_sims < 50:
            raise ValueError(f"num_sims={num_sims}: NPDE needs at least 50 simulations "
                             "(1000 is the usual choice).")
        sim = self.simulate(rng_key, num_replicates=num_sims)
        a = self._arrays
        m = sim["mask"]
        y = np.asarray(a["dv"], np.float64)
        ys = sim["dv"].astype(np.float64)  # (K, n, T)
        if self.pk.error.kind == "exponential":  # decorrelate on the scale of the error
            y, ys = np.log(np.where(m, y, 1.0)), np.log(ys)
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
            out[i, j] = np.asarray(ndtri(jnp.asarray(pde)))
        out = np.where(np.asarray(a["cens"], bool), np.nan, out)
        ids = np.broadcast_to(np.asarray(self.data.ids)[:, None], m.shape)
        return pd.DataFrame({"ID": ids[m], "TIME": np.asarray(a["obs_time"])[m],
                             "DV": np.asarray(a["dv"])[m], "NPDE": out[m]})

    def vpc_table(self, rng_key: jax.Array, *, num_sims: int = 200, bins: int | None = None,
                  quantiles=(0.05, 0.5, 0.95), pi: float = 0.9,
                  prediction_corrected: bool = False):
        """Numbers behind the VPC: per time bin, the observed quantiles and the
        ``pi`` prediction interval (and median) of the same quantiles over ``num_sims``
        simulated replicates. Censored observations are left out of the observed quantiles
        and simulated values below their LLOQ out of the simulated ones.

        :param bins: number of time bins (quantiles of the observation times; default:
            ``min(8, distinct times)``).
        :param prediction_corrected: pcVPC: every value multiplied by the median PRED of its
            bin over its own PRED.
        :return: a pandas DataFrame, one row per bin and quantile.
        """
        import pandas as pd

        a = self._arrays
        m = np.asarray(a["obs_mask"], bool) & ~np.asarray(a["cens"], bool)
        t = np.asarray(a["obs_time"], np.float64)
        y = np.asarray(a["dv"], np.float64)
        sim = self.simulate(rng_key, num_replicates=num_sims)["dv"].astype(np.float64)
        lloq = np.asarray(a["lloq"], np.float64)
        sim_ok = np.broadcast_to(m, sim.shape) & ~(sim < lloq)
        tu = np.unique(t[m])
        nb = bins or min(8, len(tu))
        edges = np.unique(np.quantile(t[m], np.linspace(0, 1, nb + 1)))
        b = np.clip(np.searchsorted(edges, t, side="right") - 1, 0, len(edges) - 2)
        if prediction_corrected:
            pred = self._predict(self.individual_parameters("typical"), a)
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
            tb = float(np.median(t[sel]))
            for q in quantiles:
                obs_q = float(np.quantile(y[sel], q))
                sq = np.array([np.quantile(s[sel & ok], q) if np.any(sel & ok) else np.nan
                               for s, ok in zip(sim, sim_ok, strict=True)])
                rows.append({"bin": k, "time": tb, "quantile": q, "observed": obs_q,
                             "sim_lo": float(np.nanquantile(sq, lo)),
                             "sim_median": float(np.nanmedian(sq)),
                             "sim_hi": float(np.nanquantile(sq, hi)),
                             "n_obs": int(sel.sum())})
        return pd.DataFrame(rows)

    # ------------------------------------------------------------------ plots
    def plot_goodness_of_fit(self, path: str | Path | None = None, npde=None):
        """Observations vs PRED and vs IPRED, IWRES and CWRES vs time and vs PRED (and NPDE vs time
        and vs PRED when ``npde`` -- the DataFrame of :meth:`npde` -- is given). Saved as PNG
        to ``path`` when given; returns the matplotlib figure."""
        plt = _pyplot()
        df = self.predictions()
        ok = ~df["CENS"].to_numpy()
        panels = [("PRED", "DV"), ("IPRED", "DV"), ("TIME", "IWRES"), ("PRED", "IWRES"),
                  ("TIME", "CWRES"), ("PRED", "CWRES")]
        if npde is not None:
            df = df.assign(NPDE=npde["NPDE"].to_numpy())
            panels += [("TIME", "NPDE"), ("PRED", "NPDE")]
        ncol = len(panels) // 2
        nrow = 2
        fig, ax = plt.subplots(nrow, ncol, figsize=(4 * ncol, 3.6 * nrow), squeeze=False)
        for k, (x, y) in enumerate(panels):
            axi = ax[k // ncol][k % ncol]
            axi.scatter(df[x][ok], df[y][ok], s=10, alpha=0.7)
            if y == "DV":
                lim = [0, max(df[x].max(), df["DV"].max()) * 1.05]
                axi.plot(lim, lim, "k--", lw=1)
            else:
                axi.axhline(0, color="k", lw=1)
                for h in (-1.96, 1.96):
                    axi.axhline(h, color="k", ls=":", lw=1)
            axi.set_xlabel(x.lower() if x == "TIME" else x)
            axi.set_ylabel(y)
            axi.set_title(f"{y} vs {x.lower() if x == 'TIME' else x}")
        fig.tight_layout()
        return _save(fig, path)

    def plot_individual_fits(self, path: str | Path | None = None, subjects=None,
                             num_points: int = 200, ncols: int = 4):
        """Observations with the IPRED and PRED curves on a fine time grid, one panel per
        subject (default: the first 12)."""
        plt = _pyplot()
        a = self._arrays
        n = a["obs_time"].shape[0]
        idx = list(range(min(n, 12))) if subjects is None else list(subjects)
        tmax = np.max(np.where(a["obs_mask"], a["obs_time"], 0), 1)
        grid = np.linspace(0, 1, num_points)[None, :] * tmax[:, None] * 1.05
        grid = grid.astype(np.asarray(a["obs_time"]).dtype)
        ipred = self._predict(self.individual_parameters("mode"), a, grid)
        pred = self._predict(self.individual_parameters("typical"), a, grid)
        nrows = -(-len(idx) // ncols)
        fig, ax = plt.subplots(nrows, ncols, figsize=(3.2 * ncols, 2.6 * nrows),
                               squeeze=False)
        for k, i in enumerate(idx):
            axi = ax[k // ncols][k % ncols]
            mk = np.asarray(a["obs_mask"][i], bool)
            axi.plot(grid[i], ipred[i], "C0-", lw=1.2, label="IPRED")
            axi.plot(grid[i], pred[i], "C1--", lw=1, label="PRED")
            axi.plot(np.asarray(a["obs_time"][i])[mk], np.asarray(a["dv"][i])[mk], "ko",
                     ms=3)
            axi.set_title(f"ID {self.data.ids[i]}", fontsize=9)
        for k in range(len(idx), nrows * ncols):
            ax[k // ncols][k % ncols].axis("off")
        ax[0][0].legend(fontsize=7)
        fig.tight_layout()
        return _save(fig, path)

    def plot_vpc(self, rng_key: jax.Array, path: str | Path | None = None, **kw):
        """Visual predictive check (:meth:`vpc_table`; keyword arguments go there): the
        observations, their binned 5/50/95th percentiles (lines) and the 90 % prediction
        intervals of the same percentiles from the simulations (bands)."""
        plt = _pyplot()
        tab = self.vpc_table(rng_key, **kw)
        a = self._arrays
        m = np.asarray(a["obs_mask"], bool) & ~np.asarray(a["cens"], bool)
        fig, ax = plt.subplots(figsize=(6.5, 4.2))
        if not kw.get("prediction_corrected", False):
            ax.plot(np.asarray(a["obs_time"])[m], np.asarray(a["dv"])[m], "o", color="0.6",
                    ms=3)
        for q, col in zip(sorted(tab["quantile"].unique()), ("C0", "C3", "C0"), strict=False):
            s = tab[tab["quantile"] == q]
            ax.fill_between(s["time"], s["sim_lo"], s["sim_hi"], color=col, alpha=0.2)
            ax.plot(s["time"], s["observed"], color=col, lw=1.5,
                    label=f"observed {int(100 * q)}th")
        ax.set_xlabel("time")
        ax.set_ylabel("prediction-corrected DV" if kw.get("prediction_corrected") else "DV")
        ax.legend(fontsize=8)
        ax.set_title("VPC (bands: 90% PI of simulated percentiles)")
        fig.tight_layout()
        return _save(fig, path)


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
