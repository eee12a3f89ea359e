"""RL algorithms as pure tensor functions: advantages, policy loss, KL, entropy, DAPO helpers.

Nothing here knows about modality or distributed setup. A rollout is N samples x A actions
(tokens or denoising steps); N = B prompts x G samples per prompt. Shapes in docstrings use
B prompts, G samples per prompt, N = B*G samples, A actions, V vocabulary.

Groups are given as ``group_index`` (N,) long with values in 0..B-1; samples of a group need
not be contiguous. Groups never span ranks, so group statistics are always local. Statistics
over the whole batch are made global through ``reduce``: a callable that sums a tensor across
ranks (e.g. an all-reduce with SUM), the identity when None.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch
from torch import Tensor

from mmyatt.protocols import CLOSED_FORM_KL

Reduce = Callable[[Tensor], Tensor]

# Log-ratios are clamped to this range before exp: exp(20) ~ 4.9e8 is finite in fp32/bf16,
# while exp(89) overflows fp32 to inf, and inf in the forward pass turns into 0 * inf = NaN
# gradients even where the value is later discarded.
_MAX_LOG_RATIO = 20.0


# --- group and batch statistics ------------------------------------------------------------


def _num_groups(group_index: Tensor) -> int:
    return int(group_index.max()) + 1 if group_index.numel() else 0


def _group_sum(x: Tensor, group_index: Tensor, num_groups: int) -> Tensor:
    """(N,) -> (B,) per-group sums; works for any order of samples."""
    return x.new_zeros(num_groups).index_add_(0, group_index, x)


def _group_mean_std(rewards: Tensor, group_index: Tensor) -> tuple[Tensor, Tensor]:
    """Per-sample mean and unbiased std of its group, both (N,).

    Unbiased (divide by G-1) as in DeepSeek's GRPO and verl. A group of one sample has no
    spread to estimate; its std is 0 (not NaN), so its advantage r - mean = 0 stays 0.
    """
    b = _num_groups(group_index)
    count = _group_sum(torch.ones_like(rewards), group_index, b)
    mean = _group_sum(rewards, group_index, b) / count.clamp(min=1)
    dev = rewards - mean[group_index]
    var = _group_sum(dev * dev, group_index, b) / (count - 1).clamp(min=1)
    return mean[group_index], var.sqrt()[group_index]


def _batch_mean_std(x: Tensor, reduce: Reduce | None) -> tuple[Tensor, Tensor]:
    """Mean and unbiased std of ``x`` (N,) over the global batch, as 0-dim float32 tensors.

    Sum, sum of squares and count go through ``reduce`` together, in one tensor, so a single
    collective makes them global. They are accumulated in float64 because the
    sum-of-squares formula subtracts two large numbers.
    """
    x64 = x.double()
    count = torch.tensor(float(x.numel()), dtype=torch.float64, device=x.device)
    moments = torch.stack([x64.sum(), (x64 * x64).sum(), count])
    if reduce is not None:
        # a collective may hand back its result on the communication device
        moments = reduce(moments).to(device=x.device, dtype=torch.float64)
    total, total_sq, n = moments.unbind()
    mean = total / n.clamp(min=1)
    var = ((total_sq - n * mean * mean) / (n - 1).clamp(min=1)).clamp(min=0)
    return mean.float(), var.sqrt().float()


# --- advantages ----------------------------------------------------------------------------


def grpo_advantages(
    rewards: Tensor,
    group_index: Tensor,
    *,
    scale_by_std: bool = True,
    std_mode: str = "group",
    eps: float = 1e-6,
    clip: float | None = None,
    reduce: Reduce | None = None,
) -> Tensor:
    """GRPO advantages (arXiv 2402.03300): (r - group mean) / (std + eps).

    Args:
        rewards: (N,) scalar reward per sample.
        group_index: (N,) long, the prompt group of each sample.
        scale_by_std: divide by the std; False gives Dr. GRPO's mean-only advantage.
        std_mode: "group" uses each group's unbiased std (groups of one sample get 0);
            "batch" uses one unbiased std over all rewards of the global batch (Flow-GRPO's
            global-std option, arXiv 2505.05470), made global through ``reduce``.
        eps: added to the std so zero-variance groups give 0 instead of NaN.
        clip: if set, clamp advantages to [-clip, clip].
        reduce: sums a tensor across ranks; only used by std_mode="batch".

    Returns:
        (N,) float32 advantages.
    """
    if std_mode not in ("group", "batch"):
        raise ValueError(f"std_mode must be one of ('group', 'batch'), got {std_mode!r}")
    rewards = rewards.float()
    mean, group_std = _group_mean_std(rewards, group_index)
    adv = rewards - mean
    if scale_by_std:
        std = group_std if std_mode == "group" else _batch_mean_std(rewards, reduce)[1]
        adv = adv / (std + eps)
    if clip is not None:
        adv = adv.clamp(-clip, clip)
    return adv


def drgrpo_advantages(rewards: Tensor, group_index: Tensor) -> Tensor:
    """Dr. GRPO advantages (arXiv 2503.20783): r - group mean, (N,) -> (N,) float32.

    Dropping the std division removes GRPO's bias towards groups whose rewards barely differ.
    """
    return grpo_advantages(rewards, group_index, scale_by_std=False)


def rloo_advantages(rewards: Tensor, group_index: Tensor) -> Tensor:
    """RLOO advantages (arXiv 2402.14740): r_i - mean of the other G-1 rewards of the group.

    r_i - (S - r_i) / (G - 1) = (G r_i - S) / (G - 1) with S the group sum. A group of one
    sample has no other sample to compare with; its advantage is 0.

    Args:
        rewards: (N,) scalar reward per sample.
        group_index: (N,) long, the prompt group of each sample.

    Returns:
        (N,) float32 advantages.
    """
    rewards = rewards.float()
    b = _num_groups(group_index)
    count = _group_sum(torch.ones_like(rewards), group_index, b)[group_index]
    total = _group_sum(rewards, group_index, b)[group_index]
    adv = (count * rewards - total) / (count - 1).clamp(min=1)
    return torch.where(count > 1, adv, torch.zeros_like(adv))


def reinforce_pp_advantages(
    rewards: Tensor,
    group_index: Tensor | None = None,
    *,
    baseline: str = "none",
    eps: float = 1e-6,
    reduce: Reduce | None = None,
) -> Tensor:
    """REINFORCE++ advantages (arXiv 2501.03262): whitening over the global batch.

    (x - batch mean) / (batch std + eps) with x = r for baseline="none", or x = r - group mean
    for baseline="group" (REINFORCE++-baseline). Unlike GRPO the scale comes from the whole
    batch, so groups with tiny reward spread are not blown up. The std is unbiased.

    Args:
        rewards: (N,) scalar reward per sample.
        group_index: (N,) long; required for baseline="group".
        baseline: "none" or "group".
        eps: added to the batch std.
        reduce: sums a tensor across ranks so mean and std are those of the global batch.

    Returns:
        (N,) float32 advantages.
    """
    if baseline not in ("none", "group"):
        raise ValueError(f"baseline must be one of ('none', 'group'), got {baseline!r}")
    x = rewards.float()
    if baseline == "group":
        if group_index is None:
            raise ValueError("baseline='group' needs group_index")
        x = x - _group_mean_std(x, group_index)[0]
    mean, std = _batch_mean_std(x, reduce)
    return (x - mean) / (std + eps)


def _ignore_reduce(fn: Callable[[Tensor, Tensor], Tensor]) -> Callable[..., Tensor]:
    """Adapt an estimator with only group statistics (always local) to the common signature."""

    def estimator(rewards: Tensor, group_index: Tensor, reduce: Reduce | None = None) -> Tensor:
        return fn(rewards, group_index)

    return estimator


# Config name -> estimator with signature (rewards, group_index, reduce=None, **options).
ADVANTAGES: dict[str, Callable[..., Tensor]] = {
    "grpo": grpo_advantages,
    "drgrpo": _ignore_reduce(drgrpo_advantages),
    "rloo": _ignore_reduce(rloo_advantages),
    "reinforce_pp": partial(reinforce_pp_advantages, baseline="none"),
    "reinforce_pp_baseline": partial(reinforce_pp_advantages, baseline="group"),
}


def compute_advantages(
    name: str,
    rewards: Tensor,
    group_index: Tensor,
    reduce: Reduce | None = None,
    **kw,
) -> Tensor:
    """Advantages (N,) float32 by config name; ``kw`` are the estimator's own options."""
    if name not in ADVANTAGES:
        raise ValueError(f"unknown advantage estimator {name!r}; choose from {sorted(ADVANTAGES)}")
    return ADVANTAGES[name](rewards, group_index, reduce=reduce, **kw)


