"""The likelihood reported by an SAEM fit is honest, and annealing works with a full Omega.

Issue 12 asks for two tests:

1. **Honest importance-sampling -2LL.** ``log_likelihood(method="is")`` draws, per subject,
   from a multivariate t built from the conditional mean and covariance of the final draws
   (saemix's ``llis``). Its estimate and its reported Monte Carlo SE must be honest: at the
   SAME theta (the fitted one), the error to the exact -2LL (``tests/saem_cases.py``: closed
   form for the linear sleepstudy, adaptive Gauss--Hermite for Theophylline) lies within 2
   reported SE for ~95% of seeds, its mean is ~0 and its spread is the reported SE. (The issue's
   example: a linear mixed model whose IS estimate was 8 units above exact with a reported SE
   of 1.3.) ``method="gq"`` and ``method="laplace"`` are checked against the same exact value.
2. **Simulated annealing with a Cholesky Omega.** Correlated random effects
   (``MultivariateNormal(scale_tril=L)`` with a ``lower_cholesky`` param) used to crash under
   the saemix schedule's annealing. The sleepstudy case runs with the default schedule (it
   anneals) and with an explicit annealing ``Schedule``; during the annealing iterations every
   variance -- the diagonal of ``L L^T`` and sigma^2 -- decreases by at most the factor
   ``anneal_factor`` per iteration, and the fit reaches the exact maximum. The two other
   full-Omega parametrisations of the closed-form M-step (a ``positive_definite`` covariance
   param, and ``diag(omega) L_corr`` with a ``corr_cholesky`` param) are checked the same way
   on a small simulated linear mixed model with a closed-form likelihood.

Cost: the compile of each SAEM fit dominates (~25-45 s each on a 2-core CPU; the runs take
< 1 s): one default fit per case, shared by both tests (module-scoped fixture; in the same
process as test_saem_defaults.py the compiled programs are reused), one explicit-schedule fit
and one fit of the simulated model (marked ``slow``). IS calls take ~0.1 s once compiled.
Measured on a busy 2-core machine: ~240 s for the file, ~170 s with ``-m "not slow"``.
"""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
import pytest
import saem_cases as sc
from numpyro.distributions import constraints

from numpyro_fed.saem import SAEM, ConvergenceWarning, Schedule

# one linear model with a full Omega (closed-form exact -2LL) and one nonlinear PK model with
# three random effects (exact -2LL by adaptive Gauss--Hermite quadrature)
IS_CASES = ["sleepstudy", "theoph_long"]


def _fit(model, key=0, **kw):
    # convergence is test_saem_defaults.py's business; here the fits are vehicles
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)
        saem = SAEM(model, **kw.pop("saem_kw", {}))
        return saem, saem.run(jax.random.key(key), **kw)


# the default fits are shared with test_saem_defaults.py (sc.default_fit, cached per
# process): one worker runs both files (make test: --dist loadgroup)
pytestmark = pytest.mark.xdist_group("saem_default_fits")


@pytest.fixture(scope="module")
def default_fit():
    """The default fit (seed 0) of a case: ``(case, result)``."""
    return lambda name: (sc.get_case(name), sc.default_fit(name)[0])


