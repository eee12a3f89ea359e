"""Placement mappings: which cores each role holds in each mode, checked before start.

A mapping that cannot work fails in ``load_config`` (so before data, models, judges or
controllers start) with a message that says what does not add up: more cores than this
machine lets the run use, a split that leaves rollout or the judge nothing, a judge
that must be pinned but is not started with the run.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

from mmyatt.config.checks import register_check
from mmyatt.config.errors import ConfigError
from mmyatt.config.schema import PlacementConfig, RunConfig, to_dict

# placement/mode_id in the metrics: the mode a step ran in, as a number
MODE_IDS = {"shared": 0, "colocate": 1, "partial": 2}


def allowed_cores() -> list[int]:
    """The CPU cores this process may run on (its affinity mask), sorted."""
    return sorted(os.sched_getaffinity(0))


@dataclass(frozen=True)
class CorePlan:
    """Core sets per role for one mode. Phases run in series (colocate) or rollout and
    judge at once on disjoint sets (partial); training always holds ``train``."""

    mode: str
    cores: tuple[int, ...]
    rollout: tuple[int, ...]
    judge: tuple[int, ...]
    train: tuple[int, ...]

    @property
    def split(self) -> str:
        """``rollout:judge`` core counts while generating ("2:2" in colocate: in series)."""
        return f"{len(self.rollout)}:{len(self.judge)}"


def run_cores(p: PlacementConfig, available: list[int] | None = None) -> tuple[int, ...]:
    """``placement.cores`` checked against the cores this process may use (all of them
    when empty)."""
    avail = allowed_cores() if available is None else sorted(available)
    if not p.cores:
        return tuple(avail)
    if len(set(p.cores)) != len(p.cores):
        raise ConfigError(f"placement.cores={list(p.cores)} names a core twice")
    missing = [c for c in p.cores if c not in avail]
    if missing:
        raise ConfigError(
            f"placement.cores={list(p.cores)} names core(s) {missing}, but this process may "
            f"run on cores {avail} ({len(avail)} cores): more cores than exist here"
        )
    return tuple(p.cores)


def partial_split(p: PlacementConfig, n: int) -> tuple[int, int]:
    """(rollout cores, judge cores) for partial mode on ``n`` cores, checked."""
    if n < 2:
        raise ConfigError(
            f"placement.mode=partial runs rollout and the judge at once on disjoint cores: it "
            f"needs at least 2 cores, the run has {n}"
        )
    r, j = p.rollout_cores, p.judge_cores
    if r == 0 and j == 0:
        r = (n + 1) // 2
    if r == 0:
        r = n - j
    if j == 0:
        j = n - r
    if r + j > n:
        raise ConfigError(
            f"placement.rollout_cores ({r}) + placement.judge_cores ({j}) = {r + j} cores, "
            f"but the run has {n}: more cores than exist"
        )
    if j <= 0:
        raise ConfigError(
            f"placement.mode=partial gives the judge nothing: rollout_cores={r} takes all "
            f"{n} cores; lower placement.rollout_cores or set placement.judge_cores"
        )
    if r <= 0:
        raise ConfigError(
            f"placement.mode=partial gives rollout nothing: judge_cores={j} takes all {n} cores"
        )
    return r, j


def make_plan(mode: str, cores: tuple[int, ...], rollout: int = 0, judge: int = 0) -> CorePlan:
    """The core sets of ``mode`` on ``cores``; partial takes ``rollout`` + ``judge`` cores."""
    if mode == "partial":
        return CorePlan(mode, cores, cores[:rollout], cores[rollout : rollout + judge], cores)
    return CorePlan(mode, cores, cores, cores, cores)


def releases_judge(p: PlacementConfig) -> bool:
    """Whether the run's steps may drop the judge's weights (colocate's phases, or partial
    ones with ``partial_release_judge``): its servers then settle before they serve."""
    colocates = p.mode in ("colocate", "auto") and p.release_judge
    return colocates or (p.mode in ("partial", "auto") and p.partial_release_judge)


def plan_for(cfg: RunConfig, available: list[int] | None = None) -> CorePlan | None:
    """The static plan of a run (None for shared; auto's starting plan is colocate)."""
    p = cfg.placement
    if p.mode == "shared":
        return None
    cores = run_cores(p, available)
    if p.mode == "partial":
        return make_plan("partial", cores, *partial_split(p, len(cores)))
    return make_plan("colocate", cores)


def candidate_plans(cfg: RunConfig, available: list[int] | None = None) -> list[CorePlan]:
    """What auto chooses from: shared (nothing pinned), colocate, and partial at every
    split of the cores."""
    cores = run_cores(cfg.placement, available)
    plans = [make_plan("shared", cores), make_plan("colocate", cores)]
    plans += [make_plan("partial", cores, r, len(cores) - r) for r in range(1, len(cores))]
    return plans


def work_key(cfg: RunConfig) -> str:
    """What one step does, as text: the sections that set its generation, judging and
    training work and who runs it (model, sampling, rollout, reward, algorithm, train,
    distributed, placement, the prompts per step). Auto keeps it with its measurements:
    a run resumed with other work (longer completions, a judge added) knows its
    measurements are of different work. Steps, budgets, logging and checkpoints are not
    in it."""
    work = {k: to_dict(getattr(cfg, k)) for k in _WORK_SECTIONS}
    for k in _CHOOSER:  # how auto chooses, not what a step does
        work["placement"].pop(k, None)
    work["prompts_per_step"] = cfg.data.prompts_per_step
    work["threads"] = cfg.trainer.threads
    return json.dumps(work, sort_keys=True, default=str)


_WORK_SECTIONS = (
    "model", "sampling", "rollout", "reward", "algorithm", "train", "distributed", "placement",
)  # fmt: skip
_CHOOSER = (
    "mode", "profile_steps", "profile_all_modes", "reevaluate_every", "drift_threshold",
    "explore_margin", "log_memory",
)  # fmt: skip


@register_check
def check_placement(cfg: RunConfig, available: list[int] | None = None) -> None:
    """Every check of the placement section past its fields' own ranges (run by
    ``load_config``); raises ConfigError naming the key."""
    p = cfg.placement
    check_over_dispatch(cfg)
    if p.merge_rollout:
        check_merge_rollout(cfg)
    if p.offload_policy:
        if p.mode not in ("colocate", "auto"):
            raise ConfigError(
                f"placement.offload_policy=true moves the policy off the device in colocate "
                f"steps, and placement.mode={p.mode} has none: use colocate or auto"
            )
        if cfg.train.backend != "replica":
            raise ConfigError(
                f"placement.offload_policy=true with train.backend={cfg.train.backend}: "
                "moving a sharded policy off the device is not implemented; it "
                "moves a whole module: use train.backend=replica"
            )
    if p.partial_release_judge and p.mode not in ("partial", "auto"):
        raise ConfigError(
            f"placement.partial_release_judge=true drops the judge's weights while partial "
            f"steps train, and placement.mode={p.mode} has none: use partial or auto"
        )
    if p.mode == "shared":
        if p.cores or p.rollout_cores or p.judge_cores:
            raise ConfigError(
                "placement.cores / rollout_cores / judge_cores are set but placement.mode="
                "shared pins nothing; choose placement.mode colocate, partial or auto"
            )
        return
    cores = run_cores(p, available)
    judge = cfg.reward.judge
    uses_judge = any(f.name == "genrm" for f in cfg.reward.functions)
    if p.partial_release_judge and not uses_judge:
        raise ConfigError(
            "placement.partial_release_judge=true, but no reward.functions entry is genrm: "
            "there is no judge to release"
        )
    if p.mode in ("partial", "auto") and uses_judge and judge.model is None:
        raise ConfigError(
            f"placement.mode={p.mode} pins the judge to its cores, so the judge must be "
            "started with the run (reward.judge.model); a judge at reward.judge.urls runs "
            "elsewhere: use placement.mode=shared or colocate"
        )
    if p.mode == "partial":
        partial_split(p, len(cores))
    elif p.rollout_cores or p.judge_cores:
        if p.mode == "colocate":
            raise ConfigError(
                "placement.rollout_cores / judge_cores split the cores in partial mode; "
                "colocate gives every phase all of placement.cores"
            )
        partial_split(p, len(cores))  # auto: the split it starts partial with
    if p.mode in ("partial", "auto"):
        z = [f.name for f in cfg.reward.functions if f.zscore]
        if z:
            raise ConfigError(
                f"placement.mode={p.mode} scores each finished group as it comes, but "
                f"reward.functions {z} use zscore, which standardises over the whole batch; "
                "drop zscore or use placement.mode=colocate"
            )


def check_merge_rollout(cfg: RunConfig) -> None:
    """placement.merge_rollout: the first controller generates for all of them in
    partial steps, so every controller's policy must be a whole replica it can run alone,
    and the records it is sent must be small (text)."""
    p, why = cfg.placement, None
    if p.mode not in ("partial", "auto"):
        why = f"it merges partial steps' generation, and placement.mode={p.mode} has none"
    elif cfg.model.kind != "text":
        why = (
            f"it sends each controller's records to the first one, and model.kind="
            f"{cfg.model.kind} records hold media, which never leave their controller"
        )
    elif cfg.train.backend != "replica":
        why = (
            f"the first controller generates alone, and train.backend={cfg.train.backend} "
            "shards the policy over the controllers (every one must join its forward)"
        )
    elif cfg.rollout.backend != "hf":
        why = f"rollout.backend={cfg.rollout.backend} serves its own batches"
    elif cfg.rollout.over_dispatch_ratio > 1:
        why = "over-dispatch cuts each controller's generate call to its own prompt groups"
    if why:
        raise ConfigError(f"placement.merge_rollout=true cannot run here: {why}")


def check_over_dispatch(cfg: RunConfig) -> None:
    """rollout.over_dispatch_ratio with the rest of the run (mmyatt/placement/dispatch.py;
    its range and max_carries' are the fields' own)."""
    ro = cfg.rollout
    if ro.redraw_carried and (ro.over_dispatch_ratio <= 1 or not ro.reuse_unused_prompts):
        raise ConfigError(
            "rollout.redraw_carried=true redraws the prompts over-dispatch carries, and this "
            f"run carries none (rollout.over_dispatch_ratio={ro.over_dispatch_ratio}, "
            f"rollout.reuse_unused_prompts={ro.reuse_unused_prompts}): set "
            "over_dispatch_ratio > 1 with reuse_unused_prompts=true, or drop redraw_carried"
        )
    if cfg.placement.balance and cfg.model.kind == "vlm" and cfg.train.backend != "replica":
        raise ConfigError(
            "placement.balance for a VLM runs each controller's vision tower over its own "
            f"media, which a sharded policy (train.backend={cfg.train.backend}) cannot do "
            "alone: every rank would have to join each forward; use train.backend=replica"
        )
    if cfg.placement.balance and cfg.model.kind == "vlm" and not cfg.model.freeze:
        raise ConfigError(
            "placement.balance moves a VLM sample's vision features between controllers, "
            "never its pixels, so the vision tower must be frozen: set model.freeze: "
            "[model.visual] (or placement.balance=false)"
        )
    if ro.over_dispatch_ratio > 1 and cfg.model.kind == "flow":
        raise ConfigError(
            f"rollout.over_dispatch_ratio={ro.over_dispatch_ratio} stops decoding once the "
            "batch's groups are complete, which text and VLM policies do (model.kind="
            f"{cfg.model.kind}); a flow model runs every sample through the same denoising "
            "steps: there is no long tail to cut"
        )
