"""Typed configuration: one frozen dataclass per component, one YAML per recipe.

``load_config(path, overrides)`` reads a recipe, applies dotted ``key=value``
overrides from the command line and builds the dataclasses. Unknown keys, wrong
types and values outside a ``Literal`` fail here, before any process starts, with
the dotted key and the valid choices in the message.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml


class ConfigError(ValueError):
    """A recipe or override that cannot be turned into a valid config."""


@dataclass(frozen=True)
class LoraConfig:
    rank: int = 0  # 0: full-weight training
    alpha: float = 16.0
    target_modules: tuple[str, ...] = ()  # empty: the adapter's default attention projections


@dataclass(frozen=True)
class ModelConfig:
    kind: Literal["text", "vlm", "flow"] = "text"
    path: str | None = None  # local HF / diffusers directory; None builds the tiny built-in
    tiny_size: str = "qwen2-1m"  # built-in size when path is None (text; vlm: small/...)
    vlm_arch: Literal["qwen2-vl", "qwen2.5-vl"] = "qwen2-vl"  # built-in VLM architecture
    video_fps: float = 2.0  # VLM: uniform frame sampling rate for videos
    video_max_frames: int = 8
    lora: LoraConfig = field(default_factory=LoraConfig)
    reference: Literal["lora_disabled", "frozen_copy"] = "lora_disabled"  # flow KL reference
    ema_decay: float | None = None  # flow: EMA of trained weights, used for eval when set
    # parameter-name prefixes of policy.module() kept frozen (e.g. the flow transformer's
    # output head [norm_out, proj_out], whose token-independent part tiles every patch)
    freeze: tuple[str, ...] = ()
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    max_prompt_tokens: int = 64
    prompt_overflow: Literal["reject", "truncate"] = "reject"
    use_chat_template: bool = False


@dataclass(frozen=True)
class DataConfig:
    train: str = "synthetic:arithmetic"  # JSONL path(s, comma separated) or synthetic:<task>
    eval: str = "synthetic:arithmetic"
    # JSONL for choices made during a run (the SFT stopping check), never the reported
    # eval; synthetic tasks write and fill it in
    val: str | None = None
    synthetic_train_size: int = 20000
    synthetic_eval_size: int = 500
    # keyword arguments of the synthetic task's writer (synthetic:describe:
    # extra_colours, the share of train and SFT records in colours outside the eval
    # palette; val_fold: 2 for the second validation fold; shape_first, the share of
    # reference answers that name the shape before the colour; extra_shapes, the share
    # of train and SFT images showing a shape outside the eval's three)
    synthetic_kwargs: dict[str, Any] = field(default_factory=dict)
    prompts_per_step: int = 16  # B, global over all controllers
    shuffle: bool = True
    bad_lines: Literal["fail", "skip"] = "fail"
    eval_prompts: int = 500  # global, split over controllers
    # which eval split a synthetic task reports: test (the reported figures) or val (the
    # split recipes and judges are chosen on; its own prompts, combinations and seeds)
    eval_split: Literal["test", "val"] = "test"


@dataclass(frozen=True)
class SamplingConfig:
    group_size: int = 8  # G
    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 8
    stop: tuple[str, ...] = ()
    # flow models (Flow-GRPO): see models/flow_sde.py
    denoise_steps: int = 10  # training rollouts
    eval_denoise_steps: int = 20  # eval (ODE); more steps than training = denoising reduction
    noise_level: float = 0.7
    sde_type: Literal["sde", "cps"] = "sde"
    guidance_scale: float = 1.0  # 1.0 = no CFG
    train_steps: Literal["all", "fraction", "window", "sliding"] = "all"
    train_fraction: float = 1.0
    window: int = 2
    window_start: int = 0
    slide_every: int = 1


@dataclass(frozen=True)
class NFTConfig:
    """DiffusionNFT knobs (``algorithm.name: diffusion_nft``; math in mmyatt/algorithms/nft.py)."""

    beta: float = 1.0  # implicit policies v+- = v_old +- beta (v_theta - v_old); loss / beta
    reward_norm: Literal["advantage", "raw"] = "advantage"  # r = A / (2 adv_clip) + 1/2, or
    # the reward clamped to [0, 1] (win rates, probabilities)
    adv_clip: float = 5.0  # advantages clipped to +-adv_clip before the map to [0, 1]
    weighting: Literal["adaptive_x0", "velocity"] = "adaptive_x0"  # NVlabs' x0-space error
    # over its mean |error|, or the plain velocity MSE
    loss_scale: float | None = None  # multiplies the loss; None: adv_clip (NVlabs)
    timesteps: Literal["sampler", "uniform", "logit_normal"] = "sampler"  # training t: the
    # rollout sampler's own sigmas (random, without replacement), U(0,1) or logit-normal
    timesteps_per_sample: int = 2  # forward-noised copies of each clean sample per step
    decay_rate: float = 0.001  # sampling ("old") policy: old <- d old + (1-d) theta after
    decay_max: float = 0.5  # every step, d = min(decay_rate * step, decay_max); 0, 0: on-policy


@dataclass(frozen=True)
class AlgorithmConfig:
    # grpo: the GRPO family (PPO-clip on log-prob ratios, advantages below); diffusion_nft:
    # flow models only, forward-process RL on clean samples from any sampler (ODE included)
    name: Literal["grpo", "diffusion_nft"] = "grpo"
    nft: NFTConfig = field(default_factory=NFTConfig)
    advantage: Literal["grpo", "drgrpo", "rloo", "reinforce_pp", "reinforce_pp_baseline"] = "grpo"
    advantage_std: Literal["group", "batch"] = "group"  # grpo only; batch = Flow-GRPO global std
    advantage_clip: float | None = None  # grpo only; Flow-GRPO clips to 5
    clip_low: float = 0.2
    clip_high: float = 0.28  # DAPO clip-higher; equal to clip_low for symmetric PPO
    dual_clip: float | None = None
    loss_agg: Literal[
        "token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"
    ] = "token-mean"
    kl_coef: float = 0.0  # 0 skips the reference entirely
    # k1/k2/k3: sample estimators on log-probs. Flow models only: closed_form (exact KL of
    # the Gaussian SDE/CPS steps from policy and reference means) or closed_form_flowgrpo
    # (the same divided by s^2 instead of s^2*|dt|, as flow_grpo's loss; its betas carry over)
    kl_estimator: Literal["k1", "k2", "k3", "closed_form", "closed_form_flowgrpo"] = "k3"
    # closed-form KL only: k > 0 penalises only the part of each step's mean that varies
    # within k x k pixel (latent) tiles, i.e. texture; 0 penalises the whole step
    kl_block: int = 0
    entropy_coef: float = 0.0
    ppo_epochs: int = 1
    minibatches: int = 1
    # > 0: micro-batches of at most this many padded tokens, as many on every rank (batches.py)
    micro_batch_tokens: int = 0
    dynamic_sampling: bool = False  # DAPO: drop zero-variance groups and refill
    max_refill_rounds: int = 3
    overlong: Literal["none", "filter", "penalty"] = "none"
    overlong_buffer: int = 4
    overlong_penalty: float = 1.0
    recompute_old_logprobs: bool = False  # use a fresh forward instead of sampling-time log-probs


@dataclass(frozen=True)
class OptimConfig:
    lr: float = 1e-4
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    grad_clip: float = 1.0
    warmup_steps: int = 0
    schedule: Literal["constant", "cosine"] = "constant"


@dataclass(frozen=True)
class RewardSpec:
    name: str  # a rule (rewards/rules.py, rewards/image.py), "module:function", or "genrm"
    weight: float = 1.0
    kwargs: dict[str, Any] = field(default_factory=dict)
    zscore: bool = False  # standardise this reward over the batch before weighting


@dataclass(frozen=True)
class JudgeConfig:
    """GenRM judges: started with the run (``model``) or already running (``urls``)."""

    model: str | None = None  # local judge directory, or builtin:<name>
    num_servers: int = 1
    urls: tuple[str, ...] = ()  # existing OpenAI-compatible servers (e.g. `vllm serve`)
    api_key_env: str | None = None  # name of the env var holding the key; keys never enter configs
    max_batch: int = 32
    threads: int = 1  # torch threads per judge server (CPU)
    devices: tuple[str, ...] = ()  # a GPU id per server, round robin ('0,1': 2 GPUs, one server)
    max_retries: int = 8  # per judge request; with the backoff (0.2 s doubling, at most 5 s
    # between tries) the run waits ~10-20 s for a lost judge before it saves and stops
    timeout_s: float = 30.0  # per attempt
    max_restarts: int = 3  # a judge server started with the run that dies is restarted
    # who serves `model`: our GenRM server, or `vllm serve` children (same pool, health
    # checks and restarts; pip install 'mmyatt[vllm]')
    backend: Literal["mmyatt", "vllm"] = "mmyatt"
    vllm_args: tuple[str, ...] = ()  # extra `vllm serve` arguments (backend vllm)


@dataclass(frozen=True)
class RewardConfig:
    functions: tuple[RewardSpec, ...] = (RewardSpec(name="numeric_match"),)
    nonfinite: Literal["skip_step", "fail"] = "skip_step"
    judge: JudgeConfig = field(default_factory=JudgeConfig)


@dataclass(frozen=True)
class SFTConfig:
    """Supervised warm start (``mmyatt sft`` and the optional ``sft`` phase of a recipe)."""

    enabled: bool = False
    max_steps: int = 3000
    batch_size: int = 64
    lr: float = 1e-3
    eval_every: int = 100
    stop_at_accuracy: float | None = None  # stop early once greedy held-out accuracy reaches it
    eval_prompts: int = 200
    target_key: str = "answer"
    # the reward function (a registry name, e.g. "describe_check") the stopping check
    # scores with; None: the run's reward (which cannot hold a judge: none runs yet)
    check: str | None = None
    # JSONL the warm start trains on; None: data.train (synthetic:describe fills in its
    # sft.jsonl, which, like the flow recipes' base models, sees every combination)
    data: str | None = None
    threads: int = 1  # SFT runs once, in the launching process, before controllers start
    # parameter-name prefixes frozen in SFT only; None: model.freeze (e.g. [] trains a VLM's
    # vision tower on the warm start's data while RL keeps model.freeze's [model.visual])
    freeze: tuple[str, ...] | None = None


@dataclass(frozen=True)
class TrainerConfig:
    steps: int = 100
    max_minutes: float | None = None  # stop training (then evaluate) after this wall time
    eval_every: int = 0  # 0: only at the start and the end
    log_every: int = 1
    seed: int = 0
    threads: int = 1  # torch threads per controller
    save_rollouts_every: int = 10  # steps between rollout logs (rollouts/rank<r>.jsonl); 0: none
    # at most this many samples per controller per logged step: whole prompt groups, in
    # the order drawn, until the next group would pass it (at least one group)
    rollouts_per_step: int = 64
    progress: bool = True
    eval_sampling: Literal["greedy", "sample"] = "greedy"  # sample: at the training temperature,
    # and greedy accuracy is logged as eval/greedy_accuracy too


@dataclass(frozen=True)
class CheckpointConfig:
    save_every: int = 0  # steps between run-state checkpoints; 0 = none (final export only)
    keep_last: int = 2
    keep_every: int = 0  # also keep every step divisible by this (0 = none)
    async_save: bool = True
    resume: str = "auto"  # auto | never | a checkpoint directory
    export_every: int = 0  # also write the policy in HF layout every N steps (0: only at the end)


@dataclass(frozen=True)
class DistributedConfig:
    nproc: int = 1  # controllers started by `mmyatt train` (ignored under an external torchrun)
    max_restarts: int = 0  # torchrun elastic restarts: a controller that dies restarts the
    # group, which resumes from the last checkpoint (`mmyatt bench faults`, controller_dies)
    backend: Literal["auto", "gloo", "nccl"] = "auto"
    # where each controller's policy lives: auto = cuda:<local rank> when CUDA is
    # available (one controller included), else cpu; cpu forces the CPU on a GPU machine
    device: Literal["auto", "cpu", "cuda"] = "auto"


@dataclass(frozen=True)
class PlacementConfig:
    """Who runs where at each phase of a step (mmyatt/placement, docs/placement.md): shared
    (nothing pinned), colocate (phases in series, each on every core, idle models
    released), partial (rollout beside the judge), auto (chosen from measured costs)."""

    mode: Literal["shared", "colocate", "partial", "auto"] = "shared"
    cores: tuple[int, ...] = ()  # CPU core ids the run may use; empty: every allowed core
    rollout_cores: int = 0  # partial: cores rollout holds while it generates (0: half)
    judge_cores: int = 0  # partial: cores the judge holds meanwhile (0: the rest)
    # partial: flow models, vLLM and over-dispatch generate chunks of this many groups and
    # send each to the judge when done (text and VLM stream each sample as it finishes)
    stream_groups: int = 1
    # partial: once every controller has generated, the judge takes every core of the run
    widen_judge: bool = True
    # partial: at most this many samples per judge call while generating (0: all waiting)
    stream_max_samples: int = 8
    # partial, text, several controllers: the first generates every controller's groups in
    # one batch and streams them to the judge; each gets its own back (docs/placement.md)
    merge_rollout: bool = False
    release_judge: bool = True  # colocate: drop the judge's weights outside its phase
    # partial: the judge drops its weights while training takes everything (reloaded next step)
    partial_release_judge: bool = False
    offload_policy: bool = False  # colocate, GPU: idle policy off the device (placement/offload.py)
    judge_threads: int = -1  # colocate: judge's threads (-1: measured, 1 or all; 0: one per core)
    profile_steps: int = 2  # auto: steps measured in its starting mode before choosing
    # auto: profile colocate, then partial (with a judge), instead of starting in shared and
    # measuring a plan only where its optimistic prediction wins (placement/auto.py)
    profile_all_modes: bool = False
    reevaluate_every: int = 10  # auto: steps between re-evaluations
    drift_threshold: float = 0.25  # auto: re-evaluate when a phase cost moves this much
    # auto: how much faster a role may run alone than it was measured beside the other one
    # (partial); a plan that could then beat the best by 3% is measured, not just predicted
    explore_margin: float = 0.15
    log_memory: bool = True  # per-phase peak RSS, and device MB on CUDA (placement/peak_*)
    # Karmarkar-Karp over the controllers each step: every rank trains the same number of
    # samples with nearly the same work (text tokens, denoising transitions); only token /
    # latent tensors move between ranks (mmyatt/placement/exchange.py)
    balance: bool = False


@dataclass(frozen=True)
class LoggingConfig:
    """Trackers besides metrics.jsonl (mmyatt/outputs/trackers.py): scalars, eval sample grids and
    a table of logged rollouts. Each is optional; one requested but not installed fails
    at start with the command that installs it."""

    trackers: tuple[Literal["tensorboard", "wandb", "mlflow"], ...] = ("tensorboard",)
    project: str = "mmyatt"  # wandb project, mlflow experiment
    offline: bool = True  # wandb: mode=offline (`wandb sync` later); mlflow: local file store
    mlflow_uri: str | None = None  # None: a file store in <run dir>/mlruns


@dataclass(frozen=True)
class TrainConfig:
    """The training engine behind the update (mmyatt/engines). replica: a full copy per
    controller, gradients summed in one flat all-reduce; fsdp2: torch ``fully_shard``
    (parameters, gradients and optimizer state sharded over the controllers); megatron:
    megatron-core GPTModel for text LLMs (pip install 'mmyatt[megatron]')."""

    backend: Literal["replica", "fsdp2", "megatron"] = "replica"  # docs/engines.md
    mixed_precision: Literal["none", "bfloat16", "float16"] = "none"  # fsdp2: compute dtype
    # of the sharded module (gradients are reduced in float32)
    cpu_offload: bool = False  # fsdp2: sharded parameters and optimizer state in host memory (CUDA)
    activation_checkpointing: bool = False  # fsdp2: recompute block activations in backward
    reshard_after_forward: bool = True  # fsdp2: free gathered weights after each block forward
    tensor_parallel: int = 1  # megatron: tensor-parallel size (a group of processes = a controller)
    pipeline_parallel: int = 1  # megatron: pipeline stages (a group of processes = a controller)


@dataclass(frozen=True)
class RolloutConfig:
    """Who generates the rollouts: the policy adapter (hf) or an in-process vLLM engine
    (pip install 'mmyatt[vllm]'; text and VLM policies, images/video as multi_modal_data)."""

    backend: Literal["hf", "vllm"] = "hf"  # docs/engines.md
    gpu_memory_utilization: float = 0.4  # vllm: share of the device its KV cache may take
    sleep_level: Literal[0, 1, 2] = 1  # vllm: sleep during training (0: stay awake)
    is_cap: float = 2.0  # vllm: each token's loss times min(exp(trainer - engine logprob), cap)
    # long tail (docs/placement.md): dispatch ceil(r x prompts) prompts per generate call,
    # stop decoding once the batch's groups are complete, keep the rest for the next step
    over_dispatch_ratio: float = 1.0  # 1: every dispatched prompt is trained on (no carry)
    reuse_unused_prompts: bool = True  # carry cut-short prompts to the next step (else drop)
    max_carries: int = 2  # a prompt cut short this many times must finish next time (0: no cap)
    redraw_carried: bool = False  # a carried prompt gets a new seed (a length bias: see docs)


@dataclass(frozen=True)
class RunConfig:
    name: str = "run"
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    sft: SFTConfig = field(default_factory=SFTConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    placement: PlacementConfig = field(default_factory=PlacementConfig)


# --------------------------------------------------------------------------- building


def build(cls: type, data: Any, where: str = "") -> Any:
    """Turn nested dicts into the dataclass ``cls``, checking every key and type."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{where or 'config'}: expected a mapping, got {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    unknown = [k for k in data if k not in names]
    if unknown:
        key = f"{where}.{unknown[0]}" if where else unknown[0]
        raise ConfigError(f"unknown config key {key!r}; valid keys here: {', '.join(names)}")
    kwargs = {}
    for name in names:
        if name in data:
            key = f"{where}.{name}" if where else name
            kwargs[name] = _coerce(hints[name], data[name], key)
    try:
        return cls(**kwargs)
    except TypeError as e:  # a required field is missing
        raise ConfigError(f"{where or 'config'}: {e}") from None


