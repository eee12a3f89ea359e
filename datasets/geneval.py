"""A tiny GenEval: text-to-image prompts that ask for counts, two objects, colours bound
to objects and positions, on 48x48 images of coloured shapes.

GenEval (Ghosh et al., 2023) grades a text-to-image model with an object detector on six
kinds of prompt; this task keeps five, with the colours and shapes of
:mod:`mmyatt.datasets.shapes` as its objects:

=============  ======================================  ====================================
kind           prompt                                  correct when the image shows
=============  ======================================  ====================================
single         "a red circle"                          a red circle (GenEval's single
                                                       object and colour kinds in one)
counting       "three red circles" (one to four)       exactly that many red circles
two_objects    "a circle and a square"                 a circle and a square, any colours
colour_attr    "a red circle and a blue square"        a red circle and a blue square
position       "a red circle left of a blue square"    both, in that relation (left of,
               (left of, right of, above, below)       right of, above, below; GenEval's
                                                       rule on the centres, ``relations``)
=============  ======================================  ====================================

Every prompt has a deterministic **scene spec** (``spec``: kind, objects with colour,
shape and count, relation) and :func:`draw_scene` draws a scene from a spec with
:mod:`~mmyatt.datasets.shapes`' painter (solid shapes on the dark background,
supersampled), returning the drawn objects too: pretraining images for the generator and
judge data labelled by how they were drawn.

**Held-out combinations** (``HELDOUT_TEST`` / ``HELDOUT_VAL``): per kind, combinations of
colour, shape, count and relation that no training record has: (colour, shape) pairs for
single (``shapes.HELDOUT_TEST`` / ``VAL``), (count, colour, shape) for counting, ordered
shape pairs for two_objects, (colour, shape, colour, shape) for colour_attr and (colour,
shape, relation, colour, shape) for position. They are picked once from a seeded
permutation of each kind's combinations (``_heldout``); test and validation are disjoint.
A held-out combination is new as a whole: its words, and each of its parts in other
combinations, appear in training. RL trains on ``train.jsonl``; the judge never sees a
scene drawn from a held-out prompt (``judge_records``); validation chooses, test reports.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw

from .shapes import (
    BACKGROUND,
    COLOURS,
    HELDOUT_TEST,
    HELDOUT_VAL,
    SHAPES,
    SUPERSAMPLE,
    mix_eval_split,
    paint_shape,
    write_splits,
)

__all__ = [
    "IMAGE_SIZE",
    "KINDS",
    "NUMBERS",
    "RELATIONS",
    "HELDOUT_TEST_GENEVAL",
    "HELDOUT_VAL_GENEVAL",
    "combos",
    "draw_scene",
    "geneval_records",
    "is_heldout",
    "judge_questions",
    "judge_records",
    "make_record",
    "relations",
    "vocab",
    "write_geneval_task",
]

IMAGE_SIZE = 48
KINDS: tuple[str, ...] = ("single", "counting", "two_objects", "colour_attr", "position")
NUMBERS: dict[int, str] = {1: "one", 2: "two", 3: "three", 4: "four"}
RELATIONS: tuple[str, ...] = ("left of", "right of", "above", "below")
POSITION_THRESHOLD = 0.1  # GenEval's: offsets within 0.1 x (both box sides) count as none
# half-extent as a fraction of the image: one object is drawn large, several smaller
RADIUS_SINGLE = (0.16, 0.24)
RADIUS_MANY = (0.11, 0.15)
_GAP = 2.0  # pixels kept free between the bounding boxes of two objects
# How many combinations of each kind are held out for test and (as many) for validation.
_N_HELDOUT = {"counting": 8, "two_objects": 1, "colour_attr": 12, "position": 24}


def _plural(shape: str) -> str:
    return shape + "s"


def combos(kind: str) -> list[tuple]:
    """Every combination of a kind, in a fixed order.

    >>> len(combos("single")), len(combos("counting")), len(combos("two_objects"))
    (18, 72, 6)
    >>> len(combos("colour_attr")), len(combos("position"))
    (180, 720)
    """
    cs, ss = list(COLOURS), list(SHAPES)
    if kind == "single":
        return [(c, s) for c in cs for s in ss]
    if kind == "counting":
        return [(n, c, s) for n in NUMBERS for c in cs for s in ss]
    if kind == "two_objects":
        return [(a, b) for a in ss for b in ss if a != b]
    pairs = [(ca, sa, cb, sb) for sa in ss for sb in ss if sa != sb for ca in cs for cb in cs]
    pairs = [p for p in pairs if p[0] != p[2]]
    if kind == "colour_attr":
        return pairs
    if kind == "position":
        return [(ca, sa, r, cb, sb) for ca, sa, cb, sb in pairs for r in RELATIONS]
    raise ValueError(f"unknown kind {kind!r}; expected one of {KINDS}")


def _heldout(split: str) -> dict[str, tuple]:
    out = {"single": tuple(HELDOUT_TEST if split == "test" else HELDOUT_VAL)}
    for k, kind in enumerate(KINDS[1:]):
        every = combos(kind)
        order = np.random.default_rng([53, k]).permutation(len(every))
        n = _N_HELDOUT[kind]
        pick = order[:n] if split == "test" else order[n : 2 * n]
        out[kind] = tuple(every[i] for i in sorted(pick))
    return out


HELDOUT_TEST_GENEVAL: dict[str, tuple] = _heldout("test")
HELDOUT_VAL_GENEVAL: dict[str, tuple] = _heldout("val")


def is_heldout(kind: str, combo: tuple, split: str | None = None) -> bool:
    """Whether ``combo`` of ``kind`` is held out (``split``: "test", "val", or None for
    either)."""
    splits = ("test", "val") if split is None else (split,)
    held = {"test": HELDOUT_TEST_GENEVAL, "val": HELDOUT_VAL_GENEVAL}
    return any(tuple(combo) in held[s][kind] for s in splits)


# --- prompts, scene specs and the judge's questions ------------------------------------
def _obj(colour: str | None, shape: str, count: int = 1) -> dict:
    return {"colour": colour, "shape": shape, "count": count}


def _prompt(kind: str, combo: tuple) -> tuple[str, list[dict], str | None]:
    if kind == "single":
        c, s = combo
        return f"a {c} {s}", [_obj(c, s)], None
    if kind == "counting":
        n, c, s = combo
        noun = s if n == 1 else _plural(s)
        return f"{NUMBERS[n]} {c} {noun}", [_obj(c, s, n)], None
    if kind == "two_objects":
        a, b = combo
        return f"a {a} and a {b}", [_obj(None, a), _obj(None, b)], None
    if kind == "colour_attr":
        ca, sa, cb, sb = combo
        return f"a {ca} {sa} and a {cb} {sb}", [_obj(ca, sa), _obj(cb, sb)], None
    ca, sa, r, cb, sb = combo
    return f"a {ca} {sa} {r} a {cb} {sb}", [_obj(ca, sa), _obj(cb, sb)], r


def judge_questions(kind: str, objects: list[dict], relation: str | None) -> list[tuple[str, str]]:
    """The two (question, expected answer) pairs the GenRM judge is asked about a sample
    of this prompt (GenRM ``mode: vqa``, combined by product).

    >>> judge_questions("counting", [_obj("red", "circle", 3)], None)
    [('How many red circles?', '3'), ('Is there a red circle?', 'Yes')]
    """
    a = objects[0]
    if kind == "single":
        return [
            (f"Is there a {a['colour']} {a['shape']}?", "Yes"),
            (f"What colour is the {a['shape']}?", a["colour"]),
        ]
    if kind == "counting":
        return [
            (
                COUNT_QUESTION.format(colour=a["colour"], shapes=_plural(a["shape"])),
                str(a["count"]),
            ),
            (f"Is there a {a['colour']} {a['shape']}?", "Yes"),
        ]
    b = objects[1]
    if kind == "two_objects":
        return [(f"Is there a {a['shape']}?", "Yes"), (f"Is there a {b['shape']}?", "Yes")]
    if kind == "colour_attr":
        return [
            (f"What colour is the {a['shape']}?", a["colour"]),
            (f"What colour is the {b['shape']}?", b["colour"]),
        ]
    return [
        (POSITION_QUESTION.format(a=_name(a), relation=relation, b=_name(b)), "Yes"),
        (f"Is there a {b['colour']} {b['shape']}?", "Yes"),
    ]


COUNT_QUESTION = "How many {colour} {shapes}?"
POSITION_QUESTION = "Is the {a} {relation} the {b}?"


def _name(o: dict) -> str:
    return f"{o['colour']} {o['shape']}" if o.get("colour") else o["shape"]


def make_record(kind: str, combo: tuple, rid: str, split: str | None = None) -> dict:
    """A prompt record: "prompt", "kind" (and "task", the same), "combo", the scene spec ("objects",
    "relation"), "colour" and "shape" of the first object (what the one-object rules
    read), the judge's questions "q1", "a1", "q2", "a2", "id" (and "split")."""
    prompt, objects, relation = _prompt(kind, combo)
    (q1, a1), (q2, a2) = judge_questions(kind, objects, relation)
    rec = {
        "prompt": prompt,
        "kind": kind,
        "task": kind,  # eval figures per kind (eval/heldout/<kind>/reward/...)
        "combo": list(combo),
        "objects": objects,
        "relation": relation,
        "colour": objects[0]["colour"] or "",
        "shape": objects[0]["shape"],
        "q1": q1,
        "a1": a1,
        "q2": q2,
        "a2": a2,
        "id": rid,
    }
    if split is not None:
        rec["split"] = split
    return rec


