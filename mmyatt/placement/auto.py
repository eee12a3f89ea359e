"""Dynamic placement: a cost model fitted from measured phase times, and the chooser.

Each step's measurement (reduced over controllers) gives, for the mode it ran in:
``gen_s`` (generation wall time on the rollout cores; in partial mode with the judge
running alongside), ``judge_s`` (the judge servers' busy time), ``reload_s`` (judge
weights reloaded), ``train_s`` (advantage + log-probs + update on every core),
``collect_s`` (all of generate + score as the mode ran them) and ``step_s``. The model
keeps the latest (smoothed) time of each role: generation per (mode, rollout cores), the
judge per (mode, judge threads), and predicts

- shared: gen(C) + judge(t_shared) + train + rest_shared (nothing pinned; the judge runs
  on its configured threads, reward.judge.threads)
- colocate: gen(C) + reload + judge(t_colocate) + train + rest_colocate (the judge on
  placement.judge_threads, one per core by default)
- partial on r + j cores: pipeline(gen(r), judge(j), chunks) [+ reload when the judge
  sleeps through training, placement.partial_release_judge] + train + rest_partial,
  where the judge scores each finished chunk while the next one is generated:
  pipeline = max(g + J / n, J + g / n) for g = gen(r), J = judge(j), n chunks; samples
  the token budget cuts (a measured share c) are sent when generation ends, so n is at
  most 1 / c (every sample cut: g + J). Partial's judge takes every core once generation
  is done (placement.widen_judge): its measured J includes those calls, and the
  optimistic prediction lets the judging left after generation run cores / threads
  faster (the point prediction never assumes more threads faster)

A time not measured at its own key is derived from a measurement of the same mode,
else of the nearest core or thread count, among equals one that ran the role the same
way (alone, or beside the other role as partial runs it). Generation (one process per controller) scales by
the ratio of core counts (work conserved). Shared mode's generation is keyed by the cores
its processes can use, controllers x trainer.threads at most every core: one controller
on one thread is a 1-core measurement, and colocate (which gives it every core) is then
worth measuring, without a judge too. The judge is slowed by the ratio of threads
when it gets fewer, and its point prediction never assumes it faster with more.

Two predictions per plan: the point prediction above, and an optimistic one, where a
derived judge time scales ideally with threads and a role measured beside the other one
(in partial) may run ``explore_margin`` faster alone. A plan whose optimistic prediction
beats the best estimate by ``min_gain`` is worth measuring (explored); the chooser then
compares measured step times (median of the plan's recent steps) where it has them and
point predictions where it does not. ``rest_*`` is what a mode's measured step held
beyond the modelled phases (barriers, HTTP, stragglers, judge sleep calls); an
unmeasured mode gets the smallest measured one. When a role's time moves by more than
the drift threshold, every stored time of that role is scaled by the same factor (the
work changed, not the machine), the measured step times start over, and the choice is
made again at once from the scaled model.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass, field

from mmyatt.placement.config import CorePlan


@dataclass
class Measure:
    """One step as measured, reduced over controllers (max of wall times)."""

    mode: str
    rollout_cores: int
    judge_cores: int
    gen_s: float
    judge_s: float
    reload_s: float
    train_s: float
    collect_s: float  # generate + score, as the mode ran them (the step less training)
    step_s: float
    chunks: int = 1
    judge_threads: int = 0  # the judge's threads in this mode (0: one per judge core)
    cut_frac: float = 0.0  # share of the samples the token budget cut (text; any mode)


def pipeline(g: float, judge: float, n: int, widen: float = 1.0) -> float:
    """Time for generation (g) and judging (judge) of n equal chunks, streamed. ``widen``:
    how much faster the judge runs once generation is done (partial's judge takes the
    rollout's cores then: placement.widen_judge); it matters when the judge is behind."""
    n = max(1, n)
    # judging left when generation ends: the last chunk, or, when the judge is behind,
    # all it could not do from the first chunk on (widen 1: max(g + J/n, J + g/n))
    left = max(judge / n, judge - (g - g / n))
    return g + left / max(1.0, widen)


def streamable(chunks: int, cut: float) -> int:
    """The chunks partial can overlap with generation when a share ``cut`` of the
    samples run to the token budget: those are sent only when generation ends, so at
    least that share of the judging waits for it (every sample cut: nothing overlaps)."""
    if cut <= 0:
        return max(1, chunks)
    return max(1, min(chunks, int(1.0 / cut)))


def _overlapped(mode: str) -> bool:
    """Roles run beside each other (partial) rather than alone."""
    return mode == "partial"


@dataclass
class CostModel:
    cores: int
    has_judge: bool
    smoothing: float = 0.5  # weight of the newest measurement
    drift_threshold: float = 0.25
    explore_margin: float = 0.15  # optimistic: how much faster a role may run alone
    gen: dict[tuple[str, int], float] = field(default_factory=dict)  # (mode, cores) -> s
    judge: dict[tuple[str, int], float] = field(default_factory=dict)  # (mode, threads) -> s
    reload: float = 0.0
    train: float | None = None
    rest: dict[str, float] = field(default_factory=dict)  # mode -> s
    chunks: int = 1
    cut: float = 0.0  # the latest measured share of samples cut by the token budget
    # the judge's threads in a plan (shared: reward.judge.threads, colocate:
    # placement.judge_threads); default one per judge core
    threads_of: Callable[[CorePlan], int] | None = None
    # the cores a plan's generation can use (shared: controllers x trainer.threads, at
    # most every core); default the plan's rollout cores
    rollout_of: Callable[[CorePlan], int] | None = None
    # partial's judge takes every core once generation is done (placement.widen_judge):
    # the optimistic prediction lets it run cores / judge threads faster then
    widen: bool = False
    # partial steps reload the judge before generating (placement.partial_release_judge)
    partial_reload: bool = False
    _suspect: dict = field(default_factory=dict)  # role -> (ratio, key) of a first move
    # resumed with other work (``AutoPlacer.load_state_dict``): the next measurement of
    # each role is its move, with no second one to wait for
    work_changed: bool = False

    def _update(self, table: dict, key, value: float) -> float | None:
        """Store value at key; returns the drift factor when it moved past the threshold
        in two measurements running, the same way (one step's spike is noise, not a
        change of work), and then scales the role's other entries by it; else None."""
        old = table.get(key)
        role = id(table)
        if old is None or old <= 0:
            table[key] = value
            self._suspect.pop(role, None)
            return None
        ratio = value / old
        moved = abs(ratio - 1.0) > self.drift_threshold
        # resumed with other work: this measurement is the role's time now, with nothing
        # to wait for or smooth with; within one run a move waits for a second one
        if not self.work_changed:
            if not moved:
                self._suspect.pop(role, None)
                table[key] = (1 - self.smoothing) * old + self.smoothing * value
                return None
            first = self._suspect.get(role)
            if first is None or (first[0] > 1) != (ratio > 1) or first[1] != key:
                self._suspect[role] = (ratio, key)  # wait for the next measurement
                return None
            ratio = (first[0] + ratio) / 2
        self._suspect.pop(role, None)
        for k in table:
            table[k] *= ratio
        table[key] = value
        return ratio if moved else None

    def observe(self, m: Measure) -> list[str]:
        """Fold one measurement in; returns the drifts it showed (e.g. ['judge x1.80'])."""
        drifts = []
        d = self._update(self.gen, (m.mode, m.rollout_cores), m.gen_s)
        if d is not None:
            drifts.append(f"generate x{d:.2f}")
        threads = m.judge_threads or m.judge_cores
        if self.has_judge:
            d = self._update(self.judge, (m.mode, threads), m.judge_s)
            if d is not None:
                drifts.append(f"judge x{d:.2f}")
        if m.mode == "colocate" or (m.mode == "partial" and self.partial_reload and m.reload_s):
            self.reload = m.reload_s if self.reload == 0 else 0.5 * (self.reload + m.reload_s)
        fresh = self.train is None or self.work_changed
        self.train = m.train_s if fresh else 0.5 * (self.train + m.train_s)
        self.work_changed = False  # every role has had its first measurement
        self.chunks = max(1, m.chunks) if m.mode == "partial" else self.chunks
        self.cut = m.cut_frac
        model = self._phases(m.mode, m.rollout_cores, threads)
        if model is not None and not self._suspect:  # not while a role's move is unconfirmed
            rest = max(0.0, m.collect_s - model)
            old = self.rest.get(m.mode)
            self.rest[m.mode] = rest if old is None else 0.5 * (old + rest)
        return drifts

    def _derived(
        self, table: dict, mode: str, amount: int, judge: bool, optimistic: bool
    ) -> float | None:
        """The role's time in ``mode`` at ``amount`` cores (generation) or threads (the
        judge): measured if stored, else derived from the nearest measurement (module
        docstring)."""
        if (mode, amount) in table:
            return table[(mode, amount)]
        if not table:
            return None

        def rank(kv):
            (m, a), v = kv
            same_way = _overlapped(m) == _overlapped(mode)
            return (m != mode, abs(a - amount), not same_way, v)

        (m0, a0), v = min(table.items(), key=rank)
        if judge:
            if amount < a0:
                v = v * a0 / max(1, amount)  # fewer threads: slower by the ratio
            elif optimistic:
                v = v * a0 / max(1, amount)  # more threads: ideal speed-up at best
        else:
            v = v * a0 / max(1, amount)  # work conserved over the cores
        if optimistic and _overlapped(m0) and not _overlapped(mode):
            v *= (
                1.0 - self.explore_margin
            )  # measured beside the other role; alone it may run faster
        return v

    def gen_time(self, mode: str, cores: int, optimistic: bool = False) -> float | None:
        return self._derived(self.gen, mode, cores, False, optimistic)

    def judge_time(self, threads: int, mode: str, optimistic: bool = False) -> float | None:
        if not self.has_judge:
            return 0.0
        return self._derived(self.judge, mode, threads, True, optimistic)

    def _phases(self, mode: str, r: int, t: int, optimistic: bool = False) -> float | None:
        g = self.gen_time(mode, r, optimistic)
        jt = self.judge_time(t, mode, optimistic)
        if g is None or jt is None:
            return None
        if mode == "shared":
            return g + jt
        if mode == "colocate":
            return g + (self.reload if self.has_judge else 0.0) + jt
        if not self.has_judge:
            return g
        w = self.cores / max(1, t) if optimistic and self.widen else 1.0
        reload = self.reload if self.partial_reload else 0.0
        return reload + pipeline(g, jt, streamable(self.chunks, self.cut), w)

    def threads(self, plan: CorePlan) -> int:
        return self.threads_of(plan) if self.threads_of is not None else len(plan.judge)

    def rollout(self, plan: CorePlan) -> int:
        return self.rollout_of(plan) if self.rollout_of is not None else len(plan.rollout)

    def predict(self, plan: CorePlan, optimistic: bool = False) -> float | None:
        """Predicted step seconds of ``plan``; None while a needed role is unmeasured."""
        phases = self._phases(plan.mode, self.rollout(plan), self.threads(plan), optimistic)
        if phases is None or self.train is None:
            return None
        rest = self.rest.get(plan.mode, min(self.rest.values(), default=0.0))
        return phases + self.train + rest


class AutoPlacer:
    """Profiles, predicts, explores, picks; re-evaluates every ``every`` steps or on drift.

    Schedule (``profile_all=False``, the default): step 1 runs shared, the unpinned
    baseline (the run as it would be without placement), and is not measured (warm-up);
    then ``profile`` measured steps of it. At each decision, a plan not yet measured
    whose optimistic prediction beats the best estimate by ``min_gain`` is measured for
    ``profile`` steps (the most promising first, one at a time); otherwise the plan with
    the lowest estimate is taken: the median of its recent measured steps, or the point
    prediction where it has none (and then it is measured for ``profile`` steps before
    the choice is made again). Partial's bound before it ran uses ``chunks``, the chunks
    per step its configuration streams. Without a judge colocate is not a candidate: its
    phases are shared's, with nothing to release. ``profile_all=True``: warm-up and
    ``profile`` steps of colocate, then ``profile`` steps of partial at
    ``start_partial``'s split (with a judge), then the choice."""

    window = 5  # recent steps per plan whose median is its measured estimate

    def __init__(
        self,
        candidates: list[CorePlan],
        *,
        has_judge: bool,
        start_partial: CorePlan | None,
        profile: int = 1,
        every: int = 10,
        drift_threshold: float = 0.25,
        min_gain: float = 0.03,
        profile_all: bool = False,
        explore_margin: float = 0.15,
        judge_threads: Callable[[CorePlan], int] | None = None,
        chunks: int = 1,
        widen: bool = False,
        partial_reload: bool = False,
        shared_cores: int | None = None,
        work: str = "",
    ):
        """``shared_cores``: the cores shared mode's processes can use (controllers x
        trainer.threads, at most every core; None: every core). ``work``: what a step
        does (``placement.config.work_key``), kept with the state so that a resumed run
        knows whether its measurements are of the same work."""
        colocate = [p for p in candidates if p.mode == "colocate"]
        self.colocate = colocate[0]
        cores = len(self.colocate.cores)
        shared_fills = shared_cores is None or shared_cores >= cores
        # without a judge colocate is shared pinned: a candidate only where it gives the
        # controllers cores that shared leaves idle
        if not has_judge and not profile_all and shared_fills:
            if any(p.mode == "shared" for p in candidates):
                candidates = [p for p in candidates if p.mode != "colocate"]
        self.candidates = candidates
        self.shared_cores = cores if shared_fills else max(1, int(shared_cores))
        self.model = CostModel(
            cores,
            has_judge,
            drift_threshold=drift_threshold,
            explore_margin=explore_margin,
            threads_of=judge_threads,
            rollout_of=self.rollout_cores,
            chunks=max(1, chunks),
            widen=widen,
            partial_reload=partial_reload,
        )
        shared = [p for p in candidates if p.mode == "shared"]
        if profile_all:
            self.queue: list[CorePlan] = [self.colocate] * (1 + profile)
            if has_judge and start_partial is not None:
                self.queue += [start_partial] * profile
        else:
            self.queue = [shared[0] if shared else self.colocate] * (1 + profile)
        self.warmup = 1
        self.profile = profile
        self.verify_in = 0  # steps left to measure a plan just switched to
        self.every, self.min_gain = every, min_gain
        self.current: CorePlan = self.queue[0]
        self.since = 0
        self.steps: dict[str, list[float]] = {}  # plan -> measured step s since the last drift
        self.predictions: dict[str, float] = {}
        self.estimates: dict[str, float] = {}
        self.reason = "profiling"
        self.pending_reason: str | None = None
        self.work, self.start_partial = work, start_partial
        self.profiled = "profiled"  # the reason given for the choice after profiling

    def rollout_cores(self, plan: CorePlan) -> int:
        """The cores ``plan``'s generation can use (the key of its measurements)."""
        if plan.mode == "shared":
            return min(len(plan.rollout), self.shared_cores)
        return len(plan.rollout)

    @staticmethod
    def key(plan: CorePlan) -> str:
        return f"partial {plan.split}" if plan.mode == "partial" else plan.mode

    def measured(self, plan: CorePlan) -> float | None:
        """Median of the plan's recent measured step times since the last drift."""
        vals = self.steps.get(self.key(plan))
        return statistics.median(vals[-self.window :]) if vals else None

    def next_plan(self) -> tuple[CorePlan, str | None]:
        """The plan of the coming step, and a line to show when the choice changed."""
        if self.queue:
            plan = self.queue.pop(0)
            changed = plan != self.current
            self.current = plan
            return plan, (f"profiling {self.key(plan)}" if changed else None)
        if self.reason == "profiling":
            due = self.profiled + (f", {self.pending_reason}" if self.pending_reason else "")
        elif self.verify_in:
            return self.current, None
        else:
            due = self.pending_reason or ("re-evaluation" if self.since >= self.every else None)
        if due is None:
            return self.current, None
        self.pending_reason = None
        self.since = 0
        return self._decide(due)

    def _decide(self, due: str) -> tuple[CorePlan, str | None]:
        self.predictions, self.estimates, optimistic = {}, {}, {}
        for p in self.candidates:
            k = self.key(p)
            v = self.model.predict(p)
            if v is not None:
                self.predictions[k] = v
            m = self.measured(p)
            if m is not None or v is not None:
                self.estimates[k] = m if m is not None else v
            if m is None and (o := self.model.predict(p, optimistic=True)) is not None:
                optimistic[k] = o
        if not self.estimates:
            return self.current, None
        known = [p for p in self.candidates if self.key(p) in self.estimates]
        # on a tie a measured plan beats a predicted one (the prediction is derived from it)
        best = min(known, key=lambda p: (self.estimates[self.key(p)], self.measured(p) is None))
        bar = (1 - self.min_gain) * self.estimates[self.key(best)]
        old = self.current
        explore = [p for p in self.candidates if optimistic.get(self.key(p), bar) < bar]
        self.reason = due
        if explore:
            p = min(explore, key=lambda p: optimistic[self.key(p)])
            self.current, self.verify_in = p, self.profile
            line = (
                f"{due}: auto measures {self.key(p)} (at best {optimistic[self.key(p)]:.2f}s, "
                f"against {self.key(best)} {self.estimates[self.key(best)]:.2f}s)"
            )
            return self.current, line
        now = self.estimates.get(self.key(self.current))
        if now is None or self.estimates[self.key(best)] < (1 - self.min_gain) * now:
            self.current = best
            if best != old and self.measured(best) is None:
                self.verify_in = self.profile  # measure it, then choose again
        others = ", ".join(
            f"{k} {v:.2f}s{'' if k in self.steps else ' predicted'}"
            for k, v in sorted(self.estimates.items())
        )
        verb = "picks" if self.current != old or due == "profiled" else "keeps"
        return self.current, f"{due}: auto {verb} {self.key(self.current)} ({others})"

    def predicted(self, plan: CorePlan) -> float | None:
        return self.model.predict(plan)

    def observe(self, m: Measure) -> list[str]:
        if self.warmup:
            self.warmup -= 1
            return []
        self.since += 1
        drifts = self.model.observe(m)
        k = self.key(self.current)
        if drifts and not self.queue:
            # the work changed: earlier step times no longer say what a plan costs (the
            # step before this one, which first showed the move, is kept)
            self.steps = {k: self.steps.get(k, [])[-1:] + [m.step_s]}
            self.verify_in = 0
            self.pending_reason = "drift (" + ", ".join(drifts) + ")"
            return drifts
        self.steps.setdefault(k, []).append(m.step_s)
        if self.verify_in and not self.queue:
            self.verify_in -= 1
            if self.verify_in == 0:
                self.pending_reason = f"measured {k}"
        return drifts

    # ------------------------------------------------------------------ across a resume
    def state_dict(self) -> dict:
        """What auto has measured and chosen, for the checkpoint (plain data)."""
        m = self.model
        return {
            "version": 1,
            "work": self.work,
            "cores": m.cores,
            "shared_cores": self.shared_cores,
            "has_judge": m.has_judge,
            "current": self.key(self.current),
            "reason": self.reason,
            "since": self.since,
            "verify_in": self.verify_in,  # steps left to measure a plan just switched to
            "pending": self.pending_reason,  # a decision due at the next step
            "gen": [[k[0], k[1], v] for k, v in m.gen.items()],
            "judge": [[k[0], k[1], v] for k, v in m.judge.items()],
            "reload": m.reload,
            "train": m.train,
            "rest": dict(m.rest),
            "chunks": m.chunks,
            "cut": m.cut,
            "steps": {k: list(v[-self.window :]) for k, v in self.steps.items()},
        }

    def load_state_dict(self, state: dict | None) -> str | None:
        """Carry a checkpoint's measurements into this run; returns a line to show.

        Same cores, same work: the measured times, step medians and choice come back,
        and the run goes on in the plan it was in (one warm-up step, not measured), with
        no profiling. Same cores, other work (``work_key`` differs: longer completions,
        a judge added): the role times come back but the step medians do not, and each
        role's next measurement sets its time at once (no second step to confirm a
        drift); a judge new to the run is first measured in partial (its judge beside
        generation, the measurement colocate's and shared's judge times derive from),
        else the run stays in its plan for one measured step; then auto chooses. Other
        cores or controllers: nothing carries over and auto profiles as a new run does.
        """
        if not state or state.get("version") != 1:
            return None
        m = self.model
        if state["cores"] != m.cores or state["shared_cores"] != self.shared_cores:
            return "auto: the checkpoint's measurements are of other cores; profiling anew"
        same = state["work"] == self.work and state["has_judge"] == m.has_judge
        m.gen = {(k, int(c)): float(v) for k, c, v in state["gen"]}
        if m.has_judge and state["has_judge"]:
            m.judge = {(k, int(c)): float(v) for k, c, v in state["judge"]}
        m.reload, m.train = float(state["reload"]), state["train"]
        m.rest = {k: float(v) for k, v in state["rest"].items()}
        by_key = {self.key(p): p for p in self.candidates}
        plan = by_key.get(state["current"])
        if same:
            m.chunks, m.cut = int(state["chunks"]), float(state["cut"])
            self.steps = {k: list(v) for k, v in state["steps"].items() if k in by_key}
            if plan is not None and state["reason"] != "profiling":
                self.current, self.queue = plan, [plan]  # warm-up, then go on
                self.reason, self.since = "resumed", int(state["since"])
                self.verify_in = int(state.get("verify_in", 0))
                self.pending_reason = state.get("pending")
                return f"auto resumes in {self.key(plan)} with the checkpoint's measurements"
            return "auto resumes with the checkpoint's measurements; profiling"
        m.work_changed = True
        new_judge = m.has_judge and not state["has_judge"]
        if new_judge and self.start_partial is not None:
            plan = self.start_partial
        plan = plan if plan is not None else self.queue[0]
        n = 1 + (self.profile if new_judge else 1)  # warm-up, then measured steps
        self.current, self.queue = plan, [plan] * n
        self.profiled = "resumed with other work"
        what = "a judge new to the run" if new_judge else "other work"
        return (
            f"auto resumes with the checkpoint's measurements, {what}: "
            f"measures {self.key(plan)} first"
        )
