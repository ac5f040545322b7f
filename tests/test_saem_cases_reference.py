"""Tests of the exact references of the SAEM test cases (tests/saem_cases.py): the reference
log-likelihoods describe the models as written, the quadrature is exact to the stated
tolerances, the cached maxima are maxima, and they agree with published fits."""

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import pytest
import saem_cases as sc
from numpyro.distributions import constraints

CASES = sc.CASE_NAMES
LINEAR = [n for n in CASES if sc.get_case(n).linear]
NONLINEAR = [n for n in CASES if not sc.get_case(n).linear]
#: checks of the stored references themselves (brute-force integration, maximality) run in
#: CI on these cases -- a PK model with 3 REs, a binomial GLMM, a closed-form LMM -- and on
#: the others with the slow tests (``make test-slow``): the references are stored in
#: tests/data/saem_references.json and only change when a case does
CI_REFERENCE_CASES = {"theoph_long", "cbpp", "sleepstudy"}


def _ci(names):
    return [n if n in CI_REFERENCE_CASES else pytest.param(n, marks=pytest.mark.slow)
            for n in names]


def _ref_params(name):
    return sc.reference(name)["params"]


def _sites(case):
    """Trace of the model at its init, in JAX's default precision (as a user runs it)."""
    return numpyro.handlers.trace(numpyro.handlers.seed(case.model, 0)).get_trace(**case.data)


# ----------------------------------------------------------------------------- the set
def test_case_set_covers_the_brief():
    cases = sc.all_cases()
    assert len(cases) >= 7
    assert {c.layout for c in cases} == {"long", "padded"}
    assert {c.n_re for c in cases} == {1, 2, 3}
    assert LINEAR and NONLINEAR
    kinds = " ".join(" ".join(c.covers) for c in cases)
    for word in ("LMM", "NLME (growth)", "NLME (PK)", "binomial GLMM", "Poisson GLMM",
                 "full Omega", "without RE", "covariate", "mask"):
        assert word in kinds, word
    # one correlated (full-Omega) case: a lower_cholesky param
    _, cons = sc.param_spec("sleepstudy")
    assert cons["L"] is constraints.lower_cholesky


@pytest.mark.parametrize("name", CASES)
def test_model_follows_the_contract(name):
    """Params have the expected constraints, inits are not the MLE, every latent site is in
    the subject plate, the observed site is in a plate, and the model runs in float32."""
    case = sc.get_case(name)
    tr = _sites(case)
    init, cons = sc.param_spec(case)
    ref = sc.reference(case)
    for k, c in cons.items():
        assert c in (constraints.real, constraints.positive, constraints.lower_cholesky), k
        assert not np.allclose(init[k], ref["params"][k], rtol=0.05), k
    latent = [s for s in tr.values() if s["type"] == "sample" and not s["is_observed"]]
    observed = [s for s in tr.values() if s["type"] == "sample" and s["is_observed"]]
    assert latent and len(observed) == 1
    for s in latent:
        assert case.subject_plate in {f.name for f in s["cond_indep_stack"]}, s["name"]
    obs = observed[0]
    assert obs["cond_indep_stack"], "the observed site must be in a plate"
    lp = obs["fn"].log_prob(obs["value"])
    assert lp.dtype == jnp.float32 and bool(jnp.all(jnp.isfinite(lp)))
    assert int(np.prod(np.shape(obs["value"]))) >= case.n_obs


@pytest.mark.parametrize("name", CASES)
def test_reference_log_joint_is_the_model(name):
    """The hand-written per-subject log joint equals NumPyro's log density of the model at
    random effects near their prior location (float64; round-off only)."""
    case = sc.get_case(name)
    th = _ref_params(name)
    rng = np.random.default_rng(0)
    with jax.enable_x64(True):
        b0 = np.asarray(case.re_init({k: jnp.asarray(v) for k, v in th.items()}))
    b0 = np.broadcast_to(b0, (case.n_subjects, case.n_re))
    for _ in range(2):
        b = b0 + rng.normal(size=b0.shape) * (0.05 * np.abs(b0) + 0.05)
        mine = float(np.sum(sc.reference_log_joint(case, th, b)))
        theirs = sc.model_log_density(case, th, b)
        assert mine == pytest.approx(theirs, rel=1e-10, abs=1e-8)


