"""Algorithm tests against values worked out by hand in the comments.

Every expected number is a literal with its arithmetic next to it, so a reader can check it
with a pencil; nothing is recomputed by a second implementation.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch.testing import assert_close

from mmyatt.algorithms import (
    ADVANTAGES,
    LOSS_AGG_MODES,
    aggregate_loss,
    allocate_quota,
    compute_advantages,
    drgrpo_advantages,
    entropy_from_logits,
    group_has_variance,
    grpo_advantages,
    kl_k1,
    kl_k2,
    kl_k3,
    kl_penalty,
    loss_terms,
    masked_mean,
    overlong_filter_mask,
    overlong_penalty,
    ppo_clip_loss,
    reinforce_pp_advantages,
    rloo_advantages,
)

INF = float("inf")
NAN = float("nan")
LN2 = math.log(2.0)  # 0.693147


def t(x, dtype=torch.float32):
    return torch.tensor(x, dtype=dtype)


def _recorder(log):
    def record(x):
        log.append(x.clone())
        return x

    return record


def _all_reduce(seen):
    """An all-reduce stand-in: the k-th call returns the sum of every rank's k-th input."""
    k = -1

    def all_reduce(x):
        nonlocal k
        k += 1
        return sum(s[k] for s in seen)

    return all_reduce


def simulate_two_ranks(fn, shards):
    """Run ``fn(*shard, reduce=...)`` as if each shard sat on its own rank.

    Pass 1 records what each rank hands to ``reduce``; pass 2 answers the k-th reduce call
    of every rank with the sum of all ranks' k-th inputs, which is what an all-reduce does.
    """
    seen = [[] for _ in shards]
    for log, args in zip(seen, shards):
        fn(*args, reduce=_recorder(log))
    return torch.cat([fn(*args, reduce=_all_reduce(seen)) for args in shards])


# --- advantages ----------------------------------------------------------------------------

# Interleaved groups: the functions must not assume contiguous samples.
# group 0 = positions 0, 2, 4 with rewards [1, 2, 3]; group 1 = positions 1, 3 with [0, 4].
REWARDS = t([1.0, 0.0, 2.0, 4.0, 3.0])
GROUPS = t([0, 1, 0, 1, 0], torch.long)


def test_grpo_group_std_is_unbiased():
    # group 0: mean 2, dev [-1, 0, 1], unbiased var (1+0+1)/2 = 1, std 1 -> [-1, 0, 1]
    #   (the population std sqrt(2/3) = 0.816 would give -1.2247: this test tells them apart)
    # group 1: mean 2, dev [-2, 2], unbiased var (4+4)/1 = 8, std 2*sqrt(2) -> -+1/sqrt(2)
    r2 = 1 / math.sqrt(2)  # 0.707107
    adv = grpo_advantages(REWARDS, GROUPS, eps=0.0)
    assert adv.dtype == torch.float32
    assert_close(adv, t([-1.0, -r2, 0.0, r2, 1.0]))


def test_grpo_without_std_and_clip():
    # no std: r - group mean = [1-2, 0-2, 2-2, 4-2, 3-2] = [-1, -2, 0, 2, 1]
    assert_close(grpo_advantages(REWARDS, GROUPS, scale_by_std=False), t([-1.0, -2, 0, 2, 1]))
    # clip 0.5 on the std-scaled [-1, -0.707, 0, 0.707, 1]
    adv = grpo_advantages(REWARDS, GROUPS, eps=0.0, clip=0.5)
    assert_close(adv, t([-0.5, -0.5, 0.0, 0.5, 0.5]))


def test_grpo_group_of_one_is_zero_not_nan():
    # group 0 = [5]: dev 0, std 0 -> 0 / (0 + eps) = 0
    # group 1 = [1, 3]: mean 2, dev -+1, unbiased var 2, std sqrt(2) -> -+0.707107
    adv = grpo_advantages(t([5.0, 1.0, 3.0]), t([0, 1, 1], torch.long))
    assert_close(adv, t([0.0, -0.707107, 0.707107]))


def test_grpo_batch_std():
    # group devs (group means 2 and 2): [-1, 0, 1, -2, 2]
    # batch [1, 2, 3, 0, 4]: mean 2, squared devs 1+0+1+4+4 = 10, unbiased var 10/4 = 2.5
    # 1/sqrt(2.5) = 0.632456 -> [-0.632456, 0, 0.632456, -1.264911, 1.264911]
    rewards, groups = t([1.0, 2.0, 3.0, 0.0, 4.0]), t([0, 0, 0, 1, 1], torch.long)
    expected = t([-0.632456, 0.0, 0.632456, -1.264911, 1.264911])
    assert_close(grpo_advantages(rewards, groups, std_mode="batch", eps=0.0), expected)


