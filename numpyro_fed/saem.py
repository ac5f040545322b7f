"""MCMC-SAEM: maximum marginal likelihood (empirical Bayes) for NumPyro models.

The user writes one NumPyro model: hyperparameters :math:`\\theta` are ``numpyro.param`` sites
(with constraints), latent variables :math:`z` are ``sample`` sites, data are observed sites.
:class:`SAEM` maximises :math:`\\ell(\\theta) = \\log p(y\\mid\\theta) = \\log\\int p(y, z\\mid
\\theta)\\,dz` by the MCMC-SAEM recursion of Kuhn & Lavielle (2004), in the form studied by the
MCMC-SAEM paper (``003``, Sec. 2.2, eq. (2)):

.. math::

    z_{k+1} \\sim \\Pi^{m}_{\\theta_k}(z_k, \\cdot), \\qquad
    s_{k+1} = s_k + \\gamma_{k+1}\\,(S(z_{k+1}) - s_k), \\qquad
    \\theta_{k+1} = \\hat\\theta(s_{k+1}),

where :math:`\\Pi_\\theta` is a Markov kernel targeting :math:`p(z\\mid y;\\theta)` (ULA or MALA,
Sec. 2.3; ``m = 4`` steps per iteration as in Sec. 5, warm-started from the last :math:`z`),
optionally with a :math:`\\theta`-dependent diagonal preconditioner (Sec. 5.4), or any NumPyro
:class:`~numpyro.infer.mcmc.MCMCKernel` (e.g. NUTS).

M-step, three ways:

(a) :class:`SufficientStatistics` -- the user gives :math:`S(z)` and :math:`\\hat\\theta(s)`
    (the curved exponential family of assumption H1/H2 of the paper).
(b) ``mstep="gaussian"`` -- recognised automatically: Gaussian latent sites
    :math:`z \\sim \\mathcal N(A\\beta + c, \\operatorname{diag}(\\omega^2))` (random effects on
    transformed individual parameters, covariates allowed, :math:`A` may be any constant design)
    and Gaussian observed sites whose scale is proportional to one parameter
    (:math:`\\sigma` for additive error, :math:`b\\,|f(z)|` for proportional error).
    The sufficient statistics are :math:`E[z]`, :math:`E[z^2]` and the weighted residual sums
    of squares; the M-step is closed form (generalised least squares for :math:`\\beta`, one
    pass of expectation-conditional maximisation when a coefficient is shared by elements
    with different variances).
(c) ``mstep="newton"`` -- any other model: stochastic-approximation Newton. SA averages of
    the complete-data score :math:`g` and Hessian :math:`H` (in unconstrained coordinates),
    with the quadratic surrogate transported along the iterates (Gu & Kong 1998), give the
    damped, preconditioned ascent :math:`\\theta^+ = \\theta + \\delta\\,(-H)^{-1}g`; no past
    :math:`z` is stored.

Step sizes :math:`\\gamma_k`: :class:`Schedule` -- an exploration phase at :math:`\\gamma = 1`
(optionally with saemix-style simulated annealing of the variances), then
:math:`\\gamma_k = k^{-a}` (the paper's :math:`a = 1/2`; saemix's :math:`a = 1`, which averages
the statistics over the final phase).

The whole loop is one compiled :func:`jax.lax.scan` (in a few equal chunks when a progress bar
is shown). :class:`SAEMResult` holds named estimates, the trajectory (pandas), a convergence
plot, the latent draws at the final :math:`\\theta` (ArviZ), :math:`-2\\ell` / AIC / BIC by
importance sampling, standard errors from the stochastic-approximation Louis information
(Delyon, Lavielle & Moulines 1999, Sec. 7; Kuhn & Lavielle 2005) and per-subject conditional
means.
"""

from __future__ import annotations

import copy
import math
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import numpyro.distributions as dist
from jax import lax, random
from jax.flatten_util import ravel_pytree
from numpyro.distributions import constraints
from numpyro.distributions.transforms import biject_to
from numpyro.handlers import block, seed, substitute, trace
from numpyro.infer.initialization import init_to_median
from numpyro.infer.mcmc import MCMCKernel
from numpyro.infer.util import compute_log_probs

from numpyro_fed.kernels.base import DivergenceError

__all__ = [
    "SAEM",
    "SAEMResult",
    "SAEMState",
    "Schedule",
    "SufficientStatistics",
    "annealed_importance_sampling",
]


# ============================================================================ schedule
@dataclass(frozen=True)
class Schedule:
    """Stochastic-approximation step sizes :math:`\\gamma_k` and phases of SAEM.

    :param num_iters: number of SAEM iterations (E-step + SA + M-step).
    :param num_exploration: iterations at :math:`\\gamma = 1` at the start (saemix's ``K1``).
    :param decay: exponent :math:`a` of :math:`\\gamma_k = (k - K_1 + 1)^{-a}` after the
        exploration phase; :math:`a \\in (0, 1]`. The MCMC-SAEM paper uses :math:`a = 1/2`
        (Sec. 5); saemix uses :math:`a = 1`, which makes the final phase an average of the
        statistics (needed for small variances such as :math:`\\omega^2_V` of Theophylline).
    :param num_burnin: MCMC steps at :math:`\\theta_0` before the first update.
    :param annealing: saemix-style simulated annealing during exploration: a variance
        parameter may decrease at most by the factor ``anneal_factor`` per iteration.
    :param anneal_factor: the factor (saemix's ``alpha.sa`` = 0.97).
    :param gammas: explicit sequence of step sizes (overrides the rule above; must be in
        :math:`(0, 1]` and non-increasing).
    """

    num_iters: int = 500
    num_exploration: int = 0
    decay: float = 0.5
    num_burnin: int = 10
    annealing: bool = False
    anneal_factor: float = 0.97
    gammas: tuple | None = None

    @classmethod
    def paper(cls, num_iters: int = 1000, num_burnin: int = 100) -> Schedule:
        """:math:`\\gamma_k = 1/\\sqrt{k}` from the first iteration (MCMC-SAEM paper, Sec. 5)."""
        return cls(num_iters=num_iters, num_exploration=0, decay=0.5, num_burnin=num_burnin)

    @classmethod
    def saemix(
        cls, k1: int = 300, k2: int = 100, num_burnin: int = 5, annealing: bool = True
    ) -> Schedule:
        """saemix's default: ``k1`` iterations at :math:`\\gamma = 1` (simulated annealing of
        the variances) then ``k2`` iterations at :math:`\\gamma_k = 1/k`."""
        return cls(
            num_iters=k1 + k2, num_exploration=k1, decay=1.0, num_burnin=num_burnin,
            annealing=annealing,
        )

    def validate(self) -> None:
        for name in ("num_iters", "num_exploration", "num_burnin"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int | np.integer) or v < 0:
                raise ValueError(f"Schedule.{name} must be a non-negative int, got {v!r}.")
        if self.num_iters < 1:
            raise ValueError("Schedule.num_iters must be at least 1.")
        if self.gammas is None:
            if not 0.0 < self.decay <= 1.0:
                raise ValueError(
                    f"Schedule.decay={self.decay!r}: the step sizes gamma_k = k^-a must "
                    "decrease (a > 0) with sum gamma_k = infinity (a <= 1); use a in (0, 1] "
                    "(0.5 as in the MCMC-SAEM paper, 1 as in saemix)."
                )
        if not 0.0 < self.anneal_factor <= 1.0:
            raise ValueError("Schedule.anneal_factor must lie in (0, 1].")

    def gamma_sequence(self) -> np.ndarray:
        """The step sizes :math:`\\gamma_1, \\dots, \\gamma_K` (validated)."""
        self.validate()
        if self.gammas is not None:
            g = np.asarray(self.gammas, dtype=np.float64).reshape(-1)
            if g.size != self.num_iters:
                raise ValueError(
                    f"Schedule.gammas has {g.size} values but num_iters={self.num_iters}."
                )
        else:
            k = np.arange(self.num_iters, dtype=np.float64)
            after = np.maximum(k - self.num_exploration + 1.0, 1.0)
            g = np.where(k < self.num_exploration, 1.0, after ** (-self.decay))
        if np.any(~np.isfinite(g)) or np.any(g <= 0) or np.any(g > 1):
            raise ValueError("SAEM step sizes gamma_k must lie in (0, 1].")
        if np.any(np.diff(g) > 1e-12):
            bad = int(np.argmax(np.diff(g) > 1e-12))
            raise ValueError(
                f"The SAEM schedule does not decrease: gamma[{bad + 1}]={g[bad + 1]:.4g} > "
                f"gamma[{bad}]={g[bad]:.4g}. Stochastic approximation needs non-increasing "
                "step sizes (paper, Sec. 2.4); give a non-increasing `gammas`."
            )
        return g


# ============================================================================ M-step (a)
@dataclass(frozen=True)
class SufficientStatistics:
    """User-given exponential-family M-step (MCMC-SAEM paper, assumptions H1--H2).

    :param stats: ``stats(z, *model_args, **model_kwargs)`` -> pytree :math:`S(y, z)`, where
        ``z`` is a dict of constrained latent values of one chain.
    :param maximizer: ``maximizer(s, *model_args, **model_kwargs)`` -> dict of constrained
        values of the ``param`` sites, :math:`\\hat\\theta(s)`.
    """

    stats: Callable
    maximizer: Callable


