"""Config -> the policy adapter: the engine's one door to the adapters of models/.

``build_policy`` loads the adapter ``model.kind`` names, ``build_nft`` wraps a flow
policy for DiffusionNFT, ``build_tiny`` writes the tiny built-in text or VLM model of a
run without ``model.path``. Only the run's builders import this module (the controller,
the trainer, the placement and the engines import no adapter)."""

from __future__ import annotations

import time
from pathlib import Path

import torch

from mmyatt.config.builtin import builtin_folder
from mmyatt.config.schema import ModelConfig, RunConfig
from mmyatt.datasets.manifest import ShardedManifest
from mmyatt.models.builtin.tiny import build_tiny_text_model
from mmyatt.models.builtin.tiny_vlm import build_tiny_vlm
from mmyatt.models.flow import FlowPolicy
from mmyatt.models.flow_nft import FlowNFT, NFTSettings
from mmyatt.models.text import TextPolicy
from mmyatt.models.vlm import VLMPolicy
from mmyatt.step.data import manifest_paths
from mmyatt.step.freeze import freeze_parameters

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def build_policy(m: ModelConfig, device: str | None = None):
    """The policy adapter for ``m``, its weights on ``device`` (default: the CPU), with
    the parameters named by ``model.freeze`` frozen."""
    policy = _load_policy(m, device)
    if m.freeze:
        freeze_parameters(policy.module(), m.freeze)
    return policy


def _load_policy(m: ModelConfig, device: str | None = None):
    device = str(device or "cpu")
    if m.path is None:
        raise ValueError("model.path is unset: prepare_run() builds the tiny model first")
    lora = None  # model.lora.rank > 0: a LoRA adapter trains, the base stays frozen
    if m.lora.rank > 0:
        lora = {"r": m.lora.rank, "alpha": m.lora.alpha}
        if m.lora.target_modules:
            lora["target_modules"] = list(m.lora.target_modules)
    if m.kind == "text":
        return TextPolicy.load(
            m.path,
            dtype=DTYPES[m.dtype],
            max_prompt_tokens=m.max_prompt_tokens,
            prompt_overflow=m.prompt_overflow,
            use_chat_template=m.use_chat_template,
            device=device,
            lora=lora,
        )
    if m.kind == "vlm":
        return VLMPolicy.load(
            m.path,
            dtype=DTYPES[m.dtype],
            max_prompt_tokens=m.max_prompt_tokens,
            video_fps=m.video_fps,
            video_max_frames=m.video_max_frames,
            device=device,
            lora=lora,
        )
    if m.kind == "flow":
        kw: dict = {"reference": m.reference}
        if lora is not None:
            kw["lora"] = lora
        return FlowPolicy.load(m.path, **kw).to(device)
    raise NotImplementedError(f"model.kind={m.kind!r} is not wired into the engine")


def build_nft(cfg: RunConfig, policy):
    """DiffusionNFT's sampling policy and loss (models/flow_nft.py) over ``policy`` when
    ``algorithm.name`` is diffusion_nft, else None."""
    if cfg.algorithm.name != "diffusion_nft":
        return None
    n = cfg.algorithm.nft
    settings = NFTSettings(**{k: getattr(n, k) for k in NFTSettings.__dataclass_fields__})
    return FlowNFT(policy, settings, seed=cfg.trainer.seed)


def streams_finished(policy) -> bool:
    """The adapter reports each finished sample during ``generate`` (text and VLM
    adapters), so placement partial can stream it to the judge."""
    return isinstance(policy, TextPolicy | VLMPolicy)


def build_tiny(cfg: RunConfig, out: Path, log=print) -> Path:
    """The tiny built-in text or VLM model of a run without ``model.path``, its tokenizer
    trained on the run's training prompts, written to ``out`` (kept if already there)."""
    if (out / "config.json").exists():
        return out
    if cfg.model.kind == "flow":
        raise ValueError("model.path is required for flow models (e.g. builtin:tiny_t2i)")
    manifest = ShardedManifest(
        manifest_paths(cfg.data.train), shuffle=False, bad_lines=cfg.data.bad_lines
    )
    recs = manifest.eval_records(5000)
    t0 = time.perf_counter()
    if cfg.model.kind == "vlm":
        corpus = [f"{r['prompt']} {r.get('answer', '')}" for r in recs]
        path = build_tiny_vlm(
            out,
            arch=cfg.model.vlm_arch,
            size=cfg.model.tiny_size,
            corpus=corpus,
            seed=cfg.trainer.seed,
        )
    else:
        corpus = [f"{r['prompt']}{r.get('answer', '')}" for r in recs]
        path = build_tiny_text_model(
            out, size=cfg.model.tiny_size, corpus=corpus, seed=cfg.trainer.seed
        )
    log(f"[prepare] tiny model {cfg.model.tiny_size} at {path} ({time.perf_counter() - t0:.1f}s)")
    return Path(path)


def resolve_builtin(path: str | None) -> str | None:
    """``builtin:<name>`` names a checkpoint shipped in models/builtin/."""
    if path is None or not path.startswith("builtin:"):
        return path
    p = builtin_folder() / path.split(":", 1)[1]
    if not p.is_dir():
        raise FileNotFoundError(f"{path}: no built-in checkpoint at {p}")
    return str(p)
