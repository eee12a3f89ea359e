"""Dynamic placement: a cost model fitted from measured phase times, and the chooser.

Each step's measurement (reduced over controllers) gives, for the mode it ran in:
``gen_s`` (generation wall time on the rollout cores; in partial mode with the judge
running alongside), ``judge_s`` (the judge servers' busy time), ``reload_s`` (judge
weights reloaded), ``train_s`` (advantage + log-probs + update on every core) and
``collect_s`` (all of generate + score as the mode ran them) and ``step_s``. The model keeps the latest (smoothed) time of each role per core count it
was measured at, and predicts

- shared on C cores: gen(C) + judge(C) + train + rest_shared (nothing pinned)
- colocate on C cores: gen(C) + reload + judge(C) + train + rest_colocate
- partial on r + j cores: pipeline(gen(r), judge(j), chunks) + train + rest_partial,
  where the judge scores each finished chunk while the next one is generated:
  pipeline = max(g + J / n, J + g / n) for g = gen(r), J = judge(j), n chunks

Each time is kept per (mode, core count) as measured. An unmeasured one is derived from
the nearest measured core count: generation (one process per controller) by the ratio
of core counts (work conserved); the judge (one server process, whose extra threads
may not help) is slowed by the ratio when it gets fewer cores but never assumed faster
with more than it was measured at. ``rest_*`` is what a mode's measured step held
beyond the modelled phases (barriers, HTTP, stragglers, judge sleep calls); an
unmeasured mode gets the smallest measured one. When a role's time moves by more than the drift
threshold, every stored time of that role is scaled by the same factor (the work
changed, not the machine) and the choice is re-evaluated.
"""

from __future__ import annotations

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


def pipeline(g: float, judge: float, n: int) -> float:
    """Time for generation (g) and judging (judge) of n equal chunks, streamed."""
    n = max(1, n)
    return max(g + judge / n, judge + g / n)


@dataclass
class CostModel:
    cores: int
    has_judge: bool
    smoothing: float = 0.5  # weight of the newest measurement
    drift_threshold: float = 0.25
    gen: dict[tuple[str, int], float] = field(default_factory=dict)  # (mode, cores) -> s
    judge: dict[tuple[str, int], float] = field(default_factory=dict)  # (mode, cores) -> s
    reload: float = 0.0
    train: float | None = None
    rest: dict[str, float] = field(default_factory=dict)  # mode -> s
    chunks: int = 1

    def _update(self, table: dict, key, value: float) -> float | None:
        """Store value at key; returns the drift factor when it moved past the threshold
        (and scales the role's other entries by it), else None."""
        old = table.get(key)
        if old is None or old <= 0:
            table[key] = value
            return None
        ratio = value / old
        if abs(ratio - 1.0) > self.drift_threshold:
            for k in table:
                table[k] *= ratio
            table[key] = value
            return ratio
        table[key] = (1 - self.smoothing) * old + self.smoothing * value
        return None

    def observe(self, m: Measure) -> list[str]:
        """Fold one measurement in; returns the drifts it showed (e.g. ['judge x1.80'])."""
        drifts = []
        d = self._update(self.gen, (m.mode, m.rollout_cores), m.gen_s)
        if d is not None:
            drifts.append(f"generate x{d:.2f}")
        if self.has_judge:
            d = self._update(self.judge, (m.mode, m.judge_cores), m.judge_s)
            if d is not None:
                drifts.append(f"judge x{d:.2f}")
        if m.mode == "colocate":
            self.reload = m.reload_s if self.reload == 0 else 0.5 * (self.reload + m.reload_s)
        self.train = m.train_s if self.train is None else 0.5 * (self.train + m.train_s)
        self.chunks = max(1, m.chunks) if m.mode == "partial" else self.chunks
        model = self._phases(m.mode, m.rollout_cores, m.judge_cores)
        if model is not None:
            rest = max(0.0, m.collect_s - model)
            old = self.rest.get(m.mode)
            self.rest[m.mode] = rest if old is None else 0.5 * (old + rest)
        return drifts

    def _scaled(
        self, table: dict, key, cores: int, match=None, speedup: bool = True
    ) -> float | None:
        if key in table:
            return table[key]
        near = [(k, v) for k, v in table.items() if match is None or match(k)]
        if not near:
            return None
        k, v = min(near, key=lambda kv: (abs(kv[0][1] - cores), kv[1]))
        c0 = k[1]
        if not speedup and cores >= c0:
            return v
        return v * c0 / max(1, cores)

    def gen_time(self, mode: str, cores: int) -> float | None:
        # partial generates chunk by chunk: prefer partial's own measurements, else scale
        exact = self.gen.get((mode, cores))
        if exact is not None:
            return exact
        same = self._scaled(self.gen, (mode, cores), cores, match=lambda k: k[0] == mode)
        return same if same is not None else self._scaled(self.gen, (mode, cores), cores)

    def judge_time(self, cores: int, mode: str | None = None) -> float | None:
        if not self.has_judge:
            return 0.0
        if mode is not None:
            same = self._scaled(
                self.judge, (mode, cores), cores, match=lambda k: k[0] == mode, speedup=False
            )
            if same is not None:
                return same
        return self._scaled(self.judge, (mode, cores), cores, speedup=False)

    def _phases(self, mode: str, r: int, j: int) -> float | None:
        g = self.gen_time(mode, r)
        jt = self.judge_time(j, mode)
        if g is None or jt is None:
            return None
        if mode == "shared":
            return g + jt
        if mode == "colocate":
            return g + (self.reload if self.has_judge else 0.0) + jt
        return pipeline(g, jt, self.chunks) if self.has_judge else g

    def predict(self, plan: CorePlan) -> float | None:
        """Predicted step seconds of ``plan``; None while a needed role is unmeasured."""
        phases = self._phases(plan.mode, len(plan.rollout), len(plan.judge))
        if phases is None or self.train is None:
            return None
        rest = self.rest.get(plan.mode, min(self.rest.values(), default=0.0))
        return phases + self.train + rest


