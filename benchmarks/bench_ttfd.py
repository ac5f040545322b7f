"""Time to first draw: a user's whole ``MCMC.run`` (compilation included) against the papers'
reference loops, reimplemented in numpy.

Problems (the papers' toys at 20 clients x 500 rows, d = 20, and one realistic size,
50 clients x 1000 rows, d = 50):

* **QLSD family** (QLSD#, QLSD*, QLSD++, 4-bit stochastic quantisation): the QLSD paper's
  Gaussian toy (Vono et al. 2022, Sec. 4), :math:`U_i(\\theta) = \\sum_j \\|\\theta -
  y_{ij}\\|^2/2` with non-iid clients and a N(0, 10^2) prior split over the clients,
  minibatch n = N_i / 10, step :math:`\\gamma = 0.01 / L` as in the authors' notebook, QLSD++
  with l = 100 and memory :math:`\\alpha = 1/(\\omega+1)`, QLSD* with the closed-form
  :math:`\\theta^\\star` (as the authors' notebook; the default federated search is timed
  separately in the diagnosis, ``--diagnose``).
* **ELF family** (D-, P-, B-ELF with Top-5) and **federated LMC**
  (:class:`~numpyro_fed.FederatedLangevin`, full local gradients, identity compressor): the
  ELF paper's Bayesian logistic regression (Karagulyan & Richtárik 2023, Sec. 5), synthetic
  features N(0, I/d), N(0, 1) prior split over the clients, exact local gradients,
  :math:`\\gamma = 10^{-3}`.

**Reference loops** (not the authors' code; their loops reimplemented faithfully in numpy,
as the papers' baselines): one Python iteration per step and, inside it, one per client, each
client computing its gradient by hand-written numpy (``X^T(sigmoid(Xw) - y)``, or
``N_i (x - mean(y_S))``), compressing it (the QLSD notebook's ``SQuantization`` with
``np.random.binomial``; Top-k by ``np.argpartition``) and the server summing and moving
:math:`x` with ``np.random.normal`` noise; every draw is stored, as the notebooks do.

**Ours**: ``MCMC(kernel, num_warmup=0, num_samples=K, progress_bar=False).run(key)`` then
``get_samples()``, timed from the kernel's construction (``FederatedPotential`` analysis of
the model included) to the draws on the host, in a **fresh Python process** for each kernel,
size and K (what a user's script pays; interpreter start-up and ``import jax`` are not
counted, they are in the notes). ``jax.monitoring`` splits the run into tracing, lowering to
MLIR, XLA compilation (and counts the programs compiled); the rest is initialisation,
sampling and Python. The same process then runs the kernel a second time (a new ``MCMC``
object, same shapes), which NumPyro 0.22 recompiles.

Tables: (1) the split of the first run, (2) end to end vs numpy for K = 1000 and 10 000
(targets: <= 0.5 and <= 0.2), (3) steady state per step, compilation excluded, in one
process with interleaved repeats: NumPyro's sampling loop of ``MCMC.run`` compiled once
(:func:`_common.mcmc_loop_runner`), the hand-fused ``lax.scan`` of the same recursion
(:func:`bench_overhead.fused_federated`) and the numpy loop (targets: ours / fused <= 1.5,
ELF >= 10x faster than numpy).
Writes ``benchmarks/results/time-to-first-draw.md``.

Usage: ``python benchmarks/bench_ttfd.py [--sizes toy realistic] [--steps 1000 10000]
[--kernels ...] [--repeats 2]``; ``--smoke`` runs tiny sizes in-process (seconds).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np  # noqa: E402

#: (clients, rows per client, dimension) of each named size
SIZES = {"toy": (20, 500, 20), "realistic": (50, 1000, 50), "smoke": (3, 20, 4)}
KERNELS = ("LMC", "QLSD#", "QLSD*", "QLSD++", "D-ELF", "P-ELF", "B-ELF")
FAMILY = {"LMC": "logistic", "QLSD#": "gauss", "QLSD*": "gauss", "QLSD++": "gauss",
          "D-ELF": "logistic", "P-ELF": "logistic", "B-ELF": "logistic"}
BITS = 4  # QLSD: s = 2^4 levels
TOP_K = 5  # ELF: Top-5 on the compressed links
REFRESH = 100  # QLSD++: l
PRIOR_SCALE_GAUSS = 10.0
GAMMA_LOGISTIC = 1e-3
EVENTS = {
    "/jax/core/compile/jaxpr_trace_duration": "trace",
    "/jax/core/compile/jaxpr_to_mlir_module_duration": "lower",
    "/jax/core/compile/backend_compile_duration": "compile",
}


# ---------------------------------------------------------------------------- problems
def make_problem(family: str, b: int, n_per: int, d: int, seed: int = 0) -> dict:
    """Synthetic client data of a family, as numpy arrays (one entry per client)."""
    rng = np.random.default_rng(seed)
    if family == "gauss":  # the QLSD toy: non-iid client means (the notebook's iid_level)
        mus = rng.normal(0.0, 1.0, size=(b, d))
        ys = [(mus[i] + rng.normal(size=(n_per, d))).astype(np.float32) for i in range(b)]
        total = b * n_per
        theta_star = (np.concatenate(ys).sum(0) / (total + PRIOR_SCALE_GAUSS**-2))
        return {"family": family, "b": b, "n": n_per, "d": d, "y": ys,
                "theta_star": theta_star.astype(np.float32), "gamma": 0.01 / total,
                "batch": max(1, n_per // 10)}
    w = rng.normal(size=d)
    Xs, ys = [], []
    for _ in range(b):
        X = (rng.normal(size=(n_per, d)) / np.sqrt(d)).astype(np.float32)
        Xs.append(X)
        ys.append((rng.uniform(size=n_per) < 1 / (1 + np.exp(-X @ w))).astype(np.float32))
    return {"family": family, "b": b, "n": n_per, "d": d, "X": Xs, "y": ys,
            "gamma": GAMMA_LOGISTIC}


def gauss_model(y):
    """The QLSD toy as a NumPyro model: rows y_j ~ N(theta, I), theta ~ N(0, 10^2 I)."""
    import numpyro
    import numpyro.distributions as dist

    theta = numpyro.sample(
        "theta", dist.Normal(0.0, PRIOR_SCALE_GAUSS).expand([y.shape[-1]]).to_event(1))
    with numpyro.plate("data", y.shape[0]):
        numpyro.sample("y", dist.Normal(theta, 1.0).to_event(1), obs=y)


def make_kernel(name: str, prob: dict):
    """Our kernel ``name`` on ``prob`` (built here: its construction is part of the timing)."""
    from numpyro_fed import ELF, QLSD, ClientPartition, FederatedLangevin, compressors
    from numpyro_fed.examples import logistic_regression

    gamma = prob["gamma"]
    if prob["family"] == "gauss":
        part = ClientPartition.from_clients([{"y": y} for y in prob["y"]])
        variant = name[4:]
        kw = {"theta_star": {"theta": prob["theta_star"]}} if variant == "*" else {}
        return QLSD(gauss_model, part, variant=variant, step_size=gamma,
                    batch_size=prob["batch"], bits=BITS, refresh_every=REFRESH, **kw)
    part = ClientPartition.from_clients(
        [{"X": X, "y": y} for X, y in zip(prob["X"], prob["y"], strict=True)])
    if name == "LMC":
        return FederatedLangevin(logistic_regression, part, step_size=gamma)
    top = compressors.top_k(min(TOP_K, prob["d"]))
    variant = name[0]
    links = {"D": {"uplink": top}, "P": {"downlink": top},
             "B": {"uplink": top, "downlink": top}}[variant]
    return ELF(logistic_regression, part, variant=variant, step_size=gamma, **links)


# ---------------------------------------------------------------------- numpy references
def _squantization(s: int, x: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """The QLSD notebook's ``SQuantization(s, x)`` (stochastic quantisation, eq. (4))."""
    norm_x = np.linalg.norm(x, 2)
    if norm_x == 0:
        return x
    ratio = np.abs(x) / norm_x
    lvl = np.floor(ratio * s)
    p = ratio * s - lvl
    sampled = rng.binomial(1, p)
    return np.sign(x) * norm_x * (lvl + sampled) / s


