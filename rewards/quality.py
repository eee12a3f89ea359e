"""Sample-quality checks for generated images and clips: texture a reward cannot see.

A policy trained against a reward can grow patterns the reward does not look at (a grid
texture over the background, checker noise in clips) or the judge even pays for. These
checks measure that drift so it shows next to the rewards: the high-frequency energy of
the background and of the object, as the mean absolute 4-neighbour Laplacian of the grey
image (values in [0, 1]), each over its own pixels.

The regions come from :func:`mmyatt.rewards.image.foreground_mask` (bright, saturated
pixels of the shape task): the background is what lies at least two pixels away from
any foreground pixel, the object what lies at least one pixel inside it, so the shape's
own edges count in neither. A clean drawn shape scores 0 on its background; the
engine reports these figures for every eval and the summary compares the last eval's
against the base model's (step 0), e.g. a background ratio of 3 means three times the
base's high-frequency energy.

>>> from mmyatt.datasets.shapes import draw_shape
>>> round(texture(draw_shape("red", "circle", rng=0))["background_hf"], 6)
0.0
"""

from __future__ import annotations

from typing import Any

import numpy as np
from PIL import Image

from mmyatt.rewards.image import _frames, foreground_mask

__all__ = ["laplacian_energy", "texture", "texture_metrics"]


def laplacian_energy(grey: np.ndarray) -> np.ndarray:
    """(H-2, W-2) absolute 4-neighbour Laplacian of an (H, W) float image (interior)."""
    g = grey
    return np.abs(4 * g[1:-1, 1:-1] - g[:-2, 1:-1] - g[2:, 1:-1] - g[1:-1, :-2] - g[1:-1, 2:])


def _dilate(mask: np.ndarray, steps: int) -> np.ndarray:
    for _ in range(steps):
        p = np.pad(mask, 1)
        mask = (
            p[1:-1, 1:-1]
            | p[:-2, 1:-1]
            | p[2:, 1:-1]
            | p[1:-1, :-2]
            | p[1:-1, 2:]
            | p[:-2, :-2]
            | p[:-2, 2:]
            | p[2:, :-2]
            | p[2:, 2:]
        )
    return mask


def _frame_texture(img: Image.Image) -> tuple[float, float, int, int]:
    """(background sum, object sum, background pixels, object pixels) of one frame."""
    rgb = img.convert("RGB")
    grey = np.asarray(rgb.convert("L"), dtype=np.float64) / 255.0
    lap = laplacian_energy(grey)
    fg = foreground_mask(rgb)
    background = ~_dilate(fg, 2)[1:-1, 1:-1]
    inside = ~_dilate(~fg, 1)[1:-1, 1:-1]
    return (
        float(lap[background].sum()),
        float(lap[inside].sum()),
        int(background.sum()),
        int(inside.sum()),
    )


def texture(output: Any) -> dict[str, float]:
    """{"background_hf", "object_hf"} of an image or a list of frames: mean absolute
    Laplacian over the background (resp. object) pixels of all frames; NaN where a
    region is empty (e.g. nothing drawn: no object pixels)."""
    b_sum, o_sum, b_n, o_n = (sum(v) for v in zip(*map(_frame_texture, _frames(output))))
    return {
        "background_hf": b_sum / b_n if b_n else float("nan"),
        "object_hf": o_sum / o_n if o_n else float("nan"),
    }


def texture_metrics(outputs: list) -> dict[str, tuple[float, int]]:
    """Sums and counts of :func:`texture` over many outputs, for an all-reduce:
    {"background_hf": (sum, n), "object_hf": (sum, n)}; NaN outputs are not counted."""
    out = {"background_hf": [0.0, 0], "object_hf": [0.0, 0]}
    for o in outputs:
        for k, v in texture(o).items():
            if np.isfinite(v):
                out[k][0] += v
                out[k][1] += 1
    return {k: (s, n) for k, (s, n) in out.items()}
