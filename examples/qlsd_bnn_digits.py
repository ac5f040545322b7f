"""QLSD paper, Sec. 4 "Bayesian neural networks" (Fig. 2, right), at a size a CPU can run.

The paper trains a 784-128-10 sigmoid MLP on MNIST (b = 100 clients) and uses FASHION-MNIST as
out-of-distribution inputs. Here: scikit-learn's 8x8 digits, an MLP 64 -> H (sigmoid) -> 5
(softmax) trained on digits 0-4, with digits 5-9 as out-of-distribution inputs; prior
N(0, 5e-2 I) (the paper's), b = 10 clients (uniform split), n = N_i / 7.5, gamma = 1e-4.
QLSD# with s in {2, 4} levels vs its uncompressed counterpart LSD#.

Outputs: test accuracy on the images whose posterior predictive probability of the predicted
label (argmax of the posterior predictive) is at least tau, against tau; the bits saved per
round; and a kernel density estimate of the log predictive confidence on in-distribution (0-4)
and out-of-distribution (5-9) test images.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax
import jax.numpy as jnp
import matplotlib.pyplot as plt
import numpy as np
import numpyro
import numpyro.distributions as dist
import pandas as pd
from _qlsd_common import parser, run_chains, write_outputs
from jax import random
from scipy.stats import gaussian_kde

from numpyro_fed import ClientPartition
from numpyro_fed.examples import load_digits
from numpyro_fed.kernels.qlsd import LSD, QLSD

NAME = "qlsd_bnn_digits"
PRIOR_SCALE = float(np.sqrt(5e-2))


def mlp_model(X, y=None, hidden=32, num_classes=5, prior_scale=PRIOR_SCALE):
    """One-hidden-layer sigmoid MLP classifier (the paper's architecture, smaller)."""
    d = X.shape[-1]
    prior = dist.Normal(0.0, prior_scale)
    W1 = numpyro.sample("W1", prior.expand([d, hidden]).to_event(2))
    a1 = numpyro.sample("a1", prior.expand([hidden]).to_event(1))
    W2 = numpyro.sample("W2", prior.expand([hidden, num_classes]).to_event(2))
    a2 = numpyro.sample("a2", prior.expand([num_classes]).to_event(1))
    logits = jax.nn.sigmoid(X @ W1 + a1) @ W2 + a2
    with numpyro.plate("data", X.shape[0]):
        numpyro.sample("y", dist.Categorical(logits=logits), obs=y)


@jax.jit
def predictive(samples, X):
    """Posterior predictive class probabilities, averaged over draws."""

    def one(W1, a1, W2, a2):
        return jax.nn.softmax(jax.nn.sigmoid(X @ W1 + a1) @ W2 + a2, axis=-1)

    return jax.vmap(one)(samples["W1"], samples["a1"], samples["W2"], samples["a2"]).mean(0)


def main(argv: list[str] | None = None) -> pd.DataFrame:
    p = parser(NAME, __doc__)
    p.add_argument("--clients", type=int, default=10)
    p.add_argument("--hidden", type=int, default=32)
    p.add_argument("--warmup", type=int, default=5000)
    p.add_argument("--steps", type=int, default=10_000)
    p.add_argument("--chains", type=int, default=4)
    p.add_argument("--step-size", type=float, default=1e-4)
    p.add_argument("--levels", type=int, nargs="+", default=[2, 4])
    p.add_argument("--thin", type=int, default=20)
    args = p.parse_args(argv)
    if args.smoke:
        args.clients, args.hidden, args.warmup, args.steps, args.chains = 3, 4, 20, 40, 2
        args.levels, args.thin = [2], 4
    X_in, X_te, y_in, y_te = load_digits(classes=[0, 1, 2, 3, 4], seed=args.seed)
    _, X_ood, _, _ = load_digits(classes=[5, 6, 7, 8, 9], seed=args.seed)
    part = ClientPartition.iid({"X": X_in, "y": y_in}, args.clients,
                               key=random.PRNGKey(args.seed), shared={"hidden": args.hidden})
    batch = max(1, int(part.sizes_np.min() / 7.5))
    taus = np.round(np.linspace(0.0, 0.95, 20), 3)
    rows, curves, confidences = [], {}, {}
    configs = [("LSD#", None)] + [(f"QLSD# s={s}", s) for s in args.levels]
    for label, s in configs:
        kw = dict(variant="#", step_size=args.step_size, batch_size=batch)
        kern = (LSD(mlp_model, part, **kw) if s is None
                else QLSD(mlp_model, part, levels=s, **kw))
        _, up, mcmc, wall = run_chains(kern, args.steps, args.chains, args.seed,
                                       num_warmup=args.warmup)
        samples = {k: v[:: args.thin] for k, v in mcmc.get_samples().items()}
        p_in = np.asarray(predictive(samples, jnp.asarray(X_te)))
        p_ood = np.asarray(predictive(samples, jnp.asarray(X_ood)))
        pred, conf = p_in.argmax(-1), p_in.max(-1)
        acc = [float((pred[conf >= t] == y_te[conf >= t]).mean()) if np.any(conf >= t)
               else np.nan for t in taus]
        curves[label] = acc
        confidences[label] = (np.log(conf), np.log(p_ood.max(-1)))
        rows.append({"algorithm": label, "test accuracy": float((pred == y_te).mean()),
                     "accuracy at tau=0.9": acc[int(np.argmin(np.abs(taus - 0.9)))],
                     "mean log conf. (in)": float(np.log(conf).mean()),
                     "mean log conf. (OOD)": float(np.log(p_ood.max(-1)).mean()),
                     "uplink kbit/round": float(up.mean() / 1e3), "wall s": wall})
    df = pd.DataFrame(rows)
    lsd_bits = df.loc[0, "uplink kbit/round"]
    df["bits saved (x)"] = lsd_bits / df["uplink kbit/round"]

    fig, ax = plt.subplots(1, 2, figsize=(11, 4))
    for label, acc in curves.items():
        ax[0].plot(taus, acc, "o-", ms=3, label=label)
    ax[0].set(xlabel="credibility threshold tau", ylabel="test accuracy on D_pred(tau)")
    ax[0].legend()
    grid = np.linspace(-1.7, 0.0, 200)
    for (label, (c_in, c_ood)), col in zip(confidences.items(), ["C0", "C1", "C2", "C3"],
                                           strict=False):
        for vals, ls, name in ((c_in, "-", "digits 0-4"), (c_ood, "--", "digits 5-9 (OOD)")):
            if np.ptp(vals) > 0:
                ax[1].plot(grid, gaussian_kde(vals)(grid), ls, color=col, label=f"{label}, {name}")
    ax[1].set(xlabel="log predictive confidence", ylabel="density")
    ax[1].legend(fontsize=7)
    d = kern.potential.dim
    notes = (f"MLP 64-{args.hidden}-5 (d={d}), b={args.clients}, N={part.total_size}, "
             f"n={batch}, gamma={args.step_size}, {args.chains} chains x ({args.warmup} warmup + "
             f"{args.steps}) steps, every {args.thin}th draw kept; {len(y_te)} in-distribution "
             f"and {len(X_ood)} out-of-distribution test images.")
    write_outputs(args, NAME, df, fig, "Bayesian MLP on digits with QLSD# (Fig. 2, right)",
                  notes)
    return df


if __name__ == "__main__":
    main()
