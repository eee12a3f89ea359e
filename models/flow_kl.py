"""The KL reference of :class:`~mmyatt.models.flow.FlowPolicy` (the ``ReferenceKL`` and
``ClosedFormKL`` capabilities of :mod:`mmyatt.protocols`), as a mixin.

The reference is the base transformer with its LoRA adapters switched off (no copy), or
a frozen copy of the transformer; the closed-form KL compares the policy's and the
reference's Gaussian transition means (``flow_sde.kl_closed_form``).
"""

from __future__ import annotations

import copy

import torch
from torch import Tensor

from mmyatt.rollout import Rollout


class FlowReferenceKL:
    """Reference log-probs and the closed-form KL of the rollout's transitions, for a
    policy with ``transformer``, ``lora``, ``reference`` and ``_transitions`` /
    ``_entropy`` (FlowPolicy)."""

    _ref_model = None  # the frozen copy, when the reference is one

    def enable_reference(self) -> None:
        """Fix the KL reference: with LoRA and reference="lora_disabled" the base model
        (adapters off) is the reference and nothing is copied; otherwise snapshot a frozen
        copy of the current transformer."""
        if self.reference == "lora_disabled" and self.lora is not None:
            self._ref_model = None
            return
        self._ref_model = copy.deepcopy(self.transformer).eval().requires_grad_(False)

    def _reference_transitions(self, rollout: Rollout) -> tuple[Tensor, Tensor, Tensor]:
        with torch.no_grad():
            if self._ref_model is not None:
                return self._transitions(self._ref_model, rollout)
            if self.reference == "lora_disabled" and self.lora is not None:
                self.transformer.disable_adapters()
                try:
                    return self._transitions(self.transformer, rollout)
                finally:
                    self.transformer.enable_adapters()
        raise RuntimeError("no reference policy: call enable_reference() first")

    def reference_logprobs(self, rollout: Rollout) -> Tensor:
        """(N, A) log pi_ref of the rollout's transitions, no grad."""
        return self._reference_transitions(rollout)[0]

    def attach_reference_means(self, rollout: Rollout) -> Rollout:
        """Store the reference policy's transition means (N, A, ...) in the rollout's
        context ("ref_mean", fp32, no grad) for the closed-form KL of
        ``logprobs_with_kl``; returns the same rollout."""
        rollout.context["ref_mean"] = self._reference_transitions(rollout)[2].detach()
        return rollout

    def logprobs_with_kl(self, rollout: Rollout, estimator: str = "closed_form", block: int = 0):
        """(log-probs, entropy, KL) each (N, A): ``logprobs(with_entropy=True)`` plus the
        closed-form KL(pi || pi_ref) of every transition from one forward pass.

        Policy and reference steps are Gaussians with the same std (it depends only on the
        schedule), so KL = mean over elements of (mu - mu_ref)^2 / (2 var):
        ``"closed_form"`` uses the step's variance (std^2 = s^2 |Delta| for the SDE step,
        s^2 for CPS), the exact per-element KL; ``"closed_form_flowgrpo"`` divides by
        s^2 without the step length |Delta|, as flow_grpo's loss does (so its beta values
        carry over); for CPS both are the same. ``block`` > 0 keeps only the components
        that vary within ``block`` x ``block`` spatial tiles (``flow_sde.kl_closed_form``).
        Needs ``attach_reference_means`` first.
        """
        from mmyatt.models.flow_sde import kl_closed_form
        from mmyatt.protocols import CLOSED_FORM_KL

        if estimator not in CLOSED_FORM_KL:
            raise ValueError(f"estimator must be one of {CLOSED_FORM_KL}, got {estimator!r}")
        ctx = rollout.context
        if "ref_mean" not in ctx:
            raise RuntimeError("no reference means: call attach_reference_means(rollout) first")
        lp, std, mu = self._transitions(self.transformer, rollout)
        kl_std = std
        if estimator == "closed_form_flowgrpo" and ctx["sde_type"] == "sde":
            step = (ctx["sigma"] - ctx["sigma_next"]).clamp_min(0.0).sqrt()  # sqrt|Delta|
            kl_std = torch.where(step > 0, std / step.clamp_min(1e-30), std)
        kl = kl_closed_form(
            mu.flatten(0, 1), ctx["ref_mean"].flatten(0, 1), kl_std.reshape(-1), block=block
        )
        return lp, self._entropy(std), kl.reshape(lp.shape)
