"""Every docstring example in the installed packages runs, module by module.

Modules are found by their source (a ``>>>`` line that is not ``+SKIP``), so a new module
with examples is run without being listed, and each module must attempt at least one
example: a runner that finds none fails instead of passing.
"""

from __future__ import annotations

import doctest
import importlib
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {  # as pyproject.toml's package-dir installs them
    "mmyatt": ROOT / "mmyatt",
    "mmyatt.models": ROOT / "models",
    "mmyatt.rewards": ROOT / "rewards",
    "mmyatt.datasets": ROOT / "datasets",
}
EXAMPLE = re.compile(r'^\s*(?:[rRuU]?""")?>>> ', re.M)
# modules known to hold examples: if discovery misses them, it is broken, not they
KNOWN = {
    "mmyatt.rewards.rules",
    "mmyatt.rewards.image",
    "mmyatt.rewards.verdicts",
    "mmyatt.datasets.manifest",
    "mmyatt.datasets.synthetic",
    "mmyatt.datasets.media",
    "mmyatt.datasets.vision_tasks",
    "mmyatt.step.loop",
    "mmyatt.report.inspect",
}
# examples that do not pass yet, each with why; strict, so a fix makes the entry fail
BROKEN: dict[str, str] = {}


def modules_with_examples() -> list[str]:
    found = []
    for package, folder in PACKAGES.items():
        for path in sorted(folder.rglob("*.py")):  # subpackages too (mmyatt/step/, ...)
            lines = [m.group(0) for m in re.finditer(r"^.*>>> .*$", path.read_text(), re.M)]
            if any(EXAMPLE.match(x) and "doctest: +SKIP" not in x for x in lines):
                parts = path.relative_to(folder).with_suffix("").parts
                parts = parts[:-1] if parts[-1] == "__init__" else parts
                found.append(".".join((package, *parts)))
    return found


MODULES = modules_with_examples()


def test_discovery_finds_the_modules_with_examples():
    assert KNOWN <= set(MODULES), sorted(KNOWN - set(MODULES))
    assert set(BROKEN) <= set(MODULES), sorted(set(BROKEN) - set(MODULES))


@pytest.mark.parametrize(
    "name",
    [
        pytest.param(m, marks=pytest.mark.xfail(reason=BROKEN[m], strict=True))
        if m in BROKEN
        else m
        for m in MODULES
    ],
)
def test_module_examples(name):
    module = importlib.import_module(name)
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0, f"{name}: no example ran (source has '>>>' lines)"
    assert result.failed == 0, f"{name}: {result.failed} of {result.attempted} examples failed"
