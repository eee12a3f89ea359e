"""Open descriptions of images and clips: the task of the VLM + GenRM recipe.

A VLM sees one coloured shape (an image) or a moving one (a clip) and is asked
"Describe the object." / "Describe the object and how it moves."; it answers in free
text. Nothing matches an answer string exactly: a judge reads the answer next to the
image (or the clip's frames) and says whether it is correct
(``configs/vlm_genrm_tiny.yaml``). Three things live here:

* **Records** (:func:`describe_records`): images and clips of the flow recipes' shapes
  (``datasets/shapes.py``) with their ground-truth attributes and one reference
  description in a varied phrasing (the SFT target); ``describe_task.py`` writes the
  task's splits from them.
* **The independent check** lives apart, in ``describe_check.py``: the ground-truth
  attributes against the words of the answer, rule-based and read by no training of
  the judge.
* **Judge data** (:func:`judge_records`): the judge's question about a description,
  half correct in varied phrasings, half deliberately wrong (wrong colour, shape or
  direction, a false attribute added, an attribute missing, a repeated word), labelled
  by how the record was drawn.

Held-out combinations: no training record, of the policy or of the judge, shows or names
a (colour, shape) in :data:`mmyatt.datasets.shapes.HELDOUT` or a clip triple in
``MOTION_HELDOUT``; ``test.jsonl`` / ``val.jsonl`` are 2/3 held-out ("split": "heldout")
and 1/3 trained combinations ("split": "seen").
"""

from __future__ import annotations

import re

import numpy as np
from PIL import Image

from .factored_shapes import EXTRA_COLOURS, EXTRA_SHAPES, draw_extra
from .shapes import (
    COLOURS,
    DIRECTIONS,
    HELDOUT,
    MOTION_HELDOUT,
    SHAPES,
    draw_shape,
    is_heldout,
    moving_shape_clip,
)
from .vision_tasks import other_value

IMAGE_SIZE = 56
FRAMES = 4
DESCRIBE_IMAGE = "Describe the object."
DESCRIBE_VIDEO = "Describe the object and how it moves."
# noun phrases, so that a description reads as a whole in the judge's question
IMAGE_PHRASES = (
    "a {colour} {shape}",
    "a {shape} that is {colour}",
    "one {colour} {shape}",
    "a single {colour} {shape}",
    "the {colour} {shape}",
)
VIDEO_PHRASES = (
    "a {colour} {shape} moving {direction}",
    "a {colour} {shape} that moves {direction}",
    "a {colour} {shape} going {direction}",
    "one {colour} {shape} moving {direction}",
    "a {shape} that is {colour} moving {direction}",
)
# the phrasings that name the shape before the colour (``shape_first``): a policy that
# writes the shape first picks it from the picture, before a colour word it could be
# guessed from
SHAPE_FIRST_PHRASES = {False: IMAGE_PHRASES[1], True: VIDEO_PHRASES[4]}  # image, clip
# the built-in judge's question: the GenRM template ``yes_no_shows`` (rewards/templates)
# with the policy's answer filled in (the base judge's own format, "Does this image show
# a red circle?", so what it learned about colour and shape carries over)
JUDGE_TEMPLATE = "Does this image show {output}? Answer Yes or No."
# the score variant's question (template ``score_shows``) and the judge's answers to it
SCORE_TEMPLATE = (
    'Does this image show {output}? Reply with one line in the form "Score: N", '
    "N from 1 (wrong) to 10 (correct)."
)
SCORE_ANSWERS = {"Yes": "Score: 9", "No": "Score: 2"}
# a drill for the judge: which way a clip's object moves, asked outright (a yes/no
# question about a whole description carries little signal about motion)
DIRECTION_QUESTION = "Which way does the object move? Answer left, right, up or down."
JUDGE_NEGATIVES = tuple(  # every kind of wrong description :func:`_negative` draws
    "colour shape direction added missing repeat stutter two garble split conflict "
    "fragment junk shape_first".split()
)
# How often each kind of wrong description is drawn: mostly the ones only the picture
# can refute (a wrong colour, shape or direction); the text-only ones (an attribute
# added, missing, a word repeated or stuttered, a second object) are learned quickly.
NEGATIVE_WEIGHTS = {
    "colour": 0.3,
    "shape": 0.25,
    "direction": 0.15,
    "added": 0.06,
    "missing": 0.06,
    "repeat": 0.06,
    "stutter": 0.06,
    "two": 0.06,
    "garble": 0.12,
}
# With ``split_negatives``: words broken by spaces and fragments repeated ("a circle th
# is is purple"), the text a policy found that the judge still paid.
SPLIT_WEIGHTS = {**NEGATIVE_WEIGHTS, "garble": 0.08, "split": 0.12}
# With ``conflict_negatives`` too: the true value and a false one of the same attribute
# in one description ("a green square that is yellow"), and a description that lost its
# noun ("a that is purple"): what a policy drifts into when a judge reads only the last
# colour it names or does not miss the shape.
CONFLICT_WEIGHTS = {**SPLIT_WEIGHTS, "conflict": 0.14, "fragment": 0.06}
# And ``junk``: a correct description with one to three insertions anywhere (a run of
# random letters, alone or glued to a word; a colour, shape or direction word, the true
# one repeated or another; a filler fragment): any text beyond a clean description is
# "No", whatever form the policy's next drift takes ("a red circle momomomo left", "a
# green square yellow yellow greenesn down").
JUNK_WEIGHTS = {**CONFLICT_WEIGHTS, "junk": 0.25}
# And ``shape_first``: a wrong shape in the shape-first phrasing ("a circle that is red" of
# a red square), which the judges above paid 0.41-0.48 on trained pairs against 0.01-0.08
# in the other phrasings, and which a policy rewarded by them drifted into (at 0.8, about a
# third of the negatives, 1000 steps brought it to 0.17; at 0.25, 400 steps, to 0.41).
SHAPE_FIRST_WEIGHTS = {**JUNK_WEIGHTS, "shape_first": 0.8}
# The second validation fold's held-out combinations
# (``describe_task.write_describe_task(val_fold=2)``): each validation colour's other
# trained shape, and clips of them.
VAL_FOLD2_PAIRS: tuple[tuple[str, str], ...] = (
    ("yellow", "square"),
    ("cyan", "circle"),
    ("purple", "triangle"),
)
VAL_FOLD2_TRIPLES: tuple[tuple[str, str, str], ...] = (
    ("yellow", "square", "left"),
    ("cyan", "circle", "up"),
    ("purple", "triangle", "down"),
)
_FILLERS = ("is", "th", "t", "that", "mo", "mov", "moving", "it", "n", "es")
_LETTERS = "abcdefghijklmnoprstuvwy"  # what garbled and junk text is made of
_WORD = re.compile(r"[a-z]+")


