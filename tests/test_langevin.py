"""ULA, MALA and the federated Langevin kernel inside numpyro.infer.MCMC."""

import arviz as az
import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
import pytest
from jax import random
from mc_stats import batch_means_se
from numpyro.infer import MCMC, NUTS

from numpyro_fed import (
    MALA,
    ULA,
    ClientPartition,
    DivergenceError,
    FederatedLangevin,
    communication_summary,
    compressors,
    to_inference_data,
)
from numpyro_fed.examples import logistic_regression


# ----------------------------------------------------------------------------- helpers
def gauss_model(y, prior_scale=1.0):
    theta = numpyro.sample("theta", dist.Normal(0.0, prior_scale).expand([y.shape[-1]]).to_event(1))
    with numpyro.plate("data", y.shape[0]):
        numpyro.sample("y", dist.Normal(theta, 1.0).to_event(1), obs=y)


def gauss_clients(seed=0, sizes=(10, 25, 40, 60), d=2):
    """Heterogeneous clients: client-specific means and spreads, unequal sizes."""
    rng = np.random.default_rng(seed)
    clients = []
    for k, n in enumerate(sizes):
        mean = rng.normal(0.0, 2.0, d) + k
        spread = 0.5 + k * 0.4
        clients.append({"y": (mean + spread * rng.normal(size=(n, d))).astype(np.float32)})
    return ClientPartition.from_clients(clients)


def gauss_closed_form(part, step, batch_size, prior_scale=1.0):
    """Stationary mean/variance per coordinate of federated ULA on the Gaussian model.

    U(theta) = sum_ij ||theta - y_ij||^2 / 2 + ||theta||^2 / (2 s0^2): grad U = a theta - c,
    a = N + 1/s0^2, c = sum_ij y_ij. The minibatch oracle (with replacement) has the exact
    theta-part N_i theta and noise e = sum_i (N_i/n) sum_k y_{i,j_k} - c, independent of
    theta, Var e = sum_i (N_i^2 / n) Var_i(y) (population variance). The recursion
    theta+ = (1 - step a) theta + step (c - e) + sqrt(2 step) Z is AR(1): mean c/a, variance
    (step Var e + 2) / (a (2 - step a)); full batch: Var e = 0."""
    ys = [np.asarray(part.client(i)["y"], np.float64) for i in range(part.num_clients)]
    n_tot = sum(len(y) for y in ys)
    a = n_tot + 1.0 / prior_scale**2
    c = sum(y.sum(0) for y in ys)
    var_e = 0.0 if batch_size is None else sum(len(y) ** 2 / batch_size * y.var(0) for y in ys)
    return c / a, (step * var_e + 2.0) / (a * (2.0 - step * a))


# ----------------------------------------------------------------------------- closed form
@pytest.mark.parametrize("batch_size", [None, 5])
def test_gaussian_stationary_law_matches_closed_form(batch_size):
    part = gauss_clients()
    step = 0.3 / (part.total_size + 1.0)  # step * a = 0.3: AR(1) coefficient 0.7
    kernel = FederatedLangevin(gauss_model, part, step_size=step, batch_size=batch_size)
    mcmc = MCMC(kernel, num_warmup=500, num_samples=20_000, num_chains=8,
                chain_method="vectorized", progress_bar=False)
    mcmc.run(random.PRNGKey(0))
    theta = np.asarray(mcmc.get_samples(group_by_chain=True)["theta"], np.float64)
    mean_cf, var_cf = gauss_closed_form(part, step, batch_size)
    mean_hat, mean_se = batch_means_se(theta)
    sq_hat, sq_se = batch_means_se((theta - mean_cf) ** 2)
    # 4.5 batch-means SEs per coordinate and statistic (8 checks per test: family-wise
    # false-alarm probability < 8 * 7e-6); the minibatch variance is ~2.3x the full-batch
    # one, far outside these bands, so the test distinguishes the two closed forms.
    assert np.all(np.abs(mean_hat - mean_cf) <= 4.5 * mean_se), (mean_hat, mean_cf, mean_se)
    assert np.all(np.abs(sq_hat - var_cf) <= 4.5 * sq_se), (sq_hat, var_cf, sq_se)
    other = gauss_closed_form(part, step, 5 if batch_size is None else None)[1]
    assert np.all(np.abs(other - var_cf) > 10 * sq_se)


