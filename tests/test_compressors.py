"""Tests for :mod:`numpyro_fed.compressors`.

Statistical tests use Monte Carlo with fixed seeds and a 5-standard-error tolerance:
for a Gaussian-approximated mean, a single 5-sigma check fails with probability
about 6e-7, so with ``d`` coordinates checked jointly the family-wise false-alarm
probability is below ``d * 6e-7`` (a union bound), i.e. negligible for the ``d <= 64``
used here, while genuine biases of a few percent are still detected at these sample
sizes.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from numpyro_fed.compressors import (
    COMPRESSOR_KINDS,
    Compressor,
    CompressorSpec,
    ceil_log2,
    elias_gamma_length,
    get_compressor,
    identity,
    quantize,
    rand_k,
    scaled,
    top_k,
)

M = 20_000  # Monte Carlo samples per statistical test
N_SE = 5.0  # tolerance in standard errors (see module docstring)


def _draws(comp: Compressor, v: jax.Array, seed: int = 0, m: int = M):
    keys = jax.random.split(jax.random.key(seed), m)
    v_hat, bits = jax.jit(jax.vmap(comp, in_axes=(0, None)))(keys, v)
    return np.asarray(v_hat, dtype=np.float64), np.asarray(bits)


def _test_vectors(d: int = 32) -> dict[str, jax.Array]:
    rng = np.random.default_rng(1)
    dense = rng.standard_normal(d)
    sparse = np.zeros(d)
    sparse[[2, 9, 20]] = [1.5, -0.3, 0.8]
    one_hot = np.zeros(d)
    one_hot[5] = -2.0
    return {
        "dense": jnp.asarray(dense, jnp.float32),
        "sparse": jnp.asarray(sparse, jnp.float32),
        "one_hot": jnp.asarray(one_hot, jnp.float32),
    }


def _reference_coded_bits(levels: np.ndarray, float_bits: int = 32) -> int:
    """Pure-Python sparse Elias-gamma length of a level vector (loop reference)."""

    def gamma(n: int) -> int:
        return 2 * (n.bit_length() - 1) + 1

    total = float_bits + gamma(int(np.count_nonzero(levels)) + 1)
    prev = -1
    for j, lvl in enumerate(levels):
        if lvl != 0:
            total += gamma(j - prev) + 1 + gamma(int(lvl))
            prev = j
    return total


# ------------------------------------------------------------------ statistics


@pytest.mark.parametrize("s", [1, 2, 16])
def test_quantize_unbiased(s):
    v = _test_vectors()["dense"]
    v_hat, _ = _draws(quantize(s), v, seed=s)
    mean = v_hat.mean(0)
    se = v_hat.std(0, ddof=1) / math.sqrt(M)
    # Coordinates quantised deterministically have SE = 0; allow float rounding there.
    atol = 1e-5 * float(jnp.linalg.norm(v))
    np.testing.assert_array_less(np.abs(mean - np.asarray(v)), N_SE * se + atol)


def test_rand_k_unbiased():
    v = _test_vectors()["dense"]
    v_hat, _ = _draws(rand_k(4), v, seed=7)
    mean = v_hat.mean(0)
    se = v_hat.std(0, ddof=1) / math.sqrt(M)
    np.testing.assert_array_less(np.abs(mean - np.asarray(v)), N_SE * se)
    # Every draw keeps exactly k distinct coordinates (dense v has no zeros).
    assert np.all(np.count_nonzero(v_hat, axis=1) == 4)


def _sq_err_stats(comp, v, seed):
    v_hat, _ = _draws(comp, v, seed=seed)
    err = ((v_hat - np.asarray(v, np.float64)) ** 2).sum(1)
    return err.mean(), err.std(ddof=1) / math.sqrt(M)


@pytest.mark.parametrize("s", [1, 4, 16])
@pytest.mark.parametrize("kind", ["dense", "sparse", "one_hot"])
def test_quantize_variance_bound(s, kind):
    v = _test_vectors()[kind]
    comp = quantize(s)
    mean, se = _sq_err_stats(comp, v, seed=s)
    sq_norm = float(jnp.sum(v**2))
    assert mean - N_SE * se <= comp.omega(v.shape[0]) * sq_norm + 1e-6 * sq_norm
    # Exact variance: each coordinate is a scaled Bernoulli,
    # E||C(v) - v||^2 = (||v|| / s)^2 * sum_j p_j (1 - p_j),  p_j = frac(s |v_j| / ||v||).
    r = s * np.abs(np.asarray(v, np.float64)) / math.sqrt(sq_norm)
    p = r - np.floor(r)
    exact = sq_norm / s**2 * np.sum(p * (1 - p))
    assert abs(mean - exact) <= N_SE * se + 1e-5 * sq_norm


@pytest.mark.parametrize("k", [1, 8, 31])
def test_rand_k_variance_exact(k):
    v = _test_vectors()["dense"]
    comp = rand_k(k)
    d = v.shape[0]
    mean, se = _sq_err_stats(comp, v, seed=k)
    exact = (d / k - 1) * float(jnp.sum(v**2))
    assert comp.omega(d) == pytest.approx(d / k - 1)
    assert abs(mean - exact) <= N_SE * se


@pytest.mark.parametrize("k", [1, 3, 10, 50])
def test_top_k_contraction_deterministic(k):
    d = 50
    vs = jax.random.normal(jax.random.key(3), (200, d)) * jnp.exp(
        jax.random.normal(jax.random.key(4), (200, d))
    )
    v_hat, bits = jax.vmap(top_k(k), in_axes=(None, 0))(jax.random.key(0), vs)
    err = jnp.sum((v_hat - vs) ** 2, axis=1)
    bound = (1 - k / d) * jnp.sum(vs**2, axis=1)
    assert bool(jnp.all(err <= bound * (1 + 1e-6) + 1e-6))
    assert bool(jnp.all(jnp.count_nonzero(v_hat, axis=1) == k))
    assert top_k(k).alpha(d) == k / d
    assert np.all(np.asarray(bits) == k * (32 + ceil_log2(d)))


def test_top_k_keeps_largest():
    v = jnp.array([0.1, -5.0, 2.0, -0.3, 4.0])
    v_hat, _ = top_k(2)(None, v)
    np.testing.assert_array_equal(v_hat, jnp.array([0.0, -5.0, 0.0, 0.0, 4.0]))


@pytest.mark.parametrize("inner", [quantize(2), quantize(bits=4), rand_k(5)])
def test_scaled_contraction_in_expectation(inner):
    comp = scaled(inner)
    d = 32
    alpha = comp.alpha(d)
    assert alpha == pytest.approx(1 / (inner.omega(d) + 1))
    assert 0 < alpha <= 1 and not comp.unbiased and comp.omega is None
    assert comp.name == f"scaled({inner.name})"
    for kind, v in _test_vectors(d).items():
        mean, se = _sq_err_stats(comp, v, seed=11)
        sq_norm = float(jnp.sum(v**2))
        assert mean - N_SE * se <= (1 - alpha) * sq_norm, kind


def test_scaled_divides_inner_output():
    v = _test_vectors()["dense"]
    key = jax.random.key(5)
    inner = quantize(3)
    v_in, b_in = inner(key, v)
    v_sc, b_sc = scaled(inner)(key, v)
    np.testing.assert_allclose(v_sc, v_in / (inner.omega(32) + 1), rtol=1e-6)
    assert int(b_sc) == int(b_in)
    assert scaled(inner).nominal_bits(32) == inner.nominal_bits(32)


# ------------------------------------------------------------------ bit accounting


def test_elias_gamma_length():
    n = jnp.array([1, 2, 3, 4, 7, 8, 1023, 1024, 2**24 - 1, 2**24, 2**31 - 1])
    expected = [1, 3, 3, 5, 5, 7, 19, 21, 47, 49, 61]
    out = elias_gamma_length(n)
    assert out.dtype == jnp.int32
    np.testing.assert_array_equal(out, expected)
    np.testing.assert_array_equal(elias_gamma_length(jnp.array([0, -2])), [0, 0])


def test_ceil_log2():
    assert [ceil_log2(n) for n in (1, 2, 3, 4, 5, 8, 9, 100, 1024, 1025)] == [
        0,
        1,
        2,
        2,
        3,
        3,
        4,
        7,
        10,
        11,
    ]
    with pytest.raises(ValueError, match="`n`"):
        ceil_log2(0)


@pytest.mark.parametrize(
    ("v", "s", "levels", "coded", "nominal"),
    [
        # 32 + g(3) + [g(1) + 1 + g(3)] + [g(2) + 1 + g(4)] = 32 + 3 + 5 + 9
        ([3.0, 0.0, 4.0], 5, [3, 0, 4], 49, 32 + 3 * (1 + 3)),
        # norm 13; 32 + g(3) + [g(4) + 1 + g(5)] + [g(2) + 1 + g(12)] = 32 + 3 + 11 + 11
        ([0.0, 0.0, 0.0, -5.0, 0.0, 12.0], 13, [0, 0, 0, 5, 0, 12], 57, 32 + 6 * (1 + 4)),
        # zero vector: 32 + g(1)
        ([0.0, 0.0, 0.0, 0.0], 8, [0, 0, 0, 0], 33, 32 + 4 * (1 + 4)),
        # one-hot at index 9 with s = 16: 32 + g(2) + [g(10) + 1 + g(16)] = 32 + 3 + 17
        ([0.0] * 9 + [-2.5] + [0.0] * 6, 16, [0] * 9 + [16] + [0] * 6, 52, 32 + 16 * 6),
    ],
)
def test_quantize_exact_bits(v, s, levels, coded, nominal):
    v = jnp.asarray(v, jnp.float32)
    comp = quantize(s)
    assert comp.nominal_bits(v.shape[0]) == nominal
    for seed in range(5):  # levels are deterministic here, whatever xi is
        v_hat, bits = comp(jax.random.key(seed), v)
        assert bits.dtype == jnp.int32 and bits.shape == ()
        assert int(bits) == coded
        expected = jnp.sign(v) * jnp.linalg.norm(v) * jnp.asarray(levels) / s
        np.testing.assert_allclose(v_hat, expected, rtol=1e-6)
        assert not bool(jnp.any(jnp.isnan(v_hat)))


# d = 1, 20, 64 take the doubling branch of the previous-nonzero index, 300 the associative
# scan (compressors._DOUBLING_MAX_D = 128)
@pytest.mark.parametrize("s,d", [(1, 64), (3, 64), (64, 64), (3, 1), (3, 20), (3, 300)])
def test_quantize_coded_bits_match_reference(s, d):
    v = jnp.asarray(np.random.default_rng(d).standard_normal(d) * (np.arange(d) % 3 == 0),
                    jnp.float32)
    comp = quantize(s)
    keys = jax.random.split(jax.random.key(s), 20)
    v_hat, bits = jax.vmap(comp, in_axes=(0, None))(keys, v)
    norm = float(jnp.linalg.norm(v))
    for vh, b in zip(np.asarray(v_hat), np.asarray(bits), strict=True):
        lvl = np.rint(np.abs(vh) * s / norm).astype(int)
        assert lvl.max() <= s
        assert int(b) == _reference_coded_bits(lvl)


def test_nominal_bits_and_constants():
    assert quantize(bits=4).name == "quantize(s=16)"
    assert quantize(16).omega(100) == pytest.approx(min(100 / 256, 10 / 16))
    assert quantize(1).omega(100) == pytest.approx(10.0)
    assert quantize(16).alpha is None and quantize(16).unbiased
    assert top_k(3).nominal_bits(100) == 3 * (32 + 7)
    assert top_k(3).name == "top_k(k=3)" and top_k(3).omega is None
    assert rand_k(3).nominal_bits(100) == 3 * (32 + 7) and rand_k(3).alpha is None
    _, bits = top_k(3)(jax.random.key(0), jnp.ones(100))
    assert int(bits) == 3 * (32 + 7)
    _, bits = rand_k(3, float_bits=16)(jax.random.key(0), jnp.ones(100))
    assert int(bits) == 3 * (16 + 7)

    ident = identity()
    v = jnp.arange(5.0)
    v_hat, bits = ident(jax.random.key(0), v)
    np.testing.assert_array_equal(v_hat, v)
    assert int(bits) == 32 * 5 == ident.nominal_bits(5)
    assert ident.omega(5) == 0.0 and ident.alpha(5) == 1.0 and ident.unbiased
    assert ident.is_identity
    assert identity(float_bits=64).nominal_bits(5) == 320
    assert not quantize(4).is_identity and not scaled(ident).is_identity


# ------------------------------------------------------------------ validation


@pytest.mark.parametrize(
    ("factory", "exc", "match"),
    [
        (lambda: quantize(levels=0), ValueError, "levels"),
        (lambda: quantize(levels=2.5), TypeError, "`levels` must be an int >= 1"),
        (lambda: quantize(levels=2, bits=3), ValueError, "exactly one of `levels`"),
        (lambda: quantize(), ValueError, "exactly one of `levels`"),
        (lambda: quantize(bits=-1), ValueError, "bits"),
        (lambda: quantize(bits=40), ValueError, "bits"),
        (lambda: top_k(0), ValueError, "`k`"),
        (lambda: top_k(True), TypeError, "`k` must be an int >= 1, got True of type bool"),
        (lambda: rand_k(-1), ValueError, "`k`"),
        (lambda: identity(float_bits=0), ValueError, "float_bits"),
        (lambda: scaled(top_k(1)), ValueError, r"compressor.*top_k\(k=1\)"),
    ],
)
def test_invalid_parameters(factory, exc, match):
    with pytest.raises(exc, match=match):
        factory()


@pytest.mark.parametrize("comp", [top_k(5), rand_k(5)])
def test_k_larger_than_d(comp):
    key = jax.random.key(0)
    with pytest.raises(ValueError, match=r"k=5.*d=3"):
        comp(key, jnp.ones(3))
    with pytest.raises(ValueError, match=r"k=5.*d=3"):
        jax.jit(comp.fn)(key, jnp.ones(3))


def test_rejects_non_vector():
    with pytest.raises(ValueError, match="1-D"):
        quantize(4)(jax.random.key(0), jnp.ones((2, 3)))


def test_get_compressor():
    assert get_compressor(None).is_identity
    assert get_compressor("identity").is_identity
    assert get_compressor("quantize:16").name == "quantize(s=16)"
    assert get_compressor("qsgd:8").name == "quantize(s=8)"
    assert get_compressor(" Bits:4 ").name == "quantize(s=16)"
    assert get_compressor("top_k:3").name == "top_k(k=3)"
    assert get_compressor("rand_k:3").name == "rand_k(k=3)"
    comp = scaled(rand_k(2))
    assert get_compressor(comp) is comp
    for bad in ("nope", "top_k", "top_k:x", "quantize:0", 3):
        with pytest.raises(ValueError):
            get_compressor(bad)
    with pytest.raises(ValueError, match="valid forms"):
        get_compressor("gzip:9")


# ------------------------------------------------------------------ transformations

ALL = [
    identity(),
    quantize(4),
    quantize(bits=1),
    top_k(3),
    rand_k(3),
    scaled(quantize(2)),
    scaled(rand_k(4)),
]


@pytest.mark.parametrize("comp", ALL, ids=lambda c: c.name)
def test_jit_vmap_over_clients(comp):
    n_clients, d = 6, 10
    vs = jax.random.normal(jax.random.key(0), (n_clients, d))
    keys = jax.random.split(jax.random.key(1), n_clients)
    batched = jax.jit(jax.vmap(comp))
    v_hat, bits = batched(keys, vs)
    assert v_hat.shape == (n_clients, d) and v_hat.dtype == vs.dtype
    assert bits.shape == (n_clients,) and bits.dtype == jnp.int32
    v_hat2, bits2 = batched(keys, vs)
    np.testing.assert_array_equal(v_hat, v_hat2)
    np.testing.assert_array_equal(bits, bits2)
    for i in range(n_clients):  # matches the unbatched, un-jitted computation
        vi, bi = comp(keys[i], vs[i])
        np.testing.assert_allclose(v_hat[i], vi, rtol=1e-6, atol=1e-7)
        assert int(bits[i]) == int(bi)
    if comp.name.startswith(("quantize", "rand_k", "scaled")):
        other, _ = batched(jax.random.split(jax.random.key(2), n_clients), vs)
        assert not np.array_equal(other, v_hat)


def test_legacy_uint32_keys():
    v = jnp.arange(1.0, 9.0)
    v_hat, _ = quantize(4)(jax.random.PRNGKey(0), v)
    assert v_hat.shape == v.shape


@pytest.mark.parametrize("comp", ALL, ids=lambda c: c.name)
def test_float64(comp):
    with jax.enable_x64(True):
        v = jax.random.normal(jax.random.key(0), (12,), dtype=jnp.float64)
        v_hat, bits = jax.jit(comp.fn)(jax.random.key(1), v)
        assert v_hat.dtype == jnp.float64 and bits.dtype == jnp.int32
        assert bool(jnp.all(jnp.isfinite(v_hat)))


def test_float64_quantize_unbiased():
    with jax.enable_x64(True):
        v = jnp.asarray(np.random.default_rng(2).standard_normal(16), jnp.float64)
        keys = jax.random.split(jax.random.key(3), M)
        v_hat, bits = jax.jit(jax.vmap(quantize(4), in_axes=(0, None)))(keys, v)
        assert v_hat.dtype == jnp.float64
        v_hat = np.asarray(v_hat)
    se = v_hat.std(0, ddof=1) / math.sqrt(M)
    np.testing.assert_array_less(np.abs(v_hat.mean(0) - np.asarray(v)), N_SE * se + 1e-12)


@pytest.mark.parametrize("comp, randomised", [
    (identity(), False), (top_k(3), False), (scaled(identity()), False),
    (quantize(bits=2), True), (rand_k(3), True), (scaled(quantize(bits=2)), True),
])
def test_randomised_flag_matches_key_use(comp, randomised):
    """`randomised=False` promises that the key is ignored (kernels then derive none): two
    keys give the same message exactly; randomised compressors differ on a generic vector."""
    v = jax.random.normal(jax.random.PRNGKey(0), (20,))
    a = comp(jax.random.PRNGKey(1), v)[0]
    b = comp(jax.random.PRNGKey(2), v)[0]
    assert comp.randomised is randomised
    assert bool(np.array_equal(np.asarray(a), np.asarray(b))) is not randomised


# ------------------------------------------------------------------ structured spec
@pytest.mark.parametrize("comp", ALL + [quantize(4, float_bits=16), top_k(2, float_bits=8),
                                        identity(float_bits=16)], ids=lambda c: c.name)
def test_spec_describes_the_compressor(comp):
    """Every factory's compressor carries its kind and parameters; the spec's text is the
    name, reads back to the same spec, and rebuilds a compressor with the same output."""
    spec = comp.spec
    assert isinstance(spec, CompressorSpec) and spec.kind in COMPRESSOR_KINDS
    assert spec.text == comp.name
    assert CompressorSpec.parse(comp.name) == spec and hash(CompressorSpec.parse(comp.name))
    rebuilt = spec.build()
    assert rebuilt.spec == spec and rebuilt.name == comp.name
    assert get_compressor(comp.name).spec == spec and get_compressor(spec).spec == spec
    v = jax.random.normal(jax.random.key(1), (12,))
    a, bits_a = comp(jax.random.key(2), v)
    b, bits_b = rebuilt(jax.random.key(2), v)
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert int(bits_a) == int(bits_b)


def test_spec_parameters_and_scaled_wraps_the_inner_spec():
    assert quantize(bits=4).spec == CompressorSpec("quantize", (("s", 16), ("float_bits", 32)))
    assert quantize(16).spec.param("s") == 16 and top_k(3).spec.param("k") == 3
    assert identity().spec == CompressorSpec("identity", (("float_bits", 32),))
    inner = rand_k(4)
    sc = scaled(inner)
    assert sc.spec == CompressorSpec("scaled", (), inner.spec) and sc.spec.inner == inner.spec
    assert sc.spec.text == "scaled(rand_k(k=4))"
    # parameters in any order describe the same compressor
    assert CompressorSpec("top_k", (("float_bits", 32), ("k", 3))) == top_k(3).spec
    # a custom compressor has no spec, and nor has scaled() of one
    custom = Compressor(name="mine", fn=lambda k, v: (v, jnp.int32(0)), nominal_bits=lambda d: 0,
                        omega=lambda d: 0.0, alpha=None, unbiased=True)
    assert custom.spec is None and scaled(custom).spec is None


@pytest.mark.parametrize("text, match", [
    ("zip(k=3)", "unknown compressor kind 'zip'"),
    ("quantize()", r"quantize needs \['s'\]"),
    ("top_k(j=3)", r"top_k takes the parameters \['k', 'float_bits'\]"),
    ("top_k(k=3, k=4)", "each once"),
    ("rand_k(k=x)", "'k=x' is not 'name=integer'"),
    ("quantize(s=4", "unbalanced"),
    ("scaled()", r"scaled\(...\) needs the compressor it wraps"),
])
def test_spec_parse_errors_name_the_problem(text, match):
    with pytest.raises(ValueError, match=match):
        CompressorSpec.parse(text)


def test_spec_constructor_validates():
    with pytest.raises(ValueError, match="unknown `kind`='gzip'"):
        CompressorSpec("gzip")
    with pytest.raises(ValueError, match=r"quantize takes the parameters \['s', 'float_bits'\]"):
        CompressorSpec("quantize", (("s", 4),))
    with pytest.raises(ValueError, match="parameter 'k' of top_k must be an int"):
        CompressorSpec("top_k", (("k", True), ("float_bits", 32)))
    with pytest.raises(ValueError, match="`inner`"):
        CompressorSpec("scaled")
