"""Config -> plain objects. Adapters and rewards never see config dataclasses."""

from __future__ import annotations

import time
from pathlib import Path

import torch

from mmyatt.config.schema import ModelConfig, RewardConfig, RunConfig
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
    if m.kind == "text":
        from mmyatt.models.text import TextPolicy

        return TextPolicy.load(
            m.path,
            dtype=DTYPES[m.dtype],
            max_prompt_tokens=m.max_prompt_tokens,
            prompt_overflow=m.prompt_overflow,
            use_chat_template=m.use_chat_template,
            device=device,
        )
    if m.kind == "vlm":
        from mmyatt.models.vlm import VLMPolicy

        return VLMPolicy.load(
            m.path,
            dtype=DTYPES[m.dtype],
            max_prompt_tokens=m.max_prompt_tokens,
            video_fps=m.video_fps,
            video_max_frames=m.video_max_frames,
            device=device,
        )
    if m.kind == "flow":
        from mmyatt.models.flow import FlowPolicy

        kw: dict = {"reference": m.reference}
        if m.lora.rank > 0:
            lora = {"r": m.lora.rank, "alpha": m.lora.alpha}
            if m.lora.target_modules:
                lora["target_modules"] = list(m.lora.target_modules)
            kw["lora"] = lora
        return FlowPolicy.load(m.path, **kw).to(device)
    raise NotImplementedError(f"model.kind={m.kind!r} is not wired into the engine")


def build_nft(cfg: RunConfig, policy):
    """DiffusionNFT's sampling policy and loss (models/flow_nft.py) over ``policy`` when
    ``algorithm.name`` is diffusion_nft, else None."""
    if cfg.algorithm.name != "diffusion_nft":
        return None
    from mmyatt.models.flow_nft import FlowNFT, NFTSettings

    n = cfg.algorithm.nft
    settings = NFTSettings(**{k: getattr(n, k) for k in NFTSettings.__dataclass_fields__})
    return FlowNFT(policy, settings, seed=cfg.trainer.seed)


def build_tiny(cfg: RunConfig, out: Path, log=print) -> Path:
    """The tiny built-in text or VLM model of a run without ``model.path``, its tokenizer
    trained on the run's training prompts, written to ``out`` (kept if already there)."""
    if (out / "config.json").exists():
        return out
    if cfg.model.kind == "flow":
        raise ValueError("model.path is required for flow models (e.g. builtin:tiny_t2i)")
    from mmyatt.datasets.manifest import ShardedManifest

    manifest = ShardedManifest(manifest_paths(cfg.data.train), shuffle=False)
    recs = manifest.eval_records(5000)
    t0 = time.perf_counter()
    if cfg.model.kind == "vlm":
        from mmyatt.models.builtin.tiny_vlm import build_tiny_vlm

        corpus = [f"{r['prompt']} {r.get('answer', '')}" for r in recs]
        path = build_tiny_vlm(
            out,
            arch=cfg.model.vlm_arch,
            size=cfg.model.tiny_size,
            corpus=corpus,
            seed=cfg.trainer.seed,
        )
    else:
        from mmyatt.models.builtin.tiny import build_tiny_text_model

        corpus = [f"{r['prompt']}{r.get('answer', '')}" for r in recs]
        path = build_tiny_text_model(
            out, size=cfg.model.tiny_size, corpus=corpus, seed=cfg.trainer.seed
        )
    log(f"[prepare] tiny model {cfg.model.tiny_size} at {path} ({time.perf_counter() - t0:.1f}s)")
    return Path(path)


def build_reward(r: RewardConfig):
    import os

    from mmyatt.rewards.mixture import RewardMixture

    key = os.environ.get(r.judge.api_key_env) if r.judge.api_key_env else None
    specs = [
        {"name": s.name, "weight": s.weight, "kwargs": s.kwargs, "zscore": s.zscore}
        for s in r.functions
    ]
    client = {"max_retries": r.judge.max_retries, "timeout_s": r.judge.timeout_s}
    return RewardMixture.from_specs(specs, judge_urls=r.judge.urls, api_key=key, client=client)


def resolve_builtin(path: str | None) -> str | None:
    """``builtin:<name>`` names a checkpoint shipped in models/builtin/."""
    if path is None or not path.startswith("builtin:"):
        return path
    import mmyatt.models

    p = Path(mmyatt.models.__file__).resolve().parent / "builtin" / path.split(":", 1)[1]
    if not p.is_dir():
        raise FileNotFoundError(f"{path}: no built-in checkpoint at {p}")
    return str(p)


def manifest_paths(spec: str) -> list[str]:
    """``data.train`` / ``data.eval``: one manifest, or several joined by commas. A spec
    that names an existing file is that one file, commas and all (a run directory may
    hold a comma, and a synthetic task's files are written under it)."""
    if not spec.startswith("synthetic:") and Path(spec).is_file():
        return [spec]
    paths = [p.strip() for p in spec.split(",") if p.strip()]
    for p in paths:
        if p.startswith("synthetic:"):
            raise ValueError(f"{spec!r} must be resolved to files by prepare_run() first")
    return paths


def media_transform(cfg: RunConfig):
    """VLM records decode their images/videos as the shard reads them, so a missing or
    corrupt file is a bad record of the manifest (error naming file and line, or skipped
    and counted in ``data/skipped`` under ``data.bad_lines=skip``) instead of an error
    in the middle of a rollout."""
    if cfg.model.kind != "vlm":
        return None
    from functools import partial

    from mmyatt.datasets.media import media_transform as decode

    return partial(decode, fps=cfg.model.video_fps, max_frames=cfg.model.video_max_frames)


