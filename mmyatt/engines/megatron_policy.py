"""The policy over a Megatron model (``train.backend: megatron``): the text adapter keeps
generating with its Hugging Face model (or vLLM does), the Megatron model trains and
scores. After every optimizer step the trained weights are converted back into the HF
model before the next generation (``sync_weights``), so samples always come from the
weights being trained. With ``train.tensor_parallel > 1`` the group's first rank
generates and broadcasts (``megatron_group.broadcast_rollout``).
"""

from __future__ import annotations

import torch
import torch.distributed as tdist
import torch.nn.functional as F
from torch import Tensor, nn

from mmyatt.engines.megatron_group import broadcast_rollout
from mmyatt.engines.megatron_model import (
    forward_logits,
    gather_hf_weights,
    load_hf_weights,
    token_logprobs,
    trimmed_inputs,
)
from mmyatt.engines.wrapper import WrappedPolicy
from mmyatt.protocols import TokenPolicy


class MegatronTextPolicy(WrappedPolicy):
    """A TextPolicy whose trained weights live in a Megatron GPTModel (see the module
    docstring); generation and export go through the HF model after a weight sync. The
    ``WholeWeights`` capability."""

    def __init__(self, inner: TokenPolicy, model: nn.Module, hf_cfg):
        super().__init__(inner)
        self.model, self.hf_cfg = model, hf_cfg
        self._synced: tuple | None = self._version()

    def module(self) -> nn.Module:
        return self.model

    def _version(self) -> tuple:
        return tuple(p._version for p in self.model.parameters())

    def whole_weights(self) -> dict[str, Tensor]:
        """The whole model's HF-named weights, on every rank (a collective)."""
        return gather_hf_weights(self.model, self.hf_cfg)

    def load_whole(self, state: dict[str, Tensor]) -> None:
        load_hf_weights(self.model, state, self.hf_cfg)

    def sync_weights(self) -> None:
        """Trained Megatron weights -> the HF model (only when they changed)."""
        if self._synced == self._version():
            return
        sd = self.whole_weights()
        hf = self._inner.module()
        with torch.no_grad():
            missing, unexpected = hf.load_state_dict(sd, strict=False)
        if unexpected or [k for k in missing if k != "lm_head.weight"]:
            raise ValueError(f"HF weight sync: missing {missing}, unexpected {unexpected}")
        self._synced = self._version()

    def generate(self, prompts, group_size, sampling, seeds):
        from megatron.core import parallel_state as ps

        self.sync_weights()
        if ps.get_tensor_model_parallel_world_size() == 1:
            return self._inner.generate(prompts, group_size, sampling, seeds)
        # a tensor-parallel group is one controller: its first rank generates
        first = ps.get_tensor_model_parallel_src_rank()
        out = None
        if tdist.get_rank() == first:
            out = self._inner.generate(prompts, group_size, sampling, seeds)
        return broadcast_rollout(out, first, ps.get_tensor_model_parallel_group())

    def save(self, path: str) -> None:
        self.sync_weights()
        self._inner.save(path)

    def logprobs(self, rollout, with_entropy: bool = False):
        """TextPolicy.logprobs computed by the Megatron model."""
        ids, attn, actions, kept, temperature, last = trimmed_inputs(rollout)
        logits = forward_logits(self.model, ids, attn)
        lp, entropy = token_logprobs(
            self._inner, logits, actions, kept, temperature, last, with_entropy
        )
        A = rollout.actions.shape[1]
        lp = F.pad(lp, (0, A - last))
        if not with_entropy:
            return lp
        return lp, F.pad(entropy, (0, A - last))
