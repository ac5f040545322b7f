"""MCMC-SAEM on Theophylline pharmacokinetics (MCMC-SAEM paper, Sec. 5.2).

(a) Fit of the one-compartment model with additive and proportional residual error on the 12
    subjects (120 observations, saemix's data): saemix's schedule (simulated annealing, then
    :math:`\\gamma_k = 1/k`), E-step of independence proposals from the prior (saemix's kernel 1)
    and preconditioned MALA, automatic Gaussian M-step. Estimates,
    Louis standard errors, :math:`-2\\ell` / AIC / BIC by importance sampling, against the
    maximum of the exact marginal likelihood (adaptive Gauss--Hermite quadrature over the three
    random effects, ``numpyro_fed.examples.pk.theophylline_exact_fit``). Convergence plots.
(b) The paper's experiment (Fig. 2): test marginal log predictive density per test subject
    (annealed importance sampling, 100 particles x 1000 quadratic-schedule temperatures) of the
    hyperparameters fitted by SAEM (paper's settings: :math:`\\gamma_k = 1/\\sqrt k`, 1000
    iterations after 100 burn-in steps, 4 Langevin steps per iteration, one chain, no
    preconditioner) vs the ULA/MALA step size, over random 9:3 subject splits, with 80%
    bootstrap bands of the mean. The LPD of the exact maximum (quadrature) on each split is
    the reference.

Default: 4 splits x 5 step sizes (about 5 minutes on 2 CPU cores); ``--splits 32 --steps
1e-4,3e-4,1e-3,3e-3,1e-2,3e-2,1e-1,3e-1,1`` is the paper's setting.
"""

from __future__ import annotations

import math
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
from _saem_common import (  # noqa: E402
    bootstrap_mean_ci,
    fit_or_none,
    make_ais,
    out_dir,
    paper_saem,
    parser,
    write_outputs,
)
from jax import random  # noqa: E402

from numpyro_fed.examples.pk import (  # noqa: E402
    THEOPHYLLINE_INIT,
    load_theophylline,
    theophylline_exact_fit,
    theophylline_exact_loglik,
    theophylline_model,
    theophylline_random_split,
    theophylline_sufficient_statistics,
)
from numpyro_fed.saem import SAEM, Schedule  # noqa: E402

NAME = "saem_theophylline"
_ARGS = ("dose", "time", "conc")


def _precond(th):
    """Diagonal preconditioner of the E-step: the random-effect variances (the prior
    covariance of :math:`\\phi_i`), which puts the three coordinates on a common scale."""
    return {"phi": jnp.stack([th["omega_ka"], th["omega_V"], th["omega_CL"]]) ** 2}


def _rel_error(name: str, est: float, ref: float) -> float:
    """Relative error: fixed effects on the natural scale (ka, V, CL), omega as variances,
    residual-error parameters as they are."""
    if name.startswith("mu_"):
        return math.expm1(est - ref)
    if name.startswith("omega_"):
        return est**2 / ref**2 - 1.0
    return est / ref - 1.0


