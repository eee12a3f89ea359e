"""mmyatt.step.profile: timers count the outermost call only, "other" is the rest of the
step, shares add up to 1, and patches come off again."""

from __future__ import annotations

import time

import pytest
import torch

from mmyatt.bench.runs import merge_profiles
from mmyatt.step.profile import StepProfile, instrument_common


class Box:
    def slow(self, s):
        time.sleep(s)
        return s

    def outer(self, s):
        time.sleep(s)
        return self.slow(s)  # nested: counted as the outer call's kind only


def test_outermost_call_counts_and_other_is_the_rest():
    prof = StepProfile()
    box = Box()
    prof.patch(box, "slow", "forward")
    prof.patch(box, "outer", "reward")
    for _ in range(2):
        prof.begin_step()
        box.slow(0.02)
        box.outer(0.01)  # 0.02 s of reward, none of it forward
        time.sleep(0.01)  # outside every timer: other
        prof.end_step()
    s = prof.summary(skip=1)
    assert s["steps_profiled"] == 1
    sec = s["seconds"]
    assert sec["forward"] == pytest.approx(0.02, abs=0.008)
    assert sec["reward"] == pytest.approx(0.02, abs=0.008)
    assert sec["other"] == pytest.approx(0.01, abs=0.008)
    assert sum(s["share"].values()) == pytest.approx(1.0, abs=1e-9)
    assert s["model_compute_share"] == pytest.approx(s["share"]["forward"])
    prof.restore()
    assert "slow" not in vars(box) and "outer" not in vars(box)


def test_common_timers_see_backward_and_optimizer_and_restore():
    prof = StepProfile()
    w = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.SGD([w], lr=0.1)
    original_backward = torch.Tensor.backward
    instrument_common(prof, opt)
    prof.begin_step()
    (w * 2).sum().backward()
    opt.step()
    prof.end_step()
    prof.restore()
    row = prof.steps[0]
    assert row["backward"] > 0 and row["optimizer"] > 0 and "forward" not in row
    assert torch.Tensor.backward is original_backward
    assert "step" not in vars(opt)
    assert torch.allclose(w.detach(), torch.full((3,), 0.8))  # the real calls ran


def test_merge_profiles_averages_controllers():
    def rank(fwd, other):
        step = fwd + other
        return {
            "summary": {
                "steps_profiled": 3,
                "step_s": step,
                "seconds": {"forward": fwd, "other": other},
                "model_compute_share": fwd / step,
            }
        }

    m = merge_profiles([rank(0.6, 0.4), rank(0.8, 0.2)])
    assert m["controllers"] == 2 and m["step_s"] == pytest.approx(1.0)
    assert m["share"] == pytest.approx({"forward": 0.7, "other": 0.3})
    assert m["model_compute_share"] == pytest.approx(0.7)
    assert m["model_compute_share_per_controller"] == pytest.approx([0.6, 0.8])
    assert merge_profiles([]) == {}