# --- policy loss ---------------------------------------------------------------------------


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

    The log-ratio is clamped to [-20, 20] before exp (see ``_MAX_LOG_RATIO``); beyond that
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
    ratio = torch.exp(log_ratio.clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO))
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


# --- KL and entropy ------------------------------------------------------------------------


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
    log_ratio = (logprobs - ref_logprobs).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    return torch.exp(-log_ratio) - 1.0 + log_ratio


_KL_ESTIMATORS = {"k1": kl_k1, "k2": kl_k2, "k3": kl_k3}


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
    if estimator not in _KL_ESTIMATORS:
        raise ValueError(
            f"unknown KL estimator {estimator!r}; choose from {sorted(_KL_ESTIMATORS)}"
        )
    return _KL_ESTIMATORS[estimator](logprobs, ref_logprobs)


def entropy_from_logits(logits: Tensor) -> Tensor:
    """Entropy of softmax(logits), (..., V) -> (...).

    Computed from log_softmax, so large logits do not overflow. Logits of -inf (banned
    tokens) have p = 0 and contribute 0; their log-prob is replaced before the product, since
    0 * -inf would be NaN in the value and the gradient.
    """
    logp = torch.log_softmax(logits, dim=-1)
    finite_logp = torch.where(torch.isneginf(logp), torch.zeros_like(logp), logp)
    return -(logp.exp() * finite_logp).sum(-1)


