"""Per-client potentials equal NumPyro's own potential energy on the pooled data."""

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
import pytest
from jax import random
from numpyro.infer.util import potential_energy

from numpyro_fed import ClientPartition, FederatedPotential
from numpyro_fed.potential import client_bits


def rich_model(X, g, y=None):
    """Several latent sites: real vector, positive scale, simplex; a deterministic site."""
    w = numpyro.sample("w", dist.Normal(0, 1).expand([X.shape[1]]).to_event(1))
    sigma = numpyro.sample("sigma", dist.LogNormal(0.0, 0.5))
    p = numpyro.sample("p", dist.Dirichlet(jnp.ones(3)))
    numpyro.deterministic("mu", X @ w + p[g])  # data-dependent deterministic site
    with numpyro.plate("data", X.shape[0]):
        numpyro.sample("y", dist.StudentT(4.0, X @ w + 3 * p[g], sigma), obs=y)


def make_partition(seed=0, sizes=(7, 30, 13, 50)):
    rng = np.random.default_rng(seed)
    clients = []
    for k, n in enumerate(sizes):
        X = rng.normal(k * 0.5, 1.0, size=(n, 3))
        g = rng.integers(0, 3, size=n)
        y = X @ np.array([1.0, -2.0, 0.5]) + k + rng.standard_t(4, size=n)
        clients.append({"X": X, "g": g, "y": y})
    return ClientPartition.from_clients(clients)


def random_point(pot, key):
    return random.normal(key, (pot.dim,))


@pytest.mark.parametrize("prior", ["split", "size", "server", "custom"])
def test_sum_of_client_potentials_is_numpyro_potential(x64, prior):
    part = make_partition()
    if prior == "custom":
        prior = np.array([0.1, 0.2, 0.3, 0.4])
    pot = FederatedPotential(rich_model, part, prior=prior)
    pooled = part.pooled()

    @jax.jit
    def ours_and_numpyro(theta, part):
        z = pot.unravel(theta)
        pe = lambda zz: potential_energy(rich_model, (), pooled, zz)  # noqa: E731
        ref, ref_grad = jax.value_and_grad(pe)(z)
        U = pot.potential(theta, part)
        grad = pot.full_grads(theta, part).sum(0) + pot.server_grad(theta)
        return U, grad, ref, pot.ravel(ref_grad), jax.grad(pot.potential)(theta, part)

    for s in range(3):
        theta = random_point(pot, random.PRNGKey(s))
        U, grad, ref, ref_grad, grad_direct = ours_and_numpyro(theta, part)
        assert abs(float(U - ref)) <= 1e-5 * abs(float(ref))
        np.testing.assert_allclose(grad, ref_grad, rtol=1e-5, atol=1e-8)
        # grad of the potential function itself agrees with the oracle sum
        np.testing.assert_allclose(grad_direct, grad, rtol=1e-9)


def test_padded_rows_never_contribute(x64):
    part = make_partition(sizes=(3, 40))
    pot = FederatedPotential(rich_model, part)
    theta = random_point(pot, random.PRNGKey(3))
    f = jax.jit(lambda t, p: (pot.client_potentials(t, p), pot.full_grads(t, p)))
    before = f(theta, part)
    # corrupt the padded rows of client 0: nothing may change
    data = dict(part.data)
    data["y"] = data["y"].at[0, 3:].set(1e6)
    corrupted = ClientPartition(data, part.sizes)
    after = f(theta, corrupted)
    np.testing.assert_array_equal(after[0], before[0])
    np.testing.assert_array_equal(after[1], before[1])


def test_minibatch_oracle_scaling_and_unbiasedness(x64):
    part = make_partition(sizes=(9, 25))
    pot = FederatedPotential(rich_model, part)
    theta = random_point(pot, random.PRNGKey(1))
    full = jax.jit(pot.full_grads)(theta, part)
    # batch = N_i with replacement is still random; average over many draws is unbiased.
    keys = random.split(random.PRNGKey(7), 4000)
    draws = jax.jit(jax.vmap(lambda k: pot.batch_grads(k, theta, part, 4)))(keys)
    mean = draws.mean(0)
    se = draws.std(0) / np.sqrt(len(keys))
    # 5 standard errors per coordinate: false alarm probability < 2 * d * 3e-7
    assert np.all(np.abs(mean - full) <= 5 * se + 1e-9)


