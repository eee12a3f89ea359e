"""The independent check of the VLM + GenRM recipe: an answer's words against the record's
ground truth.

Each attribute (colour, shape and, for a clip, direction) counts when its true value is
named and no other value of it is; a false value of any attribute (a second colour, a
direction for a still image) makes the whole answer wrong. Rule-based, and read by no
training of the judge (``datasets/describe.py`` draws the judge's data from ground truth,
labelled by how each record was drawn). The recipe logs these with weight 0 beside the
judge's reward (``rewards/rules.py``: ``describe_check``, ``describe_false_claims``,
``answer_words``, ``describe_colour``, ``describe_shape``, ``describe_direction``).
"""

from __future__ import annotations

import re

from .describe import _WORD, EXTRA_COLOURS
from .factored_shapes import EXTRA_SHAPES
from .shapes import COLOURS, DIRECTIONS, SHAPES

_VALUES = {  # every value a description may name (a star named for a circle is false)
    "colour": (*COLOURS, *EXTRA_COLOURS),
    "shape": (*SHAPES, *EXTRA_SHAPES),
    "direction": tuple(DIRECTIONS),
}


def _named(text: str) -> dict[str, list[str]]:
    words = _WORD.findall(text.lower())
    return {k: [w for w in words if w in v] for k, v in _VALUES.items()}


def check_details(answer: str, record: dict) -> dict:
    """{"correct": attributes named right, "attributes": how many the record has,
    "false": false values named (wrong colour/shape/direction, or a direction for an
    image), "score": correct / attributes, or 0 when anything false is named}.

    >>> rec = {"colour": "red", "shape": "circle", "direction": None}
    >>> check_details("a red circle", rec)["score"], check_details("red red circle", rec)["score"]
    (1.0, 1.0)
    >>> check_details("a circle", rec)["score"], check_details("a blue circle", rec)["score"]
    (0.5, 0.0)
    >>> check_details("a red circle moving left", rec)["false"]
    1
    """
    named = _named(answer)
    keys = ("colour", "shape") + (("direction",) if record.get("direction") else ())
    correct = sum(1 for k in keys if record[k] in named[k])
    false = sum(1 for k in keys for w in set(named[k]) if w != record[k])
    if not record.get("direction"):
        false += len(set(named["direction"]))
    score = 0.0 if false else correct / len(keys)
    return {"correct": correct, "attributes": len(keys), "false": false, "score": score}


def description_check(completion: str, record: dict) -> float:
    """The independent check's score in [0, 1] (:func:`check_details`)."""
    return check_details(completion, record)["score"]


def attribute_right(completion: str, record: dict, attribute: str) -> float:
    """1.0 when the answer names the record's true value of ``attribute`` and no other
    value of it, else 0.0: the check split by attribute, so that a policy that reads
    colour better while naming shapes from colour alone shows there.

    >>> rec = {"colour": "yellow", "shape": "circle", "direction": None}
    >>> [attribute_right(a, rec, "shape") for a in ("the yellow circle", "the yellow square", "a yellow")]
    [1.0, 0.0, 0.0]
    >>> attribute_right("a yellow circle that is red", rec, "colour")
    0.0
    """
    named = set(_named(completion)[attribute])
    return float(named == {record[attribute]})


def colour_right(completion: str, record: dict) -> float:
    """:func:`attribute_right` for the colour."""
    return attribute_right(completion, record, "colour")


def shape_right(completion: str, record: dict) -> float:
    """:func:`attribute_right` for the shape."""
    return attribute_right(completion, record, "shape")


def direction_right(completion: str, record: dict) -> float:
    """:func:`attribute_right` for a clip's direction; for an image (no direction), 1.0
    when the answer names none: whether a policy reads motion, apart from colour and shape.

    >>> clip = {"colour": "red", "shape": "circle", "direction": "up"}
    >>> [direction_right(a, clip) for a in ("a red square moving up", "a red circle moving left")]
    [1.0, 0.0]
    >>> direction_right("a red circle", {"colour": "red", "shape": "circle", "direction": None})
    1.0
    """
    if not record.get("direction"):
        return float(not _named(completion)["direction"])
    return attribute_right(completion, record, "direction")


def false_claims(completion: str, record: dict) -> float:
    """How many false attribute values the answer names (:func:`check_details`)."""
    return float(check_details(completion, record)["false"])


def answer_words(completion: str, record: dict) -> float:
    """Answer length in words: a policy padding its answers shows here.

    >>> answer_words("a red  circle", {})
    3.0
    """
    return float(len(completion.split()))


