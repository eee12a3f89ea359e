"""One measured arm of the placement bench: the tiny workload's overrides, a training
run started as a user starts it, and the figures read back from its metrics.

Shared by the bench's workloads (``bench.py``) and its memory workload
(``bench_memory.py``).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from mmyatt.bench.runs import CONFIGS
from mmyatt.outputs.metrics import read_metrics

JUDGE_TOKENS = 16
# placement.judge_threads in every arm: 0 = one per core (the default until 2026-12-05,
# now -1, measured), so that the figures of record keep their meaning
COLOCATE_JUDGE_THREADS = 0
STOP = ["e", "1"]  # a completion token holding one of these ends it: geometric lengths

CORPUS = [
    "Question: 12+30= Answer: 42 Is the answer correct? Score: 7",
    "Question: 8+5= Answer: 13 Score: 3 the rate of a tone at noon",
] * 60


def run_overrides(steps: int) -> list[str]:
    """A measured run of ``steps`` steps on 2 controllers of one thread each: no SFT,
    no dynamic sampling, no evaluation, no rollout log, no progress bar."""
    return [
        "algorithm.dynamic_sampling=false",
        "sft.enabled=false",
        f"trainer.steps={steps}",
        "trainer.max_minutes=null",
        "trainer.eval_every=0",
        "trainer.save_rollouts_every=0",
        "trainer.progress=false",
        "trainer.threads=1",
        "distributed.nproc=2",
    ]


def base_overrides(policy: Path, steps: int) -> list[str]:
    return [
        f"model.path={policy}",
        "model.max_prompt_tokens=8",
        "data.synthetic_train_size=2000",
        "data.synthetic_eval_size=8",
        "data.eval_prompts=8",
        "data.prompts_per_step=8",
        "sampling.group_size=8",
        "sampling.max_new_tokens=48",
        f"sampling.stop={json.dumps(STOP)}",
        *run_overrides(steps),
        "placement.profile_steps=2",  # auto: medians of 2 measured steps per plan
        "placement.stream_groups=2",  # 2 chunks of 2 groups per controller and step
        # colocate's judge phase on every core (its default): on quiet cores a judge on
        # both is faster than on one, and partial's judge takes both cores once generation
        # ends. On cores under other load a 2-thread judge can be many times slower.
        f"placement.judge_threads={COLOCATE_JUDGE_THREADS}",
    ]


def judge_overrides(judge: Path, tokens: int = JUDGE_TOKENS) -> list[str]:
    return [
        "reward.functions=[{name: numeric_match, weight: 1.0}, {name: genrm, weight: 0.5, "
        f"kwargs: {{mode: score, template: score_text_1_10, max_tokens: {tokens}}}}}]",
        f"reward.judge.model={judge}",
        "reward.judge.max_batch=64",
    ]


RULE = ["reward.functions=[{name: numeric_match, weight: 1.0}]"]

# drifting: the segments' sampling. First the judge-heavy workload's geometric lengths;
# then every completion runs to a doubled cap, as when response length grows until
# truncation dominates (the judge reads the longer completions: its call grows too)
DRIFT_JUDGE_TOKENS = 4  # a judge that answers with a short score
COMPARABLE_JUDGE_TOKENS = DRIFT_JUDGE_TOKENS  # judge_comparable: the same short answer
DRIFT = {
    "short": [],
    "long": ["sampling.max_new_tokens=96", "sampling.stop=[]"],
}


def train_arm_run(run_dir: Path, overrides: list[str]) -> None:
    cmd = [sys.executable, "-m", "mmyatt", "train", str(CONFIGS / "text_grpo_tiny.yaml")]
    cmd += ["--run-dir", str(run_dir), *overrides]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        raise RuntimeError(
            f"placement bench run failed ({' '.join(cmd)}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
        )


def measured_rows(run_dir: Path, first: int = 1) -> list[dict]:

    return [r for r in read_metrics(run_dir) if "timing/step_s" in r and r["step"] >= first]


def arm_summary(rows: list[dict]) -> dict:
    """Measured steps (warm-up left out by the caller) -> the figures of one arm."""

    def mean(key):
        vals = [r[key] for r in rows if isinstance(r.get(key), int | float)]
        return statistics.fmean(vals) if vals else None

    def by_phase(metric):  # the largest of each phase's placement/<metric>_<phase>
        return {
            ph: max((r.get(f"placement/{metric}_{ph}", 0.0) for r in rows), default=0.0)
            for ph in ("generate", "judge", "train")
        }

    out = {
        "steps_measured": len(rows),
        "step_s": mean("timing/step_s"),
        "total_s": sum(r["timing/step_s"] for r in rows),
        "modes_run": [r.get("placement/mode") for r in rows],
        "splits_run": [r.get("placement/split") for r in rows],
        "cpu_util": mean("placement/cpu_util"),
        "idle_frac": {
            role: mean(f"placement/idle_frac_{role}")
            for role in ("rollout", "judge", "train", "cores")
        },
        "phase_s": {k: mean(f"placement/{k}") for k in ("gen_s", "train_s", "judge_busy_s")},
        # the rollout phase (generation and judging until every controller holds its
        # rewards), the phase G-Core's partial coexistence shortens
        "rollout_s": mean("placement/rollout_s"),
        "judge_reload_s": mean("placement/judge_reload_s"),
        "peak_rss_mb": max((r.get("placement/peak_rss_mb", 0.0) for r in rows), default=None),
        "peak_rss_mb_by_phase": by_phase("peak_rss_mb"),
        # on CUDA: the controllers' and the judge's allocators, summed (absent on the CPU)
        "peak_device_mb_by_phase": by_phase("peak_device_mb"),
        "response_length_mean": mean("response_length/mean"),
        "response_truncated_frac": mean("response_length/truncated_frac"),
    }
    pred = [
        (r["placement/predicted_step_s"], r["timing/step_s"])
        for r in rows
        if "placement/predicted_step_s" in r
    ]
    if pred:
        out["auto_predicted_vs_actual"] = [[round(p, 4), round(a, 4)] for p, a in pred]
    return out


def run_arm(tmp: Path, name: str, overrides: list[str], steps: int) -> dict:
    rd = tmp / name
    t0 = time.perf_counter()
    train_arm_run(rd, overrides + [f"trainer.steps={steps}"])
    out = arm_summary(measured_rows(rd, first=2))
    out["wall_s"] = time.perf_counter() - t0
    return out
