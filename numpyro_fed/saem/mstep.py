"""M-steps of MCMC-SAEM: stochastic approximation of the statistics and the maximisation.

Every M-step is an explicit ``(init, update)`` pair on its own state (Optax style), an
implementation of the :class:`~numpyro_fed.saem.protocols.MStep` protocol:

- ``init(theta_u, z, data, aux) -> state`` -- the statistics at the first draws;
- ``update(state, gamma, theta_u, z, data, aux, anneal, score_hess) -> (theta_u, state)``
  -- :math:`s^+ = s + \\gamma(S(z) - s)`, then :math:`\\theta^+ = \\hat\\theta(s^+)`, with
  saemix's simulated annealing of the variances when ``anneal`` (a traced bool) holds;
- ``prepare(theta_u, z, data) -> aux`` -- data-dependent constants (the design matrices of
  the random-effect means), computed inside the compiled program so that new data of the
  same shapes reuse it.

:class:`GaussianMStep` (``mstep="auto"``) is the closed-form M-step of the Gaussian
random-effects family, found by numerical probes of the model: latent sites
:math:`z_i \\sim \\mathcal N(A_i\\beta + c_i, \\Omega)` with :math:`\\Omega` diagonal (each
standard deviation proportional to one parameter) or full (a ``MultivariateNormal`` whose
``scale_tril`` is a ``lower_cholesky`` param, or whose covariance is a ``positive_definite``
param, or :math:`\\operatorname{diag}(\\omega)L` with a ``corr_cholesky`` :math:`L`), and Normal
observations whose scale is proportional to one parameter (additive or proportional error).
Sufficient statistics :math:`E[z]`, :math:`E[zz^\\top]` and the weighted residual sums of
squares; :math:`\\beta` by generalised least squares and :math:`\\Omega` by the moment formula,
alternated (expectation-conditional maximisation). Every other parameter -- fixed effects
without a random effect, parameters of a non-Gaussian likelihood, a combined error model --
is updated by the stochastic-approximation Newton step of :class:`NewtonMStep` restricted to
those coordinates (a hybrid: the closed form where it exists, Newton elsewhere). With
``interweave`` (the default) a third cycle follows: SA-Newton in the non-centred
parametrisation of the diagonal sites, :math:`z = \\mu(\\theta) + \\omega(\\theta)\\eta` with
:math:`\\eta` held fixed (Yu & Meng 2011's interweaving, as an AECM cycle of Meng & van Dyk
1997), which converges fast where the centred cycles move at EM's slow rate.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import numpyro.distributions as dist
from jax import lax, random
from jax.flatten_util import ravel_pytree
from numpyro.distributions import constraints

from numpyro_fed.saem.model import (
    ModelInfo,
    jit_once,
    merge_data,
    prefer_forward,
    score_hessian,
    split_data,
)
from numpyro_fed.saem.protocols import MStep

__all__ = ["SufficientStatistics", "GaussianMStep", "NewtonMStep", "UserMStep",
           "detect_gaussian"]


@dataclass(frozen=True)
class SufficientStatistics:
    """User-given exponential-family M-step (Gruffaz et al. 2024, assumptions H1--H2).

    :param stats: ``stats(z, *model_args, **model_kwargs)`` -> pytree :math:`S(y, z)`, where
        ``z`` is a dict of constrained latent values of one chain.
    :param maximizer: ``maximizer(s, *model_args, **model_kwargs)`` -> dict of constrained
        values of the ``param`` sites, :math:`\\hat\\theta(s)`.
    """

    stats: Callable
    maximizer: Callable


# ------------------------------------------------------------------------------ helpers
def _unwrap(fn):
    """``(base, mask)``: the base distribution under Masked/Independent/Expanded wrappers;
    the mask (``None``: none) over the value's shape (a mask over a wrapper's batch dims is
    given trailing singleton dims for that wrapper's event dims)."""
    mask = None
    d = fn
    while True:
        if isinstance(d, dist.MaskedDistribution):
            m = d._mask
            if isinstance(m, bool) or np.ndim(m) == 0:
                m = jnp.full(tuple(d.batch_shape), m, bool)
            m = jnp.broadcast_to(m, tuple(d.batch_shape))
            m = m.reshape(m.shape + (1,) * d.event_dim)
            mask = m if mask is None else jnp.logical_and(mask, m)
            d = d.base_dist
        elif isinstance(d, dist.Independent | dist.ExpandedDistribution):
            d = d.base_dist
        else:
            return d, mask


def unwrap_normal(fn, value):
    """``(loc, scale, mask)`` broadcast to ``value``'s shape if ``fn`` is a (masked,
    expanded, independent) Normal, else ``None``."""
    d, mask = _unwrap(fn)
    if type(d) is not dist.Normal:
        return None
    shape = jnp.shape(value)
    m = jnp.ones(shape, bool) if mask is None else jnp.broadcast_to(mask, shape)
    return jnp.broadcast_to(d.loc, shape), jnp.broadcast_to(d.scale, shape), m


def unwrap_mvn(fn, value):
    """``(loc (rows, q), scale_tril (rows, q, q))`` if ``fn`` is an (expanded) unmasked
    MultivariateNormal, else ``None``."""
    d, mask = _unwrap(fn)
    if type(d) is not dist.MultivariateNormal or mask is not None:
        return None
    shape = jnp.shape(value)
    q = shape[-1]
    loc = jnp.broadcast_to(d.loc, shape).reshape(-1, q)
    L = jnp.broadcast_to(d.scale_tril, shape + (q,)).reshape(-1, q, q)
    return loc, L


def _allclose(a, b, rtol=2e-3, atol_scale=1e-5):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    atol = atol_scale * max(1.0, float(np.max(np.abs(a))) if a.size else 1.0)
    return a.shape == b.shape and bool(np.all(np.abs(a - b) <= atol + rtol * np.abs(b)))


def _is_positive(c) -> bool:
    return isinstance(c, type(constraints.positive))


def _is_real(c) -> bool:
    return c in (constraints.real, constraints.real_vector)


# ------------------------------------------------------------------------------ detection
class GaussianSpec(NamedTuple):
    """The structure found by :func:`detect_gaussian` (static: no data values)."""

    diag_sites: tuple  # latent Normal sites (diagonal Omega)
    mvn_sites: tuple  # (name, rule, cov param names) of MultivariateNormal sites
    obs_sites: tuple  # observed Normal sites with a closed-form residual scale
    loc_idx: np.ndarray  # flat theta indices of the location coefficients beta
    lat_g: np.ndarray  # flat theta index of each diag latent element's scale
    obs_g: tuple  # (site, (n_site,) flat theta index of each element's scale)
    scale_lat_idx: np.ndarray  # flat theta indices of diag latent scales
    scale_obs_idx: np.ndarray  # flat theta indices of residual scales
    newton_idx: np.ndarray  # flat theta indices updated by SA-Newton
    mvn_q: tuple  # event size of each MVN site
    diag_loc_idx: np.ndarray = np.zeros(0, int)  # flat theta indices of diag-site locations
    mvn_par_idx: np.ndarray = np.zeros(0, int)  # flat theta indices of MVN locations, covs


_MVN_RULES = ("cholesky", "covariance", "scale_corr")


def mvn_rule_covariance(rule, names, tc: dict):
    """The covariance of a MultivariateNormal site under its ``rule`` (the inverse of
    :func:`_mvn_rule_params`) from the constrained params ``tc``."""
    if rule == "cholesky":
        L = tc[names[0]]
        return L @ L.T
    if rule == "covariance":
        return tc[names[0]]
    L = tc[names[0]][:, None] * tc[names[1]]
    return L @ L.T


def _mvn_rule_params(rule, names, Sigma):
    """Param values (constrained) giving the covariance ``Sigma`` under ``rule``."""
    if rule == "cholesky":
        return {names[0]: jnp.linalg.cholesky(Sigma)}
    if rule == "covariance":
        return {names[0]: Sigma}
    sd = jnp.sqrt(jnp.diagonal(Sigma))
    corr = Sigma / (sd[:, None] * sd[None, :])
    # names = (omega, L_corr) in the order found
    return {names[0]: sd, names[1]: jnp.linalg.cholesky(corr)}


#: The key of the structure probes (:func:`detect_gaussian`): fixed, so that the M-step a
#: model gets does not depend on the key of the fit.
PROBE_SEED = 7
#: Perturbation sizes (times the default) of the redrawn probes where the model was not
#: finite: two new directions, then smaller steps (still far above the 2e-3 relative
#: tolerance of the affinity checks).
PROBE_RETRY_SCALES = (1.0, 1.0, 0.5, 0.25, 0.125)