# ----------------------------------------------------------------------------- vs NUTS
def logistic_data(seed=0, n=300):
    rng = np.random.default_rng(seed)
    X = np.concatenate([np.ones((n, 1)), rng.normal(size=(n, 2))], 1).astype(np.float32)
    y = (rng.uniform(size=n) < 1 / (1 + np.exp(-X @ np.array([0.5, 1.5, -1.0])))).astype(np.int32)
    return X, y


def test_logistic_regression_agrees_with_nuts():
    X, y = logistic_data()
    part = ClientPartition.dirichlet({"X": X, "y": y}, 6, labels=y, concentration=0.5,
                                     key=random.PRNGKey(1))
    # L ~ 0.25 * lambda_max(X^T X) ~ 80: step * L = 0.04, so the O(step) discretisation bias
    # of the sd (~ step * L / 4 ~ 1%) is below its Monte Carlo SE (~2-3%) here.
    kernel = FederatedLangevin(logistic_regression, part, step_size=5e-4)
    fed = MCMC(kernel, num_warmup=2000, num_samples=30_000, num_chains=8,
               chain_method="vectorized", progress_bar=False)
    fed.run(random.PRNGKey(0))
    w_fed = np.asarray(fed.get_samples(group_by_chain=True)["w"], np.float64)
    nuts = MCMC(NUTS(logistic_regression), num_warmup=500, num_samples=2000, num_chains=4,
                chain_method="vectorized", progress_bar=False)
    nuts.run(random.PRNGKey(1), X=X, y=y)
    w_nuts = np.asarray(nuts.get_samples(group_by_chain=True)["w"], np.float64)

    m_fed, se_fed = batch_means_se(w_fed)
    m_nuts, se_nuts = batch_means_se(w_nuts, num_batches=20)
    # means: 4 combined batch-means SEs (3 coordinates)
    assert np.all(np.abs(m_fed - m_nuts) <= 4 * np.hypot(se_fed, se_nuts)), (m_fed, m_nuts)
    # sds via batch means of centred squares and the delta method SE(sd) = SE(var) / (2 sd)
    v_fed, vse_fed = batch_means_se((w_fed - m_fed) ** 2)
    v_nuts, vse_nuts = batch_means_se((w_nuts - m_nuts) ** 2, num_batches=20)
    sd_fed, sd_nuts = np.sqrt(v_fed), np.sqrt(v_nuts)
    tol = 4 * np.hypot(vse_fed / (2 * sd_fed), vse_nuts / (2 * sd_nuts))
    assert np.all(np.abs(sd_fed - sd_nuts) <= tol), (sd_fed, sd_nuts, tol)


def test_mala_adapts_and_targets_the_posterior():
    X, y = logistic_data(1, 200)
    mcmc = MCMC(MALA(logistic_regression, step_size=1e-4), num_warmup=1000, num_samples=4000,
                num_chains=2, chain_method="vectorized", progress_bar=False)
    mcmc.run(random.PRNGKey(0), X=X, y=y, extra_fields=("accept_prob",))
    acc = np.asarray(mcmc.get_extra_fields()["accept_prob"]).mean()
    # dual averaging hits the target acceptance 0.574 to within a few percent after warmup
    assert abs(acc - 0.574) < 0.06, acc
    assert np.all(mcmc.last_state.step_size > 1e-3)  # grew from the poor initial 1e-4
    nuts = MCMC(NUTS(logistic_regression), num_warmup=500, num_samples=2000,
                progress_bar=False)
    nuts.run(random.PRNGKey(1), X=X, y=y)
    w_mala = np.asarray(mcmc.get_samples(group_by_chain=True)["w"])
    w_nuts = np.asarray(nuts.get_samples(group_by_chain=True)["w"])
    m1, se1 = batch_means_se(w_mala, 20)
    m2, se2 = batch_means_se(w_nuts, 20)
    assert np.all(np.abs(m1 - m2) <= 4 * np.hypot(se1, se2))


