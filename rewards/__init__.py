"""Rewards, installed as ``mmyatt.rewards``.

Rule rewards are plain functions ``fn(completion, record, **kwargs) -> float``;
:class:`WeightedReward` combines them. Importing this package does not import torch.
"""

from mmyatt.rewards.rules import (
    REGISTRY,
    RewardError,
    WeightedReward,
    answer_tag_match,
    exact_match,
    extract_answer,
    format_check,
    numeric_match,
    resolve_reward,
)

__all__ = [
    "REGISTRY",
    "RewardError",
    "WeightedReward",
    "answer_tag_match",
    "exact_match",
    "extract_answer",
    "format_check",
    "numeric_match",
    "resolve_reward",
]
