"""Theophylline end to end, side by side with saemix in one run (issue 29).

Usage: ``python benchmarks/bench_theophylline_saemix.py [--repeats 5] [--out DIR]``; writes
``benchmarks/results/theophylline_saemix.md``.

Timed, interleaved round by round so that both see the same machine load:

- **ours, PKModel**: ``nlme.PKModel(one_compartment(), KA/V/CL log-normal, additive
  error).fit(load_theophylline(), key)`` with SAEM's defaults, then ``parameter_table()``
  (standard errors) and ``result.log_likelihood()`` (the -2LL);
- **ours, SAEM**: the hand-written model of ``tests/saem_cases.py`` (``theoph_long``, the
  same 120 rows and model) with ``SAEM(model).run``, ``standard_errors()``,
  ``log_likelihood()``;
- **saemix** (R), when ``Rscript`` and the ``saemix`` package are installed: its documented
  Theophylline example (``theo.saemix``, ``model1cpt``, log-normal ka/V/CL, diagonal Omega,
  constant error) with its default settings (``saemixControl()``: 300 + 100 iterations, one
  chain, MAP, linearised Fisher information for the SEs, importance-sampling -2LL), only
  printing, plotting and saving off; one R process, each call timed by ``system.time``.

A round fits each once (a new seed each round) after one warm-up call of each in this
process; the medians and their ratios are reported. The repeated fit of ours replays the
programs of the warm-up run without tracing them (:mod:`numpyro_fed.saem.memo`); the row
"replay off" times the same fit with every program traced (``NUMPYRO_FED_REPLAY_RUNS=0``
behaviour, switched in-process). saemix is not part of this project: install R and saemix
yourself (e.g. Debian's ``r-base-core`` and saemix from its repository) to get its column.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

#: the saemix side: one R process that fits the documented Theophylline example once per
#: line read from stdin (the seed) and prints one JSON line per fit
R_SERVER = r"""
suppressPackageStartupMessages(library(saemix))
data(theo.saemix)
sd <- saemixData(name.data = theo.saemix, header = TRUE, sep = " ", na = NA,
  name.group = c("Id"), name.predictors = c("Dose", "Time"),
  name.response = c("Concentration"), name.covariates = c("Weight", "Sex"),
  units = list(x = "hr", y = "mg/L", covariates = c("kg", "-")), name.X = "Time",
  verbose = FALSE)
model1cpt <- function(psi, id, xidep) {
  dose <- xidep[, 1]; tim <- xidep[, 2]
  ka <- psi[id, 1]; V <- psi[id, 2]; CL <- psi[id, 3]; k <- CL / V
  dose * ka / (V * (ka - k)) * (exp(-k * tim) - exp(-ka * tim))
}
sm <- saemixModel(model = model1cpt, description = "1-cmt oral",
  psi0 = matrix(c(1., 20, 0.5), ncol = 3, byrow = TRUE,
                dimnames = list(NULL, c("ka", "V", "CL"))),
  transform.par = c(1, 1, 1), covariance.model = diag(3),
  error.model = "constant", verbose = FALSE)
