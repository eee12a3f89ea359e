"""An independent critic for the coloured-shapes task: a small CNN classifier.

The GenRM demo pays the policy what a learned judge says; the judge's second training
stage is labelled by the colour/shape rule (``prompt_alignment_rule``), so the rule is
not an independent check of it. This critic is: it is a convolutional network trained
only on clean drawn shapes (``mmyatt.datasets.shapes.draw_shape``) with their drawing
labels, never on generator samples, never on the rule's or the judge's verdicts, and no
training (RL or judge) ever reads it. It looks at pixels through learned filters, not at
hue histograms and bounding-box fill as the rule does.

Two heads, colour (6) and shape (3), over a shared trunk; the critic's score for a
record is P(colour = record colour) x P(shape = record shape), in [0, 1] (for clips the
mean over frames). Images are resized to 32x32.

Training (:func:`train_shape_critic`, ~1 minute on one CPU thread): batches of freshly
drawn shapes (all colours and shapes, half-extent 15-36% of the side, centre jitter up
to 20%), each augmented with a random blur, Gaussian pixel noise and a brightness
change, so that soft edges and noise do not make a shape unreadable. Its accuracy on
fresh drawings and its agreement with the rule on generator samples are in
``models/builtin/shape_critic/README.md``.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import torch
from PIL import Image, ImageFilter
from torch import nn

from mmyatt.datasets.shapes import COLOURS, SHAPES, draw_shape
from mmyatt.models.builtin.train_tiny_judge import generator_samples
from mmyatt.rewards.image import prompt_alignment_rule
from mmyatt.step.lr_schedule import cosine_schedule

__all__ = [
    "ShapeCritic",
    "critic_batch",
    "critic_vs_rule",
    "load_shape_critic",
    "train_shape_critic",
]

SIDE = 32
_COLOURS = list(COLOURS)


class ShapeCritic(nn.Module):
    def __init__(self, width: int = 32):
        super().__init__()
        w = width
        self.trunk = nn.Sequential(
            nn.Conv2d(3, w, 3, padding=1),
            nn.ReLU(),
            nn.Conv2d(w, w, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),  # 16
            nn.Conv2d(w, 2 * w, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),  # 8
            nn.Conv2d(2 * w, 2 * w, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),  # 4
            nn.Flatten(),
            nn.Linear(2 * w * 16, 128),
            nn.ReLU(),
        )
        self.colour = nn.Linear(128, len(COLOURS))
        self.shape = nn.Linear(128, len(SHAPES))
        self.width = width

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.trunk(x)
        return self.colour(h), self.shape(h)

    def to_tensor(self, images: list[Image.Image]) -> torch.Tensor:
        arrs = [
            np.asarray(im.convert("RGB").resize((SIDE, SIDE), Image.BILINEAR), dtype=np.float32)
            for im in images
        ]
        return torch.from_numpy(np.stack(arrs)).permute(0, 3, 1, 2) / 127.5 - 1.0

    @torch.no_grad()
    def probabilities(self, images: list[Image.Image]) -> tuple[np.ndarray, np.ndarray]:
        """(N, 6) colour and (N, 3) shape probabilities, in COLOURS / SHAPES order."""
        self.eval()
        c, s = self(self.to_tensor(images))
        return c.softmax(-1).numpy(), s.softmax(-1).numpy()

    def score(self, images: list[Image.Image], colours: list[str], shapes: list[str]) -> np.ndarray:
        """P(colour) x P(shape) for each image and its claimed colour and shape."""
        pc, ps = self.probabilities(images)
        ci = [_COLOURS.index(c) for c in colours]
        si = [SHAPES.index(s) for s in shapes]
        idx = np.arange(len(images))
        return pc[idx, ci] * ps[idx, si]

    def save(self, out_dir: str | Path, info: dict | None = None) -> None:
        from safetensors.torch import save_file

        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        save_file(
            {k: v.contiguous() for k, v in self.state_dict().items()}, out / "model.safetensors"
        )
        cfg = {"width": self.width, "colours": _COLOURS, "shapes": list(SHAPES), **(info or {})}
        (out / "config.json").write_text(json.dumps(cfg, indent=2))


def load_shape_critic(path: str | Path) -> ShapeCritic:
    from safetensors.torch import load_file

    path = Path(path)
    cfg = json.loads((path / "config.json").read_text())
    if cfg["colours"] != _COLOURS or cfg["shapes"] != list(SHAPES):
        raise ValueError(f"{path}: trained for other colours/shapes than this task's")
    model = ShapeCritic(cfg["width"])
    model.load_state_dict(load_file(str(path / "model.safetensors")))
    return model.eval()


def augment_image(img: Image.Image, rng: np.random.Generator) -> Image.Image:
    """A random blur (half the time), a brightness change and Gaussian pixel noise: the
    soft edges and noise of generated images. The critic's training and the shape judge's
    (``models/builtin/train_shape_judge.py``) both use it."""
    if rng.random() < 0.5:
        img = img.filter(ImageFilter.GaussianBlur(float(rng.uniform(0.3, 1.2))))
    a = np.asarray(img, dtype=np.float32)
    a = a * rng.uniform(0.8, 1.15) + rng.normal(0.0, rng.uniform(0.0, 20.0), a.shape)
    return Image.fromarray(np.clip(a, 0, 255).astype(np.uint8))


def critic_batch(n: int, seed: int, augment: bool = True) -> tuple[list[Image.Image], list, list]:
    """``n`` drawn shapes (all combinations) with their colour and shape indices."""
    rng = np.random.default_rng([seed, 11])
    images, cols, shps = [], [], []
    for _ in range(n):
        c, s = int(rng.integers(len(_COLOURS))), int(rng.integers(len(SHAPES)))
        img = _draw_varied(_COLOURS[c], SHAPES[s], rng)
        images.append(augment_image(img, rng) if augment else img)
        cols.append(c)
        shps.append(s)
    return images, cols, shps


def _draw_varied(colour: str, shape: str, rng: np.random.Generator) -> Image.Image:
    """draw_shape with a wider size and position range than the flow task's."""
    return draw_shape(colour, shape, size=SIDE, rng=rng, jitter=0.2, radius=(0.15, 0.36))


