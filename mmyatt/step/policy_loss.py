"""The policy losses a step trains with, behind one interface (:class:`PolicyLoss`): the
PPO-clip family (GRPO, DAPO, Dr. GRPO, RLOO, REINFORCE++: the advantage differs, the
loss is one) and DiffusionNFT. The trainer (``mmyatt.step.trainer``) calls every loss
the same way, so the step has no branch on the algorithm.

A loss returns the *numerator* of its minibatch loss and sums over this rank's samples
(its token or sample count ``tokens``, the denominator ``den``, the numerator ``num`` and
its statistics); the trainer all-reduces the sums and divides, so the loss of P
controllers on 1/P of the data each is the loss of one controller on all of it.

Leaves out the tensor math (``mmyatt.algorithms``: PPO-clip, KL estimators, loss
aggregation, DiffusionNFT's objective), optimizer steps, minibatches and micro-batches
(``mmyatt.step.trainer``, ``mmyatt.step.batches``), and the flow adapter's side of
DiffusionNFT (``mmyatt.models.flow_nft``, handed in by ``mmyatt.step.builders``).
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import Protocol

import torch
from torch import Tensor

from mmyatt.algorithms import kl, losses, overlong
from mmyatt.distributed import Lockstep
from mmyatt.rollout import Rollout
from mmyatt.step.async_rollouts import STALENESS
from mmyatt.step.batches import MicroBatches

BEHAVIOUR = "behaviour_weight"  # context key: (N, A) capped proximal / behaviour ratio
BEHAVIOUR_CLIPPED = "behaviour_clipped"  # context key: (N, A) the ratio hit the cap

# per-token statistics every loss reports (0 where a loss has no such thing), so a run's
# metrics keep their names whatever the algorithm
TOKEN_STATS = ("entropy", "clip_frac", "ratio_mean", "approx_kl")


class PolicyLoss(Protocol):
    """What the trainer calls on a loss."""

    # local sum -> metric name; the trainer reports each sum over the global token count
    metrics: dict[str, str]

    def sampling(self) -> AbstractContextManager:
        """A context in which the policy samples the step's rollouts (DiffusionNFT: its
        trailing "old" copy)."""
        ...

    def prepare(self, policy, rollout: Rollout, passes: MicroBatches) -> Rollout:
        """What the loss reads that is fixed during the update (sampling and reference
        log-probs), computed once, without gradient."""
        ...

    def denominator(self, mb: Rollout) -> float:
        """The loss denominator of this rank's share of a minibatch (no forward)."""
        ...

    def __call__(
        self, policy, mb: Rollout | None, step: int
    ) -> tuple[Tensor | None, dict[str, float]]:
        """The differentiable numerator over ``mb`` and this rank's sums (``tokens``,
        ``den``, ``num`` and the keys of ``metrics``). ``mb`` None or empty: the
        zero-weight loss a sharded engine needs (None where nothing runs), no sums."""
        ...

    def after_update(self, step: int) -> dict[str, float]:
        """Work after the step's optimizer steps; its metrics."""
        ...

    def state_dict(self) -> dict | None: ...

    def load_state_dict(self, state: dict | None) -> None: ...