# ----------------------------------------------------------------------------- part (a)
def part_a(a, data, out: Path) -> pd.DataFrame:
    args = tuple(data[k] for k in _ARGS)
    rows = []
    for error in a.errors:
        t0 = time.perf_counter()
        saem = SAEM(theophylline_model, kernel="mala", step_size=a.fit_step, num_chains=a.chains,
                    preconditioner=_precond, schedule=Schedule.saemix(a.k1, a.k2), fisher=True,
                    prior_proposals=a.prior_proposals)
        res = saem.run(random.key(a.seed), *args, error=error)
        t_fit = time.perf_counter() - t0
        ll = res.log_likelihood(random.key(a.seed + 1), num_samples=a.is_samples)
        t0 = time.perf_counter()
        est, se = res.estimates(), res.standard_errors()
        if a.exact:
            with jax.enable_x64(True):
                exact = theophylline_exact_fit(data, error=error, num_nodes=a.nodes)
        else:
            exact = dict.fromkeys([*est, "m2ll"], np.nan)
        t_exact = time.perf_counter() - t0
        p = res.num_params
        print(f"[a] {error}: SAEM {t_fit:.1f} s, exact quadrature {t_exact:.1f} s; "
              f"-2LL {ll['m2ll']:.2f} +- {ll['m2ll_se']:.2f} vs exact {exact['m2ll']:.3f}")
        for n in est:
            rows.append({"error": error, "quantity": n, "SAEM": est[n], "SE": se[n],
                         "RSE %": 100 * se[n] / abs(est[n]), "exact": exact[n],
                         "rel. error": _rel_error(n, est[n], exact[n])})
        n_subj = ll["num_subjects"]
        for q, v, ref in [
            ("-2LL", ll["m2ll"], exact["m2ll"]),
            ("AIC", ll["aic"], exact["m2ll"] + 2 * p),
            ("BIC", ll["bic"], exact["m2ll"] + math.log(n_subj) * p),
        ]:
            rows.append({"error": error, "quantity": q, "SAEM": v, "SE": ll["m2ll_se"],
                         "RSE %": np.nan, "exact": ref, "rel. error": v - ref})
        rows.append({"error": error, "quantity": "fit time (s)", "SAEM": t_fit, "SE": np.nan,
                     "RSE %": np.nan, "exact": t_exact, "rel. error": np.nan})
        fig = res.plot_convergence(reference={k: exact[k] for k in est})
        fig.suptitle(f"Theophylline SAEM, {error} error (dotted: exact maximum)", y=1.02)
        fig.savefig(out / f"{NAME}_convergence_{error}.png", dpi=110, bbox_inches="tight")
        plt.close(fig)
    return pd.DataFrame(rows)


# ----------------------------------------------------------------------------- part (b)
def part_b(a, data) -> tuple[pd.DataFrame, pd.DataFrame]:
    ais = make_ais(theophylline_model, num_particles=a.ais_particles, num_steps=a.ais_steps,
                   step_size=a.ais_step)
    init = {**{k: THEOPHYLLINE_INIT[k] for k in ("mu_ka", "mu_V", "mu_CL")},
            "omega_ka": 1.0, "omega_V": 1.0, "omega_CL": 1.0, "sigma": 1.0}
    rows = []
    for split in range(a.splits):
        train, test = theophylline_random_split(data, 9, seed=a.seed + split)
        targs = tuple(test[k] for k in _ARGS)
        key = random.fold_in(random.key(a.seed), split)
        ref = np.nan
        if a.reference:
            with jax.enable_x64(True):
                ex = theophylline_exact_fit(train, num_nodes=a.nodes)
                th64 = {k: jnp.float64(ex[k]) for k in init}
                ll = theophylline_exact_loglik(
                    th64, {k: np.asarray(test[k], np.float64) for k in _ARGS},
                    num_nodes=a.nodes)
            ref = float(ll) / len(test["dose"])
        for kernel in a.kernels:
            for eta in a.steps:
                t0 = time.perf_counter()
                # the paper's E-step and schedule (fixed step for the sweep, 1 chain, joint MH
                # test, gamma_k = 1/sqrt(k), no prior proposals/centring): not the defaults
                saem = paper_saem(theophylline_model, kernel, eta, a.iters, a.burnin,
                                  fisher=False, mstep=theophylline_sufficient_statistics(),
                                  mh_blocks="joint", num_draws=1)
                res = fit_or_none(saem, key, *(train[k] for k in _ARGS), init_params=init)
                t_fit = time.perf_counter() - t0
                if res is None:
                    lpd, acc = -np.inf, np.nan
                else:
                    th = {k: float(v) for k, v in res.params.items()}
                    lpd = float(np.mean(np.asarray(ais(random.fold_in(key, 99), th, *targs))))
                    acc = float(res.trajectory["accept_rate"].mean())
                rows.append({"split": split, "kernel": kernel.upper(), "step": eta, "lpd": lpd,
                             "accept": acc, "fit_s": t_fit, "exact_lpd": ref})
                print(f"[b] split {split} {kernel.upper():4s} eta={eta:.0e}: LPD {lpd:.3f} "
                      f"(exact-MLE {ref:.3f}), accept {acc:.3f}, {t_fit:.1f} s")
    raw = pd.DataFrame(rows)
    summ = []
    for (kernel, eta), g in raw.groupby(["kernel", "step"], sort=True):
        m, lo, hi = bootstrap_mean_ci(g["lpd"].to_numpy(), seed=a.seed)
        finite = np.isfinite(g["lpd"].to_numpy())
        summ.append({"kernel": kernel, "step": eta, "LPD mean": m, "80% lo": lo, "80% hi": hi,
                     "diverged": f"{int((~finite).sum())}/{len(g)}",
                     "mean LPD (converged)": float(g["lpd"][finite].mean())
                     if finite.any() else np.nan,
                     "exact-MLE LPD": float(g["exact_lpd"].mean()),
                     "accept": float(g["accept"].mean()), "fit s": float(g["fit_s"].mean())})
    return pd.DataFrame(summ), raw


