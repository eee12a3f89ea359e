"""Bench plumbing: `bench all` writes the committed files, data-sharding's quick JSON
holds measured figures, the checkpoint arms are warmed alike, and the faults bench's
from-outside checks fail when a kill did not land or a rerun did not resume."""

from __future__ import annotations

import importlib
import inspect
import json
import sys
from pathlib import Path

import pytest

from mmyatt.bench import fault_runs, registry
from mmyatt.bench.text_grpo import TEXT_GRPO_ARMS
from mmyatt.checkpoint.checkpointer import Checkpointer
from mmyatt.cli import main as cli

ROOT = Path(__file__).resolve().parent.parent


def test_every_bench_is_registered_once_and_has_its_committed_result():
    files = {registry.bench_file(n) for n in registry.BENCHES}
    assert files == {
        "text_grpo.json",
        "flow_grpo.json",
        "checkpoint.json",
        "faults.json",
        "genrm.json",
        "data_sharding.json",
        "engines.json",
        "placement.json",
        "placement_sim.json",
        "flow_real.json",
        "lora_sync.json",
        "balance.json",
        "async.json",
    }
    committed = {p.name for p in registry.RESULTS.glob("*.json")}
    # every committed bench result belongs to a registered bench; the GPU benches (engines,
    # the real-size flow step) have no committed CPU result
    assert committed <= files and files - committed <= {"engines.json", "flow_real.json"}
    # every registered name resolves to a function that takes quick=
    for target in registry.BENCHES.values():
        module, function = target.split(":")
        fn = getattr(importlib.import_module(module), function)
        assert "quick" in inspect.signature(fn).parameters, target
    # the CLI offers the registered benches and nothing else
    with pytest.raises(SystemExit) as stop:
        cli.main(["bench", "nosuchbench", "--out", "x.json"])
    assert stop.value.code == 2


def test_a_result_records_its_revision_and_date(tmp_path):
    out = registry.write_result({"benchmark": "x", "figure": 1.5}, tmp_path / "x.json")
    got = json.loads(out.read_text())
    assert got["benchmark"] == "x" and got["figure"] == 1.5
    rev = got["measured_on"]["revision"]
    assert rev == "unknown" or len(rev.split("+")[0]) == 40
    assert got["measured_on"]["date"].startswith("20") and got["measured_on"]["date"].endswith("Z")


def test_an_unknown_bench_names_the_valid_ones():
    with pytest.raises(ValueError, match="choose one of text-grpo"):
        registry.run_bench("nosuchbench")


def test_bench_all_writes_one_file_per_bench(tmp_path, monkeypatch):
    ran = []

    def fake(name, quick=False, **kwargs):
        ran.append((name, quick, kwargs))
        return {"benchmark": name}

    monkeypatch.setattr(registry, "run_bench", fake)
    assert cli.main(["bench", "all", "--out", str(tmp_path / "out"), "--quick"]) == 0
    # placement-sim reads the placement figures this same invocation wrote
    placement = tmp_path / "out" / "placement.json"
    assert ran == [
        (n, True, {"measured_path": placement} if n == "placement-sim" else {})
        for n in registry.BENCHES
    ]
    for name in registry.BENCHES:
        got = json.loads((tmp_path / "out" / registry.bench_file(name)).read_text())
        assert got["benchmark"] == name and "measured_on" in got
    assert cli.main(["bench", "all", "--out", str(tmp_path / "x.json")]) == 2
    # one bench to one file still works
    assert cli.main(["bench", "genrm", "--out", str(tmp_path / "g.json")]) == 0
    assert json.loads((tmp_path / "g.json").read_text())["benchmark"] == "genrm"
    # without placement in the call, placement-sim reads the committed placement figures
    ran.clear()
    registry.run_all(tmp_path / "sim", quick=True, names=("placement-sim",))
    assert ran == [("placement-sim", True, {"measured_path": registry.RESULTS / "placement.json"})]


