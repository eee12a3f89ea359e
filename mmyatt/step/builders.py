"""Config -> plain objects: the policy, reward, data shard and the step's parts
(placement, loss, trainer, sampling, evaluation) each get their settings as plain
arguments; none of them reads the run config. Adapters and rewards never see config
dataclasses. The adapters are imported only when a config asks for one (importing the
engine pulls in no adapter)."""

from __future__ import annotations

import importlib.util
import os
import time
from functools import partial
from pathlib import Path

import torch

from mmyatt.algorithms.advantages import Advantages
from mmyatt.config.schema import ModelConfig, RewardConfig, RunConfig
from mmyatt.datasets import shapes, vision_tasks
from mmyatt.datasets.describe import write_describe_task
from mmyatt.datasets.geneval import write_geneval_task
from mmyatt.datasets.manifest import ShardedManifest
from mmyatt.datasets.media import media_transform as decode_media
from mmyatt.datasets.synthetic import write_arithmetic_task
from mmyatt.distributed import Dist, Lockstep
from mmyatt.engines import build_engines
from mmyatt.outputs.metrics import MetricsLogger
from mmyatt.outputs.trackers import make_logger
from mmyatt.placement.auto import AutoPlacer
from mmyatt.placement.balancer import balance_settings
from mmyatt.placement.config import candidate_plans, partial_split, plan_for, run_cores, work_key
from mmyatt.placement.dispatch import OverDispatch
from mmyatt.placement.exchange import Exchange
from mmyatt.placement.judge_threads import JudgeThreads
from mmyatt.placement.judges import JudgeControl
from mmyatt.placement.offload import PolicyOffload
from mmyatt.placement.runner import Placement, PlacementSettings
from mmyatt.protocols import (
    CLOSED_FORM_KL,
    EMA,
    ClosedFormKL,
    LatentOutputs,
    ReferenceKL,
    Sampling,
    capable,
    require,
)
from mmyatt.rewards.mixture import RewardMixture
from mmyatt.step.async_rollouts import async_run
from mmyatt.step.batches import MicroBatches, Minibatches
from mmyatt.step.controller import Controller
from mmyatt.step.evaluation import Evaluator
from mmyatt.step.freeze import freeze_parameters
from mmyatt.step.policy_loss import NFTLoss, PolicyLoss, PPOClipLoss
from mmyatt.step.sampling import DynamicSampling, SamplingSchedule
from mmyatt.step.scoring import OverlongPenalty, Scorer
from mmyatt.step.trainer import Trainer

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def build_policy(m: ModelConfig, device: str | None = None):
    """The policy adapter for ``m``, its weights on ``device`` (default: the CPU), with
    the parameters named by ``model.freeze`` frozen."""
    policy = _load_policy(m, device)
    if m.freeze:
        freeze_parameters(policy.module(), m.freeze)
    return policy


def _load_policy(m: ModelConfig, device: str | None = None):
    device = str(device or "cpu")
    if m.path is None:
        raise ValueError("model.path is unset: prepare_run() builds the tiny model first")
    if m.kind == "text":
        from mmyatt.models.text import TextPolicy

        return TextPolicy.load(
            m.path,
            dtype=DTYPES[m.dtype],
            max_prompt_tokens=m.max_prompt_tokens,
            prompt_overflow=m.prompt_overflow,
            use_chat_template=m.use_chat_template,
            device=device,
        )
    if m.kind == "vlm":
        from mmyatt.models.vlm import VLMPolicy

        return VLMPolicy.load(
            m.path,
            dtype=DTYPES[m.dtype],
            max_prompt_tokens=m.max_prompt_tokens,
            video_fps=m.video_fps,
            video_max_frames=m.video_max_frames,
            device=device,
        )
    if m.kind == "flow":
        from mmyatt.models.flow import FlowPolicy

        kw: dict = {"reference": m.reference}
        if m.lora.rank > 0:
            lora = {"r": m.lora.rank, "alpha": m.lora.alpha}
            if m.lora.target_modules:
                lora["target_modules"] = list(m.lora.target_modules)
            kw["lora"] = lora
        return FlowPolicy.load(m.path, **kw).to(device)
    raise NotImplementedError(f"model.kind={m.kind!r} is not wired into the engine")


