"""Wire formats of the compressed messages: what actually crosses the network.

Each :class:`~numpyro_fed.compressors.Compressor` declares the coded length of a message
(``bits`` returned by ``fn``). :func:`wire_codec` gives, for the compressors of
:mod:`numpyro_fed.compressors`, a bit-exact serialisation whose payload is *that* many bits
(padded to whole bytes), so the bits on the wire can be checked against the declared bits.
The codec is chosen by the compressor's structured
:attr:`~numpyro_fed.compressors.Compressor.spec` (kind and parameters), never by its display
name; a custom compressor (``spec=None``) has no wire format and is refused with the list of
deployable ones:

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
from collections.abc import Callable
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from numpyro_fed.compressors import Compressor, CompressorSpec, ceil_log2, get_compressor
from numpyro_fed.errors import WireFormatError  # re-exported: defined here before errors.py

__all__ = [
    "WireCodec",
    "WireFormatError",
    "codec_for",
    "compressor_from_name",
    "dense_codec",
    "deployable_spec",
    "wire_codec",
]


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


def _top_k_indices(k: int):
    return lambda key, v: lax.top_k(jnp.abs(v), k)[1]


def _rand_k_indices(k: int):
    return lambda key, v: lax.top_k(jax.random.bits(key, (v.shape[0],), dtype=jnp.uint32), k)[1]


#: The compressor kinds (:class:`~numpyro_fed.compressors.CompressorSpec` ``kind``) that have a
#: wire format, each with its codec ``(spec, compressor, d) -> WireCodec``. A new compressor
#: kind becomes deployable by adding its codec here.
_CODECS: dict[str, Callable[[CompressorSpec, Compressor, int], WireCodec]] = {
    "identity": lambda spec, comp, d: dense_codec(d),
    "quantize": lambda spec, comp, d: _quantize_codec(comp.name, d, spec.param("s"), comp),
    "top_k": lambda spec, comp, d: _sparse_codec(
        comp.name, d, spec.param("k"), comp, _top_k_indices(spec.param("k"))),
    "rand_k": lambda spec, comp, d: _sparse_codec(
        comp.name, d, spec.param("k"), comp, _rand_k_indices(spec.param("k"))),
}

_DEPLOYABLE = ("identity(), quantize(...), top_k(...), rand_k(...) and scaled(...) of "
               "quantize/rand_k, with 32-bit floats (float_bits=32)")


def _check_deployable(spec: CompressorSpec | None, name: str) -> CompressorSpec:
    if spec is None:
        raise ValueError(
            f"No wire format for compressor {name!r}: it carries no `spec` (a custom "
            f"Compressor, or one built from one), so the Flower deployment cannot serialise "
            f"its messages. Deployable compressors: {_DEPLOYABLE}."
        )
    if spec.inner is not None:
        _check_deployable(spec.inner, name)
    elif spec.kind not in _CODECS:
        raise ValueError(
            f"No wire format for compressor {name!r} (kind {spec.kind!r}). Deployable "
            f"compressors: {_DEPLOYABLE}."
        )
    elif spec.param("float_bits") != 32:
        raise ValueError(
            f"No wire format for compressor {name!r}: the wire carries float32 values, so "
            f"`float_bits` must be 32, got {spec.param('float_bits')}. Deployable "
            f"compressors: {_DEPLOYABLE}."
        )
    return spec


def wire_codec(compressor: Compressor | CompressorSpec | str | None, d: int) -> WireCodec:
    """The wire format of ``compressor`` for messages of dimension ``d``, chosen by its
    :attr:`~numpyro_fed.compressors.Compressor.spec` (kind and parameters).

    :param compressor: a compressor of :mod:`numpyro_fed.compressors`, its spec, or a string
        that :func:`~numpyro_fed.compressors.get_compressor` reads (``"quantize(s=16)"``).
    :param d: message dimension.
    :raises ValueError: for a compressor without a wire format (a custom ``Compressor``,
        whose ``spec`` is ``None``, or a ``float_bits`` other than 32), naming the
        deployable compressors.
    """
    comp = get_compressor(compressor)
    spec = _check_deployable(comp.spec, comp.name)
    if spec.inner is not None:  # scaled(C): C's message, the factor known to both sides
        inner_comp = spec.inner.build()
        inner = _CODECS[spec.inner.kind](spec.inner, inner_comp, d)
        return _scaled(inner, 1.0 / (inner_comp.omega(d) + 1.0), comp)
    return _CODECS[spec.kind](spec, comp, d)


def deployable_spec(compressor: Compressor | CompressorSpec | str | None, arg: str) -> str:
    """The canonical text (:attr:`~numpyro_fed.compressors.CompressorSpec.text`) of a
    compressor that the deployment can serialise, as a :class:`FlowerSpec
    <numpyro_fed.flower.protocol.FlowerSpec>` carries it.

    :param compressor: a compressor, its spec, or a string
        :func:`~numpyro_fed.compressors.get_compressor` reads.
    :param arg: the argument's name, for the error message.
    :raises ValueError: naming ``arg``, for an invalid compressor or one without a wire format.
    """
    try:
        comp = get_compressor(compressor)
        return _check_deployable(comp.spec, comp.name).text
    except (TypeError, ValueError, KeyError) as err:
        raise ValueError(
            f"`{arg}`={getattr(compressor, 'name', compressor)!r} is not a deployable "
            f"compressor ({err}); use e.g. 'identity', 'quantize(s=16)', 'top_k(k=2)' or "
            "'scaled(quantize(s=16))'."
        ) from err


def compressor_from_name(name: Compressor | CompressorSpec | str | None) -> Compressor:
    """A compressor from its :attr:`~numpyro_fed.compressors.Compressor.name` (its
    :attr:`~numpyro_fed.compressors.CompressorSpec.text`, as a
    :class:`~numpyro_fed.flower.protocol.FlowerSpec` carries it) or from any other form
    :func:`~numpyro_fed.compressors.get_compressor` reads (``"quantize:16"``)."""
    return get_compressor(name)


@functools.lru_cache(maxsize=32)
def codec_for(name: str, d: int) -> WireCodec:
    """:func:`wire_codec` of the compressor whose spec text is ``name``
    (:func:`compressor_from_name`), cached: codecs are stateless, and the clients of one
    process (a loopback run, a simulation) then share their compiled helpers instead of
    compiling them once each."""
    return wire_codec(compressor_from_name(name), d)
