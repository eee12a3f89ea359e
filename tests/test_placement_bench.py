"""The placement bench's arithmetic on hand-made arms (no run): per-segment means of the
drifting workload over rounds, and whether its best fixed mode changes."""

from __future__ import annotations

import pytest

from mmyatt.placement.bench_figures import MODES, combine_rounds, derive_ratios, paired_ratio, t95


def _arm(short: float, long: float, modes=("x",), labels=("short", "long")) -> dict:
    """A drifting workload's arm: two segments of 5 steps at these s/step."""
    seg = lambda s: {"step_s": s, "total_s": 5 * s, "modes_run": list(modes)}  # noqa: E731
    return {
        f"segment_{labels[0]}": seg(short),
        f"segment_{labels[1]}": seg(long),
        "total_s": 5 * (short + long),
        "steps_measured": 10,
    }


def _step_arm(step_s: float, modes: list[str] | None = None) -> dict:
    """A fixed workload's arm: its step time, the modes its steps ran (5 by default)."""
    modes = modes if modes is not None else ["x"] * 5
    return {
        "step_s": step_s,
        "total_s": step_s * len(modes),
        "modes_run": modes,
        "peak_rss_mb": 1.0,
        "idle_frac": {},
        "rollout_s": step_s / 2,
    }


def test_drifting_segments_are_averaged_over_rounds_and_the_best_change_is_found():
    per_round = {
        "shared": [_arm(0.5, 2.0), _arm(0.7, 2.2)],  # short 0.6, long 2.1
        "colocate": [_arm(0.65, 2.3), _arm(0.65, 2.3)],
        "partial": [_arm(1.0, 1.7), _arm(1.2, 1.9)],  # short 1.1, long 1.8
        "auto": [_arm(0.6, 1.8), _arm(0.6, 1.8)],
    }
    out = {"drifting": combine_rounds(per_round, "drifting")}
    assert out["drifting"]["shared"]["segment_short"]["step_s"] == pytest.approx(0.6)
    assert out["drifting"]["partial"]["segment_long"]["step_s_per_round"] == [1.7, 1.9]
    assert out["drifting"]["shared"]["total_s"] == pytest.approx(13.5)  # 5 x (0.6 + 2.1)
    derive_ratios(out)
    assert out["best_fixed_drifting"] == "shared"  # 13.5 against 14.5 (partial), 14.75
    assert out["auto_over_best_fixed_drifting"] == pytest.approx(12.0 / 13.5)
    assert out["drifting_best_fixed_per_segment"] == {"short": "shared", "long": "partial"}
    assert out["drifting_best_fixed_changes"] is True


def test_a_drift_whose_best_fixed_mode_stays_is_reported_as_such():
    per_round = {m: [_arm(0.5, 1.0)] for m in MODES}
    per_round["partial"] = [_arm(1.0, 1.1)]
    out = {"drifting": combine_rounds(per_round, "drifting")}
    derive_ratios(out)
    assert out["drifting_best_fixed_per_segment"] == {"short": "shared", "long": "shared"}
    assert out["drifting_best_fixed_changes"] is False


def test_auto_choice_is_the_mode_it_ran_most_not_its_last_step():
    """A re-evaluation may measure another plan for a few steps, even the run's last ones:
    auto's choice is the mode of most of its measured steps over all rounds."""

    per_round = {
        "shared": [_step_arm(1.0, ["shared"] * 6)] * 2,
        "colocate": [_step_arm(1.1, ["colocate"] * 6)] * 2,
        "partial": [_step_arm(0.9, ["partial"] * 6)] * 2,
        "auto": [
            _step_arm(0.9, ["shared"] * 2 + ["partial"] * 4),
            _step_arm(0.9, ["shared"] * 2 + ["partial"] * 2 + ["colocate"] * 2),
        ],
    }
    out = {"judge_heavy": combine_rounds(per_round, "judge_heavy")}
    derive_ratios(out)
    assert out["auto_last_mode_judge_heavy"] == "colocate"
    assert out["auto_choice_judge_heavy"] == "partial"
    assert out["auto_steps_per_mode_judge_heavy"] == {"shared": 4, "partial": 6, "colocate": 2}
    assert out["auto_picked_best_fixed_judge_heavy"] is True
    assert out["partial_over_colocate_judge_heavy"] == pytest.approx(0.9 / 1.1)