class _Probes(NamedTuple):
    """Where :func:`detect_gaussian` looks at the model: three values of :math:`\\theta`
    (flat constrained), two of :math:`z` (flat unconstrained), and the param site of each
    flat constrained coordinate."""

    theta_c: list  # (d,) arrays
    z: list  # (d_z,) arrays
    coord_param: np.ndarray  # (d,) index into info.param_names
    unravel_c: Callable  # flat constrained theta -> dict

    @property
    def pairs(self) -> list[tuple[int, int]]:
        """Every (theta, z) probe pair, in a fixed order."""
        return [(i, j) for i in range(len(self.theta_c)) for j in range(len(self.z))]

    def params_of(self, J) -> set[int]:
        """The params whose coordinates a Jacobian ``J`` ``(rows, d)`` depends on."""
        return {int(self.coord_param[j]) for j in np.nonzero(np.any(J != 0, 0))[0]}

    def columns(self, params) -> np.ndarray:
        """Flat constrained indices of the coordinates of ``params``."""
        return np.nonzero(np.isin(self.coord_param, sorted(params)))[0]


class _SiteProbe(NamedTuple):
    """What the probes say of one site: its location and scale at every probe pair
    (``vals``), their Jacobians in :math:`\\theta` (``loc_jac``, ``scale_jac``, in the order
    of :attr:`_Probes.pairs`) and the params each depends on."""

    loc: np.ndarray  # (P, Z, rows)
    scale: np.ndarray  # (P, Z, rows)
    loc_jac: list  # (rows, d) per pair
    scale_jac: list  # (rows, d) per pair
    loc_params: set
    scale_params: set


def _make_probes(info: ModelInfo, key, scale: float = 1.0) -> _Probes:
    """Three values of :math:`\\theta` (the initial one and two random perturbations of it,
    unconstrained, ``scale`` times the default size) and two of :math:`z` (the initial one
    and a perturbation)."""
    tc0 = {n: jnp.asarray(v) for n, v in info.theta0_c.items()}
    _, unravel_c = ravel_pytree(tc0)
    coord_param = np.concatenate(
        [np.full(int(np.size(tc0[n])), i) for i, n in enumerate(info.param_names)]
    ).astype(int)
    k1, k2, k3 = random.split(key, 3)
    tu0 = info.theta0_u_flat
    probes_u = [tu0, tu0 + scale * 0.3 * random.normal(k1, tu0.shape),
                tu0 + scale * (-0.2 + 0.25 * random.normal(k2, tu0.shape))]
    probes_c = [ravel_pytree(info.constrain_theta(t))[0] for t in probes_u]
    z0 = info.z0_u_flat
    zs = [z0, z0 + scale * 0.2 * random.normal(k3, z0.shape)]
    return _Probes(probes_c, zs, coord_param, unravel_c)


def _probe_sites(info: ModelInfo, pr: _Probes, args, kwargs) -> tuple[dict, dict, np.ndarray]:
    """At every probe pair, the location and scale of each Normal site (and of each latent
    MultivariateNormal site: its location and ``scale_tril``) with their Jacobians in
    :math:`\\theta`, and which params enter each site's log-density. Returns
    ``({site: _SiteProbe}, {site: set of params entering it}, finite)``, ``finite`` ``(P, Z)``
    whether every value, Jacobian and log-density derivative is finite at that pair; one
    compiled program (the data are its arguments: new data or probes of the same shapes
    reuse it)."""
    site_names = info.latent_names + info.observed_names
    unravel_c = pr.unravel_c

    def parts(tcf, zf, args, kwargs):
        zc, _ = info.constrain_z(zf)
        tr = info.trace_at(unravel_c(tcf), zc, args, kwargs)
        out = {}
        for n in site_names:
            s = tr[n]
            if s.get("scale") is not None:
                continue
            p = unwrap_normal(s["fn"], s["value"])
            if p is not None:
                out[n] = (p[0].reshape(-1), p[1].reshape(-1))
                continue
            if n in info.latent_names:
                m = unwrap_mvn(s["fn"], s["value"])
                if m is not None:
                    out[n] = (m[0].reshape(-1), m[1].reshape(-1))
        return out

    def site_lps(tcf, zf, args, kwargs):
        zc, _ = info.constrain_z(zf)
        lps = info.site_log_probs({**unravel_c(tcf), **zc}, args, kwargs)
        return {n: jnp.sum(v) for n, v in lps.items()}

    # the data are arguments of the probe (those the model reads concretely are constants)
    arrays, static = split_data(args, kwargs, info.static_data)

    def probe(P, Z, arrays):
        a, k = merge_data(arrays, static)
        jac_val = jax.jacfwd(lambda t, z: (parts(t, z, a, k),) * 2, has_aux=True)
        jacs, vals = jax.vmap(jax.vmap(jac_val, (None, 0)), (0, None))(P, Z)
        dep = jax.vmap(jax.vmap(jax.jacfwd(lambda t, z: site_lps(t, z, a, k)), (None, 0)),
                       (0, None))(P, Z)
        return vals, jacs, dep

    P, Z = jnp.stack(pr.theta_c), jnp.stack(pr.z)
    vals, jacs, dep = jax.tree.map(np.asarray, jit_once(probe)(P, Z, arrays))
    finite = np.ones((P.shape[0], Z.shape[0]), bool)
    for leaf in jax.tree.leaves((vals, jacs, dep)):
        finite &= np.all(np.isfinite(leaf.reshape(P.shape[0], Z.shape[0], -1)), axis=-1)
    # which params enter the log-density of each site (any probe)
    enters = {n: {int(pr.coord_param[j]) for j in np.nonzero(np.any(dep[n] != 0, (0, 1)))[0]}
              for n in site_names}
    sites = {}
    for n in vals:
        Jl = [jacs[n][0][i, j] for i, j in pr.pairs]
        Js = [jacs[n][1][i, j] for i, j in pr.pairs]
        sites[n] = _SiteProbe(vals[n][0], vals[n][1], Jl, Js,
                              set().union(*[pr.params_of(J) for J in Jl]),
                              set().union(*[pr.params_of(J) for J in Js]))
    return sites, enters, finite


def _positive_params(info: ModelInfo, params) -> bool:
    return all(_is_positive(info.param_constraints[info.param_names[p]]) for p in params)


def _observed_candidate(info: ModelInfo, pr: _Probes, sp: _SiteProbe) -> dict | None:
    """An observed Normal site whose scale is, element by element, one positive param times
    a constant: ``dict(g=flat index of each element's scale param, scale, loc)``, or
    ``None``."""
    if not _positive_params(info, sp.scale_params):
        return None
    cols = pr.columns(sp.scale_params)
    if any(np.any(np.count_nonzero(J[:, cols], axis=1) != 1) for J in sp.scale_jac):
        return None
    g = cols[np.argmax(sp.scale_jac[0][:, cols] != 0, axis=1)]
    if not all(_allclose(sp.scale[i, j], sp.scale_jac[k][:, cols] @ np.asarray(
            pr.theta_c[i])[cols]) for k, (i, j) in enumerate(pr.pairs)):
        return None
    return dict(g=g, scale=sp.scale_params, loc=sp.loc_params)


def _affine_location(info: ModelInfo, pr: _Probes, sp: _SiteProbe) -> bool:
    """The location is affine in real-valued params, with a design that depends on neither
    :math:`z` nor :math:`\\theta`."""
    if sp.loc_params and not all(_is_real(info.param_constraints[info.param_names[p]])
                                 for p in sp.loc_params):
        return False
    lcols = pr.columns(sp.loc_params)
    if not all(_allclose(J[:, lcols], sp.loc_jac[0][:, lcols]) for J in sp.loc_jac):
        return False
    A_full = sp.loc_jac[0][:, lcols]
    c0 = sp.loc[0, 0] - A_full @ np.asarray(pr.theta_c[0])[lcols]
    return all(_allclose(sp.loc[i, j], A_full @ np.asarray(pr.theta_c[i])[lcols] + c0)
               for i, j in pr.pairs)


def _latent_candidate(info: ModelInfo, pr: _Probes, n: str, sp: _SiteProbe, is_mvn: bool,
                      args, kwargs, key) -> dict | None:
    """A latent site with an affine location (:func:`_affine_location`) and either (Normal)
    each scale one positive param times a constant, or (MultivariateNormal) a recognised
    parametrisation of its covariance (:func:`_find_mvn_rule`); ``None`` otherwise."""
    if not _affine_location(info, pr, sp):
        return None
    if not all(_allclose(J, sp.scale_jac[0]) for J in sp.scale_jac) and not is_mvn:
        return None
    if is_mvn:
        q = info.trace0[n]["value"].shape[-1]
        rule = _find_mvn_rule(info, n, sorted(sp.scale_params), args, kwargs, key)
        if rule is None:
            return None
        return dict(kind="mvn", loc=sp.loc_params, scale=sp.scale_params, rule=rule, q=q)
    if not _positive_params(info, sp.scale_params):
        return None
    cols = pr.columns(sp.scale_params)
    J0 = sp.scale_jac[0][:, cols]
    if np.any(np.count_nonzero(J0, axis=1) != 1):
        return None
    g = cols[np.argmax(J0 != 0, axis=1)]
    if not _allclose(sp.scale[0, 0], J0 @ np.asarray(pr.theta_c[0])[cols]):
        return None
    return dict(kind="diag", loc=sp.loc_params, scale=sp.scale_params, g=g)


