"""Unit tests of the closed-form Gaussian M-step (``numpyro_fed.saem.mstep``) for the three
full-Omega parametrisations of a ``MultivariateNormal`` random effect recognised by
``_find_mvn_rule`` -- "cholesky" (a ``lower_cholesky`` scale_tril), "covariance" (a
``positive_definite`` covariance_matrix) and "scale_corr" (``omega[:, None] * L_corr`` with a
``corr_cholesky`` L_corr) -- and of saemix's simulated annealing of their variances.

No SAEM fit and no compiled SAEM loop: ``detect_gaussian`` on a tiny model, then one
``GaussianMStep.update`` with gamma = 1 on given latent draws, compared with the
complete-data MLE computed independently in numpy (float64).

One model holds the three rules side by side (one site, one location vector and one residual
scale of its own per rule): one ``ModelInfo``, one detection and one compile of the M-step
instead of three keeps the file fast; each site gets different draws and data, so that a
site's update using another site's statistics is caught too.

Tolerance: the M-step runs in float32 (JAX's default). The statistics are means of 90 terms
(30 subjects x 3 chains) of O(1-10) magnitude, Omega comes from the raw second moments
(E[zz^T] - mu mu^T: a cancellation by a factor (|mu|^2 + var) / var of at most ~6 here), and
the parameters then go through a Cholesky factorisation and the constraint bijections and
back: each step costs a few float32 ulps (6e-8). The largest relative error seen is 6e-7
(sigma^2; Omega and its parameters <= 3e-7). ``rtol=1e-4`` leaves a margin of ~100 while
catching any real error of the formulas: a divisor N C - 1 instead of N C is 1.1e-2, an
annealing factor sqrt(0.97) instead of 0.97 1.5e-2, statistics of one chain only O(0.1).
"""

import inspect

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
import pytest
from jax import random
from numpyro.distributions import constraints

from numpyro_fed.saem.model import ModelInfo
from numpyro_fed.saem.mstep import GaussianMStep, detect_gaussian

N, T, C = 30, 5, 3  # subjects, times per subject, chains
TIMES = np.linspace(-1.0, 1.0, T).astype(np.float32)
RTOL = 1e-4
RULES = ("cholesky", "covariance", "scale_corr")
COV_NAMES = {"cholesky": ("L",), "covariance": ("Omega",), "scale_corr": ("omega", "L_corr")}
TAU = inspect.signature(GaussianMStep.__init__).parameters["anneal_factor"].default

# one worker under `pytest -n 2 --dist loadgroup`: the module fixture (one ModelInfo, one
# detection, one compile) is then built once
pytestmark = pytest.mark.xdist_group("saem_mstep_rules")


def model(design, y=None):
    """Per rule r: phi_r,i ~ MVN(mu_r, Omega_r) with Omega_r parametrised by r,
    y_r,ij ~ N(phi_r,i0 + phi_r,i1 t_j, sigma_r) (``design`` = [1; t], ``y`` a tuple).
    Initial values in numpy and the mean as one matmul: fewer eager JAX ops to compile
    while ModelInfo and detect_gaussian trace the model."""
    one, eye = np.ones(2, np.float32), np.eye(2, dtype=np.float32)
    re = {}
    for r in RULES:
        mu = numpyro.param(f"mu_{r}", 0.0 * one)
        if r == "cholesky":
            L = numpyro.param("L", eye, constraint=constraints.lower_cholesky)
            re[r] = dist.MultivariateNormal(mu, scale_tril=L)
        elif r == "covariance":
            S = numpyro.param("Omega", eye, constraint=constraints.positive_definite)
            re[r] = dist.MultivariateNormal(mu, covariance_matrix=S)
        else:
            om = numpyro.param("omega", one, constraint=constraints.positive)
            Lc = numpyro.param("L_corr", eye, constraint=constraints.corr_cholesky)
            re[r] = dist.MultivariateNormal(mu, scale_tril=om[:, None] * Lc)
    sigma = {r: numpyro.param(f"sigma_{r}", 1.0, constraint=constraints.positive)
             for r in RULES}
    with numpyro.plate("subject", N):
        for k, r in enumerate(RULES):
            phi = numpyro.sample(f"phi_{r}", re[r])
            numpyro.sample(f"y_{r}", dist.Normal(phi @ design, sigma[r]).to_event(1),
                           obs=None if y is None else y[k])


