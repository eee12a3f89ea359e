"""The clipped policy loss as pure tensor math: PPO-clip with DAPO's clip-higher and
dual-clip, masked means, the loss aggregations (token and sequence means) split into
numerator and denominator so that they add up over ranks, and the entropy of logits.
Leaves out KL estimators (``kl.py``) and who calls the policy (``mmyatt.step.policy_loss``).

Shapes: N samples, A actions (tokens or denoising steps), V vocabulary.
"""

from __future__ import annotations

import torch
from torch import Tensor

# Log-ratios are clamped to this range before exp: exp(20) ~ 4.9e8 is finite in fp32/bf16,
# while exp(89) overflows fp32 to inf, and inf in the forward pass turns into 0 * inf = NaN
# gradients even where the value is later discarded.
MAX_LOG_RATIO = 20.0


def masked_mean(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Mean of ``x`` where ``mask`` > 0, over all elements or along ``dim``; 0 where empty.

    Masked positions are replaced, not multiplied, so -inf/NaN there cannot leak.
    """
    valid = mask > 0
    w = mask.to(x.dtype)
    x = torch.where(valid, x, torch.zeros_like(x)) * w
    if dim is None:
        num, den = x.sum(), w.sum()
    else:
        num, den = x.sum(dim), w.sum(dim)
    return num / torch.where(den > 0, den, torch.ones_like(den))


def ppo_clip_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    dual_clip: float | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO-clip per-action loss (arXiv 1707.06347) with DAPO clip-higher and dual-clip.

    ratio = exp(logprobs - old_logprobs); loss = max(-A ratio, -A clamp(ratio, 1 - clip_low,
    1 + clip_high)). A clip_high above clip_low (DAPO, arXiv 2503.14476) lets unlikely tokens
    with A > 0 grow further, which keeps entropy from collapsing. With dual_clip = c > 1
    (arXiv 1912.09729, as in verl), actions with A < 0 have their loss capped at -A c, so one
    action with a huge ratio cannot dominate the update.

    The log-ratio is clamped to [-20, 20] before exp (see ``MAX_LOG_RATIO``); beyond that
    range the action is clipped anyway or its gradient would be meaningless.

    Args:
        logprobs: (N, A) log pi(a|s) under the current policy (requires grad).
        old_logprobs: (N, A) log pi_old(a|s) recorded at sampling time.
        advantages: (N,) broadcast over actions, or (N, A).
        mask: (N, A), > 0 where an action counts. Masked positions may hold -inf log-probs.
        clip_low, clip_high: the ratio is clipped to [1 - clip_low, 1 + clip_high].
        dual_clip: the constant c (> 1) of dual-clip, or None.

    Returns:
        loss: (N, A) per-action loss, exactly 0 where mask is 0; aggregate with
            ``loss_terms``/``aggregate_loss``.
        metrics: detached 0-dim tensors over valid actions: "clip_frac" (the clipped term was
            larger), "clip_frac_low", "clip_frac_high" (the same, split by bound),
            "ratio_mean", "ratio_max", "approx_kl" (mean of old - new, k1), and
            "dual_clip_frac" when dual_clip is set.
    """
    if dual_clip is not None and dual_clip <= 1.0:
        raise ValueError(f"dual_clip must be > 1, got {dual_clip}")
    valid = mask > 0
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(-1)
    advantages = advantages.expand_as(logprobs)
    # Padding can hold -inf on both sides; -inf - -inf = NaN must not reach exp or the sums.
    log_ratio = torch.where(valid, logprobs - old_logprobs, torch.zeros_like(logprobs))
    ratio = torch.exp(log_ratio.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO))
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    loss = torch.maximum(unclipped, clipped)
    took_clip = clipped > unclipped
    metrics = {
        "clip_frac": took_clip,
        "clip_frac_low": took_clip & (ratio < 1.0 - clip_low),
        "clip_frac_high": took_clip & (ratio > 1.0 + clip_high),
    }
    if dual_clip is not None:
        cap = -advantages * dual_clip
        capped = (advantages < 0) & (cap < loss)
        loss = torch.where(capped, cap, loss)
        metrics["dual_clip_frac"] = capped
    loss = torch.where(valid, loss, torch.zeros_like(loss))

    with torch.no_grad():
        metrics = {k: masked_mean(v.float(), mask) for k, v in metrics.items()}
        metrics["ratio_mean"] = masked_mean(ratio, mask)
        # Ratios are positive, so zeros at masked positions never exceed a valid ratio.
        metrics["ratio_max"] = torch.where(valid, ratio, torch.zeros_like(ratio)).max()
        metrics["approx_kl"] = masked_mean(-log_ratio, mask)
    return loss, {k: v.detach() for k, v in metrics.items()}


