"""`mmyatt bench faults`: inject faults into real runs and count what survives.

Three tiny jobs on 2 controllers (checkpoint every 2 steps), each compared with an
uninterrupted reference run of the same job (or, for corrupt media, with the records
the sharding rules say each controller must read):

Text GRPO, rule reward:

* ``kill_during_step``: SIGKILL the whole process tree while step 3 runs, restart.
* ``kill_during_save``: SIGKILL while the step-4 checkpoint is being written (a delay
  before its completion marker, in step 4's saves only, widens the window), restart;
  the partial checkpoint must be ignored and the step-2 one resumed.
* ``sigterm``: SIGTERM to every process while step 3 runs; the run finishes the step,
  saves it and exits 0; restart.
* ``nan_reward``: the reward is NaN for one step; that step is skipped and counted.
* ``controller_dies_rank0`` / ``_rank1``: SIGKILL one controller only, inside step 3,
  with ``distributed.max_restarts=1``: torchrun restarts the group, which resumes from
  the last complete checkpoint by itself.

Where each fault landed and where the rerun resumed are checked from outside the run
and recorded: the reward function of the faulted runs writes a marker file (rank, pid)
when a controller starts scoring step 3 and then holds that step, and the kill is sent
only once a marker is there; right after it, ``metrics.jsonl`` must end at step 2 (step
3 never finished: ``landed``) and the complete checkpoints are listed. For the kill
during a save, the step-4 checkpoint folder must be there without its completion
marker. The rerun's log must hold exactly one "[resume] from .../step_N: continuing at
step N+1" line naming the last complete checkpoint (``resumed_from_checkpoint``). A
scenario survives only if its fault landed where it was aimed and the rerun resumed.

Text GRPO, GenRM reward from a judge server started with the run (an untrained tiny
text judge served by ``mmyatt.serving.server``, one request per model call so
that its answers are deterministic; the reward is its next-token mass on one set of
tokens against another: meaningless as a task, but sample-dependent and exact, which
is what a fault test needs):

* ``judge_crash``: SIGKILL the judge server after step 2; the judge pool restarts it on
  the same port, the controllers' clients retry until it answers, the run goes on.
* ``judge_gone``: the same kill with judge restarts off and a short retry budget: the
  run must stop with an error naming the judge URL after checkpointing its last
  complete step; a rerun (with a judge again) resumes from that checkpoint.

VLM GRPO on image questions (``data.bad_lines=skip``):

* ``corrupt_media``: some images truncated, some overwritten with garbage, some
  deleted. The run finishes, every bad record is skipped and counted in
  ``data/skipped``, and every controller reads exactly the good records it owns, in
  order. The same manifest with ``data.bad_lines=fail`` must stop with an error naming
  the manifest file and line and the image file.

``records_lost`` counts manifest records that the reference run drew at some step and
the faulted run did not draw at that step, plus records drawn that the reference did
not draw (repeats); a resumed run must match record for record. ``exact`` says whether
the final weights are bitwise equal to the reference's.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import tempfile
import time
from functools import partial
from pathlib import Path

from mmyatt.bench.fault_runs import (
    JOB,
    MEDIA_JOB,
    REWARD,
    STEP4_FIRST_CALL,
    STEPS,
    VLM_CONFIG,
    arm,
    complete_checkpoints,
    drawn_records,
    fault_facts,
    finish_run,
    judge_job,
    kill_tree,
    landed_mid_save,
    landed_mid_step,
    last_metrics,
    log_size,
    log_text,
    read_markers,
    records_lost,
    resume_facts,
    start_run,
    step_logged,
    wait_exit,
    wait_for,
    wait_marked,
    weights_equal,
)
from mmyatt.datasets.manifest import ShardedManifest
from mmyatt.datasets.vision_tasks import write_shape_task
from mmyatt.models.builtin.tiny import build_tiny_text_model
from mmyatt.serving.pool import check_health


def _resumed_report(name, injected, landed, facts, rc, ref, run, resumed) -> dict:
    out = _report(name, injected, rc, ref, run)
    out["landed"] = bool(landed)
    out["at_fault"] = {k: v for k, v in facts.items() if k != "markers"}
    out["at_fault"]["ranks_in_step"] = sorted({m["rank"] for m in facts["markers"]})
    out.update(resumed)
    out["survived"] = bool(out["survived"] and landed and resumed["resumed_from_checkpoint"])
    return out


def scenario_kill_during_step(tmp: Path, ref: Path) -> dict:
    """SIGKILL every process while step 3 runs (a controller is inside its step-3 reward,
    step 2 is checkpointed); the rerun must resume from step 2 at step 3."""
    run = tmp / "kill_step"
    env, marks = arm(run, hold_s=30)
    proc = start_run(tmp, run, env)
    injected = wait_marked(marks, proc, run, 2)
    kill_tree(proc, signal.SIGKILL)
    proc.wait()
    facts = fault_facts(run, marks)
    landed = injected and landed_mid_step(facts, 3)
    offset = log_size(tmp, run)
    rc = finish_run(tmp, run)
    last = facts["complete_checkpoints"][-1] if facts["complete_checkpoints"] else None
    resumed = resume_facts(log_text(tmp, run, offset), last)
    return _resumed_report("kill_during_step", injected, landed, facts, rc, ref, run, resumed)


def scenario_kill_during_save(tmp: Path, ref: Path) -> dict:
    """SIGKILL every process while the step-4 checkpoint is written (every rank's files
    are in, rank 0 holds before the completion marker); the rerun must ignore the
    partial checkpoint and resume from step 2."""
    run = tmp / "kill_save"
    # rank 0 holds 30 s before writing the completion marker, from step 4's reward on:
    # the step-2 checkpoint completes as usual
    env = {"FAULT_SAVE_DELAY_FROM_CALL": str(STEP4_FIRST_CALL), "FAULT_SAVE_DELAY_S": "30"}
    proc = start_run(tmp, run, env)
    state = run / "checkpoints" / "state"
    injected = wait_for(
        lambda: (
            (state / "step_00000004.tmp" / "rank1.done").exists() and 2 in complete_checkpoints(run)
        ),
        proc,
    )
    time.sleep(0.5)
    kill_tree(proc, signal.SIGKILL)
    proc.wait()
    facts = fault_facts(run)
    landed = injected and landed_mid_save(facts, 4)
    offset = log_size(tmp, run)
    rc = finish_run(tmp, run)
    resumed = resume_facts(log_text(tmp, run, offset), 2)
    out = _resumed_report("kill_during_save", injected, landed, facts, rc, ref, run, resumed)
    out["partial_checkpoint_ignored"] = resumed["resumed_from_step"] == 2
    return out


def scenario_sigterm(tmp: Path, ref: Path) -> dict:
    """SIGTERM to every process while step 3 runs: the run finishes step 3, saves it and
    exits 0; the rerun must resume from step 3 at step 4."""
    run = tmp / "sigterm"
    env, marks = arm(run, hold_s=3)
    proc = start_run(tmp, run, env)
    injected = wait_marked(marks, proc, run, 2)
    facts = fault_facts(run, marks)  # read as the signal goes out: step 3 not finished
    kill_tree(proc, signal.SIGTERM)
    rc_term = wait_exit(proc, timeout=120)
    landed = injected and landed_mid_step(facts, 3)
    saved = complete_checkpoints(run)
    offset = log_size(tmp, run)
    rc = finish_run(tmp, run)
    resumed = resume_facts(log_text(tmp, run, offset), 3)
    out = _resumed_report("sigterm", injected, landed, facts, rc, ref, run, resumed)
    out["clean_exit_code"] = rc_term
    out["saved_on_sigterm"] = 3 in saved
    out["survived"] = out["survived"] and rc_term == 0 and 3 in saved
    return out


def scenario_controller_dies(tmp: Path, ref: Path, rank: int = 1) -> dict:
    """SIGKILL one controller (``rank``) inside step 3 only: torchrun restarts the group,
    which must resume from the step-2 checkpoint by itself (distributed.max_restarts)."""
    run = tmp / f"rank{rank}_dies"
    env, marks = arm(run, hold_s=5)
    proc = start_run(tmp, run, env, job=[*JOB, "distributed.max_restarts=1"])
    injected = wait_marked(marks, proc, run, 2, rank=rank)
    victims = [m["pid"] for m in read_markers(marks) if m["rank"] == rank] if injected else []
    for pid in victims:  # the controller that wrote the marker: rank `rank`, inside step 3
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            victims.remove(pid)
    facts = fault_facts(run, marks)
    (marks / "ARMED").unlink()  # the restarted group runs step 3 without holding
    injected = injected and bool(victims)
    landed = injected and landed_mid_step(facts, 3)
    rc = wait_exit(proc)
    resumed = resume_facts(log_text(tmp, run), 2)
    out = _resumed_report(
        f"controller_dies_rank{rank}", injected, landed, facts, rc, ref, run, resumed
    )
    out["group_restarted_from_checkpoint"] = resumed["resumed_from_checkpoint"]
    return out


def _judges(proc: subprocess.Popen) -> list:
    import psutil

    found = []
    for p in psutil.Process(proc.pid).children(recursive=True):
        try:
            if "mmyatt.serving.server" in p.cmdline():
                found.append(p)
        except psutil.Error:
            pass
    return found


def _judge_url(run: Path) -> str:
    import yaml

    return yaml.safe_load((run / "config.yaml").read_text())["reward"]["judge"]["urls"][0]


def _kill_judges_after(tmp: Path, run: Path, job: list[str], step: int):
    """Start the job, SIGKILL its judge servers once ``step`` is logged. Returns (the run's
    process, the judges killed, the judge URL; both empty if the step never came)."""
    proc = start_run(tmp, run, job=job)
    injected = wait_for(step_logged(run, step), proc)
    victims = _judges(proc) if injected else []
    url = _judge_url(run) if victims else ""
    for p in victims:
        p.kill()
    facts = fault_facts(run)
    facts["run_alive_at_kill"] = proc.poll() is None
    return proc, victims, url, facts


def scenario_judge_crash(tmp: Path, ref: Path, job: list[str]) -> dict:
    """SIGKILL the judge server mid-run; the pool restarts it, clients retry."""

    run = tmp / "judge_crash"
    proc, victims, url, facts = _kill_judges_after(tmp, run, job, 2)
    t_kill = time.perf_counter()
    down_s = None
    while victims and proc.poll() is None and time.perf_counter() - t_kill < 120:
        if check_health(url, 0.5):
            down_s = time.perf_counter() - t_kill
            break
        time.sleep(0.1)
    rc = wait_exit(proc)
    out = _report("judge_crash", bool(victims), rc, ref, run)
    log = (tmp / "judge_crash.log").read_text(errors="replace")
    out["judge_restarts"] = log.count("restarting it on the same port")
    out["judge_down_s"] = round(down_s, 1) if down_s is not None else None
    # mid-run: the run was alive and had not finished its steps when the judge died; it
    # went on without a restart of its own (no resume)
    out["landed"] = bool(
        victims and facts["run_alive_at_kill"] and facts["last_logged_step"] < STEPS
    )
    out["at_fault"] = facts
    out["resume_lines"] = resume_facts(log, None)["resume_lines"]
    out["survived"] = bool(
        out["survived"]
        and out["judge_restarts"] == 1
        and out["landed"]
        and out["resume_lines"] == 0
    )
    return out


def scenario_judge_gone(tmp: Path, ref: Path, job: list[str]) -> dict:
    """The judge dies for good (no restarts, short retry budget): the run checkpoints its
    last complete step and stops naming the judge URL; a rerun resumes from there."""
    run = tmp / "judge_gone"
    gone = [*job[:-1], "reward.judge.max_retries=3", "reward.judge.max_restarts=0"]
    proc, victims, url, facts = _kill_judges_after(tmp, run, gone, 3)
    rc_stop = wait_exit(proc)
    log = log_text(tmp, run)
    steps = complete_checkpoints(run)
    out_stop = {
        "stop_exit_code": rc_stop,
        "error_names_judge_url": bool(url) and "JudgeUnavailableError" in log and url in log,
        "checkpoint_before_stop": steps[-1] if steps else None,
    }
    offset = len(log)
    rc = finish_run(tmp, run, job=job)  # a judge again: resume
    out = _report("judge_gone", bool(victims), rc, ref, run)
    out.update(out_stop)
    out["landed"] = bool(
        victims and facts["run_alive_at_kill"] and facts["last_logged_step"] < STEPS
    )
    out["at_fault"] = facts
    out.update(resume_facts(log_text(tmp, run, offset), out_stop["checkpoint_before_stop"]))
    out["survived"] = bool(
        out["survived"]
        and out["landed"]
        and rc_stop not in (0, -9)
        and out_stop["error_names_judge_url"]
        and f"checkpoint of step {steps[-1] if steps else -1} in" in log
        and out["resumed_from_checkpoint"]
    )
    return out


def _media_task(root: Path, n_train: int = 120) -> tuple[Path, Path, dict[int, str]]:
    """The VLM image task with some images truncated, garbage or missing. Returns the
    manifests and {record index: what was done to its image}."""

    p = write_shape_task(root, n_train=n_train, n_eval=16, seed=0)
    records = [json.loads(x) for x in p["train"].read_text().splitlines() if x.strip()]
    bad: dict[int, str] = {}
    rng = __import__("random").Random(0)
    for i in rng.sample(range(len(records)), 30):
        image = root / records[i]["image"]
        kind = ("truncated", "garbage", "missing")[len(bad) % 3]
        if kind == "truncated":
            image.write_bytes(image.read_bytes()[: image.stat().st_size // 3])
        elif kind == "garbage":
            image.write_bytes(rng.randbytes(500))
        else:
            image.unlink()
        bad[i] = kind
    return p["train"], p["eval"], bad


def _expected_reads(train: Path, bad: set[int], steps: int, per_rank: int, world: int):
    """{step: records} the sharding rules give when bad records are passed over, and how
    many bad records that passes over (from ``owned_indices``, not the reading code)."""

    out: dict[int, set[int]] = {}
    passed = 0
    for rank in range(world):
        m = ShardedManifest(str(train), rank=rank, world_size=world, seed=0, shuffle=True)
        stream = (int(i) for e in range(1000) for i in m.owned_indices(e))
        for step in range(1, steps + 1):
            got: list[int] = []
            while len(got) < per_rank:
                i = next(stream)
                if i in bad:
                    passed += 1
                else:
                    got.append(i)
            out.setdefault(step, set()).update(got)
    return out, passed


def scenario_corrupt_media(tmp: Path) -> dict:
    train, ev, bad = _media_task(tmp / "media")
    data = [f"data.train={train}", f"data.eval={ev}"]
    run = tmp / "corrupt_media"
    rc = finish_run(tmp, run, job=[*MEDIA_JOB, *data], config=VLM_CONFIG)
    done = rc == 0 and (run / "checkpoints" / "final").exists()
    expected, passed = _expected_reads(train, set(bad), steps=6, per_rank=2, world=2)
    got = drawn_records(run) if done else {}
    lost = sum(len(expected[s] ^ got.get(s, set())) for s in expected) if done else None
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()] if done else []
    counted = max((r.get("data/skipped", 0) for r in rows), default=0)
    # the same manifest under the fail policy: the error names manifest line and file
    fail_run = tmp / "corrupt_media_fail"
    job = [*MEDIA_JOB, *data, "data.bad_lines=fail"]
    rc_fail = finish_run(tmp, fail_run, job=job, config=VLM_CONFIG)
    log = (tmp / "corrupt_media_fail.log").read_text(errors="replace")
    lines = [x for x in train.read_text().splitlines() if x.strip()]
    named = any(f"{train}:{i + 1}: " in log and json.loads(lines[i])["image"] in log for i in bad)
    return {
        "fault": "corrupt_media",
        "injected": True,
        "exit_code": rc,
        "bad_images": {k: sum(v == k for v in bad.values()) for k in set(bad.values())},
        "bad_records_passed_over": passed,
        "data_skipped_metric": counted,
        "records_lost": lost,
        "exact_weights": None,
        "fail_policy_exit_code": rc_fail,
        "fail_policy_error_names_line_and_file": named,
        "survived": bool(
            done and lost == 0 and passed > 0 and counted == passed and rc_fail != 0 and named
        ),
    }


def scenario_nan_reward(tmp: Path, ref: Path) -> dict:
    run = tmp / "nan"
    # eval at step 0 scores 8 prompts per rank, then 8 samples per rank per step:
    # calls 25-32 are step 3 on each rank
    rc = finish_run(tmp, run, {"FAULT_NAN_CALLS": "25-32"})
    out = _report("nan_reward", True, rc, ref, run, expect_exact=False)
    skipped = last_metrics(run).get("faults/nonfinite_reward_steps")
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    skipped = max((r.get("faults/nonfinite_reward_steps", 0) for r in rows), default=0)
    out["nonfinite_steps_counted"] = skipped
    out["survived"] = out["survived"] and skipped == 1
    return out


def _report(name, injected, rc, ref, run, expect_exact=True) -> dict:
    done = rc == 0 and (run / "checkpoints" / "final").exists()
    lost = records_lost(ref, run) if done else None
    exact = weights_equal(ref, run) if done else False
    survived = bool(injected and done and lost == 0 and (exact or not expect_exact))
    return {
        "fault": name,
        "injected": bool(injected),
        "exit_code": rc,
        "survived": survived,
        "records_lost": lost,
        "exact_weights": exact,
    }


def bench_faults(quick: bool = False) -> dict:
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        (tmp / "faultreward.py").write_text(REWARD)
        ref = tmp / "reference"
        if finish_run(tmp, ref) != 0:
            raise RuntimeError(f"reference run failed; see {ref}.log")
        scenarios = [scenario_kill_during_step, scenario_nan_reward]
        if not quick:
            scenarios += [
                scenario_kill_during_save,
                scenario_sigterm,
                partial(scenario_controller_dies, rank=0),
                partial(scenario_controller_dies, rank=1),
            ]
        results = [s(tmp, ref) for s in scenarios]
        # the judge-backed job: its own reference

        corpus = [f"Question: {a}+{b}=\nAnswer: {a + b}\n" for a in range(30) for b in range(10)]
        job = judge_job(build_tiny_text_model(tmp / "judge", size="qwen2-0.1m", corpus=corpus))
        ref_judge = tmp / "reference_judge"
        if finish_run(tmp, ref_judge, job=job) != 0:
            raise RuntimeError(f"judge reference run failed; see {ref_judge}.log")
        scenarios = [partial(scenario_judge_crash, job=job)]
        if not quick:
            scenarios.append(partial(scenario_judge_gone, job=job))
        results += [s(tmp, ref_judge) for s in scenarios]
        if not quick:
            results.append(scenario_corrupt_media(tmp))
    return {
        "benchmark": "faults",
        "faults_injected": sum(r["injected"] for r in results),
        "faults_survived": sum(r["survived"] for r in results),
        "records_lost": sum(r["records_lost"] or 0 for r in results),
        "faults_landed_where_aimed": sum(r["landed"] for r in results if "landed" in r),
        "faults_aimed": sum("landed" in r for r in results),
        "reruns_resumed_from_checkpoint": sum(
            bool(r.get("resumed_from_checkpoint")) for r in results
        ),
        "scenarios": results,
        "wall_s": time.perf_counter() - t0,
    }