def spec(record: dict) -> dict:
    """The scene spec of a record: {"kind", "objects", "relation"}."""
    return {k: record[k] for k in ("kind", "objects", "relation")}


def vocab() -> list[str]:
    """Every word of the prompts (the generator's tokenizer vocabulary)."""
    words = ["a", "and", "of", *COLOURS, *SHAPES, *map(_plural, SHAPES), *NUMBERS.values()]
    return words + ["left", "right", "above", "below"]


# --- drawing -------------------------------------------------------------------------
def relations(box_a, box_b, threshold: float = POSITION_THRESHOLD) -> set[str]:
    """GenEval's relations of object a to object b from their boxes (x0, y0, x1, y1; y
    down): the centre offset, each axis shrunk by ``threshold`` x (the two boxes' sides),
    normalised by the offset's length; a component under -0.5 / over 0.5 gives left of /
    right of (x) and above / below (y).

    >>> sorted(relations((0, 0, 10, 10), (20, 2, 30, 12)))
    ['left of']
    >>> relations((0, 0, 10, 10), (1, 1, 11, 11))
    set()
    """
    a, b = np.asarray(box_a, dtype=float), np.asarray(box_b, dtype=float)
    ca, cb = (a[:2] + a[2:]) / 2, (b[:2] + b[2:]) / 2
    dims = (a[2:] - a[:2]) + (b[2:] - b[:2])
    offset = ca - cb
    norm = float(np.linalg.norm(offset))
    revised = np.maximum(np.abs(offset) - threshold * dims, 0.0) * np.sign(offset)
    if norm == 0.0 or np.all(np.abs(revised) < 1e-3):
        return set()
    dx, dy = revised / norm
    out = set()
    if dx < -0.5:
        out.add("left of")
    if dx > 0.5:
        out.add("right of")
    if dy < -0.5:
        out.add("above")
    if dy > 0.5:
        out.add("below")
    return out


