"""What the results tables share: where the committed results live and how a figure
cell is written. Used by ``tests/results_tables.py`` and ``tests/results_bench.py``."""

from __future__ import annotations

import json
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "results"
ARROW = "→"
Rows = dict[str, list[str | None]]  # row name -> cells after the first, in header order

# ---------------------------------------------------------------------------- data


def load(rel: str):
    return json.loads((RESULTS / rel).read_text())


def run_dir(name: str) -> tuple[dict, list[dict]]:
    """A recipe run kept under results/recipes/NAME: its summary and eval rows."""
    d = RESULTS / "recipes" / name
    rows = [json.loads(x) for x in (d / "eval.jsonl").read_text().splitlines() if x.strip()]
    return json.loads((d / "summary.json").read_text()), rows


def change(a: float, b: float) -> str:
    return f"{a:.3f} {ARROW} {b:.3f} ({b - a:+.3f})"


def times(x: float, d: int = 2) -> str:
    return f"{x:.{d}f}x"


def ratio_ci(r: float, ci: list[float], d: int = 3) -> str:
    return f"{r:.{d}f} ({ci[0]:.2f}-{ci[1]:.2f})"


def first_last(summary: dict, key: str) -> tuple[float, float]:
    m = summary["metrics"][key]
    return m["first"], m["last"]