def test_grpo_batch_std_reduce_across_ranks():
    # rank 0 holds group [1, 2, 3], rank 1 holds group [0, 4]; local group ids restart at 0.
    # Alone, rank 0 would use std([1, 2, 3]) = 1 and give [-1, 0, 1]; with the reduce hook
    # both ranks must use the global std sqrt(2.5) of test_grpo_batch_std.
    def fn(r, g, reduce):
        return grpo_advantages(r, g, std_mode="batch", eps=0.0, reduce=reduce)

    zeros = t([0, 0, 0], torch.long)
    shards = [(t([1.0, 2.0, 3.0]), zeros), (t([0.0, 4.0]), zeros[:2])]
    assert_close(fn(*shards[0], reduce=None), t([-1.0, 0.0, 1.0]))
    expected = t([-0.632456, 0.0, 0.632456, -1.264911, 1.264911])
    assert_close(simulate_two_ranks(fn, shards), expected)


def test_drgrpo_is_mean_subtraction_only():
    # r - group mean: [1-2, 0-2, 2-2, 4-2, 3-2]
    assert_close(drgrpo_advantages(REWARDS, GROUPS), t([-1.0, -2.0, 0.0, 2.0, 1.0]))


def test_rloo_leave_one_out():
    # group 0 [1, 2, 3]: 1 - (2+3)/2 = -1.5, 2 - (1+3)/2 = 0, 3 - (1+2)/2 = 1.5
    # group 1 [0, 4]:    0 - 4 = -4, 4 - 0 = 4
    assert_close(rloo_advantages(REWARDS, GROUPS), t([-1.5, -4.0, 0.0, 4.0, 1.5]))
    # a group of one has nobody to compare with: 0; [1, 3] -> 1-3, 3-1
    adv = rloo_advantages(t([5.0, 1.0, 3.0]), t([0, 1, 1], torch.long))
    assert_close(adv, t([0.0, -2.0, 2.0]))


# REINFORCE++ batch: groups [0, 1] and [2, 5].
RPP_REWARDS = t([0.0, 1.0, 2.0, 5.0])
RPP_GROUPS = t([0, 0, 1, 1], torch.long)
# baseline none: mean 2, devs [-2, -1, 0, 3], unbiased var (4+1+0+9)/3 = 14/3,
#   1/std = sqrt(3/14) = 0.462910 -> [-0.925820, -0.462910, 0, 1.388730]
RPP_NONE = t([-0.925820, -0.462910, 0.0, 1.388730])
# baseline group: group means 0.5, 3.5 -> x = [-0.5, 0.5, -1.5, 1.5], batch mean 0,
#   unbiased var (0.25+0.25+2.25+2.25)/3 = 5/3, 1/std = sqrt(3/5) = 0.774597
#   -> [-0.387298, 0.387298, -1.161895, 1.161895]
RPP_GROUP = t([-0.387298, 0.387298, -1.161895, 1.161895])


def test_reinforce_pp_batch_whitening():
    assert_close(reinforce_pp_advantages(RPP_REWARDS, eps=0.0), RPP_NONE)
    adv = reinforce_pp_advantages(RPP_REWARDS, RPP_GROUPS, baseline="group", eps=0.0)
    assert_close(adv, RPP_GROUP)


@pytest.mark.parametrize("baseline,expected", [("none", RPP_NONE), ("group", RPP_GROUP)])
def test_reinforce_pp_reduce_across_ranks(baseline, expected):
    # rank 0 holds group [0, 1], rank 1 holds group [2, 5]: alone, rank 0 would whiten [0, 1]
    # to [-0.707, 0.707]; with the reduce hook it must match the full-batch numbers above.
    def fn(r, g, reduce):
        return reinforce_pp_advantages(r, g, baseline=baseline, eps=0.0, reduce=reduce)

    zeros = t([0, 0], torch.long)
    shards = [(t([0.0, 1.0]), zeros), (t([2.0, 5.0]), zeros)]
    assert_close(simulate_two_ranks(fn, shards), expected)