def _top_k(v: np.ndarray, k: int) -> np.ndarray:
    """Top-k: the ``k`` largest coordinates in absolute value, zeros elsewhere."""
    out = np.zeros_like(v)
    idx = np.argpartition(np.abs(v), -k)[-k:]
    out[idx] = v[idx]
    return out


def _sigmoid(z: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-z))


def numpy_reference(name: str, prob: dict, steps: int, seed: int = 0) -> np.ndarray:
    """The reference loop of kernel ``name``: ``steps`` iterations, every draw stored."""
    rng = np.random.default_rng(seed)
    b, d, gamma = prob["b"], prob["d"], prob["gamma"]
    sq = np.sqrt(2 * gamma)
    x = np.zeros(d)
    theta = np.zeros((steps, d))
    if prob["family"] == "gauss":
        ys = [y.astype(np.float64) for y in prob["y"]]
        sizes = [len(y) for y in ys]
        n = prob["batch"]
        s = 2**BITS
        prior = 1.0 / (PRIOR_SCALE_GAUSS**2 * b)  # prior share of each client
        variant = name[4:]
        omega = min(d / s**2, np.sqrt(d) / s)
        alpha = 1.0 / (omega + 1.0) if variant == "++" else 0.0
        eta = np.zeros((b, d))
        qgrad = np.zeros((b, d))
        ts = prob["theta_star"].astype(np.float64)
        # g* = sum_i grad U_i(theta*) (zero up to rounding for the closed form)
        g_star = sum(N * ts - y.sum(0) + prior * ts for N, y in zip(sizes, ys, strict=True))
        zeta, g_zeta = x.copy(), np.zeros((b, d))
        for t in range(steps):
            if variant == "++" and t % REFRESH == 0:
                zeta = x.copy()
                for i in range(b):
                    g_zeta[i] = sizes[i] * zeta - ys[i].sum(0) + prior * zeta
            memory_sum = eta.sum(axis=0)
            for i in range(b):
                idx = rng.integers(0, sizes[i], size=n)
                if variant == "#":  # N_i/n sum_S grad U_ij(x) + prior share
                    h = sizes[i] * (x - ys[i][idx].mean(0)) + prior * x
                else:  # N_i/n sum_S [grad U_ij(x) - grad U_ij(c)] + prior share difference
                    c = ts if variant == "*" else zeta
                    rows = ys[i][idx]
                    h = (sizes[i] / n) * ((x - rows) - (c - rows)).sum(0) + prior * (x - c)
                    if variant == "++":
                        h = h + g_zeta[i]
                qgrad[i] = _squantization(s, h - eta[i], rng)
                if alpha > 0:
                    eta[i] += alpha * qgrad[i]
            g = np.sum(qgrad, axis=0) + memory_sum + (g_star if variant == "*" else 0.0)
            x = x - gamma * g + sq * rng.normal(size=d)
            theta[t] = x
        return theta
    Xs = [X.astype(np.float64) for X in prob["X"]]
    ys = [y.astype(np.float64) for y in prob["y"]]
    prior = 1.0 / b

    def grad_i(i, w):
        return Xs[i].T @ (_sigmoid(Xs[i] @ w) - ys[i]) + prior * w

    k = min(TOP_K, d)
    if name == "LMC":
        grads = np.zeros((b, d))
        for t in range(steps):
            for i in range(b):
                grads[i] = grad_i(i, x)
            x = x - gamma * grads.sum(0) + sq * rng.normal(size=d)
            theta[t] = x
        return theta
    up, down = name[0] in "DB", name[0] in "PB"
    w = x.copy()
    g_local = np.stack([grad_i(i, w) for i in range(b)])
    g = g_local.sum(0)
    for t in range(steps):
        x = x - gamma * g + sq * rng.normal(size=d)
        w = w + _top_k(x - w, k) if down else x
        for i in range(b):
            h = grad_i(i, w)
            if up:
                c = _top_k(h - g_local[i], k)
                g_local[i] += c
                g += c
            else:
                g_local[i] = h
        if not up:
            g = g_local.sum(0)
        theta[t] = x
    return theta


