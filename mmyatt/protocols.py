"""The boundary between the engine and a modality adapter, owned by the engine.

Adapters do single-device math: sample, score log-probs, expose the module to
optimise, save in Hugging Face layout. They never see optimizers, process groups or
config objects; builders in the engine turn config into constructor arguments.

Every adapter implements :class:`Policy` in full. What only some adapters can do is a
capability of its own, a separate protocol the engine checks with ``isinstance``:

* :class:`ReferenceKL`: a frozen reference and its log-probs (the k1/k2/k3 KL penalty);
* :class:`ClosedFormKL`: the KL of Gaussian transitions from their means (flow models);
* :class:`EMA`: an exponential moving average of the trained weights (flow models);
* :class:`LatentOutputs`: outputs left as latents for rewards that read them (flow models);
* :class:`RolloutStats`: per-step metrics of a rollout engine (vLLM rollouts);
* :class:`SupervisedPolicy`: a supervised loss for ``mmyatt sft``.

Adapters import this module and :mod:`mmyatt.rollout` only from the engine; the engine
reaches adapters only through :mod:`mmyatt.step.builders`.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch
from torch import Tensor, nn

from mmyatt.rollout import Rollout

# KL estimators computed by a ClosedFormKL policy from transition means, not from log-probs
CLOSED_FORM_KL = ("closed_form", "closed_form_flowgrpo")


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
    # text over-dispatch (rollout.over_dispatch_ratio): stop decoding once this many prompt
    # groups have every sample finished and so have the groups in must_finish (indices);
    # the other groups come back cut short. 0: decode until every sample has finished.
    complete_groups: int = 0
    must_finish: tuple[int, ...] = ()
    # text/VLM streaming (placement partial): ``on_finished(rows, texts)`` is called during
    # decoding with rows of this call (indices into its samples) that have just finished
    # (stop token or stop string) and their completions, while the others go on decoding.
    # finished_unit "group": a prompt group's rows once all of them have finished (for
    # rewards that compare a group's samples); "sample": each row as it finishes. Rows the
    # budget cuts are not reported.
    on_finished: Callable[[list[int], list[str]], None] | None = field(
        default=None, compare=False, repr=False
    )
    finished_unit: str = "group"


@runtime_checkable
class Policy(Protocol):
    """What every adapter implements: the engine calls these on any policy."""

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


@runtime_checkable
class ReferenceKL(Protocol):
    """A frozen reference policy for the KL penalty (``algorithm.kl_coef`` > 0)."""

    def enable_reference(self) -> None:
        """Snapshot the current weights as the frozen reference (or note that the
        LoRA-disabled model is the reference)."""
        ...

    def reference_logprobs(self, rollout: Rollout) -> Tensor:
        """(N, A) log pi_ref(a|s), no grad."""
        ...


@runtime_checkable
class ClosedFormKL(ReferenceKL, Protocol):
    """KL(pi || pi_ref) of Gaussian transitions from their means (``CLOSED_FORM_KL``)."""

    def attach_reference_means(self, rollout: Rollout) -> Rollout:
        """Put the reference's transition means into ``rollout.context``."""
        ...

    def logprobs_with_kl(
        self, rollout: Rollout, estimator: str = "closed_form", block: int = 0
    ) -> tuple[Tensor, Tensor, Tensor]:
        """(log-probs, entropies, per-action KL), each (N, A), from one forward pass."""
        ...


@runtime_checkable
class EMA(Protocol):
    """An exponential moving average of the trained weights (``model.ema_decay``)."""

    def ema_update(self, decay: float = 0.9) -> None: ...

    def ema_state(self) -> dict[str, Tensor] | None: ...

    def load_ema_state(self, state: dict[str, Tensor] | None) -> None: ...

    def ema_weights(self) -> AbstractContextManager:
        """A context in which the module holds the EMA weights (for evaluation)."""
        ...


@runtime_checkable
class LatentOutputs(Protocol):
    """Outputs that can stay latents (no VAE decode) when every reward reads latents."""

    decode_outputs: bool  # False: ``Rollout.outputs`` are the final latents


@runtime_checkable
class RolloutStats(Protocol):
    """Extra per-step metrics of the rollout engine (vLLM rollouts: TIS, weight sync)."""

    def rollout_stats(self, rollout: Rollout) -> dict[str, float]: ...


@runtime_checkable
class MediaPrompts(Protocol):
    """A policy whose prompts hold images or video (the VLMs): the placeholder tokens
    its prompts expand (a vLLM rollout engine sends such prompts as multimodal inputs)."""

    image_token_id: int
    video_token_id: int


@runtime_checkable
class SupervisedPolicy(Protocol):
    """A supervised loss on manifest records (``mmyatt sft``)."""

    def sft_loss(self, records: list[dict], target_key: str = "answer") -> Tensor: ...


def require(policy: Any, capability: type, why: str) -> None:
    """Raise a TypeError naming the capability ``why`` needs when ``policy`` lacks it."""
    if not isinstance(policy, capability):
        missing = [n for n in protocol_methods(capability) if n not in dir(policy)]
        raise TypeError(
            f"{why} needs a policy with the {capability.__name__} capability; "
            f"{type(policy).__name__} lacks {', '.join(missing)}"
        )


def protocol_methods(capability: type) -> list[str]:
    """The methods and attributes a protocol class (and the protocols it extends) declares."""
    names: set[str] = set()
    for base in capability.__mro__:
        if base is Protocol or base is object or not getattr(base, "_is_protocol", False):
            continue
        names |= {n for n, v in vars(base).items() if callable(v) and not n.startswith("_")}
        names |= set(vars(base).get("__annotations__", {}))
    return sorted(names)


def seeded_generator(seed: int, device: torch.device | str = "cpu") -> torch.Generator:
    g = torch.Generator(device=device)
    g.manual_seed(int(seed) & 0x7FFF_FFFF_FFFF_FFFF)
    return g


def prompt_seed(base_seed: int, *keys: Any) -> int:
    """A stable 63-bit seed from a base seed and keys (epoch, record index, ...)."""
    h = hashlib.blake2b(repr((int(base_seed), *keys)).encode(), digest_size=8).digest()
    return int.from_bytes(h, "little") & 0x7FFF_FFFF_FFFF_FFFF
