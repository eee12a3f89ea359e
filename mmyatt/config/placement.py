"""Who runs where at each phase of a step (the plans themselves: mmyatt/placement)."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from mmyatt.config.section import Bool, Float, Int, Section


class PlacementConfig(Section):
    """Who runs where at each phase of a step (mmyatt/placement, docs/placement.md): shared
    (nothing pinned), colocate (phases in series, each on every core, idle models
    released), partial (rollout beside the judge), auto (chosen from measured costs)."""

    mode: Literal["shared", "colocate", "partial", "auto"] = "shared"
    cores: tuple[Annotated[Int, Field(ge=0)], ...] = ()
    """CPU core ids the run may use; empty: every allowed core"""
    rollout_cores: Int = Field(0, ge=0)
    """partial: cores rollout holds while it generates (0: half)"""
    judge_cores: Int = Field(0, ge=0)
    """partial: cores the judge holds meanwhile (0: the rest)"""
    stream_groups: Int = Field(1, ge=1)
    """partial: flow models, vLLM and over-dispatch generate chunks of this many groups and
    send each to the judge when done (text and VLM stream each sample as it finishes)"""
    widen_judge: Bool = True
    """partial: once every controller has generated, the judge takes every core of the run"""
    stream_max_samples: Int = Field(8, ge=0)
    """partial: at most this many samples per judge call while generating (0: all waiting)"""
    merge_rollout: Bool = False
    """partial, text, several controllers: the first generates every controller's groups in
    one batch and streams them to the judge; each gets its own back (docs/placement.md)"""
    release_judge: Bool = True
    """colocate: drop the judge's weights outside its phase"""
    partial_release_judge: Bool = False
    """partial: the judge drops its weights while training takes everything (reloaded next
    step)"""
    offload_policy: Bool = False
    """colocate, GPU: idle policy off the device (placement/offload.py)"""
    judge_threads: Int = Field(-1, ge=-1)
    """colocate: judge's threads (-1: measured, 1 or all; 0: one per core)"""
    profile_steps: Int = Field(2, ge=1)
    """auto: steps measured in its starting mode before choosing"""
    profile_all_modes: Bool = False
    """auto: profile colocate, then partial (with a judge), instead of starting in shared and
    measuring a plan only where its optimistic prediction wins (placement/auto.py)"""
    reevaluate_every: Int = Field(10, ge=1)
    """auto: steps between re-evaluations"""
    drift_threshold: Float = Field(0.25, gt=0)
    """auto: re-evaluate when a phase cost moves this much"""
    explore_margin: Float = Field(0.15, ge=0, lt=1)
    """auto: how much faster a role may run alone than it was measured beside the other one
    (partial); a plan that could then beat the best by 3% is measured, not just predicted"""
    log_memory: Bool = True
    """per-phase peak RSS, and device MB on CUDA (placement/peak_*); in shared mode a
    judge's counters are read only when the run starts it (not at reward.judge.urls)"""
    balance: Bool = False
    """move whole prompt groups between the controllers before the update so that the
    slowest rank's update is shorter (balance_when); only token / latent tensors move
    (mmyatt/placement/exchange.py); or prompt records before generation (balance_at)"""
    balance_at: Literal["update", "dispatch"] = "update"
    """balance: where groups move. update: generated groups, before the update (the
    update alone is balanced); dispatch: prompt records, before generation, planned on
    each record's prompt tokens plus the token budget, so generation, scoring and the
    update are balanced (text models, without over-dispatch or merge_rollout;
    mmyatt/placement/dispatch_balance.py); the balance_when / fit / refit keys are for
    update"""
    balance_when: Literal["pays", "always"] = "pays"
    """balance: move groups only when the cost model (fitted on this run's measured
    micro-batch times) predicts an update shorter by more than the exchange costs and
    the model's recent error (pays), or every step by token counts (always);
    mmyatt/placement/balancer.py"""
    balance_fit_steps: Int = Field(2, ge=1)
    """balance: steps measured (nothing moves) before the cost model is first fitted"""
    balance_refit_error: Float = Field(0.15, gt=0)
    """balance: refit the cost model when its prediction of a rank's update is off by more
    than this fraction"""
