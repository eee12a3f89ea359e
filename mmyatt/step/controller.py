"""The per-rank controller: shard -> rollout -> reward -> advantage -> update.

Every training process runs one ``Controller``. It reads only its own records,
generates its own rollouts (all G samples of a prompt on this rank), scores them,
computes advantages and takes optimizer steps whose gradients are summed over all
controllers. Between controllers travel gradients, scalar metrics and counts only.
Reading ``step`` top to bottom is reading the algorithm: collect, advantages, update.

What this file deliberately leaves out: process start-up and the run loop
(``mmyatt.step.run``, ``mmyatt.step.loop``), config -> objects (``mmyatt.step.builders``:
every object here is handed its plain settings, none reads the run config), the math
(``mmyatt.algorithms``), anything modality-specific (the adapters in ``mmyatt.models``),
who runs where and how generation and scoring overlap (``mmyatt.placement``), the
losses (``mmyatt.step.policy_loss``), the optimizer steps (``mmyatt.step.trainer``),
dynamic sampling (``mmyatt.step.sampling``), rewards (``mmyatt.step.scoring``) and the
held-out evaluation (``mmyatt.step.evaluation``).

Equivalence across world sizes: a prompt's samples come from a generator seeded by
(seed, epoch, record index), the loss is normalised by global counts and gradients
are summed, so P controllers on 1/P of the data each take the same optimizer steps
as one controller on all of it (``tests/test_controller.py`` checks this).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from mmyatt.algorithms.advantages import Advantages
from mmyatt.checkpoint.checkpointer import (
    load_scheduler_state,
    rng_state,
    scheduler_state,
    set_rng_state,
)
from mmyatt.distributed import Dist
from mmyatt.outputs.metrics import MetricsLogger, PhaseTimer
from mmyatt.outputs.rollout_log import truncate_rollouts, write_rollouts
from mmyatt.placement.runner import Placement
from mmyatt.protocols import EMA, RolloutStats, capable, require
from mmyatt.rollout import Rollout
from mmyatt.step.async_rollouts import (
    AsyncRollouts,
    AsyncSettings,
    drop_stale,
    load_weights,
    rollout_copy,
    sampling_weights,
)
from mmyatt.step.batches import MicroBatches, Minibatches, group_index
from mmyatt.step.evaluation import Evaluator
from mmyatt.step.perf import StepFlops
from mmyatt.step.policy_loss import BEHAVIOUR, BEHAVIOUR_CLIPPED, PolicyLoss
from mmyatt.step.sampling import DynamicSampling, SamplingSchedule
from mmyatt.step.trainer import SKIPPED, Trainer


class Controller:
    """One rank's step, from the objects ``mmyatt.step.builders.build_controller`` makes:
    ``groups`` prompt groups of G = ``group_size`` samples per generation round;
    ``nonfinite_reward``: "skip" a step with a NaN/inf reward (counted), or "fail";
    ``async_settings``: the step's batches made ahead by a producer thread
    (``mmyatt.step.async_rollouts``), None: each step collects its own;
    ``perf``: the step's model FLOP/s and MFU (``mmyatt.step.perf``), None: not logged."""

    def __init__(
        self,
        dist: Dist,
        run_dir: Path,
        *,
        policy,
        engine,
        shard,
        placement: Placement,
        schedule: SamplingSchedule,
        dynamic: DynamicSampling,
        advantage: Advantages,
        minibatches: Minibatches,
        micro_batches: MicroBatches,
        loss: PolicyLoss,
        trainer: Trainer,
        evaluator: Evaluator,
        logger: MetricsLogger,
        groups: int,
        group_size: int,
        nonfinite_reward: str = "skip",
        rollouts_per_step: int = 0,
        async_settings: AsyncSettings | None = None,
        perf: StepFlops | None = None,
    ):
        self.dist, self.run_dir = dist, Path(run_dir)
        self.policy, self.engine, self.shard = policy, engine, shard
        self.placement, self.schedule, self.dynamic = placement, schedule, dynamic
        self.advantage, self.minibatches, self.micro_batches = advantage, minibatches, micro_batches
        self.loss, self.trainer, self.evaluator = loss, trainer, evaluator
        self.scorer = placement.scorer
        self.logger, self.perf = logger, perf
        self.groups, self.group_size = groups, group_size
        self.nonfinite_reward = nonfinite_reward
        self.rollouts_per_step = rollouts_per_step
        self.params, self.optimizer = trainer.params, trainer.optimizer
        self.step_count = 0
        self.last_rollout: Rollout | None = None
        self.consumed: list[int] = []  # manifest indices drawn in the current step
        self.counters = {"faults/nonfinite_reward_steps": 0, "faults/nonfinite_loss_steps": 0}
        self.rollouts: AsyncRollouts | None = None
        if async_settings is not None:
            self.counters["async/dropped_samples_total"] = 0
            self.rollouts = AsyncRollouts(
                async_settings,
                make_copy=lambda: rollout_copy(self.policy, self.loss.sampling),
                snapshot=lambda: sampling_weights(self.policy, self.loss.sampling),
                load=load_weights,
                collect=self._produce,
                local_state=self._data_state,
            )

    # ------------------------------------------------------------------ the step
    def step(self) -> dict[str, float]:
        """One RL step on this rank; returns globally reduced metrics."""
        # the state before the step's first draw: what a checkpoint holds when the step
        # fails before its update (a judge that stays down, see Scorer.score)
        self.step_start_local = self.local_state()
        timer = PhaseTimer()
        self.consumed, self.last_rollout = [], None  # a skipped step logs no rollout

        # collect: generate + reward, as the placement mode says (+ DAPO refill rounds);
        # with trainer.async, the batch the producer made ahead
        if self.rollouts is None:
            with self.loss.sampling():  # the policy that samples (DiffusionNFT: its old copy)
                rollout, dyn, self.consumed = self._collect(self.step_count, timer)
        else:
            rollout, dyn = self._take(timer)
        if rollout is None:  # every group everywhere had equal rewards (or was too stale)
            return self._end_step({**dyn, **timer.metrics()})
        if self.dist.any(not torch.isfinite(rollout.rewards).all()):
            self.counters["faults/nonfinite_reward_steps"] += 1
            if self.nonfinite_reward == "fail":
                raise FloatingPointError("non-finite reward in this step (reward.nonfinite=fail)")
            return self._end_step({**dyn, **timer.metrics(), "step/skipped_nonfinite_reward": 1.0})

        # advantages
        with timer("advantage"):
            rollout.advantages = self.advantage(rollout.rewards, group_index(rollout))

        # update: (placement.balance: samples re-partitioned over the controllers first)
        train, bal = self.minibatches.balance(rollout, timer)
        with timer("logprob"):
            train = self.loss.prepare(self.policy, train, self.micro_batches)
        with timer("update"):
            upd = self.trainer.update(train, self.loss, self.step_count)
            upd.update(self.loss.after_update(self.step_count + 1))
        if SKIPPED in upd:
            self.counters["faults/nonfinite_loss_steps"] += 1
        self.last_rollout = train if not self.minibatches.balanced else rollout  # this rank's
        metrics = rollout_metrics(rollout, self.dist, self.policy)
        if self.rollouts is not None:
            metrics.update(behaviour_metrics(train))
        if self.perf is not None:  # model FLOP/s (and MFU) of generation and the update
            metrics.update(self.perf(rollout, train, timer.seconds))
        return self._end_step({**metrics, **dyn, **upd, **bal, **timer.metrics()})

    def _end_step(self, out: dict[str, float]) -> dict[str, float]:
        if self.rollouts is None:  # else the producer's, in the batch's metrics
            out.update(self.placement.end_step())
        self.step_count += 1  # counts skipped steps too: it is the loop's step number
        if self.rollouts is not None:  # version step_count, for the batches made with it
            self.rollouts.publish(self.step_count)
        return out

    def _collect(self, step: int, timer: PhaseTimer):
        """Step ``step + 1``'s batch: rounds of scored groups until dynamic sampling has
        its batch; (rollout or None, dynamic-sampling metrics, manifest indices drawn)."""
        sampling = self.schedule.train(step)
        self.dynamic.begin()
        consumed: list[int] = []
        complete = False
        while not complete:
            scored = self.placement.produce(self.groups, sampling, timer)
            consumed += [rec["_index"] for rec in scored.records[:: self.group_size]]
            complete = self.dynamic.keep(scored)
        rollout, dyn = self.dynamic.batch()
        return rollout, dyn, consumed

    def _produce(self, policy, step: int, timer: PhaseTimer):
        """The producer thread's collect phase of (1-based) ``step`` on the rollout-side
        ``policy``; with its placement metrics."""
        self.placement.policy = policy
        rollout, dyn, consumed = self._collect(step - 1, timer)
        return rollout, dyn, consumed, self.placement.end_step()

    def _take(self, timer: PhaseTimer):
        """The producer's batch of this step, samples staler than the bound dropped
        (counted); its staleness figures join the step's metrics (in ``dyn``)."""
        if not self.rollouts.started():
            self.rollouts.start(self.step_count)
        with timer("async_wait"):
            batch = self.rollouts.take(self.step_count + 1)
        self.consumed = batch.consumed
        made = batch.metrics.items()  # the producer's phases (generate, reward)
        timer.seconds.update(
            {k[7:-2]: v for k, v in made if k.startswith("timing/") and k.endswith("_s")}
        )
        dyn = {**batch.dynamic, **{k: v for k, v in batch.metrics.items() if "timing/" not in k}}
        dyn["async/version"] = float(batch.version)
        if batch.rollout is None:
            return None, dyn
        rollout, st = drop_stale(batch.rollout, self.step_count, self.rollouts.bound)
        self.counters["async/dropped_samples_total"] += int(st["async/dropped_samples"])
        return rollout, {**dyn, **st}

    # ------------------------------------------------------------------ run state
    def shared_state(self) -> dict:
        """State identical on every controller: weights, optimizer, schedule, step, counters."""
        ema = self.policy.ema_state() if capable(self.policy, EMA) else None
        return {
            "model": self.engine.model_state(self.policy),
            "optimizer": self.engine.optimizer_state(self.policy, self.optimizer),
            "scheduler": scheduler_state(self.trainer.scheduler),
            "step": self.step_count,
            "counters": dict(self.counters),
            "ema": ema,
            "nft_old": self.loss.state_dict(),
            "async": None if self.rollouts is None else self.rollouts.state_dict(self.step_count),
        }

    def local_state(self) -> dict:
        """This controller's own state: its data cursor and RNG streams. With batches made
        ahead, the cursor before the next batch's first draw (the producer's)."""
        balance = self.minibatches.state_dict()  # placement.balance's measurements
        if self.rollouts is not None and self.rollouts.started():
            return {**self.rollouts.start_state(self.step_count + 1), "rng": rng_state(), **balance}
        return {**self._data_state(), "rng": rng_state(), **balance}

    def _data_state(self) -> dict:
        local = {"cursor": self.shard.state_dict()}
        local.update(self.placement.state_dict())  # carried prompts, auto's measurements
        return local

    def load_state(self, shared: dict, local: dict) -> int:
        self.engine.load_model_state(self.policy, shared["model"])
        self.engine.load_optimizer_state(self.policy, self.optimizer, shared["optimizer"])
        load_scheduler_state(self.trainer.scheduler, shared["scheduler"])
        self.step_count = int(shared["step"])
        self.counters.update(shared["counters"])
        if shared.get("ema") is not None:
            require(self.policy, EMA, "a checkpoint with EMA weights")
            self.policy.load_ema_state(shared["ema"])
        self.loss.load_state_dict(shared.get("nft_old"))
        if self.rollouts is not None:  # the older weights the next batches are made with
            self.rollouts.load_state_dict(shared.get("async"))
        self.shard.load_state_dict(local["cursor"])
        self.placement.load_state_dict(local)
        self.minibatches.load_state_dict(local)
        set_rng_state(local["rng"])
        return self.step_count

    # ------------------------------------------------------------------ evaluation and logs
    def evaluate(self) -> dict[str, float]:
        """Held-out prompts (``mmyatt.step.evaluation``)."""
        return self.evaluator()

    @property
    def eval_outputs(self) -> list:
        """(output, prompt, reward, record) of the last evaluation on this rank."""
        return self.evaluator.outputs

    def trace_records(self, step: int) -> None:
        """Append which manifest records this step drew (the audit trail for faults)."""
        path = self.run_dir / "rollouts" / f"records_rank{self.dist.rank}.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("a") as f:
            f.write(json.dumps({"step": step, "records": self.consumed}) + "\n")

    def truncate_trace(self, step: int) -> None:
        path = self.run_dir / "rollouts" / f"records_rank{self.dist.rank}.jsonl"
        if path.exists():
            rows = [x for x in path.read_text().splitlines() if x.strip()]
            path.write_text("".join(x + "\n" for x in rows if json.loads(x)["step"] <= step))
        truncate_rollouts(self.run_dir, self.dist.rank, step)

    def save_rollouts(self, step: int, r: Rollout) -> None:
        """The rollout log (mmyatt/outputs/rollout_log.py, docs/rollout_logs.md); rank 0's rows also
        go to the trackers' rollout table."""
        rows = write_rollouts(self.run_dir, self.dist.rank, step, r, self.rollouts_per_step)
        self.logger.log_rollouts(step, rows)


