"""DiffusionNFT (arXiv 2509.16117): online RL for flow models on the forward process.

Flow-GRPO turns each reverse (denoising) step into a Gaussian policy and needs its
log-probability, so it must sample with an SDE and train on the sampler's transitions.
DiffusionNFT needs neither: rollouts come from any sampler (the deterministic ODE
included), only the final clean samples x0 and their rewards are kept, and training is
flow matching on freshly forward-noised copies x_t = (1 - t) x0 + t eps, target
velocity v* = eps - x0.

The reward enters through two *implicit* policies built from the trained velocity
v_theta and the velocity v_old of the policy that sampled (held fixed during a step):

    v+ = (1 - beta) v_old + beta v_theta        (implicit positive policy)
    v- = (1 + beta) v_old - beta v_theta        (implicit negative policy, v_old's mirror)

    loss = r * ||v+ - v*||^2 + (1 - r) * ||v- - v*||^2

with r in [0, 1] the sample's normalised reward (optimality probability). A sample with
r = 1 pulls v+ (hence v_theta) towards its own flow-matching target, one with r = 0 pulls
v- there, i.e. pushes v_theta away from it; r = 1/2 gives no net pull. For one target the minimiser is
v_theta = v_old + (2r - 1) / beta * (v* - v_old) (``tests/test_nft.py`` checks it): over
many samples, v_old moved along the direction from the negative towards the positive
data (the paper's policy-improvement direction), by a step scaled by 1/beta.

Two forms of the squared error (``weighting``):

``"velocity"``
    The objective as written above: mean over elements of (v+- - v*)^2.
``"adaptive_x0"`` (the NVlabs code)
    In x0 space, x0_hat = x_t - t v, with each sample's error divided by its own mean
    absolute x0 error (detached): ||x0_hat - x0||^2 / mean|x0_hat - x0|. It evens out
    the weight of high- and low-noise timesteps.

In both, the per-sample loss is divided by ``beta`` and multiplied by ``scale`` (the
NVlabs code: scale = adv_clip, so that the gradient does not shrink with a small beta
or a narrow r range).

The normalised reward (``reward_weight``): ``"advantage"`` (the paper's) takes the
group-normalised advantage A (GRPO's, clipped to [-c, c]) and maps it to
r = A / (2c) + 1/2; ``"raw"`` uses the reward itself, clamped to [0, 1] (for rewards that
already are probabilities or win rates).

The sampling ("old") policy trails the trained one: after each RL step,
old <- d * old + (1 - d) * theta with d = min(decay_rate * step, decay_max)
(:func:`old_decay`; the NVlabs default is rate 0.001, max 0.5; 0 and 0 resample from the
current weights every step, fully on-policy).
"""

from __future__ import annotations

import torch
from torch import Tensor

NFT_WEIGHTINGS = ("velocity", "adaptive_x0")
NFT_REWARD_NORMS = ("advantage", "raw")
NFT_TIMESTEPS = ("sampler", "uniform", "logit_normal")


def reward_weight(
    advantages: Tensor | None,
    rewards: Tensor | None,
    mode: str = "advantage",
    adv_clip: float = 5.0,
) -> Tensor:
    """The optimality weight r in [0, 1] per sample, (N,) -> (N,) float32.

    >>> reward_weight(torch.tensor([-10.0, -2.5, 0.0, 5.0]), None, "advantage", 5.0).tolist()
    [0.0, 0.25, 0.5, 1.0]
    >>> reward_weight(None, torch.tensor([-0.5, 0.3, 1.5]), "raw").tolist()
    [0.0, 0.30000001192092896, 1.0]
    """
    if mode == "advantage":
        if advantages is None:
            raise ValueError("reward_weight(mode='advantage') needs advantages")
        if adv_clip <= 0:
            raise ValueError(f"adv_clip must be > 0, got {adv_clip}")
        a = advantages.float().clamp(-adv_clip, adv_clip)
        return (a / (2.0 * adv_clip) + 0.5).clamp(0.0, 1.0)
    if mode == "raw":
        if rewards is None:
            raise ValueError("reward_weight(mode='raw') needs rewards")
        return rewards.float().clamp(0.0, 1.0)
    raise ValueError(f"reward normalisation must be one of {NFT_REWARD_NORMS}, got {mode!r}")


def implicit_policies(v_theta: Tensor, v_old: Tensor, beta: float) -> tuple[Tensor, Tensor]:
    """(v+, v-) = ((1 - beta) v_old + beta v_theta, (1 + beta) v_old - beta v_theta);
    v_old is detached."""
    v_old = v_old.detach()
    return (1.0 - beta) * v_old + beta * v_theta, (1.0 + beta) * v_old - beta * v_theta


