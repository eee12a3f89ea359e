"""KL(pi || pi_ref) estimators from per-action log-probs (Schulman's k1, k2, k3) and
the lookup by config name. Leaves out the closed-form KL of Gaussian transitions, which
a flow policy computes from its transition means (``ClosedFormKL``).
"""

from __future__ import annotations

import torch
from torch import Tensor

from mmyatt.algorithms.losses import MAX_LOG_RATIO
from mmyatt.protocols import CLOSED_FORM_KL


def kl_k1(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    """k1 = log pi - log pi_ref per action: unbiased, high variance, can be negative.

    Schulman's estimators of KL(pi || pi_ref) from samples of pi:
    http://joschu.net/blog/kl-approx.html. Shapes: any, elementwise.
    """
    return logprobs - ref_logprobs


def kl_k2(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    """k2 = (log pi - log pi_ref)^2 / 2 per action: biased, low variance, >= 0."""
    return 0.5 * (logprobs - ref_logprobs).square()


def kl_k3(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    """k3 = exp(ref - logp) - (ref - logp) - 1 per action: unbiased, low variance, >= 0.

    The log-ratio is clamped to [-20, 20] first: a policy far from the reference would
    otherwise overflow exp to inf and poison the gradients with NaN.
    """
    log_ratio = (logprobs - ref_logprobs).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
    return torch.exp(-log_ratio) - 1.0 + log_ratio


KL_ESTIMATORS = {"k1": kl_k1, "k2": kl_k2, "k3": kl_k3}


# Closed-form KL of Gaussian transitions with a shared std (flow models): computed by the
# adapter from the policy's and the reference's transition means, not from log-probs
# (``ClosedFormKL.logprobs_with_kl``; the math is ``mmyatt.models.flow_sde.kl_closed_form``).


def kl_penalty(logprobs: Tensor, ref_logprobs: Tensor, estimator: str) -> Tensor:
    """Per-action KL(pi || pi_ref) estimate, (N, A) -> (N, A), by estimator name."""
    if estimator in CLOSED_FORM_KL:
        raise ValueError(
            f"KL estimator {estimator!r} is computed by the policy from transition means "
            "(policy.logprobs_with_kl), not from log-probs"
        )
    if estimator not in KL_ESTIMATORS:
        raise ValueError(f"unknown KL estimator {estimator!r}; choose from {sorted(KL_ESTIMATORS)}")
    return KL_ESTIMATORS[estimator](logprobs, ref_logprobs)
