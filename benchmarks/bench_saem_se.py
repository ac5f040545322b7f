"""Standard errors of the variance components: SAEM's against the exact observed information.

For every case of ``tests/saem_cases.py`` (each has an exact reference) and seed: the default
fit ``SAEM(case.model).run(jax.random.key(seed), **case.data)``, then the standard error of
every variance / covariance quantity of the case (``omega^2``, ``sigma^2``, ``Sigma[i,j]``)
from the information :meth:`SAEMResult.fisher_information` returns, taken as the curvature
in the case's quantities (``SAEMResult._information_in``: the gradient term of a stochastic
estimate included, as the library's parameter table does; before it, the delta method from
the fit's unconstrained coordinates), divided by

* ``exact@est``: the SE from the exact observed information in those quantities at the SAEM
  estimate (float64 Hessian of the case's own exact marginal likelihood -- closed form or
  adaptive Gauss--Hermite -- written independently of the library);
* ``exact@mle``: the stored reference SE at the exact maximum (``saem_references.json``).

The target is ``|ratio - 1| <= 0.2``. A boundary variance (Dyestuff2's tau^2, ML value 0) has
no regular SE and is left out. ``--methods louis,auto`` (the default) measures, on the same
fit, the Louis estimate from the fit's draws (what the library used before) and what
:meth:`SAEMResult.standard_errors` uses now. On the base commit (no ``method`` argument)
the Louis estimate is measured whatever is asked.

Usage: ``python benchmarks/bench_saem_se.py [--seeds 0 1] [--methods louis,auto]
[--json rows.json] [--out benchmarks/results/saem_se.md] [names...]``;
``--from-json rows.json ...`` writes the results file from saved rows.
"""

from __future__ import annotations

import argparse
import inspect
import json
import sys
import time
import warnings
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))


def quantity_se(res, case, names, method: str) -> tuple[dict, str]:
    """SAEM's SEs of ``names`` (quantities of ``case``) and the method that gave them."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    fi = res.fisher_information
    if "method" in inspect.signature(fi).parameters:
        info_u = fi(method=method)
        used = res.fisher_method
    else:
        info_u = fi()
        used = "louis (base)"
    theta = jnp.asarray(res.theta)

    def q_all(th_u):
        qd = case.quantities(res.info.constrain_theta(th_u))
        return jnp.stack([jnp.asarray(v, theta.dtype) for v in qd.values()])

    if hasattr(res, "_information_in"):  # the curvature in the quantities (reported)
        info_u = res._information_in(info_u, q_all)
    cov_u = res._face_inverse(info_u)
    allq = list(case.quantities(res.info.constrain_theta(theta)))
    J = np.asarray(jax.jacfwd(q_all)(theta), np.float64)[[allq.index(k) for k in names]]
    var = np.diag(J @ cov_u @ J.T)
    return dict(zip(names, np.sqrt(np.where(var > 0, var, np.nan)).tolist(),
                    strict=True)), used


def exact_se_at(case, params, names) -> dict:
    """SEs of ``names`` from the exact observed information at ``params`` (float64), in the
    case's quantities (:func:`saem_cases.exact_se`)."""
    import saem_cases as sc

    return sc.exact_se(case, params, names)


def run_case(name: str, seed: int, methods: list[str]) -> dict:
    """One default fit of ``name``; per method in ``methods``, the ratios of its variance
    SEs to the exact ones (``ratio_est``: at the estimate, ``ratio_mle``: the reference at
    the exact maximum), whether ``standard_errors`` warned about them, and the seconds."""
    import jax
    import saem_cases as sc

    from numpyro_fed.saem import SAEM

    case = sc.get_case(name)
    names = [k for k, kind in case.kinds.items() if kind != "fixed" and k not in case.boundary]
    out = {"case": name, "seed": seed, "by_method": {}}
    t0 = time.perf_counter()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            res = SAEM(case.model).run(jax.random.key(seed), **case.data)
    except Exception as e:  # the report is the point
        out["error"] = f"{type(e).__name__}: {str(e).strip().splitlines()[0][:200]}"
        return out
    out["fit_s"] = time.perf_counter() - t0
    ref = sc.reference(case)
    ex = (exact_se_at(case, res.params, names) if not case.boundary
          else {k: ref["se"][k] for k in names})
    new_api = "method" in inspect.signature(res.standard_errors).parameters
    for m in methods:
        t1 = time.perf_counter()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            se, used = quantity_se(res, case, names, m)
            if new_api:
                res.standard_errors(method=m)
            else:
                res.standard_errors()
        out["by_method"][m] = {
            "method": used, "se_s": time.perf_counter() - t1,
            "warned": any(("Monte Carlo error" in str(w.message)
                           or "not positive definite" in str(w.message)) for w in caught),
            "ratio_est": {k: se[k] / ex[k] for k in names},
            "ratio_mle": {k: se[k] / ref["se"][k] for k in names}}
    return out


