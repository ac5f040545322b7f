"""Per-row outputs in the user's row order, in every output path (issue 27).

A partition built by ``dirichlet`` / ``iid`` / ``power_law`` / ``by_group`` shuffles or
groups the user's rows into clients. Before, the per-row deterministic sites of
``mcmc.get_samples()`` (and the posterior of ``az.from_numpyro`` / ``to_inference_data``) and
ArviZ's replayed observed data and log-likelihood came back in the clients' order, while the
user's ``X``, ``y`` and ``to_inference_data``'s log-likelihood are in the user's order:
NumPyro's ``log_likelihood(model, mcmc.get_samples(), X, y)`` substituted the misordered
deterministic sites (a wrong WAIC) and a posterior predictive on the training ``X`` did not
line up with ``az.from_numpyro``'s observed data (a wrong LOO-PIT).

Every per-row value here is compared with the same quantity computed directly from the
user's arrays and the draws: exact up to float32 rounding, no Monte Carlo tolerance (the
runs are short; only the order of the rows is tested).

Also: a likelihood that spans the rows (one ``MultivariateNormal`` over all observations)
is refused with a ``ValueError`` naming the observed site (before: JAX's "sub got
incompatible shapes for broadcasting: (2,), (8,)").
"""

from __future__ import annotations

import warnings

import arviz as az
import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
import pytest
from jax import random
from numpyro.infer import MCMC, Predictive, log_likelihood

from numpyro_fed import (
    BELF,
    DELF,
    LSD,
    PELF,
    QLSD,
    ClientPartition,
    FederatedPotential,
    compressors,
    to_inference_data,
)

N, D = 48, 3
CHAINS, WARMUP, DRAWS = 2, 10, 15
# float32 model evaluations in different program layouts: a few ulps
TOL = {"rtol": 1e-5, "atol": 1e-6}


def _data():
    rng = np.random.default_rng(0)
    X = rng.normal(size=(N, D)).astype(np.float32)
    logits = X @ np.array([1.0, -1.0, 0.5])
    y = (rng.random(N) < 1.0 / (1.0 + np.exp(-logits))).astype(np.float32)
    return X, y


X, Y = _data()


def logistic(X, y=None):
    """Logistic regression with a per-row deterministic site inside the data plate."""
    w = numpyro.sample("w", dist.Normal(0.0, 1.0).expand([X.shape[1]]).to_event(1))
    with numpyro.plate("data", X.shape[0]):
        p = numpyro.deterministic("p", jax.nn.sigmoid(X @ w))
        numpyro.sample("y", dist.Bernoulli(probs=p), obs=y)


def _shuffled():
    part = ClientPartition.dirichlet({"X": X, "y": Y}, 4, labels=Y, concentration=0.5,
                                     min_size=6, key=random.key(1))
    assert not np.array_equal(part.original_index(), np.arange(N))  # the rows are shuffled
    return part


PART = _shuffled()
K1 = compressors.top_k(1)
KERNELS = {
    "LSD": lambda m, p: LSD(m, p, variant="#", step_size=1e-3, batch_size=4),
    "QLSD++": lambda m, p: QLSD(m, p, variant="++", step_size=1e-3, batch_size=4, bits=4,
                                refresh_every=5),
    "DELF": lambda m, p: DELF(m, p, step_size=1e-3, uplink=K1),
    "PELF": lambda m, p: PELF(m, p, step_size=1e-3, downlink=K1),
    "BELF": lambda m, p: BELF(m, p, step_size=1e-3, uplink=K1, downlink=K1),
}


def _run(kernel, chains=CHAINS):
    mcmc = MCMC(kernel, num_warmup=WARMUP, num_samples=DRAWS, num_chains=chains,
                chain_method="vectorized", progress_bar=False)
    mcmc.run(random.key(0))
    return mcmc


def _direct_p(w):
    """sigmoid(X w) on the user's X for draws ``w`` (..., D): (..., N)."""
    return np.asarray(jax.nn.sigmoid(np.asarray(w) @ X.T))


def _direct_loglik(w):
    return np.asarray(dist.Bernoulli(probs=_direct_p(w)).log_prob(Y))


_RUNS: dict = {}


