"""Auto's profiling is a fixed cost: how much of it is left on a longer run. Auto
against partial (the best fixed mode there) on the placement bench's judge_comparable
workload, 61 steps per arm (step 1 is warm-up, left out), 3 rounds in alternating order.
Besides the ratio over all 60 measured steps, the ratio over the first 20 of them (what
the bench measures) from the same runs. Writes bench/placement/auto_run_length.json.

    .venv/bin/python bench/placement_auto_run_length.py   # ~8 min
"""

import json
import shutil
import statistics
import tempfile
from pathlib import Path

from mmyatt.placement import bench as B
from mmyatt.placement.bench_figures import paired_ratio

STEPS, ROUNDS, FIRST = 61, 3, 20
tmp = Path(tempfile.mkdtemp(prefix="mmyatt-auto-length-"))
policy, judge = B._models(tmp)
base = B._base(policy, STEPS) + B._judge(judge, B.COMPARABLE_JUDGE_TOKENS)
names = ["partial", "auto"]
res: dict[str, list[dict]] = {n: [] for n in names}
for k in range(ROUNDS):
    for n in names if k % 2 == 0 else names[::-1]:
        B._train(tmp / f"{n}_{k}", base + [f"placement.mode={n}", f"trainer.steps={STEPS}"])
        rows = B._rows(tmp / f"{n}_{k}", first=2)
        steps = [r["timing/step_s"] for r in rows]
        modes = [r.get("placement/mode") for r in rows]
        res[n].append(
            {
                "steps_measured": len(steps),
                "step_s": statistics.fmean(steps),
                "step_s_first": statistics.fmean(steps[:FIRST]),
                "modes_run": modes,
                "step_s_per_step": steps,
            }
        )
        print(f"round {k + 1} {n}: {res[n][-1]['step_s']:.3f} s/step", flush=True)
out = {
    "benchmark": "placement_auto_run_length",
    "workload": "judge_comparable (placement bench), train split",
    "steps_per_run": STEPS,
    "warmup_steps_excluded": 1,
    "rounds": ROUNDS,
    "arms": res,
    "auto_over_partial_all_steps": paired_ratio(
        [a["step_s"] for a in res["auto"]], [a["step_s"] for a in res["partial"]]
    ),
    f"auto_over_partial_first_{FIRST}_steps": paired_ratio(
        [a["step_s_first"] for a in res["auto"]], [a["step_s_first"] for a in res["partial"]]
    ),
}
# auto's steps in partial against the partial arm's same steps (the same work: the same
# seeds give the same samples in every mode), after auto's first 2 partial steps
after = []
for a, p in zip(res["auto"], res["partial"]):
    idx = [i for i, m in enumerate(a["modes_run"]) if m == "partial"][2:]
    after.append(
        statistics.fmean(a["step_s_per_step"][i] for i in idx)
        / statistics.fmean(p["step_s_per_step"][i] for i in idx)
    )
out["auto_partial_steps_over_partial_same_steps"] = after
dest = Path(__file__).parent / "placement" / "auto_run_length.json"
dest.write_text(json.dumps(out, indent=2) + "\n")
print(json.dumps({k: v for k, v in out.items() if k.startswith("auto_over")}, indent=1))
shutil.rmtree(tmp, ignore_errors=True)