def _keep_own_params(cand_lat: dict, cand_obs: dict, enters: dict, site_names) -> None:
    """Drop (in place, to a fixed point) the candidates whose closed-form params enter
    another site: a location coefficient may be shared with another closed-form latent
    site, and so may a (vector) scale param between diagonal sites (each element matched to
    its coordinate, e.g. omega[0] and omega[1] of two sites); a residual scale may be
    shared between observed candidates; and no param may be the scale of both a latent and
    an observed candidate."""
    changed = True
    while changed:
        changed = False
        for n in list(cand_lat):
            own = cand_lat[n]["loc"] | cand_lat[n]["scale"]
            others_loc = [m for m in cand_lat if m != n]
            for m in site_names:
                if m == n:
                    continue
                shared = own & enters[m]
                if not shared:
                    continue
                ok = m in others_loc and (
                    shared <= (cand_lat[n]["loc"] & cand_lat[m]["loc"])
                    or (shared <= (cand_lat[n]["scale"] & cand_lat[m]["scale"])
                        and cand_lat[n]["kind"] == cand_lat[m]["kind"] == "diag"))
                if not ok:
                    del cand_lat[n]
                    changed = True
                    break
        for n in list(cand_obs):
            for m in site_names:
                if m != n and cand_obs[n]["scale"] & enters[m] and not (
                        m in cand_obs and cand_obs[n]["scale"] <= cand_obs[m]["scale"]):
                    del cand_obs[n]
                    changed = True
                    break
        lat_scales = set().union(*[v["scale"] for v in cand_lat.values()]) if cand_lat else set()
        for n in list(cand_obs):
            if cand_obs[n]["scale"] & lat_scales:
                del cand_obs[n]
                changed = True


def _gaussian_spec(info: ModelInfo, pr: _Probes, cand_lat: dict, cand_obs: dict
                   ) -> GaussianSpec:
    """The :class:`GaussianSpec` of the kept candidates (sites in the model's order)."""
    diag_sites = tuple(n for n in info.latent_names if n in cand_lat
                       and cand_lat[n]["kind"] == "diag")
    mvn_sites = tuple(n for n in info.latent_names if n in cand_lat
                      and cand_lat[n]["kind"] == "mvn")
    obs_sites = tuple(n for n in info.observed_names if n in cand_obs)
    loc_params = set().union(*[v["loc"] for v in cand_lat.values()])
    closed = set(loc_params)
    for v in cand_lat.values():
        closed |= v["scale"]
    for v in cand_obs.values():
        closed |= v["scale"]
    newton_params = set(range(len(info.param_names))) - closed
    idx_of = pr.columns
    return GaussianSpec(
        diag_sites=diag_sites,
        mvn_sites=tuple((n, cand_lat[n]["rule"][0], cand_lat[n]["rule"][1]) for n in mvn_sites),
        obs_sites=obs_sites,
        loc_idx=idx_of(loc_params),
        lat_g=(np.concatenate([cand_lat[n]["g"] for n in diag_sites]) if diag_sites
               else np.zeros(0, int)),
        obs_g=tuple((n, cand_obs[n]["g"]) for n in obs_sites),
        scale_lat_idx=idx_of(set().union(*[cand_lat[n]["scale"] for n in diag_sites])
                             if diag_sites else set()),
        scale_obs_idx=idx_of(set().union(*[v["scale"] for v in cand_obs.values()])
                             if cand_obs else set()),
        newton_idx=idx_of(newton_params),
        mvn_q=tuple(cand_lat[n]["q"] for n in mvn_sites),
        diag_loc_idx=idx_of(set().union(*[cand_lat[n]["loc"] for n in diag_sites])
                            if diag_sites else set()),
        mvn_par_idx=idx_of(set().union(*[cand_lat[n]["loc"] | cand_lat[n]["scale"]
                                         for n in mvn_sites]) if mvn_sites else set()),
    )


def detect_gaussian(info: ModelInfo, args, kwargs, key=None
                    ) -> tuple[GaussianSpec | None, str]:
    """Recognise the Gaussian random-effects family by numerical probes (three values of
    :math:`\\theta`, two of :math:`z`). Returns ``(spec, "")`` or ``(None, reason)`` when no
    latent site is of the family (the whole M-step is then SA-Newton).

    A latent Normal site is closed-form when its location is exactly affine in real-valued
    parameters with a design that depends on neither :math:`z` nor :math:`\\theta` and each
    scale is proportional to one positive parameter; a MultivariateNormal site when its
    location is affine and its covariance is one of the recognised parametrisations (checked
    by mapping a random covariance to the parameters and back). These parameters must not
    enter any other site. An observed Normal site gives a closed-form residual scale when its
    scale is proportional to one positive parameter that enters no other site. All other
    parameters are left to SA-Newton.

    The probes are drawn from ``key`` (default :data:`PROBE_SEED`: the same for every fit
    of a model); a perturbed probe where the model is not finite is redrawn
    (:data:`PROBE_RETRY_SCALES`).

    The steps: the probe points (:func:`_make_probes`), the sites' locations, scales and
    dependencies there (:func:`_probe_sites`), each site's candidacy
    (:func:`_observed_candidate`, :func:`_latent_candidate`), the candidates whose
    params are their own (:func:`_keep_own_params`), the spec (:func:`_gaussian_spec`).
    """
    key = random.key(PROBE_SEED) if key is None else key
    pr = _make_probes(info, key)
    sites, enters, finite = _probe_sites(info, pr, args, kwargs)
    for attempt, scale in enumerate(PROBE_RETRY_SCALES):
        if finite.all() or not finite[0, 0]:
            break
        # a perturbed probe where the model is not finite (e.g. a covariate coefficient
        # moved by 0.3 on a covariate spanning +-50: no steady state) says nothing about the
        # model's structure, and its NaN derivatives would make every param seem to enter
        # every site: redraw it (new directions, then smaller steps)
        new = _make_probes(info, random.fold_in(key, attempt + 1), scale)
        pr = pr._replace(
            theta_c=[old if ok else nw for old, nw, ok in zip(pr.theta_c, new.theta_c,
                                                                finite[:, 0], strict=True)],
            z=[old if ok else nw for old, nw, ok in zip(pr.z, new.z, finite[0], strict=True)])
        sites, enters, finite = _probe_sites(info, pr, args, kwargs)
    if finite[0, 0] and not finite.all():
        return None, ("the model is not finite at points near the initial values (the "
                      "structure probes of the closed-form M-step)")
    cand_lat: dict = {}
    cand_obs: dict = {}
    for n, sp in sites.items():
        if not sp.scale_params or sp.loc_params & sp.scale_params:
            continue
        if n in info.observed_names:
            cand = _observed_candidate(info, pr, sp)
            if cand is not None:
                cand_obs[n] = cand
            continue
        is_mvn = unwrap_normal(info.trace0[n]["fn"], info.trace0[n]["value"]) is None
        cand = _latent_candidate(info, pr, n, sp, is_mvn, args, kwargs, key)
        if cand is not None:
            cand_lat[n] = cand
    _keep_own_params(cand_lat, cand_obs, enters, info.latent_names + info.observed_names)
    if not cand_lat:
        return None, "no latent site is Gaussian with an affine mean and a recognised scale"
    return _gaussian_spec(info, pr, cand_lat, cand_obs), ""


def _find_mvn_rule(info: ModelInfo, site, scale_params, args, kwargs, key):
    """Which parametrisation maps a covariance to the site's covariance parameters:
    ``(rule, param names)`` or ``None``. Checked on a random covariance."""
    names = [info.param_names[p] for p in scale_params]
    q = info.trace0[site]["value"].shape[-1]
    A = np.asarray(random.normal(key, (q, q)))
    Sigma = jnp.asarray(A @ A.T + q * np.eye(q), dtype=jnp.result_type(float))
    rules = []
    if len(names) == 1:
        c = info.param_constraints[names[0]]
        if c is constraints.lower_cholesky or isinstance(c, type(constraints.lower_cholesky)):
            rules.append(("cholesky", (names[0],)))
        if c is constraints.positive_definite or isinstance(
                c, type(constraints.positive_definite)):
            rules.append(("covariance", (names[0],)))
        rules += [("cholesky", (names[0],)), ("covariance", (names[0],))]
    elif len(names) == 2:
        a, b = names
        for om, lc in ((a, b), (b, a)):
            if _is_positive(info.param_constraints[om]) and isinstance(
                    info.param_constraints[lc], type(constraints.corr_cholesky)):
                rules.append(("scale_corr", (om, lc)))
    for rule, nm in rules:
        try:
            vals = _mvn_rule_params(rule, nm, Sigma)
            if any(jnp.shape(v) != jnp.shape(info.theta0_c[k]) for k, v in vals.items()):
                continue
            tc = {**info.theta0_c, **vals}
            zc = {n: info.trace0[n]["value"] for n in info.latent_names}
            tr = info.trace_at(tc, zc, args, kwargs)
            m = unwrap_mvn(tr[site]["fn"], tr[site]["value"])
            L = np.asarray(m[1], np.float64)
            cov = L @ np.swapaxes(L, -1, -2)
            if _allclose(cov, np.broadcast_to(np.asarray(Sigma), cov.shape), rtol=1e-4):
                return rule, nm
        except Exception:  # noqa: BLE001 - a rule that does not apply to this site
            continue
    return None