# ----------------------------------------------------------------------------- quadrature
@pytest.mark.parametrize("name", LINEAR)
def test_closed_form_matches_agq(name):
    """For a linear Gaussian model p(y_i, b_i) is Gaussian in b_i, so AGQ is exact up to
    round-off (even the Laplace approximation is); 1e-6 absolute, at the MLE and at the
    user's initial values."""
    case = sc.get_case(name)
    init, _ = sc.param_spec(case)
    for th in (_ref_params(name), init):
        assert sc.agq_loglik(case, th) == pytest.approx(sc.exact_loglik(case, th), abs=1e-6)
        assert sc.agq_loglik(case, th, num_nodes=1) == pytest.approx(
            sc.exact_loglik(case, th), abs=1e-6)


@pytest.mark.parametrize("name", _ci(NONLINEAR))
def test_agq_matches_brute_force(name):
    """AGQ (25 / 15^2 / 9^3 nodes) against the trapezoidal rule on a dense grid (4001 /
    321^2 / 97^3 points over +-12 Laplace standard deviations, spacing <= 0.25) at the MLE.
    The grid's discretisation and truncation errors are far below 1e-10 for these smooth,
    light-tailed integrands (measured: the two rules agree to ~1e-9 per subject); AGQ's own
    error, estimated by the change from the default number of nodes to fewer, is ~1e-6 at
    most. 1e-4 absolute on the total log-likelihood (the quantity behind the -2LL target of
    0.5) leaves a wide margin while still catching any error that could move an MLE."""
    case = sc.get_case(name)
    th = _ref_params(name)
    agq = sc.exact_loglik_per_subject(case, th)
    brute = sc.brute_force_loglik(case, th)
    assert np.all(np.isfinite(brute))
    assert abs(agq.sum() - brute.sum()) < 1e-4
    np.testing.assert_allclose(agq, brute, atol=1e-5)
    assert sc.exact_loglik(case, th) == pytest.approx(agq.sum(), abs=1e-9)


# ----------------------------------------------------------------------------- the maxima
@pytest.mark.parametrize("name", _ci(CASES))
def test_reference_is_a_maximum(name):
    """At the cached MLE: the cached log-likelihood is what the code computes, the gradient
    vanishes (the Newton decrement g' I^-1 g, i.e. twice the log-likelihood a Newton step
    could still gain, is < 1e-8) and the observed information is positive definite."""
    case = sc.get_case(name)
    ref = sc.reference(case)
    ll, g, H = sc.loglik_grad_hess(case, ref["params"])
    assert ll == pytest.approx(ref["loglik"], abs=1e-6)
    info = -(H + H.T) / 2
    eig = np.linalg.eigvalsh(info)
    assert eig.min() > 0
    assert float(g @ np.linalg.solve(info, g)) < 1e-8
    se_u = np.sqrt(np.diag(np.linalg.inv(info)))
    assert np.max(np.abs(g) * se_u) < 1e-4
    assert all(np.isfinite(v) and v > 0 for v in ref["se"].values())


@pytest.mark.parametrize("name", ["dyestuff", "cbpp"])
def test_cache_matches_recomputation(name):
    """Recompute one closed-form and one AGQ reference from scratch (two starts)."""
    cached = sc.reference(name)
    fresh = sc.exact_mle(name)
    assert fresh["m2ll"] == pytest.approx(cached["m2ll"], abs=1e-6)
    for k, v in cached["quantities"].items():
        se = cached["se"][k]
        assert abs(fresh["quantities"][k] - v) < 1e-4 * se, k
        assert fresh["se"][k] == pytest.approx(se, rel=1e-4), k


