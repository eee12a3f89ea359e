"""What every config section is: a frozen pydantic model that rejects unknown keys.

Scalars are strict, as YAML gives them: an integer key takes no ``3.0``, ``"3"`` or
``true``; a boolean takes only ``true``/``false``. Numbers are the exception YAML forces:
YAML 1.1 reads ``3e-3`` (no dot) as a string, so a float key takes a numeric string (but
never ``.inf`` or ``.nan``). A key
that holds a list of strings also takes one string (``model.freeze=model.visual``).
The docstring under a field is its entry in docs/configuration.md.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import AllowInfNan, BaseModel, BeforeValidator, ConfigDict, Strict
from pydantic_core import PydanticCustomError


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)


def _number(value: Any) -> Any:
    if isinstance(value, bool):  # a bool is an int to Python, never a number to a user
        raise PydanticCustomError("float_type", "expected a number")
    return value


def one_or_many(value: Any) -> Any:
    return (value,) if isinstance(value, str) else value


Int = Annotated[int, Strict()]
Float = Annotated[float, BeforeValidator(_number), AllowInfNan(False)]
Bool = Annotated[bool, Strict()]
Str = Annotated[str, Strict()]
Strings = Annotated[tuple[Str, ...], BeforeValidator(one_or_many)]
