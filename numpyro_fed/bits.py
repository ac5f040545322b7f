"""Exact integer accounting of communicated bits inside compiled loops.

Without ``jax_enable_x64`` (the default, float32 mode) a compiled loop has no 64-bit
integers, and ``int32`` wraps at :math:`2^{31}` bits (256 MiB): one step of 1000 clients
sending 47 000 float32 numbers each, or a single dense message of 70 million float32
numbers, already exceeds it. Every count of bits that can reach :math:`2^{31}` is therefore
kept as a :class:`BitCounter`: two ``uint32`` words ``(hi, lo)`` with value
``hi * 2**32 + lo``, exact up to :data:`MAX_BITS` :math:`= 2^{64} - 1` in either precision
mode. The arithmetic of this module (:func:`bits_add`, :func:`sum_bits`,
:func:`count_times`, :func:`scale_bits`) is exact on that range and pure JAX (``jit``,
``vmap`` and ``lax.scan`` compatible).

An amount of bits passed to these functions may be

* a Python ``int`` (exact at any size: the coded length of identity, top-k and rand-k
  messages, broadcasts of dense vectors, one-off rounds), split into words on the host;
* a non-negative ``int32`` array (below :math:`2^{31}`: the old one-word contract of a
  compressor's coded length, and the fast path of the kernels when a static bound shows
  that the count cannot reach :math:`2^{31}`);
* a :class:`BitCounter`.

A federated kernel's state holds the bits of the current step as one :class:`BitCounter`
of shape ``(2,)`` (``(up, down)``, words ``uint32[2, 2]``) and the cumulative counters of
both directions as another (:func:`totals_add`). On the host a :class:`BitCounter` reads as
exact ``int64`` numbers: ``np.asarray(counter)``, :func:`counter_value`, ``int(counter)``;
so do the fields collected by ``MCMC.run(..., extra_fields=("bits_up", "bits_down"))``
(``np.asarray(mcmc.get_extra_fields()["bits_up"])`` is an ``int64`` array) and the
``bits`` sample statistics of ``az.from_numpyro``.
"""

from __future__ import annotations

import numbers
from typing import Any, Union

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

__all__ = [
    "BitCounter",
    "Bits",
    "INT32_LIMIT",
    "MAX_BITS",
    "MAX_STEP_BITS",
    "as_words",
    "bit_count",
    "bits_add",
    "count_times",
    "counter_value",
    "scale_bits",
    "step_bits",
    "sum_bits",
    "sum_small",
    "totals_add",
    "totals_counter",
    "totals_zeros",
]

#: One-word (``int32``) counts are exact below this bound.
INT32_LIMIT = 1 << 31
#: Largest count a :class:`BitCounter` holds exactly.
MAX_BITS = (1 << 64) - 1
#: Largest number of bits one step may count: since the two-word representation, the same as
#: :data:`MAX_BITS` (it was :math:`2^{30}` when per-step counts were ``int32``).
MAX_STEP_BITS = MAX_BITS
_WORD = 32
_MASK = (1 << _WORD) - 1
_HALF = 16
_HALF_MASK = (1 << _HALF) - 1
_U32 = jnp.uint32


