"""Tests for :mod:`numpyro_fed.partition`."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import random

from numpyro_fed.partition import ClientPartition

N = 600
NUM_CLASSES = 10


@pytest.fixture(scope="module")
def pooled_data():
    rng = np.random.default_rng(0)
    idx = np.arange(N, dtype=np.int32)
    X = rng.normal(size=(N, 3)).astype(np.float32)
    y = rng.integers(0, NUM_CLASSES, size=N).astype(np.int32)
    return {"idx": idx, "X": X, "y": y}


def _constructors(data):
    """Partitions built by every constructor from the same pooled data."""
    y = data["y"]
    groups = data["idx"] % 7
    chunks = [slice(0, 10), slice(10, 200), slice(200, 233), slice(233, N)]
    return {
        "from_clients": ClientPartition.from_clients(
            [{k: v[s] for k, v in data.items()} for s in chunks]
        ),
        "iid": ClientPartition.iid(data, 7, key=random.key(0)),
        "dirichlet": ClientPartition.dirichlet(
            data, 8, labels=y, concentration=0.5, key=random.key(1)
        ),
        "by_group": ClientPartition.by_group(data, groups),
        "power_law": ClientPartition.power_law(data, 6, key=random.key(2), exponent=1.2),
    }


def _check_invariants(p, data):
    sizes = p.sizes_np
    b, n_max = p.num_clients, p.max_size
    assert sizes.sum() == N == p.total_size
    assert sizes.shape == (b,) and sizes.min() >= 1 and sizes.max() == n_max
    assert p.sizes.dtype == jnp.int32
    assert p.keys == tuple(data)
    # dtypes preserved
    for k in data:
        assert p.data[k].dtype == data[k].dtype
        assert p.data[k].shape == (b, n_max, *data[k].shape[1:])
    # every pooled row appears exactly once
    pooled = p.pooled()
    np.testing.assert_array_equal(np.sort(pooled["idx"]), np.arange(N))
    for k in data:
        np.testing.assert_array_equal(pooled[k], data[k][pooled["idx"]])
    # mask
    mask = np.asarray(p.mask)
    assert mask.shape == (b, n_max) and mask.dtype == bool
    np.testing.assert_array_equal(mask.sum(1), sizes)
    np.testing.assert_array_equal(mask, np.arange(n_max)[None] < sizes[:, None])
    # padding repeats the client's first row; client() returns the unpadded rows
    for i in range(b):
        for k in data:
            arr = np.asarray(p.data[k][i])
            for row in arr[sizes[i] :]:
                np.testing.assert_array_equal(row, arr[0])
            np.testing.assert_array_equal(p.client(i)[k], arr[: sizes[i]])
    # client_index consistent with pooled
    ci = p.client_index()
    assert ci.shape == (N,)
    for i in range(b):
        np.testing.assert_array_equal(pooled["idx"][ci == i], p.client(i)["idx"])
    np.testing.assert_allclose(p.weights, sizes / N)
    assert len(p.client_names) == b


@pytest.mark.parametrize("name", ["from_clients", "iid", "dirichlet", "by_group", "power_law"])
def test_constructor_invariants(pooled_data, name):
    p = _constructors(pooled_data)[name]
    _check_invariants(p, pooled_data)


def test_unequal_sizes_from_clients(pooled_data):
    p = _constructors(pooled_data)["from_clients"]
    np.testing.assert_array_equal(p.sizes_np, [10, 190, 33, 367])
    assert p.client_names == ("0", "1", "2", "3")
    # pooled round trip is the input in client order (here: the original order)
    for k, v in pooled_data.items():
        np.testing.assert_array_equal(p.pooled()[k], v)
    np.testing.assert_array_equal(p.client_index(), np.repeat(np.arange(4), [10, 190, 33, 367]))


def test_padding_is_first_row_not_zero():
    p = ClientPartition.from_clients([{"y": np.array([2.0, 3.0, 4.0])}, {"y": np.array([5.0])}])
    np.testing.assert_array_equal(np.asarray(p.data["y"]), [[2.0, 3.0, 4.0], [5.0, 5.0, 5.0]])
    assert np.all(np.isfinite(np.log(np.asarray(p.data["y"]))))


@pytest.mark.parametrize(
    "build",
    [
        lambda d, k: ClientPartition.iid(d, 7, key=k),
        lambda d, k: ClientPartition.dirichlet(d, 8, labels=d["y"], concentration=0.5, key=k),
        lambda d, k: ClientPartition.power_law(d, 6, key=k),
    ],
    ids=["iid", "dirichlet", "power_law"],
)
def test_key_determinism(pooled_data, build):
    a = build(pooled_data, random.key(3))
    b = build(pooled_data, random.key(3))
    c = build(pooled_data, random.key(4))
    legacy = build(pooled_data, random.PRNGKey(3))
    np.testing.assert_array_equal(a.sizes_np, b.sizes_np)
    np.testing.assert_array_equal(np.asarray(a.data["idx"]), np.asarray(b.data["idx"]))
    assert not np.array_equal(a.pooled()["idx"], c.pooled()["idx"])
    _check_invariants(legacy, pooled_data)


def test_iid_near_equal_sizes(pooled_data):
    p = ClientPartition.iid(pooled_data, 7, key=random.key(0))
    assert p.sizes_np.max() - p.sizes_np.min() <= 1


def _mean_max_class_fraction(p):
    fr = []
    for i in range(p.num_clients):
        counts = np.bincount(p.client(i)["y"], minlength=NUM_CLASSES)
        fr.append(counts.max() / counts.sum())
    return float(np.mean(fr))


def test_dirichlet_label_skew():
    rng = np.random.default_rng(123)
    n = 2000
    y = rng.integers(0, NUM_CLASSES, size=n)
    data = {"y": y}
    skewed, flat = [], []
    for seed in range(4):
        key = random.key(seed)
        skewed.append(
            _mean_max_class_fraction(
                ClientPartition.dirichlet(data, 20, labels=y, concentration=0.1, key=key)
            )
        )
        flat.append(
            _mean_max_class_fraction(
                ClientPartition.dirichlet(data, 20, labels=y, concentration=100.0, key=key)
            )
        )
    # iid share of the majority class is ~0.1 plus noise; Dir(0.1) concentrates on few classes
    assert np.mean(skewed) > 0.55, skewed
    assert max(flat) < 0.3, flat
    assert min(skewed) > 2 * max(flat)


def test_dirichlet_min_size(pooled_data):
    p = ClientPartition.dirichlet(
        pooled_data, 5, labels=pooled_data["y"], concentration=1.0, key=random.key(0), min_size=40
    )
    assert p.sizes_np.min() >= 40


def test_by_group():
    groups = np.array([30, 10, 20, 10, 30, 30, 20, 10, 10])
    data = {"g": groups.astype(np.float32), "i": np.arange(9)}
    p = ClientPartition.by_group(data, groups)
    assert p.num_clients == 3
    assert p.client_names == (10, 20, 30)
    np.testing.assert_array_equal(p.sizes_np, [4, 2, 3])
    for i, g in enumerate(p.client_names):
        c = p.client(i)
        assert np.all(c["g"] == g)
        np.testing.assert_array_equal(c["i"], np.flatnonzero(groups == g))

    p_str = ClientPartition.by_group({"x": np.arange(4.0)}, np.array(["b", "a", "b", "c"]))
    assert p_str.client_names == ("a", "b", "c")
    np.testing.assert_array_equal(p_str.client(1)["x"], [0.0, 2.0])


def test_power_law_sizes(pooled_data):
    p = ClientPartition.power_law(pooled_data, 8, key=random.key(0), exponent=1.5, min_size=20)
    s = p.sizes_np
    assert s.sum() == N
    assert s.min() >= 20
    assert np.all(np.diff(s) <= 0)
    assert s[0] > 3 * s[-1]
    flat = ClientPartition.power_law(pooled_data, 8, key=random.key(0), exponent=0.0)
    assert flat.sizes_np.max() - flat.sizes_np.min() <= 1


def test_shared_and_pytree(pooled_data):
    scale = jnp.array(2.0)
    p = ClientPartition.iid(
        pooled_data, 4, key=random.key(0), shared={"num_classes": 10, "scale": scale}
    )
    total = jax.jit(lambda q: q.data["X"].sum())(p)
    np.testing.assert_allclose(total, np.asarray(p.data["X"]).sum(), rtol=1e-5)

    @jax.jit
    def f(q):
        # static Python ints stay Python ints under jit; shapes are static too
        assert isinstance(q.shared["num_classes"], int)
        assert q.num_clients == 4 and q.max_size == p.max_size
        masked = jnp.where(q.mask, q.data["y"], 0)
        return jax.nn.one_hot(masked, q.shared["num_classes"]).sum() * q.shared["scale"]

    np.testing.assert_allclose(f(p), 2.0 * p.num_clients * p.max_size)

    q = jax.tree.map(lambda a: a, p)
    assert isinstance(q, ClientPartition)
    assert q.keys == p.keys and q.client_names == p.client_names
    assert q.shared["num_classes"] == 10
    np.testing.assert_array_equal(q.sizes_np, p.sizes_np)
    leaves = jax.tree.leaves(p)
    assert len(leaves) == len(pooled_data) + 2  # data arrays, sizes, shared scale

    stacked = jax.vmap(lambda x, m: jnp.sum(jnp.where(m, x[:, 0], 0.0)))(p.data["X"], p.mask)
    np.testing.assert_allclose(stacked.sum(), pooled_data["X"][:, 0].sum(), rtol=1e-4)


def test_direct_init_and_repr():
    data = {"X": np.zeros((3, 5, 2), np.float32), "y": np.ones((3, 5), np.int32)}
    p = ClientPartition(data, [5, 2, 3])
    assert p.num_clients == 3 and p.max_size == 5 and p.total_size == 10
    assert p.shared == {}
    r = repr(p)
    assert r == (
        "ClientPartition(num_clients=3, keys=('X', 'y'), sizes: min 2 / median 3 / max 5, total 10)"
    )
    with pytest.raises(ValueError, match="client 1 has size 0"):
        ClientPartition(data, [5, 0, 3])
    with pytest.raises(ValueError, match="N_max=5"):
        ClientPartition(data, [6, 1, 3])
    with pytest.raises(ValueError, match="length num_clients=3"):
        ClientPartition(data, [5, 1])
    with pytest.raises(ValueError, match="'X' has 3 and 'y' has 2"):
        ClientPartition({"X": np.zeros((3, 5)), "y": np.zeros((2, 5))}, [1, 1, 1])
    with pytest.raises(ValueError, match="N_max"):
        ClientPartition({"X": np.zeros((3, 5)), "y": np.zeros((3, 4))}, [1, 1, 1])
    with pytest.raises(ValueError, match="both in data and in shared"):
        ClientPartition(data, [5, 2, 3], shared={"X": 1})


def test_check_batch_size(pooled_data):
    p = _constructors(pooled_data)["from_clients"]
    p.check_batch_size(None)
    p.check_batch_size(1)
    p.check_batch_size(10)
    with pytest.raises(ValueError, match=r"batch_size=11.*client 0.*10 rows.*batch_size <= 10"):
        p.check_batch_size(11)
    with pytest.raises(ValueError, match=r"`batch_size` must be an int >= 1 or None, got 0\. "
                                         r"Use None for full-batch gradients"):
        p.check_batch_size(0)
    with pytest.raises(TypeError, match=r"`batch_size` must be an int >= 1 or None, got 2\.5"):
        p.check_batch_size(2.5)


def test_check_model(pooled_data):
    def model(X, y=None):
        pass

    def model_kwargs(X, **kwargs):
        pass

    p = ClientPartition.iid({"X": pooled_data["X"], "y": pooled_data["y"]}, 3, key=random.key(0))
    p.check_model(model)
    p.check_model(model_kwargs)
    bad = ClientPartition.iid({"Z": pooled_data["X"]}, 3, key=random.key(0))
    with pytest.raises(ValueError, match=r"'Z'.*accepts \('X', 'y'\)"):
        bad.check_model(model)
    shared_bad = ClientPartition.iid(
        {"X": pooled_data["X"]}, 3, key=random.key(0), shared={"prior_scale": 1.0}
    )
    with pytest.raises(ValueError, match="shared key 'prior_scale'"):
        shared_bad.check_model(model)
    shared_bad.check_model(model_kwargs)


# ---------------------------------------------------------------------------
# errors
# ---------------------------------------------------------------------------


def test_error_empty_client():
    with pytest.raises(ValueError, match="client 1 has no data"):
        ClientPartition.from_clients([{"X": np.ones((2, 2))}, {"X": np.ones((0, 2))}])
    with pytest.raises(ValueError, match="non-empty sequence"):
        ClientPartition.from_clients([])


def test_error_dirichlet_gives_up():
    # a split that keeps producing empty clients ends with an error that says how to fix it
    data = {"x": np.arange(12.0)}
    labels = np.repeat(np.arange(3), 4)
    with pytest.raises(ValueError, match="larger concentration.*fewer clients"):
        ClientPartition.dirichlet(
            data, 12, labels=labels, concentration=1e-3, key=random.key(0), max_tries=5
        )


def test_error_mismatched_leading_axes():
    data = {"X": np.zeros((10, 2)), "y": np.zeros(9)}
    with pytest.raises(ValueError, match="'X' has 10 rows and 'y' has 9 rows"):
        ClientPartition.iid(data, 2, key=random.key(0))
    with pytest.raises(ValueError, match=r"clients\[1\].*'X' has 3 rows and 'y' has 2 rows"):
        ClientPartition.from_clients(
            [{"X": np.zeros((2, 2)), "y": np.zeros(2)}, {"X": np.zeros((3, 2)), "y": np.zeros(2)}]
        )


@pytest.mark.parametrize(
    "build",
    [
        lambda d, b: ClientPartition.iid(d, b, key=random.key(0)),
        lambda d, b: ClientPartition.dirichlet(
            d, b, labels=np.zeros(10), concentration=1.0, key=random.key(0)
        ),
        lambda d, b: ClientPartition.power_law(d, b, key=random.key(0)),
    ],
    ids=["iid", "dirichlet", "power_law"],
)
def test_error_num_clients(build):
    data = {"x": np.arange(10.0)}
    with pytest.raises(ValueError, match="`num_clients` must be an int >= 1, got 0"):
        build(data, 0)
    with pytest.raises(TypeError, match="`num_clients` must be an int >= 1, got 2.0"):
        build(data, 2.0)
    with pytest.raises(ValueError, match="num_clients=11 exceeds the number of data points N=10"):
        build(data, 11)


def test_error_inconsistent_keys():
    with pytest.raises(ValueError, match=r"inconsistent keys.*client 1.*missing keys \['y'\]"):
        ClientPartition.from_clients([{"X": np.ones(2), "y": np.ones(2)}, {"X": np.ones(3)}])
    with pytest.raises(ValueError, match=r"inconsistent trailing shapes"):
        ClientPartition.from_clients([{"X": np.ones((2, 3))}, {"X": np.ones((2, 4))}])


def test_error_labels_and_concentration():
    data = {"x": np.arange(10.0)}
    with pytest.raises(ValueError, match=r"labels must be a 1-D array.*length N=10"):
        ClientPartition.dirichlet(data, 2, labels=np.zeros(9), concentration=1.0, key=random.key(0))
    with pytest.raises(ValueError, match=r"groups must be a 1-D array.*length N=10"):
        ClientPartition.by_group(data, np.zeros(11))
    for bad in (0.0, -1.0):
        with pytest.raises(ValueError, match="`concentration` must be finite and > 0"):
            ClientPartition.dirichlet(
                data, 2, labels=np.zeros(10), concentration=bad, key=random.key(0)
            )


def test_error_non_array_values():
    with pytest.raises(ValueError, match=r"data\['lam'\] is a scalar.*shared"):
        ClientPartition.iid({"x": np.arange(10.0), "lam": 3.0}, 2, key=random.key(0))
    with pytest.raises(ValueError, match=r"data\['name'\].*shared"):
        ClientPartition.iid({"x": np.arange(10.0), "name": "abc"}, 2, key=random.key(0))
    with pytest.raises(ValueError, match=r"clients\[0\]: data\['k'\] is a scalar"):
        ClientPartition.from_clients([{"x": np.ones(2), "k": 1}])


def test_error_bad_key():
    with pytest.raises(ValueError, match="key must be a JAX PRNG key"):
        ClientPartition.iid({"x": np.arange(10.0)}, 2, key=np.array([1.5, 2.0]))


def test_error_power_law_min_size():
    with pytest.raises(ValueError, match="min_size=4 with num_clients=3.*fewer clients"):
        ClientPartition.power_law({"x": np.arange(10.0)}, 3, key=random.key(0), min_size=4)
    with pytest.raises(ValueError, match="`exponent` must be finite and >= 0"):
        ClientPartition.power_law({"x": np.arange(10.0)}, 3, key=random.key(0), exponent=-1.0)


# ---------------------------------------------------------------------------
# original row index, non-finite data
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["from_clients", "iid", "dirichlet", "by_group", "power_law"])
def test_row_index_is_the_users_row(pooled_data, name):
    p = _constructors(pooled_data)[name]
    ri = p.row_index
    assert ri.shape == (p.num_clients, p.max_size)
    np.testing.assert_array_equal(ri < 0, ~np.asarray(p.mask))
    # pooled_data["idx"] is the user's row number: the row index gives it back
    np.testing.assert_array_equal(p.original_index(), p.pooled()["idx"])
    # it survives pytree round trips and jit, and partitions of other row orders do not
    # share a compiled program's tree structure
    q = jax.tree.map(lambda a: a, p)
    np.testing.assert_array_equal(q.row_index, ri)
    out = jax.jit(lambda r: r)(p)
    np.testing.assert_array_equal(out.row_index, ri)


def test_row_index_distinguishes_partitions(pooled_data):
    a = ClientPartition.iid(pooled_data, 4, key=random.key(0))
    b = ClientPartition.iid(pooled_data, 4, key=random.key(1))
    assert jax.tree.structure(a) == jax.tree.structure(jax.tree.map(lambda v: v, a))
    assert jax.tree.structure(a) != jax.tree.structure(b)
    out = jax.jit(lambda r: r)(b)
    np.testing.assert_array_equal(out.original_index(), b.pooled()["idx"])


def test_error_bad_row_index():
    data = {"X": np.zeros((2, 3))}
    with pytest.raises(ValueError, match="row_index must be an integer array of shape"):
        ClientPartition(data, [3, 2], row_index=np.zeros((2, 2), int))
    with pytest.raises(ValueError, match="-1 on padding"):
        ClientPartition(data, [3, 2], row_index=np.array([[0, 1, 2], [3, 4, 5]]))
    with pytest.raises(ValueError, match="repeat"):
        ClientPartition(data, [3, 2], row_index=np.array([[0, 1, 2], [2, 4, -1]]))


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_error_non_finite_data_names_key_client_and_row(pooled_data, bad):
    """Before: accepted; the chains then returned NaN or diverged."""
    data = {k: v.copy() for k, v in pooled_data.items()}
    data["X"] = data["X"].astype(np.float64)
    data["X"][123, 1] = bad
    p_ok = ClientPartition.iid(pooled_data, 5, key=random.key(0))
    client = int(np.flatnonzero((p_ok.row_index == 123).any(1))[0])
    row = int(np.flatnonzero(p_ok.row_index[client] == 123)[0])
    with pytest.raises(ValueError, match=rf"data\['X'\] has a non-finite value \({bad}\) in "
                                         rf"client {client} .*its row {row} \(row 123 of"):
        ClientPartition.iid(data, 5, key=random.key(0))
    with pytest.raises(ValueError, match=r"data\['X'\].*client 1 \('1'\), at its row 3 .*row 13 "):
        ClientPartition.from_clients([{k: v[:10] for k, v in data.items()},
                                      {k: v[10:] for k, v in {**data, "X": np.where(
                                          np.arange(N)[:, None] == 13, bad, data["X"])}.items()}])
    # padding is never checked (it repeats a real row) and integer arrays cannot hold NaN
    ClientPartition.iid({"y": pooled_data["y"]}, 5, key=random.key(0))
