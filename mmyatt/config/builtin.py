"""The checkpoints shipped with mmyatt (``builtin:<name>`` in ``model.path`` and
``reward.judge.model``): which exist, where they are, and the check that a config names
one that does (run by ``load_config``).

The folder is found from the package's location without importing the adapters, so the
engine can check a config without loading any model code.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from mmyatt.config.checks import register_check
from mmyatt.config.errors import ConfigError
from mmyatt.config.model_folder import check_model_folder


def builtin_folder() -> Path:
    """``models/builtin/``, where the shipped checkpoints live (installed as
    ``mmyatt.models.builtin``)."""
    spec = importlib.util.find_spec("mmyatt.models")
    return Path(next(iter(spec.submodule_search_locations))) / "builtin"


def builtin_names() -> list[str]:
    """Every shipped checkpoint: a folder with a config.json or model_index.json."""
    return sorted(
        p.name
        for p in builtin_folder().iterdir()
        if (p / "config.json").is_file() or (p / "model_index.json").is_file()
    )


def builtin_path(spec: str, key: str) -> Path:
    """The folder ``builtin:<name>`` names; ConfigError naming ``key`` and the choices."""
    name = spec.split(":", 1)[1]
    if name not in builtin_names():
        raise ConfigError(
            f"{key}={spec}: no built-in checkpoint {name!r}; built-ins: "
            f"{', '.join(builtin_names())}"
        )
    return builtin_folder() / name


@register_check
def check_builtin_paths(cfg) -> None:
    """``builtin:`` names in the model and judge paths exist; the model's is of
    ``model.kind``."""
    if cfg.model.path and cfg.model.path.startswith("builtin:"):
        folder = builtin_path(cfg.model.path, "model.path")
        check_model_folder("model.path", folder, cfg.model.kind, cfg.model.path)
    judge = cfg.reward.judge.model
    if judge and judge.startswith("builtin:"):
        builtin_path(judge, "reward.judge.model")
