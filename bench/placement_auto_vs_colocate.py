"""The drifting workload's long segment (every completion runs to a 96-token cap, the
4-token judge) on its own: the colocate arm against auto, which settles on colocate, in
alternating rounds. Compares the phase times of each arm's colocate steps: in the
40-step drifting bench auto's colocate steps ran faster than the colocate arm's.

    .venv/bin/python bench/placement_auto_vs_colocate.py 21 3 bench/placement/auto_vs_colocate.json   # ~5 min
"""

import json
import sys
import tempfile
from pathlib import Path

from mmyatt.placement import bench as B
from mmyatt.placement.bench_figures import _mean


def mean(key: str, rows: list[dict]) -> float | None:
    return _mean([r.get(key) for r in rows])


def main(steps: int, rounds: int, out_path: str) -> None:
    out: dict = {"colocate": [], "auto": []}
    with tempfile.TemporaryDirectory(prefix="mmyatt-avc-") as t:
        tmp = Path(t)
        policy, judge = B._models(tmp)
        base = B._base(policy, steps) + B._judge(judge, B.DRIFT_JUDGE_TOKENS) + B.DRIFT["long"]
        for k in range(rounds):
            for mode in ["colocate", "auto"] if k % 2 == 0 else ["auto", "colocate"]:
                rd = tmp / f"{mode}_{k}"
                B._train(rd, base + [f"placement.mode={mode}", f"trainer.steps={steps}"])
                rows = B._rows(rd, first=2)
                col = [r for r in rows if r.get("placement/mode") == "colocate"]
                rec = {
                    "steps": len(rows),
                    "colocate_steps": len(col),
                    "modes": "".join(r.get("placement/mode", "?")[0] for r in rows),
                    "step_s_all": mean("timing/step_s", rows),
                    "colocate_step_s": mean("timing/step_s", col),
                    "colocate_gen_s": mean("placement/gen_s", col),
                    "colocate_train_s": mean("placement/train_s", col),
                    "colocate_judge_s": mean("placement/judge_busy_s", col),
                    "colocate_cpu": mean("placement/cpu_util", col),
                    "per_step": [
                        [
                            r["step"],
                            r.get("placement/mode"),
                            round(r["timing/step_s"], 3),
                            round(r.get("placement/gen_s", 0), 3),
                            round(r.get("placement/train_s", 0), 3),
                        ]
                        for r in rows
                    ],
                }
                out[mode].append(rec)
                print(mode, k, {a: b for a, b in rec.items() if a != "per_step"}, flush=True)
    Path(out_path).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main(*B.probe_argv(sys.argv[1:], 21, 3, "bench/placement/auto_vs_colocate.json"))
