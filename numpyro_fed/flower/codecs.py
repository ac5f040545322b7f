"""Wire formats of the compressed messages: what actually crosses the network.

Each :class:`~numpyro_fed.compressors.Compressor` declares the coded length of a message
(``bits`` returned by ``fn``). :func:`wire_codec` gives, for the compressors of
:mod:`numpyro_fed.compressors`, a bit-exact serialisation whose payload is *that* many bits
(padded to whole bytes), so the bits on the wire can be checked against the declared bits:

* ``identity``: ``d`` IEEE float32 values (``32 d`` bits);
* ``quantize(s)`` (QLSD eq. (4), QSGD's sparse Elias code): the float32 norm, the
  Elias-gamma code of ``nnz + 1``, then for every nonzero level its Elias-gamma position gap,
  a sign bit and the Elias-gamma level -- exactly the length counted by the compressor;
* ``top_k(k)`` / ``rand_k(k)``: ``k`` pairs (``ceil_log2(d)``-bit index, float32 value);
* ``scaled(C)``: the message of ``C`` (the factor :math:`1/(\\omega+1)` is known to both
  sides).

Decoding validates everything (length, trailing bits, indices, levels, finiteness) and raises
:class:`WireFormatError` with the reason; a server never applies a message that does not
decode.
"""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Callable
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from numpyro_fed.compressors import Compressor, ceil_log2, get_compressor

__all__ = [
    "WireCodec",
    "WireFormatError",
    "codec_for",
    "compressor_from_name",
    "dense_codec",
    "wire_codec",
]


class WireFormatError(ValueError):
    """A received message is malformed, oversized or inconsistent with its codec."""


# ----------------------------------------------------------------------------- bit streams
class _BitWriter:
    def __init__(self) -> None:
        self.bits: list[int] = []

    def uint(self, value: int, width: int) -> None:
        self.bits.extend((value >> (width - 1 - j)) & 1 for j in range(width))

    def gamma(self, n: int) -> None:
        if n < 1:
            raise ValueError(f"Elias-gamma codes integers >= 1, got {n}")
        length = n.bit_length()
        self.bits.extend([0] * (length - 1))
        self.uint(n, length)

    def float32(self, x: float | np.floating) -> None:
        self.uint(int(np.asarray(x, np.float32).view(np.uint32)), 32)

    def tobytes(self) -> tuple[np.ndarray, int]:
        arr = np.asarray(self.bits, np.uint8)
        return np.packbits(arr), len(self.bits)


class _BitReader:
    def __init__(self, payload: np.ndarray) -> None:
        self.bits = np.unpackbits(np.asarray(payload, np.uint8))
        self.pos = 0

    def _take(self, width: int) -> np.ndarray:
        if self.pos + width > self.bits.size:
            raise WireFormatError("message truncated: read past the end of the payload")
        out = self.bits[self.pos : self.pos + width]
        self.pos += width
        return out

    def uint(self, width: int) -> int:
        value = 0
        for bit in self._take(width):
            value = (value << 1) | int(bit)
        return value

    def gamma(self, limit: int) -> int:
        zeros = 0
        while True:
            if zeros > limit.bit_length():
                raise WireFormatError("invalid Elias-gamma code (too many leading zeros)")
            if int(self._take(1)[0]) == 1:
                break
            zeros += 1
        value = 1
        for _ in range(zeros):
            value = (value << 1) | int(self._take(1)[0])
        if value > limit:
            raise WireFormatError(f"Elias-gamma value {value} exceeds its bound {limit}")
        return value

    def float32(self) -> np.float32:
        return np.asarray(self.uint(32), np.uint32).view(np.float32)[()]

    def finish(self) -> int:
        """Check that only zero padding (< 8 bits) is left; return the bits read."""
        rest = self.bits[self.pos :]
        if rest.size >= 8 or np.any(rest):
            raise WireFormatError(
                f"{rest.size} unexpected trailing bits after the message (payload too long)"
            )
        return self.pos


# ----------------------------------------------------------------------------- codecs
@dataclass(frozen=True)
class WireCodec:
    """Bit-exact serialisation of one compressor's messages of dimension ``d``.

    - ``compress(key, v) -> (payload uint8 array, bits, v_dec)``: compress ``v`` exactly as
      the in-process kernel does (same key), serialise it, and return the decoded value the
      receiver will see (use it for any state update, so both sides stay in agreement).
    - ``decode(payload) -> (v_dec, bits)``: validate and decode a received payload.
    - ``max_bytes``: the largest payload a valid message can have (larger ones are rejected
      before decoding).
    """

    name: str
    dim: int
    compress: Callable[[jax.Array, jax.Array], tuple[np.ndarray, int, np.ndarray]]
    decode: Callable[[np.ndarray], tuple[np.ndarray, int]]
    max_bytes: int
    declared_bits: Callable[[jax.Array, jax.Array], int]


