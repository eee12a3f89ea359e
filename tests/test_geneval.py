"""The tiny GenEval: its splits, its drawings, its independent checker and its judge data.

Hand-worked cases: scenes drawn for a prompt that the checker must accept, scenes that
break the prompt (count, colour, shape, relation) that it must reject, and images that
look generated (ragged rims, blur, noise, an object cut by the frame) that it must
accept where the one-object rule (``prompt_alignment_rule``) does not.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from PIL import Image, ImageDraw, ImageFilter

from mmyatt.datasets import geneval as ge
from mmyatt.datasets.shapes import BACKGROUND, COLOURS
from mmyatt.rewards import geneval_check as gc
from mmyatt.rewards.image import prompt_alignment_rule


def _canvas(size: int = 48) -> tuple[Image.Image, ImageDraw.ImageDraw]:
    img = Image.new("RGB", (size, size), BACKGROUND)
    return img, ImageDraw.Draw(img)


def _square(d, colour, cx, cy, r):
    d.rectangle([cx - r, cy - r, cx + r - 1, cy + r - 1], fill=COLOURS[colour])


def _circle(d, colour, cx, cy, r):
    d.ellipse([cx - r, cy - r, cx + r - 1, cy + r - 1], fill=COLOURS[colour])


def _triangle(d, colour, cx, cy, r):
    d.polygon([(cx, cy - r), (cx + r, cy + r), (cx - r, cy + r)], fill=COLOURS[colour])


def _generated_look(img: Image.Image, seed: int = 0) -> Image.Image:
    """Blur and pixel noise, as a generator's samples have."""
    rng = np.random.default_rng(seed)
    a = np.asarray(img.filter(ImageFilter.GaussianBlur(0.7)), dtype=np.float32)
    a = a + rng.normal(0.0, 8.0, a.shape)
    return Image.fromarray(np.clip(a, 0, 255).astype(np.uint8))


def _ragged(img: Image.Image, colour: str, seed: int = 0) -> Image.Image:
    """Bite random pixels out of the object's rim and add random spurs around it."""
    rng = np.random.default_rng(seed)
    a = np.asarray(img).copy()
    obj = np.all(a == COLOURS[colour], axis=-1)
    p = np.pad(obj, 1)
    inner = p[1:-1, 1:-1] & p[:-2, 1:-1] & p[2:, 1:-1] & p[1:-1, :-2] & p[1:-1, 2:]
    rim, near = obj & ~inner, ~obj & (p[:-2, 1:-1] | p[2:, 1:-1] | p[1:-1, :-2] | p[1:-1, 2:])
    a[rim & (rng.random(obj.shape) < 0.4)] = BACKGROUND
    a[near & (rng.random(obj.shape) < 0.3)] = COLOURS[colour]
    return Image.fromarray(a)


def _rec(prompt: str) -> dict:
    return {"prompt": prompt, **gc.parse_prompt(prompt)}


# --- the task ----------------------------------------------------------------------------
def test_heldout_combinations_are_new_and_split():
    for kind in ge.KINDS:
        test, val = ge.HELDOUT_TEST_GENEVAL[kind], ge.HELDOUT_VAL_GENEVAL[kind]
        assert test and val and not set(test) & set(val), kind
    train = ge.geneval_records(3000, 0)
    assert {r["kind"] for r in train} == set(ge.KINDS)
    assert not any(ge.is_heldout(r["kind"], tuple(r["combo"])) for r in train)
    words = {w for r in train for w in r["prompt"].split()}
    for split in ("test", "val"):
        for r in ge.geneval_records(40, 1, heldout=split):  # every kind, held-out only
            assert ge.is_heldout(r["kind"], tuple(r["combo"]), split)
            assert set(r["prompt"].split()) <= words  # new combination of known words


def test_write_task_splits(tmp_path):
    paths = ge.write_geneval_task(tmp_path, n_train=50, n_eval=20, seed=0)
    again = ge.write_geneval_task(tmp_path / "again", n_train=50, n_eval=20, seed=0)
    rows = {k: [json.loads(line) for line in open(p)] for k, p in paths.items()}
    assert rows["test"] == [json.loads(line) for line in open(again["test"])]
    assert len(rows["train"]) == 50 and len(rows["test"]) == len(rows["val"]) == 30
    for name in ("test", "val"):
        held = [r for r in rows[name] if r["split"] == "heldout"]
        assert len(held) == 20 and {r["kind"] for r in held} == set(ge.KINDS)
        assert all(ge.is_heldout(r["kind"], tuple(r["combo"]), name) for r in held)
    assert {r["prompt"] for r in rows["test"]} != {r["prompt"] for r in rows["val"]}


def test_drawn_scenes_follow_their_spec():
    rec = ge.make_record("position", ("red", "circle", "above", "blue", "square"), "x")
    for seed in range(20):
        img, objs = ge.draw_scene(rec, rng=seed)
        assert img.size == (48, 48)
        a, b = objs
        assert (a["colour"], a["shape"], b["colour"], b["shape"]) == (
            "red",
            "circle",
            "blue",
            "square",
        )
        assert a["cy"] < b["cy"]
    _, objs = ge.draw_scene(ge.make_record("counting", (4, "green", "triangle"), "y"), rng=3)
    assert len(objs) == 4
    _, objs = ge.draw_scene(ge.make_record("two_objects", ("circle", "square"), "z"), rng=3)
    assert objs[0]["colour"] != objs[1]["colour"]


