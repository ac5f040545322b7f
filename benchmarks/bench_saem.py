"""Theophylline MCMC-SAEM timing: ``SAEM.run`` compile time and run time of its compiled
``lax.scan`` program vs a Python loop over the same (jitted) iterations.

Usage: ``python benchmarks/bench_saem.py [--iters 500] [--mstep auto|newton]``; writes
``benchmarks/results/saem.md``.

- first ``SAEM.run``: model analysis, tracing, compilation and the run;
- second ``SAEM.run`` (new key, same data shapes): the cached compiled program only (what a
  bootstrap or a seed sweep pays per fit); compile time = first - second;
- Python loop: ``SAEM.run(progress_bar=True, num_chunks=<one per iteration>)`` calls the same
  compiled iteration once per iteration from Python (warmed up first: the one-iteration chunk
  compiles once), with the progress bar's divergence check -- one host sync per iteration.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import jax.numpy as jnp  # noqa: E402
from _common import device_name, md_table, write_result  # noqa: E402
from jax import random  # noqa: E402

from numpyro_fed.examples.pk import load_theophylline, theophylline_model  # noqa: E402
from numpyro_fed.saem import SAEM, Schedule  # noqa: E402


def _precond(th):
    return {"phi": jnp.stack([th["omega_ka"], th["omega_V"], th["omega_CL"]]) ** 2}


def _timed_run(saem, key, args, **kw):
    t = time.perf_counter()
    with contextlib.redirect_stderr(io.StringIO()):  # the progress bar of the Python loop
        res = saem.run(key, *args, **kw)
    return res, time.perf_counter() - t


def main(argv: list[str] | None = None) -> str:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--iters", type=int, default=500)
    p.add_argument("--mstep", default="auto")
    p.add_argument("--chains", type=int, default=4)
    p.add_argument("--prior-proposals", type=int, default=2,
                   help="independence proposals from p(phi | theta) per E-step (saemix: 2)")
    p.add_argument("--out", default=None, help="results folder (default benchmarks/results)")
    a = p.parse_args(argv)
    d = load_theophylline()
    args = (d["dose"], d["time"], d["conc"])
    k1 = a.iters // 2
    # fixed-step preconditioned MALA (no adaptation: every iteration does the same work) and
    # one kept draw, so that the timed program is the SAEM iterations
    saem = SAEM(theophylline_model, kernel="mala", step_size=0.03, num_chains=a.chains,
                preconditioner=_precond, schedule=Schedule.saemix(k1, a.iters - k1),
                mstep=a.mstep, num_draws=1, prior_proposals=a.prior_proposals)
    res, t_first = _timed_run(saem, random.key(0), args)
    _, t_run = _timed_run(saem, random.key(1), args)
    t_compile = t_first - t_run
    total = len(saem.gammas) + max(1, saem.schedule.num_burnin) + saem.num_draws
    loop = dict(progress_bar=True, num_chunks=total)
    _timed_run(saem, random.key(2), args, **loop)  # compiles the one-iteration chunk
    _, t_loop = _timed_run(saem, random.key(3), args, **loop)
    st = saem.program
    row = {"iterations": a.iters, "mstep": res.mstep, "first_run_s": t_first,
            "compile_s": t_compile, "cached_run_s": t_run, "python_loop_run_s": t_loop,
            "ratio_loop_over_compiled": t_loop / t_run}
    for k, v in row.items():
        print(f"{k:24s} {v:.4g}" if isinstance(v, float) else f"{k:24s} {v}")
    text = (
        "### MCMC-SAEM, Theophylline: compiled fit vs Python loop\n\n"
        f"{a.iters} SAEM iterations (saemix schedule) after {saem.schedule.num_burnin} burn-in "
        f"E-steps, {st.num_chains} chains, per E-step {st.prior_proposals} prior proposals "
        f"then 4 MALA steps (fixed step 0.03, preconditioned by omega^2), M-step "
        f"`{res.mstep}` (the Louis information for standard errors is computed after the "
        "fit, not timed here), float32, "
        f"{device_name()}. 'first run': `SAEM.run` with model analysis, tracing and "
        "compilation; 'compiled run': a second `SAEM.run` (new key, same data shapes) reusing "
        "the cached program; 'compile' = first - compiled; 'Python loop': the same compiled "
        "iteration called once per iteration from Python (`SAEM.run(progress_bar=True, "
        "num_chunks=<iterations>)`, warmed up; a host sync per iteration). Target: compiled run "
        "< 2 s.\n\n"
        + md_table(["iterations", "compile s", "compiled run s", "Python loop s",
                    "loop / compiled", "first run s"],
                   [[a.iters, f"{t_compile:.2f}", f"{t_run:.3f}", f"{t_loop:.2f}",
                     f"{t_loop / t_run:.1f}", f"{t_first:.2f}"]])
    )
    print(f"wrote {write_result('saem', text, a.out)}")
    return text


if __name__ == "__main__":
    main()