# ================================================================ 1. honest likelihoods
# Design of the coverage test. If the reported SE is honest and the error ~ normal, each seed
# misses |err| <= 2 SE with probability p0 = 4.55%, independently across seeds (independent
# keys, same fit). The literal criterion (>= 18 of 20 seeds within) would then fail
# with probability P(Bin(20, p0) >= 3) = 6.0%: too flaky for CI. We use 40 seeds and require
# >= 33 within (at most 7 misses): P(Bin(40, p0) >= 8) = 0.038%. The library's SE is slightly
# optimistic on theoph_long (measured over 200 other seeds: sd(err) = 1.11 x SE, 15/200 = 7.5%
# misses, the usual understatement of a self-normalised IS variance with heavy-ish weights);
# even at that miss rate P(Bin(40, 0.075) >= 8) = 0.9%. Power: an SE understated by 2x misses
# with p = 31.7%, so passes with P(Bin(40, 0.317) <= 7) = 3.4%; a bias of 6 SE (the issue's
# 8 units at SE 1.3) misses every seed.
NUM_SEEDS, MIN_WITHIN_2SE = 40, 33
# Mean error: honest and unbiased, mean(err) ~ N(0, SE^2 / 40); |mean| <= 3.5 SE / sqrt(40)
# fails with probability 2 Phi(-3.5) = 0.05% (0.16% with the measured sd = 1.11 SE). It
# catches a bias of 1 SE (= 6.3 SE / sqrt(40)), which coverage alone would let through ~60%
# of the time. (The Jensen bias of log-mean-weight is (SE/2)^2 ~ 4e-4: negligible.)
MEAN_ERR_IN_SE_OVER_SQRT_N = 3.5
# Spread: the empirical sd of the 40 errors over the mean reported SE is chi_39 / sqrt(39)
# distributed when honest: outside [0.6, 1.6] with probability 8e-5 (9e-5 with the measured
# ratio 1.11); an SE understated by 2x passes with probability 4%, overstated by 2x never.
SD_RATIO_RANGE = (0.6, 1.6)
# Usefulness: measured SE 0.040-0.041 on both cases at the default num_samples=5000 (the
# issue's bad example reported 1.3); 0.15 leaves a 3.5x margin and is far below the 0.5
# tolerance on -2LL used by the other SAEM tests.
MAX_SE = 0.15


@pytest.mark.parametrize("name", IS_CASES)
def test_importance_sampling_m2ll_and_its_se_are_honest(default_fit, name):
    case, res = default_fit(name)
    exact = -2.0 * case.exact_loglik(res.params)  # exact -2LL at the SAME theta
    errs, ses = [], []
    for seed in range(NUM_SEEDS):
        ll = res.log_likelihood(jax.random.key(seed), method="is")
        assert ll["method"] == "is"
        assert np.isfinite(ll["m2ll"]) and ll["m2ll"] == pytest.approx(-2 * ll["loglik"])
        errs.append(ll["m2ll"] - exact)
        ses.append(ll["m2ll_se"])
    errs, ses = np.asarray(errs), np.asarray(ses)
    within = int(np.sum(np.abs(errs) <= 2.0 * ses))
    se = float(np.mean(ses))
    msg = (f"{name}: exact -2LL {exact:.4f}; IS errors {np.round(errs, 4).tolist()}; "
           f"reported SE {np.round(ses, 4).tolist()}; {within}/{NUM_SEEDS} within 2 SE "
           f"(first 20 seeds: {int(np.sum(np.abs(errs[:20]) <= 2 * ses[:20]))}/20), mean "
           f"error {errs.mean():+.4f}, sd {errs.std(ddof=1):.4f}")
    assert np.all(ses > 0) and np.all(ses < MAX_SE), msg
    assert within >= MIN_WITHIN_2SE, msg
    assert abs(errs.mean()) <= MEAN_ERR_IN_SE_OVER_SQRT_N * se / np.sqrt(NUM_SEEDS), msg
    lo, hi = SD_RATIO_RANGE
    assert lo <= errs.std(ddof=1) / se <= hi, msg
    # same key, same estimate
    again = res.log_likelihood(jax.random.key(0), method="is")
    assert again["m2ll"] == pytest.approx(errs[0] + exact, abs=1e-9)


# The criterion (issue 28): over 20 seeds, the default -2LL within 2 reported SE of
# the exact value in >= 90% of them, on the nested binomial cbpp_olre (15 herds, groups of up
# to 5 latents), crossed Penicillin and nested Pastes / Oats (linear Gaussian: the default is
# the closed form, SE 0, scored within 1e-3 of exact as float32 round-off) and the
# single-factor binomial cbpp and Poisson epil, each fitted once with the defaults (seed 0).
# An HONEST SE misses 3 or more of 20 seeds with probability 6% (4.55% per seed), so the
# 20-seed count is checked on fixed seeds 100-119 together with the sharper 40-seed checks of
# the test above (>= 33 within, |mean err| <= 3.5 SE / sqrt(40), sd/SE in [0.6, 1.6]).
# Measured (seeds 100-139): within 19/38, 20/40 (exact), 20/40, 20/40, 20/40, 20/37; sd/SE
# 0.92 (cbpp_olre), 0.90 (cbpp), 1.24 (epil; 1.06 over 200 other seeds). The code before
# (importance sampling from the draws' moments by default) had 17/20 on cbpp_olre -- a 6%
# event for its SE, honest too (189/200 within over 200 other seeds).
SWEEP_CASES = ["cbpp_olre", "penicillin", "pastes", "oats", "cbpp", "epil"]


