"""Does the one warm-up step the placement bench leaves out suffice? The judge_comparable
workload's shared, colocate and partial arms in rotated rounds, every step's time kept,
and partial / colocate with the first 1, 2, 3 and 5 steps left out.

    .venv/bin/python bench/placement_warmup.py 21 3 bench/placement/warmup_judge_comparable.json   # ~6 min
"""

import json
import statistics
import sys
import tempfile
from pathlib import Path

from mmyatt.placement import bench as B

MODES = ["shared", "colocate", "partial"]


def main(steps: int, rounds: int, out_path: str) -> None:
    steps_of: dict[str, list] = {}
    with tempfile.TemporaryDirectory(prefix="mmyatt-warmup-") as t:
        tmp = Path(t)
        policy, judge = B._models(tmp)
        base = B._base(policy, steps) + B._judge(judge, B.COMPARABLE_JUDGE_TOKENS)
        for k in range(rounds):
            for mode in MODES[k % 3 :] + MODES[: k % 3]:
                rd = tmp / f"{mode}_{k}"
                B._train(rd, base + [f"placement.mode={mode}", f"trainer.steps={steps}"])
                rows = B._rows(rd, first=1)
                steps_of.setdefault(mode, []).append(
                    [[r["step"], r["timing/step_s"]] for r in rows]
                )
                print(mode, k, " ".join(f"{r['timing/step_s']:.2f}" for r in rows), flush=True)
    out: dict = {"step_s_per_run": steps_of, "partial_over_colocate_by_first_step": {}}
    for first in (2, 3, 4, 6):
        mean = {
            m: [statistics.fmean(s for i, s in run if i >= first) for run in runs]
            for m, runs in steps_of.items()
        }
        pc = [p / c for p, c in zip(mean["partial"], mean["colocate"], strict=True)]
        out["partial_over_colocate_by_first_step"][first] = statistics.fmean(pc)
    print(out["partial_over_colocate_by_first_step"])
    Path(out_path).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main(*B.probe_argv(sys.argv[1:], 21, 3, "bench/placement/warmup_judge_comparable.json"))
