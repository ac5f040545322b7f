"""The result of an MCMC-SAEM fit (:class:`SAEMResult`)."""

from __future__ import annotations

import math
import warnings

import jax
import jax.numpy as jnp
import numpy as np
from jax import random

from numpyro_fed.saem import likelihood as lik
from numpyro_fed.saem.model import (
    ModelInfo,
    SubjectLayout,
    centred_score_hess,
    jit_loop,
    joint_layout,
    merge_data,
    split_data,
)

__all__ = ["SAEMResult", "ConvergenceWarning"]


class ConvergenceWarning(UserWarning):
    """The SAEM fit shows signs of not having converged."""


class SAEMResult:
    """Result of :meth:`SAEM.run <numpyro_fed.saem.SAEM.run>`.

    Attributes: ``params`` (dict of constrained estimates), ``theta`` (flat unconstrained),
    ``trajectory`` (pandas DataFrame, one row per iteration: constrained coordinates, step
    size :math:`\\gamma_k`, acceptance rate), ``idata`` (ArviZ InferenceData of the latent
    draws at the final :math:`\\theta`), ``mstep`` (which M-step ran), ``settings`` (what the
    defaults resolved to: chains, prior proposals, subjects, ...), ``num_params``.
    """

    def __init__(self, *, model, info: ModelInfo, layout: SubjectLayout | None, ids, theta,
                 thetas_u, gammas, accs, zs, accept_final, centring, mstep, args, kwargs,
                 num_exploration, settings, programs: dict | None = None) -> None:
        import pandas as pd

        self.model = model
        self.info, self.layout, self.ids = info, layout, ids
        self.args, self.kwargs = args, kwargs
        self.theta = np.asarray(theta)
        self.params = {n: np.asarray(v) for n, v in info.constrain_theta(
            jnp.asarray(self.theta)).items()}
        tc = np.asarray(jax.vmap(info.theta_c_flat)(jnp.asarray(thetas_u)))
        df = pd.DataFrame(tc, columns=info.theta_coord_names)
        df.insert(0, "gamma", np.asarray(gammas)[: len(df)])
        df["accept_rate"] = accs
        df.index = pd.RangeIndex(1, len(df) + 1, name="iteration")
        self.trajectory = df
        self.z_draws = np.asarray(zs)  # (T, C, d_z) unconstrained
        self.accept_rate_final = accept_final
        #: centring design of the fit (``None``: standard errors were not asked for)
        self.centring = centring
        self._fisher = None
        self.mstep = mstep
        self.num_params = info.dim_theta
        self.num_exploration = int(num_exploration)
        self.settings = dict(settings)
        self._ll: dict = {}
        # compiled likelihood programs, shared by every fit of the same structure (the data
        # are arguments), so that a repeated fit does not recompile them
        self._programs = {} if programs is None else programs

    def _program(self, name: str, build):
        """A compiled ``f(arrays, ids, *args)`` of ``build(args, kwargs)``, cached per
        structure and name."""
        arrays, static = split_data(self.args, self.kwargs)
        key = (name, repr(static))
        prog = self._programs.get(key)
        if prog is None:
            def f(arrays, ids, *a):
                args, kwargs = merge_data(arrays, static)
                return build(args, kwargs, ids)(*a)

            prog = self._programs[key] = jit_loop(f)
        return lambda *a: prog(arrays, self.ids, *a)

    # -- estimates ----------------------------------------------------------------------------
    @property
    def names(self) -> list[str]:
        return list(self.info.theta_coord_names)

    def estimates(self) -> dict[str, float]:
        """Flat, named constrained estimates ``{"omega[0]": ..., ...}``."""
        flat = np.asarray(self.info.theta_c_flat(jnp.asarray(self.theta)))
        return dict(zip(self.names, flat.tolist(), strict=True))

    def fisher_information(self) -> np.ndarray:
        """Louis observed information at :math:`\\hat\\theta` in unconstrained coordinates,
        :math:`-(\\bar H + \\overline{gg^\\top} - \\bar g\\bar g^\\top)`, the averages over
        the draws of :math:`z` at the final :math:`\\theta` of the complete-data score
        :math:`g` and Hessian :math:`H` (Louis 1982; Delyon, Lavielle & Moulines 1999,
        Sec. 6), differentiated in the centred coordinates of the fit (see
        :func:`~numpyro_fed.saem.model.centring_design`: the same information, a smaller
        Monte Carlo error). Computed once (a compiled program cached per model structure)."""
        if self.centring is None:
            raise ValueError("Standard errors need SAEM(..., fisher=True).")
        if self._fisher is None:
            info = self.info

            def build(args, kwargs, ids):
                def f(theta, zs, M):
                    def one(zf):
                        g, H = centred_score_hess(info, theta, zf[None], args, kwargs, M)
                        return g[0], H[0]

                    # batches of B draws, B a divisor of the number of draws (one copy of
                    # the Hessian in the program: lax.map compiles a remainder separately),
                    # at most 32: the memory of a batch is B forward-over-reverse passes of
                    # the whole model (256 took 10 GB on nlme::Quinidine, densely evaluated)
                    S = zs.shape[0]
                    B = max(b for b in range(1, min(S, 32) + 1) if S % b == 0)
                    return jax.lax.map(one, zs, batch_size=B)

                return f

            zs = jnp.asarray(self.z_draws).reshape(-1, self.z_draws.shape[-1])
            g, H = self._program("louis", build)(jnp.asarray(self.theta), zs,
                                                   jnp.asarray(self.centring, zs.dtype))
            g, H = np.asarray(g, np.float64), np.asarray(H, np.float64)
            gm = g.mean(0)
            info_u = -(H.mean(0) + (g.T @ g) / g.shape[0] - np.outer(gm, gm))
            self._fisher = (info_u + info_u.T) / 2.0
        return self._fisher.copy()

    def standard_errors(self) -> dict[str, float]:
        """Standard errors of the constrained estimates (delta method on the Louis
        information in unconstrained coordinates)."""
        info_u = self.fisher_information()
        try:
            cov_u = np.linalg.inv(info_u)
        except np.linalg.LinAlgError:
            cov_u = np.full_like(info_u, np.nan)
        var_u = np.diag(cov_u)
        if np.any(var_u <= 0):
            warnings.warn("The Louis information is not positive definite.", stacklevel=2)
        jac = np.asarray(jax.jacfwd(self.info.theta_c_flat)(jnp.asarray(self.theta)))
        cov_c = jac @ cov_u @ jac.T
        se = np.sqrt(np.where(np.diag(cov_c) > 0, np.diag(cov_c), np.nan))
        return dict(zip(self.names, se.tolist(), strict=True))

    def summary(self):
        """DataFrame of estimates, standard errors and relative standard errors (%)."""
        import pandas as pd

        est = self.estimates()
        se = (self.standard_errors() if self.centring is not None
              else dict.fromkeys(est, np.nan))
        df = pd.DataFrame({"estimate": est, "se": se})
        df["rse_%"] = 100 * df["se"] / df["estimate"].abs()
        return df

    # -- latents ------------------------------------------------------------------------------
    def latent_samples(self) -> dict[str, np.ndarray]:
        """Constrained latent draws at the final :math:`\\theta`, ``(chains, draws, ...)``."""
        info = self.info
        T, C, dz = self.z_draws.shape
        flat = jnp.asarray(self.z_draws).reshape(T * C, dz)
        zc = jax.vmap(lambda f: info.constrain_z(f)[0])(flat)
        return {
            n: np.moveaxis(np.asarray(v).reshape((T, C) + v.shape[1:]), 0, 1)
            for n, v in zc.items()
        }

    @property
    def idata(self):
        """ArviZ InferenceData with the latent draws at the final :math:`\\theta`."""
        import arviz as az

        return az.from_dict(posterior=self.latent_samples())

    def conditional_means(self) -> dict[str, np.ndarray]:
        """Per-subject conditional means :math:`E[z_i\\mid y;\\hat\\theta]` of each latent site."""
        return {n: v.mean(axis=(0, 1)) for n, v in self.latent_samples().items()}

    # -- likelihood ---------------------------------------------------------------------------
    def log_likelihood(self, rng_key: jax.Array | None = None, *, method: str = "is",
                       num_samples: int = 5000, df: float = 4.0, batch_size: int = 500,
                       num_nodes: int | None = None, data_transforms: dict | None = None
                       ) -> dict:
        """Marginal log-likelihood at :math:`\\hat\\theta` (see
        :mod:`~numpyro_fed.saem.likelihood`).

        :param method: ``"is"`` (importance sampling, multivariate-t proposals per subject from
            the conditional mean and covariance of the draws; saemix's ``llis``), ``"gq"``
            (adaptive Gauss--Hermite quadrature, at most 3 latent coordinates per subject) or
            ``"laplace"`` (Laplace at the conditional modes).
        :param data_transforms: ``{site: T}`` for observed sites whose data are
            :math:`v = T^{-1}(y)` (e.g. ``ExpTransform()`` for an exponential error model
            written on :math:`\\log y`): the likelihood is then reported on the scale of
            :math:`y` (the Jacobian is added), so error models compare by AIC.
        :return: dict with ``loglik``, ``m2ll`` (:math:`-2\\ell`), ``m2ll_se`` (Monte Carlo
            standard error, 0 for the deterministic methods), ``aic``, ``bic`` (log of the
            number of subjects when there are subjects, else of the number of
            observations), ``method``, ``num_subjects``.
        """
        if method not in ("is", "gq", "laplace"):
            raise ValueError(f"method={method!r}: use 'is', 'gq' or 'laplace'.")
        info, layout = self.info, self.layout
        key = random.key(0) if rng_key is None else rng_key
        args, kwargs = self.args, self.kwargs
        theta_c = info.constrain_theta(jnp.asarray(self.theta))
        lay = layout if layout is not None else joint_layout(info)
        n = lay.n
        zs = jnp.asarray(self.z_draws)
        if method == "is":
            prog = self._program(
                ("is", num_samples, df, batch_size),
                lambda a, kw, ids: lambda tc, zs, key: lik.importance_sampling(
                    info, layout, ids, tc, zs, a, kw, key, num_samples=num_samples, df=df,
                    batch_size=batch_size))
            ll_i, var_i, rest = prog(theta_c, zs, key)
            se = float(2 * np.sqrt(np.sum(np.asarray(var_i, np.float64))))
        else:
            z_init = jnp.mean(zs.reshape(-1, zs.shape[-1]), 0)
            fn = lik.gauss_hermite if method == "gq" else lik.laplace
            kw = {"num_nodes": num_nodes} if method == "gq" else {}
            prog = self._program(
                (method, num_nodes),
                lambda a, kwa, ids: lambda tc, z0: fn(info, layout, ids, tc, z0, a, kwa, **kw))
            ll_i, rest = prog(theta_c, z_init)
            se = 0.0
        ll_i = np.asarray(ll_i, np.float64)
        if not np.all(np.isfinite(ll_i)):
            bad = np.nonzero(~np.isfinite(ll_i))[0]
            raise FloatingPointError(
                f"log_likelihood(method={method!r}): non-finite value for subject(s) "
                f"{bad[:10].tolist()}; try method='is' with more samples."
            )
        ll = float(ll_i.sum() + float(rest))
        if data_transforms:
            zc, _ = info.constrain_z(zs[0, 0])
            ll += float(lik.observation_jacobian(info, theta_c, zc, args, kwargs,
                                                 data_transforms))
        p = self.num_params
        nb = n if layout is not None else info.n_obs
        out = {
            "loglik": ll, "m2ll": -2 * ll, "m2ll_se": se,
            "aic": -2 * ll + 2 * p, "bic": -2 * ll + math.log(nb) * p,
            "method": method, "num_subjects": int(n),
        }
        if method == "is":
            out["num_samples"] = int(-(-num_samples // batch_size) * batch_size)
        self._ll[method] = out
        return out

    # -- diagnostics --------------------------------------------------------------------------
    def check_convergence(self, warn: bool = True) -> list[str]:
        """Signs of a fit that has not converged, as messages naming what to change (and
        warned as :class:`ConvergenceWarning` when ``warn``):

        - a coordinate of :math:`\\theta` still drifting at the end of the exploration phase:
          the change of its mean between the two halves of the last 40% of exploration is
          larger than 3 standard errors of that difference (batch means over 10 iterations)
          and than 1% of its value -> more ``num_exploration``;
        - a low acceptance rate of the E-step (< 5% on average over the final phase; not for
          ULA, whose moves are all taken: its recorded rate is the Metropolis ratio it skips);
        - a coordinate still moving in the averaging phase: its last value is further from
          the mean of the second half of the phase than 25% of that phase's range plus 1%.
        """
        msgs = []
        df = self.trajectory
        K1 = min(self.num_exploration, len(df))
        cols = self.names
        if K1 >= 50:
            seg = df[cols].to_numpy()[int(0.6 * K1):K1]
            h = len(seg) // 2
            a, b = seg[:h], seg[h:2 * h]
            nbm = max(h // 10, 2)

            def se_mean(x):
                m = len(x) // nbm
                bm = x[: m * nbm].reshape(nbm, m, -1).mean(1)
                return bm.std(0, ddof=1) / np.sqrt(nbm)

            diff = b.mean(0) - a.mean(0)
            se = np.sqrt(se_mean(a) ** 2 + se_mean(b) ** 2)
            scale = np.abs(b.mean(0))
            drift = (np.abs(diff) > 3 * se + 1e-12) & (np.abs(diff) > 0.01 * scale + 1e-12)
            if np.any(drift):
                names = [c for c, d in zip(cols, drift, strict=True) if d]
                msgs.append(
                    f"SAEM: {names} still drift at the end of the exploration phase "
                    f"({K1} iterations); lengthen both phases (e.g. Schedule(num_iters="
                    f"{2 * K1 + max(len(df) - K1, 200)}, num_exploration={2 * K1})) or give "
                    "initial values closer to the estimates."
                )
        final = df["accept_rate"].to_numpy()[K1:] if K1 < len(df) else df["accept_rate"].to_numpy()
        if final.size and self.settings.get("kernel") != "ula" and np.mean(final) < 0.05:
            msgs.append(
                f"SAEM: the E-step accepted {np.mean(final):.1%} of its moves in the final "
                "phase; the latent draws barely move (use the default adaptive E-step: "
                "step_size=None, or a smaller step_size)."
            )
        if K1 < len(df) - 20:
            tail = df[cols].to_numpy()[K1:]
            h = tail[len(tail) // 2:]
            rng = np.ptp(tail, 0)
            far = np.abs(tail[-1] - h.mean(0)) > 0.25 * rng + 0.01 * np.abs(h.mean(0)) + 1e-12
            if np.any(far):
                names = [c for c, d in zip(cols, far, strict=True) if d]
                msgs.append(
                    f"SAEM: {names} still move in the averaging phase; increase the number of "
                    "iterations after the exploration (Schedule(num_iters=...))."
                )
        if warn:
            for m in msgs:
                warnings.warn(m, ConvergenceWarning, stacklevel=3)
        return msgs

    # -- plots --------------------------------------------------------------------------------
    def plot_convergence(self, reference: dict | None = None, ncols: int = 4):
        """Trajectories of every coordinate of :math:`\\theta`; ``reference`` adds horizontal
        lines (e.g. true values or an exact maximum). Returns the matplotlib figure."""
        import matplotlib.pyplot as plt

        cols = self.names
        nrows = -(-len(cols) // ncols)
        fig, axes = plt.subplots(nrows, min(ncols, len(cols)), figsize=(3.2 * min(ncols, len(
            cols)), 2.4 * nrows), squeeze=False)
        for ax, c in zip(axes.flat, cols, strict=False):
            ax.plot(self.trajectory.index, self.trajectory[c], lw=1)
            if reference is not None and c in reference:
                ax.axhline(reference[c], color="k", ls=":", lw=1)
            ax.set_title(c, fontsize=9)
            ax.set_xlabel("iteration", fontsize=8)
        for ax in list(axes.flat)[len(cols):]:
            ax.axis("off")
        fig.tight_layout()
        return fig

    def __repr__(self) -> str:
        est = ", ".join(f"{k}={v:.4g}" for k, v in self.estimates().items())
        return f"SAEMResult(mstep={self.mstep!r}, {est})"
