"""What the reported figures rest on: held-out combinations kept out of the judge's data,
the texture check, the block KL, frozen parameters, and a summary that says when a run
did not finish its steps."""

from __future__ import annotations

import json
import logging

import numpy as np
import pytest
import torch
from PIL import Image

from mmyatt.datasets import vision_tasks as vt
from mmyatt.datasets.shapes import HELDOUT, HELDOUT_TEST, draw_shape, is_heldout
from mmyatt.models.builtin.train_tiny_judge import rule_judge_records
from mmyatt.models.flow_sde import kl_closed_form, within_blocks
from mmyatt.rewards.quality import texture, texture_metrics
from mmyatt.step.freeze import freeze_parameters
from mmyatt.step.summary import print_summary


# --- the judge's data never shows or asks about a held-out combination ----------------------
def test_judge_data_excludes_heldout_combinations():
    recs = vt.judge_training_mix(
        600, seed=3, classification_fraction=0.25, attribute_fraction=0.25, exclude=HELDOUT
    )
    assert len(recs) == 600
    for r in recs:
        assert not is_heldout((r["colour"], r["shape"]), HELDOUT)  # the image
        if "claimed_colour" in r:  # the question
            assert not is_heldout((r["claimed_colour"], r["claimed_shape"]), HELDOUT)
    # without the exclusion the same stream does contain them (the filter is what removes them)
    free = vt.judge_training_mix(600, seed=3, classification_fraction=0.25)
    assert any(is_heldout((r["colour"], r["shape"]), HELDOUT) for r in free)
    # and the held-out check set is made only of them
    held = vt.heldout_judge_records(60, seed=1, combos=HELDOUT_TEST)
    assert len(held) == 60
    assert all(
        is_heldout((r["colour"], r["shape"]), HELDOUT_TEST)
        or is_heldout((r["claimed_colour"], r["claimed_shape"]), HELDOUT_TEST)
        for r in held
    )


def test_rule_judge_claims_avoid_heldout_combinations():
    samples = [
        {"colour": c, "shape": s, "image": draw_shape(c, s, rng=i)}
        for i, (c, s) in enumerate([("red", "circle"), ("blue", "square"), ("green", "circle")] * 8)
    ]
    recs = rule_judge_records(samples, seed=0, exclude=HELDOUT)
    assert len(recs) == 2 * len(samples)
    assert not any(is_heldout((r["claimed_colour"], r["claimed_shape"]), HELDOUT) for r in recs)


# --- texture ------------------------------------------------------------------------------
def _noisy(img: Image.Image, where: str, scale: float = 20.0) -> Image.Image:
    from mmyatt.rewards.image import foreground_mask

    a = np.asarray(img, dtype=np.float64)
    fg = foreground_mask(img)
    mask = ~fg if where == "background" else fg
    noise = np.random.default_rng(0).normal(0, scale, a.shape) * mask[..., None]
    return Image.fromarray(np.clip(a + noise, 0, 255).astype(np.uint8))


def test_texture_separates_background_and_object():
    clean = draw_shape("blue", "square", rng=2)
    t0 = texture(clean)
    assert t0["background_hf"] == pytest.approx(0.0, abs=1e-9)
    bg = texture(_noisy(clean, "background"))
    obj = texture(_noisy(clean, "object"))
    assert bg["background_hf"] > 0.02 and bg["object_hf"] < 0.02
    assert obj["object_hf"] > 0.02 and obj["background_hf"] < 1e-6
    # a clip is the mean over its frames' pixels; sums and counts add up for an all-reduce
    assert texture([clean, clean])["background_hf"] == pytest.approx(0.0, abs=1e-9)
    sums = texture_metrics([clean, _noisy(clean, "background")])
    assert sums["background_hf"][1] == 2
    assert sums["background_hf"][0] == pytest.approx(bg["background_hf"], rel=1e-9)


# --- the block KL ---------------------------------------------------------------------------
def test_block_kl_hand_worked():
    mean = torch.tensor([[[1.0, 3.0], [5.0, 7.0]]])  # (1, 2, 2)
    ref = torch.zeros_like(mean)
    # tile mean 4; within-tile part [-3, -1, 1, 3]: mean square 5, KL = 5 / (2 * 1)
    assert within_blocks(mean, 2).flatten().tolist() == [-3.0, -1.0, 1.0, 3.0]
    assert kl_closed_form(mean, ref, torch.tensor([1.0]), block=2).item() == pytest.approx(2.5)
    # whole KL: (1 + 9 + 25 + 49) / 4 / 2
    assert kl_closed_form(mean, ref, torch.tensor([1.0])).item() == pytest.approx(10.5)
    # a change that is constant on every tile costs nothing with block > 0
    flat = torch.full((2, 3, 4, 4), 0.7)
    flat[:, :, :2, :2] = -1.0
    assert kl_closed_form(flat, torch.zeros_like(flat), torch.ones(2), block=2).abs().max() < 1e-12
    with pytest.raises(ValueError, match="divide"):
        within_blocks(torch.zeros(1, 5, 5), 2)


def test_block_kl_needs_a_closed_form_estimator():
    from mmyatt.config.schema import ConfigError, load_config

    with pytest.raises((ConfigError, ValueError), match="kl_block"):
        load_config(None, ["model.kind=flow", "algorithm.kl_block=4", "algorithm.kl_estimator=k3"])


