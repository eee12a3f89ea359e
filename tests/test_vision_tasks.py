"""Synthetic VLM tasks: determinism, disjoint splits, balanced judge negatives, motion clips."""

from __future__ import annotations

import collections
import json

import numpy as np
from PIL import Image

from mmyatt.datasets.media import load_image, load_video
from mmyatt.datasets.vision_tasks import (
    COLOURS,
    SHAPES,
    judge_records,
    judge_training_mix,
    motion_clip,
    shape_records,
    write_judge_task,
    write_motion_task,
    write_shape_task,
)


def _read(path):
    return [json.loads(line) for line in open(path)]


def test_shape_task_splits_disjoint_and_loadable(tmp_path):
    paths = write_shape_task(tmp_path, n_train=24, n_eval=12, seed=3)
    train, evals = _read(paths["train"]), _read(paths["eval"])
    assert len(train) == 24 and len(evals) == 12
    assert not {r["id"] for r in train} & {r["id"] for r in evals}
    assert not {r["image"] for r in train} & {r["image"] for r in evals}
    train_pixels = {load_image(tmp_path / r["image"]).tobytes() for r in train}
    assert not train_pixels & {load_image(tmp_path / r["image"]).tobytes() for r in evals}
    for r in train:
        assert r["answer"] == (r["colour"] if r["task"] == "colour" else r["shape"])
        assert r["answer"] in COLOURS or r["answer"] in SHAPES
    assert load_image(tmp_path / train[0]["image"]).size == (56, 56)


def test_records_are_deterministic_and_show_the_colour():
    a, b = shape_records(6, seed=1), shape_records(6, seed=1)
    assert [r["image"].tobytes() for r in a] == [r["image"].tobytes() for r in b]
    for r in a:
        pixels = np.asarray(r["image"]).reshape(-1, 3).astype(int)
        target = np.array(COLOURS[r["colour"]])
        assert (np.abs(pixels - target).max(-1) <= 15).sum() > 100  # the shape is there


def test_judge_negatives_balanced(tmp_path):
    records = judge_records(300, seed=0)
    answers = collections.Counter(r["answer"] for r in records)
    assert answers == {"Yes": 150, "No": 150}
    kinds = collections.Counter(r["negative_type"] for r in records if r["answer"] == "No")
    assert kinds == {"colour": 50, "shape": 50, "both": 50}
    for r in records:
        colour_ok, shape_ok = r["claimed_colour"] == r["colour"], r["claimed_shape"] == r["shape"]
        expected = {
            None: (True, True),
            "colour": (False, True),
            "shape": (True, False),
            "both": (False, False),
        }
        assert (colour_ok, shape_ok) == expected[r["negative_type"]]
        assert f"{r['claimed_colour']} {r['claimed_shape']}" in r["prompt"]
    odd = collections.Counter(
        r["negative_type"] for r in judge_records(31, seed=1) if r["answer"] == "No"
    )
    assert max(odd.values()) - min(odd.values()) <= 1


def test_judge_task_files(tmp_path):
    paths = write_judge_task(tmp_path, n_train=40, n_eval=30, seed=0, classification_fraction=0.5)
    train, evals = _read(paths["train"]), _read(paths["eval"])
    assert collections.Counter(r["task"] for r in train)["judge"] == 20
    assert {r["task"] for r in evals} == {"judge"}
    assert not {r["id"] for r in train} & {r["id"] for r in evals}
    mix = judge_training_mix(10, seed=0, classification_fraction=0.3)
    assert collections.Counter(r["task"] for r in mix)["judge"] == 7
    assert isinstance(mix[0]["image"], Image.Image)
    mix = judge_training_mix(40, seed=0, classification_fraction=0.25, attribute_fraction=0.25)
    tasks = collections.Counter(r["task"] for r in mix)
    assert tasks["judge"] == 20 and tasks["check_colour"] == tasks["check_shape"] == 5
    for r in mix:
        if r["task"] == "check_colour":
            assert (r["colour"] in r["prompt"]) == (r["answer"] == "Yes")
        if r["task"] == "check_shape":
            assert (r["shape"] in r["prompt"]) == (r["answer"] == "Yes")


def test_motion_task_videos_move(tmp_path):
    rng = np.random.default_rng(0)
    clip = motion_clip("left", rng, frames=6)
    xs = [np.nonzero((f != f[0, 0]).any(-1))[1].mean() for f in clip]
    assert (np.diff(xs) < 0).all()
    paths = write_motion_task(tmp_path, n_train=4, n_eval=2, seed=0)
    train = _read(paths["train"])
    assert {r["answer"] for r in train} == {"left", "right"}
    frames = load_video(tmp_path / train[0]["video"], fps=2.0, max_frames=8)
    assert frames.shape[0] == train[0]["num_frames"] and frames.shape[1:] == (56, 56, 3)