def _box(o: dict) -> tuple[float, float, float, float]:
    return (o["cx"] - o["r"], o["cy"] - o["r"], o["cx"] + o["r"], o["cy"] + o["r"])


def _instances(scene: dict, rng: np.random.Generator) -> list[dict]:
    """One entry per object to draw (counts expanded, free colours drawn)."""
    out = []
    taken = {o["colour"] for o in scene["objects"] if o.get("colour")}
    for o in scene["objects"]:
        colour = o.get("colour")
        if not colour:  # two_objects: any colour, different from the other object's
            free = [c for c in COLOURS if c not in taken]
            colour = free[int(rng.integers(len(free)))]
            taken.add(colour)
        out += [{"colour": colour, "shape": o["shape"]} for _ in range(int(o.get("count", 1)))]
    return out


def _place(objs: list[dict], size: int, rng, relation: str | None, radius) -> bool:
    """Draw radii and centres (boxes ``_GAP`` apart, inside the frame; with a relation,
    object 0 is in exactly that relation to object 1). False if no layout was found."""
    for _ in range(400):
        for o in objs:
            o["r"] = size * float(rng.uniform(*radius))
            lo, hi = o["r"] + 1.0, size - o["r"] - 1.0
            o["cx"], o["cy"] = (float(v) for v in rng.uniform(lo, hi, size=2))
        if any(
            max(abs(p["cx"] - q["cx"]), abs(p["cy"] - q["cy"])) < p["r"] + q["r"] + _GAP
            for i, p in enumerate(objs)
            for q in objs[i + 1 :]
        ):
            continue
        if relation is None or relations(_box(objs[0]), _box(objs[1])) == {relation}:
            return True
    return False


