"""Where the compile seconds of a first ``MCMC.run`` go (``bench_ttfd.py --diagnose``).

Five measurements on the toy size of :mod:`bench_ttfd` (``--size`` to change it), written to
``benchmarks/results/time-to-first-draw-diagnosis.md``; the conclusions and the proposals drawn
from them are in ``benchmarks/README.md`` ("Time to first draw").

A. **Programs per phase** (a fresh process per kernel): every XLA compilation of a user's first
   ``MCMC.run`` (``jax.monitoring``), attributed to the kernel's construction, its ``init``,
   NumPyro's sampling loop (``jit(_fori_collect_loop)``) and NumPyro's eager operations around
   the loop, then a second run (new ``MCMC``, same kernel); QLSD* also with its default
   federated :math:`\\theta^\\star` search, and NumPyro's progress bar (its default) on LMC.
B. **The sampling loop** (one process, interleaved repeats): the size of the program
   ``MCMC.run`` compiles (StableHLO text, operations, bytes of constants), and its compilation
   time and 1000-step run time under XLA options given per compilation
   (``lowered.compile(compiler_options)``).
C. **Building blocks** (one process): compilation time of each part of a step at the
   kernels' shapes (a key split, the Langevin noise, exact and minibatch gradients, the
   compressors with their bit counts, one kernel step), and the PRNG calls per step.
D. **One PRNG call per step**: the hand-fused QLSD# and LMC scans of ``bench_overhead`` (the
   kernels' key splits) against the same recursion drawing all of a step's random words from
   one ``random.bits`` call: compilation and run time.
E. **Persistent compilation cache** (fresh processes): a first run with a cold cache, then
   with a warm one, with ``min_compile_time_s`` 0 (every program cached) and 0.1 (the default
   of :func:`numpyro_fed.enable_compilation_cache` so far).
"""

from __future__ import annotations

import re
import shutil
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import bench_ttfd as B
import numpy as np

XLA_OPTIONS = {
    "default": {},
    "xla_llvm_disable_expensive_passes": {"xla_llvm_disable_expensive_passes": True},
    "xla_cpu_use_fusion_emitters=false": {"xla_cpu_use_fusion_emitters": False},
    "xla_backend_optimization_level=0": {"xla_backend_optimization_level": 0},
    "fusion_emitters=false, opt level 1 (SAEM's loops)": {
        "xla_cpu_use_fusion_emitters": False, "xla_backend_optimization_level": 1},
}
_RANDOM_PRIMS = ("threefry2x32", "random_bits", "random_split", "random_fold_in")


# --------------------------------------------------------------------- A: programs per phase
def phase_worker(spec: dict) -> dict:
    """Fresh-process worker of part A: compile seconds and programs by phase."""
    import jax
    from jax import random
    from numpyro.infer import MCMC

    phase = ["kernel build"]
    recs: list[tuple[str, str, str, float]] = []

    def on(event: str, duration: float, fun_name: str = "", **_) -> None:
        if event in B.EVENTS:
            recs.append((phase[0], B.EVENTS[event], fun_name, duration))

    jax.monitoring.register_event_duration_secs_listener(on)
    prob = B.make_problem(B.FAMILY[spec["kernel"]], *B.SIZES[spec["size"]])
    t0 = time.perf_counter()
    if spec.get("search"):  # QLSD* without theta_star: the default federated search
        prob = dict(prob, theta_star=None)
        kern = _qlsd_star_search_kernel(prob)
    else:
        kern = B.make_kernel(spec["kernel"], prob)
    wall = {"kernel build": time.perf_counter() - t0}
    init = kern.init

    def tagged_init(*args, **kwargs):
        phase[0] = "init"
        t = time.perf_counter()
        try:
            return init(*args, **kwargs)
        finally:
            wall["init"] = wall.get("init", 0.0) + time.perf_counter() - t
            phase[0] = "run"

    kern.init = tagged_init
    runs = []
    for label in ("first", "second"):
        phase[0] = "run"
        if label == "second":
            recs.clear()
        t = time.perf_counter()
        mcmc = MCMC(kern, num_warmup=0, num_samples=spec["steps"],
                    progress_bar=bool(spec.get("progress_bar")))
        mcmc.run(random.PRNGKey(0))
        jax.block_until_ready(mcmc.get_samples())
        run_wall = time.perf_counter() - t
        out: dict = defaultdict(lambda: {"programs": 0, "trace": 0.0, "lower": 0.0,
                                         "compile": 0.0, "top": defaultdict(float)})
        for ph, cat, fun, dur in recs:
            if ph == "run":
                ph = "sample loop" if "_fori_collect_loop" in fun or fun.endswith(
                    "_body_fn)") or fun == "_body_fn" else "NumPyro eager ops"
            out[ph][cat] += dur
            if cat == "compile":
                out[ph]["programs"] += 1
                out[ph]["top"][fun] += dur
        runs.append({"label": label, "wall": run_wall + (wall["kernel build"]
                                                          if label == "first" else 0.0),
                     "phases": {k: dict(v, top=sorted(v["top"].items(), key=lambda kv: -kv[1]))
                                for k, v in out.items()}})
    return {"runs": runs, "build_wall": wall["kernel build"]}


