"""Tests of the SAEM example models (numpyro_fed.examples.glmm, numpyro_fed.examples.pk
helpers), of annealed importance sampling, and smoke runs of the SAEM examples."""

import importlib
import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import random
from scipy.stats import norm, poisson

from numpyro_fed.examples.glmm import (
    ard_logistic,
    ard_preconditioner,
    load_azpro,
    load_medpar,
    poisson_lognormal,
    poisson_lognormal_exact_fit,
    poisson_lognormal_loglik,
)
from numpyro_fed.examples.pk import (
    load_theophylline,
    theophylline_exact_loglik,
    theophylline_model,
    theophylline_random_split,
)
from numpyro_fed.saem import SAEM, Schedule, annealed_importance_sampling

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
sys.path.insert(0, str(EXAMPLES))


def _example(name):
    return importlib.import_module(name)


# ----------------------------------------------------------------------------- AIS
def test_ais_gaussian_closed_form(x64):
    """z ~ N(0, I_3), y | z ~ N(z, 0.5^2 I): log p(y) = sum log N(y_j; 0, 1.25). Over 5 seeds
    the error of the AIS estimate (1000 particles x 1000 temperatures) was -0.012 .. +0.021
    (sd ~0.013; with 200 x 200 it is ~0.07, with no bias); tolerance 0.06 (> 4 sd)."""
    y = jnp.array([0.3, -1.2, 2.0])
    exact = float(jnp.sum(jax.scipy.stats.norm.logpdf(y, 0.0, jnp.sqrt(1.25))))
    est = annealed_importance_sampling(
        random.key(0), lambda z: jnp.sum(jax.scipy.stats.norm.logpdf(z)),
        lambda z: jnp.sum(jax.scipy.stats.norm.logpdf(y, z, 0.5)),
        lambda k: random.normal(k, (3,)), num_particles=1000, num_steps=1000, step_size=0.05)
    assert abs(float(est) - exact) < 0.06


def test_ais_theophylline_matches_quadrature():
    """Per-subject AIS (the example's test LPD) against adaptive Gauss-Hermite quadrature on
    the three test subjects of the example's first 9:3 split (the smoke run of the example
    uses the same AIS settings and reuses the compiled sampler). With 100 particles x 400
    temperatures the estimate of one subject scatters by ~0.1 across seeds (measured);
    tolerance 0.35."""
    ais = _example("_saem_common").make_ais(theophylline_model, num_particles=100,
                                             num_steps=400, step_size=1e-2)
    _, test = theophylline_random_split(load_theophylline(), 9, seed=0)
    th = dict(mu_ka=0.45, mu_V=3.45, mu_CL=0.99, omega_ka=0.64, omega_V=0.13, omega_CL=0.26,
              sigma=0.73)
    est = np.asarray(ais(random.key(0), th, *(test[k] for k in ("dose", "time", "conc"))))
    with jax.enable_x64(True):
        one = jax.jit(lambda t, dd: theophylline_exact_loglik(t, dd, num_nodes=6))
        exact = [float(one(
            {k: jnp.float64(v) for k, v in th.items()},
            {k: test[k][i:i + 1].astype(np.float64) for k in ("dose", "time", "conc")}))
            for i in range(3)]
    np.testing.assert_allclose(est, exact, atol=0.35)


def test_theophylline_split():
    d = load_theophylline()
    tr, te = theophylline_random_split(d, 9, seed=3)
    assert tr["conc"].shape == (9, 10) and te["conc"].shape == (3, 10)
    assert set(tr["subject"]) | set(te["subject"]) == set(d["subject"])
    assert not set(tr["subject"]) & set(te["subject"])
    with pytest.raises(ValueError, match="num_train"):
        theophylline_random_split(d, 12)


# ----------------------------------------------------------------------------- Poisson-LN
def test_poisson_lognormal_quadrature_vs_brute_force():
    """Adaptive Gauss-Hermite (20 nodes) vs trapezoidal integration on a fine grid."""
    rng = np.random.default_rng(0)
    X = rng.normal(size=(30, 2))
    y = rng.poisson(np.exp(1.0 + X @ [0.5, -0.3] + 0.6 * rng.normal(size=30))).astype(float)
    beta0, beta, sigma = 1.0, np.array([0.5, -0.3]), 0.6
    with jax.enable_x64(True):
        quad = np.asarray(poisson_lognormal_loglik(beta0, jnp.asarray(beta), sigma,
                                                   jnp.asarray(X), jnp.asarray(y)))
    g = np.linspace(-8, 12, 100_001)
    mu = beta0 + X @ beta
    brute = [np.log(np.trapezoid(poisson.pmf(y[i], np.exp(g)) * norm.pdf(g, mu[i], sigma), g))
             for i in range(30)]
    np.testing.assert_allclose(quad, brute, atol=1e-7)


