"""Exact bit accounting beyond int32 in float32 mode (issue 14): the two-word arithmetic at
the boundaries 2^31, 2^32, 2^62, the host readers, the compressor contract, and real kernel
runs whose per-step counts exceed 2^31."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
import pytest
from jax import random
from numpyro.infer import MCMC

from numpyro_fed import ClientPartition, compressors
from numpyro_fed import bits as B
from numpyro_fed.bits import (
    BitCounter,
    bits_add,
    count_times,
    counter_value,
    scale_bits,
    sum_bits,
    sum_small,
    totals_add,
    totals_zeros,
)
from numpyro_fed.infdata import communication_summary, to_inference_data
from numpyro_fed.kernels.elf import ELF
from numpyro_fed.kernels.langevin import FederatedLangevin
from numpyro_fed.kernels.qlsd import QLSD

pytestmark = pytest.mark.skipif(jax.config.jax_enable_x64, reason="float32 mode is the point")

# values around the word boundaries
EDGES = [0, 1, 2**31 - 1, 2**31, 2**31 + 1, 2**32 - 1, 2**32, 2**32 + 1, 2**62 - 1, 2**62,
         2**62 + 1, 3 * 2**61 + 12345]


# ============================================================ arithmetic at the boundaries
def _pairs(xs, ys, ok):
    """The parameter pairs whose result is within the host's exact int64 range."""
    return [(x, y) for x in xs for y in ys if ok(x, y)]


@pytest.mark.parametrize("a, b", _pairs(EDGES, [0, 1, 2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**62],
                                        lambda a, b: a + b <= 2**63 - 1))
def test_add_is_exact_at_word_boundaries(a, b):
    got = jax.jit(bits_add)(BitCounter(B.as_words(a)), BitCounter(B.as_words(b)))
    assert int(got) == a + b
    # one-word int32 operands (the old compressor contract) are promoted exactly
    if b < 2**31:
        assert int(jax.jit(bits_add)(BitCounter(B.as_words(a)), jnp.int32(b))) == a + b


def test_totals_cross_2_32_and_2_62_step_by_step():
    """Cumulative counters of a lax.scan crossing the word boundary and 2^62, with a traced
    int32 uplink (a one-word count) and a static downlink of 2^32 - 1."""
    start, up, down = 2**62 - 3 * (2**31 - 1), 2**31 - 1, 2**32 - 1

    def body(t, x):
        return totals_add(t, x, down), None

    t0 = totals_add(totals_zeros(), start, start)
    xs = jnp.full((5,), up, jnp.int32)
    t, _ = jax.jit(lambda t, xs: jax.lax.scan(body, t, xs))(t0, xs)
    assert np.asarray(t).dtype == np.int64
    np.testing.assert_array_equal(np.asarray(t), [start + 5 * up, start + 5 * down])
    assert int(t.component(0)) > 2**62 and int(t.component(1)) > 2**62


