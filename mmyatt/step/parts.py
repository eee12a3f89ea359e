"""Pieces of a controller's step that are plain functions of the config or the rollout:
the sampling settings of a training or an evaluation rollout, the reduced rollout
metrics, the clipped policy-gradient loss terms of a minibatch (or of one of its
micro-batches), and the micro-batch passes: as many micro-batches on every rank, no-grad
log-probs over them, and the backward over them (mmyatt/step/controller.py calls them)."""

from __future__ import annotations

import math

import torch

from mmyatt import algorithms as alg
from mmyatt.protocols import RolloutStats, Sampling
from mmyatt.rollout import Rollout
from mmyatt.step.batches import to_count, token_micro_batches


def rollout_metrics(r: Rollout, dist, policy) -> dict[str, float]:
    """Reward, length, truncation and advantage figures summed over the controllers."""
    n, lengths = len(r), r.mask.sum(1)
    local = {
        "n": n,
        "reward": float(r.rewards.sum()),
        "reward_sq": float((r.rewards**2).sum()),
        "len": float(lengths.sum()),
        "trunc": float(r.truncated.sum()) if r.truncated is not None else 0.0,
        "adv_abs": float(r.advantages.abs().sum()),
    }
    for k, v in r.reward_parts.items():
        local[f"part/{k}"] = float(v.sum())
    g = dist.sum_many(local)
    n = max(g["n"], 1.0)
    mean = g["reward"] / n
    out = {
        "reward/mean": mean,
        "reward/std": math.sqrt(max(g["reward_sq"] / n - mean**2, 0.0)),
        "response_length/mean": g["len"] / n,
        "response_length/truncated_frac": g["trunc"] / n,
        "advantage/abs_mean": g["adv_abs"] / n,
        "rollout/samples": g["n"],
        "rollout/tokens": g["len"],
    }
    out.update({f"reward/{k[5:]}": v / n for k, v in g.items() if k.startswith("part/")})
    if isinstance(policy, RolloutStats):  # vLLM rollouts: TIS, weight sync, sleep
        out.update(policy.rollout_stats(r))
    return out


def train_sampling(cfg, step: int, *, nft: bool = False) -> Sampling:
    """The sampling of step ``step``'s training rollouts (flow: its SDE / trained steps)."""
    s = cfg.sampling
    sde_steps, train_steps = alg.train_step_schedule(
        s.denoise_steps,
        mode=s.train_steps,
        fraction=s.train_fraction,
        window=s.window,
        window_start=s.window_start,
        step=step,
        slide_every=s.slide_every,
    )
    return Sampling(
        temperature=s.temperature,
        top_p=s.top_p,
        max_new_tokens=s.max_new_tokens,
        stop=s.stop,
        denoise_steps=s.denoise_steps,
        noise_level=s.noise_level,
        sde_type=s.sde_type,
        guidance_scale=s.guidance_scale,
        sde_steps=sde_steps,
        # DiffusionNFT keeps only the clean samples: no transition becomes an action
        train_steps=() if nft else train_steps,
    )


def eval_sampling(cfg, greedy: bool | None = None) -> Sampling:
    """Held-out sampling: greedy or sampled (trainer.eval_sampling), flow by the ODE."""
    s = cfg.sampling
    if greedy is None:
        greedy = cfg.trainer.eval_sampling == "greedy"
    return Sampling(
        temperature=s.temperature,
        max_new_tokens=s.max_new_tokens,
        stop=s.stop,
        greedy=greedy,
        noise_level=0.0,  # flow eval: the deterministic ODE
        denoise_steps=s.eval_denoise_steps,
        guidance_scale=s.guidance_scale,
    )