cat(sprintf("READY saemix %s %s\n", packageVersion("saemix"), R.version.string))
con <- file("stdin"); open(con)
while (length(line <- readLines(con, n = 1)) > 0) {
  seed <- as.integer(line)
  fit <- NULL
  tm <- system.time(invisible(capture.output(fit <- saemix(sm, sd, list(
    seed = seed, save = FALSE, save.graphs = FALSE, displayProgress = FALSE,
    print = FALSE)))))
  r <- fit@results
  cat(sprintf("{\"elapsed\": %.6f, \"m2ll_is\": %.6f, \"ka\": %.6f, \"V\": %.6f, \"CL\": %.6f}\n",
              tm[["elapsed"]], -2 * r@ll.is, r@fixed.effects[1], r@fixed.effects[2],
              r@fixed.effects[3]))
  flush(stdout())
}
"""


class Saemix:
    """The R process fitting the saemix example on request (``None`` fits if unavailable)."""

    def __init__(self) -> None:
        self.proc = None
        self.version = "not installed (Rscript or the saemix package missing)"
        if shutil.which("Rscript") is None:
            return
        proc = subprocess.Popen(["Rscript", "-e", R_SERVER], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                text=True, bufsize=1)
        first = proc.stdout.readline()
        if not first.startswith("READY"):
            proc.kill()
            return
        self.proc, self.version = proc, first.split(" ", 1)[1].strip()

    def fit(self, seed: int) -> dict | None:
        if self.proc is None:
            return None
        self.proc.stdin.write(f"{seed}\n")
        self.proc.stdin.flush()
        return json.loads(self.proc.stdout.readline())

    def close(self) -> None:
        if self.proc is not None:
            self.proc.stdin.close()
            self.proc.wait(timeout=60)


def ours_pk(seed: int) -> dict:
    import jax

    from numpyro_fed import nlme

    data = nlme.load_theophylline()
    pk = nlme.PKModel(nlme.one_compartment(),
                      params={"KA": nlme.Param(1.0), "V": nlme.Param(20.0),
                              "CL": nlme.Param(0.5)}, error="additive")
    t0 = time.perf_counter()
    fit = pk.fit(data, jax.random.key(seed))
    t1 = time.perf_counter()
    fit.parameter_table()
    t2 = time.perf_counter()
    ll = fit.result.log_likelihood(jax.random.key(seed + 1000))
    t3 = time.perf_counter()
    return {"fit": t1 - t0, "se": t2 - t1, "m2ll_s": t3 - t2, "total": t3 - t0,
            "m2ll": ll["m2ll"]}


def ours_saem(seed: int) -> dict:
    import jax
    import saem_cases as sc

    from numpyro_fed.saem import SAEM

    case = sc.get_case("theoph_long")
    t0 = time.perf_counter()
    res = SAEM(case.model).run(jax.random.key(seed), **case.data)
    t1 = time.perf_counter()
    res.standard_errors()
    t2 = time.perf_counter()
    ll = res.log_likelihood(jax.random.key(seed + 1000))
    t3 = time.perf_counter()
    return {"fit": t1 - t0, "se": t2 - t1, "m2ll_s": t3 - t2, "total": t3 - t0,
            "m2ll": ll["m2ll"]}


def main(argv: list[str] | None = None) -> str:
    import warnings

    from _common import device_name, md_table, write_result

    from numpyro_fed.saem import fit as saem_fit

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", default=None, help="results folder (default benchmarks/results)")
    a = p.parse_args(argv)
    warnings.simplefilter("ignore")
    peer = Saemix()
    runs: dict[str, list[dict]] = {"pk": [], "saem": [], "pk_noreplay": [], "saemix": []}
    try:
        ours_pk(0), ours_saem(0), peer.fit(632545)  # warm-up: compile, record
        for r in range(1, a.repeats + 1):
            runs["pk"].append(ours_pk(r))
            runs["saem"].append(ours_saem(r))
            saem_fit.REPLAY_RUNS = False
            try:
                runs["pk_noreplay"].append(ours_pk(r))
            finally:
                saem_fit.REPLAY_RUNS = True
            s = peer.fit(632545 + r)
            if s is not None:
                runs["saemix"].append({"total": s["elapsed"], "m2ll": s["m2ll_is"]})
    finally:
        peer.close()
    med = {k: statistics.median(x["total"] for x in v) for k, v in runs.items() if v}
    ref = med.get("saemix")
    labels = {"pk": "ours: PKModel fit + parameter_table + -2LL (repeated, replayed)",
              "saem": "ours: SAEM(model) fit + SEs + -2LL (repeated, replayed)",
              "pk_noreplay": "ours: PKModel, every program traced (replay off)",
              "saemix": "saemix 3.4 defaults: fit + FIM SEs + IS -2LL"}
    rows = []
    for k, v in runs.items():
        if not v:
            continue
        times = ", ".join(f"{x['total']:.3f}" for x in v)
        m2ll = statistics.median(x["m2ll"] for x in v)
        rows.append([labels[k], times, f"{med[k]:.3f}",
                     "" if ref is None else f"{ref / med[k]:.2f}", f"{m2ll:.2f}"])
    headline = "; ".join(f"{k} {med[k]:.3f} s" for k in med)
    if ref is not None:
        headline += (f"; saemix / ours (PKModel) = {ref / med['pk']:.2f}x, "
                     f"(SAEM) = {ref / med['saem']:.2f}x (target >= 4)")
    text = (f"### Theophylline end to end, ours and saemix side by side\n\n"
            f"{device_name()}; saemix: {peer.version}. {a.repeats} rounds after one warm-up "
            "call of each, interleaved (ours PKModel, ours SAEM, ours PKModel with replay "
            "off, saemix); seconds of each call, median, saemix's median over ours.\n\n"
            + md_table(["run", "seconds per round", "median s", "saemix / this",
                        "-2LL (median)"], rows)
            + f"\n\n{headline}\n")
    print(text)
    print(f"wrote {write_result('theophylline_saemix', text, a.out)}")
    return text


if __name__ == "__main__":
    main()