def behaviour_metrics(r: Rollout) -> dict[str, float]:
    """Decoupled PPO's behaviour ratio over this rank's counted actions: its mean and the
    share that hit the cap (0 and 0 when no sample was stale)."""
    mask = r.mask
    n = max(float(mask.sum()), 1.0)
    if BEHAVIOUR not in r.context:
        return {"async/behaviour_weight_mean": 1.0, "async/behaviour_clip_frac": 0.0}
    w, hit = r.context[BEHAVIOUR].cpu(), r.context[BEHAVIOUR_CLIPPED].cpu()
    return {
        "async/behaviour_weight_mean": float((w * mask).sum()) / n,
        "async/behaviour_clip_frac": float((hit * mask).sum()) / n,
    }


def rollout_metrics(r: Rollout, dist: Dist, policy) -> dict[str, float]:
    """Reward, length, truncation and advantage figures summed over the controllers."""
    n, lengths = len(r), r.mask.sum(1)
    local = {
        "n": n,
        "reward": float(r.rewards.sum()),
        "reward_sq": float((r.rewards**2).sum()),
        "len": float(lengths.sum()),
        "trunc": float(r.truncated.sum()) if r.truncated is not None else 0.0,
        "adv_abs": float(r.advantages.abs().sum()),
    }
    for k, v in r.reward_parts.items():
        local[f"part/{k}"] = float(v.sum())
    g = dist.sum_many(local)
    n = max(g["n"], 1.0)
    mean = g["reward"] / n
    out = {
        "reward/mean": mean,
        "reward/std": math.sqrt(max(g["reward_sq"] / n - mean**2, 0.0)),
        "response_length/mean": g["len"] / n,
        "response_length/truncated_frac": g["trunc"] / n,
        "advantage/abs_mean": g["adv_abs"] / n,
        "rollout/samples": g["n"],
        "rollout/tokens": g["len"],
    }
    out.update({f"reward/{k[5:]}": v / n for k, v in g.items() if k.startswith("part/")})
    if isinstance(policy, RolloutStats):  # vLLM rollouts: TIS, weight sync, sleep
        out.update(policy.rollout_stats(r))
    return out