def _check_payload(payload: np.ndarray, max_bytes: int) -> np.ndarray:
    arr = np.asarray(payload)
    if arr.dtype != np.uint8 or arr.ndim != 1:
        raise WireFormatError(
            f"payload must be a 1-D uint8 array, got dtype {arr.dtype} and shape {arr.shape}"
        )
    if arr.size > max_bytes:
        raise WireFormatError(
            f"oversized message: {arr.size} bytes > {max_bytes} bytes, the largest valid "
            "message of this compressor"
        )
    return arr


def _finite(v: np.ndarray) -> np.ndarray:
    if not np.all(np.isfinite(v)):
        raise WireFormatError("decoded message has non-finite values")
    return v


def dense_codec(d: int) -> WireCodec:
    """Dense float32 vectors (``32 d`` bits): the identity compressor, broadcasts of
    :math:`\\theta`, initial full gradients."""

    def compress(key, v):
        v32 = np.asarray(v, np.float32)
        payload = np.frombuffer(v32.astype(">f4").tobytes(), np.uint8).copy()
        return payload, 32 * d, v32

    def decode(payload):
        arr = _check_payload(payload, 4 * d)
        if arr.size != 4 * d:
            raise WireFormatError(f"dense message of {arr.size} bytes, expected {4 * d}")
        return _finite(np.frombuffer(arr.tobytes(), ">f4").astype(np.float32)), 32 * d

    return WireCodec("identity", d, compress, decode, 4 * d, lambda k, v: 32 * d)


def _sparse_codec(name: str, d: int, k: int, comp: Compressor, select) -> WireCodec:
    idx_bits = ceil_log2(d)
    total = k * (32 + idx_bits)
    select = jax.jit(select)

    def compress(key, v):
        v_hat, bits = comp(key, v)
        idx = np.asarray(select(key, v))
        vals = np.asarray(v_hat, np.float32)[idx]
        w = _BitWriter()
        for i, x in zip(idx.tolist(), vals, strict=True):
            w.uint(int(i), idx_bits)
            w.float32(x)
        payload, n = w.tobytes()
        assert n == int(bits) == total
        dec, _ = decode(payload)
        return payload, n, dec

    def decode(payload):
        arr = _check_payload(payload, math.ceil(total / 8))
        r = _BitReader(arr)
        out = np.zeros(d, np.float32)
        seen = set()
        for _ in range(k):
            i = r.uint(idx_bits)
            if i >= d or i in seen:
                raise WireFormatError(f"invalid or repeated index {i} (dimension {d})")
            seen.add(i)
            out[i] = r.float32()
        return _finite(out), r.finish()

    return WireCodec(name, d, compress, decode, math.ceil(total / 8), lambda key, v: total)


def _quantize_codec(name: str, d: int, s: int, comp: Compressor) -> WireCodec:
    gamma_max = 2 * (max(d, s) + 1).bit_length() + 1
    max_bits = 32 + gamma_max + d * (2 * gamma_max + 1)
    max_bytes = math.ceil(max_bits / 8)
    norm_fn = jax.jit(lambda v: jnp.linalg.norm(v))

    def _decode_values(norm, signs, lvl):
        return (norm * signs * lvl.astype(np.float32) / np.float32(s)).astype(np.float32)

    def compress(key, v):
        v_hat, bits = comp(key, v)
        v_hat = np.asarray(v_hat, np.float32)
        norm = np.float32(norm_fn(jnp.asarray(v, jnp.float32)))
        if not (np.isfinite(norm) and np.all(np.isfinite(v_hat))):
            raise ValueError(f"{name}: cannot code a message with a non-finite norm or values")
        if norm > 0:
            lvl = np.rint(np.abs(v_hat) * np.float32(s) / norm).astype(np.int64)
        else:
            lvl = np.zeros(d, np.int64)
        w = _BitWriter()
        w.float32(norm)
        nz = np.flatnonzero(lvl)
        w.gamma(int(nz.size) + 1)
        prev = -1
        for j in nz.tolist():
            w.gamma(j - prev)
            w.uint(1 if v_hat[j] < 0 else 0, 1)
            w.gamma(int(lvl[j]))
            prev = j
        payload, n = w.tobytes()
        if n != int(bits):
            raise AssertionError(f"quantize codec wrote {n} bits, compressor declared {bits}")
        dec, _ = decode(payload)
        return payload, n, dec

    def decode(payload):
        arr = _check_payload(payload, max_bytes)
        r = _BitReader(arr)
        norm = r.float32()
        if not np.isfinite(norm) or norm < 0:
            raise WireFormatError(f"invalid norm {norm}")
        nnz = r.gamma(d + 1) - 1
        signs = np.zeros(d, np.float32)
        lvl = np.zeros(d, np.int64)
        prev = -1
        for _ in range(nnz):
            j = prev + r.gamma(d)
            if j >= d:
                raise WireFormatError(f"coordinate {j} out of range (dimension {d})")
            signs[j] = -1.0 if r.uint(1) else 1.0
            lvl[j] = r.gamma(s)
            prev = j
        return _finite(_decode_values(np.float32(norm), signs, lvl)), r.finish()

    return WireCodec(name, d, compress, decode, max_bytes, lambda key, v: int(comp(key, v)[1]))


