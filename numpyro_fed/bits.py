"""Exact integer accounting of communicated bits inside compiled loops.

Per-step bit counts are ``int32`` (a step may send at most :math:`2^{30}` bits). Cumulative
totals overflow ``int32`` after a few thousand steps, and 64-bit integers are unavailable
unless ``jax_enable_x64`` is set, so totals are kept as a :class:`BitCounter`, a pair of
``int32`` words ``total = hi * 2**30 + lo`` with ``0 <= lo < 2**30``: exact up to
:math:`2^{61}` bits whatever the precision mode.
"""

from __future__ import annotations

from typing import NamedTuple

import jax.numpy as jnp
import numpy as np

__all__ = ["BitCounter", "counter_zeros", "counter_add", "counter_value", "MAX_STEP_BITS"]

_SHIFT = 30
_MASK = (1 << _SHIFT) - 1
MAX_STEP_BITS = 1 << _SHIFT


class BitCounter(NamedTuple):
    """Cumulative bit count ``hi * 2**30 + lo`` (both ``int32``)."""

    hi: jnp.ndarray
    lo: jnp.ndarray


def counter_zeros() -> BitCounter:
    """A counter at zero."""
    return BitCounter(jnp.zeros((), jnp.int32), jnp.zeros((), jnp.int32))


def counter_add(counter: BitCounter, bits) -> BitCounter:
    """Add ``bits`` (an ``int32`` array below :data:`MAX_STEP_BITS`, or any Python int)."""
    if isinstance(bits, (int, np.integer)):
        bits = int(bits)
        hi_add, lo_add = bits >> _SHIFT, bits & _MASK
        lo = counter.lo + jnp.int32(lo_add)
        return BitCounter(counter.hi + jnp.int32(hi_add) + (lo >> _SHIFT), lo & _MASK)
    lo = counter.lo + jnp.asarray(bits, jnp.int32)
    return BitCounter(counter.hi + (lo >> _SHIFT), lo & _MASK)


def counter_value(counter: BitCounter) -> np.ndarray:
    """Host-side exact total as ``int64`` (any leading chain axes are kept)."""
    return np.asarray(counter.hi, np.int64) * (1 << _SHIFT) + np.asarray(counter.lo, np.int64)
