"""MCMC-SAEM for logistic regression with automatic relevance determination on ``ISLR/Caravan``
(MCMC-SAEM paper, Sec. 5.4, Fig. 4).

Model (``numpyro_fed.examples.glmm.ard_logistic``): :math:`\\beta_0 \\sim \\mathcal N(0, 10)`,
:math:`\\beta_j \\sim \\mathcal N(0, \\gamma_j^{-1})`, Bernoulli-logit likelihood; the 85
relevance hyperparameters are fitted by SAEM (:math:`\\gamma_k = 1/\\sqrt k`, 4 Langevin steps
per iteration, :math:`\\theta_0 = 1`) with the paper's diagonal preconditioner
:math:`P_{jj} = 1/(\\gamma_j^2 + 0.01) + \\delta`. Test log predictive density per
observation from posterior draws at :math:`\\hat\\gamma` (preconditioned MALA, step adapted
to an acceptance rate of 0.57 during warm-up as in the paper) vs the ULA/MALA step size of
the E-step, over random 80:20 splits with 80% bootstrap bands.
"""

from __future__ import annotations

import sys
import time
from functools import partial
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
    out_dir,
    paper_saem,
    parser,
    write_outputs,
)
from jax import lax, random  # noqa: E402

from numpyro_fed.examples.glmm import ard_logistic, ard_preconditioner, load_caravan_ard  # noqa: E402

NAME = "saem_ard"


def posterior_lpd(key, tau, X, y, Xte, yte, num_warmup: int, num_samples: int,
                  target: float = 0.57) -> tuple[float, float]:
    """Test LPD per observation, :math:`\\frac1n\\sum_i\\log\\frac1S\\sum_s p(y_i\\mid
    \\beta^{(s)})`, from preconditioned MALA draws of :math:`p(\\beta_0, \\beta\\mid y;
    \\hat\\tau)` (preconditioner :math:`\\mathrm{diag}(10, \\hat\\tau^2)`, the prior covariance;
    Robbins--Monro adaptation of the log step towards acceptance ``target`` during warm-up).
    Returns ``(lpd, acceptance rate after warm-up)``. One compilation serves every call with
    the same shapes."""
    lpd, acc = _posterior_lpd(key, jnp.asarray(tau), *map(jnp.asarray, (X, y, Xte, yte)),
                              int(num_warmup), int(num_samples), float(target))
    return float(lpd), float(acc)


@partial(jax.jit, static_argnums=(6, 7, 8))
def _posterior_lpd(key, tau, X, y, Xte, yte, num_warmup, num_samples, target):
    prior_var = jnp.concatenate([jnp.array([10.0], X.dtype), tau**2])
    yf = y.astype(X.dtype)

    def logp(w):
        logits = w[0] + X @ w[1:]
        return jnp.sum(yf * logits - jnp.logaddexp(0.0, logits)) - 0.5 * jnp.sum(w**2 / prior_var)

    vg = jax.value_and_grad(logp)
    p = prior_var
    w0 = jnp.zeros(X.shape[1] + 1, X.dtype)

    def step(c, x):
        w, lp, g, log_eta = c
        k, i = x
        eta = jnp.exp(log_eta)
        kn, ku = random.split(k)
        prop = w + eta * p * g + jnp.sqrt(2 * eta * p) * random.normal(kn, w.shape, w.dtype)
        lq, gq = vg(prop)
        fwd = jnp.sum((prop - w - eta * p * g) ** 2 / p)
        bwd = jnp.sum((w - prop - eta * p * gq) ** 2 / p)
        lr = lq - lp + (fwd - bwd) / (4 * eta)
        acc = jnp.exp(jnp.minimum(jnp.where(jnp.isnan(lr), -jnp.inf, lr), 0.0))
        ok = random.uniform(ku) < acc
        w, lp, g = (jnp.where(ok, prop, w), jnp.where(ok, lq, lp), jnp.where(ok, gq, g))
        adapt = i < num_warmup
        log_eta = log_eta + jnp.where(adapt, (acc - target) / jnp.sqrt(i + 1.0), 0.0)
        return (w, lp, g, log_eta), (w, acc)

    lp0, g0 = vg(w0)
    n = num_warmup + num_samples
    _, (ws, accs) = lax.scan(step, (w0, lp0, g0, jnp.log(jnp.asarray(1e-3, X.dtype))),
                             (random.split(key, n), jnp.arange(n)))
    ws, accs = ws[num_warmup:], accs[num_warmup:]
    logits = ws[:, :1] + ws[:, 1:] @ Xte.T  # (S, n_test)
    ll = yte * logits - jnp.logaddexp(0.0, logits)
    lpd = jnp.mean(jax.nn.logsumexp(ll, axis=0) - jnp.log(ws.shape[0]))
    return lpd, jnp.mean(accs)


