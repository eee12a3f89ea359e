"""The boundaries of the engine, written down: what it calls on a policy, a reward, a
training engine and a placement, owned by the engine.

Adapters do single-device math: sample, score log-probs, expose the module to
optimise, save in Hugging Face layout. They never see optimizers, process groups or
config objects; builders in the engine turn config into constructor arguments.

Every adapter implements :class:`Policy` in full. What only some adapters can do is a
capability of its own, a separate protocol the engine checks with :func:`capable` (an
``isinstance`` on the adapter under any engine wrapper, see :func:`adapter_of`):

* :class:`TokenPolicy`: tokens: the tokenizer, pad/EOS ids, banned ids, prompt encoding
  and tempering (text and VLM adapters; a vLLM rollout engine samples with them);
* :class:`MediaPrompts`: prompts that hold images or video, and their vision features
  (VLM adapters);
* :class:`ReferenceKL`: a frozen reference and its log-probs (the k1/k2/k3 KL penalty);
* :class:`ClosedFormKL`: the KL of Gaussian transitions from their means (flow models);
* :class:`EMA`: an exponential moving average of the trained weights (flow models);
* :class:`LatentOutputs`: outputs left as latents for rewards that read them (flow models);
* :class:`FlowVelocity`: the velocity field and the noise draw DiffusionNFT trains on;
* :class:`SupervisedPolicy`: a supervised loss for ``mmyatt sft``;
* :class:`RolloutStats`: per-step metrics of a rollout engine (vLLM rollouts);
* :class:`DecoderFlops`: the decoder whose model FLOPs are counted (text and VLM
  adapters; the step's ``perf/*`` metrics);
* :class:`WholeWeights`: whole, Hugging Face-named weights of a policy whose module is
  split (a Megatron model);
* :class:`PolicyWrapper`: an engine's policy over an adapter (``inner``).

The engine side: :class:`Reward` (rules, judges and mixtures alike), :class:`Engine`
(who trains: replica, FSDP2, Megatron-core) with :class:`LockstepEngine` for engines
whose every pass is a collective, and :class:`Placement` (who holds which devices
when, called with plain data: ``produce(groups, sampling, timer) -> Rollout``).

Left out on purpose: no base classes (adapters implement these structurally), and no
defaults: a member some implementation lacks is a capability, never a ``hasattr``.
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
class TokenPolicy(Protocol):
    """Tokens (text and VLM adapters): what a rollout engine other than the adapter's own
    sampler (vLLM) needs to sample exactly as the adapter does, and streaming."""

    tokenizer: Any  # a Hugging Face tokenizer
    pad_id: int  # fills prompts on the left and actions after EOS
    eos_ids: set[int]  # sampling stops at any of these
    banned_tokens: Tensor  # (K,) ids never sampled (pad, vision placeholders, unused rows)
    max_prompt_tokens: int  # P: prompts are left-padded to this width
    # "samples_generated" / "tokens_generated" (and the adapter's own counters), summed by
    # whoever samples for the adapter
    stats: dict[str, int]
    # True: generate calls ``Sampling.on_finished`` as samples finish (partial streams them)
    streams_finished: bool

    def encode_prompts(self, records: list[dict]) -> list[list[int]]:
        """Each record's prompt token ids, at most ``max_prompt_tokens`` long."""
        ...

    def tempered(self, logits: Tensor, temperature: float) -> Tensor:
        """``logits`` as sampling sees them: divided by ``temperature``, banned ids -inf."""
        ...


@runtime_checkable
class MediaPrompts(Protocol):
    """A policy whose prompts hold images or video (the VLMs): the placeholder tokens
    its prompts expand (a vLLM rollout engine sends such prompts as multimodal inputs),
    how a record becomes ids and pixels, and the vision features of a rollout."""

    image_token_id: int
    video_token_id: int

    def prepare(self, record: dict, index: int, *, limit: bool = True) -> dict:
        """``{"ids": prompt ids with the placeholders expanded, "media": per-sample pixel
        tensors}`` of one record (``index``: its place in the call, for messages)."""
        ...

    def messages(self, record: dict, source: str) -> tuple[list[dict], list, list]:
        """(chat messages, images, (frames, fps) videos) of a record, in placeholder order."""
        ...

    def encode_media(self, rollout: Rollout) -> Rollout:
        """``rollout`` with its pixels replaced by the frozen vision tower's output (what
        ``placement.balance`` moves between controllers: tokens, never media)."""
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
class FlowVelocity(Protocol):
    """The velocity field of a flow policy, as DiffusionNFT trains it (on its own
    forward-process samples, not on the rollout's transitions)."""

    transformer: nn.Module  # the velocity model that ``module()`` trains
    shared_group_noise: bool  # True: a group's samples start from one initial noise
    device: torch.device
    sample_shape: tuple[int, ...]  # one sample's latent: (C, H, W) or (C, F, H, W)

    def velocity(
        self, model: nn.Module, x: Tensor, t: Tensor, cond: Tensor, pooled: Tensor
    ) -> Tensor:
        """``model``'s velocity at latents ``x`` (N, ...) and times ``t`` (N,), with CFG as
        sampling applies it (the condition rows of ``generate``'s context)."""
        ...

    def reference_velocity(self, x: Tensor, t: Tensor, cond: Tensor, pooled: Tensor) -> Tensor:
        """The KL reference's velocity (``enable_reference`` first), no grad."""
        ...