def test_paired_ratio_by_hand():
    """Ratios 1.0 and 1.21: geometric mean 1.1; the logs' standard error is ln 1.1, so
    the 95% interval (t with 1 degree of freedom, 12.706) is 1.1 ** (1 -+ 12.706)."""
    r = paired_ratio([2.0, 2.42], [2.0, 2.0])
    assert r["per_round"] == pytest.approx([1.0, 1.21])
    assert r["geo_mean"] == pytest.approx(1.1)
    assert r["ci95"] == pytest.approx([1.1 ** (1 - 12.706), 1.1 ** (1 + 12.706)])
    same = paired_ratio([0.9, 0.9, 0.9], [1.0, 1.0, 1.0])  # no spread: a point
    assert same["ci95"] == pytest.approx([0.9, 0.9])
    assert paired_ratio([0.9], [1.0])["ci95"] is None  # one round: no interval


def test_t_quantile_beyond_the_table_is_not_the_normals():
    assert t95(8) == pytest.approx(2.306)
    assert t95(16) == pytest.approx(2.120, abs=1e-3)  # Student's t, 16 and 30 degrees
    assert t95(30) == pytest.approx(2.042, abs=1e-3)


def test_acceptance_ratios_carry_their_round_by_round_spread():
    per_round = {
        "shared": [_step_arm(1.0), _step_arm(1.0)],
        "colocate": [_step_arm(1.0), _step_arm(2.0)],  # a slow round for everyone
        "partial": [_step_arm(0.9), _step_arm(1.8)],
        "auto": [_step_arm(0.95), _step_arm(2.1)],
    }
    out = {"judge_heavy": combine_rounds(per_round, "judge_heavy")}
    derive_ratios(out)
    # best fixed by the means: shared (1.0) against colocate (1.5) and partial (1.35)
    assert out["auto_over_best_judge_heavy_rounds"]["per_round"] == pytest.approx([0.95, 2.1])
    pc = out["partial_over_colocate_judge_heavy_rounds"]
    assert pc["per_round"] == pytest.approx([0.9, 0.9])  # the slow round cancels
    assert pc["ci95"] == pytest.approx([0.9, 0.9])
    drift = {m: [_arm(0.5, 1.0), _arm(0.6, 1.2)] for m in MODES}
    drift["auto"] = [_arm(0.45, 0.9), _arm(0.6, 1.2)]
    out = {"drifting": combine_rounds(drift, "drifting")}
    derive_ratios(out)
    assert out["auto_over_best_fixed_drifting_rounds"]["per_round"] == pytest.approx([0.9, 1.0])


def test_every_figure_of_an_arm_is_averaged_over_rounds_not_the_last_rounds():
    def arm(step_s: float, rollout_s: float, peak: float) -> dict:
        return {
            "step_s": step_s,
            "total_s": 5 * step_s,
            "modes_run": ["x"] * 5,
            "rollout_s": rollout_s,
            "cpu_util": step_s / 2,
            "peak_rss_mb": peak,
            "peak_rss_mb_by_phase": {"generate": peak - 10, "judge": peak, "train": None},
            "idle_frac": {"judge": 0.5},
        }

    per_round = {
        "shared": [arm(1.0, 0.8, 100.0)] * 2,
        "colocate": [arm(1.0, 0.6, 90.0), arm(2.0, 1.0, 110.0)],
        "partial": [arm(1.0, 0.5, 120.0), arm(1.4, 0.5, 120.0)],
        "auto": [arm(1.0, 0.5, 100.0)] * 2,
    }
    out = {"judge_heavy": combine_rounds(per_round, "judge_heavy")}
    c = out["judge_heavy"]["colocate"]
    assert c["rollout_s"] == pytest.approx(0.8)
    assert c["rollout_s_per_round"] == [0.6, 1.0]
    assert c["cpu_util"] == pytest.approx(0.75)
    assert c["peak_rss_mb"] == pytest.approx(100.0)
    assert c["peak_rss_mb_by_phase"] == {"generate": 90.0, "judge": 100.0, "train": None}
    derive_ratios(out)
    assert out["partial_over_colocate_rollout_judge_heavy"] == pytest.approx(0.5 / 0.8)
    assert out["peak_rss_mb_judge_heavy"]["partial"] == pytest.approx(120.0)