def draw_scene(
    scene: dict, *, size: int = IMAGE_SIZE, rng: np.random.Generator | int | None = None
) -> tuple[Image.Image, list[dict]]:
    """Draw a scene spec ({"kind", "objects", "relation"}, e.g. a record): the image and
    the drawn objects [{"colour", "shape", "cx", "cy", "r"}] (pixels, y down).

    One object gets a half-extent of ``RADIUS_SINGLE`` x size, several ``RADIUS_MANY``;
    no two objects' boxes touch; a relation holds exactly by :func:`relations`.

    >>> img, objs = draw_scene(make_record("counting", (3, "red", "circle"), "x"), rng=0)
    >>> img.size, [o["shape"] for o in objs]
    ((48, 48), ['circle', 'circle', 'circle'])
    """
    g = rng if isinstance(rng, np.random.Generator) else np.random.default_rng(rng)
    objs = _instances(scene, g)
    radius = RADIUS_SINGLE if len(objs) == 1 else RADIUS_MANY
    while not _place(objs, size, g, scene.get("relation"), radius):
        radius = (radius[0] * 0.9, radius[1] * 0.9)  # crowded: smaller objects
    k = SUPERSAMPLE
    img = Image.new("RGB", (size * k, size * k), BACKGROUND)
    draw = ImageDraw.Draw(img)
    for o in objs:
        paint_shape(draw, o["shape"], o["cx"] * k, o["cy"] * k, o["r"] * k, COLOURS[o["colour"]])
    return img.resize((size, size), Image.BOX), objs


