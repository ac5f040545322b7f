r"""Observed information of a fitted mixed-effects model from its marginal likelihood.

The Louis identity (:meth:`SAEMResult.fisher_information <numpyro_fed.saem.SAEMResult.
fisher_information>` with ``method="louis"``) estimates :math:`-\nabla^2_\theta\log p(y\mid
\theta)` as :math:`-(E[\nabla^2 f] + \mathrm{Var}[\nabla f])` from MCMC draws of the latents
:math:`z` at :math:`\hat\theta` (:math:`f = \log p(y, z\mid\theta)`). For a weakly
identified variance the two terms nearly cancel, and the Monte Carlo error of the variance
term (hundreds of autocorrelated draws) becomes the error of the standard error: Orthodont's
slope variance had SE ratios 0.47-0.69 to the exact ones. Where the marginal likelihood
itself can be computed, its Hessian is the information, without that cancellation:

- :func:`gaussian_hessian` -- a linear Gaussian model (any grouping): the closed form
  :math:`\ell_i(\theta) = f_i(\hat z_i(\theta), \theta) + \tfrac q2\log 2\pi -
  \tfrac12\log|H_i(\theta)|` with :math:`\hat z(\theta) = z_0 - H(\theta)^{-1}\nabla_z
  f(z_0, \theta)` -- one Newton step from the mode :math:`z_0` at :math:`\hat\theta`, the exact
  mode at every :math:`\theta` because the integrand is quadratic -- differentiated twice by
  automatic differentiation: the exact observed information (rounding only).
- :func:`node_hessian` -- any model whose latents split into small groups: the marginal
  likelihood of each group as a weighted sum over NODES fixed at :math:`\hat\theta`,
  :math:`\ell_i(\theta) = \log\sum_k \exp(f_i(b_{ik} - M(\theta - \hat\theta), \theta) +
  c_{ik})`, differentiated twice. Its Hessian is the Louis identity with the posterior
  expectations taken under the node weights. With the nodes of adaptive Gauss--Hermite
  quadrature (:func:`gh_nodes`, up to 3 latents per group) it is deterministic and, for an
  integrand whose :math:`\theta`-derivatives are polynomials of low degree in :math:`z` times
  the posterior (exactly so for a linear Gaussian model), exact; with independent draws of
  a multivariate-t proposal (:func:`is_nodes`: importance sampling, any number of latents per
  group) its Monte Carlo error is estimated from independent batches of the draws. The shift
  :math:`M` is the centring design of the fit (the nodes follow the posterior as the fixed
  effects move; a unit-Jacobian change of the integration variable, so the integral is
  unchanged).
"""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from numpyro_fed.saem.likelihood import _mvt_logpdf, _student_t, conditional_moments
from numpyro_fed.saem.model import (
    ModelInfo,
    SubjectLayout,
    block_hessian,
    from_blocks,
    log_joint_per_subject,
    pad_log_density,
    pad_mask,
    prefer_forward,
    to_blocks,
)

__all__ = ["gaussian_hessian", "gh_nodes", "is_nodes", "node_hessian", "GH_MAX_LATENTS"]

#: most latent coordinates per group for the Gauss--Hermite nodes (8^3 = 512 nodes per group)
GH_MAX_LATENTS = 3


def gaussian_hessian(info: ModelInfo, lay: SubjectLayout, ids, theta_u, z0, args, kwargs):
    """Log-likelihood, its gradient and its Hessian in the unconstrained :math:`\\theta` of
    a linear Gaussian model (the integrand of every group quadratic in the latents; checked
    by the caller, :func:`~numpyro_fed.saem.likelihood.gaussian_exact`), from the mode
    ``z0`` ``(d_z,)`` at ``theta_u``: ``(loglik, gradient (p,), hessian (p, p))``."""

    def ll(tu):
        tc = info.constrain_theta(tu)

        def f(z):
            return log_joint_per_subject(info, lay, tc, z, args, kwargs, ids=ids)

        grad_u = jax.grad(lambda z: -jnp.sum(f(z)[0]))
        H = block_hessian(grad_u, z0, lay)  # (n, q, q): minus the integrand's curvature
        g = to_blocks(grad_u(z0), lay.zidx)  # (n, q): gradient of -f at z0
        step = jnp.linalg.solve(H, g[..., None])[..., 0]
        z = z0 - from_blocks(step, lay.zidx)
        val, rest = f(z)
        _, logdet = jnp.linalg.slogdet(H)
        return jnp.sum(val + 0.5 * lay.q * jnp.log(2 * jnp.pi) - 0.5 * logdet) + rest

    def value_grad(tu):
        v, g = jax.value_and_grad(ll)(tu)
        return g, (v, g)

    H, (value, grad) = jax.jacfwd(value_grad, has_aux=True)(theta_u)
    return value, grad, H


