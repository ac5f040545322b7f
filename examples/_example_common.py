"""Plumbing shared by every example: common flags and the output folder."""

from __future__ import annotations

import argparse
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


def parser(name: str, description: str) -> argparse.ArgumentParser:
    """Common flags: ``--out``, ``--smoke``, ``--seed``, ``--no-results-copy``."""
    p = argparse.ArgumentParser(prog=name, description=description)
    p.add_argument("--out", default=None, help=f"output folder (default out/{name})")
    p.add_argument("--smoke", action="store_true", help="tiny settings (a few seconds)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-results-copy", action="store_true",
                   help="do not copy the markdown table to examples/results/")
    return p


def out_dir(args, name: str) -> Path:
    """``--out`` or ``out/<name>``, created."""
    path = Path(args.out) if args.out else Path("out") / name
    path.mkdir(parents=True, exist_ok=True)
    return path