LOSS_AGG_MODES = (
    "token-mean",
    "seq-mean-token-mean",
    "seq-mean-token-sum",
    "seq-mean-token-sum-norm",
)


def loss_terms(
    loss_mat: Tensor, mask: Tensor, mode: str, *, max_len: int | None = None
) -> tuple[Tensor, Tensor]:
    """Numerator and denominator of an aggregated loss, additive across ranks.

    The loss is numerator / denominator; for a batch split across ranks, the sum of the
    numerators over the sum of the denominators equals the loss of the whole batch, which the
    mean of per-rank losses does not (ranks hold different numbers of tokens and sequences).

    Modes ("sequences" are those with at least one valid action; fully masked samples, e.g.
    overlong-filtered ones, count as absent in every mode):
        "token-mean": sum over valid actions / number of valid actions (DAPO).
        "seq-mean-token-mean": mean over sequences of each sequence's action mean (GRPO).
        "seq-mean-token-sum": mean over sequences of each sequence's action sum.
        "seq-mean-token-sum-norm": action sum divided by the constant ``max_len``, mean over
            sequences (Dr. GRPO, arXiv 2503.20783: no length normalization bias).

    Args:
        loss_mat: (N, A) per-action loss.
        mask: (N, A), > 0 where an action counts; used as weights.
        mode: one of ``LOSS_AGG_MODES``.
        max_len: the constant for "seq-mean-token-sum-norm".

    Returns:
        numerator: 0-dim, differentiable. denominator: 0-dim float, without grad.
    """
    if mode not in LOSS_AGG_MODES:
        raise ValueError(f"unknown loss aggregation {mode!r}; choose from {LOSS_AGG_MODES}")
    w = mask.to(loss_mat.dtype)
    weighted = torch.where(mask > 0, loss_mat, torch.zeros_like(loss_mat)) * w
    if mode == "token-mean":
        return weighted.sum(), w.sum().detach()
    tokens = w.sum(-1)
    num_seqs = (tokens > 0).to(loss_mat.dtype).sum().detach()
    seq_sum = weighted.sum(-1)
    if mode == "seq-mean-token-mean":
        return (seq_sum / torch.where(tokens > 0, tokens, torch.ones_like(tokens))).sum(), num_seqs
    if mode == "seq-mean-token-sum":
        return seq_sum.sum(), num_seqs
    if max_len is None or max_len <= 0:
        raise ValueError(f"mode {mode!r} needs a positive max_len, got {max_len}")
    return seq_sum.sum() / max_len, num_seqs


def aggregate_loss(
    loss_mat: Tensor, mask: Tensor, mode: str, *, max_len: int | None = None
) -> Tensor:
    """(N, A) per-action loss -> 0-dim loss; see ``loss_terms`` for the modes.

    0 (still differentiable, zero gradient) when nothing is valid.
    """
    num, den = loss_terms(loss_mat, mask, mode, max_len=max_len)
    return num / torch.where(den > 0, den, torch.ones_like(den))


def entropy_from_logits(logits: Tensor) -> Tensor:
    """Entropy of softmax(logits), (..., V) -> (...).

    Computed from log_softmax, so large logits do not overflow. Logits of -inf (banned
    tokens) have p = 0 and contribute 0; their log-prob is replaced before the product, since
    0 * -inf would be NaN in the value and the gradient.
    """
    logp = torch.log_softmax(logits, dim=-1)
    finite_logp = torch.where(torch.isneginf(logp), torch.zeros_like(logp), logp)
    return -(logp.exp() * finite_logp).sum(-1)