def test_sum_bits_exact_over_clients():
    rng = np.random.default_rng(0)
    lengths = rng.integers(2**30, 2**31, size=1000).astype(np.int32)  # sum ~ 1.6e12
    got = jax.jit(lambda x: sum_bits(x))(jnp.asarray(lengths))
    assert isinstance(got, BitCounter) and int(got) == int(lengths.astype(np.int64).sum())
    # two-word lengths (a BitCounter per client), masked
    big = np.array([2**62 // 1000 + i for i in range(1000)], dtype=object)
    words = jnp.asarray(np.stack([B.as_words(int(v)) for v in big]))
    mask = rng.uniform(size=1000) < 0.7
    got = jax.jit(lambda w, m: sum_bits(BitCounter(w), mask=m))(words, jnp.asarray(mask))
    assert int(got) == int(sum(int(v) for v, m in zip(big, mask, strict=True) if m))
    # a static bound keeps the int32 reduction when the sum cannot reach 2^31
    small = jax.jit(lambda x: sum_bits(x, max_each=1000))(jnp.full((100,), 999, jnp.int32))
    assert small.dtype == jnp.int32 and int(small) == 99900


def test_sum_small_beyond_int32():
    """A data-dependent sum of many small per-coordinate lengths above 2^31 and 2^32 (the
    Elias-coded length of a very long quantised message)."""
    x = jnp.full((45_000_000,), 100, jnp.int32)  # 4.5e9 > 2^32
    got = jax.jit(lambda v: sum_small(v, 127))(x)
    assert isinstance(got, BitCounter) and int(got) == 4_500_000_000
    assert int(jax.jit(lambda v: jnp.sum(v))(x)) != 4_500_000_000  # what int32 gave


@pytest.mark.parametrize("count, length", _pairs(
    [0, 1, 999, 1000, 65537, 2**31 - 1],
    [1, 2**31 - 1, 2**32 + 3, 2**40 + 12345, 2**62 // 2**31], lambda c, n: c * n < 2**63))
def test_count_times_static_length(count, length):
    got = jax.jit(lambda c: count_times(c, length, max_count=2**31 - 1))(jnp.int32(count))
    assert int(got) == count * length


@pytest.mark.parametrize("value, factor", _pairs(
    [0, 5, 2**31 - 1, 2**32 - 1, 2**32, 2**40 + 7, 2**53 + 1],
    [0, 1, 1000, 2**16 + 1, 2**32 - 1], lambda v, f: v * f < 2**63))
def test_scale_bits(value, factor):
    got = jax.jit(lambda w: scale_bits(BitCounter(w), factor))(B.as_words(value))
    assert int(got) == value * factor
    if value < 2**31:
        got = jax.jit(lambda v: scale_bits(v, factor))(jnp.int32(value))
        assert int(got) == value * factor


def test_python_ints_are_split_exactly_and_out_of_range_raises():
    assert int(BitCounter(B.as_words(2**64 - 1)).words[..., 0]) == 2**32 - 1
    with pytest.raises(OverflowError, match="2\\*\\*64"):
        B.as_words(2**64)
    with pytest.raises(OverflowError, match="2\\*\\*64"):
        B.as_words(-1)
    with pytest.raises(OverflowError, match="int64"):
        counter_value(BitCounter(B.as_words(2**63)))


# ================================================================= host view of a counter
def test_bitcounter_reads_as_exact_int64_on_the_host():
    c = bits_add(BitCounter(B.as_words(2**40)), jnp.asarray([1, 2, 3], jnp.int32))
    arr = np.asarray(c)
    assert arr.dtype == np.int64 and arr.tolist() == [2**40 + 1, 2**40 + 2, 2**40 + 3]
    assert c.shape == (3,) and c.ndim == 1 and len(c) == 3 and c.dtype == np.int64
    assert c[1] == 2**40 + 2 and np.all(c == arr) and c.tolist() == arr.tolist()
    assert c.copy().dtype == np.int64 and int(c.component(2)) == 2**40 + 3
    assert float(c.component(0)) == float(2**40 + 1)
    np.testing.assert_array_equal(np.asarray(c, np.float64), arr.astype(np.float64))
    # converting to a JAX array never wraps around silently
    with pytest.raises(OverflowError, match="int32"):
        jnp.asarray(c)
    np.testing.assert_array_equal(jnp.asarray(BitCounter(B.as_words(12))), 12)


def test_bitcounter_inside_jit_is_a_pytree_and_refuses_array_use():
    f = jax.jit(lambda c: jnp.asarray(c) + 1)
    with pytest.raises(TypeError, match="words"):
        f(BitCounter(B.as_words(3)))
    out = jax.jit(lambda c: c)(BitCounter(B.as_words(2**33)))
    assert isinstance(out, BitCounter) and int(out) == 2**33


# ===================================================================== compressor contract
def test_static_coded_lengths_are_exact_python_ints_at_any_size():
    d = 70_000_000  # one message of 2.24e9 bits > 2^31
    ident, top, rand = compressors.identity(), compressors.top_k(3), compressors.rand_k(5)
    assert ident.static_bits(d) == 32 * d and isinstance(ident.static_bits(d), int)
    assert top.static_bits(d) == 3 * (32 + 27) and rand.static_bits(d) == 5 * (32 + 27)
    sq = compressors.scaled(compressors.rand_k(5))
    assert sq.static_bits(d) == rand.static_bits(d)
    q = compressors.quantize(bits=4)
    assert q.static_bits is None and q.max_bits(d) > 2**31
    assert compressors.scaled(q).max_bits(d) == q.max_bits(d)
    # the identity's fn returns the two-word count for this message (it used to raise
    # "Python integer 2240000000 out of bounds for int32")
    v = jnp.zeros((d,), jnp.float32)
    _, bits = ident(random.key(0), v)
    assert isinstance(bits, BitCounter) and int(bits) == 32 * d
    # below 2^31 the one-word int32 contract is unchanged
    _, small = ident(random.key(0), jnp.zeros((10,), jnp.float32))
    assert small.dtype == jnp.int32 and int(small) == 320


@pytest.mark.parametrize("levels", [2, 16, 2**12])
def test_quantize_two_word_length_equals_one_word_length(monkeypatch, levels):
    """Quantize's coded length computed in two words (the path of messages whose length can
    exceed 2^31) equals the int32 length, message by message (limits lowered to force the
    two-word path on small messages)."""
    keys = random.split(random.key(1), 6)
    v = random.normal(random.key(2), (6, 300)) * jnp.linspace(0.01, 3.0, 300)
    v = v.at[3].set(0.0)
    ref_hat, ref = jax.vmap(compressors.quantize(levels))(keys, v)
    assert ref.dtype == jnp.int32
    monkeypatch.setattr(compressors, "INT32_LIMIT", 64)
    monkeypatch.setattr(B, "INT32_LIMIT", 64)
    comp = compressors.quantize(levels)
    got_hat, got = jax.vmap(comp)(keys, v)
    assert isinstance(got, BitCounter)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(ref, np.int64))
    np.testing.assert_array_equal(got_hat, ref_hat)


def _custom(kind: str, length: int) -> compressors.Compressor:
    """A custom compressor with no static sizes: the old one-word contract (int32 scalar) or
    the new one (a BitCounter)."""

    def fn(key, v):
        del key
        out = jnp.int32(length) if kind == "int32" else B.bit_count(length)
        return v, out

    return compressors.Compressor(
        name=f"custom-{kind}", fn=fn, nominal_bits=lambda d: length, omega=lambda d: 0.0,
        alpha=lambda d: 1.0, unbiased=True, randomised=False,
    )


# ============================================================ kernels (small, forced paths)
def _logistic(X, y=None):
    w = numpyro.sample("w", dist.Normal(0.0, 1.0).expand([X.shape[1]]).to_event(1))
    numpyro.sample("y", dist.Bernoulli(logits=X @ w), obs=y)


@pytest.fixture(scope="module")
def small_part():
    rng = np.random.default_rng(0)
    X = rng.normal(size=(120, 6)).astype(np.float32)
    y = (rng.uniform(size=120) < 0.5).astype(np.float32)
    return ClientPartition.iid({"X": X, "y": y}, 6, key=random.key(0))


def _small_kernels(part):
    kw = dict(step_size=1e-3, postprocess_deterministic=False)
    q = compressors.quantize(bits=3)
    return {
        "LMC": FederatedLangevin(_logistic, part, batch_size=5, **kw),
        "QLSD#": QLSD(_logistic, part, batch_size=5, compressor=q, **kw),
        "QLSD++ p=0.6": QLSD(_logistic, part, variant="++", batch_size=5, compressor=q,
                             participation=0.6, **kw),
        "LSD p=0.6": QLSD(_logistic, part, participation=0.6, **kw),
        "B-ELF scaled(quantize)": ELF(_logistic, part, variant="B",
                                      uplink=compressors.scaled(q),
                                      downlink=compressors.scaled(q), **kw),
        "D-ELF top-2 p=0.5": ELF(_logistic, part, variant="D", uplink=compressors.top_k(2),
                                 participation=0.5, **kw),
        "P-ELF top-2": ELF(_logistic, part, variant="P", downlink=compressors.top_k(2), **kw),
        "custom int32": FederatedLangevin(_logistic, part, compressor=_custom("int32", 77),
                                          **kw),
        "custom BitCounter": FederatedLangevin(_logistic, part,
                                               compressor=_custom("words", 2**33 + 1), **kw),
    }


def _run(kern, n=6, chains=1):
    mcmc = MCMC(kern, num_warmup=2, num_samples=n, num_chains=chains,
                chain_method="vectorized", progress_bar=False)
    mcmc.run(random.key(3), extra_fields=("bits_up", "bits_down", "extra"))
    return mcmc


# one case covers a data-dependent quantised length with participation-free sums (a custom
# compressor's two-word length, participants x static length: test_count_times_static_length
# and, under -m slow, the custom BitCounter, QLSD++ / LSD / D-ELF cases); the others run with
# -m slow (35-41 s each: suite time)
_SLOW = pytest.mark.slow

@pytest.mark.parametrize("name", [
    "B-ELF scaled(quantize)", pytest.param("custom BitCounter", marks=_SLOW),
    *(pytest.param(n, marks=_SLOW) for n in ("QLSD++ p=0.6", "LMC", "QLSD#", "LSD p=0.6",
                                             "D-ELF top-2 p=0.5", "P-ELF top-2",
                                             "custom int32"))])
def test_two_word_paths_count_what_the_int32_paths_count(monkeypatch, small_part, name):
    """Every kernel counts the same bits (and draws the same chain) whether its sums run in
    int32 or in two words; the two-word path is forced by lowering the int32 limit."""
    ref = _run(_small_kernels(small_part)[name], chains=2)
    monkeypatch.setattr(B, "INT32_LIMIT", 8)
    monkeypatch.setattr(compressors, "INT32_LIMIT", 8)
    got = _run(_small_kernels(small_part)[name], chains=2)
    ex_r, ex_g = ref.get_extra_fields(), got.get_extra_fields()
    for f in ("bits_up", "bits_down"):
        assert np.asarray(ex_g[f]).dtype == np.int64
        np.testing.assert_array_equal(np.asarray(ex_g[f]), np.asarray(ex_r[f]))
    np.testing.assert_array_equal(counter_value(got.last_state.totals),
                                  counter_value(ref.last_state.totals))
    np.testing.assert_array_equal(got.get_samples()["w"], ref.get_samples()["w"])


def test_bits_match_their_definition(small_part):
    """Per-step counts from the definitions: partial participation counts participants
    times the static length; a custom compressor's two-word length is summed exactly."""
    kerns = _small_kernels(small_part)
    b, d = small_part.num_clients, 6
    m = _run(kerns["LSD p=0.6"])
    parts = np.asarray(m.get_extra_fields()["extra"].participants)
    np.testing.assert_array_equal(np.asarray(m.get_extra_fields()["bits_up"]),
                                  parts.sum(-1) * 32 * d)
    m = _run(kerns["custom BitCounter"])
    up = np.asarray(m.get_extra_fields()["bits_up"])
    assert up.dtype == np.int64 and np.all(up == b * (2**33 + 1))
    m = _run(kerns["custom int32"])
    assert np.all(np.asarray(m.get_extra_fields()["bits_up"]) == b * 77)


# ======================================================= real runs beyond 2^31 per step
def _linreg(X, y=None):
    w = numpyro.sample("w", dist.Normal(0.0, 1.0).expand([X.shape[1]]).to_event(1))
    numpyro.sample("y", dist.Normal(X @ w, 1.0), obs=y)


@pytest.fixture(scope="module")
def wide_part():
    """1000 clients of one row, d = 70 000: a dense round is 1000 * 32 * 70 000 = 2.24e9
    bits > 2^31 each way (the size that could not start)."""
    b, d = 1000, 70_000
    rng = np.random.default_rng(1)
    X = (rng.standard_normal((b, d), dtype=np.float32) / np.sqrt(d)).astype(np.float32)
    y = rng.standard_normal(b).astype(np.float32)
    return ClientPartition.from_clients([{"X": X[i:i + 1], "y": y[i:i + 1]} for i in range(b)])


def test_kernel_counts_beyond_int32_per_step(wide_part):
    b, d, steps = 1000, 70_000, 3
    dense = b * 32 * d
    assert 2**31 < dense < 2**32
    kern = FederatedLangevin(_linreg, wide_part, step_size=1e-6,
                             postprocess_deterministic=False)
    mcmc = MCMC(kern, num_warmup=0, num_samples=steps, progress_bar=False)
    mcmc.run(random.key(0), extra_fields=("bits_up", "bits_down"))
    ex = mcmc.get_extra_fields()
    for f in ("bits_up", "bits_down"):
        arr = np.asarray(ex[f])
        assert arr.dtype == np.int64 and arr.tolist() == [dense] * steps
    # the packed sample field reads the same
    np.testing.assert_array_equal(np.asarray(mcmc.last_state.bits), [dense, dense])
    # cumulative: the initial broadcast and 3 steps down, 3 steps up (> 2^32: carries)
    assert int(mcmc.last_state.total_up) == steps * dense
    assert int(mcmc.last_state.total_down) == (steps + 1) * dense
    comm = communication_summary(mcmc)
    assert comm["up"].tolist() == [steps * dense]
    assert comm["total"].tolist() == [(2 * steps + 1) * dense]
    assert comm["per_step_up"] == dense
    # az.from_numpyro's `bits` and to_inference_data's bits_up / bits_down are the exact
    # int64 counts (replaying the model on 1000 x 70 000 rows is skipped: log_likelihood=False)
    idata = to_inference_data(mcmc, log_likelihood=False)
    up = idata.sample_stats["bits_up"].values
    assert up.dtype == np.int64 and np.all(up == dense)
    assert idata.sample_stats.attrs["bits_up_total"] == [steps * dense]
