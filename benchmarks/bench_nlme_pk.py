"""Closed-form compartment models: the general model vs the model specialised to the dosing
routes of the data (``CompartmentModel.for_doses``) vs a minimal hand-written function.

Usage: ``python benchmarks/bench_nlme_pk.py [--repeats 7] [--calls 100] [--loop 50]``; prints
a markdown table (nothing is written). Runs in under a minute on a 2-core CPU.

Each case vmaps the model over the subjects of a dataset (float32): *value* is the
predictions ``(n, T)``, *grad* the gradient of their sum with respect to the ``(n,)``
individual parameters, timed per call of a compiled program (dispatch included: ~20-30 µs of
these small programs) and per evaluation inside a compiled loop of ``--loop`` evaluations
(what a fit runs: SAEM's iterations are one compiled program). Programs are compiled ahead
of time; a time is the minimum over ``--repeats`` interleaved repeats of the mean over
``--calls`` calls. The ratios (to the hand-written function, or to the
specialised model where there is none) are what the table is for: absolute times depend on
the machine and its load. ``eqns`` counts the equations of the jaxpr of one subject's call
(value; grad of the sum), with ``TLAG``/``F`` not estimated.

Cases:

- ``phenobarb``: 59 subjects x 6 observations x 15 IV boluses into the central compartment,
  ``one_compartment(absorption=None)``; hand-written: the bolus superposition
  ``sum_d amt_d e^{-k (t - t_d)} / V``;
- ``theophylline``: 12 subjects x 10 observations x 1 oral dose, ``one_compartment()``;
  hand-written: the textbook ``F amt ka / (V (ka - k)) (e^{-k t} - e^{-ka t})`` (which,
  unlike the library, divides by zero at ``KA = CL/V``);
- ``2-cmt infusion``: the Phenobarb dosing times and amounts given as 30-minute infusions,
  ``two_compartment(absorption=None)`` (no hand-written function).
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
from _common import device_name, md_table, xla_threading  # noqa: E402

from numpyro_fed import nlme  # noqa: E402
from numpyro_fed.nlme.pk import one_compartment, two_compartment  # noqa: E402


def hand_bolus(p, t, d):
    """IV boluses, one compartment: the minimal structural function."""
    dt = t[:, None] - d.time[None, :]
    on = d.mask[None, :] & (dt >= 0)
    k = p["CL"] / p["V"]
    amount = jnp.where(on, d.amt[None, :] * jnp.exp(-k * jnp.where(on, dt, 0.0)), 0.0)
    return jnp.sum(amount, -1) / p["V"]


def hand_oral(p, t, d):
    """Oral boluses, one compartment: the textbook formula (singular at KA = CL/V)."""
    dt = t[:, None] - d.time[None, :]
    on = d.mask[None, :] & (dt >= 0)
    k, ka = p["CL"] / p["V"], p["KA"]
    dt = jnp.where(on, dt, 0.0)
    resp = d.amt[None, :] * ka / (ka - k) * (jnp.exp(-k * dt) - jnp.exp(-ka * dt))
    return jnp.sum(jnp.where(on, resp, 0.0), -1) / p["V"]


def _programs(f, p, t, d, loop):
    """Ahead-of-time compiled programs of ``vmap(f)``: one call of the value and of the
    gradient, and ``loop`` of each inside one program (a ``fori_loop`` whose parameters
    depend on the carry, so that nothing is hoisted but what does not depend on them, as in
    a fit: the dose preprocessing)."""

    def value(p, t, d):
        return jax.vmap(f)(p, t, d)

    def grad(p, t, d):
        return jax.grad(lambda p: jnp.sum(jax.vmap(f)(p, t, d)))(p)

    def looped(fn):
        def run(p, t, d):
            def body(i, c):
                q = {k: v * (1.0 + 1e-30 * c) for k, v in p.items()}
                return c + sum(jnp.sum(x) for x in jax.tree.leaves(fn(q, t, d)))

            return jax.lax.fori_loop(0, loop, body, jnp.float32(0.0))

        return run

    progs = (value, grad, looped(value), looped(grad))
    return [jax.jit(fn).lower(p, t, d).compile() for fn in progs]


def _eqns(f, p, t, d):
    """Equations of the jaxpr of one subject's call (value, grad of the sum)."""
    p1, t1, d1 = jax.tree.map(lambda a: a[0], (p, t, d))
    value = jax.make_jaxpr(f)(p1, t1, d1)
    grad = jax.make_jaxpr(jax.grad(lambda q: jnp.sum(f(q, t1, d1))))(p1)
    return len(value.eqns), len(grad.eqns)


