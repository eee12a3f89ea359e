"""The boundary between the engine and a modality adapter.

Adapters do single-device math: sample, score log-probs, expose the module to
optimise, save in Hugging Face layout. They never see optimizers, process groups or
config objects; builders in the engine turn config into constructor arguments.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch
from torch import Tensor, nn

from mmyatt.rollout import Rollout


@dataclass(frozen=True)
class Sampling:
    """How to sample one rollout. Adapters ignore what does not apply to them."""

    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 32  # text/VLM action budget
    stop: tuple[str, ...] = ()  # text/VLM stop strings (the stop string is kept in the output)
    greedy: bool = False  # text: argmax; flow: deterministic ODE sampling (noise level 0)
    # flow models (Flow-GRPO): denoising steps of this rollout, SDE noise level a, sampler,
    # classifier-free guidance, and which steps are stochastic / trained. Steps are indices
    # 0..denoise_steps-1 from high noise to low; None means all of them.
    denoise_steps: int = 10
    noise_level: float = 0.7
    sde_type: str = "sde"  # "sde" (Flow-GRPO) | "cps" (coefficients-preserving)
    guidance_scale: float = 1.0  # 1.0 = no CFG
    sde_steps: tuple[int, ...] | None = None  # stochastic steps; ODE elsewhere (Flow-GRPO-Fast)
    train_steps: tuple[int, ...] | None = None  # steps that become actions (subset of sde_steps)


@runtime_checkable
class Policy(Protocol):
    def generate(
        self,
        prompts: list[dict],
        group_size: int,
        sampling: Sampling,
        seeds: list[int],
    ) -> Rollout:
        """Sample ``group_size`` completions per prompt.

        ``prompts`` are manifest records (dicts with at least ``"prompt"``); ``seeds``
        has one integer per prompt: all randomness for a prompt's group comes from a
        generator seeded with it, so a prompt yields the same samples on any rank.
        Returns a rollout with N = len(prompts) * group_size samples, groups contiguous.
        """
        ...

    def logprobs(
        self, rollout: Rollout, with_entropy: bool = False
    ) -> Tensor | tuple[Tensor, Tensor]:
        """(N, A) differentiable log pi(a|s) of the rollout's actions under current weights,
        with the same numerics as sampling; with_entropy also returns (N, A) entropies."""
        ...

    def module(self) -> nn.Module:
        """What the engine optimises (and wraps for LoRA/DDP/FSDP)."""
        ...

    def save(self, path: str) -> None:
        """Write the policy in Hugging Face layout (transformers or diffusers)."""
        ...


# Optional capabilities, looked up with hasattr by the engine:
#   enable_reference() -> None            snapshot the current weights as the frozen KL reference
#                                         (or note that the LoRA-disabled model is the reference)
#   reference_logprobs(rollout) -> Tensor (N, A) log pi_ref(a|s), no grad
#   sft_loss(records) -> Tensor           supervised loss for `mmyatt sft`


def seeded_generator(seed: int, device: torch.device | str = "cpu") -> torch.Generator:
    g = torch.Generator(device=device)
    g.manual_seed(int(seed) & 0x7FFF_FFFF_FFFF_FFFF)
    return g


def prompt_seed(base_seed: int, *keys: Any) -> int:
    """A stable 63-bit seed from a base seed and keys (epoch, record index, ...)."""
    import hashlib

    h = hashlib.blake2b(repr((int(base_seed), *keys)).encode(), digest_size=8).digest()
    return int.from_bytes(h, "little") & 0x7FFF_FFFF_FFFF_FFFF
