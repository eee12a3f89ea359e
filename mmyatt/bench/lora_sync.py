"""`mmyatt bench lora-sync`: what a weight sync moves and how long it takes, for a LoRA
policy (the adapter only) against a full fine-tune (the whole weights), on the recipes'
policy models with a rank-8 adapter (alpha 16, the default targets).

Per model:

- bytes: the adapter's tensors (``models/lora.py`` ``adapter_tensors``) and the whole
  weights a full fine-tune sends (the training engine's ``full_weights``; a tied
  embedding counted once), and their ratio;
- seconds (``sync/seconds`` as the run logs it), the median of ``reps`` syncs after an
  engine's first: text and VLM into a real vLLM engine (``rollout.backend=vllm``; the
  LoRA path writes the adapter folder and vLLM loads it, the full path loads the weights
  in place), flow into the rollout side's copy of the transformer (``trainer.async``'s
  rollout copy; ``adapter_state`` / ``load_adapter_state`` against the whole state
  dict). Where vLLM is not installed, or cannot run a model (its CPU attention has no
  kernel for head_dim 16), the text / VLM seconds are reported as skipped with the reason.

    mmyatt bench lora-sync --out results/bench/lora_sync.json
"""

from __future__ import annotations

import copy
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

from mmyatt.bench.runs import machine
from mmyatt.config.builtin import builtin_folder
from mmyatt.config.schema import RolloutConfig
from mmyatt.distributed import Dist
from mmyatt.engines import ReplicaEngine, available
from mmyatt.engines.vllm_rollout import VLLMRolloutPolicy
from mmyatt.models.builtin.tiny import build_tiny_text_model
from mmyatt.models.builtin.tiny_vlm import build_tiny_vlm
from mmyatt.models.flow import FlowPolicy
from mmyatt.models.lora import adapter_state, adapter_tensors, load_adapter_state, tensor_bytes
from mmyatt.models.text import TextPolicy
from mmyatt.models.vlm import VLMPolicy

LORA = {"r": 8, "alpha": 16.0}
# the recipes' policy models: row -> (kind, source, the recipes that train it)
MODELS = {
    "text qwen2-1m": ("text", "tiny:qwen2-1m", "text_grpo_tiny"),
    "vlm tiny small": ("vlm", "tiny:small", "vlm_grpo_image_tiny, vlm_grpo_video_tiny"),
    "vlm builtin:shape_judge": ("vlm", "builtin:shape_judge", "vlm_genrm_tiny"),
    "flow builtin:tiny_t2i": ("flow", "builtin:tiny_t2i", "flow_grpo_tiny, flow_nft_tiny"),
}
CORPUS = [f"What is {a} + {b}? The answer is {a + b}." for a in range(30) for b in range(10)]


def _model_dir(kind: str, source: str, tmp: Path) -> Path:
    name = source.split(":", 1)[1]
    if source.startswith("builtin:"):
        return builtin_folder() / name
    if kind == "text":
        return build_tiny_text_model(tmp / name, size=name, corpus=CORPUS)
    return build_tiny_vlm(tmp / name, size=name, corpus=CORPUS)


def _load(kind: str, path: Path, lora: dict | None):
    if kind == "text":
        return TextPolicy.load(path, max_prompt_tokens=16, lora=lora)
    if kind == "vlm":
        return VLMPolicy.load(path, max_prompt_tokens=64, lora=lora)
    return FlowPolicy.load(path, **({"lora": lora} if lora else {}))


def _step(policy, seed: int) -> None:
    """An "update": every trained weight moves."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in policy.module().parameters():
            if p.requires_grad:
                p.add_(torch.randn(p.shape, generator=g) * 1e-3)


def _head_dim(policy) -> int:
    cfg = policy.module().config
    cfg = getattr(cfg, "text_config", None) or cfg
    return int(getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)


def _vllm_seconds(policy, path: Path, reps: int) -> dict:
    """Median ``sync/seconds`` over ``reps`` syncs into a real engine (after its first)."""
    cfg = RolloutConfig(backend="vllm", gpu_memory_utilization=0.3, sleep_level=0)
    v = VLLMRolloutPolicy(policy, ReplicaEngine(Dist()), cfg, Dist(), model_path=str(path))
    try:
        v.sync_weights()  # the engine starts; its first sync is not counted
        seconds, sent = [], set()
        for i in range(reps):
            _step(policy, i)
            v.sync_weights()
            seconds.append(v.timings["sync/seconds"])
            sent.add(int(v.timings["sync/bytes"]))
    finally:
        v.close()
    return {"seconds": statistics.median(seconds), "samples": seconds, "bytes_logged": sorted(sent)}


def _copy_seconds(policy, lora: bool, reps: int) -> dict:
    """Median seconds to bring a rollout-side copy of the transformer to the trained
    weights: the adapter entries, or the whole state dict."""
    module = policy.module()
    other = copy.deepcopy(module)
    seconds = []
    for i in range(reps):
        _step(policy, i)
        t0 = time.perf_counter()
        if lora:
            load_adapter_state(other, adapter_state(module))
        else:
            with torch.no_grad():
                other.load_state_dict({k: v.clone() for k, v in module.state_dict().items()})
        seconds.append(time.perf_counter() - t0)
    return {"seconds": statistics.median(seconds), "samples": seconds}


def _skip_reason(kind: str, policy) -> str | None:
    if kind == "flow":
        return None
    if not available("vllm"):
        return "vllm not installed"
    if not torch.cuda.is_available() and _head_dim(policy) < 32:
        return f"head_dim {_head_dim(policy)}: vLLM's CPU attention has no kernel below 32"
    return None


def bench_lora_sync(quick: bool = False, reps: int = 5, models: tuple[str, ...] = ()) -> dict:
    """Bytes for every model of ``MODELS`` (or those named); seconds unless ``quick``."""
    threads = torch.get_num_threads()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    rows = {}
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for name in models or tuple(MODELS):
                kind, source, recipes = MODELS[name]
                path = _model_dir(kind, source, Path(tmp))
                adapted, full = _load(kind, path, dict(LORA)), _load(kind, path, None)
                lora_bytes = tensor_bytes(adapter_tensors(adapted.module()))
                full_bytes = tensor_bytes(ReplicaEngine(Dist()).full_weights(full))
                row = {
                    "kind": kind,
                    "source": source,
                    "recipes": recipes,
                    "lora_bytes": lora_bytes,
                    "full_bytes": full_bytes,
                    "bytes_ratio": lora_bytes / full_bytes,
                }
                skip = "quick" if quick else _skip_reason(kind, full)
                if skip is not None:
                    row["seconds_skipped"] = skip
                elif kind == "flow":
                    row["target"] = "the rollout side's copy of the transformer"
                    row["lora_sync"] = _copy_seconds(adapted, True, reps)
                    row["full_sync"] = _copy_seconds(full, False, reps)
                else:
                    row["target"] = "vLLM engine"
                    row["lora_sync"] = _vllm_seconds(adapted, path, reps)
                    row["full_sync"] = _vllm_seconds(full, path, reps)
                if "lora_sync" in row:
                    row["seconds_ratio"] = row["lora_sync"]["seconds"] / row["full_sync"]["seconds"]
                rows[name] = row
    finally:
        torch.set_num_threads(threads)
    out = {"lora": LORA, "reps": reps, "models": rows, "machine": machine()}
    if available("vllm"):
        import vllm

        out["vllm"] = vllm.__version__
    return out
