"""Tests of MCMC-SAEM (numpyro_fed.saem) and the Theophylline model (numpyro_fed.examples.pk)."""

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
import pytest
from jax import lax, random
from mc_stats import batch_means_se
from numpyro.distributions import constraints
from numpyro.infer import NUTS
from scipy.stats import norm

from numpyro_fed.examples.pk import (
    load_theophylline,
    theophylline_exact_fit,
    theophylline_model,
    theophylline_prediction,
)
from numpyro_fed.kernels.base import DivergenceError
from numpyro_fed.saem import SAEM, Schedule, SufficientStatistics
from numpyro_fed.saem.estep import LangevinEStep
from numpyro_fed.saem.model import ModelInfo, joint_layout, log_joint_per_subject, subject_layout


# ----------------------------------------------------------------------------- toy model
def hier(y=None, n=200):
    """y_i ~ N(z_i, 1), z_i ~ N(mu, tau^2): marginal y_i ~ N(mu, 1 + tau^2), so the MLE is
    mu = mean(y), tau^2 = var(y) - 1 (when positive)."""
    mu = numpyro.param("mu", 0.0)
    tau = numpyro.param("tau", 1.0, constraint=constraints.positive)
    with numpyro.plate("subject", n):
        z = numpyro.sample("z", dist.Normal(mu, tau))
        numpyro.sample("y", dist.Normal(z, 1.0), obs=y)


def _toy_data(n=200, seed=0, tau=0.8):
    rng = np.random.default_rng(seed)
    return (1.5 + np.sqrt(1.0 + tau**2) * rng.standard_normal(n)).astype(np.float32)


def _toy_mle(y):
    return float(np.mean(y)), float(np.sqrt(max(np.var(y) - 1.0, 0.0)))


def test_schedule_and_errors():
    g = Schedule(num_iters=6, num_exploration=2, decay=1.0).gamma_sequence()
    np.testing.assert_allclose(g, [1, 1, 1, 1 / 2, 1 / 3, 1 / 4])
    np.testing.assert_allclose(Schedule.paper(4).gamma_sequence(), 1 / np.sqrt([1, 2, 3, 4]))
    with pytest.raises(ValueError, match="does not decrease"):
        Schedule(num_iters=3, gammas=(0.5, 1.0, 0.2)).gamma_sequence()
    with pytest.raises(ValueError, match="decay"):
        SAEM(hier, schedule=Schedule(decay=0.0))
    with pytest.raises(ValueError, match="kernel"):
        SAEM(hier, kernel="hmc")

    def no_param(y=None):
        z = numpyro.sample("z", dist.Normal(0, 1))
        numpyro.sample("y", dist.Normal(z, 1), obs=y)

    def no_latent(y=None):
        m = numpyro.param("m", 0.0)
        numpyro.sample("y", dist.Normal(m, 1), obs=y)

    with pytest.raises(ValueError, match="no `numpyro.param` site"):
        SAEM(no_param).run(random.key(0), 1.0)
    with pytest.raises(ValueError, match="no latent"):
        SAEM(no_latent).run(random.key(0), 1.0)

    def not_gaussian(y=None):
        r = numpyro.param("r", 1.0, constraint=constraints.positive)
        z = numpyro.sample("z", dist.Gamma(r, 1.0))
        numpyro.sample("y", dist.Poisson(z), obs=y)

    with pytest.raises(ValueError, match="not of the recognised Gaussian family"):
        SAEM(not_gaussian, mstep="gaussian").run(random.key(0), 3.0)
    # a diverging E-step reports theta and the step size (ULA: MALA would reject the moves)
    y = _toy_data()
    with pytest.raises(DivergenceError, match=r"theta=\{mu: .*step_size=50"):
        SAEM(hier, kernel="ula", step_size=50.0,
             schedule=Schedule(num_iters=20, num_exploration=10, num_burnin=0),
             fisher=False).run(random.key(0), y)


