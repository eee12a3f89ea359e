"""The run's schedule and records: the SFT warm start, steps and evals, checkpoints,
trackers."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BeforeValidator, Field, create_model

from mmyatt.config.section import Bool, Float, Int, Section, Str, Strings, one_or_many


class SFTConfig(Section):
    """Supervised warm start (``mmyatt sft`` and the optional ``sft`` phase of a recipe)."""

    enabled: Bool = False
    max_steps: Int = Field(3000, ge=1)
    batch_size: Int = Field(64, ge=1)
    lr: Float = Field(1e-3, gt=0)
    eval_every: Int = Field(100, ge=1)
    stop_at_accuracy: Float | None = Field(None, ge=0, le=1)
    """stop early once greedy held-out accuracy reaches it"""
    eval_prompts: Int = Field(200, ge=1)
    target_key: Str = "answer"
    check: Str | None = None
    """the reward function (a registry name, e.g. "describe_check") the stopping check
    scores with; None: the run's reward (which cannot hold a judge: none runs yet)"""
    data: Str | None = None
    """JSONL the warm start trains on; None: data.train (synthetic:describe fills in its
    sft.jsonl, which, like the flow recipes' base models, sees every combination)"""
    threads: Int = Field(1, ge=1)
    """SFT runs once, in the launching process, before controllers start"""
    freeze: Strings | None = None
    """parameter-name prefixes frozen in SFT only; None: model.freeze (e.g. [] trains a VLM's
    vision tower on the warm start's data while RL keeps model.freeze's [model.visual])"""


class AsyncConfig(Section):
    """Rollouts made ahead of the update (docs/async.md): a producer thread generates and
    scores the next steps' batches with a rollout-side copy of the policy while the
    trainer updates; the loss is decoupled PPO (proximal log-probs recomputed, the
    behaviour ratio capped at rollout.is_cap)."""

    mode: Literal["sync", "one_step_off", "fully_async"] = "sync"
    """sync: each step waits for its own rollouts; one_step_off: step t trains on rollouts
    made with the weights after step t-2 (synced every step); fully_async: up to
    max_staleness steps ahead, weights synced every sync_every steps"""
    max_staleness: Int = Field(1, ge=0)
    """a sample made with weights this many updates older than the trainer's is the oldest
    that may reach the loss (older ones are dropped and counted); 0: the synchronous step"""
    sync_every: Int = Field(1, ge=1)
    """fully_async: the rollout side takes the trainer's weights every N steps (needs
    max_staleness >= N - 1); one_step_off syncs every step"""


class _TrainerFields(Section):
    steps: Int = Field(100, ge=1)
    """RL steps (one batch of data.prompts_per_step prompts each)"""
    max_minutes: Float | None = Field(None, gt=0)
    """stop training (then evaluate) after this wall time"""
    eval_every: Int = Field(0, ge=0)
    """0: only at the start and the end"""
    log_every: Int = Field(1, ge=1)
    seed: Int = Field(0, ge=0)
    """the base of every seed: torch's, each record's generation seed, the synthetic data
    and the tiny built-in model"""
    threads: Int = Field(1, ge=1)
    """torch threads per controller"""
    save_rollouts_every: Int = Field(10, ge=0)
    """steps between rollout logs (rollouts/rank<r>.jsonl); 0: none"""
    rollouts_per_step: Int = Field(64, ge=1)
    """at most this many samples per controller per logged step: whole prompt groups, in
    the order drawn, until the next group would pass it (at least one group)"""
    progress: Bool = True
    eval_sampling: Literal["greedy", "sample"] = "greedy"
    """sample: at the training temperature, and greedy accuracy is logged as
    eval/greedy_accuracy too"""


# ``async`` is a Python keyword: the field is added by name (read it with
# ``async_settings(cfg.trainer)``)
TrainerConfig = create_model(
    "TrainerConfig",
    __base__=_TrainerFields,
    __module__=__name__,
    __doc__=None,
    **{
        "async": (
            AsyncConfig,
            Field(default_factory=AsyncConfig, description="rollouts made ahead of the update"),
        )
    },
)


def async_settings(trainer) -> AsyncConfig:
    """``trainer.async`` of a TrainerConfig."""
    return getattr(trainer, "async")


class CheckpointConfig(Section):
    save_every: Int = Field(0, ge=0)
    """steps between run-state checkpoints; 0 = none (final export only)"""
    keep_last: Int = Field(2, ge=1)
    keep_every: Int = Field(0, ge=0)
    """also keep every step divisible by this (0 = none)"""
    async_save: Bool = True
    resume: Str = "auto"
    """auto | never | a checkpoint directory"""
    export_every: Int = Field(0, ge=0)
    """also write the policy in HF layout every N steps (0: only at the end)"""


class LoggingConfig(Section):
    """Trackers besides metrics.jsonl (mmyatt/outputs/trackers.py): scalars, eval sample grids and
    a table of logged rollouts. Each is optional; one requested but not installed fails
    at start with the command that installs it."""

    trackers: Annotated[
        tuple[Literal["tensorboard", "wandb", "mlflow"], ...], BeforeValidator(one_or_many)
    ] = ("tensorboard",)
    project: Str = "mmyatt"
    """wandb project, mlflow experiment"""
    offline: Bool = True
    """wandb: mode=offline (`wandb sync` later); mlflow: local file store"""
    mlflow_uri: Str | None = None
    """None: a file store in <run dir>/mlruns"""
