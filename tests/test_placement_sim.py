"""The placement simulator on hand-worked cases: series phases in colocate, streaming
overlap and queueing in partial, processor sharing of controllers over fewer units."""

from __future__ import annotations

import pytest

from mmyatt.placement.simulate import Profile, at_scale, simulate, simulate_one_step_off


def prof(**kw) -> Profile:
    base = dict(
        chunk_gen_s=[[1.0, 1.0], [1.0, 1.0]],  # 2 controllers x 2 chunks of 1 core-second
        samples_per_chunk=4,
        judge_sample_s=0.25,  # a chunk of 4 samples: 1 core-second of judging
        judge_eff=1.0,
        reload_s=0.5,
        train_s=2.0,
    )
    base.update(kw)
    return Profile(**base)


def test_colocate_runs_phases_in_series():
    # generate: 2 controllers on 2 units, 2 s each; reload 0.5; judge 4 chunks x 1 core-s on
    # 2 units (linear) = 2 s; train 2 s -> 6.5 s
    r = simulate(prof(), "colocate", 2)
    assert r.step_s == pytest.approx(2.0 + 0.5 + 2.0 + 2.0)
    assert r.idle_frac_rollout == pytest.approx(1 - 4.0 / (2 * 4.5))


def test_one_step_off_lasts_as_long_as_the_slower_side():
    # 4 units, 2 for rollouts: generation 2 controllers x 2 chunks of 1 core-s on 2 units
    # = 2 s, reload 0.5, judging 4 core-s on 2 units = 2 s -> the rollout side takes 4.5 s;
    # training, 2 s of work on 4 units, gets 2 units: 4 s -> the step is 4.5 s
    assert simulate_one_step_off(prof(), 4, 2).step_s == pytest.approx(4.5)
    # training, 6 s of work on 4 units, gets 1 unit: 24 s; the rollout side on 3 units is
    # shorter (generation 2 s, reload 0.5 s, judging 4 core-s on 3 units 4/3 s)
    assert simulate_one_step_off(prof(train_s=6.0), 4, 3).step_s == pytest.approx(24.0)
    with pytest.raises(ValueError, match="rollout units"):
        simulate_one_step_off(prof(), 4, 4)


def test_partial_streams_chunks_and_shares_the_rollout_core():
    # 2 controllers share 1 rollout unit: each chunk takes 2 s of wall, the two first
    # chunks finish together at t=2 and the two last at t=4; the judge (1 unit) takes the
    # first two as one batch: 2 s, done at t=4, then the last two: done at t=6; + train 2
    r = simulate(prof(), "partial", 2, 1, 1)
    assert r.step_s == pytest.approx(8.0)
    assert r.idle_frac_judge == pytest.approx(1 - 4.0 / 6.0)


def test_partial_without_a_judge_is_generation_alone():
    r = simulate(prof(judge_sample_s=0.0), "partial", 2, 1, 1)
    assert r.step_s == pytest.approx(4.0 + 2.0)
    r = simulate(prof(judge_sample_s=0.0), "colocate", 2)
    assert r.step_s == pytest.approx(2.0 + 2.0)  # no judge, no reload


def test_shared_judges_each_controller_when_its_batch_is_done():
    # both controllers' batches take 2 core-s on 2 units: done at t=2; their 4 chunks
    # (1 core-s of judging each) on the judge's 1 unit: t=6; + train 2 -> 8
    p = prof(batch_gen_s=[[2.0], [2.0]])
    assert simulate(p, "shared", 2).step_s == pytest.approx(8.0)
    # uneven: controller 0 done at t=1, its 2 chunks judged 1..3 while controller 1 still
    # generates; controller 1 done at t=3, judged 3..5; + train 2 -> 7
    p = prof(batch_gen_s=[[1.0], [3.0]])
    r = simulate(p, "shared", 2)
    assert r.step_s == pytest.approx(7.0)
    assert r.idle_frac_judge == pytest.approx(1 - 4.0 / 5.0)
    # its own training time where the profile has one; 2 judge threads: 4 core-s in 2 s
    p = prof(batch_gen_s=[[2.0], [2.0]], train_by_mode={"shared": 1.0}, shared_judge_units=2)
    assert simulate(p, "shared", 2).step_s == pytest.approx(2.0 + 2.0 + 1.0)
    assert simulate(prof(judge_sample_s=0.0), "shared", 2).step_s == pytest.approx(2.0 + 2.0)


def test_sublinear_judge_makes_partial_win():
    # a judge that gains nothing from a second unit (eff 0): colocate judges 4 s after
    # generating 2 s; partial overlaps: as above but the judge keeps pace -> 8 s vs 8.5 s
    p = prof(judge_eff=0.0)
    assert simulate(p, "colocate", 2).step_s == pytest.approx(2.0 + 0.5 + 4.0 + 2.0)
    assert simulate(p, "partial", 2, 1, 1).step_s == pytest.approx(8.0)