# ------------------------------------------------------------------------------ M-steps
class NewtonState(NamedTuple):
    """SA averages of the complete-data score and Hessian (unconstrained, the Newton
    coordinates) and the modified Hessian used for transport."""

    g: jax.Array
    H: jax.Array
    Hmod: jax.Array


#: SA-Newton steps taken while gamma = 1 (the exploration phase) are backtracked until the
#: complete-data log-likelihood of the current draws increases (Armijo): at most this many
#: halvings, after which the step is not taken
LINE_SEARCH_HALVINGS = 12


def _log_scale_mask(info: ModelInfo) -> np.ndarray:
    """Unconstrained coordinates whose natural scale is 1: those of params whose bijection is
    elementwise ``exp`` or ``sigmoid`` (with an affine shift): ``positive``, ``greater_than``,
    ``interval``, ``unit_interval`` -- a step of ``max_step`` there multiplies the value (or
    its odds) by ``e^max_step``, whatever the value. Every other coordinate is measured
    against its magnitude (:func:`_step_bounds`)."""
    from numpyro.distributions import transforms as T

    m = np.zeros(info.dim_theta, bool)
    for i, n in enumerate(info.param_names):
        t = info.param_transforms[n]
        parts = t.parts if isinstance(t, T.ComposeTransform) else [t]
        if (any(isinstance(q, T.ExpTransform | T.SigmoidTransform) for q in parts)
                and all(isinstance(q, T.ExpTransform | T.SigmoidTransform | T.AffineTransform)
                        for q in parts)):
            m[info.param_offsets_u[i]:info.param_offsets_u[i + 1]] = True
    return m


def _step_bounds(theta, step, max_step, log_scale):
    """Per coordinate, the largest move a step may make: ``max_step`` on a log (or logit)
    scale coordinate (``log_scale``); otherwise ``max_step * max(1, |theta|)`` away from 0
    and, toward 0, ``max(max_step, (1 - e^-max_step) |theta|)``: a coordinate beyond
    ``max_step`` keeps at least ``e^-max_step`` of its magnitude, so that it neither lands
    on 0 nor crosses it in one step from afar (before, the bound ``max_step * max(1,
    |theta|)`` put a Theophylline PKModel's ``mu_V = log V`` from 3.05 exactly on 0 -- V from
    21 to 1 -- and a log standard deviation ``log omega = -4`` could move by 4, then 8, ...:
    a variance collapsing at an accelerating rate)."""
    mag = jnp.abs(theta)
    away = max_step * jnp.maximum(1.0, mag)
    toward = jnp.maximum(max_step, (1.0 - np.exp(-max_step)) * mag)
    rel = jnp.where(step * theta < 0, toward, away)
    return jnp.where(jnp.asarray(log_scale), max_step, rel)


def _newton_step(state: NewtonState, gamma, sc, he, damping, max_step, eig_floor, theta,
                 gamma_h=None, log_scale=None):
    """The SA update of the surrogate and its Newton step, scaled as a whole (the direction
    kept) so that no coordinate moves beyond its bound (:func:`_step_bounds`). Clipping each
    coordinate on its own, as before, changed the direction of the step: with a noisy
    one-chain Hessian it could even point downhill."""
    g = state.g + gamma * (sc - state.g)
    H = state.H + (gamma if gamma_h is None else gamma_h) * (he - state.H)
    # Jacobi scaling before the eigen-decomposition: the floor below acts on the curvature of
    # the standardised coordinates, so that badly scaled coordinates (an intercept next to the
    # slope of an uncentred covariate of ~200: condition ~5e6, a correlation of 0.996) are
    # not floored into a crawl along their ridge
    Hs = -(H + H.T) / 2.0
    d = jnp.sqrt(jnp.abs(jnp.diagonal(Hs)))
    d = jnp.where(d > 0, d, 1.0)
    d = jnp.maximum(d, 1e-6 * jnp.max(d))
    lam, V = jnp.linalg.eigh(Hs / d[:, None] / d[None, :])
    lam = jnp.abs(lam)
    lam = jnp.maximum(lam, jnp.maximum(eig_floor * jnp.max(lam), 1e-12))
    V = V / d[:, None]  # columns: the eigenvectors mapped back, D^{-1} V
    step = damping * (V @ ((V.T @ g) / lam))
    if log_scale is None:
        log_scale = np.zeros(theta.shape, bool)
    bound = _step_bounds(theta, step, max_step, log_scale)
    tiny = jnp.finfo(step.dtype).tiny
    scale = jnp.minimum(1.0, jnp.min(bound / jnp.maximum(jnp.abs(step), tiny), initial=1.0))
    step = step * scale
    W = V * (d * d)[:, None]  # D V: -Hmod = D V diag(lam) V^T D
    Hmod = -(W * lam) @ W.T
    return step, NewtonState(g, H, Hmod)


def _backtrack(objective, x0, step, g, active):
    """The step scaled by the largest ``2^-j`` (``j <= LINE_SEARCH_HALVINGS``) that increases
    ``objective`` by at least ``1e-4`` of its linear prediction (Armijo) or makes it
    non-finite, or 0 if none does; the whole step when ``active`` is false (no objective
    evaluated)."""
    if objective is None:
        return step

    def search(_):
        slope = jnp.vdot(g, step)

        # j = -1 evaluates the start (f0), j = 0, 1, ... the halvings: one evaluation site of
        # the objective in the program
        def cond(c):
            return ~c[1] & (c[2] <= LINE_SEARCH_HALVINGS)

        def body(c):
            _, _, j, f0 = c
            start = j < 0
            a = jnp.where(start, 0.0, jnp.asarray(0.5, step.dtype) ** j).astype(step.dtype)
            v = objective(x0 + a * step)
            f0 = jnp.where(start, v, f0)
            # a step to where the model is not finite is taken: a declared constraint keeps
            # theta in its domain, so this is a model not defined on the domain its params
            # declare (e.g. a variance without constraints.positive), which the fit reports
            # by name at the failing iteration; refusing the step would hide it
            ok = ~start & (~jnp.isfinite(v) | (v >= f0 + 1e-4 * a * slope))
            return jnp.where(ok, a, 0.0).astype(step.dtype), ok, j + 1, f0

        zero = jnp.zeros((), step.dtype)
        a, _, _, f0 = lax.while_loop(cond, body, (zero, jnp.zeros((), bool),
                                                  -jnp.ones((), jnp.int32), zero))
        # a non-finite objective at the start (a model not finite at these draws): no test
        return jnp.where(jnp.isfinite(f0), a, 1.0) * step

    return lax.cond(active, search, lambda _: step, None)


class NewtonMStep(MStep):
    """Stochastic-approximation Newton on the SA-averaged complete-data log-likelihood.

    Keeps SA averages of the score :math:`g` and Hessian :math:`H` of
    :math:`\\log p(y, z\\mid\\theta)` (unconstrained :math:`\\theta`); the quadratic surrogate
    is transported along the iterates (:math:`g \\leftarrow g + H\\,\\Delta\\theta`), so that an
    undamped step gives Gu & Kong's (1998) SA Newton--Raphson
    :math:`\\theta^+ = \\theta + \\gamma (-H)^{-1}\\nabla\\log p(y, z\\mid\\theta)`.
    Where :math:`-H` is not positive definite (far from the maximum) its eigenvalues are
    replaced by their absolute values (saddle-free Newton, Dauphin et al. 2014), floored at
    ``eig_floor`` times the largest -- eigenvalues of the Jacobi-scaled Hessian
    :math:`D^{-1/2}HD^{-1/2}` (:math:`D = |\\mathrm{diag}\\,H|`), so that the floor does not
    depend on the units of the coordinates; the step is scaled (its direction kept) so that no
    coordinate moves beyond its bound (:func:`_step_bounds`: ``max_step`` on a log scale,
    relative to the magnitude otherwise), and while :math:`\\gamma = 1` it is backtracked
    until the complete-data log-likelihood of the current draws increases
    (:func:`_backtrack`): a Newton step from a noisy or indefinite Hessian can overshoot by
    orders of magnitude and collapse a variance.
    Annealing floors positive scalar parameters at ``sqrt(anneal_factor)`` times their
    previous value.
    """

    kind = "newton"
    needs_score = True
    transport = None

    def __init__(self, info: ModelInfo, damping: float = 1.0, max_step: float = 1.0,
                 eig_floor: float = 1e-4, anneal_factor: float = 0.97,
                 annealed: np.ndarray | None = None) -> None:
        self.info = info
        self.damping, self.max_step, self.eig_floor = float(damping), float(max_step), eig_floor
        self.tau = anneal_factor
        self.annealed = _positive_mask(info) if annealed is None else annealed
        self.log_scale = _log_scale_mask(info)

    def prepare(self, theta_u, z, data, M):
        return M  # the centring design: the line search moves the chains with theta

    def init(self, theta_u, z, data, aux):
        d = self.info.dim_theta
        dt = jnp.result_type(theta_u)
        return NewtonState(jnp.zeros(d, dt), jnp.zeros((d, d), dt), jnp.zeros((d, d), dt))

    def update(self, state, gamma, theta_u, z, data, aux, anneal, score_hess):
        sc, he = score_hess
        step, st = _newton_step(state, gamma, sc, he, self.damping, self.max_step,
                                self.eig_floor, theta_u, log_scale=self.log_scale)
        step = _backtrack(_centred_objective(self.info, theta_u, z, data, aux), theta_u, step,
                          st.g, gamma >= 1.0)
        theta_new = _anneal_flat(self.info, theta_u, theta_u + step, self.annealed, anneal,
                                 self.tau)
        st = st._replace(g=st.g + st.Hmod @ (theta_new - theta_u))
        return theta_new, st


