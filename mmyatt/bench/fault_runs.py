"""The fault jobs of ``mmyatt bench faults`` and how they are run and read from outside:
the tiny jobs and their configs, the reward script that marks and holds step 3, starting,
waiting for and killing a run's process tree, and what a run's files and log say about
where a fault landed and where the rerun resumed (:mod:`mmyatt.bench.faults` has the
scenarios)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch

CONFIG = Path(__file__).resolve().parents[2] / "configs" / "text_grpo_tiny.yaml"
JOB = [
    "model.tiny_size=qwen2-0.1m",
    "data.synthetic_train_size=400",
    "data.synthetic_eval_size=16",
    "data.eval_prompts=16",
    "data.prompts_per_step=4",
    "sampling.group_size=4",
    "sampling.max_new_tokens=4",
    "algorithm.dynamic_sampling=false",
    "sft.enabled=false",
    "trainer.steps=6",
    "trainer.max_minutes=null",
    "trainer.progress=false",
    "trainer.save_rollouts_every=0",
    "checkpoint.save_every=2",
    "distributed.nproc=2",
    "optim.lr=0.01",
    "reward.functions=[{name: 'faultreward:reward'}]",
]
REWARD = """
import json, os, time
calls = 0
held = False
def delay_saves(seconds):
    # widen the window in which a kill lands between a checkpoint's data files and its
    # completion marker: the rank that writes the marker waits first (this controller's
    # Checkpointer, patched here; the library has no fault hook)
    from mmyatt.checkpoint.checkpointer import Checkpointer
    wait = Checkpointer._wait_for_ranks
    if getattr(wait, "delayed", False):
        return
    def wait_then_delay(self, tmp, step):
        wait(self, tmp, step)
        time.sleep(seconds)
    wait_then_delay.delayed = True
    Checkpointer._wait_for_ranks = wait_then_delay
def reward(completion, record):
    global calls, held
    calls += 1
    nan_calls = os.environ.get("FAULT_NAN_CALLS")
    if nan_calls:
        lo, hi = map(int, nan_calls.split("-"))
        if lo <= calls <= hi:
            return float("nan")
    delay_from = os.environ.get("FAULT_SAVE_DELAY_FROM_CALL")
    if delay_from and calls >= int(delay_from):  # delay only the saves after this call
        delay_saves(float(os.environ["FAULT_SAVE_DELAY_S"]))
    mark = os.environ.get("FAULT_MARK_CALLS")
    if mark and not held and os.path.exists(os.environ["FAULT_ARM"]):
        lo, hi = map(int, mark.split("-"))
        if lo <= calls <= hi:  # inside the step under test: say so, then hold the step
            held = True
            rank, pid = os.environ.get("RANK", "0"), os.getpid()
            info = {"rank": int(rank), "pid": pid, "call": calls, "time": time.time()}
            path = os.path.join(os.environ["FAULT_MARK_DIR"], f"rank{rank}_pid{pid}.json")
            with open(path + ".tmp", "w") as f:
                json.dump(info, f)
            os.rename(path + ".tmp", path)
            time.sleep(float(os.environ.get("FAULT_HOLD_S", "5")))
    return len(completion) / 10.0
