"""`mmyatt bench text-grpo`: the same GRPO workload on one core and on two, the two-core
arms differing only in how the cores are used (threads or controllers)."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

from mmyatt.bench.runs import CONFIGS, machine, merge_profiles, train_run
from mmyatt.outputs.metrics import read_metrics

# (label, controllers, torch threads per controller): 1 core, and 2 cores used by threads
# or by controllers
TEXT_GRPO_ARMS = (("1proc", 1, 1), ("1proc_2threads", 1, 2), ("2proc", 2, 1))


def bench_text_grpo(quick: bool) -> dict:
    """The same GRPO workload (B=16 prompts x G=8 samples, 16 new tokens, tiny Qwen2) on
    1 controller x 1 thread, 1 controller x 2 threads (``trainer.threads=2``) and 2
    controllers x 1 thread each: the 2-core arms differ only in how the cores are used."""
    steps = 3 if quick else 8
    out: dict = {
        "benchmark": "text-grpo",
        "machine": machine(),
        "steps": steps,
        "warmup_steps_excluded": 1,
        "arms": {label: {"controllers": p, "threads": th} for label, p, th in TEXT_GRPO_ARMS},
    }
    with tempfile.TemporaryDirectory() as tmp:
        for label, p, threads in TEXT_GRPO_ARMS:
            rd = Path(tmp) / label
            wall = train_run(
                CONFIGS / "bench_text_grpo.yaml",
                rd,
                [
                    f"distributed.nproc={p}",
                    f"trainer.threads={threads}",
                    f"trainer.steps={steps}",
                ],
                env={"MMYATT_STEP_PROFILE": "step_profile"},
            )
            rows = [r for r in read_metrics(rd) if "timing/step_s" in r][1:]  # drop warm-up step
            secs = sum(r["timing/step_s"] for r in rows)
            samples = sum(r["rollout/samples"] for r in rows)
            tokens = sum(r["rollout/tokens"] for r in rows)
            phases = sorted(
                {
                    k[7:-6]
                    for r in rows
                    for k in r
                    if k.startswith("timing/") and k.endswith("_share")
                }
            )
            last = read_metrics(rd)[-1]
            rss = [v for k, v in sorted(last.items()) if k.startswith("memory/peak_rss_mb_rank")]
            out[f"samples_per_s_{label}"] = samples / secs
            out[f"tokens_per_s_{label}"] = tokens / secs
            out[f"step_s_{label}"] = secs / len(rows)
            out[f"phase_share_{label}"] = {
                ph: sum(r.get(f"timing/{ph}_share", 0) for r in rows) / len(rows) for ph in phases
            }
            out[f"peak_rss_mb_{label}"] = rss
            out[f"profile_{label}"] = merge_profiles(
                [json.loads(f.read_text()) for f in sorted(rd.glob("step_profile_rank*.json"))]
            )
            out[f"wall_s_{label}"] = wall
    out["load_average_at_end"] = [round(x, 2) for x in os.getloadavg()]
    out["peak_rss_mb_per_controller"] = out["peak_rss_mb_2proc"]
    one = out["samples_per_s_1proc"]
    out["speedup_2proc_over_1proc"] = out["samples_per_s_2proc"] / one
    out["speedup_1proc_2threads_over_1proc"] = out["samples_per_s_1proc_2threads"] / one
    out["speedup_2proc_over_1proc_2threads"] = (
        out["samples_per_s_2proc"] / out["samples_per_s_1proc_2threads"]
    )
    return out
