"""`mmyatt bench lora-sync`: what a weight sync moves and how long it takes, for a LoRA
policy (the adapter only) against a full fine-tune (the whole weights), on the recipes'
policy models with a rank-8 adapter (alpha 16, the default targets).

Per model:

- bytes: the adapter's tensors (``models/lora.py`` ``adapter_tensors``) and the whole
  weights a full fine-tune sends (the training engine's ``full_weights``; a tied
  embedding counted once), and their ratio;
- seconds (``sync/seconds`` as the run logs it), the median of ``reps`` syncs after an
  engine's first, the two arms alternating (each sync follows an "update" that moves
  every trained weight): text and VLM into a real vLLM engine (``rollout.backend=vllm``;
  the LoRA path writes the adapter folder and vLLM loads it, the full path loads the
  weights in place), flow into the rollout side's copy of the transformer
  (``adapter_state`` / ``load_adapter_state`` against the whole state dict). Where vLLM
  is not installed, or cannot run a model (its CPU attention has no kernel for head_dim
  16), the text / VLM seconds are reported as skipped with the reason.

The tiny models' syncs are a few milliseconds either way, fixed costs more than bytes; the
last row is a real shape, Qwen2.5-0.5B's (random weights, bfloat16, not in ``quick``),
where the bytes decide.

    mmyatt bench lora-sync --out results/bench/lora_sync.json
"""

from __future__ import annotations

import copy
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

from mmyatt.bench.engines import build_text_model
from mmyatt.bench.runs import machine
from mmyatt.config.builtin import builtin_folder
from mmyatt.distributed import Dist
from mmyatt.engines import ReplicaEngine, available
from mmyatt.engines.vllm_lora import tensor_bytes
from mmyatt.engines.vllm_rollout import VLLMRolloutPolicy
from mmyatt.models.builtin.tiny import build_tiny_text_model
from mmyatt.models.builtin.tiny_vlm import build_tiny_vlm
from mmyatt.models.flow import FlowPolicy
from mmyatt.models.lora import adapter_state, adapter_tensors, load_adapter_state
from mmyatt.models.text import TextPolicy
from mmyatt.models.vlm import VLMPolicy

LORA = {"r": 8, "alpha": 16.0}
# the recipes' policy models: row -> (kind, source, the recipes that train it)
MODELS = {
    "text qwen2-1m": ("text", "tiny:qwen2-1m", "text_grpo_tiny"),
    "vlm tiny small": ("vlm", "tiny:small", "vlm_grpo_image_tiny, vlm_grpo_video_tiny"),
    "vlm builtin:shape_judge": ("vlm", "builtin:shape_judge", "vlm_genrm_tiny"),
    "flow builtin:tiny_t2i": ("flow", "builtin:tiny_t2i", "flow_grpo_tiny, flow_nft_tiny"),
    "text qwen2.5-0.5b": ("text", "qwen2.5:qwen2.5-0.5b", "none (a real model's shape)"),
}
REAL = "text qwen2.5-0.5b"  # its two engines do not run side by side (memory): one, then the other
CORPUS = [f"What is {a} + {b}? The answer is {a + b}." for a in range(30) for b in range(10)]


def _model_dir(kind: str, source: str, tmp: Path) -> Path:
    name = source.split(":", 1)[1]
    if source.startswith("builtin:"):
        return builtin_folder() / name
    if source.startswith("qwen2.5:"):
        return build_text_model(tmp / name, name, torch.bfloat16)
    if kind == "text":
        return build_tiny_text_model(tmp / name, size=name, corpus=CORPUS)
    return build_tiny_vlm(tmp / name, size=name, corpus=CORPUS)


def _load(kind: str, path: Path, lora: dict | None):
    if kind == "text":
        cfg = json.loads((path / "config.json").read_text())
        dtype = cfg.get("dtype") or cfg.get("torch_dtype") or "float32"
        return TextPolicy.load(path, max_prompt_tokens=16, lora=lora, dtype=getattr(torch, dtype))
    if kind == "vlm":
        return VLMPolicy.load(path, max_prompt_tokens=64, lora=lora)
    return FlowPolicy.load(path, **({"lora": lora} if lora else {}))