def rule_params(rule, Omega):
    """The constrained covariance params giving ``Omega`` under ``rule`` (numpy float64)."""
    Omega = np.asarray(Omega, np.float64)
    if rule == "cholesky":
        return {"L": np.linalg.cholesky(Omega)}
    if rule == "covariance":
        return {"Omega": Omega}
    sd = np.sqrt(np.diag(Omega))
    return {"omega": sd, "L_corr": np.linalg.cholesky(Omega / np.outer(sd, sd))}


def cov_of(rule, tc):
    """Omega from the constrained params ``tc`` (numpy float64)."""
    if rule == "cholesky":
        return tc["L"] @ tc["L"].T
    if rule == "covariance":
        return tc["Omega"]
    L = tc["omega"][:, None] * tc["L_corr"]
    return L @ L.T


def corr(S):
    sd = np.sqrt(np.diag(S))
    return S / np.outer(sd, sd)


def _data():
    """Per rule: y (N, T) and the latent draws of the C chains (C, N, 2) -- any values (here
    around, not at, the phi that generated y), different for each rule."""
    rng = np.random.default_rng(0)
    ys, draws = [], []
    for mu, Om in (([2.0, -1.0], [[1.0, 0.6], [0.6, 2.0]]),
                   ([-1.0, 0.5], [[0.5, -0.3], [-0.3, 1.5]]),
                   ([0.5, 3.0], [[2.0, 0.4], [0.4, 0.3]])):
        phi = rng.multivariate_normal(mu, Om, N)
        ys.append(phi[:, :1] + phi[:, 1:] * TIMES + 0.5 * rng.normal(size=(N, T)))
        draws.append(phi[None] + rng.normal(scale=[0.8, 0.5], size=(C, N, 2)))
    return np.stack(ys).astype(np.float32), np.stack(draws).astype(np.float32)


Y, DRAWS = _data()


def complete_data_mle(k):
    """mu, Omega, sigma^2 of rule k maximising the complete-data likelihood averaged over
    the chains (numpy float64, from the float32 values the M-step sees)."""
    phi = np.asarray(DRAWS[k], np.float64)
    mu = phi.mean((0, 1))
    D = phi - mu
    Omega = np.einsum("cni,cnj->ij", D, D) / (C * N)
    res = np.asarray(Y[k], np.float64) - (phi[..., :1] + phi[..., 1:] * TIMES.astype(float))
    return mu, Omega, np.mean(res**2)


@pytest.fixture(scope="module")
def setup():
    design = np.stack([np.ones(T, np.float32), TIMES])
    args, kwargs = (jnp.asarray(design),), {"y": tuple(jnp.asarray(v) for v in Y)}
    info = ModelInfo(model, args, kwargs, random.PRNGKey(0))
    spec, reason = detect_gaussian(info, args, kwargs, random.PRNGKey(1))
    assert spec is not None, reason
    mstep = GaussianMStep(info, spec, interweave=False)  # the closed-form cycle alone
    data = (args, kwargs)

    def one_update(theta_c, phi, anneal):
        """From the constrained theta and the draws {site: (C, N, 2)}: prepare, then update
        with gamma = 1; the new constrained theta. The state has init's structure (built as
        in SAEM._init_program, from jax.eval_shape) but every statistic set to 7: gamma = 1
        must forget it (and computing it by init would cost a model trace more to compile)."""
        theta_u = info.unconstrain_theta(theta_c)
        z = jax.vmap(info.unconstrain_z)(phi)
        aux = mstep.prepare(theta_u, z, data,
                            jnp.zeros((z.shape[1], theta_u.shape[0]), z.dtype))
        shape = jax.eval_shape(lambda: mstep.init(theta_u, z, data, aux))
        state = jax.tree.map(lambda a: jnp.full(a.shape, 7.0, a.dtype), shape)
        theta_new, _ = mstep.update(state, jnp.float32(1.0), theta_u, z, data, aux, anneal,
                                    None)
        return info.constrain_theta(theta_new)

    # one compile (anneal traced; everything inside, no eager op to compile); -O0: it runs
    # a few times only
    jitted = jax.jit(one_update, compiler_options={"xla_backend_optimization_level": 0})
    phi = {f"phi_{r}": DRAWS[k] for k, r in enumerate(RULES)}

    def update(old_omega, old_sigma, anneal):
        """The constrained theta (numpy float64) after one update from the theta with
        every Omega_r = ``old_omega``, sigma_r = ``old_sigma``, mu_r = (0.5, 0.5)."""
        tc = {}
        for r in RULES:
            tc[f"mu_{r}"] = np.array([0.5, 0.5])
            tc[f"sigma_{r}"] = np.array(old_sigma)
            tc.update(rule_params(r, old_omega))
        out = jitted({n: v.astype(np.float32) for n, v in tc.items()}, phi, anneal)
        return {n: np.asarray(v, np.float64) for n, v in out.items()}

    return info, spec, mstep, update