def _centred_objective(info: ModelInfo, theta_u, z, data, M, idx=None, base=None):
    """``f(x)``: the complete-data log-likelihood averaged over the chains ``z`` (drawn at
    ``theta_u``) at :math:`\\theta` = ``base`` with coordinates ``idx`` set to ``x`` (all
    coordinates when ``idx`` is ``None``), the chains moved along the centred coordinates
    :math:`z - M(\\theta - \\theta_u)` -- the objective whose score and Hessian the SA-Newton
    step of the centred cycle uses (:func:`~numpyro_fed.saem.model.centred_score_hess`)."""
    args, kwargs = data

    def f(x):
        t = x if idx is None else base.at[idx].set(x)
        return jnp.mean(jax.vmap(
            lambda zf: info.log_joint(t, zf - M @ (t - theta_u), args, kwargs))(z))

    return f


def _positive_mask(info: ModelInfo) -> np.ndarray:
    """Coordinates of the flat *constrained* theta that belong to positive params."""
    m = np.zeros(info.dim_theta_c, bool)
    for i, n in enumerate(info.param_names):
        if _is_positive(info.param_constraints[n]):
            m[info.param_offsets[i]:info.param_offsets[i + 1]] = True
    return m


def _anneal_flat(info, theta_old_u, theta_new_u, mask, anneal, tau):
    """Floor the masked (positive) constrained coordinates at ``sqrt(tau)`` times their old
    value while ``anneal`` holds (a variance decreases at most by ``tau``)."""
    if not np.any(mask):
        return theta_new_u
    old = info.theta_c_flat(theta_old_u)
    new = info.theta_c_flat(theta_new_u)
    floored = jnp.where(jnp.asarray(mask) & anneal, jnp.maximum(new, jnp.sqrt(tau) * old), new)
    return info.unconstrain_theta(info._unravel_theta_c(floored))


class UserMStep(MStep):
    """Stochastic approximation on user sufficient statistics + their closed-form maximiser
    (:class:`SufficientStatistics`)."""

    kind = "sufficient-statistics"
    needs_score = False
    transport = None

    def __init__(self, info: ModelInfo, ss: SufficientStatistics, anneal_factor=0.97,
                 annealed: np.ndarray | None = None):
        self.info, self.ss = info, ss
        self.tau = anneal_factor
        self.annealed = _positive_mask(info) if annealed is None else annealed

    def prepare(self, theta_u, z, data, M):
        return ()

    def _mean_stats(self, z, data):
        args, kwargs = data

        def one(zf):
            zc, _ = self.info.constrain_z(zf)
            return self.ss.stats(zc, *args, **kwargs)

        return jax.tree.map(lambda v: jnp.mean(v, 0), jax.vmap(one)(z))

    def init(self, theta_u, z, data, aux):
        return self._mean_stats(z, data)

    def update(self, state, gamma, theta_u, z, data, aux, anneal, score_hess):
        args, kwargs = data
        s = jax.tree.map(lambda a, b: a + gamma * (b - a), state, self._mean_stats(z, data))
        new = self.ss.maximizer(s, *args, **kwargs)
        missing = set(self.info.param_names) - set(new)
        if missing:
            raise ValueError(
                f"SufficientStatistics.maximizer returned no value for param sites "
                f"{sorted(missing)}; it must return a dict with every `param` site."
            )
        tc = {n: jnp.asarray(new[n], jnp.result_type(float)) for n in self.info.param_names}
        theta_new = self.info.unconstrain_theta(tc)
        theta_new = _anneal_flat(self.info, theta_u, theta_new, self.annealed, anneal,
                                 self.tau)
        return theta_new, s


#: the interweaving cycle averages its Hessian over at least this many M-steps
NC_HESSIAN_MEMORY = 4

#: while gamma = 1, the interweaving cycle lowers a random-effect variance by at most this
#: factor per iteration below the centred cycle's value where the centred cycle did not lower
#: it (``None``: no limit); see :meth:`GaussianMStep.update`. Measured on the normal-normal
#: model (30 subjects, y ~ N(0, 1), seeds 0-39; exact -2LL gap at the estimates; 18 seeds with
#: an interior MLE, 22 with the MLE at 0): no limit -- interior gaps up to 0.755 (3 of 18 above
#: 0.05: omega collapsed from its MLE 0.49 to the floor), boundary up to 0.101 (2 of 22); 0.5
#: -- interior up to 0.038 (0 of 18), boundary up to 0.133 (3 of 22, each warned by the
#: likelihood's slope at 0); 0.3 -- 0.101 (1 of 18, a collapse) and 0.079 (1 of 22); 0.7 --
#: 0.060 and 0.162 (5 of 22). Limiting it whatever the centred cycle did (0.97, 0.8, 0.5):
#: the boundary fits slowed, up to 0.21 (10 of 22 above 0.05) with 0.97
NC_EXPLORE_TAU = 0.5

#: a variance heading to the boundary 0 (its maximum-likelihood value is 0: a singular fit)
#: is held at this fraction of the largest value its standard deviation had during the fit
#: (theta_0 included), after the closed-form cycle and after the whole update. Its cost in
#: -2LL is 2|g| (1e-5 omega_max)^2 for the derivative g of the log-likelihood in the variance
#: at 0 (below 1e-6 on the boundary cases measured). Without it the moment formula of a
#: variance whose MLE is 0 fell geometrically (to 1e-15, its own floor) and the interweaving
#: cycle's float32 score of the latents' prior overflowed: a normal-normal model with 30
#: subjects crashed at iteration 274 (seed 0) and on 2 of 8 seeds. The Monte Carlo noise of
#: that cycle moves a variance held at the floor by a factor up to ~40 above it (measured:
#: 1e-3 let Dyestuff2's tau climb back to 1.2% of its largest value, no longer told from an
#: interior estimate); 1e-5 keeps it below
#: :data:`~numpyro_fed.saem.result.BOUNDARY_RATIO` (1e-3), so it is reported singular
VARIANCE_FLOOR = 1e-5

#: smallest eigenvalue of a full Omega's correlation matrix (a correlation heading to +-1,
#: a singular fit): 1e-6, a conditional standard deviation of 1.4e-3 of the marginal one for
#: two random effects. Without it the moment formula's covariance lost positive definiteness
#: in float32 rounding as a correlation approached 1 and its Cholesky factor was NaN: nlme's
#: Phenobarb with a full Omega (CL, V) crashed on 2 of 4 seeds ("the M-step gave a
#: non-finite theta at iteration 200", L_omega[1,1] at 9e-4 of L_omega[1,0])
CORR_FLOOR = 1e-6


def _corr_floor(Sig):
    """``(Sig', low)``: the covariance ``Sig`` with its correlation matrix's smallest
    eigenvalue held at :data:`CORR_FLOOR` (the variances kept; ``Sig`` itself, bit for bit,
    where it is above), and whether it was below (or not finite)."""
    sd = jnp.sqrt(jnp.maximum(jnp.diagonal(Sig), jnp.finfo(Sig.dtype).tiny))
    R = Sig / (sd[:, None] * sd[None, :])
    w, U = jnp.linalg.eigh((R + R.T) / 2.0)
    low = ~(jnp.min(w) >= CORR_FLOOR)
    Rf = (U * jnp.maximum(w, CORR_FLOOR)) @ U.T
    rd = jnp.sqrt(jnp.diagonal(Rf))
    Rf = Rf / (rd[:, None] * rd[None, :])
    return jnp.where(low, Rf * sd[:, None] * sd[None, :], Sig), low


class GaussianAux(NamedTuple):
    """Data-dependent constants of :class:`GaussianMStep` (computed in the program)."""

    A: jax.Array  # (n_diag, p) design of the diag latent means
    c: jax.Array  # (n_diag,)
    lat_r: jax.Array  # (n_diag,) scale / theta[g]
    mvn_A: tuple  # per MVN site (rows, q, p)
    mvn_c: tuple  # per MVN site (rows, q)
    M: Any  # (d_z, d) centring design (see :func:`~numpyro_fed.saem.model.centring_design`)


class GaussianState(NamedTuple):
    s: Any  # SA statistics
    newton: NewtonState  # centred SA-Newton cycle (full (d,) coordinates)
    nc: NewtonState  # interweaving SA-Newton cycle (its own coordinates; empty if none)
    ref: jax.Array  # theta before the interweaving cycle of the last update (unconstrained)
    count: jax.Array  # updates done
    smax: jax.Array  # (d,) largest constrained value of each scale coordinate so far
    vmax: tuple  # per MVN site: largest variance (diagonal of Omega) so far