# --- records and splits ----------------------------------------------------------------
def geneval_records(
    n: int, seed: int, *, heldout: str | None = None, kinds: tuple[str, ...] = KINDS
) -> list[dict]:
    """``n`` prompt records, kinds in turn. ``heldout`` None: combinations drawn uniformly
    from each kind's trainable ones (held out for neither split); "test" / "val":
    round-robin over that split's held-out combinations of each kind."""
    g = np.random.default_rng([seed, 53])
    pools = {}
    for kind in kinds:
        if heldout is None:
            pools[kind] = [c for c in combos(kind) if not is_heldout(kind, c)]
        else:
            held = HELDOUT_TEST_GENEVAL if heldout == "test" else HELDOUT_VAL_GENEVAL
            pools[kind] = list(held[kind])
    out = []
    for i in range(n):
        kind = kinds[i % len(kinds)]
        pool = pools[kind]
        j = (i // len(kinds)) % len(pool) if heldout else int(g.integers(len(pool)))
        out.append(make_record(kind, pool[j], f"geneval-{seed}-{i}"))
    return out


def write_geneval_task(
    out_dir: str | Path, *, n_train: int = 2000, n_eval: int = 80, seed: int = 0
) -> dict[str, Path]:
    """Write ``train.jsonl`` (trainable combinations only), ``test.jsonl`` and
    ``val.jsonl`` (``n_eval`` records of that split's held-out combinations, "split":
    "heldout", every kind equally often, then ``n_eval // 2`` of trained ones, "seen",
    interleaved two held-out to one seen, as ``shapes.write_shape_task``). Test and
    validation come from their own seeds. Returns {"train", "test", "val"} paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    splits = {"train": geneval_records(n_train, seed)}
    for k, name in enumerate(("test", "val")):
        base = seed + 1 + 2 * k
        held = [{**r, "split": "heldout"} for r in geneval_records(n_eval, base, heldout=name)]
        seen = [{**r, "split": "seen"} for r in geneval_records(n_eval // 2, base + 1)]
        for r in held + seen:
            r["id"] = f"{name}-{r['id']}"
        splits[name] = mix_eval_split(held, seen)
    return write_splits(out, splits)


# --- judge data: drawn scenes, questions answered from the drawing ------------------------
def _count(objs: list[dict], colour: str | None, shape: str) -> int:
    return sum(o["shape"] == shape and (colour is None or o["colour"] == colour) for o in objs)


def _random_scene(g: np.random.Generator) -> dict:
    """A scene of 1-4 random objects (no prompt's spec): negatives and crowded counts."""
    objs = [
        _obj(list(COLOURS)[int(g.integers(6))], SHAPES[int(g.integers(3))])
        for _ in range(int(g.integers(1, 5)))
    ]
    return {"kind": "random", "objects": objs, "relation": None}


def _is_heldout_scene(objs: list[dict], relation: str | None) -> bool:
    """Whether the drawn objects are exactly what some held-out prompt asks for."""
    keys = sorted((o["colour"], o["shape"]) for o in objs)
    n = len(objs)
    if n == 1:
        return is_heldout("single", keys[0])
    shapes_ = {s for _, s in keys}
    if len(shapes_) == 1 and len(set(keys)) == 1 and is_heldout("counting", (n, *keys[0])):
        return True
    if n == 2 and len(shapes_) == 2:
        (ca, sa), (cb, sb) = (
            (objs[0]["colour"], objs[0]["shape"]),
            (
                objs[1]["colour"],
                objs[1]["shape"],
            ),
        )
        if is_heldout("two_objects", (sa, sb)) or is_heldout("two_objects", (sb, sa)):
            return True
        if is_heldout("colour_attr", (ca, sa, cb, sb)) or is_heldout(
            "colour_attr", (cb, sb, ca, sa)
        ):
            return True
        rel = relations(_box(objs[0]), _box(objs[1]))
        back = relations(_box(objs[1]), _box(objs[0]))
        if any(is_heldout("position", (ca, sa, r, cb, sb)) for r in rel):
            return True
        if any(is_heldout("position", (cb, sb, r, ca, sa)) for r in back):
            return True
    return False


def judge_records(n: int, *, seed: int, size: int = IMAGE_SIZE) -> list[dict]:
    """``n`` judge SFT records {"prompt" (a question), "image", "answer", "task"} about
    drawn scenes, answered from how the scene was drawn. Scenes: half drawn from training
    prompts (trainable combinations), half random scenes of 1-4 objects; any scene whose
    drawn objects are exactly a held-out prompt of either split (of any kind, in any
    layout that prompt would accept) is redrawn, so no image the judge sees answers a
    held-out prompt. Questions cycle through: count ("How many red circles? ..." -> "0"
    to "4"), presence ("Is there a red circle?" / "Is there a circle?"), colour ("What
    colour is the circle?", asked where exactly one circle is drawn) and position ("Is the
    red circle left of the blue square?", about two drawn objects, their true relation
    or another, or naming an absent object -> "No")."""
    g = np.random.default_rng([seed, 54])
    train_prompts = geneval_records(max(64, n), seed + 7)
    tasks = ("count", "there", "colour", "position")
    out = []
    i = 0
    while len(out) < n:
        task = tasks[i % len(tasks)]
        i += 1
        scene = train_prompts[int(g.integers(len(train_prompts)))] if g.random() < 0.5 else None
        if scene is None:
            scene = _random_scene(g)
        image, objs = draw_scene(scene, size=size, rng=g)
        if _is_heldout_scene(objs, scene.get("relation")):
            continue
        q = _question(task, objs, g)
        if q is None:
            continue
        out.append({"id": f"gj{seed}-{len(out)}", "image": image, "task": task, **q})
    return out


def _question(task: str, objs: list[dict], g: np.random.Generator) -> dict | None:
    colours, present = list(COLOURS), objs[int(g.integers(len(objs)))]
    if task == "count":
        c, s = (
            (present["colour"], present["shape"])
            if g.random() < 0.7
            else (colours[int(g.integers(6))], SHAPES[int(g.integers(3))])
        )
        prompt = COUNT_QUESTION.format(colour=c, shapes=_plural(s))
        return {"prompt": prompt, "answer": str(_count(objs, c, s))}
    if task == "there":
        with_colour = g.random() < 0.6
        if g.random() < 0.5:
            c, s = present["colour"], present["shape"]
        else:
            c, s = colours[int(g.integers(6))], SHAPES[int(g.integers(3))]
        c = c if with_colour else None
        name = f"{c} {s}" if c else s
        return {"prompt": f"Is there a {name}?", "answer": "Yes" if _count(objs, c, s) else "No"}
    if task == "colour":
        shapes_ = [s for s in SHAPES if _count(objs, None, s) == 1]
        if not shapes_:
            return None
        s = shapes_[int(g.integers(len(shapes_)))]
        colour = next(o["colour"] for o in objs if o["shape"] == s)
        return {"prompt": f"What colour is the {s}?", "answer": colour}
    # position: about a uniquely named pair of drawn objects, or one that is absent
    unique = [o for o in objs if _count(objs, o["colour"], o["shape"]) == 1]
    if len(unique) < 2:
        return None
    ia, ib = g.choice(len(unique), size=2, replace=False)
    a, b = dict(unique[ia]), dict(unique[ib])
    truth = relations(_box(a), _box(b))
    r = RELATIONS[int(g.integers(4))]
    if truth and g.random() < 0.5:
        r = sorted(truth)[int(g.integers(len(truth)))]
    answer = "Yes" if r in truth else "No"
    if g.random() < 0.2:  # name an object that is not drawn: "No" whatever the layout
        which = a if g.random() < 0.5 else b
        which["colour"] = next(
            c
            for c in (colours[int(j)] for j in g.permutation(6))
            if not _count(objs, c, which["shape"])
        )
        answer = "No"
    prompt = POSITION_QUESTION.format(a=_name(a), relation=r, b=_name(b))
    return {"prompt": prompt, "answer": answer}


def heldout_judge_records(n: int, *, seed: int, split: str, size: int = IMAGE_SIZE) -> list[dict]:
    """Judge records about scenes drawn for ``split``'s held-out prompts (to choose a
    judge on, "val", or report it, "test"; never to train one): the prompt's own two
    questions (answered as the prompt asks, which the drawing fulfils) alternating with a
    question of ``judge_records``' kinds answered from the drawing."""
    g = np.random.default_rng([seed, 55])
    prompts = geneval_records(max(n, 50), seed, heldout=split)
    tasks = ("count", "there", "colour", "position")
    out: list[dict] = []
    i = 0
    while len(out) < n:
        rec = prompts[i % len(prompts)]
        image, objs = draw_scene(rec, size=size, rng=g)
        if i % 2 == 0:
            k = (i // 2) % 2 + 1
            q = {"prompt": rec[f"q{k}"], "answer": rec[f"a{k}"]}
            task = f"prompt_{rec['kind']}"
        else:
            task = tasks[(i // 2) % len(tasks)]
            q = _question(task, objs, g)
        i += 1
        if q is not None:
            out.append({"id": f"gh{split}{seed}-{len(out)}", "image": image, "task": task, **q})
    return out
