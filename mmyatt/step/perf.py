"""Model FLOP/s and MFU of a step's generation and update: the ``perf/*`` metrics.

For text and VLM policies (the ``DecoderFlops`` capability); a flow policy logs none.
Per step, from the rollout and the phases' measured seconds (``timing/generate_s``,
``timing/update_s``):

* ``perf/generate_tflops``: ``rollout_flops``' generation FLOPs of the step's rollout
  (each prompt prefilled once, then its rows' actions) over the generate seconds;
* ``perf/update_tflops``: its training FLOPs (forward + backward, three forwards' worth)
  of the samples this rank trains on, times the PPO epochs (every epoch's minibatches
  and micro-batches together pass each sample once), over the update seconds;
* ``perf/generate_mfu``, ``perf/update_mfu``: those over the device's dense bf16 peak
  (``mmyatt.step.flops.PEAK_BF16``), only where it is known: none on a CPU or an unlisted GPU.

Model FLOPs are the ones the model needs (``mmyatt/step/flops.py``): padding, a VLM's vision
tower, the old log-prob and KL reference passes and groups that dynamic sampling drops
are not counted. The figures are this controller's (its own rollout over its own phase
seconds, like ``timing/*``); a model-parallel controller's update is spread over its
processes, so its update figure is per device of the group.
"""

from __future__ import annotations

import torch

from mmyatt.rollout import Rollout
from mmyatt.step.flops import ModelFlops, mfu, peak_bf16_flops, rollout_flops


def device_peak(device: torch.device) -> float | None:
    """The dense bf16 peak of ``device`` (FLOP/s); None on a CPU or an unlisted GPU."""
    if device.type != "cuda":
        return None
    return peak_bf16_flops(torch.cuda.get_device_name(device))


class StepFlops:
    """The ``perf/*`` metrics of a step (see the module docstring): ``flops`` the policy's
    decoder, ``peak`` the device's FLOP/s (None: no MFU), ``epochs`` the update's passes
    over the samples, ``update_devices`` the devices one controller trains on."""

    def __init__(
        self, flops: ModelFlops, *, peak: float | None, epochs: int = 1, update_devices: int = 1
    ):
        self.flops, self.peak = flops, peak
        self.epochs, self.update_devices = epochs, max(update_devices, 1)

    def __call__(
        self, generated: Rollout, trained: Rollout, seconds: dict[str, float]
    ) -> dict[str, float]:
        """The metrics of a step that generated ``generated`` and trained on ``trained``,
        its phases having taken ``seconds`` (``PhaseTimer.seconds``); a phase that did
        not run (no seconds) logs nothing."""
        generate, _ = rollout_flops(generated, self.flops)
        _, update = rollout_flops(trained, self.flops)
        phases = {"generate": generate, "update": update * self.epochs / self.update_devices}
        out: dict[str, float] = {}
        for phase, flops in phases.items():
            s = seconds.get(phase, 0.0)
            if s <= 0:
                continue
            out[f"perf/{phase}_tflops"] = flops / s / 1e12
            util = mfu(flops, s, self.peak)
            if util is not None:
                out[f"perf/{phase}_mfu"] = util
        return out
