"""Large scale: Bayesian logistic regression, N = 10^6 rows, d = 50, 1000 clients.

Centralised NUTS on the full data vs our variance-reduced federated kernels, LSD* / LSD++
(identity compressor) and their 4-bit QLSD versions, all single chains started at the prior
median (``init_to_median``).

**Reference.** The Laplace approximation at the MAP (Newton's method on the full data,
float64 Hessian): for a well-conditioned logistic posterior with N = 10^6 the Bernstein-von
Mises error of its mean and standard deviations is O(N^{-1/2}) relative to the posterior sd
(about 0.001 sd here), two orders of magnitude below the tolerances, so it stands in for the
"long reference run" at a fraction of its cost (``--reference nuts`` uses a long NUTS run
instead, for the full version).

**Criterion.** Running estimates from the first k post-warmup draws are compared with the
reference: posterior-mean error = RMS over the d coordinates of |mean_k - mean_ref| / sd_ref
(≤ 0.1) and sd error = RMS of |sd_k / sd_ref - 1| (≤ 10%); the max over coordinates is
reported too. "Reached at k" = the first checkpoint (every ``--checkpoint`` draws) from which
every later checkpoint satisfies both.

**Wall time to the criterion** = warmup phase (for our kernels: init, QLSD*'s federated
theta* search, burn-in) + k x the measured time per post-warmup draw; "compile excluded"
subtracts the tracing/compilation time reported by ``jax.monitoring``, "compile included"
does not. Bits: the cumulative uplink + downlink bits (init rounds, theta* search, burn-in and
the k draws). Step size: gamma = c / L with L = lambda_max(X^T X)/4 + 1, the global Lipschitz
constant of the gradient (clients can compute it from their d x d Gram matrices once;
those d^2 floats are not counted), c = ``--gamma-scale``.

Target: our best kernel reaches the criterion in <= 1/5 of NUTS's wall time. Writes
``benchmarks/results/large.md``.
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
import numpy as np  # noqa: E402
from _common import _compile_seconds, device_name, md_table, write_result  # noqa: E402
from jax import random  # noqa: E402
from numpyro.infer import MCMC, NUTS  # noqa: E402
from numpyro.infer.initialization import init_to_median  # noqa: E402

from numpyro_fed import ClientPartition  # noqa: E402
from numpyro_fed.bits import counter_value  # noqa: E402
from numpyro_fed.examples import logistic_regression  # noqa: E402
from numpyro_fed.kernels.qlsd import QLSD  # noqa: E402


def make_data(N: int, d: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    X = rng.normal(size=(N, d)).astype(np.float32)
    w = rng.normal(size=d) / np.sqrt(d)
    y = (rng.uniform(size=N) < 1 / (1 + np.exp(-(X @ w)))).astype(np.float32)
    return X, y


def laplace(X, y, iters: int = 12):
    """MAP by Newton's method (N(0, 1) prior) and the Laplace mean / sd."""
    Xj, yj = jnp.asarray(X), jnp.asarray(y)

    @jax.jit
    def newton(w):
        p = jax.nn.sigmoid(Xj @ w)
        g = Xj.T @ (p - yj) + w
        H = (Xj * (p * (1 - p))[:, None]).T @ Xj
        H = H.astype(jnp.float64) if jax.config.jax_enable_x64 else H
        return w - jnp.linalg.solve(H + jnp.eye(w.shape[0], dtype=H.dtype), g).astype(w.dtype), H

    w = jnp.zeros(X.shape[1], jnp.float32)
    for _ in range(iters):
        w, H = newton(w)
    cov = np.linalg.inv(np.asarray(H, np.float64) + np.eye(X.shape[1]))
    return np.asarray(w, np.float64), np.sqrt(np.diag(cov))


def errors(draws: np.ndarray, mean_ref, sd_ref, checkpoints):
    """RMS and max of the mean error (in sd units) and sd relative error at each checkpoint."""
    c1 = np.cumsum(draws, 0)
    c2 = np.cumsum(draws.astype(np.float64) ** 2, 0)
    out = []
    for k in checkpoints:
        m = c1[k - 1] / k
        sd = np.sqrt(np.maximum(c2[k - 1] / k - m**2, 0) * k / max(k - 1, 1))
        em, es = np.abs(m - mean_ref) / sd_ref, np.abs(sd / sd_ref - 1)
        out.append((np.sqrt(np.mean(em**2)), em.max(), np.sqrt(np.mean(es**2)), es.max()))
    return np.array(out)