@jax.tree_util.register_pytree_node_class
class BitCounter:
    """An exact count of bits (any array shape): ``uint32`` words with value
    ``hi * 2**32 + lo``, exact up to :data:`MAX_BITS`.

    :param words: ``uint32`` array of shape ``shape + (2,)``; the last axis is ``(hi, lo)``.

    A :class:`BitCounter` is a JAX pytree (one leaf, ``words``), so it is returned by
    ``jit``-ed functions, mapped by ``vmap`` and collected by NumPyro's ``MCMC`` like an
    array. On the host it behaves as the ``int64`` array of its values:
    ``np.asarray(counter)``, ``counter.shape``, ``counter[i]``, ``counter == 5``,
    ``int(counter)``, ``counter.tolist()``, ``counter.copy()`` (which ``az.from_numpyro`` uses).
    Converting it to a JAX array (``jnp.asarray``) works only when every value fits in
    ``int32`` and raises :class:`OverflowError` otherwise, instead of wrapping around.
    Inside compiled code use :attr:`words` and the functions of :mod:`numpyro_fed.bits`.
    """

    __slots__ = ("words",)
    __array_priority__ = 100  # numpy defers binary operators to __eq__ / __ne__ below

    def __init__(self, words: Any) -> None:
        self.words = words

    # -- pytree --------------------------------------------------------------------------
    def tree_flatten(self):
        return (self.words,), None

    @classmethod
    def tree_unflatten(cls, aux, children):
        return cls(*children)

    # -- words ---------------------------------------------------------------------------
    @property
    def hi(self):
        """High words (multiples of :math:`2^{32}`)."""
        return self.words[..., 0]

    @property
    def lo(self):
        """Low words."""
        return self.words[..., 1]

    def component(self, index: Any) -> BitCounter:
        """The counter of ``index`` along the last value axis (works inside ``jit``): e.g.
        ``state.bits.component(0)`` is the uplink of a step."""
        return BitCounter(self.words[..., index, :])

    # -- host view as int64 --------------------------------------------------------------
    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(np.shape(self.words)[:-1])

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))

    @property
    def dtype(self) -> np.dtype:
        return np.dtype(np.int64)

    def __len__(self) -> int:
        if not self.shape:
            raise TypeError("len() of a 0-d BitCounter")
        return self.shape[0]

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        value = counter_value(self)
        return value if dtype is None else value.astype(dtype)

    def __int__(self) -> int:
        return int(counter_value(self))

    def __float__(self) -> float:
        return float(counter_value(self))

    def __getitem__(self, index: Any) -> Any:
        return counter_value(self)[index]

    def __eq__(self, other: Any) -> Any:  # type: ignore[override]
        return counter_value(self) == (counter_value(other) if isinstance(other, BitCounter)
                                       else other)

    def __ne__(self, other: Any) -> Any:  # type: ignore[override]
        return counter_value(self) != (counter_value(other) if isinstance(other, BitCounter)
                                       else other)

    __hash__ = None  # type: ignore[assignment]

    def copy(self) -> np.ndarray:
        """The values as a new ``int64`` array."""
        return np.array(counter_value(self))

    def tolist(self) -> Any:
        """The values as (nested lists of) Python ints."""
        return counter_value(self).tolist()

    def __jax_array__(self) -> jax.Array:
        if isinstance(self.words, jax.core.Tracer):
            raise TypeError(
                "A BitCounter cannot be used as a JAX array inside compiled code; use its "
                "`words` with the functions of numpyro_fed.bits (bits_add, sum_bits, ...)."
            )
        value = counter_value(self)
        if np.any(value >= INT32_LIMIT):
            raise OverflowError(
                f"Bit count {value.max()} does not fit in int32; read it on the host with "
                "np.asarray(counter) or numpyro_fed.counter_value(counter) (int64)."
            )
        return jnp.asarray(value.astype(np.int32))

    def __repr__(self) -> str:
        if isinstance(self.words, jax.core.Tracer):
            return f"BitCounter(<traced words of shape {np.shape(self.words)}>)"
        try:
            return f"BitCounter({counter_value(self)!r})"
        except OverflowError:
            return f"BitCounter(words={np.asarray(self.words)!r})"


Bits = Union[int, np.integer, jax.Array, BitCounter]  # noqa: UP007
"""An amount of bits: Python int, non-negative ``int32`` array or :class:`BitCounter`."""


def counter_value(counter: Any) -> np.ndarray:
    """Host-side exact value of a count of bits as ``int64`` (shape kept).

    :param counter: a :class:`BitCounter`, a Python int, or an integer array.
    :raises OverflowError: for a value of :math:`2^{63}` bits or more (not representable as
        ``int64``).
    """
    if isinstance(counter, BitCounter):
        words = np.asarray(counter.words)
        if words.dtype != np.uint32 or words.shape[-1:] != (2,):
            raise TypeError(
                f"BitCounter words must be uint32 with a last axis of 2, got {words.dtype} "
                f"{words.shape}."
            )
        hi = words[..., 0].astype(np.uint64)
        if np.any(hi >= (1 << (_WORD - 1))):
            raise OverflowError("bit count of 2**63 or more does not fit in int64")
        value = (hi << np.uint64(_WORD)) | words[..., 1].astype(np.uint64)
        return np.asarray(value, np.int64)
    if isinstance(counter, numbers.Integral):
        return np.asarray(int(counter), np.int64)
    return np.asarray(np.asarray(counter).astype(np.int64))


