"""The independent check of the VLM + GenRM recipe: an answer's words against the record's
ground truth.

Each attribute (colour, shape and, for a clip, direction) counts when its true value is
named and no other value of it is; a false value of any attribute (a second colour, a
direction for a still image) makes the whole answer wrong. Rule-based, and read by no
training of the judge (``datasets/describe.py`` draws the judge's data from ground truth,
labelled by how each record was drawn). The recipe logs these with weight 0 beside the
judge's reward (``rewards/rules.py``: ``describe_check``, ``describe_false_claims``,
``answer_words``, ``describe_colour``, ``describe_shape``).
"""

from __future__ import annotations

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


def false_claims(completion: str, record: dict) -> float:
    """How many false attribute values the answer names (:func:`check_details`)."""
    return float(check_details(completion, record)["false"])


def answer_words(completion: str, record: dict) -> float:
    """Answer length in words: a policy padding its answers shows here.

    >>> answer_words("a red  circle", {})
    3.0
    """
    return float(len(completion.split()))