@runtime_checkable
class SupervisedPolicy(Protocol):
    """A supervised loss on manifest records (``mmyatt sft``)."""

    def sft_loss(self, records: list[dict], target_key: str = "answer") -> Tensor: ...


@runtime_checkable
class RolloutStats(Protocol):
    """Extra per-step metrics of the rollout engine (vLLM rollouts: TIS, weight sync)."""

    # the engine's last timings by metric name (rollout/weight_sync_s, rollout/wake_s, ...)
    timings: dict[str, float]

    def rollout_stats(self, rollout: Rollout) -> dict[str, float]: ...


@runtime_checkable
class DecoderFlops(Protocol):
    """A causal decoder whose model FLOPs per token are counted (``mmyatt/step/flops.py``):
    the step's ``perf/*`` metrics (``mmyatt.step.perf``)."""

    def flops_modules(self) -> tuple[nn.Module, nn.Module]:
        """(the causal LM with its output head, the part of it each token goes through):
        the whole model for text, a VLM's language model without its vision tower."""
        ...


@runtime_checkable
class FixedShapeDecode(Protocol):
    """An adapter whose own decode loop can step at one fixed shape over a key/value
    cache kept between rollouts, compiled or not (``rollout.hf_static_cache``,
    ``rollout.compile_decode``; models/fast_decode.py)."""

    def set_decode(self, static_cache: bool, compile_step: bool = False) -> None: ...


@runtime_checkable
class WholeWeights(Protocol):
    """A policy whose trained module is split or converted (a Megatron model over a
    tensor- or pipeline-parallel group): its weights whole and Hugging Face-named."""

    def whole_weights(self) -> dict[str, Tensor]:
        """The whole model's HF-named weights, on every rank (a collective)."""
        ...

    def load_whole(self, state: dict[str, Tensor]) -> None: ...

    def sync_weights(self) -> None:
        """Trained weights -> the model that generates and exports, when they changed."""
        ...


@runtime_checkable
class LoRAOptions(Protocol):
    """A policy that may train through a LoRA adapter (``model.lora.rank > 0``)."""

    lora: dict | None  # the adapter's options; None: no adapter, full fine-tuning


@runtime_checkable
class LoRAPolicy(LoRAOptions, Protocol):
    """A LoRA policy whose rollout engine holds the base model and receives the adapter
    alone (text and VLM through vLLM's LoRA support)."""

    def adapter_weights(self) -> tuple[dict[str, Tensor], dict]:
        """The adapter as peft writes it: its tensors (copies) and adapter_config.json."""
        ...

    def base_model_weights(self) -> dict[str, Tensor]:
        """The base model's weights under their own names, the adapter left out."""
        ...


@runtime_checkable
class PolicyWrapper(Protocol):
    """An engine's policy over another policy (a sharding engine's, a vLLM rollout
    engine's): capabilities are the adapter's, found under ``inner``."""

    @property
    def inner(self) -> Any: ...


@runtime_checkable
class Reward(Protocol):
    """A reward source: rules, a judge, or a weighted mixture of them, all alike.

    Called with a rollout's ``outputs``, ``records`` and ``prompt_ids`` (samples of one
    group are contiguous); returns the (N,) combined reward and one (N,) tensor per
    named part."""

    # the keys of the parts dict every call returns (a controller with nothing to score
    # still reports them, so all ranks sum the same metrics)
    names: list[str]
    reads_latents: bool  # True: reads latents, not decoded outputs (the rollout skips decode)
    compares_groups: bool  # True: a sample's reward depends on its group's other samples
    last_verdicts: list[dict]  # (N,) per sample of the last call: {judge term: verdict}

    def __call__(
        self, outputs: list[Any], records: list[dict], prompt_ids: list[str] | None = None
    ) -> tuple[Tensor, dict[str, Tensor]]: ...


