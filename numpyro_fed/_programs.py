"""Compile once per program *content*: the one cache of compiled programs of the library.

JAX's :func:`jax.jit` keeps the trace of a Python function by the function's identity: a
function that reads a module global, a closure cell, a numpy array changed in place or a
mutable object gives the program of its first trace forever after. Keying a cache on the
objects a program was built from (a kernel, a model, a list of "settings") has the same
fault one level up. Here every call **traces again** (cheaper than compiling: measured
below) and lowers to StableHLO, and the compiled executable is looked up by a fingerprint
of what XLA compiles:

- the lowered module (its bytecode: every operation, shape, dtype, embedded constant and
  attribute -- donation and shardings included);
- the contents of the constants JAX hoists out of the module as arguments (with
  ``jax_use_simplified_jaxpr_constants``; none by default in JAX 0.10, where closed-over
  arrays are embedded in the module);
- the compiler options, the backend (platform and version), the devices, and every JAX
  configuration value that JAX itself puts in its jit cache key (``jax_enable_x64``, default
  matmul precision, ...);
- what the :class:`jax.stages.Compiled` object adds around the executable: the input and
  output pytree structures, the input and output types (weak types included), the arguments
  dead-code elimination kept and the donated ones.

So a cached executable is used only where compiling the fresh trace would give the same
executable: what JAX's persistent compilation cache guarantees across processes, here in
memory, with no disk read.

Lowering a large trace costs about a third of tracing it again (a repeated ``PKModel`` fit on
``nlme::Quinidine``: 3.1-3.7 s of the 9-10 s spent re-tracing its 7 programs). So a trace is
also fingerprinted as it is (:func:`_traced_key`: its jaxpr by value -- every equation's
primitive, operand types, parameters and literals, nested jaxprs, the constants' contents --
with the arguments' structure, sharding and devices, the output structure, donation, options,
backend and configuration); a trace
whose fingerprint lowered before is not lowered again. A trace with anything the fingerprint
cannot read by value (a host callback, an effect, a parameter of a type it does not know) is
lowered and keyed by its module as before. The test suite lowers every trace anyway and
raises if a known fingerprint lowers to another program (``NUMPYRO_FED_VERIFY_TRACE_KEYS``).

A program with a host callback (``jax.pure_callback``,
``io_callback``, ``jax.debug.print``) calls a Python function that the module does not show;
it is never cached (compiled on every call).

Measured on the toys of ``benchmarks/bench_ttfd.py`` (a loaded 2-core CPU): a second
1000-step ``CachedMCMC`` run traces and lowers its programs (the potential's initialiser, the
kernel's ``init``, the loop) in 0.1-0.35 s, against 0.45-1.0 s to compile them; the
fingerprints take 3-20 ms (4-9 ms with 1000 clients x 70 rows x d = 50: the data are
arguments of the programs, not constants).
"""

from __future__ import annotations

import contextlib
import contextvars
import enum
import functools
import hashlib
import io
import os
import threading
import types
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.extend.core as jcore
import numpy as np

from numpyro_fed import _serial_lapack

__all__ = ["Program", "compile_program", "program_key", "platform_options", "clear", "size",
           "stats", "replay_scope"]

#: most compiled programs kept (least recently used first out)
MAX_PROGRAMS = 128

_CACHE: OrderedDict[tuple, Any] = OrderedDict()
#: trace fingerprint (:func:`_traced_key`) -> the key in ``_CACHE`` its lowering had
_TRACE_KEYS: OrderedDict[tuple, tuple] = OrderedDict()
_LOCK = threading.Lock()
_STATS = {"hits": 0, "misses": 0, "uncached": 0, "trace_hits": 0, "replay_hits": 0}
#: lower every trace, also those whose trace fingerprint is known, and raise if the lowered
#: program is not the one that fingerprint gave before (the test suite sets it:
#: ``NUMPYRO_FED_VERIFY_TRACE_KEYS=1``)
VERIFY_TRACE_KEYS = os.environ.get("NUMPYRO_FED_VERIFY_TRACE_KEYS", "0") == "1"


def clear() -> None:
    """Forget every compiled program."""
    with _LOCK:
        _CACHE.clear()
        _TRACE_KEYS.clear()
        _REPLAYS.clear()


def size(tag: str | None = None) -> int:
    """Number of compiled programs held (those compiled with this ``tag``, if given)."""
    with _LOCK:
        return sum(1 for _, t in _CACHE.values() if tag is None or t == tag)


def stats() -> dict[str, int]:
    """Counters since the process started: ``hits`` (a compiled program reused), ``misses``
    (compiled and kept), ``uncached`` (compiled, never kept: host callbacks), ``trace_hits``
    (the hits found by the trace's fingerprint, without lowering it)."""
    with _LOCK:
        return dict(_STATS)


