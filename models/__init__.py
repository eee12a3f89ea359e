"""Policy adapters and the models they wrap.

Exports resolve lazily so that importing ``mmyatt.protocols`` (which every part
of the engine does) does not import transformers.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "Policy": "protocol",
    "Sampling": "protocol",
    "seeded_generator": "protocol",
    "prompt_seed": "protocol",
    "TextPolicy": "text",
    "PromptTooLongError": "text",
    "train_bpe_tokenizer": "tokenizer",
    "TINY_TEXT_CONFIGS": "tiny",
    "build_tiny_text_model": "tiny",
    "VLMPolicy": "vlm",
    "build_tiny_vlm": "tiny_vlm",
    "FlowPolicy": "flow",
    "build_tiny_flow_model": "flow_tiny",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
