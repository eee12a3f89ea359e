"""`mmyatt bench flow-real`: a flow step of real size (SD3.5-medium at 512x512).

What is built (random weights, from configs, nothing downloaded):

* the transformer: ``SD3Transformer2DModel`` with the values of the SD3.5-medium
  checkpoint's ``transformer/config.json`` (24 layers of 24 heads x 64, width 1536, joint
  attention width 4096, pooled width 2048, 16 latent channels, patch 2, RMS q/k norm,
  dual attention in layers 0-12, ``pos_embed_max_size`` 384): about 2.5 B parameters;
* the text encoders: CLIP-L (768 wide, 12 layers) and CLIP-G (1280 wide, 32 layers) with
  projections, as in the pipeline; the 4.7 B T5 is left out, and then
  ``StableDiffusion3Pipeline`` (and the project's loader, which mirrors it) feeds zeros of
  the T5's shape: the transformer sees 77 + 256 = 333 text tokens x 4096 and a pooled
  2048, the real shapes. Prompts are tokenized byte by byte (a tokenizer without merges);
* the VAE: the SD3 ``AutoencoderKL`` (128-256-512-512 channels, 16 latent channels,
  factor 8), used to decode the final latents;
* the scheduler: ``FlowMatchEulerDiscreteScheduler(shift=3.0)``.

They are written as a ``StableDiffusion3Pipeline`` folder and loaded back with the
project's loader (``FlowPolicy.load``), so the bench runs what a user's run would load.

Measured, each phase with its peak device memory (``torch.cuda.max_memory_allocated``,
reset per phase; on CPU the process's resident memory at the phase's end instead):

* ``rollout_mmyatt``: ``FlowPolicy.generate`` (SDE sampler, CFG, VAE decode to PIL);
* ``rollout_diffusers``: ``StableDiffusion3Pipeline.__call__`` built from the same loaded
  components (the same transformer object), same prompts, image size, steps and guidance;
  ``rollout_ratio_mmyatt_over_diffusers`` compares their seconds;
* ``update_flow_grpo``: one Flow-GRPO update (PPO-clip over every trained transition,
  gradients accumulated over one denoising step's rows at a time, one AdamW step);
* ``update_nft``: one DiffusionNFT update (``FlowNFT.loss`` one prompt group at a time,
  one AdamW step).

Training is full fine-tuning with the weights, gradients and AdamW state in the model's
dtype (bf16 on the GPU: the documented bf16 choice, no float32 master copy). MFU =
transformer FLOPs executed / seconds / 989 TFLOP/s (dense bf16 of one H100 or H200
SXM), the FLOPs counted from the config (``sd3_forward_flops``). MFU is reported on
CUDA in bf16 only; elsewhere the achieved TFLOP/s are reported and MFU is null.

``size="tiny"`` runs the same code on a scaled-down config (2 layers, heads of 16,
64x64 images, 2 steps) in seconds on a CPU: the bench's dry run.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

from mmyatt import algorithms as alg
from mmyatt.models.flow import FlowPolicy
from mmyatt.models.flow_nft import FlowNFT, NFTSettings
from mmyatt.protocols import Sampling

log = logging.getLogger(__name__)

PEAK_BF16_FLOPS = 989e12  # dense bf16 of one H100 / H200 SXM (as mmyatt.bench.engines)
CLIP_MAX_LENGTH = 77

# stabilityai/stable-diffusion-3.5-medium, transformer/config.json
SD35_MEDIUM_TRANSFORMER = {
    "sample_size": 128,
    "patch_size": 2,
    "in_channels": 16,
    "out_channels": 16,
    "num_layers": 24,
    "attention_head_dim": 64,
    "num_attention_heads": 24,
    "joint_attention_dim": 4096,
    "caption_projection_dim": 1536,
    "pooled_projection_dim": 2048,
    "pos_embed_max_size": 384,
    "dual_attention_layers": tuple(range(13)),
    "qk_norm": "rms_norm",
}
# the SD3 / SD3.5 VAE (vae/config.json)
SD3_VAE = {
    "in_channels": 3,
    "out_channels": 3,
    "down_block_types": ("DownEncoderBlock2D",) * 4,
    "up_block_types": ("UpDecoderBlock2D",) * 4,
    "block_out_channels": (128, 256, 512, 512),
    "layers_per_block": 2,
    "latent_channels": 16,
    "norm_num_groups": 32,
    "sample_size": 1024,
    "scaling_factor": 1.5305,
    "shift_factor": 0.0609,
    "use_quant_conv": False,
    "use_post_quant_conv": False,
}
# CLIP-L (text_encoder) and OpenCLIP bigG (text_encoder_2) of the SD3 pipelines
CLIP_L = {"hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 12,
          "num_attention_heads": 12, "projection_dim": 768, "hidden_act": "quick_gelu"}  # fmt: skip
CLIP_G = {"hidden_size": 1280, "intermediate_size": 5120, "num_hidden_layers": 32,
          "num_attention_heads": 20, "projection_dim": 1280, "hidden_act": "gelu"}  # fmt: skip

SIZES: dict[str, dict] = {
    "sd3.5-medium": {
        "transformer": SD35_MEDIUM_TRANSFORMER,
        "vae": SD3_VAE,
        "clip_l": CLIP_L,
        "clip_g": CLIP_G,
        "clip_vocab": 49408,
        "t5_tokens": 256,
        "image_size": 512,
        "steps": 10,
        "prompts": 2,
        "group_size": 4,
        "forward_batch": 8,
        "repetitions": 2,
        "dtype": "bfloat16",
    },
    "tiny": {
        "transformer": {
            **SD35_MEDIUM_TRANSFORMER,
            "sample_size": 8,
            "num_layers": 2,
            "attention_head_dim": 16,
            "num_attention_heads": 2,
            "joint_attention_dim": 64,
            "caption_projection_dim": 32,
            "pooled_projection_dim": 32,
            "pos_embed_max_size": 16,
            "dual_attention_layers": (0,),
        },
        "vae": {
            **SD3_VAE,
            "block_out_channels": (8, 8, 8, 8),
            "layers_per_block": 1,
            "norm_num_groups": 4,
            "sample_size": 64,
        },  # fmt: skip
        "clip_l": {
            "hidden_size": 16,
            "intermediate_size": 32,
            "num_hidden_layers": 1,
            "num_attention_heads": 2,
            "projection_dim": 16,
            "hidden_act": "quick_gelu",
        },  # fmt: skip
        "clip_g": {
            "hidden_size": 16,
            "intermediate_size": 32,
            "num_hidden_layers": 1,
            "num_attention_heads": 2,
            "projection_dim": 16,
            "hidden_act": "gelu",
        },  # fmt: skip
        "clip_vocab": 514,
        "t5_tokens": 8,
        "image_size": 64,
        "steps": 2,
        "prompts": 2,
        "group_size": 2,
        "forward_batch": 4,
        "repetitions": 1,
        "dtype": "float32",
    },
}
PROMPTS = [
    "a photo of a red apple on a wooden table",
    "a watercolor painting of a lighthouse at dusk",
    "a blue bicycle leaning against a brick wall",
    "a cat sleeping on a green sofa",
]
GUIDANCE = 4.5  # Flow-GRPO's CFG scale for SD3.5-medium rollouts
NOISE_LEVEL = 0.7


# --------------------------------------------------------------------------------------
# FLOPs
# --------------------------------------------------------------------------------------
def sd3_forward_flops(config: dict, image_tokens: int, text_tokens: int) -> float:
    """Matrix FLOPs (2 per multiply-add) of one ``SD3Transformer2DModel`` forward on one
    row (one image), counted from the config.

    With D = num_attention_heads x attention_head_dim, Ti image tokens ((latent side /
    patch)^2), Tt text tokens, T = Ti + Tt, L layers (the last one ``context_pre_only``),
    Ld = dual attention layers, p patch, C in/out channels, Dj joint_attention_dim,
    Dp pooled_projection_dim::

        F = 2 Ti (C p^2) D                          patch embedding (conv)
          + 2 Tt Dj D                               context embedder
          + 2 (256 D + D^2) + 2 (Dp D + D^2)        timestep and pooled embedders
          + sum over layers:
              24 Ti D^2                             image q,k,v (3D^2), out (D^2), MLP (8D^2)
            + 24 Tt D^2   (6 Tt D^2 in the last)    text stream (only q,k,v in the last)
            + 4 T^2 D                               joint attention: Q K^T and A V
            + 8 Ti D^2 + 4 Ti^2 D   (Ld layers)     dual (image-only) attention
            + 2 D (6D or 9D) + 2 D (6D or 2D)       adaLN modulations (per row)
          + 2 D (2D) + 2 Ti D (p^2 C)               final adaLN and projection

    Norms, activations, softmax and element-wise ops are left out (well under 1%). At
    SD3.5-medium, 512x512 (Ti = 1024) and 333 text tokens this is about 2.4 TFLOP.
    A training row costs 3 F (forward and backward, without recomputation).
    """
    c = config
    d = int(c["num_attention_heads"]) * int(c["attention_head_dim"])
    p, cin, cout = int(c["patch_size"]), int(c["in_channels"]), int(c.get("out_channels") or 0)
    cout = cout or cin
    n_layers, dual = int(c["num_layers"]), set(c.get("dual_attention_layers") or ())
    ti, tt = image_tokens, text_tokens
    t = ti + tt
    f = 2.0 * ti * cin * p * p * d
    f += 2.0 * tt * int(c["joint_attention_dim"]) * int(c["caption_projection_dim"])
    f += 2.0 * (256 * d + d * d) + 2.0 * (int(c["pooled_projection_dim"]) * d + d * d)
    for layer in range(n_layers):
        last = layer == n_layers - 1
        f += 24.0 * ti * d * d
        f += (6.0 if last else 24.0) * tt * d * d
        f += 4.0 * t * t * d
        if layer in dual:
            f += 8.0 * ti * d * d + 4.0 * ti * ti * d
        f += 2.0 * d * (9 if layer in dual else 6) * d + 2.0 * d * (2 if last else 6) * d
    f += 2.0 * d * 2 * d + 2.0 * ti * d * p * p * cout
    return f


# --------------------------------------------------------------------------------------
# building the pipeline folder
# --------------------------------------------------------------------------------------
def _byte_tokenizer(max_length: int):
    """A CLIPTokenizer without merges: every byte is a token (514 ids), nothing downloaded."""
    from transformers import CLIPTokenizer

    keep = [*range(33, 127), *range(161, 173), *range(174, 256)]
    extra = [b for b in range(256) if b not in keep]
    chars = [chr(b) for b in keep] + [chr(256 + i) for i in range(len(extra))]
    words = chars + [ch + "</w>" for ch in chars] + ["<|startoftext|>", "<|endoftext|>"]
    vocab = {w: i for i, w in enumerate(words)}
    return CLIPTokenizer(vocab=vocab, merges=[], model_max_length=max_length)


def _clip(cfg: dict, vocab: int, tok, seed: int):
    from transformers import CLIPTextConfig, CLIPTextModelWithProjection

    torch.manual_seed(seed)
    conf = CLIPTextConfig(
        vocab_size=vocab,
        max_position_embeddings=CLIP_MAX_LENGTH,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        **cfg,
    )
    return CLIPTextModelWithProjection(conf).eval()


def build_pipeline(root: Path, size: str, device: str, dtype: torch.dtype) -> Path:
    """Write a StableDiffusion3Pipeline folder of ``size`` with random weights to ``root``
    (the modules are initialised on ``device``, which is fast for billions of weights)."""
    from diffusers import (
        AutoencoderKL,
        FlowMatchEulerDiscreteScheduler,
        SD3Transformer2DModel,
        StableDiffusion3Pipeline,
    )

    s = SIZES[size]
    tok = _byte_tokenizer(CLIP_MAX_LENGTH)
    with torch.device(device):
        torch.manual_seed(0)
        transformer = SD3Transformer2DModel(**s["transformer"]).to(dtype).eval()
        torch.manual_seed(1)
        vae = AutoencoderKL(**s["vae"]).to(dtype).eval()
        te1 = _clip(s["clip_l"], s["clip_vocab"], tok, 2).to(dtype)
        te2 = _clip(s["clip_g"], s["clip_vocab"], tok, 3).to(dtype)
    pipe = StableDiffusion3Pipeline(
        transformer=transformer,
        scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0),
        vae=vae,
        text_encoder=te1,
        text_encoder_2=te2,
        text_encoder_3=None,  # zeros of the T5's shape, as the pipeline does without it
        tokenizer=tok,
        tokenizer_2=tok,
        tokenizer_3=None,
    )
    pipe.save_pretrained(root)
    del pipe, transformer, vae, te1, te2
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    return root


# --------------------------------------------------------------------------------------
# measuring
# --------------------------------------------------------------------------------------
def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _rss_mb() -> float | None:
    try:
        pages = int(Path("/proc/self/statm").read_text().split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return pages * os.sysconf("SC_PAGE_SIZE") / 2**20


class _Phases:
    """Seconds and peak memory of named phases."""

    def __init__(self, device: torch.device):
        self.device, self.memory = device, {}

    @contextlib.contextmanager
    def phase(self, name: str):
        cuda = self.device.type == "cuda"
        if cuda:
            _sync(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        try:
            yield
        finally:
            _sync(self.device)
            self.memory[name] = {
                "device_peak_gb": torch.cuda.max_memory_allocated(self.device) / 2**30
                if cuda
                else None,
                "cpu_rss_gb": (_rss_mb() or 0.0) / 1024 or None,
            }


def _timed(device, fn, *args, **kwargs) -> tuple[float, object]:
    _sync(device)
    t0 = time.perf_counter()
    out = fn(*args, **kwargs)
    _sync(device)
    return time.perf_counter() - t0, out


def _diffusers_pipeline(policy: FlowPolicy):
    """StableDiffusion3Pipeline over the policy's own loaded modules (the same objects)."""
    from diffusers import FlowMatchEulerDiscreteScheduler, StableDiffusion3Pipeline

    enc = policy.prompt_encoder
    return StableDiffusion3Pipeline(
        transformer=policy.transformer,
        scheduler=FlowMatchEulerDiscreteScheduler.from_config(policy.scheduler_config),
        vae=policy.vae.vae,
        text_encoder=enc.te1,
        text_encoder_2=enc.te2,
        text_encoder_3=enc.te3,
        tokenizer=enc.tok1,
        tokenizer_2=enc.tok2,
        tokenizer_3=enc.tok3,
    )


