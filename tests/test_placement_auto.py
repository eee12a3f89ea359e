"""Auto placement on synthetic cost profiles: the cost model's point and optimistic
predictions, ties broken by measuring, choices by measured medians, drift confirmed over
two steps and followed at once from the scaled model (every figure hand-worked)."""

from __future__ import annotations

import pytest

from mmyatt.placement.auto import AutoPlacer, CostModel, Measure, pipeline
from mmyatt.placement.config import make_plan

SHARED = make_plan("shared", (0, 1))
COLOCATE = make_plan("colocate", (0, 1))
PARTIAL = make_plan("partial", (0, 1), 1, 1)
PLANS = [SHARED, COLOCATE, PARTIAL]


def threads(colocate: int = 1):
    """The judge's threads per mode, as the runner gives them: shared on
    reward.judge.threads (1), colocate on placement.judge_threads, partial on its cores."""
    return lambda plan: {"shared": 1, "colocate": colocate}.get(plan.mode, len(plan.judge))


def _measure(mode, r, j, gen, judge, reload=0.0, train=1.0, rest=0.0, chunks=2, threads=0):
    if mode == "colocate":
        phases = gen + reload + judge
    elif mode == "shared":
        phases = gen + judge
    else:
        phases = pipeline(gen, judge, chunks)
    collect = phases + rest
    return Measure(mode, r, j, gen, judge, reload, train, collect, collect + train, chunks, threads)


def _run(a: AutoPlacer, measures) -> list[tuple[str, str | None]]:
    out = []
    for m in measures:
        plan, line = a.next_plan()
        out.append((a.key(plan), line))
        a.observe(m)
    return out


def test_pipeline_math():
    # 4 chunks: generation 8 s, judging 4 s; the judge finishes 1 s after the last chunk
    assert pipeline(8.0, 4.0, 4) == pytest.approx(9.0)
    assert pipeline(2.0, 8.0, 4) == pytest.approx(8.5)  # judge-bound: waits for chunk 1
    assert pipeline(3.0, 3.0, 1) == pytest.approx(6.0)  # one chunk: nothing overlaps


def test_cost_model_point_and_optimistic_predictions():
    m = CostModel(cores=2, has_judge=True, explore_margin=0.15, threads_of=threads(colocate=2))
    m.observe(_measure("partial", 1, 1, gen=6.0, judge=4.0))  # max(6 + 2, 4 + 3) = 8
    assert m.predict(PARTIAL) == pytest.approx(8.0 + 1.0)
    # shared: generation 6 s on 1 core -> 3 on 2; the judge on 1 thread as measured: 4
    assert m.predict(SHARED) == pytest.approx(3.0 + 4.0 + 1.0)
    # optimistic: both measured beside the other role, so alone up to 15% faster
    assert m.predict(SHARED, optimistic=True) == pytest.approx(0.85 * 3 + 0.85 * 4 + 1.0)
    # colocate's judge on 2 threads: never assumed faster (point), ideally twice (optimistic)
    assert m.predict(COLOCATE) == pytest.approx(3.0 + 4.0 + 1.0)
    assert m.predict(COLOCATE, optimistic=True) == pytest.approx(0.85 * 3 + 0.85 * 2 + 1.0)

    # a judge measured on 2 threads is slowed by the ratio on 1, also optimistically
    m2 = CostModel(cores=2, has_judge=True, threads_of=threads(colocate=2))
    m2.observe(_measure("colocate", 2, 2, gen=2.0, judge=0.6, reload=0.3, threads=2))
    assert m2.judge_time(1, "shared") == pytest.approx(1.2)
    assert m2.predict(SHARED, optimistic=True) == pytest.approx(2.0 + 1.2 + 1.0)
    # with the judge also measured on 1 thread (in partial), shared's 1-thread judge comes
    # from that one (the same thread count), not from 2 threads scaled
    m2.observe(_measure("partial", 1, 1, gen=4.0, judge=0.9))
    assert m2.judge_time(1, "shared") == pytest.approx(0.9)
    assert m2.judge_time(1, "shared", optimistic=True) == pytest.approx(0.9 * 0.85)


def test_cost_model_scales_an_unmeasured_core_count_by_cores():
    m = CostModel(cores=4, has_judge=True)
    m.observe(_measure("colocate", 4, 4, gen=2.0, judge=1.0))
    assert m.gen_time("colocate", 1) == pytest.approx(8.0)
    assert m.judge_time(2, "colocate") == pytest.approx(2.0)
    assert m.predict(make_plan("partial", (0, 1, 2, 3), 3, 1)) is not None