def build_nft(cfg: RunConfig, policy):
    """DiffusionNFT's sampling policy and loss (models/flow_nft.py) over ``policy`` when
    ``algorithm.name`` is diffusion_nft, else None."""
    if cfg.algorithm.name != "diffusion_nft":
        return None
    from mmyatt.models.flow_nft import FlowNFT, NFTSettings

    n = cfg.algorithm.nft
    settings = NFTSettings(**{k: getattr(n, k) for k in NFTSettings.__dataclass_fields__})
    return FlowNFT(policy, settings, seed=cfg.trainer.seed)


def build_controller(
    cfg: RunConfig,
    run_dir: Path,
    dist: Dist,
    *,
    policy,
    reward,
    shard,
    eval_records: list[dict],
    logger: MetricsLogger | None = None,
) -> Controller:
    """One rank's controller over ``policy`` (the adapter; the training engine wraps it
    here), ``reward`` and this rank's ``shard``, every part given its plain settings."""
    a, o, s = cfg.algorithm, cfg.optim, cfg.sampling
    logger = logger or make_logger(cfg, run_dir, enabled=dist.is_main)
    # DiffusionNFT's sampling copy is taken before an engine shards the transformer
    nft = build_nft(cfg, policy)
    # replica / fsdp2 / megatron training, hf / vllm rollouts (mmyatt/engines)
    engine, wrapped = build_engines(cfg, dist, policy)
    lockstep = Lockstep(dist, engine, wrapped)
    exchange = None  # placement.balance with more than one controller
    if cfg.placement.balance and dist.world_size > 1:
        exchange = Exchange(dist, cfg.model.kind, balance_settings(cfg))
    planner = exchange.balancer if exchange is not None else None  # length buckets, timed
    micro_batches = MicroBatches(a.micro_batch_tokens, lockstep, planner)
    encode = wrapped.encode_media if cfg.model.kind == "vlm" else None
    minibatches = Minibatches(a.minibatches, exchange, encode)
    trainer = Trainer(
        wrapped,
        engine,
        dist,
        minibatches,
        micro_batches,
        lr=o.lr,
        betas=o.betas,
        weight_decay=o.weight_decay,
        grad_clip=o.grad_clip,
        warmup_steps=o.warmup_steps,
        schedule=o.schedule,
        total_steps=cfg.trainer.steps,
        epochs=a.ppo_epochs,
        ema_decay=cfg.model.ema_decay,
    )
    penalty = None
    if a.overlong == "penalty":
        penalty = OverlongPenalty(s.max_new_tokens, a.overlong_buffer, a.overlong_penalty)
    scorer = Scorer(reward, dist, penalty)
    # which cores each phase runs on (placement.*), which records each call generates
    offload = (
        PolicyOffload(wrapped.module(), trainer.optimizer) if cfg.placement.offload_policy else None
    )
    placement = build_placement(
        cfg,
        dist,
        shard,
        policy=wrapped,
        scorer=scorer,
        offload=offload,
        streams_finished=streams_finished(policy),
    )
    if cfg.model.ema_decay is not None:
        require(policy, EMA, f"model.ema_decay={cfg.model.ema_decay}")
    closed_form_kl = nft is None and a.kl_coef > 0 and a.kl_estimator in CLOSED_FORM_KL
    if a.kl_coef > 0:
        why = f"algorithm.kl_coef={a.kl_coef} with kl_estimator={a.kl_estimator}"
        require(policy, ClosedFormKL if closed_form_kl else ReferenceKL, why)
        engine.enable_reference(policy)
    if reward.reads_latents:  # every reward reads latents: no decode
        require(policy, LatentOutputs, "rewards that read latents (flow models only)")
        policy.decode_outputs = False
    schedule = SamplingSchedule(
        Sampling(
            temperature=s.temperature,
            top_p=s.top_p,
            max_new_tokens=s.max_new_tokens,
            stop=s.stop,
            denoise_steps=s.denoise_steps,
            noise_level=s.noise_level,
            sde_type=s.sde_type,
            guidance_scale=s.guidance_scale,
        ),
        Sampling(
            temperature=s.temperature,
            max_new_tokens=s.max_new_tokens,
            stop=s.stop,
            noise_level=0.0,  # flow eval: the deterministic ODE
            denoise_steps=s.eval_denoise_steps,
            guidance_scale=s.guidance_scale,
        ),
        schedule={
            "mode": s.train_steps,
            "fraction": s.train_fraction,
            "window": s.window,
            "window_start": s.window_start,
            "slide_every": s.slide_every,
        },
        trains_transitions=nft is None,
        eval_greedy=cfg.trainer.eval_sampling == "greedy",
    )
    grpo = {"std_mode": a.advantage_std, "clip": a.advantage_clip} if a.advantage == "grpo" else {}
    return Controller(
        dist,
        run_dir,
        policy=wrapped,
        engine=engine,
        shard=shard,
        placement=placement,
        schedule=schedule,
        dynamic=DynamicSampling(
            dist,
            cfg.data.prompts_per_step,
            enabled=a.dynamic_sampling,
            max_refill_rounds=a.max_refill_rounds,
        ),
        advantage=Advantages(a.advantage, dist.sum if dist.active else None, **grpo),
        minibatches=minibatches,
        micro_batches=micro_batches,
        loss=build_loss(cfg, nft, lockstep, closed_form_kl),
        async_settings=async_run(cfg),
        trainer=trainer,
        evaluator=Evaluator(
            wrapped,
            scorer,
            dist,
            eval_records,
            schedule,
            seed=cfg.trainer.seed + 1,
            salt="eval" if cfg.data.eval_split == "test" else "val",
            ema=capable(wrapped, EMA) and cfg.model.ema_decay is not None,
        ),
        logger=logger,
        groups=cfg.data.prompts_per_step // dist.world_size,
        group_size=s.group_size,
        nonfinite_reward=cfg.reward.nonfinite,
        rollouts_per_step=cfg.trainer.rollouts_per_step,
    )


