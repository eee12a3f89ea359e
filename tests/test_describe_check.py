"""The well-formedness parser of the VLM + GenRM recipe's checker, against hand-written
answers: a description is a colour, a shape and, for a clip, a direction, nothing else."""

import numpy as np
import pytest

from mmyatt.datasets import describe as d
from mmyatt.datasets import describe_check as dc
from mmyatt.rewards.rules import resolve_reward

IMG = {"colour": "red", "shape": "circle", "direction": None}
CLIP = {"colour": "cyan", "shape": "square", "direction": "up"}
# the names configs/vlm_genrm_tiny.yaml gives them
WELLFORMED = "describe_wellformed"
STRICT = "describe_strict"
WARM_START = "describe_warm_start"


@pytest.mark.parametrize(
    "answer, parsed",
    [
        ("a red circle", ("red", "circle")),
        ("the red circle", ("red", "circle")),
        ("one red circle", ("red", "circle")),
        ("a single red circle", ("red", "circle")),
        ("a circle that is red", ("red", "circle")),
        ("A Red Circle.", ("red", "circle")),  # case and a closing full stop
        ("a  red   circle", ("red", "circle")),  # runs of spaces
        ("red circle", ("red", "circle")),  # no article
        ("a blue square", ("blue", "square")),  # well formed, whatever the truth
        ("a pink star", ("pink", "star")),  # the judge's extra colours and shapes are words
        ("a red", None),  # the shape lost
        ("a circle", None),  # the colour lost
        ("a red circle moving left", None),  # a still image does not move
        ("a red circle and a blue one", None),  # a second object
        ("a red red circle", None),  # a word repeated
        ("a red circlemognnin", None),  # junk glued to a word
        ("a red circle th is", None),  # stray fragments
        ("a circle that is red and blue", None),  # a second colour
        ("a ssssst that is red", None),  # no shape word
        ("", None),
    ],
)
def test_image_answers(answer, parsed):
    got = dc.parse_description(answer, clip=False)
    if parsed is None:
        assert got is None
        assert resolve_reward(WELLFORMED)(answer, IMG) == 0.0
    else:
        assert got == {"colour": parsed[0], "shape": parsed[1], "direction": None}
        assert resolve_reward(WELLFORMED)(answer, IMG) == 1.0


@pytest.mark.parametrize(
    "answer, parsed",
    [
        ("a cyan square moving up", ("cyan", "square", "up")),
        ("a cyan square that moves up", ("cyan", "square", "up")),
        ("a cyan square going up", ("cyan", "square", "up")),
        ("one cyan square moving up", ("cyan", "square", "up")),
        ("a square that is cyan moving up", ("cyan", "square", "up")),
        ("the cyan square moves left", ("cyan", "square", "left")),
        ("a red triangle moving down", ("red", "triangle", "down")),  # wrong, but words
        # what the shipped recipe's clip answers became, and what its warm start wrote
        ("a cyan squaremognnin up", None),
        ("a purple circlemognnn up left", None),
        ("a blue circlemoiomomomo left", None),
        ("a purple triangle moatvng up", None),
        ("a cyan triangle tat cyan cyanvn up", None),
        ("a green square gatvngg", None),
        ("a cyan square", None),  # the direction lost
        ("a cyan square moving", None),
        ("a cyan square moving up and left", None),  # two directions
        ("a cyan square moving up up", None),
        ("a cyan square up", None),  # no verb: not a phrasing it was taught
        ("a square that is cyan moving", None),
    ],
)
def test_clip_answers(answer, parsed):
    got = dc.parse_description(answer, clip=True)
    if parsed is None:
        assert got is None
        assert resolve_reward(WELLFORMED)(answer, CLIP) == 0.0
    else:
        assert got == dict(zip(("colour", "shape", "direction"), parsed, strict=True))
        assert resolve_reward(WELLFORMED)(answer, CLIP) == 1.0


def test_every_reference_phrasing_parses_to_its_own_attributes():
    """The SFT targets (every phrasing, images and clips, extra shapes too) are well formed
    and parse to the record's own colour, shape and direction."""
    for rec in d.describe_records(200, seed=5, extra_shapes=0.3):
        got = dc.parse_description(rec["answer"], clip=rec["direction"] is not None)
        assert got == {k: rec[k] for k in ("colour", "shape", "direction")}, rec["answer"]


def test_text_only_judge_negatives_do_not_parse():
    """The judge's negatives that only the text refutes (a stray word, a second object, a
    word repeated, junk) are malformed by the parser too; those that only the picture
    refutes (a wrong colour) are well formed."""
    recs = d.judge_records(400, seed=3, negative_weights=d.JUNK_WEIGHTS)
    kinds = {}
    for r in recs:
        clip = r["direction"] is not None
        kinds.setdefault(r["negative_type"], []).append(dc.parse_description(r["output"], clip))
    for kind in ("added", "repeat", "two", "junk"):
        assert all(p is None for p in kinds[kind]), kind
    assert all(p is not None for p in kinds["colour"])
    assert all(p is not None for p in kinds[None])  # the correct descriptions


def test_strict_check_is_the_check_of_a_wellformed_answer():
    assert resolve_reward("describe_check")("a cyan squaremoving up", CLIP) == pytest.approx(2 / 3)
    assert resolve_reward(STRICT)("a cyan squaremoving up", CLIP) == 0.0
    assert resolve_reward(STRICT)("a cyan square moving up", CLIP) == 1.0
    assert resolve_reward(STRICT)("a cyan square moving left", CLIP) == 0.0
    assert resolve_reward(STRICT)("a cyan square moving", CLIP) == 0.0
    assert resolve_reward(STRICT)("the red circle", IMG) == 1.0
    assert np.isclose(resolve_reward(STRICT)("a red square", IMG), 0.0)


def test_warm_start_check_weighs_images_and_clips_half_each():
    """Over the task's mix (one clip in four) a warm start whose clips are all malformed
    scores half, however good its images; the plain mean would give it three quarters."""
    recs = d.describe_records(400, seed=2)
    clip_share = sum(r["direction"] is not None for r in recs) / len(recs)
    assert clip_share == pytest.approx(0.25)
    check = resolve_reward(WARM_START)

    def answer(r, clips_malformed):
        if r["direction"] is None:
            return f"a {r['colour']} {r['shape']}"
        verb = "movnvng" if clips_malformed else "moving"
        return f"a {r['colour']} {r['shape']} {verb} {r['direction']}"

    images_only = np.mean([check(answer(r, True), r) for r in recs])
    assert images_only == pytest.approx(0.5)
    assert np.mean([dc.strict_check(answer(r, True), r) for r in recs]) == pytest.approx(0.75)
    assert np.mean([check(answer(r, False), r) for r in recs]) == pytest.approx(1.0)
