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
    "HELDOUT",
    "HELDOUT_TEST",
    "HELDOUT_VAL",
    "MOTION_HELDOUT",
    "MOTION_HELDOUT_TEST",
    "MOTION_HELDOUT_VAL",
    "is_heldout",
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
# Combinations no RL training and no stage of the built-in judge's training ever sees.
# TEST is what README and BENCHMARKS report; VAL is where recipes and judges are chosen
# (its own prompts, combinations and seeds). Every colour and every shape still appears
# in training (each colour with two shapes, each shape with four colours), so a held-out
# caption is a new combination of known words.
HELDOUT_TEST: tuple[tuple[str, str], ...] = (
    ("red", "square"),
    ("green", "triangle"),
    ("blue", "circle"),
)
HELDOUT_VAL: tuple[tuple[str, str], ...] = (
    ("yellow", "circle"),
    ("cyan", "triangle"),
    ("purple", "square"),
)
HELDOUT = HELDOUT_TEST + HELDOUT_VAL
# Video: (colour, shape, direction) triples out of 72; every pair and every direction
# still appears in training.
MOTION_HELDOUT_TEST: tuple[tuple[str, str, str], ...] = (
    ("red", "square", "left"),
    ("green", "triangle", "up"),
    ("blue", "circle", "right"),
    ("yellow", "square", "down"),
    ("cyan", "circle", "left"),
    ("purple", "triangle", "right"),
)
MOTION_HELDOUT_VAL: tuple[tuple[str, str, str], ...] = (
    ("red", "circle", "down"),
    ("green", "square", "right"),
    ("blue", "triangle", "left"),
    ("yellow", "triangle", "up"),
    ("cyan", "square", "up"),
    ("purple", "circle", "down"),
)
MOTION_HELDOUT = MOTION_HELDOUT_TEST + MOTION_HELDOUT_VAL
BACKGROUND = (24, 24, 32)  # plain dark background: foreground = bright, saturated pixels
SUPERSAMPLE = 4  # draw at 4x and box-downsample: smooth edges, exact fill ratios


def _rng(rng: np.random.Generator | int | None) -> np.random.Generator:
    return rng if isinstance(rng, np.random.Generator) else np.random.default_rng(rng)


def _check(colour: str | None, shape: str) -> None:
    """A palette colour (None: not a palette name, nothing to check) and a shape."""
    if colour is not None and colour not in COLOURS:
        raise ValueError(f"unknown colour {colour!r}; expected one of {list(COLOURS)}")
    if shape not in SHAPES:
        raise ValueError(f"unknown shape {shape!r}; expected one of {list(SHAPES)}")


def paint_shape(
    draw: ImageDraw.ImageDraw, shape: str, cx: float, cy: float, r: float, fill
) -> None:
    """A shape of half-extent r centred at (cx, cy), axis-aligned: its bounding-box fill
    ratio is 1 for a square, pi/4 for a circle and 1/2 for the triangle."""
    box = [cx - r, cy - r, cx + r, cy + r]
    if shape == "circle":
        draw.ellipse(box, fill=fill)
    elif shape == "square":
        draw.rectangle(box, fill=fill)
    else:  # isosceles, apex up, as tall as it is wide
        draw.polygon([(cx, cy - r), (cx + r, cy + r), (cx - r, cy + r)], fill=fill)


def _render(
    colour: str | tuple[int, int, int], shape: str, size: int, cx: float, cy: float, r: float
) -> Image.Image:
    """``colour``: a palette name or an RGB triple."""
    k = SUPERSAMPLE
    img = Image.new("RGB", (size * k, size * k), BACKGROUND)
    fill = COLOURS[colour] if isinstance(colour, str) else tuple(colour)
    paint_shape(ImageDraw.Draw(img), shape, cx * k, cy * k, r * k, fill)
    return img.resize((size, size), Image.BOX)


def draw_shape(
    colour: str | tuple[int, int, int],
    shape: str,
    *,
    size: int = 32,
    rng: np.random.Generator | int | None = None,
    jitter: float = 0.15,
    radius: tuple[float, float] = (0.24, 0.34),
) -> Image.Image:
    """A ``size`` x ``size`` RGB image of one solid shape on the dark background.

    ``colour`` is a palette name or an RGB triple (e.g. grey). The half-extent is drawn
    from ``radius`` (fractions of the image; default 24-34%); the centre moves by up to
    ``jitter`` x size from the middle on each axis (clamped so the shape stays inside
    the frame). Modest jitter keeps the caption -> image map learnable by a tiny model in
    minutes on a CPU.
    """
    _check(colour if isinstance(colour, str) else None, shape)
    g = _rng(rng)
    r = size * g.uniform(*radius)
    reach = max(0.0, min(size * jitter, size / 2 - r - 1.0))
    cx, cy = size / 2 + g.uniform(-reach, reach, size=2)
    return _render(colour, shape, size, cx, cy, r)


def shape_caption(colour: str, shape: str) -> str:
    """The prompt for one colour and shape.

    >>> shape_caption("red", "circle")
    'a red circle'
    """
    _check(colour, shape)
    return f"a {colour} {shape}"


def motion_caption(colour: str, shape: str, direction: str) -> str:
    """The prompt for a moving shape.

    >>> motion_caption("red", "square", "right")
    'a red square moving right'
    """
    if direction not in DIRECTIONS:
        raise ValueError(f"unknown direction {direction!r}; expected one of {list(DIRECTIONS)}")
    return f"{shape_caption(colour, shape)} moving {direction}"