class GaussianMStep(MStep):
    """Closed-form M-step of the Gaussian random-effects family, SA-Newton for the other
    parameters (see the module docstring). Simulated annealing (saemix): while ``anneal``
    holds, each variance -- a diagonal :math:`\\omega^2`, the diagonal of a full
    :math:`\\Omega` (correlations kept), a residual variance -- decreases at most by the
    factor ``anneal_factor`` per iteration."""

    kind = "gaussian"

    def __init__(self, info: ModelInfo, spec: GaussianSpec, num_ecm: int = 3,
                 damping: float = 1.0, max_step: float = 1.0, eig_floor: float = 1e-4,
                 anneal_factor: float = 0.97, interweave: bool = True) -> None:
        self.info, self.spec = info, spec
        self.num_ecm = int(num_ecm)
        self.damping, self.max_step, self.eig_floor = float(damping), float(max_step), eig_floor
        self.tau = float(anneal_factor)
        self.needs_score = bool(spec.newton_idx.size)
        # spec indices are in the flat constrained theta; SA-Newton works on the unconstrained
        # coordinates of the same param sites
        d = info.dim_theta_c
        coord_param = np.repeat(np.arange(len(info.param_names)), np.diff(info.param_offsets))
        newton_params = np.unique(coord_param[spec.newton_idx])

        def u_idx(params):
            return (np.concatenate([np.arange(info.param_offsets_u[i], info.param_offsets_u[i + 1])
                                    for i in params]) if len(params) else np.zeros(0, int))

        self.newton_idx_u = u_idx(newton_params)
        #: the coordinates of the complete-data score and Hessian that :meth:`update` reads
        #: (computed in those only: a ``k x k`` Hessian, not ``d x d``)
        self.score_idx = self.newton_idx_u
        # interweaving (non-centred SA-Newton cycle) on the locations and scales of the
        # Gaussian sites and on the Newton parameters
        self.interweave = bool(interweave and (spec.diag_sites or spec.mvn_sites))
        if self.interweave:
            nc = np.concatenate([spec.newton_idx, spec.diag_loc_idx, spec.scale_lat_idx,
                                 spec.mvn_par_idx])
            self.nc_idx_u = u_idx(np.unique(coord_param[nc.astype(int)]))
            lab = info._unravel_z(jnp.arange(info.dim_z, dtype=jnp.float32))
            self.diag_pos = (np.concatenate([np.asarray(lab[n]).reshape(-1)
                                             for n in spec.diag_sites]).astype(int)
                             if spec.diag_sites else np.zeros(0, int))
            self.mvn_pos = tuple(np.asarray(lab[n]).reshape(-1, q).astype(int)
                                 for (n, _, _), q in zip(spec.mvn_sites, spec.mvn_q,
                                                         strict=True))
        self.cnt_lat = np.bincount(spec.lat_g, minlength=d).astype(np.float64)
        self.is_lat_scale = np.zeros(d, bool)
        self.is_lat_scale[spec.scale_lat_idx] = True
        self.is_obs_scale = np.zeros(d, bool)
        self.is_obs_scale[spec.scale_obs_idx] = True
        pos = _positive_mask(info)
        self.newton_annealed = np.zeros(d, bool)
        self.newton_annealed[spec.newton_idx] = pos[spec.newton_idx]
        self.nc_annealed = self.newton_annealed | self.is_lat_scale
        #: the variances held above VARIANCE_FLOOR times their running maximum
        self.floor_mask = self.is_lat_scale | self.is_obs_scale
        self._unravel_c = ravel_pytree(info.theta0_c)[1]
        self.log_scale = _log_scale_mask(info)

    # -- constants --------------------------------------------------------------------------
    def _latent_parts(self, tcf, zf, data):
        args, kwargs = data
        zc, _ = self.info.constrain_z(zf)
        tr = self.info.trace_at(self._unravel_c(tcf), zc, args, kwargs)
        diag = [unwrap_normal(tr[n]["fn"], tr[n]["value"]) for n in self.spec.diag_sites]
        mvn = [unwrap_mvn(tr[n]["fn"], tr[n]["value"]) for n, _, _ in self.spec.mvn_sites]
        loc = (jnp.concatenate([p[0].reshape(-1) for p in diag]) if diag
               else jnp.zeros(0, tcf.dtype))
        scale = (jnp.concatenate([p[1].reshape(-1) for p in diag]) if diag
                 else jnp.zeros(0, tcf.dtype))
        return loc, scale, tuple(m[0] for m in mvn)

    def prepare(self, theta_u, z, data, M):
        """Designs and scale ratios at :math:`\\theta` (exact: the means are affine)."""
        tcf = self.info.theta_c_flat(theta_u)
        li = jnp.asarray(self.spec.loc_idx)
        zf = z[0]

        def locs(beta):
            loc, _, mloc = self._latent_parts(tcf.at[li].set(beta), zf, data)
            return loc, mloc

        beta0 = tcf[li]
        loc0, mloc0 = locs(beta0)
        J, mJ = jax.jacfwd(locs)(beta0)
        A = J.reshape(loc0.shape[0], beta0.shape[0])
        c = loc0 - A @ beta0
        mvn_A = tuple(j.reshape(m.shape + (-1,)) for j, m in zip(mJ, mloc0, strict=True))
        mvn_c = tuple(m - jnp.einsum("rqp,p->rq", a, beta0) for a, m in
                      zip(mvn_A, mloc0, strict=True))
        _, scale, _ = self._latent_parts(tcf, zf, data)
        g = jnp.asarray(self.spec.lat_g)
        lat_r = scale / tcf[g] if g.size else scale
        return GaussianAux(A, c, lat_r, mvn_A, mvn_c, M)

    # -- statistics --------------------------------------------------------------------------
    def _stats_one(self, theta_c, zf, data):
        args, kwargs = data
        info, spec = self.info, self.spec
        d = info.dim_theta_c
        zc, _ = info.constrain_z(zf)
        zl = (jnp.concatenate([zc[n].reshape(-1) for n in spec.diag_sites]) if spec.diag_sites
              else jnp.zeros(0, zf.dtype))
        mv = []
        for (n, _, _), q in zip(spec.mvn_sites, spec.mvn_q, strict=True):
            v = zc[n].reshape(-1, q)
            mv.append((v, v[:, :, None] * v[:, None, :]))
        R = jnp.zeros(d, zf.dtype)
        N = jnp.zeros(d, zf.dtype)
        if spec.obs_sites:
            tr = info.trace_at(theta_c, zc, args, kwargs)
            tcf = ravel_pytree(theta_c)[0]
            for n, g in spec.obs_g:
                s = tr[n]
                loc, scale, mask = unwrap_normal(s["fn"], s["value"])
                g = jnp.asarray(g)
                rr = scale.reshape(-1) / tcf[g]
                res = ((s["value"].reshape(-1) - loc.reshape(-1)) / rr) ** 2
                w = mask.reshape(-1).astype(res.dtype)
                R = R + jax.ops.segment_sum(jnp.where(w > 0, res, 0.0), g, d)
                N = N + jax.ops.segment_sum(w, g, d)
        return {"m1": zl, "m2": zl**2, "mvn": tuple(mv), "R": R, "N": N}

    def _mean_stats(self, theta_u, z, data):
        theta_c = self.info.constrain_theta(theta_u)
        st = jax.vmap(lambda zf: self._stats_one(theta_c, zf, data))(z)
        return jax.tree.map(lambda v: jnp.mean(v, 0), st)

    def init(self, theta_u, z, data, aux):
        d = self.info.dim_theta
        dt = jnp.result_type(theta_u)
        nw = NewtonState(jnp.zeros(d, dt), jnp.zeros((d, d), dt), jnp.zeros((d, d), dt))
        e = int(self.nc_idx_u.size) if self.interweave else 0
        nc = NewtonState(jnp.zeros(e, dt), jnp.zeros((e, e), dt), jnp.zeros((e, e), dt))
        t = self.info.theta_c_flat(theta_u)
        vmax = tuple(jnp.diagonal(self._mvn_cov(t, k)) for k in range(len(self.spec.mvn_sites)))
        return GaussianState(self._mean_stats(theta_u, z, data), nw, nc, theta_u,
                             jnp.zeros((), jnp.int32), t, vmax)

    def _floor(self, theta_u, smax, vmax):
        """Hold every variance at :data:`VARIANCE_FLOOR` (on the standard deviation scale) of
        the largest value it had (``smax``, ``vmax``): a diagonal omega or residual scale by
        its coordinate, the diagonal of a full Omega by a symmetric rescaling (the
        correlations kept). Returns the floored theta (unchanged when nothing is below its
        floor) and the updated maxima."""
        t = self.info.theta_c_flat(theta_u)
        fm = jnp.asarray(self.floor_mask)
        smax = jnp.where(fm, jnp.maximum(smax, t), smax)
        low = fm & (t < VARIANCE_FLOOR * smax)
        t2 = jnp.where(low, VARIANCE_FLOOR * smax, t)
        any_low = jnp.any(low)
        new_vmax = []
        for k in range(len(self.spec.mvn_sites)):
            Sig = self._mvn_cov(t2, k)
            dg = jnp.diagonal(Sig)
            vm = jnp.maximum(vmax[k], dg)
            fl = VARIANCE_FLOOR**2 * vm
            f = jnp.where(dg < fl, jnp.sqrt(fl / jnp.maximum(dg, jnp.finfo(dg.dtype).tiny)),
                          1.0)
            any_low = any_low | jnp.any(dg < fl)
            Sig, corr_low = _corr_floor(Sig * f[:, None] * f[None, :])
            any_low = any_low | corr_low
            t2 = jnp.where(jnp.any(dg < fl) | corr_low, self._set_mvn(t2, k, Sig), t2)
            new_vmax.append(vm)
        out = jnp.where(any_low, self.info.unconstrain_theta(self._unravel_c(t2)), theta_u)
        return out, smax, tuple(new_vmax)

    # -- maximisation ------------------------------------------------------------------------
    def _maximize(self, s, t, aux: GaussianAux, anneal):
        spec = self.spec
        d = self.info.dim_theta_c
        A, c = aux.A, aux.c
        lat_g = jnp.asarray(spec.lat_g)
        lat_r = aux.lat_r
        m1, m2 = s["m1"], s["m2"]
        t_old = t
        p = spec.loc_idx.size
        mvn_par = [self._mvn_cov(t, k) for k in range(len(spec.mvn_sites))]
        for _ in range(self.num_ecm if p else 1):
            if p:
                M = jnp.zeros((p, p), t.dtype)
                r = jnp.zeros(p, t.dtype)
                if spec.diag_sites:
                    w = 1.0 / (t[lat_g] * lat_r) ** 2
                    AtW = A.T * w
                    M = M + AtW @ A
                    r = r + AtW @ (m1 - c)
                for k, Sig in enumerate(mvn_par):
                    Si = jnp.linalg.inv(Sig)
                    Ak = aux.mvn_A[k]
                    S1 = s["mvn"][k][0]
                    M = M + jnp.einsum("rqp,qs,rsk->pk", Ak, Si, Ak)
                    r = r + jnp.einsum("rqp,qs,rs->p", Ak, Si, S1 - aux.mvn_c[k])
                # Jacobi-scaled solve with a relative ridge: the weights 1/omega^2 of two
                # sites may differ by many orders of magnitude (a variance near its floor),
                # and a ridge relative to trace(M) would then pull the coefficients of the
                # weakly weighted site to 0
                dsc = 1.0 / jnp.sqrt(jnp.maximum(jnp.diagonal(M), 1e-300))
                Ms = M * dsc[:, None] * dsc[None, :]
                beta = dsc * jnp.linalg.solve(Ms + 1e-10 * jnp.eye(p, dtype=t.dtype), dsc * r)
                t = t.at[spec.loc_idx].set(beta)
            else:
                beta = jnp.zeros(0, t.dtype)
            if spec.diag_sites:
                mlat = A @ beta + c if p else c
                e2 = (m2 - 2.0 * mlat * m1 + mlat**2) / lat_r**2
                var = jax.ops.segment_sum(e2, lat_g, d) / jnp.maximum(self.cnt_lat, 1.0)
                sd = jnp.sqrt(jnp.maximum(var, 1e-30))
                sd = jnp.where(anneal, jnp.maximum(sd, jnp.sqrt(self.tau) * t_old), sd)
                t = jnp.where(self.is_lat_scale, sd, t)
            new_par = []
            for k in range(len(spec.mvn_sites)):
                S1, S2 = s["mvn"][k]
                mk = (jnp.einsum("rqp,p->rq", aux.mvn_A[k], beta) if p else 0.0) + aux.mvn_c[k]
                E = S2 - mk[:, :, None] * S1[:, None, :] - S1[:, :, None] * mk[:, None, :] \
                    + mk[:, :, None] * mk[:, None, :]
                Sig = jnp.mean(E, 0)
                Sig = (Sig + Sig.T) / 2.0
                q = Sig.shape[0]
                Sig = Sig + 1e-12 * jnp.trace(Sig) / q * jnp.eye(q, dtype=Sig.dtype)
                Sig = self._anneal_cov(Sig, self._mvn_cov(t_old, k), anneal)
                Sig, _ = _corr_floor(Sig)
                new_par.append(Sig)
                t = self._set_mvn(t, k, Sig)
            mvn_par = new_par
        if spec.obs_sites:
            var_obs = s["R"] / jnp.maximum(s["N"], 1.0)
            sd = jnp.sqrt(jnp.maximum(var_obs, 1e-30))
            sd = jnp.where(anneal, jnp.maximum(sd, jnp.sqrt(self.tau) * t_old), sd)
            t = jnp.where(self.is_obs_scale, sd, t)
        return t

    def _anneal_cov(self, Sig, Sig_old, anneal):
        """Simulated annealing of a full covariance: while ``anneal`` holds, each variance
        decreases at most by the factor ``tau`` (the correlations kept)."""
        old_d, new_d = jnp.diagonal(Sig_old), jnp.diagonal(Sig)
        f = jnp.where(anneal, jnp.sqrt(jnp.maximum(new_d, self.tau * old_d) / new_d), 1.0)
        return Sig * f[:, None] * f[None, :]

    def _mvn_cov(self, t, k):
        n, rule, names = self.spec.mvn_sites[k]
        return mvn_rule_covariance(rule, names, self._unravel_c(t))

    def _set_mvn(self, t, k, Sig):
        n, rule, names = self.spec.mvn_sites[k]
        tc = self._unravel_c(t)
        tc = {**tc, **_mvn_rule_params(rule, names, Sig)}
        return ravel_pytree(tc)[0]

    def _nc_path(self, t_u, ref_u, zf, aux: GaussianAux):
        """The latents along the non-centred path through ``zf`` at ``ref_u``: the Gaussian
        sites' standardised values held fixed -- :math:`\\eta = (z - \\mu(\\theta_{ref})) /
        \\omega(\\theta_{ref})` of a diagonal site, :math:`\\eta = L(\\theta_{ref})^{-1}(z -
        \\mu(\\theta_{ref}))` of a MultivariateNormal one (:math:`\\Omega = LL^\\top`) --
        and :math:`z(t) = \\mu(t) + \\omega(t)\\eta` (or :math:`\\mu(t) + L(t)\\eta`), every other
        coordinate held fixed (no centring shift: the model's parametrisation with its Gaussian
        sites non-centred); and the log-Jacobian of :math:`\\eta \\mapsto z(t)` (up to a
        constant)."""
        spec = self.spec
        li = jnp.asarray(spec.loc_idx)
        p = spec.loc_idx.size
        tc0, tc1 = self.info.theta_c_flat(ref_u), self.info.theta_c_flat(t_u)
        z2, lj = zf, jnp.zeros((), zf.dtype)
        if spec.diag_sites:
            g = jnp.asarray(spec.lat_g)
            pos = jnp.asarray(self.diag_pos)

            def loc_scale(tcf):
                loc = aux.A @ tcf[li] + aux.c if p else aux.c
                return loc, aux.lat_r * tcf[g]

            l0, s0 = loc_scale(tc0)
            l1, s1 = loc_scale(tc1)
            z2 = z2.at[pos].set(l1 + s1 * ((zf[pos] - l0) / s0))
            lj = lj + jnp.sum(jnp.log(s1))
        for k, pos in enumerate(self.mvn_pos):
            pos = jnp.asarray(pos)
            A, c = aux.mvn_A[k], aux.mvn_c[k]

            def mean(tcf, A=A, c=c):
                return jnp.einsum("rqp,p->rq", A, tcf[li]) + c if p else c

            L0 = jnp.linalg.cholesky(self._mvn_cov(tc0, k))
            L1 = jnp.linalg.cholesky(self._mvn_cov(tc1, k))
            eta = jax.scipy.linalg.solve_triangular(L0, (zf[pos] - mean(tc0)).T, lower=True)
            z2 = z2.at[pos].set(mean(tc1) + (L1 @ eta).T)
            lj = lj + pos.shape[0] * jnp.sum(jnp.log(jnp.diagonal(L1)))
        return z2, lj

    def describe(self) -> dict:
        """Interweaving, the flat constrained indices of the standard deviations of the
        diagonal Gaussian sites and of the residuals, and the MultivariateNormal sites'
        covariance params (for the variance scale of the parameter table)."""
        spec = self.spec
        return {
            "interweave": self.interweave,
            "variance_coords": sorted(int(i) for i in np.concatenate(
                [spec.scale_lat_idx, spec.scale_obs_idx])),
            "mvn_covariances": [(n, r, list(ps)) for n, r, ps in spec.mvn_sites],
        }

    def transport(self, state: GaussianState, zf, theta_old, theta_new, aux: GaussianAux):
        """Where a chain at ``zf`` (a draw at ``theta_old``) goes after the update: by the
        centring shift of the centred cycles (to ``state.ref``), then along the non-centred
        path of the interweaving cycle."""
        if not self.interweave:
            return zf - aux.M @ (theta_new - theta_old)
        z1 = zf - aux.M @ (state.ref - theta_old)
        return self._nc_path(theta_new, state.ref, z1, aux)[0]

    def _nc_score_hess(self, theta_u, z, data, aux: GaussianAux, chain):
        """Mean over chains of the score, and the Hessian at chain ``chain % C``, in the
        interweaving coordinates, of
        :math:`\\log p(y, z(t)\\mid t) + \\log|\\partial z(t)/\\partial\\eta|` along the
        non-centred path through each chain (:meth:`_nc_path`)."""
        args, kwargs = data
        idx = jnp.asarray(self.nc_idx_u)
        info = self.info

        def ll(sub, zf):
            t = theta_u.at[idx].set(sub)
            z2, lj = self._nc_path(t, theta_u, zf, aux)
            return info.log_joint(t, z2, args, kwargs) + lj

        x0 = theta_u[idx]
        zc = lax.dynamic_index_in_dim(z, chain % z.shape[0], keepdims=False)
        # forward mode for a few coordinates of a model without a loop (the reverse pass of
        # a sparse-superposition PK model is slow on XLA:CPU; see prefer_forward)
        fwd = prefer_forward(lambda x: ll(x, zc), x0, info)
        gfn = jax.jacfwd(ll) if fwd else jax.grad(ll)
        g = jnp.mean(jax.vmap(lambda zf: gfn(x0, zf))(z), 0)
        # the Hessian (the costly part, score_hessian) at one chain, a different one at each
        # update: it scales the step only (the fixed point is where the SA-averaged score
        # vanishes), and its SA average runs over the chains
        H = score_hessian(lambda x: ll(x, zc), x0, forward=fwd)[1]
        return g, H

    def _nc_objective(self, theta_u, z, data, aux: GaussianAux):
        """``f(x)``: the objective of :meth:`_nc_score_hess` (mean over the chains ``z``) at
        the interweaving coordinates ``x``."""
        args, kwargs = data
        idx = jnp.asarray(self.nc_idx_u)
        info = self.info

        def f(x):
            t = theta_u.at[idx].set(x)

            def one(zf):
                z2, lj = self._nc_path(t, theta_u, zf, aux)
                return info.log_joint(t, z2, args, kwargs) + lj

            return jnp.mean(jax.vmap(one)(z))

        return f

    def update(self, state: GaussianState, gamma, theta_u, z, data, aux, anneal, score_hess):
        """One M-step (an AECM iteration, Meng & van Dyk 1997): the SA statistics and the
        closed-form cycle (centred); the SA-Newton cycle of the Newton parameters (centred);
        then, when interweaving, an SA-Newton cycle on the non-centred path (the Newton
        parameters and the locations and scales or covariances of the Gaussian sites; Yu &
        Meng 2011's interweaving of the centred and non-centred augmentations, which
        converges fast where the centred one is slow: a variance small against what the data
        say of each subject)."""
        info = self.info
        s_new = self._mean_stats(theta_u, z, data)
        s = jax.tree.map(lambda a, b: a + gamma * (b - a), state.s, s_new)
        tc_u = info.theta_c_flat(theta_u)
        t = self._maximize(s, tc_u, aux, anneal)
        theta_new = info.unconstrain_theta(self._unravel_c(t))
        nw, nc = state.newton, state.nc
        if self.spec.newton_idx.size:
            idx = jnp.asarray(self.newton_idx_u)
            sc, he = score_hess  # in the coordinates score_idx = newton_idx_u already
            theta_new, nw = _block_newton(
                info, nw, idx, gamma, theta_u, theta_new, sc, he, self,
                self.newton_annealed, anneal, full=True,
                objective=_centred_objective(info, theta_u, z, data, aux.M, idx, theta_new))
        # the floor before the interweaving cycle too: its score differentiates the latents'
        # prior at the closed form's variance (a standard deviation of 1e-15 there -- the
        # moment formula of a variance whose MLE is 0 -- overflowed its float32 score)
        theta_new, smax, vmax = self._floor(theta_new, state.smax, state.vmax)
        theta2 = theta_new
        count = state.count + 1
        if self.interweave:
            idx = jnp.asarray(self.nc_idx_u)
            z2 = jax.vmap(lambda zf: zf - aux.M @ (theta2 - theta_u))(z)
            sc, he = self._nc_score_hess(theta2, z2, data, aux, state.count)
            # with MultivariateNormal sites, the Hessian (the metric of the step, not its
            # fixed point) is averaged over at least NC_HESSIAN_MEMORY updates even while
            # gamma = 1: a full step with one draw's Hessian in the Cholesky coordinates can
            # jump and collapse a variance (measured: Orthodont with correlated intercept and
            # slope diverged on every seed; with the memory, -2LL within 0.4 of the maximum).
            # Diagonal sites alone keep the current Hessian (a stale one slows the way back
            # from a small variance: Orthodont 2/4 seeds within the targets instead of 3/4)
            mem = NC_HESSIAN_MEMORY if self.spec.mvn_sites else 1
            gamma_h = jnp.where(state.count == 0, 1.0,
                                jnp.minimum(gamma, 1.0 / mem)).astype(gamma.dtype)
            theta_new, nc = _block_newton(info, nc, idx, gamma, theta_u, theta2, sc, he, self,
                                          self.nc_annealed, anneal, full=False,
                                          gamma_h=gamma_h,
                                          objective=self._nc_objective(theta2, z2, data, aux))
            if self.spec.mvn_sites:
                # with MultivariateNormal sites the cycle waits for the end of the annealing
                # (annealing each variance of the step instead -- at most a factor tau per
                # iteration -- measured worse: Orthodont with correlated REs, -2LL gaps up to
                # 0.70 instead of 0.38)
                theta_new = jnp.where(anneal, theta2, theta_new)
                nc = jax.tree.map(lambda a, b: jnp.where(anneal, a, b), state.nc, nc)
                count = jnp.where(anneal, state.count, count)
            if NC_EXPLORE_TAU is not None and np.any(self.is_lat_scale):
                # while gamma = 1 the cycle's objective is that of one draw: where the
                # standardised draws of a small scale do not correlate with the data its
                # maximum is at 0, and the Newton step walks log(omega) down by 0.5-1 per
                # iteration, faster than the centred cycle brings it back (normal-normal, 30
                # subjects, seed 4: omega from 0.5 to 1e-5 in 13 iterations, MLE 0.49, -2LL
                # 0.75 off). Here it lowers a random-effect scale by at most NC_EXPLORE_TAU
                # (a variance) per iteration below the centred cycle's value, where that cycle
                # did not lower it (where both go down -- a variance whose MLE is 0 -- the
                # cycle keeps its pace)
                old_c = info.theta_c_flat(theta2)
                new_c = info.theta_c_flat(theta_new)
                bound = np.sqrt(NC_EXPLORE_TAU) * old_c
                low = (jnp.asarray(self.is_lat_scale) & (old_c >= tc_u) & (gamma >= 1.0)
                       & (new_c < bound))
                capped = info.unconstrain_theta(info._unravel_theta_c(
                    jnp.where(low, bound, new_c)))
                capped = jnp.where(jnp.any(low), capped, theta_new)  # bit for bit otherwise
                nc = nc._replace(g=nc.g + nc.Hmod @ (capped - theta_new)[idx])
                theta_new = capped
        floored, smax, vmax = self._floor(theta_new, smax, vmax)
        if self.interweave:  # the surrogate of the interweaving cycle follows the floor
            idx = jnp.asarray(self.nc_idx_u)
            nc = nc._replace(g=nc.g + nc.Hmod @ (floored - theta_new)[idx])
        return floored, GaussianState(s, nw, nc, theta2, count, smax, vmax)


