"""Long-tail over-dispatch (rollout.over_dispatch_ratio): which prompts each step trains
on (worked by hand), the decode stopping once the batch's groups are complete (a tiny
text model: the kept samples are the ones a full decode draws), resume equal to an
uninterrupted run, and the config checks."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from bandit_policy import BanditPolicy

from mmyatt.checkpoint.checkpointer import flatten_state, unflatten_state
from mmyatt.config.schema import ConfigError, load_config
from mmyatt.datasets.manifest import ShardedManifest
from mmyatt.datasets.synthetic import write_jsonl
from mmyatt.distributed import Dist
from mmyatt.rewards.rules import WeightedReward
from mmyatt.step.builders import build_controller
from mmyatt.step.controller import Controller

# record i needs LENS[i] decode steps (every sample of its group)
LENS = [5, 9, 3, 2, 8, 4, 1, 9, 9, 2, 3, 4]


def arm_reward(completion: str, record: dict) -> float:
    return float(completion == "2")


class LengthPolicy(BanditPolicy):
    """A bandit whose groups take ``record["len"]`` decode steps: with complete_groups
    it stops as the text decode does (once that many groups and every must_finish group
    are done) and marks the other groups cut short."""

    def generate(self, prompts, group_size, sampling, seeds):
        r = super().generate(prompts, group_size, sampling, seeds)
        lens = [p["len"] for p in prompts]
        if sampling.complete_groups:
            stop = max(
                min(
                    t for t in sorted(lens) if sum(x <= t for x in lens) >= sampling.complete_groups
                ),
                max([lens[i] for i in sampling.must_finish], default=0),
            )
            cut = torch.tensor([x > stop for x in lens]).repeat_interleave(group_size)
            r.truncated = cut
        return r


def controller(tmp: Path, overrides=(), policy=None) -> Controller:
    manifest = tmp / "m.jsonl"
    recs = [{"prompt": f"p{i}", "answer": "2", "len": n, "id": f"r{i}"} for i, n in enumerate(LENS)]
    write_jsonl(manifest, recs)
    cfg = load_config(
        None,
        [
            "sampling.group_size=2",
            "data.prompts_per_step=2",
            "data.shuffle=false",
            "optim.lr=0.1",
            "rollout.over_dispatch_ratio=1.5",
            "reward.functions=[{name: 'test_placement_dispatch:arm_reward'}]",
            *overrides,
        ],
    )
    return build_controller(
        cfg,
        tmp,
        Dist(),
        policy=policy or LengthPolicy(seed=0),
        reward=WeightedReward([{"name": "test_placement_dispatch:arm_reward"}]),
        shard=ShardedManifest([str(manifest)], rank=0, world_size=1, seed=0, shuffle=False),
        eval_records=[],
    )


def test_data_order_by_hand(tmp_path):
    ctl = controller(tmp_path)
    trained, carried = [], []
    for _ in range(4):
        m = ctl.step()
        trained.append(ctl.consumed)
        carried.append([r["_index"] for r in ctl.placement.dispatch.carried])
        assert m["rollout/dispatched_prompts"] == 3.0
    # step 1: dispatch 0 1 2 (5, 9, 3 steps): 0 and 2 done at step 5, 1 cut short
    # step 2: 1 (carried once), 3, 4 (9, 2, 8): 3 and 4 done at 8, 1 cut short again
    # step 3: 1 (carried twice: must finish), 5, 6 (9, 4, 1): all done at 9; the batch is
    #         the first two in dispatch order, 1 and 5; 6 is complete but left over
    # step 4: 6, 7, 8 (1, 9, 9): all done at 9; 6 and 7 trained, 8 left over
    assert trained == [[0, 2], [3, 4], [1, 5], [6, 7]]
    assert carried == [[1], [1], [6], [8]]
    assert [r["_carries"] for r in ctl.placement.dispatch.carried] == [0]
    assert ctl.shard.state_dict()["pos"] == 9  # 2 fresh per step after the first 3


def test_without_reuse_cut_prompts_are_dropped(tmp_path):
    ctl = controller(tmp_path, ["rollout.reuse_unused_prompts=false"])
    trained = []
    for _ in range(3):
        m = ctl.step()
        trained.append(ctl.consumed)
    # step 1: 0 1 2 (5, 9, 3): 1 cut short and dropped; step 2: 3 4 5 (2, 8, 4): 4 cut
    # short; step 3: 6 7 8 (1, 9, 9): all complete, 8 left over and dropped
    assert trained == [[0, 2], [3, 5], [6, 7]]
    assert m["rollout/cut_short_prompts"] == 0.0 and m["rollout/unused_complete_prompts"] == 1.0
    assert m["rollout/carried_prompts"] == 0.0


def test_ratio_one_is_unchanged(tmp_path):
    ctl = controller(tmp_path, ["rollout.over_dispatch_ratio=1"])
    for _ in range(3):
        m = ctl.step()
    assert ctl.consumed == [4, 5] and "rollout/carried_prompts" not in m
    assert "carried" not in ctl.local_state()


def _weights(ctl):
    return [p.detach().clone() for p in ctl.params]


def test_resume_equals_uninterrupted(tmp_path):
    full = controller(tmp_path / "a")
    order_full = []
    for _ in range(5):
        full.step()
        order_full.append(full.consumed)
    first = controller(tmp_path / "b")
    order = []
    for _ in range(2):
        first.step()
        order.append(first.consumed)
    # through the checkpoint's own encoding (safetensors + JSON)
    saved = [flatten_state(s) for s in (first.shared_state(), first.local_state())]
    assert json.dumps(saved[1][1])  # the carried prompts are plain JSON
    shared, local = (unflatten_state(t, m) for t, m in saved)
    assert [c[0] for c in local["carried"]] == [1]
    resumed = controller(tmp_path / "c")
    resumed.load_state(shared, local)
    for _ in range(3):
        resumed.step()
        order.append(resumed.consumed)
    assert order == order_full
    assert all(torch.equal(a, b) for a, b in zip(_weights(full), _weights(resumed)))


def test_config_checks():
    odr = ["rollout.over_dispatch_ratio=1.5"]
    with pytest.raises(ConfigError, match="over_dispatch_ratio must be >= 1"):
        load_config(None, ["rollout.over_dispatch_ratio=0.5"])
    with pytest.raises(ConfigError, match="same denoising steps: there is no long tail"):
        load_config(None, ["rollout.over_dispatch_ratio=1.5", "model.kind=flow"])
    from mmyatt.config.schema import RunConfig, apply_override, build
    from mmyatt.placement.config import check_over_dispatch

    tree: dict = {}
    for o in [*odr, "rollout.backend=vllm"]:  # not load_config: vllm is not installed here
        apply_override(tree, o)
    check_over_dispatch(build(RunConfig, tree))  # the vLLM step loop stops early too
    load_config(None, [*odr, "model.kind=vlm"])  # the VLM policy's decode stops too
    with pytest.raises(ConfigError, match="max_carries must be >= 0"):
        load_config(None, ["rollout.max_carries=-1"])
    with pytest.raises(ConfigError, match=r"redraw_carried=true .* carries none .*ratio=1.0"):
        load_config(None, ["rollout.redraw_carried=true"])
    with pytest.raises(ConfigError, match="reuse_unused_prompts=False"):
        load_config(
            None, [*odr, "rollout.redraw_carried=true", "rollout.reuse_unused_prompts=false"]
        )
    load_config(None, [*odr, "rollout.redraw_carried=true"])  # carried prompts to redraw
    with pytest.raises(ConfigError, match=r"vision tower must be frozen: set model.freeze"):
        load_config(None, ["placement.balance=true", "model.kind=vlm"])
    vlm = ["placement.balance=true", "model.kind=vlm", "model.freeze=[model.visual]"]
    load_config(None, vlm)
    with pytest.raises(ConfigError, match=r"train.backend=fsdp2\) cannot do alone"):
        load_config(None, [*vlm, "train.backend=fsdp2"])


def test_text_decode_stops_when_the_batch_is_complete(tmp_path):
    """The real decode loop: complete_groups=2 of 4 prompts stops early; the two kept
    groups hold the samples a full decode draws for them (per-prompt seeds)."""
    from mmyatt.models.builtin.tiny import build_tiny_text_model
    from mmyatt.models.text import TextPolicy
    from mmyatt.placement.dispatch import complete_groups
    from mmyatt.protocols import Sampling

    corpus = ["a b c d e f g h i j k l m n o p q r s t u v w x y z"] * 20
    path = build_tiny_text_model(tmp_path / "m", size="qwen2-0.1m", corpus=corpus, seed=0)
    policy = TextPolicy.load(path)
    prompts = [{"prompt": p, "_index": i} for i, p in enumerate(["a b", "c d", "e f", "g h"])]
    seeds = [11, 12, 13, 14]
    base = Sampling(max_new_tokens=24, stop=(" ",))
    full = policy.generate(prompts, 2, base, seeds)
    lens_full = full.mask.sum(1).view(4, 2).amax(1)
    cut = policy.generate(
        prompts, 2, Sampling(max_new_tokens=24, stop=(" ",), complete_groups=2), seeds
    )
    done = complete_groups(cut, 4, 24)
    assert sum(done) >= 2 and not all(done)  # stopped before every group finished
    stop_t = int(cut.mask.sum(1).max())
    assert stop_t == sorted(lens_full.tolist())[1]  # when the second group finished
    for g in (i for i, ok in enumerate(done) if ok):
        rows = slice(2 * g, 2 * g + 2)
        assert cut.outputs[rows] == full.outputs[rows]
        torch.testing.assert_close(cut.logprobs[rows], full.logprobs[rows])


def test_vlm_decode_stops_when_the_batch_is_complete(tmp_path):
    """The VLM policy honours complete_groups as the text one does: 2 of 4 image prompts
    complete stops the decode, and the kept groups hold a full decode's samples."""
    from test_vlm_policy import CORPUS, square

    from mmyatt.models.builtin.tiny_vlm import build_tiny_vlm
    from mmyatt.models.vlm import VLMPolicy
    from mmyatt.placement.dispatch import complete_groups
    from mmyatt.protocols import Sampling

    policy = VLMPolicy.load(build_tiny_vlm(tmp_path / "vlm", corpus=CORPUS), max_prompt_tokens=48)
    colours = ["red", "blue", "green", "yellow"]
    prompts = [
        {"prompt": "What colour?", "image": square(c), "_index": i} for i, c in enumerate(colours)
    ]
    seeds = [21, 22, 23, 24]
    base = Sampling(max_new_tokens=16, stop=(" ",))  # completions of 1-15 tokens
    full = policy.generate(prompts, 2, base, seeds)
    lens_full = full.mask.sum(1).view(4, 2).amax(1)
    cut = policy.generate(prompts, 2, replace(base, complete_groups=2), seeds)
    done = complete_groups(cut, 4, 16)
    assert sum(done) >= 2 and not all(done)  # stopped before every group finished
    assert int(cut.mask.sum(1).max()) == sorted(lens_full.tolist())[1]  # the second finished
    for g in (i for i, ok in enumerate(done) if ok):
        rows = slice(2 * g, 2 * g + 2)
        assert cut.outputs[rows] == full.outputs[rows]
        torch.testing.assert_close(cut.logprobs[rows], full.logprobs[rows])


