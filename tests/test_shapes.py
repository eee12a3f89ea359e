"""Synthetic coloured shapes (datasets/shapes.py)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from mmyatt.datasets.shapes import (
    BACKGROUND,
    COLOURS,
    HELDOUT,
    HELDOUT_TEST,
    HELDOUT_VAL,
    MOTION_HELDOUT,
    MOTION_HELDOUT_TEST,
    SHAPES,
    draw_shape,
    is_heldout,
    motion_caption,
    motion_records,
    moving_shape_clip,
    shape_caption,
    shape_records,
    write_shape_task,
)


def test_draw_shape_is_seeded_and_jittered():
    a = np.asarray(draw_shape("red", "circle", rng=1))
    b = np.asarray(draw_shape("red", "circle", rng=1))
    c = np.asarray(draw_shape("red", "circle", rng=2))
    assert a.shape == (32, 32, 3) and a.dtype == np.uint8
    assert np.array_equal(a, b) and not np.array_equal(a, c)
    assert tuple(a[0, 0]) == BACKGROUND  # corners stay background
    # the shape's colour is present in its interior
    assert (np.abs(a.astype(int) - COLOURS["red"]).sum(-1) == 0).sum() > 50
    assert draw_shape("blue", "triangle", size=16, rng=0).size == (16, 16)


def test_captions_and_validation():
    assert shape_caption("red", "circle") == "a red circle"
    assert motion_caption("blue", "square", "up") == "a blue square moving up"
    with pytest.raises(ValueError, match="colour"):
        draw_shape("mauve", "circle")
    with pytest.raises(ValueError, match="shape"):
        shape_caption("red", "hexagon")
    with pytest.raises(ValueError, match="direction"):
        motion_caption("red", "circle", "sideways")


def test_records_respect_holdout():
    recs = shape_records(200, seed=3, holdout=[("red", "triangle")])
    assert len(recs) == 200 and len({r["id"] for r in recs}) == 200
    assert all(r["prompt"] == shape_caption(r["colour"], r["shape"]) for r in recs)
    assert not any((r["colour"], r["shape"]) == ("red", "triangle") for r in recs)
    assert {r["shape"] for r in recs} == set(SHAPES) and {r["colour"] for r in recs} == set(COLOURS)
    assert recs == shape_records(200, seed=3, holdout=[("red", "triangle")])
    sub = shape_records(20, seed=0, colours=["red", "blue"], shapes=["circle"])
    assert {r["prompt"] for r in sub} <= {"a red circle", "a blue circle"}
    with pytest.raises(ValueError, match="held out"):
        shape_records(1, 0, holdout=[("red", "circle")], colours=["red"], shapes=["circle"])


def read(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_write_shape_task_holds_out_combinations(tmp_path):
    paths = write_shape_task(tmp_path, n_train=300, n_eval=12, seed=1)
    train, test, val = read(paths["train"]), read(paths["test"]), read(paths["val"])
    assert len(train) == 300 and len(test) == len(val) == 12 + 6
    combo = lambda r: (r["colour"], r["shape"])  # noqa: E731
    # no held-out combination (test or val) is trained on; training still sees all words
    assert not {combo(r) for r in train} & set(HELDOUT)
    assert {r["colour"] for r in train} == set(COLOURS) and {r["shape"] for r in train} == set(
        SHAPES
    )
    for split, held in ((test, HELDOUT_TEST), (val, HELDOUT_VAL)):
        heldout = [r for r in split if r["split"] == "heldout"]
        seen = [r for r in split if r["split"] == "seen"]
        assert len(heldout) == 12 and len(seen) == 6
        assert [combo(r) for r in heldout] == [held[i % len(held)] for i in range(12)]  # balanced
        assert not {combo(r) for r in seen} & set(HELDOUT)
    # test, val and train are different records
    ids = [{r["id"] for r in x} for x in (train, test, val)]
    assert not (ids[0] & ids[1] or ids[0] & ids[2] or ids[1] & ids[2])
    video = write_shape_task(tmp_path / "v", n_train=200, n_eval=6, video=True)
    train_v = read(video["train"])
    assert train_v[0]["prompt"].endswith(f"moving {train_v[0]['direction']}")
    triple = lambda r: (r["colour"], r["shape"], r["direction"])  # noqa: E731
    assert not {triple(r) for r in train_v} & set(MOTION_HELDOUT)
    assert {triple(r) for r in read(video["test"]) if r["split"] == "heldout"} == set(
        MOTION_HELDOUT_TEST
    )


def test_is_heldout_pairs_cover_every_direction():
    assert is_heldout(("red", "square", "left"), [("red", "square")])
    assert not is_heldout(("red", "square", "left"), [("red", "square", "right")])
    assert is_heldout(("red", "square"), HELDOUT_TEST)


def test_moving_clip_moves_the_right_way():
    for direction, axis, sign in [("right", 1, 1), ("left", 1, -1), ("down", 0, 1), ("up", 0, -1)]:
        frames = moving_shape_clip("green", "square", direction, num_frames=6, size=32, rng=4)
        assert len(frames) == 6 and frames[0].size == (32, 32)
        cents = []
        for f in frames:
            fg = np.abs(np.asarray(f).astype(int) - BACKGROUND).sum(-1) > 100
            cents.append(np.argwhere(fg).mean(0))
        moved = cents[-1][axis] - cents[0][axis]
        assert sign * moved > 32 * 0.3, (direction, moved)
        assert abs(cents[-1][1 - axis] - cents[0][1 - axis]) < 0.5  # straight line
        # the shape stays inside the frame: the border is background in every frame
        for f in frames:
            a = np.asarray(f)
            assert (a[0] == BACKGROUND).all() and (a[:, -1] == BACKGROUND).all()
    recs = motion_records(8, seed=0)
    assert all(r["prompt"] == motion_caption(r["colour"], r["shape"], r["direction"]) for r in recs)
