"""Rules between keys of different sections, which no single field's type or range can
state. Each names every key involved and the way out."""

from __future__ import annotations

from typing import TYPE_CHECKING

from mmyatt.config.errors import ConfigError
from mmyatt.config.trainer import async_settings

if TYPE_CHECKING:
    from mmyatt.config.run import RunConfig

# advantages measured against the other samples of the prompt's group
GROUP_BASELINES = ("grpo", "drgrpo", "rloo", "reinforce_pp_baseline")


def check_rules(cfg: RunConfig) -> None:
    """Raise ConfigError for the first rule ``cfg`` breaks."""
    a, s = cfg.algorithm, cfg.sampling
    kind = cfg.model.kind
    closed_form = a.kl_estimator.startswith("closed_form")
    rules = [
        (
            cfg.data.prompts_per_step % cfg.distributed.nproc == 0,
            f"data.prompts_per_step ({cfg.data.prompts_per_step}) must be divisible by "
            f"distributed.nproc ({cfg.distributed.nproc})",
        ),
        (
            a.advantage not in GROUP_BASELINES or s.group_size >= 2,
            f"algorithm.advantage={a.advantage} compares each sample with its group, so "
            f"sampling.group_size must be >= 2, got {s.group_size} (or use reinforce_pp)",
        ),
        (
            not a.dynamic_sampling or s.group_size >= 2,
            "algorithm.dynamic_sampling drops groups whose rewards do not vary, which needs "
            f"sampling.group_size >= 2, got {s.group_size}",
        ),
        (
            kind == "flow" or not closed_form,
            f"algorithm.kl_estimator={a.kl_estimator} needs a flow model (Gaussian "
            f"denoising steps), not model.kind={kind}; use k1, k2 or k3",
        ),
        (
            a.kl_block == 0 or closed_form,
            f"algorithm.kl_block={a.kl_block} needs kl_estimator closed_form or "
            f"closed_form_flowgrpo (got {a.kl_estimator})",
        ),
        (
            a.name != "diffusion_nft" or kind == "flow",
            f"algorithm.name=diffusion_nft trains flow models, not model.kind={kind}",
        ),
        (
            a.name != "diffusion_nft"
            or a.nft.timesteps != "sampler"
            or a.nft.timesteps_per_sample <= s.denoise_steps,
            f"algorithm.nft.timesteps_per_sample={a.nft.timesteps_per_sample} "
            f"exceeds sampling.denoise_steps={s.denoise_steps} (timesteps=sampler "
            "draws distinct sampler steps)",
        ),
        (
            a.overlong == "none" or a.overlong_buffer <= s.max_new_tokens,
            f"algorithm.overlong_buffer={a.overlong_buffer} must be in [1, "
            f"sampling.max_new_tokens={s.max_new_tokens}]",
        ),
        (
            len(set(cfg.logging.trackers)) == len(cfg.logging.trackers),
            f"logging.trackers={list(cfg.logging.trackers)} names a tracker twice",
        ),
        (
            not any(f.name == "genrm" for f in cfg.reward.functions)
            or cfg.reward.judge.model is not None
            or bool(cfg.reward.judge.urls),
            "reward.functions has genrm but no judge is configured: set reward.judge.model "
            "(servers started with the run) or reward.judge.urls",
        ),
    ]
    for ok, message in rules:
        if not ok:
            raise ConfigError(message)
    check_fast_decode(cfg)
    check_async(cfg)
    check_dispatch_balance(cfg)


def check_fast_decode(cfg: RunConfig) -> None:
    """rollout.hf_static_cache / compile_decode: where the fixed-shape decode runs."""
    r = cfg.rollout
    if r.compile_decode and not r.hf_static_cache:
        raise ConfigError(
            "rollout.compile_decode compiles the fixed-shape decode step: set "
            "rollout.hf_static_cache=true too, or compile_decode=false"
        )
    if not r.hf_static_cache:
        return
    if r.backend != "hf" or cfg.model.kind not in ("text", "vlm"):
        raise ConfigError(
            "rollout.hf_static_cache is the decode of the text and VLM adapters (rollout."
            f"backend=hf); got rollout.backend={r.backend}, model.kind={cfg.model.kind}: "
            "set rollout.hf_static_cache=false"
        )
    if cfg.train.backend != "replica":
        raise ConfigError(
            "rollout.hf_static_cache calls the decoder's blocks directly, without the "
            f"gathers of a sharded model (train.backend={cfg.train.backend}): use "
            "train.backend=replica or rollout.hf_static_cache=false"
        )


