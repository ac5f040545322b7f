"""Theophylline MCMC-SAEM timing: compile time and run time of the compiled ``lax.scan`` loop
vs a Python loop over the same (individually jitted) iterations.

Usage: ``python benchmarks/bench_saem.py [--iters 500] [--mstep auto|newton]``.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
from jax import lax, random

from models.pk import load_theophylline, theophylline_model
from numpyro_fed.saem import SAEM, Schedule


def _precond(th):
    return {"phi": jnp.stack([th["omega_ka"], th["omega_V"], th["omega_CL"]]) ** 2}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--iters", type=int, default=500)
    p.add_argument("--mstep", default="auto")
    p.add_argument("--chains", type=int, default=4)
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
    return res


if __name__ == "__main__":
    main()
