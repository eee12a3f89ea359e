"""datasets/describe_motion.py: the judge's direction-contrast records (never naming a
held-out combination) and how far a clip's colour and shape alone predict its direction."""

import json

import pytest

from mmyatt.datasets import describe as d
from mmyatt.datasets import describe_check as dc
from mmyatt.datasets import describe_motion as dm
from mmyatt.datasets import describe_task as dt
from mmyatt.datasets.shapes import HELDOUT, HELDOUT_TEST, HELDOUT_VAL, MOTION_HELDOUT


def test_direction_contrast_records_differ_in_the_direction_alone():
    """A red circle moving up, asked with every direction: "up" is "Yes", "left" and
    "right" are "No", and "down" is never asked (red circle down is a held-out triple of
    the validation split); the other words are the same in every record of the clip."""
    recs = dm.direction_contrast_records(
        3, seed=0, wrong=3, only_triples=[("red", "circle", "up")], exclude_triples=()
    )
    assert len(recs) == 3 * 3
    for k in range(3):
        clip = recs[3 * k : 3 * k + 3]
        named = [r["output"].split()[-1] for r in clip]
        assert named[0] == "up" and sorted(named[1:]) == ["left", "right"]
        assert [r["answer"] for r in clip] == ["Yes", "No", "No"]
        assert [r["negative_type"] for r in clip] == [None, "direction", "direction"]
        assert len({r["output"].rsplit(" ", 1)[0] for r in clip}) == 1  # one phrasing
        assert all(r["image"] is clip[0]["image"] and len(r["image"]) == d.FRAMES for r in clip)
        for r in clip:
            assert r["prompt"] == d.JUDGE_TEMPLATE.format(output=r["output"])
            assert dc.description_check(r["output"], r) == (1.0 if r["answer"] == "Yes" else 0.0)


def test_direction_contrast_records_never_show_or_name_a_heldout_combination():
    recs = dm.direction_contrast_records(200, seed=3, wrong=3, extra_colours=True)
    assert sum(r["answer"] == "Yes" for r in recs) == 200
    assert len(recs) < 4 * 200  # some wrong directions were skipped: they name a held-out triple
    for r in recs:
        assert (r["colour"], r["shape"]) not in HELDOUT
        assert (r["colour"], r["shape"], r["direction"]) not in MOTION_HELDOUT
        assert not d.names_heldout(r["output"], r)
    with pytest.raises(ValueError, match="wrong must be"):
        dm.direction_contrast_records(1, seed=0, wrong=4)


def test_direction_contrast_records_ask_a_wrong_colour_or_shape_in_the_same_words():
    """With ``other_kinds=1`` every clip is asked with its true description and a wrong
    colour or shape in the same phrasing. Of a red triangle moving left only "circle" is
    a wrong shape that names no held-out combination (red square is a held-out pair), and
    "green", "cyan" and "blue" are never its wrong colour (green and cyan triangles are
    held-out pairs, a blue triangle moving left a held-out triple); the direction is kept."""
    recs = dm.direction_contrast_records(
        40, seed=1, wrong=1, other_kinds=1.0, only_triples=[("red", "triangle", "left")]
    )
    assert len(recs) == 80
    kinds = [r["negative_type"] for r in recs]
    assert kinds[0::2] == [None] * 40 and set(kinds[1::2]) == {"colour", "shape"}
    for yes, no in zip(recs[0::2], recs[1::2]):
        assert (yes["answer"], no["answer"]) == ("Yes", "No")
        assert yes["output"].split()[-1] == no["output"].split()[-1] == "left"
        changed = set(yes["output"].split()) ^ set(no["output"].split())
        assert len(changed) == 2 and changed & {"red", "triangle"}  # one word swapped
        named = set(no["output"].split())
        if no["negative_type"] == "shape":
            assert "circle" in named
        assert not named & {"square", "green", "cyan", "blue"}
        assert not d.names_heldout(no["output"], no)
        assert dc.description_check(no["output"], no) == 0.0
        assert yes["image"] is no["image"]
    # a cyan circle moving up has no such wrong shape (cyan triangle: a held-out pair; a
    # cyan square moving up: a held-out triple): it comes without one, never with a held-out name
    cyan = dm.direction_contrast_records(
        20, seed=2, other_kinds=1.0, only_triples=[("cyan", "circle", "up")]
    )
    assert sum(r["answer"] == "Yes" for r in cyan) == 20
    assert {r["negative_type"] for r in cyan} <= {None, "colour"}
    assert not any(d.names_heldout(r["output"], r) for r in cyan)