# ============================================================================ state
class SAEMState(NamedTuple):
    """Carry of the compiled SAEM loop.

    - **k** -- iteration counter.
    - **z** -- latent values, flat unconstrained, one row per chain ``(C, d_z)``.
    - **theta** -- flat unconstrained :math:`\\theta_k`.
    - **mstate** -- state of the M-step (SA statistics :math:`s_k`, or Newton's ``(g, H)``).
    - **kstate** -- state of a NumPyro E-step kernel (``()`` for the built-in ULA/MALA).
    - **louis** -- SA averages ``(score, score score^T + Hessian)`` for the Louis information.
    - **rng_key** -- random key.
    - **bad_iter** -- first iteration with a non-finite E-step (-1: none).
    - **bad_theta** -- :math:`\\theta` (unconstrained) at that iteration.
    """

    k: jax.Array
    z: jax.Array
    theta: jax.Array
    mstate: Any
    kstate: Any
    louis: Any
    rng_key: jax.Array
    bad_iter: jax.Array
    bad_theta: jax.Array


# ============================================================================ model info
def _unwrap_normal(fn, value):
    """Return ``(loc, scale, mask)`` broadcast to ``value``'s shape if ``fn`` is a (masked,
    expanded, independent) Normal, else ``None``."""
    mask = None
    d = fn
    while True:
        if isinstance(d, dist.MaskedDistribution):
            m = d._mask
            mask = m if mask is None else jnp.logical_and(mask, m)
            d = d.base_dist
        elif isinstance(d, dist.Independent | dist.ExpandedDistribution):
            d = d.base_dist
        elif type(d) is dist.Normal:
            shape = jnp.shape(value)
            m = jnp.ones(shape, bool) if mask is None else jnp.broadcast_to(mask, shape)
            return (
                jnp.broadcast_to(d.loc, shape),
                jnp.broadcast_to(d.scale, shape),
                m,
            )
        else:
            return None


class _Model:
    """Static description of the user's model: param sites, latent sites, flat layouts."""

    def __init__(self, model, args, kwargs, key):
        tr = trace(seed(model, key)).get_trace(*args, **kwargs)
        self.model = model
        params = {n: s for n, s in tr.items() if s["type"] == "param"}
        latents = {
            n: s for n, s in tr.items() if s["type"] == "sample" and not s["is_observed"]
        }
        observed = {n: s for n, s in tr.items() if s["type"] == "sample" and s["is_observed"]}
        if not params:
            raise ValueError(
                "SAEM: the model has no `numpyro.param` site. Declare the hyperparameters "
                "to estimate as `numpyro.param(name, init_value, constraint=...)`."
            )
        if not latents:
            raise ValueError(
                "SAEM: the model has no latent `sample` site (all sample sites are observed). "
                "SAEM integrates out latent variables; without them maximise the likelihood "
                "directly (e.g. numpyro.infer.SVI with a Delta guide or an optimiser)."
            )
        self.param_names = sorted(params)
        self.latent_names = sorted(latents)
        self.observed_names = sorted(observed)
        self.param_constraints = {
            n: s["kwargs"].get("constraint", constraints.real) for n, s in params.items()
        }
        self.param_transforms = {n: biject_to(c) for n, c in self.param_constraints.items()}
        self.latent_transforms = {n: biject_to(latents[n]["fn"].support) for n in latents}
        theta0_c = {n: jnp.asarray(params[n]["value"]) for n in params}
        self.theta0_c = theta0_c
        theta0_u = {n: self.param_transforms[n].inv(v) for n, v in theta0_c.items()}
        self.theta0_u_flat, self._unravel_theta = ravel_pytree(theta0_u)
        _, self._unravel_theta_c = ravel_pytree(theta0_c)
        z0_c = {n: jnp.asarray(latents[n]["value"]) for n in latents}
        z0_u = {n: self.latent_transforms[n].inv(v) for n, v in z0_c.items()}
        self.z0_u_flat, self._unravel_z = ravel_pytree(z0_u)
        self.z_shapes = {n: jnp.shape(v) for n, v in z0_c.items()}
        self.z_u_shapes = {n: jnp.shape(v) for n, v in z0_u.items()}
        self.dim_theta = int(self.theta0_u_flat.size)
        self.dim_z = int(self.z0_u_flat.size)
        self.trace0 = tr
        self.n_obs = int(sum(np.size(observed[n]["value"]) for n in observed))
        # names of flat theta coordinates
        self.theta_coord_names = []
        for n in self.param_names:
            size = int(np.size(theta0_c[n]))
            if np.ndim(theta0_c[n]) == 0:
                self.theta_coord_names.append(n)
            else:
                idx = np.array(np.unravel_index(np.arange(size), np.shape(theta0_c[n]))).T
                self.theta_coord_names += [f"{n}[{','.join(map(str, i))}]" for i in idx]

    # -- theta ------------------------------------------------------------------------------
    def constrain_theta(self, theta_u_flat) -> dict:
        u = self._unravel_theta(theta_u_flat)
        return {n: self.param_transforms[n](v) for n, v in u.items()}

    def unconstrain_theta(self, theta_c: dict):
        u = {n: self.param_transforms[n].inv(jnp.asarray(theta_c[n])) for n in self.param_names}
        return ravel_pytree(u)[0]

    def theta_c_flat(self, theta_u_flat):
        return ravel_pytree(self.constrain_theta(theta_u_flat))[0]

    # -- latents ----------------------------------------------------------------------------
    def constrain_z(self, z_u_flat):
        u = self._unravel_z(z_u_flat)
        zc = {n: self.latent_transforms[n](v) for n, v in u.items()}
        logj = sum(
            jnp.sum(self.latent_transforms[n].log_abs_det_jacobian(u[n], zc[n])) for n in u
        )
        return zc, logj

    def unconstrain_z(self, z_c: dict):
        u = {n: self.latent_transforms[n].inv(jnp.asarray(z_c[n])) for n in self.latent_names}
        return ravel_pytree(u)[0]

    # -- densities --------------------------------------------------------------------------
    def log_joint_c(self, theta_c, z_c, args, kwargs):
        lps, _ = compute_log_probs(self.model, args, kwargs, {**theta_c, **z_c})
        return sum(lps.values())

    def log_joint(self, theta_u_flat, z_u_flat, args, kwargs):
        """:math:`\\log p(y, z\\mid\\theta) + \\log|J(z)|` on flat unconstrained vectors."""
        zc, logj = self.constrain_z(z_u_flat)
        return self.log_joint_c(self.constrain_theta(theta_u_flat), zc, args, kwargs) + logj

    def trace_at(self, theta_c, z_c, args, kwargs):
        return trace(substitute(self.model, data={**theta_c, **z_c})).get_trace(*args, **kwargs)


# ============================================================================ M-step (b)
class _GaussianSpec(NamedTuple):
    latent_sites: tuple  # names of Gaussian latent sites
    obs_sites: tuple  # names of Gaussian observed sites
    A: np.ndarray  # (n_lat, n_loc)
    c: np.ndarray  # (n_lat,)
    loc_idx: np.ndarray  # flat constrained-theta indices of the location coefficients
    lat_g: np.ndarray  # (n_lat,) flat theta index of each latent element's scale
    lat_r: np.ndarray  # (n_lat,) constant ratio scale / theta[g]
    obs_g: dict  # site -> (n_site,) flat theta index of the scale of each element
    scale_lat_idx: np.ndarray  # flat theta indices of latent scale parameters
    scale_obs_idx: np.ndarray  # flat theta indices of residual scale parameters


def _allclose(a, b, rtol=2e-3, atol_scale=1e-5):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    atol = atol_scale * max(1.0, float(np.max(np.abs(a))) if a.size else 1.0)
    return a.shape == b.shape and bool(np.all(np.abs(a - b) <= atol + rtol * np.abs(b)))