#: prefixes of the XLA options the library tunes for XLA:CPU (the fusion emitters, LLVM's
#: optimisation level): dropped on other backends, whose compilers reject ``xla_cpu_*``
#: options ("No such compile option", measured with jax 0.11 on CUDA) and keep their own
#: defaults
CPU_TUNED_OPTIONS = ("xla_cpu_", "xla_backend_optimization_level")


def platform_options(compiler_options: dict | None, platform: str | None = None) -> dict:
    """``compiler_options`` for the backend the programs compile for (``platform``, default
    :func:`jax.default_backend`): all of them on the CPU, without the CPU-tuned ones
    (:data:`CPU_TUNED_OPTIONS`, :data:`UNROLLED_RNG`) elsewhere."""
    opts = dict(compiler_options or {})
    if (platform or jax.default_backend()) == "cpu":
        return opts
    return {k: v for k, v in opts.items()
            if not k.startswith(CPU_TUNED_OPTIONS) and k != UNROLLED_RNG}


#: a pseudo compiler option (part of the cache keys, never given to XLA): lower the program's
#: random-number generation with JAX's unrolled Threefry rounds rather than the rolled loop
#: that JAX emits on the CPU (:func:`unrolled_threefry`)
UNROLLED_RNG = "numpyro_fed_unrolled_threefry"

_THREEFRY_LOCK = threading.RLock()


@contextlib.contextmanager
def unrolled_threefry():
    """Lower ``threefry2x32`` with JAX's own unrolled rule (the one of every backend but the
    CPU) while the context is open.

    On the CPU JAX lowers each Threefry hash as a 5-trip ``while`` loop (smaller modules).
    XLA:CPU runs a loop trip as a sequence of small kernels and copies of the loop state:
    in the SAEM loop on Theophylline (12 subjects, 5 chains) the random numbers of an
    iteration ran about 1,500 such steps, and the unrolled rule made the whole fit 20%
    faster (0.56-0.58 s -> 0.42-0.46 s, 2-core CPU). The random bits are the same (the
    same integer rounds; checked by ``tests/test_programs_rng.py``); the programs around
    them may fuse differently, so their floating point can differ in the last bits from
    the rolled lowering's -- one lowering or the other, each run of a program is
    reproducible. JAX internals: without them (another JAX) the context does nothing."""
    try:
        from jax._src.interpreters import mlir
        from jax._src.random import threefry2x32 as tf

        prim = tf.threefry2x32_p
        table = mlir._platform_specific_lowerings["cpu"]
        rolled, generic = table[prim], mlir._lowerings[prim]
    except (ImportError, AttributeError, KeyError):
        yield
        return
    with _THREEFRY_LOCK:
        table[prim] = generic
        try:
            yield
        finally:
            table[prim] = rolled


def _xla_options(opts: dict) -> dict | None:
    """The options given to XLA (:data:`UNROLLED_RNG` is the library's own)."""
    out = {k: v for k, v in opts.items() if k != UNROLLED_RNG}
    return out or None


def _config_fingerprint() -> str:
    """The JAX configuration values that are part of JAX's own jit cache key."""
    try:
        from jax._src import config as _config

        values = _config.trace_context()
    except Exception:  # noqa: BLE001 -- a JAX without it: the flag that matters most
        values = (bool(jax.config.jax_enable_x64),)
    keep = []
    for v in values:
        if v is None or isinstance(v, (bool, int, float, str)):
            keep.append(repr(v))
        elif hasattr(v, "name") and hasattr(v, "value"):  # enums
            keep.append(repr(v))
        elif isinstance(v, tuple) and all(isinstance(u, (bool, int, float, str)) for u in v):
            keep.append(repr(v))
        else:  # axis environments, meshes: empty at the top level, shown by the module
            keep.append(type(v).__name__)
    return "|".join(keep) + f"|x64={bool(jax.config.jax_enable_x64)}"


def _array_digest(h, x) -> None:
    a = np.asarray(x)
    h.update(repr((a.shape, a.dtype.str)).encode())
    h.update(np.ascontiguousarray(a).view(np.uint8).reshape(-1).data
             if a.dtype != object else repr(a.tolist()).encode())


def _module_bytes(module) -> bytes:
    """The module's bytecode without its debug information (source locations: they name
    the caller's line, which does not change the program), as JAX's persistent cache key."""
    from jax._src.lib.mlir import passmanager

    with module.context:
        clone = module.operation.clone()
        passmanager.PassManager.parse("builtin.module(strip-debuginfo)").run(clone)
        buf = io.BytesIO()
        clone.write_bytecode(file=buf)
    return buf.getvalue()


def _has_callbacks(lowering) -> bool:
    args = lowering.compile_args
    return bool(args.get("host_callbacks") or args.get("keepalive")
                or args.get("ordered_effects") or args.get("unordered_effects"))


def _key(lowered, options: tuple) -> tuple | None:
    """The cache key of a lowered program, or ``None`` when it must not be cached (host
    callbacks, or anything this JAX version does not let us read: never a guess)."""
    try:
        return _key_of(lowered, options)
    except Exception:  # noqa: BLE001 -- unreadable: compile, do not cache
        return None


