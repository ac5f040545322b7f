"""A drop-in :class:`numpyro.infer.MCMC` whose sampling loop is compiled once per program content.

NumPyro 0.22's ``MCMC.run`` traces and compiles its sampling loop again on **every** call,
for every kernel (NUTS included): ``numpyro.util.fori_collect`` wraps the loop body in a new
``jax.jit`` object each time and passes it to ``jit(_fori_collect_loop)`` as a *static*
argument, which JAX hashes by identity, so the compiled program of the previous run is never
found. On the toy problems of ``benchmarks/bench_ttfd.py`` that is 1-4 s per run on a 2-core
CPU for a loop that then samples in 0.1-0.5 s.

:class:`CachedMCMC` runs the same computation -- the kernel's ``init`` and ``sample``, the
same collection of the same fields with the same postprocessing, the same warmup, thinning
and chain handling -- through one jitted loop, kept in a process-wide cache of compiled
programs: a second ``run`` that would build the same program (a new ``CachedMCMC`` or the
same one, any ``rng_key``) compiles nothing. The loop's bounds are arguments of the program,
so ``progress_bar=True`` (NumPyro's default, which otherwise steps a separately compiled body
once per iteration from Python) runs the same program in about 20 chunks and updates the bar
between them, at the speed of ``progress_bar=False``.

**No stale program.** Every ``run`` builds the loop afresh and traces it (the kernel's
``sample``, the model, the postprocessing, as they are now), lowers it, and looks the
compiled executable up by a fingerprint of the lowered module (with the contents of its
constants, the compiler options, the backend and the JAX configuration:
:mod:`numpyro_fed._programs`). Whatever the program reads -- a module global or a closure
cell of the model, arrays in a dict or a tuple, a numpy array changed in place, a mutable
config object, any attribute of the kernel (its compressor, participation, step size),
``jax_enable_x64`` -- a change that changes the program is a new compilation, and a run
gives what ``MCMC`` gives. Nothing is keyed on object identity and nothing needs to be
cleared (:func:`clear_cache` only frees memory). A program with a host callback is compiled
on every run. Tracing and lowering cost 0.1-0.35 s per run on the toys of
``benchmarks/bench_ttfd.py``, against 0.45-1.0 s of compilation saved.

**Compiler options.** By default the loop is compiled with XLA's default options, the
program ``MCMC`` compiles: its draws are ``MCMC``'s bit for bit and it runs as fast.
``compiler_options="auto"`` selects :data:`LOOP_COMPILER_OPTIONS` on CPU, which compile
1.75-2.1x faster but run some loops slower (measured: QLSD++ with ``batch_size=1`` 1.2x
slower per step on the 20 x 500 x 20 toy, 1.46x on 50 x 1000 x 50; the other kernels within
the noise).

The cache holds at most :data:`MAX_LOOPS` programs (least recently used first out). The
loops of other processes are not kept: for a *new process* to skip compilation, turn on
JAX's persistent compilation cache with :func:`numpyro_fed.enable_compilation_cache` (it also
serves NumPyro's own ``MCMC``).

Falls back to NumPyro's own loop (same results, compiled every run) under a JAX transform
(``chain_method="parallel"`` or a callable ``chain_method``), for ensemble kernels, with
NumPyro's control flow disabled, and when a collected field has an extended dtype (typed PRNG
keys).

**NumPyro versions.** The loop reuses private internals of NumPyro's ``MCMC``
(``MCMC._single_chain_mcmc``, its ``_collection_params`` and ``_jit_model_args``,
``numpyro.infer.mcmc._collect_and_postprocess``, ``numpyro.util._is_under_jax_transform`` and
``_DISABLE_CONTROL_FLOW_PRIM``), which NumPyro may change in any release: it is tested on the
versions of :data:`TESTED_NUMPYRO` (the range ``pyproject.toml`` requires). With another
NumPyro, or one that lacks those names, :class:`CachedMCMC` warns
:class:`~numpyro_fed.errors.NumPyroVersionWarning` (naming the version and the fix) and runs
NumPyro's own loop: ``MCMC``'s draws, compiled at every run.
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Callable, Mapping
from typing import Any

import jax
import numpy as np
import numpyro
from jax import lax
from numpyro import util as _numpyro_util
from numpyro.infer import MCMC
from numpyro.util import is_prng_key

from numpyro_fed import _programs
from numpyro_fed.errors import NumPyroVersionWarning

try:  # private: absent from another NumPyro, where CachedMCMC runs NumPyro's own loop
    from numpyro.infer.mcmc import _collect_and_postprocess
except ImportError:  # pragma: no cover - depends on the installed NumPyro
    _collect_and_postprocess = None

__all__ = ["CachedMCMC", "LOOP_COMPILER_OPTIONS", "MAX_LOOPS", "TESTED_NUMPYRO",
           "clear_cache", "cached_loops", "numpyro_supported"]

#: NumPyro versions (``(major, minor)``, lower bound included, upper excluded) whose private
#: sampling-loop internals :class:`CachedMCMC` was tested on; ``pyproject.toml`` requires the
#: same range. Widen both only after ``tests/test_compilation.py`` and
#: ``tests/test_cache_correctness.py`` pass on the new version.
TESTED_NUMPYRO: tuple[tuple[int, int], tuple[int, int]] = ((0, 22), (0, 23))

#: most compiled programs kept by the process-wide cache (shared by every cache of the
#: library, :data:`numpyro_fed._programs.MAX_PROGRAMS`)
MAX_LOOPS = _programs.MAX_PROGRAMS
_TAG = "CachedMCMC loop"

#: XLA options of the sampling loop with ``compiler_options="auto"`` on CPU (opt-in, not the
#: default): XLA:CPU's classic emitters instead of its MLIR fusion emitters, and LLVM ``-O1``
#: instead of ``-O2`` (the options of the SAEM loops, :mod:`numpyro_fed.saem.model`).
#: Measured on the seven kernels' loops at the papers' toy sizes (``bench_ttfd.py
#: --diagnose``, part B, 2-core CPU): compiled 1.75-2.1x faster (QLSD++ 1.93 -> 0.90 s, LMC
#: 0.64 -> 0.37 s). Not as fast to run everywhere: QLSD++ with ``batch_size=1`` runs 1.2x
#: (toy) to 1.37-1.46x (50 clients x 1000 rows x d = 50) slower per step than with XLA's
#: defaults; the cause is LLVM ``-O1`` (measured at 50 x 1000 x 50: 250 us/step with it alone,
#: 183 with the classic emitters alone, 189 with the defaults).
LOOP_COMPILER_OPTIONS: dict[str, Any] = {"xla_cpu_use_fusion_emitters": False,
                                         "xla_backend_optimization_level": 1}


def _requirement() -> str:
    (a, b), (c, d) = TESTED_NUMPYRO
    return f"numpyro>={a}.{b},<{c}.{d}"


def numpyro_supported(version: str | None = None) -> str | None:
    """Why :class:`CachedMCMC` cannot use its cached loop with NumPyro ``version`` (default:
    the installed ``numpyro.__version__``), or ``None`` when it can: the version is in
    :data:`TESTED_NUMPYRO` and NumPyro has the private names the loop reuses."""
    version = numpyro.__version__ if version is None else str(version)
    m = re.match(r"(\d+)\.(\d+)", version)
    lo, hi = TESTED_NUMPYRO
    fix = (f"Fix: install a tested NumPyro (pip install '{_requirement()}'), or use "
           "numpyro.infer.MCMC.")
    if m is None or not lo <= (int(m.group(1)), int(m.group(2))) < hi:
        return (f"numpyro_fed.CachedMCMC was tested with {_requirement()} and relies on "
                f"private internals of NumPyro's MCMC loop; NumPyro {version} is installed. "
                "CachedMCMC runs NumPyro's own sampling loop instead (the draws of "
                f"numpyro.infer.MCMC, compiled at every run). {fix}")
    missing = [n for n, ok in (
        ("numpyro.infer.mcmc._collect_and_postprocess", _collect_and_postprocess is not None),
        ("MCMC._single_chain_mcmc", hasattr(MCMC, "_single_chain_mcmc")),
        ("numpyro.util._is_under_jax_transform",
         hasattr(_numpyro_util, "_is_under_jax_transform")),
        ("numpyro.util._DISABLE_CONTROL_FLOW_PRIM",
         hasattr(_numpyro_util, "_DISABLE_CONTROL_FLOW_PRIM")),
    ) if not ok]
    if missing:
        return (f"NumPyro {version} lacks {', '.join(missing)}, which numpyro_fed.CachedMCMC "
                "reuses: CachedMCMC runs NumPyro's own sampling loop instead (the draws of "
                f"numpyro.infer.MCMC, compiled at every run). {fix}")
    return None


def clear_cache() -> None:
    """Forget every compiled program of the library's cache (the sampling loops of
    :class:`CachedMCMC` and the other programs, :mod:`numpyro_fed._programs`). Never needed
    for correctness: a program is reused only where a fresh trace lowers to the same one."""
    _programs.clear()


def cached_loops() -> int:
    """Number of compiled sampling loops of :class:`CachedMCMC` in the cache."""
    return _programs.size(_TAG)


def _ensure_vmap(fn: Callable, batch_size: int) -> Callable:
    """NumPyro's vectorized postprocessing: ``vmap(fn)``, or a broadcast when the state has
    no array leaf (same as ``MCMC._get_cached_fns``)."""

    def wrapper(x):
        if jax.tree.leaves(x):
            return jax.vmap(fn)(x)
        return jax.tree.map(lambda v: jax.numpy.broadcast_to(v, (batch_size, *np.shape(v))), fn(x))

    return wrapper


def _build_loop(sampler, user_postprocess: Callable | None, vector_chains: int | None,
                jit_model_args: bool, args: tuple, kwargs: dict, collect_fields: tuple,
                remove_sites: tuple) -> tuple[Callable, Callable]:
    """``(loop, transform)``: the collection loop of ``MCMC._single_chain_mcmc`` for one
    configuration, ``loop(val, collection, lo, hi, start_idx, thinning)``, and the collected,
    postprocessed fields of a state value. Built afresh on every run (what it reads is read
    now); compiled by :func:`numpyro_fed._programs.compile_program`."""

    def postprocess(state, model_args, model_kwargs):
        body = (sampler.postprocess_fn(model_args, model_kwargs) if user_postprocess is None
                else user_postprocess)
        if vector_chains:
            body = _ensure_vmap(body, vector_chains)
        return body(state)

    if jit_model_args:

        def sample(val):
            state, model_args, model_kwargs = val
            return sampler.sample(state, model_args, model_kwargs), model_args, model_kwargs

        post = postprocess
    else:

        def sample(val):
            return (sampler.sample(val[0], args, kwargs),)

        def post(state):
            return postprocess(state, args, kwargs)

    transform = _collect_and_postprocess(post, collect_fields, remove_sites)

    def loop(val, collection, lo, hi, start_idx, thinning):
        def body(i, carry):
            val, coll = carry
            val = sample(val)
            idx = (i - start_idx) // thinning
            coll = lax.cond(
                idx >= 0,
                lambda c: jax.tree.map(lambda a, v: a.at[idx].set(v), c, transform(val)),
                lambda c: c,
                coll,
            )
            return val, coll

        return lax.fori_loop(lo, hi, body, (val, collection))

    return loop, transform


class CachedMCMC(MCMC):
    """:class:`numpyro.infer.MCMC` that compiles its sampling loop once per program content
    (see the module docstring): same constructor, same ``run``,
    ``warmup``, ``get_samples``, ``last_state``, ``print_summary``, same draws as ``MCMC``
    for the same key.

    **Example**

    .. code-block:: python

        kernel = QLSD(model, clients, variant="++", step_size=1e-4, batch_size=32, bits=4)
        mcmc = CachedMCMC(kernel, num_warmup=1000, num_samples=5000)
        mcmc.run(random.key(0))   # compiles the loop
        mcmc.run(random.key(1))   # same program: traced, not compiled
        CachedMCMC(kernel, num_warmup=1000, num_samples=5000).run(random.key(2))  # neither
        kernel.compressor = compressors.quantize(bits=1)
        mcmc.run(random.key(3))   # another program: compiled (never the old one)

    For a new process to skip compilation as well, call
    :func:`numpyro_fed.enable_compilation_cache` at the start of the script.

    :param sampler: any NumPyro ``MCMCKernel`` (ours, NUTS, ...).
    :param compiler_options: XLA options of the compiled sampling loop: ``None`` (default)
        or ``{}`` keeps XLA's defaults (the program ``MCMC`` compiles, as fast to run);
        ``"auto"`` is :data:`LOOP_COMPILER_OPTIONS` when JAX's default backend is the CPU
        (faster to compile, slower to run for some kernels) and none otherwise.
        The draws do not depend on them beyond floating-point rounding: with ``None`` they
        are ``MCMC``'s bit for bit; with other options than those ``MCMC`` compiles with
        (its default, or ``XLA_FLAGS``) the last bits of a float32 chain can differ (seen in
        the tests: 1e-7 relative over 20 QLSD steps; NUTS, whose trajectories amplify them,
        gives visibly different draws of the same posterior), as between two XLA versions.
    :param kwargs: :class:`numpyro.infer.MCMC`'s arguments (``num_warmup``,
        ``num_samples``, ``num_chains``, ``thinning``, ``postprocess_fn``, ``chain_method``,
        ``progress_bar``, ``jit_model_args``).
    :warns NumPyroVersionWarning: with a NumPyro outside :data:`TESTED_NUMPYRO` (or one that
        lacks the private names the loop reuses); it then runs NumPyro's own loop.
    """

    def __init__(self, sampler, *args: Any,
                 compiler_options: Mapping[str, Any] | str | None = None,
                 **kwargs: Any) -> None:
        super().__init__(sampler, *args, **kwargs)
        if isinstance(compiler_options, str):
            if compiler_options != "auto":
                raise ValueError("`compiler_options` must be 'auto', None or a mapping of XLA "
                                 f"option names to values, got {compiler_options!r}.")
            compiler_options = (LOOP_COMPILER_OPTIONS if jax.default_backend() == "cpu"
                                else None)
        elif compiler_options is not None and not isinstance(compiler_options, Mapping):
            raise TypeError("`compiler_options` must be 'auto', None or a mapping of XLA "
                            f"option names to values, got {type(compiler_options).__name__}.")
        self.compiler_options: dict[str, Any] = dict(compiler_options or {})
        unsupported = numpyro_supported()
        if unsupported is not None:
            warnings.warn(unsupported, NumPyroVersionWarning, stacklevel=2)
        #: whether runs use the cached loop (``False``: NumPyro's own, see the warning)
        self.cached_loop = unsupported is None

    def _single_chain_mcmc(self, *args, **kwargs):
        # NumPyro's own loop (called as it calls it) with an untested NumPyro
        if not self.cached_loop:
            return super()._single_chain_mcmc(*args, **kwargs)
        return self._cached_single_chain_mcmc(*args, **kwargs)

    def _cached_single_chain_mcmc(self, init, args, kwargs, collect_fields, remove_sites):
        if (_numpyro_util._is_under_jax_transform() or _numpyro_util._DISABLE_CONTROL_FLOW_PRIM
                or self.sampler.is_ensemble_kernel):
            return super()._single_chain_mcmc(init, args, kwargs, collect_fields, remove_sites)
        rng_key, init_state, init_params = init
        # as MCMC._single_chain_mcmc: (re)initialise unless the kernel keeps a sample fn
        if init_state is None or getattr(self.sampler, "_sample_fn", None) is None:
            new_state = self.sampler.init(rng_key, self.num_warmup, init_params,
                                          model_args=args, model_kwargs=kwargs)
            init_state = new_state if init_state is None else init_state
        vector = self.num_chains if (self.chain_method == "vectorized"
                                     and self.num_chains > 1) else None
        # the loop is built and traced afresh on every run: what the kernel, the model and
        # the arguments hold *now* is what is compiled (or found compiled, by content)
        loop, transform = _build_loop(self.sampler, self.postprocess_fn, vector,
                                      self._jit_model_args, args, kwargs,
                                      tuple(collect_fields), tuple(remove_sites))
        init_val = (init_state, args, kwargs) if self._jit_model_args else (init_state,)
        params = self._collection_params
        lower, upper = params["lower"], params["upper"]
        size = params["collection_size"]
        size = (upper - lower) // self.thinning if size is None else size // self.thinning
        item = jax.eval_shape(transform, init_val)
        if any(jax.dtypes.issubdtype(s.dtype, jax.dtypes.extended)
               for s in jax.tree.leaves(item)):
            return super()._single_chain_mcmc((rng_key, init_state, init_params), args,
                                              kwargs, collect_fields, remove_sites)
        collection = jax.tree.map(lambda s: np.zeros((size, *s.shape), s.dtype), item)
        start_idx = lower + (upper - lower) % self.thinning
        run = _programs.compile_program(
            loop, (init_val, collection, 0, upper, start_idx, self.thinning),
            donate_argnums=1, compiler_options=self.compiler_options, tag=_TAG)
        if self.progress_bar and upper > 0:
            val, collection = self._run_chunks(run, init_val, collection, lower, upper,
                                               start_idx, rng_key)
        else:
            val, collection = run(init_val, collection, 0, upper, start_idx, self.thinning)
        states = (collection,) if len(collect_fields) == 1 else collection
        return dict(zip(collect_fields, states, strict=False)), val[0]

    def _run_chunks(self, run: Callable, val, collection, lower: int, upper: int,
                    start_idx: int, rng_key):
        """The compiled loop in about 20 chunks, with NumPyro's progress bar between them."""
        from tqdm.auto import tqdm

        rate = self.progress_rate or max(1, upper // 20)
        phase = self._collection_params["phase"]
        show_diag = is_prng_key(rng_key) or self.sampler.is_ensemble_kernel
        bounds = sorted({0, upper, *range(rate, upper, rate)} | ({lower} if 0 < lower < upper
                                                                 else set()))
        with tqdm(total=upper) as bar:
            for lo, hi in zip(bounds[:-1], bounds[1:], strict=True):
                val, collection = run(val, collection, lo, hi, start_idx, self.thinning)
                desc = phase if phase is not None else ("warmup" if hi <= lower else "sample")
                bar.set_description(desc, refresh=False)
                if show_diag:
                    bar.set_postfix_str(self.sampler.get_diagnostics_str(val[0]),
                                        refresh=False)
                bar.update(hi - lo)
        return val, collection
