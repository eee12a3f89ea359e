"""The placement runner's per-step work: what a step under auto touches (affinity calls)
against the fixed mode it runs. One controller, a stand-in policy, scorer and shard (no
model): only the placement bookkeeping runs."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest

from mmyatt.config.schema import load_config
from mmyatt.distributed import Dist
from mmyatt.outputs.metrics import PhaseTimer
from mmyatt.placement import resources as res
from mmyatt.placement.config import candidate_plans
from mmyatt.placement.runner import Placement
from mmyatt.step.builders import build_placement

SAMPLING = SimpleNamespace(max_new_tokens=4)


class Shard:
    def __init__(self):
        self.i = 0

    def next_batch(self, n):
        out = [{"_index": self.i + k} for k in range(n)]
        self.i += n
        return out


class Rows(list):
    """A stand-in rollout: its records."""

    truncated = None


class Ctl:
    """A stand-in policy and scorer: the records back, unscored."""

    compares_groups = True

    def generate(self, records, group_size, sampling, seeds):
        return Rows(records)

    def score(self, r):
        return r


def placement(cfg, ctl=None, **kw) -> Placement:
    """The placement ``cfg`` asks for, over a stand-in shard, generating and scoring with
    ``ctl`` (a stand-in policy and scorer)."""
    ctl = ctl or Ctl()
    return build_placement(cfg, Dist(), Shard(), policy=ctl, scorer=ctl, **kw)


def produce(pl: Placement, ctl, n: int, sampling):
    """One ``produce`` call of ``pl`` with ``ctl`` as its policy and scorer."""
    pl.policy = pl.scorer = ctl
    return pl.produce(n, sampling, PhaseTimer())


@pytest.fixture
def calls(monkeypatch):
    """Every sched_setaffinity call made (thread id, mask), and in ``calls.pins`` every
    pin_process call (its cores); affinity restored after."""
    before = os.sched_getaffinity(0)
    made = Calls()
    real, real_pin = os.sched_setaffinity, res.pin_process

    def spy(tid, mask):
        made.append((tid, set(mask)))
        real(tid, mask)

    def pin_spy(cores, pid=None):
        made.pins.append(sorted(cores))
        return real_pin(cores, pid)

    monkeypatch.setattr(res.os, "sched_setaffinity", spy)
    monkeypatch.setattr(res, "pin_process", pin_spy)
    yield made
    real_pin(sorted(before))


class Calls(list):
    def __init__(self):
        super().__init__()
        self.pins: list[list[int]] = []


def _steps(pl: Placement, n: int) -> list[str]:
    ctl, modes = Ctl(), []
    for _ in range(n):
        produce(pl, ctl, 2, SAMPLING)
        modes.append(pl.end_step()["placement/mode"])
    return modes


def test_pin_process_leaves_threads_already_on_the_cores_alone(calls):
    cores = sorted(os.sched_getaffinity(0))
    assert res.pin_process(cores) == 0 and calls == []  # the mask it has: no call
    if len(cores) > 1:
        assert res.pin_process(cores[:1]) >= 1 and calls[-1][1] == {cores[0]}
        n = len(calls)
        assert res.pin_process(cores[:1]) == 0 and len(calls) == n
        res.pin_process(cores)
        assert sorted(os.sched_getaffinity(0)) == cores


def test_auto_running_shared_makes_no_affinity_call_until_a_pinned_plan_ran(calls):
    """Rule reward only: auto profiles shared (warm-up + 2 steps) and its shared steps
    touch nothing, as the fixed shared mode; after a colocate step the next shared step
    puts every thread back once, and the one after that again touches nothing."""
    cfg = load_config(None, ["placement.mode=auto", "placement.profile_steps=2"])
    pl = placement(cfg)
    assert _steps(pl, 3) == ["shared"] * 3
    assert calls == [] and calls.pins == []
    plans = {p.mode: p for p in candidate_plans(cfg)}
    pl.auto.queue = [plans["colocate"], plans["shared"], plans["shared"]]
    cores = set(plans["colocate"].cores)
    assert _steps(pl, 1) == ["colocate"]
    pinned = len(calls)  # colocate pins rollout and training to its cores (changed or not)
    assert all(mask == cores for _, mask in calls)
    pins = len(calls.pins)
    assert _steps(pl, 2) == ["shared", "shared"]
    assert calls.pins[pins:] == [sorted(cores)]  # put back once, by the first shared step
    assert len(calls) == pinned  # its cores were all the cores: no thread had to move
    assert sorted(os.sched_getaffinity(0)) == sorted(cores)


def test_a_shared_step_after_a_pinned_split_puts_the_threads_back_once(calls):
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        pytest.skip("partial needs 2 cores")
    cfg = load_config(None, ["placement.mode=auto", "placement.profile_steps=2"])
    pl = placement(cfg)
    plans = {(p.mode, len(p.rollout)): p for p in candidate_plans(cfg)}
    shared, part = plans[("shared", len(cores))], plans[("partial", 1)]
    pl.auto.queue = [part, shared, shared]
    ctl = Ctl()
    # partial pins generation to its rollout core; stop before its judge thread runs
    pl._begin_step()
    assert pl.plan == part
    res.use_cores(part.rollout, sharers=1)
    pl._pinned = True
    pl._collect_end = pl._t0
    pl.end_step()
    assert sorted(os.sched_getaffinity(0)) == list(part.rollout)
    n = len(calls)
    produce(pl, ctl, 2, SAMPLING)  # shared: back on every core
    pl.end_step()
    assert sorted(os.sched_getaffinity(0)) == cores and len(calls) > n
    n = len(calls)
    produce(pl, ctl, 2, SAMPLING)  # shared again: nothing to do
    pl.end_step()
    assert len(calls) == n


class StreamingCtl:
    """A policy that reports groups 0..3 finished one after another and a judge whose
    first call waits until generation is over, so the groups reported meanwhile must wait
    for the next call. Reward = the sample's row. (Groups the budget cuts are sent after
    generate returns, racing the next call: tests/test_placement_modes.py has them.)"""

    def __init__(self, G: int):
        import threading

        self.G, self.batches = G, []
        self.first_call = threading.Event()
        self.generated = threading.Event()

    UNIT = "group"  # a reward that compares a group's samples: partial streams groups
    compares_groups = True

    def units(self, n: int) -> list[list[int]]:
        """The rows reported finished, call by call."""
        return [list(range(g * self.G, (g + 1) * self.G)) for g in range(n // self.G)]

    def generate(self, records, group_size, sampling, seeds):
        import torch

        from mmyatt.rollout import Rollout

        G, N = self.G, len(records) * self.G
        outputs = [f"row {i}" for i in range(N)]
        assert sampling.finished_unit == self.UNIT
        for k, rows in enumerate(self.units(N)):
            sampling.on_finished(rows, [outputs[i] for i in rows])
            if k == 0:
                assert self.first_call.wait(5)  # the judge holds the first report
        self.generated.set()
        return Rollout(
            prompt_ids=[str(r["_index"]) for r in records for _ in range(G)],
            actions=torch.zeros(N, 1),
            logprobs=torch.zeros(N, 1),
            mask=torch.ones(N, 1),
            context={},
            outputs=outputs,
            records=[r for r in records for _ in range(G)],
        )

    def __call__(self, outputs, records, ids):
        import torch

        self.batches.append([int(o.split()[1]) for o in outputs])
        if len(self.batches) == 1:
            self.first_call.set()
            assert self.generated.wait(5)
        rows = torch.tensor(self.batches[-1], dtype=torch.float32)
        return rows, {"row": rows.clone()}

    def verdicts(self):
        return []

    def agree(self, error):
        assert error is None

    def finish(self, r, scored, verdicts=None):
        r.rewards, r.reward_parts = scored
        return r


def _partial_step(ctl, G: int = 2):
    """One partial step of 4 prompt groups with a streaming policy: (rollout, metrics)."""
    import torch

    from mmyatt.protocols import Sampling

    cfg = load_config(None, ["placement.mode=partial", f"sampling.group_size={G}"])
    pl = placement(cfg, ctl, streams_finished=True)
    cores, threads = sorted(os.sched_getaffinity(0)), torch.get_num_threads()
    try:
        r = produce(pl, ctl, 4, Sampling(max_new_tokens=4))
        return r, pl.end_step()
    finally:
        res.pin_process(cores)
        torch.set_num_threads(threads)


def test_partial_sends_the_first_group_at_once_and_coalesces_what_finishes_meanwhile():
    """Partial with a streaming policy: group 0 goes to the judge alone the moment it
    finishes; groups 1, 2 and 3, finished while the judge answers it, go in one call;
    the rewards come back in the rollout's row order."""
    import torch

    ctl = StreamingCtl(2)
    r, m = _partial_step(ctl)
    assert ctl.batches == [[0, 1], [2, 3, 4, 5, 6, 7]]
    assert m["placement/judge_calls"] == 2
    torch.testing.assert_close(r.rewards, torch.arange(8, dtype=torch.float32))
    torch.testing.assert_close(r.reward_parts["row"], torch.arange(8, dtype=torch.float32))