def _step(policy, seed: int) -> None:
    """An "update": every trained weight moves."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in policy.module().parameters():
            if p.requires_grad:
                p.add_((torch.randn(p.shape, generator=g) * 1e-3).to(p.dtype))


def _head_dim(policy) -> int:
    cfg = policy.module().config
    cfg = getattr(cfg, "text_config", None) or cfg
    return int(getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)


def _vllm_seconds(adapted, full, path: Path, reps: int, alternate: bool) -> dict:
    """``sync/seconds`` of ``reps`` syncs per arm into a real engine each (after its
    first), the arms alternating (``alternate``) or one after the other."""
    arms = {"lora_sync": adapted, "full_sync": full}
    out = {arm: {"samples": [], "bytes_logged": set()} for arm in arms}

    def one(v, arm: str, i: int) -> None:
        _step(arms[arm], i)
        v.sync_weights()
        out[arm]["samples"].append(v.timings["sync/seconds"])
        out[arm]["bytes_logged"].add(int(v.timings["sync/bytes"]))

    def engine(policy):
        options = {"gpu_memory_utilization": 0.3, "sleep_level": 0}
        v = VLLMRolloutPolicy(
            policy, ReplicaEngine(Dist()), Dist(), model_path=str(path), **options
        )
        v.sync_weights()  # the engine starts; its first sync is not counted
        return v

    if alternate:
        engines = {arm: engine(policy) for arm, policy in arms.items()}
        try:
            for i in range(reps):
                for arm, v in engines.items():
                    one(v, arm, i)
        finally:
            for v in engines.values():
                v.close()
    else:
        for arm, policy in arms.items():
            v = engine(policy)
            try:
                for i in range(reps):
                    one(v, arm, i)
            finally:
                v.close()
    for o in out.values():
        o["seconds"] = statistics.median(o["samples"])
        o["bytes_logged"] = sorted(o["bytes_logged"])
    return out


def _copy_seconds(adapted, full, reps: int) -> dict:
    """Seconds to bring a rollout-side copy of the transformer to the trained weights:
    the adapter entries, or the whole state dict; the arms alternating."""
    copies = {
        "lora_sync": copy.deepcopy(adapted.module()),
        "full_sync": copy.deepcopy(full.module()),
    }
    out = {arm: {"samples": []} for arm in copies}
    for i in range(reps):
        for arm, policy in (("lora_sync", adapted), ("full_sync", full)):
            _step(policy, i)
            module, other = policy.module(), copies[arm]
            t0 = time.perf_counter()
            if arm == "lora_sync":
                load_adapter_state(other, adapter_state(module))
            else:
                with torch.no_grad():
                    other.load_state_dict({k: v.clone() for k, v in module.state_dict().items()})
            out[arm]["samples"].append(time.perf_counter() - t0)
    for o in out.values():
        o["seconds"] = statistics.median(o["samples"])
    return out


def _skip_reason(kind: str, policy) -> str | None:
    if kind == "flow":
        return None
    if not available("vllm"):
        return "vllm not installed"
    if not torch.cuda.is_available() and _head_dim(policy) < 32:
        return f"head_dim {_head_dim(policy)}: vLLM's CPU attention has no kernel below 32"
    return None


def bench_lora_sync(quick: bool = False, reps: int = 15, models: tuple[str, ...] = ()) -> dict:
    """Bytes for every model of ``MODELS`` (or those named; ``quick``: the recipes'
    models only); seconds unless ``quick``."""
    threads = torch.get_num_threads()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    rows = {}
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for name in models or tuple(n for n in MODELS if not (quick and n == REAL)):
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
                    row.update(_copy_seconds(adapted, full, reps))
                else:
                    row["target"] = "vLLM engine"
                    row.update(_vllm_seconds(adapted, full, path, reps, alternate=name != REAL))
                if "lora_sync" in row:
                    row["seconds_ratio"] = row["lora_sync"]["seconds"] / row["full_sync"]["seconds"]
                rows[name] = row
                del adapted, full
    finally:
        torch.set_num_threads(threads)
    out = {"lora": LORA, "reps": reps, "models": rows, "machine": machine()}
    if available("vllm"):
        import vllm

        out["vllm"] = vllm.__version__
    return out
