"""Image and clip rule rewards (rewards/image.py)."""

from __future__ import annotations

import numpy as np
import pytest
from PIL import Image

from mmyatt.datasets.shapes import COLOURS, SHAPES, draw_shape, moving_shape_clip
from mmyatt.rewards.image import (
    IMAGE_REWARDS,
    brightness,
    classify_shape,
    colour_match,
    jpeg_compressibility,
    jpeg_incompressibility,
    load_scorer,
    motion_direction,
    prompt_alignment_rule,
    shape_fill,
    shape_match,
)
from mmyatt.rewards.latent import LATENT_REWARDS
from mmyatt.rewards.rules import resolve_reward


def test_colour_match_on_a_red_circle():
    img = draw_shape("red", "circle", rng=0)
    assert colour_match(img, {"colour": "red"}) > 0.95
    assert colour_match(img, {"colour": "blue"}) < 0.05
    assert colour_match(img, {"prompt": "a red circle"}) > 0.95  # colour read from the prompt
    # nothing drawn: no colour
    assert colour_match(Image.new("RGB", (32, 32), (24, 24, 32)), {"colour": "red"}) == 0.0
    with pytest.raises(KeyError):
        colour_match(img, {"prompt": "something"})


def test_every_colour_is_recognised():
    for i, c in enumerate(COLOURS):
        img = draw_shape(c, SHAPES[i % 3], rng=i)
        scores = {o: colour_match(img, {"colour": o}) for o in COLOURS}
        assert max(scores, key=scores.get) == c and scores[c] > 0.9


@pytest.mark.parametrize("size", [32, 64])
def test_shape_rule_accuracy(size):
    rng = np.random.default_rng(123)
    hits, n = 0, 0
    for i in range(90):
        shape = SHAPES[i % 3]
        img = draw_shape(list(COLOURS)[i % 6], shape, size=size, rng=rng)
        hits += classify_shape(img) == shape
        n += 1
    assert hits / n >= 0.95
    img = draw_shape("green", "triangle", rng=5)
    assert shape_match(img, {"shape": "triangle"}) == 1.0
    assert shape_match(img, {"shape": "square"}) == 0.0
    assert classify_shape(Image.new("RGB", (32, 32), (24, 24, 32))) is None


def test_shapes_cut_off_by_the_frame_are_not_shapes():
    dark = (24, 24, 32)
    full = Image.new("RGB", (32, 32), (230, 40, 40))  # a colour filling the frame
    assert classify_shape(full) is None
    assert prompt_alignment_rule(full, {"prompt": "a red square"}) == 0.0
    inside = Image.new("RGB", (32, 32), dark)
    inside.paste((230, 40, 40), (6, 6, 26, 26))  # a square clear of the edges
    assert classify_shape(inside) == "square"
    edge = Image.new("RGB", (32, 32), dark)
    edge.paste((230, 40, 40), (0, 6, 20, 26))  # touching the left edge
    assert classify_shape(edge) is None


def test_shape_fill_is_what_classify_shape_thresholds():
    dark = (24, 24, 32)
    square = Image.new("RGB", (32, 32), dark)
    square.paste((230, 40, 40), (6, 6, 26, 26))  # 20 x 20; the 3x3 opening cuts 4 corners
    assert shape_fill(square) == pytest.approx((400 - 4) / 400)
    # an L: a 12 x 12 square with its 6 x 6 top-right quarter missing fills 3/4 of its box
    ell = Image.new("RGB", (32, 32), dark)
    ell.paste((40, 200, 40), (8, 14, 20, 20))
    ell.paste((40, 200, 40), (8, 8, 14, 14))
    # the opening takes the pixel at each convex corner: 4 of the square, 5 of the L
    assert shape_fill(ell) == pytest.approx((144 - 36 - 5) / 144)
    assert classify_shape(ell) == "circle"  # 0.715: between the triangle and square bounds
    assert shape_fill(Image.new("RGB", (32, 32), dark)) is None
    assert shape_fill(Image.new("RGB", (32, 32), (230, 40, 40))) is None  # touches the edge


def test_prompt_alignment_rule():
    img = draw_shape("yellow", "square", rng=1)
    assert prompt_alignment_rule(img, {"prompt": "a yellow square"}) > 0.95
    assert prompt_alignment_rule(img, {"prompt": "a yellow circle"}) == 0.0
    assert prompt_alignment_rule(img, {"prompt": "a blue square"}) < 0.05