def test_judge_memory_rotates_the_modes_and_pairs_the_rounds(monkeypatch, tmp_path):
    """judge_memory runs colocate, partial and partial with the judge released for
    training in rotated order per round (no run here: the arms are stubbed) and reports
    each ratio of means with its paired rounds."""
    from mmyatt.placement import bench_memory

    order: list[str] = []
    peaks = {
        "colocate": [900.0, 1000.0],
        "partial": [1000.0, 1000.0],
        "partial_release": [800.0, 950.0],
    }
    steps = {"colocate": [1.0, 2.0], "partial": [0.5, 2.0], "partial_release": [0.6, 2.2]}

    def fake_arm(tmp, name, overrides, n):
        mode = next(o.split("=")[1] for o in overrides if o.startswith("placement.mode="))
        if "placement.partial_release_judge=true" in overrides:
            mode = "partial_release"
        k = int(name.rsplit("_r", 1)[1])
        order.append(f"{name.split('_policy_')[1].split('_')[0]}:{mode}")
        arm = _step_arm(steps[mode][k])
        arm["peak_rss_mb"] = peaks[mode][k]
        return arm

    monkeypatch.setattr(bench_memory, "run_arm", fake_arm)
    monkeypatch.setattr(bench_memory, "big_model", lambda out_dir, seed: (out_dir, 25_000_000))
    out = bench_memory.memory_arms(tmp_path, [], 3, rounds=2)
    rotated = ["colocate", "partial", "partial_release", "partial", "partial_release", "colocate"]
    assert order == [f"qwen2:{m}" for m in rotated] + [f"25m:{m}" for m in rotated]
    arms = out["policy_25m"]
    assert arms["colocate"]["peak_rss_mb"] == pytest.approx(950.0)
    assert arms["colocate_over_partial_peak_rss"] == pytest.approx(0.95)
    assert arms["colocate_over_partial_peak_rss_rounds"]["per_round"] == pytest.approx([0.9, 1.0])
    assert arms["partial_over_colocate_step_s"] == pytest.approx(2.5 / 3.0)
    assert arms["partial_over_colocate_step_s_rounds"]["per_round"] == pytest.approx([0.5, 1.0])
    assert arms["partial_release_over_partial_peak_rss"] == pytest.approx(875.0 / 1000.0)
    got = arms["partial_release_over_partial_peak_rss_rounds"]["per_round"]
    assert got == pytest.approx([0.8, 0.95])
    got = arms["partial_release_over_colocate_peak_rss_rounds"]["per_round"]
    assert got == pytest.approx([800 / 900, 0.95])
    assert arms["partial_release_over_partial_step_s"] == pytest.approx(2.8 / 2.5)
    got = arms["partial_release_over_partial_step_s_rounds"]["per_round"]
    assert got == pytest.approx([1.2, 1.1])
    assert out["rounds"] == 2


def test_the_judge_comparable_workload_gets_its_own_ratios_and_cost_balance():
    def arm(step_s: float, gen_s: float, judge_s: float) -> dict:
        return {**_step_arm(step_s), "phase_s": {"gen_s": gen_s, "judge_busy_s": judge_s}}

    per_round = {
        "shared": [arm(1.0, 0.2, 0.5)] * 2,
        "colocate": [arm(1.0, 0.2, 0.4), arm(1.2, 0.2, 0.4)],
        "partial": [arm(0.8, 0.4, 0.5), arm(1.08, 0.4, 0.5)],
        "auto": [arm(0.9, 0.3, 0.45)] * 2,
    }
    out = {"judge_comparable": combine_rounds(per_round, "judge_comparable")}
    derive_ratios(out)
    assert out["partial_over_colocate_judge_comparable"] == pytest.approx(0.94 / 1.1)
    assert out["partial_over_colocate_judge_comparable_rounds"]["per_round"] == pytest.approx(
        [0.8, 0.9]
    )
    assert out["judge_over_generation_s_judge_comparable"] == pytest.approx(
        {"partial": 1.25, "colocate": 2.0}
    )
    assert out["best_fixed_judge_comparable"] == "partial"
    assert "partial_over_colocate_judge_heavy" not in out  # that workload did not run


