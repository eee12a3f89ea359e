"""A LoRA policy's weight sync to its vLLM engine: the adapter only.

The engine is started from the policy's base checkpoint with vLLM's LoRA support on
(``enable_lora``, one adapter slot, ``max_lora_rank`` the smallest vLLM allows that
holds the adapter's rank). The base weights never move (only the adapter trains), so a
sync sends the adapter alone (:mod:`mmyatt.models.lora`): each version is written as a
peft adapter folder (``adapter_model.safetensors`` + ``adapter_config.json``) in a
private temporary directory, loaded under a new adapter id through vLLM's public
``LLMEngine.add_lora``, and the previous version is removed from the engine and from
disk; the generations that follow name the new version in their ``LoRARequest``.

Why a folder and not tensors in memory: vLLM (0.32) builds adapters only from a path.
verl patches vLLM's private loader to take tensors (``TensorLoRARequest``); reaching into
vLLM's worker internals breaks with its versions, and the adapter is small (the bytes
logged as ``sync/bytes``; the write and read are inside ``sync/seconds``).
"""

from __future__ import annotations

import json
import logging
import shutil
import tempfile
from pathlib import Path

from torch import Tensor

from mmyatt.protocols import LoRAPolicy

logger = logging.getLogger(__name__)

VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # vllm.config.lora.MaxLoRARanks
WEIGHTS = "adapter_model.safetensors"  # peft's file names, which vLLM reads
CONFIG = "adapter_config.json"


def tensor_bytes(tensors: dict[str, Tensor]) -> int:
    """Bytes of a name -> tensor mapping (what a weight sync moves), a tensor under two
    names (a tied embedding and output head) counted once."""
    seen = {(t.data_ptr(), t.numel(), t.dtype): t for t in tensors.values()}
    return sum(t.numel() * t.element_size() for t in seen.values())


def lora_engine_args(lora: dict) -> dict:
    """``vllm.LLM`` keyword arguments for an engine that serves this adapter."""
    r = int(lora["r"])
    fits = [k for k in VLLM_LORA_RANKS if k >= r]
    if not fits:
        raise ValueError(f"model.lora.rank={r}: vLLM serves LoRA ranks up to {VLLM_LORA_RANKS[-1]}")
    return {"enable_lora": True, "max_lora_rank": fits[0], "max_loras": 1, "max_cpu_loras": 1}


def write_adapter(folder: Path, tensors: dict, config: dict) -> None:
    """A peft adapter folder: the tensors (peft names) and their config."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / WEIGHTS))
    (folder / CONFIG).write_text(json.dumps(config))


class AdapterSync:
    """The engine side of a LoRA policy: which adapter version the engine holds, the
    ``LoRARequest`` that names it and the folder it was read from."""

    def __init__(self, lora: dict):
        self.lora = dict(lora)
        self.version = 0  # adapter ids start at 1 (vLLM's rule)
        self.request = None
        self._root: Path | None = None

    def push(self, llm, policy: LoRAPolicy) -> int:
        """Send ``policy``'s adapter to ``llm`` as a new version; returns its bytes."""
        tensors, config = policy.adapter_weights()
        if self._root is None:
            self._root = Path(tempfile.mkdtemp(prefix="mmyatt-lora-"))
        self.version += 1
        folder = self._root / f"v{self.version}"
        write_adapter(folder, tensors, config)
        cls = getattr(llm, "lora_request_class", None)
        if cls is None:
            from vllm.lora.request import LoRARequest as cls
        request = cls(
            lora_name=f"policy-v{self.version}", lora_int_id=self.version, lora_path=str(folder)
        )
        engine = llm if hasattr(llm, "add_lora") else llm.llm_engine
        if not engine.add_lora(request):
            raise RuntimeError(f"rollout.backend=vllm: the engine did not load adapter {folder}")
        old, self.request = self.request, request
        if old is not None:
            engine.remove_lora(old.lora_int_id)
            shutil.rmtree(old.lora_path, ignore_errors=True)
        return tensor_bytes(tensors)

    def close(self) -> None:
        """Delete the adapter folders."""
        if self._root is not None:
            shutil.rmtree(self._root, ignore_errors=True)
            self._root = None