class PointwiseCtl(StreamingCtl):
    """Reports single samples, out of group order; its reward is pointwise
    (``compares_groups`` False), so partial streams samples, not groups."""

    UNIT = "sample"
    compares_groups = False
    ORDER = [3, 0, 5, 1, 2, 4, 6, 7]

    def units(self, n: int) -> list[list[int]]:
        return [[i] for i in self.ORDER]


def test_partial_streams_single_samples_to_a_pointwise_judge():
    """A pointwise reward: each sample goes to the judge as it finishes, without waiting
    for its group (row 3 alone, before row 2 of its group); what finishes while the
    judge answers goes in the next call; the rewards come back in row order."""
    import torch

    ctl = PointwiseCtl(2)
    r, m = _partial_step(ctl)
    assert ctl.batches == [[3], [0, 5, 1, 2, 4, 6, 7]]
    assert m["placement/judge_calls"] == 2
    torch.testing.assert_close(r.rewards, torch.arange(8, dtype=torch.float32))


class JudgeSpy:
    """The judges' control calls, in order."""

    readable = True  # its counters are read (JudgeControl.readable)

    def __init__(self):
        self.calls = []

    def wake(self):
        self.calls.append("wake")

    def sleep(self):
        self.calls.append("sleep")

    def place(self, cores, threads, reset_peak=False):
        self.calls.append("place")

    def stats(self):
        return {"peak_rss_mb": 0.0}

    def reset_peak(self):
        pass


