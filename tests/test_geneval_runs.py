"""bench/geneval_runs.py: the judge-checker agreement read from a run's rollout log,
checked on a hand-made log."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("geneval_runs", ROOT / "bench" / "geneval_runs.py")
geneval_runs = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(geneval_runs)


def _write(run: Path, rank: int, rows: list[tuple[int, int, float, float]]) -> None:
    (run / "rollouts").mkdir(parents=True, exist_ok=True)
    lines = [  # the fields a rollout log line carries that the reading needs
        json.dumps(
            {
                "step": s,
                "rank": rank,
                "group": g,
                "sample": i,
                "parts": {"genrm": j, "geneval_check": c},
            }
        )
        for i, (s, g, j, c) in enumerate(rows)
    ]
    (run / "rollouts" / f"rank{rank}.jsonl").write_text("\n".join(lines) + "\n")


def test_rollout_agreement_hand_worked(tmp_path: Path) -> None:
    # group (1, 0, 0): checker 1, 0, 0; judge 0.9, 0.2, 0.95 -> pairs the checker tells
    # apart: (a, b) judge agrees, (a, c) judge disagrees: 1 of 2.
    # group (1, 0, 1): checker 1, 1: no pair. group (2, 1, 0), rank 1: checker 0, 1,
    # judge tied -> half. Total 1.5 of 3.
    _write(
        tmp_path,
        0,
        [(1, 0, 0.9, 1.0), (1, 0, 0.2, 0.0), (1, 0, 0.95, 0.0), (1, 1, 0.3, 1.0), (1, 1, 0.1, 1.0)],
    )
    _write(tmp_path, 1, [(2, 0, 0.5, 0.0), (2, 0, 0.5, 1.0)])
    got = geneval_runs.rollout_agreement(tmp_path)
    assert got == {"groups": 3, "pairs": 3, "agreement": 0.5}


def test_rollout_agreement_without_a_log(tmp_path: Path) -> None:
    assert geneval_runs.rollout_agreement(tmp_path) == {
        "groups": 0,
        "pairs": 0,
        "agreement": None,
    }
