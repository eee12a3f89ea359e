"""The idle policy off the device in colocate steps (``placement.offload_policy``).

In a colocate step on a GPU the judge's phase runs while the policy waits, and the
policy's generation needs its weights but not its optimizer's state. So, on a device
other than the CPU:

- when the step starts, the optimizer's state (AdamW: two tensors the size of the
  weights, in float32) moves to host memory;
- when generation has ended on every controller, the weights (and the module's buffers)
  follow;
- when the judge's phase has ended, both come back, before training needs them.

Each move hands the allocator's cache back to the device (``torch.cuda.empty_cache``),
so the judge's process can use what the policy left. The parameters stay the same
``Parameter`` objects (``Module.to`` replaces their data), so the optimizer, the engine
and the checkpoint see the same tensors as before. Gradients are not moved: the update
drops them when it ends (``Controller.update``). On the CPU there is nothing to move and
every call returns at once.
"""

from __future__ import annotations

import time

import torch
from torch import nn


class PolicyOffload:
    def __init__(self, module: nn.Module, optimizer: torch.optim.Optimizer):
        self.module, self.optimizer = module, optimizer
        first = next(module.parameters(), None)
        self.home = first.device if first is not None else torch.device("cpu")
        self.active = self.home.type != "cpu"
        self.weights_away = False
        self._state_devices: dict[tuple[int, str], torch.device] = {}  # (id(param), key)
        self.seconds = 0.0  # moves of the current step, both ways

    def optimizer_off(self) -> None:
        """The optimizer's state to host memory (a no-op when it is already there)."""
        if not self.active or self._state_devices:
            return
        t0 = time.perf_counter()
        for p, state in self.optimizer.state.items():
            for k, v in state.items():
                if isinstance(v, torch.Tensor) and v.device.type != "cpu":
                    self._state_devices[(id(p), k)] = v.device
                    state[k] = v.to("cpu")
        self._settle(t0)

    def weights_off(self) -> None:
        """The module's weights and buffers to host memory."""
        if not self.active or self.weights_away:
            return
        t0 = time.perf_counter()
        self.module.to("cpu")
        self.weights_away = True
        self._settle(t0)

    def on(self) -> None:
        """Everything moved back to the device it came from."""
        if not self.active or not (self.weights_away or self._state_devices):
            return
        t0 = time.perf_counter()
        if self.weights_away:
            self.module.to(self.home)
            self.weights_away = False
        for p, state in self.optimizer.state.items():
            for k in list(state):
                dev = self._state_devices.get((id(p), k))
                if dev is not None:
                    state[k] = state[k].to(dev)
        self._state_devices = {}
        self._settle(t0, release=False)

    def take_seconds(self) -> float:
        s, self.seconds = self.seconds, 0.0
        return s

    def _settle(self, t0: float, release: bool = True) -> None:
        if self.home.type == "cuda":
            if release:
                torch.cuda.empty_cache()  # what the policy left, for the judge's process
            torch.cuda.synchronize(self.home)
        self.seconds += time.perf_counter() - t0