def test_the_judge_is_placed_before_it_reloads_its_weights():
    """A judge colocate left asleep must be moved to its cores and thread count before it
    reloads: reloaded on 2 threads and then moved to 1 core, its next model calls ran 8x
    slower (the first partial step after colocate: 1.04 s of judge time against 0.13)."""
    import torch

    from mmyatt.protocols import Sampling

    cfg = load_config(None, ["placement.mode=partial", "sampling.group_size=2"])
    pl = placement(cfg, streams_finished=True)
    pl.judges = spy = JudgeSpy()
    cores, threads = sorted(os.sched_getaffinity(0)), torch.get_num_threads()
    try:
        produce(pl, StreamingCtl(2), 4, Sampling(max_new_tokens=4))
        pl.end_step()
        assert spy.calls[:2] == ["place", "wake"], spy.calls
        # auto's shared step after a pinned one puts the judge back the same way
        spy.calls.clear()
        shared = next(p for p in candidate_plans(cfg) if p.mode == "shared")
        pl._unpin(shared)
        assert spy.calls == ["place", "wake"], spy.calls
    finally:
        res.pin_process(cores)
        torch.set_num_threads(threads)


def test_auto_measures_the_share_of_samples_the_budget_cut():
    """Every step tells auto which share of its samples ran to the token budget (partial
    sends those only when generation ends: mmyatt/placement/auto.py ``streamable``)."""
    import torch

    class CutCtl(Ctl):
        def generate(self, records, group_size, sampling, seeds):
            r = Rows(records * 2)  # 2 groups of 2 samples
            r.truncated = torch.tensor([True, False, False, False])
            return r

    cfg = load_config(None, ["placement.mode=auto", "placement.profile_steps=2"])
    pl = placement(cfg)
    for _ in range(2):  # a warm-up step (not measured), then a measured one
        assert pl.auto.model.cut == 0.0
        produce(pl, CutCtl(), 2, SAMPLING)
        pl.end_step()
    assert pl.auto.model.cut == pytest.approx(0.25)


class PlaceSpy(JudgeSpy):
    """Records each placement (cores, threads) and where generation stood."""

    def __init__(self, ctl):
        super().__init__()
        self.ctl, self.placed = ctl, []

    def place(self, cores, threads, reset_peak=False):
        self.placed.append((sorted(cores), threads, self.ctl.generated.is_set()))


@pytest.mark.parametrize("widen", [True, False])
def test_partial_gives_the_judge_every_core_once_generation_is_done(widen):
    """Partial: the judge serves on its own cores while the controllers generate; once
    every controller has generated, it takes the rollout's cores too (every core, one
    thread per core) for what is left of its queue; placement.widen_judge=false keeps it
    on its share. The next partial step puts it back on its share."""
    import torch

    from mmyatt.protocols import Sampling

    cfg = load_config(
        None,
        [
            "placement.mode=partial",
            "sampling.group_size=2",
            "placement.cores=[0,1]",
            f"placement.widen_judge={str(widen).lower()}",
        ],
    )
    pl = placement(cfg, streams_finished=True)
    pl.has_judge = True
    cores, threads = sorted(os.sched_getaffinity(0)), torch.get_num_threads()
    if len(cores) < 2:
        pytest.skip("needs 2 cores")
    try:
        ctls = [StreamingCtl(2), StreamingCtl(2)]
        pl.judges = spy = PlaceSpy(ctls[0])
        for ctl in ctls:
            spy.ctl = ctl
            produce(pl, ctl, 4, Sampling(max_new_tokens=4))
            pl.end_step()
        share, every = (sorted(pl.plan.judge), len(pl.plan.judge)), ([0, 1], 2)
        assert len(pl.plan.judge) == 1
        want = [(*share, False)]
        if widen:
            want = [(*share, False), (*every, True), (*share, False), (*every, True)]
        assert spy.placed == want
    finally:
        res.pin_process(cores)
        torch.set_num_threads(threads)