def _key_of(lowered, options: tuple) -> tuple | None:
    lowering = lowered._lowering
    if _has_callbacks(lowering):
        return None
    h = hashlib.blake2b(digest_size=32)
    h.update(_module_bytes(lowering.stablehlo()))
    for c in lowering.const_args:
        _array_digest(h, c)
    args = lowering.compile_args
    backend = args["backend"]
    h.update(repr(options).encode())
    h.update(f"{backend.platform}|{backend.platform_version}".encode())
    h.update(_config_fingerprint().encode())
    donated = tuple(bool(getattr(a, "donated", False))
                    for a in jax.tree.leaves(lowered.args_info))
    return (h.digest(), lowered.in_tree, lowered.out_tree,
            tuple(args["global_in_avals"]), tuple(args["global_out_avals"]),
            frozenset(args["kept_var_idx"]), donated,
            tuple(str(d) for d in jax.devices(backend.platform)[:args["num_devices"]]))


class _Unkeyable(Exception):
    """A trace holding something :func:`_traced_key` cannot fingerprint by value."""


#: parameters that hold Python functions the lowering never calls: a ``custom_jvp_call`` or
#: ``custom_vjp_call`` is lowered from its ``call_jaxpr`` alone (its derivative rules were
#: applied, if at all, when the program was traced and differentiated)
_LOWERING_UNUSED = {("custom_jvp_call", "jvp_jaxpr_fun"), ("custom_jvp_call", "jvp_jaxpr_thunk"),
                    ("custom_vjp_call", "fwd_jaxpr_thunk"), ("custom_vjp_call", "bwd"),
                    ("custom_vjp_call", "out_trees")}
_SCALARS = (type(None), bool, int, float, complex, str, bytes, range, slice)


def _feed_value(h, v, depth: int = 0) -> None:
    """Feed a jaxpr parameter into ``h`` by value, or raise :class:`_Unkeyable`."""
    if depth > 64:
        raise _Unkeyable("nested too deep")
    if isinstance(v, _SCALARS):
        h.update(f"{type(v).__name__}:{v!r};".encode())
    elif isinstance(v, jcore.ClosedJaxpr):
        h.update(b"closed{")
        _feed_jaxpr(h, v.jaxpr, v.consts, depth + 1)
        h.update(b"}")
    elif isinstance(v, jcore.Jaxpr):
        h.update(b"open{")
        _feed_jaxpr(h, v, (), depth + 1)
        h.update(b"}")
    elif isinstance(v, (np.ndarray, np.generic, jax.Array)):
        h.update(b"array:")
        _array_digest(h, v)
    elif isinstance(v, np.dtype) or (isinstance(v, type) and issubclass(v, np.generic)):
        h.update(f"dtype:{np.dtype(v).str};".encode())
    elif isinstance(v, tuple | list):
        # NamedTuples (GatherDimensionNumbers, custom_linear_solve's jaxprs) by type too
        h.update(f"{type(v).__module__}.{type(v).__qualname__}(".encode())
        for u in v:
            _feed_value(h, u, depth + 1)
        h.update(b")")
    elif isinstance(v, frozenset | set):
        raise _Unkeyable("a set parameter")
    elif isinstance(v, enum.Enum):
        h.update(f"{type(v).__module__}.{type(v).__qualname__}.{v.name};".encode())
    elif type(v).__module__.startswith("jax.") and type(v).__name__ in _REPR_TYPES:
        h.update(f"{type(v).__name__}:{v!r};".encode())
    else:  # a function, an object of a type not listed: never a guess
        raise _Unkeyable(f"a parameter of type {type(v).__name__}")


#: JAX parameter types fingerprinted by ``repr`` (value objects whose repr shows all they
#: hold: meshes, shardings, layouts, precisions)
_REPR_TYPES = {"Mesh", "AbstractMesh", "UnspecifiedValue", "NamedSharding",
               "SingleDeviceSharding", "PartitionSpec", "AutoLayout", "Layout", "Format"}


def _feed_aval(h, aval) -> None:
    h.update(f"{aval.str_short(short_dtypes=False)}|w{int(getattr(aval, 'weak_type', 0))}"
             f"|{type(aval).__name__};".encode())


