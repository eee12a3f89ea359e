"""Synthetic vision-language tasks for the VLM demos, tests and the tiny judge.

* **Colour / shape questions** (:func:`shape_records`, :func:`write_shape_task`): a 56x56
  image of one coloured shape; "What colour is the shape?" -> colour word, "What shape
  is it?" -> shape word.
* **Motion** (:func:`write_motion_task`): 4-8 frame clips of a square moving left or
  right, written as H.264 mp4; "Which way does the square move? Answer left or right."
* **Judge SFT data** (:func:`judge_records`, :func:`write_judge_task`): "Does this image
  show a {colour} {shape}? Answer Yes or No." with half positives and the negatives split
  evenly between wrong colour, wrong shape and both wrong (``negative_type``), plus the
  classification questions mixed in: a judge trained on Yes/No alone never learns to
  reject wrong shapes, one that also answers "what colour / shape"
  does.

Everything is deterministic in ``seed``; on disk a task is ``images/`` (or ``videos/``)
plus ``train.jsonl`` / ``eval.jsonl`` with media paths relative to the manifest, which
:func:`mmyatt.datasets.media.media_transform` resolves. Train and eval draw from
separate seeded streams and no image is shared between splits.

:mod:`mmyatt.models.builtin.train_tiny_judge` trains and scores the tiny built-in judge on these
records.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from PIL import Image

from .media import write_video
from .shapes import COLOURS, SHAPES, draw_shape, is_heldout, moving_shape_clip

IMAGE_SIZE = 56
JITTER = 0.1  # centre jitter as a fraction of the image (shapes.draw_shape's default: 0.15)
COLOUR_QUESTION = "What colour is the shape?"
SHAPE_QUESTION = "What shape is it?"
MOTION_QUESTION = "Which way does the square move? Answer left or right."
JUDGE_QUESTION = "Does this image show a {colour} {shape}? Answer Yes or No."
# the first-token spellings of the judge's answers that P(Yes) is summed over
JUDGE_YES, JUDGE_NO = ("Yes", " Yes"), ("No", " No")
NEGATIVE_TYPES = ("colour", "shape", "both")
COLOUR_CHECK = "Is the shape {colour}? Answer Yes or No."
SHAPE_CHECK = "Is it a {shape}? Answer Yes or No."


def draw(
    colour: str, shape: str, rng: np.random.Generator, sizes: tuple[int, ...] = (IMAGE_SIZE,)
) -> Image.Image:
    """One shape drawn by :func:`mmyatt.datasets.shapes.draw_shape` (the flow recipes'
    images: solid shape, dark background), at a size picked from ``sizes``."""
    size = sizes[int(rng.integers(len(sizes)))] if len(sizes) > 1 else sizes[0]
    return draw_shape(colour, shape, size=size, rng=rng, jitter=JITTER)


def _pick(rng: np.random.Generator, exclude) -> tuple[str, str]:
    """A (colour, shape) drawn uniformly, redrawn while it is in ``exclude``."""
    colours = list(COLOURS)
    while True:
        colour = colours[int(rng.integers(len(colours)))]
        shape = SHAPES[int(rng.integers(len(SHAPES)))]
        if not is_heldout((colour, shape), exclude):
            return colour, shape


# --- colour / shape questions ----------------------------------------------------------
def shape_records(
    n: int,
    *,
    seed: int,
    questions: tuple[str, ...] = ("colour", "shape"),
    sizes: tuple[int, ...] = (IMAGE_SIZE,),
    exclude=(),
) -> list[dict]:
    """``n`` records with in-memory PIL images; questions cycle through ``questions``;
    image sides are drawn from ``sizes``; no image shows a (colour, shape) in
    ``exclude``.

    >>> r = shape_records(2, seed=0)
    >>> r[0]["prompt"], r[1]["prompt"]
    ('What colour is the shape?', 'What shape is it?')
    """
    rng = np.random.default_rng([seed, 1])
    out = []
    for i in range(n):
        colour, shape = _pick(rng, exclude)
        kind = questions[i % len(questions)]
        out.append(
            {
                "id": f"s{seed}-{i}",
                "prompt": COLOUR_QUESTION if kind == "colour" else SHAPE_QUESTION,
                "image": draw(colour, shape, rng, sizes),
                "answer": colour if kind == "colour" else shape,
                "task": kind,
                "colour": colour,
                "shape": shape,
            }
        )
    return out


def grey_shape_records(n: int, *, seed: int, sizes: tuple[int, ...] = (IMAGE_SIZE,)) -> list[dict]:
    """Shape questions about achromatic shapes (grey to white, no palette colour):
    alternating "What shape is it?" and "Is it a {shape}?" (half true). They teach shape
    apart from colour without showing any (palette colour, shape) combination, so a
    judge trained with held-out combinations can still learn to read the shape of one."""
    rng = np.random.default_rng([seed, 8])
    out = []
    for i in range(n):
        shape = SHAPES[int(rng.integers(len(SHAPES)))]
        size = sizes[int(rng.integers(len(sizes)))] if len(sizes) > 1 else sizes[0]
        v = int(rng.integers(140, 246))
        image = draw_shape((v, v, v), shape, size=size, rng=rng, jitter=JITTER)
        if i % 2 == 0:
            prompt, answer, task = SHAPE_QUESTION, shape, "grey_shape"
        else:
            true = bool((i // 2) % 2 == 0)
            claim = shape if true else other_value(list(SHAPES), shape, rng)
            prompt, answer, task = (
                SHAPE_CHECK.format(shape=claim),
                "Yes" if true else "No",
                "grey_check",
            )
        out.append(
            {
                "id": f"g{seed}-{i}",
                "prompt": prompt,
                "image": image,
                "answer": answer,
                "task": task,
                "colour": None,
                "shape": shape,
            }
        )
    return out


# --- judge data ------------------------------------------------------------------------
def judge_records(
    n: int, *, seed: int, sizes: tuple[int, ...] = (IMAGE_SIZE,), exclude=()
) -> list[dict]:
    """``n`` Yes/No records: ``n // 2`` positives (rounded up), negatives cycling through
    wrong colour / wrong shape / both in a shuffled order (counts within 1 of each
    other), in random order. In-memory PIL images. Neither the image nor the question
    is ever a (colour, shape) in ``exclude``."""
    rng = np.random.default_rng([seed, 2])
    colours = list(COLOURS)
    n_pos = (n + 1) // 2
    kinds: list[str | None] = [None] * n_pos + [NEGATIVE_TYPES[i % 3] for i in range(n - n_pos)]
    kinds = [kinds[i] for i in rng.permutation(n)]
    out = []
    for i, kind in enumerate(kinds):
        while True:
            colour, shape = _pick(rng, exclude)
            claimed_colour, claimed_shape = colour, shape
            if kind in ("colour", "both"):
                claimed_colour = other_value(colours, colour, rng)
            if kind in ("shape", "both"):
                claimed_shape = other_value(list(SHAPES), shape, rng)
            if not is_heldout((claimed_colour, claimed_shape), exclude):
                break
        out.append(
            {
                "id": f"j{seed}-{i}",
                "prompt": JUDGE_QUESTION.format(colour=claimed_colour, shape=claimed_shape),
                "image": draw(colour, shape, rng, sizes),
                "answer": "Yes" if kind is None else "No",
                "negative_type": kind,
                "task": "judge",
                "colour": colour,
                "shape": shape,
                "claimed_colour": claimed_colour,
                "claimed_shape": claimed_shape,
            }
        )
    return out


def attribute_records(
    n: int, *, seed: int, sizes: tuple[int, ...] = (IMAGE_SIZE,), exclude=()
) -> list[dict]:
    """One-attribute Yes/No checks, alternating "Is the shape {colour}?" and "Is it a
    {shape}?", half of each true. They teach the comparison one attribute at a time."""
    rng = np.random.default_rng([seed, 5])
    colours = list(COLOURS)
    out = []
    for i in range(n):
        colour, shape = _pick(rng, exclude)
        kind, true = ("colour", "shape")[i % 2], bool((i // 2) % 2 == 0)
        if kind == "colour":
            claim = colour if true else other_value(colours, colour, rng)
            prompt = COLOUR_CHECK.format(colour=claim)
        else:
            claim = shape if true else other_value(list(SHAPES), shape, rng)
            prompt = SHAPE_CHECK.format(shape=claim)
        out.append(
            {
                "id": f"a{seed}-{i}",
                "prompt": prompt,
                "image": draw(colour, shape, rng, sizes),
                "answer": "Yes" if true else "No",
                "task": f"check_{kind}",
                "colour": colour,
                "shape": shape,
            }
        )
    return out


def judge_training_mix(
    n: int,
    *,
    seed: int,
    classification_fraction: float = 0.5,
    attribute_fraction: float = 0.0,
    sizes: tuple[int, ...] = (IMAGE_SIZE,),
    exclude=(),
    grey_fraction: float = 0.0,
) -> list[dict]:
    """Judge SFT data, shuffled: Yes/No judge records (:func:`judge_records`) with colour
    and shape questions (``classification_fraction`` of the total), one-attribute
    checks (``attribute_fraction``, :func:`attribute_records`) and achromatic shape
    questions (``grey_fraction``, :func:`grey_shape_records`) mixed in; no (colour,
    shape) in ``exclude`` is shown or asked about."""
    n_cls = int(round(n * classification_fraction))
    n_attr = int(round(n * attribute_fraction))
    n_grey = int(round(n * grey_fraction))
    if n_cls + n_attr + n_grey > n:
        raise ValueError("classification, attribute and grey fractions must sum to <= 1")
    records = judge_records(n - n_cls - n_attr - n_grey, seed=seed, sizes=sizes, exclude=exclude)
    records += grey_shape_records(n_grey, seed=seed + 104729, sizes=sizes)
    records += shape_records(n_cls, seed=seed + 7919, sizes=sizes, exclude=exclude)
    records += attribute_records(n_attr, seed=seed + 15485863, sizes=sizes, exclude=exclude)
    order = np.random.default_rng([seed, 3]).permutation(len(records))
    return [records[i] for i in order]


def other_value(options: list[str], value: str, rng: np.random.Generator) -> str:
    """One of ``options`` other than ``value``, drawn with ``rng``."""
    rest = [o for o in options if o != value]
    return rest[int(rng.integers(len(rest)))]


# --- writing tasks to disk ---------------------------------------------------------------
def write_split(records: list[dict], root: Path, split: str, folder: str = "images") -> Path:
    """``records`` as ``root/<split>.jsonl``, each image a PNG and each clip a GIF
    (lossless for these flat colours, unlike H.264) under ``root/folder``, named by split
    and id; the rows hold those paths relative to ``root``."""
    (root / folder).mkdir(parents=True, exist_ok=True)
    path = root / f"{split}.jsonl"
    with open(path, "w") as f:
        for rec in records:
            rec = dict(rec)
            if "video" in rec:
                media = write_video(
                    rec.pop("video"), root / folder / f"{split}-{rec['id']}.gif", fps=2.0
                )
                rec["video"] = str(media.relative_to(root))
            else:
                rel = f"{folder}/{split}-{rec['id']}.png"
                rec.pop("image").save(root / rel)
                rec["image"] = rel
            f.write(json.dumps(rec) + "\n")
    return path


def write_shape_task(
    out_dir: str | Path, *, n_train: int = 512, n_eval: int = 128, seed: int = 0, n_val: int = 0
) -> dict[str, Path]:
    """Colour and shape questions as PNGs + ``train.jsonl`` / ``eval.jsonl`` (and
    ``val.jsonl`` with ``n_val`` > 0: its own image stream, for the SFT stopping check)."""
    root = Path(out_dir)
    out = {
        "train": write_split(shape_records(n_train, seed=2 * seed), root, "train"),
        "eval": write_split(shape_records(n_eval, seed=2 * seed + 1), root, "eval"),
    }
    if n_val:
        out["val"] = write_split(shape_records(n_val, seed=1_000_003 + seed), root, "val")
    return out


def write_judge_task(
    out_dir: str | Path,
    *,
    n_train: int = 4096,
    n_eval: int = 600,
    seed: int = 0,
    classification_fraction: float = 0.5,
) -> dict[str, Path]:
    """Judge SFT data: ``train.jsonl`` (Yes/No mixed with classification questions) and
    ``eval.jsonl`` (Yes/No only, balanced negative types)."""
    root = Path(out_dir)
    train = judge_training_mix(
        n_train, seed=2 * seed, classification_fraction=classification_fraction
    )
    return {
        "train": write_split(train, root, "train"),
        "eval": write_split(judge_records(n_eval, seed=2 * seed + 1), root, "eval"),
    }


# --- motion videos -----------------------------------------------------------------------
def motion_clip(
    direction: str, rng: np.random.Generator, *, frames: int, size: int = IMAGE_SIZE
) -> np.ndarray:
    """(frames, size, size, 3) uint8: a square of a random colour sliding ``"left"`` or
    ``"right"`` (:func:`mmyatt.datasets.shapes.moving_shape_clip`)."""
    if direction not in ("left", "right"):
        raise ValueError(f"direction must be 'left' or 'right', got {direction!r}")
    colour = list(COLOURS)[int(rng.integers(len(COLOURS)))]
    clip = moving_shape_clip(colour, "square", direction, num_frames=frames, size=size, rng=rng)
    return np.stack([np.asarray(f) for f in clip])


def write_motion_task(
    out_dir: str | Path,
    *,
    n_train: int = 64,
    n_eval: int = 16,
    seed: int = 0,
    fps: float = 2.0,
    n_val: int = 0,
) -> dict[str, Path]:
    """Clips of 4, 6 or 8 frames written at ``fps`` (mp4, or GIF without an H.264
    encoder), with ``train.jsonl`` / ``eval.jsonl`` (answer ``left`` / ``right``, half each).
    At ``fps`` 2, :func:`~mmyatt.datasets.media.load_video` at 2 fps keeps every frame.
    ``n_val`` > 0 also writes ``val.jsonl`` from its own stream."""
    root = Path(out_dir)
    (root / "videos").mkdir(parents=True, exist_ok=True)
    paths = {}
    splits = [("train", n_train, 2 * seed), ("eval", n_eval, 2 * seed + 1)]
    if n_val:  # its own stream, for the SFT stopping check
        splits.append(("val", n_val, 1_000_003 + seed))
    for split, n, stream in splits:
        rng = np.random.default_rng([stream, 4])
        path = root / f"{split}.jsonl"
        with open(path, "w") as f:
            for i in range(n):
                direction = ("left", "right")[i % 2]
                frames = int(rng.choice([4, 6, 8]))
                written = write_video(
                    motion_clip(direction, rng, frames=frames),
                    root / "videos" / f"{split}-{i}.mp4",
                    fps=fps,
                )
                rec = {
                    "id": f"m{stream}-{i}",
                    "prompt": MOTION_QUESTION,
                    "video": str(written.relative_to(root)),
                    "answer": direction,
                    "task": "motion",
                    "num_frames": frames,
                }
                f.write(json.dumps(rec) + "\n")
        paths[split] = path
    return paths


# --- held-out judge checks ---------------------------------------------------------------
def heldout_judge_records(
    n: int, *, seed: int, combos, sizes: tuple[int, ...] = (IMAGE_SIZE,)
) -> list[dict]:
    """``n`` Yes/No records (drawn as :func:`judge_records`) in which the image or the
    question is one of ``combos``: how a judge trained with ``exclude=combos`` does on
    the combinations it never saw."""
    out: list[dict] = []
    k = 0
    while len(out) < n:
        for r in judge_records(4 * n, seed=seed + 7 * k, sizes=sizes):
            if is_heldout((r["colour"], r["shape"]), combos) or is_heldout(
                (r["claimed_colour"], r["claimed_shape"]), combos
            ):
                out.append(r)
        k += 1
    return out[:n]