def test_judge_calls_are_capped_while_generation_runs_and_the_rest_goes_in_one():
    """placement.stream_max_samples: while generation runs a call takes whole pieces up to
    that many samples (so the call under way when the judge is widened is short); once
    generation is done, everything still waiting goes in one call; rows kept in order."""
    import threading

    from mmyatt.placement.stream import JudgeStream

    held, release, batches = threading.Event(), threading.Event(), []

    def judge(outputs, records, ids):
        batches.append(list(outputs))
        if len(batches) == 1:
            held.set()
            assert release.wait(5)
        return list(outputs)

    s = JudgeStream(judge, max_call=2)
    s.send([0], ["a"], [None], ["p"])
    assert held.wait(5)
    for i, o in zip(range(1, 6), "bcdef"):
        s.send([i], [o], [None], ["p"])
    s.send([6, 7, 8], ["g", "h", "i"], [None] * 3, ["p"] * 3)  # a group: never split
    s.send([9], ["j"], [None], ["p"])
    release.set()
    while len(batches) < 5:  # what generation's sends scheduled
        threading.Event().wait(0.01)
    s.finish()
    out, error = s.results()
    s.close()
    assert error is None
    assert batches == [["a"], ["b", "c"], ["d", "e"], ["f"], ["g", "h", "i"], ["j"]]
    assert [i for rows, _ in out for i in rows] == list(range(10))


def test_finish_lifts_the_cap_for_what_still_waits():
    """Generation ends while the judge answers its first call: everything sent meanwhile
    goes in the next call, whatever the cap (on every core, when the judge is widened)."""
    import threading

    from mmyatt.placement.stream import JudgeStream

    held, release, batches = threading.Event(), threading.Event(), []

    def judge(outputs, records, ids):
        batches.append(list(outputs))
        if len(batches) == 1:
            held.set()
            assert release.wait(5)
        return list(outputs)

    s = JudgeStream(judge, max_call=2)
    s.send([0], ["a"], [None], ["p"])
    assert held.wait(5)
    for i, o in zip(range(1, 7), "bcdefg"):
        s.send([i], [o], [None], ["p"])
    s.finish()
    release.set()
    out, error = s.results()
    s.close()
    assert error is None
    assert batches == [["a"], list("bcdefg")]
    assert [i for rows, _ in out for i in rows] == list(range(7))


def test_auto_measurements_travel_in_the_controllers_checkpoint_state(calls):
    """A controller's placement state holds auto's measurements and choice; a run
    resumed on the same work starts where it was (a warm-up step, no profiling). A run
    with other work (here a longer completion budget) keeps the role times but measures
    before choosing; shared mode has nothing to keep."""
    args = ["placement.mode=auto", "placement.profile_steps=1"]
    pl = placement(load_config(None, args))
    _steps(pl, 3)  # warm-up, profile, the choice (its times are the stand-in's: ~0)
    state = pl.state_dict()
    assert set(state) == {"auto"} and state["auto"]["current"] == pl.auto.key(pl.auto.current)
    again = placement(load_config(None, args))
    again.load_state_dict(state)
    assert again.auto.model.gen == pl.auto.model.gen and again.auto.reason == "resumed"
    assert again.auto.queue == [pl.auto.current] and again.auto.current == pl.auto.current
    other = placement(load_config(None, [*args, "sampling.max_new_tokens=64"]))
    other.load_state_dict(state)
    assert other.auto.model.gen == pl.auto.model.gen and other.auto.model.work_changed
    assert other.auto.steps == {} and len(other.auto.queue) == 2
    assert placement(load_config(None, [])).state_dict() == {}


@pytest.mark.parametrize(
    ("judge", "reads"),
    [
        (["reward.judge.model=builtin:tiny_judge"], True),  # started by the run
        (["reward.judge.model=null", "reward.judge.urls=[http://127.0.0.1:9]"], False),
    ],
)
def test_shared_mode_reads_counters_only_of_judges_the_run_starts(judge, reads):
    """A judge at reward.judge.urls may be across a network: shared mode makes no call to
    it for counters (each would be a round trip on the step's path, around every phase)."""
    cfg = load_config("configs/flow_grpo_genrm_tiny.yaml", ["placement.mode=shared", *judge])
    assert cfg.placement.log_memory
    pl = placement(cfg)
    assert (pl.judges is not None) is reads
    if reads:  # a judge started by the run: its stand-in has no servers, counters read as 0
        pl.judges.urls = []
    produce(pl, Ctl(), 2, SAMPLING)
    # the judge's idle share only where its counters were read (not a made-up 1.0)
    assert ("placement/idle_frac_judge" in pl.end_step()) is reads
