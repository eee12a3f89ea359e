"""DiffusionNFT training for the flow adapter (``algorithm.name: diffusion_nft``).

The math is :mod:`mmyatt.algorithms.nft`; this module holds what touches a ``FlowPolicy``: the
sampling ("old") policy, a frozen copy of the transformer that trails the trained one
by an EMA, and the loss of a rollout's clean samples under forward noising.

What a rollout must carry (``FlowPolicy.generate`` stores it): ``context["x0"]`` the
final samples (pixels for the built-ins, latents for pipelines, before any VAE decode),
``context["cond"]``/``["pooled"]`` the prompt embeddings and
``context["sampler_sigmas"]`` (N, S) the sampler's noise levels. No transition, no
log-probability and no CFG branch is used: training is conditional flow matching
(the paper trains CFG-free), and samples may come from any sampler, the ODE included.

Noise and timesteps of a group come from a generator seeded by (seed, step, the
group's record), so P controllers draw the same noise for a sample as one would.
"""

from __future__ import annotations

import contextlib
import copy
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from mmyatt.algorithms import nft
from mmyatt.models.flow_sde import within_blocks
from mmyatt.protocols import FlowVelocity, prompt_seed, require, seeded_generator
from mmyatt.rollout import Rollout


@dataclass(frozen=True)
class NFTSettings:
    """The knobs of ``algorithm.nft`` (see ``mmyatt.config.schema.NFTConfig``)."""

    beta: float = 1.0
    reward_norm: str = "advantage"
    adv_clip: float = 5.0
    weighting: str = "adaptive_x0"
    loss_scale: float | None = None  # None: adv_clip (the NVlabs code)
    timesteps: str = "sampler"
    timesteps_per_sample: int = 2
    decay_rate: float = 0.001
    decay_max: float = 0.5