def test_reinforce_pp_group_baseline_needs_groups():
    with pytest.raises(ValueError, match="group_index"):
        reinforce_pp_advantages(RPP_REWARDS, baseline="group")


def test_advantage_registry():
    assert set(ADVANTAGES) == {"grpo", "drgrpo", "rloo", "reinforce_pp", "reinforce_pp_baseline"}
    # same hand values as above, reached by name
    assert_close(compute_advantages("rloo", REWARDS, GROUPS), t([-1.5, -4.0, 0.0, 4.0, 1.5]))
    assert_close(compute_advantages("drgrpo", REWARDS, GROUPS), t([-1.0, -2.0, 0.0, 2.0, 1.0]))
    assert_close(
        compute_advantages("grpo", REWARDS, GROUPS, eps=0.0, clip=0.5), t([-0.5, -0.5, 0, 0.5, 0.5])
    )
    assert_close(compute_advantages("reinforce_pp", RPP_REWARDS, RPP_GROUPS, eps=0.0), RPP_NONE)
    adv = compute_advantages("reinforce_pp_baseline", RPP_REWARDS, RPP_GROUPS, eps=0.0)
    assert_close(adv, RPP_GROUP)
    with pytest.raises(ValueError, match="reinforce_pp_baseline"):
        compute_advantages("ppo", REWARDS, GROUPS)


# --- PPO-clip ------------------------------------------------------------------------------


def _ppo(ratios, advantages, mask=None, **kw):
    """Loss, metrics and d(loss.sum())/d(logprobs) for given ratios (old log-probs = 0)."""
    logprobs = t(ratios).log().requires_grad_()
    mask = torch.ones_like(logprobs) if mask is None else t(mask)
    loss, metrics = ppo_clip_loss(logprobs, torch.zeros_like(logprobs), t(advantages), mask, **kw)
    loss.sum().backward()
    return loss, metrics, logprobs.grad


def test_ppo_symmetric_clip():
    # eps 0.2 -> ratio clamped to [0.8, 1.2]; loss = max(-A r, -A clamp(r))
    # A=+1: r=0.5 max(-0.5, -0.8) = -0.5; r=1 -1; r=1.5 max(-1.5, -1.2) = -1.2 (clipped high)
    # A=-1: r=0.5 max(0.5, 0.8) = 0.8 (clipped low); r=1 1; r=1.5 max(1.5, 1.2) = 1.5
    loss, m, grad = _ppo([[0.5, 1.0, 1.5], [0.5, 1.0, 1.5]], [1.0, -1.0])
    assert_close(loss, t([[-0.5, -1.0, -1.2], [0.8, 1.0, 1.5]]))
    # d/dlogp of -A r is -A r; clipped actions get none: [-0.5, -1, 0], [0, 1, 1.5]
    assert_close(grad, t([[-0.5, -1.0, 0.0], [0.0, 1.0, 1.5]]))
    assert set(m) == {
        "clip_frac",
        "clip_frac_low",
        "clip_frac_high",
        "ratio_mean",
        "ratio_max",
        "approx_kl",
    }
    assert_close(m["clip_frac"], t(2 / 6))
    assert_close(m["clip_frac_low"], t(1 / 6))
    assert_close(m["clip_frac_high"], t(1 / 6))
    assert_close(m["ratio_mean"], t(1.0))  # 2 * (0.5 + 1 + 1.5) / 6
    assert_close(m["ratio_max"], t(1.5))
    # mean(old - new) = -2 * (ln 0.5 + 0 + ln 1.5) / 6 = -(-0.693147 + 0.405465) / 3
    assert_close(m["approx_kl"], t(0.095894))
    assert not any(v.requires_grad for v in m.values())


def test_ppo_clip_higher_asymmetric():
    # DAPO: clip_low 0.2, clip_high 0.28 -> ratio clamped to [0.8, 1.28]
    # A=+1: r=1.25 max(-1.25, -1.25) = -1.25, not clipped (symmetric 0.2 would give -1.2)
    #       r=1.5  max(-1.5, -1.28) = -1.28 (clipped high)
    # A=-1: r=0.75 max(0.75, 0.8) = 0.8 (clipped low); r=0.5 max(0.5, 0.8) = 0.8 (clipped low)
    loss, m, grad = _ppo([[1.25, 1.5], [0.75, 0.5]], [1.0, -1.0], clip_high=0.28)
    assert_close(loss, t([[-1.25, -1.28], [0.8, 0.8]]))
    assert_close(grad, t([[-1.25, 0.0], [0.0, 0.0]]))
    assert_close(m["clip_frac"], t(3 / 4))
    assert_close(m["clip_frac_low"], t(2 / 4))
    assert_close(m["clip_frac_high"], t(1 / 4))