@pytest.mark.parametrize("mstep", ["auto", "newton"])
def test_toy_exact_mle(mstep):
    """On the conjugate toy model the MLE is known. MALA targets p(z | y; theta) exactly;
    with 200 subjects x 4 chains and 300 averaging iterations (gamma = 1/k) the Monte Carlo
    standard error of mu is about sd(z|y)/sqrt(200*4*300*ESS fraction) < 0.01, and that of tau
    is of the same order: tolerance 0.03 is > 3 standard errors. (The joint MALA accept step
    in 200 dimensions needs a small step: at 0.3 it rejects almost everything.)"""
    y = _toy_data()
    mu_hat, tau_hat = _toy_mle(y)
    saem = SAEM(hier, kernel="mala", step_size=0.05, num_chains=4, mstep=mstep,
                schedule=Schedule.saemix(100, 300, annealing=False))
    res = saem.run(random.key(1), y)
    assert res.mstep == ("gaussian" if mstep == "auto" else "newton")
    # the subject plate is detected: per-subject MH tests, saemix's 2 prior proposals
    assert res.settings["subjects"] == y.size and res.settings["subject_plate"] == "subject"
    assert res.settings["prior_proposals"] == 2
    assert abs(res.params["mu"] - mu_hat) < 0.03
    assert abs(res.params["tau"] - tau_hat) < 0.03
    # Louis information: se(mu) of the marginal model is sqrt((1 + tau^2) / n)
    se = res.standard_errors()
    assert se["mu"] == pytest.approx(np.sqrt((1 + tau_hat**2) / y.size), rel=0.15)
    # importance-sampling log-likelihood equals the closed-form marginal one
    ll = res.log_likelihood(random.key(2), method="is", num_samples=2000)
    exact = float(np.sum(
        -0.5 * (y - res.params["mu"]) ** 2 / (1 + res.params["tau"] ** 2)
        - 0.5 * np.log(2 * np.pi * (1 + res.params["tau"] ** 2))
    ))
    assert ll["num_subjects"] == y.size
    assert abs(ll["loglik"] - exact) < max(0.05, 4 * ll["m2ll_se"])
    assert res.trajectory.shape[0] == 400 and "tau" in res.trajectory
    idata = res.idata
    assert idata.posterior["z"].shape == (4, saem.num_draws, y.size)
    assert res.conditional_means()["z"].shape == (y.size,)


def test_numpyro_kernel_estep():
    """Any NumPyro kernel works as the E-step (HMC/NUTS via wrap_model; theta passed through
    `_saem_theta` and re-bound with `refresh`).

    Data with tau ~ 1.8 (not 0.6): a NumPyro kernel gets no centring, and with tau ~ 0.6 the
    latents carry 73% of the information on theta, so the SA error decays like k^-0.27 in the
    1/k phase (measured over 8 seeds with 2 chains: sd 0.036 for mu, 0.07 for tau -- the old
    tolerances were 1.5 sd). At tau ~ 1.8 that fraction is 24%; with 4 chains, 8 seeds gave
    |error| <= 0.016 (mu) and <= 0.030 (tau), rms 0.010 and 0.016: tolerances 0.05 and 0.06
    are > 3.5 sd."""
    y = _toy_data(n=50, tau=2.0)
    mu_hat, tau_hat = _toy_mle(y)

    def model(y=None):
        hier(y, n=50)

    saem = SAEM(model, kernel=NUTS(model, step_size=0.5, adapt_step_size=False, max_tree_depth=2),
                num_mcmc_steps=1, num_chains=4, num_draws=20,
                schedule=Schedule.saemix(30, 120, annealing=False, num_burnin=5))
    res = saem.run(random.key(0), y)
    assert res.settings["kernel"] == "NUTS" and res.settings["centring"] is False
    assert abs(res.params["mu"] - mu_hat) < 0.05
    assert abs(res.params["tau"] - tau_hat) < 0.06


# ----------------------------------------------------------------------------- Theophylline
def _theo_stats(z, dose, time, conc):
    phi = z["phi"]
    f = theophylline_prediction(phi, dose, time)
    return {"s1": phi.sum(0), "s2": (phi**2).sum(0), "r": jnp.sum((conc - f) ** 2)}


