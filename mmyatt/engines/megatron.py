"""``train.backend: megatron``: megatron-core ``GPTModel`` training for text LLMs.

The policy's Hugging Face model keeps generating (or vLLM does); training runs on a
megatron-core ``GPTModel`` built from the same Qwen2/Llama config, its weights
converted from the HF model (``megatron_convert``). After every optimizer step the
trained weights are converted back into the HF model before the next generation, so
samples always come from the weights being trained. Log-probs for the loss come from
the Megatron model with exactly the adapter's conventions (tempered, banned ids at the
lowest float, left padding masked).

Tensor parallelism: ``build_gpt(cfg, tp)`` splits attention heads, MLP columns and the
vocabulary over the tensor-parallel group (``initialize_model_parallel``), and logits
are gathered to the full vocabulary. Inside ``mmyatt train`` a controller is one
data-parallel rank; with ``train.tensor_parallel > 1`` it spans a tensor-parallel group
of processes (``megatron_group``: the group's first rank generates and broadcasts the
rollout, every rank runs the loss on its shard). ``megatron_pp`` runs pipeline
parallelism with megatron-core's schedules; with ``train.pipeline_parallel > 1`` a
pipeline group is one controller (``megatron_pp_train``).


The model and its CPU shims: ``megatron_model``; the policy over it: ``megatron_policy``.
"""

from __future__ import annotations

from contextlib import nullcontext

import torch
from torch import Tensor

from mmyatt.engines.megatron_group import clip_grad_norm_tp
from mmyatt.engines.megatron_model import (
    build_gpt,
    init_parallel,
    load_hf_weights,
    load_optimizer_state_hf,
    optimizer_state_hf,
)
from mmyatt.engines.megatron_policy import MegatronTextPolicy
from mmyatt.engines.megatron_pp import build_stage
from mmyatt.engines.megatron_pp_train import (
    PipelineTextPolicy,
    clip_grad_norm_pp,
    load_optimizer_state_pp,
    optimizer_state_pp,
)
from mmyatt.protocols import Policy
from mmyatt.rollout import Rollout


class MegatronEngine:
    """Controllers are data-parallel ranks, each with a Megatron model (split over its
    tensor-parallel group when ``train.tensor_parallel > 1``, see ``megatron_group``);
    gradients summed over controllers like the replica backend's. The policy it wraps
    becomes a ``MegatronTextPolicy`` (``PipelineTextPolicy`` over a pipeline), whose
    whole weights (``WholeWeights``) are what checkpoints and weight syncs read."""

    name = "megatron"
    lockstep = False

    def __init__(self, dist, *, tensor_parallel: int = 1, pipeline_parallel: int = 1):
        self.dist = dist
        self.tp, self.pp = int(tensor_parallel), int(pipeline_parallel)
        self.hf_cfg = None  # the HF config of the wrapped policy (names in optimizer state)
        self._model = None

    def wrap(self, policy: Policy) -> MegatronTextPolicy:
        init_parallel(self.tp, self.pp)
        hf = policy.module()
        self.hf_cfg = hf_cfg = hf.config
        dtype = next(hf.parameters()).dtype
        if self.pp > 1:  # one stage per process; the pipeline group is one controller
            model = build_stage(hf_cfg, self.tp, self.pp, dtype)
            self._model = model  # the gradient norm skips its tied-embedding copy
            out = PipelineTextPolicy(policy, model, hf_cfg)
            out.load_whole(hf.state_dict())
            hf.requires_grad_(False)
            return out
        model = build_gpt(hf_cfg, self.tp, dtype)
        load_hf_weights(model, hf.state_dict(), hf_cfg)
        hf.requires_grad_(False)  # the HF copy only generates
        return MegatronTextPolicy(policy, model, hf_cfg)

    def enable_reference(self, policy: Policy) -> None:
        policy.enable_reference()

    def reduce_and_clip(self, params, max_norm: float) -> Tensor:
        self.dist.sum_grads(params)  # over the data-parallel controllers
        if self.pp > 1:
            return clip_grad_norm_pp(self._model, params, max_norm)
        if self.tp == 1:
            return torch.nn.utils.clip_grad_norm_(params, max_norm)
        return clip_grad_norm_tp(params, max_norm)

    def rollout_weights(self, policy: Policy):
        return nullcontext()

    def keep_filler(self, rollout: Rollout) -> None:
        """Nothing to keep: a rank without samples runs no pass."""

    def model_state(self, policy: MegatronTextPolicy) -> dict:
        """HF-named weights (exact conversion): checkpoints read like any other run's."""
        return policy.whole_weights()

    def full_weights(self, policy: MegatronTextPolicy) -> dict:
        return policy.whole_weights()

    def load_model_state(self, policy: MegatronTextPolicy, state: dict) -> None:
        policy.load_whole(state)

    def optimizer_state(self, policy: Policy, optimizer) -> dict:
        if self.pp > 1:
            return optimizer_state_pp(policy.module(), optimizer, self.hf_cfg)
        if self.tp == 1:
            return optimizer.state_dict()
        return optimizer_state_hf(policy.module(), optimizer, self.hf_cfg)

    def load_optimizer_state(self, policy: Policy, optimizer, state: dict) -> None:
        if self.pp > 1:
            return load_optimizer_state_pp(policy.module(), optimizer, state, self.hf_cfg)
        if self.tp == 1:
            return optimizer.load_state_dict(state)
        load_optimizer_state_hf(policy.module(), optimizer, state, self.hf_cfg)

    def export(self, policy: MegatronTextPolicy, path: str) -> None:
        policy.sync_weights()
        if self.dist.is_main:
            policy.save(str(path))