def gradient_floor(prob: dict, steps: int) -> Callable[[], object] | None:
    """The least a JAX step of a full-gradient kernel (LMC, ELF) costs on this machine: a
    scan of the Langevin move with every client's logistic gradient written by hand
    (:math:`X_i^\\top(\\sigma(X_i\\theta) - y_i) + \\theta/b`, the numpy reference's formula, one
    fused matvec for all rows), no model, no compression. ``None`` for the Gaussian family
    (QLSD's minibatch steps). A compiled no-argument runner."""
    if prob["family"] != "logistic":
        return None
    import jax
    import jax.numpy as jnp
    from _common import compiled_scan
    from jax import lax, random

    X, y = jnp.asarray(np.stack(prob["X"])), jnp.asarray(np.stack(prob["y"]))
    b, n, d = X.shape
    gamma = prob["gamma"]

    def run(x0, key, X, y):
        def body(carry, _):
            x, key = carry
            key, k_noise = random.split(key)
            r = jax.nn.sigmoid((X.reshape(b * n, d) @ x).reshape(b, n)) - y
            grads = jnp.einsum("bnd,bn->bd", X, r) + x / b  # (b, d): every client's gradient
            x = x - gamma * grads.sum(0) + jnp.sqrt(2 * gamma) * random.normal(k_noise, (d,))
            return (x, key), x

        return lax.scan(body, (x0, key), None, length=steps)[1]

    return compiled_scan(run, jnp.zeros(d, jnp.float32), random.PRNGKey(0), X, y)