@pytest.mark.slow
@pytest.mark.parametrize("name", SWEEP_CASES)
def test_default_m2ll_is_honest_over_20_seeds(default_fit, name):
    case, res = default_fit(name)
    exact = -2.0 * case.exact_loglik(res.params)
    errs, ses = [], []
    for seed in range(NUM_SEEDS):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ConvergenceWarning)
            ll = res.log_likelihood(jax.random.key(100 + seed))
        assert ll["method"] == ("exact" if case.linear else "is"), ll["method"]
        errs.append(ll["m2ll"] - exact)
        ses.append(ll["m2ll_se"])
    errs, ses = np.asarray(errs), np.asarray(ses)
    within = np.abs(errs) <= np.maximum(2.0 * ses, 1e-3)
    msg = (f"{name}: exact {exact:.4f}; errors {np.round(errs, 4).tolist()}; SE "
           f"{np.round(ses, 4).tolist()}; first 20 within: {int(within[:20].sum())}/20")
    assert int(within[:20].sum()) >= 18, msg
    assert int(within.sum()) >= MIN_WITHIN_2SE, msg
    if not case.linear:
        se = float(np.mean(ses))
        assert 0.0 < se < MAX_SE, msg
        assert abs(errs.mean()) <= MEAN_ERR_IN_SE_OVER_SQRT_N * se / np.sqrt(NUM_SEEDS), msg
        lo, hi = SD_RATIO_RANGE
        assert lo <= errs.std(ddof=1) / se <= hi, msg


# Deterministic methods (no seed): the error is quadrature/approximation error plus float32
# round-off of the model's log-density (a -2LL of ~1750 in float32 carries ~1e-4).
# - gq: adaptive Gauss-Hermite at the conditional modes, 12 nodes per axis for 2 REs, 8 for
#   3; measured |err| 1.1e-4 (sleepstudy, Gaussian integrand: exact but for round-off) and
#   1.1e-3 (theoph_long, 3 REs); bound 0.05 as the issue asks.
# - laplace: exact for a linear Gaussian model (measured 1.2e-4 on sleepstudy, round-off;
#   bound 1e-3); an approximation otherwise (measured +0.42 on theoph_long; bound 3 units).
# CI runs the nonlinear case (GQ's hard one, 3 REs); the linear one (a separate GQ/Laplace
# compile, ~55 s) with the slow tests
@pytest.mark.parametrize("name", [pytest.param("sleepstudy", marks=pytest.mark.slow),
                                  "theoph_long"])
def test_quadrature_and_laplace_against_exact(default_fit, name):
    case, res = default_fit(name)
    exact = -2.0 * case.exact_loglik(res.params)
    assert case.n_re <= 3
    gq = res.log_likelihood(method="gq")
    assert gq["method"] == "gq" and gq["m2ll_se"] == 0.0
    assert abs(gq["m2ll"] - exact) < 0.05, (name, gq["m2ll"], exact)
    lap = res.log_likelihood(method="laplace")
    assert lap["method"] == "laplace" and lap["m2ll_se"] == 0.0
    assert np.isfinite(lap["m2ll"])
    tol = 1e-3 if case.linear else 3.0
    assert abs(lap["m2ll"] - exact) < tol, (name, lap["m2ll"], exact)


# ================================================================ 2. annealing, full Omega
def _chol_variances(traj, name, q):
    """Per iteration, the diagonal of L L^T from the trajectory's ``name[i,j]`` columns."""
    L = np.stack([np.stack([traj[f"{name}[{i},{j}]"].to_numpy(np.float64) for j in range(q)],
                           -1) for i in range(q)], -2)
    return np.einsum("kij,kij->ki", L, L)


