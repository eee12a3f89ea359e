"""Typed configuration: one frozen pydantic section per component, one YAML per recipe.

``load_config(path, overrides)`` reads a recipe, applies dotted ``key=value`` overrides
from the command line and validates the result: unknown keys, wrong types, values outside
a choice list or a range, rules between sections (``mmyatt/config/rules.py``), the model
folder against ``model.kind``, and the checks other packages register against this
machine and their registries (``mmyatt/config/checks.py``). Each failure is one
``ConfigError`` line naming the dotted key and what it accepts, before anything starts.

The sections live one module per component group (model, data, sampling, algorithm,
reward, trainer, engines, placement), composed in ``run.py``; this module re-exports them
with ``RunConfig``, so ``from mmyatt.config.schema import ...`` reaches every name.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from mmyatt.config.algorithm import AlgorithmConfig, NFTConfig, OptimConfig
from mmyatt.config.checks import run_checks
from mmyatt.config.data import DataConfig
from mmyatt.config.engines import DistributedConfig, RolloutConfig, TrainConfig
from mmyatt.config.errors import ConfigError, annotation_at, dotted, is_section, one_line
from mmyatt.config.model import LoraConfig, ModelConfig
from mmyatt.config.model_folder import check_folder, check_model_folder
from mmyatt.config.placement import PlacementConfig
from mmyatt.config.reward import JudgeConfig, RewardConfig, RewardSpec
from mmyatt.config.rules import check_rules
from mmyatt.config.run import RunConfig
from mmyatt.config.sampling import SamplingConfig
from mmyatt.config.trainer import CheckpointConfig, LoggingConfig, SFTConfig, TrainerConfig

__all__ = [
    "AlgorithmConfig",
    "CheckpointConfig",
    "ConfigError",
    "DataConfig",
    "DistributedConfig",
    "JudgeConfig",
    "LoggingConfig",
    "LoraConfig",
    "ModelConfig",
    "NFTConfig",
    "OptimConfig",
    "PlacementConfig",
    "RewardConfig",
    "RewardSpec",
    "RolloutConfig",
    "RunConfig",
    "SFTConfig",
    "SamplingConfig",
    "TrainConfig",
    "TrainerConfig",
    "apply_override",
    "build",
    "dump_yaml",
    "load_config",
    "to_dict",
    "validate",
]


def build(cls: type[BaseModel], data: Any, where: str = "") -> Any:
    """The section ``cls`` from nested dicts, every key, type and range checked; a
    problem is a one-line ConfigError naming the dotted key (``where`` prefixes it)."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{where or 'config'}: expected a mapping, got {type(data).__name__}")
    try:
        return cls.model_validate(data)
    except ValidationError as e:
        raise ConfigError(one_line(e, cls, where)) from None


def apply_override(tree: dict, dotted: str) -> None:
    """Apply one ``a.b.c=value`` override; the value is parsed as YAML (so 0.1, true, [1,2])."""
    if "=" not in dotted:
        raise ConfigError(f"override {dotted!r} must look like key.sub=value")
    key, raw = dotted.split("=", 1)
    parts = key.strip().split(".")
    if not all(parts):
        raise ConfigError(f"override {dotted!r}: empty key component")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError as e:
        raise ConfigError(
            f"override {dotted!r}: invalid YAML: {' '.join(str(e).split())}"
        ) from None
    node = tree
    for i, part in enumerate(parts):
        section, _ = annotation_at(RunConfig, tuple(parts[:i]))
        if is_section(section) and part not in section.model_fields:
            where = ".".join(parts[:i]) or "top level"
            raise ConfigError(
                f"unknown config key {'.'.join(parts[: i + 1])!r}; valid keys at {where}: "
                f"{', '.join(section.model_fields)}"
            )
        if i == len(parts) - 1:
            node[part] = value
            return
        nxt = node.setdefault(part, {})
        if not isinstance(nxt, dict):
            raise ConfigError(f"override {dotted!r}: {'.'.join(parts[: i + 1])} is not a section")
        node = nxt


def read_recipe(path: str | Path) -> dict:
    """A recipe file's YAML tree (a mapping)."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file not found: {p}")
    try:
        tree = yaml.safe_load(p.read_text()) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"{p}: invalid YAML: {' '.join(str(e).split())}") from None
    if not isinstance(tree, dict):
        raise ConfigError(f"{p}: the top level must be a mapping")
    return tree


def load_config(path: str | Path | None, overrides: list[str] = ()) -> RunConfig:
    """The recipe at ``path`` (None: the defaults) with ``overrides``, fully checked."""
    tree = read_recipe(path) if path is not None else {}
    in_recipe = _leaf_keys(tree)
    for o in overrides:
        apply_override(tree, o)
    try:
        cfg = RunConfig.model_validate(tree)
    except ValidationError as e:
        key = dotted(tuple(e.errors()[0]["loc"]))
        overridden = any(_nested(key, o.split("=", 1)[0].strip()) for o in overrides)
        from_recipe = any(_nested(key, k) for k in in_recipe)
        where = f"{path}: " if from_recipe and not overridden else ""
        raise ConfigError(where + one_line(e, RunConfig)) from None
    validate(cfg)
    return cfg


def _nested(key: str, other: str) -> bool:
    """Whether one of two dotted keys holds the other (``a.b`` and ``a.b[0].c``)."""
    a, b = sorted((key, other), key=len)
    return b == a or b.startswith((a + ".", a + "["))


def _leaf_keys(tree: dict, prefix: str = "") -> set[str]:
    out = set()
    for k, v in tree.items():
        key = f"{prefix}.{k}" if prefix else str(k)
        out |= _leaf_keys(v, key) if isinstance(v, dict) and v else {key}
    return out


def validate(cfg: RunConfig) -> None:
    """Every check past the fields' own: the rules between sections, the model folder
    against ``model.kind`` and the judge's folder, then the registered checks against
    this machine and the registries."""
    check_rules(cfg)
    path, judge = cfg.model.path, cfg.reward.judge.model
    if path is not None and not path.startswith("builtin:"):
        check_model_folder("model.path", path, cfg.model.kind)
    if judge is not None and not judge.startswith("builtin:"):
        check_folder("reward.judge.model", judge)
    run_checks(cfg)


def to_dict(cfg: Any) -> Any:
    """Plain data (lists, dicts, scalars) for YAML/JSON."""
    if isinstance(cfg, BaseModel):
        return {name: to_dict(getattr(cfg, name)) for name in type(cfg).model_fields}
    if isinstance(cfg, tuple | list):
        return [to_dict(v) for v in cfg]
    if isinstance(cfg, dict):
        return {k: to_dict(v) for k, v in cfg.items()}
    return cfg


def dump_yaml(cfg: Any) -> str:
    return yaml.safe_dump(to_dict(cfg), sort_keys=False)
