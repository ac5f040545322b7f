"""SAEM's defaults on the normal-normal model over many seeds (issue 28: boundary fits and
variances that must not collapse): 30 subjects, one observation each, y ~ N(0, 1), so that
the maximum-likelihood omega is 0 on about half of the seeds and interior on the others.

    y_i = mu + omega * b_i + e_i,  b_i, e_i ~ N(0, 1)  =>  y_i ~ N(mu, 1 + omega^2)

The exact maximum is closed form (mu = mean(y), omega^2 = max(var(y) - 1, 0)); each fit is
judged by the exact -2LL at its estimates minus that maximum, and by what it said: reported
singular (``SingularFitWarning``), warned (a ``ConvergenceWarning``), or silent.

Usage: ``python benchmarks/saem_normal_normal_seeds.py [--seeds N]`` (default 40, about a
minute on 2 cores); prints a markdown table and a summary (nothing is written).
"""

from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def normal_normal(y):
    import numpyro
    import numpyro.distributions as dist
    from numpyro.distributions import constraints

    mu = numpyro.param("mu", 0.0)
    omega = numpyro.param("omega", 1.0, constraint=constraints.positive)
    with numpyro.plate("subject", y.shape[0]):
        b = numpyro.sample("b", dist.Normal(mu, omega))
        numpyro.sample("y", dist.Normal(b, 1.0), obs=y)


def m2ll(y, mu, omega):
    v = 1.0 + np.float64(omega) ** 2
    y = np.asarray(y, np.float64)
    return float(np.sum(np.log(2 * np.pi * v) + (y - mu) ** 2 / v))


def main(argv: list[str] | None = None) -> str:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--seeds", type=int, default=40)
    a = ap.parse_args(argv)
    from jax import random

    from numpyro_fed import ConvergenceWarning, SingularFitWarning
    from numpyro_fed.saem import SAEM

    rows, summary = [], {"interior": [], "boundary": []}
    for seed in range(a.seeds):
        y = np.random.default_rng(seed).normal(0, 1, 30).astype(np.float32)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            res = SAEM(normal_normal).run(random.key(seed), y=y)
        y64 = y.astype(np.float64)
        om_hat = float(np.sqrt(max(y64.var() - 1.0, 0.0)))
        gap = m2ll(y, float(res.params["mu"]), float(res.params["omega"])) - m2ll(
            y, y64.mean(), om_hat)
        cats = [w.category for w in caught if issubclass(w.category, ConvergenceWarning)]
        said = ("singular" if res.singular or SingularFitWarning in cats
                else "warned" if cats else "silent")
        kind = "boundary" if om_hat == 0.0 else "interior"
        summary[kind].append((gap, said))
        rows.append(f"| {seed} | {om_hat:.3f} | {float(res.params['omega']):.4f} | {gap:.4f} | "
                    f"{said} |")
    lines = ["| seed | exact omega | SAEM omega | -2LL gap | said |", "|---|---|---|---|---|",
             *rows, ""]
    for kind, v in summary.items():
        if not v:
            continue
        g = np.array([x[0] for x in v])
        said = [x[1] for x in v]
        lines.append(
            f"- {kind} maximum ({len(v)} seeds): gap up to {g.max():.3f}, above 0.05 on "
            f"{int(np.sum(g > 0.05))}; " + ", ".join(
                f"{s} {said.count(s)}" for s in ("singular", "warned", "silent"))
            + "; silent with a gap above 0.05: "
            + str(sum(1 for x in v if x[1] == "silent" and x[0] > 0.05)))
    text = "\n".join(lines)
    print(text)
    return text


if __name__ == "__main__":
    main()
