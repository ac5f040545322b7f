"""Exact integer accounting of communicated bits inside compiled loops.

Per-step bit counts are ``int32`` (a step may send at most :math:`2^{30}` bits). Cumulative
totals overflow ``int32`` after a few thousand steps, and 64-bit integers are unavailable
unless ``jax_enable_x64`` is set, so totals are kept as a :class:`BitCounter`, a pair of
``int32`` words ``total = hi * 2**30 + lo`` with ``0 <= lo < 2**30``: exact up to
:math:`2^{61}` bits whatever the precision mode. A federated kernel's state packs the
counters of both directions into one ``int32[2, 2]`` array (:func:`totals_add`) and exposes
them as :class:`BitCounter` views (``state.total_up``, ``state.total_down``).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax.numpy as jnp
import numpy as np

__all__ = [
    "BitCounter", "counter_value", "MAX_STEP_BITS", "totals_zeros", "totals_add",
    "totals_counter",
]

_SHIFT = 30
_MASK = (1 << _SHIFT) - 1
MAX_STEP_BITS = 1 << _SHIFT


class BitCounter(NamedTuple):
    """Cumulative bit count ``hi * 2**30 + lo`` (both ``int32``)."""

    hi: jnp.ndarray
    lo: jnp.ndarray


def counter_value(counter: BitCounter) -> np.ndarray:
    """Host-side exact total as ``int64`` (any leading chain axes are kept)."""
    return np.asarray(counter.hi, np.int64) * (1 << _SHIFT) + np.asarray(counter.lo, np.int64)


def _split_add(bits) -> tuple[Any, Any]:
    """``(hi, lo)`` words to add for ``bits``: a Python int of any size is split on the host;
    an ``int32`` array (below :data:`MAX_STEP_BITS`) is added to ``lo`` whole."""
    if isinstance(bits, (int, np.integer)):
        bits = int(bits)
        return jnp.int32(bits >> _SHIFT), jnp.int32(bits & _MASK)
    return jnp.zeros((), jnp.int32), jnp.asarray(bits, jnp.int32)


def totals_zeros() -> jnp.ndarray:
    """Packed cumulative counters at zero: ``int32[2, 2]``, rows ``(up, down)``, columns
    ``(hi, lo)`` as in :class:`BitCounter`."""
    return jnp.zeros((2, 2), jnp.int32)


def totals_add(totals: jnp.ndarray, up, down) -> jnp.ndarray:
    """Add ``up`` and ``down`` bits to packed counters ``totals`` (``int32[..., 2, 2]``).

    Both directions and both words live in one array, so that a compiled step updates them
    with one fused operation instead of one per word and direction (4 on CPU), and a
    kernel's state carries one buffer for them."""
    (hu, lu), (hd, ld) = _split_add(up), _split_add(down)
    lo = totals[..., 1] + jnp.stack(jnp.broadcast_arrays(lu, ld), -1)
    hi = totals[..., 0] + jnp.stack(jnp.broadcast_arrays(hu, hd), -1) + (lo >> _SHIFT)
    return jnp.stack([hi, lo & _MASK], -1)


def totals_counter(totals: jnp.ndarray, direction: int) -> BitCounter:
    """The :class:`BitCounter` of one direction (0: up, 1: down) of packed ``totals``."""
    return BitCounter(totals[..., direction, 0], totals[..., direction, 1])
