"""DAPO's dynamic sampling (arXiv 2503.14476) as pure functions: which prompt groups
carry a learning signal, and how many kept groups each rank trains on. Leaves out the
refill loop over generation rounds (``mmyatt.step.sampling``).
"""

from __future__ import annotations

from torch import Tensor

from mmyatt.algorithms.groups import count_groups


def group_has_variance(
    rewards: Tensor, group_index: Tensor, num_groups: int | None = None, *, eps: float = 1e-6
) -> Tensor:
    """(B,) bool: True for groups whose rewards are not all equal (max - min > eps).

    DAPO's dynamic sampling (arXiv 2503.14476) keeps only these: a group with equal rewards
    has zero advantage everywhere and contributes no gradient. Groups with no sample (index
    below ``num_groups`` but absent) are False.

    Args:
        rewards: (N,) scalar reward per sample.
        group_index: (N,) long, the prompt group of each sample.
        num_groups: B; defaults to max(group_index) + 1.
    """
    b = count_groups(group_index) if num_groups is None else num_groups
    rewards = rewards.float()
    hi = rewards.new_zeros(b).scatter_reduce(0, group_index, rewards, "amax", include_self=False)
    lo = rewards.new_zeros(b).scatter_reduce(0, group_index, rewards, "amin", include_self=False)
    return (hi - lo) > eps


def allocate_quota(counts: list[int], target: int) -> list[int]:
    """How many kept groups each rank trains on so the global total is ``target``.

    ``counts`` are the kept groups per rank in rank order (e.g. after an all-gather); ranks in
    order take min(count, remaining). Every rank computes the same answer from the same
    counts, with no further communication. The sum is min(target, sum(counts)).
    """
    if target < 0 or any(c < 0 for c in counts):
        raise ValueError(f"counts and target must be >= 0, got {counts} and {target}")
    quota, remaining = [], target
    for c in counts:
        take = min(c, remaining)
        quota.append(take)
        remaining -= take
    return quota