def _scaled(inner: WireCodec, factor: float, comp: Compressor) -> WireCodec:
    f32 = np.float32(factor)

    def compress(key, v):
        payload, n, dec = inner.compress(key, v)
        return payload, n, (dec * f32).astype(np.float32)

    def decode(payload):
        dec, n = inner.decode(payload)
        return (dec * f32).astype(np.float32), n

    return WireCodec(
        f"scaled({inner.name})", inner.dim, compress, decode, inner.max_bytes, inner.declared_bits
    )


def wire_codec(compressor: Compressor | str | None, d: int) -> WireCodec:
    """The wire format of ``compressor`` for messages of dimension ``d``.

    :param compressor: a compressor of :mod:`numpyro_fed.compressors` (or a spec string).
    :param d: message dimension.
    :raises ValueError: for a compressor without a wire format (a custom ``Compressor`` or a
        ``float_bits`` other than 32).
    """
    comp = get_compressor(compressor)
    name = comp.name
    if comp.is_identity and name == "identity":
        return dense_codec(d)
    m = re.fullmatch(r"scaled\((.*)\)", name)
    if m:
        inner_spec = _spec(m.group(1))
        inner = wire_codec(inner_spec, d)
        omega = get_compressor(inner_spec).omega(d)
        return _scaled(inner, 1.0 / (omega + 1.0), comp)
    m = re.fullmatch(r"quantize\(s=(\d+)\)", name)
    if m:
        return _quantize_codec(name, d, int(m.group(1)), comp)
    m = re.fullmatch(r"top_k\(k=(\d+)\)", name)
    if m:
        k = int(m.group(1))
        return _sparse_codec(name, d, k, comp, lambda key, v: lax.top_k(jnp.abs(v), k)[1])
    m = re.fullmatch(r"rand_k\(k=(\d+)\)", name)
    if m:
        k = int(m.group(1))
        return _sparse_codec(
            name, d, k, comp,
            lambda key, v: lax.top_k(jax.random.bits(key, (v.shape[0],), dtype=jnp.uint32), k)[1],
        )
    raise ValueError(
        f"No wire format for compressor {name!r}: the Flower deployment supports identity(), "
        "quantize(...), top_k(...), rand_k(...) and scaled(...) of these, with 32-bit floats."
    )


def _spec(name: str) -> str:
    """Spec string of a compressor name (``"quantize(s=16)"`` -> ``"quantize:16"``)."""
    m = re.fullmatch(r"(quantize|top_k|rand_k)\((?:s|k)=(\d+)\)", name)
    if m:
        return f"{m.group(1)}:{m.group(2)}"
    if name == "identity":
        return name
    raise ValueError(f"No wire format for compressor {name!r}.")


def compressor_from_name(name: Compressor | str | None) -> Compressor:
    """A compressor from its :attr:`~numpyro_fed.compressors.Compressor.name` (as sent in a
    :class:`~numpyro_fed.flower.protocol.FlowerSpec`) or from a spec string
    (``"quantize:16"``); ``scaled(...)`` names are rebuilt with
    :func:`~numpyro_fed.compressors.scaled`."""
    from numpyro_fed.compressors import scaled

    if name is None or isinstance(name, Compressor):
        return get_compressor(name)
    m = re.fullmatch(r"scaled\((.*)\)", name.strip())
    if m:
        return scaled(compressor_from_name(m.group(1)))
    try:
        return get_compressor(_spec(name.strip()))
    except ValueError:
        return get_compressor(name)


@functools.lru_cache(maxsize=32)
def codec_for(name: str, d: int) -> WireCodec:
    """:func:`wire_codec` of the compressor called ``name`` (:func:`compressor_from_name`),
    cached: codecs are stateless, and the clients of one process (a loopback run, a
    simulation) then share their compiled helpers instead of compiling them once each."""
    return wire_codec(compressor_from_name(name), d)
