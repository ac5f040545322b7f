"""Timing helpers shared by the benchmark scripts.

All timings here follow three rules, because these benchmarks run on small, shared and
noisy machines:

* **compilation is excluded.** Pure-JAX loops are compiled ahead of time
  (``jit(...).lower(...).compile()``) and only their executables are timed. NumPyro 0.22's
  ``MCMC.run`` re-traces and re-compiles its sampling loop (``jit(_fori_collect_loop)``) on
  *every* call, for every kernel including NUTS, and calls the kernel's ``init`` again, so an
  MCMC per-step time is the *difference quotient* ``(t(K) - t(K/4)) / (3K/4)`` between two run
  lengths, after subtracting from each run the tracing/compilation time that
  ``jax.monitoring`` reports: what is left is the steady-state cost of one step.
* **minimum over interleaved repeats.** Every candidate of a comparison is run once per
  repeat, in turn, so that a change of machine load hits all of them; the minimum over repeats
  is kept.
* **ratios, not absolute times,** are what the tables are meant for: both sides of a ratio are
  measured in the same process, minutes apart at most.
"""

from __future__ import annotations

import os
import platform
import time
from collections.abc import Callable
from pathlib import Path

SINGLE_THREADED_FLAG = "--xla_cpu_multi_thread_eigen=false"


def single_threaded_xla() -> None:
    """Turn off XLA:CPU's multi-threaded Eigen kernels (call before JAX starts).

    The overhead and peer items time steps of 8-300 µs made of many small operations. With
    Eigen's intra-op thread pool on a shared 2-core machine, the same executable measured
    up to 30% apart between runs (a row's minimum over 7 interleaved repeats: QLSD# 4-bit
    kernel 45.7 vs 61.3 µs/step in two runs), which a ratio of two such rows inherits; with
    it off, three runs gave 47.4-50.7. The setting applies to every candidate of a table
    alike (ours, the fused scans, BlackJAX). The large-scale and scaling items keep the
    default, which the 10^6-row matrix products of NUTS and of 1000 clients need."""
    flags = os.environ.get("XLA_FLAGS", "")
    if SINGLE_THREADED_FLAG not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} {SINGLE_THREADED_FLAG}".strip()


def xla_threading() -> str:
    """How XLA:CPU was threaded for a result table (in words)."""
    if SINGLE_THREADED_FLAG in os.environ.get("XLA_FLAGS", ""):
        return f"XLA_FLAGS={SINGLE_THREADED_FLAG}"
    return "default XLA threading"


import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax import random  # noqa: E402
from numpyro.infer import MCMC  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"

_COMPILE_EVENTS = (
    "/jax/core/compile/jaxpr_trace_duration",
    "/jax/core/compile/jaxpr_to_mlir_module_duration",
    "/jax/core/compile/backend_compile_duration",
)
_compile_seconds = [0.0]


def _on_event(event: str, duration: float, **_) -> None:
    if event in _COMPILE_EVENTS:
        _compile_seconds[0] += duration


jax.monitoring.register_event_duration_secs_listener(_on_event)


def timed(fn: Callable[[], object]) -> tuple[float, float]:
    """Run ``fn`` (blocking on its result); return ``(wall seconds, of which tracing and
    compilation seconds)``."""
    _compile_seconds[0] = 0.0
    t0 = time.perf_counter()
    jax.block_until_ready(fn())
    return time.perf_counter() - t0, _compile_seconds[0]


def device_name() -> str:
    """The device the benchmarks ran on, in words (for the result tables)."""
    dev = jax.devices()[0]
    if dev.platform == "cpu":
        return f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"
    return f"{dev.platform.upper()} ({getattr(dev, 'device_kind', dev)})"


def compiled_scan(fn: Callable, *args) -> Callable[[], object]:
    """Ahead-of-time compile ``jit(fn)`` for ``args``; return a no-argument runner."""
    exe = jax.jit(fn).lower(*args).compile()
    return lambda: exe(*args)


def mcmc_runner(kernel, num_chains: int, num_samples: int, run_kwargs: dict | None = None,
                extra_fields: tuple = ()) -> Callable[[], object]:
    """A no-argument function running ``MCMC(kernel).run`` (no warmup, vectorized chains,
    no progress bar) and returning the samples."""
    run_kwargs = dict(run_kwargs or {})

    def run():
        mcmc = MCMC(kernel, num_warmup=0, num_samples=num_samples, num_chains=num_chains,
                    chain_method="vectorized", progress_bar=False)
        mcmc.run(random.PRNGKey(0), extra_fields=extra_fields, **run_kwargs)
        return mcmc.get_samples()

    return run