# ------------------------------------------------------------------ words arithmetic
def _split(n: int) -> np.ndarray:
    if isinstance(n, bool) or not isinstance(n, numbers.Integral):
        raise TypeError(f"a bit count must be an integer, got {n!r}")
    n = int(n)
    if not 0 <= n <= MAX_BITS:
        raise OverflowError(f"bit count {n} outside [0, 2**64 - 1]")
    return np.array([n >> _WORD, n & _MASK], np.uint32)


def as_words(bits: Bits) -> jax.Array:
    """The ``uint32`` words ``(..., 2)`` of an amount of bits (see the module docstring).

    A Python int is split exactly on the host; an integer array is taken as a one-word
    count (non-negative, below :math:`2^{31}` for ``int32``)."""
    if isinstance(bits, BitCounter):
        return jnp.asarray(bits.words, _U32)
    if isinstance(bits, numbers.Integral):
        return jnp.asarray(_split(bits))
    x = jnp.asarray(bits)
    if not jnp.issubdtype(x.dtype, jnp.integer):
        raise TypeError(f"a bit count must be an integer array, got dtype {x.dtype}")
    lo = x.astype(_U32)
    return jnp.stack([jnp.zeros_like(lo), lo], -1)


def bit_count(n: int) -> jax.Array | BitCounter:
    """A compressor's coded length ``n`` (a Python int known from the shape) as returned by
    ``Compressor.fn``: an ``int32`` scalar below :math:`2^{31}` (the one-word contract),
    else a :class:`BitCounter`."""
    n = int(n)
    if 0 <= n < INT32_LIMIT:
        return jnp.asarray(n, jnp.int32)
    return BitCounter(jnp.asarray(_split(n)))


def _add_words(a: tuple, b: tuple) -> tuple:
    """``(hi, lo) + (hi, lo)`` with the carry of the low words (modulo :math:`2^{64}`)."""
    lo = a[1] + b[1]
    hi = a[0] + b[0] + (lo < a[1]).astype(_U32)
    return hi, lo


def bits_add(a: Bits, b: Bits) -> BitCounter:
    """Exact ``a + b``."""
    wa, wb = as_words(a), as_words(b)
    hi, lo = _add_words((wa[..., 0], wa[..., 1]), (wb[..., 0], wb[..., 1]))
    return BitCounter(jnp.stack([hi, lo], -1))


def _words_sum(words: jax.Array, axis: int) -> jax.Array:
    """Exact sum of ``words`` (``(..., 2)``) over value axis ``axis`` (one variadic reduce)."""
    axis = axis % (words.ndim - 1)
    zero = jnp.zeros((), _U32)
    hi, lo = lax.reduce((words[..., 0], words[..., 1]), (zero, zero),
                        lambda a, b: _add_words(a, b), (axis,))
    return jnp.stack([hi, lo], -1)