def test_detects_rules(setup):
    """detect_gaussian finds each MVN site with its rule and covariance params, each
    residual scale in closed form, and leaves nothing to SA-Newton."""
    info, spec, mstep, _ = setup
    assert set(spec.mvn_sites) == {(f"phi_{r}", r, COV_NAMES[r]) for r in RULES}
    assert spec.mvn_q == (2, 2, 2)
    assert spec.diag_sites == ()
    assert set(spec.obs_sites) == {f"y_{r}" for r in RULES}
    assert spec.newton_idx.size == 0 and not mstep.needs_score
    mu_idx = [info.param_offsets[info.param_names.index(f"mu_{r}")] + j
              for r in RULES for j in (0, 1)]
    np.testing.assert_array_equal(np.sort(spec.loc_idx), np.sort(mu_idx))


@pytest.mark.parametrize("k,rule", list(enumerate(RULES)))
def test_update_is_complete_data_mle(setup, k, rule):
    """gamma = 1, anneal off: mu = mean of phi over subjects and chains, Omega = mean of
    (phi - mu)(phi - mu)^T, sigma^2 = mean squared residual, in the rule's parameters."""
    *_, update = setup
    mu, Omega, s2 = complete_data_mle(k)
    tc = update([[3.0, -1.0], [-1.0, 2.0]], 2.0, anneal=False)
    np.testing.assert_allclose(tc[f"mu_{rule}"], mu, rtol=RTOL, atol=RTOL * np.abs(mu).max())
    for n, v in rule_params(rule, Omega).items():
        np.testing.assert_allclose(tc[n], v, rtol=RTOL, atol=RTOL * np.abs(v).max(),
                                   err_msg=n)
    np.testing.assert_allclose(cov_of(rule, tc), Omega, rtol=RTOL,
                               atol=RTOL * np.abs(Omega).max())
    np.testing.assert_allclose(tc[f"sigma_{rule}"] ** 2, s2, rtol=RTOL)


@pytest.mark.parametrize("old_diag", [(100.0, 100.0), (100.0, 0.01)],
                         ids=["both-floored", "one-floored"])
@pytest.mark.parametrize("k,rule", list(enumerate(RULES)))
def test_annealing(setup, k, rule, old_diag):
    """anneal on, current variances far above the draws' (~1): each variance of Omega
    decreases by exactly the factor anneal_factor (where the MLE is below that floor, else
    it is the MLE), the correlation is the unannealed MLE's, mu is the MLE; sigma^2 likewise
    (floored at anneal_factor sigma_old^2). anneal off from the same theta: the plain MLE."""
    *_, update = setup
    assert TAU == 0.97
    mu, Omega, s2 = complete_data_mle(k)
    old = np.diag(old_diag)
    sigma_old = 10.0
    floored = np.diag(old) * TAU > np.diag(Omega)
    assert floored.tolist() == [True, old_diag[1] == 100.0]

    plain = update(old, sigma_old, anneal=False)
    np.testing.assert_allclose(cov_of(rule, plain), Omega, rtol=RTOL,
                               atol=RTOL * np.abs(Omega).max())
    np.testing.assert_allclose(plain[f"sigma_{rule}"] ** 2, s2, rtol=RTOL)

    ann = update(old, sigma_old, anneal=True)
    S = cov_of(rule, ann)
    np.testing.assert_allclose(np.diag(S), np.where(floored, TAU * np.diag(old),
                                                    np.diag(Omega)), rtol=RTOL)
    np.testing.assert_allclose(corr(S), corr(cov_of(rule, plain)), rtol=RTOL, atol=RTOL)
    np.testing.assert_allclose(corr(S), corr(Omega), rtol=RTOL, atol=RTOL)
    np.testing.assert_allclose(ann[f"mu_{rule}"], mu, rtol=RTOL,
                               atol=RTOL * np.abs(mu).max())
    np.testing.assert_allclose(ann[f"sigma_{rule}"] ** 2, TAU * sigma_old**2, rtol=RTOL)



