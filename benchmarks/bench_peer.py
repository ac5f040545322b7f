"""Peer comparison: our federated Langevin kernel with one client vs BlackJAX ``sgld``.

Same minibatch Bayesian logistic regression (synthetic, N rows, dimension d, N(0, 1) prior),
same step size, minibatches of ``n`` rows drawn uniformly with replacement by the same index
sampler (:func:`numpyro_fed.potential.batch_indices`):

* ``ours (MCMC loop)`` -- ``FederatedLangevin(model, ClientPartition with 1 client,
  batch_size=n)`` (identity compressor) in NumPyro's own ``MCMC.run`` sampling loop compiled
  once (:func:`_common.mcmc_loop_runner`);
* ``ours (MCMC.run)`` -- whole ``MCMC.run`` calls, compilation excluded by difference
  quotient (see :mod:`_common`);
* ``ours (kernel scan)`` -- the same kernel's ``sample`` in a plain ``lax.scan``;
* ``BlackJAX sgld (model log-density)`` -- ``blackjax.sgld`` with
  ``blackjax.sgmcmc.gradients.grad_estimator`` built from the *same* model-derived prior and
  per-row log-likelihood that our kernel differentiates (``FederatedPotential.log_prior`` /
  ``point_loglik``), in the ``lax.scan`` loop BlackJAX's documentation uses;
* ``BlackJAX sgld (hand-written log-density)`` -- the same with ``log_sigmoid`` written by
  hand, to show what deriving densities from a NumPyro model costs (nothing, once jitted).

Target: ours (MCMC loop) / BlackJAX (model log-density) <= 1.1. Writes
``benchmarks/results/peer.md``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from _common import (  # noqa: E402
    compiled_scan,
    device_name,
    interleaved_min,
    mcmc_candidate,
    mcmc_loop_runner,
    md_table,
    write_result,
)
from bench_overhead import kernel_scan  # noqa: E402
from jax import lax, random  # noqa: E402

from models import logistic_regression  # noqa: E402
from numpyro_fed import ClientPartition  # noqa: E402
from numpyro_fed.kernels.langevin import FederatedLangevin  # noqa: E402
from numpyro_fed.potential import batch_indices  # noqa: E402


def blackjax_runner(pot, X, y, n: int, gamma: float, steps: int, hand: bool):
    """BlackJAX sgld in a ``lax.scan`` (minibatch drawn per step), emitting the positions."""
    import blackjax
    from blackjax.sgmcmc.gradients import grad_estimator

    N = X.shape[0]
    if hand:
        def logprior(w):
            return -0.5 * jnp.sum(w**2)

        def loglik(w, row):
            xb, yb = row
            logit = xb @ w
            return yb * jax.nn.log_sigmoid(logit) + (1 - yb) * jax.nn.log_sigmoid(-logit)
    else:
        def logprior(w):
            return pot.log_prior(w)

        def loglik(w, row):
            return pot.point_loglik(w, {"X": row[0], "y": row[1]})

    sgld = blackjax.sgld(grad_estimator(logprior, loglik, N))
    size = jnp.int32(N)

    def body(carry, _):
        key, w = carry
        key, k_batch, k_step = random.split(key, 3)
        idx = batch_indices(k_batch, size, n, N)
        w = sgld.step(k_step, w, (X[idx], y[idx]), gamma)
        return (key, w), w

    def run(key, w0):
        return lax.scan(body, (key, sgld.init(w0)), None, length=steps)[1]

    return compiled_scan(run, random.PRNGKey(0), jnp.zeros(pot.dim))


def main(argv: list[str] | None = None) -> str:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, default=10_000)
    p.add_argument("--dim", type=int, default=50)
    p.add_argument("--batch", type=int, default=100)
    p.add_argument("--steps", type=int, default=10_000)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    rng = np.random.default_rng(0)
    d, N = args.dim, args.rows
    X = (rng.normal(size=(N, d)) / np.sqrt(d)).astype(np.float32)
    y = (rng.uniform(size=N) < 1 / (1 + np.exp(-X @ rng.normal(size=d)))).astype(np.float32)
    part = ClientPartition.from_clients([{"X": X, "y": y}])
    gamma = 0.1 / N
    kern = FederatedLangevin(logistic_regression, part, step_size=gamma, batch_size=args.batch,
                             postprocess_deterministic=False)
    Xj, yj = jnp.asarray(X), jnp.asarray(y)
    cands = {
        "ours (MCMC loop)": (mcmc_loop_runner(kern, 1, args.steps), args.steps),
        "ours (MCMC.run)": mcmc_candidate(kern, 1, args.steps),
        "ours (kernel scan)": (kernel_scan(kern, args.steps, 1, {}), args.steps),
        "BlackJAX sgld (model log-density)": (
            blackjax_runner(kern.potential, Xj, yj, args.batch, gamma, args.steps, False),
            args.steps),
        "BlackJAX sgld (hand-written log-density)": (
            blackjax_runner(kern.potential, Xj, yj, args.batch, gamma, args.steps, True),
            args.steps),
    }
    t = interleaved_min(cands, args.repeats)
    ref = t["BlackJAX sgld (model log-density)"]
    rows = [[k, 1e6 * v, v / ref] for k, v in t.items()]
    md = (f"### Peer: FederatedLangevin (1 client, identity compressor) vs BlackJAX sgld\n\n"
          f"Logistic regression, N = {N}, d = {d}, minibatch n = {args.batch} (with "
          f"replacement, same index sampler), step {gamma:.2g}, float32, {device_name()}. "
          f"{args.steps} steps, min of {args.repeats} interleaved repeats, compilation "
          "excluded. Target: ours (MCMC loop) / BlackJAX (model log-density) ≤ 1.1.\n\n"
          + md_table(["sampler", "µs/step", "ratio to BlackJAX (model log-density)"], rows))
    print(md)
    write_result("peer", md, args.out)
    return md


if __name__ == "__main__":
    main()
