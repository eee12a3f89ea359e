"""One controller against two, in colocate and partial, side by side: the placement
bench's judge_comparable settings (4-token judge, 64 samples a step, 2 cores),
R rotated rounds of S-step runs (step 1 left out). Writes
bench/placement/layouts_comparable.json.

    .venv/bin/python bench/placement_layouts.py [STEPS] [ROUNDS]   # defaults: 21 4

With one controller colocate's phases leave a core idle and partial overlaps them; with
two, data parallelism fills both cores in every phase. This measures which layout gives
the shorter step, and partial / colocate within each.
"""

import json
import shutil
import sys
import tempfile
from pathlib import Path

from mmyatt.placement import bench as B
from mmyatt.placement.bench_figures import paired_ratio

FIGURES = {
    "step_s": "timing/step_s",
    "rollout_s": "placement/rollout_s",
    "gen_s": "placement/gen_s",
    "judge_busy_s": "placement/judge_busy_s",
    "train_s": "placement/train_s",
    "cpu_util": "placement/cpu_util",
}
PAIRS = {
    "partial_over_colocate_2ctl": ("partial_2ctl", "colocate_2ctl"),
    "partial_over_colocate_1ctl": ("partial_1ctl", "colocate_1ctl"),
    "partial_1ctl_over_colocate_2ctl": ("partial_1ctl", "colocate_2ctl"),
    "partial_1ctl_over_partial_2ctl": ("partial_1ctl", "partial_2ctl"),
}

steps = int(sys.argv[1]) if len(sys.argv) > 1 else 21
rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 4
tmp = Path(tempfile.mkdtemp(prefix="mmyatt-layouts-"))
policy, judge = B._models(tmp)
base = B._base(policy, steps) + B._judge(judge, B.COMPARABLE_JUDGE_TOKENS)
arms = {
    f"{mode}_{n}ctl": [f"placement.mode={mode}", f"distributed.nproc={n}"]
    for n in (2, 1)
    for mode in ("colocate", "partial")
}
runs = B._arm_rounds(tmp, "layouts", base, arms, rounds, FIGURES)
out: dict = {"arms": B._arm_means(runs, "step_s"), "runs": runs}
out["ratios"] = {
    k: paired_ratio([r["step_s"] for r in runs[a]], [r["step_s"] for r in runs[b]])
    for k, (a, b) in PAIRS.items()
}
out["split"] = "train (synthetic prompts)"
out["steps_per_run"], out["rounds"] = steps, rounds
out["command"] = " ".join([".venv/bin/python bench/placement_layouts.py", *sys.argv[1:]])
Path("bench/placement/layouts_comparable.json").write_text(json.dumps(out, indent=2) + "\n")
for k, v in out["ratios"].items():
    print(k, round(v["geo_mean"], 3), [round(x, 3) for x in v["ci95"] or []], flush=True)
shutil.rmtree(tmp, ignore_errors=True)
