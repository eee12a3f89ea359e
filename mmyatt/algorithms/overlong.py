"""DAPO's overlong handling (arXiv 2503.14476): the soft length penalty added to the
reward, and the filter that leaves truncated samples out of the loss.
"""

from __future__ import annotations

import torch
from torch import Tensor


def overlong_penalty(lengths: Tensor, max_len: int, buffer: int, penalty: float = 1.0) -> Tensor:
    """DAPO soft overlong punishment (arXiv 2503.14476), (N,) lengths -> (N,) float32 reward.

    0 up to max_len - buffer, then linear down to -penalty at max_len, -penalty beyond:
        L <= max_len - buffer:            0
        max_len - buffer < L <= max_len:  ((max_len - buffer) - L) / buffer * penalty
        L > max_len:                      -penalty
    """
    if not 0 < buffer <= max_len:
        raise ValueError(f"buffer must be in (0, max_len={max_len}], got {buffer}")
    start = max_len - buffer
    lengths = lengths.float()
    ramp = (start - lengths).clamp(max=0) / buffer * penalty
    return torch.where(lengths > max_len, torch.full_like(lengths, -penalty), ramp)


def overlong_filter_mask(mask: Tensor, truncated: Tensor) -> Tensor:
    """(N, A) mask with every action of truncated samples ((N,) bool) zeroed; same dtype.

    DAPO's overlong filtering: a truncated sample's reward says nothing about its unfinished
    answer, so it is left out of the loss.
    """
    return torch.where(truncated.unsqueeze(-1), torch.zeros_like(mask), mask)
