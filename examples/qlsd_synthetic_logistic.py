"""QLSD paper, Sec. 4 "Bayesian logistic regression, synthetic data" (Fig. 1, bottom row).

Data: FedProx's SYNTHETIC(alpha=1, beta=1) generator (Li et al., 2020, Sec. 5.1) in its binary,
2-feature form, as implemented by
``numpyro_fed.examples.synthetic_fedprox(1, 1, 50, dim=2, num_classes=2)``:
client k has its own model W_k, b_k ~ N(u_k, 1), u_k ~ N(0, 1), inputs x ~ N(v_k, diag(j^-1.2)),
v_k ~ N(B_k, 1), B_k ~ N(0, 1), labels argmax(W_k x + b_k); client sizes follow FedProx's
lognormal power law (50 to 2000 rows). b = 50 clients, logistic regression without intercept
(d = 2), prior N(0, 2e-2 I). QLSD++ with l = 100, gamma = 1e-5, s in {2, 4}, with memory
(alpha = 1/(omega + 1)) and without (alpha = 0); the Euclidean norm of the error of the
posterior variance (running estimate) against a long MALA ground truth on the pooled data.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
from _qlsd_common import parser, run_chains, write_outputs
from jax import random
from numpyro.infer import MCMC

from numpyro_fed import MALA, ClientPartition
from numpyro_fed.examples import logistic_regression, synthetic_fedprox
from numpyro_fed.kernels.qlsd import QLSD

NAME = "qlsd_synthetic_logistic"
PRIOR_SCALE = float(np.sqrt(2e-2))


def main(argv: list[str] | None = None) -> pd.DataFrame:
    p = parser(NAME, __doc__)
    p.add_argument("--clients", type=int, default=50)
    p.add_argument("--steps", type=int, default=20_000)
    p.add_argument("--chains", type=int, default=4)
    p.add_argument("--step-size", type=float, default=1e-5)
    p.add_argument("--batch-size", type=int, default=10)
    p.add_argument("--refresh-every", type=int, default=100)
    p.add_argument("--levels", type=int, nargs="+", default=[2, 4])
    p.add_argument("--mala-samples", type=int, default=20_000)
    p.add_argument("--mala-warmup", type=int, default=2000)
    args = p.parse_args(argv)
    if args.smoke:
        args.clients, args.steps, args.chains, args.mala_samples = 5, 200, 2, 300
        args.mala_warmup = 200
        args.levels = [2]
    clients = synthetic_fedprox(1.0, 1.0, args.clients, dim=2, num_classes=2, seed=args.seed)
    part = ClientPartition.from_clients([{"X": X, "y": y} for X, y in clients],
                                        shared={"prior_scale": PRIOR_SCALE})
    pooled = part.pooled()

    mala = MCMC(MALA(logistic_regression, step_size=1e-4), num_warmup=args.mala_warmup,
                num_samples=args.mala_samples, num_chains=4, chain_method="vectorized",
                progress_bar=False)
    mala.run(random.PRNGKey(args.seed + 100), X=pooled["X"], y=pooled["y"],
             prior_scale=PRIOR_SCALE)
    w_mala = np.asarray(mala.get_samples()["w"], np.float64)
    var_true = w_mala.var(0)

    burn = args.steps // 10
    rows, curves = [], {}
    for s in args.levels:
        for memory in (True, False):
            kern = QLSD(logistic_regression, part, variant="++", step_size=args.step_size,
                        batch_size=args.batch_size, levels=s,
                        memory_rate=None if memory else 0.0, refresh_every=args.refresh_every)
            theta, up, mcmc, wall = run_chains(kern, args.steps, args.chains, args.seed)
            th = theta[:, burn:]
            k = np.arange(1, th.shape[1] + 1)
            m1 = np.cumsum(th, 1).mean(0) / k[:, None]
            m2 = np.cumsum(th**2, 1).mean(0) / k[:, None]
            err = np.linalg.norm(m2 - m1**2 - var_true, axis=-1)
            label = f"QLSD++ s={s} " + ("with memory" if memory else "no memory")
            curves[label] = err
            rows.append({"algorithm": label, "s": s, "alpha": kern.memory_rate,
                         "omega": kern.omega, "final variance error": float(err[-1]),
                         "relative variance error": float(err[-1] / np.linalg.norm(var_true)),
                         "uplink kbit/round": float(up.mean() / 1e3), "wall s": wall})
    df = pd.DataFrame(rows)
    fig, ax = plt.subplots(figsize=(6, 4))
    for label, err in curves.items():
        ax.loglog(np.arange(1, len(err) + 1) + burn, err, label=label)
    ax.set(xlabel="iterations", ylabel="||var_QLSD++ - var_MALA||")
    ax.legend()
    notes = (f"b={args.clients}, N={part.total_size}, d=2, gamma={args.step_size}, "
             f"n={args.batch_size}, l={args.refresh_every}, {args.chains} chains x {args.steps} "
             f"steps (first {burn} discarded); MALA ground truth: 4 x {args.mala_samples} draws, "
             f"posterior variances {np.array2string(var_true, precision=4)}.")
    write_outputs(args, NAME, df, fig, "QLSD++ with and without memory, SYNTHETIC(1,1) "
                  "(Fig. 1, bottom)", notes)
    return df


if __name__ == "__main__":
    main()