def _coerce(tp: Any, value: Any, key: str) -> Any:
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if tp is Any:
        return value
    if origin is Literal:
        if value not in args:
            raise ConfigError(f"{key}: {value!r} is not one of {', '.join(map(repr, args))}")
        return value
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for a in args:
            if a is type(None):
                continue
            try:
                return _coerce(a, value, key)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(errors[0] if len(errors) == 1 else f"{key}: {value!r} fits none of {tp}")
    if dataclasses.is_dataclass(tp):
        return build(tp, value, key)
    if origin is tuple:
        if isinstance(value, str):
            value = [value]
        if not isinstance(value, list | tuple):
            raise ConfigError(f"{key}: expected a list, got {value!r}")
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_coerce(args[0], v, f"{key}[{i}]") for i, v in enumerate(value))
        if len(value) != len(args):
            raise ConfigError(f"{key}: expected {len(args)} items, got {len(value)}")
        return tuple(_coerce(a, v, f"{key}[{i}]") for i, (a, v) in enumerate(zip(args, value)))
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a mapping, got {value!r}")
        return dict(value)
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{key}: expected true/false, got {value!r}")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise ConfigError(f"{key}: expected an integer, got {value!r}")
    if tp is float:
        if isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # YAML 1.1 reads "3e-3" (no dot) as a string
            try:
                return float(value)
            except ValueError:
                pass
        raise ConfigError(f"{key}: expected a number, got {value!r}")
    if tp is str:
        if isinstance(value, str):
            return value
        raise ConfigError(f"{key}: expected a string, got {value!r}")
    raise ConfigError(f"{key}: unsupported config type {tp}")


