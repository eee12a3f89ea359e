"""One judge server with its threads against two servers of one thread each
(``reward.judge.num_servers``), in shared, colocate and partial, on the placement bench's
judge-heavy settings (2 controllers, 2 cores, 16-token judge): 3 rotated rounds x 20
measured steps. Writes bench/placement/judge_servers.json.

    .venv/bin/python bench/placement_judge_servers.py

Every arm keeps the bench's other settings (colocate's judge on one thread per core, as
in the figures of record). Two servers split each judge call between them, one thread
each; in partial both sit on the judge's core until generation ends.
"""

import json
import shutil
import tempfile
from pathlib import Path

from mmyatt.placement import bench as B
from mmyatt.placement.bench_figures import paired_ratio

tmp = Path(tempfile.mkdtemp(prefix="mmyatt-judge-servers-"))
policy, judge = B._models(tmp)
base = B._base(policy, 21) + B._judge(judge)
arms = {
    f"{mode}_{n}server": [f"placement.mode={mode}", f"reward.judge.num_servers={n}"]
    for mode in ("shared", "colocate", "partial")
    for n in (1, 2)
}
FIGURES = {"step_s": "timing/step_s", "rollout_s": "placement/rollout_s"}
runs = B._arm_rounds(tmp, "judge_servers", base, arms, 3, FIGURES)
out: dict = {"arms": B._arm_means(runs, "step_s"), "runs": runs}


def steps_of(arm: str) -> list[float]:
    return [r["step_s"] for r in runs[arm]]


ratios = {}
for mode in ("shared", "colocate", "partial"):  # two servers over one, per mode
    ratios[f"{mode}_2servers_over_1server"] = paired_ratio(
        steps_of(f"{mode}_2server"), steps_of(f"{mode}_1server")
    )
for n in (1, 2):  # the modes against each other at each server count
    for a, b in (("partial", "colocate"), ("shared", "colocate")):
        ratios[f"{a}_over_{b}_{n}server"] = paired_ratio(
            steps_of(f"{a}_{n}server"), steps_of(f"{b}_{n}server")
        )
out["ratios"] = ratios
out["split"] = "train (synthetic prompts)"
out["command"] = ".venv/bin/python bench/placement_judge_servers.py"
Path("bench/placement/judge_servers.json").write_text(json.dumps(out, indent=2) + "\n")
for k, v in ratios.items():
    print(k, round(v["geo_mean"], 3), [round(x, 3) for x in v["per_round"]])
shutil.rmtree(tmp, ignore_errors=True)
