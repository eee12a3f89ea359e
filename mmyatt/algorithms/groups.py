"""Group and batch statistics of per-sample rewards: what advantages and dynamic
sampling compute over prompt groups, and the global-batch moments made global through a
``reduce`` callable. Leaves out every estimator (``advantages.py``) and the policy loss.

Groups are given as ``group_index`` (N,) long with values in 0..B-1; samples of a group need
not be contiguous. Groups never span ranks, so group statistics are always local. Statistics
over the whole batch are made global through ``reduce``: a callable that sums a tensor across
ranks (e.g. an all-reduce with SUM), the identity when None.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

Reduce = Callable[[Tensor], Tensor]


def count_groups(group_index: Tensor) -> int:
    return int(group_index.max()) + 1 if group_index.numel() else 0


def group_sum(x: Tensor, group_index: Tensor, num_groups: int) -> Tensor:
    """(N,) -> (B,) per-group sums; works for any order of samples."""
    return x.new_zeros(num_groups).index_add_(0, group_index, x)


def group_mean_std(rewards: Tensor, group_index: Tensor) -> tuple[Tensor, Tensor]:
    """Per-sample mean and unbiased std of its group, both (N,).

    Unbiased (divide by G-1) as in DeepSeek's GRPO and verl. A group of one sample has no
    spread to estimate; its std is 0 (not NaN), so its advantage r - mean = 0 stays 0.
    """
    b = count_groups(group_index)
    count = group_sum(torch.ones_like(rewards), group_index, b)
    mean = group_sum(rewards, group_index, b) / count.clamp(min=1)
    dev = rewards - mean[group_index]
    var = group_sum(dev * dev, group_index, b) / (count - 1).clamp(min=1)
    return mean[group_index], var.sqrt()[group_index]


def batch_mean_std(x: Tensor, reduce: Reduce | None) -> tuple[Tensor, Tensor]:
    """Mean and unbiased std of ``x`` (N,) over the global batch, as 0-dim float32 tensors.

    Sum, sum of squares and count go through ``reduce`` together, in one tensor, so a single
    collective makes them global. They are accumulated in float64 because the
    sum-of-squares formula subtracts two large numbers.
    """
    x64 = x.double()
    count = torch.tensor(float(x.numel()), dtype=torch.float64, device=x.device)
    moments = torch.stack([x64.sum(), (x64 * x64).sum(), count])
    if reduce is not None:
        # a collective may hand back its result on the communication device
        moments = reduce(moments).to(device=x.device, dtype=torch.float64)
    total, total_sq, n = moments.unbind()
    mean = total / n.clamp(min=1)
    var = ((total_sq - n * mean * mean) / (n - 1).clamp(min=1)).clamp(min=0)
    return mean.float(), var.sqrt().float()
