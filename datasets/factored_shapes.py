"""Judge data in which colour and shape vary independently, far beyond the task's palette.

The flow recipes' judge must say whether an image shows "a red square" for colour x
shape combinations it never saw (``shapes.HELDOUT``). Trained only on the task's twelve
remaining combinations, a tiny vision tower learns features of whole combinations: it
does not recognise a red square as a square (models/builtin/tiny_judge/README.md). This
module draws the records that make colour and shape separate features without showing
any task combination the judge must not see:

* **off-palette colours** (:func:`off_palette_colour`): hues at least
  ``OFF_PALETTE_MARGIN`` degrees from every palette hue, random saturation and value, and
  greys. A square in orange is no (palette colour, shape) combination, so shape
  questions about task shapes in such colours teach shape apart from colour;
* **extra shapes** (``EXTRA_SHAPES``: diamond, pentagon, hexagon, cross, star), drawn in
  palette colours: colour questions about them teach colour apart from shape, and they
  are negatives for every task shape;
* the task's own records of trained combinations (``vision_tasks``), as before.

No record shows or asks about a combination in ``exclude``; every record is seeded.
"""

from __future__ import annotations

import colorsys
import math

import numpy as np
from PIL import Image, ImageDraw

from .shapes import BACKGROUND, COLOURS, SHAPES, draw_shape, is_heldout
from .vision_tasks import (
    COLOUR_CHECK,
    COLOUR_QUESTION,
    IMAGE_SIZE,
    JITTER,
    JUDGE_QUESTION,
    SHAPE_CHECK,
    SHAPE_QUESTION,
    draw,
    other_value,
)

# Colours outside the policy's palette that only the judge's training draws, with every
# shape: with more (colour, shape) pairs than it can memorise one by one, the judge has
# to read colour and shape apart, which is what a held-out pair asks of it.
EXTRA_COLOURS: dict[str, tuple[int, int, int]] = {
    "orange": (240, 140, 30),
    "pink": (240, 130, 200),
    "white": (230, 230, 230),
    "brown": (150, 95, 45),
}
EXTRA_SHAPES: tuple[str, ...] = ("diamond", "pentagon", "hexagon", "cross", "star")
OFF_PALETTE_MARGIN = 24.0  # degrees of hue kept clear around every palette colour
_SUPERSAMPLE = 4


def _hue(rgb: tuple[int, int, int]) -> float:
    return 360.0 * colorsys.rgb_to_hsv(*(c / 255 for c in rgb))[0]


PALETTE_HUES: dict[str, float] = {name: _hue(rgb) for name, rgb in COLOURS.items()}


def _hue_gap(a: float, b: float) -> float:
    d = abs(a - b) % 360.0
    return min(d, 360.0 - d)


def off_palette_colour(
    rng: np.random.Generator, grey_fraction: float = 0.2
) -> tuple[int, int, int]:
    """An RGB colour that names no palette colour: a grey (``grey_fraction`` of draws) or
    a hue at least ``OFF_PALETTE_MARGIN`` degrees from every palette hue.

    >>> rng = np.random.default_rng(0)  # (8-bit rounding moves a hue by under a degree)
    >>> all(min(_hue_gap(_hue(c), h) for h in PALETTE_HUES.values()) >= OFF_PALETTE_MARGIN - 1
    ...     for c in (off_palette_colour(rng, 0.0) for _ in range(200)))
    True
    """
    if rng.random() < grey_fraction:
        v = int(rng.integers(120, 246))
        return (v, v, v)
    while True:
        h = float(rng.uniform(0.0, 360.0))
        if min(_hue_gap(h, p) for p in PALETTE_HUES.values()) >= OFF_PALETTE_MARGIN:
            break
    s, v = float(rng.uniform(0.55, 0.85)), float(rng.uniform(0.75, 0.92))
    r, g, b = colorsys.hsv_to_rgb(h / 360.0, s, v)
    return (int(round(255 * r)), int(round(255 * g)), int(round(255 * b)))


def _polygon(cx: float, cy: float, r: float, n: int, start: float = -math.pi / 2):
    return [
        (
            cx + r * math.cos(start + 2 * math.pi * k / n),
            cy + r * math.sin(start + 2 * math.pi * k / n),
        )
        for k in range(n)
    ]