def _check_annealing(V, v0, schedule, labels):
    """``V`` (K, m) variances per iteration (trajectory row k = theta after iteration k),
    ``v0`` (m,) at theta_0. Annealing applies to iterations 1..annealing_iters: there
    ``V_k >= tau V_{k-1}``, up to float32 round-off of the constrained coordinates (relative
    ~1e-7; measured min ratio 0.96999966 for tau = 0.97; tolerance 1e-5 relative). The floor
    must actually bind (else the check is vacuous): measured on sleepstudy 31/61/0 binding
    iterations of 150 (default, 45 chains: the full-covariance chain rule; 96/101/40 with
    the 3 chains of before) and 49-52/63-68/25-26 of 100 (explicit schedule, seeds 0-3);
    108-150 of 150 on the simulated model; required >= 10 for some variance (with 45 chains
    the residual variance of sleepstudy starts near its maximum and never needs the floor)."""
    tau, n_ann = schedule.anneal_factor, schedule.annealing_iters
    assert schedule.annealing and 0 < n_ann < len(V)
    V = np.vstack([np.asarray(v0, np.float64)[None], V])
    ratio = V[1:] / V[:-1]
    ann = ratio[:n_ann]
    worst = dict(zip(labels, ann.min(0), strict=True))
    where = dict(zip(labels, ann.argmin(0) + 1, strict=True))
    assert np.all(ann >= tau * (1.0 - 1e-5)), (
        f"annealing (tau={tau}) violated: min ratio per variance {worst} at iterations {where}")
    binding = np.sum(np.abs(ann - tau) <= 1e-5 * tau, 0)
    assert np.max(binding) >= 10, dict(zip(labels, binding, strict=True))
    # after the annealing phase the floor is lifted: some variance falls faster than tau
    assert np.any(ratio[n_ann:] < tau * (1.0 - 1e-3)), "annealing never switched off"


def _check_sleepstudy_annealing(case, res, schedule, init):
    V = np.column_stack([_chol_variances(res.trajectory, "L", 2),
                         res.trajectory["sigma"].to_numpy(np.float64) ** 2])
    L0 = np.asarray(init["L"], np.float64)
    v0 = np.r_[np.diag(L0 @ L0.T), float(init["sigma"]) ** 2]
    _check_annealing(V, v0, schedule, ["Sigma[0,0]", "Sigma[1,1]", "sigma^2"])
    # the exact maximum: the targets of test_saem_defaults.py (fixed effects within max(0.2
    # SE, 1%), variances within max(0.3 SE, 10%), exact -2LL at the estimate within 0.5 of the
    # exact minimum). Measured: default schedule, seed 0 (the fit of test_saem_defaults.py):
    # -2LL gap 0.008, every quantity within 0.06 SE with 3 chains; 0.0004 with the 45 of the
    # full-covariance chain rule (seed 1: 0.0001); explicit schedule, seeds 0-3: gaps 0.018,
    # 0.029, 0.012, 0.006, every quantity within 0.14 SE (the targets are 0.2/0.3 SE and 0.5).
    out = sc.compare(case, res.params)
    assert out["ok"], sc.format_comparison(out)


def test_default_schedule_anneals_a_cholesky_omega(default_fit):
    case, res = default_fit("sleepstudy")
    schedule = Schedule()  # SAEM's default: saemix's, with annealing
    assert schedule.annealing and schedule.anneal_factor == 0.97
    assert schedule.annealing_iters == schedule.num_exploration // 2 == 150
    assert res.mstep == "gaussian"  # the closed-form M-step with the Cholesky rule
    init, cons = sc.param_spec(case)
    assert cons["L"] is constraints.lower_cholesky
    _check_sleepstudy_annealing(case, res, schedule, init)


@pytest.mark.slow  # a compile of its own (~25 s); the default-schedule test above runs in CI
def test_explicit_annealing_schedule_with_a_cholesky_omega():
    """A stronger annealing factor (0.9) from variances 10-300x too large: the floor binds
    for tens of iterations in a row, and the fit still reaches the exact maximum."""
    case = sc.get_case("sleepstudy")
    schedule = Schedule(num_iters=300, num_exploration=150, annealing=True,
                        anneal_factor=0.9, num_annealing=100)
    init = {"beta": np.array([200.0, 7.0]), "L": 100.0 * np.eye(2), "sigma": 100.0}
    saem, res = _fit(case.model, init_params=init, saem_kw={"schedule": schedule},
                     **case.data)
    assert saem.program.mstep.spec.mvn_sites[0][1] == "cholesky"
    _check_sleepstudy_annealing(case, res, schedule, init)