def test_training_batch_gives_its_share_to_direction_contrasts():
    from mmyatt.models.builtin.train_describe_judge import training_batch

    batch = training_batch(32, seed=0, base_share=0.1, score_share=0.05, contrast_share=0.5)
    # the contrast clips are drawn with their own seed (seed + 71): 16 records, 8 clips
    contrasts = [r for r in batch if r["id"].startswith("d71-")]
    assert len(batch) == 32 and len(contrasts) == 16
    assert sum(r["answer"] == "Yes" for r in contrasts) == 8
    assert {r["negative_type"] for r in contrasts} == {None, "direction"}


def test_direction_shortcut_hand_worked():
    # training clips: red circle up x2, down x1 -> guess "up"; blue square left x1 -> "left";
    # an image (no direction) is ignored. Train: 3 of 4 clips are their pair's guess.
    clip = lambda c, s, dr, **kw: {"colour": c, "shape": s, "direction": dr, **kw}  # noqa: E731
    train = [
        clip("red", "circle", "up"),
        clip("red", "circle", "up"),
        clip("red", "circle", "down"),
        clip("blue", "square", "left"),
        {"colour": "red", "shape": "circle", "direction": None},
    ]
    evaluated = [
        clip("red", "circle", "up", split="seen"),  # guessed
        clip("blue", "square", "right", split="heldout"),  # pair never moved right
        clip("red", "circle", "left", split="heldout"),
        clip("green", "circle", "up", split="heldout"),  # no training clip: no guess
    ]
    got = dm.direction_shortcut(train, evaluated)
    assert got == {"pairs": 2, "train": 0.75, "evaluated": 0.25, "heldout": 0.0, "seen": 1.0}


def test_direction_shortcut_of_the_written_task(tmp_path):
    # the shipped task: the held-out triple of a pair is a direction the pair never takes
    # in training, so the guess never names it
    paths = dt.write_describe_task(tmp_path, n_train=400, n_eval=48, seed=0)
    read = lambda p: [json.loads(x) for x in p.read_text().splitlines()]  # noqa: E731
    got = dm.direction_shortcut(read(paths["train"]), read(paths["test"]))
    assert got["heldout"] == 0.0
    assert got["train"] > 0.25


def test_clip_heldout_pairs_holds_out_whole_pairs_and_trains_every_direction(tmp_path):
    paths = dt.write_describe_task(tmp_path, n_train=2000, n_eval=48, seed=0, clip_heldout="pairs")
    read = lambda p: [json.loads(x) for x in p.read_text().splitlines()]  # noqa: E731
    train, test, val = read(paths["train"]), read(paths["test"]), read(paths["val"])
    clips = [r for r in train if r["direction"]]
    # every trained pair moves every way in training; no held-out pair is trained
    moves: dict[tuple, set] = {}
    for r in clips:
        moves.setdefault((r["colour"], r["shape"]), set()).add(r["direction"])
    assert len(moves) == 12 and all(len(v) == 4 for v in moves.values())
    assert not any((r["colour"], r["shape"]) in HELDOUT for r in train)
    # the held-out clips are the held-out pairs', in more than one direction
    for split, pairs in ((test, HELDOUT_TEST), (val, HELDOUT_VAL)):
        held = [r for r in split if r["split"] == "heldout" and r["direction"]]
        assert held and all((r["colour"], r["shape"]) in pairs for r in held)
        assert len({r["direction"] for r in held}) > 1
    # colour and shape tell nothing of a held-out clip's direction
    assert dm.direction_shortcut(train, test)["heldout"] == 0.0


def test_clip_heldout_is_checked(tmp_path):
    with pytest.raises(ValueError, match="clip_heldout"):
        dt.write_describe_task(tmp_path, n_train=10, n_eval=6, clip_heldout="clips")
    with pytest.raises(ValueError, match="val_fold"):
        dt.write_describe_task(tmp_path, n_train=10, n_eval=6, clip_heldout="pairs", val_fold=2)


def test_sft_direction_drill_asks_each_sft_clip_its_direction(tmp_path):
    paths = dt.write_describe_task(tmp_path, n_train=40, n_eval=6, sft_direction_drill=True)
    read = lambda p: [json.loads(x) for x in p.read_text().splitlines()]  # noqa: E731
    for name in ("sft", "sft_heldout"):
        recs = read(paths[name])
        clips = [r for r in recs if r["direction"] and r["task"] == "describe_video"]
        drill = [r for r in recs if r["task"] == "direction_drill"]
        assert clips and len(drill) == len(clips)
        for r in drill:
            assert r["prompt"] == d.DIRECTION_QUESTION and r["answer"] == r["direction"]
            assert (tmp_path / r["video"]).exists()
    assert not any(r["task"] == "direction_drill" for r in read(paths["train"]))