def test_gradient_differences_use_the_same_minibatch(x64):
    part = make_partition(sizes=(9, 25))
    pot = FederatedPotential(rich_model, part)
    theta = random_point(pot, random.PRNGKey(1))
    key = random.PRNGKey(11)
    diffs = jax.jit(pot.batch_grad_diffs, static_argnums=4)
    grads = jax.jit(pot.batch_grads, static_argnums=3)
    # at zeta = theta the difference vanishes (same rows; XLA may reorder sums: ~1e-16)
    np.testing.assert_allclose(diffs(key, theta, theta, part, 5), 0.0, atol=1e-12)
    zeta = theta + 0.1
    diff = diffs(key, theta, zeta, part, 5)
    direct = grads(key, theta, part, 5) - grads(key, zeta, part, 5)
    np.testing.assert_allclose(diff, direct, rtol=1e-10, atol=1e-10)


def test_likelihood_weight_tempers_the_likelihood(x64):
    part = make_partition()
    tau = np.array([0.5, 1.0, 2.0, 0.1])
    hot = FederatedPotential(rich_model, part, likelihood_weight=tau, prior="server")
    cold = FederatedPotential(rich_model, part, prior="server")
    theta = random_point(cold, random.PRNGKey(2))
    lik_hot = jax.jit(hot.client_potentials)(theta, part)
    lik_cold = jax.jit(cold.client_potentials)(theta, part)
    np.testing.assert_allclose(lik_hot, tau * lik_cold, rtol=1e-12)


def test_pointwise_loglik_and_constrain(x64):
    part = make_partition()
    pot = FederatedPotential(rich_model, part)
    theta = random_point(pot, random.PRNGKey(4))
    ll, U_clients, log_prior = jax.jit(
        lambda t: (pot.pointwise_loglik(t, part), pot.client_potentials(t, part), pot.log_prior(t))
    )(theta)
    assert ll.shape == (part.num_clients, part.max_size)
    assert np.all(np.asarray(ll)[~np.asarray(part.mask)] == 0)
    # sum_i U_i = -loglik - log prior (prior split across clients)
    np.testing.assert_allclose(float(U_clients.sum()), float(-ll.sum() - log_prior), rtol=1e-10)
    out = jax.jit(pot.constrain)(theta)
    assert out["sigma"] > 0 and np.isclose(float(out["p"].sum()), 1.0)
    assert out["mu"].shape == (part.total_size,)
    back = pot.unconstrain({k: out[k] for k in ("w", "sigma", "p")})
    np.testing.assert_allclose(back, theta, rtol=1e-9, atol=1e-9)


def test_non_factorising_model_is_rejected():
    def bad_model(X, y=None):
        w = numpyro.sample("w", dist.Normal(0, 1))
        numpyro.factor("penalty", -jnp.sum(X) * w)  # sums over rows but outside any plate
        numpyro.sample("obs", dist.Normal(w * X.mean(), 1.0), obs=y.mean())

    rng = np.random.default_rng(0)
    part = ClientPartition.iid({"X": rng.normal(size=40), "y": rng.normal(size=40)}, 2,
                               key=random.PRNGKey(0))
    with pytest.raises(ValueError, match="factorise"):
        FederatedPotential(bad_model, part)


def test_local_latent_is_rejected():
    def local_model(X, y=None):
        mu = numpyro.sample("mu", dist.Normal(0, 1))
        with numpyro.plate("data", X.shape[0]):
            z = numpyro.sample("z", dist.Normal(mu, 1))
            numpyro.sample("y", dist.Normal(z, 1), obs=y)

    rng = np.random.default_rng(0)
    part = ClientPartition.iid({"X": rng.normal(size=20), "y": rng.normal(size=20)}, 2,
                               key=random.PRNGKey(0))
    with pytest.raises(ValueError, match="local to data rows"):
        FederatedPotential(local_model, part)