def _logistic_run(name):
    if name not in _RUNS:
        _RUNS[name] = _run(KERNELS[name](logistic, PART))
    return _RUNS[name]


# ----------------------------------------------------------------------------- get_samples
@pytest.mark.parametrize("name", list(KERNELS))
def test_get_samples_per_row_site_is_in_the_users_order(name):
    mcmc = _logistic_run(name)
    s = mcmc.get_samples(group_by_chain=True)
    assert s["p"].shape == (CHAINS, DRAWS, N)
    np.testing.assert_allclose(s["p"], _direct_p(s["w"]), **TOL)


# ----------------------------------------------------------------------------- ArviZ
@pytest.mark.parametrize("name", ["QLSD++", "BELF"])
def test_az_from_numpyro_and_to_inference_data_are_in_the_users_order(name):
    mcmc = _logistic_run(name)
    w = np.asarray(mcmc.get_samples(group_by_chain=True)["w"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plain = az.from_numpyro(mcmc)
        ours = to_inference_data(mcmc)
    for idata in (plain, ours):
        np.testing.assert_allclose(idata.posterior["p"].values, _direct_p(w), **TOL)
        np.testing.assert_array_equal(idata.observed_data["y"].values, Y)
        np.testing.assert_allclose(idata.log_likelihood["y"].values, _direct_loglik(w),
                                   rtol=1e-5, atol=1e-5)
    # the row coordinates of to_inference_data: the user's row index and its client
    client_of = {int(r): i for i in range(PART.num_clients) for r in PART.row_index[i]
                 if r >= 0}
    obs = ours.observed_data["y"]
    np.testing.assert_array_equal(obs[obs.dims[0]].values, np.arange(N))
    np.testing.assert_array_equal(obs["client"].values.astype(int),
                                  [client_of[r] for r in range(N)])


def test_waic_from_numpyro_log_likelihood_equals_to_inference_data():
    """NumPyro's recipe ``log_likelihood(model, mcmc.get_samples(), X, y)`` substitutes the
    deterministic ``p`` from the samples (before: in the clients' order, WAIC -174.8 instead
    of -131.2 in the issue's run)."""
    mcmc = _logistic_run("QLSD++")
    samples = mcmc.get_samples()
    ll_np = np.asarray(log_likelihood(logistic, samples, X, Y)["y"])
    ll_ours = to_inference_data(mcmc).log_likelihood["y"].values.reshape(-1, N)
    np.testing.assert_allclose(ll_np, ll_ours, rtol=1e-5, atol=1e-5)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        waic_np = az.waic(az.from_dict(log_likelihood={"y": ll_np[None]})).elpd_waic
        waic_ours = az.waic(to_inference_data(mcmc)).elpd_waic
    np.testing.assert_allclose(waic_np, waic_ours, rtol=1e-5)


def test_loo_pit_of_az_from_numpyro_equals_to_inference_data():
    """The documented posterior predictive on the training X, with az.from_numpyro (before:
    LOO-PIT correlation -0.04 with the right one) and with to_inference_data."""
    mcmc = _logistic_run("QLSD++")
    pp = Predictive(logistic, mcmc.get_samples())(random.key(3), X)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plain = az.from_numpyro(mcmc, posterior_predictive=pp)
        ours = to_inference_data(mcmc, posterior_predictive=pp)
        pit_plain = np.asarray(az.loo_pit(plain, y="y"))
        pit_ours = np.asarray(az.loo_pit(ours, y="y"))
    np.testing.assert_allclose(pit_plain, pit_ours, rtol=1e-5, atol=1e-6)


# ----------------------------------------------------------------------------- Predictive
def test_predictive_on_the_users_x_and_on_the_kernel_model():
    mcmc = _logistic_run("LSD")
    samples = mcmc.get_samples()
    ref = _direct_p(samples["w"])
    # NumPyro's Predictive recomputes deterministic sites by default; with
    # condition_deterministic=True it substitutes them from the samples
    for cond in (False, True):
        out = Predictive(logistic, samples, condition_deterministic=cond)(random.key(3), X)
        np.testing.assert_allclose(out["p"], ref, **TOL)
    # the kernel's model with no data arguments replays the pooled data: the user's order
    kernel = mcmc.sampler
    for cond in (False, True):
        out = Predictive(kernel.model, samples, condition_deterministic=cond)(random.key(3))
        np.testing.assert_allclose(out["p"], ref, **TOL)
        np.testing.assert_array_equal(out["y"][0], Y)  # observed: the user's y, in order


# ----------------------------------------------------------------------------- layouts
def two_plates(X, y=None, c=None):
    """Two data plates over the rows (one nested with a trailing plate), a per-row site
    outside any plate, one whose rows are on the second axis and one as long as the data
    that is not per row."""
    w = numpyro.sample("w", dist.Normal(0.0, 1.0).expand([X.shape[1]]).to_event(1))
    s = numpyro.sample("s", dist.HalfNormal(1.0))
    eta = X @ w
    numpyro.deterministic("fitted", eta)  # (N,), in no plate
    numpyro.deterministic("both", jnp.stack([eta, -eta]))  # (2, N): rows on axis 1
    # N long but not per row (no data in it): must come back as computed, not permuted
    numpyro.deterministic("grid", w[0] * jnp.arange(X.shape[0], dtype=eta.dtype))
    with numpyro.plate("rows_y", X.shape[0]):
        numpyro.sample("y", dist.Normal(eta, s), obs=y)
    with numpyro.plate("rows_c", X.shape[0], dim=-2), numpyro.plate("k", 3, dim=-1):
        q = numpyro.deterministic("q", eta[:, None] * jnp.arange(1.0, 4.0))  # (N, 3)
        numpyro.sample("c", dist.Normal(q, 1.0), obs=c)


def _two_plate_data():
    rng = np.random.default_rng(2)
    y = (X @ np.array([0.5, -1.0, 0.3]) + 0.5 * rng.normal(size=N)).astype(np.float32)
    c = rng.normal(size=(N, 3)).astype(np.float32)
    groups = rng.integers(0, 5, size=N)
    return {"X": X, "y": y, "c": c}, groups


def test_two_data_plates_and_trailing_dims_are_in_the_users_order():
    data, groups = _two_plate_data()
    part = ClientPartition.by_group(data, groups)  # rows grouped: not the user's order
    assert not np.array_equal(part.original_index(), np.arange(N))
    mcmc = _run(QLSD(two_plates, part, variant="#", step_size=1e-3, batch_size=4, bits=4))
    s = mcmc.get_samples(group_by_chain=True)
    eta = np.asarray(s["w"]) @ X.T  # (chain, draw, N)
    np.testing.assert_allclose(s["fitted"], eta, **TOL)
    np.testing.assert_allclose(s["both"], np.stack([eta, -eta], axis=2), **TOL)
    np.testing.assert_allclose(s["q"], eta[..., None] * np.arange(1.0, 4.0), **TOL)
    np.testing.assert_allclose(s["grid"], np.asarray(s["w"])[..., :1] * np.arange(N), **TOL)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        idata = to_inference_data(mcmc)
        plain = az.from_numpyro(mcmc)
    for ds in (idata, plain):
        np.testing.assert_allclose(ds.posterior["q"].values, s["q"], **TOL)
        np.testing.assert_array_equal(ds.observed_data["y"].values, data["y"])
        np.testing.assert_array_equal(ds.observed_data["c"].values, data["c"])
    sd = np.asarray(s["s"])[..., None]
    ref = (dist.Normal(eta, sd).log_prob(data["y"])
           + dist.Normal(eta[..., None] * np.arange(1.0, 4.0), 1.0).log_prob(data["c"]).sum(-1))
    np.testing.assert_allclose(idata.log_likelihood["log_lik"].values, ref, rtol=1e-5,
                               atol=1e-4)
    np.testing.assert_allclose(plain.log_likelihood["y"].values,
                               dist.Normal(eta, sd).log_prob(data["y"]), rtol=1e-5, atol=1e-5)


def test_from_clients_order_is_the_concatenation_order():
    """``from_clients``: the user's order is the clients' rows concatenated in the order
    given (documented); the per-row outputs follow it."""
    cuts = [0, 10, 30, N]
    clients = [{"X": X[a:b], "y": Y[a:b]} for a, b in zip(cuts[:-1], cuts[1:], strict=True)]
    part = ClientPartition.from_clients(clients[::-1])  # the last block first
    concat = np.concatenate([c["X"] for c in clients[::-1]])
    np.testing.assert_array_equal(part.user_order(), np.arange(N))
    np.testing.assert_array_equal(part.pooled(order="user")["X"], concat)
    mcmc = _run(LSD(logistic, part, variant="#", step_size=1e-3, batch_size=4), chains=1)
    s = mcmc.get_samples()
    np.testing.assert_allclose(s["p"], jax.nn.sigmoid(np.asarray(s["w"]) @ concat.T), **TOL)


@pytest.mark.parametrize("build", ["iid", "dirichlet", "power_law", "by_group"])
def test_pooled_in_the_users_order_is_the_input(build):
    idx = np.arange(N)
    data = {"X": X, "idx": idx}
    part = {
        "iid": lambda: ClientPartition.iid(data, 5, key=random.key(0)),
        "dirichlet": lambda: ClientPartition.dirichlet(data, 5, labels=Y, concentration=0.3,
                                                       key=random.key(0)),
        "power_law": lambda: ClientPartition.power_law(data, 5, key=random.key(0)),
        "by_group": lambda: ClientPartition.by_group(data, idx % 7),
    }[build]()
    np.testing.assert_array_equal(part.pooled(order="user")["idx"], idx)
    np.testing.assert_array_equal(part.pooled(order="user")["X"], X)
    np.testing.assert_array_equal(part.pooled()["idx"][part.user_order()], idx)


def test_pooled_order_argument_is_checked():
    with pytest.raises(ValueError, match=r"`order` must be 'clients' or 'user'"):
        PART.pooled(order="original")


# ----------------------------------------------------------------------------- factorisation
M8 = 8


def _mvn_data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=M8).astype(np.float32)
    y = rng.normal(size=M8).astype(np.float32)
    K = (0.5 * np.eye(M8) + 0.5).astype(np.float32)
    return x, y, K


def mvn_shared_mean(y=None, mu=None, K=None):
    """One MultivariateNormal over all observations; mean and covariance in `shared`."""
    s = numpyro.sample("s", dist.HalfNormal(1.0))
    numpyro.sample("y", dist.MultivariateNormal(mu, covariance_matrix=s * K), obs=y)


def mvn_row_mean(x, y=None, K=None):
    """One MultivariateNormal over all observations, mean from the rows."""
    w = numpyro.sample("w", dist.Normal(0.0, 1.0))
    numpyro.sample("y_all", dist.MultivariateNormal(w * x, covariance_matrix=K), obs=y)


def shared_rows_in_code(x, y=None, mu=None):
    """A per-row array passed through `shared`, used in the model's code before its site."""
    w = numpyro.sample("w", dist.Normal(0.0, 1.0))
    loc = w * x + mu
    with numpyro.plate("data", x.shape[0]):
        numpyro.sample("obs", dist.Normal(loc, 1.0), obs=y)


NOT_FACTORISING = [
    # (model, data keys, shared keys, observed site named)
    ("mvn_shared_mean", mvn_shared_mean, ("y",), ("mu", "K"), "y"),
    ("mvn_row_mean", mvn_row_mean, ("x", "y"), ("K",), "y_all"),
    ("shared_rows_in_code", shared_rows_in_code, ("x", "y"), ("mu",), "obs"),
]


@pytest.mark.parametrize("num_clients", [M8, 2], ids=["one_row_per_client", "two_clients"])
@pytest.mark.parametrize("case", NOT_FACTORISING, ids=[c[0] for c in NOT_FACTORISING])
def test_likelihood_spanning_the_rows_is_refused_naming_the_site(case, num_clients):
    _, model, keys, shared_keys, site = case
    x, y, K = _mvn_data()
    values = {"x": x, "y": y, "mu": x, "K": K}
    part = ClientPartition.iid({k: values[k] for k in keys}, num_clients, key=random.key(0),
                               shared={k: values[k] for k in shared_keys})
    msg = (rf"log-likelihood does not factorise over the rows of the partition: observed "
           rf"site '{site}'")
    with pytest.raises(ValueError, match=msg):
        QLSD(model, part, variant="#", step_size=1e-3)
    # deployed clients build their potential with check=False: the same error
    with pytest.raises(ValueError, match=msg):
        FederatedPotential(model, part, check=False)