def is_heldout(combo: tuple[str, ...], holdout) -> bool:
    """True if ``combo`` ((colour, shape) or (colour, shape, direction)) matches an entry
    of ``holdout``: a pair holds out every direction of that colour and shape."""
    for h in holdout:
        h = tuple(h)
        if tuple(combo[: len(h)]) == h:
            return True
    return False


def _combos(colours, shapes, holdout, directions=None, only=None) -> list[tuple[str, ...]]:
    if only is not None:
        combos = [tuple(c) for c in only]
    elif directions is None:
        combos = [(c, s) for c in colours for s in shapes]
    else:
        combos = [(c, s, d) for c in colours for s in shapes for d in directions]
    combos = [c for c in combos if not is_heldout(c, holdout)]
    for c in combos:
        _check(c[0], c[1])
        if len(c) > 2 and c[2] not in DIRECTIONS:
            raise ValueError(f"unknown direction {c[2]!r}; expected one of {list(DIRECTIONS)}")
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
    only: tuple[tuple[str, str], ...] | list | None = None,
) -> list[dict]:
    """``n`` prompt records {"prompt", "colour", "shape", "id"}, combinations drawn
    uniformly from colours x shapes minus the ``holdout`` pairs, or round-robin over
    ``only``."""
    combos = _combos(colours, shapes, holdout, only=only)
    g = np.random.default_rng(seed)
    out = []
    for i in range(n):  # ``only``: round-robin, so every listed combination is equally common
        pick = i % len(combos) if only is not None else int(g.integers(len(combos)))
        c, s = combos[pick][:2]
        out.append(
            {"prompt": shape_caption(c, s), "colour": c, "shape": s, "id": f"shape-{seed}-{i}"}
        )
    return out


def motion_records(
    n: int,
    seed: int,
    holdout: tuple[tuple[str, ...], ...] | list = (),
    *,
    colours: tuple[str, ...] | list[str] = tuple(COLOURS),
    shapes: tuple[str, ...] | list[str] = SHAPES,
    directions: tuple[str, ...] | list[str] = tuple(DIRECTIONS),
    only: tuple[tuple[str, str, str], ...] | list | None = None,
) -> list[dict]:
    """Like ``shape_records`` with a "direction" and captions "a red square moving right";
    combinations are (colour, shape, direction) triples, uniform over colours x shapes x
    directions (or ``only``) minus ``holdout`` (triples, or pairs for every direction)."""
    combos = _combos(colours, shapes, holdout, directions=directions, only=only)
    g = np.random.default_rng(seed)
    out = []
    for i in range(n):
        pick = i % len(combos) if only is not None else int(g.integers(len(combos)))
        c, s, d = combos[pick]
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
    colour: str | tuple[int, int, int],
    shape: str,
    direction: str,
    num_frames: int = 8,
    size: int = 32,
    rng: np.random.Generator | int | None = None,
) -> list[Image.Image]:
    """``num_frames`` frames of a shape moving in a straight line in ``direction``.

    ``colour`` is a palette name or an RGB triple. Half-extent 15-22% of the frame; the
    shape travels 35-50% of the frame over the clip and stays fully inside it.
    """
    _check(colour if isinstance(colour, str) else None, shape)
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


def mix_eval_split(heldout: list[dict], seen: list[dict]) -> list[dict]:
    """An eval split's order: two held-out records, then one seen, the rest of the seen
    ones at the end (so a short eval prefix holds both kinds)."""
    mixed, j = [], 0
    for i, r in enumerate(heldout):
        mixed.append(r)
        if i % 2 == 1 and j < len(seen):
            mixed.append(seen[j])
            j += 1
    return mixed + seen[j:]


def write_splits(out: Path, splits: dict[str, list[dict]]) -> dict[str, Path]:
    """Each split as ``out/<name>.jsonl``, one record per line; returns the paths."""
    paths = {}
    for name, recs in splits.items():
        path = out / f"{name}.jsonl"
        with path.open("w") as f:
            for rec in recs:
                f.write(json.dumps(rec) + "\n")
        paths[name] = path
    return paths


def write_shape_task(
    out_dir: str | Path,
    *,
    n_train: int = 512,
    n_eval: int = 64,
    seed: int = 0,
    video: bool = False,
    heldout_test: tuple | list | None = None,
    heldout_val: tuple | list | None = None,
) -> dict[str, Path]:
    """Write the splits of the text-to-image (``video``: text-to-video) task:

    * ``train.jsonl``: ``n_train`` records over every combination except the held-out
      ones of both eval splits;
    * ``test.jsonl``: ``n_eval`` records of the ``heldout_test`` combinations
      ("split": "heldout") and ``n_eval // 2`` of training combinations ("split": "seen"),
      interleaved; the split README and BENCHMARKS report;
    * ``val.jsonl``: the same for ``heldout_val``, from other seeds: the split recipes and
      judges are chosen on.

    Defaults: :data:`HELDOUT_TEST` / :data:`HELDOUT_VAL` (images) or the MOTION_ ones.
    Returns {"train", "test", "val"} paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    make = motion_records if video else shape_records
    if heldout_test is None:
        heldout_test = MOTION_HELDOUT_TEST if video else HELDOUT_TEST
    if heldout_val is None:
        heldout_val = MOTION_HELDOUT_VAL if video else HELDOUT_VAL
    held = tuple(heldout_test) + tuple(heldout_val)
    splits = {"train": make(n_train, seed, held)}
    for k, (name, combos) in enumerate((("test", heldout_test), ("val", heldout_val))):
        base = seed + 1 + 2 * k
        heldout = [{**r, "split": "heldout"} for r in make(n_eval, base, only=combos)]
        seen = [{**r, "split": "seen"} for r in make(n_eval // 2, base + 1, held)]
        splits[name] = mix_eval_split(heldout, seen)
    return write_splits(out, splits)