def _feed_jaxpr(h, jaxpr, consts, depth: int) -> None:
    """Feed a jaxpr's structure into ``h``: its variables numbered in order of appearance
    with their types, every equation's primitive, operands and parameters, literals and
    constants by value."""
    if jaxpr.effects:
        raise _Unkeyable("effects")
    ids: dict[int, int] = {}

    def define(v):
        if isinstance(v, jcore.DropVar):
            h.update(b"_;")
            return
        ids[id(v)] = len(ids)
        _feed_aval(h, v.aval)

    def use(a):
        if isinstance(a, jcore.Literal):
            h.update(b"lit:")
            _feed_aval(h, a.aval)
            _feed_value(h, np.asarray(a.val), depth + 1)
        else:
            h.update(f"v{ids[id(a)]};".encode())

    h.update(f"consts{len(jaxpr.constvars)}:".encode())
    for v in jaxpr.constvars:
        define(v)
    for c in consts:
        _feed_value(h, c, depth + 1)
    h.update(f"in{len(jaxpr.invars)}:".encode())
    for v in jaxpr.invars:
        define(v)
    for e in jaxpr.eqns:
        if e.effects:
            raise _Unkeyable("effects")
        name = e.primitive.name
        h.update(f"eqn:{name}(".encode())
        for a in e.invars:
            use(a)
        h.update(b")[")
        for k in sorted(e.params):
            if (name, k) in _LOWERING_UNUSED:
                continue
            h.update(f"{k}=".encode())
            _feed_value(h, e.params[k], depth + 1)
        h.update(b"]->")
        for v in e.outvars:
            define(v)
    h.update(b"out:")
    for a in jaxpr.outvars:
        use(a)


def _placement(x) -> tuple | None:
    """Where an argument lives, as the lowering sees it: the sharding and device assignment
    of a JAX array (a committed one is lowered with its sharding), ``None`` for the others."""
    if not isinstance(x, jax.Array):
        return None
    sh = x.sharding
    devices = tuple(d.id for d in getattr(sh, "_device_assignment", ()) or ())
    return (repr(sh), devices, bool(getattr(x, "committed", getattr(x, "_committed", True))))


def _traced_key(traced, leaves: Sequence, treedef, options: tuple, donated: tuple,
                keep_unused: bool) -> tuple | None:
    """A fingerprint of a trace (``jax.stages.Traced``) of the flat program of arguments
    ``leaves`` (structure ``treedef``) that determines its lowered program: the jaxpr by
    value (:func:`_feed_jaxpr`), where each argument lives (:func:`_placement`), the input
    and output structures, the donated arguments, the compiler options, backend, devices and
    JAX configuration. ``None`` when something in it cannot be fingerprinted by value (a
    Python callback, an effect, a parameter of an unknown type): then the trace is lowered
    and keyed by its module, as before."""
    try:
        h = hashlib.blake2b(digest_size=32)
        _feed_jaxpr(h, traced.jaxpr.jaxpr, traced.jaxpr.consts, 0)
        backend = jax.default_backend()
        h.update(repr((options, donated, bool(keep_unused), backend)).encode())
        h.update(repr(tuple(_placement(x) for x in leaves)).encode())
        h.update(_config_fingerprint().encode())
        devices = tuple(str(d) for d in jax.devices(backend))
        return (h.digest(), treedef, traced.out_tree, traced.fun_name, devices)
    except _Unkeyable:
        return None
    except Exception:  # noqa: BLE001 -- a JAX whose jaxprs we cannot read: lower, as before
        return None


def _fresh(fn: Callable) -> Callable:
    """A new function object calling ``fn``: JAX's tracing caches (keyed by the function's
    identity) cannot serve an earlier trace of it."""

    def program(*args, **kwargs):
        return fn(*args, **kwargs)

    name = getattr(fn, "__name__", None)
    if isinstance(name, str):
        program.__name__ = program.__qualname__ = name
    return program


def _traced(args: Sequence, kwargs: dict) -> bool:
    leaves = jax.tree.leaves((args, kwargs))
    return any(isinstance(v, jax.core.Tracer) for v in leaves)


def _flat_program(fn: Callable, args: Sequence, kwargs: dict,
                  donate_argnums: int | Sequence[int]):
    """``(program, leaves, treedef, donated leaf indices)``: ``fn`` as a function of the
    flat leaves of ``(args, kwargs)``. The executable then takes plain arrays, whatever
    pytrees the arguments are (a pytree whose flattening keeps non-array leaves in its
    metadata, as :class:`~numpyro_fed.partition.ClientPartition` does, would not match its
    own ``Compiled`` signature), and the structure is a key of the cache."""
    leaves, treedef = jax.tree.flatten((tuple(args), dict(kwargs)))
    donate = (donate_argnums,) if isinstance(donate_argnums, int) else tuple(donate_argnums)
    donated, start = [], 0
    for i, a in enumerate(args):
        n = len(jax.tree.leaves(a))
        if i in donate:
            donated.extend(range(start, start + n))
        start += n

    def program(*flat):
        a, k = jax.tree.unflatten(treedef, flat)
        return fn(*a, **k)

    name = getattr(fn, "__name__", None)
    if isinstance(name, str):
        program.__name__ = program.__qualname__ = name
    return program, leaves, treedef, tuple(donated)


