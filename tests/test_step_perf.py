"""The perf/* step metrics (mmyatt/step/perf.py): a tiny text run's update TFLOP/s worked
out by hand from its rollout, no MFU without a known peak, none of them for a flow run."""

from __future__ import annotations

import pytest
import torch
from test_nft import _controller as flow_controller

from mmyatt.config.schema import load_config
from mmyatt.datasets.manifest import ShardedManifest
from mmyatt.datasets.synthetic import write_jsonl
from mmyatt.distributed import Dist
from mmyatt.models.builtin.tiny import build_tiny_text_model
from mmyatt.models.text import TextPolicy
from mmyatt.rewards.rules import WeightedReward
from mmyatt.rollout import Rollout
from mmyatt.step.builders import build_controller
from mmyatt.step.flops import ModelFlops, rollout_flops
from mmyatt.step.perf import StepFlops, device_peak

torch.set_num_threads(1)

CORPUS = [f"What is {a} + {b}? The answer is {a + b}." for a in range(20) for b in range(10)]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return build_tiny_text_model(tmp_path_factory.mktemp("tiny"), size="qwen2-0.1m", corpus=CORPUS)


def _text_controller(tmp_path, tiny_dir, policy, overrides=()):
    recs = [{"prompt": f"What is {i} + {i % 3}?", "answer": str(i + i % 3)} for i in range(8)]
    write_jsonl(tmp_path / "m.jsonl", recs)
    cfg = load_config(
        None,
        [
            "sampling.group_size=2",
            "sampling.max_new_tokens=6",
            "data.prompts_per_step=4",
            "reward.functions=[{name: exact_match}]",
            *overrides,
        ],
    )
    shard = ShardedManifest([str(tmp_path / "m.jsonl")], rank=0, world_size=1, seed=0)
    reward = WeightedReward([{"name": "exact_match"}])
    return build_controller(
        cfg, tmp_path, Dist(), policy=policy, reward=reward, shard=shard, eval_records=[]
    )


def _by_hand(r) -> tuple[int, int]:
    """(tokens, keys) of a rollout: each group's prompt once (its real tokens, each
    attending itself and those before it), then every row's actions but the last, each
    attending the prompt, the earlier actions and itself."""
    tokens = keys = 0
    prompt_width = r.context["attention_mask"].shape[1] - r.num_actions
    for i in range(len(r)):
        p = int(r.context["attention_mask"][i, :prompt_width].sum())
        if i == 0 or r.prompt_ids[i] != r.prompt_ids[i - 1]:
            tokens, keys = tokens + p, keys + p * (p + 1) // 2
        for j in range(max(int(r.mask[i].sum()) - 1, 0)):
            tokens, keys = tokens + 1, keys + p + j + 1
    return tokens, keys


def test_update_tflops_of_a_tiny_text_step_is_its_training_flops_over_its_seconds(
    tmp_path, tiny_dir
):
    """Two PPO epochs of two minibatches in micro-batches: the step's update is every
    sample's forward + backward twice, over the timed update seconds."""
    policy = TextPolicy.load(tiny_dir, max_prompt_tokens=32)
    over = ["algorithm.ppo_epochs=2", "algorithm.minibatches=2", "algorithm.micro_batch_tokens=16"]
    ctl = _text_controller(tmp_path, tiny_dir, policy, over)
    m = ctl.step()
    r = ctl.last_rollout
    assert m["train/optimizer_steps"] == 4.0 and m["train/micro_batches"] > 1  # per minibatch
    # N: q, k, v, o and the MLP's three projections of each layer, and the tied head
    cfg = policy.module().config
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    h, i, kv = cfg.hidden_size, cfg.intermediate_size, cfg.num_key_value_heads * head_dim
    per_layer = h * h + 2 * h * kv + h * h + 3 * h * i
    n = cfg.num_hidden_layers * per_layer + cfg.vocab_size * h
    d = cfg.num_attention_heads * head_dim
    assert ModelFlops.of(*policy.flops_modules()) == ModelFlops(n, cfg.num_hidden_layers, d)
    tokens, keys = _by_hand(r)
    forward = 2 * n * tokens + 4 * cfg.num_hidden_layers * d * keys
    assert rollout_flops(r, ModelFlops(n, cfg.num_hidden_layers, d)) == (forward, 3 * forward)
    want = 2 * 3 * forward / m["timing/update_s"] / 1e12  # 2 epochs of forward + backward
    assert m["perf/update_tflops"] == pytest.approx(want, rel=1e-12)
    assert m["perf/generate_tflops"] == pytest.approx(forward / m["timing/generate_s"] / 1e12)
    assert not [k for k in m if k.startswith("perf/") and k.endswith("_mfu")]  # a CPU


def test_mfu_only_with_a_known_peak():
    assert device_peak(torch.device("cpu")) is None
    perf = StepFlops(ModelFlops(10, 1, 1), peak=None)
    r = _rollout()
    assert sorted(perf(r, r, {"generate": 1.0, "update": 2.0})) == [
        "perf/generate_tflops",
        "perf/update_tflops",
    ]
    with_peak = StepFlops(ModelFlops(10, 1, 1), peak=1e3, epochs=2, update_devices=2)
    out = with_peak(r, r, {"update": 2.0})  # generation not timed: not logged
    fg, fu = rollout_flops(r, ModelFlops(10, 1, 1))
    assert out == {"perf/update_tflops": fu / 2.0 / 1e12, "perf/update_mfu": fu / 2.0 / 1e3}
    assert fg > 0


def _rollout() -> Rollout:
    """Two rows of one prompt (4 real tokens), with 1 and 2 actions."""
    attn = torch.tensor([[0, 1, 1, 1, 1, 0], [0, 1, 1, 1, 1, 1]])
    return Rollout(
        prompt_ids=["a", "a"],
        actions=torch.zeros(2, 2, dtype=torch.long),
        logprobs=torch.zeros(2, 2),
        mask=torch.tensor([[1.0, 0.0], [1.0, 1.0]]),
        context={"attention_mask": attn},
        outputs=["", ""],
        records=[{}, {}],
    )


def test_a_flow_run_logs_no_perf_metrics(tmp_path):
    ctl, _ = flow_controller(tmp_path, [{"name": "latent_brightness"}])
    assert ctl.perf is None
    m = ctl.step()
    assert "timing/update_s" in m and not [k for k in m if k.startswith("perf/")]
