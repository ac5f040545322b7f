"""The SAEM programs' random numbers lowered without loops (``_programs.unrolled_threefry``):
the same bits as JAX's rolled CPU lowering, no loop left in the module, the option never
given to XLA, and JAX's lowering table restored."""

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import random

from numpyro_fed import _programs
from numpyro_fed.saem.model import LOOP_COMPILER_OPTIONS

pytestmark = pytest.mark.skipif(jax.default_backend() != "cpu",
                                reason="the rolled Threefry loop is JAX's CPU lowering")


def _draws(key):
    k1, k2 = random.split(random.fold_in(key, 7))
    return (random.normal(k1, (1000,)), random.uniform(k2, (3, 77)),
            random.key_data(random.split(key, 5)), random.bits(k1, (64,), jnp.uint32))


def _fresh():
    # a new function each time: JAX caches the lowering of a jitted function's trace (the
    # library traces a fresh closure for every program, see numpyro_fed._programs)
    return jax.jit(lambda key: _draws(key))


def _module(unrolled: bool) -> str:
    with _programs.unrolled_threefry() if unrolled else contextlib.nullcontext():
        return _fresh().lower(random.key(3)).as_text()


def test_unrolled_threefry_gives_the_same_bits_without_a_loop():
    rolled, unrolled = _module(False), _module(True)
    assert "stablehlo.while" in rolled  # JAX's CPU lowering: a 5-trip loop per hash
    assert "stablehlo.while" not in unrolled
    key = random.key(42)
    with _programs.unrolled_threefry():
        a = _fresh().lower(key).compile()(key)
    b = _fresh().lower(key).compile()(key)
    for x, y in zip(a, b, strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_the_lowering_table_is_restored_even_after_an_error():
    before = _module(False)
    with pytest.raises(ZeroDivisionError), _programs.unrolled_threefry():
        1 / 0  # noqa: B018
    assert _module(False) == before
    assert "stablehlo.while" in before


def test_the_option_keys_the_program_and_never_reaches_xla():
    assert LOOP_COMPILER_OPTIONS[_programs.UNROLLED_RNG] is True

    def f(key):
        return random.normal(key, (8,))

    key = random.key(0)
    opts = {k: v for k, v in LOOP_COMPILER_OPTIONS.items() if k != _programs.UNROLLED_RNG}
    a = _programs.compile_program(f, (key,), compiler_options=LOOP_COMPILER_OPTIONS)
    b = _programs.compile_program(f, (key,), compiler_options=opts)
    assert a.key != b.key  # two lowerings, two programs
    np.testing.assert_array_equal(np.asarray(a(key)), np.asarray(b(key)))
    # another backend's compiler would reject an unknown option: it is dropped there
    assert _programs.UNROLLED_RNG not in _programs.platform_options(LOOP_COMPILER_OPTIONS,
                                                                    "cuda")