def plot_b(summ: pd.DataFrame):
    fig, ax = plt.subplots(figsize=(5.5, 3.8))
    for kernel, color in (("ULA", "C0"), ("MALA", "C3")):
        g = summ[summ["kernel"] == kernel].sort_values("step")
        ok = np.isfinite(g["LPD mean"])
        ax.plot(g["step"][ok], g["LPD mean"][ok], "o-", color=color, label=kernel)
        ax.fill_between(g["step"][ok], g["80% lo"][ok], g["80% hi"][ok], color=color,
                        alpha=0.25)
        bad = g["diverged"].str.split("/").str[0].astype(int) > 0
        if bad.any():
            y0 = np.nanmin(summ["mean LPD (converged)"])
            ax.plot(g["step"][bad], np.full(int(bad.sum()), y0), "x", color=color, ms=9,
                    label=f"{kernel} diverged")
    ref = summ["exact-MLE LPD"].to_numpy(np.float64)
    if np.isfinite(ref).any():
        ref = float(np.nanmean(ref))
        ax.axhline(ref, color="k", ls=":", lw=1, label="exact MLE (quadrature)")
    ax.set_xscale("log")
    ax.set_xlabel("Langevin step size $\\eta$")
    ax.set_ylabel("test LPD per subject")
    ax.set_title("Theophylline: test marginal LPD (AIS), 9:3 splits")
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