def build_shard(cfg: RunConfig, rank: int, world_size: int):
    from mmyatt.datasets.manifest import ShardedManifest

    return ShardedManifest(
        manifest_paths(cfg.data.train),
        rank=rank,
        world_size=world_size,
        seed=cfg.trainer.seed,
        shuffle=cfg.data.shuffle,
        bad_lines=cfg.data.bad_lines,
        transform=media_transform(cfg),
    )


def eval_records(cfg: RunConfig, rank: int, world_size: int) -> list[dict]:
    from mmyatt.datasets.manifest import ShardedManifest

    m = ShardedManifest(
        manifest_paths(cfg.data.eval),
        rank=rank,
        world_size=world_size,
        seed=cfg.trainer.seed,
        shuffle=False,
        bad_lines=cfg.data.bad_lines,
        transform=media_transform(cfg),
    )
    limit = -(-cfg.data.eval_prompts // world_size)  # ceil: every rank scores its share
    return m.eval_records(limit)


def synthetic_task(spec: str, out_dir: Path, cfg: RunConfig) -> tuple[Path, Path, Path | None]:
    """Write a synthetic task's files: (train, the eval split reported, the validation
    split that choices during the run are made on, e.g. the SFT stopping check)."""
    train, ev = _synthetic_task(spec, out_dir, cfg)
    val = out_dir / "val.jsonl"
    return train, ev, val if val.exists() else None


# the keyword arguments each synthetic task's writer takes from data.synthetic_kwargs
WRITER_KEYS: dict[str, tuple[str, ...]] = {
    "describe": ("extra_colours", "val_fold", "shape_first", "extra_shapes")
}


def _writer_kwargs(cfg: RunConfig, task: str) -> dict:
    """``data.synthetic_kwargs``, checked against the keys the task's writer takes."""
    known = WRITER_KEYS.get(task, ())
    kw = dict(cfg.data.synthetic_kwargs)
    unknown = sorted(set(kw) - set(known))
    if unknown:
        raise ValueError(
            f"data.synthetic_kwargs: synthetic:{task} takes {list(known) or 'no keys'}, "
            f"not {unknown}"
        )
    return kw


def _synthetic_task(spec: str, out_dir: Path, cfg: RunConfig) -> tuple[Path, Path]:
    task = spec.split(":", 1)[1]
    writer_kwargs = _writer_kwargs(cfg, task)
    if cfg.data.eval_split == "val" and task not in (
        "shapes_t2i",
        "motion_t2v",
        "geneval_t2i",
        "describe",
    ):
        raise ValueError(
            f"data.eval_split=val: synthetic:{task} has no validation split "
            "(shapes_t2i, motion_t2v and geneval_t2i do); point data.eval at your own "
            "validation file"
        )
    if task == "arithmetic":
        from mmyatt.datasets.synthetic import write_arithmetic_task

        return write_arithmetic_task(
            out_dir,
            n_train=cfg.data.synthetic_train_size,
            n_eval=cfg.data.synthetic_eval_size,
            seed=cfg.trainer.seed,
            n_val=cfg.sft.eval_prompts,
        )
    if task == "shapes_vqa":
        from mmyatt.datasets.vision_tasks import write_shape_task

        p = write_shape_task(
            out_dir,
            n_train=cfg.data.synthetic_train_size,
            n_eval=cfg.data.synthetic_eval_size,
            seed=cfg.trainer.seed,
            n_val=cfg.sft.eval_prompts,
        )
        return p["train"], p["eval"]
    if task == "motion_vqa":
        from mmyatt.datasets.vision_tasks import write_motion_task

        p = write_motion_task(
            out_dir,
            n_train=cfg.data.synthetic_train_size,
            n_eval=cfg.data.synthetic_eval_size,
            seed=cfg.trainer.seed,
            n_val=cfg.sft.eval_prompts,
        )
        return p["train"], p["eval"]
    if task == "describe":
        from mmyatt.datasets.describe import write_describe_task

        p = write_describe_task(
            out_dir,
            n_train=cfg.data.synthetic_train_size,
            n_eval=cfg.data.synthetic_eval_size,
            seed=cfg.trainer.seed,
            **writer_kwargs,
        )
        return p["train"], p[cfg.data.eval_split]
    if task in ("shapes_t2i", "motion_t2v"):
        from mmyatt.datasets.shapes import write_shape_task

        p = write_shape_task(
            out_dir,
            n_train=cfg.data.synthetic_train_size,
            n_eval=cfg.data.synthetic_eval_size,
            seed=cfg.trainer.seed,
            video=task == "motion_t2v",
        )
        return p["train"], p[cfg.data.eval_split]
    if task == "geneval_t2i":
        from mmyatt.datasets.geneval import write_geneval_task

        p = write_geneval_task(
            out_dir,
            n_train=cfg.data.synthetic_train_size,
            n_eval=cfg.data.synthetic_eval_size,
            seed=cfg.trainer.seed,
        )
        return p["train"], p[cfg.data.eval_split]
    raise ValueError(
        f"unknown synthetic task {task!r}; available: arithmetic, shapes_vqa, motion_vqa, "
        "describe, shapes_t2i, motion_t2v, geneval_t2i"
    )
