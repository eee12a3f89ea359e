"""The device side of the resource pool (mmyatt/placement/devices.py): judge GPUs checked
against a machine with a given number of CUDA devices, and the device map a run prints."""

from __future__ import annotations

import pytest

from mmyatt.config.schema import ConfigError, RunConfig, apply_override, build
from mmyatt.placement.devices import check_judge_devices, device_lines, judge_device_sets

JUDGE = ["reward.functions=[{name: genrm}]", "reward.judge.model=/some/judge"]


def cfg(*overrides):
    tree: dict = {}
    for o in overrides:
        apply_override(tree, o)
    return build(RunConfig, tree)


def test_no_devices_named_is_always_fine():
    check_judge_devices(cfg(*JUDGE), count=0)
    check_judge_devices(cfg(*JUDGE), count=8)


def test_ids_parse_one_server_per_entry_and_commas_join_gpus():
    assert judge_device_sets(["1", 2, "2, 3"]) == [(1,), (2,), (2, 3)]
    with pytest.raises(ConfigError, match=r"reward.judge.devices\[1\]='cuda:1' is not a GPU id"):
        judge_device_sets(["0", "cuda:1"])
    with pytest.raises(ConfigError, match=r"reward.judge.devices\[0\]='0,' is not a GPU id"):
        judge_device_sets(["0,"])


def test_gpus_on_a_machine_without_cuda_are_refused_not_quietly_run_on_the_cpu():
    with pytest.raises(
        ConfigError, match=r"devices=\['0'\] names GPUs, but this machine has no CUDA"
    ):
        check_judge_devices(cfg(*JUDGE, "reward.judge.devices=['0']"), count=0)


def test_a_gpu_the_machine_lacks_is_named_with_the_count():
    c = cfg(*JUDGE, "reward.judge.num_servers=2", "reward.judge.devices=['1', '2,3']")
    with pytest.raises(
        ConfigError,
        match=r"names GPU\(s\) \[2, 3\], but this machine has 2 CUDA device\(s\) \(ids 0-1\)",
    ):
        check_judge_devices(c, count=2)
    check_judge_devices(c, count=4)


def test_devices_beyond_the_servers_and_devices_without_a_started_judge_are_refused():
    c = cfg(*JUDGE, "reward.judge.devices=['0', '1']")  # one server
    with pytest.raises(
        ConfigError, match=r"2 device sets but reward.judge.num_servers=1: \[\[1\]\]"
    ):
        check_judge_devices(c, count=2)
    c = cfg("reward.functions=[{name: genrm}]", "reward.judge.urls=['http://h:1']",
            "reward.judge.devices=['0']")  # fmt: skip
    with pytest.raises(ConfigError, match="reward.judge.model is not set"):
        check_judge_devices(c, count=2)


def test_device_map_and_the_time_slicing_note(monkeypatch):
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    two = ["distributed.nproc=2", "data.prompts_per_step=8"]
    # the judge on a GPU of its own: partial overlaps on separate devices, no note
    own = device_lines(cfg(*JUDGE, *two, "placement.mode=partial", "reward.judge.devices=['2']"), 3)
    assert own == [
        "[placement] controllers (rollout, train) on cuda:0, cuda:1",
        "[placement] judge servers on 0: cuda:2",
    ]
    # no devices named: the server loads on GPU 0, controller 0's; partial and auto say so
    for mode in ("partial", "auto"):
        lines = device_lines(cfg(*JUDGE, *two, f"placement.mode={mode}"), 2)
        assert lines[1] == "[placement] judge servers on 0: cuda:0"
        assert lines[2].startswith(
            "[placement] the judge shares cuda:0 with generating controllers"
        )
    # merge_rollout: only the first controller generates; a judge on the second one's GPU
    # runs beside rollout, and training takes that GPU too
    merged = [*JUDGE, *two, "placement.mode=partial", "placement.merge_rollout=true"]
    lines = device_lines(cfg(*merged, "reward.judge.devices=['1']"), 2)
    assert lines[2:] == [
        "[placement] partial steps: rollout on cuda:0 (merge_rollout) beside the judge on "
        "cuda:1, then training on every GPU with the judge's weights kept there "
        "(placement.partial_release_judge frees them)"
    ]
    flag = "placement.partial_release_judge=true"
    lines = device_lines(cfg(*merged, flag, "reward.judge.devices=['1']"), 2)
    assert lines[2].endswith("with the judge asleep (placement.partial_release_judge)")
    lines = device_lines(cfg(*merged, "reward.judge.devices=['0']"), 2)  # the generating one
    assert len(lines) == 3 and "time-slice" in lines[2]
    # colocate takes turns by design: nothing to note
    assert len(device_lines(cfg(*JUDGE, *two, "placement.mode=colocate"), 2)) == 2
    # round robin over the sets, several GPUs per server
    c = cfg(*JUDGE, "reward.judge.num_servers=3", "reward.judge.devices=['1,2', '3']")
    assert (
        device_lines(c, 4)[1]
        == "[placement] judge servers on 0: cuda:1+cuda:2, 1: cuda:3, 2: cuda:1+cuda:2"
    )
    # the CPU: controllers on it, or no CUDA device at all -> nothing to print
    assert device_lines(cfg(*JUDGE, "distributed.device=cpu"), 2) == []
    assert device_lines(cfg(*JUDGE), 0) == []
    # under torchrun the controllers on this machine are LOCAL_WORLD_SIZE
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert device_lines(cfg(), 8) == [
        "[placement] controllers (rollout, train) on cuda:0, cuda:1, cuda:2, cuda:3"
    ]


def test_train_refuses_judge_gpus_before_it_prepares_anything(tmp_path):
    """`mmyatt train` on this machine (no CUDA device in CI): the error comes before the
    run directory, data or judges are made."""
    from mmyatt.placement.devices import cuda_count
    from mmyatt.step.run import train

    if cuda_count():
        pytest.skip("this machine has CUDA devices")
    rd, judge = tmp_path / "run", tmp_path / "judge"
    judge.mkdir()  # load_config checks the judge folder exists
    judged = ["reward.functions=[{name: genrm}]", f"reward.judge.model={judge}"]
    with pytest.raises(ConfigError, match="names GPUs, but this machine has no CUDA device"):
        train(None, [*judged, "reward.judge.devices=['0']"], str(rd))
    assert not rd.exists()
