"""Theophylline MCMC-SAEM timing: compile time and run time of the compiled ``lax.scan`` loop
vs a Python loop over the same (individually jitted) iterations.

Usage: ``python benchmarks/bench_saem.py [--iters 500] [--mstep auto|newton]``; writes
``benchmarks/results/saem.md``. The Python loop is warmed up first (its jitted iteration
compiles once: the SAEM state keeps one type).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from _common import device_name, md_table, write_result  # noqa: E402
from jax import lax, random  # noqa: E402

from models.pk import load_theophylline, theophylline_model  # noqa: E402
from numpyro_fed.saem import SAEM, Schedule  # noqa: E402


def _precond(th):
    return {"phi": jnp.stack([th["omega_ka"], th["omega_V"], th["omega_CL"]]) ** 2}


def main(argv: list[str] | None = None) -> str:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--iters", type=int, default=500)
    p.add_argument("--mstep", default="auto")
    p.add_argument("--chains", type=int, default=4)
    p.add_argument("--out", default=None, help="results folder (default benchmarks/results)")
    a = p.parse_args(argv)
    d = load_theophylline()
    args = (d["dose"], d["time"], d["conc"])
    k1 = a.iters // 2
    saem = SAEM(theophylline_model, kernel="mala", step_size=0.03, num_chains=a.chains,
                preconditioner=_precond, schedule=Schedule.saemix(k1, a.iters - k1),
                mstep=a.mstep)
    state, iteration = saem._build(random.key(0), args, {}, None)
    gammas = jnp.asarray(saem.gammas, state.theta.dtype)
    scan = jax.jit(lambda s, g: lax.scan(lambda c, x: iteration(c, x), s, g))
    t = time.perf_counter()
    compiled = scan.lower(state, gammas).compile()
    t_compile = time.perf_counter() - t
    t = time.perf_counter()
    out = compiled(state, gammas)
    jax.block_until_ready(out)
    t_run = time.perf_counter() - t
    step = jax.jit(iteration)
    s = state
    s1, _ = step(s, gammas[0])
    jax.block_until_ready(s1)
    t = time.perf_counter()
    for g in gammas:
        s, _ = step(s, g)
    jax.block_until_ready(s)
    t_loop = time.perf_counter() - t
    res = {"iterations": a.iters, "mstep": saem.mstep.kind, "compile_s": t_compile,
           "scan_run_s": t_run, "python_loop_run_s": t_loop, "ratio_loop_over_scan": t_loop / t_run}
    for k, v in res.items():
        print(f"{k:22s} {v:.4g}" if isinstance(v, float) else f"{k:22s} {v}")
    text = (
        "### MCMC-SAEM, Theophylline: compiled fit vs Python loop\n\n"
        f"{a.iters} SAEM iterations (saemix schedule), {a.chains} chains, 4 preconditioned "
        f"MALA steps per iteration, M-step `{saem.mstep.kind}`, float32, {device_name()}. "
        "'compiled': the whole fit as one `lax.scan` program (what `SAEM.run` compiles); "
        "'Python loop': the same jitted iteration called once per iteration. Target: compiled "
        "run < 2 s after compilation.\n\n"
        + md_table(["iterations", "compile s", "compiled run s", "Python loop s",
                    "loop / compiled"],
                   [[a.iters, f"{t_compile:.2f}", f"{t_run:.3f}", f"{t_loop:.2f}",
                     f"{t_loop / t_run:.0f}"]])
    )
    print(f"wrote {write_result('saem', text, a.out)}")
    return text


if __name__ == "__main__":
    main()
