"""Eval samples for eyes, under samples/: image grids with their captions, clips as GIF,
text (and a VLM's answers, with the image or clip each answered about and the expected
answer) as JSONL.

``shown`` is what the last eval produced on this rank: ``(output, prompt, reward,
record)`` per sample, the record as the manifest gave it (a VLM record's media paths in
``image_path`` / ``video_path``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from PIL import Image

from mmyatt.datasets.media import resolve_media_path

GRID_COLUMNS = 8


def image_grid(images: list[Image.Image], cols: int = GRID_COLUMNS, scale: int = 2) -> Image.Image:
    w, h = images[0].size
    rows = -(-len(images) // cols)
    grid = Image.new("RGB", (cols * w, rows * h))
    for i, im in enumerate(images):
        grid.paste(im.convert("RGB"), ((i % cols) * w, (i // cols) * h))
    return grid.resize((grid.width * scale, grid.height * scale), Image.NEAREST)


def save_samples(
    samples_dir: Path, step: int, shown: list[tuple[Any, str, float, dict]], limit: int = 32
):
    """Write what the last eval produced; returns the image grid (for TensorBoard) or None.

    Images: ``step_<step>.png``, a grid of ``GRID_COLUMNS`` per row, and
    ``step_<step>.txt``, its captions (``index<TAB>reward<TAB>prompt``, row-major). Clips:
    ``step_<step>_clip<i>.gif`` and the same captions. Text: ``step_<step>.jsonl``,
    ``{"prompt", "output", "reward"}`` plus, when the record has them, ``"answer"`` (the
    expected one) and ``"image"`` / ``"video"`` (the media's path)."""
    if not shown:
        return None
    samples_dir.mkdir(parents=True, exist_ok=True)
    shown = shown[:limit]
    first = shown[0][0]
    if isinstance(first, Image.Image):
        grid = image_grid([s[0] for s in shown])
        grid.save(samples_dir / f"step_{step:06d}.png")
        _captions(samples_dir / f"step_{step:06d}.txt", shown)
        return grid
    if isinstance(first, list) and first and isinstance(first[0], Image.Image):
        for i, (frames, *_) in enumerate(shown[:8]):
            frames[0].save(
                samples_dir / f"step_{step:06d}_clip{i}.gif",
                save_all=True,
                append_images=frames[1:],
                duration=150,
                loop=0,
            )
        _captions(samples_dir / f"step_{step:06d}.txt", shown[:8])
        # a filmstrip of the first clip for TensorBoard
        return image_grid(first, cols=len(first))
    with (samples_dir / f"step_{step:06d}.jsonl").open("w") as f:
        for out, prompt, reward, *record in shown:
            row = {"prompt": prompt, "output": str(out), "reward": reward}
            row.update(_record_fields(record[0] if record else {}))
            f.write(json.dumps(row) + "\n")
    return None


def _record_fields(record: dict) -> dict:
    """The expected answer and the media a VLM answered about (absolute paths)."""
    out = {}
    if record.get("answer") is not None:
        out["answer"] = record["answer"]
    source = record.get("_source")
    for key in ("image", "video"):
        path = record.get(f"{key}_path", record.get(key))
        if isinstance(path, str) and not path.startswith("data:"):
            out[key] = str(resolve_media_path(path, source).resolve())
    return out


def read_captions(path: Path) -> list[tuple[int, float, str]]:
    """A grid's captions: (index, reward, prompt) per image, row-major."""
    rows = []
    for line in path.read_text().splitlines():
        index, reward, prompt = line.split("\t", 2)
        rows.append((int(index), float(reward), prompt))
    return rows


def _captions(path: Path, shown) -> None:
    path.write_text("".join(f"{i}\t{s[2]:.3f}\t{s[1]}\n" for i, s in enumerate(shown)))
