"""The open-description task of the VLM + GenRM recipe: records, held-out combinations,
the independent check against hand-written answers, judge data and GenRM's clip frames."""

import json

import numpy as np
import pytest
from PIL import Image

from mmyatt.datasets import describe as d
from mmyatt.datasets import describe_check as dc
from mmyatt.datasets import describe_task as dt
from mmyatt.datasets.shapes import HELDOUT, HELDOUT_TEST, MOTION_HELDOUT, MOTION_HELDOUT_TEST
from mmyatt.rewards.genrm import GenRMReward, load_template
from mmyatt.rewards.rules import resolve_reward

IMG = {"colour": "red", "shape": "circle", "direction": None}
CLIP = {"colour": "blue", "shape": "square", "direction": "left"}


@pytest.mark.parametrize(
    "answer, record, score, false",
    [
        ("a red circle", IMG, 1.0, 0),
        ("It is a circle that is red.", IMG, 1.0, 0),
        ("a circle", IMG, 0.5, 0),
        ("red", IMG, 0.5, 0),
        ("", IMG, 0.0, 0),
        ("a blue circle", IMG, 0.0, 1),
        ("a red circle and a blue one", IMG, 0.0, 1),
        ("a red square", IMG, 0.0, 1),
        ("a red circle moving left", IMG, 0.0, 1),  # a still image does not move
        ("red red red circle circle", IMG, 1.0, 0),  # padding: caught by answer_words
        ("a blue square moving left", CLIP, 1.0, 0),
        ("the blue square moves", CLIP, 2 / 3, 0),
        ("a blue square moving right", CLIP, 0.0, 1),
        ("a blue square moving left and up", CLIP, 0.0, 1),
        ("A BLUE SQUARE, LEFT.", CLIP, 1.0, 0),
    ],
)
def test_check_against_hand_written_answers(answer, record, score, false):
    got = dc.check_details(answer, record)
    assert got["score"] == pytest.approx(score)
    assert got["false"] == false
    assert resolve_reward("describe_check")(answer, record) == pytest.approx(score)
    assert resolve_reward("describe_false_claims")(answer, record) == false


@pytest.mark.parametrize(
    "answer, colour, shape",
    [
        ("a red circle", 1.0, 1.0),
        ("a red square", 1.0, 0.0),  # the shape named from the colour: the check split shows it
        ("a blue circle", 0.0, 1.0),
        ("a circle that is red and blue", 0.0, 1.0),
        ("ainnn is red", 1.0, 0.0),  # the shape word lost
        ("", 0.0, 0.0),
    ],
)
def test_attribute_checks_against_hand_written_answers(answer, colour, shape):
    assert resolve_reward("describe_colour")(answer, IMG) == colour
    assert resolve_reward("describe_shape")(answer, IMG) == shape


@pytest.mark.parametrize(
    "answer, record_direction, right",
    [
        ("a red circle moving up", "up", 1.0),
        ("a blue square moving up", "up", 1.0),  # the direction alone is judged
        ("a red circle moving left", "up", 0.0),
        ("a red circle moving up and left", "up", 0.0),  # a second direction is a false one
        ("a red circle", "up", 0.0),  # no direction named for a clip
        ("a red circle", None, 1.0),  # an image: none named is right
        ("a red circle moving up", None, 0.0),  # an image said to move
    ],
)
def test_direction_check_against_hand_written_answers(answer, record_direction, right):
    record = {"colour": "red", "shape": "circle", "direction": record_direction}
    assert resolve_reward("describe_direction")(answer, record) == right


def test_answer_words_counts_padding():
    f = resolve_reward("answer_words")
    assert f("a red circle", IMG) == 3.0
    assert f("red red red circle circle", IMG) == 5.0


def test_records_hold_out_combinations_and_carry_media():
    recs = d.describe_records(400, seed=3)
    assert {r["task"] for r in recs} == {"describe_image", "describe_video"}
    for r in recs:
        assert (r["colour"], r["shape"]) not in HELDOUT
        if r["direction"]:
            assert (r["colour"], r["shape"], r["direction"]) not in MOTION_HELDOUT
            assert r["video"].shape == (d.FRAMES, d.IMAGE_SIZE, d.IMAGE_SIZE, 3)
            assert r["prompt"] == d.DESCRIBE_VIDEO
        else:
            assert isinstance(r["image"], Image.Image)
        assert dc.description_check(r["answer"], r) == 1.0  # the reference is correct


