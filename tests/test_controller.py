"""Engine behaviour on a bandit policy: learning, dynamic sampling across 2 ranks,
1-vs-2 controller equivalence, non-finite rewards never applied."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from bandit_policy import BanditPolicy

from mmyatt.config.schema import load_config
from mmyatt.datasets.manifest import ShardedManifest
from mmyatt.datasets.synthetic import write_jsonl
from mmyatt.distributed import Dist, free_port, init_from_env, shutdown
from mmyatt.rewards.rules import WeightedReward
from mmyatt.step.builders import build_controller
from mmyatt.step.controller import Controller


def arm_reward(completion: str, record: dict) -> float:
    kind = record.get("kind", "learn")
    if kind == "always":
        return 1.0
    if kind == "never":
        return 0.0
    if kind == "nan":
        return float("nan")
    return float(completion == record["answer"])


def write_manifest(path: Path, kinds: list[str]) -> Path:
    recs = [
        {"prompt": f"p{i}", "answer": "2", "kind": k, "id": f"r{i}"} for i, k in enumerate(kinds)
    ]
    write_jsonl(path, recs)
    return path


def make_controller(
    tmp: Path, manifest: Path, dist: Dist, overrides: list[str], eval_records=()
) -> Controller:
    cfg = load_config(
        None,
        [
            "sampling.group_size=4",
            "data.prompts_per_step=4",
            "optim.lr=0.1",
            "optim.grad_clip=100",
            "reward.functions=[{name: 'test_controller:arm_reward'}]",
            *overrides,
        ],
    )
    return build_controller(
        cfg,
        tmp,
        dist,
        policy=BanditPolicy(seed=0),
        reward=WeightedReward([{"name": "test_controller:arm_reward"}]),
        shard=ShardedManifest(
            [str(manifest)],
            rank=dist.rank,
            world_size=dist.world_size,
            seed=0,
            shuffle=cfg.data.shuffle,
        ),
        eval_records=list(eval_records),
    )


def test_bandit_reward_goes_up(tmp_path):
    m = write_manifest(tmp_path / "m.jsonl", ["learn"] * 32)
    ctl = make_controller(tmp_path, m, Dist(), [])
    first = ctl.step()["reward/mean"]
    for _ in range(25):
        last = ctl.step()["reward/mean"]
    assert first < 0.5 and last > 0.8, (first, last)


def test_nonfinite_reward_skips_step_and_counts(tmp_path):
    m = write_manifest(tmp_path / "m.jsonl", ["nan"] * 8)
    ctl = make_controller(tmp_path, m, Dist(), [])
    before = [p.detach().clone() for p in ctl.params]
    assert before
    out = ctl.step()
    assert out["step/skipped_nonfinite_reward"] == 1.0
    assert ctl.counters["faults/nonfinite_reward_steps"] == 1
    assert all(torch.equal(a, b) for a, b in zip(before, ctl.params))


def test_dynamic_sampling_single_rank_refills(tmp_path):
    # half the prompts have all-equal rewards; refill rounds must top the batch up
    kinds = ["always", "learn", "never", "learn"] * 32
    m = write_manifest(tmp_path / "m.jsonl", kinds)
    ctl = make_controller(
        tmp_path, m, Dist(), ["algorithm.dynamic_sampling=true", "algorithm.max_refill_rounds=30"]
    )
    out = ctl.step()
    assert out["dynamic/kept_groups"] == 4
    assert out["dynamic/refill_rounds"] >= 1
    assert out["dynamic/dropped_groups"] > 0
    assert out["rollout/samples"] == 16


def _join(rank: int, world: int, store: str) -> Dist:
    """This spawned rank's process group (gloo over a file store)."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    # a file store, not a TCP port: other processes on a busy machine cannot steal it
    torch.distributed.init_process_group(
        "gloo", init_method=f"file://{store}", rank=rank, world_size=world
    )
    return init_from_env("gloo", device="cpu")


def _rank_main(rank: int, world: int, port: int, tmp: str, manifest: str, overrides, steps, out):
    dist = _join(rank, world, f"{tmp}/store-{port}")
    try:
        ctl = make_controller(Path(tmp), Path(manifest), dist, overrides)
        rows, local = [], []
        for _ in range(steps):
            rows.append(ctl.step())
            local.append(len(ctl.last_rollout))
        params = [p.detach().tolist() for p in ctl.params]
        Path(out, f"rank{rank}.json").write_text(
            json.dumps({"rows": rows, "params": params, "local": local})
        )
        dist.barrier()
    finally:
        shutdown()
    # results are on disk; leave without interpreter teardown, where gloo's threads
    # occasionally abort ("terminate called without an active exception")
    os._exit(0)