def test_text_grpo_has_the_one_controller_two_threads_arm():
    arms = {label: (p, th) for label, p, th in TEXT_GRPO_ARMS}
    assert arms == {"1proc": (1, 1), "1proc_2threads": (1, 2), "2proc": (2, 1)}


def test_checkpoint_bench_warms_both_arms_alike(tmp_path):
    from mmyatt.bench.checkpoint import bench_checkpoint

    out = bench_checkpoint(quick=True, root=tmp_path)
    assert out["reps"] >= 5 and out["warmup_saves_discarded"] == 1
    for arm in ("sync_save_s", "async_stall_s", "async_complete_s"):
        assert len(out["samples"][arm]) == out["reps"]
        assert len(out["warmup_samples"][arm]) == 1
    assert out["sync_save_s"] == round(sorted(out["samples"]["sync_save_s"])[2], 4)
    assert list(tmp_path.iterdir()) == []


def test_data_sharding_quick_reports_measured_memory():
    from mmyatt.bench.data import bench_data_sharding

    out = bench_data_sharding(quick=True)
    ranks = out["controllers_p4"]["ranks"]
    drv, workers = out["driver_p4"]["driver"], out["driver_p4"]["workers"]
    assert out["controller_peak_rss_mb_p4"] == max(r["peak_rss_mb"] for r in ranks)
    assert out["driver_peak_rss_mb"] == drv["peak_rss_mb"] > 0
    assert out["driver_over_controller_rss_p4"] == round(
        out["driver_peak_rss_mb"] / out["controller_peak_rss_mb_p4"], 3
    )
    # the driver decoded and held everything and sent every worker its share
    assert drv["bytes_held"] == out["decoded_bytes_total"] == sum(r["bytes_held"] for r in ranks)
    assert [w["bytes_held"] for w in workers] == [r["bytes_held"] for r in ranks]
    assert sum(w["bytes_received"] for w in workers) == out["driver_bytes_sent"] > 0
    assert all(r["peak_rss_mb"] > 0 for r in [*ranks, *workers, out["idle"]])


# ---- faults: the from-outside checks ---------------------------------------------------


def _run_dir(tmp_path: Path, logged: list[int], complete: list[int], partial=()) -> Path:
    run = tmp_path / "run"
    state = run / "checkpoints" / "state"
    state.mkdir(parents=True)
    rows = [{"step": 0, "eval/reward/mean": 0.1}]
    rows += [{"step": s, "reward/mean": 0.5} for s in logged]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    for s in complete:
        (state / f"step_{s:08d}").mkdir()
        (state / f"step_{s:08d}" / "COMPLETE").write_text("{}")
    for s in partial:
        (state / f"step_{s:08d}.tmp").mkdir()
        (state / f"step_{s:08d}.tmp" / "rank0.done").write_text("{}")
    return run


def _marks(tmp_path: Path, ranks=(0,)) -> Path:
    marks = tmp_path / "marks"
    marks.mkdir()
    for r in ranks:
        (marks / f"rank{r}_pid{100 + r}.json").write_text(json.dumps({"rank": r, "pid": 100 + r}))
    return marks


def test_kill_mid_step_is_seen_from_outside(tmp_path):
    facts = fault_runs.fault_facts(_run_dir(tmp_path, [1, 2], [2]), _marks(tmp_path))
    assert facts["last_logged_step"] == 2 and facts["complete_checkpoints"] == [2]
    assert fault_runs.landed_mid_step(facts, 3)


def test_kill_after_the_step_finished_did_not_land(tmp_path):
    # the kill came late: step 3 is in metrics.jsonl
    facts = fault_runs.fault_facts(_run_dir(tmp_path, [1, 2, 3], [2]), _marks(tmp_path))
    assert not fault_runs.landed_mid_step(facts, 3)