# ----------------------------------------------------------------------------- exactness
def _run(kernel, key, init, n=200, chains=1, **run_kwargs):
    mcmc = MCMC(kernel, num_warmup=0, num_samples=n, num_chains=chains,
                chain_method="vectorized", progress_bar=False)
    mcmc.run(key, init_params=init, **run_kwargs)
    return mcmc


@pytest.mark.parametrize("sizes", [(300,), (40, 100, 160)])
def test_full_batch_identity_equals_ula(x64, sizes):
    X, y = logistic_data(2, sum(sizes))
    cuts = np.cumsum((0,) + sizes)
    part = ClientPartition.from_clients(
        [{"X": X[a:b], "y": y[a:b]} for a, b in zip(cuts[:-1], cuts[1:], strict=True)])
    init = {"w": jnp.array([0.1, -0.2, 0.3])}
    fed = _run(FederatedLangevin(logistic_regression, part, step_size=2e-3), random.PRNGKey(3),
               init)
    ula = _run(ULA(logistic_regression, step_size=2e-3), random.PRNGKey(3), init,
               X=jnp.asarray(X, jnp.float64), y=y)
    a = np.asarray(fed.get_samples()["w"])
    b = np.asarray(ula.get_samples()["w"])
    assert a.dtype == np.float64
    # sum_i grad U_i vs grad U differ only by summation order: ~1e-13 after 200 steps
    np.testing.assert_allclose(a, b, rtol=0, atol=1e-10)


def test_same_key_same_samples_and_bits():
    part = gauss_clients()
    kern = lambda: FederatedLangevin(gauss_model, part, step_size=1e-3, batch_size=4,  # noqa: E731
                                     compressor=compressors.quantize(bits=2))
    runs = []
    for _ in range(2):
        m = MCMC(kern(), num_warmup=50, num_samples=100, num_chains=2,
                 chain_method="vectorized", progress_bar=False)
        m.run(random.PRNGKey(5))
        runs.append((m.get_samples()["theta"], m.get_extra_fields()["bits"]))
    np.testing.assert_array_equal(runs[0][0], runs[1][0])
    np.testing.assert_array_equal(runs[0][1], runs[1][1])
    m.run(random.PRNGKey(6))
    assert not np.array_equal(m.get_samples()["theta"], runs[0][0])


# ----------------------------------------------------------------------------- bits
def test_bits_are_counted_per_step_and_cumulatively_including_warmup():
    part = gauss_clients()
    b, d = part.num_clients, 2
    kernel = FederatedLangevin(gauss_model, part, step_size=1e-3)
    mcmc = MCMC(kernel, num_warmup=30, num_samples=40, thinning=4, progress_bar=False)
    mcmc.run(random.PRNGKey(0))
    bits = np.asarray(mcmc.get_extra_fields()["bits"])  # (draw, (up, down))
    assert bits.shape == (10, 2)  # 40 samples thinned by 4
    assert np.all(bits[:, 0] == b * 32 * d)  # identity: float32 gradients
    assert np.all(bits[:, 1] == b * 32 * d)  # dense broadcast of theta
    comm = communication_summary(mcmc)
    assert comm["up"][0] == 70 * b * 32 * d  # warmup and thinned-out steps counted
    assert comm["down"][0] == 71 * b * 32 * d  # + initial broadcast of theta_0

    q = compressors.quantize(bits=2)
    kq = FederatedLangevin(gauss_model, part, step_size=1e-3, compressor=q)
    mq = MCMC(kq, num_warmup=0, num_samples=50, progress_bar=False)
    mq.run(random.PRNGKey(0))
    up = np.asarray(mq.get_extra_fields()["bits"])[:, 0]
    assert np.all(up < b * 32 * d + b * 64) and np.all(up > b * 32)
    assert communication_summary(mq)["up"][0] == up.sum()
    # the properties collect the directions apart, as the same numbers
    mq.run(random.PRNGKey(0), extra_fields=("bits_up", "bits_down"))
    np.testing.assert_array_equal(np.asarray(mq.get_extra_fields()["bits_up"]), up)
    assert communication_summary(mq)["per_step_up"] == up.mean()