def pg_terms(policy, mb: Rollout, a, closed_form_kl: bool, local: dict):
    """The clipped policy-gradient loss's numerator over ``mb`` (differentiable), under
    the algorithm config ``a``; its denominator and statistics are added into ``local``
    (sums over samples, reduced over the controllers by the caller)."""
    if closed_form_kl:
        lp, ent, kl = policy.logprobs_with_kl(mb, a.kl_estimator, a.kl_block)
    else:
        lp, ent = policy.logprobs(mb, with_entropy=True)
    dev = lp.device  # rewards and advantages live on the CPU; the policy may not
    mask = mb.mask.to(dev)
    loss_mat, m = alg.ppo_clip_loss(
        lp,
        mb.logprobs.to(dev),
        mb.advantages.to(dev),
        mask,
        clip_low=a.clip_low,
        clip_high=a.clip_high,
        dual_clip=a.dual_clip,
    )
    if "is_weight" in mb.context:  # truncated IS, rollout engine vs trainer (vllm)
        loss_mat = loss_mat * mb.context["is_weight"].to(dev)
    if a.kl_coef > 0:
        if not closed_form_kl:
            kl = alg.kl_penalty(lp, mb.ref_logprobs.to(dev), a.kl_estimator)
        loss_mat = loss_mat + a.kl_coef * torch.where(mask.bool(), kl, 0.0)
        local["kl"] += float(alg.masked_mean(kl.detach(), mask)) * float(mask.sum())
    if a.entropy_coef:
        loss_mat = loss_mat - a.entropy_coef * torch.where(mask.bool(), ent, 0.0)
    num, den = alg.loss_terms(loss_mat, mask, a.loss_agg, max_len=mb.num_actions)
    ntok = float(mask.sum())
    local["tokens"] += ntok
    local["den"] += float(den)
    local["num"] += float(num.detach())
    local["entropy"] += float(alg.masked_mean(ent.detach(), mask)) * ntok
    for k in ("clip_frac", "ratio_mean", "approx_kl"):
        local[k] += float(m[k]) * ntok
    return num


def micro_parts(r: Rollout | None, budget: int, dist, lockstep: bool) -> list[list[int]]:
    """This rank's micro-batches of ``r`` (``algorithm.micro_batch_tokens``), as many as
    the fullest rank's (one all-reduce): every rank runs the same number, some of them
    empty where a rank has too few rows (``batches.to_count``). On a sharded engine they
    hold whole prompt groups, so each makes the forwards a minibatch makes, on every
    rank. ``budget <= 0``: one pass, no collective."""
    n = 0 if r is None else len(r)
    if budget <= 0:
        return [list(range(n))] if n else []
    parts = token_micro_batches(r, budget, lockstep) if n else []
    count = max(dist.gather_ints(len(parts)))
    return to_count(r, parts, count, lockstep) if n else [[] for _ in range(count)]


def in_micro_batches(fn, r: Rollout, parts: list[list[int]], idle) -> torch.Tensor:
    """(N, A) ``fn(r)`` with no gradient, run over ``parts``; an empty part runs
    ``fn(idle())`` if ``idle`` is given (a sharded engine's filler), its result dropped."""
    if len(parts) == 1 and parts[0]:  # one pass over every row
        return fn(r).detach()
    out = None
    for rows in parts:
        if not rows:
            if idle is not None:
                fn(idle())
            continue
        lp = fn(r.select(rows)).detach()
        if out is None:
            out = lp.new_zeros((len(r), *lp.shape[1:]))
        out[torch.as_tensor(rows, device=lp.device)] = lp
    return out if out is not None else r.mask.new_zeros(r.mask.shape)


def micro_backward(policy, mb, parts, a, closed_form_kl: bool, local: dict, dist, engine) -> bool:
    """The backward of the minibatch ``mb`` over ``parts``, this rank's micro-batches (as
    many as every rank's, ``micro_parts``): each micro-batch's loss numerator is divided
    by the minibatch's global denominator, all-reduced first (it needs only the masks),
    so the gradients add up to the one-pass update's. Statistics go into ``local``. An
    empty part runs a sharded engine's zero-weight pass. False (and no backward) when no
    rank has a counted action."""
    den = 0.0
    if any(parts):
        zero = mb.mask * 0
        den = float(alg.loss_terms(zero, mb.mask, a.loss_agg, max_len=mb.num_actions)[1])
    g_den = float(dist.sum(den))
    if g_den <= 0:
        return False
    local["micro_batches"] = float(sum(1 for rows in parts if rows))
    for rows in parts:
        if rows:
            (pg_terms(policy, mb.select(rows), a, closed_form_kl, local) / g_den).backward()
        elif engine.lockstep:  # a sharded backward: every rank joins it
            engine.zero_weight_loss(policy).backward()
    return True
