"""Eval samples for eyes: image grids, clips as GIF, text as JSONL, under samples/."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from PIL import Image


def image_grid(images: list[Image.Image], cols: int = 8, scale: int = 2) -> Image.Image:
    w, h = images[0].size
    rows = -(-len(images) // cols)
    grid = Image.new("RGB", (cols * w, rows * h))
    for i, im in enumerate(images):
        grid.paste(im.convert("RGB"), ((i % cols) * w, (i // cols) * h))
    return grid.resize((grid.width * scale, grid.height * scale), Image.NEAREST)


def save_samples(
    samples_dir: Path, step: int, shown: list[tuple[Any, str, float]], limit: int = 32
):
    """Write what the last eval produced; returns the image grid (for TensorBoard) or None."""
    if not shown:
        return None
    samples_dir.mkdir(parents=True, exist_ok=True)
    shown = shown[:limit]
    first = shown[0][0]
    if isinstance(first, Image.Image):
        grid = image_grid([o for o, _, _ in shown])
        grid.save(samples_dir / f"step_{step:06d}.png")
        _captions(samples_dir / f"step_{step:06d}.txt", shown)
        return grid
    if isinstance(first, list) and first and isinstance(first[0], Image.Image):
        for i, (frames, _, _) in enumerate(shown[:8]):
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
        for out, prompt, reward in shown:
            f.write(json.dumps({"prompt": prompt, "output": str(out), "reward": reward}) + "\n")
    return None


def _captions(path: Path, shown) -> None:
    path.write_text("".join(f"{i}\t{r:.3f}\t{p}\n" for i, (_, p, r) in enumerate(shown)))
