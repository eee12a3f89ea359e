"""Rollouts made ahead of the update (``trainer.async``, mmyatt/step/async_rollouts.py):
``max_staleness: 0`` is the synchronous step bit for bit; one_step_off and fully_async
runs stopped and resumed equal runs that never stopped; the config's limits are errors
that name the way out."""

from __future__ import annotations

import copy
import json
import math
import re
from contextlib import nullcontext
from pathlib import Path

import pytest
import torch
from bandit_policy import BanditPolicy
from safetensors.torch import load_file
from test_cli import ROOT, TINY, mmyatt
from test_controller import make_controller, write_manifest
from test_resume import stop_and_resume, train_rows
from test_vlm_policy import CORPUS, square

from mmyatt.config.schema import ConfigError, load_config
from mmyatt.config.trainer import async_settings
from mmyatt.distributed import Dist, Lockstep
from mmyatt.engines.replica import ReplicaEngine
from mmyatt.models.builtin.tiny_vlm import build_tiny_vlm
from mmyatt.models.vlm import VLMPolicy
from mmyatt.protocols import Sampling
from mmyatt.step.async_rollouts import load_weights, rollout_copy, sampling_weights
from mmyatt.step.batches import MicroBatches
from mmyatt.step.policy_loss import PPOClipLoss

CFG = str(ROOT / "configs" / "text_grpo_tiny.yaml")
# one controller (the producer thread shares no process group), a step's samples
# reach a reward that varies (the completion's length), a constant learning rate
ARGS = [*TINY, "distributed.nproc=1"]


def rows(run: Path) -> list[dict]:
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]


def final_weights(run: Path) -> dict[str, torch.Tensor]:
    return load_file(str(run / "checkpoints" / "final" / "model.safetensors"))


def test_max_staleness_zero_is_the_synchronous_step(tmp_path):
    sync, zero = tmp_path / "sync", tmp_path / "zero"
    mmyatt(tmp_path, "train", CFG, *ARGS, "trainer.steps=3", "--run-dir", str(sync))
    for mode in ("one_step_off", "fully_async"):
        mmyatt(
            tmp_path,
            "train",
            CFG,
            *ARGS,
            "trainer.steps=3",
            f"trainer.async.mode={mode}",
            "trainer.async.max_staleness=0",
            "--run-dir",
            str(zero / mode),
        )
        a, b = train_rows(sync), train_rows(zero / mode)
        assert sorted(a) == [1, 2, 3]
        for step in a:  # the async run's own figures besides, every metric equal
            assert a[step] == {k: v for k, v in b[step].items() if not k.startswith("async/")}
            assert b[step]["async/staleness_max"] == 0.0
            assert b[step]["async/version"] == step - 1
        wa, wb = final_weights(sync), final_weights(zero / mode)
        assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


# ---------------------------------------------------------------- in-process, bandit policy
def bandit(tmp_path: Path, *overrides: str, steps: int = 6):
    m = write_manifest(tmp_path / "m.jsonl", ["learn"] * 64)
    return make_controller(tmp_path, m, Dist(), [f"trainer.steps={steps}", *overrides])


def test_one_step_off_trains_on_the_weights_two_updates_back(tmp_path):
    ctl = bandit(tmp_path, "trainer.async.mode=one_step_off", steps=25)
    out = [ctl.step() for _ in range(25)]
    assert [m["async/version"] for m in out[:4]] == [0.0, 0.0, 1.0, 2.0]
    assert [m["async/staleness_max"] for m in out[:3]] == [0.0, 1.0, 1.0]
    assert out[0]["async/behaviour_clip_frac"] == 0.0  # staleness 0: no correction
    assert out[2]["async/behaviour_weight_mean"] != 1.0  # stale: the ratio is applied
    assert out[0]["reward/mean"] < 0.5 and out[-1]["reward/mean"] > 0.8


def test_samples_staler_than_the_bound_never_reach_the_loss(tmp_path):
    ctl = bandit(tmp_path, "trainer.async.mode=fully_async", "trainer.async.max_staleness=3")
    ctl.rollouts.bound = 1  # the producer runs 3 updates ahead; the loss takes 1 at most
    seen = []
    prepare = ctl.loss.prepare

    def spy(policy, r, passes):
        seen.append(r.context["staleness"].tolist())
        return prepare(policy, r, passes)

    ctl.loss.prepare = spy
    out = [ctl.step() for _ in range(6)]
    # w(t) = 0, 0, 0, 0, 1, 2: staleness 0 1 2 3 3 3; steps 3..6 dropped whole
    assert [m.get("async/dropped_samples") for m in out] == [0.0, 0.0, 16.0, 16.0, 16.0, 16.0]
    assert seen == [[0] * 16, [1] * 16]
    assert ctl.counters["async/dropped_samples_total"] == 64
    assert out[3]["async/staleness_count_3"] == 16.0


def test_decoupled_loss_by_hand():
    """Two actions of one stale sample: proximal log-prob p (the current policy),
    behaviour b; the action's loss is -A min(r, clip(r)) x min(exp(p - b), cap)."""
    policy = BanditPolicy(arms=2, seed=0)
    r = policy.generate([{"id": "a"}], 2, Sampling(), [7])
    prox = policy.logprobs(r).detach()
    r.logprobs = prox - torch.tensor([[1.0], [-0.5]])  # behaviour ratios e^1 (capped), e^-0.5
    r.advantages = torch.tensor([1.0, -1.0])
    r.context["staleness"] = torch.tensor([2, 2])
    loss = PPOClipLoss(Lockstep(Dist(), ReplicaEngine(Dist()), policy), behaviour_cap=2.0)
    r = loss.prepare(policy, r, MicroBatches(0, Lockstep(Dist(), ReplicaEngine(Dist()), policy)))
    assert torch.equal(r.logprobs, prox)  # the ratio is against the proximal policy
    w = r.context["behaviour_weight"]
    assert torch.allclose(w, torch.tensor([[2.0], [math.exp(-0.5)]]))
    assert r.context["behaviour_clipped"].tolist() == [[True], [False]]
    num, sums = loss(policy, r, 0)
    # at the proximal policy the ratio is 1: the loss is -A x w, token-mean over 2 actions
    assert float(num.detach()) / sums["den"] == pytest.approx((-2.0 + math.exp(-0.5)) / 2)


