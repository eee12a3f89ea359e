"""The update of a step: PPO epochs x minibatches, each minibatch one optimizer step on
every controller, gradients summed over the controllers by the training engine.

The loss is the object handed in (``mmyatt.step.policy_loss``); the trainer divides its
numerator by the global denominator (summed over the controllers before any forward:
it needs only the masks), sums its statistics over the controllers, clips the global
gradient norm and steps, and never applies a NaN/inf update. With
``micro_batch_tokens`` a minibatch's backward runs micro-batch by micro-batch, each
numerator over the minibatch's global denominator, so the gradients add up to the
one-pass update's.

Leaves out the loss math (``mmyatt.algorithms``), how a minibatch is cut
(``mmyatt.step.batches``), the padding of ranks whose passes are collectives
(``mmyatt.distributed.Lockstep``) and how gradients become global (the engines).
"""

from __future__ import annotations

import math

import torch

from mmyatt.distributed import Dist
from mmyatt.protocols import EMA, capable
from mmyatt.rollout import Rollout
from mmyatt.step.batches import MicroBatches, Minibatches
from mmyatt.step.lr_schedule import cosine_factor
from mmyatt.step.policy_loss import PolicyLoss

SKIPPED = "step/skipped_nonfinite_loss_minibatches"


class Trainer:
    def __init__(
        self,
        policy,
        engine,
        dist: Dist,
        minibatches: Minibatches,
        micro_batches: MicroBatches,
        *,
        lr: float,
        betas: tuple[float, float],
        weight_decay: float,
        grad_clip: float,
        warmup_steps: int = 0,
        schedule: str = "constant",
        total_steps: int = 1,
        epochs: int = 1,
        ema_decay: float | None = None,
    ):
        self.policy, self.engine, self.dist = policy, engine, dist
        self.minibatches, self.micro_batches = minibatches, micro_batches
        self.grad_clip, self.epochs, self.ema_decay = grad_clip, epochs, ema_decay
        self.warmup_steps, self.total_steps = warmup_steps, max(total_steps, 1)
        self.floor = 0.0 if schedule == "cosine" else 1.0
        self.params = [p for p in policy.module().parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(
            self.params, lr=lr, betas=betas, weight_decay=weight_decay
        )
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, self.lr_factor)

    def lr_factor(self, step: int) -> float:
        """The shared schedule (mmyatt/step/lr_schedule.py): linear warm-up over
        ``warmup_steps``, then constant, or a cosine to 0 at the run's last step."""
        return cosine_factor(step, self.total_steps, warmup=self.warmup_steps, floor=self.floor)

    def update(self, r: Rollout, loss: PolicyLoss, step: int) -> dict[str, float]:
        """PPO epochs x minibatches of ``r``, each one optimizer step on every rank; the
        metrics averaged over the optimizer steps."""
        totals: dict[str, float] = {}
        steps = skipped = 0
        for _ in range(self.epochs):
            for mb in self.minibatches.split(r):
                self.optimizer.zero_grad(set_to_none=True)
                # the same keys on every rank, whether or not this rank has samples in mb
                local = dict.fromkeys(("tokens", "den", "num", *loss.metrics, "kl"), 0.0)
                parts = self.micro_batches.parts(mb)  # every row at once, or micro-batches
                # the global denominator first (masks only): each part's numerator over it
                # adds up to the one-pass loss
                den = float(self.dist.sum(loss.denominator(mb) if any(parts) else 0.0))
                stats: dict[str, float] | None = {}  # no rank has a counted action
                if den > 0:
                    if self.micro_batches.active:
                        local["micro_batches"] = float(sum(1 for rows in parts if rows))
                    # a rank without rows still runs the loss: the zero-weight pass a
                    # sharded engine needs
                    for rows in parts or [[]]:
                        part = _rows(mb, rows)
                        with self.micro_batches.timed(part):  # placement.balance's model
                            num, sums = loss(self.policy, part, step)
                            _add(local, sums)
                            if num is not None:
                                (num / den).backward()
                    stats = self._optimizer_step(local, loss)
                if stats is None:
                    skipped += 1
                    continue
                steps += 1
                for k, v in stats.items():
                    totals[k] = totals.get(k, 0.0) + v
        # the gradients are not needed again before the next update: on a GPU their
        # memory (the size of the trained weights) is free for generation and the judge
        self.optimizer.zero_grad(set_to_none=True)
        out = {k: v / max(steps, 1) for k, v in totals.items()}
        out["train/optimizer_steps"] = float(steps)
        out["train/lr"] = self.scheduler.get_last_lr()[0]
        if skipped:
            out[SKIPPED] = float(skipped)
        out.update(self.minibatches.report(self.dist))  # idle at the all-reduce, balancing
        return out

    def _optimizer_step(self, local: dict[str, float], loss: PolicyLoss) -> dict | None:
        """The summed gradients applied (their global norm clipped) and the minibatch's
        metrics; None, and nothing applied, when the loss or the gradient is not finite."""
        self.dist.wait_for_slowest()  # this rank's idle time at the all-reduce, timed
        g = self.dist.sum_many(local)
        grad_norm = self.engine.reduce_and_clip(self.params, self.grad_clip)
        if self.dist.any(not (math.isfinite(g["num"]) and torch.isfinite(grad_norm))):
            self.optimizer.zero_grad(set_to_none=True)  # never apply a NaN/inf update
            return None
        self.optimizer.step()
        self.scheduler.step()
        if capable(self.policy, EMA) and self.ema_decay is not None:
            self.policy.ema_update(self.ema_decay)
        tok = max(g["tokens"], 1.0)
        out = {"train/loss": g["num"] / g["den"], "train/grad_norm": float(grad_norm)}
        out.update({name: g[k] / tok for k, name in loss.metrics.items()})
        if "micro_batches" in g:  # summed over the controllers
            out["train/micro_batches"] = g["micro_batches"]
        return out


def _rows(mb: Rollout | None, rows: list[int]) -> Rollout | None:
    """The samples ``rows`` of ``mb`` (``mb`` itself when they are all of it, in order);
    None for no rows."""
    if not rows:
        return None
    return mb if rows == list(range(len(mb))) else mb.select(rows)


def _add(local: dict[str, float], sums: dict[str, float]) -> None:
    for k, v in sums.items():
        local[k] += v