# --- records -----------------------------------------------------------------------------
def _combo(
    rng: np.random.Generator, video: bool, exclude_pairs, exclude_triples, only=None, colours=None
):
    if only is not None:
        return tuple(only[int(rng.integers(len(only)))])
    colours = list(colours or COLOURS)
    while True:
        c = (colours[int(rng.integers(len(colours)))], SHAPES[int(rng.integers(len(SHAPES)))])
        if video:
            c = (*c, list(DIRECTIONS)[int(rng.integers(len(DIRECTIONS)))])
        if is_heldout(c[:2], exclude_pairs):
            continue
        if video and is_heldout(c, exclude_triples):
            continue
        return c


def describe(
    colour: str, shape: str, direction: str | None, rng: np.random.Generator, shape_first=False
) -> str:
    """A correct description in a phrasing drawn from :data:`IMAGE_PHRASES` /
    :data:`VIDEO_PHRASES` (the draw is made either way), or with ``shape_first`` the
    one of :data:`SHAPE_FIRST_PHRASES`.

    >>> rng = np.random.default_rng(0)
    >>> describe("red", "square", None, rng, shape_first=True)
    'a square that is red'
    """
    phrases = IMAGE_PHRASES if direction is None else VIDEO_PHRASES
    phrase = phrases[int(rng.integers(len(phrases)))]
    if shape_first:
        phrase = SHAPE_FIRST_PHRASES[direction is not None]
    return phrase.format(colour=colour, shape=shape, direction=direction)