def test_async_resumes_exactly_in_process(tmp_path):
    """A fully_async controller's state after 3 steps, loaded into a fresh one, gives the
    uninterrupted controller's steps 4..6 bit for bit."""
    args = ("trainer.async.mode=fully_async", "trainer.async.max_staleness=2")
    full = bandit(tmp_path / "a", *args)
    ref = [full.step() for _ in range(6)]
    first = bandit(tmp_path / "b", *args)
    for _ in range(3):
        first.step()
    shared, local = first.shared_state(), first.local_state()
    resumed = bandit(tmp_path / "c", *args)
    assert resumed.load_state(copy.deepcopy(shared), copy.deepcopy(local)) == 3
    rest = [resumed.step() for _ in range(3)]
    for a, b in zip(ref[3:], rest):
        assert strip(a) == strip(b)
    assert all(torch.equal(p, q) for p, q in zip(full.params, resumed.params))


def strip(m: dict) -> dict:
    return {k: v for k, v in m.items() if not k.startswith(("timing/", "placement/"))}


# ---------------------------------------------------------------- config
@pytest.mark.parametrize(
    ("overrides", "says"),
    [
        (["trainer.async.mode=later"], "trainer.async.mode"),
        (["trainer.async.max_staleness=-1"], "trainer.async.max_staleness"),
        (["trainer.async.sync_every=0"], "trainer.async.sync_every"),
        (["trainer.async.stale=1"], "unknown config key 'trainer.async.stale'"),
        (["trainer.async.mode=one_step_off"], "set distributed.nproc=1"),
        (
            [
                "trainer.async.mode=one_step_off",
                "distributed.nproc=1",
                "trainer.async.sync_every=2",
            ],
            "applies to fully_async",
        ),
        (
            [
                "trainer.async.mode=fully_async",
                "distributed.nproc=1",
                "trainer.async.sync_every=3",
                "trainer.async.max_staleness=1",
            ],
            "max_staleness must be >= 2",
        ),
        (
            ["trainer.async.mode=one_step_off", "distributed.nproc=1", "placement.mode=colocate"],
            "set placement.mode=shared",
        ),
        (
            ["trainer.async.mode=one_step_off", "distributed.nproc=1", "train.backend=fsdp2"],
            "use train.backend=replica",
        ),
    ],
)
def test_config_errors_name_the_way_out(overrides, says):
    with pytest.raises(ConfigError, match=re.escape(says)):
        load_config(CFG, overrides)


def test_config_defaults_to_sync():
    a = async_settings(load_config(CFG, []).trainer)
    assert (a.mode, a.max_staleness, a.sync_every) == ("sync", 1, 1)


# ---------------------------------------------------------------- the tiny text recipe, resumed
@pytest.mark.slow  # 6 runs of the CLI; the in-process fully_async resume runs in make test
@pytest.mark.parametrize(
    "mode",
    [
        ["trainer.async.mode=one_step_off"],
        [
            "trainer.async.mode=fully_async",
            "trainer.async.max_staleness=2",
            "trainer.async.sync_every=2",
        ],
    ],
)
def test_stop_and_resume_equals_uninterrupted(tmp_path, mode):
    args = [*ARGS, *mode, "checkpoint.save_every=2", "data.shuffle=true"]
    full, parts, out = stop_and_resume(tmp_path, CFG, *args, steps=5, stop=2)
    a, b = train_rows(full), train_rows(parts)
    assert sorted(b) == [1, 2, 3, 4, 5] and a == b
    wa, wb = final_weights(full), final_weights(parts)
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    assert max(r["async/staleness_max"] for r in a.values()) >= 1  # it did run ahead


# ---------------------------------------------------------------- the rollout-side copy
@pytest.mark.slow  # builds a tiny VLM (a minute on 2 cores)
def test_vlm_rollout_copy_samples_alike_and_keeps_its_own_weights(tmp_path):
    policy = VLMPolicy.load(build_tiny_vlm(tmp_path, corpus=CORPUS), max_prompt_tokens=48)
    twin = rollout_copy(policy, nullcontext)
    prompts = [{"prompt": "What colour is the shape?", "image": square("red"), "id": "a"}]
    a = policy.generate(prompts, 2, Sampling(max_new_tokens=4), [3])
    b = twin.generate(prompts, 2, Sampling(max_new_tokens=4), [3])
    assert torch.equal(a.actions, b.actions) and torch.equal(a.logprobs, b.logprobs)
    snapshot = sampling_weights(policy, nullcontext)
    with torch.no_grad():
        for p in policy.module().parameters():
            p.add_(1.0)
    assert all(torch.equal(snapshot[k], v) for k, v in twin.module().state_dict().items())
    load_weights(twin, {k: v for k, v in policy.module().state_dict().items()})
    assert all(
        torch.equal(x, y) for x, y in zip(policy.module().parameters(), twin.module().parameters())
    )