def build_loss(cfg: RunConfig, nft, lockstep: Lockstep, closed_form_kl: bool) -> PolicyLoss:
    """DiffusionNFT's loss over ``nft`` (``build_nft``), else the PPO-clip family's."""
    a = cfg.algorithm
    if nft is not None:  # its KL is on velocities (models/flow_nft.py)
        return NFTLoss(nft, lockstep, kl_coef=a.kl_coef, kl_block=a.kl_block)
    return PPOClipLoss(
        lockstep,
        clip_low=a.clip_low,
        clip_high=a.clip_high,
        dual_clip=a.dual_clip,
        loss_agg=a.loss_agg,
        entropy_coef=a.entropy_coef,
        kl_coef=a.kl_coef,
        kl_estimator=a.kl_estimator,
        kl_block=a.kl_block,
        closed_form_kl=closed_form_kl,
        recompute_old_logprobs=a.recompute_old_logprobs,
        overlong_filter=a.overlong == "filter",
        behaviour_cap=cfg.rollout.is_cap,  # trainer.async's behaviour ratio
    )


def streams_finished(policy) -> bool:
    """The adapter reports each finished sample during ``generate`` (text and VLM
    adapters), so placement partial can stream it to the judge."""
    from mmyatt.models.text import TextPolicy
    from mmyatt.models.vlm import VLMPolicy

    return isinstance(policy, TextPolicy | VLMPolicy)