def test_kill_before_the_step_began_did_not_land(tmp_path):
    # no controller had started step 3's reward (no marker): the kill came early
    marks = tmp_path / "marks"
    marks.mkdir()
    facts = fault_runs.fault_facts(_run_dir(tmp_path, [1, 2], [2]), marks)
    assert not fault_runs.landed_mid_step(facts, 3)
    facts = fault_runs.fault_facts(_run_dir(tmp_path / "b", [1], []), _marks(tmp_path / "b"))
    assert not fault_runs.landed_mid_step(facts, 3)


def test_kill_mid_save_needs_a_partial_checkpoint(tmp_path):
    facts = fault_runs.fault_facts(_run_dir(tmp_path, [1, 2, 3, 4], [2], partial=[4]))
    assert facts["partial_checkpoints"] == [4] and fault_runs.landed_mid_save(facts, 4)
    # the save had finished: step 4 is complete, nothing partial
    facts = fault_runs.fault_facts(_run_dir(tmp_path / "b", [1, 2, 3, 4], [2, 4]))
    assert not fault_runs.landed_mid_save(facts, 4)


def test_resume_is_read_from_the_rerun_log():
    line = "[resume] from /tmp/x/run/checkpoints/state/step_00000002: continuing at step 3\n"
    assert fault_runs.resume_facts("[config] ...\n" + line, 2) == {
        "resume_lines": 1,
        "resumed_from_step": 2,
        "continued_at_step": 3,
        "resumed_from_checkpoint": True,
    }
    assert not fault_runs.resume_facts("[train] steps 1..6\n", 2)[
        "resumed_from_checkpoint"
    ]  # fresh
    assert not fault_runs.resume_facts(line.replace("00002", "00004"), 2)["resumed_from_checkpoint"]
    assert not fault_runs.resume_facts(line + line, 2)["resumed_from_checkpoint"]  # restarted twice
    assert not fault_runs.resume_facts(line, None)["resumed_from_checkpoint"]


def test_fault_reward_marks_step_3_only_while_armed(tmp_path, monkeypatch):
    (tmp_path / "faultreward_t.py").write_text(fault_runs.REWARD)
    monkeypatch.syspath_prepend(str(tmp_path))
    env, _ = fault_runs.arm(tmp_path / "marks_run", hold_s=0)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("FAULT_SAVE_DELAY_FROM_CALL", str(fault_runs.STEP4_FIRST_CALL))
    monkeypatch.setenv("FAULT_SAVE_DELAY_S", "30")
    monkeypatch.setattr(Checkpointer, "_wait_for_ranks", Checkpointer._wait_for_ranks)  # restored
    marks = Path(env["FAULT_MARK_DIR"])
    mod = importlib.import_module("faultreward_t")
    try:
        for _ in range(24):  # the step-0 eval, steps 1 and 2
            assert mod.reward("abc", {}) == 0.3
        assert fault_runs.read_markers(marks) == []
        mod.reward("abc", {})  # call 25: step 3
        (m,) = fault_runs.read_markers(marks)
        assert m["rank"] == 1 and m["call"] == 25
        for _ in range(7):  # the rest of step 3: no checkpoint delay yet
            mod.reward("abc", {})
        assert not getattr(Checkpointer._wait_for_ranks, "delayed", False)
        mod.reward("abc", {})  # call 33: step 4, whose checkpoint is delayed
        assert Checkpointer._wait_for_ranks.delayed  # the saves from step 4 on wait
        (marks / "ARMED").unlink()
        mod = importlib.reload(mod)
        for _ in range(32):
            mod.reward("abc", {})
        assert len(fault_runs.read_markers(marks)) == 1  # disarmed: no new marker
    finally:
        sys.modules.pop("faultreward_t", None)


@pytest.mark.slow
def test_quick_faults_bench_kill_lands_mid_step_and_resumes():
    from mmyatt.bench.faults import bench_faults

    out = bench_faults(quick=True)
    (kill,) = [s for s in out["scenarios"] if s["fault"] == "kill_during_step"]
    assert kill["landed"] and kill["at_fault"]["last_logged_step"] == 2
    assert kill["resumed_from_step"] == 2 and kill["continued_at_step"] == 3
    assert kill["survived"] and kill["records_lost"] == 0
