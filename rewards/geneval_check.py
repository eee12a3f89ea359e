"""The tiny GenEval's independent checker: a rule that reads the image, as GenEval's
object detector does, and grades each prompt correct or incorrect.

It is trained on nothing (no generator's sample, no judge's verdict, no label of any
kind): objects are found by colour, their shape is read from their outline, their
relation from their boxes.

1. **Objects by colour.** Foreground pixels are the saturated, bright ones
   (``image.foreground_mask``); each takes the nearest palette hue. Per hue, the mask is
   opened with a 3x3 cross (ragged rims, one-pixel bridges and specks go) and split into
   4-connected components; a component of at least ``MIN_AREA`` of the image (37 px of
   a 48x48 one) is an object; smaller ones, such as a generator's patch-sized specks,
   are not.
   A component that spans almost the whole frame on both axes (``FRAME_SPAN``) is a
   coloured background, not an object.
2. **Shape** from three numbers of the component's bounding box: the fraction it fills
   and the fill of its top and bottom corner regions (a quarter of the box's side each
   way). A square fills its corners, a circle none of them, the apex-up triangle only the
   bottom ones. The shape is the nearest of the three prototypes, measured once on the
   shapes as :mod:`mmyatt.datasets.shapes` draws them. Unlike the one-object rule
   (``image.classify_shape``, a threshold on box fill alone), a square with a ragged rim
   (box fill under 0.89) is still a square, and an object cut by the frame still counts.
3. **Verdict** per kind (as GenEval's): single: an object of that colour and shape;
   counting: exactly that many of that colour and shape (other objects ignored);
   two_objects: both shapes, any colour; colour_attr: both (colour, shape) objects;
   position: both, and GenEval's relation (``geneval.relations`` on the boxes of the
   largest object of each) includes the prompt's.

Use ``check(image, record)`` for the verdict and the objects found, ``geneval_check``
as a reward function (1.0 / 0.0; log it with weight 0: nothing may train on it) and
``accuracy_by_kind`` for per-kind accuracies.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
from PIL import Image, ImageFilter

from mmyatt.datasets.geneval import KINDS, NUMBERS, RELATIONS, relations
from mmyatt.datasets.shapes import COLOURS, SHAPES, draw_shape
from mmyatt.rewards.image import _frames, _hsv, _nearest_colour, _open, _small, foreground_mask

__all__ = [
    "accuracy_by_kind",
    "check",
    "components",
    "find_objects",
    "geneval_check",
    "parse_prompt",
    "shape_features",
]

# Of the image: smaller components are specks, not objects (37 px of a 48x48 image; the
# task's smallest object, a triangle of half-extent 0.11 x 48, covers about 56 px). A
# generator's patch-sized specks (6x6 = 36 px) would otherwise pass as small squares.
MIN_AREA = 0.016
FRAME_SPAN = 0.9  # a component this wide AND this tall (of the frame) is a background
CORNER = 0.25  # corner regions: this fraction of the box's width and height


def components(mask: np.ndarray) -> list[np.ndarray]:
    """The 4-connected components of a boolean mask, largest first, as boolean masks.

    >>> m = np.zeros((4, 6), bool); m[1:3, 0:2] = True; m[1, 4] = True
    >>> [int(c.sum()) for c in components(m)]
    [4, 1]
    """
    h, w = mask.shape
    big = h * w + 1
    lab = np.where(mask, np.arange(1, h * w + 1).reshape(h, w), big)
    while True:  # every pixel takes the smallest label among itself and its 4 neighbours
        p = np.pad(lab, 1, constant_values=big)
        low = np.minimum.reduce([lab, p[:-2, 1:-1], p[2:, 1:-1], p[1:-1, :-2], p[1:-1, 2:]])
        low = np.where(mask, low, big)
        if np.array_equal(low, lab):
            break
        lab = low
    ids, counts = np.unique(lab[mask], return_counts=True)
    return [lab == i for i in ids[np.argsort(-counts, kind="stable")]]


def shape_features(blob: np.ndarray) -> tuple[float, float, float]:
    """(box fill, top-corner fill, bottom-corner fill) of a component's bounding box."""
    ys, xs = np.nonzero(blob)
    box = blob[ys.min() : ys.max() + 1, xs.min() : xs.max() + 1].astype(np.float64)
    h, w = box.shape
    ch, cw = max(1, round(CORNER * h)), max(1, round(CORNER * w))
    top = (box[:ch, :cw].mean() + box[:ch, -cw:].mean()) / 2
    bottom = (box[-ch:, :cw].mean() + box[-ch:, -cw:].mean()) / 2
    return float(box.mean()), float(top), float(bottom)