class PPOClipLoss:
    """PPO-clip with clip-higher and dual-clip (``losses.ppo_clip_loss``), a KL penalty to
    the reference (k1 / k2 / k3 from log-probs, or closed form from a flow policy's
    transition means), an entropy bonus, truncated importance weights of a vLLM rollout,
    and DAPO's overlong filter.

    Decoupled PPO for samples made by older weights (``trainer.async``, arXiv 2505.24298):
    where a sample's ``context["staleness"]`` is above 0, ``prepare`` recomputes the
    proximal log-probs with the current (pre-update) policy, the clipped ratio is taken
    against them, and each action's loss is weighted by the behaviour ratio
    ``min(exp(proximal - behaviour), behaviour_cap)`` (0: no weight), the behaviour
    log-probs being those recorded at sampling (a flow policy's SDE log-probs). A sample
    of staleness 0 was made by the proximal policy itself: nothing changes for it."""

    def __init__(
        self,
        lockstep: Lockstep,
        *,
        clip_low: float = 0.2,
        clip_high: float = 0.2,
        dual_clip: float | None = None,
        loss_agg: str = "token-mean",
        entropy_coef: float = 0.0,
        kl_coef: float = 0.0,
        kl_estimator: str = "k3",
        kl_block: int = 0,
        closed_form_kl: bool = False,
        recompute_old_logprobs: bool = False,
        overlong_filter: bool = False,
        behaviour_cap: float = 2.0,
    ):
        self.lockstep = lockstep
        self.clip_low, self.clip_high, self.dual_clip = clip_low, clip_high, dual_clip
        self.loss_agg, self.entropy_coef = loss_agg, entropy_coef
        self.kl_coef, self.kl_estimator, self.kl_block = kl_coef, kl_estimator, kl_block
        self.closed_form_kl = closed_form_kl
        self.recompute_old_logprobs = recompute_old_logprobs
        self.overlong_filter = overlong_filter
        self.behaviour_cap = behaviour_cap
        self.metrics = {k: f"train/{k}" for k in TOKEN_STATS}
        if kl_coef > 0:
            self.metrics["kl"] = "train/kl"

    def sampling(self) -> AbstractContextManager:
        return nullcontext()

    def prepare(self, policy, r: Rollout, passes: MicroBatches) -> Rollout:
        with torch.no_grad():
            behaviour = r.logprobs
            if self.recompute_old_logprobs:
                lp = passes.no_grad(policy.logprobs, r)
                r.logprobs = r.logprobs if lp is None else lp
            stale = r.context[STALENESS] > 0 if STALENESS in r.context else None
            if stale is not None and bool(stale.any()):  # decoupled PPO (see the class)
                proximal = r.logprobs
                if not self.recompute_old_logprobs:
                    proximal = passes.no_grad(policy.logprobs, r)
                rows = stale[:, None].to(behaviour.device)
                r.logprobs = torch.where(rows, proximal.to(behaviour.device), behaviour)
                w, clipped = behaviour_weights(
                    r.logprobs, behaviour, r.mask.to(behaviour.device) * rows, self.behaviour_cap
                )
                r.context[BEHAVIOUR], r.context[BEHAVIOUR_CLIPPED] = w, clipped
            if self.closed_form_kl:  # the reference's transition means, into the context
                if len(r):
                    r = policy.attach_reference_means(r)
                else:
                    self.lockstep.idle(lambda f: policy.attach_reference_means(f.select([0])))
            elif self.kl_coef > 0:
                r.ref_logprobs = passes.no_grad(policy.reference_logprobs, r)
        if self.overlong_filter and r.truncated is not None and len(r):
            r.mask = overlong.overlong_filter_mask(r.mask, r.truncated)
        return r

    def denominator(self, mb: Rollout) -> float:
        zero = mb.mask * 0
        return float(losses.loss_terms(zero, mb.mask, self.loss_agg, max_len=mb.num_actions)[1])

    def __call__(self, policy, mb: Rollout | None, step: int):
        if mb is None or not len(mb):
            return self.lockstep.zero_loss(), {}
        if self.closed_form_kl:
            lp, ent, kl_est = policy.logprobs_with_kl(mb, self.kl_estimator, self.kl_block)
        else:
            lp, ent = policy.logprobs(mb, with_entropy=True)
        dev = lp.device  # rewards and advantages live on the CPU; the policy may not
        mask = mb.mask.to(dev)
        loss_mat, m = losses.ppo_clip_loss(
            lp,
            mb.logprobs.to(dev),
            mb.advantages.to(dev),
            mask,
            clip_low=self.clip_low,
            clip_high=self.clip_high,
            dual_clip=self.dual_clip,
        )
        if "is_weight" in mb.context:  # truncated IS, rollout engine vs trainer (vllm)
            loss_mat = loss_mat * mb.context["is_weight"].to(dev)
        if BEHAVIOUR in mb.context:  # decoupled PPO: proximal / behaviour, capped
            loss_mat = loss_mat * mb.context[BEHAVIOUR].to(dev)
        sums: dict[str, float] = {}
        if self.kl_coef > 0:
            if not self.closed_form_kl:
                kl_est = kl.kl_penalty(lp, mb.ref_logprobs.to(dev), self.kl_estimator)
            loss_mat = loss_mat + self.kl_coef * torch.where(mask.bool(), kl_est, 0.0)
            sums["kl"] = float(losses.masked_mean(kl_est.detach(), mask)) * float(mask.sum())
        if self.entropy_coef:
            loss_mat = loss_mat - self.entropy_coef * torch.where(mask.bool(), ent, 0.0)
        num, den = losses.loss_terms(loss_mat, mask, self.loss_agg, max_len=mb.num_actions)
        ntok = float(mask.sum())
        sums.update(tokens=ntok, den=float(den), num=float(num.detach()))
        sums["entropy"] = float(losses.masked_mean(ent.detach(), mask)) * ntok
        for k in ("clip_frac", "ratio_mean", "approx_kl"):
            sums[k] = float(m[k]) * ntok
        return num, sums

    def after_update(self, step: int) -> dict[str, float]:
        return {}

    def state_dict(self) -> None:
        return None

    def load_state_dict(self, state: dict | None) -> None:
        pass


