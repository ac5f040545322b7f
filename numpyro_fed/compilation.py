"""Compile time: JAX's persistent compilation cache behind one documented option.

Most of the time of a short run (a first SAEM fit, a 1000-step chain) is XLA compiling the
programs, not running them. JAX can keep compiled programs on disk and read them back in a
later process; :func:`enable_compilation_cache` turns that on for every JAX program of the
process (ours, NumPyro's, the user's). Within one process, :class:`numpyro_fed.CachedMCMC`
keeps the compiled sampling loop of a kernel, which NumPyro's ``MCMC`` compiles again at
every ``run``.

The cache is keyed by the program (its HLO), the compiler options, the JAX/XLA version and
the machine, so it cannot serve a program compiled for other code, shapes or settings: a
hit gives the executable a fresh compilation would have given, bit for bit.
"""

from __future__ import annotations

import os
from pathlib import Path

import jax

from numpyro_fed._validation import check_float

__all__ = ["default_cache_dir", "enable_compilation_cache"]


def default_cache_dir() -> Path:
    """``$NUMPYRO_FED_CACHE_DIR``, else ``$XDG_CACHE_HOME/numpyro_fed/jax`` (``~/.cache``
    when ``XDG_CACHE_HOME`` is not set)."""
    env = os.environ.get("NUMPYRO_FED_CACHE_DIR")
    if env:
        return Path(env).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base).expanduser() / "numpyro_fed" / "jax"


def enable_compilation_cache(path: str | os.PathLike | None = None, *,
                             min_compile_time_s: float = 0.0) -> Path:
    """Keep compiled programs on disk, so that a new process running the same programs
    (the same model structure, shapes and settings) reads them instead of compiling them.

    Best called at the start of a script; a call after programs have been compiled turns
    the cache on for the programs compiled from then on. Equivalent to setting JAX's
    ``jax_compilation_cache_dir``, ``jax_persistent_cache_min_compile_time_secs`` and
    ``jax_persistent_cache_min_entry_size_bytes`` options (or the ``JAX_...`` environment
    variables of the same names, which also reach the processes a script starts).

    :param path: the cache folder (created if needed); default :func:`default_cache_dir`.
    :param min_compile_time_s: programs that compile faster than this are not written.
        Default 0: every program, including the ~100-200 single operations that NumPyro's
        model initialisation and the kernels' ``init`` run eagerly, one compilation each
        (20-50 ms apiece on a 2-core CPU). Measured on the toys of
        ``benchmarks/bench_ttfd.py`` (fresh process, first ``MCMC.run`` of 1000 steps with a
        warm cache): 2.5-3.2 s with 0, 5.8-9.7 s with 0.1 (the earlier default), 8-11 s
        without the cache. JAX's own default is 1 s, which leaves out most of the programs
        of a SAEM fit as well.
    :returns: the cache folder.
    """
    min_compile_time_s = check_float("min_compile_time_s", min_compile_time_s, low=0.0,
                                     what=" (seconds)")
    from jax.experimental.compilation_cache import compilation_cache as _cc

    folder = Path(path).expanduser() if path is not None else default_cache_dir()
    folder.mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", str(folder))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", float(min_compile_time_s))
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    # JAX decides whether to use the cache at its first compilation: decide again
    _cc.reset_cache()
    return folder
