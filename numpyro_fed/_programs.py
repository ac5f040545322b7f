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
memory, with no disk read. A program with a host callback (``jax.pure_callback``,
``io_callback``, ``jax.debug.print``) calls a Python function that the module does not show;
it is never cached (compiled on every call).

Measured on the toys of ``benchmarks/bench_ttfd.py`` (a loaded 2-core CPU): a second
1000-step ``CachedMCMC`` run traces and lowers its programs (the potential's initialiser, the
kernel's ``init``, the loop) in 0.1-0.35 s, against 0.45-1.0 s to compile them; the
fingerprints take 3-20 ms (4-9 ms with 1000 clients x 70 rows x d = 50: the data are
arguments of the programs, not constants).
"""

from __future__ import annotations

import hashlib
import io
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from numpyro_fed import _serial_lapack

__all__ = ["Program", "compile_program", "program_key", "platform_options", "clear", "size",
           "stats"]

#: most compiled programs kept (least recently used first out)
MAX_PROGRAMS = 128

_CACHE: OrderedDict[tuple, Any] = OrderedDict()
_LOCK = threading.Lock()
_STATS = {"hits": 0, "misses": 0, "uncached": 0}


def clear() -> None:
    """Forget every compiled program."""
    with _LOCK:
        _CACHE.clear()


def size(tag: str | None = None) -> int:
    """Number of compiled programs held (those compiled with this ``tag``, if given)."""
    with _LOCK:
        return sum(1 for _, t in _CACHE.values() if tag is None or t == tag)


def stats() -> dict[str, int]:
    """Counters since the process started: ``hits`` (a compiled program reused), ``misses``
    (compiled and kept), ``uncached`` (compiled, never kept: host callbacks)."""
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
    (:data:`CPU_TUNED_OPTIONS`) elsewhere."""
    opts = dict(compiler_options or {})
    if (platform or jax.default_backend()) == "cpu":
        return opts
    return {k: v for k, v in opts.items() if not k.startswith(CPU_TUNED_OPTIONS)}


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

    __slots__ = ("compiled", "treedef")

    def __init__(self, compiled, treedef) -> None:
        self.compiled, self.treedef = compiled, treedef

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        leaves, treedef = jax.tree.flatten((tuple(args), dict(kwargs)))
        if treedef != self.treedef:
            raise TypeError("A compiled program was called with arguments of another "
                            f"structure: compiled for {self.treedef}, given {treedef}.")
        return self.compiled(*leaves)


def _lower(fn, args, kwargs, opts, donate_argnums, keep_unused):
    program, leaves, treedef, donated = _flat_program(fn, args, kwargs, donate_argnums)
    jitted = jax.jit(program, donate_argnums=donated, keep_unused=keep_unused,
                     compiler_options=opts or None)
    traced = jitted.trace(*leaves)
    if jax.default_backend() == "cpu":
        # batched LAPACK calls one at a time: two at once can hang XLA:CPU for ever
        serial = _serial_lapack.serialise(traced)
        if serial is not None:
            serial.__name__ = serial.__qualname__ = program.__name__
            traced = jax.jit(serial, donate_argnums=donated, keep_unused=keep_unused,
                             compiler_options=opts or None).trace(*leaves)
    return traced.lower(), treedef


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
    kwargs = kwargs or {}
    opts = platform_options(compiler_options)
    if _traced(args, kwargs):
        return jax.jit(_fresh(fn), donate_argnums=donate_argnums, keep_unused=keep_unused,
                       compiler_options=opts or None)
    lowered, treedef = _lower(fn, args, kwargs, opts, donate_argnums, keep_unused)
    key = _key(lowered, tuple(sorted(opts.items())))
    if key is None:
        with _LOCK:
            _STATS["uncached"] += 1
        return _Runner(lowered.compile(), treedef)
    key = (key, treedef)
    with _LOCK:
        hit = _CACHE.get(key)
        if hit is not None:
            _CACHE.move_to_end(key)
            _STATS["hits"] += 1
            return _Runner(hit[0], treedef)
    compiled = lowered.compile()
    with _LOCK:
        _STATS["misses"] += 1
        _CACHE[key] = (compiled, tag)
        while len(_CACHE) > MAX_PROGRAMS:
            _CACHE.popitem(last=False)
    return _Runner(compiled, treedef)


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

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.compiled(*args, **kwargs)(*args, **kwargs)