class _Runner:
    """Runs a compiled flat program on arguments of the structure it was traced with."""

    __slots__ = ("compiled", "treedef", "key")

    def __init__(self, compiled, treedef, key: tuple | None = None) -> None:
        #: ``key``: the program's key in the cache (``None``: not kept)
        self.compiled, self.treedef, self.key = compiled, treedef, key

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        leaves, treedef = jax.tree.flatten((tuple(args), dict(kwargs)))
        if treedef != self.treedef:
            raise TypeError("A compiled program was called with arguments of another "
                            f"structure: compiled for {self.treedef}, given {treedef}.")
        return self.compiled(*leaves)


def _trace(fn, args, kwargs, opts, donate_argnums, keep_unused):
    """``(traced, leaves, treedef, donated)``: ``fn`` traced afresh as a flat program."""
    program, leaves, treedef, donated = _flat_program(fn, args, kwargs, donate_argnums)
    jitted = jax.jit(program, donate_argnums=donated, keep_unused=keep_unused,
                     compiler_options=_xla_options(opts))
    return jitted.trace(*leaves), leaves, treedef, donated


def _lower(fn, args, kwargs, opts, donate_argnums, keep_unused):
    traced, leaves, treedef, donated = _trace(fn, args, kwargs, opts, donate_argnums,
                                              keep_unused)
    return _lower_traced(traced, leaves, treedef, opts, donated, keep_unused)


def _lower_traced(traced, leaves, treedef, opts, donated, keep_unused):
    if jax.default_backend() == "cpu":
        # batched LAPACK calls one at a time: two at once can hang XLA:CPU for ever
        serial = _serial_lapack.serialise(traced)
        if serial is not None:
            serial.__name__ = serial.__qualname__ = traced.fun_name
            traced = jax.jit(serial, donate_argnums=donated, keep_unused=keep_unused,
                             compiler_options=_xla_options(opts)).trace(*leaves)
    with (unrolled_threefry() if opts.get(UNROLLED_RNG) else contextlib.nullcontext()):
        return traced.lower(), treedef


class Pending:
    """A program traced, lowered and keyed but not compiled yet (:func:`prepare_program`):
    :meth:`finish` compiles it (XLA releases the GIL: another thread may run it while this
    one traces) and keeps it in the cache."""

    __slots__ = ("lowered", "key", "treedef", "tag")

    def __init__(self, lowered, key, treedef, tag: str) -> None:
        self.lowered, self.key, self.treedef, self.tag = lowered, key, treedef, tag

    def finish(self) -> _Runner:
        """Compile (or take the program that another caller compiled meanwhile)."""
        if self.key is None:  # never kept: host callbacks
            with _LOCK:
                _STATS["uncached"] += 1
            return _Runner(self.lowered.compile(), self.treedef)
        with _LOCK:
            hit = _CACHE.get(self.key)
            if hit is not None:
                _CACHE.move_to_end(self.key)
                _STATS["hits"] += 1
                return _Runner(hit[0], self.treedef, self.key)
        compiled = self.lowered.compile()
        with _LOCK:
            _STATS["misses"] += 1
            _CACHE[self.key] = (compiled, self.tag)
            while len(_CACHE) > MAX_PROGRAMS:
                _CACHE.popitem(last=False)
        return _Runner(compiled, self.treedef, self.key)


# ------------------------------------------------------------------------ replayed runs
#: the programs of recent runs, by run key (:func:`replay_scope`): the paths recorded under
#: the key, newest first, each the ordered ``((signature, program key), ...)`` of every
#: program one run prepared
_REPLAYS: OrderedDict[tuple, tuple] = OrderedDict()
#: most run keys remembered (least recently used first out)
MAX_REPLAYS = 64
#: most paths remembered per run key. Runs under one key can prepare different programs
#: where the numbers decide (a convergence check that examines a variance ending near 0 on
#: one seed and not on another): with one path remembered, two seeds taking turns each
#: traced again what the other had replaced (Theophylline, 5 rounds of 2 seeds: 2 of 5
#: repeated fits 0.4-0.6 s longer)
REPLAY_PATHS = 4
_SCOPE: contextvars.ContextVar = contextvars.ContextVar("numpyro_fed_replay", default=None)


