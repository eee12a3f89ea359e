"""Rule rewards for generated images and clips.

Each reward is a plain function ``fn(output, record, **kw) -> float`` where ``output`` is
a PIL image or, for video, a list of PIL frames (image rewards then average over the
frames). ``record`` is the manifest record the sample answers; the shape rules read its
"colour", "shape" and "direction" keys, or find those words in ``record["prompt"]``.

The colour/shape rules assume the synthetic task of ``mmyatt.datasets.shapes``: one
saturated shape on a dark, unsaturated background. They are exact enough to serve as
ground truth when checking a learned judge (GenRM) for reward hacking.
"""

from __future__ import annotations

import functools
import importlib.util
import io
import math
import sys
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from mmyatt.datasets.shapes import COLOURS, DIRECTIONS, SHAPES
from mmyatt.rewards.latent import reads_latents

__all__ = [
    "IMAGE_REWARDS",
    "brightness",
    "classify_shape",
    "colour_match",
    "foreground_mask",
    "geneval_rule",
    "jpeg_compressibility",
    "jpeg_incompressibility",
    "latent_brightness",
    "load_scorer",
    "motion_direction",
    "prompt_alignment_rule",
    "reads_latents",
    "shape_fill",
    "shape_match",
]

Output = Any  # a PIL image, or a list of PIL frames

_MAX_SIDE = 64  # the blob rules run on images downscaled to at most this side
_MIN_FOREGROUND = 0.01  # fewer foreground pixels than this fraction: "nothing drawn"
# Bounding-box fill ratio of the dominant blob: square 1, circle pi/4, triangle 1/2; the
# class boundaries sit between those values (checked on rendered samples in the tests).
_SQUARE_ABOVE, _TRIANGLE_BELOW = 0.89, 0.65


def _frames(output: Output) -> list[Image.Image]:
    if isinstance(output, Image.Image):
        return [output]
    if (
        isinstance(output, list | tuple)
        and output
        and all(isinstance(f, Image.Image) for f in output)
    ):
        return list(output)
    raise TypeError(f"expected a PIL image or a list of PIL frames, got {type(output).__name__}")


def _per_frame(fn: Callable[[Image.Image], float], output: Output) -> float:
    frames = _frames(output)
    return float(sum(fn(f) for f in frames) / len(frames))


def _target(record: dict | None, key: str, choices) -> str:
    """record[key], or the first word of record["prompt"] among ``choices``."""
    record = record or {}
    if key in record:
        value = str(record[key]).lower()
    else:
        words = str(record.get("prompt", "")).lower().replace(",", " ").split()
        value = next((w for w in words if w in choices), "")
    if value not in choices:
        raise KeyError(f"record has no {key!r} among {sorted(choices)}: {record}")
    return value


# --- JPEG (DDPO) ---------------------------------------------------------------------------
def _jpeg_bytes(img: Image.Image, quality: int = 95) -> int:
    buf = io.BytesIO()
    img.convert("RGB").save(buf, format="JPEG", quality=quality)
    return buf.tell()


@functools.lru_cache(maxsize=64)
def _jpeg_range(width: int, height: int, quality: int) -> tuple[int, int]:
    """JPEG sizes of a flat image and of uniform noise of this size: the floor (mostly
    header) and a practical ceiling."""
    flat = Image.new("RGB", (width, height), (128, 128, 128))
    rng = np.random.default_rng(0)
    noise = Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))
    return _jpeg_bytes(flat, quality), _jpeg_bytes(noise, quality)


def _incompressibility(img: Image.Image, quality: int) -> float:
    lo, hi = _jpeg_range(img.width, img.height, quality)
    return float(np.clip((_jpeg_bytes(img, quality) - lo) / (hi - lo), 0.0, 1.0))


def jpeg_incompressibility(
    output: Output, record: dict | None = None, *, quality: int = 95
) -> float:
    """DDPO's incompressibility: the JPEG size (quality 95), scaled into [0, 1].

    DDPO rewards +size in kB, which depends on resolution and, for small images, is
    mostly the ~0.6 kB JPEG header. Here the size is mapped linearly between a flat image
    of the same size (0) and uniform RGB noise (1), clipped: an affine, monotone
    transform of DDPO's reward for a fixed resolution, comparable across resolutions.

    >>> jpeg_incompressibility(Image.new("RGB", (32, 32), (128, 128, 128)), {})
    0.0
    """
    return _per_frame(lambda f: _incompressibility(f, quality), output)


