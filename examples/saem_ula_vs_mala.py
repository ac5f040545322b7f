"""ULA vs MALA in the E-step of MCMC-SAEM: robustness to the Langevin step size (MCMC-SAEM
paper, Sec. 5.1 and Fig. 1).

Synthetic hierarchical logistic regression, :math:`\\beta \\sim \\mathcal N(\\mu 1_d, \\sigma^2
I_d)`, :math:`y_i \\sim \\mathrm{Bernoulli}(\\mathrm{logistic}(x_i^\\top\\beta))`, with
:math:`d = 100`, :math:`N = 1000` and a design of condition number 1000; hyperparameters
:math:`\\theta = (\\mu, \\sigma)`, :math:`\\theta^* = (1, 0.1)`, :math:`\\theta_0 = (0, 1)`.
As in the paper: 10 burn-in MCMC steps, 100 SAEM iterations with :math:`\\gamma_k = 1/\\sqrt
k`, 4 Langevin steps per iteration, one chain started from a standard Gaussian. The M-step is
the closed-form Gaussian one (recognised automatically). Reported: :math:`|\\theta_k -
\\theta^*|` vs iteration for a grid of step sizes, and the final error (median and 10%/90%
quantiles over independent replications, as the paper's code).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import numpyro  # noqa: E402
import numpyro.distributions as dist  # noqa: E402
import pandas as pd  # noqa: E402
from _saem_common import fit_or_none, out_dir, paper_saem, parser, write_outputs  # noqa: E402
from jax import random  # noqa: E402
from numpyro.distributions import constraints  # noqa: E402
from numpyro.infer.initialization import init_to_sample  # noqa: E402

NAME = "saem_ula_vs_mala"
THETA_STAR = (1.0, 0.1)
THETA_0 = {"mu": 0.0, "sigma": 1.0}


def hierarchical_logistic(X, y=None):
    """:math:`\\beta \\sim \\mathcal N(\\mu 1, \\sigma^2 I)`, :math:`y \\sim
    \\mathrm{Bernoulli}(\\mathrm{logistic}(X\\beta))`; ``mu``, ``sigma`` are ``param`` sites."""
    mu = numpyro.param("mu", 0.0)
    sigma = numpyro.param("sigma", 1.0, constraint=constraints.positive)
    beta = numpyro.sample("beta", dist.Normal(mu, sigma).expand([X.shape[1]]).to_event(1))
    with numpyro.plate("data", X.shape[0]):
        numpyro.sample("y", dist.Bernoulli(logits=X @ beta), obs=y)


def synthetic_data(n: int = 1000, d: int = 100, cond: float = 1000.0, seed: int = 0,
                   logit_sd: float = 2.0):
    """Design :math:`X = U\\,\\mathrm{diag}(s)\\,V^\\top` with orthonormal :math:`U, V` (QR of
    Gaussian matrices) and singular values log-spaced from 1 to ``1/cond`` (condition number
    ``cond``), scaled so that the logits :math:`X\\beta` have standard deviation ``logit_sd``;
    :math:`\\beta \\sim \\mathcal N(\\mu^* 1, \\sigma^{*2} I)` and Bernoulli labels."""
    rng = np.random.default_rng(seed)
    U, _ = np.linalg.qr(rng.standard_normal((n, d)))
    V, _ = np.linalg.qr(rng.standard_normal((d, d)))
    s = np.geomspace(1.0, 1.0 / cond, d)
    X = (U * s) @ V.T
    beta = rng.normal(THETA_STAR[0], THETA_STAR[1], d)
    X *= logit_sd / np.std(X @ beta)
    y = rng.random(n) < 1.0 / (1.0 + np.exp(-X @ beta))
    return X.astype(np.float32), y.astype(np.int32), np.linalg.cond(X)


def main(argv: list[str] | None = None) -> dict[str, pd.DataFrame]:
    p = parser(NAME, __doc__)
    p.add_argument("--steps", default="1e-4,1e-3,3e-3,5e-3,1e-2,2e-2",
                   help="Langevin step sizes")
    p.add_argument("--reps", type=int, default=3, help="independent replications per step")
    p.add_argument("--iters", type=int, default=100, help="SAEM iterations (paper: 100)")
    p.add_argument("--burnin", type=int, default=10, help="burn-in MCMC steps (paper: 10)")
    p.add_argument("--n", type=int, default=1000)
    p.add_argument("--d", type=int, default=100)
    a = p.parse_args(argv)
    steps = [float(s) for s in a.steps.split(",")]
    if a.smoke:
        steps, a.reps, a.iters, a.n, a.d = [2e-2], 1, 10, 200, 20
    t_start = time.perf_counter()
    X, y, cond = synthetic_data(a.n, a.d, seed=a.seed)
    star = np.array(THETA_STAR)
    rows, curves = [], {}
    for kernel in ("ula", "mala"):
        for eta in steps:
            for rep in range(a.reps):
                # the paper's algorithm (fixed step for the sweep, 1 chain, gamma_k =
                # 1/sqrt(k)): the defaults adapt the step and run 50 chains without a plate
                saem = paper_saem(hierarchical_logistic, kernel, eta, a.iters, a.burnin,
                                  fisher=False, num_draws=1, init_strategy=init_to_sample,
                                  init_jitter=0.0)
                t0 = time.perf_counter()
                # the chain starts from a standard Gaussian: a draw from the prior at theta_0
                res = fit_or_none(saem, random.key(1000 * rep + a.seed), X, y,
                                  init_params=THETA_0)
                t_fit = time.perf_counter() - t0
                if res is None:
                    err = np.full(a.iters, np.inf)
                    acc, final = np.nan, (np.nan, np.nan)
                else:
                    traj = res.trajectory[["mu", "sigma"]].to_numpy()
                    err = np.linalg.norm(traj - star, axis=1)
                    acc = float(res.trajectory["accept_rate"].mean())
                    final = tuple(traj[-1])
                curves[(kernel.upper(), eta, rep)] = err
                rows.append({"kernel": kernel.upper(), "step": eta, "rep": rep,
                             "final error": float(err[-1]), "mu": final[0], "sigma": final[1],
                             "accept": acc, "fit_s": t_fit})
                print(f"{kernel.upper():4s} eta={eta:.0e} rep {rep}: |theta - theta*| = "
                      f"{err[-1]:.4f} (mu={final[0]:.3f}, sigma={final[1]:.3f}), accept "
                      f"{acc:.3f}, {t_fit:.1f} s")
    raw = pd.DataFrame(rows)
    summ = []
    for (kernel, eta), g in raw.groupby(["kernel", "step"], sort=True):
        e = g["final error"].to_numpy()
        summ.append({"kernel": kernel, "step": eta, "median final error": float(np.median(e)),
                     "q10": float(np.quantile(e, 0.1)), "q90": float(np.quantile(e, 0.9)),
                     "median mu": float(g["mu"].median()),
                     "median sigma": float(g["sigma"].median()),
                     "diverged": f"{int((~np.isfinite(e)).sum())}/{len(e)}",
                     "accept": float(g["accept"].mean()), "fit s": float(g["fit_s"].mean())})
    summ = pd.DataFrame(summ)
    fig = plot(curves, summ, steps, a.reps)
    elapsed = time.perf_counter() - t_start
    notes = (
        f"N = {a.n}, d = {a.d}, condition number of X = {cond:.0f}, theta* = (1, 0.1), "
        f"theta_0 = (0, 1); {a.burnin} burn-in steps, {a.iters} SAEM iterations, gamma_k = "
        f"1/sqrt(k), 4 Langevin steps per iteration, 1 chain from N(0, I); {a.reps} "
        "replications (independent chains) per step size; error = Euclidean norm of theta - "
        "theta* after the last iteration (theta* is the data-generating value, so the error "
        "does not vanish: the MLE of one finite data set differs from it). 'accept' = mean "
        f"MALA acceptance rate over the iterations. Total time {elapsed:.0f} s."
    )
    write_outputs(a, NAME, {"final_error": summ, "runs": raw}, fig,
                  "MCMC-SAEM: ULA vs MALA step-size robustness (paper Sec. 5.1)", notes)
    print(f"wrote {out_dir(a, NAME)}/{NAME}.{{png,csv,md}} in {elapsed:.0f} s")
    return {"final_error": summ, "runs": raw}


def plot(curves, summ, steps, reps):
    fig, axes = plt.subplots(1, 3, figsize=(14, 3.8))
    cmap = plt.get_cmap("viridis")
    for ax, kernel in zip(axes[:2], ("ULA", "MALA"), strict=True):
        for j, eta in enumerate(steps):
            errs = np.stack([curves[(kernel, eta, r)] for r in range(reps)])
            med = np.median(errs, 0)
            ax.plot(np.arange(1, med.size + 1), med, color=cmap(j / max(1, len(steps) - 1)),
                    label=f"$\\eta$={eta:.0e}")
        ax.set_yscale("log")
        ax.set_xlabel("SAEM iteration")
        ax.set_ylabel("$|\\theta_k - \\theta^*|$ (median)")
        ax.set_title(f"{kernel} E-step")
        ax.legend(fontsize=7)
    ax = axes[2]
    for kernel, color in (("ULA", "C0"), ("MALA", "C3")):
        g = summ[summ["kernel"] == kernel].sort_values("step")
        ok = np.isfinite(g["median final error"])
        ax.plot(g["step"][ok], g["median final error"][ok], "o-", color=color, label=kernel)
        ax.fill_between(g["step"][ok], g["q10"][ok], g["q90"][ok], color=color, alpha=0.2)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("Langevin step size $\\eta$")
    ax.set_ylabel("final $|\\theta - \\theta^*|$")
    ax.set_title("final error (median, 10-90%)")
    ax.legend()
    fig.tight_layout()
    return fig


if __name__ == "__main__":
    main()