def test_motion_direction():
    clip = moving_shape_clip("red", "square", "right", num_frames=8, size=32, rng=0)
    assert motion_direction(clip, {"direction": "right"}) > 0.9
    assert motion_direction(clip, {"direction": "left"}) < 0.1
    assert motion_direction(clip, {"prompt": "a red square moving up"}) == pytest.approx(
        0.5, abs=0.05
    )
    still = [draw_shape("red", "square", rng=0)] * 4
    assert motion_direction(still, {"direction": "right"}) == pytest.approx(0.5)
    empty = [Image.new("RGB", (32, 32), (24, 24, 32))] * 4
    assert motion_direction(empty, {"direction": "right"}) == 0.0
    small = moving_shape_clip("blue", "circle", "down", num_frames=8, size=16, rng=2)
    assert motion_direction(small, {"direction": "down"}) > 0.9
    # image rules average over the frames of a clip
    assert colour_match(clip, {"colour": "red"}) > 0.95


def test_jpeg_ordering_and_range():
    rng = np.random.default_rng(0)
    noise = Image.fromarray(rng.integers(0, 256, (32, 32, 3), dtype=np.uint8))
    flat = Image.new("RGB", (32, 32), (10, 200, 30))
    shape = draw_shape("red", "circle", rng=0)
    inc = [jpeg_incompressibility(im, {}) for im in (flat, shape, noise)]
    assert inc[0] < inc[1] < inc[2] and inc[2] > 0.9 and inc[0] < 0.05
    assert all(0.0 <= v <= 1.0 for v in inc)
    assert jpeg_compressibility(flat, {}) > jpeg_compressibility(noise, {})
    assert jpeg_compressibility(shape, {}) == pytest.approx(1 - inc[1])


def test_brightness():
    assert brightness(Image.new("RGB", (8, 8), (0, 0, 0)), {}) == 0.0
    assert brightness([Image.new("RGB", (8, 8), (255, 255, 255))] * 2, {}) == 1.0
    with pytest.raises(TypeError):
        brightness("not an image", {})


def test_load_scorer(tmp_path):
    d = tmp_path / "scorer"
    d.mkdir()
    (d / "scorer.py").write_text(
        "import numpy as np\n"
        "def score(images, prompts):\n"
        "    return [float(np.asarray(im).mean() / 255) + len(p) * 0 for im, p in zip(images, prompts)]\n"
    )
    fn = load_scorer(d)
    white = Image.new("RGB", (4, 4), (255, 255, 255))
    assert fn(white, {"prompt": "x"}) == 1.0
    assert fn.score_batch([white, Image.new("RGB", (4, 4))], ["a", "b"]) == [1.0, 0.0]
    assert fn([white, Image.new("RGB", (4, 4))], {"prompt": "clip"}) == 0.5
    with pytest.raises(FileNotFoundError, match="scorer.py"):
        load_scorer(tmp_path)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_scorer(tmp_path / "nope")


def test_registry():
    assert set(IMAGE_REWARDS) >= {
        "jpeg_compressibility",
        "jpeg_incompressibility",
        "colour_match",
        "brightness",
        "shape_match",
        "prompt_alignment_rule",
        "motion_direction",
    }
    img = draw_shape("red", "circle", rng=0)
    rec = {
        "prompt": "a red circle moving right",
        "colour": "red",
        "shape": "circle",
        "direction": "right",
    }
    import torch

    latent = torch.from_numpy(np.asarray(img, dtype=np.float32) / 127.5 - 1.0).permute(2, 0, 1)
    # the image rules, and the checker and the critic the registry resolves by name
    named = {name: resolve_reward(name) for name in ("geneval_check", "shape_critic")}
    assert "shape_critic" not in IMAGE_REWARDS  # it imports torch: resolved by name only
    for name, fn in {**IMAGE_REWARDS, **named}.items():
        out = [img, img] if name == "motion_direction" else img
        if fn in LATENT_REWARDS:  # latent rewards get the final latents
            out = latent
        v = fn(out, rec)
        assert isinstance(v, float) and 0.0 <= v <= 1.0, name