def test_written_task_splits(tmp_path):
    p = dt.write_describe_task(tmp_path, n_train=40, n_eval=12)

    test = [json.loads(x) for x in p["test"].read_text().splitlines()]
    held = [r for r in test if r["split"] == "heldout"]
    seen = [r for r in test if r["split"] == "seen"]
    assert len(held) == 12 and len(seen) == 6
    for r in held:
        if r["direction"]:
            assert (r["colour"], r["shape"], r["direction"]) in MOTION_HELDOUT_TEST
        else:
            assert (r["colour"], r["shape"]) in HELDOUT_TEST
    for r in seen:
        assert (r["colour"], r["shape"]) not in HELDOUT
    train = [json.loads(x) for x in p["train"].read_text().splitlines()]
    assert all((r["colour"], r["shape"]) not in HELDOUT for r in train)
    assert all((tmp_path / r.get("image", r.get("video"))).exists() for r in train + test)


def test_judge_records_are_labelled_by_construction():
    recs = d.judge_records(120, seed=1)
    assert sum(r["answer"] == "Yes" for r in recs) == 60
    for r in recs:
        if r["answer"] == "Yes":
            assert dc.description_check(r["output"], r) == 1.0
        elif r["negative_type"] in ("colour", "shape", "direction", "added"):
            assert dc.description_check(r["output"], r) == 0.0
        assert (r["colour"], r["shape"]) not in HELDOUT
    clips = [r for r in recs if r["direction"]]
    assert clips and all(len(r["image"]) == d.FRAMES for r in clips)


def test_judge_prompt_is_the_genrm_template():
    assert d.JUDGE_TEMPLATE == load_template("yes_no_shows")


class _Capture:
    def __init__(self):
        self.bodies = []

    def chat_many(self, bodies):
        self.bodies += bodies
        top = [{"token": "Yes", "logprob": -0.1}, {"token": "No", "logprob": -2.4}]
        return [{"choices": [{"logprobs": {"content": [{"top_logprobs": top}]}}]} for _ in bodies]


def test_genrm_sends_image_or_clip_frames():
    cap = _Capture()
    g = GenRMReward(cap, mode="yes_prob", template="yes_no_correct", image_key="media")
    image = Image.new("RGB", (8, 8))
    clip = np.zeros((6, 8, 8, 3), dtype=np.uint8)
    rec_i = {"prompt": d.DESCRIBE_IMAGE, "image": image}
    rec_v = {"prompt": d.DESCRIBE_VIDEO, "image": None, "video": clip}
    reward, _ = g(["a red circle", "a blue square moving left"], [rec_i, rec_v])
    parts = [b["messages"][-1]["content"] for b in cap.bodies]
    kinds = [[p["type"] for p in ps] for ps in parts]
    assert kinds[0] == ["image_url", "text"]
    assert kinds[1] == ["image_url"] * 4 + ["text"]  # 6 frames, max_frames 4
    assert "Answer: a blue square moving left" in parts[1][-1]["text"]
    assert reward.tolist() == pytest.approx([1 / (1 + np.exp(-2.3))] * 2, abs=1e-6)
    with pytest.raises(ValueError, match="no 'media'"):
        g(["x"], [{"prompt": "q"}])


def test_judge_records_send_the_frames_genrm_sends():
    """A clip in the judge's data is the frames GenRM sends with the same max_frames: the
    first and the last always, evenly spaced between."""
    recs = d.describe_records(8, seed=5)
    clip = next(r for r in recs if "video" in r)
    for frames, picked in ((2, [0, 3]), (3, [0, 2, 3]), (4, [0, 1, 2, 3])):
        judged = d.judge_records(8, seed=5, frames=frames)
        got = next(r for r in judged if r["id"] == clip["id"])["image"]
        assert [np.asarray(im).tolist() for im in got] == [
            clip["video"][j].tolist() for j in picked
        ]
        cap = _Capture()
        g = GenRMReward(
            cap, mode="yes_prob", template="yes_no_shows", image_key="media", max_frames=frames
        )
        g(["x"], [{"prompt": d.DESCRIBE_VIDEO, "video": clip["video"]}])
        sent = [p for p in cap.bodies[0]["messages"][-1]["content"] if p["type"] == "image_url"]
        assert len(sent) == frames
    with pytest.raises(ValueError, match="frames"):
        d.judge_records(4, seed=0, frames=1)


