"""Run outputs that people read: metrics.jsonl, TensorBoard, progress, phase timings."""

from __future__ import annotations

import json
import math
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from mmyatt.outputs.rollout_log import markdown_table


class PhaseTimer:
    """Wall time per phase of a step, e.g. ``with timer("generate"): ...``."""

    def __init__(self):
        self.seconds: dict[str, float] = {}

    @contextmanager
    def __call__(self, phase: str):
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[phase] = self.seconds.get(phase, 0.0) + time.perf_counter() - t0

    def metrics(self) -> dict[str, float]:
        total = sum(self.seconds.values()) or 1.0
        out = {f"timing/{k}_s": v for k, v in self.seconds.items()}
        out.update({f"timing/{k}_share": v / total for k, v in self.seconds.items()})
        return out


class MetricsLogger:
    """Writes one JSON object per logged step; only the main controller writes."""

    def __init__(
        self,
        run_dir: str | Path,
        enabled: bool = True,
        tensorboard: bool = True,
        trackers: list | None = None,
    ):
        self.enabled = enabled
        self.run_dir = Path(run_dir)
        self.path = Path(run_dir) / "metrics.jsonl"
        self._tb = None
        self.trackers = list(trackers or [])  # wandb / mlflow (mmyatt/outputs/trackers.py)
        if enabled:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            if tensorboard:
                try:
                    from torch.utils.tensorboard import SummaryWriter

                    self._tb = SummaryWriter(log_dir=str(Path(run_dir) / "tensorboard"))
                except ImportError:  # tensorboard is a dependency; tolerate a trimmed install
                    self._tb = None

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        if not self.enabled:
            return
        row = {"step": int(step)}
        for k in sorted(metrics):
            v = metrics[k]
            if isinstance(v, float) and not math.isfinite(v):
                v = str(v)  # JSON has no NaN; keep the fact visible
            row[k] = v
        with self.path.open("a") as f:
            f.write(json.dumps(row) + "\n")
        scalars = {
            k: float(v)
            for k, v in metrics.items()
            if isinstance(v, int | float) and not isinstance(v, bool)
        }
        if self._tb is not None:
            for k, v in scalars.items():
                self._tb.add_scalar(k, v, step)
            self._tb.flush()
        for t in self.trackers:
            t.log_scalars(int(step), scalars)

    def truncate_after(self, step: int) -> None:
        """Drop rows logged after ``step`` (a resumed run rewrites them)."""
        if not self.enabled or not self.path.exists():
            return
        keep = [
            x
            for x in self.path.read_text().splitlines()
            if x.strip() and json.loads(x)["step"] <= step
        ]
        self.path.write_text("".join(line + "\n" for line in keep))
        if self._tb is not None:
            from torch.utils.tensorboard import SummaryWriter

            self._tb.close()
            self._tb = SummaryWriter(log_dir=self._tb.log_dir, purge_step=step + 1)

    def add_image(self, tag: str, image, step: int) -> None:
        if not self.enabled:
            return
        if self._tb is not None:
            import numpy as np

            self._tb.add_image(tag, np.asarray(image), step, dataformats="HWC")
        for t in self.trackers:
            t.log_image(tag, image, step)

    def log_rollouts(self, step: int, rows: list[dict]) -> None:
        """The main controller's logged rollouts of a step, as a table in every tracker."""
        if not self.enabled or not rows:
            return
        if self._tb is not None:
            self._tb.add_text("rollouts", markdown_table(rows), step)
        for t in self.trackers:
            t.log_rollouts(step, rows, self.run_dir)

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
        for t in self.trackers:
            t.close()
        self.trackers = []


def read_metrics(run_dir: str | Path) -> list[dict]:
    path = Path(run_dir) / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
