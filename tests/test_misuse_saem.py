"""SAEM misuse and untrustworthy fits (issue 27): refused sizes, errors that name the cause,
and fits that say when they are not to be trusted.

- sizes the process cannot hold (``Schedule(num_iters=10**9)``, ``num_draws``) and empty
  data (zero subjects) are refused with a ``ValueError`` naming the argument;
- ``log_likelihood(num_samples=0)`` is refused (it used to draw one batch and report 0);
- a fit that has not converged (too short, still drifting, a variance heading to its
  boundary) warns :class:`~numpyro_fed.ConvergenceWarning` at the end of the fit, and again
  on its standard errors and -2LL, which also carry the verdict (``converged``);
- a well-converged default fit does not warn;
- a variance collapsing to its boundary (its MLE is 0) names the parameter, its last
  finite value, the iteration and what to do, instead of blaming the constraints.
"""

import functools
import tracemalloc
import warnings

import numpy as np
import numpyro
import numpyro.distributions as dist
import pytest
from jax import random
from numpyro.distributions import constraints

from numpyro_fed import ConvergenceWarning, DivergenceError
from numpyro_fed.saem import SAEM, Schedule
from numpyro_fed.saem.result import BOUNDARY_SETTLED_RATIO

pytestmark = pytest.mark.xdist_group("saem_misuse")


def normal_normal(y=None, n=30):
    """z_i ~ N(mu, omega^2), y_i ~ N(z_i, 1): the MLE of omega is sqrt(max(var(y) - 1, 0))."""
    mu = numpyro.param("mu", 0.0)
    omega = numpyro.param("omega", 1.0, constraint=constraints.positive)
    with numpyro.plate("subject", n):
        z = numpyro.sample("z", dist.Normal(mu, omega))
        numpyro.sample("y", dist.Normal(z, 1.0), obs=y)


def expanded(x, y=None):
    """No plate: the subjects are the length of the data (an `.expand` latent)."""
    mu = numpyro.param("mu", 0.0)
    omega = numpyro.param("omega", 1.0, constraint=constraints.positive)
    z = numpyro.sample("z", dist.Normal(mu, omega).expand([x.shape[0]]).to_event(1))
    numpyro.sample("y", dist.Normal(z + x, 1.0).to_event(1), obs=y)


def _y(var: float, seed: int = 0) -> np.ndarray:
    """30 observations whose marginal variance is `var` (omega^2 = var - 1 when > 1)."""
    rng = np.random.default_rng(seed)
    z = 2.0 + np.sqrt(max(var - 1.0, 0.0)) * rng.normal(size=30)
    return (z + rng.normal(size=30)).astype(np.float32)


