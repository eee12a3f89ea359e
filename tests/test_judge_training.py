"""Judge training and its measures: rule-labelled questions about a generator's samples,
rule agreement, per-shape acceptance, and drawing samples from a flow model."""

from __future__ import annotations

import numpy as np
import pytest
from PIL import Image

from mmyatt.datasets.vision_tasks import COLOURS, SHAPES, judge_records
from mmyatt.models.builtin.train_tiny_judge import (
    generator_samples,
    judge_accuracy,
    rule_agreement,
    rule_judge_records,
)


# --- judge data from a generator's samples ------------------------------------------------
def _drawn(n, seed=0):
    from mmyatt.datasets.shapes import draw_shape

    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        colour, shape = list(COLOURS)[i % len(COLOURS)], SHAPES[i % len(SHAPES)]
        img = draw_shape(colour, shape, size=32, rng=rng)
        out.append({"id": f"d{i}", "colour": colour, "shape": shape, "image": img})
    return out


def test_rule_judge_records_take_the_rules_verdict():
    from mmyatt.rewards.image import prompt_alignment_rule

    recs = rule_judge_records(_drawn(12), seed=1)
    assert len(recs) == 24
    own, other = recs[0::2], recs[1::2]
    # a clean drawn shape passes the rule for its own caption and fails any other claim
    assert all(r["answer"] == "Yes" for r in own)
    assert all(r["answer"] == "No" for r in other)
    assert all(
        (r["claimed_colour"], r["claimed_shape"]) != (s["colour"], s["shape"])
        for r, s in zip(other, _drawn(12))
    )
    for r in recs:
        claim = {"colour": r["claimed_colour"], "shape": r["claimed_shape"]}
        assert r["rule_score"] == prompt_alignment_rule(r["image"], claim)
        assert (
            r["prompt"]
            == f"Does this image show a {r['claimed_colour']} {r['claimed_shape']}? Answer Yes or No."
        )
    # a blob that is not square enough is "No" for "square" whatever the caption said
    blob = Image.new("RGB", (32, 32), (20, 20, 25))
    from PIL import ImageDraw

    ImageDraw.Draw(blob).ellipse((8, 8, 24, 24), fill=COLOURS["red"])
    r = rule_judge_records([{"id": "b", "colour": "red", "shape": "square", "image": blob}], seed=0)
    assert r[0]["answer"] == "No"


def test_rule_judge_records_leave_out_the_ambiguous_band():
    from mmyatt.rewards.image import shape_fill

    drawn = _drawn(12)
    fills = [shape_fill(s["image"]) for s in drawn]
    band = (0.7, 0.9)  # clean circles (~0.8) fall in it; squares (~1) and triangles (~0.5) not
    kept = [i for i, f in enumerate(fills) if not band[0] <= f < band[1]]
    assert {drawn[i]["shape"] for i in kept} == {"square", "triangle"} and len(kept) == 8
    recs = rule_judge_records(drawn, seed=1, ambiguous=band)
    assert [r["id"] for r in recs] == [f"g1-{i}-{j}" for i in kept for j in (0, 1)]
    # the claims and answers of the images kept are those of the unfiltered records
    every = {r["id"]: r for r in rule_judge_records(drawn, seed=1)}
    assert all(r["prompt"] == every[r["id"]]["prompt"] for r in recs)
    assert all(r["answer"] == every[r["id"]]["answer"] for r in recs)
    with pytest.raises(ValueError, match="ambiguous"):
        rule_judge_records(drawn, seed=1, ambiguous=(0.9, 0.7))


class _FixedJudge:
    """Says P(Yes) = p for every request (a stand-in for VLMPolicy.next_token_logprobs)."""

    def __init__(self, p_yes):
        self.p = list(p_yes)

    def next_token_logprobs(self, batch, top_k):
        out = []
        for _ in batch:
            p = self.p.pop(0)
            out.append([("Yes", float(np.log(p))), ("No", float(np.log(1 - p)))])
        return out


def test_rule_agreement_counts_matches_and_correlation():
    recs = rule_judge_records(_drawn(4), seed=1)  # answers: Yes, No, Yes, No, ...
    m = rule_agreement(_FixedJudge([0.9, 0.2, 0.3, 0.1, 0.8, 0.6, 0.7, 0.4]), recs)
    # said yes: T F F F T T T F ; truth: T F T F T F T F -> 6 of 8 agree
    assert m["agreement"] == 6 / 8
    assert m["accept_rule_yes"] == 3 / 4 and m["reject_rule_no"] == 3 / 4
    assert m["n"] == 8 and 0 < m["corr_rule"] <= 1


def test_judge_accuracy_reports_what_it_pays_per_shape():
    recs = judge_records(60, seed=3, sizes=(32,))
    pos = [r for r in recs if r["answer"] == "Yes"]
    # P(Yes) = 0.6 for positive squares, 0.9 for other positives, 0.2 for every negative
    ps = [(0.6 if r["shape"] == "square" else 0.9) if r["answer"] == "Yes" else 0.2 for r in recs]
    m = judge_accuracy(_FixedJudge(ps), recs, batch_size=7)
    assert m["accuracy"] == 1.0 and m["accept_positive"] == 1.0
    assert {r["shape"] for r in pos} == {"circle", "square", "triangle"}
    assert m["p_yes_square"] == pytest.approx(0.6)
    assert m["p_yes_circle"] == pytest.approx(0.9) and m["p_yes_triangle"] == pytest.approx(0.9)


def test_generator_samples_draw_from_the_flow_model():
    from mmyatt.step.builders import resolve_builtin

    def draw():
        return generator_samples(
            resolve_builtin("builtin:tiny_t2i"),
            4,
            seed=0,
            batch=2,
            noise_levels=(0.0, 0.7),
            denoise_steps=(2,),
        )

    out, again = draw(), draw()
    assert [set(r) for r in out] == [{"id", "prompt", "colour", "shape", "image"}] * 4
    assert all(r["image"].size == (32, 32) for r in out)
    assert all(
        np.array_equal(np.asarray(a["image"]), np.asarray(b["image"])) for a, b in zip(out, again)
    )


def test_shape_judge_trainer_runs_both_stages_and_saves(tmp_path):
    """A few steps of the flow demo's judge recipe (augmented, chosen on the questions):
    both stages run, a checkpoint is saved and measured on every set."""
    from mmyatt.models.builtin.train_shape_judge import train_shape_judge

    out = train_shape_judge(
        tmp_path / "judge",
        minutes=5,
        size="small",
        batch_size=4,
        sizes=(32,),
        max_stage_steps=1,
        judge_steps=2,
        eval_every=1,
        n_eval=8,
        augment=0.5,
        select="questions",
        log=None,
    )
    assert [h["stage"] for h in out["history"]] == ["classification", "judge", "judge"]
    assert (tmp_path / "judge" / "config.json").exists()
    assert {"test_heldout/colour", "val_heldout/shape", "seen/judge_accuracy"} <= set(out["test"])