# --- DAPO dynamic sampling and overlong handling -------------------------------------------


def group_has_variance(
    rewards: Tensor, group_index: Tensor, num_groups: int | None = None, *, eps: float = 1e-6
) -> Tensor:
    """(B,) bool: True for groups whose rewards are not all equal (max - min > eps).

    DAPO's dynamic sampling (arXiv 2503.14476) keeps only these: a group with equal rewards
    has zero advantage everywhere and contributes no gradient. Groups with no sample (index
    below ``num_groups`` but absent) are False.

    Args:
        rewards: (N,) scalar reward per sample.
        group_index: (N,) long, the prompt group of each sample.
        num_groups: B; defaults to max(group_index) + 1.
    """
    b = _num_groups(group_index) if num_groups is None else num_groups
    rewards = rewards.float()
    hi = rewards.new_zeros(b).scatter_reduce(0, group_index, rewards, "amax", include_self=False)
    lo = rewards.new_zeros(b).scatter_reduce(0, group_index, rewards, "amin", include_self=False)
    return (hi - lo) > eps


def allocate_quota(counts: list[int], target: int) -> list[int]:
    """How many kept groups each rank trains on so the global total is ``target``.

    ``counts`` are the kept groups per rank in rank order (e.g. after an all-gather); ranks in
    order take min(count, remaining). Every rank computes the same answer from the same
    counts, with no further communication. The sum is min(target, sum(counts)).
    """
    if target < 0 or any(c < 0 for c in counts):
        raise ValueError(f"counts and target must be >= 0, got {counts} and {target}")
    quota, remaining = [], target
    for c in counts:
        take = min(c, remaining)
        quota.append(take)
        remaining -= take
    return quota


