"""ELF paper experiment (Sec. 5, App. D.1): federated Bayesian logistic regression with a
Gaussian prior on 40 clients, federated LMC vs D-ELF, P-ELF and B-ELF with Top-k.

Datasets (offline): scikit-learn's breast cancer (d = 31 with intercept) and ISLR ``Caravan``
(d = 86), standardised, 80/20 train/test split, training rows split i.i.d. over 40 clients.

Two targets:

* ``tempered`` -- the paper's target literally, :math:`F = \\frac1b\\sum_i f_i`,
  :math:`f_i = \\frac1{N_i}\\sum_j \\ell_{ij} + \\frac\\lambda2\\|x\\|^2`, i.e. the model with a
  :math:`\\mathcal N(0, 1/\\lambda)` prior split equally over clients and
  ``likelihood_weight = 1/(b N_i)``; the paper's step sizes {0.01, 0.1, 0.5}.
* ``posterior`` -- the true posterior (prior :math:`\\mathcal N(0, 1)`), step size
  :math:`\\gamma = c/L` with :math:`L = \\frac14\\|X\\|_2^2 + 1/\\sigma_0^2` the smoothness of U.

Every chain starts at ``x_0 = 0``. Reported for each method: test accuracy and mean test log
predictive density (LPD) of the average of the last 100 iterates (the paper's estimator,
averaged over chains) and of the posterior predictive (all chains, second half of the run),
and the exact bits sent (uplink = sum over clients, downlink = received by the clients, one-off
rounds included). Targets of the issue: every ELF run within 1 pp of LMC in accuracy and within
2% in LPD; for k <= d/10, B-ELF >= 5x fewer total bits than LMC, D-ELF >= 5x fewer uplink bits
and P-ELF >= 5x fewer downlink bits.

Usage::

    python examples/elf_logistic.py              # default (< 10 min on 2 CPU cores)
    python examples/elf_logistic.py --paper      # + all of the paper's tau values, longer runs
    python examples/elf_logistic.py --smoke      # seconds
"""

from __future__ import annotations

import argparse
import shutil
import time
from pathlib import Path

import numpy as np

PAPER_TAUS = (1, 5, 10, 50, 100)
DATASETS = {"breast_cancer": (1, 3), "caravan": (1, 5, 8)}


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--datasets", default="breast_cancer,caravan")
    p.add_argument("--targets", default="tempered,posterior")
    p.add_argument("--tempered-steps", default="0.01,0.1,0.5", help="paper's step sizes")
    p.add_argument("--lam", type=float, default=1.0, help="lambda of the tempered target")
    p.add_argument("--c", type=float, default=0.5, help="posterior step size gamma = c / L")
    p.add_argument("--num-steps", type=int, default=1000, help="iterations (tempered)")
    p.add_argument("--num-steps-posterior", type=int, default=2000, help="iterations (posterior)")
    p.add_argument("--chains", type=int, default=2, help="vectorized chains per run")
    p.add_argument("--clients", type=int, default=40)
    p.add_argument("--paper", action="store_true", help="all tau values {1,5,10,50,100} <= d")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="out/elf_logistic")
    p.add_argument("--smoke", action="store_true", help="tiny settings (tests)")
    args = p.parse_args(argv)
    if args.smoke:
        args.datasets = "breast_cancer"
        args.targets = "tempered"
        args.tempered_steps = "0.1"
        args.num_steps = args.num_steps_posterior = 120
        args.chains = 1
        args.clients = 10
    return args


