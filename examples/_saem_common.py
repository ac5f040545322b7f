"""Shared plumbing of the MCMC-SAEM examples: arguments, bootstrap bands, annealed importance
sampling of a NumPyro model's marginal likelihood, and writing tables/figures."""

from __future__ import annotations

import functools
import math
import shutil
from collections.abc import Callable
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import jax
import jax.numpy as jnp
import numpy as np
import pandas as pd
from _example_common import RESULTS, out_dir, parser  # noqa: F401  (re-exported)
from jax import random
from jax.flatten_util import ravel_pytree
from numpyro.handlers import seed, substitute, trace
from numpyro.infer.util import compute_log_probs

from numpyro_fed.kernels.base import DivergenceError
from numpyro_fed.saem import SAEM, Schedule, annealed_importance_sampling

#: Langevin steps per SAEM iteration in the MCMC-SAEM paper (Sec. 5)
PAPER_MCMC_STEPS = 4


def markdown_table(df: pd.DataFrame, floatfmt: str = "{:.4g}") -> str:
    """A GitHub markdown table of ``df`` (floats with ``floatfmt``; NaN as an empty cell)."""
    def fmt(v):
        if isinstance(v, float | np.floating):
            return "" if np.isnan(v) else floatfmt.format(v)
        return str(v)

    head = "| " + " | ".join(map(str, df.columns)) + " |"
    sep = "|" + "|".join("---" for _ in df.columns) + "|"
    rows = ["| " + " | ".join(fmt(v) for v in row) + " |" for row in df.itertuples(index=False)]
    return "\n".join([head, sep, *rows]) + "\n"


def write_outputs(args, name: str, tables: dict[str, pd.DataFrame], fig, header: str,
                  notes: str = "") -> Path:
    """Write ``<name>.png``, one CSV per table (``<name>.csv`` for the first,
    ``<name>_<key>.csv`` for the others) and ``<name>.md`` (all tables) to the output folder,
    and copy the markdown file to ``examples/results/<name>.md`` (not in smoke mode)."""
    import matplotlib.pyplot as plt

    out = out_dir(args, name)
    md = [f"# {header}\n"]
    if notes:
        md.append(notes.strip() + "\n")
    for i, (key, df) in enumerate(tables.items()):
        df.to_csv(out / (f"{name}.csv" if i == 0 else f"{name}_{key}.csv"), index=False)
        if len(tables) > 1:
            md.append(f"## {key}\n")
        md.append(markdown_table(df))
    (out / f"{name}.md").write_text("\n".join(md))
    if fig is not None:
        fig.savefig(out / f"{name}.png", dpi=120, bbox_inches="tight")
        plt.close(fig)
    if not args.smoke and not args.no_results_copy:
        RESULTS.mkdir(exist_ok=True)
        shutil.copy(out / f"{name}.md", RESULTS / f"{name}.md")
    return out


def bootstrap_mean_ci(x, level: float = 0.8, num: int = 2000, seed: int = 0):
    """Mean of ``x`` and the percentile bootstrap interval of the mean (the paper's 80%
    bands, Figs. 2--4). Non-finite entries (diverged runs) make the mean ``-inf``."""
    x = np.asarray(x, np.float64)
    if x.size == 0:
        return np.nan, np.nan, np.nan
    if not np.all(np.isfinite(x)):
        return -np.inf, -np.inf, -np.inf
    rng = np.random.default_rng(seed)
    means = x[rng.integers(0, x.size, (num, x.size))].mean(1)
    lo, hi = np.quantile(means, [(1 - level) / 2, (1 + level) / 2])
    return float(x.mean()), float(lo), float(hi)


def paper_saem(model, kernel: str, step_size: float, num_iters: int, burnin_steps: int,
               **kwargs) -> SAEM:
    """:class:`SAEM` running the MCMC-SAEM paper's algorithm (Sec. 5), which is no longer the
    library's default: ULA or MALA with the fixed step ``step_size`` (the step-size sweeps
    need it; the default adapts it), :math:`\\gamma_k = 1/\\sqrt k` from the first
    iteration without annealing (``Schedule.paper``), ``burnin_steps`` Langevin steps at
    :math:`\\theta_0` (the paper counts single steps; SAEM's burn-in counts E-steps of
    ``PAPER_MCMC_STEPS`` steps: rounded up), one chain, no independence proposals from the
    prior, and the model's own coordinates (no centring). ``kwargs`` go to :class:`SAEM`
    (``mh_blocks``, ``preconditioner``, ``mstep``, ...)."""
    burnin = math.ceil(burnin_steps / PAPER_MCMC_STEPS)
    return SAEM(model, kernel=kernel, step_size=step_size, num_mcmc_steps=PAPER_MCMC_STEPS,
                num_chains=1, prior_proposals=0, centring=False,
                schedule=Schedule.paper(num_iters, burnin), **kwargs)


def fit_or_none(saem, key, *args, **kwargs):
    """``saem.run(...)``, or ``None`` when the E-step diverges (a point of the step-size
    sweep where the Langevin step is too large: the paper counts it as a failure)."""
    try:
        return saem.run(key, *args, **kwargs)
    except DivergenceError:
        return None


# ----------------------------------------------------------------------------- AIS
@functools.lru_cache(maxsize=16)
def make_ais(model: Callable, *, num_particles: int = 100, num_steps: int = 1000,
             step_size: float = 1e-3, num_mh: int = 1):
    """Compiled per-group log marginal likelihood of a NumPyro model by annealed importance
    sampling (:func:`numpyro_fed.saem.annealed_importance_sampling`; Neal 2001, with the
    quadratic schedule and the settings of the MCMC-SAEM paper, Sec. 5.2: 100 particles,
    1000 temperatures, MALA moves).

    Returns ``ais(key, theta, *group_args) -> (G,)``: each array of ``group_args`` has a
    leading axis of ``G`` independent groups (subjects); the model is called on one group at a
    time (``arg[g]``) with the ``param`` sites fixed to ``theta`` (constrained dict). Latent
    sites must be real-valued (they are annealed in their own space). One compilation serves
    every ``theta`` and every set of groups with the same shapes; the compiled function is
    cached per model and settings (calls with the same settings share it).
    """

    def one_group(key, theta, gargs):
        m = substitute(model, data=theta)
        tr = trace(seed(m, random.key(0))).get_trace(*gargs)
        latent = [n for n, s in tr.items() if s["type"] == "sample" and not s["is_observed"]]
        observed = [n for n, s in tr.items() if s["type"] == "sample" and s["is_observed"]]
        z0, unravel = ravel_pytree({n: tr[n]["value"] for n in latent})

        def parts(zf):
            lps, _ = compute_log_probs(m, gargs, {}, unravel(zf), sum_log_prob=True)
            return sum(lps[n] for n in latent), sum(lps[n] for n in observed)

        def sample_prior(k):
            t = trace(seed(m, k)).get_trace(*gargs)
            return ravel_pytree({n: t[n]["value"] for n in latent})[0]

        return annealed_importance_sampling(
            key, lambda z: parts(z)[0], lambda z: parts(z)[1], sample_prior,
            num_particles=num_particles, num_steps=num_steps, step_size=step_size,
            num_mh=num_mh,
        )

    @jax.jit
    def ais(key, theta, *group_args):
        G = group_args[0].shape[0]
        keys = random.split(key, G)
        theta = {k: jnp.asarray(v) for k, v in theta.items()}
        return jax.vmap(lambda k, *ga: one_group(k, theta, tuple(a[None] for a in ga)))(
            keys, *group_args)

    return ais
