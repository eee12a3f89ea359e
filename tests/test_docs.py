"""The docs cannot drift from the code: the configuration reference is generated from the
config dataclasses, and every dotted config key the docs name exists."""

from __future__ import annotations

import dataclasses
import re
import typing
from pathlib import Path

import pytest

from mmyatt.config import reference as config_reference
from mmyatt.config.schema import RunConfig

DOCS = Path(__file__).resolve().parent.parent / "docs"
KEY = re.compile(r"`([a-z_]+(?:\.[a-z_0-9]+)+)`")
SECTIONS = {f.name for f in dataclasses.fields(RunConfig)}


def test_configuration_reference_has_no_drift():
    committed = config_reference.PAGE.read_text()
    assert committed == config_reference.render(), (
        "docs/configuration.md differs from the config dataclasses in mmyatt/config/schema.py; "
        "regenerate it with: python -m mmyatt.config.reference --write"
    )


def test_reference_lists_every_key():
    page = config_reference.render()
    for prefix, cls in config_reference._sections(RunConfig, ""):
        for f in dataclasses.fields(cls):
            key = f"{prefix}.{f.name}" if prefix else f.name
            assert f"| `{key}` |" in page, key


def field_comment_example():
    return """
class C:
    a: int = 1  # first line of a's comment,
    # its wrapped second line
    b: int = 2  # b inline
    # two lines that describe
    # the field below
    c: int = 3
"""


def test_comments_are_attributed_to_their_field():
    got = config_reference.field_comments(field_comment_example())
    assert got[("C", "a")] == "first line of a's comment, its wrapped second line"
    assert got[("C", "b")] == "b inline"
    assert got[("C", "c")] == "two lines that describe the field below"


def is_key(dotted: str) -> bool:
    cls: typing.Any = RunConfig
    for part in dotted.split("."):
        if not dataclasses.is_dataclass(cls):
            return False
        fields = {f.name: f for f in dataclasses.fields(cls)}
        if part not in fields:
            return False
        tp = typing.get_type_hints(cls)[part]
        if typing.get_origin(tp) is tuple and dataclasses.is_dataclass(typing.get_args(tp)[0]):
            tp = typing.get_args(tp)[0]
        cls = tp
    return True


@pytest.mark.parametrize("page", ["mapping.md", "concepts.md", "rollout_logs.md"])
def test_config_keys_named_in_the_docs_exist(page):
    text = (DOCS / page).read_text()
    if page == "mapping.md":  # only the mmyatt column: the first one holds the other tools' keys
        rows = [line.split(" | ") for line in text.splitlines() if line.startswith("| `")]
        text = "\n".join(cells[1] for cells in rows if len(cells) > 2)
    named = {k for k in KEY.findall(text) if k.split(".")[0] in SECTIONS}
    assert named, f"{page} names no config key"
    missing = sorted(k for k in named if not is_key(k))
    assert not missing, f"docs/{page} names config keys that do not exist: {missing}"


def test_mapping_page_covers_the_three_tools():
    text = (DOCS / "mapping.md").read_text()
    for title in ("## verl", "## TRL", "## flow_grpo"):
        assert title in text