def two_sites(t, y=None):
    """Independent intercepts and slopes: b0_i ~ N(beta0, omega_0), b1_i ~ N(beta1, omega_1)."""
    beta0 = numpyro.param("beta0", 0.0)
    beta1 = numpyro.param("beta1", 0.0)
    omega = numpyro.param("omega", np.ones(2, np.float32), constraint=constraints.positive)
    sigma = numpyro.param("sigma", 1.0, constraint=constraints.positive)
    with numpyro.plate("subject", N, dim=-2):
        b0 = numpyro.sample("b0", dist.Normal(beta0, omega[0]))
        b1 = numpyro.sample("b1", dist.Normal(beta1, omega[1]))
        numpyro.sample("y", dist.Normal(b0 + b1 * t, sigma), obs=y)


def test_locations_exact_when_one_variance_is_at_its_floor():
    """Regression (Orthodont, 600 exploration iterations): omega_0 collapsed to 1e-15 made
    the weights of the two sites differ by 1e28, and a ridge relative to trace(M) then set
    beta1 to 3e-20 (the -2LL 80 above the maximum). With gamma = 1 each location is the
    mean of its own site's draws, whatever the other site's variance: the Jacobi-scaled
    solve gives it to float32 rounding (rtol 1e-5, ~100 ulps of a mean of 90 terms)."""
    rng = np.random.default_rng(3)
    y = rng.normal(size=(N, T)).astype(np.float32)
    args, kwargs = (jnp.asarray(TIMES),), {"y": jnp.asarray(y)}
    info = ModelInfo(two_sites, args, kwargs, random.PRNGKey(0))
    spec, reason = detect_gaussian(info, args, kwargs, random.PRNGKey(1))
    assert spec is not None and set(spec.diag_sites) == {"b0", "b1"}, reason
    mstep = GaussianMStep(info, spec, interweave=False)  # the closed-form cycle alone
    data = (args, kwargs)
    b0 = 17.0 + 1e-3 * rng.normal(size=(C, N, 1)).astype(np.float32)
    b1 = 0.66 + 0.1 * rng.normal(size=(C, N, 1)).astype(np.float32)

    @jax.jit
    def update(theta_c, b0, b1):
        theta_u = info.unconstrain_theta(theta_c)
        z = jax.vmap(lambda u, v: info.unconstrain_z({"b0": u, "b1": v}))(b0, b1)
        aux = mstep.prepare(theta_u, z, data,
                            jnp.zeros((z.shape[1], theta_u.shape[0]), z.dtype))
        shape = jax.eval_shape(lambda: mstep.init(theta_u, z, data, aux))
        state = jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), shape)
        theta_new, _ = mstep.update(state, jnp.float32(1.0), theta_u, z, data, aux, False,
                                    None)
        return info.constrain_theta(theta_new)

    tc = {"beta0": np.float32(17.0), "beta1": np.float32(0.5),
          "omega": np.array([1e-15, 0.1], np.float32), "sigma": np.float32(1.0)}
    out = update(tc, b0, b1)
    np.testing.assert_allclose(float(out["beta0"]), b0.mean(dtype=np.float64), rtol=1e-5)
    np.testing.assert_allclose(float(out["beta1"]), b1.mean(dtype=np.float64), rtol=1e-5)