def test_judge_records_balance_images_and_clips():
    recs = d.judge_records(160, seed=2)
    for task in ("describe_image", "describe_video"):
        sub = [r for r in recs if r["task"] == task]
        yes = sum(r["answer"] == "Yes" for r in sub)
        assert abs(yes - len(sub) / 2) <= 1, (task, yes, len(sub))


def test_warm_start_split_sees_every_combination(tmp_path):
    """sft.jsonl sees every combination; sft_heldout.jsonl, the same draw without the
    held-out pairs and triples (the other arm of docs/vlm_genrm.md), sees none of them,
    and sft_holdout=True makes it the warm start's split."""

    def read(path):
        return [json.loads(x) for x in path.read_text().splitlines()]

    p = dt.write_describe_task(tmp_path / "a", n_train=300, n_eval=6)
    sft, held = read(p["sft"]), read(p["sft_heldout"])
    assert any((r["colour"], r["shape"]) in HELDOUT for r in sft)
    assert not any((r["colour"], r["shape"]) in HELDOUT for r in held)
    triples = [(r["colour"], r["shape"], r["direction"]) for r in held if r["direction"]]
    assert triples and not set(triples) & set(MOTION_HELDOUT)
    q = dt.write_describe_task(tmp_path / "b", n_train=300, n_eval=6, sft_holdout=True)
    assert [r["answer"] for r in read(q["sft"])] == [r["answer"] for r in held]


def test_extra_colours_reach_train_and_sft_only(tmp_path):

    plain = d.describe_records(60, seed=5)
    assert d.describe_records(60, seed=5, extra_fraction=0.0)[7]["answer"] == plain[7]["answer"]
    p = dt.write_describe_task(tmp_path, n_train=400, n_eval=12, extra_colours=0.3)
    rows = {k: [json.loads(x) for x in p[k].read_text().splitlines()] for k in p}
    for split in ("train", "sft"):
        extra = [r for r in rows[split] if r["colour"] in d.EXTRA_COLOURS]
        assert 0.2 < len(extra) / len(rows[split]) < 0.4
        assert {r["shape"] for r in extra} == set(d.SHAPES)  # every shape, images and clips
        assert {r["task"] for r in extra} == {"describe_image", "describe_video"}
        assert all(dc.description_check(r["answer"], r) == 1.0 for r in extra)
    assert all((r["colour"], r["shape"]) not in HELDOUT for r in rows["train"])
    for split in ("test", "val"):  # the eval splits keep the palette
        assert not [r for r in rows[split] if r["colour"] in d.EXTRA_COLOURS]
    with pytest.raises(ValueError, match="extra_fraction"):
        d.describe_records(2, seed=0, extra_fraction=1.5)


def test_second_validation_fold_swaps_the_validation_pairs_into_training(tmp_path):

    from mmyatt.datasets.shapes import HELDOUT_VAL

    p = dt.write_describe_task(tmp_path, n_train=600, n_eval=12, val_fold=2)
    rows = {k: [json.loads(x) for x in p[k].read_text().splitlines()] for k in p}
    pairs = {k: {(r["colour"], r["shape"]) for r in v} for k, v in rows.items()}
    assert not pairs["train"] & (set(HELDOUT_TEST) | set(d.VAL_FOLD2_PAIRS))
    assert set(HELDOUT_VAL) <= pairs["train"]  # the first fold's pairs are trained on
    held = [r for r in rows["val"] if r["split"] == "heldout"]
    seen = [r for r in rows["val"] if r["split"] == "seen"]
    assert {(r["colour"], r["shape"]) for r in held} <= set(d.VAL_FOLD2_PAIRS)
    for r in held:
        if r["direction"]:
            assert (r["colour"], r["shape"], r["direction"]) in d.VAL_FOLD2_TRIPLES
    assert not {(r["colour"], r["shape"]) for r in seen} & set(d.VAL_FOLD2_PAIRS)
    default = dt.write_describe_task(tmp_path / "one", n_train=600, n_eval=12)
    assert p["test"].read_text() == default["test"].read_text()  # the test split stays
    with pytest.raises(ValueError, match="val_fold"):
        dt.write_describe_task(tmp_path / "bad", n_train=4, n_eval=3, val_fold=3)