# ----------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> dict[str, pd.DataFrame]:
    p = parser(NAME, __doc__)
    p.add_argument("--parts", default="ab", help="'a' (fit vs exact), 'b' (LPD vs step), 'ab'")
    p.add_argument("--errors", default="additive,proportional")
    p.add_argument("--k1", type=int, default=300, help="saemix exploration iterations (a)")
    p.add_argument("--k2", type=int, default=300, help="saemix averaging iterations (a)")
    p.add_argument("--chains", type=int, default=4, help="chains per subject (a)")
    p.add_argument("--fit-step", type=float, default=0.03, help="MALA step of the fit (a)")
    p.add_argument("--prior-proposals", type=int, default=2,
                   help="independence proposals from p(phi | theta) per E-step (a; saemix: 2)")
    p.add_argument("--is-samples", type=int, default=10_000, help="IS samples for -2LL (a)")
    p.add_argument("--nodes", type=int, default=6, help="Gauss-Hermite nodes per dimension")
    p.add_argument("--splits", type=int, default=4, help="random 9:3 splits (paper: 32)")
    p.add_argument("--steps", default="1e-4,1e-3,1e-2,3e-2,1e-1", help="Langevin step grid")
    p.add_argument("--iters", type=int, default=1000, help="SAEM iterations (b; paper 1000)")
    p.add_argument("--kernels", default="ula,mala", help="E-step kernels of (b)")
    p.add_argument("--burnin", type=int, default=100, help="burn-in MCMC steps (b)")
    p.add_argument("--ais-particles", type=int, default=100)
    p.add_argument("--ais-steps", type=int, default=1000)
    p.add_argument("--ais-step", type=float, default=1e-2, help="MALA step inside AIS")
    p.add_argument("--no-reference", dest="reference", action="store_false",
                   help="skip the exact-MLE LPD of each split (b)")
    p.add_argument("--no-exact", dest="exact", action="store_false",
                   help="skip the exact quadrature fit (a)")
    a = p.parse_args(argv)
    a.errors = [e.strip() for e in a.errors.split(",") if e.strip()]
    a.steps = [float(s) for s in a.steps.split(",")]
    a.kernels = [k.strip().lower() for k in a.kernels.split(",") if k.strip()]
    if a.smoke:
        a.kernels = ["mala"]
        a.errors, a.k1, a.k2, a.chains, a.is_samples, a.nodes = ["additive"], 30, 30, 2, 500, 3
        a.exact, a.splits, a.steps, a.iters, a.burnin = False, 1, [1e-1], 30, 5
        # AIS settings of tests/test_saem_examples.py's AIS check (3 test subjects): the
        # compiled sampler is shared in a test session; its run time is negligible
        a.ais_particles, a.ais_steps, a.ais_step, a.reference = 100, 400, 1e-2, False
    if not set(a.parts) <= {"a", "b"}:
        raise ValueError(f"--parts={a.parts!r}: use 'a', 'b' or 'ab'.")
    t_start = time.perf_counter()
    data = load_theophylline()
    out = out_dir(a, NAME)
    tables: dict[str, pd.DataFrame] = {}
    fig = None
    if "a" in a.parts:
        tables["fit"] = part_a(a, data, out)
    if "b" in a.parts:
        summ, raw = part_b(a, data)
        tables["lpd_vs_step"] = summ
        tables["lpd_per_split"] = raw
        fig = plot_b(summ)
    elapsed = time.perf_counter() - t_start
    notes = (
        "(a) 12 subjects / 120 observations; SAEM: saemix schedule "
        f"({a.k1} annealed iterations at gamma = 1, then {a.k2} at 1/k), E-step: "
        f"{a.prior_proposals} independence proposals from p(phi | theta) (saemix's kernel 1) "
        f"then 4 MALA steps (step {a.fit_step}, preconditioned by omega^2, accept/reject per "
        f"subject), {a.chains} chains, automatic "
        f"Gaussian M-step, Louis SEs, -2LL by importance sampling ({a.is_samples} draws per "
        "subject; 'SE' of the -2LL rows is its Monte Carlo SE). Exact: maximum of the adaptive "
        f"Gauss-Hermite ({a.nodes}^3 nodes) marginal likelihood. 'rel. error': exp(mu - mu*) - 1 "
        "for fixed effects, omega^2 / omega*^2 - 1, b / b* - 1, sigma / sigma* - 1; for -2LL / "
        "AIC / BIC the difference.\n\n"
        f"(b) {a.splits} random 9:3 subject splits; SAEM gamma_k = 1/sqrt(k), {a.iters} "
        f"iterations after {a.burnin} burn-in steps, 4 Langevin steps per iteration (MALA: "
        "one accept/reject for the whole latent vector, as in the paper), 1 chain, "
        "sufficient-statistics M-step, no preconditioner, theta_0 = saemix's (ka = 1, V = 20, "
        "CL = 0.5), omega = sigma = 1; "
        f"test LPD per subject by AIS ({a.ais_particles} particles x {a.ais_steps} "
        f"temperatures, MALA step {a.ais_step}); 80% percentile-bootstrap band of the mean over "
        "splits; a diverged fit counts as LPD = -inf. 'exact-MLE LPD': quadrature LPD of the "
        f"exact maximum on the same splits. Total time {elapsed:.0f} s."
    )
    write_outputs(a, NAME, tables, fig, "MCMC-SAEM: Theophylline (paper Sec. 5.2)", notes)
    print(f"wrote {out}/{NAME}.{{png,csv,md}} in {elapsed:.0f} s")
    return tables


if __name__ == "__main__":
    main()