def _detect_gaussian(info: _Model, args, kwargs, key) -> tuple[_GaussianSpec | None, str]:
    """Recognise the Gaussian random-effects / Gaussian-residual family by numerical probes.

    Returns ``(spec, "")`` or ``(None, reason)``. Probes: three values of :math:`\\theta`
    and two of :math:`z`; a structure is accepted only if the location is exactly affine
    in the location parameters with a design independent of :math:`z` and :math:`\\theta`,
    the scale is exactly proportional to a single positive parameter, and the rest of the
    log joint density does not depend on :math:`\\theta`.
    """
    tc0 = {n: jnp.asarray(v) for n, v in info.theta0_c.items()}
    tc0_flat, unravel_c = ravel_pytree(tc0)
    dtheta = int(tc0_flat.size)
    names_of_coord = np.concatenate(
        [np.full(int(np.size(tc0[n])), i) for i, n in enumerate(info.param_names)]
    )
    k1, k2, k3 = random.split(key, 3)
    # probe points: positive params are perturbed multiplicatively, real ones additively
    tu0 = info.theta0_u_flat
    probes_u = [tu0, tu0 + 0.3 * random.normal(k1, tu0.shape), tu0 - 0.2 + 0.25 * random.normal(
        k2, tu0.shape)]
    probes_c = [ravel_pytree(info.constrain_theta(t))[0] for t in probes_u]
    z0 = info.z0_u_flat
    zs = [z0, z0 + 0.2 * random.normal(k3, z0.shape)]

    def parts(tcf, zf):
        zc, _ = info.constrain_z(zf)
        tr = info.trace_at(unravel_c(tcf), zc, args, kwargs)
        out = {}
        for n, s in tr.items():
            if s["type"] != "sample":
                continue
            p = _unwrap_normal(s["fn"], s["value"])
            out[n] = (p, s["value"], s.get("scale"))
        return out

    out0 = parts(probes_c[0], zs[0])
    normal_sites = [n for n, (p, _, sc) in out0.items() if p is not None and sc is None]
    if not normal_sites:
        return None, "the model has no Normal sample site"

    def loc_scale(tcf, zf):
        out = parts(tcf, zf)
        return {n: (out[n][0][0].reshape(-1), out[n][0][1].reshape(-1)) for n in normal_sites}

    def site_log_probs(tcf, zf):
        zc, _ = info.constrain_z(zf)
        lps, _ = compute_log_probs(info.model, args, kwargs, {**unravel_c(tcf), **zc},
                                   sum_log_prob=True)
        return lps

    def probe(P, Z):
        jac_val = jax.jacfwd(lambda t, z: (loc_scale(t, z),) * 2, has_aux=True)
        jacs, vals = jax.vmap(jax.vmap(jac_val, (None, 0)), (0, None))(P, Z)
        return vals, jacs, jax.vmap(site_log_probs, (0, None))(P, Z[0])

    # ONE compiled evaluation of values, Jacobians and per-site log densities at the probes
    P, Z = jnp.stack(probes_c), jnp.stack(zs)
    vals, jacs, site_lps = jax.tree.map(np.asarray, jax.jit(probe)(P, Z))
    pz = [(i, j) for i in range(len(probes_c)) for j in range(len(zs))]

    lat_blocks, obs_blocks = [], []
    loc_params, scale_params_lat, scale_params_obs = set(), set(), set()
    for n in normal_sites:
        observed = n in info.observed_names
        Jl = [jacs[n][0][i, j] for i, j in pz]
        Js = [jacs[n][1][i, j] for i, j in pz]
        dep_loc = {int(names_of_coord[j]) for J in Jl for j in np.nonzero(np.any(J != 0, 0))[0]}
        dep_scale = {int(names_of_coord[j]) for J in Js for j in np.nonzero(np.any(J != 0, 0))[0]}
        if not dep_loc and not dep_scale:
            continue  # a Normal site with fixed hyperparameters: not part of the M-step
        if not dep_scale:
            return None, f"the scale of site '{n}' does not depend on a parameter"
        if dep_loc & dep_scale:
            return None, f"the location and scale of site '{n}' share a parameter"
        for sp in dep_scale:
            if not isinstance(
                info.param_constraints[info.param_names[sp]], type(constraints.positive)
            ):
                return None, f"scale parameter '{info.param_names[sp]}' is not positive"
        cols = np.nonzero(np.isin(names_of_coord, sorted(dep_scale)))[0]
        # proportionality: scale_k = r_k * theta[g(k)], exactly one parameter per element
        for J in Js:
            if np.any(np.count_nonzero(J[:, cols], axis=1) != 1):
                return None, f"site '{n}': each scale must be proportional to one parameter"
        J0 = Js[0][:, cols]
        g_local = np.argmax(J0 != 0, axis=1)
        g = cols[g_local]
        for (i, j), J in zip(pz, Js, strict=True):
            t = probes_c[i]
            sc = vals[n][1][i, j]
            if not _allclose(sc, np.asarray(J[:, cols] @ np.asarray(t)[cols])):
                return None, f"the scale of site '{n}' is not proportional to its parameter"
        if observed:
            if dep_loc:
                return None, f"the location of observed site '{n}' depends on a parameter"
            obs_blocks.append((n, g))
            scale_params_obs |= dep_scale
        else:
            if not all(_allclose(J, Js[0]) for J in Js):
                return None, f"the scale of latent site '{n}' depends on z or other parameters"
            r = J0[np.arange(J0.shape[0]), g_local]
            lcols = np.nonzero(np.isin(names_of_coord, sorted(dep_loc)))[0]
            if not all(_allclose(J[:, lcols], Jl[0][:, lcols]) for J in Jl):
                return None, f"the location of latent site '{n}' is not affine with a fixed design"
            A_full = Jl[0]
            loc0 = vals[n][0][0, 0]
            c_full = loc0 - A_full[:, lcols] @ np.asarray(probes_c[0])[lcols]
            for i in range(1, len(probes_c)):
                pred = A_full[:, lcols] @ np.asarray(probes_c[i])[lcols] + c_full
                if not _allclose(vals[n][0][i, 1], pred):
                    return None, f"the location of latent site '{n}' is not affine"
            for p in dep_loc:
                if info.param_constraints[info.param_names[p]] not in (
                    constraints.real, constraints.real_vector
                ):
                    return None, f"location parameter '{info.param_names[p]}' is constrained"
            lat_blocks.append((n, A_full, c_full, g, r))
            loc_params |= dep_loc
            scale_params_lat |= dep_scale
    if scale_params_lat & scale_params_obs:
        return None, "a scale parameter is shared by latent and observed sites"
    if loc_params & (scale_params_lat | scale_params_obs):
        return None, "a parameter is both a location and a scale"
    covered = loc_params | scale_params_lat | scale_params_obs
    if covered != set(range(len(info.param_names))):
        missing = [info.param_names[i] for i in sorted(set(range(len(info.param_names))) - covered)]
        return None, f"parameters {missing} are not locations or scales of Normal sites"
    if not lat_blocks:
        return None, "no Gaussian latent site depends on the parameters"
    # the rest of the log density must not depend on theta
    rest_names = tuple(b[0] for b in lat_blocks) + tuple(b[0] for b in obs_blocks)

    r0 = [float(sum(np.float64(v[i]) for k, v in site_lps.items() if k not in rest_names))
          for i in range(len(probes_c))]
    if not _allclose(np.array(r0), np.full(3, r0[0]), rtol=1e-5, atol_scale=1e-5):
        return None, "other sites of the model depend on the parameters"
    loc_idx = np.nonzero(np.isin(names_of_coord, sorted(loc_params)))[0]
    A = np.concatenate([b[1][:, loc_idx] for b in lat_blocks], 0)
    c = np.concatenate([b[2] for b in lat_blocks])
    lat_g = np.concatenate([b[3] for b in lat_blocks])
    lat_r = np.concatenate([b[4] for b in lat_blocks])
    spec = _GaussianSpec(
        latent_sites=tuple(b[0] for b in lat_blocks),
        obs_sites=tuple(b[0] for b in obs_blocks),
        A=A, c=c, loc_idx=loc_idx, lat_g=lat_g, lat_r=lat_r,
        obs_g={b[0]: b[1] for b in obs_blocks},
        scale_lat_idx=np.nonzero(np.isin(names_of_coord, sorted(scale_params_lat)))[0],
        scale_obs_idx=np.nonzero(np.isin(names_of_coord, sorted(scale_params_obs)))[0],
    )
    del dtheta
    return spec, ""


class _ExpFamMStep:
    """Stochastic approximation on sufficient statistics + closed-form maximiser."""

    kind = "sufficient-statistics"

    def __init__(self, info: _Model, stats, maximize):
        self.info, self._stats, self._maximize = info, stats, maximize

    def mean_stats(self, theta_u, z, args, kwargs):
        def one(zf):
            zc, _ = self.info.constrain_z(zf)
            return self._stats(zc, self.info.constrain_theta(theta_u), args, kwargs)

        return jax.tree.map(lambda v: jnp.mean(v, 0), jax.vmap(one)(z))

    def init(self, theta_u, z, args, kwargs):
        return self.mean_stats(theta_u, z, args, kwargs)

    def update(self, mstate, gamma, theta_u, z, args, kwargs, score_hess):
        s_new = self.mean_stats(theta_u, z, args, kwargs)
        s = jax.tree.map(lambda a, b: a + gamma * (b - a), mstate, s_new)
        theta_c = self._maximize(s, self.info.constrain_theta(theta_u), args, kwargs)
        return self.info.unconstrain_theta(theta_c), s

    def transport(self, mstate, step):
        return mstate


def _user_mstep(info: _Model, ss: SufficientStatistics) -> _ExpFamMStep:
    def stats(zc, theta_c, args, kwargs):
        return ss.stats(zc, *args, **kwargs)

    def maximize(s, theta_c_old, args, kwargs):
        new = ss.maximizer(s, *args, **kwargs)
        missing = set(info.param_names) - set(new)
        if missing:
            raise ValueError(
                f"SufficientStatistics.maximizer returned no value for param sites "
                f"{sorted(missing)}; it must return a dict with every `param` site."
            )
        return {n: jnp.asarray(new[n], jnp.result_type(float)) for n in info.param_names}

    return _ExpFamMStep(info, stats, maximize)


def _gaussian_mstep(info: _Model, spec: _GaussianSpec, num_ecm: int = 3) -> _ExpFamMStep:
    A = jnp.asarray(spec.A)
    c = jnp.asarray(spec.c)
    lat_g = jnp.asarray(spec.lat_g)
    lat_r = jnp.asarray(spec.lat_r)
    d = int(info.theta0_u_flat.size)
    _, unravel_c = ravel_pytree(info.theta0_c)
    cnt_lat = np.bincount(spec.lat_g, minlength=d).astype(np.float64)
    is_lat_scale = np.zeros(d, bool)
    is_lat_scale[spec.scale_lat_idx] = True
    is_obs_scale = np.zeros(d, bool)
    is_obs_scale[spec.scale_obs_idx] = True

    def stats(zc, theta_c, args, kwargs):
        zl = jnp.concatenate([zc[n].reshape(-1) for n in spec.latent_sites])
        R = jnp.zeros(d)
        N = jnp.zeros(d)
        if spec.obs_sites:
            tr = info.trace_at(theta_c, zc, args, kwargs)
            tcf = ravel_pytree(theta_c)[0]
            for n in spec.obs_sites:
                s = tr[n]
                loc, scale, mask = _unwrap_normal(s["fn"], s["value"])
                g = jnp.asarray(spec.obs_g[n])
                rr = scale.reshape(-1) / tcf[g]
                res = ((s["value"].reshape(-1) - loc.reshape(-1)) / rr) ** 2
                w = mask.reshape(-1).astype(res.dtype)
                R = R + jax.ops.segment_sum(jnp.where(w > 0, res, 0.0), g, d)
                N = N + jax.ops.segment_sum(w, g, d)
        return {"m1": zl, "m2": zl**2, "R": R, "N": N}

    def maximize(s, theta_c_old, args, kwargs):
        t = ravel_pytree(theta_c_old)[0]
        m1, m2 = s["m1"], s["m2"]
        for _ in range(num_ecm if spec.loc_idx.size else 1):
            if spec.loc_idx.size:
                sig = t[lat_g] * lat_r
                w = 1.0 / sig**2
                AtW = A.T * w
                M = AtW @ A
                ridge = 1e-10 * jnp.trace(M) / M.shape[0]
                beta = jnp.linalg.solve(M + ridge * jnp.eye(M.shape[0]), AtW @ (m1 - c))
                t = t.at[spec.loc_idx].set(beta)
                mlat = A @ beta + c
            else:
                mlat = c
            e2 = (m2 - 2.0 * mlat * m1 + mlat**2) / lat_r**2
            var = jax.ops.segment_sum(e2, lat_g, d) / jnp.maximum(cnt_lat, 1.0)
            t = jnp.where(is_lat_scale, jnp.sqrt(jnp.maximum(var, 1e-30)), t)
        var_obs = s["R"] / jnp.maximum(s["N"], 1.0)
        t = jnp.where(is_obs_scale, jnp.sqrt(jnp.maximum(var_obs, 1e-30)), t)
        return unravel_c(t)

    m = _ExpFamMStep(info, stats, maximize)
    m.kind = "gaussian"
    m.spec = spec
    return m