def gh_nodes(lay: SubjectLayout, z_mode, H, num_nodes: int | None = None):
    """Nodes ``(K, n, q)`` and log weights ``(K, n)`` of adaptive Gauss--Hermite quadrature
    at each group's conditional mode ``z_mode`` ``(d_z,)`` with minus the Hessian ``H``
    ``(n, q, q)`` there (as :func:`~numpyro_fed.saem.likelihood.gauss_hermite`; default
    nodes per axis 20, 12, 8 for 1, 2, 3 latents)."""
    q = lay.q
    if num_nodes is None:
        num_nodes = {1: 20, 2: 12, 3: 8}[q]
    x, w = np.polynomial.hermite.hermgauss(int(num_nodes))
    grid = np.array(list(itertools.product(range(num_nodes), repeat=q)))
    X = jnp.asarray(x[grid], z_mode.dtype)  # (K, q)
    logW = np.sum(np.log(w)[grid], 1) + np.sum(x[grid] ** 2, 1)
    Hinv = jnp.linalg.inv(H)
    L = jnp.linalg.cholesky((Hinv + jnp.swapaxes(Hinv, -1, -2)) / 2.0)
    logdet_L = jnp.sum(jnp.log(jnp.diagonal(L, axis1=-2, axis2=-1)), -1)
    zb = to_blocks(z_mode, lay.zidx)
    nodes = zb + jnp.sqrt(2.0) * jnp.einsum("nij,kj->kni", L, X)
    logw = (jnp.asarray(logW, z_mode.dtype)[:, None] + 0.5 * q * jnp.log(2.0)
            + logdet_L[None, :])
    return nodes, logw


def is_nodes(lay: SubjectLayout, zs, key, num_samples: int, df: float = 4.0):
    """Independent draws ``(K, n, q)`` of a multivariate-t proposal per group (centred at the
    conditional mean of the draws ``zs`` ``(T, C, d_z)``, with their covariance; as
    :func:`~numpyro_fed.saem.likelihood.importance_sampling`) and their log weights
    :math:`-\\log q(b) - \\log K` ``(K, n)``."""
    n, q = lay.n, lay.q
    mu, cov = conditional_moments(lay, zs)
    dt = mu.dtype
    eye = jnp.eye(q, dtype=dt)
    pad = pad_mask(lay.zidx)
    if pad.any():
        real = jnp.asarray(~pad, dt)
        cov = cov * real[:, :, None] * real[:, None, :] + jnp.asarray(pad, dt)[..., None] * eye
    scale = jnp.mean(jnp.diagonal(cov, axis1=-2, axis2=-1), -1)[:, None, None]
    cov = cov + 1e-8 * scale * eye + 1e-12 * eye
    L = jnp.linalg.cholesky(cov)
    logdet_L = jnp.sum(jnp.log(jnp.diagonal(L, axis1=-2, axis2=-1)), -1)
    x, w = _student_t(key, df, (num_samples, n, q), dt)
    xw = x / jnp.sqrt(w)[..., None]
    nodes = mu + jnp.einsum("nij,snj->sni", L, xw)
    logw = -_mvt_logpdf(xw, logdet_L, df, q) - jnp.log(float(num_samples))
    return nodes, logw