class AutoPlacer:
    """Profiles, predicts, picks; re-evaluates every ``every`` steps or on drift.

    Schedule (``profile_all=False``, the default): step 1 runs the starting plan and is
    not measured (warm-up): partial at ``start_partial``'s split when a judge serves the
    reward (judging can overlap generation), else shared; then ``profile`` measured
    steps of it; then the plan with the lowest predicted step time, the others
    predicted from the measured roles. A plan it switches to is measured for
    ``profile`` steps and the choice made again with both measured, so a prediction
    that was wrong costs ``profile`` steps. ``profile_all=True``: warm-up and
    ``profile`` steps of colocate, then ``profile`` steps of partial (with a judge),
    then the choice. Without a judge, partial's judge cores would idle and it is
    predicted, not run."""

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
    ):
        self.candidates = candidates
        colocate = [p for p in candidates if p.mode == "colocate"]
        self.colocate = colocate[0]
        self.model = CostModel(len(self.colocate.cores), has_judge, drift_threshold=drift_threshold)
        shared = [p for p in candidates if p.mode == "shared"]
        if profile_all:
            self.queue: list[CorePlan] = [self.colocate] * (1 + profile)
            if has_judge and start_partial is not None:
                self.queue += [start_partial] * profile
        else:
            start = start_partial if has_judge and start_partial is not None else None
            start = start or (shared[0] if shared else self.colocate)
            self.queue = [start] * (1 + profile)
        self.warmup = 1
        self.profile = profile
        self.verify_in = 0  # steps left to measure a plan just switched to
        self.every, self.min_gain = every, min_gain
        self.current: CorePlan = self.queue[0]
        self.since = 0
        self.predictions: dict[str, float] = {}
        self.reason = "profiling"
        self.pending_reason: str | None = None

    @staticmethod
    def key(plan: CorePlan) -> str:
        return f"partial {plan.split}" if plan.mode == "partial" else plan.mode

    def next_plan(self) -> tuple[CorePlan, str | None]:
        """The plan of the coming step, and a line to show when the choice changed."""
        if self.queue:
            plan = self.queue.pop(0)
            changed = plan != self.current
            self.current = plan
            return plan, (f"profiling {self.key(plan)}" if changed else None)
        if self.reason == "profiling":
            due = "profiled"
        else:
            due = self.pending_reason or ("re-evaluation" if self.since >= self.every else None)
        if due is None:
            return self.current, None
        self.pending_reason = None
        self.since = 0
        self.predictions = {
            self.key(p): v for p in self.candidates if (v := self.model.predict(p)) is not None
        }
        if not self.predictions:
            return self.current, None
        best = min(
            (p for p in self.candidates if self.key(p) in self.predictions),
            key=lambda p: self.predictions[self.key(p)],
        )
        now = self.predictions.get(self.key(self.current))
        switch = now is None or self.predictions[self.key(best)] < (1 - self.min_gain) * now
        old = self.current
        if switch:
            self.current = best
            measured = self.model.gen.get((best.mode, len(best.rollout))) is not None
            if best != old and not measured:
                self.verify_in = self.profile  # measure it, then choose again
        self.reason = due
        others = ", ".join(f"{k} {v:.2f}s" for k, v in sorted(self.predictions.items()))
        verb = "picks" if self.current != old or due == "profiled" else "keeps"
        return self.current, f"{due}: auto {verb} {self.key(self.current)} (predicted {others})"

    def predicted(self, plan: CorePlan) -> float | None:
        return self.model.predict(plan)

    def observe(self, m: Measure) -> list[str]:
        if self.warmup:
            self.warmup -= 1
            return []
        self.since += 1
        drifts = self.model.observe(m)
        if drifts and not self.queue:
            self.pending_reason = "drift (" + ", ".join(drifts) + ")"
        elif self.verify_in and not self.queue:
            self.verify_in -= 1
            if self.verify_in == 0:
                self.pending_reason = f"measured {self.key(self.current)}"
        return drifts
