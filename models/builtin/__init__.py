"""The checkpoints shipped with mmyatt (``builtin:<name>`` in ``model.path`` and
``reward.judge.model``) and the code that made each of them."""

from __future__ import annotations

from pathlib import Path

from mmyatt.config.checks import register_check
from mmyatt.config.errors import ConfigError
from mmyatt.config.model_folder import check_model_folder

BUILTIN = Path(__file__).resolve().parent


def builtin_names() -> list[str]:
    """Every shipped checkpoint: a folder here with a config.json or model_index.json."""
    return sorted(
        p.name
        for p in BUILTIN.iterdir()
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
    return BUILTIN / name


@register_check
def check_builtin_paths(cfg) -> None:
    """``builtin:`` names in the model and judge paths exist; the model's is of
    ``model.kind`` (run by ``load_config``)."""
    if cfg.model.path and cfg.model.path.startswith("builtin:"):
        folder = builtin_path(cfg.model.path, "model.path")
        check_model_folder("model.path", folder, cfg.model.kind, cfg.model.path)
    judge = cfg.reward.judge.model
    if judge and judge.startswith("builtin:"):
        builtin_path(judge, "reward.judge.model")
