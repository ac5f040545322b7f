"""Time per step of the QLSD kernels inside ``numpyro.infer.MCMC`` vs a hand-fused JAX loop.

Problem: the QLSD paper's toy Gaussian shapes (b = 20 clients, d = 50, N = 200 per client,
minibatch n = 20, s = 2^4 levels, QLSD++ with l = 100 and memory). For each variant and for 1
and 4 vectorized chains, three timings, all measured in this run:

* ``mcmc`` -- ``MCMC(kernel, progress_bar=False).run`` (collects ``z`` and ``bits``
  per step), timed by difference quotient with the compilation subtracted;
* ``kernel scan`` -- ``lax.scan`` over ``kernel.sample`` alone (no MCMC collection/postprocess);
* ``fused`` -- the same recursion written directly as a ``lax.scan`` on flat arrays from the
  same building blocks (minibatch gradients, quantiser, Langevin move), no state NamedTuple,
  no ravel/unravel, no bit counters, no divergence check; ``fused+out`` also computes the
  exact coded bits the kernels report (see ``bench_overhead``).

Compilation is excluded (see :func:`bench`); the minimum over ``--repeats`` interleaved
repeats is kept. Ratios kernel/fused (target <= 1.15) go to a markdown table printed and
written to ``benchmarks/results/qlsd.md``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np  # noqa: E402
import numpyro  # noqa: E402
import numpyro.distributions as dist  # noqa: E402
from _common import interleaved_min, mcmc_candidate  # noqa: E402
from bench_overhead import fused_federated, kernel_scan  # noqa: E402

from numpyro_fed import ClientPartition  # noqa: E402
from numpyro_fed.kernels.qlsd import QLSD  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"


def gauss_model(y):
    theta = numpyro.sample("theta", dist.Normal(0.0, 10.0).expand([y.shape[-1]]).to_event(1))
    with numpyro.plate("data", y.shape[0]):
        numpyro.sample("y", dist.Normal(theta, 1.0).to_event(1), obs=y)


def bench(kern, num_chains, num_steps, repeats):
    """Per-step times (compilation excluded) of the fused scan, the kernel scan and
    ``MCMC.run`` (difference quotient), interleaved: the runners of ``bench_overhead``."""
    cands = {
        "fused": (fused_federated(kern, num_steps, num_chains), num_steps),
        "fused+out": (fused_federated(kern, num_steps, num_chains, True), num_steps),
        "kernel scan": (kernel_scan(kern, num_steps, num_chains, {}), num_steps),
        "mcmc": mcmc_candidate(kern, num_chains, num_steps),
    }
    return interleaved_min(cands, repeats)


def main(argv: list[str] | None = None) -> str:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--steps", type=int, default=10_000)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--out", default=str(RESULTS / "qlsd.md"))
    args = p.parse_args(argv)
    b, d, N, n = 20, 50, 200, 20
    if args.smoke:
        b, d, N, n, args.steps, args.repeats = 3, 4, 20, 4, 20, 1
    rng = np.random.default_rng(0)
    part = ClientPartition.from_clients(
        [{"y": (rng.normal(size=d) + rng.normal(size=(N, d))).astype(np.float32)}
         for _ in range(b)])
    rows = []
    for variant in ("#", "*", "++"):
        kern = QLSD(gauss_model, part, variant=variant, step_size=4.9e-4, batch_size=n, bits=4,
                    refresh_every=100)
        for chains in (1, 4):
            t = bench(kern, chains, args.steps, args.repeats)
            rows.append((f"QLSD{variant}", chains, t["fused"] * 1e6, t["fused+out"] * 1e6,
                         t["kernel scan"] * 1e6, t["mcmc"] * 1e6, t["kernel scan"] / t["fused"],
                         t["mcmc"] / t["fused"], t["mcmc"] / t["fused+out"]))
            print(rows[-1], flush=True)
    md = ("| kernel | chains | fused us/step | fused+out us/step | kernel scan us/step | "
          "MCMC us/step | kernel scan / fused | MCMC / fused | MCMC / fused+out |\n"
          "|---|---|---|---|---|---|---|---|---|\n")
    md += "".join(f"| {r[0]} | {r[1]} | {r[2]:.1f} | {r[3]:.1f} | {r[4]:.1f} | {r[5]:.1f} | "
                  f"{r[6]:.3f} | {r[7]:.3f} | {r[8]:.3f} |\n" for r in rows)
    md = (f"### QLSD kernels: time per step (b={b}, d={d}, N={N}/client, n={n}, s=2^4; "
          f"{args.steps} steps, min of {args.repeats} interleaved repeats, compilation "
          "excluded; MCMC by difference quotient between K/4 and K steps)\n\n" + md)
    print(md)
    if not args.smoke:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(md)
    return md


if __name__ == "__main__":
    main()