def _qlsd_star_search_kernel(prob: dict):
    from numpyro_fed import QLSD, ClientPartition

    part = ClientPartition.from_clients([{"y": y} for y in prob["y"]])
    return QLSD(B.gauss_model, part, variant="*", step_size=prob["gamma"],
                batch_size=prob["batch"], bits=B.BITS)


def part_a(kernels: list[str], size: str, steps: int) -> str:
    from _common import md_table

    specs = [{"kernel": k, "size": size, "steps": steps} for k in kernels]
    if "QLSD*" in kernels:
        specs.append({"kernel": "QLSD*", "size": size, "steps": steps, "search": True})
    if "LMC" in kernels:
        specs.append({"kernel": "LMC", "size": size, "steps": steps, "progress_bar": True})
    rows = []
    for spec in specs:
        res = B.run_worker(dict(spec, diagnose=True))
        name = spec["kernel"] + (" (θ* search)" if spec.get("search") else "") + (
            " (progress_bar=True)" if spec.get("progress_bar") else "")
        for run in res["runs"]:
            order = ["kernel build", "init", "NumPyro eager ops", "sample loop"]
            for ph in order:
                if ph not in run["phases"]:
                    continue
                v = run["phases"][ph]
                top = ", ".join(f"{n} {d:.2f}" for n, d in v["top"][:3])
                rows.append([name, run["label"], f"{run['wall']:.2f}", ph, v["programs"],
                             v["trace"], v["lower"], v["compile"], top])
        print("A", name, "done", flush=True)
    return ("#### A. Programs compiled per phase of a user's run (fresh process per kernel; "
            "seconds)\n\n"
            + md_table(["kernel", "run", "run wall s", "phase", "programs", "tracing",
                        "lowering", "XLA compile", "largest compilations (s)"], rows))


