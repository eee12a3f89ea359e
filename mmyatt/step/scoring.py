"""A step's rewards: the reward function called on a rollout's outputs, every controller
stopping together when a judge stays down, and DAPO's soft overlong penalty added to the
reward. Placement calls it however the mode in force scores (after generation, or
streamed while generation runs).

Leaves out what a reward computes (``mmyatt.rewards``) and when it runs
(``mmyatt.placement``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mmyatt.algorithms import overlong
from mmyatt.distributed import Dist
from mmyatt.rewards.mixture import RewardMixture
from mmyatt.rollout import Rollout
from mmyatt.serving.client import JudgeError


@dataclass(frozen=True)
class OverlongPenalty:
    """``algorithm.overlong: penalty``: 0 up to ``max_len - buffer`` actions, then down to
    ``-penalty`` at ``max_len`` (``overlong.overlong_penalty``)."""

    max_len: int
    buffer: int
    penalty: float


class Scorer:
    def __init__(self, reward, dist: Dist, penalty: OverlongPenalty | None = None):
        self.reward, self.dist, self.penalty = reward, dist, penalty
        # the judges' answers, for the rollout log (only a mixture with GenRM terms has them)
        self.keeps_verdicts = isinstance(reward, RewardMixture)

    @property
    def compares_groups(self) -> bool:
        """A sample's reward depends on its group's other samples (pairwise GenRM): it is
        scored with its whole group."""
        return not self.keeps_verdicts or self.reward.compares_groups

    def __call__(self, outputs, records, prompt_ids) -> tuple[torch.Tensor, dict]:
        """The reward function itself: ((N,) rewards, {part: (N,)})."""
        return self.reward(outputs, records, prompt_ids)

    def verdicts(self) -> list[dict]:
        """The judges' verdicts of the last call, per sample ([] without a judge)."""
        return list(self.reward.last_verdicts) if self.keeps_verdicts else []

    def score(self, r: Rollout) -> Rollout:
        """``r`` with its rewards. A judge that stays down past its client's retry budget
        stops every controller at the same point (all raise JudgeError), none is left
        waiting in a collective."""
        error = None
        try:
            scored = self.reward(r.outputs, r.records, r.prompt_ids)
        except JudgeError as e:
            error, scored = e, None
        self.agree(error)
        return self.finish(r, scored)

    def agree(self, error: BaseException | None) -> None:
        """Raise on every controller if the judge calls of any one failed (a collective)."""
        if error is not None and not isinstance(error, JudgeError):
            raise error
        if self.dist.any(error is not None):
            if error is not None:
                raise error
            raise JudgeError("the judge calls of another controller failed (see its error)")

    def finish(self, r: Rollout, scored: tuple, verdicts: list[dict] | None = None) -> Rollout:
        """``r`` with ``scored`` = (rewards, parts) from the reward function, the overlong
        penalty added, and the judges' verdicts (``verdicts``: those of every streamed
        call, in row order; else the last call's)."""
        rewards, parts = scored
        if self.penalty is not None:
            p = self.penalty
            lengths = r.mask.sum(1).long()
            pen = overlong.overlong_penalty(lengths, p.max_len, p.buffer, p.penalty)
            parts = {**parts, "overlong_penalty": pen}
            rewards = rewards + pen
        r.rewards, r.reward_parts = rewards.float(), parts
        if self.keeps_verdicts:
            r.verdicts = self.reward.last_verdicts
        if verdicts:
            r.verdicts = verdicts
        return r
