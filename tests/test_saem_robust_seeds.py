"""SAEM's defaults judged over seeds, not on one (issue 28: boundary fits and variances that
collapse on the way).

The fault class: the SA-Newton step of the M-step (the interweaving cycle of the Gaussian
M-step, the Newton coordinates, ``mstep="newton"``) is a Newton step on the complete-data
log-likelihood of the current draws while :math:`\\gamma = 1`, with a Hessian taken at one
chain. Where that Hessian has a small or wrong-signed eigenvalue the step is huge; it was
clipped coordinate by coordinate to ``max_step * max(1, |theta_j|)``, which (i) let a
coordinate land exactly on 0 (``mu_V = log V`` from 3.05 to 0.000: V from 21 to 1) or move a
log standard deviation by its own magnitude (-4 -> -8 -> -16: a variance collapsing at an
accelerating rate), and (ii) changed the direction of the step, which could then point
downhill. On a clean 6-subject Theophylline table fitted with ``PKModel`` defaults the fit
jumped from iteration 9 on and diverged at iteration 30 (seed 1 and 2; seed 0 ended with
``omega_KA`` collapsed to 0.004 against its MLE 0.131, -2LL 0.20 above the maximum).

Now the step is scaled as a whole (direction kept) to per-coordinate bounds that are
``max_step`` on a log scale and never reach 0 from afar, and while :math:`\\gamma = 1` it is
backtracked until the objective increases (``numpyro_fed.saem.mstep``).

Each sweep is checked against the exact maximum: closed forms (normal-normal, linear mixed
models through ``tests/saem_cases.py``) and adaptive Gauss--Hermite quadrature over the three
random effects of each PK subject (``numpyro_fed.examples.pk.theophylline_exact_fit``).
"""

import sys
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
import pytest
from jax import random
from numpyro.distributions import constraints

from numpyro_fed import DivergenceError
from numpyro_fed.saem import SAEM, Schedule
from numpyro_fed.saem.mstep import NewtonState, _newton_step

sys.path.insert(0, str(Path(__file__).resolve().parent))
import saem_cases as sc  # noqa: E402
from test_misuse_saem import normal_normal  # noqa: E402

pytestmark = pytest.mark.xdist_group("saem_robust_seeds")


# ------------------------------------------------------------------------------ the step
def _raw_step_state(g, curv):
    """A surrogate whose Newton step is ``g / curv`` (diagonal Hessian -curv)."""
    d = len(g)
    z = jnp.zeros(d, jnp.float32)
    return NewtonState(z, jnp.zeros((d, d), jnp.float32), jnp.zeros((d, d), jnp.float32)), \
        jnp.asarray(g, jnp.float32), -jnp.diag(jnp.asarray(curv, jnp.float32))


@pytest.mark.parametrize("theta0", [3.05, -7.5, 40.0])
def test_newton_step_neither_lands_on_zero_nor_turns(theta0):
    """A real coordinate far from 0 (``mu_V = log V = 3.05`` in the Theophylline fit) whose
    Newton step points past 0 (a tiny eigenvalue of a one-chain Hessian: step -10 x its
    magnitude) keeps at least e^-max_step of its magnitude and its sign, and the step keeps
    the Newton direction (the other coordinate is scaled by the same factor). Before, the
    per-coordinate clip put it exactly on 0 and left the other coordinate's move whole."""
    st, sc_, he = _raw_step_state([-10.0 * theta0 * 0.3, 0.4 * 100.0], [0.3, 100.0])
    theta = jnp.asarray([theta0, 0.5], jnp.float32)
    raw = np.array([-10.0 * theta0, 0.4])
    step, _ = _newton_step(st, jnp.float32(1.0), sc_, he, 1.0, 1.0, 1e-4, theta)
    new = np.asarray(theta + step)
    assert np.sign(new[0]) == np.sign(theta0) and abs(new[0]) >= np.exp(-1.0) * abs(theta0) * 0.999
    # the same direction as the Newton step (a positive multiple of it)
    ratio = np.asarray(step) / raw
    assert ratio[0] > 0 and ratio[0] == pytest.approx(ratio[1], rel=1e-5)


