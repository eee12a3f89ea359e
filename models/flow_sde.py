"""Stochastic samplers that turn a flow-matching ODE into a policy (Flow-GRPO).

A flow model predicts the velocity v = eps - x0 of the interpolation
x_t = (1 - t) x0 + t eps (sigma = t; 1 is pure noise). Sampling integrates from
sigma = 1 to 0. To do RL on it, each denoising transition x -> x' is made a Gaussian
with a tractable log-density: the reverse-time SDE with the same marginals as the ODE
(Flow-GRPO), or coefficients-preserving sampling (CPS). The step functions are pure,
work on any (B, ...) tensor (images (B, C, H, W), video (B, C, F, H, W)) and compute
in fp32 whatever the input dtype: in half precision the s^2 / (2 sigma) term overflows
near sigma = 1 and the log-prob of a mean over thousands of elements loses the ratio.

Conventions shared by all steps:

* ``sigma``, ``sigma_next``, ``noise_level`` are python floats or tensors of shape (B,)
  (one value per row); they broadcast over the non-batch dimensions.
* ``prev_sample`` given: nothing is sampled; the log-prob of that sample is recomputed
  (training). Otherwise x' is drawn with ``noise`` (a standard normal tensor) or from
  ``generator``.
* ``log_prob`` is the MEAN over all non-batch elements, shape (B,), as flow_grpo does:
  the PPO ratio is then a per-element geometric mean, hence its tiny clip ranges.
* Rows with ``noise_level == 0`` take the Euler ODE step x + v * Delta bit for bit and
  get ``log_prob = 0``: a deterministic step has no density, and 0 keeps it finite.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
from torch import Tensor

if TYPE_CHECKING:
    from mmyatt.protocols import Sampling

__all__ = [
    "cps_step",
    "euler_step",
    "flow_sigmas",
    "kl_closed_form",
    "plan_steps",
    "sde_step",
    "step_entropy",
    "within_blocks",
]

_LOG_SQRT_2PI = 0.5 * math.log(2.0 * math.pi)


def _per_row(value: float | Tensor, ref: Tensor) -> Tensor:
    """A float or (B,) tensor as fp32 of shape (B, 1, ..., 1) matching ``ref`` (B, ...)."""
    t = torch.as_tensor(value, dtype=torch.float32, device=ref.device)
    if t.ndim == 0:
        t = t.expand(ref.shape[0])
    if t.shape != (ref.shape[0],):
        raise ValueError(
            f"expected a float or a ({ref.shape[0]},) tensor, got shape {tuple(t.shape)}"
        )
    return t.reshape(-1, *([1] * (ref.ndim - 1)))


def _draw(mu: Tensor, noise: Tensor | None, generator: torch.Generator | None) -> Tensor:
    if noise is not None:
        if noise.shape != mu.shape:
            raise ValueError(f"noise has shape {tuple(noise.shape)}, expected {tuple(mu.shape)}")
        return noise.to(torch.float32)
    return torch.randn(mu.shape, generator=generator, device=mu.device, dtype=torch.float32)


def euler_step(x: Tensor, v: Tensor, sigma: float | Tensor, sigma_next: float | Tensor) -> Tensor:
    """Deterministic ODE step x' = x + v * (sigma_next - sigma), fp32. x, v: (B, ...)."""
    x, v = x.to(torch.float32), v.to(torch.float32)
    return x + v * (_per_row(sigma_next, x) - _per_row(sigma, x))