def _step_slice(r, k: int):
    """The rollout restricted to its k-th trained transition (every sample): a
    micro-batch of one denoising step's rows."""
    ctx = dict(r.context)
    for key in ("x", "sigma", "sigma_next", "noise_level"):
        ctx[key] = ctx[key][:, k : k + 1]
    return r.with_(
        actions=r.actions[:, k : k + 1],
        logprobs=r.logprobs[:, k : k + 1],
        mask=r.mask[:, k : k + 1],
        context=ctx,
        advantages=r.advantages,
    )


def _grpo_update(policy: FlowPolicy, opt, r, groups: int) -> int:
    """One Flow-GRPO update over every trained transition; returns the rows trained."""
    rewards = torch.randn(len(r))  # throughput only: the reward's value does not matter
    index = torch.arange(groups).repeat_interleave(len(r) // groups)
    adv = alg.grpo_advantages(rewards, index).to(policy.device)
    r = r.with_(advantages=adv)
    a = r.num_actions
    opt.zero_grad(set_to_none=True)
    for k in range(a):
        part = _step_slice(r, k)
        lp = policy.logprobs(part)
        loss_mat, _ = alg.ppo_clip_loss(
            lp, part.logprobs.to(lp.device), adv, part.mask.to(lp.device),
            clip_low=1e-4, clip_high=1e-4,
        )  # fmt: skip
        (alg.aggregate_loss(loss_mat, part.mask.to(lp.device), "token-mean") / a).backward()
    opt.step()
    return len(r) * a


def _nft_update(policy: FlowPolicy, nft: FlowNFT, opt, r, step: int) -> int:
    """One DiffusionNFT update, one prompt group at a time; returns the rows trained."""
    rewards = torch.randn(len(r))
    index = torch.arange(len(r.group_slices())).repeat_interleave(len(r) // len(r.group_slices()))
    r = r.with_(rewards=rewards, advantages=alg.grpo_advantages(rewards, index))
    opt.zero_grad(set_to_none=True)
    slices = r.group_slices()
    for sl in slices:
        rows, _ = nft.loss(r.select(list(range(sl.start, sl.stop))), step)
        (rows.sum() / len(r)).backward()
    opt.step()
    nft.update_old(step)
    return len(r) * nft.s.timesteps_per_sample


def _cuda_name(device: torch.device) -> str | None:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else None


def bench_flow_real(
    quick: bool = False,
    size: str | None = None,
    device: str | None = None,
    repetitions: int | None = None,
) -> dict:
    """Measure the real-size flow step (module docstring). ``size``: "sd3.5-medium" or
    "tiny" (default: the env ``MMYATT_FLOW_REAL_SIZE``, else tiny when ``quick`` or
    without CUDA, sd3.5-medium otherwise)."""
    cuda = torch.cuda.is_available()
    size = (
        size
        or os.environ.get("MMYATT_FLOW_REAL_SIZE")
        or ("tiny" if quick or not cuda else "sd3.5-medium")
    )
    if size not in SIZES:
        raise ValueError(f"size must be one of {sorted(SIZES)}, got {size!r}")
    s = SIZES[size]
    dev = torch.device(device or ("cuda" if cuda else "cpu"))
    dtype = getattr(torch, s["dtype"]) if dev.type == "cuda" else torch.float32
    reps = repetitions or s["repetitions"]
    steps, n_prompts, group = s["steps"], s["prompts"], s["group_size"]
    prompts = [{"prompt": p, "id": f"p{i}", "_index": i} for i, p in enumerate(PROMPTS[:n_prompts])]
    n_images = n_prompts * group
    if dev.type == "cpu":
        torch.set_num_threads(1)  # the dry run: tiny shapes, one thread is fastest
    phases = _Phases(dev)
    out: dict = {
        "benchmark": "flow-real",
        "size": size,
        "device": str(dev),
        "gpu": _cuda_name(dev),
        "dtype": str(dtype).removeprefix("torch."),
        "image_size": s["image_size"],
        "denoise_steps": steps,
        "prompts": n_prompts,
        "group_size": group,
        "images_per_rollout": n_images,
        "guidance_scale": GUIDANCE,
        "forward_batch": s["forward_batch"],
        "repetitions": reps,
        "text_encoders": f"CLIP-L and CLIP-G of the {size} config (random weights); no T5: "
        f"zeros of its shape ({s['t5_tokens']} x {s['transformer']['joint_attention_dim']}), "
        "as StableDiffusion3Pipeline does without text_encoder_3",
        "training": f"full fine-tuning; weights, gradients and AdamW state in "
        f"{str(dtype).removeprefix('torch.')}",
    }
    t_start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="mmyatt-flow-real-") as tmp:
        with phases.phase("build"):
            t_build, _ = _timed(dev, build_pipeline, Path(tmp) / "sd3", size, str(dev), dtype)
            t_load, policy = _timed(
                dev,
                FlowPolicy.load,
                Path(tmp) / "sd3",
                dtype=dtype,
                image_size=s["image_size"],
                forward_batch=s["forward_batch"],
                max_sequence_length=s["t5_tokens"],
            )
            policy.to(dev)
        out["build_s"], out["load_s"] = t_build, t_load
    tr = policy.transformer
    out["transformer_params"] = sum(p.numel() for p in tr.parameters())
    latent = policy.sample_shape[-1]
    image_tokens = (latent // int(tr.config.patch_size)) ** 2
    text_tokens = CLIP_MAX_LENGTH + s["t5_tokens"]
    flops = sd3_forward_flops(dict(tr.config), image_tokens, text_tokens)
    out.update(
        latent_shape=list(policy.sample_shape),
        image_tokens=image_tokens,
        text_tokens=text_tokens,
        transformer_forward_flops_per_image=flops,
    )
    cfg_rows = 2 if GUIDANCE > 1 else 1

    # ---- rollouts: mmyatt's sampler against diffusers' own pipeline ------------------
    sampling = Sampling(denoise_steps=steps, noise_level=NOISE_LEVEL, guidance_scale=GUIDANCE)
    seeds = list(range(n_prompts))
    pipe = _diffusers_pipeline(policy)
    pipe.set_progress_bar_config(disable=True)
    flat_prompts = [p["prompt"] for p in prompts]

    def run_mmyatt():
        return policy.generate(prompts, group, sampling, seeds)

    def run_diffusers():
        gen = torch.Generator(dev).manual_seed(0)
        with torch.no_grad():
            return pipe(
                prompt=flat_prompts,
                num_images_per_prompt=group,
                num_inference_steps=steps,
                guidance_scale=GUIDANCE,
                height=s["image_size"],
                width=s["image_size"],
                max_sequence_length=s["t5_tokens"],
                generator=gen,
                output_type="pil",
            ).images

    t_mm, t_df = [], []
    with phases.phase("warmup"):
        run_mmyatt()
        run_diffusers()
    for _ in range(reps):  # interleaved, so drift hits both alike
        with phases.phase("rollout_mmyatt"):
            t, rollout = _timed(dev, run_mmyatt)
        t_mm.append(t)
        with phases.phase("rollout_diffusers"):
            t, images = _timed(dev, run_diffusers)
        t_df.append(t)
    if len(images) != n_images or len(rollout.outputs) != n_images:
        raise RuntimeError(
            f"expected {n_images} images, got {len(images)} / {len(rollout.outputs)}"
        )
    roll_flops = n_images * steps * cfg_rows * flops
    out["rollout_mmyatt"] = _rate(statistics.median(t_mm), n_images, roll_flops, dev, dtype, t_mm)
    out["rollout_diffusers"] = _rate(
        statistics.median(t_df), n_images, roll_flops, dev, dtype, t_df
    )
    out["rollout_ratio_mmyatt_over_diffusers"] = statistics.median(t_mm) / statistics.median(t_df)

    # ---- one Flow-GRPO update over the rollout's transitions --------------------------
    tr.train().requires_grad_(True)
    opt = torch.optim.AdamW([p for p in tr.parameters() if p.requires_grad], lr=1e-6)
    with phases.phase("update_flow_grpo"):
        t_grpo, rows = _timed(dev, _grpo_update, policy, opt, rollout, n_prompts)
    # rows: cond forward + backward (3F) and the no-grad CFG branch forward (F)
    grpo_flops = rows * (3 + (cfg_rows - 1)) * flops
    out["update_flow_grpo"] = {
        "rows": rows,
        **_rate(t_grpo, n_images, grpo_flops, dev, dtype, [t_grpo]),
    }
    del rollout
    gc.collect()

    # ---- one DiffusionNFT update ---------------------------------------------------------
    nft = FlowNFT(policy, NFTSettings(), seed=0)
    with nft.sampling(), torch.no_grad():
        r_nft = policy.generate(prompts, group, Sampling(denoise_steps=steps, greedy=True), seeds)
    with phases.phase("update_nft"):
        t_nft, rows = _timed(dev, _nft_update, policy, nft, opt, r_nft, 0)
    # rows: the old policy's forward (F) and the trained forward + backward (3F)
    out["update_nft"] = {
        "rows": rows,
        "timesteps_per_sample": nft.s.timesteps_per_sample,
        **_rate(t_nft, n_images, rows * 4 * flops, dev, dtype, [t_nft]),
    }
    out["memory"] = phases.memory
    out["total_s"] = time.perf_counter() - t_start
    del nft, opt, r_nft
    gc.collect()
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return out


def _rate(seconds: float, images: int, flops: float, dev, dtype, samples: list[float]) -> dict:
    mfu = None
    if dev.type == "cuda" and dtype == torch.bfloat16:
        mfu = flops / seconds / PEAK_BF16_FLOPS
    return {
        "seconds": seconds,
        "seconds_each": samples,
        "images_per_s": images / seconds,
        "transformer_tflops": flops / 1e12,
        "achieved_tflop_per_s": flops / seconds / 1e12,
        "mfu": mfu,
    }