def node_hessian(info: ModelInfo, lay: SubjectLayout, ids, theta_u, nodes, logw, M, args,
                 kwargs, num_batches: int = 1):
    """Log-likelihood :math:`\\sum_i\\log\\sum_k\\exp(a_{ik}(\\theta))`, :math:`a_{ik}(\\theta)
    = f_i(b_{ik} - M(\\theta - \\hat\\theta), \\theta) + c_{ik}`, and its Hessian in the
    unconstrained :math:`\\theta` at ``theta_u`` (= :math:`\\hat\\theta`), the nodes
    ``(K, n, q)`` and log weights ``(K, n)`` fixed; with ``num_batches`` B > 1, also the
    Hessians of the same sum over each of B equal batches of the nodes (each batch an estimate
    of its own), for the Monte Carlo error of independent draws.

    The Hessian is accumulated node by node (no node's intermediate values are kept: the
    memory of a few model evaluations), as the Louis identity under the node weights
    :math:`w_{ik} = e^{a_{ik}} / \\sum_l e^{a_{il}}` at :math:`\\hat\\theta`:
    :math:`\\sum_{ik} w_{ik}(\\nabla^2 a_{ik} + \\nabla a_{ik}\\nabla a_{ik}^\\top) -
    \\sum_i \\bar g_i\\bar g_i^\\top`, :math:`\\bar g_i = \\sum_k w_{ik}\\nabla a_{ik}`
    (the derivatives of :math:`\\log\\sum_k e^{a_{ik}}`).

    :return: ``(loglik, gradient (p,), hessian (p, p), batch_hessians (B, p, p) or None)``;
        the gradient :math:`\\sum_i\\bar g_i` (plus the part outside the groups).
    """
    K, n = logw.shape
    B = max(int(num_batches), 1)
    m = K // B
    nodes, logw = nodes[: m * B], logw[: m * B]
    K = m * B
    p = theta_u.shape[0]

    def a_of(tu, bk):
        tc = info.constrain_theta(tu)
        z = from_blocks(bk, lay.zidx) - M @ (tu - theta_u)
        v, rest = log_joint_per_subject(info, lay, tc, z, args, kwargs, ids=ids)
        return v + pad_log_density(bk, lay.zidx), rest

    # nodes in chunks of c (a divisor of K, at most 16) evaluated together
    c = max(d for d in range(1, min(K, 16) + 1) if K % d == 0)
    vals, rests = lax.map(lambda bk: a_of(theta_u, bk), nodes, batch_size=c)
    a = vals + logw  # (K, n)
    lse = jax.nn.logsumexp(a, 0)
    value = jnp.sum(lse) + rests[0]
    W = [jnp.exp(a - lse)]  # full weights (K, n)
    if B > 1:
        ab = a.reshape(B, m, n)
        W.append((jnp.exp(ab - jax.nn.logsumexp(ab, 1, keepdims=True))).reshape(K, n))
    W = jnp.stack(W, 1)  # (K, r, n)
    r = W.shape[1]
    bid = jnp.repeat(jnp.arange(B), m)

    fwd = prefer_forward(lambda tu: jnp.sum(a_of(tu, nodes[0])[0]), theta_u, info)

    def one(bk, wk):
        if fwd:
            # forward over forward (see score_hessian): every subject's gradient and
            # Hessian from the p x p second directional derivatives, no reverse pass
            def grads(tu):
                v = jax.jacfwd(lambda t: a_of(t, bk)[0])(tu)
                return v, v

            Hn, G = jax.jacfwd(grads, has_aux=True)(theta_u)  # (n, p, p), (n, p)
            Hk = jnp.einsum("rn,nij->rij", wk, Hn)  # (r, p, p)
        else:
            G = jax.jacfwd(lambda tu: a_of(tu, bk)[0])(theta_u)  # (n, p)
            Hk = jax.hessian(lambda tu: wk @ a_of(tu, bk)[0])(theta_u)  # (r, p, p)
        m2 = jnp.einsum("rn,ni,nj->rij", wk, G, G)
        return wk[:, :, None] * G[None], Hk + m2

    def body(carry, x):
        g_full, g_b, H_full, H_b = carry
        bks, wks, bs = x
        gs, hs = jax.vmap(one)(bks, wks)  # (c, r, n, p), (c, r, p, p)
        g_full = g_full + jnp.sum(gs[:, 0], 0)
        H_full = H_full + jnp.sum(hs[:, 0], 0)
        if r > 1:
            g_b = g_b.at[bs].add(gs[:, 1])
            H_b = H_b.at[bs].add(hs[:, 1])
        return (g_full, g_b, H_full, H_b), None

    dt = vals.dtype
    init = (jnp.zeros((n, p), dt), jnp.zeros((B, n, p), dt), jnp.zeros((p, p), dt),
            jnp.zeros((B, p, p), dt))
    xs = (nodes.reshape((K // c, c) + nodes.shape[1:]), W.reshape(K // c, c, r, n),
          bid.reshape(K // c, c))
    (g_full, g_b, H_full, H_b), _ = lax.scan(body, init, xs)
    rest_of = lambda tu: a_of(tu, nodes[0])[1]  # noqa: E731
    H_rest = jax.hessian(rest_of)(theta_u)
    hess = H_full - g_full.T @ g_full + H_rest
    grad = jnp.sum(g_full, 0) + jax.grad(rest_of)(theta_u)
    if B == 1:
        return value, grad, hess, None
    hb = H_b - jnp.einsum("bni,bnj->bij", g_b, g_b) + H_rest
    return value, grad, hess, hb
