"""An exponential moving average of a set of weights (the ``EMA`` capability of
:mod:`mmyatt.protocols`): an object an adapter holds, over the parameters a callable
names (with LoRA: the adapter only). It keeps the averages and nothing of the adapter.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
from torch import Tensor, nn


class EMAWeights:
    """``update`` / ``state`` / ``load_state`` / ``swapped_in`` over ``trainable()``."""

    def __init__(self, trainable: Callable[[], dict[str, nn.Parameter]]):
        self.trainable = trainable
        self.averages: dict[str, Tensor] | None = None  # name -> weight; None before an update

    @torch.no_grad()
    def update(self, decay: float = 0.9) -> None:
        """ema <- decay * ema + (1 - decay) * w over the trainable weights (the first call
        copies them). flow_grpo evaluates with EMA weights (decay 0.9 every 8 steps)."""
        if not 0.0 <= decay <= 1.0:
            raise ValueError(f"decay must be in [0, 1], got {decay}")
        params = self.trainable()
        if self.averages is None or set(self.averages) != set(params):
            self.averages = {n: p.detach().clone() for n, p in params.items()}
            return
        for n, p in params.items():
            self.averages[n].lerp_(p.detach(), 1.0 - decay)

    def state(self) -> dict[str, Tensor] | None:
        """The EMA weights (name -> tensor) for checkpoints; None before any update."""
        return None if self.averages is None else {n: t.clone() for n, t in self.averages.items()}

    def load_state(self, state: dict[str, Tensor] | None) -> None:
        self.averages = None if state is None else {n: t.clone() for n, t in state.items()}

    @contextlib.contextmanager
    def swapped_in(self) -> Iterator[None]:
        """The EMA weights in place of the trained ones (e.g. for evaluation sampling),
        restored on exit. Before any ``update`` the weights are used unchanged."""
        if self.averages is None:
            yield
            return
        params = self.trainable()
        backup = {n: p.detach().clone() for n, p in params.items()}
        with torch.no_grad():
            for n, p in params.items():
                p.copy_(self.averages[n])
        try:
            yield
        finally:
            with torch.no_grad():
                for n, p in params.items():
                    p.copy_(backup[n])
