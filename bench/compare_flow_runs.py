"""Compare finished flow runs side by side: held-out reward against wall time.

    python bench/compare_flow_runs.py RUN_DIR [RUN_DIR ...] --out results/recipes/NAME

For each run: every eval's held-out and seen rule reward, the independent critic, the
background texture (ratio to the run's step-0 eval) and the wall time at which that eval
was written (the mtime of samples/step_N.png, minus that of step 0, i.e. training time
with the evals in between; the last one matches the run's train/minutes). The first run
is the baseline: for every other run, the first eval whose held-out reward reaches the
baseline's final one, and its time as a fraction of the baseline's. Writes NAME.json
and NAME.png (held-out reward against minutes).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def read_run(run: Path) -> dict:
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x.strip()]
    evals = {}
    for r in rows:
        if "eval/reward/mean" in r:
            evals[r["step"]] = r  # the last row of a step wins (the final eval)
    t0 = (run / "samples" / "step_000000.png").stat().st_mtime
    base_bg = evals[0]["eval/quality/background_hf"]
    points = []
    for step in sorted(evals):
        r = evals[step]
        png = run / "samples" / f"step_{step:06d}.png"
        points.append(
            {
                "step": step,
                "minutes": (png.stat().st_mtime - t0) / 60.0,
                "heldout": r["eval/reward/mean"],
                "seen": r.get("eval/seen/reward/mean"),
                "critic_heldout": r.get("eval/heldout/reward/shape_critic"),
                "background_ratio": r["eval/quality/background_hf"] / base_bg,
            }
        )
    final = next((r for r in reversed(rows) if "train/minutes" in r), {})
    return {
        "run": str(run),
        "train_minutes": final.get("train/minutes"),
        "steps_done": final.get("train/steps_done"),
        "evals": points,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", nargs="+", type=Path)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    runs = [read_run(r) for r in args.runs]
    base = runs[0]
    target = base["evals"][-1]["heldout"]
    for run in runs[1:]:
        hit = next((p for p in run["evals"] if p["step"] > 0 and p["heldout"] >= target), None)
        run["reaches_baseline_final"] = None
        if hit is not None:
            run["reaches_baseline_final"] = {
                "step": hit["step"],
                "minutes": hit["minutes"],
                "fraction_of_baseline_minutes": hit["minutes"] / base["evals"][-1]["minutes"],
            }
    for run in runs:
        print(run["run"], f"train/minutes={run['train_minutes']}")
        for p in run["evals"]:
            print(
                f"  step {p['step']:4d}  {p['minutes']:5.2f} min  held-out {p['heldout']:.3f}  "
                f"seen {p['seen']:.3f}  critic {p['critic_heldout']:.3f}  "
                f"background {p['background_ratio']:.2f}x"
            )
        if "reaches_baseline_final" in run:
            print(f"  reaches the baseline's final {target:.3f}: {run['reaches_baseline_final']}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(runs, indent=2) + "\n")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.6))
    for run in runs:
        xs = [p["minutes"] for p in run["evals"]]
        ax.plot(xs, [p["heldout"] for p in run["evals"]], marker="o", label=Path(run["run"]).name)
    ax.axhline(target, color="grey", lw=0.8, ls="--")
    ax.set_xlabel("wall minutes (training and evals)")
    ax.set_ylabel("held-out rule reward (test)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(args.out.with_suffix(".png"), dpi=110)


if __name__ == "__main__":
    main()
