"""Colocate's judge threads chosen by measurement (placement.judge_threads=-1)."""

from __future__ import annotations

import os

import pytest

from mmyatt.config.schema import ConfigError, load_config
from mmyatt.placement import resources as res
from mmyatt.placement.judge_threads import JudgeThreads
from tests.test_placement_runner import SAMPLING, Ctl, JudgeSpy, placement, produce


def test_measures_all_cores_and_one_thread_in_abba_order_and_keeps_the_faster():
    jt = JudgeThreads(-1, cores=4, steps=2)
    assert jt.current() == 4
    assert jt.observe(4, 9.0, 10) is None  # the run's first colocate step: warm-up
    assert jt.observe(4, 0.05, 10) is None and jt.current() == 1  # A (5 ms per sample)
    assert jt.observe(1, 0.04, 10) is None and jt.current() == 1  # B
    assert jt.observe(1, 0.045, 10) is None and jt.current() == 4  # B
    line = jt.observe(4, 0.07, 10)  # A: 4 threads' median 6 ms, 1 thread's 4.25 ms
    assert jt.current() == 1 and jt.chosen == 1
    assert line == (
        "colocate's judge: 6.00 ms on 4, 4.25 ms on 1 thread(s) per sample (model time, "
        "median of 2 steps): keeps 1"
    )
    assert jt.observe(1, 1.0, 10) is None and jt.current() == 1  # decided once
    # three steps each: A B B A A B
    three = JudgeThreads(-1, cores=2, steps=3)
    assert three.todo == [2, 1, 1, 2, 2, 1]


def test_a_step_on_another_count_is_not_counted():
    """A colocate step that ran on a count other than the one due (the count is read when
    the judge is placed) adds nothing and moves nothing."""
    jt = JudgeThreads(-1, cores=2, steps=1)
    jt.observe(2, 1.0, 1)  # warm-up
    assert jt.observe(1, 0.01, 10) is None
    assert jt.todo == [2, 1] and jt.per_sample == {}


def test_more_threads_kept_when_faster_or_tied():
    jt = JudgeThreads(-1, cores=2, steps=1)
    jt.observe(2, 1.0, 1)  # warm-up
    jt.observe(2, 0.02, 10)
    assert jt.observe(1, 0.03, 10).endswith("keeps 2") and jt.current() == 2
    tie = JudgeThreads(-1, cores=2, steps=1)
    for threads, busy in ((2, 1.0), (2, 0.02), (1, 0.02)):
        tie.observe(threads, busy, 10)
    assert tie.current() == 2


def test_set_counts_and_one_core_measure_nothing():
    assert JudgeThreads(0, cores=2).current() == 2  # one per core
    assert JudgeThreads(3, cores=2).current() == 3
    one = JudgeThreads(-1, cores=1)
    assert one.current() == 1 and one.chosen == 1
    fixed = JudgeThreads(0, cores=2, steps=1)
    assert all(fixed.observe(2, 0.1, 10) is None for _ in range(4)) and fixed.current() == 2
    # a step that scored nothing (or a judge that did no work) is not a measurement
    jt = JudgeThreads(-1, cores=2, steps=1)
    jt.observe(2, 1.0, 1)
    assert jt.observe(2, 0.0, 10) is None and jt.observe(2, 0.1, 0) is None
    assert jt.current() == 2 and jt.per_sample == {}


def test_checkpoint_carries_a_measurement_under_way_on_the_same_cores():
    jt = JudgeThreads(-1, cores=2, steps=2)
    assert jt.checkpoint_entry() == {}  # no colocate step has judged anything yet
    assert JudgeThreads(0, cores=2).checkpoint_entry() == {}  # a set count: nothing to keep
    for threads, busy in ((2, 1.0), (2, 0.05), (1, 0.04)):
        jt.observe(threads, busy, 10)
    again = JudgeThreads(-1, cores=2, steps=2)
    again.load_state_dict(jt.checkpoint_entry()["judge_threads"])
    assert again.current() == 1 and again.todo == [1, 2]
    assert again.per_sample == {2: [0.005], 1: [0.004]}
    other = JudgeThreads(-1, cores=4, steps=2)  # other cores: measured afresh
    other.load_state_dict(jt.state_dict())
    assert other.current() == 4 and other.per_sample == {}


def test_config_measures_by_default_and_refuses_below_minus_one():
    assert load_config(None, []).placement.judge_threads == -1
    assert load_config(None, ["placement.judge_threads=0"]).placement.judge_threads == 0
    with pytest.raises(ConfigError, match=r"placement.judge_threads must be >= -1, got -2"):
        load_config(None, ["placement.judge_threads=-2"])


class TimedJudge(JudgeSpy):
    """A judge whose model time per sample depends on the threads it was placed with."""

    def __init__(self, ms_per_sample: dict[int, float], samples: int):
        super().__init__()
        self.cost, self.samples = ms_per_sample, samples
        self.threads: list[int] = []
        self.busy = 0.0

    def place(self, cores, threads, reset_peak=False):
        super().place(cores, threads)
        self.threads.append(threads)

    def wake(self):  # colocate wakes the judge for its phase: it scores the step's samples
        super().wake()
        self.busy += self.samples * self.cost[self.threads[-1]] / 1e3

    def stats(self):
        return {"peak_rss_mb": 0.0, "model_time_s": self.busy}


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 cores")
def test_colocate_steps_measure_both_counts_then_run_the_faster():
    import torch

    cfg = load_config(
        None, ["placement.mode=colocate", "placement.judge_threads=-1", "placement.cores=[0,1]"]
    )
    lines: list[str] = []
    pl = placement(cfg)
    pl.log = lambda s, **k: lines.append(s)
    pl.has_judge, pl.judges = True, TimedJudge({2: 4.0, 1: 3.0}, samples=2)
    cores, threads = sorted(os.sched_getaffinity(0)), torch.get_num_threads()
    logged = []
    try:
        for _ in range(7):
            produce(pl, Ctl(), 2, SAMPLING)
            logged.append(pl.end_step()["placement/judge_threads"])
    finally:
        res.pin_process(cores)
        torch.set_num_threads(threads)
    # warm-up on both cores, then both cores, 1, 1, both (A B B A), then 1 thread kept
    assert logged == [2.0, 2.0, 1.0, 1.0, 2.0, 1.0, 1.0]
    assert lines == [
        "[placement] colocate's judge: 4.00 ms on 2, 3.00 ms on 1 thread(s) per sample "
        "(model time, median of 2 steps): keeps 1"
    ]
    assert pl.state_dict()["judge_threads"]["chosen"] == 1
