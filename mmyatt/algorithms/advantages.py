"""Advantage estimators (GRPO, Dr. GRPO, RLOO, REINFORCE++) as pure functions of (N,)
rewards and their prompt groups, and the registry the config names them by. Leaves out
the loss, KL and dynamic sampling; the group statistics are ``groups.py``.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch
from torch import Tensor

from mmyatt.algorithms.groups import Reduce, batch_mean_std, count_groups, group_mean_std, group_sum


def grpo_advantages(
    rewards: Tensor,
    group_index: Tensor,
    *,
    scale_by_std: bool = True,
    std_mode: str = "group",
    eps: float = 1e-6,
    clip: float | None = None,
    reduce: Reduce | None = None,
) -> Tensor:
    """GRPO advantages (arXiv 2402.03300): (r - group mean) / (std + eps).

    Args:
        rewards: (N,) scalar reward per sample.
        group_index: (N,) long, the prompt group of each sample.
        scale_by_std: divide by the std; False gives Dr. GRPO's mean-only advantage.
        std_mode: "group" uses each group's unbiased std (groups of one sample get 0);
            "batch" uses one unbiased std over all rewards of the global batch (Flow-GRPO's
            global-std option, arXiv 2505.05470), made global through ``reduce``.
        eps: added to the std so zero-variance groups give 0 instead of NaN.
        clip: if set, clamp advantages to [-clip, clip].
        reduce: sums a tensor across ranks; only used by std_mode="batch".

    Returns:
        (N,) float32 advantages.
    """
    if std_mode not in ("group", "batch"):
        raise ValueError(f"std_mode must be one of ('group', 'batch'), got {std_mode!r}")
    rewards = rewards.float()
    mean, group_std = group_mean_std(rewards, group_index)
    adv = rewards - mean
    if scale_by_std:
        std = group_std if std_mode == "group" else batch_mean_std(rewards, reduce)[1]
        adv = adv / (std + eps)
    if clip is not None:
        adv = adv.clamp(-clip, clip)
    return adv


def drgrpo_advantages(rewards: Tensor, group_index: Tensor) -> Tensor:
    """Dr. GRPO advantages (arXiv 2503.20783): r - group mean, (N,) -> (N,) float32.

    Dropping the std division removes GRPO's bias towards groups whose rewards barely differ.
    """
    return grpo_advantages(rewards, group_index, scale_by_std=False)


def rloo_advantages(rewards: Tensor, group_index: Tensor) -> Tensor:
    """RLOO advantages (arXiv 2402.14740): r_i - mean of the other G-1 rewards of the group.

    r_i - (S - r_i) / (G - 1) = (G r_i - S) / (G - 1) with S the group sum. A group of one
    sample has no other sample to compare with; its advantage is 0.

    Args:
        rewards: (N,) scalar reward per sample.
        group_index: (N,) long, the prompt group of each sample.

    Returns:
        (N,) float32 advantages.
    """
    rewards = rewards.float()
    b = count_groups(group_index)
    count = group_sum(torch.ones_like(rewards), group_index, b)[group_index]
    total = group_sum(rewards, group_index, b)[group_index]
    adv = (count * rewards - total) / (count - 1).clamp(min=1)
    return torch.where(count > 1, adv, torch.zeros_like(adv))


def reinforce_pp_advantages(
    rewards: Tensor,
    group_index: Tensor | None = None,
    *,
    baseline: str = "none",
    eps: float = 1e-6,
    reduce: Reduce | None = None,
) -> Tensor:
    """REINFORCE++ advantages (arXiv 2501.03262): whitening over the global batch.

    (x - batch mean) / (batch std + eps) with x = r for baseline="none", or x = r - group mean
    for baseline="group" (REINFORCE++-baseline). Unlike GRPO the scale comes from the whole
    batch, so groups with tiny reward spread are not blown up. The std is unbiased.

    Args:
        rewards: (N,) scalar reward per sample.
        group_index: (N,) long; required for baseline="group".
        baseline: "none" or "group".
        eps: added to the batch std.
        reduce: sums a tensor across ranks so mean and std are those of the global batch.

    Returns:
        (N,) float32 advantages.
    """
    if baseline not in ("none", "group"):
        raise ValueError(f"baseline must be one of ('none', 'group'), got {baseline!r}")
    x = rewards.float()
    if baseline == "group":
        if group_index is None:
            raise ValueError("baseline='group' needs group_index")
        x = x - group_mean_std(x, group_index)[0]
    mean, std = batch_mean_std(x, reduce)
    return (x - mean) / (std + eps)


def _ignore_reduce(fn: Callable[[Tensor, Tensor], Tensor]) -> Callable[..., Tensor]:
    """Adapt an estimator with only group statistics (always local) to the common signature."""

    def estimator(rewards: Tensor, group_index: Tensor, reduce: Reduce | None = None) -> Tensor:
        return fn(rewards, group_index)

    return estimator


# Config name -> estimator with signature (rewards, group_index, reduce=None, **options).
ADVANTAGES: dict[str, Callable[..., Tensor]] = {
    "grpo": grpo_advantages,
    "drgrpo": _ignore_reduce(drgrpo_advantages),
    "rloo": _ignore_reduce(rloo_advantages),
    "reinforce_pp": partial(reinforce_pp_advantages, baseline="none"),
    "reinforce_pp_baseline": partial(reinforce_pp_advantages, baseline="group"),
}


def compute_advantages(
    name: str,
    rewards: Tensor,
    group_index: Tensor,
    reduce: Reduce | None = None,
    **kw,
) -> Tensor:
    """Advantages (N,) float32 by config name; ``kw`` are the estimator's own options."""
    if name not in ADVANTAGES:
        raise ValueError(f"unknown advantage estimator {name!r}; choose from {sorted(ADVANTAGES)}")
    return ADVANTAGES[name](rewards, group_index, reduce=reduce, **kw)


class Advantages:
    """The estimator ``name`` (a key of ``ADVANTAGES``) with its options, as one callable:
    (N,) rewards and their (N,) group index -> (N,) float32 advantages. ``reduce`` sums a
    tensor over ranks, for estimators with batch statistics."""

    def __init__(self, name: str, reduce: Reduce | None = None, **options):
        if name not in ADVANTAGES:
            raise ValueError(
                f"unknown advantage estimator {name!r}; choose from {sorted(ADVANTAGES)}"
            )
        self.name, self.reduce, self.options = name, reduce, options

    def __call__(self, rewards: Tensor, group_index: Tensor) -> Tensor:
        return compute_advantages(
            self.name, rewards, group_index, reduce=self.reduce, **self.options
        )
