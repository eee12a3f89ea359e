"""Which optional engine packages are installed, and the rollout engines this process
started (closed before the process group goes).

Optional backends (megatron-core, vllm) are imported only when a config asks for them;
a missing one is named with the command that installs it.
"""

from __future__ import annotations

import importlib.util
from typing import Protocol

INSTALL = {
    "megatron": ("megatron.core", "pip install 'mmyatt[megatron]'  (megatron-core>=0.16)"),
    "vllm": ("vllm", "pip install 'mmyatt[vllm]'  (vllm on CUDA; see docs/engines.md for CPU)"),
}


class Closable(Protocol):
    def close(self) -> None: ...


OPEN: list[Closable] = []  # rollout engines this process started (closed by close_engines)


def close_engines() -> None:
    """Shut down the rollout engines this process started; the run calls it before it
    destroys the process group (a vLLM engine tears its own groups down on exit)."""
    while OPEN:
        OPEN.pop().close()


class MissingEngineError(RuntimeError):
    """A config asks for an engine whose package is not installed."""


def available(name: str) -> bool:
    module = INSTALL[name][0]
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def require(name: str, key: str) -> None:
    """Raise ``MissingEngineError`` naming the config key and the install command."""
    if not available(name):
        module, cmd = INSTALL[name]
        raise MissingEngineError(
            f"{key} needs the Python package {module.split('.')[0]!r}, which is not installed "
            f"in this environment; install it with: {cmd}"
        )
