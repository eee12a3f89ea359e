"""Where over-dispatch's time goes on the long-tail settings (stop on "e" only, 96-token
budget): ratio 1 against 1.5 with the carried prompts redrawn (rollout.redraw_carried),
in rotated rounds. Per arm: the longest completion a controller trains on per step (read
from the rollout log), the mean completion length, and the generation and training
phases (timing/*, steps 2 on).

    .venv/bin/python bench/over_dispatch_lengths.py [STEPS] [ROUNDS] [OUT] [BACKEND]
    (defaults: 17 2 bench/placement/over_dispatch_lengths.json hf)

BACKEND vllm runs every arm with rollout.backend=vllm: run it with the vLLM venv's python
(bench/vllm_cpu_venv.sh) and VLLM_CPU_KVCACHE_SPACE=1 VLLM_ENABLE_V1_MULTIPROCESSING=0.
"""

import json
import statistics
import sys
import tempfile
from pathlib import Path

from mmyatt.placement import bench as B

steps = int(sys.argv[1]) if len(sys.argv) > 1 else 17
rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 2
ROOT = Path(__file__).resolve().parent.parent
dest = (
    Path(sys.argv[3]) if len(sys.argv) > 3 else ROOT / "bench/placement/over_dispatch_lengths.json"
)
tmp = Path(tempfile.mkdtemp(prefix="mmyatt-od-lengths-"))
policy, _ = B._models(tmp)
long_tail = ["sampling.max_new_tokens=96", 'sampling.stop=["e"]']
log = ["trainer.save_rollouts_every=1", "trainer.rollouts_per_step=1000"]
backend = sys.argv[4] if len(sys.argv) > 4 else "hf"
base = B._base(policy, steps) + long_tail + [*B.RULE, "placement.mode=shared", *log]
base.append(f"rollout.backend={backend}")
arms = {
    "1.0": ["rollout.over_dispatch_ratio=1.0"],
    "1.5": ["rollout.over_dispatch_ratio=1.5"],
    "1.5_redraw": ["rollout.over_dispatch_ratio=1.5", "rollout.redraw_carried=true"],
}
PHASES = ("step_s", "generate_s", "logprob_s", "update_s")
names, res = list(arms), {}
for k in range(rounds):
    for n in names[k % len(names) :] + names[: k % len(names)]:
        run = tmp / f"{n}_{k}"
        B._train(run, base + arms[n])
        rows = B._rows(run, first=2)
        got = {p: statistics.fmean(r[f"timing/{p}"] for r in rows) for p in PHASES}
        per_step: dict[tuple[int, int], list[int]] = {}
        for f in sorted((run / "rollouts").glob("rank*.jsonl")):
            for line in f.read_text().splitlines():
                s = json.loads(line)
                if s["step"] >= 2:
                    per_step.setdefault((s["step"], s["rank"]), []).append(s["length"])
        got["longest_trained_per_step"] = statistics.fmean(max(v) for v in per_step.values())
        got["mean_length"] = statistics.fmean(x for v in per_step.values() for x in v)
        res.setdefault(n, []).append(got)
        print(k, n, {x: round(v, 3) for x, v in got.items()}, flush=True)
out: dict = {
    "command": f"python bench/over_dispatch_lengths.py {steps} {rounds} {dest} {backend}",
    "rollout_backend": backend,
    "split": "train (synthetic arithmetic prompts)",
    "settings": long_tail,
}
for n, v in res.items():
    out[n] = {key: statistics.fmean(a[key] for a in v) for key in v[0]} | {"per_round": v}
dest.write_text(json.dumps(out, indent=1) + "\n")
print({n: {k: round(x, 3) for k, x in out[n].items() if k != "per_round"} for n in names})
