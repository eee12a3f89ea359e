"""The one error a config raises, and how pydantic's validation errors become it.

Every message is one line that names the dotted key (``reward.functions[0].name``) and
what would be accepted there: the valid keys, the choices, the range. The CLI prints it
as it is; nothing about pydantic reaches the user.
"""

from __future__ import annotations

import types
import typing
from typing import Annotated, Any

from pydantic import BaseModel, ValidationError
from pydantic.fields import FieldInfo


class ConfigError(ValueError):
    """A recipe or override that cannot be turned into a valid config."""


def dotted(loc: tuple, where: str = "") -> str:
    """``("reward", "functions", 0, "name")`` -> ``reward.functions[0].name``."""
    key = where
    for part in loc:
        if isinstance(part, int):
            key += f"[{part}]"
        else:
            key = f"{key}.{part}" if key else str(part)
    return key or "config"


def one_line(error: ValidationError, model: type[BaseModel], where: str = "") -> str:
    """The first problem of ``error`` (raised validating ``model``) as one line."""
    e = error.errors(include_url=False)[0]
    loc, kind, ctx = tuple(e["loc"]), e["type"], e.get("ctx") or {}
    key, value = dotted(loc, where), e.get("input")
    if kind == "extra_forbidden":
        owner, _ = annotation_at(model, loc[:-1])
        names = ", ".join(owner.model_fields) if is_section(owner) else ""
        return f"unknown config key {key!r}; valid keys here: {names}"
    if kind == "value_error" and isinstance(ctx.get("error"), ConfigError):
        return str(ctx["error"])
    if kind == "literal_error":
        head, sep, last = ctx["expected"].rpartition(" or ")
        return f"{key}: {value!r} is not one of {f'{head}, {last}' if sep else last}"
    if kind in BOUNDS:
        within = range_text(annotation_at(model, loc)[1]) or f"{BOUNDS[kind]} {ctx[_ATTRS[kind]]}"
        return f"{key} must be {within}, got {value}"  # a number, or YAML's "3e-3"
    if kind == "string_too_short":
        return f"{key} must not be empty"
    if kind in ("too_short", "too_long"):
        bound = "at least" if kind == "too_short" else "at most"
        want = ctx.get("min_length" if kind == "too_short" else "max_length")
        return f"{key}: expected {bound} {want} item(s), got {ctx.get('actual_length')}"
    if kind == "missing":
        return f"{key} is required"
    for prefix, expected in EXPECTED.items():
        if kind.startswith(prefix):
            return f"{key}: expected {expected}, got {value!r}"
    return f"{key}: {' '.join(str(e['msg']).split())} (got {value!r})"


EXPECTED = {
    "finite_number": "a finite number",
    "int_": "an integer",
    "float_": "a number",
    "bool_": "true/false",
    "string_": "a string",
    "tuple_": "a list",
    "list_": "a list",
    "dict_": "a mapping",
    "model_": "a mapping",
}
BOUNDS = {
    "greater_than_equal": ">=",
    "greater_than": ">",
    "less_than_equal": "<=",
    "less_than": "<",
}
_ATTRS = {
    "greater_than_equal": "ge",
    "greater_than": "gt",
    "less_than_equal": "le",
    "less_than": "lt",
}


def range_text(metadata: list) -> str:
    """``[Ge(0), Lt(1)]`` -> ``in [0, 1)``; ``[Gt(0)]`` -> ``> 0``; no bound: ``""``."""
    bounds = {
        kind: getattr(m, attr)
        for m in metadata
        for kind, attr in _ATTRS.items()
        if getattr(m, attr, None) is not None
    }
    low = [k for k in bounds if k.startswith("greater")]
    high = [k for k in bounds if k.startswith("less")]
    if low and high:
        left = "[" if low[0] == "greater_than_equal" else "("
        right = "]" if high[0] == "less_than_equal" else ")"
        return f"in {left}{bounds[low[0]]}, {bounds[high[0]]}{right}"
    return " ".join(f"{BOUNDS[k]} {bounds[k]}" for k in low + high)


def is_section(tp: Any) -> bool:
    return isinstance(tp, type) and issubclass(tp, BaseModel)


def unwrap(tp: Any) -> tuple[Any, list]:
    """``Annotated[X | None, ...]`` -> (X, the metadata of every Annotated layer)."""
    meta: list = []
    while True:
        if typing.get_origin(tp) is Annotated:
            meta += _flat(tp.__metadata__)
            tp = typing.get_args(tp)[0]
        elif typing.get_origin(tp) in (typing.Union, types.UnionType):
            rest = [a for a in typing.get_args(tp) if a is not type(None)]
            if len(rest) != 1:
                return tp, meta
            tp = rest[0]
        else:
            return tp, meta


def _flat(metadata) -> list:
    """Constraints given as ``Field(ge=0)`` inside an ``Annotated`` are a FieldInfo's."""
    out = []
    for m in metadata:
        out += m.metadata if isinstance(m, FieldInfo) else [m]
    return out


def annotation_at(model: type[BaseModel], loc: tuple) -> tuple[Any, list]:
    """(type, constraints) of the field or list item at ``loc`` inside ``model``;
    (None, []) where ``loc`` leaves the schema."""
    tp: Any = model
    meta: list = []
    for part in loc:
        tp, _ = unwrap(tp)
        if isinstance(part, int) and typing.get_origin(tp) in (tuple, list):
            args = typing.get_args(tp)
            tp = args[0] if len(args) == 1 or args[1] is Ellipsis else args[part]
            meta = []
        elif is_section(tp) and part in tp.model_fields:
            field = tp.model_fields[part]
            tp, meta = field.annotation, _flat(field.metadata)
        else:
            return None, []
    tp, inner = unwrap(tp)
    return tp, meta + inner