class ReplayScope:
    """The programs one run prepares, in order, under a key that determines them
    (:func:`replay_scope`). A later run under the same key takes the program of its n-th
    :func:`prepare_program` call from the n-th program of a recorded run, without tracing
    it, as long as every call so far had the signature recorded for it in that run (the
    function's code and that of the functions it closes over, the arguments' structure,
    types and placement, the compiler options); from the first call that no recorded run
    with the same calls so far had (or that two of them ran with different programs) it
    traces, as every call does without a scope. Up to :data:`REPLAY_PATHS` runs are
    remembered per key. A run that raises is not recorded."""

    __slots__ = ("key", "recorded", "pos", "replaying", "seen", "active", "suspended")

    def __init__(self, key: tuple | None) -> None:
        self.key, self.recorded, self.pos, self.replaying = key, None, 0, True
        self.seen: list = []
        self.active = False
        #: programs prepared while suspended are neither replayed nor recorded
        #: (:meth:`suspend`: speculative compilations whose timing decides what they do)
        self.suspended = False

    @contextlib.contextmanager
    def suspend(self):
        """Prepare programs as without a scope (traced, not recorded) inside the block."""
        old, self.suspended = self.suspended, True
        try:
            yield
        finally:
            self.suspended = old

    def activate(self, extra: Any = ()) -> None:
        """Start replaying and recording, with ``extra`` (what the run found before its
        first program: e.g. which data the model reads concretely) added to the key."""
        if self.key is None or self.active:
            return
        try:
            self.key = (self.key, extra)
            hash(self.key)
        except TypeError:
            self.key = None
            return
        with _LOCK:
            self.recorded = _REPLAYS.get(self.key)
            if self.recorded is not None:
                _REPLAYS.move_to_end(self.key)
        self.active = True

    @property
    def replays(self) -> bool:
        """Whether this run follows a recorded one so far."""
        return self.active and self.replaying and bool(self.recorded)

    def next_key(self, sig: tuple) -> tuple | None:
        """The program key the recorded runs that made the same calls so far had at this
        call, if they had this signature and agree on its program."""
        if not self.replays:
            return None
        pos = self.pos
        paths = tuple(p for p in self.recorded if pos < len(p) and p[pos][0] == sig)
        keys = {p[pos][1] for p in paths}
        if len(keys) != 1:
            self.replaying = False
            return None
        self.recorded = paths  # those still followed: the same calls, the same programs
        self.pos += 1
        return next(iter(keys))

    def note(self, sig: tuple, key: tuple | None) -> None:
        self.seen.append((sig, key))

    def store(self) -> None:
        if not self.active or not self.seen:
            return
        seen = tuple(self.seen)
        with _LOCK:
            old = tuple(p for p in _REPLAYS.get(self.key, ()) if p != seen)
            _REPLAYS[self.key] = ((seen,) + old)[:REPLAY_PATHS]
            _REPLAYS.move_to_end(self.key)
            while len(_REPLAYS) > MAX_REPLAYS:
                _REPLAYS.popitem(last=False)


@contextlib.contextmanager
def replay_scope(key: tuple | None):
    """Run a block whose programs are determined by ``key``: the first run under a key
    records the programs its :func:`prepare_program` calls give, in order; a later run
    under an equal key gets them back without tracing (see :class:`ReplayScope`).

    ``key`` must determine every program the block prepares, given the library's code: the
    caller keys by value all it builds them from (the run's model is keyed by the
    fingerprint of a full trace of it, its data and settings by content:
    :func:`numpyro_fed.saem.memo.run_key`). ``None``: no replay (every call traces).
    Nothing is replayed until :meth:`ReplayScope.activate`. With
    ``NUMPYRO_FED_VERIFY_TRACE_KEYS=1`` (the test suite) every replayed program is traced
    anyway and a program other than the recorded one raises ``RuntimeError``."""
    scope = ReplayScope(key)
    token = _SCOPE.set(scope)
    try:
        yield scope
    except BaseException:
        scope.active = False
        raise
    finally:
        _SCOPE.reset(token)
    scope.store()


def current_scope() -> ReplayScope | None:
    """The :class:`ReplayScope` of the run on this thread, if any (active or not)."""
    return _SCOPE.get()


def active_scope() -> ReplayScope | None:
    """The active :class:`ReplayScope` of the run on this thread, if any (not while
    suspended)."""
    scope = _SCOPE.get()
    return scope if scope is not None and scope.active and not scope.suspended else None


def note_runner(runner: _Runner, fn: Callable, args: Sequence = (), kwargs: dict | None = None,
                *, compiler_options: dict | None = None,
                donate_argnums: int | Sequence[int] = (), keep_unused: bool = False) -> None:
    """Record in the active :class:`ReplayScope` that ``fn`` on ``args`` is run by
    ``runner``, a program prepared earlier (e.g. while the scope was suspended), as if
    :func:`prepare_program` had been called here: a replayed run then takes the same
    program at the same call. Nothing without an active scope."""
    scope = active_scope()
    if scope is None:
        return
    opts = platform_options(compiler_options)
    leaves, treedef = jax.tree.flatten((tuple(args), dict(kwargs or {})))
    sig = _signature(fn, leaves, treedef, tuple(sorted(opts.items())), donate_argnums,
                     keep_unused)
    if sig is None or runner.key is None:
        scope.active = False
        return
    replayed = scope.next_key(sig)
    if replayed is not None and replayed != runner.key:
        raise RuntimeError(
            f"numpyro_fed._programs: a replayed run ran another program than the recorded "
            f"run at call {scope.pos} ({getattr(fn, '__qualname__', fn)!r}) -- a defect of "
            "the run key (please report it).")
    scope.note(sig, runner.key)