@pytest.fixture
def restore_affinity():
    import os

    from mmyatt.placement import resources as res

    cores, threads = sorted(os.sched_getaffinity(0)), torch.get_num_threads()
    yield
    res.pin_process(cores)
    torch.set_num_threads(threads)


@pytest.mark.skipif(len(__import__("os").sched_getaffinity(0)) < 2, reason="partial: 2 cores")
def test_partial_mode_over_dispatches_per_streamed_chunk(tmp_path, restore_affinity):
    ctl = controller(tmp_path, ["placement.mode=partial", "placement.stream_groups=1"])
    trained = []
    for _ in range(3):
        ctl.step()
        trained.append(ctl.consumed)
    # chunks of 1 group, 2 prompts each (ceil 1.5); leftovers carried at the step's end
    # step 1: [0 1] (5, 9): 0, 1 cut; [2 3] (3, 2): 3, 2 cut -> carried 1 2 (once each)
    # step 2: [1 2] (9, 3): 2, 1 cut (twice); [4 5] (8, 4): 5, 4 cut -> carried 1 4
    # step 3: [1 4]: 1 must finish, both done at 9: 1 (4 left over); [6 7] (1, 9): 6, 7 cut
    assert trained == [[0, 3], [2, 5], [1, 6]]
    assert [(r["_index"], r["_carries"]) for r in ctl.placement.dispatch.carried] == [
        (4, 1),
        (7, 1),
    ]