# --- well-formedness -------------------------------------------------------------------------
# What counts as a description: an optional article, the colour and the shape in either
# order ("a red circle", "a circle that is red") and, for a clip only, how it moves
# ("moving up", "that moves up", "going up"), nothing else. The SFT targets' phrasings
# (``describe.IMAGE_PHRASES`` / ``VIDEO_PHRASES``) all parse; a word glued to junk
# ("squaremognnin"), a second value of an attribute, a missing one, a direction named for
# a still image or a stray word do not.
def _alternatives(values) -> str:
    return "|".join(sorted(map(re.escape, values), key=len, reverse=True))


_COLOUR = f"(?:{_alternatives(_VALUES['colour'])})"
_SHAPE = f"(?:{_alternatives(_VALUES['shape'])})"
_DIRECTION = f"(?:{_alternatives(_VALUES['direction'])})"
_ARTICLE = r"(?:(?:a|an|one|the)(?: single)? )?"
_NOUN_PHRASE = (
    f"{_ARTICLE}(?:(?P<c1>{_COLOUR}) (?P<s1>{_SHAPE})"
    f"|(?P<s2>{_SHAPE}) (?:that|which) is (?P<c2>{_COLOUR}))"
)
_MOTION = (
    rf" (?:moving|going|heading|that moves|which moves|that goes|moves|goes) (?P<d>{_DIRECTION})"
)
_IMAGE_DESCRIPTION = re.compile(f"{_NOUN_PHRASE}\\.?")
_CLIP_DESCRIPTION = re.compile(f"{_NOUN_PHRASE}{_MOTION}\\.?")


def parse_description(text: str, clip: bool) -> dict[str, str | None] | None:
    """{"colour", "shape", "direction"} of a well-formed description, or None: the whole
    text (case and runs of spaces aside) must be one of the phrasings above, with a
    direction for a clip and none for an image.

    >>> parse_description("a circle that is red", clip=False)
    {'colour': 'red', 'shape': 'circle', 'direction': None}
    >>> parse_description("a cyan squaremognnin up", clip=True) is None
    True
    """
    normal = " ".join(text.lower().split())
    m = (_CLIP_DESCRIPTION if clip else _IMAGE_DESCRIPTION).fullmatch(normal)
    if m is None:
        return None
    return {
        "colour": m["c1"] or m["c2"],
        "shape": m["s1"] or m["s2"],
        "direction": m["d"] if clip else None,
    }


def wellformed(completion: str, record: dict) -> float:
    """1.0 when the answer parses as a description (:func:`parse_description`; a clip
    when the record has a direction), else 0.0. It reads the form, not the truth: "a blue
    square" of a red circle is well formed. The recipe's guard against malformed text.

    >>> clip = {"colour": "cyan", "shape": "square", "direction": "up"}
    >>> wellformed("a cyan square moving up", clip), wellformed("a cyan squaremognnin up", clip)
    (1.0, 0.0)
    """
    return float(parse_description(completion, bool(record.get("direction"))) is not None)


def strict_check(completion: str, record: dict) -> float:
    """The independent check (:func:`description_check`) of a well-formed answer, 0.0 for
    one that does not parse (:func:`wellformed`): "a red circlemoving up" names the right
    colour and shape and the check alone pays it; this does not. The warm start's stopping
    check, so that SFT does not stop before its clip answers are words.

    >>> clip = {"colour": "red", "shape": "circle", "direction": "up"}
    >>> description_check("a red circle movnvng up", clip), strict_check("a red circle movnvng up", clip)
    (1.0, 0.0)
    """
    return description_check(completion, record) * wellformed(completion, record)


def warm_start_check(completion: str, record: dict, clip_share: float = 0.25) -> float:
    """:func:`strict_check` weighted so that, over records of which ``clip_share`` are
    clips (the task's default), images and clips count half each: the SFT warm start's
    stopping check. Read over the plain mix, a warm start whose every clip answer is
    malformed passes on its images alone (three records in four).

    >>> clip = {"colour": "red", "shape": "circle", "direction": "up"}
    >>> warm_start_check("a red circle moving up", clip), warm_start_check("a red circle", {**clip, "direction": None})
    (2.0, 0.6666666666666666)
    """
    weight = 0.5 / clip_share if record.get("direction") else 0.5 / (1.0 - clip_share)
    return weight * strict_check(completion, record)