# ---------------------------------------------------------- other full-Omega parametrisations
# A small simulated LMM with two outcomes per subject, each with a well-identified correlated
# random intercept and slope: 40 subjects, 8 centred times per outcome,
#   outcome 0: y = b_i0 + b_i1 t + e,  b_i ~ N(beta, Sigma)  (Sigma: positive_definite param)
#   outcome 1: y = c_i0 + c_i1 t + e,  c_i ~ N(gamma, diag(omega) R diag(omega)), R = L L^T
#              (omega: positive, L: corr_cholesky param), e ~ N(0, sigma^2).
# Both parametrisations in one model: one compile instead of two. Per subject and outcome
# y ~ N(Z mean, Z Cov Z^T + sigma^2 I): a closed-form likelihood, maximised by scipy.
_N, _T = 40, 8
_TIMES = (np.arange(_T) - (_T - 1) / 2) / 2


def _simulated_lmm():
    rng = np.random.default_rng(12)
    t = np.tile(_TIMES, 2 * _N).astype(np.float32)
    subj = np.repeat(np.arange(_N), 2 * _T)
    outcome = np.tile(np.repeat([0, 1], _T), _N)
    b = rng.multivariate_normal([2.0, 0.5], [[1.0, 0.3], [0.3, 0.5]], _N)
    c = rng.multivariate_normal([-1.0, 1.0], [[0.5, -0.2], [-0.2, 0.4]], _N)
    re = np.where(outcome[:, None] == 0, b[subj], c[subj])
    y = re[:, 0] + re[:, 1] * t + 0.3 * rng.normal(size=t.size)
    return {"t": t, "subj": subj, "outcome": outcome, "y": y.astype(np.float32)}


def two_rules_model(t, subj, outcome, y=None, n_subjects=_N):
    beta = numpyro.param("beta", jnp.zeros(2))
    Sigma = numpyro.param("Sigma", 10.0 * jnp.eye(2), constraint=constraints.positive_definite)
    gamma = numpyro.param("gamma", jnp.zeros(2))
    omega = numpyro.param("omega", 3.0 * jnp.ones(2), constraint=constraints.positive)
    L_corr = numpyro.param("L_corr", jnp.eye(2), constraint=constraints.corr_cholesky)
    sigma = numpyro.param("sigma", 3.0, constraint=constraints.positive)
    with numpyro.plate("subject", n_subjects):
        b = numpyro.sample("b", dist.MultivariateNormal(beta, covariance_matrix=Sigma))
        c = numpyro.sample("c", dist.MultivariateNormal(gamma,
                                                        scale_tril=omega[:, None] * L_corr))
    re = jnp.where(outcome[:, None] == 0, b[subj], c[subj])
    with numpyro.plate("obs", t.shape[0]):
        numpyro.sample("y", dist.Normal(re[:, 0] + re[:, 1] * t, sigma), obs=y)


def _lmm_m2ll(data, beta, Sigma, gamma, Cov_c, s2):
    """Exact -2 log-likelihood (closed form)."""
    Z = jnp.stack([jnp.ones(_T), _TIMES], 1)
    Y = jnp.asarray(data["y"], jnp.float64).reshape(_N, 2, _T)
    out = 0.0
    for k, (m, S) in enumerate(((beta, Sigma), (gamma, Cov_c))):
        V = Z @ S @ Z.T + s2 * jnp.eye(_T)
        r = Y[:, k] - Z @ m
        _, logdet = jnp.linalg.slogdet(V)
        out = out + _N * (_T * jnp.log(2 * jnp.pi) + logdet) + jnp.einsum(
            "ni,ij,nj->", r, jnp.linalg.inv(V), r)
    return out