def _code_fingerprint(fn, depth: int = 0, seen: set | None = None):
    """The code of ``fn`` and of the functions it closes over (recursively): which program
    a call prepares, up to the values it closes over (those are determined by the run's
    key). ``None`` for a callable it cannot read."""
    seen = set() if seen is None else seen
    if id(fn) in seen or depth > 6:
        return "..."
    seen.add(id(fn))
    if isinstance(fn, functools.partial):
        inner = _code_fingerprint(fn.func, depth + 1, seen)
        return None if inner is None else ("partial", inner)
    if isinstance(fn, types.MethodType):
        inner = _code_fingerprint(fn.__func__, depth + 1, seen)
        return None if inner is None else ("method", type(fn.__self__), inner)
    code = getattr(fn, "__code__", None)
    if not isinstance(code, types.CodeType):
        return None
    parts = [code]
    for cell in getattr(fn, "__closure__", None) or ():
        try:
            v = cell.cell_contents
        except ValueError:  # an empty cell
            continue
        if isinstance(v, (types.FunctionType, types.MethodType, functools.partial)):
            inner = _code_fingerprint(v, depth + 1, seen)
            if inner is None:
                return None
            parts.append(inner)
    return tuple(parts)


def _signature(fn, leaves, treedef, options, donate_argnums, keep_unused) -> tuple | None:
    code = _code_fingerprint(fn)
    if code is None:
        return None
    avals = []
    for x in leaves:
        if isinstance(x, jax.ShapeDtypeStruct):  # an abstract argument (warming)
            avals.append(("abstract", x.shape, x.dtype, bool(x.weak_type),
                          repr(x.sharding)))
            continue
        t = jax.typeof(x) if isinstance(x, jax.Array | np.ndarray | np.generic) else None
        if t is None:
            avals.append(("py", type(x), x if isinstance(x, _SCALARS) else id(x)))
        else:
            avals.append((t.shape, t.dtype, bool(getattr(t, "weak_type", False)),
                          _placement(x)))
    donate = (donate_argnums,) if isinstance(donate_argnums, int) else tuple(donate_argnums)
    return (code, treedef, tuple(avals), options, donate, bool(keep_unused))


def prepare_program(fn: Callable, args: Sequence = (), kwargs: dict | None = None, *,
                    compiler_options: dict | None = None,
                    donate_argnums: int | Sequence[int] = (),
                    keep_unused: bool = False, tag: str = "") -> Callable:
    """:func:`compile_program` up to the compilation: the runner of a program found in the
    cache, else a :class:`Pending` program to :meth:`~Pending.finish`. Under a JAX
    transformation, ``jax.jit(fn)`` as :func:`compile_program` returns it."""
    kwargs = kwargs or {}
    opts = platform_options(compiler_options)
    if _traced(args, kwargs):
        return jax.jit(_fresh(fn), donate_argnums=donate_argnums, keep_unused=keep_unused,
                       compiler_options=_xla_options(opts))
    options = tuple(sorted(opts.items()))
    scope = active_scope()
    sig = replayed = None
    if scope is not None:
        leaves, treedef = jax.tree.flatten((tuple(args), dict(kwargs)))
        sig = _signature(fn, leaves, treedef, options, donate_argnums, keep_unused)
        replayed = None if sig is None else scope.next_key(sig)
        if sig is None:  # a callable whose code cannot be compared: no replay, no record
            scope.active = False
        if replayed is not None and not VERIFY_TRACE_KEYS:
            with _LOCK:
                hit = _CACHE.get(replayed)
                if hit is not None:  # the recorded run's program: not traced again
                    _CACHE.move_to_end(replayed)
                    _STATS["hits"] += 1
                    _STATS["replay_hits"] += 1
            if hit is not None:
                scope.note(sig, replayed)
                return _Runner(hit[0], treedef, replayed)
    out = _prepare_traced(fn, args, kwargs, opts, options, donate_argnums, keep_unused, tag)
    if sig is not None:
        key = out.key
        if replayed is not None and key != replayed:
            raise RuntimeError(
                f"numpyro_fed._programs: a replayed run prepared another program than the "
                f"recorded run at call {scope.pos} ({getattr(fn, '__qualname__', fn)!r}) -- a "
                "defect of the run key (please report it).")
        scope.note(sig, key)
    return out