def jpeg_compressibility(output: Output, record: dict | None = None, *, quality: int = 95) -> float:
    """DDPO's compressibility (-size in kB), scaled as 1 - ``jpeg_incompressibility``.

    >>> jpeg_compressibility(Image.new("RGB", (32, 32), (128, 128, 128)), {})
    1.0
    """
    return _per_frame(lambda f: 1.0 - _incompressibility(f, quality), output)


def brightness(output: Output, record: dict | None = None) -> float:
    """Mean luma (ITU-R 601, PIL "L") in [0, 1].

    >>> brightness(Image.new("RGB", (4, 4), (255, 255, 255)), {})
    1.0
    """
    return _per_frame(
        lambda f: float(np.asarray(f.convert("L"), dtype=np.float64).mean() / 255.0), output
    )


# --- colour and shape rules -----------------------------------------------------------------
def _small(img: Image.Image) -> Image.Image:
    img = img.convert("RGB")
    if max(img.size) > _MAX_SIDE:
        scale = _MAX_SIDE / max(img.size)
        img = img.resize(
            (max(1, round(img.width * scale)), max(1, round(img.height * scale))), Image.BOX
        )
    return img


def _hsv(img: Image.Image) -> np.ndarray:
    """(H, W, 3) float HSV: hue in degrees, saturation and value in [0, 1]."""
    hsv = np.asarray(img.convert("HSV"), dtype=np.float64)
    return np.stack([hsv[..., 0] * (360.0 / 256.0), hsv[..., 1] / 255.0, hsv[..., 2] / 255.0], -1)


def foreground_mask(img: Image.Image) -> np.ndarray:
    """(H, W) bool: saturated, bright pixels. The background of the shape task is dark
    and grey; a pixel half covered by a shape still passes, a quarter covered does not."""
    hsv = _hsv(img)
    return (hsv[..., 1] > 0.4) & (hsv[..., 2] > 0.35)


def _hue_of(rgb: tuple[int, int, int]) -> float:
    return _hsv(Image.new("RGB", (1, 1), rgb))[0, 0, 0]


_PALETTE_HUES = {name: _hue_of(rgb) for name, rgb in COLOURS.items()}


def _nearest_colour(hue: np.ndarray) -> np.ndarray:
    names = list(_PALETTE_HUES)
    ref = np.array([_PALETTE_HUES[n] for n in names])
    d = np.abs(hue[..., None] - ref)
    d = np.minimum(d, 360.0 - d)  # hue is circular
    return np.array(names)[d.argmin(-1)]


def _colour_score(img: Image.Image, colour: str) -> float:
    img = _small(img)
    fg = foreground_mask(img)
    if fg.mean() < _MIN_FOREGROUND:
        return 0.0
    names = _nearest_colour(_hsv(img)[..., 0][fg])
    return float((names == colour).mean())


def colour_match(output: Output, record: dict) -> float:
    """Fraction of foreground pixels whose hue is nearest to the record's colour among the
    palette ``COLOURS`` (0 if almost nothing is drawn), in [0, 1]."""
    colour = _target(record, "colour", COLOURS)
    return _per_frame(lambda f: _colour_score(f, colour), output)


def _largest_blob(mask: np.ndarray) -> np.ndarray:
    """(H, W) bool of the largest 4-connected component of ``mask`` (empty if none)."""
    h, w = mask.shape
    seen = np.zeros_like(mask)
    best: list[tuple[int, int]] = []
    for y0, x0 in zip(*np.nonzero(mask)):
        if seen[y0, x0]:
            continue
        seen[y0, x0] = True
        comp, queue = [], deque([(y0, x0)])
        while queue:
            y, x = queue.popleft()
            comp.append((y, x))
            for ny, nx in ((y - 1, x), (y + 1, x), (y, x - 1), (y, x + 1)):
                if 0 <= ny < h and 0 <= nx < w and mask[ny, nx] and not seen[ny, nx]:
                    seen[ny, nx] = True
                    queue.append((ny, nx))
        if len(comp) > len(best):
            best = comp
    out = np.zeros_like(mask)
    if best:
        ys, xs = zip(*best)
        out[list(ys), list(xs)] = True
    return out