@runtime_checkable
class Engine(Protocol):
    """Who trains (replica, FSDP2, Megatron-core): the controller's calls, no branch on
    the backend. States are whole (unsharded) for the run checkpoint."""

    name: str
    lockstep: bool  # every forward/backward is a collective (see LockstepEngine)

    def wrap(self, policy: Policy) -> Policy:
        """Shard / convert the policy's module; the policy the controller uses from then on."""
        ...

    def enable_reference(self, policy: Policy) -> None: ...

    def reduce_and_clip(self, params: list[nn.Parameter], max_norm: float) -> Tensor:
        """Make gradients global (summed over controllers), clip their global norm to
        ``max_norm``; returns that norm."""
        ...

    def rollout_weights(self, policy: Policy) -> AbstractContextManager:
        """A context in which the policy may run any number of forwards on this rank alone."""
        ...

    def keep_filler(self, rollout: Rollout) -> None:
        """Remember two of this rank's samples for the zero-weight passes of a rank that
        has none (a no-op where passes are not collectives)."""
        ...

    def model_state(self, policy: Policy) -> dict: ...

    def full_weights(self, policy: Policy) -> dict[str, Tensor]:
        """Whole HF-named weights on every rank (for a rollout engine's weight sync)."""
        ...

    def load_model_state(self, policy: Policy, state: dict) -> None: ...

    def optimizer_state(self, policy: Policy, optimizer: torch.optim.Optimizer) -> dict: ...

    def load_optimizer_state(
        self, policy: Policy, optimizer: torch.optim.Optimizer, state: dict
    ) -> None: ...

    def export(self, policy: Policy, path: str) -> None:
        """Hugging Face layout, written by rank 0 (all ranks call)."""
        ...


@runtime_checkable
class LockstepEngine(Engine, Protocol):
    """An engine whose forwards and backwards are collectives (FSDP2): a rank without
    samples runs the same passes on the kept filler, with weight 0."""

    def zero_weight_loss(self, policy: Policy) -> Tensor:
        """A loss of exactly 0 whose backward runs every collective a real one does."""
        ...

    def idle_rollout(self, policy: Policy) -> Rollout:
        """The filler with zero advantages and rewards (for a loss that reads them)."""
        ...


@runtime_checkable
class Placement(Protocol):
    """Which devices each phase holds and how generation and scoring overlap (shared,
    colocate, partial, or auto's choice per step): a strategy the controller calls with
    plain data. It never receives the controller. Trainer weights reach the rollout side
    inside generation (a vLLM engine syncs before it samples), not through placement."""

    def produce(self, groups: int, sampling: Sampling, timer: Any) -> Rollout:
        """``groups`` prompt groups of this rank's next records, G samples each, generated
        and scored in the mode in force: a rollout with its rewards. ``timer`` (a
        ``PhaseTimer``) times the phases."""
        ...

    def end_step(self) -> dict[str, float]:
        """The step's placement metrics; resets them."""
        ...

    def state_dict(self) -> dict:
        """What resumes exactly: carried prompts, auto's measurements."""
        ...

    def load_state_dict(self, state: dict) -> None: ...


def adapter_of(policy: Any) -> Any:
    """The adapter under any engine wrappers (:class:`PolicyWrapper`)."""
    while isinstance(policy, PolicyWrapper):
        policy = policy.inner
    return policy


def capable(policy: Any, capability: type) -> bool:
    """Whether the adapter under ``policy``'s engine wrappers has ``capability``."""
    return isinstance(adapter_of(policy), capability)


def require(policy: Any, capability: type, why: str) -> None:
    """Raise a TypeError naming the capability ``why`` needs when the adapter under
    ``policy`` lacks it."""
    adapter = adapter_of(policy)
    if not isinstance(adapter, capability):
        missing = [n for n in protocol_methods(capability) if n not in dir(adapter)]
        raise TypeError(
            f"{why} needs a policy with the {capability.__name__} capability; "
            f"{type(adapter).__name__} lacks {', '.join(missing)}"
        )


def protocol_methods(capability: type) -> list[str]:
    """The methods and attributes a protocol class (and the protocols it extends) declares."""
    names: set[str] = set()
    for base in capability.__mro__:
        if base is Protocol or base is object or not getattr(base, "_is_protocol", False):
            continue
        names |= {
            n
            for n, v in vars(base).items()
            if (callable(v) or isinstance(v, property)) and not n.startswith("_")
        }
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
