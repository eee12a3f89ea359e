"""Checks of a config against the world it will run in: packages installed, cores on this
machine, names in the reward registry, built-in checkpoints.

The config cannot import the packages that know these things (they import the config),
so each registers its check here when it is imported, and ``load_config`` runs every
registered check. The modules that register one are imported by ``mmyatt.step.run``
before it loads a config (tests/test_config_checks.py keeps that true).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from mmyatt.config.run import RunConfig

Check = Callable[["RunConfig"], None]
CHECKS: dict[str, Check] = {}


def register_check(check: Check) -> Check:
    """Run ``check(cfg)`` (which raises ConfigError) on every loaded config; a decorator."""
    CHECKS[f"{check.__module__}.{check.__qualname__}"] = check
    return check


def run_checks(cfg: RunConfig) -> None:
    for check in CHECKS.values():
        check(cfg)
