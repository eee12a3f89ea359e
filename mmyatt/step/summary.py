"""What a finished run reports: the before/after table of its eval metrics, the steps
it finished and the placement it ran, printed and written to ``summary.json``. It reads
the run directory's ``metrics.jsonl`` only, so any run directory can be summarised."""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

from mmyatt.outputs.metrics import read_metrics
from mmyatt.report.inspect import metrics_frame, placement_table

logger = logging.getLogger("mmyatt.run")


def red(text: str) -> str:
    """ANSI red on a terminal, plain text in logs."""
    return f"\033[31m{text}\033[0m" if sys.stdout.isatty() else text


def print_summary(run_dir: Path) -> dict:
    """The before/after table for a finished run, with the steps it finished and, for
    image and video runs, the texture checks as a ratio to the base model's (step 0).
    Also written to ``summary.json``: {"steps_done", "steps_planned", "cut_by_time",
    "placement": {mode: {"steps", "step_s"}} (placement metrics only),
    "metrics": {name: {"first", "last", "change"(, "ratio")}}}."""
    rows = read_metrics(run_dir)
    evals = [r for r in rows if any(k.startswith("eval/") for k in r)]
    if not evals:
        logger.info(f"[summary] no eval rows in {run_dir}/metrics.jsonl")
        return {}
    first, last = evals[0], evals[-1]
    keys = [k for k in last if k.startswith("eval/")]
    logger.info(f"\n[summary] {run_dir}")
    width = max([40, *(len(k) + 1 for k in keys)])  # per-task names run longer
    logger.info(
        f"  {'metric':<{width}}{'step ' + str(first['step']):>12}"
        f"{'step ' + str(last['step']):>12}{'change':>10}"
    )
    metrics = {}
    for k in keys:
        a, b = first.get(k), last.get(k)
        if isinstance(a, int | float) and isinstance(b, int | float):
            line = f"  {k:<{width}}{a:>12.4f}{b:>12.4f}{b - a:>+10.4f}"
            metrics[k] = {"first": a, "last": b, "change": b - a}
            if k.startswith("eval/quality/") and a > 0:
                metrics[k]["ratio"] = b / a
                line += f"   x{b / a:.2f} of the base"
            logger.info(line)
    final = next((r for r in reversed(rows) if "train/steps_planned" in r), None)
    out: dict = {}
    if final is not None:
        done, planned = int(final["train/steps_done"]), int(final["train/steps_planned"])
        cut = bool(final.get("train/cut_by_time", 0.0))
        out = {"steps_done": done, "steps_planned": planned, "cut_by_time": cut}
        line = f"  steps {done}/{planned}"
        if done < planned:
            why = "time budget (trainer.max_minutes)" if cut else "stopped early"
            line = red(f"{line}: INCOMPLETE, {why}; this is not the recipe's result")
        logger.info(line)
    train_rows = [r for r in rows if "timing/step_s" in r]
    if train_rows:
        sps = sum(r.get("throughput/samples_per_s", 0) for r in train_rows) / len(train_rows)
        logger.info(f"  mean samples/s {sps:.1f}")
    placed = placement_table(metrics_frame(rows))
    if not placed.empty:
        out["placement"] = {
            p.mode: {"steps": int(p.steps), "step_s": float(p.actual_step_s)}
            for p in placed.itertuples()
        }
        logger.info(
            "  placement: "
            + ", ".join(
                f"{p.mode} x{p.steps} ({p.actual_step_s:.3f} s/step)" for p in placed.itertuples()
            )
        )
    out["metrics"] = metrics
    (run_dir / "summary.json").write_text(json.dumps(out, indent=2))
    return out
