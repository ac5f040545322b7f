"""The one Langevin move and MALA ratio of the package (numpyro_fed.algorithms.langevin), as
the kernels, the Flower deployment and the MCMC-SAEM E-step use them."""

import jax
import jax.numpy as jnp
import numpy as np
from jax import random

from numpyro_fed.algorithms import (
    block_preconditioner,
    langevin_move,
    langevin_noise,
    langevin_proposal,
    mala_log_ratio,
    mala_sq_residuals,
)


def test_move_is_the_euler_maruyama_step_with_the_keys_noise():
    key = random.key(3)
    x = jnp.asarray([0.5, -1.0, 2.0], jnp.float32)
    g = jnp.asarray([1.0, 0.25, -3.0], jnp.float32)
    z = random.normal(key, (3,), jnp.float32)
    y = langevin_move(key, x, g, 0.01)
    np.testing.assert_array_equal(y, x - 0.01 * g + jnp.sqrt(2.0 * 0.01) * z)
    np.testing.assert_array_equal(langevin_noise(key, x), z)
    assert y.dtype == jnp.float32


def test_block_preconditioner_applies_each_blocks_factor():
    """Blocks i with factors L_i (full) or sqrt(p_i) (diagonal): the proposal is
    x_i - h_i L_i L_i^T g_i + sqrt(2 h_i) L_i xi_i for every chain c and block i."""
    rng = np.random.default_rng(0)
    C, n, q = 2, 3, 2
    A = rng.normal(size=(n, q, q))
    L = np.linalg.cholesky(A @ A.transpose(0, 2, 1) + np.eye(q))
    x, g, xi = (rng.normal(size=(C, n, q)) for _ in range(3))
    h = np.exp(rng.normal(size=(n,)))[None, :, None]
    out = np.asarray(langevin_proposal(jnp.asarray(x), jnp.asarray(g), jnp.asarray(h),
                                       jnp.asarray(xi), block_preconditioner(jnp.asarray(L),
                                                                             True)))
    ref = np.empty_like(x)
    for c in range(C):
        for i in range(n):
            hi, M = h[0, i, 0], L[i] @ L[i].T
            ref[c, i] = x[c, i] - hi * M @ g[c, i] + np.sqrt(2 * hi) * L[i] @ xi[c, i]
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-6)
    d = np.sqrt(np.exp(rng.normal(size=(n, q))))
    out = np.asarray(langevin_proposal(jnp.asarray(x), jnp.asarray(g), jnp.asarray(h),
                                       jnp.asarray(xi), block_preconditioner(jnp.asarray(d),
                                                                             False)))
    np.testing.assert_allclose(out, x - h * d**2 * g + np.sqrt(2 * h) * d * xi, rtol=1e-5,
                               atol=1e-6)


def test_identity_preconditioner_is_the_plain_move():
    key = random.key(0)
    x = random.normal(random.key(1), (4, 3, 2))
    g = random.normal(random.key(2), (4, 3, 2))
    eye = jnp.broadcast_to(jnp.eye(2), (3, 2, 2))
    np.testing.assert_allclose(langevin_move(key, x, g, 0.1, block_preconditioner(eye, True)),
                               langevin_move(key, x, g, 0.1), rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(
        langevin_move(key, x, g, 0.1, block_preconditioner(jnp.ones((3, 2)), False)),
        langevin_move(key, x, g, 0.1))


def test_mala_ratio_is_the_gaussian_proposal_ratio():
    """log alpha = U(x) - U(y) + log q(x|y) - log q(y|x) for q(b|a) = N(a - h grad U(a), 2h I),
    and NaN (a proposal outside the support) is -inf."""
    U = lambda v: 0.5 * jnp.sum(v**2) + jnp.sum(jnp.cos(v))  # noqa: E731
    gU = jax.grad(U)
    h = 0.3
    x = jnp.asarray([0.2, -0.7, 1.1])
    y = langevin_move(random.key(5), x, gU(x), h)
    logq = lambda b, a: -jnp.sum((b - a + h * gU(a)) ** 2) / (4 * h)  # noqa: E731
    ref = U(x) - U(y) + logq(x, y) - logq(y, x)
    lr = mala_log_ratio(U(x), U(y), *mala_sq_residuals(x, y, gU(x), gU(y), h), h)
    np.testing.assert_allclose(lr, ref, rtol=1e-5, atol=1e-6)
    assert mala_log_ratio(1.0, jnp.nan, 0.0, 0.0, h) == -jnp.inf
