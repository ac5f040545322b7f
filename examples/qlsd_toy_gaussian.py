"""QLSD paper, Sec. 4 "Toy Gaussian example" (Fig. 1, top row and bottom right).

b = 20 clients, d = 50, N = 200 observations per client, y_ij ~ N(mu_i, I_d) with
client-specific means mu_i ~ N(0, I_d) (independent, not identically distributed), U_i(theta) =
sum_j ||theta - y_ij||^2 / 2 plus a weak N(0, 10^2 I) prior split across clients, gamma = 4.9e-4,
n = N/10. Test function f(theta) = ||theta||; the MSE of the running average of f over R = 30
independent runs, against the exact E_pi[f] (pi is Gaussian: 10^6 exact draws), is plotted
against communication rounds and against uplink bits (Elias-coded quantised messages, see
numpyro_fed.compressors.quantize), for QLSD# and QLSD* at 4 and 16 bits (s = 2^4, 2^16) and
LSD*. Bottom right: bits saved by QLSD* (s = 2^16) w.r.t. LSD* to reach the same MSE
(1.1 x LSD*'s final MSE) as the step size decreases.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import matplotlib.pyplot as plt
import numpy as np
import numpyro
import numpyro.distributions as dist
import pandas as pd
from _qlsd_common import parser, run_chains, write_outputs

from numpyro_fed import ClientPartition
from numpyro_fed.kernels.qlsd import LSD, QLSD

NAME = "qlsd_toy_gaussian"


def gauss_model(y, prior_scale=10.0):
    theta = numpyro.sample("theta", dist.Normal(0.0, prior_scale).expand([y.shape[-1]]).to_event(1))
    with numpyro.plate("data", y.shape[0]):
        numpyro.sample("y", dist.Normal(theta, 1.0).to_event(1), obs=y)


def make_data(b, d, n, seed):
    rng = np.random.default_rng(seed)
    mus = rng.normal(0.0, 1.0, (b, d))
    ys = [(mus[i] + rng.normal(size=(n, d))).astype(np.float32) for i in range(b)]
    part = ClientPartition.from_clients([{"y": y} for y in ys])
    pooled = np.concatenate(ys).astype(np.float64)
    a = len(pooled) + 1.0 / 10.0**2
    mean = pooled.sum(0) / a
    exact = rng.normal(size=(1_000_000, d)) / np.sqrt(a) + mean
    return part, mean, float(np.linalg.norm(exact, axis=1).mean())


def mse_curve(theta, truth):
    f = np.linalg.norm(theta, axis=-1)  # (runs, steps)
    running = np.cumsum(f, axis=1) / np.arange(1, f.shape[1] + 1)
    return ((running - truth) ** 2).mean(0)


def main(argv: list[str] | None = None) -> pd.DataFrame:
    p = parser(NAME, __doc__)
    p.add_argument("--clients", type=int, default=20)
    p.add_argument("--dim", type=int, default=50)
    p.add_argument("--n-per-client", type=int, default=200)
    p.add_argument("--steps", type=int, default=3000)
    p.add_argument("--runs", type=int, default=30)
    p.add_argument("--step-size", type=float, default=4.9e-4)
    p.add_argument("--gammas", type=float, nargs="+", default=[4.9e-4, 2.5e-4, 1e-4])
    args = p.parse_args(argv)
    if args.smoke:
        args.clients, args.dim, args.n_per_client, args.steps, args.runs = 4, 5, 20, 60, 3
        args.gammas = []
    b, d, n = args.clients, args.dim, args.n_per_client
    part, mean, truth = make_data(b, d, n, args.seed)
    batch = max(1, n // 10)
    init = {"theta": np.zeros((args.runs, d), np.float32)}  # theta_0 = 0 for every run
    configs = [("QLSD# 4 bits", "#", 4), ("QLSD# 16 bits", "#", 16), ("QLSD* 4 bits", "*", 4),
               ("QLSD* 16 bits", "*", 16), ("LSD*", "*", None)]
    if args.smoke:
        configs = [configs[2], configs[4]]
    rows, curves = [], {}
    for label, variant, bits in configs:
        kw = dict(variant=variant, step_size=args.step_size, batch_size=batch)
        kern = LSD(gauss_model, part, **kw) if bits is None else QLSD(gauss_model, part,
                                                                       bits=bits, **kw)
        theta, up, mcmc, wall = run_chains(kern, args.steps, args.runs, args.seed, init_params=init)
        mse = mse_curve(theta, truth)
        cum_bits = np.cumsum(up.mean(0))
        curves[label] = (mse, cum_bits)
        rows.append({"algorithm": label, "s": "-" if bits is None else f"2^{bits}",
                     "final MSE": float(mse[-1]), "uplink kbit/round": float(up.mean() / 1e3),
                     "nominal kbit/round": float(b * kern.compressor.nominal_bits(d) / 1e3),
                     "theta* search rounds": (kern.theta_star_search.rounds
                                              if kern.theta_star_search else 0),
                     "wall s": wall})

    # bits saved by QLSD* (16 bits) vs LSD* as gamma decreases
    saved = []
    for gamma in args.gammas:
        res = {}
        for label, bits in (("LSD*", None), ("QLSD*", 16)):
            kw = dict(variant="*", step_size=gamma, batch_size=batch)
            kern = LSD(gauss_model, part, **kw) if bits is None else QLSD(gauss_model, part,
                                                                           bits=bits, **kw)
            theta, up, _, _ = run_chains(kern, args.steps, args.runs, args.seed + 1,
                                         init_params=init)
            res[label] = (mse_curve(theta, truth), np.cumsum(up.mean(0)))
        target = 1.1 * res["LSD*"][0][-1]

        def bits_to(label, target=target, res=res):
            mse, cb = res[label]
            above = np.flatnonzero(mse > target)  # the MSE stays below target afterwards
            first = 0 if above.size == 0 else above[-1] + 1
            return float(cb[first]) if first < len(cb) else np.nan

        saved.append({"gamma": gamma, "LSD* bits": bits_to("LSD*"),
                      "QLSD* bits": bits_to("QLSD*")})
        saved[-1]["saving"] = saved[-1]["LSD* bits"] / saved[-1]["QLSD* bits"]
        # the same with fixed-width (nominal) QSGD messages instead of the Elias code
        nominal = b * QLSD(gauss_model, part, bits=16, step_size=gamma).compressor.nominal_bits(d)
        saved[-1]["saving (nominal bits)"] = saved[-1]["saving"] * (
            res["QLSD*"][1][-1] / len(res["QLSD*"][1]) / nominal)
    df = pd.DataFrame(rows)
    sv = pd.DataFrame(saved, columns=["gamma", "LSD* bits", "QLSD* bits", "saving",
                                      "saving (nominal bits)"])

    fig, ax = plt.subplots(1, 3, figsize=(15, 4))
    for label, (mse, cb) in curves.items():
        ax[0].loglog(np.arange(1, len(mse) + 1), mse, label=label)
        ax[1].loglog(cb, mse, label=label)
    ax[0].set(xlabel="communication rounds", ylabel="MSE of running mean of ||theta||")
    ax[1].set(xlabel="uplink bits (Elias-coded)", ylabel="MSE")
    ax[0].legend()
    ax[2].semilogx(sv["gamma"], sv["saving"], "o-")
    ax[2].set(xlabel="step size gamma", ylabel="bits saved by QLSD* (2^16) vs LSD*")
    notes = (f"b={b}, d={d}, N={n}/client, n={batch}, gamma={args.step_size}, {args.runs} runs x "
             f"{args.steps} rounds from theta_0 = 0; E[||theta||]={truth:.5f}.\n\n"
             "Bits saved by QLSD* (s=2^16) vs LSD* to reach (and stay below) 1.1 x LSD*'s final "
             "MSE; 'saving' counts Elias-coded messages, 'saving (nominal bits)' fixed-width "
             "QSGD messages (32 + d(1 + ceil(log2(s+1))) bits):\n\n")
    from _qlsd_common import markdown_table
    notes += markdown_table(sv)
    write_outputs(args, NAME, df, fig, "QLSD toy Gaussian (Fig. 1, top row)", notes)
    return df


if __name__ == "__main__":
    main()
