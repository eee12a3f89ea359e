"""A small ``AutoencoderKL`` for the tiny GenEval's drawn scenes, so that a flow model can
learn in latent space as SD3 does (``pretrain_flow --vae``).

Why: the pixel-space generator (``builtin:geneval_t2i`` before it had a VAE) wrote each
4x4 patch of pixels from its own token, and its objects came out as ragged blobs whose
shape nobody could read. A convolutional decoder trained on the drawings turns a coarse
latent layout into clean edges; the transformer then only has to place and colour the
objects, as SD3's does for its VAE.

Loss: L1 + MSE of the reconstruction of a posterior sample, plus ``kl_weight`` x the KL
to N(0, I) (small, as SD's VAEs: the latents stay informative, and the KL keeps them
smooth enough to denoise). Every batch is freshly drawn by ``geneval.draw_scene`` from
training prompts of the five kinds; held-out combinations of both eval splits are never
drawn. AdamW, linear warm-up then cosine to 10% of ``lr``.

After training, ``scaling_factor`` and ``shift_factor`` are set as SD3's are (latents
are ``(z - shift) * scale``, unit variance over training scenes), and the reconstruction
is measured on validation held-out scenes: MSE, and the independent checker's verdict on
the reconstructions (the ceiling a generator in this latent space can reach).

Run: ``python -m mmyatt.models.builtin.pretrain_vae OUT_DIR`` (see ``--help``).
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from mmyatt.datasets.geneval import IMAGE_SIZE, draw_scene, geneval_records
from mmyatt.models.builtin.pretrain_flow import torch_threads
from mmyatt.models.flow_io import images_to_tensor, tensor_to_images
from mmyatt.rewards.geneval_check import accuracy_by_kind, check
from mmyatt.step.lr_schedule import cosine_schedule

__all__ = ["build_tiny_vae", "pretrain_vae"]

logger = logging.getLogger(__name__)


def build_tiny_vae(
    block_out_channels: tuple[int, ...] = (16, 32, 32), latent_channels: int = 4, seed: int = 0
):
    """A randomly initialised ``AutoencoderKL``: one resnet layer per level, no attention;
    ``len(block_out_channels) - 1`` halvings (3 levels: 48x48 pixels -> 12x12 latents)."""
    from diffusers import AutoencoderKL

    torch.manual_seed(seed)
    n = len(block_out_channels)
    return AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * n,
        up_block_types=("UpDecoderBlock2D",) * n,
        block_out_channels=tuple(block_out_channels),
        layers_per_block=1,
        latent_channels=latent_channels,
        norm_num_groups=min(16, min(block_out_channels)),
        sample_size=IMAGE_SIZE,
        mid_block_add_attention=False,
    )


def _scenes(
    n: int, seed: int, rng: np.random.Generator, heldout: str | None = None
) -> tuple[list[dict], list[Image.Image], torch.Tensor]:
    """``n`` prompt records, their drawn scenes, and the scenes as (n, 3, H, W) in [-1, 1]."""
    recs = geneval_records(n, seed, heldout=heldout)
    images = [draw_scene(r, rng=rng)[0] for r in recs]
    return recs, images, images_to_tensor(images, IMAGE_SIZE)


@torch.no_grad()
def evaluate_vae(vae, *, n: int = 80, seed: int = 0, split: str = "val") -> dict:
    """Reconstruct ``n`` scenes of ``split``'s held-out combinations (posterior mode):
    {"mse", "checker_originals", "checker": {per kind}}."""
    recs, drawn, x = _scenes(n, seed + 101, np.random.default_rng(seed), heldout=split)
    rec = vae.decode(vae.encode(x).latent_dist.mode()).sample
    ok = [check(im, d)["correct"] for im, d in zip(tensor_to_images(rec), recs)]
    ok_orig = [check(im, d)["correct"] for im, d in zip(drawn, recs)]
    return {
        "mse": float(((rec.clamp(-1, 1) - x) ** 2).mean()),
        "checker_originals": float(np.mean(ok_orig)),
        "checker": accuracy_by_kind(recs, ok),
    }


def pretrain_vae(
    out_dir: str | Path,
    *,
    steps: int = 1500,
    batch_size: int = 16,
    lr: float = 2e-3,
    kl_weight: float = 1e-6,
    block_out_channels: tuple[int, ...] = (16, 32, 32),
    latent_channels: int = 4,
    seed: int = 0,
    threads: int = 1,
    warmup: int = 50,
    log_every: int = 100,
) -> dict:
    """Train the VAE, save it to ``out_dir`` (``AutoencoderKL.save_pretrained``) with its
    metrics in ``out_dir/pretrain_metrics.json``, and return them."""
    if steps < 1 or batch_size < 1:
        raise ValueError(f"steps and batch_size must be >= 1, got {steps}, {batch_size}")
    out = Path(out_dir)
    with torch_threads(threads):
        vae = build_tiny_vae(block_out_channels, latent_channels, seed).train()
        opt = torch.optim.AdamW(vae.parameters(), lr=lr, weight_decay=0.0)
        sched = cosine_schedule(opt, steps, warmup=warmup, floor=0.1)
        rng = np.random.default_rng(seed)
        n_params = sum(p.numel() for p in vae.parameters())
        logger.info(f"pretrain vae: {n_params:,} params, {steps} steps x batch {batch_size}")
        recent: list[float] = []
        t0 = time.time()
        for step in range(steps):
            *_, x = _scenes(batch_size, int(rng.integers(2**31)), rng)
            post = vae.encode(x).latent_dist
            rec = vae.decode(post.sample()).sample
            err = rec - x
            loss = err.abs().mean() + (err**2).mean() + kl_weight * post.kl().mean()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            recent = (recent + [float(loss.detach())])[-log_every:]
            if (step + 1) % log_every == 0 or step + 1 == steps:
                logger.info(
                    f"step {step + 1}/{steps} loss {np.mean(recent):.4f} {time.time() - t0:.0f}s"
                )
        train_s = time.time() - t0
        vae.eval().requires_grad_(False)
        with torch.no_grad():  # SD3's latent normalisation, from training scenes
            *_, x = _scenes(256, seed + 7, np.random.default_rng(seed + 7))
            z = vae.encode(x).latent_dist.mode()
        vae.register_to_config(
            shift_factor=round(float(z.mean()), 4), scaling_factor=round(1.0 / float(z.std()), 4)
        )
        vae.save_pretrained(out)
        metrics = {
            "steps": steps,
            "batch_size": batch_size,
            "lr": lr,
            "kl_weight": kl_weight,
            "block_out_channels": list(block_out_channels),
            "latent_channels": latent_channels,
            "params": n_params,
            "loss": float(np.mean(recent)),
            "train_s": round(train_s, 1),
            "shift_factor": vae.config.shift_factor,
            "scaling_factor": vae.config.scaling_factor,
            "eval_val": evaluate_vae(vae, seed=seed),
        }
        (out / "pretrain_metrics.json").write_text(json.dumps(metrics, indent=2) + "\n")
        return metrics


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(message)s")  # progress on stderr
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out_dir")
    ap.add_argument("--steps", type=int, default=1500)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--kl-weight", type=float, default=1e-6)
    ap.add_argument("--channels", default="16,32,32", help="block_out_channels, one per level")
    ap.add_argument("--latent-channels", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args(argv)
    m = pretrain_vae(
        a.out_dir,
        steps=a.steps,
        batch_size=a.batch_size,
        lr=a.lr,
        kl_weight=a.kl_weight,
        block_out_channels=tuple(int(c) for c in a.channels.split(",")),
        latent_channels=a.latent_channels,
        seed=a.seed,
        threads=a.threads,
    )
    print(json.dumps(m, indent=2))


if __name__ == "__main__":
    main()
