"""Does a model folder hold the kind of model the recipe trains?

Read from the files alone, before any weights load: a diffusers pipeline has
model_index.json; a Hugging Face model has config.json, and a vision-language one names a
``vision_config`` there (or an architecture such as ``Qwen2VLForConditionalGeneration``). Anything finer (a supported architecture) is the adapter's to say
when it loads.
"""

from __future__ import annotations

import json
from pathlib import Path

from mmyatt.config.errors import ConfigError


def folder_kind(path: Path) -> tuple[str | None, str]:
    """("text" | "vlm" | "flow" | None, what the folder's files say it holds)."""
    if (path / "model_index.json").is_file():
        return "flow", "a diffusers pipeline (model_index.json)"
    config = path / "config.json"
    if not config.is_file():
        return None, "no config.json or model_index.json"
    try:
        meta = json.loads(config.read_text())
    except (OSError, ValueError) as e:
        return None, f"an unreadable config.json ({' '.join(str(e).split())})"
    archs = ", ".join(meta.get("architectures") or [])
    said = (
        f"model_type {meta['model_type']}" if meta.get("model_type") else f"architectures {archs}"
    )
    if "vision_config" in meta or any(w in archs for w in VISION_WORDS):
        return "vlm", f"a vision-language model (config.json {said})"
    return "text", f"a text model (config.json {said})"


def check_model_folder(key: str, path: str | Path, kind: str, value: str | None = None) -> None:
    """Raise ConfigError unless ``path`` is a folder holding a ``kind`` model; the message
    shows ``key=value`` (the path as the user wrote it, e.g. ``builtin:<name>``)."""
    folder, value = Path(path), value or str(path)
    check_folder(key, folder, value)
    found, holds = folder_kind(folder)
    if found != kind:
        raise ConfigError(f"{key}={value} holds {holds}, but model.kind={kind} needs {NEEDS[kind]}")


# architecture names of vision-language models whose config.json has no vision_config
VISION_WORDS = ("VL", "Vision", "Llava", "ImageTextToText")
NEEDS = {
    "text": "a text model (config.json without vision_config)",
    "vlm": "a vision-language model (config.json with vision_config)",
    "flow": "a diffusers pipeline (model_index.json)",
}


def check_folder(key: str, path: str | Path, value: str | None = None) -> None:
    """Raise ConfigError naming ``key`` unless ``path`` is a folder."""
    if not Path(path).is_dir():
        raise ConfigError(f"{key}={value or path}: no such folder")
