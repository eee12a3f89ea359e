"""Labelled sample grids of the tiny GenEval: each image with its prompt and the
independent checker's verdict (``rewards/geneval_check.py``), for eyes.

    python bench/geneval_grid.py run RUN_DIR --out PREFIX        # a run's first and last eval
    python bench/geneval_grid.py model PIPELINE --split val --out FILE.png

``run``: the run's eval grids (``samples/step_*.png`` and their captions, written by
``mmyatt.outputs.samples``) at the first and the last eval step, cut back into images,
re-graded by the checker against the prompt of each, written to PREFIX_first.png and
PREFIX_last.png. ``model``: ODE samples (20 steps, CFG 1) of a pipeline directory for
the first ``--n`` held-out prompts of a split (``geneval_records(..., heldout=split)``:
every kind in turn).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from PIL import Image, ImageDraw

from mmyatt.outputs.samples import GRID_COLUMNS, read_captions
from mmyatt.rewards.geneval_check import check, parse_prompt

TILE = 144  # pixels per image in the labelled grid (3x a 48x48 sample)
LABEL = 30  # pixels of text under each image


def labelled_grid(
    images: list[Image.Image], prompts: list[str], cols: int = 4
) -> tuple[Image.Image, list[dict]]:
    """A grid of images scaled to ``TILE``, each with its prompt and the checker's verdict
    ("ok" or what failed) under it; returns the grid and the verdicts."""
    rows = -(-len(images) // cols)
    grid = Image.new("RGB", (cols * TILE, rows * (TILE + LABEL)), "white")
    draw = ImageDraw.Draw(grid)
    verdicts = []
    for i, (img, prompt) in enumerate(zip(images, prompts)):
        v = check(img, parse_prompt(prompt))
        verdicts.append({"prompt": prompt, "correct": v["correct"], "reason": v["reason"]})
        x, y = (i % cols) * TILE, (i // cols) * (TILE + LABEL)
        grid.paste(img.convert("RGB").resize((TILE, TILE), Image.NEAREST), (x, y))
        colour = (0, 120, 0) if v["correct"] else (180, 0, 0)
        draw.text((x + 2, y + TILE + 1), prompt[:26], fill=(0, 0, 0))
        draw.text(
            (x + 2, y + TILE + 14),
            ("ok " if v["correct"] else "x ") + v["reason"][:22],
            fill=colour,
        )
    return grid, verdicts


def run_grid(samples: Path, step: int, size: int) -> tuple[list[Image.Image], list[str]]:
    """The images and prompts of a run's eval grid at ``step``."""
    grid = Image.open(samples / f"step_{step:06d}.png").convert("RGB")
    caps = read_captions(samples / f"step_{step:06d}.txt")
    scale = grid.width // (GRID_COLUMNS * size)
    tile = size * scale
    images = []
    for index, _, _ in caps:
        x, y = (index % GRID_COLUMNS) * tile, (index // GRID_COLUMNS) * tile
        images.append(grid.crop((x, y, x + tile, y + tile)).resize((size, size), Image.NEAREST))
    return images, [p for _, _, p in caps]


def model_samples(path: str, split: str, n: int, seed: int = 0):
    """ODE samples of a pipeline for the first ``n`` held-out prompts of ``split``."""
    import torch

    from mmyatt.datasets.geneval import geneval_records
    from mmyatt.models.flow import FlowPolicy
    from mmyatt.protocols import Sampling, prompt_seed

    policy = FlowPolicy.load(path)
    recs = geneval_records(n, seed + 101, heldout=split)
    seeds = [prompt_seed(seed, r["id"]) for r in recs]
    with torch.no_grad():
        out = policy.generate(recs, 1, Sampling(denoise_steps=20, greedy=True), seeds).outputs
    return out, [r["prompt"] for r in recs]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("what", choices=["run", "model"])
    ap.add_argument("path")
    ap.add_argument("--out", required=True)
    ap.add_argument("--split", default="val")
    ap.add_argument("--n", type=int, default=20)
    ap.add_argument("--size", type=int, default=48, help="run: the eval images' size")
    ap.add_argument("--limit", type=int, default=20, help="run: images shown per grid")
    a = ap.parse_args()
    if a.what == "model":
        images, prompts = model_samples(a.path, a.split, a.n)
        grid, verdicts = labelled_grid(images, prompts, cols=5)
        grid.save(a.out)
    else:
        samples = Path(a.path) / "samples"
        steps = sorted(int(p.stem.split("_")[1]) for p in samples.glob("step_*.png"))
        for name, step in (("first", steps[0]), ("last", steps[-1])):
            images, prompts = run_grid(samples, step, a.size)
            grid, verdicts = labelled_grid(images[: a.limit], prompts[: a.limit], cols=5)
            grid.save(f"{a.out}_{name}.png")
            ok = sum(v["correct"] for v in verdicts)
            print(f"{name} (step {step}): checker {ok}/{len(verdicts)} of the images shown")
    if a.what == "model":
        print(f"checker {sum(v['correct'] for v in verdicts)}/{len(verdicts)}")


if __name__ == "__main__":
    main()