def k_values(dataset: str, d: int, paper: bool, smoke: bool) -> list[int]:
    """Top-k levels: the issue's k values, k = d/2 and (``--paper``) the paper's tau <= d."""
    if smoke:
        return [1]
    ks = set(DATASETS[dataset]) | {d // 2}
    if paper:
        ks |= {t for t in PAPER_TAUS if t <= d}
    return sorted(ks)


def load(dataset: str):
    from numpyro_fed.examples import load_breast_cancer, load_caravan

    loader = {"breast_cancer": load_breast_cancer, "caravan": load_caravan}[dataset]
    return loader(dtype=np.float32)


def log_sigmoid(z):
    return -np.logaddexp(0.0, -z)


def predictive_metrics(W, X, y):
    """Accuracy and mean log predictive density of the Bayes average over draws ``W``
    (S, d) (S = 1: a point estimate)."""
    z = X @ W.T  # (n, S)
    logp1 = log_sigmoid(z)
    logp0 = log_sigmoid(-z)
    lp = np.where(y[:, None] == 1, logp1, logp0)
    lpd = np.logaddexp.reduce(lp, axis=1) - np.log(W.shape[0])
    p1 = np.exp(np.logaddexp.reduce(logp1, axis=1) - np.log(W.shape[0]))
    acc = np.mean((p1 > 0.5) == (y == 1))
    return float(acc), float(np.mean(lpd))


def run_one(kernel, num_steps, chains, seed):
    from jax import random
    from numpyro.infer import MCMC

    from numpyro_fed import counter_value

    mcmc = MCMC(
        kernel, num_warmup=0, num_samples=num_steps, num_chains=chains,
        chain_method="vectorized", progress_bar=False,
    )
    mcmc.run(random.key(seed), init_params={"w": np.zeros((chains, kernel.potential.dim))})
    w = np.asarray(mcmc.get_samples(group_by_chain=True)["w"], np.float64)
    ex = mcmc.get_extra_fields(group_by_chain=True)
    up = np.asarray(ex["bits"], np.int64)[0, :, 0]  # chain 0; bits are (up, down)
    down = np.asarray(ex["bits"], np.int64)[0, :, 1]
    tot_up = int(np.ravel(counter_value(mcmc.last_state.total_up))[0])
    tot_down = int(np.ravel(counter_value(mcmc.last_state.total_down))[0])
    cum_up = tot_up - up.sum() + np.cumsum(up)  # one-off rounds at init, then per step
    cum_down = tot_down - down.sum() + np.cumsum(down)
    return w, cum_up, cum_down


def evaluate(w, cum_up, cum_down, X_te, y_te, num_points=10):
    """Final metrics and a bits-vs-accuracy curve of the average of the last 100 iterates."""
    chains, n, _ = w.shape
    last = min(100, n)
    accs, lpds = zip(*(predictive_metrics(w[c, -last:].mean(0)[None], X_te, y_te)
                       for c in range(chains)), strict=True)
    draws = w[:, n // 2:].reshape(-1, w.shape[-1])
    draws = draws[:: max(1, draws.shape[0] // 1000)]
    acc_pp, lpd_pp = predictive_metrics(draws, X_te, y_te)
    curve = []
    for t in np.linspace(last, n, num_points).astype(int):
        a = np.mean([predictive_metrics(w[c, t - last:t].mean(0)[None], X_te, y_te)[0]
                     for c in range(chains)])
        curve.append((int(cum_up[t - 1] + cum_down[t - 1]), float(a)))
    return {
        "acc_avg": float(np.mean(accs)), "lpd_avg": float(np.mean(lpds)),
        "acc_pp": acc_pp, "lpd_pp": lpd_pp,
        "bits_up": int(cum_up[-1]), "bits_down": int(cum_down[-1]),
        "bits_total": int(cum_up[-1] + cum_down[-1]), "curve": curve,
        "w_max": float(np.abs(w[:, -last:]).max()),
    }


def experiment(dataset, target, step, args, log):
    from jax import random

    from numpyro_fed import ClientPartition, FederatedLangevin, compressors
    from numpyro_fed.examples import logistic_regression
    from numpyro_fed.kernels.elf import BELF, DELF, PELF

    X, X_te, y, y_te = load(dataset)
    d = X.shape[1]
    part = ClientPartition.iid({"X": X, "y": y}, args.clients, key=random.key(args.seed))
    if target == "tempered":
        prior_scale = 1.0 / np.sqrt(args.lam)
        lw = 1.0 / (args.clients * part.sizes_np)
        gamma, num_steps = step, args.num_steps
    else:
        prior_scale, lw = 1.0, 1.0
        L = 0.25 * np.linalg.norm(X.astype(np.float64), 2) ** 2 + 1.0 / prior_scale**2
        gamma, num_steps = args.c / L, args.num_steps_posterior
    part = ClientPartition.from_clients(
        [part.client(i) for i in range(part.num_clients)], shared={"prior_scale": prior_scale}
    )
    common = dict(step_size=gamma, likelihood_weight=lw, prior="split",
                  postprocess_deterministic=False)
    methods = [("LMC", "-", lambda: FederatedLangevin(logistic_regression, part, **common))]
    for k in k_values(dataset, d, args.paper, args.smoke):
        top = compressors.top_k(k)
        methods += [
            ("D-ELF", k, lambda top=top: DELF(logistic_regression, part, uplink=top, **common)),
            ("P-ELF", k, lambda top=top: PELF(logistic_regression, part, downlink=top, **common)),
            ("B-ELF", k, lambda top=top: BELF(logistic_regression, part, uplink=top,
                                              downlink=top, **common)),
        ]
    rows = []
    for name, k, make in methods:
        t0 = time.perf_counter()
        row = {"dataset": dataset, "d": d, "target": target, "step_size": gamma,
               "method": name, "k": k}
        try:
            w, cu, cd = run_one(make(), num_steps, args.chains, args.seed + 1)
            if not np.all(np.isfinite(w)):
                raise FloatingPointError("non-finite draws")
            row.update(evaluate(w, cu, cd, X_te, y_te))
        except Exception as err:  # a diverging chain (e.g. step 0.5) is reported, not fatal
            if "non-finite" not in str(err) and "Divergence" not in type(err).__name__:
                raise
            row.update({"acc_avg": np.nan, "lpd_avg": np.nan, "acc_pp": np.nan,
                        "lpd_pp": np.nan, "bits_up": 0, "bits_down": 0, "bits_total": 0,
                        "curve": [], "w_max": np.inf})
        row["seconds"] = time.perf_counter() - t0
        log(f"  {dataset:13s} {target:9s} gamma={gamma:.3g} {name:5s} k={k!s:3s} "
            f"acc={row['acc_avg']:.3f} lpd={row['lpd_avg']:.4f} "
            f"acc_pp={row['acc_pp']:.3f} lpd_pp={row['lpd_pp']:.4f} "
            f"bits={row['bits_total']:.3e} ({row['seconds']:.1f}s)")
        rows.append(row)
    return rows


def add_comparisons(df):
    """Differences to LMC of the same (dataset, target, step) and the issue's targets."""
    import pandas as pd

    out = []
    for _, grp in df.groupby(["dataset", "target", "step_size"], sort=False):
        ref = grp[grp.method == "LMC"].iloc[0]
        g = grp.copy()
        g["d_acc_pp"] = 100 * (g.acc_avg - ref.acc_avg)
        g["d_lpd_pct"] = 100 * (g.lpd_avg - ref.lpd_avg) / abs(ref.lpd_avg)
        g["d_acc_pp_pred"] = 100 * (g.acc_pp - ref.acc_pp)
        g["d_lpd_pct_pred"] = 100 * (g.lpd_pp - ref.lpd_pp) / abs(ref.lpd_pp)
        direction = {"D-ELF": "bits_up", "P-ELF": "bits_down", "B-ELF": "bits_total",
                     "LMC": "bits_total"}
        g["saving"] = [ref[direction[m]] / max(r[direction[m]], 1) for m, (_, r) in
                       zip(g.method, g.iterrows(), strict=True)]
        small_k = [(m != "LMC") and (int(k) <= r.d / 10) for m, k, (_, r) in
                   zip(g.method, g.k, g.iterrows(), strict=True)]
        quality = (g.d_acc_pp.abs() <= 1.0) & (g.d_lpd_pct.abs() <= 2.0)
        g["quality_ok"] = np.where(g.method == "LMC", "", np.where(quality, "yes", "no"))
        g["bits_ok"] = np.where(small_k, np.where(g.saving >= 5, "yes", "no"), "")
        out.append(g)
    return pd.concat(out)


def markdown_table(df) -> str:
    cols = ["dataset", "target", "step_size", "method", "k", "acc_avg", "d_acc_pp", "lpd_avg",
            "d_lpd_pct", "acc_pp", "lpd_pp", "bits_up", "bits_down", "bits_total", "saving",
            "quality_ok", "bits_ok", "w_max"]
    head = ["dataset", "target", "gamma", "method", "k", "acc (avg last 100)", "Δacc (pp)",
            "LPD (avg last 100)", "ΔLPD (%)", "acc (post. pred.)", "LPD (post. pred.)",
            "bits up", "bits down", "bits total", "saving (own dir.)", "≤1pp & ≤2%",
            "≥5x (k≤d/10)", "stability"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for _, r in df[cols].iterrows():
        cells = []
        for c in cols:
            v = r[c]
            if c == "step_size":
                cells.append(f"{v:.3g}")
            elif c in ("acc_avg", "acc_pp"):
                cells.append(f"{v:.3f}")
            elif c in ("lpd_avg", "lpd_pp"):
                cells.append(f"{v:.4f}" if abs(v) < 1e3 else f"{v:.2g}")
            elif c in ("d_acc_pp", "d_lpd_pct"):
                cells.append("" if r.method == "LMC" else
                             (f"{v:+.2f}" if abs(v) < 1e3 else f"{v:+.2g}"))
            elif c == "w_max":
                cells.append("" if v < 1e3 else "unstable")
            elif c.startswith("bits_") and c not in ("bits_ok",):
                cells.append(f"{v:.3e}")
            elif c == "saving":
                cells.append("" if r.method == "LMC" else f"{v:.1f}x")
            else:
                cells.append(str(v))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def plot(df, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = list(df.groupby(["dataset", "target", "step_size"], sort=False))
    ncol = min(4, len(panels))
    nrow = int(np.ceil(len(panels) / ncol))
    fig, axes = plt.subplots(nrow, ncol, figsize=(4.2 * ncol, 3.3 * nrow), squeeze=False)
    colors = {"LMC": "k", "D-ELF": "tab:blue", "P-ELF": "tab:orange", "B-ELF": "tab:green"}
    for ax, ((ds, tg, st), g) in zip(axes.flat, panels, strict=False):
        ks = sorted({int(k) for k in g.k if k != "-"})
        shown = {ks[0], ks[-1]} if ks else set()
        for _, r in g.iterrows():
            if not r.curve or (r.method != "LMC" and int(r.k) not in shown):
                continue
            bits, acc = zip(*r.curve, strict=True)
            style = "-" if r.method == "LMC" or int(r.k) == ks[0] else "--"
            label = r.method if r.method == "LMC" else f"{r.method} k={r.k}"
            ax.plot(bits, acc, style, color=colors[r.method], label=label, lw=1.3)
        ax.set_xscale("log")
        ax.set_title(f"{ds}, {tg}, γ={st:.3g}", fontsize=9)
        ax.set_xlabel("bits communicated (up + down)")
        ax.set_ylabel("test accuracy (avg last 100)")
        ax.legend(fontsize=6)
    for ax in axes.flat[len(panels):]:
        ax.axis("off")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None):
    """Run the experiment; write ``elf_logistic.{png,csv,md}`` to ``--out`` and (full runs)
    copy the table to ``examples/results/elf_logistic.md``. Returns the table (DataFrame)."""
    import pandas as pd

    args = parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    rows = []
    for dataset in args.datasets.split(","):
        for target in args.targets.split(","):
            steps = [float(s) for s in args.tempered_steps.split(",")] if target == "tempered" \
                else [None]
            for step in steps:
                rows += experiment(dataset, target, step, args, print)
    df = add_comparisons(pd.DataFrame(rows))
    df.drop(columns=["curve"]).to_csv(out / "elf_logistic.csv", index=False)
    plot(df, out / "elf_logistic.png")
    elapsed = time.perf_counter() - t0
    settings = (
        f"{args.clients} clients, {args.chains} chains, {args.num_steps} iterations (tempered, "
        f"lambda={args.lam:g}), {args.num_steps_posterior} iterations (posterior, gamma = "
        f"{args.c:g}/L), x_0 = 0, Top-k compressors; {elapsed:.0f} s."
    )
    md = (f"# ELF: federated logistic regression ({settings})\n\n"
          "Δ = difference to LMC at the same step size; saving = LMC bits / method bits in the "
          "direction the method compresses (D: up, P: down, B: total); 'unstable': the chain "
          "left the bulk of the target (max |x| > 1e3 over the last 100 iterates).\n\n"
          + markdown_table(df))
    (out / "elf_logistic.md").write_text(md)
    if not args.smoke:
        results = Path(__file__).resolve().parent / "results"
        results.mkdir(exist_ok=True)
        shutil.copy(out / "elf_logistic.md", results / "elf_logistic.md")
    print(md)
    print(f"wrote {out}/elf_logistic.{{png,csv,md}} in {elapsed:.0f} s")
    return df


if __name__ == "__main__":
    main()
