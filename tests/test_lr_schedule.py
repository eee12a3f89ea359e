"""The shared learning-rate schedule: hand-worked values, and the rates each training loop
set before it used the schedule (judge training and fine-tuning, the describe judge, flow
pre-training with warm-up, the shape critic)."""

from __future__ import annotations

import math

import pytest
import torch

from mmyatt.step.lr_schedule import cosine_factor, cosine_schedule


def _rates(total: int, n: int, lr: float = 1e-3, **kw) -> list[float]:
    """The learning rate in force at each of ``n`` optimizer steps."""
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=lr)
    sched = cosine_schedule(opt, total, **kw)
    out = []
    for _ in range(n):
        out.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return out


def test_hand_worked_values():
    # floor 0.1 over 4 steps: 0.1 + 0.45 * (1 + cos(pi * t / 4)), then flat
    assert _rates(4, 6, lr=1.0, floor=0.1) == pytest.approx(
        [1.0, 0.8681981, 0.55, 0.2318019, 0.1, 0.1]
    )
    # to zero over 4 steps: 0.5 * (1 + cos(pi * t / 4))
    assert _rates(4, 5, lr=2.0) == pytest.approx([2.0, 1.7071068, 1.0, 0.2928932, 0.0])
    # warm-up over 2 steps ((t + 1) / 2), then the cosine over the 4 steps left
    assert _rates(6, 7, lr=1.0, warmup=2, floor=0.1) == pytest.approx(
        [0.5, 1.0, 1.0, 0.8681981, 0.55, 0.2318019, 0.1]
    )
    assert cosine_factor(0, 0) == 1.0 and cosine_factor(3, 0, floor=0.2) == 0.2


def _old_judge(lr, progress):  # judge_training._set_cosine_lr
    return lr * (0.1 + 0.45 * (1 + math.cos(math.pi * progress)))


@pytest.mark.parametrize("steps", [1, 2, 7, 600])
def test_judge_finetune_rates_unchanged(steps):
    lr = 3e-4
    old = [_old_judge(lr, (s - 1) / max(1, steps - 1)) for s in range(1, steps + 1)]
    assert _rates(steps - 1, steps, lr=lr, floor=0.1) == old  # to the last bit
    assert old[-1] == pytest.approx(lr / 10) or steps == 1


def test_train_judge_stage_rates_unchanged_and_flat_after():
    lr, judge_steps = 1e-3, 50
    old = [_old_judge(lr, min(1.0, t / judge_steps)) for t in range(judge_steps + 20)]
    assert _rates(judge_steps, judge_steps + 20, lr=lr, floor=0.1) == old


def test_describe_judge_rates_unchanged():
    lr, steps = 2e-4, 40
    old = [
        lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (s - 1) / steps)))
        for s in range(1, steps + 1)
    ]
    assert _rates(steps, steps, lr=lr, floor=0.1) == pytest.approx(old, rel=1e-14)


def test_flow_pretrain_rates_unchanged():
    lr, steps, warmup = 3e-3, 30, 5

    def old(step):
        if step < warmup:
            return (step + 1) / warmup
        frac = (step - warmup) / max(1, steps - warmup)
        return 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * frac))

    assert _rates(steps, steps, lr=lr, warmup=warmup, floor=0.1) == [
        lr * old(s) for s in range(steps)
    ]


def test_shape_critic_rates_unchanged():
    lr, steps = 2e-3, 25
    old = [lr * 0.5 * (1 + math.cos(math.pi * s / steps)) for s in range(steps)]
    assert _rates(steps, steps, lr=lr) == pytest.approx(old, rel=1e-14, abs=1e-18)


def test_controller_schedule_is_the_shared_one():
    """The RL loop's factor: warm-up then constant, or warm-up then a cosine to 0 at
    trainer.steps (hand-worked: 10 steps, 2 of warm-up)."""
    from types import SimpleNamespace

    from mmyatt.step.trainer import Trainer

    def factor(schedule, warmup, step):
        floor = 0.0 if schedule == "cosine" else 1.0
        trainer = SimpleNamespace(warmup_steps=warmup, total_steps=10, floor=floor)
        return Trainer.lr_factor(trainer, step)

    assert [factor("constant", 2, t) for t in range(4)] == [0.5, 1.0, 1.0, 1.0]
    assert [factor("constant", 0, t) for t in (0, 9)] == [1.0, 1.0]
    # cosine after warm-up: step 2 -> 1, step 6 (half-way through 8) -> 0.5, step 10 -> 0
    assert [round(factor("cosine", 2, t), 6) for t in (0, 1, 2, 6, 10)] == [0.5, 1.0, 1.0, 0.5, 0.0]
    assert round(factor("cosine", 0, 5), 6) == 0.5
