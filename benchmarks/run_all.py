"""Run the whole benchmark suite (``make bench``) and print a summary table.

Items (each a script of this folder with its own ``--help``; results in
``benchmarks/results/<name>.md``):

1. ``bench_overhead.py`` -- every kernel inside MCMC vs a hand-fused ``lax.scan``
   (1 and 4 vectorized chains), target ≤ 1.15;
2. ``bench_peer.py`` -- FederatedLangevin (1 client, identity) vs BlackJAX ``sgld`` in the
   same loop (``lax.scan``, NumPyro's MCMC loop), target ≤ 1.1;
3. and 5. ``bench_scaling.py`` -- time per step as b, n, d grow 10x / 100x (fitted
   exponents), kernel-state bytes vs N, vectorized throughput with 1, 4, 16 chains;
4. ``bench_large.py`` -- N = 10^6 logistic regression over 1000 clients: NUTS vs
   LSD*/LSD++/QLSD 4-bit, wall time to a posterior-accuracy criterion, target ≤ 1/5;
6. ``bench_saem.py`` -- Theophylline MCMC-SAEM: compiled fit vs a Python loop of the same
   iterations, target < 2 s after compilation;
7. ``bench_saem_defaults.py`` -- ``SAEM(model)`` with its defaults, fit + standard errors +
   -2LL on the 120 Theophylline rows: first fit in a fresh process and repeated fits, against
   saemix's time for the same work (issue 12 target: repeated fits >= 4x faster);
8. ``bench_ttfd.py`` (item ``time-to-first-draw``) -- a user's whole ``MCMC.run`` in a fresh
   process split into kernel construction, tracing, lowering, compilation and sampling, end to
   end for 1000 and 10 000 steps against the QLSD and ELF papers' loops reimplemented in numpy
   (targets <= 0.5x and <= 0.2x), and the steady state (ours / hand-fused <= 1.5, ELF >= 10x
   faster than numpy).

Default sizes take about 20 minutes on a 2-core CPU; ``--smoke`` runs every item at tiny
sizes (seconds, for the test suite); ``--full`` uses the issue's full settings for item 4
(more NUTS draws, NUTS reference). The summary is also written to
``benchmarks/results/summary.md``.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import device_name, md_table, write_result  # noqa: E402

HERE = Path(__file__).resolve().parent

SMOKE = {
    "overhead": ["--clients", "2", "--rows", "10", "--dim", "3", "--batch", "2", "--steps", "8",
                 "--repeats", "1", "--chains", "1", "--kernels", "LMC"],
    "peer": ["--rows", "50", "--dim", "3", "--batch", "5", "--steps", "8", "--repeats", "1"],
    "scaling": ["--base", "1", "--rows", "100", "--steps", "8", "--repeats", "1", "--kinds",
                "LMC", "--axes", "d", "--chain-steps", "8", "--chain-counts", "1", "2"],
    "large": ["--rows", "2000", "--clients", "4", "--dim", "3", "--nuts-warmup", "20",
              "--nuts-samples", "20", "--fed-warmup", "20", "--fed-samples", "40",
              "--kernels", "LSD++"],
    "saem": ["--iters", "10", "--chains", "1"],
    "saem_defaults": ["--case", "dyestuff", "--repeats", "1", "--no-fresh"],
    "time-to-first-draw": ["--smoke"],
}
FULL = {"large": ["--nuts-warmup", "1000", "--nuts-samples", "2000", "--fed-samples", "20000",
                  "--reference", "nuts"]}
#: item -> script. Each runs as its own process (``python benchmarks/bench_<item>.py``, as
#: a reader would run it): a fresh JAX runtime per item, and the microsecond-step items set
#: their own XLA threading before JAX starts (see :func:`_common.single_threaded_xla`).
ITEMS = {name: HERE / f"bench_{name}.py" for name in
         ("overhead", "peer", "scaling", "large", "saem", "saem_defaults")}
ITEMS["time-to-first-draw"] = HERE / "bench_ttfd.py"


def _table(md: str, title_start: str | None = None) -> list[list[str]]:
    """Rows of the first markdown table after a heading starting with ``title_start``."""
    if title_start is not None:
        md = md[md.index(title_start):] if title_start in md else ""
    rows, started = [], False
    for line in md.splitlines():
        if line.startswith("|"):
            started = True
            if not line.startswith("|---"):
                rows.append(line.strip().strip("|").split("|"))
        elif started:  # the first table ends here
            break
    return [[c.strip() for c in r] for r in rows[1:]]


def _num(s: str) -> float:
    try:
        return float(s)
    except ValueError:
        return float("nan")


def headline(name: str, md: str) -> str:
    """One line of the key numbers of an item's markdown."""
    if name == "overhead":
        rows = _table(md)
        worst = max(rows, key=lambda r: _num(r[7]))
        out = (f"MCMC / fused: max {_num(worst[7]):.2f} ({worst[0]}, {worst[1]} chain(s)); "
               f"median {sorted(_num(r[7]) for r in rows)[len(rows) // 2]:.2f}")
        if len(rows[0]) > 8:  # like for like: against the fused scan emitting the same outputs
            like = [(_num(r[8]) if _num(r[8]) == _num(r[8]) else _num(r[7]), r) for r in rows]
            v, r = max(like, key=lambda t: t[0])
            out += f"; like for like (fused+out where reported): max {v:.2f} ({r[0]}, {r[1]})"
        return out
    if name == "peer":
        rows = {(r[0], r[1]): r for r in _table(md)}
        scan, loop = rows[("ours", "lax.scan")], rows[("ours", "NumPyro MCMC loop")]
        return (f"ours / BlackJAX sgld in the same loop: lax.scan {_num(scan[3]):.2f}, NumPyro "
                f"MCMC loop {_num(loop[3]):.2f}; ours in the MCMC loop / BlackJAX in its bare "
                f"scan {_num(loop[4]):.2f}")
    if name == "scaling":
        rows = _table(md, "### Time per step")
        ex = "; ".join(f"{r[0]} {r[1]}: {_num(r[5]):.2f}" for r in rows)
        chains = _table(md, "### Vectorized chains")
        thr = ", ".join(f"{r[0]} chains x{_num(r[3]):.2f}" for r in chains)
        return f"fitted exponents: {ex}. Throughput vs 1 chain: {thr}"
    if name == "saem":
        r = _table(md)[0]
        return (f"Theophylline SAEM, {r[0]} iterations: compiled run {r[2]} s after {r[1]} s "
                f"compilation; Python loop {r[3]} s ({r[4]}x)")
    if name == "saem_defaults":
        m = re.search(r"^(repeated fit \+ SE.*)$", md, re.M)
        return m.group(1) if m else ""
    if name == "time-to-first-draw":
        rows = _table(md, "#### End to end")
        out = []
        for k in sorted({r[2] for r in rows}, key=_num):
            at_k = [r for r in rows if r[2] == k]
            cached = max(at_k, key=lambda r: _num(r[8]))
            warm = max(at_k, key=lambda r: _num(r[9]))
            out.append(f"K={k}: CachedMCMC max {_num(cached[8]):.2f} ({cached[0]}, "
                       f"{cached[1]}), warm cache max {_num(warm[9]):.2f} ({warm[0]})")
        split = [r for r in _table(md, "#### First MCMC.run") if r[3] == "CachedMCMC"]
        comp = max(split, key=lambda r: _num(r[9])) if split else None
        tail = (f"; CachedMCMC first-run XLA compile max {_num(comp[9]):.2f} s ({comp[0]}, "
                f"{comp[1]})" if comp else "")
        return "ours / numpy end to end: " + "; ".join(out) + tail
    if name == "large":
        m = re.search(r"^(Best federated kernel.*|No federated kernel.*)$", md, re.M)
        return m.group(1) if m else ""
    return ""