# ------------------------------------------------------------------- B: the sampling loop
def _hlo_stats(text: str) -> tuple[int, int, int]:
    """(characters, operations, bytes of dense constants) of a StableHLO module's text."""
    ops = sum(1 for line in text.splitlines() if " = " in line and ("stablehlo." in line
                                                                   or "chlo." in line
                                                                   or "call @" in line))
    const = sum(len(m) // 2 for m in re.findall(r'dense<"0x([0-9A-F]+)">', text))
    return len(text), ops, const


def _time_exe(exe, args, repeats: int = 3) -> float:
    import jax

    jax.block_until_ready(exe(*args))
    best = np.inf
    for _ in range(repeats):
        t = time.perf_counter()
        jax.block_until_ready(exe(*args))
        best = min(best, time.perf_counter() - t)
    return best


def _compile_fresh(fn, args, options: dict | None = None) -> tuple[float, object, str]:
    """Compile ``jit(fn)`` for ``args`` with no in-memory cache to hit: (seconds, executable,
    StableHLO text)."""
    import jax

    jax.clear_caches()
    low = jax.jit(fn).lower(*args)
    t = time.perf_counter()
    exe = low.compile(options or None)
    return time.perf_counter() - t, exe, low.as_text()


def part_b(kernels: list[str], size: str, steps: int, repeats: int) -> str:
    from _common import mcmc_loop_fn, md_table

    loops = {}
    for name in kernels:
        kern = B.make_kernel(name, B.make_problem(B.FAMILY[name], *B.SIZES[size]))
        loops[name] = mcmc_loop_fn(kern, 1, steps)
    comp: dict = defaultdict(lambda: np.inf)
    run: dict = defaultdict(lambda: np.inf)
    stats = {}
    for _ in range(repeats):
        for name, (loop, state) in loops.items():
            for opt, options in XLA_OPTIONS.items():
                t, exe, text = _compile_fresh(loop, (state,), options)
                comp[name, opt] = min(comp[name, opt], t)
                run[name, opt] = min(run[name, opt], _time_exe(exe, (state,), 2))
                stats[name] = _hlo_stats(text)
        print("B repeat done", flush=True)
    rows = []
    for name in kernels:
        chars, ops, const = stats[name]
        row = [name, f"{chars / 1e3:.0f}", ops, f"{const / 1e3:.0f}"]
        for opt in XLA_OPTIONS:
            row += [comp[name, opt], 1e3 * run[name, opt]]
        rows.append(row)
    head = ["kernel", "StableHLO kB", "ops", "constants kB"]
    for opt in XLA_OPTIONS:
        head += [f"compile s ({opt})", f"{steps} steps ms"]
    return (f"#### B. NumPyro's sampling loop of MCMC.run ({steps} samples): program size, "
            f"compilation and run time under XLA options (min of {repeats} interleaved "
            "repeats, one process)\n\n" + md_table(head, rows))


# ------------------------------------------------------------------- C: building blocks
def _count_random(jaxpr) -> int:
    n = 0
    for eqn in jaxpr.eqns:
        if eqn.primitive.name in _RANDOM_PRIMS:
            n += 1
        for v in eqn.params.values():
            for sub in v if isinstance(v, list | tuple) else [v]:
                if hasattr(sub, "jaxpr") and hasattr(sub.jaxpr, "eqns"):
                    n += _count_random(sub.jaxpr)
                elif hasattr(sub, "eqns"):
                    n += _count_random(sub)
    return n


def _block_rows(name: str, size: str) -> list[list]:
    """Part C for one kernel."""
    import jax
    import jax.numpy as jnp
    from jax import random

    prob = B.make_problem(B.FAMILY[name], *B.SIZES[size])
    kern = B.make_kernel(name, prob)
    pot, data = kern.potential, kern.partition
    b, d, n = data.num_clients, pot.dim, kern.batch_size
    key, x, h = random.PRNGKey(0), jnp.zeros(d), jnp.ones((b, d))
    state = kern.init(key, 0, None, (), {})
    blocks = {
        "key split (3)": (lambda k: random.split(k, 3), (key,)),
        "Langevin noise (normal)": (lambda k: random.normal(k, (d,)), (key,)),
        "exact local gradients": (pot.full_grads, (x, data)),
    }
    if n is not None:
        blocks["minibatch gradients"] = (
            lambda k, x, data: pot.batch_grads(k, x, data, n), (key, x, data))
    comps = [("uplink", getattr(kern, "uplink", kern.compressor))]
    if hasattr(kern, "downlink"):
        comps.append(("downlink", kern.downlink))
    for label, c in comps:
        if c.name != "identity":
            blocks[f"{label} {c.name} (b clients, bits)"] = (
                lambda k, m, c=c: kern.compress_all(k, m, c), (key, h))

    def one_step(s):
        return kern.sample(s, (), {})

    blocks["one kernel step (sample)"] = (one_step, (state,))
    rows = []
    for block, (fn, args) in blocks.items():
        t, _, text = _compile_fresh(fn, args)
        rows.append([name, block, t, _hlo_stats(text)[1]])
    prng = _count_random(jax.make_jaxpr(one_step)(state).jaxpr)
    rows.append([name, "random primitives in the step's jaxpr", "-", prng])
    return rows


def part_c(kernels: list[str], size: str) -> str:
    from _common import md_table

    rows = []
    for name in kernels:
        rows += _block_rows(name, size)
        print("C", name, "done", flush=True)
    return ("#### C. Compilation of the parts of one step (s, one process, fresh compilations)"
            "\n\n" + md_table(["kernel", "block", "compile s", "ops"], rows))


# --------------------------------------------------------------- D: one PRNG call per step
def _one_bits_scan(kern, steps: int):
    """QLSD# (no memory) or full-batch LMC as one scan whose steps draw every random word
    from a single ``random.bits`` call: the next key (2 words), the minibatch indices
    (multiply-shift), the quantiser's uniforms and the Langevin noise (inverse erf)."""
    import jax
    import jax.numpy as jnp
    from jax import lax, random

    from numpyro_fed.minibatch import _multiply_shift

    pot, data, gamma = kern.potential, kern.partition, kern.step_size
    b, d = data.num_clients, pot.dim
    n = kern.batch_size
    quant = n is not None
    s = 2**B.BITS
    n_words = 2 + d + (b * n + b * d if quant else 0)
    lo = np.nextafter(np.float32(-1.0), np.float32(0.0))

    def unit(u):  # [0, 1) from the top 23 bits
        return lax.bitcast_convert_type((u >> 9) | np.uint32(0x3F800000), jnp.float32) - 1.0

    def step(x, key, data):
        w = random.bits(key, (n_words,), jnp.uint32)
        new_key, w = w[:2], w[2:]
        z = jnp.sqrt(2.0) * lax.erf_inv(jnp.maximum(lo, 2.0 * unit(w[:d]) - 1.0))
        w = w[d:]
        if quant:
            idx = jax.vmap(_multiply_shift)(w[: b * n].reshape(b, n), data.sizes)
            rows = jax.vmap(lambda r, ix: jax.tree.map(lambda a: a[ix], r))(data.data, idx)
            g = jax.vmap(jax.grad(pot._client_batch_potential), in_axes=(None, 0, 0, 0, None))(
                x, rows, data.sizes, pot._tau, n) + pot._w[:, None] * pot.prior_grad(x)
            xi = unit(w[b * n:]).reshape(b, d)
            norm = jnp.linalg.norm(g, axis=1, keepdims=True)
            r = jnp.clip(s * jnp.abs(g) / jnp.where(norm > 0, norm, 1.0), 0, s)
            lvl = jnp.floor(r) + (xi < r - jnp.floor(r))
            g = norm * jnp.sign(g) * lvl / s
        else:
            g = pot.full_grads(x, data)
        return x - gamma * g.sum(0) + jnp.sqrt(2 * gamma) * z, new_key

    def run(x0, key, data):
        def body(c, _):
            x, k = step(*c, data)
            return (x, k), x

        return lax.scan(body, (x0, key), None, length=steps)[1]

    return run, (jnp.zeros(d), random.PRNGKey(0), data)


def part_d(size: str, steps: int, repeats: int) -> str:
    import jax
    from _common import md_table
    from bench_overhead import fused_federated_fn

    rows = []
    for name in ("LMC", "QLSD#"):
        kern = B.make_kernel(name, B.make_problem(B.FAMILY[name], *B.SIZES[size]))
        variants = {"kernels' key splits": fused_federated_fn(kern, steps, 1),
                    "one random.bits per step": _one_bits_scan(kern, steps)}
        res = defaultdict(lambda: [np.inf, np.inf])
        for _ in range(repeats):
            for label, (fn, args) in variants.items():
                t, exe, _ = _compile_fresh(fn, args)
                res[label] = [min(res[label][0], t), min(res[label][1], _time_exe(exe, args))]
        for label, (fn, args) in variants.items():
            prng = _count_random(jax.make_jaxpr(fn)(*args).jaxpr)
            rows.append([name, label, res[label][0], 1e3 * res[label][1], prng])
        print("D", name, "done", flush=True)
    return (f"#### D. Hand-fused scan ({steps} steps): the kernels' key splits vs one PRNG "
            f"call per step (min of {repeats})\n\n"
            + md_table(["recursion", "randomness", "XLA compile s", f"{steps} steps ms",
                        "random primitives in the jaxpr"], rows))


# ------------------------------------------------------------ E: persistent cache
def part_e(kernels: list[str], size: str, steps: int) -> str:
    from _common import md_table

    rows = []
    for name in kernels:
        for min_t in (0.0, 0.1):
            folder = Path(tempfile.mkdtemp(prefix="ttfd-cache-"))
            try:
                for label in ("cold cache", "warm cache"):
                    r = B.run_worker({"kernel": name, "size": size, "steps": steps,
                                      "cache_dir": str(folder), "min_compile_time_s": min_t,
                                      "first_only": True})["first"]
                    rows.append([name, min_t, label, r["wall"], r["build"], r["trace"],
                                 r["lower"], r["compile"], r["programs"] + r["build_programs"]])
            finally:
                shutil.rmtree(folder, ignore_errors=True)
        print("E", name, "done", flush=True)
    return ("#### E. Fresh process, first run, JAX's persistent compilation cache (s)\n\n"
            + md_table(["kernel", "min_compile_time_s", "cache", "wall", "kernel build",
                        "run: tracing", "run: lowering", "run: XLA compile",
                        "programs compiled or read"], rows))


def diagnose(kernels: list[str], size: str, steps: int, repeats: int, out=None,
             parts: str = "ABCDE") -> str:
    from _common import device_name, write_result, xla_threading

    b, n, d = B.SIZES[size]
    md = (f"### Time to first draw: diagnosis ({size}: {b} clients x {n} rows, d = {d}; "
          f"{device_name()}, {xla_threading()})\n\n")
    sections = {"A": lambda: part_a(kernels, size, steps),
                "B": lambda: part_b(kernels, size, steps, repeats),
                "C": lambda: part_c(kernels, size),
                "D": lambda: part_d(size, steps, repeats),
                "E": lambda: part_e([k for k in ("LMC", "QLSD++", "D-ELF") if k in kernels],
                                    size, steps)}
    for p in parts:
        md += sections[p]() + "\n"
        print(md, flush=True)
    write_result("time-to-first-draw-diagnosis", md, out)
    return md
