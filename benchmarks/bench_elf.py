"""Time per step of the ELF kernels inside ``numpyro.infer.MCMC`` vs a hand-fused
``lax.scan`` of the same recursion and shapes.

Problem: federated logistic regression on breast cancer (d = 31, 40 clients), Top-k with
k = 3 on the compressed links, float32, CPU. For every kernel (D-ELF, P-ELF, B-ELF) and for
1 and 4 vectorized chains we time

* ``MCMC``: ``MCMC(kernel, num_warmup=0, num_samples=n, progress_bar=False)`` collecting the
  default fields (``z``, ``bits``); tracing and compilation time excluded
  (reported by ``jax.monitoring``), initial state cached by NumPyro (same key);
* ``fused``: one jitted ``lax.scan`` doing exactly the ELF recursion (Langevin move, Top-k
  downlink/uplink messages, error-feedback updates) with the same gradient oracle
  (``FederatedPotential.full_grads``), the same ``(b, d)`` / ``(d,)`` state and the draws of
  ``x`` as output; no bit counting, no finiteness check, one key split per step;
* ``fused (hand grad)``: the same scan with the logistic gradients written by hand
  (``X^T (sigmoid(Xw) - y)``), to show what the model-derived gradients cost.

The ratio MCMC / fused (same gradients) is the overhead of the kernel framework (target
<= 1.15). Writes ``benchmarks/results/elf.md``.

Usage: ``python benchmarks/bench_elf.py [--steps 4000] [--repeats 3]``.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax, random
from numpyro.infer import MCMC

from numpyro_fed import ClientPartition, compressors
from numpyro_fed.examples import load_breast_cancer, logistic_regression
from numpyro_fed.kernels.elf import BELF, DELF, PELF

K = 3
GAMMA = 1e-4


def build(num_clients=40):
    X, _, y, _ = load_breast_cancer(dtype=np.float32)
    return ClientPartition.iid({"X": X, "y": y}, num_clients, key=random.key(0))


def make_kernel(variant, part):
    top = compressors.top_k(K)
    cls = {"D": DELF, "P": PELF, "B": BELF}[variant]
    kw = {"D": {"uplink": top}, "P": {"downlink": top}, "B": {"uplink": top, "downlink": top}}
    return cls(logistic_regression, part, step_size=GAMMA, postprocess_deterministic=False,
               **kw[variant])


_COMPILE_EVENTS = (
    "/jax/core/compile/jaxpr_trace_duration",
    "/jax/core/compile/jaxpr_to_mlir_module_duration",
    "/jax/core/compile/backend_compile_duration",
)
_compile_seconds = [0.0]


def _on_event(event, duration, **_):
    if event in _COMPILE_EVENTS:
        _compile_seconds[0] += duration


jax.monitoring.register_event_duration_secs_listener(_on_event)


def time_mcmc(kernel, chains, steps, repeats):
    """Seconds per step of ``MCMC.run`` with the init state cached (same key) and the time
    JAX spends tracing and compiling subtracted (NumPyro re-jits its collection loop on every
    ``run``; tracing/compilation is reported by ``jax.monitoring``)."""
    mcmc = MCMC(kernel, num_warmup=0, num_samples=steps, num_chains=chains,
                chain_method="vectorized", progress_bar=False)
    mcmc.run(random.key(0))  # builds and caches the initial state
    best = np.inf
    for _ in range(repeats):
        _compile_seconds[0] = 0.0
        t0 = time.perf_counter()
        mcmc.run(random.key(0))
        jax.block_until_ready(mcmc.get_samples())
        best = min(best, (time.perf_counter() - t0 - _compile_seconds[0]) / steps)
    return best


def topk(v):
    _, idx = lax.top_k(jnp.abs(v), K)
    return jnp.zeros_like(v).at[idx].set(v[idx])


def fused_chain(variant, grads, d):
    """The ELF recursion as one scan; ``grads(w) -> (b, d)``."""
    up, down = variant in "DB", variant in "PB"
    sq = jnp.sqrt(2.0 * GAMMA)

    def body(carry, _):
        key, x, g_local, g, w = carry
        key, k_noise = random.split(key)
        x = x - GAMMA * g + sq * random.normal(k_noise, (d,))
        w = w + topk(x - w) if down else x
        h = grads(w)
        if up:
            c = jax.vmap(topk)(h - g_local)
            g_local, g = g_local + c, g + c.sum(0)
        else:
            g_local, g = h, h.sum(0)
        return (key, x, g_local, g, w), x

    def run(key, steps):
        x0 = jnp.zeros(d)
        h0 = grads(x0)
        carry = (key, x0, h0, h0.sum(0), x0)
        return lax.scan(body, carry, None, length=steps)[1]

    return run


def hand_grads(part, pot):
    X, y = part.data["X"], part.data["y"].astype(jnp.float32)
    mask = part.mask.astype(jnp.float32)
    b = part.num_clients

    def grads(w):
        r = (jax.nn.sigmoid(jnp.einsum("bnd,d->bn", X, w)) - y) * mask
        return jnp.einsum("bnd,bn->bd", X, r) + w[None] / b  # N(0, 1) prior split over b

    # check against the model-derived gradients
    w = jnp.linspace(-1, 1, pot.dim)
    np.testing.assert_allclose(grads(w), pot.full_grads(w, part), rtol=2e-4, atol=2e-4)
    return grads


def time_fused(variant, grads, d, chains, steps, repeats):
    one = fused_chain(variant, grads, d)
    fn = jax.jit(jax.vmap(lambda k: one(k, steps)), donate_argnums=())
    keys = random.split(random.key(0), chains)
    jax.block_until_ready(fn(keys))  # compile
    best = np.inf
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(keys))
        best = min(best, (time.perf_counter() - t0) / steps)
    return best


def main(argv: list[str] | None = None):
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--steps", type=int, default=4000)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / "elf.md"))
    args = p.parse_args(argv)
    part = build()
    rows = []
    for variant in "DPB":
        kern = make_kernel(variant, part)
        pot = kern.potential
        model_grads = lambda w, pot=pot: pot.full_grads(w, part)
        hg = hand_grads(part, pot)
        for chains in (1, 4):
            t_mcmc = time_mcmc(kern, chains, args.steps, args.repeats)
            t_fused = time_fused(variant, model_grads, pot.dim, chains, args.steps, args.repeats)
            t_hand = time_fused(variant, hg, pot.dim, chains, args.steps, args.repeats)
            rows.append((f"{variant}-ELF", chains, t_mcmc, t_fused, t_hand))
            print(f"{variant}-ELF chains={chains}: MCMC {1e6 * t_mcmc:.1f} us/step, fused "
                  f"{1e6 * t_fused:.1f}, hand-grad fused {1e6 * t_hand:.1f}, ratio "
                  f"{t_mcmc / t_fused:.2f}", flush=True)
    lines = [
        "# ELF kernels: time per step, MCMC vs hand-fused lax.scan",
        "",
        f"Breast cancer logistic regression, d = 31, 40 clients, Top-{K}, float32, "
        f"{jax.devices()[0].platform.upper()} ({jax.device_count()} device), {args.steps} steps, "
        f"best of {args.repeats}.",
        "",
        "| kernel | chains | MCMC (µs/step) | fused scan (µs/step) | ratio (target ≤ 1.15) "
        "| fused, hand-written grads (µs/step) | MCMC / hand-grad |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, chains, tm, tf, th in rows:
        lines.append(f"| {name} | {chains} | {1e6 * tm:.1f} | {1e6 * tf:.1f} | {tm / tf:.2f} "
                     f"| {1e6 * th:.1f} | {tm / th:.2f} |")
    md = "\n".join(lines) + "\n"
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(md)
    print(md)
    return rows


if __name__ == "__main__":
    main()
