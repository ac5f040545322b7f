"""Marginal likelihood :math:`\\log p(y\\mid\\hat\\theta)` of a fitted mixed-effects model.

The marginal likelihood factorises over subjects, or over the connected groups of latents of
a model with several grouping factors (:func:`~numpyro_fed.saem.model.group_layout`):
:math:`\\log p(y\\mid\\theta) = \\sum_i\\log\\int p(y_i, z_i\\mid\\theta)\\,dz_i`. Methods, each on
the unconstrained latents (the Jacobian of the latent transforms included):

- ``"exact"`` -- the closed form of a linear Gaussian model (:func:`gaussian_exact`): the
  Laplace value at the exact conditional mode, after checking that each integrand is
  quadratic. ``SAEMResult.log_likelihood``'s default ``"auto"`` uses it where the check
  passes and ``"is"`` elsewhere.
- ``"is"`` -- defensive importance sampling per group (:func:`is_proposals`,
  :func:`importance_round`): a mixture of two multivariate t, one at the conditional mode
  with the inverse Hessian there (Laplace), one at the conditional mean and covariance of the
  final draws (saemix's ``llis``), so that neither a poorly mixed E-step nor a non-Gaussian
  posterior leaves the sampler without a good proposal. The estimate per group is
  Jensen-corrected and its Monte Carlo SE is the delta method's; rounds of draws go on
  (:func:`adaptive_importance_sampling`) while a group's weights look heavy-tailed (Pareto
  :math:`\\hat k` above :data:`PARETO_K_MORE`) or its SE exceeds :data:`MAX_GROUP_SE`, and a
  :class:`LikelihoodWarning` says when :math:`\\hat k` stays above :data:`PARETO_K_WARN` (the
  SE cannot then be trusted).
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
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax, random

from numpyro_fed.algorithms.langevin import langevin_move, mala_log_ratio, mala_sq_residuals
from numpyro_fed.errors import LikelihoodWarning
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
           "gaussian_exact", "gaussian_exact_at_modes", "is_proposals", "importance_round",
           "adaptive_importance_sampling", "pareto_khat", "combine_rounds",
           "LikelihoodWarning",
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


#: a group whose weights have a Pareto :math:`\\hat k` above this (their variance is infinite
#: when :math:`k > 1/2`: the delta-method SE is then not honest) gets more draws
PARETO_K_MORE = 0.5
#: Pareto :math:`\\hat k` above which the estimate is unreliable whatever the sample size
#: (Vehtari et al. 2024, "Pareto smoothed importance sampling", JMLR: above 0.7 the
#: pre-asymptotic error of the mean decays too slowly for any practical sample size)
PARETO_K_WARN = 0.7
#: a group whose estimate has a Monte Carlo SE above this (on its log-likelihood) gets more
#: draws: the delta method (log of a mean weight, its SE and its bias -var/2) is accurate when
#: the relative SE of the mean weight is small
MAX_GROUP_SE = 0.1
#: at most this many rounds of ``num_samples`` draws per group
MAX_ROUNDS = 8


def _sqrt_inv_hessian(H, dt):
    """A square root ``S`` of :math:`H^{-1}` (``S S^T = H^{-1}``), its inverse and
    :math:`\\log|\\det S|`, from the eigen-decomposition of the symmetric ``H`` ``(n, q, q)``
    with its eigenvalues' magnitudes floored (a non-convex point still gives a proper
    proposal scale)."""
    lam, V = jnp.linalg.eigh(H)
    lam = jnp.abs(lam)
    lam = jnp.maximum(lam, 1e-6 * jnp.max(lam, -1, keepdims=True) + jnp.finfo(dt).tiny)
    S = V * (lam ** -0.5)[..., None, :]
    S_inv = jnp.swapaxes(V * (lam ** 0.5)[..., None, :], -1, -2)
    return S, S_inv, -0.5 * jnp.sum(jnp.log(lam), -1)


def is_proposals(layout: SubjectLayout | None, info: ModelInfo, zs, z_mode, H):
    """The two multivariate-t components of the importance proposal of each subject
    (connected group), as ``(means (2, n, q), scales (2, n, q, q), inverse scales
    (2, n, q, q), log|det scale| (2, n))``:

    0. **Laplace**: centred at the conditional mode ``z_mode`` with scale
       :math:`H_i^{-1/2}` (``H`` the negative Hessian blocks of :math:`\\log p(y_i, z_i\\mid
       \\theta)` there, :func:`conditional_modes`): exact up to the tails for a Gaussian
       integrand, and independent of how well the E-step's chains mixed;
    1. **draws**: centred at the conditional mean of the final draws with their covariance
       (saemix's ``llis``): it covers a skewed or multimodal posterior that the Laplace
       component misses.

    A component that is not finite for a group (a failed mode search, draws that are NaN) is
    replaced by the other one for that group."""
    lay = _layout_or_joint(info, layout)
    q = lay.q
    mu, cov = conditional_moments(lay, zs)
    dt = mu.dtype
    eye = jnp.eye(q, dtype=dt)
    pad = pad_mask(lay.zidx)
    if pad.any():
        # padded entries (unequal groups): their exact standard normal law as the proposal
        real = jnp.asarray(~pad, dt)
        cov = cov * real[:, :, None] * real[:, None, :] + jnp.asarray(pad, dt)[..., None] * eye
    scale = jnp.mean(jnp.diagonal(cov, axis1=-2, axis2=-1), -1)[:, None, None]
    cov = cov + 1e-8 * scale * eye + 1e-12 * eye
    L = jnp.linalg.cholesky(cov)
    L_inv = jnp.linalg.inv(L)
    logdet_L = jnp.sum(jnp.log(jnp.diagonal(L, axis1=-2, axis2=-1)), -1)
    m_a = to_blocks(z_mode, lay.zidx)
    S_a, S_a_inv, logdet_a = _sqrt_inv_hessian(H, dt)

    def finite(m, S, Si, ld):
        return (jnp.all(jnp.isfinite(m), -1) & jnp.all(jnp.isfinite(S), (-1, -2))
                & jnp.all(jnp.isfinite(Si), (-1, -2)) & jnp.isfinite(ld))

    ok_a = finite(m_a, S_a, S_a_inv, logdet_a)
    ok_b = finite(mu, L, L_inv, logdet_L)
    comps = [(m_a, S_a, S_a_inv, logdet_a), (mu, L, L_inv, logdet_L)]

    def pick(k):
        own, other = comps[k], comps[1 - k]
        ok = ok_a if k == 0 else ok_b
        return tuple(jnp.where(ok.reshape(ok.shape + (1,) * (a.ndim - 1)), a, b)
                     for a, b in zip(own, other, strict=True))

    parts = [pick(0), pick(1)]
    return tuple(jnp.stack([parts[0][j], parts[1][j]]) for j in range(4))


def importance_round(info: ModelInfo, layout: SubjectLayout | None, ids, theta_c, proposals,
                     args, kwargs, key, num_samples: int = 5000, df: float = 4.0,
                     batch_size: int = 500, num_top: int = 0):
    """One round of importance sampling from the two-component t mixture of
    :func:`is_proposals` (defensive importance sampling, Hesterberg 1995: within each batch
    the first ``ceil(batch_size / 2)`` draws come from the Laplace component and the others
    from the draws' component, and every weight is :math:`p(y_i, z\\mid\\theta) /
    \\sum_k \\alpha_k q_{ik}(z)` with :math:`\\alpha_k` the fractions drawn -- the balance
    heuristic of multiple importance sampling, unbiased; a weight is at most
    :math:`1/\\alpha_k` times the weight under either component alone).

    :return: ``(stats, top, rest)``: per component ``k`` and group ``i`` the sufficient
        statistics ``stats`` ``(3, 2, n)`` = (max log weight, sum of ``exp(lw - max)``, sum
        of ``exp(2 (lw - max))``); the ``num_top`` largest log weights of each group
        ``(n, num_top)`` (for the Pareto :math:`\\hat k`); the log-density terms that depend
        on no latent.
    """
    lay = _layout_or_joint(info, layout)
    n, q = lay.n, lay.q
    means, scales, inv_scales, logdets = proposals
    dt = means.dtype
    f = _per_subject_fn(info, lay, ids, theta_c, args, kwargs)
    nb = max(1, -(-int(num_samples) // int(batch_size)))
    n_a = -(-int(batch_size) // 2)
    n_b = int(batch_size) - n_a
    comp = np.arange(int(batch_size)) >= n_a  # (B,): False = Laplace, True = draws
    log_alpha = np.log(np.array([n_a, max(n_b, 1)], np.float64) / batch_size)
    use_b = n_b > 0

    def one_batch(k):
        x, w = _student_t(k, df, (batch_size, n, q), dt)
        xw = x / jnp.sqrt(w)[..., None]  # whitened t draws
        c = jnp.asarray(comp)[:, None, None]
        m = jnp.where(c, means[1], means[0])
        b = m + jnp.where(c, jnp.einsum("nij,snj->sni", scales[1], xw),
                          jnp.einsum("nij,snj->sni", scales[0], xw))
        lq0 = _mvt_logpdf(jnp.einsum("nij,snj->sni", inv_scales[0], b - means[0]),
                          logdets[0], df, q)
        if use_b:
            lq1 = _mvt_logpdf(jnp.einsum("nij,snj->sni", inv_scales[1], b - means[1]),
                              logdets[1], df, q)
            lq = jnp.logaddexp(log_alpha[0] + lq0, log_alpha[1] + lq1)
        else:
            lq = lq0
        lp, rest = jax.vmap(lambda bb: f(from_blocks(bb, lay.zidx)))(b)
        lp = lp + pad_log_density(b, lay.zidx)
        lw = lp - lq
        # a draw where the integrand is not finite (an overflow far in the tails) weighs 0
        return jnp.where(jnp.isnan(lw) | (lw == jnp.inf), -jnp.inf, lw), rest[0]

    lw, rest = lax.map(one_batch, random.split(key, nb))  # (nb, B, n)

    def stats(sel):
        lws = jnp.where(sel[None, :, None], lw, -jnp.inf)
        mx = jnp.max(lws, (0, 1))
        mx_ = jnp.where(jnp.isfinite(mx), mx, 0.0)
        e = jnp.exp(lws - mx_)
        return jnp.stack([mx, jnp.sum(e, (0, 1)), jnp.sum(e * e, (0, 1))])

    st = jnp.stack([stats(jnp.asarray(~comp)), stats(jnp.asarray(comp))], 1)  # (3, 2, n)
    k_top = min(int(num_top), nb * int(batch_size))
    top = (lax.top_k(lw.reshape(-1, n).T, k_top)[0] if k_top > 0
           else jnp.zeros((n, 0), dt))
    return st, top, rest[0]


def pareto_khat(top_lw: np.ndarray, num_samples: int) -> np.ndarray:
    """Pareto :math:`\\hat k` of each row's importance weights from its largest log weights
    ``top_lw`` ``(n, K)`` out of ``num_samples``: the generalised Pareto shape fitted by
    Zhang & Stephens (2009) to the ``M = min(0.2 S, 3 sqrt(S), K - 1)`` largest weights above
    the next one, with the weak prior of Vehtari et al. (PSIS; ArviZ's ``psislw``). ``NaN`` when
    the tail has no spread (e.g. all weights equal)."""
    S = int(num_samples)
    top = -np.sort(-np.asarray(top_lw, np.float64), 1)  # descending
    M = min(int(min(0.2 * S, 3.0 * math.sqrt(S))), top.shape[1] - 1)
    if M < 5:
        return np.full(top.shape[0], np.nan)
    hi = top[:, :1]
    x = np.exp(top[:, :M][:, ::-1] - hi) - np.exp(top[:, M:M + 1] - hi)  # ascending
    with np.errstate(all="ignore"):
        m_est = 30 + int(math.sqrt(M))
        b = 1.0 - np.sqrt(m_est / (np.arange(1, m_est + 1) - 0.5))  # (m,)
        quart = x[:, int(M / 4 + 0.5) - 1][:, None]
        b = b[None, :] / (3.0 * quart) + 1.0 / x[:, -1:]  # (n, m)
        k = np.mean(np.log1p(-b[:, :, None] * x[:, None, :]), -1)  # (n, m)
        ls = M * (np.log(-(b / k)) - k - 1.0)
        wts = 1.0 / np.sum(np.exp(ls[:, None, :] - ls[:, :, None]), -1)
        wts = np.where(np.isfinite(wts), wts, 0.0)
        wts = wts / np.sum(wts, 1, keepdims=True)
        b_post = np.sum(b * wts, 1)
        k_post = np.mean(np.log1p(-b_post[:, None] * x), 1)
        k_post = (M * k_post + 10 * 0.5) / (M + 10)
    ok = np.isfinite(k_post) & (x[:, -1] > 0)
    return np.where(ok, k_post, np.nan)


def combine_rounds(stats: list, alphas) -> tuple[np.ndarray, np.ndarray]:
    """Per-group log-likelihoods and their Monte Carlo variances from the pooled statistics
    of rounds of :func:`importance_round` (``stats``: a list of ``(3, 2, n)`` arrays, each of
    ``counts`` ``(2,)`` draws per component).

    The estimate of :math:`p_i = \\int p(y_i, z)dz` is the stratified mixture mean
    :math:`\\hat p_i = \\sum_k \\alpha_k \\bar w_{ik}`, with variance
    :math:`\\sum_k \\alpha_k^2 s_{ik}^2 / N_k` (each component's own sample variance: the
    draws are stratified by component, so the between-component spread is not Monte Carlo
    error). Reported: :math:`\\log\\hat p_i + \\tfrac12 v_i` and :math:`v_i = \\mathrm{Var}
    (\\hat p_i)/\\hat p_i^2` (delta method), the :math:`+\\tfrac12 v_i` removing the bias
    :math:`-\\tfrac12 v_i` of the log of a mean (Jensen), which over many groups would
    otherwise add up to several standard errors.

    :param alphas: ``((alpha_0, alpha_1), (N_0, N_1))``: the fractions of draws per component
        and the pooled counts.
    """
    (a0, a1), (n0, n1) = alphas
    st = np.stack([np.asarray(s, np.float64) for s in stats])  # (R, 3, 2, n)
    mx = st[:, 0]  # (R, 2, n)
    M = np.max(np.where(np.isfinite(mx), mx, -np.inf), (0, 1))  # (n,)
    M = np.where(np.isfinite(M), M, 0.0)
    with np.errstate(all="ignore"):
        sc = np.where(np.isfinite(mx), np.exp(mx - M), 0.0)
        s1 = np.sum(st[:, 1] * sc, 0)  # (2, n), relative to exp(M)
        s2 = np.sum(st[:, 2] * sc**2, 0)
        counts = np.array([n0, max(n1, 1)], np.float64)[:, None]
        mean = s1 / counts
        var = np.maximum(s2 / counts - mean**2, 0.0) * counts / np.maximum(counts - 1, 1)
        alpha = np.array([a0, a1], np.float64)[:, None]
        if n1 == 0:
            alpha = np.array([1.0, 0.0])[:, None]
        p = np.sum(alpha * mean, 0)
        v = np.sum(alpha**2 * var / counts, 0) / p**2
        ll = M + np.log(p) + 0.5 * v
    return ll, v


def adaptive_importance_sampling(run_round: Callable, key, num_samples: int, batch_size: int,
                                 max_rounds: int = MAX_ROUNDS,
                                 max_group_se: float = MAX_GROUP_SE,
                                 target_se: float | None = None):
    """Rounds of :func:`importance_round` (``run_round(key) -> (stats, top, rest)``, one
    compiled program called again with new keys: nothing compiles after the first round)
    until every group's weights have a Pareto :math:`\\hat k \\le` :data:`PARETO_K_MORE` and a
    log-likelihood SE :math:`\\le` ``max_group_se`` (and the SE of :math:`-2\\ell` is at most
    ``target_se`` when given), or ``max_rounds`` rounds were drawn.

    :return: dict with ``ll_i``, ``var_i`` (per group), ``khat`` (per group),
        ``num_samples`` (draws per group), ``rounds``, ``rest``.
    """
    nb = max(1, -(-int(num_samples) // int(batch_size)))
    n_a = -(-int(batch_size) // 2)
    n_b = int(batch_size) - n_a
    per_round = nb * int(batch_size)
    stats, tops = [], []
    rest = None
    for r in range(int(max_rounds)):
        st, top, rest = run_round(random.fold_in(key, r))
        stats.append(np.asarray(st))
        tops.append(np.asarray(top, np.float64))
        R = r + 1
        ll_i, var_i = combine_rounds(stats, ((n_a / batch_size, n_b / batch_size),
                                             (n_a * nb * R, n_b * nb * R)))
        pooled = np.concatenate(tops, 1)
        khat = pareto_khat(pooled, per_round * R)
        more = (np.any(np.nan_to_num(khat, nan=0.0) > PARETO_K_MORE)
                or np.any(~(np.sqrt(var_i) <= max_group_se)))
        if target_se is not None:
            more = more or 2.0 * math.sqrt(float(np.sum(var_i))) > target_se
        if not more:
            break
    return {"ll_i": ll_i, "var_i": var_i, "khat": khat, "num_samples": per_round * R,
            "rounds": R, "rest": rest}


def num_top_weights(num_samples: int, batch_size: int) -> int:
    """How many of the largest log weights a round keeps per group: the Pareto tail of the
    pooled sample of :data:`MAX_ROUNDS` rounds (more rounds use this many: the tail of
    :func:`pareto_khat` is capped by what is kept, so that the program does not depend on
    ``max_samples``)."""
    nb = max(1, -(-int(num_samples) // int(batch_size)))
    total = nb * int(batch_size) * MAX_ROUNDS
    return int(min(0.2 * total, 3.0 * math.sqrt(total))) + 1


def importance_sampling(info: ModelInfo, layout: SubjectLayout | None, ids, theta_c, zs, args,
                        kwargs, key, num_samples: int = 5000, df: float = 4.0,
                        batch_size: int = 500, num_iters: int = 30):
    """Per-subject log-likelihoods by one round of defensive importance sampling
    (:func:`is_proposals`, :func:`importance_round`; traceable: no adaptive rounds, no
    Pareto diagnostic -- :meth:`SAEMResult.log_likelihood
    <numpyro_fed.saem.SAEMResult.log_likelihood>` adds both).

    :return: ``(ll_i (n,), var_i (n,), rest)`` -- per-subject estimates (Jensen-corrected),
        the variances of these estimates (delta method), and the log-density terms that
        depend on no latent.
    """
    lay = _layout_or_joint(info, layout)
    z0 = jnp.mean(jnp.asarray(zs).reshape(-1, zs.shape[-1]), 0)
    z, H, _, _ = conditional_modes(info, layout, ids, theta_c, z0, args, kwargs, num_iters)
    props = is_proposals(lay, info, zs, z, H)
    st, _, rest = importance_round(info, layout, ids, theta_c, props, args, kwargs, key,
                                   num_samples, df, batch_size)
    nb = max(1, -(-int(num_samples) // int(batch_size)))
    n_a = -(-int(batch_size) // 2)
    n_b = int(batch_size) - n_a
    mx, s1, s2 = st[0], st[1], st[2]  # (2, n)
    M = jnp.max(mx, 0)
    sc = jnp.where(jnp.isfinite(mx), jnp.exp(mx - M), 0.0)
    counts = jnp.asarray([n_a * nb, max(n_b * nb, 1)], mx.dtype)[:, None]
    mean = s1 * sc / counts
    var = jnp.maximum(s2 * sc**2 / counts - mean**2, 0.0) * counts / jnp.maximum(counts - 1, 1)
    alpha = jnp.asarray([n_a, n_b], mx.dtype)[:, None] / batch_size
    p = jnp.sum(alpha * mean, 0)
    v = jnp.sum(alpha**2 * var / counts, 0) / p**2
    return M + jnp.log(p) + 0.5 * v, v, rest


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

    Whether the integrand is quadratic is checked, not assumed
    (:func:`gaussian_exact_at_modes`).

    :return: ``(ll_i (n,), rest, discrepancy (n,))`` -- the largest absolute difference
        between the integrand and its quadratic expansion over the check points, per subject
        (rounding only, for a linear Gaussian model).
    """
    z, H, val, rest = conditional_modes(info, layout, ids, theta_c, z_init, args, kwargs,
                                        num_iters)
    ll, disc = gaussian_exact_at_modes(info, layout, ids, theta_c, z, H, val, args, kwargs,
                                       key, num_checks)
    return ll, rest, disc


def gaussian_exact_at_modes(info, layout, ids, theta_c, z, H, val, args, kwargs, key,
                            num_checks: int = 8):
    r""":func:`gaussian_exact` from the conditional modes ``z``, negative Hessian blocks ``H``
    and integrand values ``val`` of :func:`conditional_modes` (computed once and shared with
    the importance sampler).

    The expansion is taken at ``z`` *with its gradient* :math:`g_i`: for a quadratic
    integrand, :math:`\ell_i(\hat z_i + \Delta) = \ell_i(\hat z_i) + g_i^\top\Delta -
    \tfrac12\Delta^\top H_i\Delta` exactly wherever :math:`\hat z_i` is, and
    :math:`\log p(y_i\mid\theta) = \ell_i(\hat z_i) + \tfrac12 g_i^\top H_i^{-1}g_i +
    \tfrac q2\log 2\pi - \tfrac12\log|H_i|`. So a mode that float32 Newton steps left a
    fraction of a standard deviation off (their improvement of the integrand below its
    rounding: dyestuff, a batch 0.0025 sd off gave a 3.4e-3 departure at the check points
    without the gradient term) is neither a wrong value nor a refused check.

    The check: at ``num_checks`` points :math:`\hat z_i + 3L_i\varepsilon` (:math:`L_iL_i^\top
    = H_i^{-1}`, :math:`\varepsilon` standard normal) the integrand must equal its quadratic
    expansion :math:`\ell_i(\hat z_i) + 3 g_i^\top L_i\varepsilon - \tfrac92|\varepsilon|^2`
    (three conditional standard deviations out, where a cubic or quartic term of a
    non-Gaussian integrand shows).

    :return: ``(ll_i (n,), discrepancy (n,))``.
    """
    lay = _layout_or_joint(info, layout)
    dt = z.dtype
    q = lay.q
    f = _per_subject_fn(info, lay, ids, theta_c, args, kwargs)
    zb = to_blocks(z, lay.zidx)

    def integrand(b):  # (n, q) -> (n,): each subject's term depends on its own block only
        return f(from_blocks(b, lay.zidx))[0] + pad_log_density(b, lay.zidx)

    g = jax.grad(lambda b: jnp.sum(integrand(b)))(zb)  # (n, q), per block by separability
    sign, logdet = jnp.linalg.slogdet(H)
    Hinv = jnp.linalg.inv(H)
    Hinv = (Hinv + jnp.swapaxes(Hinv, -1, -2)) / 2.0
    newton = 0.5 * jnp.einsum("ni,nij,nj->n", g, Hinv, g)
    ll = val + newton + 0.5 * q * jnp.log(2 * jnp.pi) - 0.5 * logdet
    ll = jnp.where(sign > 0, ll, jnp.nan)
    L = jnp.linalg.cholesky(Hinv)
    eps = 3.0 * random.normal(key, (num_checks,) + zb.shape, dt)

    def at(e):
        d = jnp.einsum("nij,nj->ni", L, e)
        return integrand(zb + d) - (val + jnp.sum(g * d, -1) - 0.5 * jnp.sum(e**2, -1))

    disc = jnp.max(jnp.abs(lax.map(at, eps)), 0)
    disc = jnp.where(jnp.isfinite(disc), disc, jnp.inf)
    return ll, disc


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