def test_shape_first_rephrases_the_answers_and_nothing_else(tmp_path):

    plain = d.describe_records(40, seed=3)
    same = d.describe_records(40, seed=3, shape_first=0.0)
    first = d.describe_records(40, seed=3, shape_first=1.0)
    half = d.describe_records(400, seed=3, shape_first=0.5)
    assert [r["answer"] for r in same] == [r["answer"] for r in plain]
    for a, b in zip(plain, first):  # the same objects and media, the shape named first
        assert (a["colour"], a["shape"], a["direction"]) == (
            b["colour"],
            b["shape"],
            b["direction"],
        )
        assert b["answer"].split()[1] == b["shape"] and dc.description_check(b["answer"], b) == 1.0
        if "image" in a:
            assert np.array_equal(np.asarray(a["image"]), np.asarray(b["image"]))
    share = np.mean([r["answer"].split()[1] == r["shape"] for r in half])
    assert 0.55 < share < 0.75  # half drawn shape first, plus the mixed phrasings' own 1/5
    p = dt.write_describe_task(tmp_path, n_train=60, n_eval=6, shape_first=1.0)
    rows = {k: [json.loads(x) for x in p[k].read_text().splitlines()] for k in p}
    assert all(r["answer"].split()[1] == r["shape"] for r in rows["sft"] + rows["train"])
    default = dt.write_describe_task(tmp_path / "plain", n_train=60, n_eval=6)
    for split in ("test", "val"):  # the eval splits are not touched
        assert p[split].read_text() == default[split].read_text()
    with pytest.raises(ValueError, match="shape_first"):
        d.describe_records(2, seed=0, shape_first=-0.1)


def test_extra_shapes_reach_train_and_sft_images_only(tmp_path):

    from mmyatt.datasets.factored_shapes import EXTRA_SHAPES

    plain = d.describe_records(40, seed=5)
    same = d.describe_records(40, seed=5, extra_shapes=0.0)
    assert [(r["shape"], r["answer"]) for r in same] == [(r["shape"], r["answer"]) for r in plain]
    many = d.describe_records(400, seed=5, extra_shapes=0.5)
    extra = [r for r in many if r["shape"] in EXTRA_SHAPES]
    images = [r for r in many if r["task"] == "describe_image"]
    assert 0.4 < len(extra) / len(images) < 0.6 and all(
        r["task"] == "describe_image" for r in extra
    )
    assert {r["shape"] for r in extra} == set(EXTRA_SHAPES)
    assert all(dc.description_check(r["answer"], r) == 1.0 for r in extra)  # named right
    p = dt.write_describe_task(tmp_path, n_train=80, n_eval=6, extra_shapes=0.5)
    rows = {k: [json.loads(x) for x in p[k].read_text().splitlines()] for k in p}
    for split in ("train", "sft"):
        assert any(r["shape"] in EXTRA_SHAPES for r in rows[split])
    default = dt.write_describe_task(tmp_path / "plain", n_train=80, n_eval=6)
    for split in ("test", "val"):  # the eval splits keep the task's shapes, unchanged
        assert p[split].read_text() == default[split].read_text()
    with pytest.raises(ValueError, match="extra_shapes"):
        d.describe_records(2, seed=0, extra_shapes=1.5)


def test_judge_records_with_extra_shapes_name_them_as_wrong_shapes_too():
    from mmyatt.datasets.factored_shapes import EXTRA_SHAPES

    recs = d.judge_records(400, seed=6, extra_shapes=0.3)
    wrong_shape = [r for r in recs if r["negative_type"] == "shape"]
    named = [set(r["output"].split()) & set(EXTRA_SHAPES) for r in wrong_shape]
    on_task_shapes = [n for n, r in zip(named, wrong_shape) if r["shape"] in d.SHAPES]
    assert any(on_task_shapes)  # "a blue star" for a blue square: No
    for r in recs:  # labelled by construction: the check agrees with every verdict
        assert (dc.description_check(r["output"], r) == 1.0) == (r["verdict"] == "Yes") or (
            r["negative_type"] not in (None, "colour", "shape", "direction")
        )
        assert not d.names_heldout(r["output"], r)