def run_ranks(tmp_path, world, manifest, overrides, steps):
    out = tmp_path / f"out{world}"
    out.mkdir()
    args = (world, free_port(), str(tmp_path), str(manifest), overrides, steps, str(out))
    if world == 1:
        # same code path as a rank, without starting a process group
        ctl = make_controller(tmp_path, manifest, Dist(), overrides)
        rows = [ctl.step() for _ in range(steps)]
        return [{"rows": rows, "params": [p.detach().tolist() for p in ctl.params]}]
    mp.start_processes(_rank_main, args=args, nprocs=world, start_method="spawn")
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]


def test_dynamic_sampling_refill_across_two_ranks(tmp_path):
    # rank 0's shard is mostly zero-variance groups, rank 1's is mostly learnable, so the
    # global count (not the local one) must decide when to stop refilling
    kinds = ["always", "learn", "never", "learn"] * 32
    m = write_manifest(tmp_path / "m.jsonl", kinds)
    ov = ["algorithm.dynamic_sampling=true", "algorithm.max_refill_rounds=30", "data.shuffle=false"]
    res = run_ranks(tmp_path, 2, m, ov, steps=2)
    for step in range(2):
        a, b = res[0]["rows"][step], res[1]["rows"][step]
        assert a["dynamic/kept_groups"] == b["dynamic/kept_groups"] == 4
        assert a["dynamic/dropped_groups"] == b["dynamic/dropped_groups"] > 0
        assert a["rollout/samples"] == b["rollout/samples"] == 16
    # rank 0 kept nothing, yet took part in every collective of both steps
    assert res[0]["local"] == [0, 0] and res[1]["local"] == [16, 16]
    assert res[0]["params"] == res[1]["params"]


@pytest.mark.parametrize("minibatches", [1, 2])
def test_two_controllers_equal_one(tmp_path, minibatches):
    kinds = ["learn"] * 32
    m = write_manifest(tmp_path / "m.jsonl", kinds)
    ov = [f"algorithm.minibatches={minibatches}", "algorithm.ppo_epochs=2"]
    one = run_ranks(tmp_path, 1, m, ov, steps=3)
    two = run_ranks(tmp_path, 2, m, ov, steps=3)
    for p1, p2 in zip(one[0]["params"], two[0]["params"]):
        torch.testing.assert_close(torch.tensor(p1), torch.tensor(p2), atol=1e-6, rtol=1e-5)
    r1 = [r["reward/mean"] for r in one[0]["rows"]]
    r2 = [r["reward/mean"] for r in two[0]["rows"]]
    assert r1 == pytest.approx(r2)


def test_nonfinite_loss_is_never_applied(tmp_path):
    m = write_manifest(tmp_path / "m.jsonl", ["learn"] * 16)
    ctl = make_controller(tmp_path, m, Dist(), [])
    before = [p.detach().clone() for p in ctl.params]
    assert before
    honest = ctl.policy.logprobs

    def poisoned(rollout, with_entropy=False):
        lp, ent = honest(rollout, with_entropy=True)
        lp = lp * float("nan")  # NaN that still carries a graph
        return (lp, ent) if with_entropy else lp

    ctl.policy.logprobs = poisoned
    out = ctl.step()
    assert out["step/skipped_nonfinite_loss_minibatches"] == 1.0
    assert ctl.counters["faults/nonfinite_loss_steps"] == 1
    assert all(torch.equal(a, b) for a, b in zip(before, ctl.params))
    ctl.policy.logprobs = honest  # later steps train normally
    for _ in range(3):
        ctl.step()
    assert not all(torch.equal(a, b) for a, b in zip(before, ctl.params))


def _eval_rank_main(rank: int, world: int, tmp: str, manifest: str, out: str):
    dist = _join(rank, world, f"{tmp}/store-eval")
    try:
        # only rank 1 holds eval records (fewer eval prompts than controllers)
        recs = [{"prompt": "p", "answer": "2", "_index": i} for i in range(3)] if rank else []
        ctl = make_controller(Path(tmp), Path(manifest), dist, [], eval_records=recs)
        result = ctl.evaluate()
        Path(out, f"eval{rank}.json").write_text(json.dumps(result))
        dist.barrier()
    finally:
        shutdown()
    os._exit(0)


def test_eval_with_a_rank_that_holds_no_eval_records(tmp_path):
    m = write_manifest(tmp_path / "m.jsonl", ["learn"] * 8)
    args = (2, str(tmp_path), str(m), str(tmp_path))
    mp.start_processes(_eval_rank_main, args=args, nprocs=2, start_method="spawn")
    r0, r1 = (json.loads((tmp_path / f"eval{r}.json").read_text()) for r in range(2))
    assert r0 == r1  # both joined the same collectives and agree on the numbers
    assert set(r0) == {"eval/reward/mean", "eval/reward/test_controller:arm_reward"}
    assert 0.0 <= r0["eval/reward/mean"] <= 1.0
