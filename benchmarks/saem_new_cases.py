"""How the current SAEM does on the issue-28 cases of ``tests/saem_cases.py`` (crossed,
nested, boundary, data-dependent plate sizes), with every default, over seeds.

Usage: ``python benchmarks/saem_new_cases.py [--seeds 0 1 2 3] [--timeout 600] [--verbose]
[names...]`` (default: :data:`saem_cases.NEW_CASE_NAMES`). Each case runs in its own process
(one wall-clock limit for its seeds), every seed in that process:
``SAEM(case.model).run(jax.random.key(seed), **case.data)``, its default standard errors and
its default -2LL (``result.log_likelihood()``: closed form where it applies, else importance
sampling). One markdown row per case and seed, scored by issue 28's targets: exact -2LL gap
within 0.5; fixed effects within max(0.2 SE, 1%) and variances within max(0.3 SE, 10%)
(:func:`saem_cases.compare`; a boundary variance within compare's tolerance AND the fit
reported singular); the reported -2LL within 2 reported SE of the exact value at the same
estimate (or, SE 0, equal to it within 0.01); SE of each variance within 20% of the exact
observed information (not defined for a boundary variance); the fits after the first compile
nothing (``compiles``, counted by ``tests/compile_count.py`` over fit + SE + -2LL).
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))


def _se_of_quantity(name: str, est: dict, se: dict) -> float:
    """SAEM's SE of a quantity of ``compare`` (a fixed effect or the square of a scale
    param: delta method 2 |s| se(s)); NaN when SAEM reports no such coordinate."""
    m = re.fullmatch(r"(.+)\^2", name)
    if m is None:
        return se.get(name, float("nan"))
    base = m.group(1)
    if base not in est:
        return float("nan")
    return 2.0 * abs(est[base]) * se.get(base, float("nan"))


def _fit_once(case, seed: int, sc) -> dict:
    """One default fit, its standard errors and its default -2LL, scored by the issue's
    targets (see the module docstring)."""
    import jax

    from numpyro_fed.saem import SAEM

    out: dict = {"seed": seed}
    t0 = time.perf_counter()
    try:
        res = SAEM(case.model).run(jax.random.key(seed), **case.data)
    except Exception as e:  # the report is the point: any failure is printed
        out["error"] = f"{type(e).__name__}: {str(e).strip().splitlines()[0][:300]}"
        out["fit_s"] = time.perf_counter() - t0
        return out
    out["fit_s"] = time.perf_counter() - t0
    out["singular_params"] = list(res.singular_params)
    m2ll = None
    try:
        ll = res.log_likelihood(jax.random.key(seed + 1000))
        m2ll, out["m2ll_se"], out["m2ll_method"] = ll["m2ll"], ll["m2ll_se"], ll["method"]
    except Exception as e:
        out["m2ll_error"] = f"{type(e).__name__}: {str(e).strip().splitlines()[0][:300]}"
    cmp = sc.compare(case, res.params, m2ll_at_est=m2ll)
    out["table"] = sc.format_comparison(cmp)
    out["gap"] = cmp["m2ll_gap"]
    rows = cmp["quantities"]
    fx = [r for r in rows.values() if r["kind"] == "fixed"]
    va = [(n, r) for n, r in rows.items() if r["kind"] != "fixed" and n not in case.boundary]
    # the worst error in SE units, and whether every quantity is within its tolerance
    out["fixed_worst_se"] = max((abs(r["err_se"]) for r in fx), default=0.0)
    out["var_worst_se"] = max((abs(r["err_se"]) for _, r in va), default=0.0)
    out["fixed_ok"] = all(r["ok"] for r in fx)
    out["var_ok"] = all(r["ok"] for _, r in va)
    # a boundary variance: within compare's tolerance AND reported singular
    bnd = [n for n in case.boundary]
    out["boundary_ok"] = all(rows[n]["ok"] for n in bnd) and (not bnd or bool(res.singular))
    out["gap_ok"] = abs(cmp["m2ll_gap"]) <= sc.M2LL_TOL
    if m2ll is not None:
        # the issue: the reported -2LL within 2 reported SE of the exact value at the same
        # estimate, or exact (a closed form: SE 0, agreement to float32 round-off, 0.01)
        se = out["m2ll_se"]
        err = m2ll - cmp["m2ll_exact_at_est"]
        out["m2ll_err"] = err
        out["m2ll_err_vs_min"] = m2ll - cmp["m2ll"]
        out["m2ll_err_se"] = err / se if se > 0 else float("nan")
        out["m2ll_ok"] = bool(abs(err) <= 2 * se if se > 0 else abs(err) < 0.01)
    else:
        out["m2ll_ok"] = False
    try:
        est, se = res.estimates(), res.standard_errors()
        ref = sc.reference(case)
        out["se_ratio"] = {k: _se_of_quantity(k, est, se) / ref["se"][k]
                           for k, kind in case.kinds.items()
                           if kind != "fixed" and kind != "covariance" and k not in case.boundary}
        out["se_ok"] = all(abs(v - 1) <= 0.2 for v in out["se_ratio"].values())
    except Exception as e:
        out["se_error"] = f"{type(e).__name__}: {str(e).strip().splitlines()[0][:300]}"
        out["se_ok"] = False
    out["ok"] = all(out[k] for k in ("fixed_ok", "var_ok", "boundary_ok", "gap_ok",
                                     "m2ll_ok", "se_ok"))
    return out


def worker(name: str, seeds: list[int]) -> list[dict]:
    """Every seed in one process: the first fit compiles, the later ones (fit, SE, -2LL)
    are counted (``compiles``: programs compiled; the issue wants none)."""
    import saem_cases as sc
    from compile_count import Compiles

    case = sc.get_case(name)
    outs = []
    for i, seed in enumerate(seeds):
        with Compiles() as c:
            out = _fit_once(case, seed, sc)
        out["compiles"] = len(c.names) if i > 0 else None
        out["compiled_names"] = sorted(set(c.names))[:8] if i > 0 else []
        outs.append(out)
        print("RESULT " + json.dumps({"case": name, **out}), flush=True)
    return outs


def _fmt_row(name: str, o: dict) -> str:
    if "error" in o:
        return f"| {name} | {o['seed']} | RAISES {o['error'][:80]} | | | | | | FAIL |"
    ratios = o.get("se_ratio", {})
    se_txt = ", ".join(f"{v:.2f}" for v in ratios.values()) or "-"
    if "m2ll_err" not in o:
        m2 = o.get("m2ll_error", "-")
    elif o["m2ll_se"] > 0:
        m2 = f"{o['m2ll_err_se']:+.2f} (is: {o['m2ll_err']:+.3f} ± {o['m2ll_se']:.3f})"
    else:
        m2 = f"exact ({o['m2ll_method']}: {o['m2ll_err']:+.4f})"
    sing = ", ".join(o["singular_params"]) or "-"
    comp = "-" if o["compiles"] is None else str(o["compiles"])
    return (f"| {name} | {o['seed']} | {o['gap']:+.3f} | {o['fixed_worst_se']:.2f} | "
            f"{o['var_worst_se']:.2f} | {m2} | {se_txt} | {sing} | {comp} | "
            f"{'ok' if o['ok'] else 'FAIL'} |")


def main() -> None:
    import saem_cases as sc

    p = argparse.ArgumentParser()
    p.add_argument("names", nargs="*")
    p.add_argument("--seeds", type=int, nargs="+", default=[0])
    p.add_argument("--timeout", type=float, default=600.0)
    p.add_argument("--worker", nargs="+")
    p.add_argument("--verbose", action="store_true")
    a = p.parse_args()
    if a.worker:
        worker(a.worker[0], [int(s) for s in a.worker[1:]])
        return
    print("| case | seed | gap | fixed worst err/SE | var worst err/SE | -2LL err / reported SE "
          "| SE ratio (variances) | singular | compiles | pass |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    tables = []
    for name in a.names or sc.NEW_CASE_NAMES:
        t0 = time.perf_counter()
        try:
            r = subprocess.run([sys.executable, __file__, "--worker", name,
                                *map(str, a.seeds)],
                               capture_output=True, text=True, timeout=a.timeout, cwd=ROOT)
            stdout = r.stdout
        except subprocess.TimeoutExpired as e:
            stdout = (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (
                e.stdout or "")
            print(f"| {name} | | no result within {a.timeout:.0f} s | | | | | | | FAIL |")
        outs = [json.loads(x[7:]) for x in stdout.splitlines() if x.startswith("RESULT ")]
        if not outs:
            tail = (r.stderr.strip().splitlines() or ["?"])[-1]
            print(f"| {name} | | the worker died (rc {r.returncode}): {tail} | | | | | | | FAIL |")
        for o in outs:
            print(_fmt_row(name, o), flush=True)
            tables.append((name, o))
        sys.stdout.flush()
        print(f"<!-- {name}: {time.perf_counter() - t0:.0f} s for {len(outs)} seeds; fit s "
              f"{[round(o.get('fit_s', 0), 1) for o in outs]} -->", flush=True)
    if a.verbose:
        for name, o in tables:
            print(f"\n== {name} seed {o['seed']}")
            if "table" in o:
                print(o["table"])
            for k in ("m2ll_error", "se_error", "compiled_names"):
                if o.get(k):
                    print(f"{k}: {o[k]}")


if __name__ == "__main__":
    main()