def _tied(shared_gen: float, shared_judge: float) -> tuple[AutoPlacer, list]:
    """Partial measured with the judge as costly as generation on 2 chunks: the model
    predicts shared exactly equal to it (10 s), the tie the optimistic bound breaks."""
    part = _measure("partial", 1, 1, gen=6.0, judge=6.0)  # max(6 + 3, 6 + 3) + 1 = 10
    shared = _measure("shared", 2, 2, gen=shared_gen, judge=shared_judge, threads=1)
    a = AutoPlacer(PLANS, has_judge=True, start_partial=PARTIAL, profile=2, judge_threads=threads())
    seen = _run(a, [part, part, part])  # warm-up, 2 profiled
    assert [k for k, _ in seen] == ["partial 1:1"] * 3
    plan, line = a.next_plan()
    # point: shared 6 / 2 + 6 + 1 = 10 = partial; optimistic 0.85 * (3 + 6) + 1 = 8.65 < 0.97 * 10
    assert a.predictions["shared"] == pytest.approx(10.0)
    assert a.estimates["partial 1:1"] == pytest.approx(10.0)
    assert plan == SHARED and line.startswith("profiled: auto measures shared (at best 8.65s")
    return a, _run(a, [shared, shared])[1:]


def test_auto_breaks_a_tie_by_measuring_and_keeps_the_faster_measured():
    a, _ = _tied(shared_gen=2.5, shared_judge=5.0)  # shared measured 2.5 + 5 + 1 = 8.5
    plan, line = a.next_plan()
    assert plan == SHARED and line.startswith("measured shared: auto keeps shared")
    assert a.estimates["shared"] == pytest.approx(8.5)
    # colocate: shared's roles (measured alone, same judge threads), no reload measured:
    # 8.5 at best too, not below 0.97 * 8.5, so not measured
    assert a.estimates["colocate"] == pytest.approx(8.5)
    assert a.next_plan() == (SHARED, None)


def test_auto_breaks_a_tie_by_measuring_and_goes_back_when_slower():
    a, _ = _tied(shared_gen=3.5, shared_judge=6.5)  # shared measured 11 > partial's 10
    plan, line = a.next_plan()
    assert plan == PARTIAL and line.startswith("measured shared: auto picks partial 1:1")
    assert a.estimates == pytest.approx({"shared": 11.0, "partial 1:1": 10.0, "colocate": 11.0})


def test_auto_without_a_judge_keeps_shared_and_never_runs_colocate():
    a = AutoPlacer(PLANS, has_judge=False, start_partial=PARTIAL, profile=2)
    shared = _measure("shared", 2, 2, gen=4.0, judge=0.0)
    assert [k for k, _ in _run(a, [shared] * 8)] == ["shared"] * 8
    # partial: 4 s on 2 cores -> 8 on 1 (measured alone: no optimistic discount), + 1
    assert a.estimates == pytest.approx({"shared": 5.0, "partial 1:1": 9.0})


def test_auto_one_slow_step_is_noise_not_drift():
    a = AutoPlacer(PLANS, has_judge=False, start_partial=PARTIAL, profile=2, every=4)
    ok = _measure("shared", 2, 2, gen=4.0, judge=0.0)
    spike = _measure("shared", 2, 2, gen=12.0, judge=0.0)  # x3 once
    seen = _run(a, [ok, ok, ok, spike, ok, ok, ok])
    assert all(k == "shared" for k, _ in seen)
    assert not any(line and "drift" in line for _, line in seen)
    assert a.model.gen[("shared", 2)] == pytest.approx(4.0)  # the spike was not folded in
    plan, line = a.next_plan()  # 4 steps since the choice: re-evaluated on the median
    assert line.startswith("re-evaluation: auto keeps shared")
    assert a.estimates["shared"] == pytest.approx(5.0)  # median of 5, 13, 5, 5, 5