def _fit(y, *, key=0, init_params=None, **kw):
    """A fit of `normal_normal` and the convergence warnings it raised."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ConvergenceWarning)
        res = SAEM(normal_normal, **kw).run(random.key(key), init_params=init_params, y=y)
    return res, [str(w.message) for w in caught if issubclass(w.category, ConvergenceWarning)]


Y = _y(3.25)


@functools.cache
def good_fit():
    """Default SAEM on the normal-normal model with omega^2 = 2.25 (an interior MLE)."""
    return _fit(Y)


@functools.cache
def short_fit():
    """Six iterations: 3 at gamma = 1, 3 decreasing."""
    return _fit(Y, schedule=Schedule(num_iters=6, num_exploration=3))


# ----------------------------------------------------------------------------- refused sizes
def _no_subjects_plate():
    SAEM(normal_normal).run(random.key(0), y=np.zeros(0, np.float32), n=0)


def _no_subjects_expand():
    SAEM(expanded).run(random.key(0), x=np.zeros(0, np.float32), y=np.zeros(0, np.float32))


@pytest.mark.parametrize("make, exc, text", [
    (lambda: Schedule(num_iters=10**9), ValueError,
     r"Schedule\.num_iters=1000000000: more than 1,000,000 iterations"),
    (lambda: Schedule(num_iters=500, num_burnin=10**9), ValueError, r"Schedule\.num_burnin"),
    (lambda: Schedule(num_iters=10**9 + 200, num_exploration=10**9), ValueError,
     r"Schedule\.num_iters"),
    (lambda: SAEM(normal_normal, num_draws=10**9), ValueError, r"num_draws=1000000000"),
    (_no_subjects_plate, ValueError,
     r"plate of the model has size 0 \(empty data: y of shape \(0,\)\).*at least one subject"),
    (_no_subjects_expand, ValueError,
     r"latent site 'z' has no element \(shape \(0,\)\): zero subjects \(empty data: x of "
     r"shape \(0,\), y of shape \(0,\)\)"),
], ids=["num_iters", "num_burnin", "num_exploration", "num_draws", "zero-subjects-plate",
        "zero-subjects-expand"])
def test_saem_sizes_and_empty_data_are_refused(make, exc, text):
    with pytest.raises(exc, match=text):
        make()


def test_huge_schedule_is_refused_before_allocating():
    """Refused at construction, from the number alone: nothing of the 10**9 rows (8 GB of
    step sizes) is allocated."""
    tracemalloc.start()
    try:
        with pytest.raises(ValueError, match="num_iters"):
            SAEM(normal_normal, schedule=Schedule(num_iters=10**9, num_exploration=300))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 1_000_000, peak


@pytest.mark.parametrize("kwargs, text", [
    ({"num_samples": 0}, r"`num_samples` must be an int >= 1, got 0"),
    ({"num_samples": -5}, r"`num_samples` must be an int >= 1"),
    ({"num_samples": 2.5}, r"`num_samples` must be an int"),
    ({"batch_size": 0}, r"`batch_size` must be an int >= 1"),
    ({"df": 0.0}, r"`df`"),
    ({"method": "gq", "num_nodes": 0}, r"`num_nodes` must be an int >= 1"),
], ids=["num_samples=0", "num_samples<0", "num_samples-float", "batch_size=0", "df=0",
        "num_nodes=0"])
def test_log_likelihood_sizes_are_refused(kwargs, text):
    res, _ = short_fit()
    exc = TypeError if isinstance(kwargs.get("num_samples"), float) else ValueError
    with pytest.raises(exc, match=text), warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)
        res.log_likelihood(random.key(1), **kwargs)


def test_log_likelihood_reports_the_samples_it_draws():
    res, _ = short_fit()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)
        ll = res.log_likelihood(random.key(1), method="is", num_samples=700,
                                batch_size=500, max_samples=700)
    assert ll["num_samples"] == 1000  # two whole batches, one round


# ----------------------------------------------------------------------------- convergence
def test_a_six_iteration_fit_warns_and_its_se_and_m2ll_say_so():
    res, msgs = short_fit()
    assert any("final (decreasing-step) phase has 3 iterations (< 50)" in m for m in msgs)
    assert any("exploration phase has 3 iterations" in m for m in msgs)
    assert not res.converged
    with pytest.warns(ConvergenceWarning, match=r"standard errors of a fit that has not "
                                                r"converged.*3 iterations"):
        se = res.standard_errors()
    assert se.converged is False and se.convergence_messages == res.convergence_messages
    with pytest.warns(ConvergenceWarning, match=r"-2LL.*of a fit that has not converged"):
        ll = res.log_likelihood(random.key(1), num_samples=500)
    assert ll["converged"] is False and ll["convergence_messages"]
    with pytest.warns(ConvergenceWarning):
        table = res.summary()
    assert table.attrs["converged"] is False


def test_a_good_default_fit_does_not_warn():
    """omega^2 = 2.25 with 30 subjects: an interior maximum, reached by the defaults (the
    closed-form Gaussian M-step): no warning at the end, on the SEs or on the -2LL."""
    res, msgs = good_fit()
    assert msgs == [] and res.converged
    y = Y
    # exact MLE: mu = mean(y), omega^2 = var(y) - 1 (one observation of unit noise each)
    assert float(res.params["mu"]) == pytest.approx(y.mean(), abs=0.05)
    assert float(res.params["omega"]) ** 2 == pytest.approx(y.var() - 1.0, rel=0.1)
    with warnings.catch_warnings():
        warnings.simplefilter("error", ConvergenceWarning)
        se = res.standard_errors()
        ll = res.log_likelihood(random.key(1), num_samples=1000)
    assert se.converged and ll["converged"] and np.all(np.isfinite(list(se.values())))


def test_a_drifting_fit_warns():
    """An M-step that can move mu by at most 0.3% of its value per iteration (a slow SA-Newton
    M-step) from mu = 20 towards mean(y) = 2: mu is still falling at the end of the final
    phase -- a drift of ~1 over its last 50 iterations, far above the Monte Carlo error and
    above 1% of the value (the Louis information there is not positive definite)."""
    res, msgs = _fit(Y, mstep="newton", newton_max_step=0.003, init_params={"mu": 20.0},
                     schedule=Schedule(num_iters=150, num_exploration=50))
    drift = [m for m in msgs if "still drift in the final phase" in m]
    assert drift and "mu by -" in drift[0], msgs
    with pytest.warns(ConvergenceWarning, match="still drift in the final phase"), \
            warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The Louis information")
        res.standard_errors()


# ----------------------------------------------------------------------------- boundary
def test_a_variance_collapsing_to_its_boundary_is_named():
    """Normal-normal, 30 subjects, seed 0: var(y) = 0.65 < 1, so the MLE of omega is 0. The
    closed-form M-step drove omega to 0 geometrically until it was not finite (a
    DivergenceError at iteration 274); since issue 28 the M-step holds it at its floor and the
    fit is a boundary (singular) fit that names omega, its value and the fix
    (tests/test_saem_boundary.py checks its maximum)."""
    y = np.random.default_rng(0).normal(0, 1, 30).astype(np.float32)
    with pytest.warns(ConvergenceWarning, match=(
            r"boundary \(singular\) fit: 'omega' fell to [\d.]+e-0\d at iteration \d+ \(down "
            r"from 1 earlier\).*the maximum-likelihood estimate of 'omega' is probably its "
            r"boundary 0.*Remove that random effect")):
        res = SAEM(normal_normal).run(random.key(0), y=y)
    assert res.singular_params == ["omega"]


def test_a_variance_at_its_boundary_warns():
    """The same model on seed 1 (var(y) = 0.68, omega's MLE 0): omega ends near its boundary
    without a crash (at 1e-4 before the interweaving cycle's limit while gamma = 1, at 0.028
    with it: -2LL 0.007 above the maximum, within the settled band of a boundary fit); the
    fit warns that omega is heading to its boundary, and so do its SEs."""
    y = np.random.default_rng(1).normal(0, 1, 30).astype(np.float32)
    with pytest.warns(ConvergenceWarning, match=r"'omega' fell to .* heading to 0, the "
                                                r"boundary of its support"):
        res = SAEM(normal_normal).run(random.key(1), y=y)
    assert float(res.params["omega"]) < BOUNDARY_SETTLED_RATIO
    with pytest.warns(ConvergenceWarning, match="boundary"), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The Louis information")
        res.standard_errors()


# ----------------------------------------------------------------------------- federated
def degenerate(y=None):
    """One latent z ~ N(mu, tau^2) seen through 200 observations y_j ~ N(z, 1): the marginal
    likelihood is that of mean(y) ~ N(mu, tau^2 + 1/200), maximal at mu = mean(y), tau = 0."""
    mu = numpyro.param("mu", 0.0)
    tau = numpyro.param("tau", 1.0, constraint=constraints.positive)
    z = numpyro.sample("z", dist.Normal(mu, tau))
    with numpyro.plate("data", y.shape[0]):
        numpyro.sample("y", dist.Normal(z, 1.0), obs=y)


@pytest.mark.slow  # compiles a federated E-step (~20-50 s on 2 cores)
def test_federated_saem_on_a_degenerate_variance_is_not_silent():
    """Federated Langevin E-step (4 clients, step 1e-3). As tau falls towards its MLE 0, the
    ULA step exceeds 2 tau^2 (the prior's curvature 1/tau^2 makes it unstable) and z runs off
    to ~1e10 -- finite in float32, so no finiteness check sees it -- and the fit returned
    mu = -33.7 (mean(y) = 1.53), tau = 3.7e8 with no warning. It must now either raise naming
    tau or warn that tau is heading to its boundary (and its SEs say so)."""
    from numpyro_fed import ClientPartition, FederatedLangevin

    y = (1.6 + np.random.default_rng(1).normal(size=200)).astype(np.float32)
    clients = ClientPartition.iid({"y": y}, 4, key=random.PRNGKey(0))
    kernel = FederatedLangevin(degenerate, clients, step_size=1e-3, prior="server")
    saem = SAEM(degenerate, kernel=kernel, num_chains=2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ConvergenceWarning)
        try:
            res = saem.run(random.PRNGKey(1), y=y)
        except DivergenceError as err:
            assert "'tau' collapsed to its boundary 0" in str(err), str(err)
            return
    msgs = [str(w.message) for w in caught if issubclass(w.category, ConvergenceWarning)]
    assert any("'tau' fell to" in m and "heading to 0, the boundary" in m for m in msgs), msgs
    assert not res.converged
    with pytest.warns(ConvergenceWarning, match="'tau' fell to"), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The Louis information")
        res.standard_errors()


@pytest.mark.slow  # a PKModel fit (~30-100 s on 2 cores)
def test_parameters_running_off_on_degenerate_pk_data_are_named():
    """Theophylline with every DV = 0 and the PKModel defaults: predictions of 0 fit the
    zeros best, and a volume V -> infinity, a clearance CL -> infinity or an absorption
    KA -> 0 all give them, so the structural parameters run off until the model is not
    finite (which of them depends on the path: mu_V once; mu_CL and mu_KA now, 18
    iterations). The error names the parameters that ran off and the data, instead of only
    "declare each param's constraint" (they are declared) or blaming the M-step."""
    from numpyro_fed import nlme

    frame = nlme.load_theophylline().to_dataframe()
    frame.loc[frame.EVID == 0, "DV"] = 0.0
    data = nlme.PKDataset.from_dataframe(frame, covariates=["WT"])
    pk = nlme.PKModel(nlme.one_compartment(absorption="first_order"),
                      params={"KA": 1.0, "V": 20.0, "CL": 0.5})
    with pytest.raises(DivergenceError, match=(
            r"Before that, '(mu_CL|mu_V|mu_KA)' ran from -?\d+\.?\d* \(theta_0\) to "
            r"-?\d+\.?\d*.* in \d+ iterations?: the data do not determine (it|them) \(a "
            r"degenerate data set")) as err:
        pk.fit(data, random.key(0))
    msg = str(err.value)
    assert "Declare each param's constraint" not in msg
    assert "M-step is not defined" not in msg and "Check it" not in msg