def overlong_penalty(lengths: Tensor, max_len: int, buffer: int, penalty: float = 1.0) -> Tensor:
    """DAPO soft overlong punishment (arXiv 2503.14476), (N,) lengths -> (N,) float32 reward.

    0 up to max_len - buffer, then linear down to -penalty at max_len, -penalty beyond:
        L <= max_len - buffer:            0
        max_len - buffer < L <= max_len:  ((max_len - buffer) - L) / buffer * penalty
        L > max_len:                      -penalty
    """
    if not 0 < buffer <= max_len:
        raise ValueError(f"buffer must be in (0, max_len={max_len}], got {buffer}")
    start = max_len - buffer
    lengths = lengths.float()
    ramp = (start - lengths).clamp(max=0) / buffer * penalty
    return torch.where(lengths > max_len, torch.full_like(lengths, -penalty), ramp)


def overlong_filter_mask(mask: Tensor, truncated: Tensor) -> Tensor:
    """(N, A) mask with every action of truncated samples ((N,) bool) zeroed; same dtype.

    DAPO's overlong filtering: a truncated sample's reward says nothing about its unfinished
    answer, so it is left out of the loss.
    """
    return torch.where(truncated.unsqueeze(-1), torch.zeros_like(mask), mask)


# --- flow models: which denoising steps are stochastic and trained ----------------------

_MODES = ("all", "fraction", "window", "sliding")


def train_step_schedule(
    num_steps: int,
    *,
    mode: str = "all",
    fraction: float = 1.0,
    window: int = 2,
    window_start: int = 0,
    step: int = 0,
    slide_every: int = 1,
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Which denoising steps are stochastic (SDE) and which are trained.

    Steps are indexed 0..num_steps-1 from high noise to low noise. Returns
    ``(sde_steps, train_steps)``, sorted tuples, train_steps a subset of sde_steps; the
    engine copies them into ``Sampling.sde_steps`` / ``Sampling.train_steps``.

    * ``"all"``: every step is SDE and trained (Flow-GRPO).
    * ``"fraction"``: every step is SDE; the first int(num_steps * fraction) are trained
      (flow_grpo ``timestep_fraction``: 0.99 of 10 steps trains steps 0-8).
    * ``"window"``: SDE and training only in [window_start, window_start + window), ODE
      elsewhere (Flow-GRPO-Fast).
    * ``"sliding"``: MixGRPO. Like "window", but the start moves one step toward low noise
      every ``slide_every`` training steps (``step`` is the engine's training step), and
      wraps around to step 0 after the last position num_steps - window.
    """
    if num_steps < 1:
        raise ValueError(f"num_steps must be >= 1, got {num_steps}")
    if mode not in _MODES:
        raise ValueError(f"mode must be one of {_MODES}, got {mode!r}")
    everything = tuple(range(num_steps))
    if mode == "all":
        return everything, everything
    if mode == "fraction":
        if not 0.0 < fraction <= 1.0:
            raise ValueError(f"fraction must be in (0, 1], got {fraction}")
        n = int(num_steps * fraction)
        if n < 1:
            raise ValueError(
                f"fraction {fraction} of {num_steps} steps trains no step; raise it to "
                f">= {1.0 / num_steps:.4g}"
            )
        return everything, everything[:n]
    if not 1 <= window <= num_steps:
        raise ValueError(f"window must be in [1, num_steps={num_steps}], got {window}")
    positions = num_steps - window + 1  # valid window starts: 0..num_steps-window
    if not 0 <= window_start < positions:
        raise ValueError(
            f"window_start must be in [0, {positions - 1}] for window {window} of "
            f"{num_steps} steps, got {window_start}"
        )
    start = window_start
    if mode == "sliding":
        if slide_every < 1:
            raise ValueError(f"slide_every must be >= 1, got {slide_every}")
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        start = (window_start + step // slide_every) % positions
    steps = tuple(range(start, start + window))
    return steps, steps