# --------------------------------------------------------------------------- overrides


def apply_override(tree: dict, dotted: str) -> None:
    """Apply one ``a.b.c=value`` override; the value is parsed as YAML (so 0.1, true, [1,2])."""
    if "=" not in dotted:
        raise ConfigError(f"override {dotted!r} must look like key.sub=value")
    key, raw = dotted.split("=", 1)
    parts = key.strip().split(".")
    if not all(parts):
        raise ConfigError(f"override {dotted!r}: empty key component")
    value = yaml.safe_load(raw) if raw.strip() else ""
    node = tree
    cls: Any = RunConfig
    for i, p in enumerate(parts):
        names = (
            {f.name: f for f in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls) else {}
        )
        if dataclasses.is_dataclass(cls) and p not in names:
            where = ".".join(parts[:i]) or "top level"
            raise ConfigError(
                f"unknown config key {'.'.join(parts[: i + 1])!r}; valid keys at {where}: "
                f"{', '.join(names)}"
            )
        if i == len(parts) - 1:
            node[p] = value
            return
        hint = typing.get_type_hints(cls)[p] if dataclasses.is_dataclass(cls) else None
        cls = hint if dataclasses.is_dataclass(hint) else None
        nxt = node.setdefault(p, {})
        if not isinstance(nxt, dict):
            raise ConfigError(f"override {dotted!r}: {'.'.join(parts[: i + 1])} is not a section")
        node = nxt