def behaviour_weights(
    proximal: Tensor, behaviour: Tensor, mask: Tensor, cap: float
) -> tuple[Tensor, Tensor]:
    """Decoupled PPO's behaviour ratio per action, ``exp(proximal - behaviour)`` capped at
    ``cap`` (1 where ``mask`` is 0, and everywhere when ``cap`` is 0), and where it hit
    the cap.

    >>> w, hit = behaviour_weights(torch.tensor([[0.0, 0.0]]), torch.tensor([[0.0, -1.0]]),
    ...                            torch.tensor([[1.0, 1.0]]), 2.0)
    >>> w.tolist(), hit.tolist()
    ([[1.0, 2.0]], [[False, True]])
    """
    on = mask > 0
    log_ratio = torch.where(on, proximal.float() - behaviour.float(), 0.0)
    ratio = log_ratio.clamp(max=losses.MAX_LOG_RATIO).exp()
    if cap <= 0:
        return torch.ones_like(ratio), torch.zeros_like(on)
    return ratio.clamp(max=cap), on & (ratio > cap)


NFT_STATS = ("positive", "negative", "old_deviation", "r_mean")


class NFTLoss:
    """DiffusionNFT (``mmyatt.algorithms.nft``): flow matching on forward-noised copies of
    the rollout's clean samples, weighted by their normalised rewards, against a
    sampling policy that trails the trained one. It reads no log-probs, so samples made
    ahead (``trainer.async``) need no behaviour correction: the producer samples with a
    snapshot of the trailing policy, and the loss is unchanged. ``nft``: the flow adapter's side
    (``FlowNFT``: the old copy, the noise draw, the loss of a rollout)."""

    def __init__(self, nft, lockstep: Lockstep, *, kl_coef: float = 0.0, kl_block: int = 0):
        self.nft, self.lockstep = nft, lockstep
        self.kl_coef, self.kl_block = kl_coef, kl_block
        self.metrics = {k: f"train/{k}" for k in TOKEN_STATS}  # 0: no ratio, no entropy
        if kl_coef > 0:  # on velocities, to the reference
            self.metrics["kl"] = "train/kl"
        self.metrics.update({f"nft/{k}": f"nft/{k}" for k in NFT_STATS})

    def sampling(self) -> AbstractContextManager:
        return self.nft.sampling()

    def prepare(self, policy, r: Rollout, passes: MicroBatches) -> Rollout:
        return r  # no log-probs: the loss reads the clean samples and their rewards

    def denominator(self, mb: Rollout) -> float:
        return float(len(mb))

    def __call__(self, policy, mb: Rollout | None, step: int):
        # a sharded forward: every rank runs the fullest rank's row count
        samples = self.lockstep.rows(0 if mb is None else len(mb))
        idle = mb is None or not len(mb)
        if idle:
            if samples is None:
                return None, {}
            mb = self.lockstep.filler()  # a zero-weight pass on the filler
        rows, stats = self.nft.loss(
            mb,
            step,
            kl_coef=self.kl_coef,
            kl_block=self.kl_block,
            reference=self.nft.reference_fn() if self.kl_coef > 0 else None,
            samples=samples,
        )
        if idle:
            return rows.sum() * 0.0, {}
        n = float(len(mb))
        sums = {"tokens": n, "den": n, "num": float(rows.detach().sum())}
        for k in NFT_STATS:
            sums[f"nft/{k}"] = float(stats[k]) * n
        if "kl" in stats:
            sums["kl"] = float(stats["kl"]) * n
        return rows.sum(), sums

    def after_update(self, step: int) -> dict[str, float]:
        """The sampling policy moves towards the trained one (its EMA decay)."""
        return {"nft/old_decay": self.nft.update_old(step)}

    def state_dict(self) -> dict:
        return self.nft.state_dict()

    def load_state_dict(self, state: dict | None) -> None:
        if state is not None:
            self.nft.load_state_dict(state)