def test_count_loaders_and_exact_fit():
    Xtr, Xte, ytr, yte = load_medpar(test_fraction=0.2, seed=0)
    assert Xtr.shape[1] == 5 and len(ytr) + len(yte) == 1495 and ytr.min() >= 1
    Xa, _, ya, _ = load_azpro(test_fraction=0.0)
    assert Xa.shape == (3589, 4)
    ex = poisson_lognormal_exact_fit(Xtr, ytr)
    assert ex["success"] and 0.3 < ex["sigma"] < 1.2
    # the maximum: the exact log-likelihood decreases when any coordinate moves
    with jax.enable_x64(True):
        def ll(b0, b, s):
            return float(jnp.sum(poisson_lognormal_loglik(b0, jnp.asarray(b), s,
                                                          jnp.asarray(Xtr, jnp.float64),
                                                          jnp.asarray(ytr, jnp.float64))))
        best = ll(ex["beta0"], ex["beta"], ex["sigma"])
        assert best == pytest.approx(ex["loglik"], abs=1e-6)
        for db in (-0.02, 0.02):
            assert ll(ex["beta0"] + db, ex["beta"], ex["sigma"]) < best
            assert ll(ex["beta0"], ex["beta"], ex["sigma"] + db) < best


def test_poisson_saem_recognises_gaussian_mstep():
    """The Poisson-lognormal model gets the closed-form Gaussian M-step, and a short SAEM on
    synthetic data lands near the exact maximum (1000 observations: the SAEM Monte Carlo
    error of beta0 is ~0.01; tolerance 0.05 on coefficients, 15% on sigma)."""
    rng = np.random.default_rng(1)
    X = rng.binomial(1, 0.4, (1000, 2)).astype(np.float32)
    y = rng.poisson(np.exp(1.5 + X @ [0.4, -0.3] + 0.5 * rng.normal(size=1000)))
    y = y.astype(np.float32)
    ex = poisson_lognormal_exact_fit(X, y)
    saem = SAEM(poisson_lognormal, kernel="mala", step_size=5e-3, num_chains=2, fisher=False,
                schedule=Schedule(num_iters=250, num_exploration=100, decay=1.0,
                                  num_burnin=50))
    # start at the intercept-only Poisson fit (from beta0 = 0, sigma = 0.1 the latents need
    # far more than 250 iterations to travel to log E[y])
    res = saem.run(random.key(0), X, y, init_params={"beta0": float(np.log(y.mean())),
                                                     "sigma": 0.3})
    assert res.mstep == "gaussian"
    assert abs(float(res.params["beta0"]) - ex["beta0"]) < 0.05
    np.testing.assert_allclose(np.asarray(res.params["beta"]), ex["beta"], atol=0.05)
    assert abs(float(res.params["sigma"]) / ex["sigma"] - 1) < 0.15


# ----------------------------------------------------------------------------- ARD
def test_ard_model_and_preconditioner():
    """ARD logistic regression: Gaussian M-step recognised (tau_j^2 = SA mean of beta_j^2),
    the paper's preconditioner has the right shape and values, and an irrelevant feature
    gets a smaller prior scale than a relevant one."""
    rng = np.random.default_rng(0)
    X = rng.normal(size=(400, 2)).astype(np.float32)
    y = (rng.random(400) < 1 / (1 + np.exp(-(X @ [2.0, 0.0])))).astype(np.int32)
    P = ard_preconditioner()({"tau": jnp.array([1.0, 0.1])})
    np.testing.assert_allclose(np.asarray(P["beta"]), [1 / 1.01, 1 / (1e4 + 0.01)], rtol=1e-5)
    # one chain (the paper's; without a plate the default would be 50). Step 1e-3: at tau_0 ~
    # 2 the preconditioner is P ~ 14 and the curvature of beta_0 ~ 50, so step * P * curvature
    # ~ 0.7 keeps ULA stable (at 0.01 ULA oscillates and tau_0 blows up to ~100).
    saem = SAEM(ard_logistic, kernel="ula", step_size=1e-3, preconditioner=ard_preconditioner(),
                num_chains=1, fisher=False,
                schedule=Schedule(num_iters=200, num_exploration=50, decay=1.0))
    res = saem.run(random.key(0), X, y)
    assert res.mstep == "gaussian"
    tau = np.asarray(res.params["tau"])
    # tau_0 ~ |beta_0| = 2 (1.88 .. 2.01 over seeds), the irrelevant feature's scale shrinks
    # (0.06 .. 0.23 over seeds)
    assert 1.0 < tau[0] < 3.0 and tau[1] < 0.5 and tau[1] < 0.5 * tau[0], tau


# ----------------------------------------------------------------------------- smoke
@pytest.mark.parametrize("name", ["saem_theophylline", "saem_ula_vs_mala", "saem_poisson",
                                  "saem_ard"])
