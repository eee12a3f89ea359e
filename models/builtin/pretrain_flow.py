"""Flow-matching pretraining of the tiny text-to-image (or text-to-video) model on
synthetic coloured shapes, so that RL starts from a policy that already draws roughly
the right thing and has reward signal to climb.

Loss (``FlowPolicy.sft_loss``): x_t = (1 - t) x0 + t eps, target v = eps - x0, MSE,
with t ~ logit-normal(0, 1) (SD3's choice: more weight on the middle of the path,
where the velocity is least determined; uniform t trained slower here). Captions are
dropped to the empty prompt 10% of the time so CFG works. Every batch is freshly drawn
shapes: no dataset is stored and nothing repeats.

The text encoder trains jointly with the transformer here (its random init would
otherwise have to carry the caption through frozen random layers); in RL it is frozen.

Defaults and why: 4x4 pixel patches (64 tokens for a 32x32 image; ``build_tiny_flow_model``
itself defaults to 2x2) train ~4x faster per step than 2x2 and on one CPU thread the
number of optimizer steps, not the images seen, decides whether shapes (not just
colours) appear; hence batch 16, lr 1.5e-3, a 1.3M-parameter SD3 transformer (4 layers,
4 heads x 24) and 2500 steps. The step count sets where RL starts: measured on the
shared 2-core machine with one thread (ODE, 20 steps, ``prompt_alignment_rule``):

| steps | wall | alignment (64 prompts) | circle / square / triangle (96 prompts) |
|---|---|---|---|
| 1500 | 4 min | 0.46 | 0.92 / 0.00 / 0.61 (squares drawn as round blobs, box fill 0.75) |
| 2500 (default, ``builtin:tiny_t2i``) | 6 min | 0.59 | 0.96 / 0.26 / 0.75 |
| 4000 | 6.2 min alone | 0.77 | 1.00 / 0.62 / 0.84 (little left for RL to gain) |

Uniform t instead of logit-normal (4000 steps) reached 0.61. Other measured
alternatives: 2x2 patches (0.58M params, batch 32, 500 steps, 6 min) and 4x4 patches at
batch 32 (1000-1500 steps) stayed at chance on shape (alignment ~0.29).

Video (wan-video, 8 x 16 x 16 frames, 4x4 patches, 0.55M params). The direction word
is only learned with ``--position-channels`` (frame/row/column planes and the products
frame x row, frame x column as extra inputs; ``FlowPolicy``) and a frozen text encoder
(``--text-lr-scale 0``; trained jointly, the encoder collapses "left" and "right").
Without the product planes, following the direction is a three-way interaction
(direction x frame x column) that no run learned (CPU and GPU, up to 5000 steps:
``motion_direction`` 0.45-0.51 = chance); with them it is a two-way one, like a colour
word and a colour channel. The built-in ``builtin:tiny_t2v`` is the snapshot after 3000
of 6500 steps of::

    python -m mmyatt.models.builtin.pretrain_flow OUT --kind wan-video --position-channels \
        --text-lr-scale 0 --device cuda --batch-size 32 --steps 6500 --snapshots 1500,3000,4500

(one H200, 2.6 min to step 3000; at the CPU's measured batch-16 step time that is
about 35 minutes on one thread, not run). ODE
``motion_direction`` at CFG 1: 0.49 after 1500 steps, 0.71 after 3000, 0.87 after 4500,
0.93 after 6500: the 3000-step snapshot leaves RL room to climb, the 1500-step one gives
RL nothing to start from (BENCHMARKS.md, video demo). With the product planes but the
text encoder trained jointly (4 or 6 layers, logit-normal or uniform t, batch 16 or 32,
6.4 GPU minutes each) ``motion_direction`` stayed at 0.47-0.54.

Run: ``python -m mmyatt.models.builtin.pretrain_flow OUT_DIR`` (see ``--help``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import time
from pathlib import Path

import numpy as np
import torch

from mmyatt.datasets.geneval import draw_scene, geneval_records
from mmyatt.datasets.geneval import vocab as geneval_vocab
from mmyatt.datasets.shapes import (
    COLOURS,
    DIRECTIONS,
    SHAPES,
    draw_shape,
    motion_records,
    moving_shape_clip,
    shape_records,
)
from mmyatt.models.builtin.flow_tiny import build_tiny_flow_model
from mmyatt.models.flow import FlowPolicy
from mmyatt.protocols import Sampling, prompt_seed
from mmyatt.rewards.geneval_check import accuracy_by_kind, geneval_check
from mmyatt.rewards.image import (
    colour_match,
    motion_direction,
    prompt_alignment_rule,
    shape_match,
)
from mmyatt.rewards.quality import texture
from mmyatt.step.lr_schedule import cosine_schedule

logger = logging.getLogger(__name__)

__all__ = [
    "evaluate_alignment",
    "evaluate_geneval",
    "pretrain_flow",
    "shape_vocab",
    "torch_threads",
]


def shape_vocab() -> list[str]:
    """Every word of the shape and moving-shape captions."""
    return ["a", *COLOURS, *SHAPES, "moving", *DIRECTIONS]


def _batch(kind: str, n: int, size: int, num_frames: int, rng: np.random.Generator) -> list[dict]:
    seed = int(rng.integers(2**31))
    if kind == "geneval":  # the tiny GenEval's drawn scenes, its five kinds shuffled
        recs = geneval_records(n, seed)
        recs = [recs[i] for i in rng.permutation(n)]
        for r in recs:
            r["image"], _ = draw_scene(r, size=size, rng=rng)
        return recs
    if kind == "wan-video":
        recs = motion_records(n, seed)
        for r in recs:
            r["frames"] = moving_shape_clip(
                r["colour"], r["shape"], r["direction"], num_frames=num_frames, size=size, rng=rng
            )
        return recs
    recs = shape_records(n, seed)
    for r in recs:
        r["image"] = draw_shape(r["colour"], r["shape"], size=size, rng=rng)
    return recs


def evaluate_alignment(
    policy: FlowPolicy,
    *,
    n: int = 64,
    seed: int = 1234,
    denoise_steps: int = 20,
    guidance_scale: float = 1.0,
    batch: int = 16,
) -> dict[str, float]:
    """ODE (greedy) samples for ``n`` shape prompts; mean rule rewards.

    Images: prompt_alignment_rule, colour_match, shape_match. Video: also
    motion_direction (the image rules averaged over frames).
    """

    video = policy.family == "wan"
    recs = motion_records(n, seed) if video else shape_records(n, seed)
    scores: dict[str, list[float]] = {"alignment": [], "colour_match": [], "shape_match": []}
    if video:
        scores["motion_direction"] = []
    sampling = Sampling(denoise_steps=denoise_steps, greedy=True, guidance_scale=guidance_scale)
    with torch.no_grad():
        for i in range(0, n, batch):
            chunk = recs[i : i + batch]
            seeds = [prompt_seed(seed, r["id"]) for r in chunk]
            out = policy.generate(chunk, 1, sampling, seeds).outputs
            for o, r in zip(out, chunk):
                scores["alignment"].append(prompt_alignment_rule(o, r))
                scores["colour_match"].append(colour_match(o, r))
                scores["shape_match"].append(shape_match(o, r))
                if video:
                    scores["motion_direction"].append(motion_direction(o, r))
    return {k: float(np.mean(v)) for k, v in scores.items()}


def evaluate_geneval(
    policy: FlowPolicy,
    *,
    split: str = "val",
    n: int = 80,
    seed: int = 0,
    denoise_steps: int = 20,
    batch: int = 16,
    with_texture: bool = False,
) -> dict[str, dict]:
    """ODE (greedy) samples for ``n`` prompts of ``split``'s held-out combinations of the
    tiny GenEval and ``n // 2`` trained ones ("val" to choose, "test" to report); the
    independent checker's accuracy per kind: {"heldout": {...}, "seen": {...}}
    (``with_texture``: each also with "background_hf", the mean of ``quality.texture``)."""

    sets = {
        "heldout": geneval_records(n, seed + 101, heldout=split),
        "seen": geneval_records(n // 2, seed + 102),
    }
    sampling = Sampling(denoise_steps=denoise_steps, greedy=True)
    out = {}
    with torch.no_grad():
        for name, recs in sets.items():
            verdicts, bg = [], []
            for i in range(0, len(recs), batch):
                chunk = recs[i : i + batch]
                seeds = [prompt_seed(seed, r["id"]) for r in chunk]
                images = policy.generate(chunk, 1, sampling, seeds).outputs
                verdicts += [geneval_check(o, r) for o, r in zip(images, chunk)]
                bg += [texture(o)["background_hf"] for o in images]
            out[name] = accuracy_by_kind(recs, verdicts)
            if with_texture:
                out[name]["background_hf"] = float(np.nanmean(bg))
    return out


@contextlib.contextmanager
def torch_threads(n: int):
    """torch's intra-op thread count set to ``n`` for the block, restored after."""
    prev = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(prev)