def reached(errs, checkpoints, tol_mean: float, tol_sd: float):
    """First checkpoint from which every later one satisfies both RMS criteria (or None)."""
    ok = (errs[:, 0] <= tol_mean) & (errs[:, 2] <= tol_sd)
    for j in range(len(ok)):
        if ok[j:].all():
            return j
    return None


def timed_phase(fn):
    _compile_seconds[0] = 0.0
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0, _compile_seconds[0]


def run_sampler(kernel, warmup: int, samples: int, run_kwargs: dict, fields=()):
    """Warmup and sampling phases timed separately; returns draws, timings, last states."""
    mcmc = MCMC(kernel, num_warmup=warmup, num_samples=samples, progress_bar=False)
    tw, cw = timed_phase(lambda: (mcmc.warmup(random.PRNGKey(1), extra_fields=fields,
                                              **run_kwargs),
                                  jax.block_until_ready(mcmc.post_warmup_state)))
    warm_state = mcmc.post_warmup_state
    ts, cs = timed_phase(lambda: (mcmc.run(random.PRNGKey(2), extra_fields=fields, **run_kwargs),
                                  jax.block_until_ready(mcmc.get_samples())))
    return mcmc, warm_state, dict(warm=tw, warm_compile=cw, sample=ts, sample_compile=cs)