def test_relations_are_genevals():
    assert ge.relations((0, 0, 10, 10), (20, 0, 30, 10)) == {"left of"}
    assert ge.relations((20, 0, 30, 10), (0, 0, 10, 10)) == {"right of"}
    assert ge.relations((0, 0, 10, 10), (0, 20, 10, 30)) == {"above"}
    assert ge.relations((0, 0, 10, 10), (20, 20, 30, 30)) == {"left of", "above"}
    assert ge.relations((0, 0, 10, 10), (2, 1, 12, 11)) == set()  # within the threshold


# --- the checker: drawn scenes ------------------------------------------------------------
def test_checker_accepts_drawn_scenes_of_every_kind():
    recs = ge.geneval_records(100, 5) + ge.geneval_records(25, 6, heldout="test")
    verdicts = [gc.check(ge.draw_scene(r, rng=i)[0], r)["correct"] for i, r in enumerate(recs)]
    acc = gc.accuracy_by_kind(recs, verdicts)
    assert acc["overall"] == 1.0 and all(acc[k] == 1.0 for k in ge.KINDS)


def test_checker_counts_colours_and_shapes_by_hand():
    img, d = _canvas()
    _circle(d, "red", 10, 10, 5)
    _circle(d, "red", 36, 12, 6)
    _circle(d, "red", 12, 36, 5)
    _square(d, "blue", 36, 36, 6)
    found = sorted((o["colour"], o["shape"]) for o in gc.find_objects(img))
    assert found == [("blue", "square"), ("red", "circle"), ("red", "circle"), ("red", "circle")]
    assert gc.check(img, _rec("three red circles"))["correct"]
    for wrong in ("two red circles", "four red circles", "three blue circles", "three red squares"):
        assert not gc.check(img, _rec(wrong))["correct"], wrong
    assert gc.check(img, _rec("a blue square"))["correct"]
    assert gc.check(img, _rec("a circle and a square"))["correct"]
    assert not gc.check(img, _rec("a circle and a triangle"))["correct"]
    assert gc.check(img, _rec("a red circle and a blue square"))["correct"]
    assert not gc.check(img, _rec("a blue circle and a red square"))["correct"]  # colours swapped


def test_checker_reads_positions_by_hand():
    img, d = _canvas()
    _triangle(d, "yellow", 12, 24, 7)
    _square(d, "purple", 36, 24, 7)
    assert gc.check(img, _rec("a yellow triangle left of a purple square"))["correct"]
    assert gc.check(img, _rec("a purple square right of a yellow triangle"))["correct"]
    for wrong in (
        "a yellow triangle right of a purple square",
        "a yellow triangle above a purple square",
        "a yellow circle left of a purple square",
        "a green triangle left of a purple square",
    ):
        assert not gc.check(img, _rec(wrong))["correct"], wrong
    flipped = img.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
    assert not gc.check(flipped, _rec("a yellow triangle left of a purple square"))["correct"]


def test_checker_rejects_scenes_of_other_prompts():
    recs = ge.geneval_records(200, 7)
    kinds = ("counting", "colour_attr", "position")
    wrong = [
        gc.check(ge.draw_scene(recs[(i + 5) % 200], rng=i)[0], r)["correct"]
        for i, r in enumerate(recs)
        if r["kind"] in kinds
    ]
    assert np.mean(wrong) < 0.1


# --- the checker: generated-looking images -----------------------------------------------
@pytest.mark.parametrize("colour", ["red", "yellow"])
def test_big_ragged_square_touching_the_frame_is_a_square(colour):
    """The one-object rule scores these 0 (a ragged rim drops the box fill under 0.89, and
    the blob touches the frame); the checker must read a square of that colour."""
    img, d = _canvas()
    _square(d, colour, 34, 26, 14)  # its right side is cut by the frame
    img = _generated_look(_ragged(img, colour, seed=1), seed=2)
    rec = {"prompt": f"a {colour} square", "colour": colour, "shape": "square"}
    assert prompt_alignment_rule(img, rec) == 0.0  # the rule's flaw
    assert gc.check(img, _rec(f"a {colour} square"))["correct"]
    assert not gc.check(img, _rec(f"a {colour} circle"))["correct"]
    assert gc.geneval_check(img, _rec(f"a {colour} square")) == 1.0


def test_generated_look_scenes_are_accepted():
    img, d = _canvas()
    _circle(d, "green", 12, 12, 6)
    _circle(d, "green", 34, 14, 6)
    _triangle(d, "cyan", 14, 36, 7)
    _square(d, "red", 36, 36, 6)
    for seed in range(3):
        noisy = _generated_look(_ragged(img, "green", seed=seed), seed=seed)
        assert gc.check(noisy, _rec("two green circles"))["correct"]
        assert gc.check(noisy, _rec("a cyan triangle and a red square"))["correct"]
        assert gc.check(noisy, _rec("a cyan triangle left of a red square"))["correct"]
        assert gc.check(noisy, _rec("a green circle above a red square"))["correct"]


