"""The GenRM image recipe (configs/flow_grpo_genrm_tiny.yaml) in each fixed placement mode,
side by side: R rotated rounds of S-step runs (evals off), step 2 on measured. Reports
per mode the median step and phase times, the judge's busy seconds per step, and the
share of core time that no process used in the shared step (placement/idle_frac_cores):
no placement can take more than that share off a step that keeps its work.

    .venv/bin/python bench/genrm_recipe_modes.py [STEPS] [ROUNDS] [OUT] [ARM,ARM,...]
    (defaults: 9 3 bench/placement/genrm_recipe_modes.json, the first four arms)

The fifth arm, colocate with its judge threads measured (placement.judge_threads=-1:
steps 2-3 on both cores, 4-5 on one thread, then the faster), runs when named:

    .venv/bin/python bench/genrm_recipe_modes.py 13 3 bench/placement/genrm_recipe_judge_threads.json shared,colocate,colocate_judge_1thread,colocate_judge_measured

Two arms run one judge server per core (reward.judge.num_servers=2, one thread each),
in shared and in colocate:

    .venv/bin/python bench/genrm_recipe_modes.py 9 4 bench/placement/genrm_recipe_judge_servers.json shared,shared_2servers,colocate_2servers
"""

import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from mmyatt.placement.bench import _rows

ROOT = Path(__file__).resolve().parent.parent
steps = int(sys.argv[1]) if len(sys.argv) > 1 else 9
rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 3
dest = Path(sys.argv[3]) if len(sys.argv) > 3 else ROOT / "bench/placement/genrm_recipe_modes.json"
arms = {
    "shared": ["placement.mode=shared"],
    # the judge phase on both cores (2 threads; the default until 2026-12-05, now measured)
    "colocate": ["placement.mode=colocate", "placement.judge_threads=0"],
    "colocate_judge_1thread": ["placement.mode=colocate", "placement.judge_threads=1"],
    "partial": ["placement.mode=partial"],
    "colocate_judge_measured": ["placement.mode=colocate", "placement.judge_threads=-1"],
    # one judge server per core, each on one thread (each judge call split between them)
    "shared_2servers": ["placement.mode=shared", "reward.judge.num_servers=2"],
    "colocate_2servers": [
        "placement.mode=colocate",
        "placement.judge_threads=0",
        "reward.judge.num_servers=2",
    ],
}
chosen = sys.argv[4].split(",") if len(sys.argv) > 4 else list(arms)[:4]
arms = {n: arms[n] for n in chosen}
KEYS = (
    "timing/step_s",
    "timing/generate_s",
    "timing/reward_s",
    "timing/logprob_s",
    "timing/update_s",
    "timing/judge_reload_s",
    "placement/judge_busy_s",
    "placement/idle_frac_cores",
    "placement/cpu_util",
)
tmp = Path(tempfile.mkdtemp(prefix="mmyatt-genrm-modes-"))
names, res = list(arms), {}
for k in range(rounds):
    for n in names[k % len(names) :] + names[: k % len(names)]:
        run = tmp / f"{n}_{k}"
        cmd = [sys.executable, "-m", "mmyatt", "train", "configs/flow_grpo_genrm_tiny.yaml"]
        cmd += [f"name={n}_{k}", f"trainer.steps={steps}", "trainer.max_minutes=null"]
        cmd += ["trainer.eval_every=0", "--run-dir", str(run), *arms[n]]
        t0 = time.perf_counter()
        subprocess.run(cmd, cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
        wall = time.perf_counter() - t0
        rows = _rows(run, first=2)
        got = {
            key: statistics.median(r[key] for r in rows if key in r)
            for key in KEYS
            if any(key in r for r in rows)
        }
        got.update(steps_measured=len(rows), wall_s=wall)
        got["judge_threads_per_step"] = [r.get("placement/judge_threads") for r in rows]
        res.setdefault(n, []).append(got)
        shown = {x.split("/")[1]: round(v, 3) for x, v in got.items() if "/" in x}
        print(k, n, shown, got["judge_threads_per_step"], flush=True)

out: dict = {"command": " ".join([".venv/bin/python bench/genrm_recipe_modes.py", *sys.argv[1:]])}
out.update(split="train (the recipe's RL prompts; no eval)", steps_per_run=steps, rounds=rounds)
for n, v in res.items():
    out[n] = {
        "step_s": statistics.fmean(a["timing/step_s"] for a in v),
        "step_s_per_round": [a["timing/step_s"] for a in v],
        "medians_per_round": v,
    }
for n in names[1:]:
    per = [a["timing/step_s"] / b["timing/step_s"] for a, b in zip(res[n], res["shared"])]
    out[f"{n}_over_shared"] = statistics.fmean(per)
    out[f"{n}_over_shared_per_round"] = per
idle = [a["placement/idle_frac_cores"] for a in res["shared"]]
out["shared_idle_frac_cores"] = statistics.fmean(idle)
out["shortest_possible_over_shared"] = 1.0 - statistics.fmean(idle)
dest.parent.mkdir(parents=True, exist_ok=True)
dest.write_text(json.dumps(out, indent=1) + "\n")
print({k: v for k, v in out.items() if "over_shared" in k or "idle" in k}, flush=True)
