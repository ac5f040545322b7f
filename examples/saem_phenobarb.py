"""The pharmacometric workflow on real multiple-dose data: Phenobarbital in neonates.

``nlme::Phenobarb`` (Grasela & Donn 1985; Pinheiro & Bates 2000, Sec. 6.4): 59 preterm
neonates, 589 intravenous bolus doses (1 to 15 per subject), 155 sparse concentrations (1 to
6 per subject), birth weight and 5-minute Apgar score. The whole path with
:mod:`numpyro_fed.nlme`:

1. the NONMEM-style dataset (``nlme.load_phenobarb()``, its report);
2. the one-compartment IV-bolus model with log-normal CL and V, additive error -- Pinheiro &
   Bates' ``phe.nlme1`` -- fitted by SAEM with its defaults; the estimates against the exact
   maximum likelihood (adaptive Gauss--Hermite quadrature over the two random effects,
   written independently in ``tests/saem_cases.py``) and against the nlme fit of the same
   model (nlme's Lindstrom--Bates linearisation: close to, not at, the exact maximum);
3. the covariate model (birth weight on log CL and log V, Apgar < 5 on log V, as in the
   book's final model) against its exact maximum, and the -2LL / AIC comparison;
4. diagnostics of the covariate model: parameter table (SE, RSE %, CV %), individual
   estimates and eta-shrinkage, PRED / IPRED / IWRES / CWRES, NPDE, goodness-of-fit plots,
   individual fits, VPC and prediction-corrected VPC (PNG);
5. simulation of a new dosing regimen (loading dose + maintenance) for new neonates;
6. Theophylline on the new layer (``nlme.load_theophylline()``, one compartment with
   first-order absorption) against the hand-written model of ``numpyro_fed.examples.pk``: same
   estimates.

Usage: ``python examples/saem_phenobarb.py [--out DIR] [--smoke]`` (about 2-3 minutes on 2
CPU cores; ``--smoke``, for the test suite: steps 1 and 3-5 with few simulations -- the fit
of step 3 is the one the tests of ``tests/test_nlme_model.py`` make, compiled once).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

import jax  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402

from numpyro_fed import nlme  # noqa: E402
from numpyro_fed.saem import SAEM  # noqa: E402

#: nlme 3.1-162 (R 4.x), ``nlme(conc ~ phenoModel(Subject, time, dose, lCl, lV), fixed =
#: lCl + lV ~ 1, random = pdDiag(lCl + lV ~ 1), start = c(-5, 0))`` on the same 155 rows,
#: measured here (Pinheiro & Bates' phe.nlme1; the book prints the same values). The
#: covariate model (lCl ~ Wt, lV ~ Wt + ApgarInd) does not converge in this nlme version
#: ("maximum number of iterations reached"), so only the base model is compared to nlme.
NLME_BASE = {"mu_CL": -5.093242, "mu_V": 0.342534, "omega_CL": 0.4402102,
             "omega_V": 0.4504399, "a": 2.792742, "loglik": -505.4157}


def _fit(pk, data, key):
    t0 = time.perf_counter()
    fit = pk.fit(data, key)
    return fit, time.perf_counter() - t0


def _exact(name: str, params: dict):
    """Exact -2LL at the estimate and the stored exact maximum (tests/saem_cases.py)."""
    import saem_cases as sc

    case = sc.get_case(name)
    ref = sc.reference(name)
    return -2 * case.exact_loglik(params), ref


def _theophylline(key, tables: dict) -> list:
    """Step 6: Theophylline on the nlme layer against the hand-written model of
    numpyro_fed.examples.pk."""
    from numpyro_fed.examples.pk import (
        load_theophylline,
        theophylline_exact_fit,
        theophylline_model,
    )

    lines: list = []
    th = nlme.load_theophylline()
    pk_th = nlme.PKModel(nlme.one_compartment(absorption="first_order"),
                         params={"KA": nlme.Param(1.0), "V": nlme.Param(20.0),
                                 "CL": nlme.Param(0.5)}, error="additive")
    fit_th, sec_th = _fit(pk_th, th, key)
    old = load_theophylline()
    res_old = SAEM(theophylline_model).run(key, old["dose"], old["time"], old["conc"])
    exact = theophylline_exact_fit(old)
    rows = []
    for new_n, old_n in (("KA", "ka"), ("V", "V"), ("CL", "CL")):
        rows.append({"parameter": f"mu_{old_n}",
                     "nlme layer": float(fit_th.params[f"mu_{new_n}"]),
                     "hand-written": float(res_old.params[f"mu_{old_n}"]),
                     "exact MLE": float(exact[f"mu_{old_n}"])})
        rows.append({"parameter": f"omega_{old_n}",
                     "nlme layer": float(fit_th.params[f"omega_{new_n}"]),
                     "hand-written": float(res_old.params[f"omega_{old_n}"]),
                     "exact MLE": float(exact[f"omega_{old_n}"])})
    rows.append({"parameter": "sigma", "nlme layer": float(fit_th.params["a"]),
                 "hand-written": float(res_old.params["sigma"]),
                 "exact MLE": float(exact["sigma"])})
    t_th = pd.DataFrame(rows).set_index("parameter")
    tables["theophylline"] = t_th
    lines += ["## Theophylline: the nlme layer against the hand-written model", "",
              f"Both with SAEM's defaults (nlme layer {sec_th:.1f} s).", "",
              t_th.to_markdown(floatfmt=".4f"), ""]
    print(t_th)
    return lines


def _base_model(data, key, key_ll, tables: dict) -> tuple[list, float]:
    """Step 2: the base model against its exact maximum and nlme; its lines and its AIC."""
    import saem_cases as sc

    base = sc._phenobarb_pk(covariates=False)
    fit0, sec0 = _fit(base, data, key)
    m2ll0, ref0 = _exact("phenobarb", fit0.params)
    lines: list = []
    rows = []
    for k in ("mu_CL", "mu_V", "omega_CL", "omega_V", "a"):
        rows.append({"parameter": k, "SAEM (defaults)": float(fit0.params[k]),
                     "exact MLE": ref0["params"][k], "nlme (LB)": NLME_BASE[k]})
    rows.append({"parameter": "-2LL (exact at the estimate)", "SAEM (defaults)": m2ll0,
                 "exact MLE": ref0["m2ll"], "nlme (LB)": -2 * NLME_BASE["loglik"]})
    t_base = pd.DataFrame(rows).set_index("parameter")
    tables["base"] = t_base
    lines += ["## Base model (Pinheiro & Bates phe.nlme1)", "",
              f"SAEM with its defaults, {sec0:.1f} s (compilation included). The nlme "
              "column is nlme's own -2LL (its linearised likelihood).", "",
              t_base.to_markdown(floatfmt=".4f"), ""]
    print(t_base)

    return lines, fit0.result.log_likelihood(key_ll)["aic"]


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=str(ROOT / "examples" / "results"))
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    key = jax.random.key(a.seed)
    k1, k2, k3, k4, k5, k6 = jax.random.split(key, 6)
    lines = ["# Phenobarbital in neonates with numpyro_fed.nlme", ""]
    tables = {}

    # 1. data ---------------------------------------------------------------------------
    data = nlme.load_phenobarb()
    print(data.report())
    lines += ["## Data", "", "```", data.report(), "```", ""]

    # 2. base model vs exact maximum and nlme ---------------------------------------------
    import saem_cases as sc

    base_aic = None
    if not a.smoke:
        more, base_aic = _base_model(data, k1, k3, tables)
        lines += more

    # 3. covariate model ----------------------------------------------------------------
    cov = sc._phenobarb_pk(covariates=True)
    fit, sec = _fit(cov, data, k2)

    m2ll, ref = _exact("phenobarb_cov", fit.params)
    case = sc.get_case("phenobarb_cov")
    cmp = sc.compare(case, fit.params)
    rows = [{"parameter": k, "SAEM (defaults)": float(np.asarray(fit.params[k])),
             "exact MLE": ref["params"][k]} for k in ref["params"]]
    rows.append({"parameter": "-2LL (exact at the estimate)", "SAEM (defaults)": m2ll,
                 "exact MLE": ref["m2ll"]})
    t_cov = pd.DataFrame(rows).set_index("parameter")
    tables["covariates"] = t_cov
    ll_is = fit.result.log_likelihood(k3)
    ll_gq = fit.result.log_likelihood(method="gq")
    lines += ["## Covariate model (WT on CL and V, Apgar on V)", "",
              f"SAEM with its defaults, {sec:.1f} s. Every quantity within the targets of the "
              f"unseen-model table: **{cmp['ok']}** (largest error "
              f"{max(abs(v['err']) / v['tol'] for v in cmp['quantities'].values()):.2f} of "
              "its tolerance).", "", t_cov.to_markdown(floatfmt=".4f"), "",
              f"-2LL by importance sampling {ll_is['m2ll']:.2f} +- {ll_is['m2ll_se']:.2f}, "
              f"by Gauss-Hermite quadrature {ll_gq['m2ll']:.2f}; AIC {ll_is['aic']:.1f}"
              + (f" against {base_aic:.1f} for the base model." if base_aic else "."), ""]
    print(t_cov)

    # 4. diagnostics --------------------------------------------------------------------
    ptab = fit.parameter_table()
    tables["parameters"] = ptab
    ind = fit.individual_estimates()
    shr = fit.shrinkage()
    pr = fit.predictions()
    npde = fit.npde(k4, num_sims=100 if a.smoke else 1000)
    fit.plot_goodness_of_fit(out / "phenobarb_gof.png", npde=npde)
    fit.plot_individual_fits(out / "phenobarb_individual.png")
    nsim = 50 if a.smoke else 500
    fit.plot_vpc(k5, out / "phenobarb_vpc.png", num_sims=nsim)
    fit.plot_vpc(k5, out / "phenobarb_pcvpc.png", num_sims=nsim, prediction_corrected=True)
    vpc = fit.vpc_table(k5, num_sims=nsim)
    inside = float(np.mean((vpc["observed"] >= vpc["sim_lo"])
                           & (vpc["observed"] <= vpc["sim_hi"])))
    nd = npde["NPDE"].dropna()
    lines += ["## Diagnostics (covariate model)", "", ptab.to_markdown(floatfmt=".4g"), "",
              "eta-shrinkage: " + ", ".join(f"{k} {v:.0f}%" for k, v in shr.items()), "",
              f"IWRES mean {pr['IWRES'].mean():.3f}, sd {pr['IWRES'].std():.3f}; CWRES mean "
              f"{pr['CWRES'].mean():.3f}, sd {pr['CWRES'].std():.3f}; NPDE mean "
              f"{nd.mean():.3f}, sd {nd.std():.3f} (N(0, 1) under the model: standard errors "
              f"{1 / np.sqrt(len(nd)):.3f} and {1 / np.sqrt(2 * len(nd)):.3f}); "
              f"{100 * inside:.0f}% of the VPC's observed percentiles inside their 90% "
              "prediction intervals.", "",
              "Individual estimates (first 5 subjects):", "",
              ind.head().to_markdown(floatfmt=".4g"), "",
              "Figures: phenobarb_gof.png, phenobarb_individual.png, phenobarb_vpc.png, "
              "phenobarb_pcvpc.png.", ""]
    tables["shrinkage"] = shr
    tables["npde"] = (float(nd.mean()), float(nd.std()))

    # 5. a new regimen for new neonates ---------------------------------------------------
    rows = []
    for i, wt in enumerate((0.8, 1.3, 2.5)):
        for t in np.arange(0.0, 120.0, 12.0):
            rows.append({"ID": i + 1, "TIME": t, "AMT": (20.0 if t == 0 else 4.0) * wt,
                         "EVID": 1, "DV": np.nan, "WT": wt, "APGARIND": ">= 5"})
        rows.append({"ID": i + 1, "TIME": 119.5, "AMT": 0.0, "EVID": 0, "DV": 0.0, "WT": wt,
                     "APGARIND": ">= 5"})
    df = pd.DataFrame(rows)
    df["APGARIND"] = pd.Categorical(df["APGARIND"], categories=["< 5", ">= 5"])
    new = nlme.PKDataset.from_dataframe(df, covariates=["WT", "APGARIND"])
    sim = fit.simulate(k6, new, num_replicates=200 if a.smoke else 2000)
    q = np.percentile(sim["f"][:, :, 0], [5, 50, 95], axis=0)
    t_reg = pd.DataFrame({"WT (kg)": [0.8, 1.3, 2.5], "trough 5%": q[0], "median": q[1],
                          "95%": q[2]})
    tables["regimen"] = t_reg
    lines += ["## New regimen: 20 mg/kg loading, 4 mg/kg every 12 h, trough at 119.5 h", "",
              "Concentration (without residual error) of new neonates with Apgar >= 5, "
              "simulated from the fitted model:", "", t_reg.to_markdown(index=False,
                                                                        floatfmt=".2f"), ""]
    print(t_reg)

    if not a.smoke:
        lines += _theophylline(k1, tables)

    name = "saem_phenobarb_smoke.md" if a.smoke else "saem_phenobarb.md"
    (out / name).write_text("\n".join(lines))
    return tables


if __name__ == "__main__":
    main()
