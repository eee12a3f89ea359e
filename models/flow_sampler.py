"""The denoising loop of a flow policy's rollout (``FlowPolicy.generate``).

From the initial noise to the final samples over a sigma schedule: the steps in the SDE
set take the stochastic step of ``flow_sde`` (``sde`` or ``cps``) at the rollout's noise
level, the others the Euler ODE step. The transitions x_k -> x_{k+1} at the trained
steps are recorded with their log-probs: they become the rollout's actions. The loop
knows nothing of the transformer: the policy hands it the velocity at (x, sigma), with
its CFG and batch-invariant forwards (``flow``).

Randomness comes from one generator per prompt: first the initial noise (one draw
shared by the prompt's group, or one per sample), then at each SDE step the group's
noise, in that order -- a rollout is a function of its seeds.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from mmyatt.models.flow_sde import cps_step, euler_step, sde_step

__all__ = ["Trajectory", "denoise", "initial_noise", "step_fn"]


@dataclass
class Trajectory:
    """One denoising run of N samples and its A recorded (trained) transitions."""

    final: Tensor  # (N, ...): the samples at sigma = 0, before any VAE decode
    x: Tensor  # (N, A, ...): x_k at each recorded step
    actions: Tensor  # (N, A, ...): x_{k+1}
    logprobs: Tensor  # (N, A) fp32; 0 at ODE steps
    sigma: Tensor  # (N, A)
    sigma_next: Tensor  # (N, A)
    noise_level: Tensor  # (N, A): the noise level at SDE steps, 0 at ODE ones


def step_fn(sde_type: str):
    """The stochastic step ``Sampling.sde_type`` names (``flow_sde.sde_step`` / ``cps_step``)."""
    if sde_type == "sde":
        return sde_step
    if sde_type == "cps":
        return cps_step
    raise ValueError(f"sde_type must be 'sde' or 'cps', got {sde_type!r}")


def initial_noise(
    gens: list[torch.Generator], group_size: int, shape: tuple[int, ...], *, shared: bool
) -> Tensor:
    """(len(gens) * group_size, *shape) starting samples, each prompt's from its generator.

    ``shared``: one draw per prompt for its whole group (flow_grpo same_latent): the
    group's samples then differ only by the SDE noise, which sharpens advantages.
    Otherwise one draw per sample (ODE rollouts: DiffusionNFT)."""
    draws = 1 if shared else group_size
    return torch.cat(
        [
            torch.randn((draws, *shape), generator=gen, device=gen.device).expand(
                group_size, *shape
            )
            for gen in gens
        ]
    )


def denoise(
    velocity: Callable[[Tensor, Tensor], Tensor],
    x: Tensor,
    sigmas: Tensor,
    gens: list[torch.Generator],
    *,
    sde_steps: set[int],
    train_steps: set[int],
    sde_type: str,
    noise_level: float,
) -> Trajectory:
    """Integrate ``x`` (N, ...) along ``sigmas`` (steps + 1 values, 1 -> 0), no grad.

    ``velocity(x, sigma)`` is the model's velocity for rows x at sigma (N,). Steps in
    ``sde_steps`` take the ``sde_type`` step with ``noise_level`` (0: every step is
    ODE), the group's noise drawn from each prompt's generator in ``gens`` (the N rows
    are len(gens) groups); steps in ``train_steps`` are recorded."""
    step = step_fn(sde_type)
    n, shape, dev = x.shape[0], tuple(x.shape[1:]), x.device
    group_size = n // len(gens)
    xs, acts, lps, sig, sig_next, levels = [], [], [], [], [], []
    with torch.no_grad():
        for k in range(len(sigmas) - 1):
            s_k = sigmas[k].repeat(n)
            s_n = sigmas[k + 1].repeat(n)
            v = velocity(x, s_k)
            level = noise_level if k in sde_steps else 0.0
            if level > 0.0:
                noise = torch.cat(
                    [torch.randn((group_size, *shape), generator=gen, device=dev) for gen in gens]
                )
                x_next, lp, _, _ = step(
                    x, v, s_k, s_n, torch.full((n,), level, device=dev), noise=noise
                )
            else:
                x_next, lp = euler_step(x, v, s_k, s_n), torch.zeros(n, device=dev)
            if k in train_steps:
                xs.append(x)
                acts.append(x_next)
                lps.append(lp)
                sig.append(s_k)
                sig_next.append(s_n)
                levels.append(torch.full((n,), level, device=dev))
            x = x_next

    def stack(ts: list[Tensor], tail: tuple[int, ...]) -> Tensor:
        return torch.stack(ts, 1) if ts else torch.zeros((n, 0, *tail), device=dev)

    return Trajectory(
        final=x,
        x=stack(xs, shape),
        actions=stack(acts, shape),
        logprobs=stack(lps, ()).float(),
        sigma=stack(sig, ()),
        sigma_next=stack(sig_next, ()),
        noise_level=stack(levels, ()),
    )