def sum_small(x: jax.Array, max_each: int, axis: int = -1) -> jax.Array | BitCounter:
    """Exact sum of non-negative ``int32`` values, each at most ``max_each`` (static).

    ``int32`` (one ``jnp.sum``, as fast as before) when ``n * max_each`` stays below
    :math:`2^{31}`; otherwise the values are summed in ``int32`` chunks short enough to be
    exact, and the chunk sums in two words: a :class:`BitCounter`."""
    x = jnp.asarray(x)
    axis = axis % x.ndim
    n = x.shape[axis]
    if n * max(int(max_each), 1) < INT32_LIMIT:
        return jnp.sum(x, axis=axis, dtype=jnp.int32)
    chunk = max(1, (INT32_LIMIT - 1) // max(int(max_each), 1))
    x = jnp.moveaxis(x, axis, -1)
    pad = -n % chunk
    if pad:
        x = jnp.concatenate([x, jnp.zeros(x.shape[:-1] + (pad,), x.dtype)], -1)
    parts = jnp.sum(x.reshape(x.shape[:-1] + (-1, chunk)), -1, dtype=jnp.int32)
    return BitCounter(_words_sum(as_words(parts), -1))


def sum_bits(bits: Bits, *, max_each: int | None = None, mask: jax.Array | None = None,
             axis: int = 0) -> jax.Array | BitCounter:
    """Exact sum over ``axis`` of per-message coded lengths (e.g. over clients).

    :param bits: ``int32`` array (one word per message) or a :class:`BitCounter`.
    :param max_each: a static upper bound of one message's length, if known: with
        ``n * max_each`` below :math:`2^{31}` the sum stays one ``int32`` ``jnp.sum``.
    :param mask: optional boolean array: only the messages where it is ``True`` count.
    """
    if isinstance(bits, BitCounter):
        words = bits.words
        if mask is not None:
            words = jnp.where(jnp.expand_dims(mask, -1), words, jnp.zeros((), _U32))
        return BitCounter(_words_sum(words, axis))
    x = jnp.asarray(bits)
    if mask is not None:
        x = jnp.where(mask, x, 0)
    if max_each is None:
        max_each = INT32_LIMIT - 1
    if x.shape[axis] * max_each < INT32_LIMIT:
        return jnp.sum(x, axis=axis, dtype=jnp.int32)
    return BitCounter(_words_sum(as_words(x), axis))


def _mul32(a: jax.Array, c: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Full 64-bit product of ``uint32`` arrays as ``(hi, lo)`` words (16-bit halves)."""
    a0, a1 = a & _HALF_MASK, a >> _HALF
    c0, c1 = c & _HALF_MASK, c >> _HALF
    p00, p01, p10, p11 = a0 * c0, a0 * c1, a1 * c0, a1 * c1
    mid = p01 + p10
    mid_carry = (mid < p01).astype(_U32)
    lo = p00 + (mid << _HALF)
    lo_carry = (lo < p00).astype(_U32)
    hi = p11 + (mid >> _HALF) + (mid_carry << _HALF) + lo_carry
    return hi, lo


def _times(words: jax.Array, c: jax.Array) -> BitCounter:
    """``words * c`` for a ``uint32`` multiplier ``c`` (exact below :math:`2^{64}`)."""
    hi, lo = _mul32(words[..., 1], c)
    return BitCounter(jnp.stack([hi + words[..., 0] * c, lo], -1))


def count_times(count: jax.Array, length: int, *, max_count: int) -> jax.Array | BitCounter:
    """Exact ``count * length`` for a traced number of messages ``count`` (``0 <= count <=
    max_count``, e.g. the participants of a round) of static length ``length`` (a Python
    int): ``int32`` when ``max_count * length`` is below :math:`2^{31}`, else a
    :class:`BitCounter`."""
    length = int(length)
    if int(max_count) * length < INT32_LIMIT:
        return (jnp.asarray(count).astype(jnp.int32) * length).astype(jnp.int32)
    return _times(as_words(length), jnp.asarray(count).astype(_U32))


def scale_bits(bits: Bits, factor: int, *, max_bits: int | None = None
               ) -> jax.Array | BitCounter:
    """Exact ``factor * bits`` for a static ``factor`` (e.g. a broadcast received by
    ``factor`` clients) with ``0 <= factor < 2**32``; ``int32`` when ``bits`` is ``int32``
    with a static bound ``max_bits`` such that the product stays below :math:`2^{31}`."""
    factor = int(factor)
    if not 0 <= factor <= _MASK:
        raise OverflowError(f"scale factor {factor} outside [0, 2**32)")
    if isinstance(bits, numbers.Integral):
        return factor * int(bits)
    if (not isinstance(bits, BitCounter) and max_bits is not None
            and factor * int(max_bits) < INT32_LIMIT):
        return (jnp.asarray(bits).astype(jnp.int32) * factor).astype(jnp.int32)
    return _times(as_words(bits), jnp.asarray(factor, _U32))


# ------------------------------------------------------------------ kernel state
def step_bits(up: Bits, down: Bits) -> BitCounter:
    """The bits of one step, ``(up, down)``: a :class:`BitCounter` of shape ``(2,)``."""
    wu, wd = jnp.broadcast_arrays(as_words(up), as_words(down))
    return BitCounter(jnp.stack([wu, wd], -2))


def totals_zeros() -> BitCounter:
    """Cumulative counters at zero: a :class:`BitCounter` of shape ``(2,)``, ``(up, down)``."""
    return BitCounter(jnp.zeros((2, 2), _U32))


def totals_add(totals: BitCounter, up: Bits, down: Bits | None = None) -> BitCounter:
    """Add ``up`` and ``down`` bits to cumulative counters ``totals`` (shape ``(..., 2)``);
    with ``down=None``, ``up`` is the :class:`BitCounter` of a whole step
    (:func:`step_bits`). Both directions and both words are one array, updated with one
    fused operation."""
    step = up if down is None else step_bits(up, down)
    return bits_add(totals, step)


def totals_counter(totals: BitCounter, direction: int) -> BitCounter:
    """The :class:`BitCounter` of one direction (0: up, 1: down) of ``totals``."""
    return totals.component(direction)
