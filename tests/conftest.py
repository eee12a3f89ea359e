"""Suite-wide switches.

``MMYATT_REQUIRE_VLLM=1`` (set by ``make test-vllm``, which runs in the venv that has
vLLM's CPU build): a test marked to skip where vLLM is not installed runs anyway, so a
broken vLLM install fails loudly instead of skipping every real-vLLM test.
"""

from __future__ import annotations

import os

import pytest


def _skips_without_vllm(mark: pytest.Mark) -> bool:
    return mark.name == "skipif" and "vllm not installed" in str(mark.kwargs.get("reason", ""))


def pytest_collection_modifyitems(config, items):
    if os.environ.get("MMYATT_REQUIRE_VLLM") != "1":
        return
    for item in items:
        item.own_markers = [m for m in item.own_markers if not _skips_without_vllm(m)]