def main(argv: list[str] | None = None) -> dict[str, pd.DataFrame]:
    p = parser(NAME, __doc__)
    p.add_argument("--splits", type=int, default=2, help="random 80:20 splits (paper: 32)")
    p.add_argument("--steps", default="1e-3,1e-2,1e-1,1", help="E-step Langevin step sizes")
    p.add_argument("--iters", type=int, default=300, help="SAEM iterations (paper: 2000)")
    p.add_argument("--burnin", type=int, default=100, help="burn-in MCMC steps (paper: 100)")
    p.add_argument("--warmup", type=int, default=1000, help="MALA warm-up for the LPD")
    p.add_argument("--samples", type=int, default=1000, help="MALA draws for the LPD")
    p.add_argument("--kernels", default="ula,mala", help="E-step kernels")
    a = p.parse_args(argv)
    a.steps = [float(s) for s in a.steps.split(",")]
    a.kernels = [k.strip().lower() for k in a.kernels.split(",") if k.strip()]
    if a.smoke:
        a.kernels = ["mala"]
        a.splits, a.steps, a.iters, a.burnin, a.warmup, a.samples = 1, [1e-1], 10, 5, 50, 50
    t_start = time.perf_counter()
    rows = []
    for split in range(a.splits):
        Xtr, Xte, ytr, yte = load_caravan_ard(test_fraction=0.2, seed=a.seed + split)
        if a.smoke:
            Xtr, ytr = Xtr[:500], ytr[:500]
        key = random.fold_in(random.key(a.seed), split)
        for kernel in a.kernels:
            for eta in a.steps:
                t0 = time.perf_counter()
                # the paper's algorithm (fixed preconditioned step for the sweep, 1 chain,
                # gamma_k = 1/sqrt(k)): the defaults adapt the step and run 50 chains
                saem = paper_saem(ard_logistic, kernel, eta, a.iters, a.burnin, fisher=False,
                                  preconditioner=ard_preconditioner(), num_draws=1)
                res = fit_or_none(saem, key, Xtr, ytr)
                t_fit = time.perf_counter() - t0
                if res is None:
                    lpd, acc, acc_lpd, pruned, tau_max = -np.inf, np.nan, np.nan, np.nan, np.nan
                else:
                    tau = np.asarray(res.params["tau"])
                    lpd, acc_lpd = posterior_lpd(random.fold_in(key, 7), tau, Xtr, ytr, Xte,
                                                 yte, a.warmup, a.samples)
                    acc = float(res.trajectory["accept_rate"].mean())
                    pruned = int(np.sum(tau < 0.01))
                    tau_max = float(np.max(tau))
                rows.append({"split": split, "kernel": kernel.upper(), "step": eta, "lpd": lpd,
                             "accept": acc, "pruned (tau<0.01)": pruned, "max tau": tau_max,
                             "LPD-MALA accept": acc_lpd, "fit_s": t_fit})
                print(f"split {split} {kernel.upper():4s} eta={eta:.0e}: LPD {lpd:.4f}, "
                      f"accept {acc:.3f}, pruned {pruned}, {t_fit:.1f} s")
    raw = pd.DataFrame(rows)
    summ = []
    for (kernel, eta), g in raw.groupby(["kernel", "step"], sort=True):
        m, lo, hi = bootstrap_mean_ci(g["lpd"].to_numpy(), seed=a.seed)
        summ.append({"kernel": kernel, "step": eta, "LPD mean": m, "80% lo": lo, "80% hi": hi,
                     "diverged": f"{int((~np.isfinite(g['lpd'])).sum())}/{len(g)}",
                     "accept": float(g["accept"].mean()),
                     "pruned": float(g["pruned (tau<0.01)"].mean()),
                     "max tau": float(g["max tau"].max()),
                     "fit s": float(g["fit_s"].mean())})
    summ = pd.DataFrame(summ)
    fig, ax = plt.subplots(figsize=(5.5, 3.8))
    for kernel, color in (("ULA", "C0"), ("MALA", "C3")):
        g = summ[summ["kernel"] == kernel].sort_values("step")
        ok = np.isfinite(g["LPD mean"].to_numpy())
        ax.plot(g["step"][ok], g["LPD mean"][ok], "o-", color=color, label=kernel)
        ax.fill_between(g["step"][ok], g["80% lo"][ok], g["80% hi"][ok], color=color,
                        alpha=0.25)
    ax.set_xscale("log")
    ax.set_xlabel("Langevin step size $\\eta$ (preconditioned)")
    ax.set_ylabel("test LPD per observation")
    ax.set_title("ARD logistic regression, Caravan")
    ax.legend()
    fig.tight_layout()
    elapsed = time.perf_counter() - t_start
    notes = (
        f"ISLR/Caravan, 85 standardised features + intercept; {a.splits} random 80:20 splits; "
        f"SAEM gamma_k = 1/sqrt(k), {a.iters} iterations after {a.burnin} burn-in steps, 4 "
        "preconditioned Langevin steps per iteration (P = 1/(gamma^2 + 0.01) + 2e-16 for beta, "
        "1 for beta0), 1 chain, theta_0 = 1, closed-form Gaussian M-step on tau = "
        f"gamma^(-1/2); test LPD from {a.samples} MALA draws after {a.warmup} adaptation "
        "steps at the fitted gamma; 'pruned' = mean number of features with tau < 0.01; "
        "diverged fits count as -inf. ULA's bias grows with its step: beyond the stability "
        "limit of the stiffest direction its beta draws oscillate with huge amplitude, the "
        "M-step turns them into huge prior scales tau ('max tau'), and the posterior at such "
        "tau predicts at random (LPD near log 1/2 = -0.693); MALA rejects those moves (its "
        "acceptance falls to 0, theta stays near the burn-in estimate) and keeps a useful LPD, "
        f"the paper's Fig. 4 finding. Total time {elapsed:.0f} s."
    )
    tables = {"lpd_vs_step": summ, "runs": raw}
    write_outputs(a, NAME, tables, fig, "MCMC-SAEM: ARD logistic regression (paper Sec. 5.4)",
                  notes)
    print(f"wrote {out_dir(a, NAME)}/{NAME}.{{png,csv,md}} in {elapsed:.0f} s")
    return tables


if __name__ == "__main__":
    main()