# ============================================================================ M-step (c)
class _NewtonMStep:
    """Stochastic-approximation Newton on the SA-averaged complete-data log-likelihood.

    Keeps SA averages of the score :math:`g` and Hessian :math:`H` of
    :math:`\\log p(y, z\\mid\\theta)` (unconstrained :math:`\\theta`); the quadratic surrogate
    is transported along the iterates (:math:`g \\leftarrow g + H\\,\\Delta\\theta`), so that an
    undamped step gives Gu & Kong's (1998) SA Newton--Raphson
    :math:`\\theta^+ = \\theta + \\gamma (-H)^{-1}\\nabla\\log p(y, z\\mid\\theta)`.
    Where :math:`-H` is not positive definite (far from the maximum) its eigenvalues are
    replaced by their absolute values (saddle-free Newton, Dauphin et al. 2014), floored at
    ``eig_floor`` times the largest; each coordinate of a step is clipped to ``max_step``.
    """

    kind = "newton"

    def __init__(self, info, damping: float = 1.0, max_step: float = 1.0, eig_floor=1e-4):
        self.info = info
        self.damping = float(damping)
        self.max_step = float(max_step)
        self.eig_floor = float(eig_floor)

    def init(self, theta_u, z, args, kwargs):
        d = self.info.dim_theta
        dt = jnp.result_type(theta_u)
        return (jnp.zeros(d, dt), jnp.zeros((d, d), dt), jnp.zeros((d, d), dt))

    def update(self, mstate, gamma, theta_u, z, args, kwargs, score_hess):
        g, H, _ = mstate
        sc, he = score_hess
        g = g + gamma * (sc - g)
        H = H + gamma * (he - H)
        # saddle-free modification of -H: |eigenvalues|, floored relative to the largest
        lam, V = jnp.linalg.eigh(-(H + H.T) / 2.0)
        lam = jnp.abs(lam)
        lam = jnp.maximum(lam, jnp.maximum(self.eig_floor * jnp.max(lam), 1e-12))
        step = self.damping * (V @ ((V.T @ g) / lam))
        step = jnp.clip(step, -self.max_step, self.max_step)
        Hmod = -(V * lam) @ V.T
        return theta_u + step, (g, H, Hmod)

    def transport(self, mstate, step):
        g, H, Hmod = mstate
        return (g + Hmod @ step, H, Hmod)


# ============================================================================ E-step
def _flat_preconditioner(info: _Model, precond: Callable | None):
    if precond is None:
        return None

    def P(theta_u):
        p = precond(info.constrain_theta(theta_u))
        if not isinstance(p, dict):
            return jnp.broadcast_to(jnp.asarray(p), (info.dim_z,))
        full = {
            n: jnp.broadcast_to(jnp.asarray(p.get(n, 1.0)), info.z_u_shapes[n])
            for n in info.latent_names
        }
        return ravel_pytree(full)[0]

    return P


