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
  reject wrong shapes (ENVIRONMENT.md), one that also answers "what colour / shape"
  does.

Everything is deterministic in ``seed``; on disk a task is ``images/`` (or ``videos/``)
plus ``train.jsonl`` / ``eval.jsonl`` with media paths relative to the manifest, which
:func:`mmyatt.datasets.media.media_transform` resolves. Train and eval draw from
separate seeded streams and no image is shared between splits.

:func:`train_judge` trains the tiny built-in judge (see its docstring for the recipe).
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

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
            claim = shape if true else _other(list(SHAPES), shape, rng)
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
                claimed_colour = _other(colours, colour, rng)
            if kind in ("shape", "both"):
                claimed_shape = _other(list(SHAPES), shape, rng)
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
            claim = colour if true else _other(colours, colour, rng)
            prompt = COLOUR_CHECK.format(colour=claim)
        else:
            claim = shape if true else _other(list(SHAPES), shape, rng)
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


def _other(options: list[str], value: str, rng: np.random.Generator) -> str:
    rest = [o for o in options if o != value]
    return rest[int(rng.integers(len(rest)))]


# --- writing tasks to disk ---------------------------------------------------------------
def _write_split(records: list[dict], root: Path, split: str) -> Path:
    (root / "images").mkdir(parents=True, exist_ok=True)
    path = root / f"{split}.jsonl"
    with open(path, "w") as f:
        for rec in records:
            rec = dict(rec)
            rel = f"images/{split}-{rec['id']}.png"
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
        "train": _write_split(shape_records(n_train, seed=2 * seed), root, "train"),
        "eval": _write_split(shape_records(n_eval, seed=2 * seed + 1), root, "eval"),
    }
    if n_val:
        out["val"] = _write_split(shape_records(n_val, seed=1_000_003 + seed), root, "val")
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
        "train": _write_split(train, root, "train"),
        "eval": _write_split(judge_records(n_eval, seed=2 * seed + 1), root, "eval"),
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


# --- judge evaluation and training -------------------------------------------------------
def _messages(record: dict) -> list[dict]:
    return [
        {
            "role": "user",
            "content": [
                {"type": "image", "image": record["image"]},
                {"type": "text", "text": record["prompt"]},
            ],
        }
    ]


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


def judge_accuracy(
    policy, records: list[dict], *, batch_size: int = 64, top_k: int = 20
) -> dict[str, Any]:
    """Held-out Yes/No accuracy of ``policy`` (a :class:`~mmyatt.models.vlm.VLMPolicy`)
    reading P(Yes) vs P(No) of the first answer token (``next_token_logprobs``), overall,
    on positives and per negative type (``reject_<type>`` = rejection rate); and, as a
    reward model is read, the mean P(Yes) / (P(Yes) + P(No)) on the positives of each
    shape (``p_yes_<shape>``): a judge can accept every square and still pay little for
    one."""
    from mmyatt.rewards.genrm import yes_probability

    correct: dict[str, list[bool]] = {"positive": [], **{t: [] for t in NEGATIVE_TYPES}}
    p_yes: dict[str, list[float]] = {s: [] for s in SHAPES}
    for start in range(0, len(records), batch_size):
        chunk = records[start : start + batch_size]
        tops = policy.next_token_logprobs([_messages(r) for r in chunk], top_k)
        for rec, top in zip(chunk, tops):
            scores = {tok.strip(): lp for tok, lp in reversed(top)}  # most likely wins
            yes, no = scores.get("Yes", -np.inf), scores.get("No", -np.inf)
            said_yes = yes > no
            key = rec["negative_type"] or "positive"
            correct[key].append(said_yes == (rec["answer"] == "Yes"))
            if key == "positive" and (p := yes_probability(top, JUDGE_YES, JUDGE_NO)) is not None:
                p_yes[rec["shape"]].append(p)
    every = [c for v in correct.values() for c in v]
    out: dict[str, Any] = {
        "accuracy": float(np.mean(every)) if every else float("nan"),
        "n": len(every),
    }
    out["accept_positive"] = (
        float(np.mean(correct["positive"])) if correct["positive"] else float("nan")
    )
    for t in NEGATIVE_TYPES:
        out[f"reject_{t}"] = float(np.mean(correct[t])) if correct[t] else float("nan")
    for shape, ps in p_yes.items():
        out[f"p_yes_{shape}"] = float(np.mean(ps)) if ps else float("nan")
    return out