# ----------------------------------------------------------------------------- numpyro UX
def rich_model(X, y=None):
    w = numpyro.sample("w", dist.Normal(0, 1).expand([X.shape[1]]).to_event(1))
    sigma = numpyro.sample("sigma", dist.HalfNormal(1.0))
    numpyro.deterministic("fitted", X @ w)  # data-dependent deterministic site
    numpyro.deterministic("w_norm", jnp.linalg.norm(w))
    with numpyro.plate("data", X.shape[0]):
        numpyro.sample("y", dist.Normal(X @ w, sigma), obs=y)


def test_constrained_sites_deterministic_sites_and_arviz():
    rng = np.random.default_rng(0)
    X = rng.normal(size=(60, 2)).astype(np.float32)
    y = (X @ np.array([1.0, -1.0]) + 0.5 * rng.normal(size=60)).astype(np.float32)
    part = ClientPartition.power_law({"X": X, "y": y}, 5, key=random.PRNGKey(0))
    kernel = FederatedLangevin(rich_model, part, step_size=2e-3, batch_size=3)
    mcmc = MCMC(kernel, num_warmup=200, num_samples=300, num_chains=2,
                chain_method="vectorized", progress_bar=False)
    mcmc.run(random.PRNGKey(1))
    s = mcmc.get_samples()
    assert np.all(s["sigma"] > 0)
    assert s["fitted"].shape == (600, 60) and s["w_norm"].shape == (600,)
    mcmc.print_summary()  # prints latent sites only (as for HMC)

    idata = az.from_numpyro(mcmc)
    assert {"posterior", "sample_stats", "observed_data", "log_likelihood"} <= set(idata.groups())
    assert idata.sample_stats["bits"].shape == (2, 300, 2)  # (up, down)
    np.testing.assert_allclose(idata.observed_data["y"].values, y)  # the user's row order

    full = to_inference_data(mcmc)
    ll = full.log_likelihood["y"]
    assert ll.shape == (2, 300, 60)
    assert set(np.unique(ll.coords["client"].values)) == {str(c) for c in part.client_names}
    az.loo(full)  # pointwise log-likelihood usable for PSIS-LOO
    by_client = to_inference_data(mcmc, log_likelihood="client")
    assert by_client.log_likelihood["y"].shape == (2, 300, 5)
    np.testing.assert_allclose(by_client.log_likelihood["y"].sum("client"), ll.sum("y_dim_0"),
                               rtol=1e-4)
    assert full.sample_stats.attrs["bits_up_total"][0] == 500 * 5 * 3 * 32


def test_clear_errors():
    part = gauss_clients()
    with pytest.raises(ValueError, match="batch_size"):
        FederatedLangevin(gauss_model, part, step_size=1e-3, batch_size=11)
    with pytest.raises(ValueError, match="step_size"):
        FederatedLangevin(gauss_model, part, step_size=-1.0)
    with pytest.raises(ValueError, match="Unknown|unknown|valid"):
        FederatedLangevin(gauss_model, part, step_size=1e-3, compressor="zip")
    mcmc = MCMC(FederatedLangevin(gauss_model, part, step_size=1e-3), num_warmup=0,
                num_samples=2, progress_bar=False)
    with pytest.raises(ValueError, match="ClientPartition"):
        mcmc.run(random.PRNGKey(0), y=np.zeros((3, 2)))


def test_progress_bar_diagnostics_string():
    part = gauss_clients()
    kernel = FederatedLangevin(gauss_model, part, step_size=1e-3,
                               compressor=compressors.quantize(bits=4))
    mcmc = MCMC(kernel, num_warmup=5, num_samples=5, progress_bar=True)
    mcmc.run(random.PRNGKey(0))
    text = kernel.get_diagnostics_str(mcmc.last_state)
    assert "kbit up/step" in text and "step size" in text


