"""The weight average that pretraining saves (models/builtin/pretrain_flow.py ``_Ema``),
checked against hand-worked values."""

from __future__ import annotations

import torch

from mmyatt.models.builtin.pretrain_flow import _Ema, _swapped, pretrain_flow
from mmyatt.models.flow import FlowPolicy


def test_ema_warms_up_then_averages_by_hand():
    p = torch.nn.Parameter(torch.tensor([0.0]))
    avg = _Ema([p], decay=0.5)
    with torch.no_grad():
        p.fill_(10.0)
    avg.update()  # decay min(0.5, 1/10) = 0.1: 0.1 * 0 + 0.9 * 10
    assert torch.allclose(avg.shadow[0], torch.tensor([9.0]))
    with torch.no_grad():
        p.fill_(1.0)
    avg.update()  # decay min(0.5, 2/11) = 2/11: 9 * 2/11 + 1 * 9/11 = 27/11
    assert torch.allclose(avg.shadow[0], torch.tensor([27.0 / 11.0]))
    for _ in range(20):  # n >= 8: the decay is the cap, 0.5
        avg.update()
    assert abs(float(avg.shadow[0]) - 1.0) < 1e-5


def test_swapped_holds_the_average_only_inside_the_block():
    p = torch.nn.Parameter(torch.tensor([2.0]))
    avg = _Ema([p], decay=0.9)
    with torch.no_grad():
        p.fill_(4.0)  # live 4, average still 2
    with _swapped(avg):
        assert float(p) == 2.0
    assert float(p) == 4.0 and float(avg.shadow[0]) == 2.0
    with _swapped(None):  # no average: the live weights
        assert float(p) == 4.0


def test_init_starts_from_the_given_weights(tmp_path):
    small = dict(steps=1, batch_size=2, image_size=16, num_layers=1, eval_guidance=(), log_every=0)
    pretrain_flow(tmp_path / "a", seed=0, lr=1e-3, **small)
    m = pretrain_flow(tmp_path / "b", seed=1, lr=1e-9, init=tmp_path / "a", ema=0.9, **small)
    assert m["init"] == str(tmp_path / "a") and m["steps_done"] == 1
    a, b = (FlowPolicy.load(tmp_path / d).transformer.state_dict() for d in ("a", "b"))
    # seed 1's own init differs; one step at lr 1e-9 (and its average) stays at a's weights
    assert all(torch.allclose(a[k], b[k], atol=1e-6) for k in a)