def describe_records(
    n: int,
    *,
    seed: int,
    video_fraction: float = 0.25,
    exclude_pairs=HELDOUT,
    exclude_triples=MOTION_HELDOUT,
    only_pairs=None,
    only_triples=None,
    extra_colours: bool = False,
    extra_fraction: float = 0.0,
    shape_first: float = 0.0,
    extra_shapes: float = 0.0,
) -> list[dict]:
    """``n`` records with in-memory media: every ``round(1 / video_fraction)``-th one a
    clip of :data:`FRAMES` frames ("video": (T, H, W, 3) uint8), the others an image
    (PIL). Keys: prompt, image|video, answer (a reference description), colour, shape,
    direction (None for an image), task ("describe_image" / "describe_video").
    ``only_pairs`` / ``only_triples`` draw from those combinations alone (held-out eval);
    ``extra_colours`` adds :data:`EXTRA_COLOURS` to the palette (judge training);
    ``extra_fraction`` draws that share of the records in an extra colour with any shape
    (a policy's training: shape has to be read apart from colour); ``shape_first``: that
    share of the answers is phrased shape first (:data:`SHAPE_FIRST_PHRASES`);
    ``extra_shapes``: that share of the images shows one of ``EXTRA_SHAPES`` instead (so
    that no colour predicts the shape).

    >>> r = describe_records(4, seed=0)
    >>> [x["task"] for x in r], r[3]["prompt"]
    (['describe_image', 'describe_image', 'describe_image', 'describe_video'], 'Describe the object and how it moves.')
    """
    rng = np.random.default_rng([seed, 11])
    every = int(round(1 / video_fraction)) if video_fraction > 0 else 0
    for name, value in (
        ("extra_fraction", extra_fraction),
        ("shape_first", shape_first),
        ("extra_shapes", extra_shapes),
    ):
        if not 0.0 <= value <= 1.0:
            raise ValueError(f"{name} must be in [0, 1], got {value}")
    palette = [*COLOURS, *EXTRA_COLOURS] if extra_colours else None
    # its own stream, so that the records without extra colours are drawn as before
    extra_rng = np.random.default_rng([seed, 12])
    order_rng = np.random.default_rng([seed, 13])  # and the phrasing order's
    shape_rng = np.random.default_rng([seed, 14])  # and the extra shapes'
    out = []
    for i in range(n):
        video = bool(every) and i % every == every - 1
        only = only_triples if video else only_pairs
        extra = only is None and extra_fraction > 0 and extra_rng.random() < extra_fraction
        combo = _combo(
            rng,
            video,
            exclude_pairs,
            exclude_triples,
            only,
            list(EXTRA_COLOURS) if extra else palette,
        )
        colour, shape = combo[0], combo[1]
        if not video and only is None and extra_shapes and shape_rng.random() < extra_shapes:
            shape = EXTRA_SHAPES[int(shape_rng.integers(len(EXTRA_SHAPES)))]
        direction = combo[2] if video else None
        rec = {
            "id": f"d{seed}-{i}",
            "prompt": DESCRIBE_VIDEO if video else DESCRIBE_IMAGE,
            "colour": colour,
            "shape": shape,
            "direction": direction,
            "task": "describe_video" if video else "describe_image",
        }
        fill = EXTRA_COLOURS.get(colour, colour)
        if video:
            frames = moving_shape_clip(
                fill, shape, direction, num_frames=FRAMES, size=IMAGE_SIZE, rng=rng
            )
            rec["video"] = np.stack([np.asarray(f) for f in frames])
        elif shape in EXTRA_SHAPES:
            rec["image"] = draw_extra(fill, shape, size=IMAGE_SIZE, rng=shape_rng, jitter=0.1)
        else:
            rec["image"] = draw_shape(fill, shape, size=IMAGE_SIZE, rng=rng, jitter=0.1)
        first = shape_first > 0 and order_rng.random() < shape_first
        rec["answer"] = describe(colour, shape, direction, rng, first)
        out.append(rec)
    return out


