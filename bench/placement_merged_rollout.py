"""Partial with ``placement.merge_rollout`` (the first controller generates both
controllers' prompt groups in one batch on the rollout core and streams them to the
judge) against partial with each controller generating its own, and colocate: the
placement bench's settings (2 controllers on 2 cores, 8 prompts x 8 samples per step, the
same judge), rotated rounds of 20 measured steps, train split.

    .venv/bin/python bench/placement_merged_rollout.py comparable 6   # ~9 min; the 4-token judge
    .venv/bin/python bench/placement_merged_rollout.py heavy 6        # ~11 min; the 16-token judge
    .venv/bin/python bench/placement_merged_rollout.py long 3         # ~8 min; drifting's long segment

Writes bench/placement/merged_rollout_<workload>.json.
"""

import json
import statistics
import sys
import tempfile
from pathlib import Path

from mmyatt.placement import bench as B
from mmyatt.placement.bench_figures import paired_ratio

WORKLOAD = sys.argv[1] if len(sys.argv) > 1 else "comparable"
ROUNDS = int(sys.argv[2]) if len(sys.argv) > 2 else 6
STEPS = 21
tokens = {
    "comparable": B.COMPARABLE_JUDGE_TOKENS,
    "heavy": B.JUDGE_TOKENS,
    "long": B.DRIFT_JUDGE_TOKENS,
}[WORKLOAD]
tmp = Path(tempfile.mkdtemp(prefix="mmyatt-merged-"))
policy, judge = B._models(tmp)
base = B._base(policy, STEPS) + B._judge(judge, tokens)
if WORKLOAD == "long":  # the drifting workload's second segment: completions run to 96
    base += B.DRIFT["long"]
arms = {
    "colocate": ["placement.mode=colocate"],
    "partial": ["placement.mode=partial"],
    "partial_merged": ["placement.mode=partial", "placement.merge_rollout=true"],
}
names = list(arms)
res: dict[str, list] = {}
out_path = Path(f"bench/placement/merged_rollout_{WORKLOAD}.json")
for k in range(ROUNDS):
    for n in names[k % 3 :] + names[: k % 3]:
        a = B._arm(tmp, f"{n}_{k}", base + arms[n], STEPS)
        res.setdefault(n, []).append(a)
        print(
            k + 1,
            n,
            "step",
            round(a["step_s"], 3),
            "rollout",
            round(a["rollout_s"], 3),
            "gen",
            round(a["phase_s"]["gen_s"], 3),
            "judge",
            round(a["phase_s"]["judge_busy_s"], 3),
            flush=True,
        )
    out: dict = {
        "benchmark": "placement merged rollout",
        "workload": WORKLOAD,
        "judge_tokens_per_sample": tokens,
        "rounds": len(res["colocate"]),
        "steps_measured_per_run": STEPS - 1,
        "split": "train",
        "command": f".venv/bin/python bench/placement_merged_rollout.py {WORKLOAD} {ROUNDS}",
    }
    for n, v in res.items():
        out[n] = {
            "step_s_per_round": [a["step_s"] for a in v],
            "rollout_s_per_round": [a["rollout_s"] for a in v],
            "step_s": statistics.fmean(a["step_s"] for a in v),
            "rollout_s": statistics.fmean(a["rollout_s"] for a in v),
            "gen_s": statistics.fmean(a["phase_s"]["gen_s"] for a in v),
            "judge_busy_s": statistics.fmean(a["phase_s"]["judge_busy_s"] for a in v),
            "train_s": statistics.fmean(a["phase_s"]["train_s"] for a in v),
            "cpu_util": statistics.fmean(a["cpu_util"] for a in v),
            "peak_rss_mb": statistics.fmean(a["peak_rss_mb"] for a in v),
        }
    if len(res.get("partial_merged", [])) == len(res["colocate"]) and len(res["colocate"]) > 1:
        c = out["colocate"]
        for n in ("partial", "partial_merged"):
            out[f"{n}_over_colocate"] = paired_ratio(
                out[n]["step_s_per_round"], c["step_s_per_round"]
            )
            out[f"{n}_over_colocate_rollout"] = paired_ratio(
                out[n]["rollout_s_per_round"], c["rollout_s_per_round"]
            )
        out["partial_merged_over_partial"] = paired_ratio(
            out["partial_merged"]["step_s_per_round"], out["partial"]["step_s_per_round"]
        )
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(out, indent=1))
print(json.dumps({k: v for k, v in out.items() if "over" in k}, indent=1))