def test_auto_follows_a_judge_that_grows_to_the_plan_that_gives_it_more_threads():
    """A cheap judge: auto explores colocate (its judge on 2 threads), settles on shared;
    the judge grows x5 (confirmed over 2 steps): colocate, as its scaled measurements
    predict, without measuring anything again first."""
    part = _measure("partial", 1, 1, gen=4.0, judge=1.0)  # max(4 + 0.5, 1 + 2) + 1 = 5.5
    colo = _measure("colocate", 2, 2, gen=2.0, judge=0.6, reload=0.3, rest=0.5, threads=2)  # 4.4
    shared = _measure("shared", 2, 2, gen=2.0, judge=1.0, threads=1)  # 4.0
    a = AutoPlacer(
        PLANS, has_judge=True, start_partial=PARTIAL, profile=1, every=100,
        judge_threads=threads(colocate=2),
    )  # fmt: skip
    seen = _run(a, [part, part, colo, shared, shared])
    assert [k for k, _ in seen] == ["partial 1:1", "partial 1:1", "colocate", "shared", "shared"]
    # profiled: point shared 2 + 1 + 1 = 4 (best); optimistic colocate 1.7 + 0.425 + 1
    # = 3.125 < 0.97 * 4: measured first
    assert seen[2][1].startswith("profiled: auto measures colocate (at best 3.12s")
    # measured colocate 4.4; shared: generation from colocate (2 cores) 2, the judge from
    # partial (1 thread, as shared's) 1: 2 + 1 + 1 = 4 (best); optimistic, the judge
    # measured beside generation: 2 + 0.85 + 1 = 3.85 < 0.97 * 4: measured
    assert seen[3][1].startswith("measured colocate: auto measures shared (at best 3.85s")
    assert seen[4][1].startswith("measured shared: auto keeps shared")
    grown = _measure("shared", 2, 2, gen=2.0, judge=5.0, threads=1)  # 8.0
    seen = _run(a, [grown, grown])
    assert seen == [("shared", None), ("shared", None)]  # the first move waits for a second
    plan, line = a.next_plan()
    assert line.startswith("drift (judge x5.00): auto picks colocate")
    assert a.model.judge[("colocate", 2)] == pytest.approx(3.0)  # 0.6 x 5
    # colocate 2 + 0.3 + 3 + 1 + 0.5 = 6.8; partial max(4 + 2.5, 5 + 2) + 1 = 8; shared
    # measured 8, 8 since the drift
    assert a.estimates == pytest.approx({"colocate": 6.8, "partial 1:1": 8.0, "shared": 8.0})
    big = _measure("colocate", 2, 2, gen=2.0, judge=3.0, reload=0.3, rest=0.5, threads=2)
    a.observe(big)
    plan, line = a.next_plan()
    assert plan == COLOCATE and line.startswith("measured colocate: auto keeps colocate")


def test_auto_profile_all_runs_colocate_then_partial():
    colo = _measure("colocate", 2, 2, gen=4.0, judge=4.0, reload=0.5)  # 9.5
    part = _measure("partial", 1, 1, gen=6.0, judge=6.0, chunks=4)  # 7.5 + 1 = 8.5
    a = AutoPlacer(
        [COLOCATE, PARTIAL], has_judge=True, start_partial=PARTIAL, profile=1, profile_all=True
    )
    seen = _run(a, [colo, colo, part])
    assert [k for k, _ in seen] == ["colocate", "colocate", "partial 1:1"]
    plan, line = a.next_plan()
    assert plan == PARTIAL and "picks partial 1:1" in line
    assert a.predictions == pytest.approx({"colocate": 9.5, "partial 1:1": 8.5})


def test_auto_measures_shared_before_settling_when_partial_chunks_hide_its_cost():
    """Partial streams 8 small chunks per controller: its measured pipeline (generation 4
    s on 1 core, judging 4 s) hides almost all generation, and shared's bound from it
    (generation 0.85 x 2, the judge 0.85 x 4, training 1: 6.1 s) is not below 0.97 x
    partial's 5.5 s (colocate's, its judge on 1 thread, is the same). Shared is still
    measured once before auto settles; its whole batches are judged twice as fast (2 s)
    as the chunks were, and auto keeps shared."""
    part = _measure("partial", 1, 1, gen=4.0, judge=4.0, chunks=8)  # max(4.5, 4.5) + 1
    shared = _measure("shared", 2, 2, gen=1.5, judge=2.0, threads=1)  # 4.5
    a = AutoPlacer(
        PLANS, has_judge=True, start_partial=PARTIAL, profile=2, every=100,
        judge_threads=threads(),
    )  # fmt: skip
    seen = _run(a, [part, part, part])
    assert a.model.predict(PARTIAL) == pytest.approx(5.5)
    assert a.model.predict(SHARED, optimistic=True) == pytest.approx(6.1)
    assert a.model.predict(COLOCATE, optimistic=True) == pytest.approx(6.1)
    seen += _run(a, [shared, shared])
    assert [k for k, _ in seen] == ["partial 1:1"] * 3 + ["shared"] * 2
    assert seen[3][1] == "profiled: auto measures shared (the unpinned baseline)"
    plan, line = a.next_plan()
    assert plan == SHARED and line.startswith("measured shared: auto keeps shared")
    assert a.estimates["shared"] == pytest.approx(4.5)
    assert a.estimates["partial 1:1"] == pytest.approx(5.5)
    assert a.baseline_due is False  # once: later choices follow measurements and bounds
