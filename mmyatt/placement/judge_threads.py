"""Colocate's judge threads, measured (``placement.judge_threads: -1``, the default).

In a colocate step the judge has every core of the run to itself. Whether its torch
threads use them depends on the judge: a text judge scoring a batch of 64 completions ran
faster on 2 threads than on 1, while the GenRM image recipe's VLM judge ran slower on 2
(0.30 s of model time per step against 0.23: its per-image operations are too small to
split; BENCHMARKS.md "The GenRM image recipe in every fixed mode"). So with -1 the run
measures instead of guessing: ``steps`` colocate steps with one thread per core and
``steps`` with one thread, in the order A B B A A B ... (one thread per core is A), and
keeps the count whose judge model time per scored sample (the median over its steps) is
lower. Measured one count after the other (A A B B), it kept the slower count in 1 of 3
runs of the placement bench's judge (bench/placement/colocate_judge_threads_measured.json
as committed in 9bfed05): a trend over a run's first steps (a process still warming, the
machine) falls on one count only there, and A B B A cancels a linear one. The first
colocate step of the run is warm-up and not counted. A judge that reports no model time
(a vLLM server has no ``/stats``) gives nothing to compare, and keeps one thread per
core. The measurements are all-reduced figures (``placement/judge_busy_s`` and the
samples scored), so every controller reaches the same choice, which auto's cost model
then sees as colocate's thread count (it keeps judge times per mode and thread count).
The choice is logged as ``placement/judge_threads`` and kept in the checkpoint.
"""

from __future__ import annotations

import statistics

MEASURED = -1  # placement.judge_threads: choose by measurement


class JudgeThreads:
    def __init__(self, setting: int, cores: int, steps: int = 2):
        self.cores = max(1, cores)
        self.steps = max(1, steps)
        self.fixed = None if setting == MEASURED else (setting or self.cores)
        # the counts still to measure, in order (A B B A ...); one core: nothing to choose
        pair = (self.cores, 1)
        abba = [pair[i % 4 in (1, 2)] for i in range(2 * self.steps)]
        self.todo = abba if self.fixed is None and self.cores > 1 else []
        self.chosen: int | None = (
            self.fixed if self.fixed is not None else (None if self.todo else 1)
        )
        self.per_sample: dict[int, list[float]] = {}
        self.warmed = False

    def for_plan(self, plan, shared: int) -> int:
        """The judge's torch threads (over all its servers) when ``plan`` runs: ``shared``
        (reward.judge.threads x servers) in shared mode, one per judge core in partial."""
        if plan is None or plan.mode == "shared":
            return shared
        if plan.mode == "colocate":
            return self.current()
        return len(plan.judge)

    def current(self) -> int:
        """The judge's threads for the next colocate step."""
        return self.chosen if self.chosen is not None else self.todo[0]

    def observe(self, threads: int, judge_busy_s: float, samples: float) -> str | None:
        """One colocate step's judge model time over ``samples`` scored samples, on
        ``threads`` threads; returns a line to show when the choice is made."""
        if self.chosen is not None or samples <= 0 or judge_busy_s <= 0:
            return None
        if not self.warmed:
            self.warmed = True
            return None
        if threads != self.todo[0]:  # not the count this step was to measure
            return None
        self.per_sample.setdefault(threads, []).append(judge_busy_s / samples)
        self.todo.pop(0)
        if self.todo:
            return None
        med = {t: statistics.median(v) for t, v in self.per_sample.items()}
        self.chosen = min(med, key=lambda t: (med[t], -t))
        shown = ", ".join(f"{1e3 * v:.2f} ms on {t}" for t, v in sorted(med.items(), reverse=True))
        return (
            f"colocate's judge: {shown} thread(s) per sample (model time, median of "
            f"{self.steps} steps): keeps {self.chosen}"
        )

    def checkpoint_entry(self) -> dict:
        """``{"judge_threads": state}`` for a controller's placement state once a colocate
        step has judged something; nothing when the count is set or nothing was seen."""
        if self.fixed is not None or not self.warmed:
            return {}
        return {"judge_threads": self.state_dict()}

    def state_dict(self) -> dict:
        return {
            "cores": self.cores,
            "chosen": self.chosen,
            "todo": list(self.todo),
            "per_sample": {str(t): v for t, v in self.per_sample.items()},
            "warmed": self.warmed,
        }

    def load_state_dict(self, state: dict | None) -> None:
        """A checkpoint's measurements, when this run measures on as many cores."""
        if self.fixed is not None or not state or state.get("cores") != self.cores:
            return
        self.chosen = state["chosen"]
        self.todo = [int(t) for t in state["todo"]]
        self.per_sample = {int(t): list(v) for t, v in state["per_sample"].items()}
        self.warmed = bool(state["warmed"])