def _open(mask: np.ndarray) -> np.ndarray:
    """Binary opening with a 3x3 cross: erase one-pixel spurs and specks, which a
    generated blob's ragged rim has and which would inflate its bounding box."""
    p = np.pad(mask, 1)
    core = p[1:-1, 1:-1] & p[:-2, 1:-1] & p[2:, 1:-1] & p[1:-1, :-2] & p[1:-1, 2:]
    q = np.pad(core, 1)
    return q[1:-1, 1:-1] | q[:-2, 1:-1] | q[2:, 1:-1] | q[1:-1, :-2] | q[1:-1, 2:]


def classify_shape(img: Image.Image) -> str | None:
    """ "circle", "square" or "triangle" for the dominant foreground blob, by the fraction
    of its bounding box it fills (square ~1, circle ~pi/4, triangle ~1/2) after a 3x3
    opening; None if nothing (or under 1% of the image) is drawn, or if the blob touches
    the edge of the image: a shape cut off by the frame is not a whole shape, and a
    colour filling the frame would otherwise pass as a square (a policy trained on this
    rule learned exactly that)."""
    fill = shape_fill(img)
    if fill is None:
        return None
    if fill >= _SQUARE_ABOVE:
        return "square"
    return "circle" if fill >= _TRIANGLE_BELOW else "triangle"


def shape_fill(img: Image.Image) -> float | None:
    """The fraction of its bounding box that the dominant foreground blob fills, after a
    3x3 opening: what :func:`classify_shape` thresholds. None where it returns None."""
    mask = foreground_mask(_small(img))
    opened = _open(mask)
    blob = _largest_blob(opened if opened.any() else mask)  # tiny shapes vanish when opened
    area = int(blob.sum())
    if area < _MIN_FOREGROUND * blob.size or area < 4:
        return None
    ys, xs = np.nonzero(blob)
    h, w = blob.shape
    if ys.min() == 0 or xs.min() == 0 or ys.max() == h - 1 or xs.max() == w - 1:
        return None
    return area / float((ys.max() - ys.min() + 1) * (xs.max() - xs.min() + 1))


def shape_match(output: Output, record: dict) -> float:
    """1.0 if the dominant blob is classified as record["shape"], else 0.0 (mean over
    frames for clips)."""
    shape = _target(record, "shape", SHAPES)
    return _per_frame(lambda f: float(classify_shape(f) == shape), output)


def prompt_alignment_rule(output: Output, record: dict) -> float:
    """colour_match x shape_match per frame, in [0, 1]: high only when the colour AND the
    shape are right (GenEval-style strictness). The rule ground truth for GenRM hacking."""
    colour = _target(record, "colour", COLOURS)
    shape = _target(record, "shape", SHAPES)
    return _per_frame(
        lambda f: _colour_score(f, colour) * float(classify_shape(f) == shape), output
    )


def _centroid(img: Image.Image) -> tuple[float, float] | None:
    small = _small(img)
    blob = _largest_blob(foreground_mask(small))
    if blob.sum() < max(2, _MIN_FOREGROUND * blob.size):
        return None
    ys, xs = np.nonzero(blob)
    # in units of the image side, so the score does not depend on resolution
    return xs.mean() / small.width, ys.mean() / small.height


def motion_direction(output: Output, record: dict, *, full_scale: float = 0.25) -> float:
    """How far the foreground moves in record["direction"] over the clip, in [0, 1].

    The centroid of the dominant blob is tracked over the frames that show one; its
    least-squares velocity times the clip length is projected on the direction (x right,
    y down) in units of the image side and mapped to 0.5 + 0.5 * clip(d / full_scale):
    0.5 = no motion, 1 = moved >= a quarter of the frame the right way, 0 = the opposite
    way. Fewer than two frames with a foreground blob score 0.
    """
    direction = _target(record, "direction", DIRECTIONS)
    frames = _frames(output)
    pts = [(i, c) for i, f in enumerate(frames) if (c := _centroid(f)) is not None]
    if len(pts) < 2:
        return 0.0
    t = np.array([i for i, _ in pts], dtype=np.float64)
    xy = np.array([c for _, c in pts])
    tc = t - t.mean()
    slope = (tc[:, None] * (xy - xy.mean(0))).sum(0) / (tc**2).sum()  # per frame
    dx, dy = DIRECTIONS[direction]
    d = float(slope @ np.array([dx, dy], dtype=np.float64)) * (len(frames) - 1)
    return float(0.5 + 0.5 * np.clip(d / full_scale, -1.0, 1.0))