def check_dispatch_balance(cfg: RunConfig) -> None:
    """placement.balance_at=dispatch: prompt records change controller before generation,
    which needs records that are small and a controller that draws its own (text, no
    carried prompts, no merged rollout, one process per controller)."""
    p = cfg.placement
    if not (p.balance and p.balance_at == "dispatch"):
        return
    key = "placement.balance_at=dispatch"
    rules = [
        (
            cfg.model.kind == "text",
            f"{key} costs and moves text prompt records; model.kind={cfg.model.kind} is not "
            "supported with it: use placement.balance_at=update (generated groups move "
            "before the update)",
        ),
        (
            cfg.rollout.over_dispatch_ratio == 1,
            f"{key} moves records for one step, and over-dispatch carries a record to the "
            f"next (rollout.over_dispatch_ratio={cfg.rollout.over_dispatch_ratio}): set "
            "rollout.over_dispatch_ratio=1 or placement.balance_at=update",
        ),
        (
            not p.merge_rollout,
            f"{key} with placement.merge_rollout: the first controller generates every "
            "record already; set one of them off",
        ),
        (
            cfg.train.tensor_parallel == 1 and cfg.train.pipeline_parallel == 1,
            f"{key} runs one process per controller; train.tensor_parallel / "
            "pipeline_parallel > 1 is not supported with it: use placement.balance_at=update",
        ),
    ]
    for ok, message in rules:
        if not ok:
            raise ConfigError(message)


def check_async(cfg: RunConfig) -> None:
    """trainer.async beyond sync: what it runs with in this version, each limit named with
    the way out."""
    a = async_settings(cfg.trainer)
    if a.mode == "sync":
        return
    key = f"trainer.async.mode={a.mode}"
    rules = [
        (
            a.mode != "one_step_off" or a.sync_every == 1,
            f"{key} syncs the weights every step; trainer.async.sync_every={a.sync_every} "
            "applies to fully_async (leave it at 1, or use mode=fully_async)",
        ),
        (
            a.mode != "fully_async" or a.max_staleness >= a.sync_every - 1,
            f"{key} with trainer.async.sync_every={a.sync_every} trains on samples up to "
            f"{a.sync_every - 1} steps old: trainer.async.max_staleness must be >= "
            f"{a.sync_every - 1}, got {a.max_staleness}",
        ),
        (
            cfg.distributed.nproc == 1,
            f"{key} runs one controller (its producer thread shares no process group); "
            f"distributed.nproc={cfg.distributed.nproc}: set distributed.nproc=1 or "
            "trainer.async.mode=sync",
        ),
        (
            cfg.placement.mode == "shared",
            f"{key} overlaps generation with the update, which placement.mode="
            f"{cfg.placement.mode} runs in series on pinned cores: set placement.mode=shared "
            "or trainer.async.mode=sync",
        ),
        (
            cfg.train.backend == "replica" and cfg.rollout.backend == "hf",
            f"{key} keeps a rollout-side copy of an hf policy on the replica engine; "
            f"train.backend={cfg.train.backend}, rollout.backend={cfg.rollout.backend} are "
            "not supported with it: use train.backend=replica, rollout.backend=hf or "
            "trainer.async.mode=sync",
        ),
        (
            not cfg.placement.offload_policy,
            f"{key} keeps the policy on its device while the update runs: set "
            "placement.offload_policy=false or trainer.async.mode=sync",
        ),
    ]
    for ok, message in rules:
        if not ok:
            raise ConfigError(message)