def test_published_fits():
    """lme4 ML fits (lmer REML=FALSE; glmer nAGQ=25) and the Theophylline -2LL of the
    literature, to the digits published."""
    r = sc.reference("sleepstudy")
    q = r["quantities"]
    assert r["m2ll"] == pytest.approx(1751.939, abs=1e-3)
    assert q["beta[0]"] == pytest.approx(251.405, abs=1e-3)
    assert q["beta[1]"] == pytest.approx(10.467, abs=1e-3)
    assert np.sqrt(q["Sigma[0,0]"]) == pytest.approx(23.780, abs=2e-3)
    assert np.sqrt(q["Sigma[1,1]"]) == pytest.approx(5.717, abs=2e-3)
    assert np.sqrt(q["sigma^2"]) == pytest.approx(25.592, abs=2e-3)
    r = sc.reference("dyestuff")
    assert r["m2ll"] == pytest.approx(327.3271, abs=1e-3)
    assert np.sqrt(r["quantities"]["tau^2"]) == pytest.approx(37.26, abs=0.01)
    assert np.sqrt(r["quantities"]["sigma^2"]) == pytest.approx(49.51, abs=0.01)
    q = sc.reference("cbpp")["quantities"]
    lme4 = {"intercept": -1.40, "beta_period[0]": -0.99, "beta_period[1]": -1.13,
            "beta_period[2]": -1.58}
    for k, v in lme4.items():
        assert abs(q[k] - v) < 0.02, k
    assert abs(np.sqrt(q["sigma^2"]) - 0.64) < 0.02
    assert sc.reference("theoph_long")["m2ll"] == pytest.approx(345.44, abs=0.05)


# ----------------------------------------------------------------------------- scoring
def test_compare_scores_estimates():
    case = sc.get_case("dyestuff")
    ref = sc.reference(case)
    out = sc.compare(case, ref["params"], m2ll_at_est=ref["m2ll"] + 0.1)
    assert out["ok"] and abs(out["m2ll_gap"]) < 1e-9
    assert out["m2ll_reported_err"] == pytest.approx(0.1)
    assert all(abs(r["err"]) < 1e-9 for r in out["quantities"].values())
    # one SE off in mu fails its tolerance max(0.2 SE, 1%) (1% of 1527.5 is 0.86 SE here) and
    # the -2LL target too (a shift of k SE in one fixed effect raises -2LL by ~k^2 = 1 > 0.5)
    se_mu = ref["se"]["mu"]
    bad = {**ref["params"], "mu": ref["params"]["mu"] + se_mu}
    out = sc.compare(case, bad)
    assert not out["ok"] and out["failures"] == ["mu", "m2ll_gap"]
    assert out["quantities"]["mu"]["err_se"] == pytest.approx(1.0)
    assert out["m2ll_gap"] == pytest.approx(1.0, abs=0.1)
    ok = {**ref["params"], "sigma": ref["params"]["sigma"] * np.sqrt(1.05)}
    assert sc.compare(case, ok)["ok"]
    # a -2LL gap of more than 0.5 fails
    far = {**ref["params"], "mu": ref["params"]["mu"] + 3 * se_mu}
    out = sc.compare(case, far)
    assert "m2ll_gap" in out["failures"] and out["m2ll_gap"] > 0.5
    assert "dyestuff" in sc.format_comparison(out)


def test_compare_covariance_scale():
    """The covariance of sleepstudy is scored relative to sqrt(var_0 var_1)."""
    case = sc.get_case("sleepstudy")
    ref = sc.reference(case)
    out = sc.compare(case, ref["params"])
    row = out["quantities"]["Sigma[1,0]"]
    q = ref["quantities"]
    assert row["kind"] == "covariance"
    assert row["tol"] == pytest.approx(max(0.3 * ref["se"]["Sigma[1,0]"],
                                           0.1 * np.sqrt(q["Sigma[0,0]"] * q["Sigma[1,1]"])))
