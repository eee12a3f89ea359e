"""What the built-in judges' training scripts share: the SFT step on a VLM judge
(``VLMPolicy.sft_loss``, gradient norm clipped to 1, AdamW without weight decay) and the
loop's bookkeeping: every measurement is taken in eval mode without gradients, stamped
with the step and the seconds since the start, logged as one JSON line and kept in the
run's history. Each script keeps its own curriculum, schedule and checkpoint choice."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch


def sft_step(policy, opt, batch: list[dict], params=None, clip: float = 1.0):
    """One SFT step of a judge: ``policy.sft_loss(batch)``, backward, gradient norm clipped
    to ``clip`` over ``params`` (default: every parameter), optimizer step; the loss."""
    loss = policy.sft_loss(batch)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(policy.module().parameters() if params is None else params, clip)
    opt.step()
    return loss


class JudgeSFT:
    """One judge's fine-tuning run: AdamW at ``lr`` over ``params`` (default: every
    parameter of the policy's module), the step, the clock and ``history``."""

    def __init__(
        self, policy, *, lr: float, params=None, log: Callable[[str], None] | None = print
    ):
        self.policy, self.model, self.params = policy, policy.module(), params
        trained = self.model.parameters() if params is None else params
        self.opt = torch.optim.AdamW(trained, lr=lr, weight_decay=0.0)
        self.say = log or (lambda _msg: None)
        self.history: list[dict[str, Any]] = []
        self.started = time.perf_counter()
        self.model.train()

    def step(self, batch: list[dict]) -> torch.Tensor:
        return sft_step(self.policy, self.opt, batch, self.params)

    def seconds(self) -> float:
        return time.perf_counter() - self.started

    @contextmanager
    def evaluating(self) -> Iterator[None]:
        """Eval mode and no gradients inside; training mode again on leaving."""
        self.model.eval()
        try:
            with torch.no_grad():
                yield
        finally:
            self.model.train()

    def record(self, metrics: dict[str, Any], *, step: int, **fields) -> dict[str, Any]:
        """``metrics`` with the step, the seconds so far and ``fields`` (loss, stage, ...),
        logged and kept in ``history``."""
        metrics.update(step=step, seconds=round(self.seconds(), 1), **fields)
        self.history.append(metrics)
        self.say(json.dumps(metrics))
        return metrics