def _per_sample(err: Tensor) -> Tensor:
    return err.reshape(err.shape[0], -1).mean(dim=1)


def nft_loss(
    v_theta: Tensor,
    v_old: Tensor,
    x0: Tensor,
    noise: Tensor,
    t: Tensor,
    r: Tensor,
    *,
    beta: float = 1.0,
    weighting: str = "adaptive_x0",
    scale: float = 1.0,
) -> tuple[Tensor, dict[str, Tensor]]:
    """The DiffusionNFT loss per row, (R,), and detached diagnostics.

    Rows are (sample, timestep) pairs: v_theta (R, ...) with grad, v_old (R, ...) the
    sampling policy's velocity at the same x_t, x0 and noise (R, ...) the clean sample
    and the forward noise that made x_t = (1 - t) x0 + t noise, t (R,), r (R,) in [0, 1].

    Diagnostics (means over rows): "positive" and "negative" (the two squared errors),
    "old_deviation" (mean (v_theta - v_old)^2).
    """
    if beta <= 0:
        raise ValueError(f"beta must be > 0, got {beta}")
    if weighting not in NFT_WEIGHTINGS:
        raise ValueError(f"weighting must be one of {NFT_WEIGHTINGS}, got {weighting!r}")
    v_theta, v_old = v_theta.float(), v_old.float().detach()
    x0, noise = x0.float(), noise.float()
    v_pos, v_neg = implicit_policies(v_theta, v_old, beta)
    if weighting == "velocity":
        target = noise - x0
        pos = _per_sample((v_pos - target) ** 2)
        neg = _per_sample((v_neg - target) ** 2)
    else:
        tb = t.float().reshape(-1, *([1] * (x0.ndim - 1)))
        xt = (1.0 - tb) * x0 + tb * noise
        e_pos = xt - tb * v_pos - x0
        e_neg = xt - tb * v_neg - x0
        with torch.no_grad():
            w_pos = _per_sample(e_pos.abs().double()).clamp_min(1e-5).float()
            w_neg = _per_sample(e_neg.abs().double()).clamp_min(1e-5).float()
        pos = _per_sample(e_pos**2) / w_pos
        neg = _per_sample(e_neg**2) / w_neg
    r = r.float().reshape(-1)
    loss = (r * pos + (1.0 - r) * neg) * (scale / beta)
    stats = {
        "positive": pos.detach().mean(),
        "negative": neg.detach().mean(),
        "old_deviation": ((v_theta.detach() - v_old) ** 2).mean(),
    }
    return loss, stats


def old_decay(step: int, rate: float, maximum: float) -> float:
    """The sampling policy's EMA decay after RL step ``step`` (1-based): min(rate * step,
    maximum); 0 makes the old policy a copy of the trained one.

    >>> old_decay(100, 0.001, 0.5), old_decay(900, 0.001, 0.5), old_decay(7, 0.0, 0.0)
    (0.1, 0.5, 0.0)
    """
    if rate < 0 or not 0.0 <= maximum < 1.0:
        raise ValueError(f"need rate >= 0 and 0 <= maximum < 1, got {rate}, {maximum}")
    return min(rate * step, maximum)


def sample_timesteps(
    n: int,
    k: int,
    mode: str,
    sampler_sigmas: Tensor | None = None,
    generator: torch.Generator | None = None,
) -> Tensor:
    """(n, k) training times t in (0, 1].

    ``"sampler"``: k distinct entries of ``sampler_sigmas`` (the rollout's own noise
    levels, (S,) with S >= k, sigma 0 excluded), drawn without replacement per sample
    (the NVlabs code: the sampler's timesteps in random order); ``"uniform"``: U(0, 1);
    ``"logit_normal"``: sigmoid(N(0, 1)) (SD3's flow-matching choice).
    """
    if k < 1:
        raise ValueError(f"need at least one timestep per sample, got {k}")
    if mode == "sampler":
        if sampler_sigmas is None:
            raise ValueError("timesteps='sampler' needs the rollout's sigmas")
        s = sampler_sigmas.float().reshape(-1)
        s = s[s > 0]
        if s.numel() < k:
            raise ValueError(f"timesteps_per_sample={k} exceeds the sampler's {s.numel()} steps")
        idx = torch.stack([torch.randperm(s.numel(), generator=generator)[:k] for _ in range(n)])
        return s[idx]
    if mode == "uniform":
        return torch.rand(n, k, generator=generator).clamp_min(1e-4)
    if mode == "logit_normal":
        return torch.sigmoid(torch.randn(n, k, generator=generator))
    raise ValueError(f"timesteps must be one of {NFT_TIMESTEPS}, got {mode!r}")
