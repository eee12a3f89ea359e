"""The policy an engine hands the controller in place of the adapter.

A sharding engine (FSDP2), a converting one (Megatron) and a vLLM rollout engine each
put a policy of their own over the adapter: it changes what it must (where generation
runs, whose weights score, how EMA state is laid out) and passes the rest to
``inner``. What it passes is listed below, member by member, so the boundary is the
protocols' and nothing else: no attribute lookup falls through to the adapter.

Capabilities are the adapter's: a wrapper forwards every capability member, so ask
``capable(policy, EMA)`` (:func:`mmyatt.protocols.capable`, which looks under the
wrappers), not ``isinstance(policy, EMA)``. A wrapper's own extras (a vLLM engine's
``RolloutStats``) are checked on the wrapper itself.
"""

from __future__ import annotations

from contextlib import AbstractContextManager

from torch import Tensor, nn

from mmyatt.protocols import Policy, Sampling
from mmyatt.rollout import Rollout


class WrappedPolicy:
    """Every member of the Policy protocol and of its capabilities, passed to ``inner``;
    an engine's policy overrides the ones it changes. (Adapter attributes that only an
    engine reads, such as the tokenizer, are read from ``adapter_of(policy)``.)"""

    def __init__(self, inner: Policy):
        self._inner = inner

    @property
    def inner(self) -> Policy:
        return self._inner

    # Policy
    def generate(
        self, prompts: list[dict], group_size: int, sampling: Sampling, seeds: list[int]
    ) -> Rollout:
        return self._inner.generate(prompts, group_size, sampling, seeds)

    def logprobs(self, rollout: Rollout, with_entropy: bool = False):
        return self._inner.logprobs(rollout, with_entropy=with_entropy)

    def module(self) -> nn.Module:
        return self._inner.module()

    def save(self, path: str) -> None:
        self._inner.save(path)

    # ReferenceKL, ClosedFormKL
    def enable_reference(self) -> None:
        self._inner.enable_reference()

    def reference_logprobs(self, rollout: Rollout) -> Tensor:
        return self._inner.reference_logprobs(rollout)

    def attach_reference_means(self, rollout: Rollout) -> Rollout:
        return self._inner.attach_reference_means(rollout)

    def logprobs_with_kl(self, rollout: Rollout, estimator: str = "closed_form", block: int = 0):
        return self._inner.logprobs_with_kl(rollout, estimator, block)

    # EMA
    def ema_update(self, decay: float = 0.9) -> None:
        self._inner.ema_update(decay)

    def ema_state(self) -> dict[str, Tensor] | None:
        return self._inner.ema_state()

    def load_ema_state(self, state: dict[str, Tensor] | None) -> None:
        self._inner.load_ema_state(state)

    def ema_weights(self) -> AbstractContextManager:
        return self._inner.ema_weights()

    # LatentOutputs
    @property
    def decode_outputs(self) -> bool:
        return self._inner.decode_outputs

    @decode_outputs.setter
    def decode_outputs(self, value: bool) -> None:
        self._inner.decode_outputs = value

    # MediaPrompts (the engine-side member: vision features of a rollout)
    def encode_media(self, rollout: Rollout) -> Rollout:
        return self._inner.encode_media(rollout)

    # SupervisedPolicy
    def sft_loss(self, records: list[dict], target_key: str = "answer") -> Tensor:
        return self._inner.sft_loss(records, target_key)
