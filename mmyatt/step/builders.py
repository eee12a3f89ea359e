"""Config -> plain objects: the reward and the step's parts (placement, loss, trainer,
sampling, evaluation) each get their settings as plain arguments; none of them reads the
run config. The policy adapter is built in :mod:`mmyatt.step.adapters`, the data in
:mod:`mmyatt.step.data`; this module is the run's one door to all three (``mmyatt.step.run``
and ``mmyatt.step.sft`` build through it). Adapters and rewards never see config
dataclasses."""

from __future__ import annotations

import os
from functools import partial
from pathlib import Path

from mmyatt.algorithms.advantages import Advantages
from mmyatt.config.schema import RewardConfig, RunConfig
from mmyatt.distributed import Dist, Lockstep
from mmyatt.engines import build_engines
from mmyatt.outputs.metrics import MetricsLogger
from mmyatt.outputs.trackers import make_logger
from mmyatt.placement.auto import AutoPlacer
from mmyatt.placement.balancer import balance_settings
from mmyatt.placement.config import candidate_plans, partial_split, plan_for, run_cores, work_key
from mmyatt.placement.dispatch import OverDispatch
from mmyatt.placement.dispatch_balance import DispatchBalance
from mmyatt.placement.exchange import Exchange
from mmyatt.placement.judge_threads import JudgeThreads
from mmyatt.placement.judges import JudgeControl
from mmyatt.placement.offload import PolicyOffload
from mmyatt.placement.runner import Placement, PlacementSettings
from mmyatt.protocols import (
    CLOSED_FORM_KL,
    EMA,
    ClosedFormKL,
    DecoderFlops,
    LatentOutputs,
    ReferenceKL,
    Sampling,
    TokenPolicy,
    adapter_of,
    capable,
    require,
)
from mmyatt.rewards.mixture import RewardMixture
from mmyatt.step.adapters import (
    build_nft,
    build_policy,
    build_tiny,
    resolve_builtin,
    streams_finished,
)
from mmyatt.step.async_rollouts import async_run
from mmyatt.step.batches import MicroBatches, Minibatches
from mmyatt.step.controller import Controller
from mmyatt.step.data import build_shard, eval_records, manifest_paths, synthetic_task
from mmyatt.step.evaluation import Evaluator
from mmyatt.step.flops import ModelFlops
from mmyatt.step.perf import StepFlops, device_peak
from mmyatt.step.policy_loss import NFTLoss, PolicyLoss, PPOClipLoss
from mmyatt.step.sampling import DynamicSampling, SamplingSchedule
from mmyatt.step.scoring import OverlongPenalty, Scorer
from mmyatt.step.trainer import Trainer

# what the run and the warm start build through this module
__all__ = [
    "build_controller",
    "build_loss",
    "build_placement",
    "build_policy",
    "build_reward",
    "build_shard",
    "build_tiny",
    "eval_records",
    "manifest_paths",
    "resolve_builtin",
    "synthetic_task",
]


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
    # perf/*: model FLOP/s of generation and update (text and VLM), the FLOPs counted on
    # the whole model, before an engine shards or converts it
    perf = None
    if capable(policy, DecoderFlops):
        perf = StepFlops(
            ModelFlops.of(*adapter_of(policy).flops_modules()),
            peak=device_peak(dist.device),
            epochs=a.ppo_epochs,
            update_devices=dist.processes // dist.world_size,
        )
    # replica / fsdp2 / megatron training, hf / vllm rollouts (mmyatt/engines)
    engine, wrapped = build_engines(cfg, dist, policy)
    lockstep = Lockstep(dist, engine, wrapped)
    exchange = None  # placement.balance (at the update) with more than one controller
    if cfg.placement.balance and cfg.placement.balance_at == "update" and dist.world_size > 1:
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
        perf=perf,
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
    # shared mode only reads the judges' counters (CPU, busy time, memory), and only of
    # judges the run starts: a judge at reward.judge.urls may be across a network, where
    # each of the step's reads (around every phase) is a round trip on the step's path
    started = bool(j.model)
    if dist.is_main and has_judge and (p.mode != "shared" or (p.log_memory and started)):
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
    dispatch_balance = None  # placement.balance_at=dispatch: records move before generation
    if p.balance and p.balance_at == "dispatch" and dist.world_size > 1:
        require(policy, TokenPolicy, "placement.balance_at=dispatch")
        adapter = adapter_of(policy)
        dispatch_balance = DispatchBalance(
            dist, lambda recs: [len(t) for t in adapter.encode_prompts(recs)]
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
        dispatch_balance=dispatch_balance,
    )


def build_reward(r: RewardConfig):
    key = os.environ.get(r.judge.api_key_env) if r.judge.api_key_env else None
    specs = [
        {"name": s.name, "weight": s.weight, "kwargs": s.kwargs, "zscore": s.zscore}
        for s in r.functions
    ]
    client = {"max_retries": r.judge.max_retries, "timeout_s": r.judge.timeout_s}
    return RewardMixture.from_specs(specs, judge_urls=r.judge.urls, api_key=key, client=client)