def test_shape_first_negatives_name_a_wrong_shape_first():
    rng = np.random.default_rng(0)
    rec = {"colour": "red", "shape": "circle", "direction": None}
    for _ in range(20):
        text = d._negative("shape_first", rec, rng)
        words = text.split()
        assert words[0] == "a" and words[2:] == ["that", "is", "red"] and words[1] != "circle"
        assert dc.check_details(text, rec)["false"] == 1
    recs = d.judge_records(200, seed=7, negative_weights=d.SHAPE_FIRST_WEIGHTS)
    assert any(r["negative_type"] == "shape_first" for r in recs)
    assert "shape_first" in d.JUDGE_NEGATIVES


def test_check_counts_an_extra_shape_named_for_a_task_shape_as_false():
    rec = {"colour": "blue", "shape": "square", "direction": None}
    assert dc.check_details("a blue star", rec) == {
        "correct": 1,
        "attributes": 2,
        "false": 1,
        "score": 0.0,
    }
    star = {"colour": "red", "shape": "star", "direction": None}
    assert dc.description_check("the red star", star) == 1.0
    assert dc.shape_right("a red circle", star) == 0.0


def test_synthetic_kwargs_are_checked_against_the_task(tmp_path):
    from mmyatt.config.schema import load_config
    from mmyatt.step.builders import synthetic_task

    cfg = load_config(
        "configs/vlm_genrm_tiny.yaml",
        [
            "data.synthetic_train_size=20",
            "data.synthetic_eval_size=6",
            "data.synthetic_kwargs={extra_colour: 0.3}",
        ],
    )
    with pytest.raises(
        ValueError,
        match=r"synthetic:describe takes \['extra_colours', 'val_fold', 'shape_first', "
        r"'extra_shapes', 'clip_heldout', 'video_fraction', 'sft_direction_drill'\]",
    ):
        synthetic_task("synthetic:describe", tmp_path, cfg)
    cfg = load_config("configs/text_grpo_tiny.yaml", ["data.synthetic_kwargs={extra_colours: 0.3}"])
    with pytest.raises(ValueError, match="synthetic:arithmetic takes no keys"):
        synthetic_task("synthetic:arithmetic", tmp_path, cfg)


def test_score_variant_records_and_template():
    recs = d.judge_records(16, seed=4, score=True)
    assert {r["answer"] for r in recs} == set(d.SCORE_ANSWERS.values())
    assert all(r["answer"] == d.SCORE_ANSWERS[r["verdict"]] for r in recs)
    assert d.SCORE_TEMPLATE == load_template("score_shows")
    from mmyatt.models.builtin.train_describe_judge import training_batch

    batch = training_batch(20, seed=0)
    assert sum(r["answer"].startswith("Score:") for r in batch) == 3


def test_judge_records_never_name_a_heldout_combination():
    """Not even as a wrong claim: "a red square" about a cyan square teaches the judge
    that the held-out pair is wrong whatever the picture shows."""
    records = d.judge_records(600, seed=5, extra_colours=True)
    assert not any(d.names_heldout(r["output"], r) for r in records)
    for r in records:
        words = set(r["output"].lower().split())
        assert not any(c in words and s in words for c, s in HELDOUT), r["output"]
    # the guard itself: it sees a held-out pair in any order
    assert d.names_heldout("a square that is red moving left", {"direction": "left"})


def test_conflict_and_fragment_negatives_are_wrong_by_the_check():
    """A 'conflict' negative names the true value and a false one of one attribute; a
    'fragment' lost its noun: the rule check never scores either 1."""
    recs = d.judge_records(600, seed=9, conflict_negatives=True, video_fraction=0.5)
    kinds = {"conflict": 0, "fragment": 0}
    for r in recs:
        k = r["negative_type"]
        if k in kinds:
            kinds[k] += 1
            truth = {"colour": r["colour"], "shape": r["shape"], "direction": r["direction"]}
            det = dc.check_details(r["output"], truth)
            assert det["score"] < 1.0, r["output"]
            if k == "conflict":
                assert det["false"] >= 1 and det["correct"] == det["attributes"], r["output"]
            assert r["answer"] == "No"
    assert min(kinds.values()) >= 10, kinds