def pretrain_flow(
    out_dir: str | Path,
    *,
    kind: str = "sd3-image",
    steps: int = 2500,
    batch_size: int = 16,
    lr: float = 1.5e-3,
    seed: int = 0,
    threads: int = 1,
    log_every: int = 50,
    image_size: int | None = None,
    num_frames: int = 8,
    patch_size: int = 4,
    num_layers: int = 4,
    num_attention_heads: int = 4,
    attention_head_dim: int = 24,
    warmup: int = 50,
    eval_samples: int = 64,
    eval_steps: int = 20,
    eval_guidance: tuple[float, ...] = (1.0, 3.0),
    t_dist: str = "logit_normal",
    device: str = "cpu",
    max_minutes: float | None = None,
    text_lr_scale: float = 1.0,
    position_channels: bool = False,
    snapshots: tuple[int, ...] = (),
    task: str = "shapes",
    ema: float = 0.0,
    init: str | Path | None = None,
    vae: str | Path | None = None,
) -> dict:
    """Build the tiny model, train it with the flow-matching loss on fresh shapes, save
    the pipeline directory to ``out_dir`` and return metrics.

    AdamW (weight decay 0) with linear warm-up over ``warmup`` steps then cosine decay
    to 10% of ``lr``; gradient norm clipped at 1. After training, ``eval_samples`` ODE
    samples (``eval_steps`` steps) are scored with the rule rewards at each guidance
    scale in ``eval_guidance``. Returns {"steps", "wall_s", "train_s", "params",
    "text_params", "loss", "eval": {"cfg1.0": {...}, ...}} and writes it to
    ``out_dir/pretrain_metrics.json``.

    ``device`` (e.g. "cuda") is where training runs; data are drawn on the CPU and the
    model is saved and evaluated on the CPU either way. ``max_minutes`` stops training
    early (the schedule is still laid out over ``steps``; the steps actually taken are
    recorded as "steps_done"). ``text_lr_scale`` scales the text encoder's learning rate;
    0 freezes it at its random init. ``position_channels`` (wan-video only): the
    transformer also reads frame/row/column planes and their frame products
    (``FlowPolicy``). ``snapshots``: after each of these step counts the pipeline is also
    saved to ``out_dir/step{N}`` (to pick a base with room left for RL). ``task``
    "geneval": the tiny GenEval's scenes (``datasets/geneval.py``) and vocabulary instead
    of single shapes; its evaluation is the independent checker on the validation split
    (``evaluate_geneval``, once, at CFG 1) instead of the shape rules. ``ema`` > 0:
    an exponential moving average of the weights (decay ``min(ema, (1 + n) / (10 + n))``
    after n steps) is what is saved, snapshots included; 0 saves the trained weights.
    ``init``: a pipeline directory of the same architecture whose weights (transformer and
    text encoder) training starts from instead of the random init (warm-up and cosine are
    laid out anew over ``steps``). ``vae``: a saved ``AutoencoderKL`` folder
    (``pretrain_vae``); the model then learns in its latent space (sd3-image only), and
    the VAE is frozen and saved with the pipeline.
    """
    if steps < 1 or batch_size < 1:
        raise ValueError(f"steps and batch_size must be >= 1, got {steps}, {batch_size}")
    out, snapshots = Path(out_dir), tuple(snapshots)
    with torch_threads(threads):
        t_start = time.time()
        build_tiny_flow_model(
            out,
            kind=kind,
            vocab=shape_vocab() if task == "shapes" else geneval_vocab(),
            seed=seed,
            image_size=image_size,
            num_frames=num_frames,
            patch_size=patch_size,
            num_layers=num_layers,
            num_attention_heads=num_attention_heads,
            attention_head_dim=attention_head_dim,
            position_channels=position_channels,
            vae=vae,
        )
        policy = FlowPolicy.load(out)
        if init is not None:
            start = FlowPolicy.load(init)
            policy.transformer.load_state_dict(start.transformer.state_dict())
            policy.text_encoder.load_state_dict(start.text_encoder.state_dict())
            logger.info(f"weights from {init}")
        policy.transformer.to(device)
        policy.text_encoder.to(device)
        train_text = text_lr_scale > 0
        policy.text_encoder.train(train_text).requires_grad_(train_text)
        policy.transformer.train()
        params = list(policy.transformer.parameters())
        groups = [{"params": params, "lr": lr}]
        if train_text:
            text_params = list(policy.text_encoder.parameters())
            groups.append({"params": text_params, "lr": lr * text_lr_scale})
            params = params + text_params
        opt = torch.optim.AdamW(groups, lr=lr, weight_decay=0.0)

        sched = cosine_schedule(opt, steps, warmup=warmup, floor=0.1)
        rng = np.random.default_rng(seed)
        gen = torch.Generator().manual_seed(seed)
        n_params = sum(p.numel() for p in policy.transformer.parameters())
        n_text = sum(p.numel() for p in policy.text_encoder.parameters())
        logger.info(
            f"pretrain {kind}: transformer {n_params:,} params, text encoder {n_text:,}, "
            f"{steps} steps x batch {batch_size}, {torch.get_num_threads()} thread(s), {device}"
        )
        averaged = _Ema(params, ema) if ema > 0 else None
        recent: list[float] = []
        t_train = time.time()
        done = 0
        for step in range(steps):
            if max_minutes is not None and time.time() - t_train > 60 * max_minutes:
                logger.info(f"stopping at step {step}: max_minutes {max_minutes} reached")
                break
            batch = _batch(
                kind if task == "shapes" else task, batch_size, policy.image_size, num_frames, rng
            )
            loss = policy.sft_loss(batch, t_dist=t_dist, generator=gen)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            sched.step()
            if averaged is not None:
                averaged.update()
            recent.append(float(loss.detach()))
            recent = recent[-log_every:]
            done = step + 1
            if done in snapshots:
                with _swapped(averaged):
                    _save_on_cpu(policy, out / f"step{done}", device)
                logger.info(f"snapshot saved: {out / f'step{done}'}")
            if log_every and ((step + 1) % log_every == 0 or step + 1 == steps):
                logger.info(
                    f"step {step + 1}/{steps} loss {np.mean(recent):.4f} lr {sched.get_last_lr()[0]:.2e} "
                    f"{time.time() - t_train:.0f}s"
                )
        train_s = time.time() - t_train
        if averaged is not None:
            averaged.swap()  # from here on the policy holds the averaged weights
        policy.text_encoder.eval().requires_grad_(False)
        policy.transformer.eval()
        policy.transformer.to("cpu")
        policy.text_encoder.to("cpu")
        policy.save(str(out))
        evals = {}
        if task == "geneval":
            evals["geneval_val"] = evaluate_geneval(policy, denoise_steps=eval_steps)
            logger.info(f"eval geneval (validation): {json.dumps(evals['geneval_val'])}")
            eval_guidance = ()
        for g in eval_guidance:
            evals[f"cfg{g}"] = evaluate_alignment(
                policy, n=eval_samples, denoise_steps=eval_steps, guidance_scale=g
            )
            logger.info(
                f"eval cfg {g}: " + ", ".join(f"{k} {v:.3f}" for k, v in evals[f"cfg{g}"].items())
            )
        metrics = {
            "kind": kind,
            "task": task,
            "steps": steps,
            "steps_done": done,
            "text_lr_scale": text_lr_scale,
            "position_channels": position_channels,
            "device": str(device),
            "batch_size": batch_size,
            "lr": lr,
            "ema": ema,
            "init": None if init is None else str(init),
            "vae": None if vae is None else str(vae),
            "params": n_params,
            "text_params": n_text,
            "loss": float(np.mean(recent)),
            "train_s": round(train_s, 1),
            "wall_s": round(time.time() - t_start, 1),
            "eval": evals,
        }
        (out / "pretrain_metrics.json").write_text(json.dumps(metrics, indent=2) + "\n")
        return metrics