def test_ppo_dual_clip():
    # c = 3, per-action advantages (N, A) = [[-1, -1, -1, +1]], eps 0.2
    # A=-1 r=0.5: max(0.5, 0.8) = 0.8, min(0.8, 3) = 0.8
    # A=-1 r=2:   max(2, 1.2) = 2,     min(2, 3) = 2
    # A=-1 r=4:   max(4, 1.2) = 4,     min(4, 3) = 3 (dual clip)
    # A=+1 r=4:   max(-4, -1.2) = -1.2 (dual clip only applies to A < 0)
    loss, m, grad = _ppo([[0.5, 2.0, 4.0, 4.0]], [[-1.0, -1.0, -1.0, 1.0]], dual_clip=3.0)
    assert_close(loss, t([[0.8, 2.0, 3.0, -1.2]]))
    # only r=2 is on the unclipped branch: d(-A r)/dlogp = 2; the cap -A c is constant
    assert_close(grad, t([[0.0, 2.0, 0.0, 0.0]]))
    assert_close(m["dual_clip_frac"], t(1 / 4))
    assert_close(m["clip_frac"], t(2 / 4))  # r=0.5 low, r=4 with A=+1 high
    assert_close(m["ratio_max"], t(4.0))
    with pytest.raises(ValueError, match="dual_clip"):
        _ppo([[1.0]], [1.0], dual_clip=1.0)


def test_ppo_masked_inf_padding_does_not_leak():
    # padding holds -inf: position 1 has old = -inf (ratio would be inf), position 2 has both
    # -inf (log-ratio NaN). Only position 0 counts: A=+1, r=1 -> loss -1, grad -1.
    logprobs = t([[0.0, 0.0, -INF]]).requires_grad_()
    old = t([[0.0, -INF, -INF]])
    loss, m = ppo_clip_loss(logprobs, old, t([1.0]), t([[1.0, 0.0, 0.0]]))
    loss.sum().backward()
    assert_close(loss, t([[-1.0, 0.0, 0.0]]))
    assert_close(logprobs.grad, t([[-1.0, 0.0, 0.0]]))
    assert_close(m["ratio_max"], t(1.0))
    assert_close(m["approx_kl"], t(0.0))
    assert all(torch.isfinite(v) for v in m.values())
    # per-action advantages may be garbage at padding too (e.g. a critic's NaN there)
    loss, _ = ppo_clip_loss(logprobs, old, t([[1.0, NAN, NAN]]), t([[1.0, 0.0, 0.0]]))
    assert_close(loss, t([[-1.0, 0.0, 0.0]]))


def test_ppo_huge_ratio_stays_finite():
    # log-ratio 100 would overflow exp in fp32; clamped to 20 the value is finite and the
    # action is clipped (A=+1): loss -1.2, no gradient, no NaN.
    logprobs = t([[100.0]]).requires_grad_()
    loss, m = ppo_clip_loss(logprobs, t([[0.0]]), t([1.0]), t([[1.0]]))
    loss.sum().backward()
    assert_close(loss, t([[-1.2]]))
    assert_close(logprobs.grad, t([[0.0]]))


# --- loss aggregation ----------------------------------------------------------------------

