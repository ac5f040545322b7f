"""Kernel overhead: every kernel inside ``numpyro.infer.MCMC`` vs a hand-fused ``lax.scan``.

Problem (one for all kernels): Bayesian logistic regression, synthetic data, ``b`` clients of
``N_i`` rows each, dimension ``d`` (defaults b = 20, N_i = 200, d = 50; features
N(0, I/d)), float32. Kernels: federated LMC (:class:`FederatedLangevin`, minibatch n = 20,
identity compressor), QLSD# / QLSD* / QLSD++ (n = 20, 4-bit quantiser, l = 100), D-/P-/B-ELF
(exact local gradients, Top-5), and :class:`ULA` / :class:`MALA` on the pooled model.

For each kernel and for 1 and 4 vectorized chains:

* ``fused`` -- the same recursion written directly as one jitted ``lax.scan`` on flat arrays,
  from the same building blocks (the potential's gradient oracles, the compressor, the
  Langevin move), emitting the draws; no state NamedTuple, no ravel/unravel, no bit
  counters, no divergence check, no NumPyro;
* ``fused+out`` -- the fused scan that also emits what the kernel reports per step beyond
  the draws, where XLA would otherwise drop it as dead code: QLSD's exact Elias-coded bits,
  and :math:`U` for ULA (its default ``potential_energy`` field);
* ``kernel scan`` -- ``lax.scan`` over ``kernel.sample`` emitting the fields MCMC collects;
* ``MCMC`` -- ``MCMC(kernel, num_warmup=0, chain_method="vectorized").run``, compilation
  excluded by difference quotient (see :mod:`_common`).

Target: MCMC / fused <= 1.15. Writes ``benchmarks/results/overhead.md``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
if __name__ == "__main__":  # before anything starts the JAX runtime
    from _common import single_threaded_xla

    single_threaded_xla()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from _common import (  # noqa: E402
    compiled_scan,
    device_name,
    interleaved_min,
    mcmc_candidate,
    mcmc_loop_runner,
    md_table,
    write_result,
    xla_threading,
)
from jax import lax, random  # noqa: E402
from jax.flatten_util import ravel_pytree  # noqa: E402
from numpyro.infer.util import initialize_model  # noqa: E402

from numpyro_fed import ClientPartition, compressors  # noqa: E402
from numpyro_fed.examples import logistic_regression  # noqa: E402
from numpyro_fed.kernels.base import langevin_move  # noqa: E402
from numpyro_fed.kernels.elf import ELF  # noqa: E402
from numpyro_fed.kernels.langevin import MALA, ULA, FederatedLangevin  # noqa: E402
from numpyro_fed.kernels.qlsd import QLSD  # noqa: E402

GAMMA = 1e-3
NOTES = """
Notes. (i) QLSD's kernels report the exact Elias-coded length of every quantised message
(`compressors.quantize`): gaps between nonzero levels need a running maximum over the
coordinates (`lax.associative_scan`, 3.4x faster than `lax.cummax` on CPU; a sort-based
variant measured no faster). That count is most of the QLSD rows' 'MCMC / fused' excess;
against the fused scan that computes it too ('fused+out') the kernels are within the target.
(ii) ULA tracks U(x) by default (`potential_energy`, diagnostics); its recursion needs only
the gradient, and XLA drops U's own arithmetic (one `exp` and one `log1p` per row) from the
fused ULA scan. `ULA(track_potential=False)` skips it (same draws, bit for bit; tested).
(iii) Ratios of single rows on a 2-core CPU are uncertain by about ±10% on an idle machine
and ±30% under load.
(iv) With 4 chains, `ULA(track_potential=False)` runs 0.7-0.87x the time of its fused
reference in every run so far: the reference (one chain's scan, `vmap`-ed) is not a lower
bound there (we did not find why XLA compiles it slower), so that row understates ULA's
overhead rather than overstating it.
"""


def make_data(b: int, n_per: int, d: int, seed: int = 0):
    """Synthetic logistic regression: pooled arrays and their iid client partition."""
    rng = np.random.default_rng(seed)
    w = rng.normal(size=d)
    X = (rng.normal(size=(b * n_per, d)) / np.sqrt(d)).astype(np.float32)
    y = (rng.uniform(size=b * n_per) < 1 / (1 + np.exp(-X @ w))).astype(np.float32)
    return X, y, ClientPartition.iid({"X": X, "y": y}, b, key=random.PRNGKey(seed))


def part_dim(part) -> int:
    """Parameter dimension of the logistic model on ``part`` (columns of ``X``)."""
    return int(part.data["X"].shape[-1])


def make_kernels(part, n: int, bits: int = 4, k: int = 5) -> dict:
    """The kernels of the table, by name (federated ones on ``part``)."""
    kw = dict(step_size=GAMMA, postprocess_deterministic=False)
    k = min(k, part_dim(part))
    top = compressors.top_k(k)
    kernels = {
        "LMC (FederatedLangevin)": FederatedLangevin(logistic_regression, part, batch_size=n,
                                                     **kw),
    }
    for v in ("#", "*", "++"):
        kernels[f"QLSD{v} {bits}-bit"] = QLSD(logistic_regression, part, variant=v,
                                              batch_size=n, bits=bits, refresh_every=100, **kw)
    kernels[f"D-ELF top-{k}"] = ELF(logistic_regression, part, variant="D", uplink=top, **kw)
    kernels[f"P-ELF top-{k}"] = ELF(logistic_regression, part, variant="P", downlink=top, **kw)
    kernels[f"B-ELF top-{k}"] = ELF(logistic_regression, part, variant="B", uplink=top,
                                    downlink=top, **kw)
    kernels["ULA"] = ULA(logistic_regression, step_size=GAMMA)
    kernels["ULA (track_potential=False)"] = ULA(logistic_regression, step_size=GAMMA,
                                                 track_potential=False)
    kernels["MALA"] = MALA(logistic_regression, step_size=GAMMA, adapt_step_size=False)
    return kernels


# ------------------------------------------------------------------ hand-fused recursions
def fused_federated(kern, steps: int, chains: int, with_bits: bool = False):
    """The recursion of a federated kernel (LMC, QLSD, ELF) as one scan over flat arrays.

    Keys are split as in the kernels. The iteration counter is shared by the chains (QLSD++'s
    refresh stays a real ``lax.cond``). Returns a compiled no-argument runner."""
    fn, args = fused_federated_fn(kern, steps, chains, with_bits)
    return compiled_scan(fn, *args)


def fused_federated_fn(kern, steps: int, chains: int, with_bits: bool = False):
    """:func:`fused_federated` before compilation: ``(fn, args)``."""
    pot, data, n, gamma = kern.potential, kern.partition, kern.batch_size, kern.step_size
    b, d = data.num_clients, pot.dim
    comp = kern.compressor

    def oracle(k, x):
        return pot.full_grads(x, data) if n is None else pot.batch_grads(k, x, data, n)

    if isinstance(kern, QLSD):
        variant, alpha, period = kern.variant, kern.memory_rate, kern.refresh_every
        kern.init(random.PRNGKey(0), 0, None, (), {})  # QLSD*: finds theta* once
        theta_star, g_star = kern.theta_star, kern.g_star

        def one(i, x, key, st):
            eta_i, eta, zeta, gz = st
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
            msg, bits = jax.vmap(comp)(random.split(k_comp, b), h - eta_i if alpha > 0 else h)
            tot = msg.sum(0)
            g = tot + off + (eta if alpha > 0 else 0.0)
            if alpha > 0:
                eta_i, eta = eta_i + alpha * msg, eta + alpha * tot
            x = langevin_move(k_noise, x, g, gamma)
            return x, key, (eta_i, eta, zeta, gz), bits.sum()

        def init_st(x):
            z = jnp.zeros((b, d), x.dtype)
            return (z, jnp.zeros_like(x), x, z)

    elif isinstance(kern, ELF):
        up_c, down_c = kern.uplink, kern.downlink
        cu, cd = kern._compress_up, kern._compress_down

        def one(i, x, key, st):
            g_local, g, w = st
            key, k_noise, k_alg = random.split(key, 3)
            k_batch, k_down, k_up = random.split(k_alg, 3)
            x = langevin_move(k_noise, x, g, gamma)
            w = w + down_c(k_down, x - w)[0] if cd else x
            h = oracle(k_batch, w)
            if cu:
                c, bits = jax.vmap(up_c)(random.split(k_up, b), h - g_local)
                g_local, g = g_local + c, g + c.sum(0)
            else:
                g_local, g, bits = h, h.sum(0), jnp.zeros((b,), jnp.int32)
            return x, key, (g_local, g, w), bits.sum()

        def init_st(x):
            h = pot.full_grads(x, data)
            return (h, h.sum(0), x)

    else:  # FederatedLangevin

        def one(i, x, key, st):
            key, k_noise, k_alg = random.split(key, 3)
            k_batch, k_comp = random.split(k_alg)
            msg, bits = jax.vmap(comp)(random.split(k_comp, b), oracle(k_batch, x))
            return langevin_move(k_noise, x, msg.sum(0), gamma), key, st, bits.sum()

        def init_st(x):
            return ()

    step = jax.vmap(one, in_axes=(None, 0, 0, 0)) if chains > 1 else one

    def body(carry, _):
        i, x, key, st = carry
        x, key, st, bits = step(i, x, key, st)
        return (i + 1, x, key, st), ((x, bits) if with_bits else x)

    partition = data

    def run(x0, keys, data_arg):
        # the client data enter the compiled scan as an argument, as they enter the kernels
        # (MCMC passes them in the state): the closures above read `data` when traced here.
        # Baked in as constants they let XLA specialise the program (measured on the QLSD
        # Gaussian toy: 94 vs 122 us/step for the same kernel scan), which no user run gets.
        nonlocal data
        data = data_arg
        st = jax.vmap(init_st)(x0) if chains > 1 else init_st(x0)
        return lax.scan(body, (0, x0, keys, st), None, length=steps)[1]

    keys = random.split(random.PRNGKey(0), chains) if chains > 1 else random.PRNGKey(0)
    x0 = jnp.zeros((chains, d) if chains > 1 else (d,))
    return run, (x0, keys, partition)


def fused_pooled(model_kwargs: dict, steps: int, chains: int, mala: bool, emit_u: bool = False):
    """ULA / MALA (fixed step) on the pooled model as one scan; the potential is NumPyro's
    ``potential_fn`` of the model (the same one the kernels differentiate). ``emit_u``: also
    emit :math:`U` of every draw (what ULA reports by default; otherwise XLA drops it from
    the ULA scan as dead code)."""
    info = initialize_model(random.PRNGKey(0), logistic_regression, model_kwargs=model_kwargs)
    flat, unravel = ravel_pytree(info.param_info.z)
    pe = lambda x: info.potential_fn(unravel(x))  # noqa: E731
    vg = jax.value_and_grad(pe)

    def body(carry, _):
        x, u, g, key = carry
        key, k_noise, k_acc = random.split(key, 3)
        y = langevin_move(k_noise, x, g, GAMMA)
        u_y, g_y = vg(y)
        if mala:
            fwd, bwd = y - x + GAMMA * g, x - y + GAMMA * g_y
            log_r = u - u_y + (jnp.sum(fwd**2) - jnp.sum(bwd**2)) / (4 * GAMMA)
            acc = jnp.log(random.uniform(k_acc)) < log_r
            y, u_y, g_y = (jnp.where(acc, a, c) for a, c in ((y, x), (u_y, u), (g_y, g)))
        return (y, u_y, g_y, key), ((y, u_y) if emit_u else y)

    def one(key):
        x0 = jnp.zeros_like(flat)
        u, g = vg(x0)
        return lax.scan(body, (x0, u, g, key), None, length=steps)[1]

    keys = random.split(random.PRNGKey(0), chains)
    fn = jax.vmap(one) if chains > 1 else (lambda k: one(k[0]))
    return compiled_scan(fn, keys)


def kernel_scan(kern, steps: int, chains: int, model_kwargs: dict):
    """``lax.scan`` over ``kernel.sample`` emitting the fields MCMC collects."""
    key = random.split(random.PRNGKey(0), chains) if chains > 1 else random.PRNGKey(0)
    state = kern.init(key, 0, None, (), model_kwargs)
    fields = tuple(dict.fromkeys((kern.sample_field, *kern.default_fields)))

    def run(state):
        def body(s, _):
            s = kern.sample(s, (), model_kwargs)
            return s, tuple(getattr(s, f) for f in fields)

        return lax.scan(body, state, None, length=steps)[1]

    return compiled_scan(run, state)


def main(argv: list[str] | None = None) -> str:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--clients", type=int, default=20)
    p.add_argument("--rows", type=int, default=200, help="rows per client")
    p.add_argument("--dim", type=int, default=50)
    p.add_argument("--batch", type=int, default=20,
                   help="minibatch n of LMC and QLSD (0: full local gradients)")
    p.add_argument("--steps", type=int, default=4000)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--chains", type=int, nargs="+", default=[1, 4])
    p.add_argument("--kernels", nargs="*", default=None, help="substrings of kernel names")
    p.add_argument("--mcmc-run", action="store_true",
                   help="also time whole MCMC.run calls (difference quotient; noisy)")
    p.add_argument("--out", default=None, help="results folder (default benchmarks/results)")
    args = p.parse_args(argv)
    X, y, part = make_data(args.clients, args.rows, args.dim)
    pooled = {"X": jnp.asarray(X), "y": jnp.asarray(y)}
    kernels = make_kernels(part, args.batch or None)
    if args.kernels:
        kernels = {k: v for k, v in kernels.items() if any(s in k for s in args.kernels)}
    rows = []
    for name, kern in kernels.items():
        fed = not isinstance(kern, ULA | MALA)
        run_kw = {} if fed else pooled
        for chains in args.chains:
            cands = {}
            if fed:
                cands["fused"] = (fused_federated(kern, args.steps, chains), args.steps)
                if isinstance(kern, QLSD):
                    cands["fused+bits"] = (fused_federated(kern, args.steps, chains, True),
                                           args.steps)
            else:
                cands["fused"] = (fused_pooled(pooled, args.steps, chains,
                                               isinstance(kern, MALA)), args.steps)
                if isinstance(kern, ULA) and kern.track_potential:
                    cands["fused+bits"] = (fused_pooled(pooled, args.steps, chains, False, True),
                                           args.steps)
            cands["kernel scan"] = (kernel_scan(kern, args.steps, chains, run_kw), args.steps)
            cands["MCMC loop"] = (mcmc_loop_runner(kern, chains, args.steps, run_kw),
                                  args.steps)
            if args.mcmc_run:
                cands["MCMC"] = mcmc_candidate(kern, chains, args.steps, run_kw)
            t = interleaved_min(cands, args.repeats)
            fb = t.get("fused+bits", np.nan)
            run = t.get("MCMC", np.nan)
            rows.append([name, chains, 1e6 * t["fused"], 1e6 * fb, 1e6 * t["kernel scan"],
                         1e6 * t["MCMC loop"], t["kernel scan"] / t["fused"],
                         t["MCMC loop"] / t["fused"], t["MCMC loop"] / fb, 1e6 * run,
                         run / t["fused"]])
            print("  ".join(str(v) if not isinstance(v, float) else f"{v:.3g}"
                            for v in rows[-1]), flush=True)
    head = ["kernel", "chains", "fused µs/step", "fused+out µs/step", "kernel scan µs/step",
            "MCMC loop µs/step", "kernel scan / fused", "**MCMC / fused** (≤ 1.15)",
            "MCMC / fused+out", "MCMC.run µs/step (diff. quotient)", "MCMC.run / fused"]
    md = (f"### Kernel overhead: MCMC vs hand-fused lax.scan\n\n"
          f"Logistic regression, b = {args.clients} clients × {args.rows} rows, d = {args.dim}, "
          f"minibatch n = {args.batch or 'all rows'} (LMC, QLSD), exact gradients (ELF, ULA, "
          "MALA on the "
          f"pooled {args.clients * args.rows} rows), float32, {device_name()}, "
          f"{xla_threading()}. {args.steps} steps, min of {args.repeats} interleaved repeats, "
          "compilation excluded. 'MCMC "
          "loop' is NumPyro's own sampling loop of MCMC.run (fori_collect with its "
          "cond-guarded collection buffer, per-step postprocess of z, default fields: z "
          "and the federated kernels' bits) compiled once and timed as an executable, "
          "because NumPyro 0.22's MCMC.run recompiles it on every call (2-10 s here); "
          "'MCMC.run' (with "
          "--mcmc-run) times whole calls by difference quotient between K/4 and K samples "
          "after subtracting the compile time reported by jax.monitoring. 'fused+out': the "
          "fused scan also emitting what the kernel reports per step beyond the draws: the "
          "exact coded bits of the quantiser (QLSD rows) or U (ULA's default "
          "`potential_energy`); XLA drops them from the plain fused scan as dead code.\n\n"
          + md_table(head, rows) + NOTES)
    print(md)
    write_result("overhead", md, args.out)
    return md


if __name__ == "__main__":
    main()