# --- learned scorers --------------------------------------------------------------------------
def load_scorer(path: str | Path) -> Callable[..., float]:
    """A reward from a local scorer directory (aesthetic / PickScore-style models).

    The directory holds ``scorer.py`` defining ``score(images, prompts) -> list[float]``
    (images: PIL images, prompts: strings); it loads its own weights relative to its file
    (e.g. ``Path(__file__).parent / "head.safetensors"``) and may import torch or
    transformers. The file is executed as Python, so only load directories you trust.
    Returns ``fn(output, record) -> float`` with ``fn.score_batch(images, prompts)`` for
    batched use; clips are scored frame by frame and averaged. (A bare torchscript or
    safetensors linear head without a scorer.py is not supported: wrap it in a scorer.py.)
    """
    root = Path(path)
    if not root.is_dir():
        raise FileNotFoundError(f"scorer directory {root} does not exist")
    file = root / "scorer.py"
    if not file.is_file():
        raise FileNotFoundError(
            f"{root}: missing scorer.py defining score(images, prompts) -> list[float]"
        )
    name = f"mmyatt_scorer_{abs(hash(str(file.resolve())))}"
    spec = importlib.util.spec_from_file_location(name, file)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    score = getattr(module, "score", None)
    if not callable(score):
        raise AttributeError(f"{file} defines no callable score(images, prompts)")

    def score_batch(images: list[Image.Image], prompts: list[str]) -> list[float]:
        values = [float(v) for v in score(list(images), list(prompts))]
        if len(values) != len(images):
            raise ValueError(
                f"{file}: score() returned {len(values)} values for {len(images)} images"
            )
        bad = [v for v in values if not math.isfinite(v)]
        if bad:
            raise ValueError(f"{file}: score() returned non-finite values {bad[:3]}")
        return values

    def reward(output: Output, record: dict | None = None) -> float:
        frames = _frames(output)
        prompt = str((record or {}).get("prompt", ""))
        return float(np.mean(score_batch(frames, [prompt] * len(frames))))

    reward.score_batch = score_batch
    reward.__name__ = f"scorer[{root.name}]"
    return reward


# --- latent rewards -----------------------------------------------------------------------
@reads_latents
def latent_brightness(output: Any, record: dict | None = None) -> float:
    """Mean of the latent mapped from [-1, 1] to [0, 1] (clipped): for the pixel-space
    built-ins the image's brightness, read without decoding; an example of a latent
    reward (for a VAE model it is the mean latent, not a brightness)."""
    import torch

    if not isinstance(output, torch.Tensor):
        raise TypeError(
            f"latent_brightness reads latents (a tensor), got {type(output).__name__}: "
            "the rollout decoded images because another reward of the run reads pixels"
        )
    return float(((output.float().mean() + 1.0) / 2.0).clamp(0.0, 1.0))


def geneval_rule(output: Output, record: dict) -> float:
    """``prompt_alignment_rule`` read on a tiny GenEval prompt's first object: colour x
    shape of the dominant blob (the shape alone where the prompt names no colour). The
    one-object rule, logged beside the checker for comparison."""
    if record.get("colour") in COLOURS:
        return prompt_alignment_rule(output, record)
    return shape_match(output, record)


IMAGE_REWARDS: dict[str, Callable[..., float]] = {
    "geneval_rule": geneval_rule,
    "latent_brightness": latent_brightness,
    "jpeg_compressibility": jpeg_compressibility,
    "jpeg_incompressibility": jpeg_incompressibility,
    "brightness": brightness,
    "colour_match": colour_match,
    "shape_match": shape_match,
    "prompt_alignment_rule": prompt_alignment_rule,
    "motion_direction": motion_direction,
}
