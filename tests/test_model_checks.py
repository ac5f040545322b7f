"""How a FederatedPotential is built from a user's model: what it refuses (with the site,
the argument and the fix named) and what it computes exactly like NumPyro on pooled data."""

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
import pytest
from jax import random
from numpyro.infer import Predictive
from numpyro.infer.util import potential_energy

from numpyro_fed import ClientPartition, FederatedPotential


def gauss_data(n=40, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(1.0, 2.0, size=n).astype(np.float32)
    y = (0.5 * x + rng.normal(size=n)).astype(np.float32)
    return x, y


def iid(data, b=4):
    return ClientPartition.iid(data, b, key=random.PRNGKey(0))


def one_row_clients(data):
    n = len(next(iter(data.values())))
    return ClientPartition.from_clients([{k: v[i:i + 1] for k, v in data.items()}
                                         for i in range(n)])


# ----------------------------------------------------------------- data-dependent priors
def prior_scaled_by_n(x, y=None):
    w = numpyro.sample("w", dist.Normal(0.0, 1.0 / x.shape[0]))
    with numpyro.plate("data", x.shape[0]):
        numpyro.sample("y", dist.Normal(w * x, 1.0), obs=y)


def autoscaled_prior(x, y=None):  # rstanarm / brms style: location and scale from the data
    w = numpyro.sample("w", dist.Normal(jnp.mean(x), 2.5 * jnp.std(x)))
    with numpyro.plate("data", x.shape[0]):
        numpyro.sample("y", dist.Normal(w * x, 1.0), obs=y)


@pytest.mark.parametrize("model", [prior_scaled_by_n, autoscaled_prior])
@pytest.mark.parametrize("layout", ["iid", "one_row_clients"])
def test_data_dependent_prior_is_refused(model, layout):
    """Before: evaluated on one client row, silently wrong (for the autoscaled prior the
    std of one row is 0: the chain diverged with 'reduce step_size')."""
    x, y = gauss_data()
    data = {"x": x, "y": y}
    part = iid(data) if layout == "iid" else one_row_clients(data)
    with pytest.raises(ValueError, match=r"latent site 'w' depends on the data rows.*shared="):
        FederatedPotential(model, part)


def test_prior_from_shared_is_exact(x64):
    """The fix the message suggests: compute the value once, pass it with `shared=`."""
    x, y = gauss_data()

    def model(x, x_mean, x_std, y=None):
        w = numpyro.sample("w", dist.Normal(x_mean, 2.5 * x_std))
        with numpyro.plate("data", x.shape[0]):
            numpyro.sample("y", dist.Normal(w * x, 1.0), obs=y)

    shared = {"x_mean": float(np.mean(x)), "x_std": float(np.std(x))}
    part = ClientPartition.iid({"x": x, "y": y}, 4, key=random.PRNGKey(0), shared=shared)
    pot = FederatedPotential(model, part)
    for t in (-0.3, 0.8):
        theta = jnp.array([t])
        ref = potential_energy(model, (), {"x": x, "y": y, **shared}, {"w": theta[0]})
        np.testing.assert_allclose(float(pot.potential(theta, part)), float(ref), rtol=1e-10)


def test_data_dependent_constraint_is_refused():
    """A support computed from the data changes the log-Jacobian with the rows."""
    x, y = gauss_data()

    def model(x, y=None):
        w = numpyro.sample("w", dist.Uniform(0.0, 1.0 + jnp.max(jnp.abs(x))))
        with numpyro.plate("data", x.shape[0]):
            numpyro.sample("y", dist.Normal(w * x, 1.0), obs=y)

    with pytest.raises(ValueError, match="latent site 'w' depends on the data rows"):
        FederatedPotential(model, iid({"x": x, "y": y}))


# ------------------------------------------------------------ factorisation, 1-row clients
def mean_likelihood(x, y=None):  # one observation of the mean: does not factorise over rows
    w = numpyro.sample("w", dist.Normal(0.0, 1.0))
    numpyro.sample("ybar", dist.Normal(w * jnp.mean(x), 1.0), obs=jnp.mean(y))


@pytest.mark.parametrize("layout", ["iid", "one_row_clients"])
def test_non_factorising_likelihood_is_refused_with_one_row_clients(layout):
    """Before: with every client holding one row the check was skipped (silently wrong)."""
    x, y = gauss_data(n=12)
    data = {"x": x, "y": y}
    part = iid(data) if layout == "iid" else one_row_clients(data)
    with pytest.raises(ValueError, match=r"factorise.*observed site 'ybar'"):
        FederatedPotential(mean_likelihood, part)


def test_one_row_clients_give_numpyro_potential(x64):
    x, y = gauss_data(n=12)

    def model(x, y=None):
        w = numpyro.sample("w", dist.Normal(0.0, 1.0))
        s = numpyro.sample("s", dist.HalfNormal(1.0))
        with numpyro.plate("data", x.shape[0]):
            numpyro.sample("y", dist.Normal(w * x, s), obs=y)

    part = one_row_clients({"x": x, "y": y})
    pot = FederatedPotential(model, part)
    theta = jnp.array([0.2, -0.4])  # (s unconstrained, w): sites in sorted order
    ref = potential_energy(model, (), {"x": x, "y": y}, pot.unravel(theta))
    np.testing.assert_allclose(float(pot.potential(theta, part)), float(ref), rtol=1e-10)


# ------------------------------------------------------------ data-independent factor
def ridge_model(x, y=None, lam=3.0):
    w = numpyro.sample("w", dist.Normal(0.0, 10.0).expand([2]).to_event(1))
    numpyro.factor("ridge", -lam * jnp.sum(w ** 2))  # a penalty: no data in it
    numpyro.sample("anchor", dist.Normal(w[1], 0.5), obs=0.25)  # a pseudo-observation
    with numpyro.plate("data", x.shape[0]):
        numpyro.sample("y", dist.Normal(w[0] * x + w[1], 1.0), obs=y)


@pytest.mark.parametrize("prior", ["split", "server", "size"])
def test_data_independent_factor_is_held_like_the_prior(x64, prior):
    """Before: refused ("does not factorise") -- and without the check it was counted once
    per row. Now it is counted once, in the prior share, and U is NumPyro's potential."""
    x, y = gauss_data()
    part = ClientPartition.power_law({"x": x, "y": y}, 5, key=random.PRNGKey(2))
    pot = FederatedPotential(ridge_model, part, prior=prior)
    assert pot.global_site_names == ("ridge", "anchor")
    assert pot.observed_names == ("y",)

    @jax.jit
    def ours_and_numpyro(theta):
        z = pot.unravel(theta)
        pe = lambda zz: potential_energy(ridge_model, (), {"x": x, "y": y}, zz)  # noqa: E731
        ref, ref_grad = jax.value_and_grad(pe)(z)
        grad = pot.full_grads(theta, part).sum(0) + pot.server_grad(theta)
        return pot.potential(theta, part), grad, ref, pot.ravel(ref_grad)

    for s in range(3):
        theta = random.normal(random.PRNGKey(s), (2,))
        U, grad, ref, ref_grad = ours_and_numpyro(theta)
        np.testing.assert_allclose(float(U), float(ref), rtol=1e-10)
        np.testing.assert_allclose(grad, ref_grad, rtol=1e-10)
    # the pointwise log-likelihood has the rows only
    ll = pot.pointwise_loglik(jnp.zeros(2), part)
    ref_ll = dist.Normal(0.0, 1.0).log_prob(part.data["y"])
    np.testing.assert_allclose(ll, jnp.where(part.mask, ref_ll, 0.0), rtol=1e-6)


def test_data_independent_factor_in_deployment_client(x64):
    """Deployed clients build their potential with check=False from their own rows (one row
    here): the penalty is still held like the prior, as in process."""
    from numpyro_fed.algorithms.oracles import ClientProblem

    x, y = gauss_data(n=3)
    client = ClientProblem(ridge_model, {"x": x[:1], "y": y[:1]}, prior_weight=0.5)
    theta = jnp.array([0.3, -0.2])

    def prior(w):  # everything but the rows: the prior, the penalty, the pseudo-observation
        return (dist.Normal(0.0, 10.0).log_prob(w).sum() - 3.0 * jnp.sum(w ** 2)
                + dist.Normal(w[1], 0.5).log_prob(0.25))

    def lik(w):
        return dist.Normal(w[0] * x[0] + w[1], 1.0).log_prob(y[0])

    expected = -jax.grad(lik)(theta) - 0.5 * jax.grad(prior)(theta)
    np.testing.assert_allclose(client.full_grad(theta), expected, rtol=1e-6)


# ------------------------------------------------------------ control flow on data values
def branch_on_data(x, y=None):
    w = numpyro.sample("w", dist.Normal(0.0, 1.0))
    if x[0] > 0:  # Python control flow on a data value
        w = w + 1.0
    with numpyro.plate("data", x.shape[0]):
        numpyro.sample("y", dist.Normal(w * x, 1.0), obs=y)


def float_of_data(x, y=None):
    w = numpyro.sample("w", dist.Normal(0.0, 1.0))
    c = float(y.sum())
    with numpyro.plate("data", x.shape[0]):
        numpyro.sample("y", dist.Normal(w * x + c, 1.0), obs=y)


@pytest.mark.parametrize("model, arg", [(branch_on_data, "x"), (float_of_data, "y")])
def test_python_control_flow_on_data_is_named(model, arg):
    """Before: a TracerBoolConversionError / ConcretizationTypeError from inside JAX."""
    x, y = gauss_data()
    with pytest.raises(ValueError, match=rf"Python control flow.*\['{arg}'\].*jnp.where"):
        FederatedPotential(model, iid({"x": x, "y": y}))


# ------------------------------------------------------------ discrete latent sites
def test_discrete_latent_site_is_named():
    """Before: NumPyro's ImportError asking to install funsor."""
    x, y = gauss_data()

    def model(x, y=None):
        k = numpyro.sample("k", dist.Bernoulli(0.5))
        with numpyro.plate("data", x.shape[0]):
            numpyro.sample("y", dist.Normal(k * x, 1.0), obs=y)

    with pytest.raises(ValueError, match="'k' is discrete.*continuous latent") as err:
        FederatedPotential(model, iid({"x": x, "y": y}))
    assert "funsor" not in str(err.value) and "Marginalise" in str(err.value)


# ------------------------------------------------------------ observations
def test_misspelt_observed_key_is_named():
    x, y = gauss_data()

    def model(x, y=None):
        w = numpyro.sample("w", dist.Normal(0.0, 1.0))
        with numpyro.plate("data", x.shape[0]):
            numpyro.sample("y", dist.Normal(w * x, 1.0), obs=y)

    with pytest.raises(ValueError, match=r"'Y' is not a keyword parameter.*did you mean 'y'"):
        FederatedPotential(model, iid({"x": x, "Y": y}))


@pytest.mark.parametrize("family", ["normal", "bernoulli"])
def test_missing_observations_are_named(family):
    """The partition has no `y`: the model would sample y as a latent site (a discrete one
    for a Bernoulli likelihood: before, NumPyro's funsor ImportError)."""
    x, y = gauss_data()

    def model(x, y=None):
        w = numpyro.sample("w", dist.Normal(0.0, 1.0))
        with numpyro.plate("data", x.shape[0]):
            d = dist.Normal(w * x, 1.0) if family == "normal" else dist.Bernoulli(logits=w * x)
            numpyro.sample("y", d, obs=y)

    with pytest.raises(ValueError, match=r"parameters are \('x', 'y'\).*data keys \('x',\)"
                                         r".*\['y'\].*under the model's argument name"):
        FederatedPotential(model, iid({"x": x}))


def test_missing_observations_with_a_penalty_are_named():
    x, _ = gauss_data()
    with pytest.raises(ValueError, match=r"'y' has no observations.*data keys \('x',\)"):
        FederatedPotential(ridge_model, iid({"x": x}))


# ------------------------------------------------------------ weights
def test_likelihood_weight_of_wrong_length_is_named():
    """Before: numpy's 'operands could not be broadcast together with remapped shapes'."""
    x, y = gauss_data()
    part = iid({"x": x, "y": y}, b=4)
    with pytest.raises(ValueError, match=r"`likelihood_weight`.*length 3.*4 clients"):
        FederatedPotential(prior_scaled_by_n, part, likelihood_weight=[1.0, 1.0, 1.0])
    with pytest.raises(ValueError, match=r"`prior` weights must be 4 .*one per client"):
        FederatedPotential(prior_scaled_by_n, part, prior=[0.5, 0.5])


# ------------------------------------------------------------ Predictive on new data
def test_predictive_on_the_kernel_model_uses_new_data():
    """Before: the bound pooled `y` stayed observed: Predictive returned the training
    labels whatever X was given."""
    from numpyro_fed import FederatedLangevin

    rng = np.random.default_rng(0)
    X = rng.normal(size=(60, 2)).astype(np.float32)
    y = (X @ np.array([2.0, -1.0]) + 0.1 * rng.normal(size=60)).astype(np.float32)

    def model(X, y=None):
        w = numpyro.sample("w", dist.Normal(0.0, 3.0).expand([2]).to_event(1))
        with numpyro.plate("data", X.shape[0]):
            numpyro.sample("y", dist.Normal(X @ w, 0.1), obs=y)

    kernel = FederatedLangevin(model, iid({"X": X, "y": y}, b=3), step_size=1e-3)
    samples = {"w": jnp.array([[2.0, -1.0], [2.01, -0.99], [1.99, -1.01]])}
    X_new = np.array([[10.0, 0.0], [0.0, 10.0], [1.0, 1.0], [-3.0, 2.0], [0.5, 0.5]],
                     np.float32)
    for call in (lambda p: p(random.PRNGKey(1), X=X_new),
                 lambda p: p(random.PRNGKey(1), X_new)):  # by name and by position
        pred = call(Predictive(kernel.model, samples))["y"]
        assert pred.shape == (3, len(X_new))
        np.testing.assert_allclose(pred.mean(0), X_new @ np.array([2.0, -1.0]), atol=0.3)
    # no data arguments: the pooled data stay bound (ArviZ's replay); y is observed
    pred = Predictive(kernel.model, samples)(random.PRNGKey(1))
    np.testing.assert_array_equal(np.sort(np.asarray(pred["y"][0])), np.sort(y))


# ------------------------------------------------------------ rows back to the user's order
def test_loo_pareto_k_maps_back_to_the_users_row():
    """`iid` shuffles rows across clients; the pointwise log-likelihood and the observed data
    come back in the user's order with the original row index, so the planted outlier's
    Pareto k is found at its own index (before: pooled client order, `y_dim_0` = 0..N-1)."""
    import arviz as az
    from numpyro.infer import MCMC

    from numpyro_fed import FederatedLangevin, to_inference_data

    rng = np.random.default_rng(1)
    y = rng.normal(size=80).astype(np.float32)
    y[17] = 12.0  # the outlier
    x = np.ones(80, np.float32)

    def model(x, y=None):
        mu = numpyro.sample("mu", dist.Normal(0.0, 10.0))
        with numpyro.plate("data", x.shape[0]):
            numpyro.sample("y", dist.Normal(mu * x, 1.0), obs=y)

    part = ClientPartition.iid({"x": x, "y": y}, 5, key=random.PRNGKey(3))
    assert not np.array_equal(part.original_index(), np.arange(80))  # shuffled
    mcmc = MCMC(FederatedLangevin(model, part, step_size=2e-3), num_warmup=200,
                num_samples=400, num_chains=2, chain_method="vectorized", progress_bar=False)
    mcmc.run(random.PRNGKey(0))
    idata = to_inference_data(mcmc)
    ll = idata.log_likelihood["y"]
    assert ll.dims == ("chain", "draw", "y_dim_0")
    np.testing.assert_array_equal(ll["y_dim_0"].values, np.arange(80))
    obs = idata.observed_data["y"]
    assert obs.dims == ("y_dim_0",)
    np.testing.assert_array_equal(obs.values, y)  # the user's order
    # the client coordinate says where each user row went
    client_of = {int(r): i for i in range(5) for r in part.row_index[i] if r >= 0}
    np.testing.assert_array_equal(ll["client"].values.astype(int),
                                  [client_of[r] for r in range(80)])
    loo = az.loo(idata, pointwise=True)
    k = loo.pareto_k
    assert int(k["y_dim_0"].values[int(np.argmax(k.values))]) == 17
    # the pointwise values are those of the user's rows
    mu = np.asarray(mcmc.get_samples(group_by_chain=True)["mu"])
    ref = dist.Normal(mu[..., None], 1.0).log_prob(y).astype(np.float32)
    np.testing.assert_allclose(ll.values, ref, rtol=1e-5, atol=1e-5)