def classification_accuracy(policy, records: list[dict], *, batch_size: int = 64) -> float:
    """Greedy first-token accuracy on colour/shape questions (answers are single words)."""
    hits = []
    for start in range(0, len(records), batch_size):
        chunk = records[start : start + batch_size]
        tops = policy.next_token_logprobs([_messages(r) for r in chunk], 1)
        hits += [top[0][0].strip() == r["answer"] for r, top in zip(chunk, tops)]
    return float(np.mean(hits))


def classification_by_task(policy, records: list[dict]) -> dict[str, float]:
    """Greedy first-token accuracy per question type ({"colour": ..., "shape": ...})."""
    out = {}
    for task in ("colour", "shape"):
        subset = [r for r in records if r["task"] == task]
        if subset:
            out[task] = classification_accuracy(policy, subset)
    return out


def train_judge(
    out_dir: str | Path | None = None,
    *,
    minutes: float = 30.0,
    seed: int = 0,
    size: str = "base",
    target: float = 0.98,
    lr: float = 1e-3,
    batch_size: int = 32,
    stage_target: float = 0.95,
    max_stage_steps: int = 800,
    sizes: tuple[int, ...] = (IMAGE_SIZE,),
    classification_fraction: float = 0.25,
    attribute_fraction: float = 0.25,
    judge_steps: int = 3000,
    n_eval: int = 600,
    n_test: int = 1200,
    eval_every: int = 100,
    exclude=(),
    grey_fraction: float = 0.0,
    log: Callable[[str], None] | None = print,
) -> dict[str, Any]:
    """Train the tiny Yes/No judge with ``VLMPolicy.sft_loss``; save the best to ``out_dir``.

    ``grey_fraction``: that share of every batch (all stages) is achromatic shape
    questions (:func:`grey_shape_records`), so shape is learned apart from colour.

    ``exclude``: (colour, shape) combinations no training or selection record shows or
    asks about (the built-in judge excludes ``shapes.HELDOUT``, the flow recipes'
    held-out combinations); the final test reports them separately.

    Recipe (one CPU thread is enough): a tiny Qwen2-VL of ``size``
    (:func:`mmyatt.models.tiny_vlm.build_tiny_vlm`, seeded), AdamW at ``lr`` without
    weight decay, gradient norm clipped to 1, batches of ``batch_size`` freshly drawn
    records with images of sides ``sizes``. A curriculum of three stages:

    1. "What shape is it?" only, until held-out shape accuracy reaches ``stage_target``
       (shape is the hard attribute: mixed with colour questions from the start, 3-way
       shape accuracy stalled near 0.85, while alone it passes 0.95 in ~300 steps);
    2. colour and shape questions, until both reach ``stage_target``;
    3. the judge mix (:func:`judge_training_mix`): ``classification_fraction`` colour /
       shape questions, ``attribute_fraction`` one-attribute Yes/No checks ("Is the
       shape red?"), the rest judge questions; the learning rate follows a cosine from
       ``lr`` to ``lr / 10`` over ``judge_steps``.

    A stage also ends after ``max_stage_steps``. Every ``eval_every`` steps the stage's
    metric is measured; in stage 3 that is :func:`judge_accuracy` on ``n_eval`` held-out
    Yes/No records (their own seed stream). Training stops when it reaches ``target`` or
    after ``minutes``; the best stage-3 checkpoint is saved (Hugging Face layout) and
    scored once more on ``n_test`` fresh Yes/No records per image side in ``sizes``
    (the eval set picked the checkpoint, so its score is optimistic; this one is not).
    Returns {"best": metrics, "test": {side: metrics}, "history": [...], "steps": int,
    "seconds": float}.
    """
    import torch

    from mmyatt.models.tiny_vlm import build_tiny_vlm
    from mmyatt.models.vlm import VLMPolicy

    say = log or (lambda _msg: None)
    torch.manual_seed(seed)
    work = Path(out_dir) if out_dir is not None else None
    build_dir = Path(f"/tmp/mmyatt-judge-build-{seed}") if work is None else work
    build_tiny_vlm(build_dir, arch="qwen2-vl", size=size, corpus=_judge_corpus(), seed=seed)
    policy = VLMPolicy.load(build_dir, max_prompt_tokens=64)
    model = policy.module()
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    ex = tuple(exclude)
    eval_records = judge_records(n_eval, seed=10_000 + seed, sizes=sizes, exclude=ex)
    cls_eval = shape_records(192, seed=20_000 + seed, sizes=sizes, exclude=ex)
    n_grey = int(round(batch_size * grey_fraction))

    def with_grey(records: list[dict], s: int) -> list[dict]:
        return records + grey_shape_records(n_grey, seed=s + 7, sizes=sizes) if n_grey else records

    stages: list[tuple[str, Callable[[int], list[dict]]]] = [
        (
            "shape",
            lambda s: with_grey(
                shape_records(
                    batch_size - n_grey, seed=s, questions=("shape",), sizes=sizes, exclude=ex
                ),
                s,
            ),
        ),
        (
            "classification",
            lambda s: with_grey(
                shape_records(batch_size - n_grey, seed=s, sizes=sizes, exclude=ex), s
            ),
        ),
        (
            "judge",
            lambda s: judge_training_mix(
                batch_size,
                seed=s,
                sizes=sizes,
                classification_fraction=classification_fraction,
                attribute_fraction=attribute_fraction,
                exclude=ex,
                grey_fraction=grey_fraction,
            ),
        ),
    ]
    start = time.perf_counter()
    history: list[dict] = []
    best: dict[str, Any] = {"accuracy": -1.0}
    step, stage, stage_start = 0, 0, 0
    while True:
        name, make = stages[stage]
        if name == "judge":  # cosine from lr to lr / 10 over judge_steps, then flat
            _set_cosine_lr(opt, lr, min(1.0, (step - stage_start) / judge_steps))
        batch = make(1_000_000 * (seed + 1) + step)
        loss = policy.sft_loss(batch)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        elapsed = time.perf_counter() - start
        out_of_time = elapsed > minutes * 60
        if step % eval_every and not out_of_time:
            continue
        model.eval()
        with torch.no_grad():
            metrics: dict[str, Any] = classification_by_task(policy, cls_eval)
            if name == "judge":
                metrics.update(judge_accuracy(policy, eval_records))
        model.train()
        metrics.update(step=step, seconds=round(elapsed, 1), loss=float(loss.detach()), stage=name)
        history.append(metrics)
        say(json.dumps(metrics))
        if name == "judge":
            if metrics["accuracy"] > best["accuracy"]:
                best = metrics
                if work is not None:
                    policy.save(str(work))
            if metrics["accuracy"] >= target:
                break
        else:
            passed = metrics["shape"] >= stage_target
            if name == "classification":
                passed = passed and metrics["colour"] >= stage_target
            if passed or step - stage_start >= max_stage_steps:
                stage, stage_start = stage + 1, step
        if out_of_time:
            break
    seconds = time.perf_counter() - start
    test: dict[int, dict] = {}
    if work is not None and best["accuracy"] >= 0:
        final = VLMPolicy.load(work, max_prompt_tokens=64)
        with torch.no_grad():
            for side in sizes:
                test[side] = judge_accuracy(
                    final, judge_records(n_test, seed=30_000 + seed, sizes=(side,))
                )
                say(json.dumps({"test_image_side": side, **test[side]}))
    return {"best": best, "test": test, "history": history, "steps": step, "seconds": seconds}