def _unpack(u):
    def cov(a, b, c):
        L = jnp.array([[jnp.exp(a), 0.0], [b, jnp.exp(c)]])
        return L @ L.T

    return u[0:2], cov(*u[2:5]), u[5:7], cov(*u[7:10]), jnp.exp(2 * u[10])


def _lmm_mle(data):
    """The exact MLE (float64, exact gradients; BFGS from the truth's neighbourhood)."""
    from scipy import optimize

    with jax.enable_x64(True):
        f = jax.jit(jax.value_and_grad(lambda u: _lmm_m2ll(data, *_unpack(u))))

        def fg(u):
            v, g = f(jnp.asarray(u))
            return float(v), np.asarray(g)

        opt = optimize.minimize(fg, np.zeros(11), jac=True, method="BFGS",
                                options={"gtol": 1e-7, "maxiter": 2000})
        assert np.max(np.abs(fg(opt.x)[1])) < 1e-4, opt
        return [np.asarray(v) for v in _unpack(jnp.asarray(opt.x))], float(opt.fun)


@pytest.mark.slow  # a compile of its own (~45-70 s); no other test covers these two rules
def test_annealing_with_covariance_and_scale_corr_omega():
    """The closed-form M-step's other full-Omega rules ('covariance' and 'scale_corr' in
    mstep.py) under the default annealing schedule: the variances (diag Sigma, omega^2,
    sigma^2) decrease by at most tau per annealing iteration, and SAEM reaches the exact MLE."""
    data = _simulated_lmm()
    saem, res = _fit(two_rules_model, **data)
    assert res.mstep == "gaussian"
    rules = {site: rule for site, rule, _ in saem.program.mstep.spec.mvn_sites}
    assert rules == {"b": "covariance", "c": "scale_corr"}
    traj = res.trajectory
    V = np.column_stack([traj["Sigma[0,0]"], traj["Sigma[1,1]"], traj["omega[0]"] ** 2,
                         traj["omega[1]"] ** 2, traj["sigma"] ** 2]).astype(np.float64)
    _check_annealing(V, [10.0, 10.0, 9.0, 9.0, 9.0], Schedule(),
                     ["Sigma[0,0]", "Sigma[1,1]", "omega[0]^2", "omega[1]^2", "sigma^2"])
    p = {k: np.asarray(v, np.float64) for k, v in res.params.items()}
    Lc = p["omega"][:, None] * p["L_corr"]
    est = [p["beta"], p["Sigma"], p["gamma"], Lc @ Lc.T, float(p["sigma"]) ** 2]
    mle, m2ll_max = _lmm_mle(data)
    with jax.enable_x64(True):
        gap = float(_lmm_m2ll(data, *(jnp.asarray(v) for v in est))) - m2ll_max
    # the reference is a maximum (gap >= 0 up to the optimiser's tolerance) and SAEM reaches
    # it: measured gaps 0.0032, 0.0022, 0.0039, 0.0022 over seeds 0-3; bound 0.05 (13x).
    assert -1e-3 <= gap <= 0.05, gap
    # estimates (the Monte Carlo error of SAEM's final average), measured over seeds 0-3:
    # covariance entries within 0.8% of sqrt(S_aa S_bb) (bound 5%, ~0.2 of their sampling SE
    # sqrt(2/40) ~ 22%), sigma^2 within 0.35% (bound 2%), means within 0.0025 (bound 0.02,
    # ~0.1 of their sampling SE ~ 0.1-0.15).
    for S, S_hat in ((est[1], mle[1]), (est[3], mle[3])):
        scale = np.sqrt(np.outer(np.diag(S_hat), np.diag(S_hat)))
        assert np.all(np.abs(S - S_hat) <= 0.05 * scale), (S, S_hat)
    assert est[4] == pytest.approx(float(mle[4]), rel=0.02)
    for m, m_hat in ((est[0], mle[0]), (est[2], mle[2])):
        np.testing.assert_allclose(m, m_hat, atol=0.02)


