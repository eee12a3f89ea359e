"""Synthetic coloured shapes: captioned images and moving-shape clips.

The toy text-to-image task of the flow recipes: "a red circle" should give a red circle.
Images are a solid shape on a plain dark background with position and size jitter, so a
rule (rewards/image.py) can check colour, shape and motion exactly. Everything is drawn
with Pillow from a seeded ``numpy.random.Generator``; nothing is downloaded.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw

__all__ = [
    "BACKGROUND",
    "COLOURS",
    "DIRECTIONS",
    "SHAPES",
    "draw_shape",
    "motion_caption",
    "motion_records",
    "moving_shape_clip",
    "shape_caption",
    "shape_records",
    "write_shape_task",
]

# Saturated colours with well separated hues (0, 60, 120, 180, 240, 285 degrees), so a
# hue rule tells them apart after blurring and JPEG-like artefacts.
COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (220, 40, 40),
    "yellow": (225, 215, 40),
    "green": (40, 200, 60),
    "cyan": (40, 200, 215),
    "blue": (50, 80, 230),
    "purple": (165, 60, 215),
}
SHAPES: tuple[str, ...] = ("circle", "square", "triangle")
DIRECTIONS: dict[str, tuple[int, int]] = {  # unit step in image coordinates (x right, y down)
    "left": (-1, 0),
    "right": (1, 0),
    "up": (0, -1),
    "down": (0, 1),
}
BACKGROUND = (24, 24, 32)  # plain dark background: foreground = bright, saturated pixels
_SUPERSAMPLE = 4  # draw at 4x and box-downsample: smooth edges, exact fill ratios


def _rng(rng: np.random.Generator | int | None) -> np.random.Generator:
    return rng if isinstance(rng, np.random.Generator) else np.random.default_rng(rng)


def _check(colour: str, shape: str) -> None:
    if colour not in COLOURS:
        raise ValueError(f"unknown colour {colour!r}; expected one of {list(COLOURS)}")
    if shape not in SHAPES:
        raise ValueError(f"unknown shape {shape!r}; expected one of {list(SHAPES)}")


def _paint(draw: ImageDraw.ImageDraw, shape: str, cx: float, cy: float, r: float, fill) -> None:
    """A shape of half-extent r centred at (cx, cy), axis-aligned: its bounding-box fill
    ratio is 1 for a square, pi/4 for a circle and 1/2 for the triangle."""
    box = [cx - r, cy - r, cx + r, cy + r]
    if shape == "circle":
        draw.ellipse(box, fill=fill)
    elif shape == "square":
        draw.rectangle(box, fill=fill)
    else:  # isosceles, apex up, as tall as it is wide
        draw.polygon([(cx, cy - r), (cx + r, cy + r), (cx - r, cy + r)], fill=fill)


def _render(colour: str, shape: str, size: int, cx: float, cy: float, r: float) -> Image.Image:
    k = _SUPERSAMPLE
    img = Image.new("RGB", (size * k, size * k), BACKGROUND)
    _paint(ImageDraw.Draw(img), shape, cx * k, cy * k, r * k, COLOURS[colour])
    return img.resize((size, size), Image.BOX)


def draw_shape(
    colour: str,
    shape: str,
    *,
    size: int = 32,
    rng: np.random.Generator | int | None = None,
    jitter: float = 0.15,
) -> Image.Image:
    """A ``size`` x ``size`` RGB image of one solid shape on the dark background.

    The half-extent is 24-34% of the image; the centre moves by up to ``jitter`` x size
    from the middle on each axis (clamped so the shape stays inside the frame). Modest
    jitter keeps the caption -> image map learnable by a tiny model in minutes on a CPU.
    """
    _check(colour, shape)
    g = _rng(rng)
    r = size * g.uniform(0.24, 0.34)
    reach = max(0.0, min(size * jitter, size / 2 - r - 1.0))
    cx, cy = size / 2 + g.uniform(-reach, reach, size=2)
    return _render(colour, shape, size, cx, cy, r)


def shape_caption(colour: str, shape: str) -> str:
    """>>> shape_caption("red", "circle")
    'a red circle'
    """
    _check(colour, shape)
    return f"a {colour} {shape}"


def motion_caption(colour: str, shape: str, direction: str) -> str:
    """>>> motion_caption("red", "square", "right")
    'a red square moving right'
    """
    if direction not in DIRECTIONS:
        raise ValueError(f"unknown direction {direction!r}; expected one of {list(DIRECTIONS)}")
    return f"{shape_caption(colour, shape)} moving {direction}"


def _combos(colours, shapes, holdout) -> list[tuple[str, str]]:
    held = {tuple(h) for h in holdout}
    combos = [(c, s) for c in colours for s in shapes if (c, s) not in held]
    for c, s in combos:
        _check(c, s)
    if not combos:
        raise ValueError("every colour/shape combination is held out")
    return combos


def shape_records(
    n: int,
    seed: int,
    holdout: tuple[tuple[str, str], ...] | list = (),
    *,
    colours: tuple[str, ...] | list[str] = tuple(COLOURS),
    shapes: tuple[str, ...] | list[str] = SHAPES,
) -> list[dict]:
    """``n`` prompt records {"prompt", "colour", "shape", "id"}, combinations drawn
    uniformly from colours x shapes minus the ``holdout`` (colour, shape) pairs."""
    combos = _combos(colours, shapes, holdout)
    g = np.random.default_rng(seed)
    out = []
    for i in range(n):
        c, s = combos[int(g.integers(len(combos)))]
        out.append(
            {"prompt": shape_caption(c, s), "colour": c, "shape": s, "id": f"shape-{seed}-{i}"}
        )
    return out


def motion_records(
    n: int,
    seed: int,
    holdout: tuple[tuple[str, str], ...] | list = (),
    *,
    colours: tuple[str, ...] | list[str] = tuple(COLOURS),
    shapes: tuple[str, ...] | list[str] = SHAPES,
    directions: tuple[str, ...] | list[str] = tuple(DIRECTIONS),
) -> list[dict]:
    """Like ``shape_records`` with a "direction" and captions "a red square moving right"."""
    combos = _combos(colours, shapes, holdout)
    g = np.random.default_rng(seed)
    out = []
    for i in range(n):
        c, s = combos[int(g.integers(len(combos)))]
        d = directions[int(g.integers(len(directions)))]
        out.append(
            {
                "prompt": motion_caption(c, s, d),
                "colour": c,
                "shape": s,
                "direction": d,
                "id": f"motion-{seed}-{i}",
            }
        )
    return out


def moving_shape_clip(
    colour: str,
    shape: str,
    direction: str,
    num_frames: int = 8,
    size: int = 32,
    rng: np.random.Generator | int | None = None,
) -> list[Image.Image]:
    """``num_frames`` frames of a shape moving in a straight line in ``direction``.

    Half-extent 15-22% of the frame; the shape travels 35-50% of the frame over the clip
    and stays fully inside it.
    """
    _check(colour, shape)
    if direction not in DIRECTIONS:
        raise ValueError(f"unknown direction {direction!r}; expected one of {list(DIRECTIONS)}")
    if num_frames < 2:
        raise ValueError(f"num_frames must be >= 2, got {num_frames}")
    g = _rng(rng)
    r = size * g.uniform(0.15, 0.22)
    travel = size * g.uniform(0.35, 0.5)
    dx, dy = DIRECTIONS[direction]
    lo, hi = r + 1.0, size - r - 1.0
    travel = min(travel, hi - lo)
    # start so the whole path fits: along the motion axis from the trailing side
    start = [g.uniform(lo, hi), g.uniform(lo, hi)]
    for axis, d in ((0, dx), (1, dy)):
        if d > 0:
            start[axis] = g.uniform(lo, hi - travel)
        elif d < 0:
            start[axis] = g.uniform(lo + travel, hi)
    frames = []
    for f in range(num_frames):
        u = travel * f / (num_frames - 1)
        frames.append(_render(colour, shape, size, start[0] + dx * u, start[1] + dy * u, r))
    return frames


def write_shape_task(
    out_dir: str | Path,
    *,
    n_train: int = 512,
    n_eval: int = 64,
    seed: int = 0,
    holdout: tuple[tuple[str, str], ...] | list = (),
    video: bool = False,
) -> dict[str, Path]:
    """Write ``train.jsonl`` (without the held-out combinations) and ``eval.jsonl`` (all
    combinations, so held-out ones measure generalisation) of prompt records. With
    ``video`` the records are moving-shape prompts. Returns {"train": path, "eval": path}."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    make = motion_records if video else shape_records
    splits = {"train": make(n_train, seed, holdout), "eval": make(n_eval, seed + 1)}
    paths = {}
    for name, recs in splits.items():
        path = out / f"{name}.jsonl"
        with path.open("w") as f:
            for rec in recs:
                f.write(json.dumps(rec) + "\n")
        paths[name] = path
    return paths