def test_correlation_heading_to_one_keeps_a_cholesky_factor():
    """A full Omega whose correlation heads to 1 (nlme's Phenobarb, full Omega on CL and V:
    2 of 4 seeds crashed with "the M-step gave a non-finite theta" once L_omega[1,1] fell to
    9e-4 of L_omega[1,0]): the moment formula's covariance, no longer positive definite in
    float32, is held at a correlation matrix with smallest eigenvalue CORR_FLOOR, variances
    kept; a covariance above the floor passes bit for bit."""
    from numpyro_fed.saem.mstep import CORR_FLOOR, _corr_floor

    sd = jnp.asarray([3.5, 2.4], jnp.float32)
    for rho in (1.0, 1.0 + 1e-7, 0.9999999):
        R = jnp.asarray([[1.0, rho], [rho, 1.0]], jnp.float32)
        Sig = R * sd[:, None] * sd[None, :]
        out, low = jax.jit(_corr_floor)(Sig)
        assert bool(low)
        L = np.asarray(jnp.linalg.cholesky(out))
        assert np.all(np.isfinite(L)) and L[1, 1] > 0, (rho, L)
        np.testing.assert_allclose(np.diagonal(out), sd ** 2, rtol=1e-5)
        c = float(out[0, 1] / (sd[0] * sd[1]))
        # smallest eigenvalue of the correlation matrix 1 - c at the floor (float32 rounding)
        assert 0.3 * CORR_FLOOR < 1.0 - c < 3.0 * CORR_FLOOR, (rho, c)
    Sig = jnp.asarray([[4.0, 1.9], [1.9, 1.0]], jnp.float32)  # correlation 0.95
    out, low = jax.jit(_corr_floor)(Sig)
    assert not bool(low) and np.array_equal(np.asarray(out), np.asarray(Sig))
    # NaN statistics stay NaN (reported by the fit as a non-finite M-step, never hidden)
    out, low = _corr_floor(jnp.full((2, 2), jnp.nan, jnp.float32))
    assert bool(low) and not np.all(np.isfinite(np.asarray(out)))


def test_structure_probes_skip_points_where_the_model_is_not_finite():
    """The closed-form M-step's structure probes perturb theta at random; a model that is
    not finite at a perturbed probe (here: no steady state once ``k`` is tiny, as in a PK
    model whose covariate coefficient moved by 0.3 on a covariate spanning +-50) made every
    param seem to enter the likelihood (NaN derivatives), so the model got SA-Newton on
    some keys and the closed form on others: Quinidine with time-varying covariates fitted
    with the Newton M-step on seed 0 and ended at a worse maximum. Now such a probe is
    redrawn, every key recognises the model, and the fit's probes do not depend on its key
    (default key)."""

    def nan_far(x, y):
        mu = numpyro.param("mu", 0.0)
        beta = numpyro.param("beta", 0.0)
        omega = numpyro.param("omega", 1.0, constraint=constraints.positive)
        sigma = numpyro.param("sigma", 1.0, constraint=constraints.positive)
        with numpyro.plate("subject", x.shape[0]):
            phi = numpyro.sample("phi", dist.Normal(mu, omega))
            # |beta| > 0.28 (a third of the default probes): u = k * 1e-7 below 5e-20, the
            # derivative -1/u^2 of the steady state 1 / (1 - e^{-k II}) overflows float32
            k = jnp.exp(phi[:, None] + beta * x[:, None] - 100.0 * jnp.abs(beta))
            ss = 1.0 / -jnp.expm1(-k * 1e-7)
            loc = jnp.broadcast_to(jnp.log(ss) - 16.0, y.shape)
            numpyro.sample("y", dist.Normal(loc, sigma).to_event(1), obs=y)

    x = np.linspace(-1.0, 1.0, 12).astype(np.float32)
    y = np.zeros((12, 3), np.float32)
    info = ModelInfo(nan_far, (x, y), {}, random.key(0))
    outcomes = []
    for s in [None, *range(8)]:
        spec, reason = detect_gaussian(info, (x, y), {}, None if s is None else random.key(s))
        outcomes.append((s, spec is not None and "phi" in spec.diag_sites, reason))
    assert all(ok for _, ok, _ in outcomes), outcomes