def test_newton_step_on_a_log_scale_is_bounded_absolutely():
    """On a log-scale coordinate (log omega = -4: a variance already small) a step that
    points down moves it by at most max_step (a factor e), not by its own magnitude (4, then
    8, ...: the accelerating collapse of a variance)."""
    st, sc_, he = _raw_step_state([-50.0 * 0.3], [0.3])
    theta = jnp.asarray([-4.0], jnp.float32)
    step, _ = _newton_step(st, jnp.float32(1.0), sc_, he, 1.0, 1.0, 1e-4, theta,
                           log_scale=np.array([True]))
    assert float(step[0]) == pytest.approx(-1.0, rel=1e-6)


# ------------------------------------------------------------------------------ PK, 6 subjects
def _theoph6():
    from numpyro_fed import nlme

    frame = nlme.load_theophylline().to_dataframe()
    frame = frame[frame.ID.isin(sorted(frame.ID.unique())[:6])].copy()
    data = nlme.PKDataset.from_dataframe(frame, covariates=["WT"])
    pk = nlme.PKModel(nlme.one_compartment(absorption="first_order"),
                      params={"KA": 1.0, "V": 20.0, "CL": 0.5})
    return pk, data


@pytest.fixture(scope="module")
def theoph6_exact():
    """The exact ML fit of subjects 1-6 (quadrature, 12^3 nodes per subject; float64)."""
    from numpyro_fed.examples.pk import (
        load_theophylline,
        theophylline_exact_fit,
        theophylline_subjects,
    )

    d = theophylline_subjects(load_theophylline(np.float64), np.arange(6))
    with jax.enable_x64(True):
        return d, theophylline_exact_fit(d, error="additive", num_nodes=12)


def _theoph6_gap(params, d, exact):
    from numpyro_fed.examples.pk import theophylline_exact_loglik

    p = {k: float(v) for k, v in params.items()}
    th = {"mu_ka": p["mu_KA"], "mu_V": p["mu_V"], "mu_CL": p["mu_CL"],
          "omega_ka": p["omega_KA"], "omega_V": p["omega_V"], "omega_CL": p["omega_CL"],
          "sigma": p["a"]}
    with jax.enable_x64(True):
        m2 = -2.0 * float(theophylline_exact_loglik(
            {k: np.float64(v) for k, v in th.items()}, d, num_nodes=12))
    return m2 - exact["m2ll"]


def test_theoph6_pkmodel_exploration_does_not_jump():
    """Seed 1 of the 6-subject table diverged at iteration 30 (E-step non-finite, theta =
    {a: 6.1, mu_*: 0.000, omega_*: 17-33}); the exploration jumped from iteration 9 on.
    With 60 exploration iterations (the fault is in the first 30) the fit now finishes with
    every fixed effect within 0.15 and every omega within a factor 2 of the exact MLE (its
    SEs: mu ~0.05-0.12 on 6 subjects; the exploration phase is not averaged yet; omega_KA
    may instead fall to its boundary, named), and no
    location moved by more than 0.5 between two iterations (an MLE-to-start distance of
    ~1 is covered in a few steps; the fault moved mu_V by 3.05 in one)."""
    pk, data = _theoph6()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fit = pk.fit(data, random.key(1), schedule=Schedule(num_iters=80, num_exploration=60))
    res = fit.result
    tr = res.trajectory
    mus = [c for c in tr.columns if c.startswith("mu_")]
    assert float(np.abs(np.diff(tr[mus].to_numpy(), axis=0)).max()) < 0.5
    ex = {"mu_KA": 0.4743, "mu_V": 3.4759, "mu_CL": 0.9732, "omega_KA": 0.1312,
          "omega_V": 0.1469, "omega_CL": 0.2575, "a": 0.9001}  # theophylline_exact_fit
    p = {k: float(v) for k, v in res.params.items()}
    for k in ("mu_KA", "mu_V", "mu_CL"):
        assert abs(p[k] - ex[k]) < 0.15, (k, p[k])
    for k in ("omega_V", "omega_CL", "a"):
        assert 0.5 < p[k] / ex[k] < 2.0, (k, p[k])
    # omega_KA (MLE 0.131 on 6 subjects, -2LL only 0.2 higher at 0) lands near its MLE or,
    # in this 80-iteration run, falls towards 0 (on one CPU it ended at 0.0014, the known
    # limit of test_theoph6_pkmodel_defaults_over_seeds, which checks the default fit names
    # it); it must not run off upwards as in the fault
    assert p["omega_KA"] < 2.0 * ex["omega_KA"], p["omega_KA"]


