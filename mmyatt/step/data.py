"""Config -> the run's data: the manifests ``data.train`` / ``data.eval`` name, this
rank's shard of them, and the files of a ``synthetic:<task>``."""

from __future__ import annotations

from functools import partial
from pathlib import Path

from mmyatt.config.schema import RunConfig
from mmyatt.datasets import shapes, vision_tasks
from mmyatt.datasets.describe_task import write_describe_task
from mmyatt.datasets.geneval import write_geneval_task
from mmyatt.datasets.manifest import ShardedManifest
from mmyatt.datasets.media import media_transform as decode_media
from mmyatt.datasets.synthetic import write_arithmetic_task


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
    return partial(decode_media, fps=cfg.model.video_fps, max_frames=cfg.model.video_max_frames)


def build_shard(cfg: RunConfig, rank: int, world_size: int):
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
    "describe": (
        "extra_colours",
        "val_fold",
        "shape_first",
        "extra_shapes",
        "clip_heldout",
        "video_fraction",
        "sft_direction_drill",
    )
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
    # every writer's split sizes and seed; the VQA tasks and arithmetic also write a
    # validation split of the warm start's check size (their eval split is reported)
    size = {
        "n_train": cfg.data.synthetic_train_size,
        "n_eval": cfg.data.synthetic_eval_size,
        "seed": cfg.trainer.seed,
    }
    if task == "arithmetic":
        return write_arithmetic_task(out_dir, **size, n_val=cfg.sft.eval_prompts)
    if task in ("shapes_vqa", "motion_vqa"):
        vqa = (
            vision_tasks.write_shape_task
            if task == "shapes_vqa"
            else vision_tasks.write_motion_task
        )
        p = vqa(out_dir, **size, n_val=cfg.sft.eval_prompts)
        return p["train"], p["eval"]
    writers = {
        "describe": partial(write_describe_task, **writer_kwargs),
        "shapes_t2i": partial(shapes.write_shape_task, video=False),
        "motion_t2v": partial(shapes.write_shape_task, video=True),
        "geneval_t2i": write_geneval_task,
    }
    if task in writers:
        p = writers[task](out_dir, **size)
        return p["train"], p[cfg.data.eval_split]
    raise ValueError(
        f"unknown synthetic task {task!r}; available: arithmetic, shapes_vqa, motion_vqa, "
        "describe, shapes_t2i, motion_t2v, geneval_t2i"
    )