def test_bad_prior_and_weights():
    part = make_partition()
    with pytest.raises(ValueError, match="prior"):
        FederatedPotential(rich_model, part, prior="everyone")
    with pytest.raises(ValueError, match="prior"):
        FederatedPotential(rich_model, part, prior=[0.5, 0.5])
    with pytest.raises(ValueError, match="likelihood_weight"):
        FederatedPotential(rich_model, part, likelihood_weight=-1.0)
    with pytest.raises(ValueError, match="Z"):
        FederatedPotential(rich_model, ClientPartition.from_clients(
            [{"X": np.ones((3, 3)), "g": np.zeros(3, int), "y": np.ones(3), "Z": np.ones(3)}]))


def _threefry_words_reference(key, i, n):
    """Word j of client i: Threefry-2x32 of the counter pair (i, j), output words XOR-ed,
    computed with the public hash ``jax.extend.random.threefry_2x32`` (which hashes the pairs
    (count[k], count[k + len/2]) and returns the two output halves concatenated)."""
    from jax.extend.random import threefry_2x32

    counts = jnp.concatenate([jnp.full((n,), i, jnp.uint32), jnp.arange(n, dtype=jnp.uint32)])
    out = threefry_2x32(key, counts)
    return out[:n] ^ out[n:]


def test_client_bits_are_per_client_counter_streams():
    """`client_bits(key, i, n)` is client i's own stream: the same words whether drawn alone
    (a deployed client) or with all clients at once (the kernels), equal to the reference
    hash of the counters (i, j), and different across clients; with a non-Threefry key it
    falls back to `fold_in(key, i)`."""
    key = random.PRNGKey(3)
    together = jax.jit(client_bits, static_argnums=2)(key, jnp.arange(5), 64)
    for i in range(5):
        alone = jax.jit(client_bits, static_argnums=2)(key, i, 64)
        np.testing.assert_array_equal(np.asarray(alone), np.asarray(together[i]))
        np.testing.assert_array_equal(np.asarray(alone),
                                      np.asarray(_threefry_words_reference(key, i, 64)))
    assert len({bytes(np.asarray(r)) for r in together}) == 5
    # typed keys (what the Flower protocol carries) give the same words as raw ones
    typed = random.wrap_key_data(key)
    np.testing.assert_array_equal(np.asarray(client_bits(typed, jnp.arange(5), 64)),
                                  np.asarray(together))
    # another PRNG implementation: per-client keys fold_in(key, i) (RBG's bits are not
    # vmap-invariant, so only determinism and distinct clients are checked)
    rbg = random.key(0, impl="rbg")
    rows = np.asarray(client_bits(rbg, jnp.arange(3), 16))
    assert rows.shape == (3, 16) and rows.dtype == np.uint32
    np.testing.assert_array_equal(rows, np.asarray(client_bits(rbg, jnp.arange(3), 16)))
    assert len({bytes(r) for r in rows}) == 3


def test_minibatch_indices_are_uniform_multiply_shift():
    """Indices are floor(u * N_i / 2^32) of 32-bit words u (exact integer arithmetic), so
    every row of every client is drawn with probability 1/N_i (to a relative 2^-16)."""
    sizes = (3, 7, 50)
    clients = [{"y": np.arange(n, dtype=np.float32)} for n in sizes]
    part = ClientPartition.from_clients(clients)

    def model(y):
        mu = numpyro.sample("mu", dist.Normal(0, 1))
        with numpyro.plate("data", y.shape[0]):
            numpyro.sample("y", dist.Normal(mu, 1), obs=y)

    pot = FederatedPotential(model, part)
    key = random.PRNGKey(0)
    rows = jax.jit(pot.sample_batch, static_argnums=2)(key, part, 20_000)["y"]
    for i, n in enumerate(sizes):
        u = np.asarray(_threefry_words_reference(key, i, 20_000), np.uint64)
        np.testing.assert_array_equal(np.asarray(rows[i], np.int64), (u * n) >> 32)
        counts = np.bincount(np.asarray(rows[i], np.int64), minlength=n)
        # each count ~ Binomial(20000, 1/n): within 5 sds of its mean
        sd = np.sqrt(20_000 / n * (1 - 1 / n))
        assert np.all(np.abs(counts - 20_000 / n) < 5 * sd), counts


