"""Colocate with its judge phase on 2 threads (its default, placement.judge_threads=0)
and on 1 (the placement bench's setting), against partial (its judge widened to every
core once generation ends), on the placement bench's judge-heavy settings: 3 rotated
rounds x 20 measured steps. Writes bench/placement/colocate_judge_threads.json.

    .venv/bin/python bench/placement_judge_threads.py

With ``measured``: colocate on 2 threads, on 1, and with its judge threads measured
(placement.judge_threads=-1), no partial arm; writes
bench/placement/colocate_judge_threads_measured.json.

    .venv/bin/python bench/placement_judge_threads.py measured
    .venv/bin/python bench/placement_judge_threads.py measured comparable   # 4-token judge

``comparable`` runs the judge_comparable workload's judge (4 tokens per sample) and
writes bench/placement/colocate_judge_threads_measured_comparable.json.
"""

import json
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

from mmyatt.placement import bench as B

tmp = Path(tempfile.mkdtemp(prefix="mmyatt-judge-threads-"))
policy, judge = B._models(tmp)
base = B._base(policy, 21)
MEASURED = sys.argv[1:2] == ["measured"]
COMPARABLE = sys.argv[2:3] == ["comparable"]
judge_args = B._judge(judge, B.COMPARABLE_JUDGE_TOKENS) if COMPARABLE else B._judge(judge)
arms = {
    "colocate_2threads": ["placement.mode=colocate", "placement.judge_threads=0"],
    "partial": ["placement.mode=partial"],
    "colocate_1thread": ["placement.mode=colocate", "placement.judge_threads=1"],
}
if MEASURED:
    del arms["partial"]
    arms["colocate_measured"] = ["placement.mode=colocate", "placement.judge_threads=-1"]
names = list(arms)
res = {}
for k in range(3):
    for n in names[k % len(names) :] + names[: k % len(names)]:
        a = B._arm(tmp, f"{n}_{k}", base + arms[n] + judge_args, 21)
        rows = B._rows(tmp / f"{n}_{k}", first=2)
        a["timing_means"] = {
            key: statistics.fmean(r[key] for r in rows if key in r)
            for key in sorted({k2 for r in rows for k2 in r if k2.startswith("timing/")})
        }
        a["judge_threads_per_step"] = [r.get("placement/judge_threads") for r in rows]
        res.setdefault(n, []).append(a)
        print(
            k,
            n,
            round(a["step_s"], 3),
            {x: round(v, 3) for x, v in a["phase_s"].items() if v},
            "rollout_s",
            round(a["rollout_s"], 3),
            flush=True,
        )
out = {
    n: {
        "step_s_per_round": [a["step_s"] for a in v],
        "step_s": statistics.fmean(a["step_s"] for a in v),
        "arms": v,
    }
    for n, v in res.items()
}
for n in ("partial", "colocate_measured"):
    for other in ("colocate_2threads", "colocate_1thread"):
        if n in out:
            per = [a["step_s"] / b["step_s"] for a, b in zip(res[n], res[other])]
            out[f"{n}_over_{other}"] = statistics.fmean(per)
            out[f"{n}_over_{other}_per_round"] = per
out["command"] = " ".join([".venv/bin/python bench/placement_judge_threads.py", *sys.argv[1:]])
name = "colocate_judge_threads_measured.json" if MEASURED else "colocate_judge_threads.json"
if COMPARABLE:
    name = name.replace(".json", "_comparable.json")
dest = Path(__file__).resolve().parent / "placement" / name
dest.write_text(json.dumps(out, indent=1, default=str) + "\n")
print({k: v for k, v in out.items() if "_over_" in k})

shutil.rmtree(tmp, ignore_errors=True)