def table(rows: list[dict], methods: list[str]) -> list[str]:
    """One row per (case, seed, quantity): the SE ratio of each method (at the estimate;
    at the exact maximum in parentheses), the method that ran, and whether it warned."""
    head = "| case | seed | quantity | " + " | ".join(
        f"{m}: SE / exact (at MLE)" for m in methods) + " |"
    lines = [head, "|" + "---|" * (3 + len(methods))]
    counts = {m: [] for m in methods}
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['case']} | {r['seed']} | fit raises: {r['error'][:70]} |"
                         + " |" * len(methods))
            continue
        first = r["by_method"][methods[0]]
        for k in first["ratio_est"]:
            cells = []
            for m in methods:
                b = r["by_method"][m]
                v = b["ratio_est"][k]
                counts[m].append(v)
                flag = "" if abs(v - 1) <= 0.2 else " **FAIL**"
                cells.append(f"{v:.3f} ({b['ratio_mle'][k]:.3f}) {b['method']}"
                             f"{' warned' if b['warned'] else ''}{flag}")
            lines.append(f"| {r['case']} | {r['seed']} | {k} | " + " | ".join(cells) + " |")
    lines.append("")
    for m in methods:
        v = np.asarray(counts[m], float)
        ok = int(np.sum(np.abs(v - 1) <= 0.2))
        lines.append(f"- {m}: {ok} of {len(v)} variance SEs within 20% of the exact observed "
                     f"information at the estimate (NaN: information not positive definite: "
                     f"{int(np.sum(~np.isfinite(v)))}); ratios {np.nanmin(v):.3f} - "
                     f"{np.nanmax(v):.3f}.")
    return lines


def main() -> None:
    import saem_cases as sc

    p = argparse.ArgumentParser()
    p.add_argument("names", nargs="*")
    p.add_argument("--seeds", type=int, nargs="+", default=[0])
    p.add_argument("--methods", default="louis,auto")
    p.add_argument("--json", help="write the raw rows here (after each fit)")
    p.add_argument("--from-json", nargs="+", help="rows files -> the results file")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "saem_se.md"))
    a = p.parse_args()
    methods = a.methods.split(",")
    if a.from_json:
        rows = [r for f in a.from_json for r in json.loads(Path(f).read_text())]
        order = list(sc.CASE_NAMES)
        rows.sort(key=lambda r: (r["seed"], order.index(r["case"]) if r["case"] in order
                                 else len(order)))
    else:
        rows = []
        for name in a.names or sc.CASE_NAMES:
            for seed in a.seeds:
                r = run_case(name, seed, methods)
                rows.append(r)
                print(json.dumps(r), flush=True)
                if a.json:
                    Path(a.json).write_text(json.dumps(rows, indent=1))
    lines = ["# Standard errors of variance components: SAEM / exact observed information",
             "", "Written by `benchmarks/bench_saem_se.py`. Each default fit of a case of "
             "`tests/saem_cases.py` (seed 0, every "
             "case with an exact reference), then the SE of each variance / covariance "
             "quantity of the case (the curvature in the case's quantities), "
             "divided by the SE from the exact observed information AT THE SAME ESTIMATE "
             "(float64 Hessian of the case's own closed-form or adaptive Gauss-Hermite "
             "marginal likelihood, written independently of the library); in parentheses, "
             "divided by the stored reference SE at the exact maximum. Target: within 20%. "
             "'warned': standard_errors() warned that the SEs are imprecise or the "
             "information not positive definite. NaN: the information is not positive "
             "definite (no SE). A boundary variance (Dyestuff2's tau^2) has no regular SE "
             "and is left out.", "",
             "Before: `louis` (the Louis identity on the fit's draws, what `standard_errors()` "
             "used at 40e77de: identical numbers, checked on the base commit). After: "
             "`auto` (what it uses now: `exact` closed form, `gq` Gauss-Hermite nodes, `is` "
             "importance draws).", ""] + table(rows, methods)
    Path(a.out).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
