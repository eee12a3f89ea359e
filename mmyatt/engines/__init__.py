"""Engines behind the adapters: who trains (replica, FSDP2, Megatron-core) and who
generates (the adapter itself, or vLLM).

The controller talks to a training engine through the ``Engine`` protocol of
:mod:`mmyatt.protocols` (``LockstepEngine`` where every pass is a collective) and never
branches on the backend. One file a concept: ``replica``, ``fsdp2``, ``megatron*``
(training), ``vllm_rollout`` / ``vllm_vlm`` / ``vllm_steps`` (generation), ``wrapper``
(the policy an engine puts over the adapter), ``build`` (engines from the run config),
``install`` (optional packages). This module holds the engine settings' config checks.

Optional backends (megatron-core, vllm) are imported only when a config asks for them;
``check_engines`` runs inside config validation, so a run that asks for a missing one
stops before anything starts and says what to install.
"""

from __future__ import annotations

import shutil

from mmyatt.config.checks import register_check
from mmyatt.config.errors import ConfigError
from mmyatt.engines.build import build_engines, build_train_engine, controller_dist, group_reward
from mmyatt.engines.fsdp2 import EnginePolicy, FSDP2Engine
from mmyatt.engines.install import (
    INSTALL,
    OPEN,
    MissingEngineError,
    available,
    close_engines,
    require,
)
from mmyatt.engines.replica import ReplicaEngine
from mmyatt.protocols import adapter_of

__all__ = [
    "INSTALL",
    "OPEN",
    "EnginePolicy",
    "FSDP2Engine",
    "MissingEngineError",
    "ReplicaEngine",
    "adapter_of",
    "available",
    "build_engines",
    "build_train_engine",
    "check_engines",
    "close_engines",
    "controller_dist",
    "group_reward",
    "require",
]


@register_check
def check_engines(cfg) -> None:
    """Config checks for the engine settings (run by ``load_config``)."""
    t, r, j = cfg.train, cfg.rollout, cfg.reward.judge
    micro = cfg.algorithm.micro_batch_tokens
    if micro and (t.backend == "megatron" or cfg.algorithm.name == "diffusion_nft"):
        raise ConfigError(  # megatron: not built for its model-parallel groups
            f"algorithm.micro_batch_tokens={micro} needs train.backend=replica or fsdp2 (got "
            f"{t.backend}) and a policy-gradient loss (got algorithm.name="
            f"{cfg.algorithm.name}); set it to 0"
        )
    if t.backend == "megatron":
        if cfg.model.kind != "text":
            raise ConfigError(
                f"train.backend=megatron trains text LLMs (megatron-core GPTModel), not "
                f"model.kind={cfg.model.kind}; use train.backend=fsdp2"
            )
        if t.tensor_parallel < 1 or t.pipeline_parallel < 1:
            raise ConfigError(
                f"train.tensor_parallel and train.pipeline_parallel must be >= 1, got "
                f"{t.tensor_parallel} and {t.pipeline_parallel}"
            )
        if t.tensor_parallel * t.pipeline_parallel > 1:
            _check_tensor_parallel(cfg)
        _require(cfg, "megatron", "train.backend=megatron")
    if t.backend == "fsdp2" and cfg.sampling.group_size < 2:
        raise ConfigError(
            "train.backend=fsdp2 needs sampling.group_size >= 2 (a one-row "
            "sharded forward on one rank against more rows on another hangs FSDP2's "
            "backward here; minibatches hold whole groups)"
        )
    if t.backend == "fsdp2" and cfg.algorithm.name == "diffusion_nft" and t.cpu_offload:
        raise ConfigError(
            "train.cpu_offload with algorithm.name=diffusion_nft is not implemented ("
            "the sampling policy's EMA gathers each offloaded shard, untested on a GPU); "
            "drop train.cpu_offload"
        )
    if t.backend != "fsdp2" and (
        t.mixed_precision != "none" or t.cpu_offload or t.activation_checkpointing
    ):
        raise ConfigError(
            "train.mixed_precision / cpu_offload / activation_checkpointing are FSDP2 options; "
            f"set train.backend=fsdp2 (got {t.backend})"
        )
    if r.backend == "vllm":
        if cfg.model.kind not in ("text", "vlm"):
            raise ConfigError(
                f"rollout.backend=vllm generates text (text and VLM policies), not "
                f"model.kind={cfg.model.kind}; use rollout.backend=hf"
            )
        if r.is_cap < 0 or not 0 < r.gpu_memory_utilization <= 1:
            raise ConfigError("rollout.is_cap must be >= 0, gpu_memory_utilization in (0, 1]")
        _require(cfg, "vllm", "rollout.backend=vllm")
    if j.backend == "vllm" and j.model is not None:
        if shutil.which("vllm") is None and not available("vllm"):
            raise ConfigError(
                "reward.judge.backend=vllm starts `vllm serve`, which is not installed; "
                f"install it with: {INSTALL['vllm'][1]}"
            )


def _check_tensor_parallel(cfg) -> None:
    """train.tensor_parallel > 1: a tensor-parallel group of processes is one controller
    (mmyatt/engines/megatron_group.py); what that does not cover is refused here."""
    t, n = cfg.train, cfg.distributed.nproc
    # a pipeline group, or a TP x PP model-parallel group, is one controller the same way
    tp = t.tensor_parallel * t.pipeline_parallel
    key = " x ".join(
        f"train.{k}={v}"
        for k, v in (
            ("tensor_parallel", t.tensor_parallel),
            ("pipeline_parallel", t.pipeline_parallel),
        )
        if v > 1
    )
    if n % tp:
        raise ConfigError(
            f"{key} needs distributed.nproc to be a multiple of it (got {n}): each group of "
            f"{tp} processes is one controller"
        )
    if cfg.data.prompts_per_step % (n // tp):
        raise ConfigError(
            f"{key}: data.prompts_per_step ({cfg.data.prompts_per_step}) must divide over the "
            f"{n // tp} controller(s) (distributed.nproc / the group's processes)"
        )
    if cfg.rollout.backend != "hf":
        raise ConfigError(
            f"{key} with rollout.backend={cfg.rollout.backend} is not implemented "
            "(the vLLM engine's weight sync is not fed from a Megatron model split "
            "over a group of processes); use rollout.backend=hf"
        )
    if cfg.placement.balance:
        raise ConfigError(
            f"{key} with placement.balance=true is not implemented (the exchange "
            "moves samples between processes of the whole process group, not between the "
            "data-parallel controllers that model-parallel groups form); set "
            "placement.balance=false"
        )


def _require(cfg, name: str, key: str) -> None:
    try:
        require(name, key)
    except MissingEngineError as e:
        raise ConfigError(str(e)) from None
