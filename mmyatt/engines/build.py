"""The engines of a run from its config: the training engine, the policy the controller
uses (sharded / converted, generating through vLLM or the adapter), and the views a
model-parallel group of processes needs to act as one controller.

These builders read the run config; the engines they build take plain arguments.
"""

from __future__ import annotations

from mmyatt.engines import megatron_group
from mmyatt.engines.fsdp2 import FSDP2Engine
from mmyatt.engines.install import require
from mmyatt.engines.megatron import MegatronEngine
from mmyatt.engines.replica import ReplicaEngine
from mmyatt.engines.vllm_rollout import VLLMRolloutPolicy
from mmyatt.protocols import Engine, FixedShapeDecode, Policy, Reward
from mmyatt.protocols import require as require_capability


def controller_dist(cfg, dist):
    """The controller's ``Dist``: ``dist``, or with ``train.backend=megatron`` and
    ``train.tensor_parallel > 1`` a data-parallel view in which a tensor-parallel group
    of processes is one controller (``megatron_group.GroupDist``)."""
    t = cfg.train
    if t.backend != "megatron" or t.tensor_parallel * t.pipeline_parallel == 1:
        return dist
    return megatron_group.controller_dist(dist, t.tensor_parallel, t.pipeline_parallel)


def group_reward(reward: Reward, dist) -> Reward:
    """The controller's reward: ``reward``, or where a model-parallel group of processes
    is one controller, the group's first rank scores and broadcasts
    (``megatron_group.GroupReward``)."""
    if not dist.model_parallel:
        return reward
    return megatron_group.group_reward(reward, dist)


def build_engines(cfg, dist, policy: Policy) -> tuple[Engine, Policy]:
    """``(engine, policy)``: the training engine for ``cfg.train.backend`` and the policy
    the controller uses (sharded / converted, generating through ``cfg.rollout.backend``).
    A frozen reference snapshot is taken here, before any sharding."""
    engine = build_train_engine(cfg, dist)
    if cfg.rollout.hf_static_cache:  # the adapter's fixed-shape decode (models/fast_decode.py)
        require_capability(policy, FixedShapeDecode, "rollout.hf_static_cache")
        policy.set_decode(True, cfg.rollout.compile_decode)
    if cfg.algorithm.kl_coef > 0 and engine.lockstep:
        engine.enable_reference(policy)
    wrapped = engine.wrap(policy)
    if cfg.rollout.backend == "vllm":
        r = cfg.rollout
        wrapped = VLLMRolloutPolicy(
            wrapped,
            engine,
            dist,
            model_path=cfg.model.path,
            sleep_level=r.sleep_level,
            gpu_memory_utilization=r.gpu_memory_utilization,
            is_cap=r.is_cap,
        )
    return engine, wrapped


def build_train_engine(cfg, dist) -> Engine:
    """The training engine ``cfg.train.backend`` names, for this controller."""
    t = cfg.train
    if t.backend == "replica":
        return ReplicaEngine(dist)
    if t.backend == "fsdp2":
        return FSDP2Engine(
            dist,
            mixed_precision=t.mixed_precision,
            cpu_offload=t.cpu_offload,
            activation_checkpointing=t.activation_checkpointing,
            reshard_after_forward=t.reshard_after_forward,
        )
    if t.backend == "megatron":
        require("megatron", "train.backend=megatron")
        return MegatronEngine(
            dist, tensor_parallel=t.tensor_parallel, pipeline_parallel=t.pipeline_parallel
        )
    raise ValueError(f"train.backend={t.backend!r}: expected replica, fsdp2 or megatron")
