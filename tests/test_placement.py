"""Placement: mapping checks and their messages, the core pool, and auto's choice on
synthetic cost profiles (hand-worked predictions)."""

from __future__ import annotations

import os

import pytest

from mmyatt.config import ConfigError, RunConfig, apply_override, build, load_config
from mmyatt.placement import resources as res
from mmyatt.placement.auto import AutoPlacer, CostModel, Measure, pipeline
from mmyatt.placement.config import check_placement, make_plan

JUDGE = [
    "reward.functions=[{name: genrm}]",
    "reward.judge.model=/some/judge",
]


def check(overrides, cores=(0, 1)):
    """Build the config without load_config's own check (which looks at this machine's
    cores), then check placement against a machine with ``cores``."""
    tree: dict = {}
    for o in overrides:
        apply_override(tree, o)
    c = build(RunConfig, tree)
    check_placement(c, available=list(cores))
    return c


def test_shared_is_the_default_and_pins_nothing():
    assert load_config(None, []).placement.mode == "shared"
    with pytest.raises(ConfigError, match="placement.mode=shared pins nothing"):
        check(["placement.cores=[0]"])


def test_more_cores_than_exist_is_refused_with_the_cores_named():
    with pytest.raises(ConfigError, match=r"names core\(s\) \[2\].*cores \[0, 1\].*more cores"):
        check(["placement.mode=colocate", "placement.cores=[0, 1, 2]"])
    with pytest.raises(
        ConfigError, match=r"rollout_cores \(2\) \+ placement.judge_cores \(1\) = 3"
    ):
        check(
            [
                *JUDGE,
                "placement.mode=partial",
                "placement.rollout_cores=2",
                "placement.judge_cores=1",
            ]
        )


def test_partial_that_leaves_the_judge_or_rollout_nothing_is_refused():
    with pytest.raises(ConfigError, match="gives the judge nothing: rollout_cores=2 takes all 2"):
        check([*JUDGE, "placement.mode=partial", "placement.rollout_cores=2"])
    with pytest.raises(ConfigError, match="gives rollout nothing: judge_cores=2"):
        check([*JUDGE, "placement.mode=partial", "placement.judge_cores=2"])
    with pytest.raises(ConfigError, match="needs at least 2 cores, the run has 1"):
        check([*JUDGE, "placement.mode=partial"], cores=(0,))


def test_partial_needs_a_judge_started_with_the_run_and_no_batch_zscore():
    with pytest.raises(ConfigError, match="judge must be started with the run"):
        check(
            [
                "reward.functions=[{name: genrm}]",
                "reward.judge.urls=[http://127.0.0.1:9]",
                "placement.mode=partial",
            ]
        )
    with pytest.raises(ConfigError, match=r"zscore.*whole batch"):
        check(
            [
                *JUDGE,
                "reward.functions=[{name: genrm, zscore: true}]",
                "placement.mode=partial",
            ]
        )


def test_a_valid_split_and_its_plan():
    c = check([*JUDGE, "placement.mode=partial", "placement.cores=[0, 1]"])
    assert c.placement.mode == "partial"
    plan = make_plan("partial", (0, 1, 2, 3), 3, 1)
    assert plan.rollout == (0, 1, 2) and plan.judge == (3,) and plan.train == (0, 1, 2, 3)
    assert plan.split == "3:1"
    colo = make_plan("colocate", (0, 1))
    assert colo.rollout == colo.judge == colo.train == (0, 1)


def test_load_config_checks_placement_before_anything_starts():
    n = len(os.sched_getaffinity(0))
    with pytest.raises(ConfigError, match="more cores than exist"):
        load_config(None, ["placement.mode=colocate", f"placement.cores={list(range(n + 1))}"])


def test_pin_process_moves_every_thread_and_sets_threads():
    import threading

    import torch

    before, threads = sorted(os.sched_getaffinity(0)), torch.get_num_threads()
    stop = threading.Event()
    t = threading.Thread(target=stop.wait)
    t.start()
    try:
        one = before[:1]
        assert res.use_cores(one, sharers=1) == 1
        tid = t.native_id
        assert sorted(os.sched_getaffinity(tid)) == one  # a thread that already existed
        assert torch.get_num_threads() == 1
    finally:
        stop.set()
        t.join()
        res.pin_process(before)
        torch.set_num_threads(threads)
    assert sorted(os.sched_getaffinity(0)) == before


def test_pipeline_math():
    # 4 chunks: generation 8 s, judging 4 s; the judge finishes 1 s after the last chunk
    assert pipeline(8.0, 4.0, 4) == pytest.approx(9.0)
    assert pipeline(2.0, 8.0, 4) == pytest.approx(8.5)  # judge-bound: waits for chunk 1
    assert pipeline(3.0, 3.0, 1) == pytest.approx(6.0)  # one chunk: nothing overlaps