# --- judge data -------------------------------------------------------------------------------
def _negative(kind: str, rec: dict, rng: np.random.Generator, shapes=SHAPES) -> str:
    c, s, d = rec["colour"], rec["shape"], rec["direction"]
    # a wrong colour from the image's own group: palette for palette images, so that
    # "an extra colour's name" is never a shortcut to "No"
    palette = list(COLOURS) if c in COLOURS else list(EXTRA_COLOURS)
    if kind == "colour":
        return describe(other_value(palette, c, rng), s, d, rng)
    if kind in ("shape", "shape_first"):
        return describe(c, other_value(list(shapes), s, rng), d, rng, kind == "shape_first")
    if kind == "direction":
        return describe(c, s, other_value(list(DIRECTIONS), d, rng), rng)
    if kind == "added":  # a false attribute on top of a correct description
        extra = (
            f" moving {other_value(list(DIRECTIONS), d or '', rng)}"
            if d is None
            else f" and a {other_value(palette, c, rng)} one"
        )
        return describe(c, s, d, rng) + extra
    if kind == "missing":
        if d is not None and rng.random() < 0.5:
            return f"a {c} {s}"
        return f"a {s}" if rng.random() < 0.5 else f"something {c}"
    if kind == "repeat":  # one true word, repeated
        word = (c, s, d or c)[int(rng.integers(3))]
        return " ".join([word] * int(rng.integers(2, 6)))
    if kind == "stutter":  # a correct description with a word or a fragment repeated
        words = describe(c, s, d, rng).split()
        k = int(rng.integers(len(words)))
        tail = words[k:] if rng.random() < 0.5 else [words[k][: max(2, len(words[k]) // 2)]]
        return " ".join(words[: k + 1] + tail)
    if kind == "two":  # a correct description followed by another object's
        other = describe(other_value(palette, c, rng), other_value(SHAPES, s, rng), d, rng)
        return describe(c, s, d, rng) + " " + other
    if kind == "garble":  # letters dropped, doubled or swapped in a word or two
        original = describe(c, s, d, rng)
        words = original.split()
        for _ in range(int(rng.integers(1, 3))):
            k = int(rng.integers(len(words)))
            w = list(words[k])
            j = int(rng.integers(len(w)))
            op = int(rng.integers(4))
            if op == 0 and len(w) > 1:
                del w[j]
            elif op == 1:
                w[j:j] = [w[j]] * int(rng.integers(1, 6))
            else:
                w[j] = _LETTERS[int(rng.integers(len(_LETTERS)))]
                if op == 3:
                    w.insert(j, _LETTERS[int(rng.integers(len(_LETTERS)))])
            words[k] = "".join(w)
        garbled = " ".join(words)
        return garbled if garbled != original else garbled + "nn"
    if kind == "conflict":  # the true value and a false one of one attribute
        attr = ("colour", "shape", "direction")[int(rng.integers(3 if d else 2))]
        values = {"colour": palette, "shape": list(SHAPES), "direction": list(DIRECTIONS)}
        wrong = other_value(values[attr], rec[attr], rng)
        first, second = (wrong, rec[attr]) if rng.random() < 0.5 else (rec[attr], wrong)
        if attr == "colour":
            text = f"a {first} {s} that is {second}"
        elif attr == "shape":
            text = f"a {c} {first} that is a {second}"
        else:
            text = f"a {c} {s} moving {first} and {second}"
        return text + (f" moving {d}" if d and attr != "direction" else "")
    if kind == "fragment":  # the noun lost: "a that is purple", "one red moving up"
        options = [f"a that is {c}", f"a {c} that is", f"one {c}", f"a {s} that is"]
        if d:
            options += [f"a {c} moving {d}", f"a that is {c} moving {d}"]
        return options[int(rng.integers(len(options)))]
    if kind == "junk":  # insertions of random letters, attribute words or fillers
        words = describe(c, s, d, rng).split()
        vocab = [*palette, *SHAPES, *DIRECTIONS]
        for _ in range(int(rng.integers(1, 4))):
            kind_of = int(rng.integers(4))
            if kind_of < 2:  # a run of letters, glued to a word or on its own
                junk = "".join(rng.choice(list(_LETTERS), int(rng.integers(2, 9))))
                k = int(rng.integers(len(words)))
                if kind_of == 0:
                    words[k] += junk
                else:
                    words.insert(k + 1, junk)
                continue
            pool = vocab if kind_of == 2 else _FILLERS  # an attribute word or a filler
            word = pool[int(rng.integers(len(pool)))]
            words.insert(int(rng.integers(1, len(words) + 1)), word)
        return " ".join(words)
    if kind == "split":  # a word broken by a space, a fragment or word said twice
        words = describe(c, s, d, rng).split()
        for _ in range(int(rng.integers(1, 3))):
            k = int(rng.integers(len(words)))
            w = words[k]
            if len(w) >= 3 and rng.random() < 0.6:
                j = int(rng.integers(1, len(w) - 1))
                parts = [w[:j], w[j:]]
                if rng.random() < 0.5:
                    parts.append(parts[-1])
                words[k : k + 1] = parts
            else:
                words[k : k + 1] = [w, w]
        return " ".join(words)
    raise ValueError(f"unknown negative kind {kind!r}")


def names_heldout(text: str, rec: dict) -> bool:
    """Whether ``text`` names a colour and a shape (or, for a clip, a colour, a shape and
    a direction) that together make a held-out combination, in any order or object.

    >>> names_heldout("a square that is red", {"direction": None})
    True
    >>> names_heldout("a red circle", {"direction": None})
    False
    """
    words = set(_WORD.findall(text.lower()))
    if any(c in words and s in words for c, s in HELDOUT):
        return True
    return bool(rec.get("direction")) and any(set(t) <= words for t in MOTION_HELDOUT)


def judge_records(
    n: int,
    *,
    seed: int,
    video_fraction: float = 0.25,
    score: bool = False,
    split_negatives: bool = False,
    conflict_negatives: bool = False,
    frames: int = FRAMES,
    negative_weights: dict[str, float] | None = None,
    **kwargs,
) -> list[dict]:
    """``n`` Yes/No records for the description judge: half correct descriptions, half
    negatives cycling through :data:`JUDGE_NEGATIVES` (direction only for clips). Each
    record's "image" is the picture or the clip's frames (a list of PIL images, as the
    GenRM reward sends them) and its "prompt" the judge template filled in (``score``:
    the score variant's, answered "Score: 9" / "Score: 2"; ``split_negatives``: the
    ``split`` kind too, at :data:`SPLIT_WEIGHTS`; ``conflict_negatives``: ``conflict`` and
    ``fragment`` as well, at :data:`CONFLICT_WEIGHTS`; ``negative_weights``: another table of
    the same kinds). A clip is sent as ``frames`` evenly spaced frames, the first and the
    last always among them, as the GenRM reward sends a clip with ``max_frames``. ``kwargs``
    go to :func:`describe_records` (held-out exclusion by default)."""
    if not 2 <= frames <= FRAMES:
        raise ValueError(f"frames must be in [2, {FRAMES}], got {frames}")
    rng = np.random.default_rng([seed, 12])
    base = describe_records(n, seed=seed, video_fraction=video_fraction, **kwargs)
    # with extra shapes drawn, a wrong shape may be any of them too
    shapes = [*SHAPES, *EXTRA_SHAPES] if kwargs.get("extra_shapes") else list(SHAPES)
    out = []
    for i, rec in enumerate(base):
        # alternate within images and within clips (clips are every 4th record at the
        # default fraction, so a plain i % 2 would make every clip a negative)
        positive = (i // 4 + i) % 2 == 0
        if positive:
            answer, kind = describe(rec["colour"], rec["shape"], rec["direction"], rng), None
        else:
            table = negative_weights or (
                CONFLICT_WEIGHTS
                if conflict_negatives
                else SPLIT_WEIGHTS
                if split_negatives
                else NEGATIVE_WEIGHTS
            )
            kinds = [k for k in table if k != "direction" or rec["direction"]]
            weights = np.asarray([table[k] for k in kinds])
            # a wrong value may name a held-out combination: redraw it, and after 20 tries
            # (no wrong value of that kind avoids them) draw another kind
            for attempt in range(200):
                if attempt % 20 == 0:
                    kind = kinds[int(rng.choice(len(kinds), p=weights / weights.sum()))]
                answer = _negative(kind, rec, rng, shapes)
                if not names_heldout(answer, rec):
                    break
            else:
                raise RuntimeError(f"no negative of {rec['id']} avoids the held-out combinations")
        media = clip_frames(rec["video"], frames) if "video" in rec else rec["image"]
        verdict = "Yes" if positive else "No"
        out.append(
            {
                **{k: rec[k] for k in ("id", "colour", "shape", "direction", "task")},
                "image": media,
                "prompt": (SCORE_TEMPLATE if score else JUDGE_TEMPLATE).format(output=answer),
                "output": answer,
                "answer": SCORE_ANSWERS[verdict] if score else verdict,
                "verdict": verdict,
                "negative_type": kind,
            }
        )
    order = rng.permutation(n)
    return [out[i] for i in order]


def clip_frames(video: np.ndarray, frames: int) -> list[Image.Image]:
    """``frames`` evenly spaced frames of a clip, the first and the last always among
    them: what the GenRM reward sends for a clip with ``max_frames=frames``.

    >>> clip = (np.arange(4)[:, None, None, None] * np.ones((4, 2, 2, 3))).astype(np.uint8)
    >>> [int(np.asarray(f)[0, 0, 0]) for f in clip_frames(clip, 2)]
    [0, 3]
    """
    t = len(video)
    if not 2 <= frames:
        raise ValueError(f"frames must be >= 2, got {frames}")
    keep = sorted({round(i * (t - 1) / (min(frames, t) - 1)) for i in range(min(frames, t))})
    return [Image.fromarray(np.asarray(video[j])) for j in keep]