LOSS = t([[1.0, 2.0, 3.0], [4.0, 5.0, INF], [7.0, 8.0, 9.0], [10.0, 11.0, 12.0]])
MASK = t([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0], [0.0, 0.0, 0.0], [1.0, 0.0, 0.0]])
# Valid actions: row 0 [1, 2, 3], row 1 [4, 5] (the inf is padding), row 2 none, row 3 [10].
# Row 2 has no valid action and is not a sequence for the seq-mean modes: 3 sequences.
AGG_CASES = {
    # (1+2+3+4+5+10) / 6 = 25 / 6
    "token-mean": (25.0, 6.0),
    # per-sequence means 6/3 = 2, 9/2 = 4.5, 10/1 = 10 -> (2 + 4.5 + 10) / 3 = 16.5 / 3 = 5.5
    "seq-mean-token-mean": (16.5, 3.0),
    # per-sequence sums 6, 9, 10 -> 25 / 3
    "seq-mean-token-sum": (25.0, 3.0),
    # per-sequence sums / max_len 4: (6 + 9 + 10) / 4 = 6.25 -> 6.25 / 3
    "seq-mean-token-sum-norm": (6.25, 3.0),
}


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_loss_terms_by_hand(mode):
    num, den = loss_terms(LOSS, MASK, mode, max_len=4)
    assert_close(num, t(AGG_CASES[mode][0]))
    assert_close(den, t(AGG_CASES[mode][1]))
    assert not den.requires_grad
    assert_close(
        aggregate_loss(LOSS, MASK, mode, max_len=4), t(AGG_CASES[mode][0] / AGG_CASES[mode][1])
    )


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_loss_terms_add_across_ranks(mode):
    # rank 0 takes rows 0-1, rank 1 rows 2-3. E.g. seq-mean-token-mean: rank 0 (2 + 4.5, 2
    # seqs), rank 1 (10, 1 seq) -> 16.5 / 3 = 5.5, whereas averaging the per-rank means
    # (3.25 + 10) / 2 = 6.625 would be wrong.
    n0, d0 = loss_terms(LOSS[:2], MASK[:2], mode, max_len=4)
    n1, d1 = loss_terms(LOSS[2:], MASK[2:], mode, max_len=4)
    assert_close((n0 + n1) / (d0 + d1), aggregate_loss(LOSS, MASK, mode, max_len=4))
    assert_close((n0 + n1) / (d0 + d1), t(AGG_CASES[mode][0] / AGG_CASES[mode][1]))


def test_seq_mean_token_mean_gradient():
    # d/dloss: 1/(3 seqs * tokens in its seq): row 0 1/9, row 1 1/6, row 3 1/3, padding 0
    loss = torch.ones(4, 3, requires_grad=True)
    aggregate_loss(loss, MASK, "seq-mean-token-mean").backward()
    expected = t([[1 / 9, 1 / 9, 1 / 9], [1 / 6, 1 / 6, 0], [0, 0, 0], [1 / 3, 0, 0]])
    assert_close(loss.grad, expected)


def test_aggregate_empty_mask_is_zero_and_differentiable():
    loss = torch.ones(2, 3, requires_grad=True)
    for mode in LOSS_AGG_MODES:
        out = aggregate_loss(loss, torch.zeros(2, 3), mode, max_len=4)
        assert_close(out, t(0.0))
        out.backward()
        assert_close(loss.grad, torch.zeros(2, 3))


def test_aggregation_errors():
    with pytest.raises(ValueError, match="max_len"):
        loss_terms(LOSS, MASK, "seq-mean-token-sum-norm")
    with pytest.raises(ValueError, match="seq-mean-token-sum-norm"):
        loss_terms(LOSS, MASK, "sum")


# --- KL, entropy, masked mean --------------------------------------------------------------

# log_ratio = logprobs - ref = [0, ln 2, -ln 2]
KL_LOGP = t([0.0, LN2, 0.0])
KL_REF = t([0.0, 0.0, LN2])


def test_kl_estimators():
    # k1 = log_ratio
    assert_close(kl_k1(KL_LOGP, KL_REF), t([0.0, 0.693147, -0.693147]))
    # k2 = 0.5 * 0.693147^2 = 0.240227
    assert_close(kl_k2(KL_LOGP, KL_REF), t([0.0, 0.240227, 0.240227]))
    # k3 = exp(-lr) - 1 + lr: lr=ln2 -> 0.5 - 1 + 0.693147 = 0.193147
    #                         lr=-ln2 -> 2 - 1 - 0.693147 = 0.306853
    assert_close(kl_k3(KL_LOGP, KL_REF), t([0.0, 0.193147, 0.306853]))
    for name, fn in (("k1", kl_k1), ("k2", kl_k2), ("k3", kl_k3)):
        assert_close(kl_penalty(KL_LOGP, KL_REF, name), fn(KL_LOGP, KL_REF))
    with pytest.raises(ValueError, match="k3"):
        kl_penalty(KL_LOGP, KL_REF, "k4")


def test_kl_k3_clamps_before_exp():
    # lr = +-100 clamped to +-20: exp(-20) - 1 + 20 = 19.000000002; exp(20) - 1 - 20 =
    # 485165195.4 - 21 = 485165174.4. Unclamped, exp(100) is inf in fp32.
    logp = t([100.0, -100.0]).requires_grad_()
    kl = kl_k3(logp, torch.zeros(2))
    assert_close(kl, t([19.0, 485165174.4]))
    kl.sum().backward()
    assert torch.isfinite(logp.grad).all()


