"""Rewards that read the generator's final latents instead of decoded images.

A reward function marked with :func:`reads_latents` gets as ``output`` the sample before
any VAE decode, a tensor (C, H, W) or (C, F, H, W) (pixels in [-1, 1] for the tiny
pixel-space built-ins). When every reward of a run reads latents, flow rollouts skip the
VAE decode (``FlowPolicy.decode_outputs``); a run mixing latent and pixel rewards is
refused when its rewards are built. The mark is a set the rewards consult, not an
attribute on the function.
"""

from __future__ import annotations

from collections.abc import Callable

LATENT_REWARDS: set[Callable[..., float]] = set()  # functions marked by reads_latents


def reads_latents(fn: Callable[..., float]) -> Callable[..., float]:
    """Declare that reward function ``fn`` reads latents (see the module docstring)."""
    LATENT_REWARDS.add(fn)
    return fn