def _measure(mode, r, j, gen, judge, reload=0.0, train=1.0, rest=0.0, chunks=4):
    from mmyatt.placement.auto import pipeline as pl

    phases = gen + reload + judge if mode == "colocate" else pl(gen, judge, chunks)
    return Measure(
        mode, r, j, gen, judge, reload, train, phases + rest, phases + rest + train, chunks
    )


PLANS = [make_plan("colocate", (0, 1)), make_plan("partial", (0, 1), 1, 1)]


def _profiled(colo: Measure, part: Measure, **kw) -> AutoPlacer:
    a = AutoPlacer(PLANS, has_judge=True, start_partial=PLANS[1], profile=1, profile_all=True, **kw)
    seen = []
    for m in (colo, colo, part):  # warm-up, colocate profile, partial profile
        plan, _ = a.next_plan()
        seen.append(plan.mode)
        a.observe(m)
    assert seen == ["colocate", "colocate", "partial"]
    return a


def test_auto_picks_partial_when_the_judge_costs_as_much_as_rollout():
    colo = _measure("colocate", 2, 2, gen=4.0, judge=4.0, reload=0.5)
    part = _measure("partial", 1, 1, gen=6.0, judge=6.0)  # measured: 1 core each, 4 chunks
    a = _profiled(colo, part)
    plan, line = a.next_plan()
    assert plan.mode == "partial" and "picks partial 1:1" in line
    # hand-worked: colocate 4 + 0.5 + 4 + 1 = 9.5; partial max(6 + 1.5, 6 + 1.5) + 1 = 8.5
    assert a.predictions["colocate"] == pytest.approx(9.5)
    assert a.predictions["partial 1:1"] == pytest.approx(8.5)


def test_auto_picks_colocate_when_rollout_dominates():
    colo = _measure("colocate", 2, 2, gen=6.0, judge=0.5, reload=0.1)
    part = _measure("partial", 1, 1, gen=11.0, judge=0.9)
    a = _profiled(colo, part)
    plan, _ = a.next_plan()
    assert plan.mode == "colocate"
    assert a.predictions["colocate"] == pytest.approx(6.0 + 0.1 + 0.5 + 1.0)
    assert a.predictions["partial 1:1"] == pytest.approx(11.0 + 0.9 / 4 + 1.0)


def test_auto_without_a_judge_never_runs_partial():
    a = AutoPlacer(PLANS, has_judge=False, start_partial=PLANS[1], profile=1)
    modes = []
    for _ in range(5):
        plan, _ = a.next_plan()
        modes.append(plan.mode)
        a.observe(_measure("colocate", 2, 0, gen=4.0, judge=0.0))
    assert modes == ["colocate"] * 5
    assert a.predictions["partial 1:1"] == pytest.approx(8.0 + 1.0)  # 4 s on 2 cores -> 8 on 1


def test_auto_switches_when_the_judge_cost_drifts():
    # one core each in partial is slower than two, but not twice (as tiny models measure)
    colo = _measure("colocate", 2, 2, gen=4.0, judge=0.5, reload=0.1)
    part = _measure("partial", 1, 1, gen=5.0, judge=0.6)
    a = _profiled(colo, part, every=100)
    plan, _ = a.next_plan()
    assert plan.mode == "colocate"
    a.observe(colo)
    plan, line = a.next_plan()
    assert line is None  # nothing moved, not due: no re-evaluation
    a.observe(_measure("colocate", 2, 2, gen=4.0, judge=5.0, reload=0.1))  # judge x10
    plan, line = a.next_plan()
    assert line.startswith("drift (judge x10.00)")
    assert plan.mode == "partial"
    # the partial judge time was scaled by the same factor: 0.6 s -> 6 s on one core
    assert a.model.judge[("partial", 1)] == pytest.approx(6.0)
    # hand-worked: colocate 4 + 0.1 + 5 + 1 = 10.1; partial max(5 + 1.5, 6 + 1.25) + 1 = 8.25
    assert a.predictions["colocate"] == pytest.approx(10.1)
    assert a.predictions["partial 1:1"] == pytest.approx(8.25)


def test_cost_model_scales_an_unmeasured_core_count_by_cores():
    m = CostModel(cores=4, has_judge=True)
    m.observe(_measure("colocate", 4, 4, gen=2.0, judge=1.0))
    assert m.gen_time("colocate", 1) == pytest.approx(8.0)
    assert m.judge_time(2) == pytest.approx(2.0)
    assert m.predict(make_plan("partial", (0, 1, 2, 3), 3, 1)) is not None