def main(argv: list[str] | None = None) -> str:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, default=1_000_000)
    p.add_argument("--clients", type=int, default=1000)
    p.add_argument("--dim", type=int, default=50)
    p.add_argument("--batch", type=int, default=10, help="per-client minibatch")
    p.add_argument("--refresh-every", type=int, default=100, help="l of LSD++/QLSD++")
    p.add_argument("--gamma-scale", type=float, default=0.15)
    p.add_argument("--fed-warmup", type=int, default=500)
    p.add_argument("--fed-samples", type=int, default=4000)
    p.add_argument("--nuts-warmup", type=int, default=200)
    p.add_argument("--nuts-samples", type=int, default=300, help="0 skips NUTS")
    p.add_argument("--checkpoint", type=int, default=0, help="0: 50 checkpoints per run")
    p.add_argument("--kernels", nargs="+", default=["LSD*", "QLSD* 4-bit", "LSD++",
                                                    "QLSD++ 4-bit"])
    p.add_argument("--reference", choices=["laplace", "nuts"], default="laplace")
    p.add_argument("--reference-samples", type=int, default=20_000)
    p.add_argument("--tol-mean", type=float, default=0.1)
    p.add_argument("--tol-sd", type=float, default=0.1)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    N, d, b = args.rows, args.dim, args.clients
    t0 = time.perf_counter()
    X, y = make_data(N, d)
    t_ref = time.perf_counter()
    if args.reference == "laplace":
        mean_ref, sd_ref = laplace(X, y)
    else:
        m = MCMC(NUTS(logistic_regression, init_strategy=init_to_median), num_warmup=1000,
                 num_samples=args.reference_samples, progress_bar=False)
        m.run(random.PRNGKey(123), X=jnp.asarray(X), y=jnp.asarray(y))
        ref = np.asarray(m.get_samples()["w"], np.float64)
        mean_ref, sd_ref = ref.mean(0), ref.std(0, ddof=1)
    t_ref = time.perf_counter() - t_ref
    print(f"data + reference ({args.reference}) in {time.perf_counter() - t0:.1f} s", flush=True)
    L = float(np.linalg.eigvalsh(X.T.astype(np.float64) @ X)[-1]) / 4 + 1.0
    gamma = args.gamma_scale / L
    rows, results = [], {}

    def record(name, mcmc, warm_state, times, draws, bits_fn, samples, extra=""):
        ck = args.checkpoint or max(1, samples // 50)
        checkpoints = list(range(ck, samples + 1, ck))
        errs = errors(draws, mean_ref, sd_ref, checkpoints)
        j = reached(errs, checkpoints, args.tol_mean, args.tol_sd)
        per_draw = (times["sample"] - times["sample_compile"]) / samples
        warm_ex = times["warm"] - times["warm_compile"]
        compile_s = times["warm_compile"] + times["sample_compile"]
        if j is None:
            k, t_ex, t_in, bits = None, np.nan, np.nan, bits_fn(None)
        else:
            k = checkpoints[j]
            t_ex = warm_ex + k * per_draw
            t_in, bits = t_ex + compile_s, bits_fn(k)
        fin = errs[-1]
        results[name] = t_ex
        rows.append([name, k if k is not None else f"not within {samples}", t_ex, t_in,
                     compile_s, 1e3 * per_draw, fin[0], fin[1], fin[2], fin[3],
                     bits if bits is not None else "-", extra])
        print(rows[-1], flush=True)

    # ---- NUTS, centralised, full data
    if args.nuts_samples > 0:
        Xj, yj = jnp.asarray(X), jnp.asarray(y)
        nuts = NUTS(logistic_regression, init_strategy=init_to_median)
        mcmc, warm, times = run_sampler(nuts, args.nuts_warmup, args.nuts_samples,
                                        {"X": Xj, "y": yj}, fields=("num_steps",))
        draws = np.asarray(mcmc.get_samples()["w"], np.float64)
        steps = np.asarray(mcmc.get_extra_fields()["num_steps"])
        record("NUTS (centralised)", mcmc, warm, times, draws, lambda k: None,
               args.nuts_samples, f"{steps.mean():.1f} leapfrog steps/draw (full-data gradients)")
        del mcmc

    # ---- ours
    part = ClientPartition.iid({"X": X, "y": y}, b, key=random.PRNGKey(0))
    for name in args.kernels:
        variant = "*" if "*" in name else "++"
        bits = 4 if name.startswith("QLSD") else None
        kern = QLSD(logistic_regression, part, variant=variant, step_size=gamma,
                    batch_size=args.batch, bits=bits, refresh_every=args.refresh_every,
                    init_strategy=init_to_median, postprocess_deterministic=False)
        mcmc, warm, times = run_sampler(kern, args.fed_warmup, args.fed_samples, {})
        draws = np.asarray(mcmc.get_samples()["w"], np.float64)
        ex = mcmc.get_extra_fields()
        per_step = np.cumsum(np.asarray(ex["bits"], np.float64).sum(-1))  # up + down
        base = float(counter_value(warm.total_up) + counter_value(warm.total_down))

        def bits_fn(k, base=base, per_step=per_step):
            return base + (per_step[k - 1] if k else per_step[-1])

        extra = f"gamma={gamma:.3g}"
        if kern.theta_star_search is not None:
            s = kern.theta_star_search
            extra += f"; theta* search: {s.rounds} rounds ({s.method})"
        record(name, mcmc, warm, times, draws, bits_fn, args.fed_samples, extra)
        del mcmc

    nuts_t = results.get("NUTS (centralised)", np.nan)
    ours = {k: v for k, v in results.items() if k != "NUTS (centralised)" and np.isfinite(v)}
    best = min(ours, key=ours.get) if ours else None
    if best and np.isfinite(nuts_t):
        summary = (f"Best federated kernel: **{best}**, {ours[best]:.1f} s vs NUTS {nuts_t:.1f} s "
                   f"(ratio {ours[best] / nuts_t:.3f}; target ≤ 0.2), compile excluded.")
    elif best:
        summary = (f"Best federated kernel: **{best}**, {ours[best]:.1f} s; NUTS did not reach "
                   "the criterion within its run (increase --nuts-samples).")
    else:
        summary = ("No federated kernel reached the criterion within its run (increase "
                   "--fed-samples).")
    head = ["sampler", "draws to criterion", "wall s (compile excl.)",
            "wall s (compile incl.)", "compile s", "ms / draw", "final mean err RMS (sd)",
            "max", "final sd rel. err RMS", "max", "bits sent (up + down)", "notes"]
    md = (f"### Large scale: logistic regression, N = {N}, d = {d}, {b} clients\n\n"
          f"Reference: {args.reference} (computed in {t_ref:.1f} s). Criterion: RMS over "
          f"coordinates of posterior-mean error ≤ {args.tol_mean} sd and of sd relative error ≤ "
          f"{args.tol_sd:.0%}. NUTS: {args.nuts_warmup} warmup + {args.nuts_samples} draws; "
          f"federated: minibatch n = {args.batch} per client, {args.fed_warmup} burn-in + "
          f"{args.fed_samples} draws, l = {args.refresh_every}. {device_name()}.\n\n"
          + md_table(head, rows) + "\n" + summary + "\n")
    print(md)
    write_result("large", md, args.out)
    return md


if __name__ == "__main__":
    main()