def _theo_max(s, dose, time, conc):
    n = dose.shape[0]
    mu = s["s1"] / n
    om = jnp.sqrt(s["s2"] / n - mu**2)
    return dict(mu_ka=mu[0], mu_V=mu[1], mu_CL=mu[2], omega_ka=om[0], omega_V=om[1],
                omega_CL=om[2], sigma=jnp.sqrt(s["r"] / conc.size))


def _theo_precond(th):
    return {"phi": jnp.stack([th["omega_ka"], th["omega_V"], th["omega_CL"]]) ** 2}


@pytest.fixture(scope="module")
def theo():
    d = load_theophylline()
    with jax.enable_x64(True):
        exact = theophylline_exact_fit(d, error="additive", num_nodes=6)
    return d, exact


def _rel(est, ref):
    """Fixed effects compared on the natural scale (ka, V, CL); omega as variances."""
    out = {}
    for k in ("ka", "V", "CL"):
        out[f"mu_{k}"] = np.exp(est[f"mu_{k}"] - ref[f"mu_{k}"]) - 1
        out[f"omega_{k}"] = est[f"omega_{k}"] ** 2 / ref[f"omega_{k}"] ** 2 - 1
    out["sigma"] = est["sigma"] / ref["sigma"] - 1
    return out


@pytest.mark.parametrize("slow", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_theophylline_matches_exact_and_msteps_agree(theo, slow):
    """(a) user sufficient statistics, (b) automatic Gaussian, (c) SA-Newton, all against the
    exact maximum (adaptive Gauss-Hermite quadrature). The final 300 iterations average the
    statistics (gamma = 1/k) over 4 chains; across seeds and step sizes the estimates vary by
    < 1% (fixed effects) and < 5% (omega^2), well inside the targets (3%, 20%)."""
    d, exact = theo
    assert exact["success"]
    # the exact -2LL is close to saemix's IS value 345.60 on the same 120 rows
    assert abs(exact["m2ll"] - 345.60) < 1.0
    args = (d["dose"], d["time"], d["conc"])
    ests = {}
    # (SA-Newton alone is checked against an exact MLE in test_toy_exact_mle[newton]; here
    # with the slow tests: a third compile)
    variants = [("b", "auto"), ("a", SufficientStatistics(_theo_stats, _theo_max))]
    if slow:
        variants.append(("c", "newton"))
    for name, ms in variants:
        saem = SAEM(theophylline_model, kernel="mala", step_size=0.03, num_chains=4,
                    preconditioner=_theo_precond, schedule=Schedule.saemix(300, 300),
                    mstep=ms, fisher=name == "b")
        res = saem.run(random.key(0), *args)
        ests[name] = res.estimates()
        rel = _rel(ests[name], exact)
        for k, v in rel.items():
            tol = 0.03 if k.startswith("mu") or k == "sigma" else 0.20
            assert abs(v) < tol, (name, k, v)
        if name == "b":
            assert res.mstep == "gaussian"
            ll = res.log_likelihood(random.key(1), num_samples=10_000)
            assert abs(ll["m2ll"] - exact["m2ll"]) < 1.0
            se = res.standard_errors()
            assert all(np.isfinite(v) and v > 0 for v in se.values())
    # (b) and (c) agree with (a). Each omega^2 estimate carries a Monte Carlo error of about
    # 10% (spread over seeds / step sizes, measured: -17% .. +3% for omega_V^2), so a pairwise
    # difference gets 25% (about 2.5 standard deviations of a difference).
    for name in [v[0] for v in variants if v[0] != "a"]:
        rel = _rel(ests[name], ests["a"])
        for k, v in rel.items():
            tol = 0.03 if k.startswith("mu") or k == "sigma" else 0.25
            assert abs(v) < tol, (name, k, v)


# ----------------------------------------------------------------------------- E-step blocks
def _langevin_estep(model, y, key, *, joint=False, **kw):
    """The built-in E-step that SAEM builds for ``model`` (``SAEM.program.estep``; here
    from its parts, without compiling a whole SAEM program): the model's
    :class:`~numpyro_fed.saem.model.ModelInfo`, its subject layout (or one joint block, as
    with ``mh_blocks='joint'``) and a :class:`~numpyro_fed.saem.estep.LangevinEStep`."""
    args = (y,)
    info = ModelInfo(model, args, {}, key)
    if joint:
        layout = joint_layout(info)
    else:
        layout, reason = subject_layout(info, None, args, {}, random.fold_in(key, 3))
        assert layout is not None, reason
    return info, layout, LangevinEStep(info, layout, **kw)


def _estep_draws(info, estep, y, key, num_draws, num_chains=4, steps_per_draw=1):
    """Draws of the E-step at the fixed initial theta (mu = 0, tau = 1), started from the
    prior; returns ``(theta0, zs (draws, chains, d_z), acceptance per draw)``."""
    data = ((y,), {})
    theta0 = info.theta0_u_flat
    th_c = info.constrain_theta(theta0)
    z0 = jax.vmap(lambda k: info.prior_draw(k, th_c, (y,), {}))(
        random.split(random.fold_in(key, 1), num_chains))
    es0 = estep.init(random.fold_in(key, 3), z0, theta0, data)

    @jax.jit
    def run(es, key):
        def body(es, k):
            es, acc, _ = estep.step(k, es, theta0, data, steps_per_draw, False)
            return es, (es.z, acc)

        return lax.scan(body, es, random.split(key, num_draws))[1]

    zs, acc = run(es0, random.fold_in(key, 2))
    return theta0, np.asarray(zs), np.asarray(acc)


@pytest.mark.parametrize("how", ["subject-mala", "prior-proposals"])
def test_estep_blocks_target_the_conditional(how, x64):
    """Per-subject MALA accept/reject and per-subject independence proposals from the prior
    both leave p(z | y; theta) invariant: z_i | y_i ~ N(y_i / 2, 1 / 2) at mu = 0, tau = 1.
    Step 0.5 (fixed): the joint MALA test in 40 dimensions accepts rarely, the per-subject one
    often. 'subject-mala' has no prior proposals (the Langevin moves alone); 'prior-proposals'
    freezes the Langevin moves (step 1e-8) so the chain is driven by the independence
    proposals alone. Tolerance: 5 batch-means standard errors of each subject's mean and
    second moment (and the pooled 5-SE bound on the mean acceptance)."""
    n = 40
    y = _toy_data(n, seed=3).astype(np.float64)

    def model(y=None):
        hier(y, n=n)

    key = random.key(0)
    if how == "subject-mala":
        info, layout, estep = _langevin_estep(model, y, key, step_size=0.5)
        _, _, joint = _langevin_estep(model, y, key, joint=True, step_size=0.5)
        acc_joint = _estep_draws(info, joint, y, key, 200)[2].mean()
    else:
        info, layout, estep = _langevin_estep(model, y, key, step_size=1e-8, prior_proposals=1)
    assert layout.plate == "subject" and layout.n == n and layout.q == 1
    theta0, zs, acc = _estep_draws(info, estep, y, key, 4000)
    zs = zs.transpose(1, 0, 2)[:, 400:]  # (chains, draws, subjects)
    m, se_m = batch_means_se(zs)
    m2, se_m2 = batch_means_se(zs**2)
    assert np.all(np.abs(m - y / 2) < 5 * se_m + 1e-3)
    assert np.all(np.abs(m2 - (0.5 + y**2 / 4)) < 5 * se_m2 + 1e-3)
    if how == "subject-mala":
        assert acc.mean() > 0.6 and acc_joint < 0.1, (acc.mean(), acc_joint)
        # per-subject log joint: sums (with the latent-free rest) to the model's log joint
        # (float64), and its observed-only part is log N(y_i; z_i, 1) subject by subject
        th_c = info.constrain_theta(theta0)
        zf = jnp.asarray(zs[0, -1])
        per, rest = log_joint_per_subject(info, layout, th_c, zf, (y,), {})
        assert per.shape == (n,) and rest.shape == ()
        assert float(jnp.sum(per) + rest) == pytest.approx(
            float(info.log_joint(theta0, zf, (y,), {})), rel=1e-12)
        obs, _ = log_joint_per_subject(info, layout, th_c, zf, (y,), {}, observed_only=True)
        np.testing.assert_allclose(np.asarray(obs), norm.logpdf(y, np.asarray(zf), 1.0),
                                   rtol=1e-12)
        np.testing.assert_allclose(np.asarray(per - obs), norm.logpdf(np.asarray(zf), 0, 1),
                                   rtol=1e-12)


def test_block_options_errors():
    with pytest.raises(ValueError, match="mh_blocks"):
        SAEM(hier, kernel="mala", mh_blocks="subjects")
    with pytest.raises(ValueError, match="prior_proposals"):
        SAEM(hier, prior_proposals=-1)
    with pytest.raises(ValueError, match="prior_proposals"):
        SAEM(hier, kernel=NUTS(hier), prior_proposals=2)

    def no_plate(y=None):
        m = numpyro.param("m", 0.0)
        z = numpyro.sample("z", dist.Normal(m, 1.0).expand([3]).to_event(1))
        numpyro.sample("y", dist.Normal(z.sum(), 1.0), obs=y)

    with pytest.raises(ValueError, match="mh_blocks='joint'"):
        SAEM(no_plate, kernel="mala", mh_blocks="subject").run(random.key(0), 1.0)


# ----------------------------------------------------------------------------- centring
def test_centring_design_finds_the_location_shifts_only():
    """centring_design maps a fixed effect to the random effects it shifts, and nothing else:
    lme4-style sleepstudy (zero-mean intercept/slope REs, beta in the mean) gets beta0 -> b0
    and beta1 -> b1 for every subject; Dyestuff mu -> b; the centred sleepstudy model (REs
    with mean beta) gets no shift at all. A scale (sigma, tau, the Cholesky factor) never
    gets one: a residual test judged against |G||m| once gave log sigma a spurious shift of
    ~500 per unit, and Louis standard errors of NaN. The design is exact (0/1 here), so the
    tolerance is float32 rounding of a least-squares solve (measured up to 2e-4)."""
    import saem_cases as sc

    from numpyro_fed.saem.model import centring_design, jit_once

    def design(name):
        c = sc.get_case(name)
        key = random.key(0)
        info = ModelInfo(c.model, (), c.data, key)
        lay, reason = subject_layout(info, None, (), c.data, key)
        assert lay is not None, reason
        # compiled as SAEM does (inside its init program), not op by op
        M = jit_once(lambda t, z, data, ids: centring_design(
            info, lay, t, z, (), data, key, ids=ids))(info.theta0_u_flat, info.z0_u_flat,
                                                     c.data, lay.ids)
        return info, lay, np.asarray(M)

    info, lay, M = design("sleepstudy_lme4style")
    off = dict(zip(info.param_names, info.param_offsets_u[:-1], strict=True))
    expect = np.zeros_like(M)
    expect[lay.zidx[:, 0], off["beta0"]] = 1.0
    expect[lay.zidx[:, 1], off["beta1"]] = 1.0
    np.testing.assert_allclose(M, expect, atol=1e-3)
    info, lay, M = design("dyestuff")
    expect = np.zeros_like(M)
    expect[:, info.param_names.index("mu")] = 1.0
    np.testing.assert_allclose(M, expect, atol=1e-3)
    _, _, M = design("sleepstudy")
    assert np.all(M == 0.0), np.abs(M).max(0)


def test_centring_design_of_a_covariate_spanning_a_wide_range():
    """A fixed effect of a subject covariate x in [-50, 50] inside the rate of a steady
    state (``1 / (1 - e^{-6k})``, ``k = e^{a + beta x}``, as a PK covariate coefficient on
    log CL under steady-state dosing): the exact shift is x_i on each subject's ``a``. The
    random design points put beta at up to 0.5, so one point's gradients can exceed the
    others' by 1e10 and, unscaled, set the least-squares fit and the tolerance for all of
    them: shifts of 3e5 to 7e16 on 4 of 8 keys (Quinidine with time-varying covariates: 1.9e8
    on phi_V, the chains at phi_V = 7e4, the fit NaN). With such points scaled down to 100x
    the median, no shift exceeds 1e5 (measured at most 4.7e3; the exact ones are at most 50)
    and most subjects get x_i. Not every subject gets exactly x_i yet (15-36 entries of 80
    off by more than 1%, bounded): the residual test is still judged against the largest
    point."""
    from numpyro_fed.saem.model import centring_design, jit_once

    def model(x, t, y):
        mu_a = numpyro.param("mu_a", -1.0)
        mu_b = numpyro.param("mu_b", 0.0)
        beta = numpyro.param("beta", 0.0)
        om = numpyro.param("omega", jnp.ones(2), constraint=constraints.positive)
        sigma = numpyro.param("sigma", 0.5, constraint=constraints.positive)
        with numpyro.plate("subject", x.shape[0]):
            a = numpyro.sample("a", dist.Normal(mu_a, om[0]))
            b = numpyro.sample("b", dist.Normal(mu_b, om[1]))
            k = jnp.exp(a + beta * x)[:, None]
            f = jnp.exp(-k * t) / -jnp.expm1(-6.0 * k) + 1e-3 * jnp.exp(b)[:, None] * t
            numpyro.sample("y", dist.Normal(f, sigma).to_event(1), obs=y)

    rng = np.random.default_rng(0)
    n = 40
    x = np.linspace(-50.0, 50.0, n).astype(np.float32)
    t = np.tile(np.array([0.5, 1.0, 2.0, 4.0, 6.0], np.float32), (n, 1))
    k0 = np.exp(-1.0)
    y = (np.exp(-k0 * t) / -np.expm1(-6 * k0) + rng.normal(0, 0.5, t.shape)).astype(np.float32)
    data = {"x": x, "t": t, "y": y}

    def design(key):
        info = ModelInfo(model, (), data, key)
        lay, reason = subject_layout(info, None, (), data, key)
        assert lay is not None, reason
        M = jit_once(lambda th, z, d, ids: centring_design(
            info, lay, th, z, (), d, key, ids=ids))(info.theta0_u_flat, info.z0_u_flat,
                                                    data, lay.ids)
        return info, lay, np.asarray(M)

    largest, right = [], []
    for s in range(8):
        info, lay, M = design(random.key(s))
        beta = dict(zip(info.param_names, info.param_offsets_u[:-1], strict=True))["beta"]
        largest.append(float(np.abs(M).max()))
        right.append(int(np.sum(np.abs(M[lay.zidx[:, 0], beta] - x) <= 1e-2 * np.abs(x))))
    assert max(largest) < 1e5, largest
    assert min(right) >= n // 2, right


def test_low_acceptance_warning_is_for_kernels_with_a_test():
    """The 'draws barely move' check reads the E-step's acceptance rate: meaningful for MALA
    (and NumPyro kernels), not for ULA, which takes every move (its recorded rate is the
    Metropolis ratio it skips)."""
    import types

    import pandas as pd

    from numpyro_fed.saem import SAEMResult

    K = 60
    df = pd.DataFrame({"mu": np.linspace(1.0, 1.0, K), "accept_rate": np.full(K, 0.01)})

    def msgs(kernel):
        obj = types.SimpleNamespace(trajectory=df, num_exploration=30, names=["mu"],
                                    settings={"kernel": kernel})
        return SAEMResult.check_convergence(obj, warn=False)

    assert any("barely move" in m for m in msgs("mala"))
    assert not any("barely move" in m for m in msgs("ula"))
    # a parameter still drifting at the end of exploration: the advice is a schedule that
    # keeps an averaging phase (advising num_exploration alone once left none at all)
    import re

    mu = 1.0 + 0.01 * np.random.default_rng(0).normal(size=200) + (np.arange(200) >= 80)
    drift = pd.DataFrame({"mu": mu, "accept_rate": np.full(200, 0.5)})  # moves at 80
    obj = types.SimpleNamespace(trajectory=drift, num_exploration=100, names=["mu"],
                                settings={"kernel": "mala"})
    msg = next(m for m in SAEMResult.check_convergence(obj, warn=False) if "drift" in m)
    ni, ne = map(int, re.search(r"Schedule\(num_iters=(\d+), num_exploration=(\d+)\)",
                                msg).groups())
    assert (ni, ne) == (400, 200)
    Schedule(num_iters=ni, num_exploration=ne).gamma_sequence()