@pytest.mark.slow  # 5 PK fits with the defaults: ~3-5 min on 2 shared cores
def test_theoph6_pkmodel_defaults_over_seeds(theoph6_exact):
    """The default fit on seeds 0-4 finishes (before: seeds 1, 2 and 4 diverged at
    iterations 30, 18 and 109) and either reaches the exact maximum (-2LL within 0.1 of it;
    measured: seeds 0-2 within 0.005, seed 4 at 0.095) or says that it did not: omega_KA
    (MLE 0.131 on 6 subjects, -2LL only 0.2 higher at omega_KA = 0) can still fall to the
    boundary during exploration (seed 3, as before the fix: -2LL +0.20), and then a
    ConvergenceWarning names it. Known limit: see the report of issue 28."""
    from numpyro_fed import ConvergenceWarning

    pk, data = _theoph6()
    d, exact = theoph6_exact
    within = 0
    for seed in range(5):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            fit = pk.fit(data, random.key(seed))
        conv = [str(w.message) for w in caught if issubclass(w.category, ConvergenceWarning)]
        gap = _theoph6_gap(fit.result.params, d, exact)
        assert gap > -1e-3, (seed, gap)
        if gap < 0.1:
            within += 1
        else:
            assert any("'omega_KA'" in m for m in conv), (seed, gap, conv)
    assert within >= 4, within


# ------------------------------------------------------------------------------ sweeps
def _nn_m2ll(y, mu, omega):
    v = 1.0 + np.float64(omega) ** 2
    y = np.asarray(y, np.float64)
    return float(np.sum(np.log(2 * np.pi * v) + (y - mu) ** 2 / v))


@pytest.mark.slow  # 6 small fits, ~1 min
def test_normal_normal_over_seeds():
    """30 subjects, y ~ N(0, 1) (the between-subject variance's MLE is 0 on most seeds):
    seeds 0-4 and 7 finish (seed 0 crashed at iteration 282 once) and reach the exact
    maximum, -2LL within 0.05 (measured <= 0.013); a fit whose MLE is 0 ends either
    reported singular or within that gap."""
    for seed in (0, 1, 2, 3, 4, 7):
        y = np.random.default_rng(seed).normal(0, 1, 30).astype(np.float32)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            res = SAEM(normal_normal).run(random.key(seed), y=y)
        y64 = y.astype(np.float64)
        om = np.sqrt(max(y64.var() - 1.0, 0.0))
        gap = (_nn_m2ll(y, float(res.params["mu"]), float(res.params["omega"]))
               - _nn_m2ll(y, y64.mean(), om))
        assert -1e-6 <= gap < 0.05, (seed, gap)


def sleepstudy_mu_model(days, subj, reaction=None, n_subjects=18):
    """(Days || Subject) with the means inside the latent: b_i ~ N(mu, diag omega^2)."""
    mu = numpyro.param("mu", jnp.zeros(2))
    omega = numpyro.param("omega", jnp.array([10.0, 10.0]), constraint=constraints.positive)
    sigma = numpyro.param("sigma", 10.0, constraint=constraints.positive)
    with numpyro.plate("subject", n_subjects):
        b = numpyro.sample("b", dist.Normal(mu, omega).to_event(1))
    with numpyro.plate("obs", days.shape[0]):
        numpyro.sample("reaction", dist.Normal(b[subj, 0] + b[subj, 1] * days, sigma),
                       obs=reaction)