def _set_cosine_lr(opt, lr: float, progress: float) -> None:
    """A cosine from ``lr`` (progress 0) to ``lr / 10`` (progress 1)."""
    for group in opt.param_groups:
        group["lr"] = lr * (0.1 + 0.45 * (1 + math.cos(math.pi * progress)))


def _judge_corpus() -> list[str]:
    """Tokenizer corpus: every question and answer the judge sees."""
    texts = [COLOUR_QUESTION, SHAPE_QUESTION, MOTION_QUESTION, "Yes", "No", *COLOURS, *SHAPES]
    texts += [JUDGE_QUESTION.format(colour=c, shape=s) for c in COLOURS for s in SHAPES]
    texts += [COLOUR_CHECK.format(colour=c) for c in COLOURS]
    texts += [SHAPE_CHECK.format(shape=s) for s in SHAPES]
    return texts * 4


# --- judge data from a generator's own samples ------------------------------------------
def generator_samples(
    generator_dir: str | Path,
    n: int,
    *,
    seed: int,
    noise_levels: tuple[float, ...] = (0.0, 0.4, 0.7, 1.0),
    denoise_steps: tuple[int, ...] = (10, 20),
    batch: int = 32,
    exclude=(),
) -> list[dict]:
    """``n`` images drawn by the flow model at ``generator_dir`` for random shape
    captions: {"id", "prompt", "colour", "shape", "image"} (the caption's attributes, not
    what was drawn). Chunks of ``batch`` cycle through ``noise_levels`` (0 = ODE) and
    ``denoise_steps``, so the pool covers what RL rollouts and ODE evals look like.
    No caption is a (colour, shape) in ``exclude``."""
    import torch

    from mmyatt.models.flow import FlowPolicy
    from mmyatt.models.protocol import Sampling, prompt_seed

    from .shapes import shape_records as caption_records

    policy = FlowPolicy.load(generator_dir)
    records = caption_records(n, seed, tuple(exclude))
    out: list[dict] = []
    with torch.no_grad():
        for k, start in enumerate(range(0, n, batch)):
            chunk = records[start : start + batch]
            level = noise_levels[k % len(noise_levels)]
            steps = denoise_steps[(k // len(noise_levels)) % len(denoise_steps)]
            sampling = Sampling(denoise_steps=steps, noise_level=level, greedy=level == 0.0)
            seeds = [prompt_seed(seed, r["id"]) for r in chunk]
            images = policy.generate(chunk, 1, sampling, seeds).outputs
            out += [{**r, "image": img} for r, img in zip(chunk, images)]
    return out


def rule_judge_records(
    samples: list[dict],
    *,
    seed: int,
    threshold: float = 0.5,
    ambiguous: tuple[float, float] | None = None,
    exclude=(),
) -> list[dict]:
    """Two judge questions per generated image, answered by the rule check
    (:func:`mmyatt.rewards.image.prompt_alignment_rule` >= ``threshold`` -> "Yes"): the
    image's own caption, and another claim (same colour and another shape half of the
    time, another colour a quarter, both the rest). The rule's verdict, not the caption,
    is the label: a square drawn as a blob is not a square.

    ``ambiguous`` = (lo, hi) leaves out images whose blob fill
    (:func:`mmyatt.rewards.image.shape_fill`) lies in [lo, hi): the band around the
    rule's square/circle boundary (0.89) where a ragged square and a round blob overlap,
    so the rule's verdict there is a coin the judge should not be taught. A claim in
    ``exclude`` is replaced by another drawn the same way."""
    from mmyatt.rewards.image import prompt_alignment_rule, shape_fill

    if ambiguous is not None and not ambiguous[0] < ambiguous[1]:
        raise ValueError(f"ambiguous must be (lo, hi) with lo < hi, got {ambiguous}")
    rng = np.random.default_rng([seed, 6])
    colours = list(COLOURS)
    out = []
    for i, s in enumerate(samples):
        while True:  # drawn for every sample, so the claims do not depend on the band
            u = rng.random()
            other_colour = _other(colours, s["colour"], rng) if u >= 0.5 else s["colour"]
            other_shape = (
                _other(list(SHAPES), s["shape"], rng) if u < 0.5 or u >= 0.75 else s["shape"]
            )
            if not is_heldout((other_colour, other_shape), exclude):
                break
        if ambiguous is not None:
            fill = shape_fill(s["image"])
            if fill is not None and ambiguous[0] <= fill < ambiguous[1]:
                continue
        for j, (colour, shape) in enumerate(
            ((s["colour"], s["shape"]), (other_colour, other_shape))
        ):
            score = prompt_alignment_rule(s["image"], {"colour": colour, "shape": shape})
            out.append(
                {
                    "id": f"g{seed}-{i}-{j}",
                    "prompt": JUDGE_QUESTION.format(colour=colour, shape=shape),
                    "image": s["image"],
                    "answer": "Yes" if score >= threshold else "No",
                    "task": "judge_generated",
                    "rule_score": float(score),
                    "claimed_colour": colour,
                    "claimed_shape": shape,
                }
            )
    return out


def rule_agreement(policy, records: list[dict], *, batch_size: int = 64) -> dict[str, float]:
    """How often the judge's Yes/No (P(Yes) > P(No)) matches the records' rule answers;
    also the Pearson correlation of P(Yes) with the rule score."""
    from mmyatt.rewards.genrm import yes_probability

    p_yes: list[float] = []
    for start in range(0, len(records), batch_size):
        chunk = records[start : start + batch_size]
        for top in policy.next_token_logprobs([_messages(r) for r in chunk], 20):
            p = yes_probability(top, JUDGE_YES, JUDGE_NO)
            p_yes.append(0.5 if p is None else p)  # neither answer among the top tokens
    p = np.array(p_yes)
    said = p > 0.5
    truth = np.array([r["answer"] == "Yes" for r in records])
    rule = np.array([r["rule_score"] for r in records])
    corr = float(np.corrcoef(p, rule)[0, 1]) if p.std() > 0 and rule.std() > 0 else 0.0
    return {
        "agreement": float(np.mean(said == truth)),
        "accept_rule_yes": float(np.mean(said[truth])) if truth.any() else float("nan"),
        "reject_rule_no": float(np.mean(~said[~truth])) if (~truth).any() else float("nan"),
        "corr_rule": corr,
        "n": len(records),
    }


def finetune_judge_on_generator(
    judge_dir: str | Path,
    generator_dir: str | Path | list,
    out_dir: str | Path,
    *,
    seed: int = 0,
    pool: int = 4000,
    steps: int = 600,
    batch_size: int = 32,
    generated_fraction: float = 0.5,
    lr: float = 3e-4,
    n_eval: int = 600,
    eval_every: int = 100,
    sizes: tuple[int, ...] = (IMAGE_SIZE,),
    ambiguous: tuple[float, float] | None = None,
    exclude=(),
    grey_fraction: float = 0.0,
    log: Callable[[str], None] | None = print,
) -> dict[str, Any]:
    """Fine-tune a Yes/No judge on the generator's own samples, labelled by the rule.
    ``grey_fraction`` of the clean mix is achromatic shape questions.
    No sample's caption, claim or clean record is a (colour, shape) in ``exclude``.

    A judge trained only on clean drawn shapes agrees with the rule check on the tiny
    generator's blobby samples barely above chance, and RL against it finds textures it
    likes (reward hacking). ``generator_dir`` may list several flow models (e.g. the base
    and a policy already trained against an earlier judge, whose samples show what RL
    drifts towards); the pool is split evenly between them. Each batch mixes
    ``generated_fraction`` rule-labelled questions about images from a pool of ``pool``
    generator samples (:func:`generator_samples`, :func:`rule_judge_records`) with the
    clean judge mix (:func:`judge_training_mix`, image sides from ``sizes``) so the clean
    skills stay; ``ambiguous`` leaves out of the pool and the held-out set the images
    whose blob fill is in that band (:func:`rule_judge_records`): the judge is taught, and
    selected on, the rule's verdicts where the rule is reliable. AdamW at ``lr`` with a cosine
    to ``lr / 10``; every ``eval_every`` steps: rule agreement on ``n_eval`` questions
    about held-out generator samples (their own seed) and clean held-out accuracy; the
    checkpoint with the best agreement whose clean accuracy stays >= 0.95 is saved to
    ``out_dir``. Returns {"start", "best", "history", "seconds"}.
    """
    import torch

    from mmyatt.models.vlm import VLMPolicy

    say = log or (lambda _msg: None)
    torch.manual_seed(seed)
    started = time.perf_counter()
    gens = [generator_dir] if isinstance(generator_dir, str | Path) else list(generator_dir)
    say(f"drawing {pool} + {n_eval // 2} samples from {len(gens)} generator(s) ...")
    train_pool, held = [], []
    for k, gen in enumerate(gens):  # the pool and the held-out set split evenly
        s_train, s_held = seed + 1000 * k, 50_000 + seed + 1000 * k
        n_k, h_k = pool // len(gens), (n_eval // 2) // len(gens)
        train_pool += rule_judge_records(
            generator_samples(gen, n_k, seed=s_train, exclude=exclude),
            seed=s_train,
            ambiguous=ambiguous,
            exclude=exclude,
        )
        held += rule_judge_records(
            generator_samples(gen, h_k, seed=s_held, exclude=exclude),
            seed=s_held,
            ambiguous=ambiguous,
            exclude=exclude,
        )
    clean_eval = judge_records(n_eval, seed=10_000 + seed, sizes=sizes, exclude=exclude)
    yes = np.mean([r["answer"] == "Yes" for r in train_pool])
    say(f"pool: {len(train_pool)} questions, {yes:.2f} answered Yes by the rule")
    policy = VLMPolicy.load(judge_dir, max_prompt_tokens=64)
    model = policy.module()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    rng = np.random.default_rng([seed, 7])
    n_gen = int(round(batch_size * generated_fraction))

    def measure(step: int, loss: float | None) -> dict[str, Any]:
        model.eval()
        with torch.no_grad():
            m = {f"gen_{k}": v for k, v in rule_agreement(policy, held).items()}
            m["clean_accuracy"] = judge_accuracy(policy, clean_eval)["accuracy"]
        model.train()
        m.update(step=step, seconds=round(time.perf_counter() - started, 1), loss=loss)
        say(json.dumps(m))
        return m

    start = measure(0, None)
    best: dict[str, Any] = {"gen_agreement": -1.0}
    history = [start]
    model.train()
    for step in range(1, steps + 1):
        _set_cosine_lr(opt, lr, (step - 1) / max(1, steps - 1))
        picks = rng.choice(len(train_pool), size=n_gen, replace=False)
        batch = [train_pool[int(i)] for i in picks]
        batch += judge_training_mix(
            batch_size - n_gen,
            seed=2_000_000 * (seed + 1) + step,
            sizes=sizes,
            classification_fraction=0.25,
            attribute_fraction=0.25,
            exclude=exclude,
            grey_fraction=grey_fraction,
        )
        loss = policy.sft_loss(batch)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % eval_every == 0 or step == steps:
            m = measure(step, float(loss.detach()))
            history.append(m)
            if m["clean_accuracy"] >= 0.95 and m["gen_agreement"] > best["gen_agreement"]:
                best = m
                policy.save(str(out_dir))
    return {
        "start": start,
        "best": best,
        "history": history,
        "seconds": round(time.perf_counter() - started, 1),
    }
