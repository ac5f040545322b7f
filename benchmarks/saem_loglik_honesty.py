"""Is the -2LL that an SAEM fit reports honest? Coverage of its Monte Carlo SE over seeds.

For each case of ``tests/saem_cases.py`` the model is fitted ONCE with every default
(``SAEM(case.model).run(jax.random.key(0), **case.data)``); then, at that same estimate,
``result.log_likelihood(jax.random.key(s), method=m)`` runs for ``--seeds`` seeds
(``s = 100, 101, ...``) and each estimate is compared with the exact -2LL at the estimate
(closed form for the linear Gaussian cases, adaptive Gauss--Hermite otherwise;
:func:`saem_cases.exact_loglik`). Printed per case and method: how many of the first 20 seeds
(the issue's criterion: >= 18 of 20) and of all seeds lie within 2 reported SE of the exact
value, the mean error, the spread of the errors over the mean reported SE (1 when the SE is
honest), the mean reported SE, the method that ran and the median seconds per call (the first
call, which compiles, excluded).

With an honest SE and normal errors a seed misses with probability 4.55%, so the count of
misses over 20 seeds is Binomial(20, 0.0455): 3 or more misses (17/20 or fewer within) has
probability 6% for a perfectly honest estimator; the spread ratio and the count over more
seeds are the sharper measures.

Usage: ``python benchmarks/saem_loglik_honesty.py [--seeds 20] [--methods is auto]
[--root PATH] [--json OUT] [names...]`` (default cases: cbpp_olre penicillin pastes oats cbpp
epil). ``--root`` imports ``numpyro_fed`` from another checkout (to measure the code before a
change with the same script and the same cases).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_CASES = ("cbpp_olre", "penicillin", "pastes", "oats", "cbpp", "epil")


def _run_case(name: str, methods, num_seeds: int) -> dict:
    import jax
    import numpy as np
    import saem_cases as sc

    from numpyro_fed.saem import SAEM, ConvergenceWarning

    case = sc.get_case(name)
    t0 = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)
        res = SAEM(case.model).run(jax.random.key(0), **case.data)
    fit_s = time.perf_counter() - t0
    exact = -2.0 * sc.exact_loglik(case, res.params)
    out = {"case": name, "fit_s": fit_s, "exact_m2ll": exact,
           "groups": int(res.layout.n) if res.layout is not None else 1,
           "latents_per_group": int(res.layout.q) if res.layout is not None else None,
           "methods": {}}
    for m in methods:
        errs, ses, secs, ran, caught, rounds, khat = [], [], [], set(), set(), [], []
        for s in range(num_seeds):
            t = time.perf_counter()
            with warnings.catch_warnings(record=True) as w:
                warnings.simplefilter("always")
                ll = res.log_likelihood(jax.random.key(100 + s), method=m)
            secs.append(time.perf_counter() - t)
            caught |= {f"{x.category.__name__}: {str(x.message)[:120]}" for x in w
                       if not issubclass(x.category, ConvergenceWarning)}
            errs.append(ll["m2ll"] - exact)
            ses.append(ll["m2ll_se"])
            ran.add(ll["method"])
            rounds.append(ll.get("rounds", 0))
            khat.append(ll.get("pareto_k", float("nan")))
        errs, ses = np.asarray(errs), np.asarray(ses)
        # a deterministic method (SE 0) is within when its error is round-off (1e-3)
        within = np.abs(errs) <= np.maximum(2.0 * ses, 1e-3)
        se = float(np.mean(ses))
        out["methods"][m] = {
            "ran": sorted(ran), "within_first20": int(np.sum(within[:20])),
            "n_first20": int(min(20, num_seeds)), "within": int(np.sum(within)),
            "n": int(num_seeds), "mean_err": float(np.mean(errs)),
            "sd_over_se": float(np.std(errs, ddof=1) / se) if se > 0 and num_seeds > 1
            else float("nan"),
            "mean_se": se, "first_call_s": secs[0],
            "median_call_s": float(np.median(secs[1:])) if num_seeds > 1 else secs[0],
            "warnings": sorted(caught)[:3],
            "mean_rounds": float(np.mean(rounds)), "max_pareto_k": float(np.nanmax(khat))
            if np.any(np.isfinite(khat)) else float("nan"),
        }
    return out


def _format(r: dict) -> str:
    lines = [f"== {r['case']}: {r['groups']} group(s) of <= {r['latents_per_group']} latents; "
             f"fit {r['fit_s']:.1f} s; exact -2LL at the estimate {r['exact_m2ll']:.4f}"]
    for m, v in r["methods"].items():
        lines.append(
            f"  {m:5s} ran {'/'.join(v['ran']):9s} within 2 SE: {v['within_first20']:2d}/"
            f"{v['n_first20']} (first 20), {v['within']:3d}/{v['n']}; mean err "
            f"{v['mean_err']:+.4f}, sd/SE {v['sd_over_se']:.2f}, SE {v['mean_se']:.4f}; "
            f"{v['median_call_s']:.3f} s/call (first {v['first_call_s']:.1f} s)"
            + (f"; rounds {v['mean_rounds']:.1f}, max k-hat {v['max_pareto_k']:.2f}"
               if v["mean_rounds"] else ""))
        for w in v["warnings"]:
            lines.append(f"        warned: {w}")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("names", nargs="*")
    p.add_argument("--seeds", type=int, default=20)
    p.add_argument("--methods", nargs="+", default=["is", "auto"])
    p.add_argument("--root", default=str(ROOT))
    p.add_argument("--json")
    a = p.parse_args()
    sys.path.insert(0, str(ROOT / "tests"))
    sys.path.insert(0, str(Path(a.root).resolve()))
    import numpyro_fed

    print(f"numpyro_fed from {Path(numpyro_fed.__file__).parent}", flush=True)
    results = []
    for name in a.names or DEFAULT_CASES:
        r = _run_case(name, a.methods, a.seeds)
        results.append(r)
        print(_format(r), flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
