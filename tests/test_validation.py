"""The shared argument checks (numpyro_fed._validation): one wording and one exception type
per fault (TypeError: wrong type, ValueError: out of range), every message naming the
argument; and the entry points that used to coerce a wrong value silently now refuse it."""

import math

import numpy as np
import pytest
from jax import random

import numpyro_fed
from numpyro_fed import ClientPartition
from numpyro_fed._validation import (
    check_bool,
    check_float,
    check_int,
    check_positive_float,
    check_probability,
)


@pytest.mark.parametrize("value", [0, 3, np.int32(2), np.int64(7)])
def test_check_int_accepts_python_and_numpy_ints(value):
    out = check_int("n", value, minimum=0)
    assert out == int(value) and type(out) is int


@pytest.mark.parametrize("value", [True, False, 2.0, 2.5, "3", np.float32(1.0), None, [1]])
def test_check_int_refuses_other_types_naming_the_argument(value):
    with pytest.raises(TypeError, match=rf"`num_draws` must be an int >= 1, got .* of type "
                                        rf"{type(value).__name__}\.$"):
        check_int("num_draws", value, minimum=1)


def test_check_int_range_none_and_hint():
    with pytest.raises(ValueError, match=r"^`k` must be an int >= 1, got 0\. Use top_k\(k=3\)\.$"):
        check_int("k", 0, minimum=1, hint=" Use top_k(k=3).")
    with pytest.raises(ValueError, match=r"^`seed` must be an int >= 0, got -1\.$"):
        check_int("seed", -1)
    assert check_int("batch_size", None, minimum=1, allow_none=True) is None
    with pytest.raises(ValueError, match=r"`batch_size` must be an int >= 1 or None, got 0"):
        check_int("batch_size", 0, minimum=1, allow_none=True)


@pytest.mark.parametrize("value", [1e-3, 2, np.float32(0.5), np.asarray(0.25)])
def test_check_positive_float_accepts_real_numbers(value):
    out = check_positive_float("step_size", value)
    assert out == float(value) and type(out) is float


@pytest.mark.parametrize("value", [0.0, -1.0, math.nan, math.inf, -math.inf])
def test_check_positive_float_refuses_non_positive_or_non_finite(value):
    with pytest.raises(ValueError, match=r"^`step_size` must be finite and > 0, got "):
        check_positive_float("step_size", value)


@pytest.mark.parametrize("value", [True, "big", None, object(), b"1"])
def test_check_float_refuses_non_numbers(value):
    with pytest.raises(TypeError, match=r"^`step_size` must be a number, got "):
        check_positive_float("step_size", value)


def test_check_float_bounds_wording():
    assert check_float("memory_rate", 0.0, low=0.0, high=1.0) == 0.0
    assert check_float("memory_rate", 1.0, low=0.0, high=1.0) == 1.0
    with pytest.raises(ValueError, match=r"`memory_rate` must be finite and in \[0, 1\] \(off\)"):
        check_float("memory_rate", 1.5, low=0.0, high=1.0, what=" (off)")
    assert check_float("exponent", 0.0, low=0.0) == 0.0
    with pytest.raises(ValueError, match=r"`exponent` must be finite and >= 0, got -0\.5"):
        check_float("exponent", -0.5, low=0.0)
    assert check_positive_float("step_size", None, allow_none=True) is None


@pytest.mark.parametrize("value", [0.0, -0.1, 1.0 + 1e-9, math.nan])
def test_check_probability(value):
    assert check_probability("p", 1.0) == 1.0
    with pytest.raises(ValueError, match=r"`p` must be finite and in \(0, 1\]"):
        check_probability("p", value)


def test_check_bool():
    assert check_bool("flag", False) is False
    for bad in (0, 1, None, "yes", np.bool_(True)):
        with pytest.raises(TypeError, match="`flag` must be True or False"):
            check_bool("flag", bad)


# ----------------------------------------------------- values once coerced without a word
def test_partition_min_size_and_max_tries_are_not_truncated():
    """``min_size=1.5`` was ``int(1.5) = 1`` (a client of one row, the caller asked for more)."""
    data = {"x": np.arange(20.0)}
    with pytest.raises(TypeError, match="`min_size` must be an int >= 1, got 1.5"):
        ClientPartition.power_law(data, 3, key=random.key(0), min_size=1.5)
    with pytest.raises(TypeError, match="`min_size` must be an int >= 1, got 2.9"):
        ClientPartition.dirichlet(data, 2, labels=np.zeros(20), concentration=1.0,
                                  key=random.key(0), min_size=2.9)
    with pytest.raises(TypeError, match="`max_tries` must be an int >= 1, got 0.5"):
        ClientPartition.dirichlet(data, 2, labels=np.zeros(20), concentration=1.0,
                                  key=random.key(0), max_tries=0.5)


def test_compilation_cache_refuses_a_nan_threshold(tmp_path):
    """``min_compile_time_s=nan`` passed ``nan < 0`` and went to JAX's configuration."""
    with pytest.raises(ValueError, match="`min_compile_time_s` must be finite and >= 0"):
        numpyro_fed.enable_compilation_cache(tmp_path, min_compile_time_s=math.nan)