def main(argv: list[str] | None = None) -> str:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--smoke", action="store_true", help="tiny sizes (seconds)")
    p.add_argument("--full", action="store_true", help="full settings for the large run")
    p.add_argument("--only", nargs="+", choices=list(ITEMS), default=list(ITEMS))
    p.add_argument("--out", default=None, help="results folder (default benchmarks/results)")
    args = p.parse_args(argv)
    rows, parts = [], []
    out_dir = Path(args.out) if args.out else HERE / "results"
    for name in args.only:
        argv_i = list(SMOKE[name]) if args.smoke else list(FULL.get(name, [])) if args.full \
            else []
        argv_i += ["--out", str(out_dir)]
        print(f"=== {name}: {ITEMS[name]} {' '.join(argv_i)}", flush=True)
        t0 = time.perf_counter()
        subprocess.run([sys.executable, str(ITEMS[name]), *argv_i], check=True)
        md = (out_dir / f"{name}.md").read_text()
        rows.append([name, f"results/{name}.md", f"{time.perf_counter() - t0:.0f}",
                     headline(name, md)])
        parts.append(md)
    for name in ITEMS:  # items not run now: their last table, if any
        path = out_dir / f"{name}.md"
        if name not in args.only and path.exists():
            rows.append([name, f"results/{name}.md", "(earlier run)",
                         headline(name, path.read_text())])
    summary = (f"### Benchmark summary ({device_name()})\n\n"
               + md_table(["item", "table", "run time s", "headline"], rows))
    write_result("summary", summary, args.out)
    print("\n" + summary)
    return summary


if __name__ == "__main__":
    main()