def _cases():
    pheno, theo = nlme.load_phenobarb(), nlme.load_theophylline()
    n_p, n_t = pheno.obs.time.shape[0], theo.obs.time.shape[0]
    f32 = lambda v, n: jnp.full(n, v, jnp.float32)  # noqa: E731
    inf = pheno.doses._replace(rate=np.where(pheno.doses.mask, 2.0 * pheno.doses.amt, 0.0)
                               .astype(np.float32))
    return [
        ("phenobarb 1-cmt IV bolus", one_compartment(None), hand_bolus,
         {"CL": f32(0.005, n_p), "V": f32(1.0, n_p)}, pheno.obs.time, pheno.doses),
        ("theophylline 1-cmt oral", one_compartment(), hand_oral,
         {"CL": f32(2.8, n_t), "V": f32(32.0, n_t), "KA": f32(1.5, n_t)}, theo.obs.time,
         theo.doses),
        ("2-cmt infusion (Phenobarb doses, 30 min)", two_compartment(None), None,
         {"CL": f32(0.005, n_p), "V": f32(1.0, n_p), "Q": f32(0.02, n_p),
          "V2": f32(2.0, n_p)}, pheno.obs.time, inf),
    ]


def main(argv: list[str] | None = None) -> str:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--repeats", type=int, default=7, help="interleaved repeats (min kept)")
    ap.add_argument("--calls", type=int, default=100, help="calls per timing")
    ap.add_argument("--loop", type=int, default=50, help="evaluations per compiled loop")
    a = ap.parse_args(argv)
    rows, cases = [], _cases()
    for name, general, hand, p, t, d in cases:
        special = general.for_doses(d)
        cands = {"general": general, "specialised": special}
        if hand is not None:
            cands["hand-written"] = hand
        progs, eqns, compile_s = {}, {}, {}
        for label, f in cands.items():
            t0 = time.perf_counter()
            progs[label] = _programs(f, p, t, d, a.loop)
            compile_s[label] = time.perf_counter() - t0
            eqns[label] = _eqns(f, p, t, d)
        # the specialised model computes the general one (float32 round-off)
        ref, out = progs["general"][0](p, t, d), progs["specialised"][0](p, t, d)
        err = float(jnp.max(jnp.abs(out - ref)) / jnp.max(jnp.abs(ref)))
        # seconds per evaluation: calls (dispatch included), and inside a compiled loop
        per = (a.calls, a.calls, a.calls * a.loop, a.calls * a.loop)
        reps = (a.calls, a.calls, max(1, a.calls // a.loop), max(1, a.calls // a.loop))
        best = {(lab, k): np.inf for lab in cands for k in range(4)}
        for _ in range(a.repeats):
            for lab in cands:
                for k in range(4):
                    exe = progs[lab][k]
                    jax.block_until_ready(exe(p, t, d))
                    t0 = time.perf_counter()
                    for _ in range(reps[k]):
                        res = exe(p, t, d)
                    jax.block_until_ready(res)
                    elapsed = (time.perf_counter() - t0) * a.calls / reps[k]
                    best[lab, k] = min(best[lab, k], elapsed / per[k])
        base = "hand-written" if hand is not None else "specialised"
        for lab in cands:
            b = [best[lab, k] for k in range(4)]
            r = [best[lab, k] / best[base, k] for k in range(4)]
            rows.append([name, lab, *(x * 1e6 for x in b), *r,
                         f"{eqns[lab][0]} / {eqns[lab][1]}", compile_s[lab]])
        rows.append([name, f"specialised vs general: max rel. diff {err:.1e}"] + [""] * 10)
    shape = "; ".join(f"{c[0]}: {c[4].shape[0]} x {c[4].shape[1]} x {c[5].time.shape[1]}"
                      for c in cases)
    text = (
        f"Structural models, float32, {device_name()}, {xla_threading()}, jax "
        f"{jax.__version__} (subjects x observations x doses: {shape}).\n\n"
        + md_table(["case", "model", "value µs", "grad µs", "value µs (loop)",
                    "grad µs (loop)", "value ratio", "grad ratio", "value ratio (loop)",
                    "grad ratio (loop)", "eqns (value / grad)", "compile s"], rows)
        + "\nµs per evaluation of all subjects: one call of a compiled program (dispatch "
        "included), or one of the evaluations of a compiled loop (the situation in a fit). "
        "ratio: to the hand-written function (to the specialised model where there is none); "
        "minimum over interleaved repeats, measured in this one run. compile s: the four "
        "programs.\n"
    )
    print(text)
    return text


if __name__ == "__main__":
    main()