def time_numpy(name: str, prob: dict, steps: int) -> float:
    """Seconds of one reference run of ``steps`` iterations."""
    t0 = time.perf_counter()
    numpy_reference(name, prob, steps)
    return time.perf_counter() - t0


# ------------------------------------------------------------------ ours, in a fresh process
class _Events:
    """Tracing / lowering / compilation seconds and programs reported by ``jax.monitoring``."""

    def __init__(self) -> None:
        import jax

        self.records: list[tuple[str, str, float]] = []
        jax.monitoring.register_event_duration_secs_listener(self._on)

    def _on(self, event: str, duration: float, fun_name: str = "", **_) -> None:
        if event in EVENTS:
            self.records.append((EVENTS[event], fun_name, duration))

    def take(self) -> dict:
        out: dict = {"trace": 0.0, "lower": 0.0, "compile": 0.0, "programs": 0}
        per: dict[str, float] = defaultdict(float)
        for cat, fun, dur in self.records:
            out[cat] += dur
            if cat == "compile":
                out["programs"] += 1
                per[fun] += dur
        out["per_program"] = sorted(per.items(), key=lambda kv: -kv[1])
        self.records.clear()
        return out


def _timed_run(make_mcmc: Callable, events: _Events) -> dict:
    """Wall seconds of building and running an MCMC (draws on the host), split into the
    kernel's construction and the run's tracing, lowering, compilation and the rest."""
    import jax
    from jax import random

    events.take()
    t0 = time.perf_counter()
    mcmc = make_mcmc()
    t_build = time.perf_counter() - t0
    built = events.take()
    mcmc.run(random.PRNGKey(0))
    jax.block_until_ready(mcmc.get_samples())
    wall = time.perf_counter() - t0
    rec = events.take()
    rec.update(wall=wall, build=t_build,
               build_jax=built["trace"] + built["lower"] + built["compile"],
               build_programs=built["programs"], build_per_program=built["per_program"],
               rest=wall - t_build - rec["trace"] - rec["lower"] - rec["compile"])
    return rec