def test_a_judge_without_placement_routes_keeps_shared_running_and_fails_pinning_clearly():
    import http.server
    import threading

    from mmyatt.placement.judges import JudgeControl

    class NotFound(http.server.BaseHTTPRequestHandler):  # e.g. `vllm serve`: no such routes
        def do_GET(self):  # noqa: N802
            self.send_response(404)
            self.end_headers()

        do_POST = do_GET  # noqa: N815

        def log_message(self, *args):
            pass

    srv = http.server.HTTPServer(("127.0.0.1", 0), NotFound)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        jc = JudgeControl([f"http://127.0.0.1:{srv.server_port}/v1"])
        assert jc.stats()["model_time_s"] == 0.0 and not jc.readable
        jc.reset_peak()  # no error: shared mode just has no judge figures
        with pytest.raises(RuntimeError, match="does not take POST /mmyatt/placement"):
            jc.place([0], 1)
    finally:
        srv.shutdown()


PLANS3 = [make_plan("shared", (0, 1)), *PLANS]


def _steps(a: AutoPlacer, measures) -> list[tuple[str, str | None]]:
    out = []
    for m in measures:
        plan, line = a.next_plan()
        out.append((plan.mode, line))
        a.observe(m(plan) if callable(m) else m)
    return out


def test_auto_with_a_judge_starts_partial_and_predicts_the_rest():
    part = _measure("partial", 1, 1, gen=6.0, judge=6.0)  # 4 chunks, train 1
    a = AutoPlacer(PLANS3, has_judge=True, start_partial=PLANS[1], profile=1)
    assert [m for m, _ in _steps(a, [part, part])] == ["partial", "partial"]  # warm-up, profile
    plan, line = a.next_plan()
    assert plan.mode == "partial" and line.startswith("profiled: auto picks partial 1:1")
    # hand-worked: partial max(6 + 1.5, 6 + 1.5) + 1 = 8.5; shared: generation on 2 cores
    # 6 / 2 = 3, the judge not assumed faster on more cores: 6, + train 1 = 10; colocate
    # the same with no reload measured yet
    assert a.predictions == pytest.approx({"partial 1:1": 8.5, "shared": 10.0, "colocate": 10.0})


def test_auto_measures_a_predicted_switch_then_chooses_again():
    part = _measure("partial", 1, 1, gen=10.0, judge=1.0)
    shared = _measure("shared", 2, 2, gen=5.5, judge=1.2)
    a = AutoPlacer(PLANS3, has_judge=True, start_partial=PLANS[1], profile=1)
    _steps(a, [part, part])
    plan, line = a.next_plan()
    # partial max(10 + 0.25, 1 + 2.5) + 1 = 11.25; shared 10 / 2 + 1 + 1 = 7 (colocate
    # ties with it: the first, shared, is taken)
    assert plan.mode == "shared" and "picks shared" in line
    assert a.predictions["partial 1:1"] == pytest.approx(11.25)
    assert a.predictions["shared"] == pytest.approx(7.0)
    a.observe(shared)  # the switch measured: 5.5 + 1.2 + 1 = 7.7
    plan, line = a.next_plan()
    assert plan.mode == "shared" and line.startswith("measured shared: auto keeps shared")
    assert a.predictions["shared"] == pytest.approx(7.7)
    a.observe(shared)
    assert a.next_plan() == (PLANS3[0], None)  # nothing due


def test_auto_without_a_judge_starts_shared_and_keeps_it():
    a = AutoPlacer(PLANS3, has_judge=False, start_partial=PLANS[1], profile=1)
    shared = _measure("shared", 2, 2, gen=4.0, judge=0.0)
    assert [m for m, _ in _steps(a, [shared] * 5)] == ["shared"] * 5
    # colocate: the same measured roles, no judge to reload; partial: 4 s on 2 cores -> 8
    assert a.predictions == pytest.approx({"shared": 5.0, "colocate": 5.0, "partial 1:1": 9.0})


def test_judge_sleep_gives_the_weights_memory_back_and_wake_reloads(tmp_path):
    """colocate's release on CPU: a ~97 MB judge's resident memory goes when its weights
    are dropped and comes back when they are reloaded (and used), the reload timed."""
    from mmyatt.placement.bench import _big_model
    from mmyatt.rewards.judge_server import JudgeServer

    path, params = _big_model(tmp_path / "judge", seed=1)
    weights_mb = params * 4 / 2**20

    def touch(server):  # a forward reads every weight page; summing them does the same
        return float(sum(p.detach().double().sum() for p in server.model.model.parameters()))

    server = JudgeServer(str(path))
    try:
        before = touch(server)
        awake = res.rss_mb()
        server.batcher.sleep()
        assert server.model is None
        asleep = res.rss_mb()
        reload_s = server.batcher.wake()
        assert touch(server) == before  # the same weights, read back from disk
        again = res.rss_mb()
    finally:
        server.batcher.stop()
    assert reload_s > 0 and server.batcher.stats["reloads"] == 1
    assert awake - asleep > 0.8 * weights_mb, (awake, asleep, weights_mb)
    assert again - asleep > 0.8 * weights_mb, (again, asleep, weights_mb)