"""
# Each controller's reward calls: the step-0 eval scores 8 prompts per rank, then every
# step scores 8 samples per rank, so calls 25-32 of a controller are step 3.
STEP3_CALLS = "25-32"
STEP4_FIRST_CALL = 33
STEPS = 6  # trainer.steps of every job


# a judge's "yes" and "no" token sets: printable ASCII by parity of the code point
YES = [chr(c) for c in range(33, 127) if c % 2 == 0]
NO = [chr(c) for c in range(33, 127) if c % 2 == 1]


def judge_job(judge_dir: Path) -> list[str]:
    kwargs = {"mode": "yes_prob", "template": "yes_no_correct", "yes_tokens": YES, "no_tokens": NO}
    return [
        *JOB[:-1],
        f"reward.functions=[{json.dumps({'name': 'genrm', 'kwargs': kwargs})}]",
        f"reward.judge.model={judge_dir}",
        "reward.judge.max_batch=1",  # a batch of one: answers do not depend on batching
        "reward.judge.max_retries=10",  # 10-20 s: outlasts a judge restart
    ]


VLM_CONFIG = CONFIG.parent / "vlm_grpo_image_tiny.yaml"
MEDIA_JOB = [
    "data.eval_prompts=8",
    "data.prompts_per_step=4",
    "data.bad_lines=skip",
    "sampling.group_size=4",
    "sampling.max_new_tokens=3",
    "algorithm.dynamic_sampling=false",
    "sft.enabled=false",
    "trainer.steps=6",
    "trainer.eval_every=0",
    "trainer.max_minutes=null",
    "trainer.progress=false",
    "trainer.save_rollouts_every=0",
    "checkpoint.save_every=2",
    "distributed.nproc=2",
]


def start_run(
    tmp: Path,
    run: Path,
    env_extra: dict | None = None,
    job: list[str] = JOB,
    config: Path = CONFIG,
) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(tmp), OMP_NUM_THREADS="1", **(env_extra or {}))
    cmd = [sys.executable, "-m", "mmyatt", "train", str(config), *job, "--run-dir", str(run)]
    log = (run.parent / f"{run.name}.log").open("a")
    return subprocess.Popen(
        cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
    )


def wait_for(pred, proc: subprocess.Popen, timeout: float = 300) -> bool:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if pred():
            return True
        if proc.poll() is not None:
            return False
        time.sleep(0.05)
    return False


def step_logged(run: Path, step: int):
    def pred() -> bool:
        p = run / "metrics.jsonl"
        if not p.exists():
            return False
        return any(
            json.loads(x).get("step") == step and "reward/mean" in json.loads(x)
            for x in p.read_text().splitlines()
            if x.strip()
        )

    return pred


def drawn_records(run: Path) -> dict[int, set[int]]:
    out: dict[int, set[int]] = {}
    for f in sorted((run / "rollouts").glob("records_rank*.jsonl")):
        for line in f.read_text().splitlines():
            row = json.loads(line)
            out.setdefault(row["step"], set()).update(row["records"])
    return out


def records_lost(ref: Path, run: Path) -> int:
    a, b = drawn_records(ref), drawn_records(run)
    lost = 0
    for step in set(a) | set(b):
        lost += len(a.get(step, set()) ^ b.get(step, set()))
    return lost


def weights_equal(ref: Path, run: Path) -> bool:
    from safetensors.torch import load_file

    wa = load_file(str(ref / "checkpoints" / "final" / "model.safetensors"))
    wb = load_file(str(run / "checkpoints" / "final" / "model.safetensors"))
    return wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


def wait_exit(proc: subprocess.Popen, timeout: float = 420) -> int:
    """The exit code; a run still going after ``timeout`` is killed (code -9: a hang)."""
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_tree(proc, signal.SIGKILL)
        proc.wait()
        return -9


def finish_run(tmp: Path, run: Path, env: dict | None = None, **kw) -> int:
    return wait_exit(start_run(tmp, run, env, **kw))


def kill_tree(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        pass


def last_metrics(run: Path) -> dict:
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x.strip()]
    return rows[-1] if rows else {}


# ---- from outside: where a fault landed and where the rerun resumed ----------------

RESUME_LINE = re.compile(r"\[resume\] from (\S*?step_(\d+)): continuing at step (\d+)")


def _logged_steps(run: Path) -> list[int]:
    """Steps that metrics.jsonl holds a training row for (a row is written when a step
    has finished)."""
    p = run / "metrics.jsonl"
    if not p.exists():
        return []
    rows = [json.loads(x) for x in p.read_text().splitlines() if x.strip()]
    return sorted({r["step"] for r in rows if "reward/mean" in r})


def complete_checkpoints(run: Path) -> list[int]:
    state = run / "checkpoints" / "state"
    return sorted(int(p.parent.name[5:]) for p in state.glob("step_*/COMPLETE"))


def arm(run: Path, hold_s: float) -> tuple[dict, Path]:
    """Env that makes every controller, in its step-3 reward, write a marker file (rank,
    pid) and then hold the step for ``hold_s``; and the marker folder. The markers are
    written only while the folder's ARMED file exists."""
    marks = run.parent / f"{run.name}.marks"
    marks.mkdir(parents=True, exist_ok=True)
    (marks / "ARMED").touch()
    env = {
        "FAULT_MARK_CALLS": STEP3_CALLS,
        "FAULT_MARK_DIR": str(marks),
        "FAULT_ARM": str(marks / "ARMED"),
        "FAULT_HOLD_S": str(hold_s),
    }
    return env, marks


def read_markers(marks: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted(marks.glob("rank*_pid*.json"))]


def fault_facts(run: Path, marks: Path | None = None) -> dict:
    """What the run's files say right after a fault landed: the steps logged as finished,
    the complete checkpoints, the partial ones, and which controllers were inside the
    step under test (their step-3 reward had started: ``markers``)."""
    logged = _logged_steps(run)
    state = run / "checkpoints" / "state"
    return {
        "last_logged_step": logged[-1] if logged else 0,
        "complete_checkpoints": complete_checkpoints(run),
        "partial_checkpoints": sorted(
            int(p.name[5:13]) for p in state.glob("step_*.tmp") if not (p / "COMPLETE").exists()
        ),
        "markers": read_markers(marks) if marks is not None else [],
    }


def landed_mid_step(facts: dict, step: int) -> bool:
    """The fault hit inside ``step``: a controller had started the step's reward and the
    step had not finished (metrics.jsonl has step - 1, not ``step``)."""
    return bool(facts["markers"]) and facts["last_logged_step"] == step - 1


def landed_mid_save(facts: dict, step: int) -> bool:
    """The fault hit while the checkpoint of ``step`` was written: its folder is there
    without a completion marker, and it is not among the complete checkpoints."""
    return step in facts["partial_checkpoints"] and step not in facts["complete_checkpoints"]


def resume_facts(log: str, expect_from: int | None) -> dict:
    """The rerun's "[resume] from ...step_N: continuing at step M" lines, and whether it
    resumed exactly once, from the checkpoint of ``expect_from`` at the step after it."""
    found = [(int(m.group(2)), int(m.group(3))) for m in RESUME_LINE.finditer(log)]
    ok = expect_from is not None and len(found) == 1 and found[0] == (expect_from, expect_from + 1)
    return {
        "resume_lines": len(found),
        "resumed_from_step": found[0][0] if found else None,
        "continued_at_step": found[0][1] if found else None,
        "resumed_from_checkpoint": bool(ok),
    }


def log_text(tmp: Path, run: Path, offset: int = 0) -> str:
    p = tmp / f"{run.name}.log"
    return p.read_text(errors="replace")[offset:] if p.exists() else ""


def log_size(tmp: Path, run: Path) -> int:
    return len(log_text(tmp, run))


def wait_marked(marks: Path, proc: subprocess.Popen, run: Path, ckpt: int, rank=None) -> bool:
    """Until a controller (of ``rank``, if given) is inside step 3 and the checkpoint of
    ``ckpt`` is complete."""

    def pred() -> bool:
        ms = [m for m in read_markers(marks) if rank is None or m["rank"] == rank]
        return bool(ms) and ckpt in complete_checkpoints(run)

    return wait_for(pred, proc)
