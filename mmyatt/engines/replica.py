"""``train.backend: replica``: a full copy of the policy on every controller.

The default, and the reference the other engines match: gradients summed in one flat
all-reduce (``Dist.sum_grads``), states as the module and optimizer hold them. Passes
are not collectives, so there is nothing to keep for an idle rank.
"""

from __future__ import annotations

from contextlib import nullcontext

import torch

from mmyatt.checkpoint.checkpointer import load_optimizer_state, optimizer_state
from mmyatt.protocols import Policy
from mmyatt.rollout import Rollout


class ReplicaEngine:
    name = "replica"
    lockstep = False

    def __init__(self, dist):
        self.dist = dist

    def wrap(self, policy: Policy) -> Policy:
        return policy

    def enable_reference(self, policy: Policy) -> None:
        policy.enable_reference()

    def reduce_and_clip(self, params, max_norm: float) -> torch.Tensor:
        self.dist.sum_grads(params)
        return torch.nn.utils.clip_grad_norm_(params, max_norm)

    def rollout_weights(self, policy: Policy):
        return nullcontext()

    def keep_filler(self, rollout: Rollout) -> None:
        """Nothing to keep: a rank without samples runs no pass."""

    def model_state(self, policy: Policy) -> dict:
        return policy.module().state_dict()

    def full_weights(self, policy: Policy) -> dict:
        """Whole HF-named weights on every rank (for a rollout engine's weight sync)."""
        return policy.module().state_dict()

    def load_model_state(self, policy: Policy, state: dict) -> None:
        policy.module().load_state_dict(state)

    def optimizer_state(self, policy: Policy, optimizer) -> dict:
        return optimizer_state(optimizer)

    def load_optimizer_state(self, policy: Policy, optimizer, state: dict) -> None:
        load_optimizer_state(optimizer, state)

    def export(self, policy: Policy, path: str) -> None:
        if self.dist.is_main:
            policy.save(str(path))