def test_record_seed_by_hand():
    from mmyatt.placement.dispatch import record_seed
    from mmyatt.protocols import prompt_seed

    fresh = {"_index": 7, "_epoch": 1, "_carries": 0}
    once, twice = {**fresh, "_carries": 1}, {**fresh, "_carries": 2}
    plain = prompt_seed(5, 1, 7)
    # without redraw (the default) a carried prompt keeps its seed: its samples come back
    assert record_seed(5, fresh) == record_seed(5, once) == record_seed(5, twice) == plain
    # with redraw a fresh prompt is unchanged; each carry is a new draw
    assert record_seed(5, fresh, True) == plain
    assert record_seed(5, once, True) == prompt_seed(5, 1, 7, "carried", 1)
    assert len({plain, record_seed(5, once, True), record_seed(5, twice, True)}) == 3
    assert record_seed(5, {"_index": 7}, True) == prompt_seed(5, 0, 7)  # no epoch: epoch 0


class SeedLog(LengthPolicy):
    """LengthPolicy that notes the seed each record's group was drawn with."""

    def __init__(self, seed):
        super().__init__(seed=seed)
        self.seeds: list[dict[int, int]] = []

    def generate(self, prompts, group_size, sampling, seeds):
        self.seeds.append({p["_index"]: s for p, s in zip(prompts, seeds)})
        return super().generate(prompts, group_size, sampling, seeds)