def build_placement(
    cfg: RunConfig,
    dist: Dist,
    shard,
    *,
    policy,
    scorer: Scorer,
    offload: PolicyOffload | None = None,
    streams_finished: bool = False,
) -> Placement:
    """The controller's placement (``placement.*``): the records each generate call gets,
    the cores of the mode (or auto's choice per step), the judge servers' control."""
    p, ro, j = cfg.placement, cfg.rollout, cfg.reward.judge
    dispatch = OverDispatch(
        ro.over_dispatch_ratio, shard, reuse=ro.reuse_unused_prompts, max_carries=ro.max_carries
    )
    # partial sends each sample (or prompt group) to the judge the moment it finishes,
    # from inside one generate call (the adapter's streams_finished: text and VLM); else
    # (flow models, over-dispatch) it generates chunks of placement.stream_groups groups,
    # one call each, and sends each chunk
    streams = streams_finished and not dispatch.active
    # placement.merge_rollout (checked in config): in partial steps the first controller
    # generates every controller's groups in one batch
    merge = p.merge_rollout and dist.world_size > 1 and not dist.model_parallel
    has_judge = any(f.name == "genrm" for f in cfg.reward.functions) and bool(j.model or j.urls)
    judges = None
    if dist.is_main and has_judge and (p.mode != "shared" or p.log_memory):
        # shared mode only reads the judges' counters (CPU, busy time, memory)
        key = os.environ.get(j.api_key_env) if j.api_key_env else None
        judges = JudgeControl(j.urls, api_key=key)
    cores = run_cores(p)
    # colocate's judge threads: set, or measured (placement.judge_threads=-1)
    colocate_threads = JudgeThreads(p.judge_threads, len(cores), p.profile_steps)
    shared_threads = j.threads * max(1, j.num_servers)
    auto = None
    if p.mode == "auto":
        start = None
        if len(cores) >= 2:
            r, _ = partial_split(p, len(cores))
            start = next(
                c for c in candidate_plans(cfg) if c.mode == "partial" and len(c.rollout) == r
            )
        groups = max(1, cfg.data.prompts_per_step // max(1, dist.world_size))
        auto = AutoPlacer(
            candidate_plans(cfg),
            has_judge=has_judge,
            start_partial=start,
            profile=p.profile_steps,
            every=p.reevaluate_every,
            drift_threshold=p.drift_threshold,
            profile_all=p.profile_all_modes,
            explore_margin=p.explore_margin,
            judge_threads=partial(colocate_threads.for_plan, shared=shared_threads),
            # partial's judge calls per step
            chunks=(groups * (dist.world_size if merge else 1))
            if streams
            else -(-groups // p.stream_groups),
            widen=p.widen_judge,
            partial_reload=p.partial_release_judge and has_judge,
            shared_cores=dist.processes * cfg.trainer.threads,
            work=work_key(cfg),
        )
    settings = PlacementSettings(
        mode=p.mode,
        group_size=cfg.sampling.group_size,
        seed=cfg.trainer.seed,
        redraw_carried=ro.redraw_carried,
        streams=streams,
        merge=merge,
        has_judge=has_judge,
        stream_groups=p.stream_groups,
        stream_max_samples=p.stream_max_samples,
        widen_judge=p.widen_judge,
        release_judge=p.release_judge,
        partial_release_judge=p.partial_release_judge,
        log_memory=p.log_memory,
        trainer_threads=cfg.trainer.threads,
        shared_judge_threads=shared_threads,
        judge_servers=j.num_servers,
        run_cores=len(cores),
    )
    return Placement(
        settings,
        dist,
        policy=policy,
        scorer=scorer,
        dispatch=dispatch,
        plan=plan_for(cfg),
        auto=auto,
        colocate_threads=colocate_threads,
        judges=judges,
        offload=offload,
    )


def build_tiny(cfg: RunConfig, out: Path, log=print) -> Path:
    """The tiny built-in text or VLM model of a run without ``model.path``, its tokenizer
    trained on the run's training prompts, written to ``out`` (kept if already there)."""
    if (out / "config.json").exists():
        return out
    if cfg.model.kind == "flow":
        raise ValueError("model.path is required for flow models (e.g. builtin:tiny_t2i)")
    manifest = ShardedManifest(
        manifest_paths(cfg.data.train), shuffle=False, bad_lines=cfg.data.bad_lines
    )
    recs = manifest.eval_records(5000)
    t0 = time.perf_counter()
    if cfg.model.kind == "vlm":
        from mmyatt.models.builtin.tiny_vlm import build_tiny_vlm

        corpus = [f"{r['prompt']} {r.get('answer', '')}" for r in recs]
        path = build_tiny_vlm(
            out,
            arch=cfg.model.vlm_arch,
            size=cfg.model.tiny_size,
            corpus=corpus,
            seed=cfg.trainer.seed,
        )
    else:
        from mmyatt.models.builtin.tiny import build_tiny_text_model

        corpus = [f"{r['prompt']}{r.get('answer', '')}" for r in recs]
        path = build_tiny_text_model(
            out, size=cfg.model.tiny_size, corpus=corpus, seed=cfg.trainer.seed
        )
    log(f"[prepare] tiny model {cfg.model.tiny_size} at {path} ({time.perf_counter() - t0:.1f}s)")
    return Path(path)


def build_reward(r: RewardConfig):
    key = os.environ.get(r.judge.api_key_env) if r.judge.api_key_env else None
    specs = [
        {"name": s.name, "weight": s.weight, "kwargs": s.kwargs, "zscore": s.zscore}
        for s in r.functions
    ]
    client = {"max_retries": r.judge.max_retries, "timeout_s": r.judge.timeout_s}
    return RewardMixture.from_specs(specs, judge_urls=r.judge.urls, api_key=key, client=client)


def resolve_builtin(path: str | None) -> str | None:
    """``builtin:<name>`` names a checkpoint shipped in models/builtin/."""
    if path is None or not path.startswith("builtin:"):
        return path
    # where the adapters' package lies, found without importing it
    models = Path(importlib.util.find_spec("mmyatt.models").origin).resolve().parent
    p = models / "builtin" / path.split(":", 1)[1]
    if not p.is_dir():
        raise FileNotFoundError(f"{path}: no built-in checkpoint at {p}")
    return str(p)


def manifest_paths(spec: str) -> list[str]:
    """``data.train`` / ``data.eval``: one manifest, or several joined by commas. A spec
    that names an existing file is that one file, commas and all (a run directory may
    hold a comma, and a synthetic task's files are written under it)."""
    if not spec.startswith("synthetic:") and Path(spec).is_file():
        return [spec]
    paths = [p.strip() for p in spec.split(",") if p.strip()]
    for p in paths:
        if p.startswith("synthetic:"):
            raise ValueError(f"{spec!r} must be resolved to files by prepare_run() first")
    return paths


def media_transform(cfg: RunConfig):
    """VLM records decode their images/videos as the shard reads them, so a missing or
    corrupt file is a bad record of the manifest (error naming file and line, or skipped
    and counted in ``data/skipped`` under ``data.bad_lines=skip``) instead of an error
    in the middle of a rollout."""
    if cfg.model.kind != "vlm":
        return None
    return partial(decode_media, fps=cfg.model.video_fps, max_frames=cfg.model.video_max_frames)


def build_shard(cfg: RunConfig, rank: int, world_size: int):
    return ShardedManifest(
        manifest_paths(cfg.data.train),
        rank=rank,
        world_size=world_size,
        seed=cfg.trainer.seed,
        shuffle=cfg.data.shuffle,
        bad_lines=cfg.data.bad_lines,
        transform=media_transform(cfg),
    )


def eval_records(cfg: RunConfig, rank: int, world_size: int) -> list[dict]:
    m = ShardedManifest(
        manifest_paths(cfg.data.eval),
        rank=rank,
        world_size=world_size,
        seed=cfg.trainer.seed,
        shuffle=False,
        bad_lines=cfg.data.bad_lines,
        transform=media_transform(cfg),
    )
    limit = -(-cfg.data.eval_prompts // world_size)  # ceil: every rank scores its share
    return m.eval_records(limit)


def synthetic_task(spec: str, out_dir: Path, cfg: RunConfig) -> tuple[Path, Path, Path | None]:
    """Write a synthetic task's files: (train, the eval split reported, the validation
    split that choices during the run are made on, e.g. the SFT stopping check)."""
    train, ev = _synthetic_task(spec, out_dir, cfg)
    val = out_dir / "val.jsonl"
    return train, ev, val if val.exists() else None


# the keyword arguments each synthetic task's writer takes from data.synthetic_kwargs
WRITER_KEYS: dict[str, tuple[str, ...]] = {
    "describe": ("extra_colours", "val_fold", "shape_first", "extra_shapes")
}


def _writer_kwargs(cfg: RunConfig, task: str) -> dict:
    """``data.synthetic_kwargs``, checked against the keys the task's writer takes."""
    known = WRITER_KEYS.get(task, ())
    kw = dict(cfg.data.synthetic_kwargs)
    unknown = sorted(set(kw) - set(known))
    if unknown:
        raise ValueError(
            f"data.synthetic_kwargs: synthetic:{task} takes {list(known) or 'no keys'}, "
            f"not {unknown}"
        )
    return kw


def _synthetic_task(spec: str, out_dir: Path, cfg: RunConfig) -> tuple[Path, Path]:
    task = spec.split(":", 1)[1]
    writer_kwargs = _writer_kwargs(cfg, task)
    if cfg.data.eval_split == "val" and task not in (
        "shapes_t2i",
        "motion_t2v",
        "geneval_t2i",
        "describe",
    ):
        raise ValueError(
            f"data.eval_split=val: synthetic:{task} has no validation split "
            "(shapes_t2i, motion_t2v and geneval_t2i do); point data.eval at your own "
            "validation file"
        )
    if task == "arithmetic":
        return write_arithmetic_task(
            out_dir,
            n_train=cfg.data.synthetic_train_size,
            n_eval=cfg.data.synthetic_eval_size,
            seed=cfg.trainer.seed,
            n_val=cfg.sft.eval_prompts,
        )
    if task == "shapes_vqa":
        p = vision_tasks.write_shape_task(
            out_dir,
            n_train=cfg.data.synthetic_train_size,
            n_eval=cfg.data.synthetic_eval_size,
            seed=cfg.trainer.seed,
            n_val=cfg.sft.eval_prompts,
        )
        return p["train"], p["eval"]
    if task == "motion_vqa":
        p = vision_tasks.write_motion_task(
            out_dir,
            n_train=cfg.data.synthetic_train_size,
            n_eval=cfg.data.synthetic_eval_size,
            seed=cfg.trainer.seed,
            n_val=cfg.sft.eval_prompts,
        )
        return p["train"], p["eval"]
    if task == "describe":
        p = write_describe_task(
            out_dir,
            n_train=cfg.data.synthetic_train_size,
            n_eval=cfg.data.synthetic_eval_size,
            seed=cfg.trainer.seed,
            **writer_kwargs,
        )
        return p["train"], p[cfg.data.eval_split]
    if task in ("shapes_t2i", "motion_t2v"):
        p = shapes.write_shape_task(
            out_dir,
            n_train=cfg.data.synthetic_train_size,
            n_eval=cfg.data.synthetic_eval_size,
            seed=cfg.trainer.seed,
            video=task == "motion_t2v",
        )
        return p["train"], p[cfg.data.eval_split]
    if task == "geneval_t2i":
        p = write_geneval_task(
            out_dir,
            n_train=cfg.data.synthetic_train_size,
            n_eval=cfg.data.synthetic_eval_size,
            seed=cfg.trainer.seed,
        )
        return p["train"], p[cfg.data.eval_split]
    raise ValueError(
        f"unknown synthetic task {task!r}; available: arithmetic, shapes_vqa, motion_vqa, "
        "describe, shapes_t2i, motion_t2v, geneval_t2i"
    )