def test_entropy_from_logits():
    # uniform over V=5: log 5 = 1.609438, whatever the constant logit
    assert_close(entropy_from_logits(torch.zeros(2, 5)), t([1.609438, 1.609438]))
    assert_close(entropy_from_logits(torch.full((5,), 1000.0)), t(1.609438))
    # p = [0.5, 0.25, 0.25]: 0.5 ln 2 + 2 * 0.25 ln 4 = 1.5 ln 2 = 1.039721
    assert_close(entropy_from_logits(t([0.5, 0.25, 0.25]).log()), t(1.039721))
    # a banned token (-inf) has p = 0 and adds nothing: uniform over 2 -> ln 2, finite grad
    logits = t([0.0, 0.0, -INF]).requires_grad_()
    h = entropy_from_logits(logits)
    assert_close(h, t(0.693147))
    h.backward()
    assert torch.isfinite(logits.grad).all()


def test_masked_mean():
    x = t([[1.0, 2.0], [3.0, 4.0]])
    mask = t([[1.0, 0.0], [1.0, 1.0]])
    assert_close(masked_mean(x, mask), t(8.0 / 3))  # (1 + 3 + 4) / 3
    assert_close(masked_mean(x, mask, dim=-1), t([1.0, 3.5]))  # [1/1, (3+4)/2]
    assert_close(masked_mean(x, torch.zeros(2, 2)), t(0.0))
    assert_close(masked_mean(x, t([[0.0, 0.0], [1.0, 0.0]]), dim=-1), t([0.0, 3.0]))


# --- DAPO helpers --------------------------------------------------------------------------


def test_group_has_variance():
    # group 0 [1, 0] varies; group 1 [1, 1] and group 2 [2, 2] do not; group 3 has no sample
    rewards = t([1.0, 1.0, 0.0, 1.0, 2.0, 2.0])
    groups = t([0, 1, 0, 1, 2, 2], torch.long)
    assert group_has_variance(rewards, groups).tolist() == [True, False, False]
    assert group_has_variance(rewards, groups, num_groups=4).tolist() == [True, False, False, False]
    # a spread of 1e-7 is below eps 1e-6
    near = t([1.0, 1.0 + 1e-7], torch.float64)
    assert group_has_variance(near, t([0, 0], torch.long)).tolist() == [False]


def test_allocate_quota():
    # target 6 over counts [3, 0, 5, 2]: rank 0 takes 3, rank 1 0, rank 2 min(5, 3) = 3
    assert allocate_quota([3, 0, 5, 2], 6) == [3, 0, 3, 0]
    assert allocate_quota([3, 0, 5, 2], 100) == [3, 0, 5, 2]  # sum 10 < target
    assert allocate_quota([3, 0, 5, 2], 0) == [0, 0, 0, 0]
    assert allocate_quota([], 5) == []
    with pytest.raises(ValueError):
        allocate_quota([1], -1)


def test_overlong_penalty():
    # max_len 20, buffer 4: free up to 16, ramp (16 - L) / 4 up to 20, -1 beyond
    # L=10: 0; L=16 (boundary): 0; L=17: -1/4; L=18: -2/4; L=20 (boundary): -4/4; L=21: -1
    lengths = t([10, 16, 17, 18, 20, 21], torch.long)
    assert_close(overlong_penalty(lengths, 20, 4), t([0.0, 0.0, -0.25, -0.5, -1.0, -1.0]))
    half = t([0.0, 0.0, -0.125, -0.25, -0.5, -0.5])
    assert_close(overlong_penalty(lengths, 20, 4, penalty=0.5), half)
    with pytest.raises(ValueError, match="buffer"):
        overlong_penalty(lengths, 20, 0)


def test_overlong_filter_mask():
    mask = t([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    truncated = torch.tensor([False, True, False])
    out = overlong_filter_mask(mask, truncated)
    assert_close(out, t([[1.0, 1.0, 0.0], [0.0, 0.0, 0.0], [1.0, 0.0, 0.0]]))
    bool_mask = overlong_filter_mask(mask.bool(), truncated)
    assert bool_mask.dtype == torch.bool
    assert bool_mask.tolist() == [[True, True, False], [False, False, False], [True, False, False]]