class _Ema:
    """An exponential moving average of ``params`` with the usual warm-up of its decay
    (``min(decay, (1 + n) / (10 + n))`` at update n), so early averages do not hold the
    random init. ``swap`` exchanges the averaged and the live weights in place."""

    def __init__(self, params: list[torch.nn.Parameter], decay: float):
        self.params, self.decay, self.n = params, decay, 0
        self.shadow = [p.detach().clone() for p in params]

    @torch.no_grad()
    def update(self) -> None:
        d = min(self.decay, (1 + self.n) / (10 + self.n))
        self.n += 1
        for s, p in zip(self.shadow, self.params):
            s.lerp_(p.detach(), 1.0 - d)

    @torch.no_grad()
    def swap(self) -> None:
        for s, p in zip(self.shadow, self.params):
            tmp = p.detach().clone()
            p.copy_(s)
            s.copy_(tmp)


@contextlib.contextmanager
def _swapped(averaged: _Ema | None):
    """The averaged weights in place for the block (nothing if ``averaged`` is None)."""
    if averaged is not None:
        averaged.swap()
    try:
        yield
    finally:
        if averaged is not None:
            averaged.swap()


def _save_on_cpu(policy: FlowPolicy, path: Path, device: str) -> None:
    """Save the pipeline from the CPU and move the weights back to ``device``."""
    policy.transformer.to("cpu")
    policy.text_encoder.to("cpu")
    policy.save(str(path))
    policy.transformer.to(device)
    policy.text_encoder.to(device)


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(message)s")  # progress on stderr
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out_dir")
    ap.add_argument("--kind", default="sd3-image", choices=["sd3-image", "flux-image", "wan-video"])
    ap.add_argument(
        "--task",
        default="shapes",
        choices=["shapes", "geneval"],
        help="what to draw: one shape per image, or the tiny GenEval's scenes",
    )
    ap.add_argument("--steps", type=int, default=2500)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--lr", type=float, default=1.5e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--log-every", type=int, default=50)
    ap.add_argument("--image-size", type=int, default=None)
    ap.add_argument("--num-frames", type=int, default=8)
    ap.add_argument("--patch-size", type=int, default=4)
    ap.add_argument("--num-layers", type=int, default=4)
    ap.add_argument(
        "--attention-head-dim",
        type=int,
        default=24,
        help="4 heads of this width; the width must reach patch^2 x 3 (the velocity "
        "of a patch, its noise included, passes through it)",
    )
    ap.add_argument(
        "--ema",
        type=float,
        default=0.0,
        help="decay of the weight average that is saved (e.g. 0.999; 0: no average)",
    )
    ap.add_argument("--warmup", type=int, default=50)
    ap.add_argument(
        "--init", default=None, help="start from this pipeline's weights (same architecture)"
    )
    ap.add_argument(
        "--vae", default=None, help="learn in this AutoencoderKL's latent space (pretrain_vae)"
    )
    ap.add_argument("--eval-samples", type=int, default=64)
    ap.add_argument("--t-dist", default="logit_normal", choices=["logit_normal", "uniform"])
    ap.add_argument("--device", default="cpu", help='where to train, e.g. "cuda"')
    ap.add_argument("--max-minutes", type=float, default=None, help="stop training early")
    ap.add_argument(
        "--text-lr-scale", type=float, default=1.0, help="text encoder lr / lr (0: frozen)"
    )
    ap.add_argument(
        "--position-channels",
        action="store_true",
        help="wan-video: frame/row/column planes and frame x row, frame x column as inputs "
        "(FlowPolicy position_channels)",
    )
    ap.add_argument(
        "--snapshots",
        default="",
        help="comma-separated step counts after which the pipeline is also saved to OUT/stepN",
    )
    a = ap.parse_args(argv)
    m = pretrain_flow(
        a.out_dir,
        kind=a.kind,
        steps=a.steps,
        batch_size=a.batch_size,
        lr=a.lr,
        seed=a.seed,
        threads=a.threads,
        log_every=a.log_every,
        image_size=a.image_size,
        num_frames=a.num_frames,
        patch_size=a.patch_size,
        num_layers=a.num_layers,
        attention_head_dim=a.attention_head_dim,
        eval_samples=a.eval_samples,
        t_dist=a.t_dist,
        device=a.device,
        max_minutes=a.max_minutes,
        text_lr_scale=a.text_lr_scale,
        position_channels=a.position_channels,
        snapshots=tuple(int(x) for x in a.snapshots.split(",") if x.strip()),
        task=a.task,
        ema=a.ema,
        warmup=a.warmup,
        init=a.init,
        vae=a.vae,
    )
    print(json.dumps(m, indent=2))


if __name__ == "__main__":
    main()
