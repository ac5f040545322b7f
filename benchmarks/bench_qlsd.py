"""Time per step of the QLSD kernels inside ``numpyro.infer.MCMC`` vs a hand-fused JAX loop.

Problem: the QLSD paper's toy Gaussian shapes (b = 20 clients, d = 50, N = 200 per client,
minibatch n = 20, s = 2^4 levels, QLSD++ with l = 100 and memory). For each variant and for 1
and 4 vectorized chains, three timings, all measured in this run:

* ``mcmc`` -- ``MCMC(kernel, progress_bar=False).run`` (collects ``z``, ``bits_up``, ``bits_down``
  per step and postprocesses the draws at the end);
* ``kernel scan`` -- ``lax.scan`` over ``kernel.sample`` alone (no MCMC collection/postprocess);
* ``fused`` -- the same recursion written directly as a ``lax.scan`` on flat arrays from the
  same building blocks (minibatch gradients, quantiser, Langevin move), no state NamedTuple,
  no ravel/unravel, no bit counters, no divergence check.

Compilation is excluded (see :func:`bench`); the minimum over ``--repeats`` interleaved
repeats is kept. Ratios kernel/fused (target <= 1.15) go to a markdown table printed and
written to ``benchmarks/results/qlsd.md``.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
from jax import lax, random
from numpyro.infer import MCMC

from numpyro_fed import ClientPartition
from numpyro_fed.kernels.base import langevin_move
from numpyro_fed.kernels.qlsd import QLSD

RESULTS = Path(__file__).resolve().parent / "results"


def gauss_model(y):
    theta = numpyro.sample("theta", dist.Normal(0.0, 10.0).expand([y.shape[-1]]).to_event(1))
    with numpyro.plate("data", y.shape[0]):
        numpyro.sample("y", dist.Normal(theta, 1.0).to_event(1), obs=y)


def fused_runner(kern, num_chains):
    """The kernel's recursion as one hand-written scan (same keys, same building blocks)."""
    pot, data, n, gamma = kern.potential, kern.partition, kern.batch_size, kern.step_size
    comp, alpha, period, variant = kern.compressor, kern.memory_rate, kern.refresh_every, \
        kern.variant
    theta_star, g_star = kern.theta_star, kern.g_star
    b = data.num_clients

    def one(i, x, key, eta_i, eta, zeta, gz):
        key, k_noise, k_alg = random.split(key, 3)
        k_batch, k_comp = random.split(k_alg)
        if variant == "#":
            h, off = pot.batch_grads(k_batch, x, data, n), 0.0
        elif variant == "*":
            h, off = pot.batch_grad_diffs(k_batch, x, theta_star, data, n), g_star
        else:
            zeta, gz = lax.cond(i % period == 0, lambda: (x, pot.full_grads(x, data)),
                                lambda: (zeta, gz))
            h, off = pot.batch_grad_diffs(k_batch, x, zeta, data, n) + gz, 0.0
        msg, _ = jax.vmap(comp)(random.split(k_comp, b), h - eta_i if alpha > 0 else h)
        tot = msg.sum(0)
        g = tot + off + (eta if alpha > 0 else 0.0)
        if alpha > 0:
            eta_i, eta = eta_i + alpha * msg, eta + alpha * tot
        return langevin_move(k_noise, x, g, gamma), key, eta_i, eta, zeta, gz

    step = jax.vmap(one, in_axes=(None, 0, 0, 0, 0, 0, 0)) if num_chains > 1 else one

    def body(carry, _):
        i, *rest = carry
        out = step(i, *rest)
        return (i + 1, *out), out[0]

    @jax.jit
    def run(x0, keys, xs):
        zb = jnp.zeros(x0.shape[:-1] + (b, x0.shape[-1]))
        carry = (0, x0, keys, zb, jnp.zeros_like(x0), x0, zb)
        return lax.scan(body, carry, xs)[1]

    return run


def bench(kern, num_chains, num_steps, repeats):
    """Per-step times with compilation excluded.

    The scans are compiled ahead of time and their executables timed over ``num_steps``.
    NumPyro's ``MCMC.run`` recompiles its sampling loop at every call (``fori_collect`` keys
    its compilation cache on a collection function rebuilt per run), so its per-step time is
    the difference quotient (min t(K2) - min t(K1)) / (K2 - K1) with K2 = ``num_steps`` and
    K1 = ``num_steps // 5``: the compilation, the same at both lengths, cancels."""
    d = kern.potential.dim
    keys = random.split(random.PRNGKey(0), num_chains)
    chain_key = keys if num_chains > 1 else keys[0]
    x0 = jnp.zeros((num_chains, d) if num_chains > 1 else (d,))
    xs = jnp.zeros(num_steps)
    state = kern.init(chain_key, 0, None, (), {})

    def mcmc_run(k):
        mcmc = MCMC(kern, num_warmup=0, num_samples=k, num_chains=num_chains,
                    chain_method="vectorized", progress_bar=False)
        # start from a ready state, so that the kernel's Python-side init (model tracing, one
        # NumPyro initialize_model per chain) is not timed: only the sampling loop is
        mcmc.post_warmup_state = state
        t0 = time.perf_counter()
        mcmc.run(random.PRNGKey(0), extra_fields=("bits_up", "bits_down"))
        jax.block_until_ready(mcmc.get_samples())
        return time.perf_counter() - t0

    kscan = jax.jit(lambda state, xs: lax.scan(
        lambda s, _: (kern.sample(s, (), {}), kern.potential.ravel(s.z)), state, xs)[1])
    kscan = kscan.lower(state, xs).compile()
    fused = fused_runner(kern, num_chains).lower(x0, chain_key, xs).compile()
    fns = {"kernel scan": lambda: kscan(state, xs), "fused": lambda: fused(x0, chain_key, xs)}
    out = {k: np.inf for k in fns}
    k1 = max(1, num_steps // 5)
    t_mcmc = {k1: np.inf, num_steps: np.inf}
    for _ in range(repeats):
        for name, fn in fns.items():  # interleaved, so that load changes hit all of them
            t0 = time.perf_counter()
            jax.block_until_ready(fn())
            out[name] = min(out[name], (time.perf_counter() - t0) / num_steps)
        for k in t_mcmc:
            t_mcmc[k] = min(t_mcmc[k], mcmc_run(k))
    out["mcmc"] = (t_mcmc[num_steps] - t_mcmc[k1]) / (num_steps - k1)
    return out


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
            rows.append((f"QLSD{variant}", chains, t["fused"] * 1e6, t["kernel scan"] * 1e6,
                         t["mcmc"] * 1e6, t["kernel scan"] / t["fused"], t["mcmc"] / t["fused"]))
            print(rows[-1], flush=True)
    md = ("| kernel | chains | fused us/step | kernel scan us/step | MCMC us/step | "
          "kernel scan / fused | MCMC / fused |\n|---|---|---|---|---|---|---|\n")
    md += "".join(f"| {r[0]} | {r[1]} | {r[2]:.1f} | {r[3]:.1f} | {r[4]:.1f} | {r[5]:.3f} | "
                  f"{r[6]:.3f} |\n" for r in rows)
    md = (f"### QLSD kernels: time per step (b={b}, d={d}, N={N}/client, n={n}, s=2^4; "
          f"{args.steps} steps, min of {args.repeats} interleaved repeats, compilation "
          "excluded; MCMC by difference quotient between K/5 and K steps)\n\n" + md)
    print(md)
    if not args.smoke:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(md)
    return md


if __name__ == "__main__":
    main()
