"""Who runs the step: the controllers, the training engine and the rollout engine."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from mmyatt.config.section import Bool, Float, Int, Section


class DistributedConfig(Section):
    nproc: Int = Field(1, ge=1)
    """controllers started by `mmyatt train` (ignored under an external torchrun)"""
    max_restarts: Int = Field(0, ge=0)
    """torchrun elastic restarts: a controller that dies restarts the group, which resumes
    from the last checkpoint (`mmyatt bench faults`, controller_dies)"""
    backend: Literal["auto", "gloo", "nccl"] = "auto"
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """where each controller's policy lives: auto = cuda:<local rank> when CUDA is
    available (one controller included), else cpu; cpu forces the CPU on a GPU machine"""


class TrainConfig(Section):
    """The training engine behind the update (mmyatt/engines). replica: a full copy per
    controller, gradients summed in one flat all-reduce; fsdp2: torch ``fully_shard``
    (parameters, gradients and optimizer state sharded over the controllers); megatron:
    megatron-core GPTModel for text LLMs (pip install 'mmyatt[megatron]')."""

    backend: Literal["replica", "fsdp2", "megatron"] = "replica"
    """docs/engines.md"""
    mixed_precision: Literal["none", "bfloat16", "float16"] = "none"
    """fsdp2: compute dtype of the sharded module (gradients are reduced in float32)"""
    cpu_offload: Bool = False
    """fsdp2: sharded parameters and optimizer state in host memory (CUDA)"""
    activation_checkpointing: Bool = False
    """fsdp2: recompute block activations in backward"""
    reshard_after_forward: Bool = True
    """fsdp2: free gathered weights after each block forward"""
    tensor_parallel: Int = Field(1, ge=1)
    """megatron: tensor-parallel size (a group of processes = a controller)"""
    pipeline_parallel: Int = Field(1, ge=1)
    """megatron: pipeline stages (a group of processes = a controller)"""


class RolloutConfig(Section):
    """Who generates the rollouts: the policy adapter (hf) or an in-process vLLM engine
    (pip install 'mmyatt[vllm]'; text and VLM policies, images/video as multi_modal_data)."""

    backend: Literal["hf", "vllm"] = "hf"
    """docs/engines.md"""
    gpu_memory_utilization: Float = Field(0.4, gt=0, le=1)
    """vllm: share of the device its KV cache may take"""
    sleep_level: Literal[0, 1, 2] = 1
    """vllm: sleep during training (0: stay awake)"""
    is_cap: Float = Field(2.0, ge=0)
    """vllm: each token's loss times min(exp(trainer - engine logprob), cap)"""
    over_dispatch_ratio: Float = Field(1.0, ge=1)
    """long tail (docs/placement.md): dispatch ceil(r x prompts) prompts per generate call,
    stop decoding once the batch's groups are complete, keep the rest for the next step;
    1: every dispatched prompt is trained on (no carry)"""
    reuse_unused_prompts: Bool = True
    """carry cut-short prompts to the next step (else drop)"""
    max_carries: Int = Field(2, ge=0)
    """a prompt cut short this many times must finish next time (0: no cap)"""
    redraw_carried: Bool = False
    """a carried prompt gets a new seed (a length bias: see docs)"""
    hf_static_cache: Bool = False
    """hf, text and VLM policies: decode steps of one fixed shape over a key/value cache
    kept between rollouts (Llama-family decoders, Qwen2-VL / Qwen2.5-VL language models;
    train.backend=replica); same samples as the default steps (docs/engines.md, "Fast HF rollout")"""
    compile_decode: Bool = False
    """hf_static_cache: torch.compile the decode step (mode reduce-overhead on CUDA: one
    CUDA graph per step; the default compiler on the CPU, minutes to compile)"""