def test_junk_negatives_insert_text_into_a_correct_description():
    """A 'junk' negative is a correct description with one to three insertions (letters,
    attribute words, fillers): every word of the clean description is still there in
    order, something was added, it is labelled No and never names a held-out pair."""
    import re

    recs = d.judge_records(600, seed=5, negative_weights=d.JUNK_WEIGHTS, video_fraction=0.5)
    junk = [r for r in recs if r["negative_type"] == "junk"]
    assert len(junk) >= 30
    for r in junk:
        assert r["answer"] == "No" and not d.names_heldout(r["output"], r)
        text = r["output"]
        # the attribute values of the record are all named (the description is intact)
        for value in (r["colour"], r["shape"], r["direction"]):
            if value:
                assert re.search(value, text), (value, text)
        assert len(text.split()) >= 2
    lengths = [len(r["output"]) for r in junk]
    clean = [len(r["output"]) for r in recs if r["verdict"] == "Yes"]
    assert sum(lengths) / len(lengths) > sum(clean) / len(clean)  # text was added
    assert "junk" in d.JUDGE_NEGATIVES


def test_describe_judge_training_keeps_frozen_parameters(tmp_path):
    """``freeze`` keeps the named parameters as the start has them and trains the rest."""
    from pathlib import Path

    import torch
    from safetensors.torch import load_file

    from mmyatt.models.builtin.train_describe_judge import train_describe_judge

    start = Path(__file__).resolve().parents[1] / "models" / "builtin" / "describe_judge_shapes"
    out = train_describe_judge(
        tmp_path / "j",
        start=str(start),
        steps=2,
        eval_every=2,
        n_eval=4,
        batch_size=4,
        lr=1e-2,
        freeze=("model.visual",),
        log=None,
    )
    assert out["best_step"] == 2
    before = load_file(str(start / "model.safetensors"))
    after = load_file(str(tmp_path / "j" / "model.safetensors"))
    # saved in the checkpoint layout transformers writes: "visual.*" beside "model.*"
    visual = [k for k in before if k.split(".")[0] == "visual"]
    other = [k for k in before if k.split(".")[0] != "visual"]
    assert visual and other
    assert all(torch.equal(before[k], after[k]) for k in visual)
    assert sum(not torch.equal(before[k], after[k]) for k in other) > len(other) // 2
    with pytest.raises(ValueError, match="matches no parameter"):
        train_describe_judge(
            tmp_path / "k", start=str(start), steps=1, n_eval=4, freeze=("visual_tower",), log=None
        )
    with pytest.raises(TypeError, match=r"unknown training_batch arguments \['base_shar'\]"):
        train_describe_judge(tmp_path / "m", start=str(start), steps=1, base_shar=0.2, log=None)


def test_judge_pair_table_names_every_shape_in_every_phrasing():
    from pathlib import Path

    from mmyatt.models.builtin.train_describe_judge import PHRASINGS, pair_table
    from mmyatt.models.vlm import VLMPolicy

    judge = VLMPolicy.load(
        str(Path(__file__).resolve().parents[1] / "models" / "builtin" / "describe_judge_shapes"),
        max_prompt_tokens=160,
    )
    table = pair_table(judge, [("red", "square")], n=2)
    assert set(table) == {"red square"}
    assert set(table["red square"]) == {"circle", "square", "triangle"}
    for by_phrasing in table["red square"].values():
        assert set(by_phrasing) == set(PHRASINGS)
        assert all(0.0 <= v <= 1.0 for v in by_phrasing.values())
    # the right shape in the plainest phrasing is paid more than a wrong one it rejects
    assert table["red square"]["square"]["a {c} {s}"] > table["red square"]["triangle"]["a {c} {s}"]


def test_judge_direction_table_asks_every_direction():
    """The judge is asked each direction of each clip; the summary means agree with the
    table, and a pick is right for a share of the clips."""
    from pathlib import Path

    from mmyatt.datasets.shapes import DIRECTIONS
    from mmyatt.models.builtin.train_describe_judge import direction_table
    from mmyatt.models.vlm import VLMPolicy

    judge = VLMPolicy.load(
        str(Path(__file__).resolve().parents[1] / "models" / "builtin" / "describe_judge_shapes"),
        max_prompt_tokens=160,
    )
    out = direction_table(judge, [("red", "circle", "down")], n=2)
    row = out["per_triple"]["red circle down"]
    assert set(row) == set(DIRECTIONS)
    assert out["p_yes_right"] == pytest.approx(row["down"])
    wrong = [v for k, v in row.items() if k != "down"]
    assert out["p_yes_wrong"] == pytest.approx(sum(wrong) / 3)
    assert out["pick_right"] in (0.0, 0.5, 1.0)