def worker(spec: dict) -> dict:
    """One fresh-process measurement: ``spec`` = kernel, size, steps, runner (``"MCMC"``,
    NumPyro's, or ``"CachedMCMC"``, ours) and optionally ``cache_dir`` (JAX's persistent
    compilation cache)."""
    if spec.get("diagnose"):
        import ttfd_diagnosis

        return ttfd_diagnosis.phase_worker(spec)
    if spec.get("cache_dir"):
        import numpyro_fed

        numpyro_fed.enable_compilation_cache(spec["cache_dir"],
                                             min_compile_time_s=spec.get("min_compile_time_s", 0))
    import jax  # noqa: F401
    from numpyro.infer import MCMC

    if spec.get("runner", "MCMC") == "CachedMCMC":
        from numpyro_fed import CachedMCMC as MCMC  # noqa: N814
    events = _Events()
    prob = make_problem(FAMILY[spec["kernel"]], *SIZES[spec["size"]])
    steps = spec["steps"]
    holder: dict = {}

    def first():
        holder["kernel"] = make_kernel(spec["kernel"], prob)
        return MCMC(holder["kernel"], num_warmup=0, num_samples=steps, progress_bar=False)

    def again():
        return MCMC(holder["kernel"], num_warmup=0, num_samples=steps, progress_bar=False)

    out = {"first": _timed_run(first, events)}
    if not spec.get("first_only"):
        out["second"] = _timed_run(again, events)
    return out


