"""The KL reference of :class:`~mmyatt.models.flow.FlowPolicy` (its ``ReferenceKL`` and
``ClosedFormKL`` capabilities of :mod:`mmyatt.protocols`).

The reference is the base transformer with its LoRA adapters switched off (no copy), or
a frozen copy of the transformer (:class:`FlowReference`, an object the policy holds);
the closed-form KL compares the policy's and the reference's Gaussian transition means
(``flow_sde.kl_closed_form``, :func:`transition_kl`).
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator

import torch
from torch import Tensor, nn

from mmyatt.models.flow_sde import kl_closed_form
from mmyatt.protocols import CLOSED_FORM_KL


class FlowReference:
    """Which module plays the KL reference: ``copy`` (a frozen snapshot) or, with LoRA
    and ``reference="lora_disabled"``, the trained transformer with its adapters off."""

    def __init__(self):
        self.copy: nn.Module | None = None
        self.lora_base = False

    def enable(self, transformer: nn.Module, *, lora_base: bool) -> None:
        """Fix the reference: the LoRA base (nothing copied) or a frozen copy of
        ``transformer`` as it is now."""
        self.lora_base = lora_base
        self.copy = None if lora_base else copy.deepcopy(transformer).eval().requires_grad_(False)

    @contextlib.contextmanager
    def module(self, transformer: nn.Module) -> Iterator[nn.Module]:
        """The reference module to run (no grad), given the policy's ``transformer``."""
        with torch.no_grad():
            if self.copy is not None:
                yield self.copy
            elif self.lora_base:
                transformer.disable_adapters()
                try:
                    yield transformer
                finally:
                    transformer.enable_adapters()
            else:
                raise RuntimeError("no reference policy: call enable_reference() first")


def transition_kl(
    std: Tensor, mu: Tensor, context: dict, estimator: str = "closed_form", block: int = 0
) -> Tensor:
    """(N, A) closed-form KL(pi || pi_ref) of each transition, from the policy's step std
    (N, A) and means (N, A, ...) and the reference means in ``context["ref_mean"]``.

    Policy and reference steps are Gaussians with the same std (it depends only on the
    schedule), so KL = mean over elements of (mu - mu_ref)^2 / (2 var):
    ``"closed_form"`` uses the step's variance (std^2 = s^2 |Delta| for the SDE step,
    s^2 for CPS), the exact per-element KL; ``"closed_form_flowgrpo"`` divides by
    s^2 without the step length |Delta|, as flow_grpo's loss does (so its beta values
    carry over); for CPS both are the same. ``block`` > 0 keeps only the components
    that vary within ``block`` x ``block`` spatial tiles (``flow_sde.kl_closed_form``).
    """
    if estimator not in CLOSED_FORM_KL:
        raise ValueError(f"estimator must be one of {CLOSED_FORM_KL}, got {estimator!r}")
    if "ref_mean" not in context:
        raise RuntimeError("no reference means: call attach_reference_means(rollout) first")
    kl_std = std
    if estimator == "closed_form_flowgrpo" and context["sde_type"] == "sde":
        step = (context["sigma"] - context["sigma_next"]).clamp_min(0.0).sqrt()  # sqrt|Delta|
        kl_std = torch.where(step > 0, std / step.clamp_min(1e-30), std)
    kl = kl_closed_form(
        mu.flatten(0, 1), context["ref_mean"].flatten(0, 1), kl_std.reshape(-1), block=block
    )
    return kl.reshape(std.shape)