def load_config(path: str | Path | None, overrides: list[str] = ()) -> RunConfig:
    tree: dict = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file not found: {p}")
        try:
            tree = yaml.safe_load(p.read_text()) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"{p}: invalid YAML: {e}") from None
        if not isinstance(tree, dict):
            raise ConfigError(f"{p}: the top level must be a mapping")
    for o in overrides:
        apply_override(tree, o)
    cfg = build(RunConfig, tree)
    validate(cfg)
    return cfg


def validate(cfg: RunConfig) -> None:
    """Cross-field checks that types alone cannot express."""
    checks = [
        (cfg.sampling.group_size >= 1, "sampling.group_size must be >= 1"),
        (cfg.data.prompts_per_step >= 1, "data.prompts_per_step must be >= 1"),
        (cfg.distributed.nproc >= 1, "distributed.nproc must be >= 1"),
        (
            cfg.data.prompts_per_step % cfg.distributed.nproc == 0,
            f"data.prompts_per_step ({cfg.data.prompts_per_step}) must be divisible by "
            f"distributed.nproc ({cfg.distributed.nproc})",
        ),
        (cfg.algorithm.minibatches >= 1, "algorithm.minibatches must be >= 1"),
        (cfg.algorithm.ppo_epochs >= 1, "algorithm.ppo_epochs must be >= 1"),
        (cfg.algorithm.micro_batch_tokens >= 0, "algorithm.micro_batch_tokens must be >= 0"),
        (cfg.algorithm.clip_low >= 0 and cfg.algorithm.clip_high >= 0, "clip ranges must be >= 0"),
        (
            cfg.algorithm.dual_clip is None or cfg.algorithm.dual_clip > 1,
            "algorithm.dual_clip must be > 1 (or null)",
        ),
        (
            cfg.model.kind == "flow" or not cfg.algorithm.kl_estimator.startswith("closed_form"),
            f"algorithm.kl_estimator={cfg.algorithm.kl_estimator} needs a flow model (Gaussian "
            f"denoising steps), not model.kind={cfg.model.kind}; use k1, k2 or k3",
        ),
        (
            cfg.algorithm.kl_block == 0
            or (
                cfg.algorithm.kl_block > 0 and cfg.algorithm.kl_estimator.startswith("closed_form")
            ),
            f"algorithm.kl_block={cfg.algorithm.kl_block} needs kl_estimator closed_form or "
            f"closed_form_flowgrpo (got {cfg.algorithm.kl_estimator}) and must be >= 0",
        ),
        (
            cfg.algorithm.name != "diffusion_nft" or cfg.model.kind == "flow",
            f"algorithm.name=diffusion_nft trains flow models, not model.kind={cfg.model.kind}",
        ),
        (
            cfg.algorithm.nft.beta > 0
            and cfg.algorithm.nft.adv_clip > 0
            and cfg.algorithm.nft.timesteps_per_sample >= 1
            and cfg.algorithm.nft.decay_rate >= 0
            and 0 <= cfg.algorithm.nft.decay_max < 1,
            "algorithm.nft: need beta > 0, adv_clip > 0, timesteps_per_sample >= 1, "
            "decay_rate >= 0 and 0 <= decay_max < 1",
        ),
        (
            cfg.algorithm.name != "diffusion_nft"
            or cfg.algorithm.nft.timesteps != "sampler"
            or cfg.algorithm.nft.timesteps_per_sample <= cfg.sampling.denoise_steps,
            f"algorithm.nft.timesteps_per_sample={cfg.algorithm.nft.timesteps_per_sample} "
            f"exceeds sampling.denoise_steps={cfg.sampling.denoise_steps} (timesteps=sampler "
            "draws distinct sampler steps)",
        ),
        (cfg.sampling.temperature > 0, "sampling.temperature must be > 0"),
        (0 < cfg.sampling.top_p <= 1, "sampling.top_p must be in (0, 1]"),
        (cfg.optim.lr > 0, "optim.lr must be > 0"),
        (cfg.trainer.rollouts_per_step >= 1, "trainer.rollouts_per_step must be >= 1"),
        (cfg.trainer.save_rollouts_every >= 0, "trainer.save_rollouts_every must be >= 0"),
        (
            len(set(cfg.logging.trackers)) == len(cfg.logging.trackers),
            "logging.trackers names a tracker twice",
        ),
        (len(cfg.reward.functions) > 0, "reward.functions must name at least one reward"),
        (
            cfg.algorithm.overlong == "none"
            or 0 < cfg.algorithm.overlong_buffer <= cfg.sampling.max_new_tokens,
            "algorithm.overlong_buffer must be in (0, sampling.max_new_tokens]",
        ),
    ]
    for ok, msg in checks:
        if not ok:
            raise ConfigError(msg)
    from mmyatt.outputs.trackers import check_trackers

    check_trackers(cfg.logging)  # a requested tracker that is not installed: its pip command
    from mmyatt.engines import check_engines

    check_engines(cfg)  # a backend that cannot run here fails now, with the install command
    from mmyatt.placement.config import check_placement

    check_placement(cfg)  # a core mapping that cannot work fails here, before anything starts


def to_dict(cfg: Any) -> Any:
    """Plain data (lists, dicts, scalars) for YAML/JSON."""
    if dataclasses.is_dataclass(cfg):
        return {f.name: to_dict(getattr(cfg, f.name)) for f in dataclasses.fields(cfg)}
    if isinstance(cfg, tuple | list):
        return [to_dict(v) for v in cfg]
    if isinstance(cfg, dict):
        return {k: to_dict(v) for k, v in cfg.items()}
    return cfg


def dump_yaml(cfg: Any) -> str:
    return yaml.safe_dump(to_dict(cfg), sort_keys=False)