# ============================================================================ SAEM
class SAEM:
    """MCMC-SAEM for maximum marginal likelihood of the ``param`` sites of a NumPyro model.

    :param model: a NumPyro model; ``numpyro.param`` sites are :math:`\\theta` (their
        ``constraint`` is respected), latent ``sample`` sites are :math:`z`.
    :param kernel: ``"ula"`` or ``"mala"`` (built-in, pure-JAX, optionally preconditioned), a
        NumPyro :class:`~numpyro.infer.mcmc.MCMCKernel` instance that implements
        ``wrap_model`` and ``refresh`` (e.g. ``NUTS(model)``), or a factory
        ``f(conditioned_model) -> MCMCKernel`` (e.g. ``lambda m: numpyro_fed.MALA(m, ...)``).
        NumPyro kernels receive :math:`\\theta` through the model keyword ``_saem_theta`` and are
        re-bound to each new :math:`\\theta` with ``refresh``.
    :param step_size: Langevin step size :math:`\\eta` of ULA/MALA.
    :param num_mcmc_steps: kernel steps per SAEM iteration (``m``, default 4 as in the paper).
    :param num_chains: independent chains of :math:`z`; statistics are averaged over chains
        (use several when subjects are few).
    :param schedule: a :class:`Schedule` (default: the paper's :math:`1/\\sqrt k`, 500 iterations).
    :param mstep: ``"auto"`` (closed-form Gaussian if recognised, else Newton), ``"gaussian"``,
        ``"newton"``, or a :class:`SufficientStatistics`.
    :param preconditioner: ``P(theta) -> dict`` of diagonal preconditioners per latent site
        (unconstrained space), or a flat array; ULA/MALA then move
        :math:`z - \\eta P\\nabla U + \\sqrt{2\\eta P}\\,\\xi` (MCMC-SAEM paper, Sec. 5.4).
    :param fisher: accumulate the SA Louis information for standard errors (costs one Hessian
        in :math:`\\theta` per iteration); default: when :math:`\\dim\\theta \\le 50`.
    :param annealed: names of ``param`` sites subject to simulated annealing when
        ``schedule.annealing`` (default: the variance parameters recognised by the Gaussian
        M-step; every positive parameter for the other M-steps).
    :param subject_plate: name of the plate indexing independent subjects (importance-sampling
        likelihood is then computed per subject); auto-detected when ``None``.
    :param mh_blocks: MALA's accept/reject test: ``"joint"`` (one test for the whole latent
        vector of a chain, the paper's MALA), ``"subject"`` (one test per subject: valid because
        :math:`p(z\\mid y;\\theta) = \\prod_i p(z_i\\mid y_i;\\theta)` over the subject plate,
        as in saemix's per-subject Metropolis steps; with many subjects a joint test rejects
        almost every proposal and a chain can freeze far in the tail) or ``"auto"``
        (``"subject"`` when the model has a subject plate, else ``"joint"``).
    :param prior_proposals: independence Metropolis--Hastings steps with the prior
        :math:`p(z\\mid\\theta)` as proposal before the Langevin steps of every E-step
        (saemix's kernel 1; accepted per subject as with ``mh_blocks``). They let chains jump
        between separated modes of :math:`p(z_i\\mid y_i;\\theta)` (nonlinear mixed-effects
        models have them), which Langevin steps cross only rarely. Default 0: the paper's
        E-step.
    :param newton_damping: damping :math:`\\delta` of the Newton M-step.
    :param newton_max_step: per-coordinate clip of a Newton step (unconstrained units).
    :param num_draws: draws per chain of :math:`z` kept at the final :math:`\\theta`.
    :param init_strategy: NumPyro initialisation strategy of the latents at :math:`\\theta_0`
        (default ``init_to_median``: the population mean for Gaussian random effects).
    :param init_jitter: standard deviation of the jitter of chains > 0 (unconstrained space).
    """

    def __init__(
        self,
        model: Callable,
        *,
        kernel: str | MCMCKernel | Callable = "ula",
        step_size: float = 1e-2,
        num_mcmc_steps: int = 4,
        num_chains: int = 1,
        schedule: Schedule | None = None,
        mstep: str | SufficientStatistics = "auto",
        preconditioner: Callable | None = None,
        fisher: bool | None = None,
        annealed: Sequence[str] | None = None,
        subject_plate: str | None = None,
        mh_blocks: str = "auto",
        prior_proposals: int = 0,
        newton_damping: float = 1.0,
        newton_max_step: float = 1.0,
        num_draws: int = 200,
        init_strategy: Callable = init_to_median,
        init_jitter: float = 0.1,
    ) -> None:
        self.model = model
        if isinstance(kernel, str):
            if kernel.lower() not in ("ula", "mala"):
                raise ValueError(f"kernel={kernel!r}: use 'ula', 'mala' or an MCMCKernel.")
            kernel = kernel.lower()
        elif not (isinstance(kernel, MCMCKernel) or callable(kernel)):
            raise TypeError("`kernel` must be 'ula', 'mala', an MCMCKernel or a factory.")
        self.kernel = kernel
        if not (isinstance(step_size, int | float) and math.isfinite(step_size) and step_size > 0):
            raise ValueError(f"`step_size` must be a positive number, got {step_size!r}.")
        self.step_size = float(step_size)
        for name, v in (("num_mcmc_steps", num_mcmc_steps), ("num_chains", num_chains),
                        ("num_draws", num_draws)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"`{name}` must be a positive int, got {v!r}.")
        self.num_mcmc_steps = num_mcmc_steps
        self.num_chains = num_chains
        self.num_draws = num_draws
        self.init_strategy = init_strategy
        self.init_jitter = float(init_jitter)
        self.schedule = Schedule() if schedule is None else schedule
        if not isinstance(self.schedule, Schedule):
            raise TypeError("`schedule` must be a numpyro_fed.saem.Schedule.")
        self.gammas = self.schedule.gamma_sequence()
        if not (isinstance(mstep, SufficientStatistics) or mstep in ("auto", "gaussian", "newton")):
            raise ValueError(
                f"mstep={mstep!r}: use 'auto', 'gaussian', 'newton' or SufficientStatistics."
            )
        self.mstep_spec = mstep
        self.preconditioner = preconditioner
        self.fisher = fisher
        self.annealed = annealed
        self.subject_plate = subject_plate
        if mh_blocks not in ("auto", "subject", "joint"):
            raise ValueError(f"mh_blocks={mh_blocks!r}: use 'auto', 'subject' or 'joint'.")
        self.mh_blocks = mh_blocks
        if isinstance(prior_proposals, bool) or not isinstance(prior_proposals, int) \
                or prior_proposals < 0:
            raise ValueError(
                f"`prior_proposals` must be a non-negative int, got {prior_proposals!r}."
            )
        if prior_proposals and not isinstance(kernel, str):
            raise ValueError("`prior_proposals` applies to the built-in 'ula'/'mala' E-steps.")
        self.prior_proposals = prior_proposals
        self.newton_damping = newton_damping
        self.newton_max_step = newton_max_step

    # ------------------------------------------------------------------ building blocks
    def _setup(self, rng_key, args, kwargs, init_params):
        info = _Model(self.model, args, kwargs, rng_key)
        self.info = info
        self._layout = None
        uses_blocks = self.kernel == "mala" or (self.kernel == "ula" and self.prior_proposals)
        if self.mh_blocks != "joint" and uses_blocks:
            self._layout = _subject_layout(info, self.subject_plate, args, kwargs)
            if self._layout is None and self.mh_blocks == "subject":
                raise ValueError(
                    "mh_blocks='subject': the model has no plate containing every sample site "
                    "(with the subject axis in every log-density); use mh_blocks='joint'."
                )
        # M-step
        reason = ""
        if isinstance(self.mstep_spec, SufficientStatistics):
            mstep = _user_mstep(info, self.mstep_spec)
        elif self.mstep_spec == "newton":
            mstep = _NewtonMStep(info, self.newton_damping, self.newton_max_step)
        else:
            spec, reason = _detect_gaussian(info, args, kwargs, random.fold_in(rng_key, 7))
            if spec is not None:
                mstep = _gaussian_mstep(info, spec)
            elif self.mstep_spec == "gaussian":
                raise ValueError(
                    f"mstep='gaussian': the model is not of the recognised Gaussian family "
                    f"({reason}). Use mstep='newton' or give SufficientStatistics."
                )
            else:
                mstep = _NewtonMStep(info, self.newton_damping, self.newton_max_step)
        self.mstep = mstep
        self.mstep_reason = reason
        fisher = self.fisher if self.fisher is not None else info.dim_theta <= 50
        self._use_fisher = bool(fisher)
        # annealing mask on flat constrained coordinates
        ann = np.zeros(info.dim_theta, bool)
        if self.schedule.annealing:
            if self.annealed is not None:
                names = list(self.annealed)
                unknown = set(names) - set(info.param_names)
                if unknown:
                    raise ValueError(f"`annealed` names unknown param sites {sorted(unknown)}.")
                offs = np.cumsum([0] + [int(np.size(info.theta0_c[n])) for n in info.param_names])
                for i, n in enumerate(info.param_names):
                    if n in names:
                        ann[offs[i]:offs[i + 1]] = True
            elif getattr(mstep, "kind", "") == "gaussian":
                ann[mstep.spec.scale_lat_idx] = True
                ann[mstep.spec.scale_obs_idx] = True
            else:  # every positive parameter (scales, variances, precisions)
                offs = np.cumsum([0] + [int(np.size(info.theta0_c[n])) for n in info.param_names])
                for i, n in enumerate(info.param_names):
                    if isinstance(info.param_constraints[n], type(constraints.positive)):
                        ann[offs[i]:offs[i + 1]] = True
        self._anneal_mask = ann
        # initial theta
        if init_params is not None:
            unknown = set(init_params) - set(info.param_names)
            if unknown:
                raise ValueError(f"`init_params` names unknown param sites {sorted(unknown)}.")
            tc = {**info.theta0_c, **{n: jnp.asarray(v) for n, v in init_params.items()}}
            theta0 = info.unconstrain_theta(tc)
        else:
            theta0 = info.theta0_u_flat
        # a strongly typed theta (Python-float initial values are weakly typed): the carry of
        # the compiled loop keeps one type, so a jitted iteration compiles once
        theta0 = jnp.asarray(theta0, dtype=jnp.result_type(theta0.dtype))
        return info, theta0

    def _init_z(self, key, theta_u, args, kwargs):
        """Initial latents: ``init_strategy`` (default: the prior median at :math:`\\theta_0`)
        for every chain, jittered by ``init_jitter`` in unconstrained space for chains > 0."""
        info = self.info
        keys = random.split(key, self.num_chains)
        theta_c = info.constrain_theta(theta_u)
        zs = []
        for c, k in enumerate(keys):
            k1, k2 = random.split(k)
            m = substitute(seed(substitute(self.model, data=theta_c), k1),
                           substitute_fn=self.init_strategy)
            tr = trace(m).get_trace(*args, **kwargs)
            zu = info.unconstrain_z({n: tr[n]["value"] for n in info.latent_names})
            if c > 0:
                zu = zu + self.init_jitter * random.normal(k2, zu.shape, zu.dtype)
            zs.append(zu)
        return jnp.stack(zs)

    def _make_estep(self, args, kwargs):
        """Return ``(init_kstate, estep)``; ``estep(key, z, kstate, theta_u, n)`` runs ``n``
        kernel steps from ``z`` targeting :math:`p(z\\mid y;\\theta)` and returns
        ``(z, kstate, mean_accept, finite)``."""
        info = self.info
        P = _flat_preconditioner(info, self.preconditioner)
        eta = self.step_size
        if isinstance(self.kernel, str):
            mala = self.kernel == "mala"
            layout = self._layout
            n_prior = self.prior_proposals
            model = self.model

            def U(th, zf):
                return -_log_joint_per_subject(info, layout, info.constrain_theta(th), zf, args,
                                               kwargs)

            def loglik(th_c, zf):
                return _log_joint_per_subject(info, layout, th_c, zf, args, kwargs, True)

            if layout is None:
                n_blk, ids = 1, jnp.zeros(info.dim_z, jnp.int32)
            else:
                n_blk, ids = layout.n, jnp.asarray(layout.block_ids)

            def prior_mh(key, z, theta_u):
                """Independence Metropolis--Hastings with the prior :math:`p(z\\mid\\theta)` as
                proposal (saemix's kernel 1): acceptance ratio = likelihood ratio, per block."""
                th_c = info.constrain_theta(theta_u)

                def draw(k):
                    tr = trace(seed(substitute(model, data=th_c), k)).get_trace(*args, **kwargs)
                    return info.unconstrain_z({nm: tr[nm]["value"] for nm in info.latent_names})

                def one(zz, k):
                    kd, ku = random.split(k)
                    y = draw(kd)
                    lr = loglik(th_c, y) - loglik(th_c, zz)
                    lr = jnp.where(jnp.isnan(lr), -jnp.inf, lr)
                    ok = jnp.log(random.uniform(ku, lr.shape, lr.dtype)) < lr
                    return jnp.where(ok[ids], y, zz)

                def body(i, zz):
                    ks = random.split(random.fold_in(key, i), zz.shape[0])
                    return jax.vmap(one)(zz, ks)

                return lax.fori_loop(0, n_prior, body, z)

            def blocks(v):  # per-block sums of a (C, d_z) array -> (C, n_blk)
                return jax.vmap(lambda r: jax.ops.segment_sum(r, ids, num_segments=n_blk))(v)

            def estep(key, z, kstate, theta_u, n):
                def vg_one(zf):
                    u_b, vjp = jax.vjp(lambda q: U(theta_u, q), zf)
                    return u_b, vjp(jnp.ones_like(u_b))[0]

                vg = jax.vmap(vg_one)
                p = jnp.ones(info.dim_z, z.dtype) if P is None else P(theta_u).astype(z.dtype)
                if n_prior:
                    key, k_pr = random.split(key)
                    z = prior_mh(k_pr, z, theta_u)
                u, g = vg(z)

                def body(i, carry):
                    z, u, g, acc_sum = carry
                    kn, ka = random.split(random.fold_in(key, i))
                    xi = random.normal(kn, z.shape, z.dtype)
                    y = z - eta * p * g + jnp.sqrt(2.0 * eta * p) * xi
                    uy, gy = vg(y)
                    if mala:
                        # MH test per block: the whole vector (the paper's MALA) or, when
                        # p(z | y; theta) factorises over subjects, each subject separately
                        fwd = y - z + eta * p * g
                        bwd = z - y + eta * p * gy
                        lr = u - uy + (blocks(fwd**2 / p) - blocks(bwd**2 / p)) / (4.0 * eta)
                        lr = jnp.where(jnp.isnan(lr), -jnp.inf, lr)
                        acc = jnp.exp(jnp.minimum(lr, 0.0))
                        ok = random.uniform(ka, acc.shape) < acc
                        ok_z = ok[:, ids]
                        y = jnp.where(ok_z, y, z)
                        uy = jnp.where(ok, uy, u)
                        gy = jnp.where(ok_z, gy, g)
                    else:
                        acc = jnp.ones(u.shape, z.dtype)
                    return y, uy, gy, acc_sum + jnp.mean(acc)

                # `n` may be traced (one compiled E-step serves burn-in, iterations and draws)
                z, u, g, acc_sum = lax.fori_loop(0, n, body, (z, u, g, jnp.zeros((), z.dtype)))
                finite = jnp.all(jnp.isfinite(u)) & jnp.all(jnp.isfinite(z))
                return z, kstate, acc_sum / jnp.maximum(n, 1).astype(z.dtype), finite

            return (lambda key, z, theta_u: ()), estep

        # NumPyro kernel
        model = self.model

        def wrapper(m):
            # `block` hides the param sites from outer handlers: NumPyro's initialize_model
            # would otherwise substitute their initial values over the current theta
            def conditioned(*a, _saem_theta=None, **kw):
                with block(hide_fn=lambda site: site["type"] == "param"):
                    with substitute(data=_saem_theta if _saem_theta is not None else {}):
                        return m(*a, **kw)

            return conditioned

        if isinstance(self.kernel, MCMCKernel):
            try:
                kernel = self.kernel.wrap_model(wrapper)
            except NotImplementedError as err:
                raise ValueError(
                    f"{type(self.kernel).__name__} does not implement `wrap_model`; pass a "
                    "factory instead, e.g. kernel=lambda m: ULA(m, step_size=...)."
                ) from err
        else:
            kernel = self.kernel(wrapper(model))
            if not isinstance(kernel, MCMCKernel):
                raise TypeError("the `kernel` factory must return a NumPyro MCMCKernel.")
        if getattr(kernel, "check_finite", False):
            # the E-step is vmapped over chains and checked for divergence below; a host
            # callback per step inside a vmapped kernel would run at every step
            kernel = copy.copy(kernel)
            kernel.check_finite = False
        self._numpyro_kernel = kernel
        field = kernel.sample_field

        # A federated kernel holds the per-row data in its ClientPartition: it receives only
        # the non-row arguments and theta (the data given to `run` serve the server-side
        # M-step and likelihood computations).
        row_keys = set(getattr(getattr(kernel, "partition", None), "keys", ()))
        kernel_kwargs = {k: v for k, v in kwargs.items() if k not in row_keys}
        if row_keys and args:
            raise ValueError(
                "With a federated E-step kernel, pass the data to SAEM.run as keyword "
                "arguments (the kernel takes the per-row data from its ClientPartition)."
            )

        def kw(theta_u):
            return {**kernel_kwargs, "_saem_theta": info.constrain_theta(theta_u)}

        def init_kstate(key, z, theta_u):
            states = []
            for c, k in enumerate(random.split(key, z.shape[0])):
                zu = info._unravel_z(z[c])
                states.append(kernel.init(k, 0, zu, args, kw(theta_u)))
            return jax.tree.map(lambda *v: jnp.stack(v), *states)

        def estep(key, z, kstate, theta_u, n):
            kwt = kw(theta_u)
            kstate = jax.vmap(lambda s: kernel.refresh(s, args, kwt))(kstate)

            def body(_, c):
                s, acc_sum = c
                s = jax.vmap(lambda st: kernel.sample(st, args, kwt))(s)
                acc = jnp.mean(getattr(s, "accept_prob", jnp.ones(())))
                return s, acc_sum + acc.astype(acc_sum.dtype)

            zdt = z.dtype
            kstate, acc_sum = lax.fori_loop(0, n, body, (kstate, jnp.zeros((), zdt)))
            zf = jax.vmap(lambda st: ravel_pytree(getattr(st, field))[0])(kstate)
            finite = jnp.all(jnp.isfinite(zf))
            return zf, kstate, acc_sum / jnp.maximum(n, 1).astype(zdt), finite

        return init_kstate, estep

    def _score_hess(self, theta_u, z, args, kwargs):
        info = self.info

        def one(zf):
            f = lambda t: info.log_joint(t, zf, args, kwargs)
            return jax.grad(f)(theta_u), jax.hessian(f)(theta_u)

        g, H = jax.vmap(one)(z)
        return g, H

    # phases of the compiled program: burn-in (then M-step statistics initialised), SAEM
    # iterations, draws at the final theta, padding of the last progress-bar chunk
    _BURN, _ITER, _DRAW, _PAD = 0, 1, 2, 3

    def _prepare(self, rng_key, args, kwargs, init_params):
        """Model analysis, initial latents, the E-step, the initial state (before burn-in; the
        M-step statistics are zeros of the right structure) and the post-E-step update of one
        SAEM iteration."""
        info, theta0 = self._setup(rng_key, args, kwargs, init_params)
        k_z, k_kern, _, k_run = random.split(random.fold_in(rng_key, 1), 4)
        z0 = self._init_z(k_z, theta0, args, kwargs)
        init_kstate, estep = self._make_estep(args, kwargs)
        self._estep = estep
        kstate = init_kstate(k_kern, z0, theta0)
        mstep = self.mstep
        # structure of the M-step state without evaluating it (it is initialised after the
        # burn-in, inside the compiled program)
        mshape = jax.eval_shape(lambda t, z: mstep.init(t, z, args, kwargs), theta0, z0)
        mstate = jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), mshape)
        d = info.dim_theta
        dt = theta0.dtype
        louis = (jnp.zeros(d, dt), jnp.zeros((d, d), dt)) if self._use_fisher else ()
        state = SAEMState(
            jnp.zeros((), jnp.int32), z0, theta0, mstate, kstate, louis, k_run,
            jnp.full((), -1, jnp.int32), theta0,
        )
        anneal = jnp.asarray(self._anneal_mask)
        tau = self.schedule.anneal_factor
        n_expl = self.schedule.num_exploration
        need_sh = self._use_fisher or isinstance(mstep, _NewtonMStep)

        def update(state: SAEMState, key, z, kstate, finite, gamma, active=True):
            """SA + M-step after the E-step drew ``z`` at ``state.theta``."""
            theta = state.theta
            gamma = jnp.asarray(gamma, dt)
            if need_sh:
                gs, Hs = self._score_hess(theta, z, args, kwargs)
                sh = (jnp.mean(gs, 0), jnp.mean(Hs, 0))
            else:
                sh = None
            theta_new, mst = mstep.update(state.mstate, gamma, theta, z, args, kwargs, sh)
            if self.schedule.annealing and n_expl > 0:
                tc_old = info.theta_c_flat(theta)
                tc_new = info.theta_c_flat(theta_new)
                floor = jnp.sqrt(tau) * tc_old
                exploring = state.k < n_expl
                tc_ann = jnp.where(anneal & exploring, jnp.maximum(tc_new, floor), tc_new)
                theta_new = info.unconstrain_theta(info._unravel_theta_c(tc_ann))
            mst = mstep.transport(mst, theta_new - theta)
            if self._use_fisher:
                D_new = jnp.mean(Hs + gs[:, :, None] * gs[:, None, :], 0)
                louis = (
                    state.louis[0] + gamma * (sh[0] - state.louis[0]),
                    state.louis[1] + gamma * (D_new - state.louis[1]),
                )
            else:
                louis = state.louis
            ok = finite & jnp.all(jnp.isfinite(theta_new))
            already_bad = state.bad_iter != -1
            new = SAEMState(state.k + 1, z, theta_new, mst, kstate, louis, key,
                            state.bad_iter, state.bad_theta)
            keep_old = already_bad | ~ok | jnp.logical_not(active)
            out = jax.tree.map(lambda a, b: jnp.where(keep_old, a, b), state, new)
            flag = ~already_bad & ~ok & active
            bad_iter = jnp.where(flag, state.k, state.bad_iter)
            bad_theta = jnp.where(flag, theta, state.bad_theta)
            return out._replace(bad_iter=bad_iter, bad_theta=bad_theta, rng_key=key)

        def after_burn_in(state: SAEMState, key, z, kstate, finite):
            """Initialise the M-step statistics at the burnt-in ``z`` (``bad_iter = -2``
            flags a divergence during burn-in)."""
            mst = mstep.init(state.theta, z, args, kwargs)
            return state._replace(
                z=z, kstate=kstate, mstate=mst, rng_key=key,
                bad_iter=jnp.where(finite, state.bad_iter, -2).astype(jnp.int32),
            )

        return state, estep, update, after_burn_in

    def _build(self, rng_key, args, kwargs, init_params):
        """State after burn-in and the one-iteration function ``iteration(state, gamma)``
        (used by the benchmark; :meth:`run` compiles the whole fit as one program)."""
        state, estep, update, after_burn_in = self._prepare(rng_key, args, kwargs, init_params)

        @jax.jit
        def burn(state):
            key, k_e = random.split(state.rng_key)
            z, kstate, _, finite = estep(k_e, state.z, state.kstate, state.theta,
                                         self.schedule.num_burnin)
            return after_burn_in(state, key, z, kstate, finite)

        state = burn(state)
        if int(state.bad_iter) == -2:
            raise self._burnin_error(state.theta)
        m = self.num_mcmc_steps

        def iteration(state: SAEMState, gamma, active=True):
            key, k_e = random.split(state.rng_key)
            z, kstate, acc, finite = estep(k_e, state.z, state.kstate, state.theta, m)
            out = update(state, key, z, kstate, finite, gamma, active)
            return out, (out.theta, acc)

        return state, iteration

    def _burnin_error(self, theta0) -> DivergenceError:
        return DivergenceError(
            f"SAEM: the E-step kernel diverged during burn-in at theta_0="
            f"{self._format_theta(theta0)} with step_size={self.step_size:.3g}; "
            "reduce `step_size`."
        )

    def _format_theta(self, theta_u) -> str:
        tc = self.info.constrain_theta(jnp.asarray(theta_u))
        return "{" + ", ".join(
            f"{n}: {np.array2string(np.asarray(v), precision=4)}" for n, v in tc.items()
        ) + "}"

    # ------------------------------------------------------------------ run
    def run(
        self,
        rng_key: jax.Array,
        *model_args: Any,
        init_params: dict | None = None,
        progress_bar: bool = False,
        num_chunks: int = 20,
        **model_kwargs: Any,
    ) -> SAEMResult:
        """Fit :math:`\\theta` by MCMC-SAEM.

        Burn-in, the SAEM iterations and the draws at the final :math:`\\theta` run as ONE
        compiled :func:`jax.lax.scan` over phases (one E-step body with a traced number of
        kernel steps serves the three), i.e. one compilation per call.

        :param rng_key: a JAX random key.
        :param model_args: positional arguments of the model (data).
        :param init_params: optional dict of constrained initial values of ``param`` sites
            (default: their ``init_value`` in the model).
        :param progress_bar: run the compiled loop in ``num_chunks`` equal chunks with a
            ``tqdm`` progress bar (one compilation).
        :param model_kwargs: keyword arguments of the model.
        :return: a :class:`SAEMResult`.
        """
        state, estep, update, after_burn_in = self._prepare(rng_key, model_args, model_kwargs,
                                                            init_params)
        dt = state.theta.dtype
        K, T, m = len(self.gammas), self.num_draws, self.num_mcmc_steps
        # the program: one burn-in step, K iterations, T draws (phase, gamma, steps, draw index)
        phase = np.concatenate([[self._BURN], np.full(K, self._ITER), np.full(T, self._DRAW)])
        gam = np.concatenate([[1.0], self.gammas, np.ones(T)])
        nst = np.concatenate([[self.schedule.num_burnin], np.full(K, m), np.ones(T)])
        jdraw = np.concatenate([np.zeros(K + 1), np.arange(T)])
        xs = (phase.astype(np.int32), gam, nst.astype(np.int32), jdraw.astype(np.int32))

        def step(carry, x):
            state, zbuf, dacc = carry
            ph, gamma, n, j = x
            key, k_e = random.split(state.rng_key)
            # one E-step for every phase (n = 0 when padding)
            z, kstate, acc, finite = estep(k_e, state.z, state.kstate, state.theta, n)

            def b_burn(_):
                return after_burn_in(state, key, z, kstate, finite), zbuf, dacc

            def b_iter(_):
                return update(state, key, z, kstate, finite, gamma), zbuf, dacc

            def b_draw(_):
                st = state._replace(z=z, kstate=kstate, rng_key=key)
                return st, zbuf.at[j].set(z), dacc + acc

            def b_pad(_):
                return state, zbuf, dacc

            out = lax.switch(ph, [b_burn, b_iter, b_draw, b_pad], None)
            return out, (out[0].theta, acc)

        def program(carry, xs):
            xs = (xs[0], jnp.asarray(xs[1], dt), xs[2], xs[3])
            return lax.scan(step, carry, xs)

        carry = (state, jnp.zeros((T,) + state.z.shape, state.z.dtype), jnp.zeros((), dt))
        total = len(phase)
        if progress_bar and total > 1:
            from tqdm.auto import tqdm

            nc = max(1, min(int(num_chunks), total))
            L = -(-total // nc)
            pad = nc * L - total
            xs = (np.concatenate([xs[0], np.full(pad, self._PAD, np.int32)]),
                  np.concatenate([xs[1], np.ones(pad)]),
                  np.concatenate([xs[2], np.zeros(pad, np.int32)]),
                  np.concatenate([xs[3], np.zeros(pad, np.int32)]))
            chunk = jax.jit(program)
            thetas, accs = [], []
            with tqdm(total=total, desc="SAEM") as bar:
                for c in range(nc):
                    carry, (th, ac) = chunk(carry, tuple(v[c * L:(c + 1) * L] for v in xs))
                    thetas.append(th)
                    accs.append(ac)
                    bar.update(min(L, total - c * L))
                    if int(carry[0].bad_iter) != -1:
                        break
            thetas = jnp.concatenate(thetas)
            accs = jnp.concatenate(accs)
        else:
            carry, (thetas, accs) = jax.jit(program)(carry, xs)
        state, zs, dacc = carry
        bad = int(state.bad_iter)
        if bad == -2:
            raise self._burnin_error(state.theta)
        if bad >= 0:
            raise DivergenceError(
                f"SAEM: the E-step became non-finite at iteration {bad} with "
                f"theta={self._format_theta(state.bad_theta)} and step_size="
                f"{self.step_size:.3g}; reduce `step_size` (or use a preconditioner / MALA)."
            )
        return SAEMResult(self, self.info, state, np.asarray(thetas[1:K + 1]),
                          np.asarray(accs[1:K + 1]), np.asarray(zs),
                          float(dacc) / max(T, 1), model_args, model_kwargs)

    fit = run


# ============================================================================ results
def _subject_plate(info: _Model, name: str | None):
    """Name and size of the plate shared by every sample site (the subjects), or None."""
    sites = [info.trace0[n] for n in info.latent_names + info.observed_names]
    frames = [{f.name: f for f in s["cond_indep_stack"]} for s in sites]
    common = set(frames[0])
    for f in frames[1:]:
        common &= set(f)
    if name is not None:
        if name not in common:
            raise ValueError(
                f"subject_plate={name!r} does not contain every sample site of the model."
            )
        return name, frames[0][name].size
    if not common:
        return None, 1
    # the outermost common plate: the one with the most negative dim in the latent sites
    best = min(common, key=lambda n: frames[0][n].dim)
    return best, frames[0][best].size


def _per_subject(arr, dim, event_dim, n):
    """Sum an array over everything except the subject axis (``dim`` counts from the right of
    the batch shape); ``None`` when the array does not carry that axis."""
    arr = jnp.asarray(arr)
    axis = arr.ndim - event_dim + dim
    if axis < 0 or arr.shape[axis] != n:
        return None
    return jnp.sum(jnp.moveaxis(arr, axis, 0).reshape(n, -1), axis=1)


class _SubjectLayout(NamedTuple):
    """Where the subjects are: the plate shared by every sample site, its size, each site's
    ``(plate dim, event dim)``, and the subject of every flat unconstrained latent coordinate.
    Given :math:`\\theta`, :math:`p(y, z\\mid\\theta) = \\prod_i p(y_i, z_i\\mid\\theta)`."""

    plate: str
    n: int
    dims: dict
    block_ids: np.ndarray


def _subject_layout(info: _Model, name: str | None, args, kwargs) -> _SubjectLayout | None:
    """The model's subject layout, or ``None`` (no plate shared by every sample site, a latent
    transform that changes shapes, or a site whose log-density lacks the subject axis)."""
    plate, n = _subject_plate(info, name)
    if plate is None or any(
        info.z_shapes[nm] != info.z_u_shapes[nm] for nm in info.latent_names
    ):
        return None
    dims = {}
    for nm in info.latent_names + info.observed_names:
        s = info.trace0[nm]
        fr = {f.name: f for f in s["cond_indep_stack"]}
        dims[nm] = (fr[plate].dim, s["fn"].event_dim)
    lps, _ = compute_log_probs(
        info.model, args, kwargs,
        {**info.theta0_c, **{nm: info.trace0[nm]["value"] for nm in info.latent_names}},
        sum_log_prob=False,
    )
    if any(_per_subject(lps[nm], dims[nm][0], 0, n) is None for nm in lps if nm in dims):
        return None
    ids = {}
    for nm in info.latent_names:
        dim, ev = dims[nm]
        shape = info.z_u_shapes[nm]
        axis = len(shape) - ev + dim
        if axis < 0 or shape[axis] != n:
            return None
        view = [1] * len(shape)
        view[axis] = n
        ids[nm] = np.broadcast_to(np.arange(n).reshape(view), shape)
    block_ids = np.asarray(ravel_pytree({k: jnp.asarray(v) for k, v in ids.items()})[0])
    return _SubjectLayout(plate, n, dims, block_ids.astype(np.int32))


def _log_joint_per_subject(info: _Model, layout: _SubjectLayout | None, theta_c, z_u_flat,
                           args, kwargs, observed_only: bool = False):
    """:math:`\\log p(y_i, z_i\\mid\\theta) + \\log|J(z_i)|` for every subject ``i``
    (flat unconstrained ``z``), shape ``(n,)``; sums to :meth:`_Model.log_joint`. With
    ``observed_only``: :math:`\\log p(y_i\\mid z_i, \\theta)`. Without a layout: shape
    ``(1,)``, the whole model."""
    zu_d = info._unravel_z(z_u_flat)
    zc = {nm: info.latent_transforms[nm](v) for nm, v in zu_d.items()}
    lps, _ = compute_log_probs(info.model, args, kwargs, {**theta_c, **zc}, sum_log_prob=False)
    names = info.observed_names if observed_only else info.latent_names + info.observed_names
    if layout is None:
        out = sum(jnp.sum(lps[nm]) for nm in names)
        if not observed_only:
            out = out + info.constrain_z(z_u_flat)[1]
        return jnp.reshape(out, (1,)).astype(z_u_flat.dtype)
    out = jnp.zeros(layout.n, z_u_flat.dtype)
    for nm in names:
        dim, ev = layout.dims[nm]
        out = out + _per_subject(lps[nm], dim, 0, layout.n)
        if nm in zu_d:
            lj = info.latent_transforms[nm].log_abs_det_jacobian(zu_d[nm], zc[nm])
            lj = jnp.broadcast_to(lj, zu_d[nm].shape)
            out = out + _per_subject(lj, dim, ev, layout.n)
    return out


def _student_t(key, df: float, shape, dtype):
    """Student-t draws. For an even integer ``df`` <= 30 (the default 4) the chi-square
    variable is :math:`-2\\sum_{j\\le df/2}\\log U_j` (a sum of exponentials), exact and far
    cheaper to compile than the rejection sampler of :func:`jax.random.gamma`."""
    if float(df).is_integer() and int(df) % 2 == 0 and 0 < df <= 30:
        kn, ku = random.split(key)
        z = random.normal(kn, shape, dtype)
        u = random.uniform(ku, (int(df) // 2, *shape), dtype, minval=jnp.finfo(dtype).tiny)
        chi2 = -2.0 * jnp.sum(jnp.log(u), 0)
        return z / jnp.sqrt(chi2 / df)
    return random.t(key, df, shape, dtype)


class SAEMResult:
    """Result of :meth:`SAEM.run`.

    Attributes: ``params`` (dict of constrained estimates), ``theta`` (flat unconstrained),
    ``trajectory`` (pandas DataFrame, one row per iteration, constrained coordinates + step
    size + acceptance rate), ``idata`` (ArviZ InferenceData of the latent draws at the final
    :math:`\\theta`), ``mstep`` (which M-step ran), ``num_params``.
    """

    def __init__(self, saem, info, state, thetas_u, accs, zs, accept_final, args, kwargs):
        self._saem, self._info, self.state = saem, info, state
        self._args, self._kwargs = args, kwargs
        self.theta = np.asarray(state.theta)
        self.params = {n: np.asarray(v) for n, v in info.constrain_theta(state.theta).items()}
        tc = np.asarray(jax.vmap(info.theta_c_flat)(jnp.asarray(thetas_u)))
        import pandas as pd

        df = pd.DataFrame(tc, columns=info.theta_coord_names)
        df.insert(0, "gamma", saem.gammas[: len(df)])
        df["accept_rate"] = accs
        df.index = pd.RangeIndex(1, len(df) + 1, name="iteration")
        self.trajectory = df
        self._z = zs  # (T, C, dz) unconstrained
        self.accept_rate_final = accept_final
        self.mstep = saem.mstep.kind
        self.num_params = info.dim_theta
        self._ll = None

    # -- estimates ----------------------------------------------------------------------------
    @property
    def names(self) -> list[str]:
        return list(self._info.theta_coord_names)

    def estimates(self) -> dict[str, float]:
        """Flat, named constrained estimates ``{"omega[0]": ..., ...}``."""
        flat = np.asarray(self._info.theta_c_flat(jnp.asarray(self.theta)))
        return dict(zip(self.names, flat.tolist(), strict=True))

    def fisher_information(self) -> np.ndarray:
        """SA Louis observed information in unconstrained coordinates:
        :math:`-(\\bar D - \\bar\\Delta\\bar\\Delta^\\top)`, with :math:`\\bar\\Delta` the SA
        average of the complete-data score and :math:`\\bar D` that of Hessian + score score^T
        (Louis 1982; Delyon, Lavielle & Moulines 1999)."""
        if not self._saem._use_fisher:
            raise ValueError("Standard errors need SAEM(..., fisher=True).")
        delta, D = (np.asarray(v, np.float64) for v in self.state.louis)
        info = -(D - np.outer(delta, delta))
        return (info + info.T) / 2.0

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
            warnings.warn("The SA Louis information is not positive definite.", stacklevel=2)
        jac = np.asarray(jax.jacfwd(self._info.theta_c_flat)(jnp.asarray(self.theta)))
        cov_c = jac @ cov_u @ jac.T
        se = np.sqrt(np.where(np.diag(cov_c) > 0, np.diag(cov_c), np.nan))
        return dict(zip(self.names, se.tolist(), strict=True))

    def summary(self):
        """DataFrame of estimates, standard errors and relative standard errors (%)."""
        import pandas as pd

        est = self.estimates()
        se = self.standard_errors() if self._saem._use_fisher else dict.fromkeys(est, np.nan)
        df = pd.DataFrame({"estimate": est, "se": se})
        df["rse_%"] = 100 * df["se"] / df["estimate"].abs()
        return df

    # -- latents ------------------------------------------------------------------------------
    def latent_samples(self) -> dict[str, np.ndarray]:
        """Constrained latent draws at the final :math:`\\theta`, ``(chains, draws, ...)``."""
        info = self._info
        T, C, dz = self._z.shape
        flat = jnp.asarray(self._z).reshape(T * C, dz)
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
    def log_likelihood(
        self, rng_key: jax.Array | None = None, num_samples: int = 5000, df: float = 4.0,
        batch_size: int = 500,
    ) -> dict[str, float]:
        """Marginal log-likelihood by importance sampling (saemix's ``llis``).

        Proposal: independent Student-t (``df`` degrees of freedom) per unconstrained latent
        coordinate, centred at the conditional mean with the conditional standard deviation
        from the draws at :math:`\\hat\\theta`. When the model has a subject plate the weights
        are averaged per subject (the marginal likelihood factorises), which is far more
        accurate than importance sampling on the joint latent vector.

        :return: dict with ``loglik``, ``m2ll`` (:math:`-2\\ell`), ``m2ll_se`` (Monte Carlo
            standard error, delta method), ``aic``, ``bic`` (log of the number of subjects when
            there is a subject plate, else of the number of observations), ``num_subjects``.
        """
        info = self._info
        key = random.key(0) if rng_key is None else rng_key
        args, kwargs = self._args, self._kwargs
        layout = _subject_layout(info, self._saem.subject_plate, args, kwargs)
        n = layout.n if layout is not None else 1
        flat = jnp.asarray(self._z).reshape(-1, info.dim_z)
        mu = jnp.mean(flat, 0)
        sd = jnp.maximum(jnp.std(flat, 0), 1e-6)
        theta_c = info.constrain_theta(jnp.asarray(self.theta))
        ids = None if layout is None else jnp.asarray(layout.block_ids)

        def logw(x):
            zu = mu + sd * x
            lq = jax.scipy.stats.t.logpdf(x, df) - jnp.log(sd)
            if layout is None:
                zc, logj = info.constrain_z(zu)
                return (info.log_joint_c(theta_c, zc, args, kwargs) + logj - jnp.sum(lq))[None]
            lp = _log_joint_per_subject(info, layout, theta_c, zu, args, kwargs)
            return lp - jax.ops.segment_sum(lq, ids, num_segments=n)

        nb = max(1, -(-int(num_samples) // int(batch_size)))

        @jax.jit
        def all_logw(key):
            keys = random.split(key, nb)

            def one(k):
                x = _student_t(k, df, (batch_size, info.dim_z), flat.dtype)
                return jax.vmap(logw)(x)

            return lax.map(one, keys).reshape(nb * batch_size, n)

        lw = np.asarray(all_logw(key), np.float64)
        mx = lw.max(0)
        w = np.exp(lw - mx)
        mean_w = w.mean(0)
        ll_i = mx + np.log(mean_w)
        var_i = w.var(0) / (w.shape[0] * mean_w**2)
        ll = float(ll_i.sum())
        p = self.num_params
        nb_ = n if layout is not None else info.n_obs
        out = {
            "loglik": ll, "m2ll": -2 * ll, "m2ll_se": float(2 * np.sqrt(var_i.sum())),
            "aic": -2 * ll + 2 * p, "bic": -2 * ll + math.log(nb_) * p,
            "num_subjects": int(n), "num_samples": int(lw.shape[0]),
        }
        self._ll = out
        return out

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


# ============================================================================ AIS
def annealed_importance_sampling(
    rng_key: jax.Array,
    log_prior: Callable,
    log_lik: Callable,
    sample_prior: Callable,
    *,
    num_particles: int = 100,
    num_steps: int = 1000,
    step_size: float = 0.05,
    num_mh: int = 1,
) -> jax.Array:
    """Log marginal likelihood :math:`\\log\\int p(y\\mid z)p(z)dz` by annealed importance
    sampling (Neal 2001) with the quadratic schedule :math:`\\beta_t = (t/T)^2` used by the
    MCMC-SAEM paper (Sec. 5.2) and ``num_mh`` Metropolis-adjusted Langevin moves per
    temperature.

    :param log_prior: ``log p(z)`` on a flat vector.
    :param log_lik: ``log p(y | z)`` on a flat vector.
    :param sample_prior: ``sample_prior(key) -> z`` exact draw from the prior.
    :return: the estimate :math:`\\log \\frac1N\\sum_j w_j`.
    """
    betas = (jnp.arange(num_steps + 1) / num_steps) ** 2
    k0, k1 = random.split(rng_key)
    z0 = jax.vmap(sample_prior)(random.split(k0, num_particles))
    lp = lambda z, b: log_prior(z) + b * log_lik(z)

    def particle(z, key):
        def step(carry, x):
            z, lw = carry
            b_prev, b, k = x
            lw = lw + (b - b_prev) * log_lik(z)

            def mh(zz, kk):
                kn, ku = random.split(kk)
                f, g = jax.value_and_grad(lp)(zz, b)
                y = zz + step_size * g + jnp.sqrt(2 * step_size) * random.normal(kn, zz.shape)
                fy, gy = jax.value_and_grad(lp)(y, b)
                fwd = jnp.sum((y - zz - step_size * g) ** 2)
                bwd = jnp.sum((zz - y - step_size * gy) ** 2)
                lr = fy - f + (fwd - bwd) / (4 * step_size)
                ok = jnp.log(random.uniform(ku)) < jnp.where(jnp.isnan(lr), -jnp.inf, lr)
                return jnp.where(ok, y, zz), None

            z, _ = lax.scan(mh, z, random.split(k, num_mh))
            return (z, lw), None

        keys = random.split(key, num_steps)
        (_, lw), _ = lax.scan(step, (z, jnp.zeros((), z.dtype)), (betas[:-1], betas[1:], keys))
        return lw

    lws = jax.vmap(particle)(z0, random.split(k1, num_particles))
    return jax.nn.logsumexp(lws) - jnp.log(num_particles)
