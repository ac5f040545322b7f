"""Scaling of the kernels' step and memory, and vectorized-chain throughput.

* **Time per step** of federated LMC (identity compressor) and QLSD# with the 4-bit quantiser
  as the number of clients ``b``, the per-client minibatch ``n`` and the dimension ``d`` each
  grow 10x and 100x from a base point (defaults b = n = d = 10, N_i = 1000 rows per client),
  the other two held at the base. Timed on the kernel's own step in a compiled ``lax.scan``
  (the MCMC wrapper adds a constant, see ``overhead.md``). The fitted exponent is the
  least-squares slope of log(time) on log(size) over the three points; the marginal exponent
  between 10x and 100x is less affected by fixed per-step costs (key splitting, loop).
* **Kernel state memory**: bytes of the state of one chain *excluding the client data*
  (``FedState.data``, which the state only references) for QLSD++ (memory terms and control
  variates, ``(b, d)`` arrays) and D-ELF, as ``N_i`` grows 10x and 100x and as ``b``, ``d``
  grow: it must be O(b d) and independent of N.
* **Many chains**: ``chain_method="vectorized"`` throughput (draws per second, all chains)
  of QLSD++ 4-bit inside MCMC with 1, 4 and 16 chains (compilation excluded by difference
  quotient).

Writes ``benchmarks/results/scaling.md``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import jax  # noqa: E402
import numpy as np  # noqa: E402
from _common import (  # noqa: E402
    device_name,
    interleaved_min,
    mcmc_candidate,
    md_table,
    write_result,
)
from bench_overhead import kernel_scan, make_data  # noqa: E402
from jax import random  # noqa: E402

from numpyro_fed import compressors  # noqa: E402
from numpyro_fed.examples import logistic_regression  # noqa: E402
from numpyro_fed.kernels.elf import ELF  # noqa: E402
from numpyro_fed.kernels.langevin import FederatedLangevin  # noqa: E402
from numpyro_fed.kernels.qlsd import QLSD  # noqa: E402


def _kernel(kind: str, part, n: int | None, gamma: float = 1e-4):
    kw = dict(step_size=gamma, postprocess_deterministic=False)
    if kind == "LMC":
        return FederatedLangevin(logistic_regression, part, batch_size=n, **kw)
    if kind == "QLSD# 4-bit":
        return QLSD(logistic_regression, part, variant="#", batch_size=n, bits=4, **kw)
    if kind == "QLSD++ 4-bit":
        return QLSD(logistic_regression, part, variant="++", batch_size=n, bits=4, **kw)
    if kind == "D-ELF top-1":
        return ELF(logistic_regression, part, variant="D", uplink=compressors.top_k(1), **kw)
    raise ValueError(kind)


def state_bytes(kern) -> tuple[int, int]:
    """``(bytes of one chain's state without the client data, bytes of the client data)``."""
    state = kern.init(random.PRNGKey(0), 0, None, (), {})
    data = sum(x.nbytes for x in jax.tree.leaves(state.data))
    own = sum(x.nbytes for x in jax.tree.leaves(state._replace(data=())))
    return own, data


def fit_exponent(sizes, times) -> tuple[float, float]:
    """Least-squares slope of log t on log size, and the slope between the last two points."""
    ls, lt = np.log(sizes), np.log(times)
    return float(np.polyfit(ls, lt, 1)[0]), float((lt[-1] - lt[-2]) / (ls[-1] - ls[-2]))


def scaling(args) -> str:
    base = dict(b=args.base, n=args.base, d=args.base)
    rows = []
    for kind in args.kinds:
        for axis in args.axes:
            sizes, cands = [], {}
            for f in (1, 10, 100):
                s = dict(base, **{axis: base[axis] * f})
                _, _, part = make_data(s["b"], args.rows, s["d"])
                kern = _kernel(kind, part, s["n"])
                cands[f] = (kernel_scan(kern, args.steps, 1, {}), args.steps)
                sizes.append(s[axis])
            t = interleaved_min(cands, args.repeats)
            times = [t[f] for f in (1, 10, 100)]
            slope, marginal = fit_exponent(sizes, times)
            rows.append([kind, axis, *(1e6 * v for v in times), slope, marginal])
            print(rows[-1], flush=True)
    b0 = args.base
    md = (f"### Time per step vs b, n, d (×1, ×10, ×100 from b = n = d = {b0}; "
          f"N_i = {args.rows} rows per client)\n\n"
          f"Kernel step in a compiled lax.scan, {args.steps} steps, min of {args.repeats} "
          f"interleaved repeats, {device_name()}.\n\n"
          + md_table(["kernel", "grown axis", "×1 µs/step", "×10 µs/step", "×100 µs/step",
                      "fitted exponent", "exponent ×10→×100"], rows))
    return md


def memory(args) -> str:
    rows = []
    b0 = args.base
    for kind in ("QLSD++ 4-bit", "D-ELF top-1"):
        for b, rows_i, d in ((b0, 100, b0), (b0, 1000, b0), (b0, 10_000, b0),
                             (10 * b0, 1000, b0), (b0, 1000, 10 * b0)):
            _, _, part = make_data(b, rows_i, d)
            kern = _kernel(kind, part, min(10, rows_i))
            own, data = state_bytes(kern)
            rows.append([kind, b, rows_i, d, own, own / (b * d), data])
    return ("### Kernel state memory (one chain, client data excluded)\n\n"
            + md_table(["kernel", "b", "N_i", "d", "state bytes", "state bytes / (b d)",
                        "client data bytes (referenced, not copied)"], rows))


def chains(args) -> str:
    _, _, part = make_data(20, 200, 50)
    kern = _kernel("QLSD++ 4-bit", part, 20, gamma=1e-3)
    cands = {c: mcmc_candidate(kern, c, args.chain_steps) for c in args.chain_counts}
    t = interleaved_min(cands, args.repeats)
    one = t[args.chain_counts[0]]
    rows = [[c, 1e6 * t[c], c / t[c], (c / t[c]) / (1 / one)] for c in args.chain_counts]
    return ("### Vectorized chains: QLSD++ 4-bit inside MCMC (b = 20, N_i = 200, d = 50, "
            f"n = 20), {args.chain_steps} steps, compilation excluded, {device_name()}\n\n"
            + md_table(["chains", "µs/step (all chains)", "draws/s (all chains)",
                        "throughput vs 1 chain"], rows))


def main(argv: list[str] | None = None) -> str:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--base", type=int, default=10)
    p.add_argument("--rows", type=int, default=1000, help="rows per client")
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--chain-steps", type=int, default=2000)
    p.add_argument("--chain-counts", type=int, nargs="+", default=[1, 4, 16])
    p.add_argument("--kinds", nargs="+", default=["LMC", "QLSD# 4-bit"],
                   choices=["LMC", "QLSD# 4-bit", "QLSD++ 4-bit", "D-ELF top-1"])
    p.add_argument("--axes", nargs="+", default=["b", "n", "d"], choices=["b", "n", "d"])
    p.add_argument("--skip", nargs="*", default=[], choices=["scaling", "memory", "chains"])
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    parts = []
    if "scaling" not in args.skip:
        parts.append(scaling(args))
    if "memory" not in args.skip:
        parts.append(memory(args))
    if "chains" not in args.skip:
        parts.append(chains(args))
    md = "\n".join(parts)
    print(md)
    write_result("scaling", md, args.out)
    return md


if __name__ == "__main__":
    main()
