"""How much of partial's rollout phase would one generating process save? On the
placement bench's judge-heavy settings (2 cores, the same 8 prompts x 8 samples per step,
the same judge), partial with one controller generating all 64 samples on the rollout
core, against partial and colocate with the bench's two controllers. Compares the
rollout phase (``placement/rollout_s``: generation and judging until every controller
holds its rewards); the training phase differs (one process instead of two) and is not
compared. 3 rotated rounds x 10 measured steps.
Writes bench/placement/one_rollout_process.json; with ``comparable``, the bench's
judge_comparable workload instead (the judge answers in 4 tokens), written to
bench/placement/one_rollout_process_comparable.json.

    .venv/bin/python bench/placement_one_rollout_process.py              # ~8 min
    .venv/bin/python bench/placement_one_rollout_process.py comparable   # ~7 min
"""

import json
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

from mmyatt.placement import bench as B
from mmyatt.placement.bench_figures import paired_ratio

STEPS = 11
tmp = Path(tempfile.mkdtemp(prefix="mmyatt-one-rollout-"))
policy, judge = B._models(tmp)
COMPARABLE = sys.argv[1:] == ["comparable"]
tokens = B.COMPARABLE_JUDGE_TOKENS if COMPARABLE else B.JUDGE_TOKENS
base = B._base(policy, STEPS) + B._judge(judge, tokens)
arms = {
    "colocate_2_controllers": ["placement.mode=colocate"],
    "partial_2_controllers": ["placement.mode=partial"],
    "partial_1_controller": ["placement.mode=partial", "distributed.nproc=1"],
}
names = list(arms)
res: dict[str, list] = {}
for k in range(3):
    for n in names[k % 3 :] + names[: k % 3]:
        a = B._arm(tmp, f"{n}_{k}", base + arms[n], STEPS)
        res.setdefault(n, []).append(a)
        print(
            k + 1, n, "step", round(a["step_s"], 3), "rollout", round(a["rollout_s"], 3), flush=True
        )
out: dict = {
    n: {
        "rollout_s_per_round": [a["rollout_s"] for a in v],
        "rollout_s": statistics.fmean(a["rollout_s"] for a in v),
        "gen_s": statistics.fmean(a["phase_s"]["gen_s"] for a in v),
        "judge_busy_s": statistics.fmean(a["phase_s"]["judge_busy_s"] for a in v),
        "step_s": statistics.fmean(a["step_s"] for a in v),
        "arms": v,
    }
    for n, v in res.items()
}
c = out["colocate_2_controllers"]["rollout_s_per_round"]
for n in ("partial_2_controllers", "partial_1_controller"):
    out[f"{n}_over_colocate_rollout"] = paired_ratio(out[n]["rollout_s_per_round"], c)
out["command"] = ".venv/bin/python bench/placement_one_rollout_process.py" + (
    " comparable" if COMPARABLE else ""
)
out["judge_tokens_per_sample"] = tokens
name = "one_rollout_process" + ("_comparable" if COMPARABLE else "")
dest = Path(__file__).resolve().parent / "placement" / f"{name}.json"
dest.write_text(json.dumps(out, indent=1, default=str) + "\n")
print({k: v for k, v in out.items() if k.endswith("_rollout")})
shutil.rmtree(tmp, ignore_errors=True)