class FlowNFT:
    """The sampling policy and the loss of DiffusionNFT for one ``FlowPolicy``."""

    def __init__(self, policy: FlowVelocity, settings: NFTSettings, seed: int = 0):
        require(policy, FlowVelocity, "algorithm.name=diffusion_nft")
        if settings.reward_norm not in nft.NFT_REWARD_NORMS:
            raise ValueError(f"nft.reward_norm must be one of {nft.NFT_REWARD_NORMS}")
        self.policy, self.s, self.seed = policy, settings, int(seed)
        self.old: nn.Module = copy.deepcopy(policy.transformer).eval().requires_grad_(False)

    # ---- the sampling policy --------------------------------------------------------------
    @contextlib.contextmanager
    def sampling(self):
        """Sample with the old policy: the policy's transformer is swapped for the old copy
        inside the block (rollouts run without grad), and every sample draws its own
        initial noise (with a deterministic sampler, a group sharing one noise would be G
        copies of one image)."""
        p = self.policy
        current, shared = p.transformer, p.shared_group_noise
        p.transformer, p.shared_group_noise = self.old, False
        try:
            yield p
        finally:
            p.transformer, p.shared_group_noise = current, shared

    @torch.no_grad()
    def update_old(self, step: int) -> float:
        """old <- d * old + (1 - d) * theta after RL step ``step``; returns d."""
        d = nft.old_decay(step, self.s.decay_rate, self.s.decay_max)
        cur = dict(self.policy.transformer.named_parameters())
        for name, p_old in self.old.named_parameters():
            p = cur[name]
            if not p.requires_grad:  # frozen weights (the LoRA base, model.freeze) stay equal
                continue
            # a sharded (FSDP2) weight is gathered whole, one at a time, on every rank
            p_old.mul_(d).add_(_whole(p.detach()).to(p_old.dtype), alpha=1.0 - d)
        return d

    def state_dict(self) -> dict[str, Tensor]:
        return {k: v.detach().clone() for k, v in self.old.state_dict().items()}

    def load_state_dict(self, state: dict[str, Tensor]) -> None:
        self.old.load_state_dict(state)

    # ---- the loss ---------------------------------------------------------------------
    def _group_noise(self, r: Rollout, step: int) -> tuple[Tensor, Tensor]:
        """(t (N, K), noise (N, K, ...)) drawn per group from a seeded generator."""
        ctx, k, shape = r.context, self.s.timesteps_per_sample, tuple(r.context["x0"].shape[1:])
        ts, noises = [], []
        for sl in r.group_slices():
            rec = r.records[sl.start]
            g = seeded_generator(
                prompt_seed(self.seed, "nft", step, rec.get("_epoch", 0), rec.get("_index", -1))
            )
            n = sl.stop - sl.start
            ts.append(
                nft.sample_timesteps(n, k, self.s.timesteps, ctx["sampler_sigmas"][sl.start], g)
            )
            noises.append(torch.randn((n, k, *shape), generator=g))
        return torch.cat(ts), torch.cat(noises)

    def loss(
        self,
        r: Rollout,
        step: int,
        *,
        kl_coef: float = 0.0,
        kl_block: int = 0,
        reference=None,
        samples: int | None = None,
    ) -> tuple[Tensor, dict[str, Tensor]]:
        """Per-sample loss (N,) (mean over its K timesteps; plus kl_coef x the mean
        squared velocity gap to ``reference``, within kl_block tiles if > 0) and detached
        diagnostics. ``reference``: a callable (x, t, cond, pooled) -> velocity, no grad.

        ``samples`` (a sharded engine): the transformer runs on that many samples' rows,
        these padded with copies of the first row (outputs dropped), so every rank runs
        the same sharded forwards and backwards whatever its own N."""
        p, ctx, k = self.policy, r.context, self.s.timesteps_per_sample
        dev = p.device
        t, noise = self._group_noise(r, step)
        t, noise = t.to(dev), noise.to(dev)
        x0 = ctx["x0"].to(dev).float().repeat_interleave(k, 0)
        noise = noise.flatten(0, 1)
        tf = t.reshape(-1)
        tb = tf.reshape(-1, *([1] * (x0.ndim - 1)))
        xt = (1.0 - tb) * x0 + tb * noise
        cond = ctx["cond"].repeat_interleave(k, 0)
        pooled = ctx["pooled"].repeat_interleave(k, 0)
        pad = 0 if samples is None else max(samples * k - xt.shape[0], 0)
        if pad:
            xt, tf_in, cond, pooled = (
                torch.cat([a, a[:1].expand(pad, *a.shape[1:])]) for a in (xt, tf, cond, pooled)
            )
        else:
            tf_in = tf
        with torch.no_grad():
            v_old = p.velocity(self.old, xt, tf_in, cond, pooled)
        v = p.velocity(p.transformer, xt, tf_in, cond, pooled)
        if pad:  # the padding's outputs are dropped: no loss, a zero gradient
            v, v_old = v[:-pad], v_old[:-pad]
        adv = None if r.advantages is None else r.advantages.float()
        if adv is not None and adv.ndim > 1:
            adv = adv.mean(1)
        w = nft.reward_weight(adv, r.rewards, self.s.reward_norm, self.s.adv_clip)
        scale = self.s.adv_clip if self.s.loss_scale is None else self.s.loss_scale
        rows, stats = nft.nft_loss(
            v,
            v_old,
            x0,
            noise,
            tf,
            w.to(dev).repeat_interleave(k, 0),
            beta=self.s.beta,
            weighting=self.s.weighting,
            scale=scale,
        )
        stats["r_mean"] = w.mean()
        if kl_coef > 0 and reference is not None:
            with torch.no_grad():
                v_ref = reference(xt, tf_in, cond, pooled)
            if pad:
                v_ref = v_ref[:-pad]
            gap = v.float() - v_ref.float()
            if kl_block:
                gap = within_blocks(gap, kl_block)
            kl = gap.square().reshape(gap.shape[0], -1).mean(1)
            rows = rows + kl_coef * kl
            stats["kl"] = kl.detach().mean()
        return rows.reshape(-1, k).mean(1), stats

    def reference_fn(self):
        """A velocity callable of the KL reference (``FlowPolicy.enable_reference``)."""
        return self.policy.reference_velocity


def _whole(t: Tensor) -> Tensor:
    """A DTensor's whole value (a collective: every rank calls it); others as they are."""
    return t.full_tensor() if isinstance(t, DTensor) else t