def sde_step(
    x: Tensor,
    v: Tensor,
    sigma: float | Tensor,
    sigma_next: float | Tensor,
    noise_level: float | Tensor,
    noise: Tensor | None = None,
    generator: torch.Generator | None = None,
    prev_sample: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """One Flow-GRPO SDE step from ``sigma`` to ``sigma_next`` (DESIGN §5).

    With Delta = sigma' - sigma < 0 and a = noise_level::

        s   = a * sqrt(sigma / (1 - sigma))
        mu  = x + [v + s^2 / (2 sigma) * (x + (1 - sigma) v)] * Delta
        std = s * sqrt(-Delta)
        x'  = mu + std * z,   z ~ N(0, I)

    x + (1 - sigma) v is the predicted noise eps_hat, so the bracket is the ODE drift minus
    (s^2 / 2) * score with score = -eps_hat / sigma: the reverse SDE with the ODE's marginals.
    At sigma == 1 the ratio sigma / (1 - sigma) is infinite; like flow_grpo the denominator
    then uses the next sigma (1 - sigma'), which only happens on the very first step.

    Args:
        x, v: (B, ...) current sample and predicted velocity.
        sigma, sigma_next: floats or (B,) tensors.
        noise_level: a, float or (B,) tensor; 0 gives the exact Euler step.
    Returns:
        (x_next (B, ...), log_prob (B,), mean (B, ...), std (B, 1, ..., 1)), all fp32.
        log_prob is the element-mean Gaussian log-density of x_next (or of ``prev_sample``)
        under N(mean, std^2); it is 0 on rows with noise_level == 0.
    """
    x, v = x.to(torch.float32), v.to(torch.float32)
    sig, sig_next, a = _per_row(sigma, x), _per_row(sigma_next, x), _per_row(noise_level, x)
    delta = sig_next - sig
    denom = 1.0 - torch.where(sig == 1.0, sig_next, sig)
    s = a * torch.sqrt(sig / denom)
    mu = x + (v + s**2 / (2.0 * sig) * (x + (1.0 - sig) * v)) * delta
    std = s * torch.sqrt(-delta)
    deterministic = a == 0
    # With a == 0 the bracket is v + 0 = v, but the Euler step is written out anyway so
    # that the ODE equivalence never depends on how the arithmetic above is arranged.
    mu = torch.where(deterministic, x + v * delta, mu)
    if prev_sample is None:
        x_next = torch.where(deterministic, mu, mu + std * _draw(mu, noise, generator))
    else:
        x_next = prev_sample.to(torch.float32)
    safe_std = torch.where(deterministic, torch.ones_like(std), std)
    # The sample is data, not a function of the weights: only mu carries the gradient.
    lp = -((x_next.detach() - mu) ** 2) / (2.0 * safe_std**2) - torch.log(safe_std) - _LOG_SQRT_2PI
    lp = torch.where(deterministic, torch.zeros_like(lp), lp)
    return x_next, lp.mean(dim=tuple(range(1, lp.ndim))), mu, std


def cps_step(
    x: Tensor,
    v: Tensor,
    sigma: float | Tensor,
    sigma_next: float | Tensor,
    noise_level: float | Tensor,
    noise: Tensor | None = None,
    generator: torch.Generator | None = None,
    prev_sample: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """One coefficients-preserving sampling (CPS) step, flow_grpo's ``sde_type="cps"``.

    ::

        s   = sigma' * sin(a * pi / 2)
        x0  = x - sigma v,   x1 = x + (1 - sigma) v          (predicted data and noise)
        mu  = (1 - sigma') x0 + sqrt(sigma'^2 - s^2) x1
        x'  = mu + s * z
        log pi = -mean((x' - mu)^2)

    The log-prob drops every constant and the 1/(2 s^2) factor, as flow_grpo does: it is
    NOT a normalised density, only a quantity whose differences give a usable PPO ratio
    (the constants cancel in the ratio; the missing scale changes the ratio's steepness).
    Shapes and return values as ``sde_step``; std is s. With a = 0 (and on rows with
    a = 0) the exact Euler step is returned, which mu equals algebraically, and log_prob 0.
    """
    x, v = x.to(torch.float32), v.to(torch.float32)
    sig, sig_next, a = _per_row(sigma, x), _per_row(sigma_next, x), _per_row(noise_level, x)
    s = sig_next * torch.sin(a * (math.pi / 2.0))
    x0_hat = x - sig * v
    x1_hat = x + (1.0 - sig) * v
    mu = (1.0 - sig_next) * x0_hat + torch.sqrt(sig_next**2 - s**2) * x1_hat
    deterministic = a == 0
    mu = torch.where(deterministic, x + v * (sig_next - sig), mu)
    if prev_sample is None:
        x_next = torch.where(deterministic, mu, mu + s * _draw(mu, noise, generator))
    else:
        x_next = prev_sample.to(torch.float32)
    lp = -((x_next.detach() - mu) ** 2)
    lp = torch.where(deterministic, torch.zeros_like(lp), lp)
    return x_next, lp.mean(dim=tuple(range(1, lp.ndim))), mu, s


def step_entropy(std: Tensor) -> Tensor:
    """Per-element entropy 0.5 * log(2 pi e std^2) of a Gaussian step of standard deviation
    ``std``; 0 where the step is deterministic (std = 0)."""
    return torch.where(
        std > 0,
        torch.log(std.clamp_min(1e-30)) + 0.5 * (1.0 + math.log(2.0 * math.pi)),
        torch.zeros_like(std),
    )


def flow_sigmas(num_steps: int, shift: float = 3.0) -> Tensor:
    """(num_steps + 1,) fp32 sigmas from 1 down to 0, exactly as diffusers'
    ``FlowMatchEulerDiscreteScheduler(shift=shift).set_timesteps(num_steps)`` makes them."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    if num_steps < 1:
        raise ValueError(f"num_steps must be >= 1, got {num_steps}")
    sched = FlowMatchEulerDiscreteScheduler(shift=shift)
    sched.set_timesteps(num_steps, device="cpu")
    return sched.sigmas.to(torch.float32).clone()


def within_blocks(x: Tensor, block: int) -> Tensor:
    """``x`` minus its mean over each ``block`` x ``block`` tile of the last two (spatial)
    dimensions: the component of an image (or of every frame) that varies inside the
    tiles. Block averaging is an orthogonal projection, so this is too.

    >>> within_blocks(torch.arange(4.0).reshape(1, 2, 2), 2).tolist()
    [[[-1.5, -0.5], [0.5, 1.5]]]
    """
    h, w = x.shape[-2:]
    if block < 1 or h % block or w % block:
        raise ValueError(f"block {block} must divide the spatial size {h}x{w}")
    flat = x.reshape(-1, 1, h, w)
    avg = torch.nn.functional.avg_pool2d(flat, block)
    up = avg.repeat_interleave(block, dim=-2).repeat_interleave(block, dim=-1)
    return (flat - up).reshape(x.shape)


def kl_closed_form(mean: Tensor, ref_mean: Tensor, std: Tensor, block: int = 0) -> Tensor:
    """KL(N(mean, std^2 I) || N(ref_mean, std^2 I)) per row, averaged over elements.

    ``block`` > 0: the KL of the steps' components within ``block`` x ``block`` spatial
    tiles only (:func:`within_blocks` of mean - ref_mean; the same Gaussians projected
    on that subspace). Changes of the tile means (composition, colour, shape) are then
    free, while texture inside the tiles (a patch transformer's grid pattern) is held to
    the reference.

    For two Gaussians with the same std the KL is sum((mean - ref_mean)^2) / (2 std^2);
    it is divided by the element count here, matching the per-element mean of the flow
    log-probs (and Flow-GRPO's KL term). mean, ref_mean: (B, ...); std: (B,) or a float.
    Rows with std == 0 get 0: deterministic steps (masked out anyway) and CPS's last step
    into sigma = 0, whose exact KL is unbounded. Gradient flows through ``mean`` only.
    """
    if mean.shape != ref_mean.shape:
        raise ValueError(f"mean {tuple(mean.shape)} vs ref_mean {tuple(ref_mean.shape)}")
    diff = mean.float() - ref_mean.detach().float()
    if block:
        diff = within_blocks(diff, block)
    sq = diff.square().reshape(diff.shape[0], -1).mean(dim=1)
    std = torch.as_tensor(std, dtype=torch.float32, device=sq.device).expand(sq.shape[0])
    var = std.square()
    return torch.where(var > 0, sq / (2.0 * torch.where(var > 0, var, 1.0)), torch.zeros_like(sq))


def plan_steps(sampling: Sampling, steps: int) -> tuple[set[int], set[int]]:
    """(sde steps, train steps) of a rollout; train steps must be stochastic unless greedy."""
    if steps < 1:
        raise ValueError(f"denoise_steps must be >= 1, got {steps}")
    everything = set(range(steps))
    sde = everything if sampling.sde_steps is None else set(sampling.sde_steps)
    train = sde if sampling.train_steps is None else set(sampling.train_steps)
    for name, s in (("sde_steps", sde), ("train_steps", train)):
        bad = sorted(s - everything)
        if bad:
            raise ValueError(f"Sampling.{name} {bad} outside 0..{steps - 1}")
    if sampling.greedy:
        return set(), train
    if not train <= sde:
        raise ValueError(
            f"Sampling.train_steps {sorted(train - sde)} are not in sde_steps: an ODE step has "
            "no log-prob to train"
        )
    if sampling.sde_type not in ("sde", "cps"):
        raise ValueError(f"Sampling.sde_type must be 'sde' or 'cps', got {sampling.sde_type!r}")
    return sde, train
