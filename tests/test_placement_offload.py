"""placement.offload_policy: the settings it cannot run with fail before start; on the
CPU there is nothing to move (every call returns at once, no state touched); a colocate
run with it trains as one without it; the update leaves no gradients behind. The moves
themselves run on a GPU: tests/test_gpu.py::test_policy_offload_*."""

from __future__ import annotations

import json

import pytest
import torch

from mmyatt.config.schema import ConfigError, load_config
from mmyatt.placement.offload import PolicyOffload


@pytest.mark.parametrize(
    "overrides, why",
    [
        (["placement.mode=partial"], "placement.mode=partial has none"),
        (["placement.mode=shared"], "placement.mode=shared has none"),
        (["placement.mode=colocate", "train.backend=fsdp2"], "not implemented; it"),
    ],
)
def test_settings_it_cannot_run_with_fail_before_start(overrides, why):
    with pytest.raises(ConfigError) as e:
        load_config(None, ["placement.offload_policy=true", *overrides])
    assert "placement.offload_policy=true" in str(e.value) and why in str(e.value)


def _trained(seed: int = 0):
    torch.manual_seed(seed)
    m = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    opt = torch.optim.AdamW(m.parameters(), lr=0.1)
    m(torch.randn(3, 4)).square().sum().backward()
    opt.step()
    return m, opt


def test_on_the_cpu_nothing_moves():
    m, opt = _trained()
    state = {id(p): {k: v for k, v in s.items()} for p, s in opt.state.items()}
    weights = [p.data.data_ptr() for p in m.parameters()]
    off = PolicyOffload(m, opt)
    assert not off.active
    off.optimizer_off()
    off.weights_off()
    off.on()
    assert [p.data.data_ptr() for p in m.parameters()] == weights  # the same memory
    assert all(opt.state[p][k] is v for p in m.parameters() for k, v in state[id(p)].items())
    assert off.take_seconds() == 0.0


def test_update_leaves_no_gradients(tmp_path):
    from test_cli import ROOT, TINY, mmyatt

    rd = tmp_path / "run"
    cfg = str(ROOT / "configs" / "text_grpo_tiny.yaml")
    args = [*TINY, "placement.mode=colocate", "placement.offload_policy=true"]
    mmyatt(tmp_path, "train", cfg, *args, "--run-dir", str(rd))
    rows = [json.loads(x) for x in (rd / "metrics.jsonl").open()]
    steps = [r for r in rows if "placement/mode" in r]
    assert [r["placement/mode"] for r in steps] == ["colocate"] * 2
    assert all("placement/policy_offload_s" not in r for r in steps)  # CPU: nothing moved
    assert all(r["train/optimizer_steps"] >= 1 for r in steps)


def test_controller_drops_gradients_after_the_update(tmp_path):
    from test_placement_modes import CORPUS

    from mmyatt.distributed import Dist
    from mmyatt.models.builtin.tiny import build_tiny_text_model
    from mmyatt.step import builders
    from mmyatt.step.builders import build_controller

    policy = build_tiny_text_model(tmp_path / "policy", size="qwen2-0.1m", corpus=CORPUS, seed=0)
    base = load_config(None, ["data.synthetic_train_size=32", "data.synthetic_eval_size=8"])
    train, _, _ = builders.synthetic_task("synthetic:arithmetic", tmp_path / "data", base)
    cfg = load_config(
        None,
        [
            f"model.path={policy}",
            f"data.train={train}",
            f"data.eval={train}",
            "data.prompts_per_step=2",
            "sampling.group_size=4",
            "sampling.max_new_tokens=4",
            "algorithm.dynamic_sampling=false",
            "optim.lr=0.01",
            "reward.functions=[{name: numeric_match}]",
        ],
    )
    ctl = build_controller(
        cfg,
        tmp_path / "run",
        Dist(),
        policy=builders.build_policy(cfg.model),
        reward=builders.build_reward(cfg.reward),
        shard=builders.build_shard(cfg, 0, 1),
        eval_records=[],
    )
    seen = []
    step = ctl.optimizer.step

    def spy(*a, **k):  # the gradients the optimizer steps with exist
        seen.append(all(p.grad is not None for p in ctl.params))
        return step(*a, **k)

    ctl.optimizer.step = spy
    m = ctl.step()
    assert m["train/optimizer_steps"] >= 1 and seen and all(seen)
    assert all(p.grad is None for p in ctl.params)  # and none outlive the update