@pytest.mark.parametrize("redraw", [False, True])
def test_a_carried_prompt_is_redrawn_only_when_asked(tmp_path, redraw):
    from mmyatt.placement.dispatch import record_seed

    log = SeedLog(seed=0)
    ctl = controller(tmp_path, [f"rollout.redraw_carried={str(redraw).lower()}"], policy=log)
    for _ in range(3):
        ctl.step()
    # record 1 (9 decode steps) is cut short at steps 1 and 2, must finish at step 3
    seeds_of_1 = [s[1] for s in log.seeds]
    if redraw:
        assert len(set(seeds_of_1)) == 3
        assert seeds_of_1[1] == record_seed(
            ctl.placement.s.seed, {"_index": 1, "_carries": 1}, True
        )
    else:
        assert len(set(seeds_of_1)) == 1
    # the data order does not depend on the seeds here (lengths come from the records)
    assert ctl.consumed == [1, 5]


def test_resume_equals_uninterrupted_with_redraw(tmp_path):
    arg = ["rollout.redraw_carried=true"]
    full = controller(tmp_path / "a", arg)
    for _ in range(4):
        full.step()
    first = controller(tmp_path / "b", arg)
    for _ in range(2):
        first.step()
    shared, local = (
        unflatten_state(*flatten_state(s)) for s in (first.shared_state(), first.local_state())
    )
    resumed = controller(tmp_path / "c", arg)
    resumed.load_state(shared, local)
    for _ in range(2):
        resumed.step()
    assert resumed.consumed == full.consumed
    assert all(torch.equal(a, b) for a, b in zip(_weights(full), _weights(resumed)))


def test_a_vlm_run_over_dispatches_and_carries_the_cut_prompts(tmp_path):
    """`mmyatt train` with the VLM recipe and rollout.over_dispatch_ratio=1.5: prompts are
    cut short and carried to the next step, as with text."""
    from test_cli import ROOT, mmyatt
    from test_recipes import RECIPES, SMALL

    args = [
        *[a for a in SMALL if not a.startswith("trainer.steps")],
        *RECIPES["vlm_grpo_image_tiny.yaml"],
        "sft.enabled=false",
        "algorithm.dynamic_sampling=false",
        "trainer.steps=3",
        "data.prompts_per_step=4",
        "sampling.group_size=2",
        "sampling.max_new_tokens=12",
        "sampling.stop=[' ']",
        "rollout.over_dispatch_ratio=1.5",
    ]
    run = tmp_path / "run"
    mmyatt(
        tmp_path,
        "train",
        str(ROOT / "configs" / "vlm_grpo_image_tiny.yaml"),
        *args,
        "--run-dir",
        str(run),
    )
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "rollout/dispatched_prompts" in r]
    assert [r["rollout/dispatched_prompts"] for r in steps] == [6.0] * 3  # ceil(1.5 x 4)
    assert sum(r["rollout/cut_short_prompts"] for r in steps) > 0, steps
    assert any(r["rollout/carried_prompts"] > 0 for r in steps)