def draw_extra(
    colour: str | tuple[int, int, int],
    shape: str,
    *,
    size: int,
    rng: np.random.Generator,
    jitter: float = JITTER,
    radius: tuple[float, float] = (0.24, 0.34),
) -> Image.Image:
    """One of ``EXTRA_SHAPES`` drawn as ``shapes.draw_shape`` draws the task's shapes
    (same background, size and position jitter, supersampled)."""
    if shape not in EXTRA_SHAPES:
        raise ValueError(f"unknown extra shape {shape!r}; expected one of {EXTRA_SHAPES}")
    fill = COLOURS[colour] if isinstance(colour, str) else tuple(colour)
    r = size * rng.uniform(*radius)
    reach = max(0.0, min(size * jitter, size / 2 - r - 1.0))
    cx, cy = size / 2 + rng.uniform(-reach, reach, size=2)
    k = _SUPERSAMPLE
    img = Image.new("RGB", (size * k, size * k), BACKGROUND)
    d = ImageDraw.Draw(img)
    cx, cy, r = cx * k, cy * k, r * k
    if shape == "diamond":
        d.polygon(_polygon(cx, cy, r, 4), fill=fill)
    elif shape == "pentagon":
        d.polygon(_polygon(cx, cy, r, 5), fill=fill)
    elif shape == "hexagon":
        d.polygon(_polygon(cx, cy, r, 6, start=0.0), fill=fill)
    elif shape == "cross":
        w = r / 3
        d.rectangle([cx - r, cy - w, cx + r, cy + w], fill=fill)
        d.rectangle([cx - w, cy - r, cx + w, cy + r], fill=fill)
    else:  # five-pointed star
        pts = []
        for j in range(10):
            rad = r if j % 2 == 0 else r * 0.45
            a = -math.pi / 2 + math.pi * j / 5
            pts.append((cx + rad * math.cos(a), cy + rad * math.sin(a)))
        d.polygon(pts, fill=fill)
    return img.resize((size, size), Image.BOX)


def _size(rng: np.random.Generator, sizes: tuple[int, ...]) -> int:
    return sizes[int(rng.integers(len(sizes)))] if len(sizes) > 1 else sizes[0]


def _record(i, seed, prompt, image, answer, task, colour, shape, **extra) -> dict:
    return {
        "id": f"f{seed}-{i}",
        "prompt": prompt,
        "image": image,
        "answer": answer,
        "task": task,
        "colour": colour,
        "shape": shape,
        **extra,
    }


def factored_records(
    n: int, *, seed: int, sizes: tuple[int, ...] = (IMAGE_SIZE,), exclude=()
) -> list[dict]:
    """``n`` records cycling through six kinds (``task`` says which):

    * ``off_shape``: "What shape is it?" about a task shape in an off-palette colour;
    * ``off_check_shape``: "Is it a {shape}?" about the same (half true);
    * ``extra_colour``: "What colour is the shape?" about an extra shape in a palette colour;
    * ``extra_check_colour``: "Is the shape {colour}?" about the same (half true);
    * ``extra_judge``: "Does this image show a {colour} {shape}?" about an extra shape,
      the claimed colour its own or another, the claimed shape a task shape: always No;
    * ``off_judge``: the judge question about a task shape in an off-palette colour,
      claiming a palette colour and the true or another task shape: always No.

    Claims never name a combination in ``exclude``; images show none (off-palette
    colours and extra shapes are no task combination)."""
    rng = np.random.default_rng([seed, 11])
    colours = list(COLOURS)
    kinds = (
        "off_shape",
        "off_check_shape",
        "extra_colour",
        "extra_check_colour",
        "extra_judge",
        "off_judge",
    )
    out = []
    for i in range(n):
        kind = kinds[i % len(kinds)]
        size = _size(rng, sizes)
        if kind.startswith("off"):
            shape = SHAPES[int(rng.integers(len(SHAPES)))]
            image = draw_shape(off_palette_colour(rng), shape, size=size, rng=rng, jitter=JITTER)
            if kind == "off_shape":
                out.append(_record(i, seed, SHAPE_QUESTION, image, shape, kind, None, shape))
            elif kind == "off_check_shape":
                true = bool(rng.random() < 0.5)
                claim = shape if true else other_value(list(SHAPES), shape, rng)
                out.append(
                    _record(
                        i,
                        seed,
                        SHAPE_CHECK.format(shape=claim),
                        image,
                        "Yes" if true else "No",
                        kind,
                        None,
                        shape,
                    )
                )
            else:
                out.append(
                    _claim_no(
                        i,
                        seed,
                        image,
                        kind,
                        (None, shape),
                        lambda shape=shape: (
                            colours[int(rng.integers(len(colours)))],
                            shape if rng.random() < 0.5 else other_value(list(SHAPES), shape, rng),
                        ),
                        exclude,
                    )
                )
        else:
            shape = EXTRA_SHAPES[int(rng.integers(len(EXTRA_SHAPES)))]
            colour = colours[int(rng.integers(len(colours)))]
            image = draw_extra(colour, shape, size=size, rng=rng)
            if kind == "extra_colour":
                out.append(_record(i, seed, COLOUR_QUESTION, image, colour, kind, colour, shape))
            elif kind == "extra_check_colour":
                true = bool(rng.random() < 0.5)
                claim = colour if true else other_value(colours, colour, rng)
                out.append(
                    _record(
                        i,
                        seed,
                        COLOUR_CHECK.format(colour=claim),
                        image,
                        "Yes" if true else "No",
                        kind,
                        colour,
                        shape,
                    )
                )
            else:
                out.append(
                    _claim_no(
                        i,
                        seed,
                        image,
                        kind,
                        (colour, shape),
                        lambda colour=colour: (
                            colour if rng.random() < 0.5 else other_value(colours, colour, rng),
                            SHAPES[int(rng.integers(len(SHAPES)))],
                        ),
                        exclude,
                    )
                )
    return out