@pytest.mark.slow  # 5 fits, ~2 min
def test_sleepstudy_intercept_and_slope_over_seeds():
    """Responses around 250, mu starting at 0, omega at 10 (the intercept's MLE is 24): on
    seeds 0-4 no variance collapses during exploration (omega_intercept never below 5) and
    every fit is within 0.05 of the exact -2LL maximum (lme4's (Days || Subject), the
    closed-form Gaussian marginal; measured 0.001-0.008) and meets every target."""
    days, subj, y = sc._sleepstudy_data()
    case = sc.get_case("sleepstudy_lme4style")
    for seed in range(5):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            res = SAEM(sleepstudy_mu_model).run(random.key(seed), days=days, subj=subj,
                                                reaction=y)
        assert float(res.trajectory["omega[0]"].min()) > 5.0, seed
        p = res.params
        out = sc.compare(case, {"beta0": p["mu"][0], "beta1": p["mu"][1], "tau": p["omega"],
                                "sigma": p["sigma"]})
        assert out["ok"] and out["m2ll_gap"] < 0.05, (seed, sc.format_comparison(out))


@pytest.mark.slow  # 5 small fits, ~1 min
def test_all_zero_response_normal_model_over_seeds():
    """Dyestuff2's model (mu, tau, sigma all free) on a response that is all 0: the
    likelihood grows without bound as sigma, tau -> 0 at mu = 0, its supremum on the
    boundary. Every seed ends reported singular on both variances, mu at 0."""
    case = sc.get_case("dyestuff2")
    data = {**case.data, "y": np.zeros_like(case.data["y"])}
    for seed in range(5):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            res = SAEM(case.model).run(random.key(seed), **data)
        assert set(res.singular_params) == {"sigma", "tau"}, seed
        assert abs(float(res.params["mu"])) < 1e-3


@pytest.mark.slow  # 5 small fits, ~1 min
def test_all_zero_response_with_known_noise_over_seeds():
    """normal-normal with y all 0 (the observation sd known, 1): a bounded likelihood whose
    maximum is mu = 0, omega = 0 on the boundary; every seed reaches it (-2LL within 1e-3)
    and reports omega singular."""
    y = np.zeros(30, np.float32)
    for seed in range(5):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            res = SAEM(normal_normal).run(random.key(seed), y=y)
        gap = _nn_m2ll(y, float(res.params["mu"]), float(res.params["omega"])) - _nn_m2ll(
            y, 0.0, 0.0)
        assert 0 <= gap < 1e-3 and res.singular_params == ["omega"], (seed, gap)


@pytest.mark.slow  # 3 PK fits that stop early, ~1-2 min
def test_all_zero_pk_table_is_a_clear_error_over_seeds():
    """Theophylline with every DV = 0 under the PKModel defaults: V -> infinity fits the
    zeros ever better (no maximum, on the boundary or inside), and so does KA -> 0 (no drug
    absorbed). Every seed raises the DivergenceError that names the parameters that ran off
    (the two furthest: mu_V, or mu_KA and mu_CL -- measured on seed 0 at e39df5e, mu_KA to
    -15.1 and mu_CL to 17.5) and the degenerate data."""
    from numpyro_fed import nlme

    frame = nlme.load_theophylline().to_dataframe()
    frame.loc[frame.EVID == 0, "DV"] = 0.0
    data = nlme.PKDataset.from_dataframe(frame, covariates=["WT"])
    pk = nlme.PKModel(nlme.one_compartment(absorption="first_order"),
                      params={"KA": 1.0, "V": 20.0, "CL": 0.5})
    for seed in range(3):
        with pytest.raises(DivergenceError, match=(
                r"'mu_(V|KA|CL)' ran from -?\d+\.?\d* \(theta_0\) to .* the data do not "
                r"determine "
                r"(it|them) \(a degenerate data set")):
            pk.fit(data, random.key(seed))