def mcmc_loop_fn(kernel, num_chains: int, num_samples: int,
                 model_kwargs: dict | None = None) -> tuple[Callable, object]:
    """NumPyro's own sampling loop of ``MCMC.run`` as a function of the kernel's initial state:
    ``(loop, state)``.

    This builds the very functions ``MCMC.run`` uses -- the sample and postprocess functions
    from ``MCMC._get_cached_fns``, the collection transform ``_collect_and_postprocess`` of the
    default fields and ``numpyro.util.fori_collect`` (its ``lax.cond``-guarded collection
    buffer) -- around the kernel's initial state."""
    from numpyro.infer import mcmc as mcmc_mod
    from numpyro.util import fori_collect

    kw = dict(model_kwargs or {})
    mcmc = MCMC(kernel, num_warmup=0, num_samples=num_samples, num_chains=num_chains,
                chain_method="vectorized", progress_bar=False)
    mcmc._args, mcmc._kwargs = (), kw
    key = random.split(random.PRNGKey(0), num_chains) if num_chains > 1 else random.PRNGKey(0)
    state = kernel.init(key, 0, None, (), kw)
    sample_fn, postprocess_fn = mcmc._get_cached_fns()
    fields = tuple(dict.fromkeys((kernel.sample_field, *kernel.default_fields)))
    transform = mcmc_mod._collect_and_postprocess(postprocess_fn, fields, ())

    def loop(state):
        return fori_collect(0, num_samples, sample_fn, (state,), transform=transform,
                            progbar=False, return_last_val=True,
                            collection_size=num_samples)

    return loop, state


def mcmc_loop_runner(kernel, num_chains: int, num_samples: int,
                     model_kwargs: dict | None = None) -> Callable[[], object]:
    """NumPyro's own sampling loop of ``MCMC.run`` (:func:`mcmc_loop_fn`), compiled once.

    ``MCMC.run`` recompiles this loop on every call (see the module docstring), which makes
    its steady-state cost hard to isolate on a noisy machine. This compiles the loop ahead of
    time and returns a runner of the executable: the per-step time of MCMC without its
    per-run compilation."""
    loop, state = mcmc_loop_fn(kernel, num_chains, num_samples, model_kwargs)
    return compiled_scan(loop, state)


def interleaved_min(candidates: dict[str, tuple[Callable, int]], repeats: int) -> dict:
    """Seconds per step of each candidate, minimum over ``repeats`` interleaved repeats.

    ``candidates[name] = (runner, steps)`` for a compiled loop (timed directly), or
    ``(runner_long, steps_long, runner_short, steps_short)`` for an ``MCMC.run`` (difference
    quotient, compilation subtracted; see the module docstring)."""
    best: dict[str, list[float]] = {k: [np.inf, np.inf] for k in candidates}
    for _ in range(repeats):
        for name, cand in candidates.items():
            runs = [(cand[0], cand[1])] if len(cand) == 2 else [cand[:2], cand[2:]]
            for j, (fn, _) in enumerate(runs):
                wall, comp = timed(fn)
                best[name][j] = min(best[name][j], wall - comp)
    out = {}
    for name, cand in candidates.items():
        if len(cand) == 2:
            out[name] = best[name][0] / cand[1]
        else:
            out[name] = (best[name][0] - best[name][1]) / (cand[1] - cand[3])
    return out


def mcmc_candidate(kernel, num_chains: int, steps: int, run_kwargs: dict | None = None):
    """``interleaved_min`` candidate for ``MCMC.run`` of ``steps`` vs ``steps // 4`` samples."""
    short = max(1, steps // 4)
    return (mcmc_runner(kernel, num_chains, steps, run_kwargs), steps,
            mcmc_runner(kernel, num_chains, short, run_kwargs), short)


def md_table(headers: list[str], rows: list[list]) -> str:
    """A GitHub markdown table; floats get 3 significant digits."""

    def fmt(v):
        if isinstance(v, float | np.floating):
            return f"{v:.3g}" if abs(v) < 1e4 else f"{v:.3e}"
        return str(v)

    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(fmt(v) for v in r) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def write_result(name: str, text: str, out_dir: str | Path | None = None) -> Path:
    """Write ``text`` to ``<out_dir or benchmarks/results>/<name>.md``."""
    path = Path(out_dir or RESULTS) / f"{name}.md"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path