@functools.lru_cache(maxsize=1)
def _prototypes() -> dict[str, np.ndarray]:
    """Mean features of each shape as the task draws it, small to large (no jitter),
    sharp and blurred (a generator's edges are soft: a small square's corners round)."""
    out = {}
    for shape in SHAPES:
        feats = []
        for radius in (0.1, 0.14, 0.2, 0.3):
            img = draw_shape("red", shape, size=48, rng=0, jitter=0.0, radius=(radius, radius))
            for blur in (0.0, 0.8):
                mask = foreground_mask(img.filter(ImageFilter.GaussianBlur(blur)) if blur else img)
                feats.append(shape_features(components(mask)[0]))
        out[shape] = np.mean(feats, axis=0)
    return out


def _dilate(mask: np.ndarray) -> np.ndarray:
    p = np.pad(mask, 1)
    return p[1:-1, 1:-1] | p[:-2, 1:-1] | p[2:, 1:-1] | p[1:-1, :-2] | p[1:-1, 2:]


def _classify(blob: np.ndarray) -> str:
    f = np.array(shape_features(blob))
    protos = _prototypes()
    return min(protos, key=lambda s: float(np.sum((protos[s] - f) ** 2)))


def find_objects(image: Image.Image) -> list[dict]:
    """The objects in an image: [{"colour", "shape", "box" (x0, y0, x1, y1), "area"
    (pixels)}], largest first within each colour."""
    img = _small(image)
    fg = foreground_mask(img)
    if not fg.any():
        return []
    h, w = fg.shape
    names = np.full(fg.shape, "", dtype=object)
    names[fg] = _nearest_colour(_hsv(img)[..., 0][fg])
    out = []
    for colour in COLOURS:
        raw = fg & (names == colour)
        if raw.sum() < MIN_AREA * h * w:
            continue
        opened = _open(raw)
        for comp in components(opened if opened.sum() >= MIN_AREA * h * w else raw):
            blob = raw & _dilate(comp)  # the corners the opening cut, without the spurs
            area = int(blob.sum())
            if comp.sum() < MIN_AREA * h * w:
                break  # components come largest first
            ys, xs = np.nonzero(blob)
            x0, y0, x1, y1 = int(xs.min()), int(ys.min()), int(xs.max()) + 1, int(ys.max()) + 1
            if (x1 - x0) >= FRAME_SPAN * w and (y1 - y0) >= FRAME_SPAN * h:
                continue
            out.append(
                {"colour": colour, "shape": _classify(blob), "box": (x0, y0, x1, y1), "area": area}
            )
    return out


# --- prompts -------------------------------------------------------------------------
_PLURALS = {s + "s": s for s in SHAPES}
_NUMBER_WORDS = {w: n for n, w in NUMBERS.items()}


def _phrase(words: list[str]) -> dict:
    """'red circle' / 'circle' -> {"colour", "shape", "count": 1}."""
    colour = next((w for w in words if w in COLOURS), None)
    shape = next((w for w in words if w in SHAPES), None)
    if shape is None:
        raise ValueError(f"no shape in {' '.join(words)!r}")
    return {"colour": colour, "shape": shape, "count": 1}