# ================================================================ 3. the estimator's parts
def _fake_rounds(log_w_sampler, n, per_round, key=0):
    """``run_round`` for :func:`adaptive_importance_sampling` from a sampler of log weights
    ``(per_round, n)``: all draws in the Laplace component's half and the other half alike
    (both halves drawn from the same law), as :func:`importance_round` returns them."""
    from numpyro_fed.saem.likelihood import num_top_weights

    num_top = num_top_weights(per_round, per_round)
    half = -(-per_round // 2)

    def run_round(k):
        lw = np.asarray(log_w_sampler(k, per_round, n), np.float64)
        parts = [lw[:half], lw[half:]]
        st = np.stack([np.stack([p.max(0), np.exp(p - p.max(0)).sum(0),
                                 np.exp(2 * (p - p.max(0))).sum(0)]) for p in parts], 1)
        top = -np.sort(-lw.T, 1)[:, :num_top]
        return st, top, 0.0

    return run_round


def test_pareto_khat_tells_light_from_heavy_tails():
    """k-hat of Pareto(1/k) weights (true tail index k) from 5000 draws: measured 0.37 for k =
    0.3 and 0.87-1.04 for k = 1; log-normal(0, 0.5) weights (all moments finite) give
    k-hat < 0.2 (log-normal(0, 1) weights, whose tail looks heavy at S = 5000, 0.16-0.48).
    Bounds at the decision thresholds 0.5 / 0.7."""
    from numpyro_fed.saem.likelihood import pareto_khat

    rng = np.random.default_rng(0)
    S = 5000
    light = np.log(rng.pareto(1 / 0.2, (3, S)) + 1)
    heavy = np.log(rng.pareto(1 / 1.0, (3, S)) + 1)
    lognorm = 0.5 * rng.normal(size=(3, S))
    assert np.all(pareto_khat(light, S) < 0.5)
    assert np.all(pareto_khat(lognorm, S) < 0.5)
    assert np.all(pareto_khat(heavy, S) > 0.7)


def test_adaptive_rounds_stop_when_weights_are_light_and_run_on_when_heavy():
    from jax import random

    from numpyro_fed.saem.likelihood import adaptive_importance_sampling

    light = _fake_rounds(lambda k, s, n: np.asarray(0.3 * random.normal(k, (s, n))), 4, 2000)
    r = adaptive_importance_sampling(light, random.key(0), 2000, 2000, max_rounds=5)
    assert r["rounds"] == 1 and r["num_samples"] == 2000 and np.all(r["khat"] < 0.5)
    heavy = _fake_rounds(lambda k, s, n: np.log(np.asarray(random.pareto(k, 1.0, (s, n))) + 1),
                         4, 2000)
    r = adaptive_importance_sampling(heavy, random.key(0), 2000, 2000, max_rounds=5)
    assert r["rounds"] == 5 and r["num_samples"] == 10_000 and np.all(r["khat"] > 0.7)


def test_log_of_mean_weight_is_jensen_corrected_over_many_groups():
    """Many groups, few draws each: the log of a mean weight is biased by -var/2 per group
    (Jensen), n times over, while the SE grows like sqrt(n). 4000 groups of log-normal(0, 1)
    weights (true log mean 0.5), 400 draws per group (one round): per-group variance of the
    estimate (e - 1)/400 = 0.0043, so the uncorrected sum is biased by -8.6 against an SE of
    sqrt(4000 * 0.0043) = 4.1 (2.1 SE); measured over keys 0-3: -2.7 to -3.7 SE uncorrected,
    -0.7 to -1.7 SE corrected (what is left comes from estimating each variance from the same
    skewed draws). The reported per-group variances are the delta-method ones (within 10%)."""
    from jax import random

    from numpyro_fed.saem.likelihood import adaptive_importance_sampling

    n, S = 4000, 400
    run = _fake_rounds(lambda k, s, n: np.asarray(random.normal(k, (s, n))), n, S)
    r = adaptive_importance_sampling(run, random.key(1), S, S, max_rounds=1)
    se = float(np.sqrt(np.sum(r["var_i"])))
    err = float(np.sum(r["ll_i"])) - 0.5 * n
    assert abs(err) < 3 * se, (err, se)
    assert float(np.sum(r["ll_i"] - 0.5 * r["var_i"])) - 0.5 * n < -1.5 * se
    np.testing.assert_allclose(np.mean(r["var_i"]), (np.e - 1) / S, rtol=0.1)