# ------------------------------------------- model analysis in one compiled program (issue 16)
def _compilations(fn):
    """Number of XLA compilations (``jax.monitoring``) while ``fn()`` runs, and its value."""
    from jax._src import monitoring

    names = []

    def listen(event, duration, fun_name="", **kw):
        if event == "/jax/core/compile/backend_compile_duration":
            names.append(fun_name)

    monitoring.register_event_duration_secs_listener(listen)
    try:
        out = fn()
    finally:
        monitoring.unregister_event_duration_listener(listen)
    return len(names), out


def test_initialisation_is_one_program_and_equals_numpyro():
    """NumPyro's initialize_model run eagerly compiles each of its operations (96 programs
    for this construction before): FederatedPotential runs it under one jit. The initial
    point is NumPyro's eager one (same key, same draw; float32 rounding aside)."""
    from numpyro.infer.initialization import init_to_uniform
    from numpyro.infer.util import initialize_model

    part = make_partition()
    # a model of its own (no program of it compiled by another test of this worker)
    def model(X, g, y=None):
        rich_model(X, g, y)
        numpyro.sample("nu", dist.Gamma(3.0, 1.0))

    n, pot = _compilations(lambda: FederatedPotential(model, part))
    assert n <= 12, n
    key = random.PRNGKey(5)
    ours = pot.init_params(key)
    eager = initialize_model(key, model, model_kwargs=pot._pooled_kwargs,
                             init_strategy=init_to_uniform).param_info.z
    np.testing.assert_allclose(ours, pot.ravel(eager), rtol=1e-6, atol=1e-6)
    # a kernel's init folds its key inside the same program: no new compilation, and the
    # point of random.fold_in(key, 1)
    n_fold, folded = _compilations(lambda: pot.init_params(key, fold_in=1))
    assert n_fold == 0, n_fold
    np.testing.assert_array_equal(folded, pot.init_params(random.fold_in(key, 1)))
    assert not np.array_equal(folded, ours)


def test_initialisation_falls_back_to_numpyro_where_it_must():
    """A support that depends on the data (its transform would hold tracers of the compiled
    program) and a model with no valid initial point take NumPyro's eager path: the right
    transform, NumPyro's RuntimeError."""
    from numpyro_fed.potential import _Initializer

    y = np.linspace(0.5, 3.0, 12)

    def bounded(y, top):
        s = numpyro.sample("s", dist.Uniform(0.0, jnp.asarray(top) + 1.0))  # computed bound
        with numpyro.plate("rows", y.shape[0]):
            numpyro.sample("y", dist.Normal(s, 1.0), obs=y)

    info = _Initializer(bounded, {"y": y, "top": 3.0},
                        numpyro.infer.init_to_uniform)(random.PRNGKey(0))
    z = info.param_info.z["s"]
    assert not isinstance(z, jax.core.Tracer) and np.isfinite(z)
    init = _Initializer(bounded, {"y": y, "top": 3.0}, numpyro.infer.init_to_uniform)
    folded = init(random.PRNGKey(0), fold_in=3).param_info.z["s"]  # eager path, folded key
    assert not init.compiled
    assert float(folded) == float(init(random.fold_in(random.PRNGKey(0), 3)).param_info.z["s"])
    assert float(folded) != float(z)
    pot = FederatedPotential(bounded, ClientPartition.from_clients(
        [{"y": y[:5]}, {"y": y[5:]}], shared={"top": 3.0}))
    # the transform of Uniform(0, 4): a large unconstrained value maps next to 4
    assert float(pot.constrain(jnp.array([50.0]))["s"]) == pytest.approx(4.0, rel=1e-5)

    def hopeless(y):
        s = numpyro.sample("s", dist.Normal(0.0, 1.0))
        numpyro.factor("nan", jnp.nan * s)
        with numpyro.plate("rows", y.shape[0]):
            numpyro.sample("y", dist.Normal(s, 1.0), obs=y)

    with pytest.raises(RuntimeError, match="Cannot find valid initial parameters"):
        _Initializer(hopeless, {"y": y}, numpyro.infer.init_to_uniform)(random.PRNGKey(0))