def parse_prompt(prompt: str) -> dict:
    """A prompt's scene spec {"kind", "objects", "relation"}, read from its words alone.

    >>> parse_prompt("three red circles")["objects"]
    [{'colour': 'red', 'shape': 'circle', 'count': 3}]
    >>> p = parse_prompt("a red circle left of a blue square")
    >>> p["kind"], p["relation"], [o["shape"] for o in p["objects"]]
    ('position', 'left of', ['circle', 'square'])
    """
    text = " ".join(prompt.lower().replace(",", " ").split())
    for rel in RELATIONS:
        if f" {rel} " in f" {text} ":
            a, b = text.split(f" {rel} ", 1)
            return {
                "kind": "position",
                "objects": [_phrase(a.split()), _phrase(b.split())],
                "relation": rel,
            }
    if " and " in text:
        objs = [_phrase(part.split()) for part in text.split(" and ", 1)]
        kind = "colour_attr" if all(o["colour"] for o in objs) else "two_objects"
        return {"kind": kind, "objects": objs, "relation": None}
    words = text.split()
    if words and words[0] in _NUMBER_WORDS:
        obj = _phrase([_PLURALS.get(w, w) for w in words[1:]])
        obj["count"] = _NUMBER_WORDS[words[0]]
        return {"kind": "counting", "objects": [obj], "relation": None}
    return {"kind": "single", "objects": [_phrase(words)], "relation": None}


# --- verdicts ------------------------------------------------------------------------
def _matches(objects: list[dict], want: dict) -> list[dict]:
    return [
        o
        for o in objects
        if o["shape"] == want["shape"] and (not want.get("colour") or o["colour"] == want["colour"])
    ]


def check(image: Image.Image, record: dict) -> dict[str, Any]:
    """Grade one image against its prompt: {"correct", "kind", "found" (objects),
    "reason"}. The spec comes from the record's "kind" / "objects" / "relation" keys,
    else from parsing its "prompt"."""
    spec = record if "objects" in record and "kind" in record else parse_prompt(record["prompt"])
    kind, want = spec["kind"], spec["objects"]
    found = find_objects(image)
    hits = [_matches(found, w) for w in want]
    if kind == "counting":
        n = len(hits[0])
        ok, reason = n == int(want[0]["count"]), f"{n} found"
    elif kind in ("single", "two_objects", "colour_attr"):
        missing = [_label(w) for w, h in zip(want, hits) if not h]
        ok, reason = not missing, ("missing " + ", ".join(missing)) if missing else "all found"
    elif kind == "position":
        if not all(hits):
            missing = [_label(w) for w, h in zip(want, hits) if not h]
            ok, reason = False, "missing " + ", ".join(missing)
        else:
            rel = relations(hits[0][0]["box"], hits[1][0]["box"])
            ok = spec["relation"] in rel
            reason = "relation " + (", ".join(sorted(rel)) or "none")
    else:
        raise ValueError(f"unknown kind {kind!r}; expected one of {KINDS}")
    return {"correct": bool(ok), "kind": kind, "found": found, "reason": reason}


def _label(o: dict) -> str:
    return f"{o['colour']} {o['shape']}" if o.get("colour") else o["shape"]


def geneval_check(output: Any, record: dict) -> float:
    """1.0 if the checker grades the image correct for the record's prompt, else 0.0
    (mean over frames for clips). A check from outside: log it with weight 0."""
    frames = _frames(output)
    return float(np.mean([check(f, record)["correct"] for f in frames]))


def accuracy_by_kind(
    records: Sequence[dict], correct: Iterable[bool | float]
) -> dict[str, float | int]:
    """{"overall", each kind present, "n"}: mean correctness overall and per kind.

    >>> accuracy_by_kind([{"kind": "single"}, {"kind": "position"}], [1.0, 0.0])
    {'overall': 0.5, 'single': 1.0, 'position': 0.0, 'n': 2}
    """
    values = [float(c) for c in correct]
    if len(values) != len(records):
        raise ValueError(f"{len(values)} verdicts for {len(records)} records")
    out: dict[str, float | int] = {"overall": float(np.mean(values)) if values else float("nan")}
    for kind in KINDS:
        v = [c for r, c in zip(records, values) if r["kind"] == kind]
        if v:
            out[kind] = float(np.mean(v))
    out["n"] = len(values)
    return out
