"""An exponential moving average of a policy's trainable weights (the ``EMA`` capability
of :mod:`mmyatt.protocols`), as a mixin for adapters whose ``module()`` holds them."""

from __future__ import annotations

import contextlib

import torch
from torch import Tensor, nn


class EMAWeights:
    """``ema_update`` / ``ema_state`` / ``load_ema_state`` / ``ema_weights`` over the
    parameters of ``self.module()`` that require grad (with LoRA: the adapter only)."""

    _ema: dict[str, Tensor] | None = None  # name -> averaged weight; None before any update

    def _trainable(self) -> dict[str, nn.Parameter]:
        return {n: p for n, p in self.module().named_parameters() if p.requires_grad}

    @torch.no_grad()
    def ema_update(self, decay: float = 0.9) -> None:
        """ema <- decay * ema + (1 - decay) * w over the trainable weights (the first call
        copies them). flow_grpo evaluates with EMA weights (decay 0.9 every 8 steps)."""
        if not 0.0 <= decay <= 1.0:
            raise ValueError(f"decay must be in [0, 1], got {decay}")
        params = self._trainable()
        if self._ema is None or set(self._ema) != set(params):
            self._ema = {n: p.detach().clone() for n, p in params.items()}
            return
        for n, p in params.items():
            self._ema[n].lerp_(p.detach(), 1.0 - decay)

    def ema_state(self) -> dict[str, Tensor] | None:
        """The EMA weights (name -> tensor) for checkpoints; None before any update."""
        return None if self._ema is None else {n: t.clone() for n, t in self._ema.items()}

    def load_ema_state(self, state: dict[str, Tensor] | None) -> None:
        self._ema = None if state is None else {n: t.clone() for n, t in state.items()}

    @contextlib.contextmanager
    def ema_weights(self):
        """Swap the EMA weights in (e.g. for evaluation sampling), restore on exit. Before
        any ``ema_update`` the weights are used unchanged."""
        if self._ema is None:
            yield self
            return
        params = self._trainable()
        backup = {n: p.detach().clone() for n, p in params.items()}
        with torch.no_grad():
            for n, p in params.items():
                p.copy_(self._ema[n])
        try:
            yield self
        finally:
            with torch.no_grad():
                for n, p in params.items():
                    p.copy_(backup[n])
