"""Standard errors of the variance components: SAEM's against the exact observed information.

For every case of ``tests/saem_cases.py`` (each has an exact reference) and seed: the default
fit ``SAEM(case.model).run(jax.random.key(seed), **case.data)``, then the standard error of
every variance / covariance quantity of the case (``omega^2``, ``sigma^2``, ``Sigma[i,j]``)
from the information :meth:`SAEMResult.fisher_information` returns (delta method from the
fit's unconstrained coordinates through ``case.quantities``), divided by

* ``exact@est``: the SE from the exact observed information at the SAEM estimate (float64
  Hessian of the case's own exact marginal likelihood -- closed form or adaptive
  Gauss--Hermite -- written independently of the library);
* ``exact@mle``: the stored reference SE at the exact maximum (``saem_references.json``).

The target is ``|ratio - 1| <= 0.2``. A boundary variance (Dyestuff2's tau^2, ML value 0) has
no regular SE and is left out. ``--method louis`` measures the Louis estimate from the fit's
draws (what the library used before the exact information); ``--method auto`` (the default)
what :meth:`SAEMResult.standard_errors` uses now. On the base commit (no ``method``
argument) the Louis estimate is measured whatever is asked.

Usage: ``python benchmarks/bench_saem_se.py [--seeds 0 1] [--method auto|louis]
[--out benchmarks/results/saem_se.md] [names...]``; ``--merge A.json B.json`` writes the
results file from two runs (before / after).
"""

from __future__ import annotations

import argparse
import inspect
import json
import sys
import time
import warnings
from pathlib import Path

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
    cov_u = res._face_inverse(info_u)
    theta = jnp.asarray(res.theta)

    def q(th_u):
        qd = case.quantities(res.info.constrain_theta(th_u))
        return jnp.stack([jnp.asarray(qd[k], theta.dtype) for k in names])

    J = np.asarray(jax.jacfwd(q)(theta), np.float64)
    var = np.diag(J @ cov_u @ J.T)
    return dict(zip(names, np.sqrt(np.where(var > 0, var, np.nan)).tolist(),
                    strict=True)), used


def exact_se_at(case, params, names) -> dict:
    """SEs of ``names`` from the exact observed information at ``params`` (float64)."""
    import jax
    import numpy as np
    import saem_cases as sc

    _, _, H = sc.loglik_grad_hess(case, params)
    fns = sc._jitted(case.name)
    with jax.enable_x64(True):
        u, _ = sc._unconstrain(fns.cons, sc._theta64(case, params))
        J = np.asarray(fns.jac_q(u))
    cov = J @ np.linalg.inv(-H) @ J.T
    allq = list(case.quantities(sc._theta64(case, params)))
    return {k: float(np.sqrt(cov[allq.index(k), allq.index(k)])) for k in names}


def run_case(name: str, seed: int, method: str) -> dict:
    import jax
    import saem_cases as sc

    from numpyro_fed.saem import SAEM

    case = sc.get_case(name)
    names = [k for k, kind in case.kinds.items() if kind != "fixed" and k not in case.boundary]
    out = {"case": name, "seed": seed}
    t0 = time.perf_counter()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            res = SAEM(case.model).run(jax.random.key(seed), **case.data)
    except Exception as e:  # the report is the point
        out["error"] = f"{type(e).__name__}: {str(e).strip().splitlines()[0][:200]}"
        return out
    out["fit_s"] = time.perf_counter() - t0
    t1 = time.perf_counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        se, used = quantity_se(res, case, names, method)
        if "method" in inspect.signature(res.standard_errors).parameters:
            res.standard_errors(method=method)
        else:
            res.standard_errors()
    out["se_s"] = time.perf_counter() - t1
    out["method"] = used
    out["warned"] = any("standard error" in str(w.message).lower() for w in caught)
    ref = sc.reference(case)
    ex = (exact_se_at(case, res.params, names) if not case.boundary
          else {k: ref["se"][k] for k in names})
    out["ratio_est"] = {k: se[k] / ex[k] for k in names}
    out["ratio_mle"] = {k: se[k] / ref["se"][k] for k in names}
    return out


def table(rows: list[dict], label: str) -> list[str]:
    lines = [f"### {label}", "",
             "| case | seed | SE method | quantity | SE / exact@est | SE / exact@mle | ok |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['case']} | {r['seed']} | fit raises | {r['error'][:60]} "
                         "| | | |")
            continue
        for k, v in r["ratio_est"].items():
            ok = "ok" if abs(v - 1) <= 0.2 else "**FAIL**"
            lines.append(f"| {r['case']} | {r['seed']} | {r['method']}"
                         f"{' (warned)' if r['warned'] else ''} | {k} | {v:.3f} | "
                         f"{r['ratio_mle'][k]:.3f} | {ok} |")
    good = [v for r in rows if "error" not in r for v in r["ratio_est"].values()]
    n_ok = sum(abs(v - 1) <= 0.2 for v in good)
    lines += ["", f"{n_ok} of {len(good)} variance SEs within 20% of the exact (at the "
              f"estimate); range {min(good):.3f} - {max(good):.3f}." if good else ""]
    return lines


def main() -> None:
    import saem_cases as sc

    p = argparse.ArgumentParser()
    p.add_argument("names", nargs="*")
    p.add_argument("--seeds", type=int, nargs="+", default=[0])
    p.add_argument("--method", default="auto")
    p.add_argument("--json", help="write the raw rows here")
    p.add_argument("--merge", nargs="+", help="label=rows.json ... -> results file")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "saem_se.md"))
    a = p.parse_args()
    if a.merge:
        lines = ["# Standard errors of variance components: SAEM / exact observed information",
                 "", __doc__.split("\n\n")[1], ""]
        for spec in a.merge:
            label, path = spec.split("=", 1)
            lines += table(json.loads(Path(path).read_text()), label) + [""]
        Path(a.out).write_text("\n".join(lines) + "\n")
        print("\n".join(lines))
        return
    rows = []
    for name in a.names or sc.CASE_NAMES:
        for seed in a.seeds:
            r = run_case(name, seed, a.method)
            rows.append(r)
            print(json.dumps(r), flush=True)
            if a.json:
                Path(a.json).write_text(json.dumps(rows, indent=1))
    print("\n".join(table(rows, f"method={a.method}")))


if __name__ == "__main__":
    main()
