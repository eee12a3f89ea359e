"""What every bench shares: the record of the machine and code a figure was measured
on, and a training run started as a user starts it (``python -m mmyatt train``).

Benches measure whole runs from outside, in their own processes, so a figure includes
everything a user waits for (start-up, data, judge servers), not a hand-timed inner loop.
"""

from __future__ import annotations

import datetime
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch

from mmyatt.step.profile import MODEL_KINDS

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = ROOT / "configs"


def revision() -> str:
    """The code revision a figure ran on: the commit, ``+dirty`` when the tree had edits,
    ``unknown`` outside a git checkout."""
    try:
        rev = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return rev + ("+dirty" if dirty else "")


def measured_on() -> dict:
    """When and on which code a figure was measured (written into every bench JSON)."""
    return {
        "revision": revision(),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
    }


def machine() -> dict:
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpus": os.cpu_count(),
        "platform": platform.platform(),
        # other work on the cores while the bench ran (1, 5, 15-minute load averages)
        "load_average_at_start": [round(x, 2) for x in os.getloadavg()],
    }


def train_run(config: Path, run_dir: Path, overrides: list[str], env: dict | None = None) -> float:
    t0 = time.perf_counter()
    cmd = [
        sys.executable,
        "-m",
        "mmyatt",
        "train",
        str(config),
        "--run-dir",
        str(run_dir),
        *overrides,
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, **(env or {})})
    if proc.returncode != 0:
        raise RuntimeError(
            f"benchmark run failed ({' '.join(cmd)}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
        )
    return time.perf_counter() - t0


def merge_profiles(ranks: list[dict]) -> dict:
    """The step profile of an arm (``mmyatt.step.profile``): every controller's mean
    seconds per step by kind (warm-up step dropped), averaged over controllers, with
    shares of the step and the model-compute share (forward + backward + optimizer +
    sampling kernels); "other" is Python and glue outside every timed call."""
    sums = [r["summary"] for r in ranks if r.get("summary")]
    if not sums:
        return {}
    kinds = list(dict.fromkeys(k for s in sums for k in s["seconds"]))
    seconds = {k: sum(s["seconds"].get(k, 0.0) for s in sums) / len(sums) for k in kinds}
    step = sum(s["step_s"] for s in sums) / len(sums)
    share = {k: v / step for k, v in seconds.items()}
    return {
        "controllers": len(sums),
        "steps_profiled": sums[0]["steps_profiled"],
        "step_s": step,
        "seconds": seconds,
        "share": share,
        "model_compute_share": sum(share.get(k, 0.0) for k in MODEL_KINDS),
        "model_compute_share_per_controller": [s["model_compute_share"] for s in sums],
    }