def test_the_judge_drift_is_derived_under_its_own_keys():
    def arm(rule: float, judged: float) -> dict:
        return _arm(rule, judged, ("x",) * 5, labels=("rule", "judged"))

    per_round = {
        "shared": [arm(0.34, 0.84)] * 2,
        "colocate": [arm(0.35, 0.77)] * 2,
        "partial": [arm(0.50, 0.67)] * 2,
        "auto": [arm(0.33, 0.72), arm(0.34, 0.70)],
    }
    out = {"drifting_judge": combine_rounds(per_round, "drifting_judge")}
    derive_ratios(out)
    assert out["best_fixed_drifting_judge"] == "colocate"  # 5.6 s against 5.85 and 5.9
    assert out["auto_over_best_fixed_drifting_judge"] == pytest.approx(5.225 / 5.6)
    assert out["auto_over_best_fixed_drifting_judge_rounds"]["per_round"] == pytest.approx(
        [5.25 / 5.6, 5.2 / 5.6]
    )
    assert out["drifting_judge_best_fixed_per_segment"] == {"rule": "shared", "judged": "partial"}
    assert out["drifting_judge_best_fixed_changes"] is True
    assert "auto_over_best_fixed_drifting" not in out  # the other drift did not run


def test_set_overrides_reach_every_run_and_the_json_names_them(monkeypatch, tmp_path):
    """`--set KEY=VALUE` (a GPU run: one controller on cuda) goes to every arm's
    overrides after the bench's own, and the JSON records them and the controller
    count (arms stubbed, no run here)."""
    from mmyatt.placement import bench

    seen: list[list[str]] = []

    def fake_arm(tmp, name, overrides, n):
        seen.append(list(overrides))
        return _step_arm(1.0)

    monkeypatch.setattr(bench, "run_arm", fake_arm)
    monkeypatch.setattr(bench, "_models", lambda tmp: (tmp / "p", tmp / "j"))
    monkeypatch.setattr(bench, "derive_ratios", lambda out: None)
    sets = ("distributed.nproc=1", "distributed.device=cuda")
    out = bench.bench_placement(workloads=("rollout_heavy",), rounds=1, steps=3, overrides=sets)
    assert len(seen) == 4  # the four modes
    for o in seen:  # after the bench's own nproc=2, so the last word wins
        assert o.index("distributed.nproc=1") > o.index("distributed.nproc=2")
        assert "distributed.device=cuda" in o
    assert out["controllers"] == 1 and out["overrides"] == list(sets)
    plain = bench.bench_placement(workloads=("rollout_heavy",), rounds=1, steps=3)
    assert plain["controllers"] == 2 and plain["overrides"] == []


def test_arm_means_averages_each_arms_rounds_and_keeps_one_figure_per_round():
    from mmyatt.placement.bench import _arm_means

    runs = {
        "a": [{"step_s": 1.0, "rollout_s": 0.5}, {"step_s": 2.0, "rollout_s": 0.7}],
        "b": [{"step_s": 0.5, "rollout_s": None}, {"step_s": 1.5, "rollout_s": 0.35}],
    }
    out = _arm_means(runs, "step_s")
    assert out["a"]["step_s_per_round"] == [1.0, 2.0]
    assert out["a"]["step_s"] == pytest.approx(1.5)
    assert out["a"]["rollout_s"] == pytest.approx(0.6)
    assert out["b"]["step_s"] == pytest.approx(1.0)
    assert out["b"]["rollout_s"] == pytest.approx(0.35)  # a round without it is left out
