"""Shared plumbing of the QLSD examples: arguments, running chains, writing tables/figures."""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import numpy as np
import pandas as pd
from _example_common import RESULTS, out_dir, parser  # noqa: F401  (re-exported)
from jax import random
from numpyro.infer import MCMC

from numpyro_fed.bits import counter_value


def run_chains(kernel, num_steps: int, num_chains: int, seed: int, num_warmup: int = 0,
               init_params=None):
    """Run ``num_chains`` vectorized chains; return (flat draws (chains, steps, d),
    uplink bits per step (chains, steps), the MCMC object, wall time)."""
    mcmc = MCMC(kernel, num_warmup=num_warmup, num_samples=num_steps, num_chains=num_chains,
                chain_method="vectorized", progress_bar=False)
    t0 = time.perf_counter()
    mcmc.run(random.PRNGKey(seed), init_params=init_params, extra_fields=("bits_up",))
    samples = mcmc.get_samples(group_by_chain=True)
    wall = time.perf_counter() - t0
    pot = kernel.potential
    z = {k: np.asarray(v) for k, v in samples.items() if k in pot.latent_names}
    c, s = num_chains, num_steps
    flat = np.concatenate([z[k].reshape(c, s, -1) for k in pot.latent_names], axis=-1)
    bits = np.asarray(mcmc.get_extra_fields(group_by_chain=True)["bits_up"], np.int64)
    return flat, bits, mcmc, wall


def total_bits(mcmc) -> tuple[np.ndarray, np.ndarray]:
    """Cumulative (up, down) bits of each chain, one-off rounds and warmup included."""
    st = mcmc.last_state
    return counter_value(st.total_up), counter_value(st.total_down)


def markdown_table(df: pd.DataFrame, floatfmt: str = "{:.4g}") -> str:
    def fmt(v):
        if isinstance(v, float | np.floating):
            return floatfmt.format(v)
        return str(v)

    head = "| " + " | ".join(map(str, df.columns)) + " |"
    sep = "|" + "|".join("---" for _ in df.columns) + "|"
    rows = ["| " + " | ".join(fmt(v) for v in row) + " |" for row in df.itertuples(index=False)]
    return "\n".join([head, sep, *rows]) + "\n"


def write_outputs(args, name: str, df: pd.DataFrame, fig, header: str, notes: str = "") -> Path:
    """Write ``<name>.csv``, ``<name>.md`` and ``<name>.png`` to the output folder and copy the
    markdown table to ``examples/results/<name>.md`` (not in smoke mode)."""
    out = out_dir(args, name)
    df.to_csv(out / f"{name}.csv", index=False)
    md = f"### {header}\n\n{markdown_table(df)}"
    if notes:
        md += f"\n{notes.strip()}\n"
    (out / f"{name}.md").write_text(md)
    fig.savefig(out / f"{name}.png", dpi=110, bbox_inches="tight")
    if not args.smoke and not args.no_results_copy:
        RESULTS.mkdir(exist_ok=True)
        shutil.copy(out / f"{name}.md", RESULTS / f"{name}.md")
    print(md)
    print(f"wrote {out}/{name}.{{csv,md,png}}")
    return out


def cpu_note() -> str:
    return f"{os.cpu_count()} CPU cores visible"
