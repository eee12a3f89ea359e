"""The learning-rate schedule the training loops share: linear warm-up, then a cosine to a
floor, then flat, as a :class:`torch.optim.lr_scheduler.LambdaLR`.

A leaf module (torch and math only), so adapters and their training scripts import it
without importing the engine.

>>> [round(cosine_factor(t, 4, floor=0.1), 4) for t in range(6)]
[1.0, 0.8682, 0.55, 0.2318, 0.1, 0.1]
>>> [round(cosine_factor(t, 6, warmup=2), 4) for t in range(4)]
[0.5, 1.0, 1.0, 0.8536]
"""

from __future__ import annotations

import math

import torch


def cosine_factor(step: int, total: int, *, warmup: int = 0, floor: float = 0.0) -> float:
    """The multiple of the base learning rate at optimizer step ``step`` (0 = the first):
    ``(step + 1) / warmup`` for the first ``warmup`` steps, then a half cosine from 1 at
    ``step == warmup`` down to ``floor`` at ``step == total``, and ``floor`` after it."""
    if step < warmup:
        return (step + 1) / warmup
    frac = min(1.0, (step - warmup) / max(1, total - warmup))
    return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * frac))


def cosine_schedule(
    optimizer: torch.optim.Optimizer, total: int, *, warmup: int = 0, floor: float = 0.0
) -> torch.optim.lr_scheduler.LambdaLR:
    """A ``LambdaLR`` over ``optimizer`` following :func:`cosine_factor`: it sets step 0's
    rate when made; call its ``step()`` after each ``optimizer.step()``."""
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: cosine_factor(step, total, warmup=warmup, floor=floor)
    )