def _claim_no(i, seed, image, kind, truth, draw_claim, exclude) -> dict:
    """The judge question about ``image`` for a (colour, shape) claim drawn by
    ``draw_claim`` (redrawn while it names a combination in ``exclude``), answered No:
    the image shows an off-palette colour or an extra shape, which no claim names."""
    while True:
        c, s = draw_claim()
        if not is_heldout((c, s), exclude):
            break
    colour, shape = truth
    wrong = "shape" if c == colour else "colour" if s == shape else "both"
    return _record(
        i,
        seed,
        JUDGE_QUESTION.format(colour=c, shape=s),
        image,
        "No",
        kind,
        colour,
        shape,
        negative_type=wrong,
    )


def heldout_classification_records(
    n: int, *, seed: int, combos, sizes: tuple[int, ...] = (IMAGE_SIZE,)
) -> list[dict]:
    """Colour and shape questions (alternating) about images of ``combos`` only: does a
    judge that never saw them read each attribute of them?"""
    rng = np.random.default_rng([seed, 12])
    combos = [tuple(c[:2]) for c in combos]
    out = []
    for i in range(n):
        colour, shape = combos[int(rng.integers(len(combos)))]
        task = ("colour", "shape")[i % 2]
        out.append(
            _record(
                i,
                seed,
                COLOUR_QUESTION if task == "colour" else SHAPE_QUESTION,
                draw(colour, shape, rng, sizes),
                colour if task == "colour" else shape,
                task,
                colour,
                shape,
            )
        )
    return out


def named_colours() -> dict[str, tuple[int, int, int]]:
    """The palette plus the judge-only named colours (:data:`EXTRA_COLOURS`)."""
    return {**COLOURS, **EXTRA_COLOURS}


def draw_any(
    colour: str, shape: str, rng: np.random.Generator, sizes: tuple[int, ...]
) -> Image.Image:
    """A named colour (palette or extra) on a task shape or an extra shape."""
    rgb = named_colours()[colour]
    size = _size(rng, sizes)
    if shape in EXTRA_SHAPES:
        return draw_extra(rgb, shape, size=size, rng=rng)
    return draw_shape(rgb, shape, size=size, rng=rng, jitter=JITTER)


def named_records(
    n: int, *, seed: int, sizes: tuple[int, ...] = (IMAGE_SIZE,), exclude=()
) -> list[dict]:
    """Records over every named colour (palette + extra) x every shape (task + extra):
    80 combinations, of which only the task's held-out pairs in ``exclude`` are never
    shown or named. Cycling: "What colour is the shape?", "What shape is it?", and the
    judge question ("Does this image show a {colour} {shape}?", half true; negatives
    wrong colour / shape / both). With this many combinations the judge cannot learn
    them one by one, so it has to check colour and shape apart."""
    rng = np.random.default_rng([seed, 15])
    colours = list(named_colours())
    shapes = [*SHAPES, *EXTRA_SHAPES]
    out = []
    for i in range(n):
        while True:
            colour = colours[int(rng.integers(len(colours)))]
            shape = shapes[int(rng.integers(len(shapes)))]
            if not is_heldout((colour, shape), exclude):
                break
        image = draw_any(colour, shape, rng, sizes)
        kind = ("colour", "shape", "judge")[i % 3]
        if kind == "colour":
            out.append(
                _record(i, seed, COLOUR_QUESTION, image, colour, "named_colour", colour, shape)
            )
        elif kind == "shape":
            out.append(_record(i, seed, SHAPE_QUESTION, image, shape, "named_shape", colour, shape))
        else:
            neg = (
                (None, "colour", "shape", "both")[int(rng.integers(4))]
                if rng.random() < 0.5
                else None
            )
            while True:
                c = colour if neg in (None, "shape") else other_value(colours, colour, rng)
                s = shape if neg in (None, "colour") else other_value(shapes, shape, rng)
                if not is_heldout((c, s), exclude):
                    break
            out.append(
                _record(
                    i,
                    seed,
                    JUDGE_QUESTION.format(colour=c, shape=s),
                    image,
                    "No" if neg else "Yes",
                    "named_judge",
                    colour,
                    shape,
                    negative_type=neg,
                )
            )
    return out


def corpus() -> list[str]:
    """The words the named records add to a judge's tokenizer corpus."""
    words = [*EXTRA_COLOURS, *EXTRA_SHAPES]
    return [
        JUDGE_QUESTION.format(colour=c, shape=s)
        for c in named_colours()
        for s in [*SHAPES, *EXTRA_SHAPES]
    ] + words