def run_worker(spec: dict, env: dict | None = None) -> dict:
    """Run :func:`worker` in a fresh Python process and return its result."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", json.dumps(spec)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, **(env or {})})
    for line in proc.stdout.splitlines():
        if line.startswith("TTFD_RESULT "):
            return json.loads(line[len("TTFD_RESULT "):])
    raise RuntimeError(f"worker {spec} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")


def best_of(results: list[dict], key: str) -> dict:
    """The repeat with the smallest wall time of run ``key``."""
    return min((r[key] for r in results), key=lambda r: r["wall"])


# ------------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> str:
    from _common import (
        device_name,
        interleaved_min,
        mcmc_loop_runner,
        md_table,
        write_result,
        xla_threading,
    )
    from bench_overhead import fused_federated

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sizes", nargs="+", default=["toy", "realistic"], choices=list(SIZES))
    p.add_argument("--steps", nargs="+", type=int, default=[1000, 10_000])
    p.add_argument("--kernels", nargs="+", default=list(KERNELS), choices=list(KERNELS))
    p.add_argument("--repeats", type=int, default=2,
                   help="interleaved repeats (fresh processes); the minimum is kept")
    p.add_argument("--numpy-max-steps", type=int, default=2_000,
                   help="numpy runs longer than this are timed at this length and "
                        "extrapolated linearly (a numpy step costs the same at every step)")
    p.add_argument("--ss-steps", type=int, default=2000,
                   help="steps of the steady-state timings (compilation excluded)")
    p.add_argument("--smoke", action="store_true", help="tiny sizes, one repeat, in-process")
    p.add_argument("--diagnose", action="store_true",
                   help="instead: where the compile seconds go (ttfd_diagnosis.py), on the "
                        "first of --sizes and the first of --steps")
    p.add_argument("--diagnose-parts", default="ABCDE", help="parts of the diagnosis to run")
    p.add_argument("--out", default=None, help="results folder (default benchmarks/results)")
    args = p.parse_args(argv)
    if args.diagnose:
        import ttfd_diagnosis

        return ttfd_diagnosis.diagnose(args.kernels, args.sizes[0], args.steps[0], args.repeats,
                                       args.out, args.diagnose_parts)
    if args.smoke:
        args.sizes, args.steps, args.repeats, args.ss_steps = ["smoke"], [20], 1, 20
        args.kernels = ["QLSD++", "B-ELF"]

    specs = [{"kernel": k, "size": s, "steps": n, "first_only": args.smoke} for s in args.sizes
             for k in args.kernels for n in args.steps]
    ours: dict[tuple, list[dict]] = defaultdict(list)
    ref: dict[tuple, float] = {}
    problems = {(f, s): make_problem(f, *SIZES[s]) for s in args.sizes for f in ("gauss",
                                                                                  "logistic")}
    runners = ["MCMC", "CachedMCMC"]
    cache_root = Path(tempfile.mkdtemp(prefix="ttfd-cache-"))
    try:
        for rep in range(args.repeats):
            for spec in specs:
                key = (spec["kernel"], spec["size"], spec["steps"])
                for runner in runners:
                    res = worker(dict(spec, runner=runner)) if args.smoke else \
                        run_worker(dict(spec, runner=runner))
                    ours[key + (runner,)].append(res)
                if not args.smoke:  # persistent cache: cold in the first repeat, then warm
                    folder = cache_root / "-".join(map(str, key))
                    res = run_worker(dict(spec, runner="CachedMCMC", cache_dir=str(folder),
                                          first_only=True))
                    ours[key + ("cold" if rep == 0 else "warm",)].append(res)
                prob = problems[(FAMILY[spec["kernel"]], spec["size"])]
                n_np = min(spec["steps"], args.numpy_max_steps)
                t_np = time_numpy(spec["kernel"], prob, n_np) * spec["steps"] / n_np
                ref[key] = min(ref.get(key, np.inf), t_np)
                f = best_of(ours[key + ("MCMC",)], "first")
                c = best_of(ours[key + ("CachedMCMC",)], "first")
                print(f"[{rep}] {spec['kernel']:7s} {spec['size']:9s} K={spec['steps']:6d}: "
                      f"MCMC {f['wall']:.2f} s (compile {f['compile']:.2f} s), CachedMCMC "
                      f"{c['wall']:.2f} s, numpy {ref[key]:.2f} s", flush=True)
    finally:
        shutil.rmtree(cache_root, ignore_errors=True)

    def first(key, runner):
        runs = ours.get(key + (runner,))
        return best_of(runs, "first") if runs else {"wall": np.nan}

    # (1) split of the first run
    rows_split = []
    for spec in specs:
        if spec["steps"] != min(args.steps):
            continue
        key = (spec["kernel"], spec["size"], spec["steps"])
        for runner in runners:
            runs = ours[key + (runner,)]
            f = best_of(runs, "first")
            s = best_of(runs, "second") if "second" in runs[0] else \
                {"wall": np.nan, "compile": np.nan, "programs": "-"}
            rows_split.append([spec["kernel"], spec["size"], spec["steps"], runner, f["wall"],
                               f["build"], f["build_jax"], f["trace"], f["lower"],
                               f["compile"], f["programs"] + f["build_programs"], f["rest"],
                               s["wall"], s["compile"], s["programs"]])
    # (2) end to end
    rows_e2e = []
    for spec in specs:
        key = (spec["kernel"], spec["size"], spec["steps"])
        target = 0.5 if spec["steps"] <= 1000 else 0.2
        t_m, t_c = first(key, "MCMC")["wall"], first(key, "CachedMCMC")["wall"]
        t_w = first(key, "warm")["wall"]
        rows_e2e.append([spec["kernel"], spec["size"], spec["steps"], ref[key], t_m, t_c, t_w,
                         t_m / ref[key], t_c / ref[key], t_w / ref[key], f"≤ {target}"])
    # (3) steady state, in this process: NumPyro's sampling loop compiled once, the
    # hand-fused scan of the same recursion and the numpy loop, interleaved
    rows_ss = []
    for size in args.sizes:
        for name in args.kernels:
            prob = problems[(FAMILY[name], size)]
            kern = make_kernel(name, prob)
            k = args.ss_steps
            cands = {
                "ours": (mcmc_loop_runner(kern, 1, k), k),
                "fused": (fused_federated(kern, k, 1), k),
                "numpy": ((lambda name=name, prob=prob, k=k: numpy_reference(name, prob, k)), k),
            }
            floor = gradient_floor(prob, k)
            if floor is not None:
                cands["floor"] = (floor, k)
            t = interleaved_min(cands, args.repeats + 1)
            floor_us, numpy_floor = ((1e6 * t["floor"], t["numpy"] / t["floor"]) if "floor" in t
                                     else ("-", "-"))  # QLSD: minibatch steps, no floor
            rows_ss.append([name, size, 1e6 * t["ours"], 1e6 * t["fused"], floor_us,
                            1e6 * t["numpy"], t["ours"] / t["fused"], t["numpy"] / t["ours"],
                            numpy_floor])
            print("steady state", rows_ss[-1], flush=True)

    b_t, n_t, d_t = SIZES[args.sizes[0]]
    md = (f"### Time to first draw: MCMC.run end to end vs the papers' loops in numpy\n\n"
          f"{device_name()}, {xla_threading()}; sizes "
          + ", ".join(f"{s} = {SIZES[s][0]} clients x {SIZES[s][1]} rows, d = {SIZES[s][2]}"
                      for s in args.sizes)
          + f". Ours: a fresh Python process per kernel, size, K and runner, timed from the "
          f"kernel's construction to the draws on the host (MCMC(kernel, num_warmup=0, "
          f"num_samples=K, progress_bar=False).run, get_samples), with NumPyro's `MCMC` and "
          f"with `numpyro_fed.CachedMCMC`; 'warm persistent cache': CachedMCMC in a fresh "
          f"process after `numpyro_fed.enable_compilation_cache()` and one earlier process "
          f"of the same run (the first repeat fills the cache). numpy: the reference loop in "
          f"the parent process. Min of {args.repeats} interleaved repeats (warm cache: of "
          f"{max(1, args.repeats - 1)}).\n\n"
          "#### First MCMC.run in a fresh process: where the time goes (s)\n\n"
          + md_table(["kernel", "size", "K", "runner", "wall", "kernel build", "of which JAX",
                      "run: tracing", "run: lowering", "run: XLA compile", "programs compiled",
                      "run: init + sampling + Python", "2nd run wall", "2nd run compile",
                      "2nd run programs"], rows_split)
          + "\n#### End to end (compilation included) vs numpy reference (s)\n\n"
          + md_table(["kernel", "size", "K", "numpy", "MCMC", "CachedMCMC",
                      "CachedMCMC, warm persistent cache", "MCMC / numpy",
                      "**CachedMCMC / numpy**", "warm cache / numpy", "target"], rows_e2e)
          + f"\n#### Steady state, µs per step ({args.ss_steps} steps, compilation "
          f"excluded, min of {args.repeats + 1} interleaved repeats in one process)\n\n"
          + md_table(["kernel", "size", "ours (MCMC loop)", "hand-fused scan",
                      "gradient floor", "numpy", "**ours / fused** (≤ 1.5)",
                      "**numpy / ours** (ELF ≥ 10)", "numpy / floor"], rows_ss)
          + NOTES)
    print(md)
    write_result("time-to-first-draw", md, args.out)
    return md


NOTES = """
Notes. (i) Interpreter start-up and `import jax, numpyro, numpyro_fed` (about 1-2 s) are
not counted on our side, `import numpy` not on numpy's. (ii) 'kernel build' is the kernel's
construction (the `FederatedPotential` analysis of the model; 'of which JAX': its tracing and
compilation); 'run: ...' split `MCMC.run` + `get_samples`: 'init + sampling + Python' is what
is left after tracing, lowering and compilation: the kernel's `init` (one compiled program), the
compiled sampling loop and NumPyro's bookkeeping. 'programs compiled' counts XLA
compilations of the whole first run, construction included (each eager operation is one).
(iii) The second run uses the same kernel object and shapes in a new `MCMC`; NumPyro 0.22
re-jits its sampling loop (`jit(_fori_collect_loop)`) on every `run`, which is why it
compiles again. (iv) numpy runs longer than `--numpy-max-steps` are extrapolated linearly.
(v) 'gradient floor' (logistic family: LMC and ELF): a scan of the Langevin move with the
clients' gradients written by hand (the numpy reference's formula, one fused matvec for all
rows; no model, no compression): the least a JAX step of a full-gradient kernel costs on this
machine, so 'numpy / floor' bounds the speed-up any JAX implementation of these steps can show.
"""


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--worker":
        result = worker(json.loads(sys.argv[2]))
        result = json.loads(json.dumps(result, default=float))
        print("TTFD_RESULT " + json.dumps(result), flush=True)
    else:
        main()