def test_ula_without_potential_same_draws_and_divergence_check():
    """ULA's recursion uses only grad U: not tracking U changes no draw (bitwise), leaves NaN
    in `potential_energy`, and a divergence is still reported (through the gradient)."""
    X, y = logistic_data(3, 100)
    out = {}
    for track in (True, False):
        mcmc = MCMC(ULA(logistic_regression, step_size=1e-3, track_potential=track),
                    num_warmup=0, num_samples=50, num_chains=2, chain_method="vectorized",
                    progress_bar=False)
        mcmc.run(random.PRNGKey(0), X=X, y=y, extra_fields=("potential_energy",))
        out[track] = (np.asarray(mcmc.get_samples()["w"]),
                      np.asarray(mcmc.get_extra_fields()["potential_energy"]))
    np.testing.assert_array_equal(out[True][0], out[False][0])
    assert np.all(np.isfinite(out[True][1])) and np.all(np.isnan(out[False][1]))
    mcmc = MCMC(ULA(logistic_regression, step_size=50.0, track_potential=False), num_warmup=0,
                num_samples=200, progress_bar=False)
    with pytest.raises(DivergenceError, match=r"non-finite.*step_size=50"):
        mcmc.run(random.PRNGKey(0), X=X * 100, y=y)


def test_extra_fields_of_hmc_work_or_say_why_not():
    """`extra_fields` that NumPyro users request of HMC: collected where the kernel has them
    (ULA/MALA potential_energy, MALA accept_prob), a clear AttributeError naming the field
    and the reason otherwise."""
    X, y = logistic_data(3, 100)
    mala = MCMC(MALA(logistic_regression, step_size=1e-2), num_warmup=5, num_samples=5,
                progress_bar=False)
    mala.run(random.key(0), X=X, y=y, extra_fields=("potential_energy", "accept_prob"))
    assert np.all(np.isfinite(mala.get_extra_fields()["potential_energy"]))
    with pytest.raises(AttributeError, match="MALAState has no field 'diverging': MALA has no"):
        mala.run(random.key(0), X=X, y=y, extra_fields=("diverging",))
    part = gauss_clients()
    fed = MCMC(FederatedLangevin(gauss_model, part, step_size=1e-3), num_warmup=0,
               num_samples=2, progress_bar=False)
    with pytest.raises(AttributeError, match=r"FedState has no field 'potential_energy': the "
                                             r"kernel was built without `track_potential=True`"
                                             r".*'bits_up'"):
        fed.run(random.key(0), extra_fields=("potential_energy",))
    # with track_potential=True: U(z) of every draw, the same chain, 32 more bits per client
    kern = FederatedLangevin(gauss_model, part, step_size=1e-3, batch_size=3,
                             track_potential=True)
    tracked = MCMC(kern, num_warmup=2, num_samples=4, progress_bar=False)
    tracked.run(random.key(0), extra_fields=("potential_energy", "bits_up"))
    plain = MCMC(FederatedLangevin(gauss_model, part, step_size=1e-3, batch_size=3),
                 num_warmup=2, num_samples=4, progress_bar=False)
    plain.run(random.key(0), extra_fields=("bits_up",))
    z, zp = tracked.get_samples(), plain.get_samples()
    for k in z:
        np.testing.assert_array_equal(np.asarray(z[k]), np.asarray(zp[k]))
    pot = kern.potential
    x = jax.vmap(pot.unconstrain)(z)
    np.testing.assert_allclose(tracked.get_extra_fields()["potential_energy"],
                               jax.vmap(lambda v: pot.potential(v, part))(x), rtol=1e-5)
    np.testing.assert_array_equal(
        np.asarray(tracked.get_extra_fields()["bits_up"]),
        np.asarray(plain.get_extra_fields()["bits_up"]) + 32 * part.num_clients)
    with pytest.raises(TypeError, match="track_potential"):
        FederatedLangevin(gauss_model, part, step_size=1e-3, track_potential="yes")
    with pytest.raises(AttributeError, match="ULA is unadjusted"):
        MCMC(ULA(logistic_regression, step_size=1e-3), num_warmup=0, num_samples=2,
             progress_bar=False).run(random.key(0), X=X, y=y, extra_fields=("accept_prob",))