def test_example_smoke(name, tmp_path):
    mod = _example(name)
    tables = mod.main(["--smoke", "--out", str(tmp_path)])
    assert (tmp_path / f"{name}.md").exists() and (tmp_path / f"{name}.csv").exists()
    assert (tmp_path / f"{name}.png").exists()
    assert all(len(t) > 0 for t in tables.values())


# ----------------------------------------------------------------------------- multiple doses
@pytest.mark.parametrize("error,ka_random", [("additive", False), ("proportional", False),
                                              ("combined2", False), ("additive", True)])
def test_nlme_multidose_reference_is_the_model(x64, error, ka_random):
    """The exact reference of examples/nlme_multidose.py (written without numpyro_fed: the
    amounts advanced by hand record by record, steady-state resets), for the example's model
    and the variants of benchmarks/nlme_multidose_variants.py (other residual errors, a
    random effect on KA), has the log joint density of the model fitted, on all 136
    Quinidine patients at random latents (float64: 1e-9 relative)."""
    import jax.numpy as jnp
    from numpyro.infer.util import log_density

    from numpyro_fed import nlme

    ex = _example("nlme_multidose")
    var = ex.Variant(error, ka_random)
    rec = ex.quinidine_records(y32=False)
    data = nlme.load_quinidine(dtype=np.float64)
    where = {v: i for i, v in enumerate(data.ids.tolist())}
    data = data.subjects([where[i] for i in rec.ids])  # the reference's order
    pk = var.model()
    case = ex._case(rec, var)
    th = {"mu_CL": 2.5, "mu_V": 5.4, "mu_KA": -0.3, "omega_CL": 0.33, "omega_V": 0.25,
          "omega_KA": 0.2, "a": 0.74, "b": 0.12}
    th = {k: th[k] for k in var.names}
    b = np.random.default_rng(0).normal(size=(len(rec.ids), var.n_re)) * 0.4
    vals = {**{k: jnp.asarray(v) for k, v in th.items()},
            **{f"phi_{r}": jnp.asarray(th[f"mu_{r}"] + b[:, i])
               for i, r in enumerate(("CL", "V", "KA")[:var.n_re])}}
    lp, _ = log_density(pk.model, (), pk.arrays(data), vals)
    want = float(jnp.sum(case.log_joint({k: jnp.asarray(v) for k, v in th.items()},
                                        jnp.asarray(b))))
    assert abs(float(lp) - want) < 1e-9 * abs(want), (float(lp), want)


def test_nlme_multidose_smoke(tmp_path):
    """examples/nlme_multidose.py --smoke: a short SAEM schedule (80 iterations) on all of
    nlme::Quinidine, scored by the exact -2LL against the stored exact maximum. No estimate
    can beat a maximum (1e-3: the reference optimiser's tolerance); measured +0.0067 (seed
    0); the tolerance 0.5 is that of the SAEM cases (tests/saem_cases.py)."""
    ex = _example("nlme_multidose")
    out = ex.main(["--smoke", "--out", str(tmp_path)])
    assert (tmp_path / "nlme_multidose_smoke.md").exists()
    assert -1e-3 < out["gap"] < 0.5, out["gap"]


@pytest.mark.slow
def test_nlme_multidose_flat_variance_is_within_target_or_warned():
    """Quinidine with a random effect on KA (benchmarks/nlme_multidose_variants.py): the
    exact maximum has omega_KA at 1e-4 with the likelihood nearly flat along it, and the
    default fits end with omega_KA at 0.21-1.10, 0.04-1.52 above the maximum (seeds 0-3;
    0.25-0.87 and 0.02-0.60 with the float32 rounding of the programs before the dose-sample
    pairs were evaluated once). Seed 3 is the one beyond the 0.5 target (+1.518, omega_KA
    1.10; before +0.604, 0.87): such a fit must never be silent -- within the target, or with
    a convergence message (it says omega_KA still drifts). The exact -2LL is the example's
    reference (11^3 Gauss-Hermite nodes per patient, 0.002 of quadrature error)."""
    from numpyro_fed import nlme

    ex = _example("nlme_multidose")
    var = ex.Variant("additive", ka_random=True)
    ref = json.loads((Path(__file__).parent / "data" / "quinidine_variants_exact.json")
                     .read_text())
    fit = var.model().fit(nlme.load_quinidine(), jax.random.key(3))
    gap = ex.ExactLikelihood(variant=var).m2ll(
        {k: float(fit.params[k]) for k in var.names}) - ref["ka_random"]["mle"]["m2ll"]
    assert gap > -1e-3, gap  # nothing beats the maximum (the reference's tolerance)
    msgs = fit.result.convergence_messages
    assert gap <= 0.5 or any("omega_KA" in m for m in msgs), (gap, msgs)