def _prepare_traced(fn, args, kwargs, opts, options, donate_argnums, keep_unused, tag):
    """:func:`prepare_program` by tracing ``fn`` (a runner with its ``key``, or a
    :class:`Pending` program)."""
    traced, leaves, treedef, donated = _trace(fn, args, kwargs, opts, donate_argnums,
                                              keep_unused)
    jkey = _traced_key(traced, leaves, treedef, options, donated, keep_unused)
    if jkey is not None and not VERIFY_TRACE_KEYS:
        with _LOCK:
            key = _TRACE_KEYS.get(jkey)
            hit = None if key is None else _CACHE.get(key)
            if hit is not None:  # the same trace: the same module, not lowered again
                _TRACE_KEYS.move_to_end(jkey)
                _CACHE.move_to_end(key)
                _STATS["hits"] += 1
                _STATS["trace_hits"] += 1
                return _Runner(hit[0], treedef, key)
    lowered, treedef = _lower_traced(traced, leaves, treedef, opts, donated, keep_unused)
    key = _key(lowered, options)
    if key is None:
        return Pending(lowered, None, treedef, tag)
    key = (key, treedef)
    if jkey is not None:
        with _LOCK:
            known = _TRACE_KEYS.get(jkey)
            if known is not None and known != key:
                raise RuntimeError(
                    f"numpyro_fed._programs: two traces of {traced.fun_name!r} with the same "
                    "trace key lowered to different programs -- a defect of the trace key "
                    "(please report it).")
            _TRACE_KEYS[jkey] = key
            _TRACE_KEYS.move_to_end(jkey)
            while len(_TRACE_KEYS) > 4 * MAX_PROGRAMS:
                _TRACE_KEYS.popitem(last=False)
    with _LOCK:
        hit = _CACHE.get(key)
        if hit is not None:
            _CACHE.move_to_end(key)
            _STATS["hits"] += 1
            return _Runner(hit[0], treedef, key)
    return Pending(lowered, key, treedef, tag)


def compile_program(fn: Callable, args: Sequence = (), kwargs: dict | None = None, *,
                    compiler_options: dict | None = None,
                    donate_argnums: int | Sequence[int] = (),
                    keep_unused: bool = False, tag: str = "") -> Callable:
    """``fn`` traced afresh on ``args``, compiled or taken from the cache: a callable that
    runs the compiled program on arguments of the same structure and types as ``args``.

    ``tag`` labels the entry for :func:`size`; it is not part of the key.

    Under a JAX transformation (tracer arguments) there is nothing to compile: the result is
    ``jax.jit(fn)``, traced into the enclosing program.
    """
    out = prepare_program(fn, args, kwargs, compiler_options=compiler_options,
                          donate_argnums=donate_argnums, keep_unused=keep_unused, tag=tag)
    return out.finish() if isinstance(out, Pending) else out


def program_key(fn: Callable, args: Sequence = (), kwargs: dict | None = None, *,
                compiler_options: dict | None = None) -> tuple | None:
    """The cache key of ``fn`` traced afresh on ``args`` (nothing is compiled): equal keys
    mean the same compiled program. ``None`` for a program that cannot be keyed (host
    callbacks, or tracer arguments)."""
    kwargs = kwargs or {}
    if _traced(args, kwargs):
        return None
    opts = platform_options(compiler_options)
    lowered, treedef = _lower(fn, args, kwargs, opts, (), False)
    key = _key(lowered, tuple(sorted(opts.items())))
    return None if key is None else (key, treedef)


class Program:
    """A :func:`jax.jit`-like callable whose compiled programs are cached by content (see
    the module docstring): every call traces ``fn`` again and reuses an executable only
    when the fresh trace lowers to the same program.

    :param fn: the function to compile.
    :param compiler_options: XLA options (``jax.jit(compiler_options=...)``).
    :param donate_argnums: as :func:`jax.jit`.
    """

    def __init__(self, fn: Callable, *, compiler_options: dict | None = None,
                 donate_argnums: int | Sequence[int] = (), keep_unused: bool = False,
                 tag: str = "") -> None:
        self.fn = fn
        self.compiler_options = dict(compiler_options or {})
        self.donate_argnums = donate_argnums
        self.keep_unused = keep_unused
        self.tag = tag
        name = getattr(fn, "__name__", None)
        if isinstance(name, str):
            self.__name__ = name

    def compiled(self, *args: Any, **kwargs: Any) -> Callable:
        """The compiled program for these arguments (traced now, compiled if new)."""
        return compile_program(self.fn, args, kwargs, compiler_options=self.compiler_options,
                               donate_argnums=self.donate_argnums,
                               keep_unused=self.keep_unused, tag=self.tag)

    def prepare(self, *args: Any, **kwargs: Any) -> Callable:
        """:meth:`compiled` up to the compilation (:func:`prepare_program`): a runner, or a
        :class:`Pending` program whose :meth:`~Pending.finish` compiles it."""
        return prepare_program(self.fn, args, kwargs, compiler_options=self.compiler_options,
                               donate_argnums=self.donate_argnums,
                               keep_unused=self.keep_unused, tag=self.tag)

    def note(self, runner: _Runner, *args: Any, **kwargs: Any) -> None:
        """:func:`note_runner`: ``runner`` (prepared earlier) runs this program on these
        arguments."""
        note_runner(runner, self.fn, args, kwargs, compiler_options=self.compiler_options,
                    donate_argnums=self.donate_argnums, keep_unused=self.keep_unused)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.compiled(*args, **kwargs)(*args, **kwargs)