def test_at_scale_rows_cover_8_to_64_gpus_quick():
    rows = at_scale(prof(), quick=True)
    assert [r["gpus"] for r in rows] == [8, 64]
    for r in rows:
        assert r["colocate_step_s"] > 0 and r["partial_over_colocate"] > 0
        assert r["single_controller_driver_media_gb"] == pytest.approx(
            r["gpus"] * r["per_controller_media_gb"]
        )


def test_calibrate_reads_each_role_from_the_arm_that_ran_it(tmp_path):
    import json

    from mmyatt.placement.simulate import bench_placement_sim, calibrate

    def arm(gen, judge, train, step, reload=0.0):
        return {
            "phase_s": {"gen_s": gen, "judge_busy_s": judge, "train_s": train},
            "judge_reload_s": reload,
            "step_s": step,
        }

    wl = {
        "colocate": arm(1.0, 2.0, 0.5, 4.0, 0.1),
        "partial": arm(4.0, 3.0, 0.4, 5.0),
        "shared": arm(9.0, 9.0, 9.0, 4.5),  # not read: shared is predicted from the others
    }
    measured = {"stream_groups": 2, "judge_heavy": wl, "rollout_heavy": wl}
    p = calibrate(measured, "judge_heavy")
    # partial: 2 controllers shared one core for 4 s -> 2 core-s each, 2 chunks of 1 s
    assert p.chunk_gen_s == [[1.0, 1.0], [1.0, 1.0]] and p.samples_per_chunk == 16
    assert p.batch_gen_s == [[1.0], [1.0]]
    assert p.judge_sample_s == pytest.approx(3.0 / 64)  # 64 samples judged on one core
    assert p.judge_eff == pytest.approx(3.0 / 2.0 - 1.0)  # 2 cores: 1.5x faster
    assert p.reload_s == 0.1 and p.train_s == 0.5
    assert p.train_by_mode == {"partial": 0.4, "shared": 0.4} and p.shared_judge_units == 1
    path = tmp_path / "placement.json"
    path.write_text(json.dumps(measured))
    out = bench_placement_sim(quick=True, measured_path=path)
    assert out["measured"] == "placement.json"  # outside the checkout: the name, no path
    committed = bench_placement_sim(quick=True)  # the committed figures, named in the repo
    assert committed["measured"] == "results/bench/placement.json"
    assert {(r["workload"], r["mode"]) for r in out["validation"]} == {
        (w, m) for w in ("judge_heavy", "rollout_heavy") for m in ("shared", "colocate", "partial")
    }
    # shared (judge-heavy): both batches 1 s on their cores, 64 samples x 3/64 s on the
    # judge's one thread: 1 + 3, + partial's training 0.4
    row = next(
        r for r in out["validation"] if r["mode"] == "shared" and r["workload"] == "judge_heavy"
    )
    assert row["predicted_step_s"] == pytest.approx(1.0 + 3.0 + 0.4)
    assert [r["gpus"] for r in out["at_scale"]] == [8, 64]


def test_finish_fractions_hand_worked():
    # half the samples run to the cap of 2 tokens: P(length > t) = q^t with q^2 = 1/2;
    # quantiles 1/8, 3/8, 5/8, 7/8 -> lengths log(1 - u) / log(q) = 0.385 (at least 1),
    # 1.356, 2.83 (cap 2), 6 (cap 2); the batch decodes 2 steps
    from mmyatt.placement.simulate import finish_fractions

    got = finish_fractions(4, mean=0.0, truncated=0.5, cap=2)
    assert got == pytest.approx([0.5, 1.356 / 2, 1.0, 1.0], abs=1e-3)
    # no truncation measured: the mean gives q = 1 - 1/mean
    assert finish_fractions(2, mean=2.0, truncated=0.0, cap=100) == pytest.approx([0.5, 1.0])


def test_calibrate_streams_single_samples_where_partial_did():
    from mmyatt.placement.simulate import calibrate, finish_fractions

    arm = {
        "phase_s": {"gen_s": 4.0, "judge_busy_s": 3.0, "train_s": 0.5},
        "judge_reload_s": 0.0,
        "step_s": 5.0,
        "response_length_mean": 10.0,
        "response_truncated_frac": 0.1,
    }
    measured = {
        "stream_groups": 2,
        "max_new_tokens": 20,
        "streaming": "text policy, pointwise judge: each sample as it finishes",
        "judge_heavy": {"colocate": arm, "partial": arm},
    }
    p = calibrate(measured, "judge_heavy")
    # 32 samples per controller, one chunk each, costs the gaps between finish times of
    # 2 core-s of generation (two controllers shared one core for 4 s)
    at = finish_fractions(32, 10.0, 0.1, 20)
    assert p.samples_per_chunk == 1 and len(p.chunk_gen_s) == 2
    assert p.chunk_gen_s[0] == pytest.approx([2.0 * (b - a) for a, b in zip([0.0, *at], at)])
    assert sum(p.chunk_gen_s[1]) == pytest.approx(2.0)
    assert p.judge_sample_s == pytest.approx(3.0 / 64)
    # without the streaming key: chunks of 2 prompt groups
    del measured["streaming"]
    assert calibrate(measured, "judge_heavy").chunk_gen_s == [[1.0, 1.0], [1.0, 1.0]]
