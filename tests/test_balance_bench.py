"""`mmyatt bench balance`: its quick form on the skewed text workload (balancing off, on
at the update and at dispatch, one round), and the figures it derives from the runs'
metrics."""

from __future__ import annotations

import json

import pytest

from mmyatt.bench import balance
from mmyatt.bench.registry import BENCHES


def test_registered():
    assert BENCHES["balance"] == "mmyatt.bench.balance:bench_balance"


def test_run_figures_leave_the_warmup_step_out_and_use_fitted_steps_only(tmp_path):
    rows = [
        {"step": 1, "timing/step_s": 9.0, "dist/idle_s": 9.0},  # warm-up: left out
        {"step": 2, "timing/step_s": 2.0, "dist/idle_s": 0.4, "balance/applied": 0.0},
        {
            "step": 3,
            "timing/step_s": 1.0,
            "dist/idle_s": 0.2,
            "balance/applied": 1.0,
            "balance/predicted_s": 0.5,
            "balance/measured_s": 0.4,
            "balance/model_error": 0.25,
        },
        {"step": 3, "eval/reward/mean": 0.1},  # not a step row
    ]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    fig = balance._run_figures(tmp_path)
    assert fig["step_s"] == pytest.approx(1.5) and fig["idle_s"] == pytest.approx(0.3)
    assert fig["applied"] == pytest.approx(0.5)
    assert fig["model_error"] == 0.25 and fig["steps_with_model"] == 1
    assert fig["steps_measured"] == 2


@pytest.mark.slow  # three 2-controller runs of 4 steps (minutes on 2 loaded cores)
def test_quick_form_measures_every_arm(tmp_path):
    out = balance.bench_balance(quick=True, workloads=("text_skewed",))
    wl = out["text_skewed"]
    assert wl["rounds"] == 1
    for arm in ("off", "on", "dispatch"):
        assert wl[arm]["step_s"] > 0 and wl[arm]["idle_s"] >= 0
    assert wl["on"]["applied"] is not None and wl["off"]["applied"] is None
    assert wl["step_s_on_over_off"]["per_round"][0] > 0
    assert wl["dispatch"]["dispatch_moved"] > 0 and wl["on"]["dispatch_moved"] is None
    assert wl["dispatch"]["dispatch_max_over_mean_after"] < 1.1
    assert wl["step_s_dispatch_over_off"]["per_round"][0] > 0


def test_skewed_workloads_give_rank_0_the_long_prompts(tmp_path):
    for wl, (lo, hi) in (("text_skewed", (20, 40)), ("text_skewed_long", (100, 200))):
        recs = [json.loads(x) for x in balance._text_data(tmp_path, wl).read_text().splitlines()]
        terms = [r["prompt"].count("1") for r in recs]
        assert all(lo <= n <= hi for n in terms[0::2]), wl  # even records: rank 0's
        assert all(1 <= n <= 2 for n in terms[1::2]), wl
        assert [int(r["answer"]) for r in recs] == terms
    even = [
        json.loads(x)
        for x in balance._text_data(tmp_path, "text_balanced").read_text().splitlines()
    ]
    assert all(1 <= r["prompt"].count("1") <= 40 for r in even)