# --- frozen parameters ---------------------------------------------------------------------
def test_freeze_parameters_by_prefix():
    m = torch.nn.ModuleDict({"proj_out": torch.nn.Linear(2, 2), "proj_out2": torch.nn.Linear(2, 2)})
    assert freeze_parameters(m, ["proj_out"]) == 2
    assert not m["proj_out"].weight.requires_grad and m["proj_out2"].weight.requires_grad
    with pytest.raises(ValueError, match="model.freeze"):
        freeze_parameters(m, ["nothing_here"])


@pytest.mark.parametrize(
    "overrides, frozen_in_sft",
    [([], ("model.visual",)), (["sft.freeze=[]"], ()), (["sft.freeze=[lm_head]"], ("lm_head",))],
)
def test_sft_freezes_model_freeze_unless_sft_freeze_says_otherwise(
    monkeypatch, tmp_path, overrides, frozen_in_sft
):
    """The warm start builds its policy with sft.freeze when set, else model.freeze; RL
    keeps model.freeze either way."""
    from mmyatt.config.schema import load_config
    from mmyatt.step import sft

    class Built(Exception):
        pass

    def capture(model, device=None):
        raise Built(model)

    cfg = load_config("configs/vlm_genrm_tiny.yaml", overrides)
    assert cfg.model.freeze == ("model.visual",)
    monkeypatch.setattr(sft.builders, "build_policy", capture)
    with pytest.raises(Built) as built:
        sft.run_sft(cfg, tmp_path / "out")
    assert built.value.args[0].freeze == frozen_in_sft


def test_sft_with_a_judged_reward_and_no_check_names_sft_check(monkeypatch, tmp_path):
    """The warm start runs before the run's judge servers start: a genrm reward with no
    sft.check fails with what to set, before any model is built; with a check it goes on."""
    from mmyatt.config.schema import ConfigError, load_config
    from mmyatt.step import sft

    class Built(Exception):
        pass

    def capture(model, device=None):
        raise Built(model)

    monkeypatch.setattr(sft.builders, "build_policy", capture)
    judged = [
        "sft.enabled=true",
        "reward.functions=[{name: numeric_match, weight: 1.0}, {name: genrm, weight: 0.5}]",
        f"reward.judge.model={tmp_path}",  # a folder: the judge never starts here
    ]
    cfg = load_config("configs/text_grpo_tiny.yaml", judged)
    with pytest.raises(ConfigError, match=r"set sft.check to a rule reward"):
        sft.run_sft(cfg, tmp_path / "out")
    cfg = load_config("configs/text_grpo_tiny.yaml", [*judged, "sft.check=numeric_match"])
    with pytest.raises(Built):
        sft.run_sft(cfg, tmp_path / "out")


# --- a run that stopped early says so --------------------------------------------------------
def _write_run(tmp_path, done: int, planned: int, cut: bool):
    rows = [
        {"step": 0, "eval/reward/mean": 0.5, "eval/quality/background_hf": 0.02},
        {"step": 1, "reward/mean": 0.5, "timing/step_s": 1.0},
        {
            "step": done,
            "eval/reward/mean": 0.6,
            "eval/quality/background_hf": 0.03,
            "train/steps_done": float(done),
            "train/steps_planned": float(planned),
            "train/cut_by_time": float(cut),
        },
    ]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_summary_flags_a_run_cut_by_its_time_budget(tmp_path, caplog):
    _write_run(tmp_path, 150, 200, True)
    with caplog.at_level(logging.INFO, logger="mmyatt"):
        out = print_summary(tmp_path)
    text = caplog.text
    assert "INCOMPLETE" in text and "150/200" in text and "max_minutes" in text
    saved = json.loads((tmp_path / "summary.json").read_text())
    assert saved == out and saved["steps_done"] == 150 and saved["cut_by_time"] is True
    assert saved["metrics"]["eval/quality/background_hf"]["ratio"] == pytest.approx(1.5)


def test_summary_of_a_finished_run(tmp_path, caplog):
    _write_run(tmp_path, 200, 200, False)
    with caplog.at_level(logging.INFO, logger="mmyatt"):
        print_summary(tmp_path)
    text = caplog.text
    assert "steps 200/200" in text and "INCOMPLETE" not in text


# --- the SFT stopping check reads a validation split, not the reported eval ----------------
def test_arithmetic_validation_split_is_disjoint(tmp_path):
    from mmyatt.datasets.synthetic import write_arithmetic_task

    train, ev = write_arithmetic_task(tmp_path, n_train=300, n_eval=50, seed=0, n_val=40)
    read = lambda p: [json.loads(x)["id"] for x in p.read_text().splitlines()]  # noqa: E731
    t, e, v = set(read(train)), set(read(ev)), set(read(tmp_path / "val.jsonl"))
    assert len(t) == 300 and len(e) == 50 and len(v) == 40
    assert not (t & e or t & v or e & v)


def test_grey_shapes_show_no_palette_colour():
    recs = vt.grey_shape_records(12, seed=0, sizes=(32,))
    assert {r["task"] for r in recs} == {"grey_shape", "grey_check"}
    for r in recs:
        a = np.asarray(r["image"], dtype=int)
        inside = a.sum(-1) >= 3 * 140  # the shape's own pixels (the background is dark)
        assert inside.any()
        # grey up to the background's blue tint at the rims; palette colours spread >= 150
        assert (a[inside].max(-1) - a[inside].min(-1)).max() <= 8
