"""Smoke test of the benchmark entry point (``make bench`` = ``benchmarks/run_all.py``).

Tiny sizes: checks that the items run end to end, write their markdown tables and that the
summary names every item; the timings themselves are meaningless at these sizes and are not
tested (benchmarks are not tests: they print ratios measured on a noisy machine).
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.fixture(scope="module")
def run_all():
    sys.path.insert(0, str(BENCH))
    spec = importlib.util.spec_from_file_location("run_all", BENCH / "run_all.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


# slow (47 s on the CI machine): benchmarks are separate from tests; `make test-slow` keeps
# `make bench` runnable
@pytest.mark.slow
def test_run_all_smoke(run_all, tmp_path):
    # saem_defaults: smoke-tested in test_saem_defaults.py, where the default fit it times is
    # already compiled
    items = ["overhead", "peer", "large", "saem", "time-to-first-draw"]
    summary = run_all.main(["--smoke", "--only", *items, "--out", str(tmp_path)])
    for name in items:
        text = (tmp_path / f"{name}.md").read_text()
        assert text.startswith("### ")
        assert f"| {name} | results/{name}.md |" in summary
    overhead = (tmp_path / "overhead.md").read_text()
    assert "| LMC (FederatedLangevin) | 1 |" in overhead
    peer = (tmp_path / "peer.md").read_text()
    for row in ("| ours | lax.scan |", "| ours | NumPyro MCMC loop |",
                "| BlackJAX sgld (model log-density) | NumPyro MCMC loop |"):
        assert row in peer
    assert "ours / BlackJAX sgld in the same loop: lax.scan " in summary
    large = (tmp_path / "large.md").read_text()
    assert "| NUTS (centralised) |" in large and "| LSD++ |" in large
    assert "| saem | results/saem.md |" in summary and "Theophylline SAEM, 10 iterations" \
        in summary
    ttfd = (tmp_path / "time-to-first-draw.md").read_text()
    for row in ("| QLSD++ | smoke | 20 | MCMC |", "| B-ELF | smoke | 20 | CachedMCMC |",
                "| B-ELF | smoke | 20 |"):
        assert row in ttfd
    assert "ours / numpy end to end: K=20: CachedMCMC max " in summary
    assert (tmp_path / "summary.md").exists()


def test_headline_parsing(run_all):
    md = ("### t\n\n| kernel | chains | a | b | c | d | e | MCMC / fused | f |\n|---|\n"
          "| K1 | 1 | 1 | 1 | 1 | 1 | 1 | 1.05 | 1 |\n| K2 | 4 | 1 | 1 | 1 | 1 | 1 | 1.30 | 1 |\n")
    assert run_all.headline("overhead", md).startswith("MCMC / fused: max 1.30 (K2, 4 chain(s))")
    scaling = ("### Time per step\n\n| kernel | axis | a | b | c | exponent | e |\n|---|\n"
               "| LMC | b | 1 | 1 | 1 | 0.81 | 1 |\n\n### Memory\n\n| k | b |\n|---|\n| Q | 1 |\n"
               "\n### Vectorized chains\n\n| chains | a | b | vs 1 |\n|---|\n"
               "| 4 | 1 | 1 | 1.04 |\n")
    assert run_all.headline("scaling", scaling) == \
        "fitted exponents: LMC b: 0.81. Throughput vs 1 chain: 4 chains x1.04"
    assert run_all.headline("large", "x\nBest federated kernel: **LSD++**, 1 s\n") \
        == "Best federated kernel: **LSD++**, 1 s"
