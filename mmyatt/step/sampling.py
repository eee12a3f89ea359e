"""What a step samples: the sampling settings of its training and evaluation rollouts,
and DAPO's dynamic sampling, which keeps the prompt groups whose rewards differ and asks
for more rounds of generation until the global batch is full.

Leaves out generation and scoring themselves (``mmyatt.placement``) and the group math
(``mmyatt.algorithms.dynamic_sampling``).
"""

from __future__ import annotations

from dataclasses import replace

import torch

from mmyatt.algorithms import dynamic_sampling, flow_steps
from mmyatt.distributed import Dist
from mmyatt.protocols import Sampling
from mmyatt.rollout import Rollout
from mmyatt.step.batches import first_groups, group_index


class SamplingSchedule:
    """The ``Sampling`` of step ``step``'s training rollouts (for flow models, which
    denoising steps are stochastic and trained, ``flow_steps.train_step_schedule``) and of
    evaluation (greedy or sampled; flow models by the ODE)."""

    def __init__(
        self,
        train: Sampling,
        evaluation: Sampling,
        *,
        schedule: dict,
        trains_transitions: bool = True,
        eval_greedy: bool = True,
    ):
        self._train, self._eval, self.schedule = train, evaluation, dict(schedule)
        # DiffusionNFT keeps only the clean samples: no transition becomes an action
        self.trains_transitions = trains_transitions
        self.eval_greedy = eval_greedy

    def train(self, step: int) -> Sampling:
        sde_steps, train_steps = flow_steps.train_step_schedule(
            self._train.denoise_steps, step=step, **self.schedule
        )
        return replace(
            self._train,
            sde_steps=sde_steps,
            train_steps=train_steps if self.trains_transitions else (),
        )

    def evaluation(self, greedy: bool | None = None) -> Sampling:
        return replace(self._eval, greedy=self.eval_greedy if greedy is None else greedy)


class DynamicSampling:
    """A step's batch, round after round of generation: with ``enabled`` (DAPO) groups
    whose rewards are all equal are dropped (zero advantage, no gradient) and rounds are
    added until the controllers hold ``target`` groups between them, at most
    ``max_refill_rounds`` more; each rank then keeps its quota (``allocate_quota``).
    Without it, one round and every group."""

    def __init__(self, dist: Dist, target: int, *, enabled: bool, max_refill_rounds: int):
        self.dist, self.target = dist, target
        self.enabled, self.max_refill_rounds = enabled, max_refill_rounds
        self.begin()

    def begin(self) -> None:
        self.kept: list[Rollout] = []
        self.last: Rollout | None = None
        self.candidates = self.dropped = self.rounds = 0
        self.reward_sum = self.samples_scored = 0.0

    def keep(self, scored: Rollout) -> bool:
        """Add a round's scored rollout; True when the batch is complete."""
        self.last = scored  # gives an empty rollout its shapes if no group is kept
        self.reward_sum += float(scored.rewards.sum())
        self.samples_scored += len(scored)
        survivors: Rollout | None = scored
        if self.enabled:
            survivors, n_drop = self.drop_equal_groups(scored)
            self.dropped += n_drop
        if survivors is not None:
            self.kept.append(survivors)
            self.candidates += len(survivors.group_slices())
        global_groups = int(self.dist.sum(self.candidates).item())
        if not self.enabled or global_groups >= self.target:
            return True
        if self.rounds >= self.max_refill_rounds:
            return True
        self.rounds += 1
        return False

    def drop_equal_groups(self, r: Rollout) -> tuple[Rollout | None, int]:
        index = group_index(r)
        keep = dynamic_sampling.group_has_variance(r.rewards, index)
        # non-finite rewards must reach the step's skip check, so such groups stay
        keep[index[~torch.isfinite(r.rewards)]] = True
        idx = [i for i, g in enumerate(index.tolist()) if keep[g]]
        n_drop = int((~keep).sum())
        return (r.select(idx) if idx else None), n_drop

    def batch(self) -> tuple[Rollout | None, dict[str, float]]:
        """This rank's share of the batch (None when no rank kept a group) and the
        dynamic-sampling metrics."""
        counts = self.dist.gather_ints(self.candidates)
        quota = dynamic_sampling.allocate_quota(counts, self.target)[self.dist.rank]
        # a rank may keep no group while others do: it still takes part in every collective
        # of the step, with an empty (N = 0) rollout of the right shapes
        rollout = first_groups(self.kept or [self.last], quota)
        total = self.dist.sum_many(
            {
                "kept_groups": quota,
                "dropped_groups": self.dropped,
                "candidate_groups": self.candidates,
                "reward_sum": self.reward_sum,
                "samples_scored": self.samples_scored,
            }
        )
        # every generated sample, before dynamic-sampling filters: the learning curve
        dyn = {
            "reward/generated_mean": total["reward_sum"] / max(total["samples_scored"], 1.0),
            "dynamic/refill_rounds": float(self.rounds),
        }
        if self.enabled:
            dyn.update(
                {
                    "dynamic/kept_groups": total["kept_groups"],
                    "dynamic/dropped_groups": total["dropped_groups"],
                    # candidates beyond the quota (refill overshoot)
                    "dynamic/discarded_groups": total["candidate_groups"] - total["kept_groups"],
                }
            )
        if int(self.dist.sum(quota).item()) == 0:
            return None, dyn
        return rollout, dyn