def _block_newton(info, nw: NewtonState, idx, gamma, theta_old, theta_u, sc, he, opts, mask,
                  anneal, full: bool, gamma_h=None, objective=None):
    """One SA-Newton cycle on the coordinates ``idx`` of the state ``nw`` (a full ``(d,)``
    state for the centred cycle, a ``(len(idx),)`` one for the interweaving cycle): transport
    the surrogate from ``theta_old`` to ``theta_u`` (earlier cycles moved theta), SA update
    with the new score and Hessian (the Hessian with the step ``gamma_h``, default
    ``gamma``), step (backtracked on ``objective`` of the coordinates ``idx`` while
    ``gamma = 1``, :func:`_backtrack`), anneal (relative to ``theta_old``), transport to the
    new point."""
    sub = (NewtonState(nw.g[idx], nw.H[idx][:, idx], nw.Hmod[idx][:, idx]) if full else nw)
    sub = sub._replace(g=sub.g + sub.Hmod @ (theta_u - theta_old)[idx])
    step, sub = _newton_step(sub, gamma, sc, he, opts.damping, opts.max_step, opts.eig_floor,
                             theta_u[idx], gamma_h, log_scale=jnp.asarray(opts.log_scale)[idx])
    step = _backtrack(objective, theta_u[idx], step, sub.g, gamma >= 1.0)
    cand = _anneal_flat(info, theta_old, theta_u.at[idx].add(step), mask, anneal, opts.tau)
    sub = sub._replace(g=sub.g + sub.Hmod @ (cand - theta_u)[idx])
    if full:
        sub = NewtonState(nw.g.at[idx].set(sub.g), nw.H.at[jnp.ix_(idx, idx)].set(sub.H),
                          nw.Hmod.at[jnp.ix_(idx, idx)].set(sub.Hmod))
    return cand, sub
