"""Marginal likelihood :math:`\\log p(y\\mid\\hat\\theta)` of a fitted mixed-effects model.

Three methods, per subject when the model has subjects (the marginal likelihood factorises,
:math:`\\log p(y\\mid\\theta) = \\sum_i\\log\\int p(y_i, z_i\\mid\\theta)\\,dz_i`), each on the
unconstrained latents (the Jacobian of the latent transforms included):

- ``"is"`` -- importance sampling with a multivariate Student-t proposal per subject, centred
  at the conditional mean of the subject's latents with their conditional covariance, both
  from the draws at :math:`\\hat\\theta` (saemix's ``llis``); the Monte Carlo standard error
  is reported (delta method on each subject's mean weight).
- ``"gq"`` -- adaptive Gauss--Hermite quadrature (up to 3 latent coordinates per subject):
  nodes placed at each subject's conditional mode and scaled by the Cholesky factor of the
  inverse Hessian there (Pinheiro & Bates 1995; lme4's ``nAGQ``).
- ``"laplace"`` -- the Laplace approximation at the conditional modes (one node of the
  quadrature; for Gaussian residuals the FOCE-type linearisation with the exact Hessian).

:func:`annealed_importance_sampling` is the AIS estimator used in the experiments of
Gruffaz et al. 2024.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax, random

from numpyro_fed.algorithms.langevin import langevin_move, mala_log_ratio, mala_sq_residuals
from numpyro_fed.saem.model import (
    ModelInfo,
    SubjectLayout,
    block_hessian,
    from_blocks,
    joint_layout,
    log_joint_per_subject,
    pad_log_density,
    pad_mask,
    to_blocks,
)

__all__ = ["importance_sampling", "gauss_hermite", "laplace", "conditional_modes",
           "gaussian_exact",
           "annealed_importance_sampling", "observation_jacobian"]


def _layout_or_joint(info, layout):
    return layout if layout is not None else joint_layout(info)


def _per_subject_fn(info: ModelInfo, layout: SubjectLayout, ids, theta_c, args, kwargs):
    def f(zf):
        return log_joint_per_subject(info, layout, theta_c, zf, args, kwargs, ids=ids)

    return f


def _student_t(key, df: float, shape, dtype):
    """Student-t draws. For an even integer ``df`` <= 30 (the default 4) the chi-square
    variable is :math:`-2\\sum_{j\\le df/2}\\log U_j` (a sum of exponentials), exact and far
    cheaper to compile than the rejection sampler of :func:`jax.random.gamma`. Returns
    ``(normal, chi2 / df)`` so that the draw is ``normal / sqrt(chi2 / df)``."""
    kn, ku = random.split(key)
    z = random.normal(kn, shape, dtype)
    if float(df).is_integer() and int(df) % 2 == 0 and 0 < df <= 30:
        u = random.uniform(ku, (int(df) // 2, *shape[:-1]), dtype, minval=jnp.finfo(dtype).tiny)
        w = -2.0 * jnp.sum(jnp.log(u), 0) / df
    else:
        w = 2.0 * random.gamma(ku, df / 2.0, shape[:-1], dtype) / df
    return z, w


def _mvt_logpdf(x_white, logdet_L, df, q):
    """Log density of a multivariate t at a point with whitened value ``x_white``."""
    from jax.scipy.special import gammaln

    m = jnp.sum(x_white**2, -1)
    return (gammaln((df + q) / 2.0) - gammaln(df / 2.0) - 0.5 * q * jnp.log(df * jnp.pi)
            - logdet_L - 0.5 * (df + q) * jnp.log1p(m / df))


def conditional_moments(layout: SubjectLayout, zs):
    """Per-subject conditional mean ``(n, q)`` and covariance ``(n, q, q)`` of the draws
    ``zs`` ``(T, C, d_z)`` (unconstrained)."""
    flat = jnp.asarray(zs).reshape(-1, zs.shape[-1])
    b = to_blocks(flat, layout.zidx)  # (S, n, q)
    mu = jnp.mean(b, 0)
    dev = b - mu
    cov = jnp.einsum("sni,snj->nij", dev, dev) / max(b.shape[0] - 1, 1)
    return mu, cov


def importance_sampling(info: ModelInfo, layout: SubjectLayout | None, ids, theta_c, zs, args,
                        kwargs, key, num_samples: int = 5000, df: float = 4.0,
                        batch_size: int = 500, inflate: float = 1.0):
    """Per-subject log-likelihoods by importance sampling with multivariate-t proposals.

    :return: ``(ll_i (n,), var_i (n,), rest)`` -- per-subject estimates, the variances of
        these estimates (delta method), and the log-density terms that depend on no latent.
    """
    lay = _layout_or_joint(info, layout)
    n, q = lay.n, lay.q
    mu, cov = conditional_moments(lay, zs)
    dt = mu.dtype
    eye = jnp.eye(q, dtype=dt)
    pad = pad_mask(lay.zidx)
    if pad.any():
        # padded entries (unequal groups): their exact standard normal law as the proposal
        real = jnp.asarray(~pad, dt)
        cov = cov * real[:, :, None] * real[:, None, :] + jnp.asarray(pad, dt)[..., None] * eye
    scale = jnp.mean(jnp.diagonal(cov, axis1=-2, axis2=-1), -1)[:, None, None]
    cov = inflate * cov + 1e-8 * scale * eye + 1e-12 * eye
    L = jnp.linalg.cholesky(cov)
    logdet_L = jnp.sum(jnp.log(jnp.diagonal(L, axis1=-2, axis2=-1)), -1)
    f = _per_subject_fn(info, lay, ids, theta_c, args, kwargs)
    nb = max(1, -(-int(num_samples) // int(batch_size)))

    def one_batch(k):
        x, w = _student_t(k, df, (batch_size, n, q), dt)
        xw = x / jnp.sqrt(w)[..., None]  # whitened t draws
        b = mu + jnp.einsum("nij,snj->sni", L, xw)
        lq = _mvt_logpdf(xw, logdet_L, df, q)  # (S, n)
        lp, rest = jax.vmap(lambda bb: f(from_blocks(bb, lay.zidx)))(b)
        lp = lp + pad_log_density(b, lay.zidx)
        return lp - lq, rest[0]

    lw, rest = lax.map(one_batch, random.split(key, nb))
    lw = lw.reshape(nb * batch_size, n)
    mx = jnp.max(lw, 0)
    w = jnp.exp(lw - mx)
    mean_w = jnp.mean(w, 0)
    ll_i = mx + jnp.log(mean_w)
    var_i = jnp.var(w, 0) / (w.shape[0] * mean_w**2)
    return ll_i, var_i, rest[0]


def conditional_modes(info: ModelInfo, layout: SubjectLayout | None, ids, theta_c, z_init,
                      args, kwargs, num_iters: int = 30):
    """Per-subject conditional modes of :math:`\\log p(y_i, z_i\\mid\\theta)` (unconstrained
    latents, Jacobian included) by damped Newton from ``z_init`` ``(d_z,)``, and the negative
    Hessian blocks there. Returns ``(z_mode (d_z,), H (n, q, q), value (n,), rest)``."""
    lay = _layout_or_joint(info, layout)
    f = _per_subject_fn(info, lay, ids, theta_c, args, kwargs)
    U = lambda z: -jnp.sum(f(z)[0])
    grad = jax.grad(U)
    q = lay.q
    eye = jnp.eye(q, dtype=z_init.dtype)

    def newton(z, _):
        g = to_blocks(grad(z), lay.zidx)  # (n, q)
        H = block_hessian(grad, z, lay)
        lam, V = jnp.linalg.eigh(H)
        lam = jnp.maximum(jnp.abs(lam), 1e-8 * jnp.max(jnp.abs(lam), -1, keepdims=True)
                          + 1e-12)
        step = -jnp.einsum("nij,nj->ni", V, jnp.einsum("nji,nj->ni", V, g) / lam)
        u0 = -f(z)[0]

        def try_scale(carry, s):
            best_z, best_u = carry
            cand = z + from_blocks(s * step, lay.zidx)
            uc = -f(cand)[0]
            better = jnp.isfinite(uc) & (uc < best_u)
            best_b = jnp.where(better[:, None], to_blocks(cand, lay.zidx),
                               to_blocks(best_z, lay.zidx))
            return (from_blocks(best_b, lay.zidx), jnp.where(better, uc, best_u)), None

        (z_new, _), _ = lax.scan(try_scale, (z, u0), jnp.asarray([1.0, 0.5, 0.25, 0.1],
                                                                   z.dtype))
        return z_new, None

    z, _ = lax.scan(newton, z_init, None, length=num_iters)
    H = block_hessian(grad, z, lay) + 0.0 * eye
    val, rest = f(z)
    # padded entries (unequal groups) sit at their mode 0
    val = val + pad_log_density(jnp.zeros((lay.n, q), z.dtype), lay.zidx)
    return z, H, val, rest


def laplace(info, layout, ids, theta_c, z_init, args, kwargs, num_iters: int = 30):
    """Laplace approximation of each subject's log-likelihood at its conditional mode:
    ``(ll_i (n,), rest)``."""
    lay = _layout_or_joint(info, layout)
    z, H, val, rest = conditional_modes(info, layout, ids, theta_c, z_init, args, kwargs,
                                        num_iters)
    sign, logdet = jnp.linalg.slogdet(H)
    ll = val + 0.5 * lay.q * jnp.log(2 * jnp.pi) - 0.5 * logdet
    return jnp.where(sign > 0, ll, jnp.nan), rest


def gaussian_exact(info, layout, ids, theta_c, z_init, args, kwargs, key,
                   num_checks: int = 8, num_iters: int = 8):
    """Closed-form log-likelihood of each subject (or connected group) when its integrand
    :math:`\\log p(y_i, z_i\\mid\\theta)` is quadratic in the (unconstrained) latents -- a
    linear Gaussian mixed model, with any number of crossed or nested grouping factors: then
    the Laplace approximation at the exact conditional mode (Newton iterations, exact after
    one on a quadratic) IS the marginal likelihood, :math:`\\log p(y_i\\mid\\theta) =
    \\ell_i(\\hat z_i) + \\tfrac q2\\log 2\\pi - \\tfrac12\\log|H_i|`.

    Whether the integrand is quadratic is checked, not assumed: at ``num_checks`` points
    :math:`\\hat z_i + 3L_i\\varepsilon` (:math:`L_iL_i^\\top = H_i^{-1}`,
    :math:`\\varepsilon` standard normal) the integrand must equal its quadratic expansion
    :math:`\\ell_i(\\hat z_i) - \\tfrac92|\\varepsilon|^2` (three conditional standard
    deviations out, where a cubic or quartic term of a non-Gaussian integrand shows).

    :return: ``(ll_i (n,), rest, discrepancy (n,))`` -- the largest absolute difference
        between the integrand and its quadratic expansion over the check points, per subject
        (rounding only, for a linear Gaussian model).
    """
    lay = _layout_or_joint(info, layout)
    z, H, val, rest = conditional_modes(info, layout, ids, theta_c, z_init, args, kwargs,
                                        num_iters)
    dt = z.dtype
    q = lay.q
    sign, logdet = jnp.linalg.slogdet(H)
    ll = val + 0.5 * q * jnp.log(2 * jnp.pi) - 0.5 * logdet
    ll = jnp.where(sign > 0, ll, jnp.nan)
    Hinv = jnp.linalg.inv(H)
    L = jnp.linalg.cholesky((Hinv + jnp.swapaxes(Hinv, -1, -2)) / 2.0)
    f = _per_subject_fn(info, lay, ids, theta_c, args, kwargs)
    zb = to_blocks(z, lay.zidx)
    eps = 3.0 * random.normal(key, (num_checks,) + zb.shape, dt)

    def at(e):
        b = zb + jnp.einsum("nij,nj->ni", L, e)
        return (f(from_blocks(b, lay.zidx))[0] + pad_log_density(b, lay.zidx)
                - (val - 0.5 * jnp.sum(e**2, -1)))

    disc = jnp.max(jnp.abs(lax.map(at, eps)), 0)
    disc = jnp.where(jnp.isfinite(disc), disc, jnp.inf)
    return ll, rest, disc


def gauss_hermite(info, layout, ids, theta_c, z_init, args, kwargs, num_nodes: int | None = None,
                  num_iters: int = 30):
    """Adaptive Gauss--Hermite quadrature of each subject's log-likelihood (at most 3 latent
    coordinates per subject): ``(ll_i (n,), rest)``. Default nodes per dimension: 20, 12, 8
    for 1, 2, 3 coordinates."""
    lay = _layout_or_joint(info, layout)
    q = lay.q
    if q > 3:
        raise ValueError(
            f"Gauss-Hermite quadrature: {q} latent coordinates per subject (at most 3); use "
            "method='is' (importance sampling) or 'laplace'."
        )
    if num_nodes is None:
        num_nodes = {1: 20, 2: 12, 3: 8}[q]
    x, w = np.polynomial.hermite.hermgauss(int(num_nodes))
    grid = np.array(list(itertools.product(range(num_nodes), repeat=q)))
    X = x[grid]  # (K, q)
    logW = np.sum(np.log(w)[grid], 1) + np.sum(x[grid] ** 2, 1)
    z, H, _, rest = conditional_modes(info, layout, ids, theta_c, z_init, args, kwargs,
                                      num_iters)
    dt = z.dtype
    # nodes z_i + sqrt(2) L_i x with L_i L_i^T = H_i^{-1}
    Hinv = jnp.linalg.inv(H)
    L = jnp.linalg.cholesky((Hinv + jnp.swapaxes(Hinv, -1, -2)) / 2.0)
    logdet_L = jnp.sum(jnp.log(jnp.diagonal(L, axis1=-2, axis2=-1)), -1)
    f = _per_subject_fn(info, lay, ids, theta_c, args, kwargs)
    zb = to_blocks(z, lay.zidx)
    Xj = jnp.asarray(X, dt)

    def at_node(xk):
        b = zb + jnp.sqrt(2.0) * jnp.einsum("nij,j->ni", L, xk)
        return f(from_blocks(b, lay.zidx))[0] + pad_log_density(b, lay.zidx)

    vals = lax.map(at_node, Xj)  # (K, n)
    terms = vals + jnp.asarray(logW, dt)[:, None]
    ll = jax.nn.logsumexp(terms, 0) + 0.5 * q * jnp.log(2.0) + logdet_L
    return ll, rest


def observation_jacobian(info: ModelInfo, theta_c, z_c, args, kwargs, transforms: dict):
    """:math:`-\\sum\\log|dT/dv|` over observed sites whose data are ``v = T^{-1}(y)``
    (e.g. ``{"log_conc": ExpTransform()}`` for an exponential error model written on
    :math:`\\log y`): added to a log-likelihood of :math:`v` it gives the log-likelihood of
    :math:`y`, so that error models can be compared by AIC on the scale of the data."""
    tr = info.trace_at(theta_c, z_c, args, kwargs)
    total = 0.0
    for name, t in transforms.items():
        if name not in info.observed_names:
            raise ValueError(
                f"data_transforms names '{name}', which is not an observed site "
                f"({info.observed_names})."
            )
        v = tr[name]["value"]
        y = t(v)
        total = total - jnp.sum(t.log_abs_det_jacobian(v, y))
    return total


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
    sampling (Neal 2001) with the quadratic schedule :math:`\\beta_t = (t/T)^2` used by
    Gruffaz et al. 2024 (Sec. 5.2) and ``num_mh`` Metropolis-adjusted Langevin moves per
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
                y = langevin_move(kn, zz, -g, step_size)
                fy, gy = jax.value_and_grad(lp)(y, b)
                # g, gy: gradients of the log-density, -grad U
                fwd, bwd = mala_sq_residuals(zz, y, -g, -gy, step_size)
                lr = mala_log_ratio(-f, -fy, fwd, bwd, step_size)
                ok = jnp.log(random.uniform(ku)) < lr
                return jnp.where(ok, y, zz), None

            z, _ = lax.scan(mh, z, random.split(k, num_mh))
            return (z, lw), None

        keys = random.split(key, num_steps)
        (_, lw), _ = lax.scan(step, (z, jnp.zeros((), z.dtype)), (betas[:-1], betas[1:], keys))
        return lw

    lws = jax.vmap(particle)(z0, random.split(k1, num_particles))
    return jax.nn.logsumexp(lws) - jnp.log(num_particles)
