"""Partial's rollout core holds both controllers on 2 cores. This probe asks what it
would gain if one process generated both controllers' samples in one batch instead of
two processes taking turns on the core: each arm pinned to core 0 on 1 thread, the
placement bench's tiny policy and sampling (geometric lengths, cap 48), 8 prompts x 8
samples in all; the median wall time of 8 calls per arm, 3 rounds, arms in turn.
Writes bench/placement/merged_generation.json.

    .venv/bin/python bench/placement_merged_generation.py   # ~1 min
"""

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from mmyatt.models.builtin.tiny import build_tiny_text_model
from mmyatt.placement.bench import CORPUS

CHILD = r"""
import os, sys, time, torch
os.sched_setaffinity(0, {0}); torch.set_num_threads(1)
from mmyatt.models.text import TextPolicy
from mmyatt.placement.bench import STOP
from mmyatt.protocols import Sampling
pol = TextPolicy.load(sys.argv[1])
first, prompts, reps = int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
recs = [{"prompt": f"Question: {i}+{i * 3}= Answer:", "answer": str(4 * i), "_index": i}
        for i in range(16)]
s = Sampling(max_new_tokens=48, stop=tuple(STOP))
pol.generate(recs[:2], 8, s, seeds=[7, 8])  # warm-up
print("ready", flush=True); sys.stdin.readline()
for r in range(reps):
    seeds = [1000 * r + i for i in range(first, first + prompts)]
    t = time.perf_counter(); out = pol.generate(recs[first:first + prompts], 8, s, seeds=seeds)
    print(time.perf_counter() - t, float(out.mask.sum()), flush=True); sys.stdin.readline()
"""
REPS = 8
if 0 not in os.sched_getaffinity(0):
    raise SystemExit("this probe pins to core 0, which this process may not use")
policy = build_tiny_text_model(
    Path(tempfile.mkdtemp(prefix="mmyatt-merge-")) / "policy",
    size="qwen2-1m",
    corpus=CORPUS,
    seed=0,
)


def arm(specs: list[tuple[int, int]]) -> dict:
    """Processes (first prompt, prompts) started together on core 0: median wall time of
    a call until every process has its samples, and the tokens generated per call."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-c", CHILD, str(policy)]
    procs = [
        subprocess.Popen(
            [*cmd, str(a), str(b), str(REPS)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        for a, b in specs
    ]
    for p in procs:
        assert p.stdout.readline().strip() == "ready"
    walls, tokens = [], []
    for _ in range(REPS):
        t = time.perf_counter()
        for p in procs:
            p.stdin.write("\n")
            p.stdin.flush()
        lines = [p.stdout.readline().split() for p in procs]
        walls.append(time.perf_counter() - t)
        tokens.append(sum(float(x[1]) for x in lines))
    for p in procs:
        p.stdin.write("\n")
        p.stdin.flush()
        p.wait()
    return {"wall_s": sorted(walls)[REPS // 2], "tokens_per_call": sum(tokens) / REPS}


out: dict = {"arms": {}}
specs = {
    "two_processes_32_samples_each": [(0, 4), (4, 4)],
    "one_process_64_samples": [(0, 8)],
    "one_process_32_samples": [(0, 4)],
}
for k in range(3):
    for name, spec in specs.items():
        out["arms"].setdefault(name, []).append(arm(spec))
        print(f"round {k + 1} {name}: {out['arms'][name][-1]}", flush=True)
walls = {name: [a["wall_s"] for a in arms] for name, arms in out["arms"].items()}
out["one_process_64_over_two_processes"] = [
    a / b for a, b in zip(walls["one_process_64_samples"], walls["two_processes_32_samples_each"])
]
path = Path(__file__).parent / "placement" / "merged_generation.json"
path.write_text(json.dumps(out, indent=1) + "\n")
print(json.dumps({k: v for k, v in out.items() if k != "arms"}, indent=1))
