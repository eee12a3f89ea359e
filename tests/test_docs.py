"""The docs cannot drift from the code: the configuration reference is generated from the
config sections, and every dotted config key the docs name exists."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from mmyatt.config import reference as config_reference
from mmyatt.config.errors import annotation_at, is_section
from mmyatt.config.schema import RunConfig

DOCS = Path(__file__).resolve().parent.parent / "docs"
KEY = re.compile(r"`([a-z_]+(?:\.[a-z_0-9]+)+)`")
SECTIONS = set(RunConfig.model_fields)


def test_configuration_reference_has_no_drift():
    committed = config_reference.PAGE.read_text()
    assert committed == config_reference.render(), (
        "docs/configuration.md differs from the config sections in mmyatt/config/; "
        "regenerate it with: python -m mmyatt.config.reference --write"
    )


def test_reference_lists_every_key():
    page = config_reference.render()
    for prefix, cls in config_reference.sections(RunConfig):
        for name in cls.model_fields:
            key = f"{prefix}.{name}" if prefix else name
            assert f"| `{key}` |" in page, key


def test_reference_shows_choices_ranges_and_descriptions():
    page = config_reference.render()
    assert "| `trainer.steps` | `int, >= 1` | `100` |" in page
    assert "| `sampling.top_p` | `float, in (0, 1]` | `1.0` |" in page
    assert "| `model.kind` | `text \\| vlm \\| flow` | `'text'` |" in page
    assert "| `algorithm.dual_clip` | `float, > 1 or null` | `null` |" in page
    assert (
        "| `algorithm.kl_coef` | `float, >= 0` | `0.0` | 0 skips the reference entirely |" in page
    )
    assert "## `reward.functions[]`" in page


def is_key(dotted: str) -> bool:
    loc: tuple = ()
    for part in dotted.split("."):
        owner, _ = annotation_at(RunConfig, loc)
        if not is_section(owner):
            owner, _ = annotation_at(RunConfig, (*loc, 0))  # a list of sections
            loc += (0,)
        if not is_section(owner) or part not in owner.model_fields:
            return False
        loc += (part,)
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
