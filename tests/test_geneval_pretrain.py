"""The weight average that pretraining saves (models/builtin/pretrain_flow.py ``_Ema``),
checked against hand-worked values."""

from __future__ import annotations

import torch

from mmyatt.models.builtin.pretrain_flow import _Ema, _swapped


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