def test_generated_failures_are_rejected():
    # two same-colour blobs run together: one object, not two
    img, d = _canvas()
    _circle(d, "red", 18, 24, 8)
    _circle(d, "red", 30, 24, 8)
    assert not gc.check(_generated_look(img), _rec("two red circles"))["correct"]
    # a colour washed over the whole frame is no object
    wash = Image.new("RGB", (48, 48), COLOURS["red"])
    assert gc.find_objects(wash) == []
    assert not gc.check(wash, _rec("a red square"))["correct"]
    # the right shapes with each other's colours
    img, d = _canvas()
    _circle(d, "blue", 12, 24, 7)
    _square(d, "red", 36, 24, 7)
    assert not gc.check(_generated_look(img), _rec("a red circle and a blue square"))["correct"]
    # specks of noise are not objects
    rng = np.random.default_rng(0)
    a = np.asarray(_canvas()[0]).copy()
    a[rng.random((48, 48)) < 0.01] = COLOURS["blue"]
    assert gc.find_objects(Image.fromarray(a)) == []
    # an empty image passes nothing
    assert not gc.check(_canvas()[0], _rec("a blue circle"))["correct"]


def test_parse_prompt_matches_the_records():
    for r in ge.geneval_records(60, 9):
        p = gc.parse_prompt(r["prompt"])
        assert (p["kind"], p["objects"], p["relation"]) == (r["kind"], r["objects"], r["relation"])


# --- the judge's data -------------------------------------------------------------------------
def test_judge_records_answer_from_the_drawing_and_skip_heldout_scenes():
    recs = ge.judge_records(120, seed=0)
    assert {r["task"] for r in recs} == {"count", "there", "colour", "position"}
    for r in recs:
        assert r["answer"] in {"Yes", "No", *COLOURS, *map(str, range(5))}
    counts = [r for r in recs if r["task"] == "count"]
    assert {r["answer"] for r in counts} > {"0", "1"}
    # the held-out prompts' scenes never appear: e.g. a lone red square (test, single)
    from mmyatt.datasets.geneval import _is_heldout_scene

    assert _is_heldout_scene([{"colour": "red", "shape": "square"}], None)
    assert not _is_heldout_scene([{"colour": "red", "shape": "circle"}], None)


def test_judge_questions_of_each_kind():
    for r in ge.geneval_records(10, 2):
        assert "?" in r["q1"] and "?" in r["q2"] and r["a1"] and r["a2"]
    rec = ge.make_record("position", ("red", "circle", "left of", "blue", "square"), "p")
    assert rec["q1"] == "Is the red circle left of the blue square?" and rec["a1"] == "Yes"
    rec = ge.make_record("colour_attr", ("red", "circle", "blue", "square"), "c")
    assert (rec["q1"], rec["a1"], rec["q2"], rec["a2"]) == (
        "What colour is the circle?",
        "red",
        "What colour is the square?",
        "blue",
    )


def test_rewards_are_registered_by_name():
    from mmyatt.rewards.rules import resolve_reward

    check, rule = resolve_reward("geneval_check"), resolve_reward("geneval_rule")
    img, d = _canvas()
    _circle(d, "red", 12, 24, 7)
    _square(d, "blue", 36, 24, 7)
    for prompt, want in (
        ("a circle and a square", 1.0),
        ("a red circle left of a blue square", 1.0),
    ):
        rec = ge.make_record(gc.parse_prompt(prompt)["kind"], _combo(prompt), "r")
        assert rec["prompt"] == prompt
        assert check(img, rec) == want
        assert 0.0 <= rule(img, rec) <= 1.0  # the one-object rule reads the first object


def _combo(prompt: str) -> tuple:
    p = gc.parse_prompt(prompt)
    a, *rest = p["objects"]
    if p["kind"] == "two_objects":
        return (a["shape"], rest[0]["shape"])
    b = rest[0]
    return (a["colour"], a["shape"], p["relation"], b["colour"], b["shape"])


def test_patch_sized_specks_are_not_objects():
    """A generator's failure mode: scattered 6x6 specks in the palette's colours. A speck
    is no object, so a speckled image passes (almost) nothing, and a drawn scene still
    passes."""
    rng = np.random.default_rng(0)
    colours = list(COLOURS.values())

    def speckle() -> Image.Image:
        a = np.zeros((48, 48, 3), np.uint8)
        a[:] = BACKGROUND
        for _ in range(int(rng.integers(5, 20))):
            x, y = rng.integers(0, 8, 2) * 6
            a[y : y + 6, x : x + 6] = colours[int(rng.integers(6))]
        return Image.fromarray(a).filter(ImageFilter.GaussianBlur(0.6))

    recs = ge.geneval_records(100, 11, heldout="test")
    assert np.mean([gc.check(speckle(), r)["correct"] for r in recs]) <= 0.05
    img, d = _canvas()
    _square(d, "red", 24, 24, 3)  # a 6x6 square alone: a speck
    assert gc.find_objects(img) == []