def train_shape_critic(
    out_dir: str | Path | None = None,
    *,
    steps: int = 1500,
    batch_size: int = 64,
    lr: float = 2e-3,
    seed: int = 0,
    log=print,
) -> tuple[ShapeCritic, dict]:
    """Train the critic on freshly drawn, augmented shapes; report accuracy on 2000
    fresh clean drawings and 2000 augmented ones (their own seeds); save to ``out_dir``."""
    torch.manual_seed(seed)
    model = ShapeCritic()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=1e-4)
    loss_fn = nn.CrossEntropyLoss()
    schedule = cosine_schedule(opt, steps)  # to zero
    start = time.perf_counter()
    for step in range(steps):
        images, cols, shps = critic_batch(batch_size, seed=1_000_000 * (seed + 1) + step)
        model.train()
        c, s = model(model.to_tensor(images))
        loss = loss_fn(c, torch.tensor(cols)) + loss_fn(s, torch.tensor(shps))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        schedule.step()
        if log and (step + 1) % 250 == 0:
            log(f"[critic] step {step + 1}/{steps} loss {loss.item():.4f}")
    info = {"steps": steps, "seconds": round(time.perf_counter() - start, 1)}
    for name, augment in (("clean", False), ("augmented", True)):
        images, cols, shps = critic_batch(2000, seed=777_777 + seed, augment=augment)
        pc, ps = model.probabilities(images)
        info[f"{name}_colour_accuracy"] = float((pc.argmax(-1) == np.array(cols)).mean())
        info[f"{name}_shape_accuracy"] = float((ps.argmax(-1) == np.array(shps)).mean())
    if log:
        log("[critic] " + json.dumps(info))
    if out_dir is not None:
        model.save(out_dir, {"trained": info})
    return model, info


def critic_vs_rule(generator_dir: str | Path, n: int = 192, seed: int = 60_000) -> dict:
    """Score ``n`` 20-step ODE samples of a flow model (random captions) with the critic
    and with ``prompt_alignment_rule``: their means, correlation and how often they give
    the same verdict at 0.5."""

    samples = generator_samples(
        generator_dir, n, seed=seed, noise_levels=(0.0,), denoise_steps=(20,)
    )
    rule = np.array([prompt_alignment_rule(s["image"], s) for s in samples])
    model = load_shape_critic(Path(__file__).resolve().parent / "shape_critic")
    critic = np.array(
        [float(model.score([s["image"]], [s["colour"]], [s["shape"]]).mean()) for s in samples]
    )
    return {
        "rule_mean": float(rule.mean()),
        "critic_mean": float(critic.mean()),
        "corr": float(np.corrcoef(rule, critic)[0, 1]),
        "same_verdict": float(((rule >= 0.5) == (critic >= 0.5)).mean()),
        "n": n,
    }
