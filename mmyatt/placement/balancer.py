"""When and how ``placement.balance`` moves prompt groups: a plan per step from the cost
model of what each rank's update runs (``cost_model.py``), fitted on this run's own
measured micro-batch times, and a decision whether the move pays.

Each step, every rank sends the shapes of its groups (rows, widths, vision patches,
transitions) to every other; rank 0 plans and broadcasts the plan, so every rank acts
on one decision. With ``placement.balance_when: pays`` the plan is a local search over
moves and swaps of whole groups between ranks (started from the ranks' holdings and
from Karmarkar-Karp on each group's own cost) that minimises the slowest rank's
predicted update plus the predicted time of moving the groups; it is applied only when
the predicted gain over keeping the groups where they are beats the exchange's own
predicted time (fitted on measured exchanges, a fixed part and a part per element
moved; before the first one is measured a positive gain is tried once) plus the
model's own recent error on the update it predicts (the mean of the last ``RECENT``
steps' ``balance/model_error`` times the predicted update with the groups held: a gain
smaller than the model's error is noise, and moving for it costs the exchange and the
bucketed passes), and only while
the steps that moved groups measure a shorter update than the steps that did not, each
over its own predicted update with the groups held (``_measured_check``). During the
first ``placement.balance_fit_steps`` steps nothing moves: the update is measured and
the model fitted (the first step, a warm-up, is not used). After every update the
model's prediction of each rank's time is compared with the measured time, and the
model is refitted when they differ by more than ``placement.balance_refit_error``.
``balance_when: always`` moves groups every step by Karmarkar-Karp on token counts.

Logged: ``balance/applied``, ``balance/predicted_gain_s``, ``balance/predicted_exchange_s``,
``balance/predicted_s`` / ``balance/measured_s`` (slowest rank; per rank with
``/rank{i}``), ``balance/model_error`` (largest relative error over ranks),
``balance/predicted_margin_s`` (the model's recent error on the held update),
``balance/refit``, ``balance/exchange_s``, ``balance/realized_s`` (the update as it ran,
from the plan to the end); and on every multi-controller run the wait
at the gradient all-reduce, ``dist/idle_s/rank{i}`` and ``dist/idle_s`` (summed).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, field, replace

import numpy as np
import torch
import torch.distributed as tdist

from mmyatt.placement.balance import assign_parts, karmarkar_karp, max_over_mean
from mmyatt.placement.cost_model import (
    CostModel,
    GroupShape,
    cut,
    features,
    group_shapes,
    nnls,
    rank_seconds,
)
from mmyatt.rollout import Rollout

logger = logging.getLogger(__name__)

WHEN = ("pays", "always")
WINDOW = 400  # observations kept for fitting (the latest)
RECENT = 5  # steps of each kind (moved, held) whose measured update decides
RETRY = 10  # steps without moving, against the model's advice, before moving again once


@dataclass
class Plan:
    """Where each group of each minibatch trains (``dest[j][g]``: a rank, groups of every
    rank in rank order) when ``applied``; the stats to log."""

    applied: bool
    dest: list[list[int]] = field(default_factory=list)
    owner: list[list[int]] = field(default_factory=list)
    stats: dict[str, float] = field(default_factory=dict)
    predicted: list[float] | None = None  # per rank, seconds (None: model not fitted)
    moved_elements: float = 0.0
    held_slowest: float = 0.0  # predicted update with the groups where they are


@dataclass
class Settings:
    when: str = "pays"
    fit_steps: int = 2
    refit_error: float = 0.15
    epochs: int = 1
    budget: int = 0  # algorithm.micro_batch_tokens


def balance_settings(cfg) -> Settings:
    """The balancer's settings from a run config (``placement.balance_*``, the update's
    epochs and micro-batch budget)."""
    p, a = cfg.placement, cfg.algorithm
    return Settings(
        p.balance_when,
        p.balance_fit_steps,
        p.balance_refit_error,
        a.ppo_epochs,
        a.micro_batch_tokens,
    )


class Balancer:
    def __init__(self, dist, kind: str, settings: Settings, choose_tokens: Callable):
        if settings.when not in WHEN:
            raise ValueError(f"placement.balance_when={settings.when!r}; expected one of {WHEN}")
        self.dist, self.kind, self.s = dist, kind, settings
        self.choose_tokens = choose_tokens  # (costs, owner, P) -> dest: the 'always' plan
        self.model = CostModel()
        self.observations: list[tuple[str, list[float], float]] = []
        self.exchanges: list[tuple[float, float]] = []  # (elements moved, seconds)
        self.errors: list[float] = []  # the model's relative error, latest steps
        self.steps = 0
        self.no_grad_passes = 0
        self._local: list[tuple[str, list[float], float]] = []
        self._no_grad_calls = 0
        self._plan: Plan | None = None
        self._last_applied: bool | None = None
        # measured update (plan to report) over the predicted update of holding, per step
        # that moved groups and per step that did not: whether moving pays, measured
        self.realized: dict[str, list[float]] = {"applied": [], "held": []}
        self.declined = 0  # steps the measurements overruled the model since moving
        self._t0 = 0.0

    # ------------------------------------------------------------------ measuring
    @contextmanager
    def timed(self, r: Rollout | None, kind: str = "train"):
        """Time one pass over ``r`` (a micro-batch) and keep its features and seconds."""
        if r is None or len(r) == 0:
            yield
            return
        if self.dist.device.type == "cuda":
            torch.cuda.synchronize(self.dist.device)
        t0 = time.perf_counter()
        yield
        if self.dist.device.type == "cuda":
            torch.cuda.synchronize(self.dist.device)
        seconds = time.perf_counter() - t0
        self._local.append((kind, features(group_shapes(r, self.kind)), seconds))

    def no_grad_fn(self, fn: Callable[[Rollout], torch.Tensor]) -> Callable:
        """``fn`` timed as a no-grad pass; counts the step's no-grad passes."""
        self._no_grad_calls += 1

        def run(r: Rollout) -> torch.Tensor:
            with self.timed(r, "no_grad"):
                return fn(r)

        return run

    def parts(self, r: Rollout | None) -> list[list[int]] | None:
        """Rows of ``r`` in length buckets of whole groups (``cost_model.length_buckets``)
        on a step whose plan moved groups; None on any other (the update runs as without
        balancing: a rank's own groups need no buckets, and extra calls cost)."""
        if self._plan is None or not self._plan.applied:
            return None
        if r is None or len(r) == 0:
            return []
        slices = r.group_slices()
        runs = cut(self.model, group_shapes(r, self.kind), self.s.budget)
        return [[i for g in run for i in range(slices[g].start, slices[g].stop)] for run in runs]

    # ------------------------------------------------------------------ planning
    def plan(self, minibatches: list[Rollout | None], token_costs: list[list[float]]) -> Plan:
        """The step's plan, the same on every rank (one all-gather, one broadcast)."""
        P = self.dist.world_size
        mine = ([group_shapes(mb, self.kind) for mb in minibatches], token_costs)
        everyone: list = [None] * P
        tdist.all_gather_object(everyone, mine)
        plan = self._decide(everyone) if self.dist.rank == 0 else None
        box = [plan]
        tdist.broadcast_object_list(box, src=0)
        self._plan = box[0]
        self._t0 = time.perf_counter()
        return self._plan

    def _decide(self, everyone: list) -> Plan:
        P, m = len(everyone), len(everyone[0][0])
        shapes = [[g for r in range(P) for g in everyone[r][0][j]] for j in range(m)]
        owner = [[r for r in range(P) for _ in everyone[r][0][j]] for j in range(m)]
        costs = [[c for r in range(P) for c in everyone[r][1][j]] for j in range(m)]
        held_s = self._predict(shapes, owner, P, bucketed=False)
        stats: dict[str, float] = {}
        if self.s.when == "always":
            dest = [self.choose_tokens(costs[j], owner[j], P) for j in range(m)]
            return self._finish(True, dest, shapes, owner, costs, held_s, stats, "always")
        if self.steps < self.s.fit_steps or not self.model.fitted:
            return self._finish(False, owner, shapes, owner, costs, held_s, stats, "fitting")
        # a VLM's samples move as vision features (encode_media): wherever they train
        # after an exchange, the tower has already run, once per prompt
        encode = any(g.image_patches or g.clip_patches for mb in shapes for g in mb)
        target = [[_encoded(g) for g in mb] for mb in shapes] if encode else shapes
        per_el = self._exchange_rate()
        dest = [self._search(target[j], owner[j], P, per_el[1]) for j in range(m)]
        new_s = self._predict(target, dest, P, bucketed=True)
        moved = sum(
            g.elements for j in range(m) for g, a, b in zip(shapes[j], owner[j], dest[j]) if a != b
        )
        gain = _slowest(held_s) - _slowest(new_s)
        cost = (per_el[0] + per_el[1] * moved) if moved or encode else 0.0
        margin = _slowest(held_s) * sum(self.errors) / len(self.errors) if self.errors else 0.0
        stats["balance/predicted_gain_s"] = gain
        stats["balance/predicted_exchange_s"] = cost
        stats["balance/predicted_margin_s"] = margin
        explore = not self.exchanges  # nothing measured yet: try a positive gain once
        pays = (moved > 0 or encode) and gain > max(cost, 0.0) + margin
        why = f"gain {gain:.4f} s, exchange {cost:.4f} s, model error {margin:.4f} s" + (
            " (first try)" if explore else ""
        )
        if pays:
            pays, why = self._measured_check(why)
        if not pays:
            return self._finish(False, owner, shapes, owner, costs, held_s, stats, why)
        return self._finish(True, dest, target, owner, costs, held_s, stats, why)

    def _measured_check(self, why: str) -> tuple[bool, str]:
        """The model predicts a gain: does moving pay, measured? The updates of recent
        steps that moved and that did not, each over its own predicted update with the
        groups held (so the step's work cancels): moving goes on while its steps measure
        less. Before both are measured, one of each is tried; after ``RETRY`` declined
        steps, moving once more."""
        moved, held = self.realized["applied"][-RECENT:], self.realized["held"][-RECENT:]
        if not moved or self.declined >= RETRY:
            self.declined = 0
            return True, why + "; trying it"
        if not held:
            self.declined += 1
            return False, why + "; measuring a step without moving first"
        m, h = sum(moved) / len(moved), sum(held) / len(held)
        if m < h:
            return True, why + f"; measured {m:.3f} moving against {h:.3f} holding"
        self.declined += 1
        return False, why + f"; but measured {m:.3f} moving against {h:.3f} holding"

    def _finish(self, applied, dest, shapes, owner, costs, held_s, stats, why) -> Plan:
        """The plan with its stats: work before and after in token units (max/mean over
        ranks), samples moved, the decision."""
        P = len(held_s)
        predicted = self._predict(shapes, dest, P, bucketed=True) if applied else held_s
        level = logging.INFO if applied != self._last_applied else logging.DEBUG
        self._last_applied = applied
        verb = "moving groups" if applied else "no move"
        logger.log(level, f"placement.balance: step {self.steps}: {verb} ({why})")
        moved = [
            (g, c)
            for j in range(len(shapes))
            for g, c, a, b in zip(shapes[j], costs[j], owner[j], dest[j])
            if a != b
        ]
        stats["balance/applied"] = float(applied)
        stats["placement/balance_before"] = _max_over_mean(costs, owner, P)
        stats["placement/balance_after"] = _max_over_mean(costs, dest, P)
        stats["placement/balance_moved"] = float(sum(g.rows for g, _ in moved))
        return Plan(
            applied,
            dest,
            owner,
            stats,
            [sum(t) + ng for t, ng in predicted] if self.model.fitted else None,
            float(sum(g.elements for g, _ in moved)),
            _slowest(held_s),
        )

    def _predict(self, shapes, dest, P, bucketed: bool) -> list[tuple[list[float], float]]:
        """Per rank: predicted training seconds per minibatch and no-grad seconds."""
        out = []
        for r in range(P):
            mbs = [[g for g, d in zip(shapes[j], dest[j]) if d == r] for j in range(len(shapes))]
            s = self.s
            out.append(
                rank_seconds(self.model, mbs, s.epochs, self.no_grad_passes, s.budget, bucketed)
            )
        return out

    def _rank_cost(self, groups: list[GroupShape]) -> float:
        train, ng = rank_seconds(
            self.model, [groups], self.s.epochs, self.no_grad_passes, self.s.budget
        )
        return train[0] + ng

    def _search(
        self, shapes: list[GroupShape], owner: list[int], P: int, per_el: float
    ) -> list[int]:
        """One minibatch's destination per group: local search (best move or swap of
        groups between two ranks, until none lowers the objective) from the holdings and
        from Karmarkar-Karp on each group's own cost, the better end point. Objective:
        the slowest rank's predicted seconds plus the moved groups' exchange seconds."""
        n = len(shapes)
        if n == 0:
            return []
        memo: dict[tuple[int, ...], float] = {}

        def rank_s(members: tuple[int, ...]) -> float:
            if members not in memo:
                memo[members] = self._rank_cost([shapes[i] for i in members])
            return memo[members]

        def objective(dest: list[int]) -> float:
            slowest = max(rank_s(tuple(i for i in range(n) if dest[i] == r)) for r in range(P))
            return slowest + per_el * sum(
                shapes[i].elements for i in range(n) if dest[i] != owner[i]
            )

        starts = [list(owner)]
        own = [self._rank_cost([g]) for g in shapes]
        parts = karmarkar_karp(own, P, equal_size=False)
        starts.append(_assign(parts, owner, P, n))
        best, best_obj = None, float("inf")
        for dest in starts:
            obj = objective(dest)
            while True:
                cand = None
                for i in range(n):
                    for r in range(P):  # move i to r
                        if r != dest[i]:
                            d = list(dest)
                            d[i] = r
                            if (o := objective(d)) < obj - 1e-12:
                                obj, cand = o, d
                    for k in range(i + 1, n):  # swap i and k
                        if dest[k] != dest[i]:
                            d = list(dest)
                            d[i], d[k] = dest[k], dest[i]
                            if (o := objective(d)) < obj - 1e-12:
                                obj, cand = o, d
                if cand is None:
                    break
                dest = cand
            if obj < best_obj - 1e-12:
                best, best_obj = dest, obj
        return best

    def _exchange_rate(self) -> tuple[float, float]:
        """(fixed seconds, seconds per element moved) of an exchange, from the measured
        ones: least squares with both non-negative; one measurement alone is all per
        element."""
        if not self.exchanges:
            return 0.0, 0.0
        xs = {round(e) for e, _ in self.exchanges}
        if len(xs) < 2:
            e = sum(x for x, _ in self.exchanges)
            return 0.0, sum(t for _, t in self.exchanges) / max(e, 1.0)
        X = np.array([[1.0, e] for e, _ in self.exchanges])
        y = np.array([t for _, t in self.exchanges])
        a, b = nnls(X, y)
        return float(a), float(b)

    # ------------------------------------------------------------------ after the update
    def exchanged(self, elements: float, seconds: float) -> None:
        """A measured exchange (elements moved over every rank, its seconds)."""
        self.exchanges = (self.exchanges + [(elements, seconds)])[-WINDOW:]

    def report(self) -> dict[str, float]:
        """After the update: every rank's measured micro-batch seconds against the plan's
        prediction, the model refitted where it drifted; the step's metrics."""
        P = self.dist.world_size
        local = (self._local, self._no_grad_calls)
        everyone: list = [None] * P
        tdist.all_gather_object(everyone, local)
        self._local, self._no_grad_calls = [], 0
        measured = [sum(t for _, _, t in obs) for obs, _ in everyone]
        plan = self._plan
        out = dict(plan.stats) if plan is not None else {}
        if plan is not None:  # the update as it ran: exchange, passes, waits, optimizer
            realized = time.perf_counter() - self._t0
            out["balance/realized_s"] = realized
            if plan.predicted is not None and plan.held_slowest > 0:
                kind = "applied" if plan.applied and self.s.when == "pays" else "held"
                self.realized[kind] = (self.realized[kind] + [realized / plan.held_slowest])[
                    -RECENT:
                ]
        if self.steps > 0:  # the first step warms up: not fitted on
            self.observations = (self.observations + [o for obs, _ in everyone for o in obs])[
                -WINDOW:
            ]
        self.no_grad_passes = everyone[0][1]
        error = None
        if plan is not None and plan.predicted is not None:
            error = max(abs(p - t) / t for p, t in zip(plan.predicted, measured) if t > 0)
            out["balance/predicted_s"] = max(plan.predicted)
            out["balance/measured_s"] = max(measured)
            out["balance/model_error"] = error
            self.errors = (self.errors + [error])[-RECENT:]
            for r in range(P):
                out[f"balance/predicted_s/rank{r}"] = plan.predicted[r]
                out[f"balance/measured_s/rank{r}"] = measured[r]
        fit_now = (
            self.steps + 1 >= self.s.fit_steps
            and self.observations
            and (not self.model.fitted or (error is not None and error > self.s.refit_error))
        )
        out["balance/refit"] = float(bool(fit_now))
        if fit_now:
            self.model.fit(self.observations)
            logger.debug(f"placement.balance: refit at step {self.steps}: {self.model.coef}")
        self.steps += 1
        self._plan = None
        return out

    # ------------------------------------------------------------------ run state
    def state_dict(self) -> dict:
        return {
            "model": self.model.state_dict(),
            "observations": [list(o) for o in self.observations],
            "exchanges": [list(e) for e in self.exchanges],
            "steps": self.steps,
            "no_grad_passes": self.no_grad_passes,
            "realized": {k: list(v) for k, v in self.realized.items()},
            "declined": self.declined,
            "errors": list(self.errors),
        }

    def load_state_dict(self, state: dict | None) -> None:
        if not state:
            return
        self.model.load_state_dict(state["model"])
        self.observations = [(k, list(x), float(t)) for k, x, t in state["observations"]]
        self.exchanges = [(float(e), float(t)) for e, t in state["exchanges"]]
        self.steps = int(state["steps"])
        self.no_grad_passes = int(state["no_grad_passes"])
        self.realized = {k: [float(x) for x in v] for k, v in state["realized"].items()}
        self.declined = int(state["declined"])
        self.errors = [float(e) for e in state.get("errors", [])]


def _encoded(g: GroupShape) -> GroupShape:
    """``g`` once its vision tower has run (``encode_media``): no patches left to run."""
    return replace(g, image_patches=0, clip_patches=0)


def _max_over_mean(costs: list[list[float]], dest: list[list[int]], P: int) -> float:
    """Max / mean of the ranks' summed token work over the step's minibatches."""
    work = [0.0] * P
    for cj, dj in zip(costs, dest):
        for c, d in zip(cj, dj):
            work[d] += c
    return max_over_mean(work)


def _slowest(per_rank: list[tuple[list[float], float]]) -> float:
    """The update's predicted seconds: every minibatch waits for its slowest rank at the
    all-reduce, and so do the no-grad passes."""
    m = len(per_rank[0][0])
    return sum(max(t[j] for t, _ in per_rank) for j in range(m)) + max(ng for _, ng in per_rank)


def _assign(parts: list[list[int]], owner: list[int], P: int, n: int) -> list[int]:
    """Destination per group for ``parts``, each part to the rank holding most of it."""
    rank_of = assign_parts(parts, owner, P)
    dest = [0] * n
    for p, items in enumerate(parts):
        for g in items:
            dest[g] = rank_of[p]
    return dest
