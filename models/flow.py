"""Flow-matching text-to-image / text-to-video generators as RL policies (Flow-GRPO).

``FlowPolicy`` wraps a diffusers transformer (``SD3Transformer2DModel``,
``FluxTransformer2DModel`` or ``WanTransformer3DModel``) plus a frozen text encoder and
implements the Policy protocol: a rollout's actions are the denoising transitions
x_k -> x_{k+1} at the trained steps, each with the log-prob of the Gaussian SDE step of
``flow_sde``.

Two kinds of directory load with ``FlowPolicy.load``:

* Our tiny built-ins (``build_tiny_flow_model``; model_index class ``MMYattFlowPipeline``)
  work in PIXEL space (images scaled to [-1, 1], no VAE): on a CPU a 32x32x3 image with
  patch 2 is 256 tokens, as cheap as a real model's latent, and it removes an
  autoencoder that would have to be pretrained too.
* Standard diffusers pipeline folders (``DiffusionPipeline.save_pretrained`` layout) of
  ``StableDiffusion3Pipeline`` (CLIP-L + CLIP-G, optional T5, ``AutoencoderKL``),
  ``FluxPipeline`` (CLIP + T5, ``AutoencoderKL``, 2x2 latent packing, embedded guidance
  for guidance-distilled models) and ``WanPipeline`` (Wan 2.1: UMT5, ``AutoencoderKLWan``)
  work in LATENT space: the initial noise has the latent shape, the actions and
  log-probs are latent transitions, the final latents are VAE-decoded (with the VAE's
  scaling/shift or Wan's latents_mean/std) into images or frames, ``sft_loss`` encodes
  its targets with the VAE. Prompt encoding and sigmas (the scheduler config's
  ``shift``, or ``use_dynamic_shifting`` with the pipeline's resolution-dependent mu)
  follow each pipeline, so a greedy rollout reproduces the diffusers pipeline's own
  Euler/ODE output (tested). Details and the unsupported cases (Wan 2.2 two-expert
  folders, other pipeline classes: NotImplementedError) are in ``flow_pipeline``.
  Square outputs only (``image_size``); ``save`` writes the same diffusers layout back
  (plus an ``_mmyatt`` block with the geometry, which diffusers ignores).

Text conditioning of the built-ins is a ``transformers.CLIPTextModelWithProjection``
built from a small ``CLIPTextConfig`` with a word-level tokenizer made in code (``tokenizers`` WordLevel
over the caption vocabulary, saved as a ``PreTrainedTokenizerFast``). CLIP gives both
what SD3/Flux need: per-token states (B, L, D) for joint attention and a pooled
projection (B, Dp) for the timestep modulation; Wan uses the per-token states only.
The text encoder is frozen during RL; a prompt's embedding is computed once per
``generate`` and stored in the rollout context.

Exact PPO ratio. diffusers models on CPU are not batch-size invariant: the small
(B, D) matmuls of the timestep/pooled embedders and the adaLN modulation take a
different kernel when B < 4 (GEMV vs GEMM), and the patch-embedding convolution picks
a batch-dependent oneDNN algorithm, so a sample's velocity changes in the last bits
with the batch it is evaluated in. GPU kernels (split-K GEMMs, cuDNN) do the same. The
policy therefore runs every transformer forward on exactly ``forward_batch`` rows,
padding the last chunk with copies of its first row: each row's result then depends
only on its own inputs, whether it is evaluated while sampling (rows = samples at one
step) or while training (rows = (sample, step) pairs of any micro-batch), and the
first-update ratio is exactly 1 (tested with torch.equal). Permuting rows inside a
fixed-size batch was verified not to change results.
"""

from __future__ import annotations

import contextlib
import copy
import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image
from torch import Tensor, nn

from mmyatt.models.flow_sde import cps_step, euler_step, flow_sigmas, sde_step
from mmyatt.models.protocol import Sampling, seeded_generator
from mmyatt.rollout import Rollout

__all__ = [
    "DEFAULT_LORA_TARGETS",
    "FlowPolicy",
    "build_tiny_flow_model",
    "build_word_tokenizer",
    "images_to_tensor",
    "tensor_to_images",
]

SPECIAL_TOKENS = ("<pad>", "<unk>", "<bos>", "<eos>")  # ids 0..3
# CLIP picks the pooled token at the first eos id, except for the legacy id 2 (argmax);
# eos is therefore 3.
PAD_ID, UNK_ID, BOS_ID, EOS_ID = 0, 1, 2, 3

# Attention projections of the joint (SD3/Flux) and self/cross (Wan) attention blocks,
# flow_grpo's LoRA targets; peft matches them as name suffixes and skips absent ones.
DEFAULT_LORA_TARGETS = (
    "to_q",
    "to_k",
    "to_v",
    "to_out.0",
    "add_q_proj",
    "add_k_proj",
    "add_v_proj",
    "to_add_out",
)
LORA_WEIGHT_NAME = "pytorch_lora_weights.safetensors"  # diffusers' name for LoRA files
LORA_METADATA_KEY = "lora_adapter_metadata"  # diffusers' safetensors metadata key
_TRANSFORMERS = {
    "SD3Transformer2DModel": "sd3",
    "FluxTransformer2DModel": "flux",
    "WanTransformer3DModel": "wan",
}
_KINDS = {"sd3-image": "sd3", "flux-image": "flux", "wan-video": "wan"}
_COMPONENTS = ("transformer", "scheduler", "text_encoder", "tokenizer")
_OWN_PIPELINE = "MMYattFlowPipeline"  # the tiny built-ins' model_index class


# --------------------------------------------------------------------------------------
# images <-> tensors
# --------------------------------------------------------------------------------------
def _pil_to_chw(img: Image.Image, size: int) -> Tensor:
    img = img.convert("RGB")
    if img.size != (size, size):
        img = img.resize((size, size), Image.BILINEAR)
    arr = np.asarray(img, dtype=np.float32) / 127.5 - 1.0
    return torch.from_numpy(arr).permute(2, 0, 1)


def images_to_tensor(items: list[Any], size: int) -> Tensor:
    """PIL images -> (B, 3, H, W), or frame lists -> (B, 3, F, H, W); fp32 in [-1, 1]."""
    out = []
    for it in items:
        if isinstance(it, str | Path):
            it = Image.open(it)
        if isinstance(it, list | tuple):
            out.append(torch.stack([_pil_to_chw(f, size) for f in it], dim=1))
        else:
            out.append(_pil_to_chw(it, size))
    return torch.stack(out)


def tensor_to_images(x: Tensor) -> list[Any]:
    """(B, 3, H, W) -> PIL RGB images; (B, 3, F, H, W) -> lists of PIL frames. x in [-1, 1]."""
    u8 = ((x.detach().float().clamp(-1, 1) + 1.0) * 127.5).round().to(torch.uint8).cpu()
    if u8.ndim == 4:
        return [Image.fromarray(im.permute(1, 2, 0).numpy(), "RGB") for im in u8]
    return [
        [Image.fromarray(fr.permute(1, 2, 0).numpy(), "RGB") for fr in clip.unbind(1)]
        for clip in u8
    ]


# --------------------------------------------------------------------------------------
# building a tiny model
# --------------------------------------------------------------------------------------
POSITION_PLANES = 5  # frame index, row, column, frame x row, frame x column


def position_planes(x: Tensor) -> Tensor:
    """(B, 5, F, H, W) position planes of a video batch (B, C, F, H, W), in x's dtype: the
    frame index, row and column, each spanning [-1, 1] (0 for an axis of length 1), then
    frame x row and frame x column.

    The products make motion a two-way interaction: the mean clip of "moving right" is
    brighter where frame x column is positive, so the model needs only to pair the
    direction word with one input plane (as it pairs a colour word with a colour
    channel). With the first three planes alone, direction, frame and column must be
    combined three ways, and the tiny Wan model never learned it (BENCHMARKS.md)."""
    b, _, f, h, w = x.shape

    def axis(n: int) -> Tensor:
        return (
            torch.linspace(-1.0, 1.0, n, device=x.device)
            if n > 1
            else torch.zeros(1, device=x.device)
        )

    fr, row, col = torch.meshgrid(axis(f), axis(h), axis(w), indexing="ij")
    planes = torch.stack([fr, row, col, fr * row, fr * col])  # (5, F, H, W)
    return planes.to(x.dtype).unsqueeze(0).expand(b, -1, -1, -1, -1)


def build_word_tokenizer(vocab: list[str], max_length: int = 12):
    """A word-level ``PreTrainedTokenizerFast``: lower-cased whitespace words, unknown
    words -> <unk>, every text wrapped as <bos> ... <eos> (the eos is CLIP's pooled token)."""
    from tokenizers import Tokenizer, normalizers, pre_tokenizers, processors
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    words = list(SPECIAL_TOKENS)
    for w in vocab:
        w = w.lower()
        if w not in words:
            words.append(w)
    tok = Tokenizer(WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(
        single="<bos> $A <eos>", special_tokens=[("<bos>", BOS_ID), ("<eos>", EOS_ID)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<bos>",
        eos_token="<eos>",
        pad_token="<pad>",
        unk_token="<unk>",
        model_max_length=max_length,
    )


def build_tiny_flow_model(
    out_dir: str | Path,
    *,
    kind: str = "sd3-image",
    vocab: list[str],
    seed: int = 0,
    image_size: int | None = None,
    num_frames: int = 8,
    channels: int = 3,
    patch_size: int = 2,
    num_layers: int = 4,
    num_attention_heads: int = 4,
    attention_head_dim: int = 16,
    text_dim: int = 32,
    text_layers: int = 2,
    max_length: int = 12,
    shift: float = 3.0,
    position_channels: bool = False,
) -> Path:
    """Write a randomly initialised tiny pixel-space flow model as a pipeline directory.

    ``kind``: "sd3-image" (SD3Transformer2DModel, default 32x32), "flux-image"
    (FluxTransformer2DModel on 2x2-packed pixels), "wan-video" (WanTransformer3DModel,
    default ``num_frames`` x 16 x 16). ``position_channels`` (wan-video only): the
    transformer takes 5 more input channels, the position planes that the policy appends
    to every input (``position_planes``, ``FlowPolicy``). Layout: transformer/,
    scheduler/, text_encoder/, tokenizer/, model_index.json (which class lives in each
    folder, plus an ``_mmyatt`` entry with the pixel geometry). Returns the directory.
    """
    from diffusers import (
        FlowMatchEulerDiscreteScheduler,
        FluxTransformer2DModel,
        SD3Transformer2DModel,
        WanTransformer3DModel,
    )
    from transformers import CLIPTextConfig, CLIPTextModelWithProjection

    if kind not in _KINDS:
        raise ValueError(f"kind must be one of {sorted(_KINDS)}, got {kind!r}")
    family = _KINDS[kind]
    if position_channels and family != "wan":
        raise ValueError("position_channels is for wan-video (SD3 and Flux embed positions)")
    if image_size is None:
        image_size = 16 if family == "wan" else 32
    if image_size % patch_size:
        raise ValueError(f"image_size {image_size} is not a multiple of patch_size {patch_size}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    tokenizer = build_word_tokenizer(vocab, max_length=max_length)
    text_cfg = CLIPTextConfig(
        vocab_size=len(tokenizer),
        hidden_size=text_dim,
        intermediate_size=2 * text_dim,
        num_hidden_layers=text_layers,
        num_attention_heads=2,
        max_position_embeddings=max_length,
        projection_dim=text_dim,
        pad_token_id=PAD_ID,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
    )
    text_encoder = CLIPTextModelWithProjection(text_cfg)
    inner = num_attention_heads * attention_head_dim
    if family == "sd3":
        transformer = SD3Transformer2DModel(
            sample_size=image_size,
            patch_size=patch_size,
            in_channels=channels,
            out_channels=channels,
            num_layers=num_layers,
            attention_head_dim=attention_head_dim,
            num_attention_heads=num_attention_heads,
            joint_attention_dim=text_dim,
            caption_projection_dim=inner,  # SD3's context stream runs at the inner width
            pooled_projection_dim=text_dim,
            pos_embed_max_size=image_size // patch_size,
        )
    elif family == "flux":
        # RoPE over (text index, row, col); the axes must add up to the head dim.
        third = (attention_head_dim // 3) // 2 * 2
        axes = [attention_head_dim - 2 * third, third, third]
        transformer = FluxTransformer2DModel(
            patch_size=1,  # pixels are packed into patch_size^2 channels outside the model
            in_channels=channels * patch_size * patch_size,
            num_layers=max(1, num_layers // 2),
            num_single_layers=max(1, num_layers - num_layers // 2),
            attention_head_dim=attention_head_dim,
            num_attention_heads=num_attention_heads,
            joint_attention_dim=text_dim,
            pooled_projection_dim=text_dim,
            axes_dims_rope=axes,
        )
    else:
        transformer = WanTransformer3DModel(
            patch_size=(1, patch_size, patch_size),
            num_attention_heads=num_attention_heads,
            attention_head_dim=attention_head_dim,
            in_channels=channels + (POSITION_PLANES if position_channels else 0),
            out_channels=channels,
            text_dim=text_dim,
            freq_dim=64,
            ffn_dim=2 * inner,
            num_layers=num_layers,
            cross_attn_norm=True,
            qk_norm="rms_norm_across_heads",
            rope_max_seq_len=max(32, num_frames, image_size),
        )
    transformer.save_pretrained(out / "transformer")
    text_encoder.save_pretrained(out / "text_encoder")
    tokenizer.save_pretrained(out / "tokenizer")
    FlowMatchEulerDiscreteScheduler(shift=shift).save_pretrained(out / "scheduler")
    geometry = {
        "kind": kind,
        "image_size": image_size,
        "channels": channels,
        "num_frames": num_frames if family == "wan" else None,
        "patch_size": patch_size,
        "max_length": max_length,
        "position_channels": bool(position_channels),
    }
    _write_model_index(out, transformer, text_encoder, geometry)
    return out


def _write_model_index(out: Path, transformer, text_encoder, geometry: dict) -> None:
    import diffusers

    index = {
        # No diffusers pipeline takes one CLIP encoder and no VAE, so the pipeline class
        # is ours; every component folder still loads with its own from_pretrained.
        "_class_name": _OWN_PIPELINE,
        "_diffusers_version": diffusers.__version__,
        "transformer": ["diffusers", type(transformer).__name__],
        "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
        "text_encoder": ["transformers", type(text_encoder).__name__],
        "tokenizer": ["transformers", "PreTrainedTokenizerFast"],
        "_mmyatt": geometry,
    }
    (out / "model_index.json").write_text(json.dumps(index, indent=2) + "\n")


# --------------------------------------------------------------------------------------
# the policy
# --------------------------------------------------------------------------------------
class FlowPolicy:
    """A flow-matching generator as a policy over denoising transitions.

    Args:
        transformer: SD3Transformer2DModel / FluxTransformer2DModel (images) or
            WanTransformer3DModel (video), predicting the velocity eps - x0.
        text_encoder: CLIPTextModelWithProjection (frozen here).
        tokenizer: its tokenizer; prompts are padded to ``max_length``.
        scheduler_shift: the FlowMatchEulerDiscreteScheduler shift of the sigma schedule.
        image_size, channels, num_frames: pixel geometry (num_frames for video only).
        patch_size: packing of pixels for Flux (SD3 and Wan patchify inside the model).
        lora: None, or dict(r=, alpha=, target_modules=, init="gaussian", dropout=0.0):
            peft LoRA on the attention projections; then only LoRA weights train.
        reference: "lora_disabled" (KL reference = this transformer with its adapters
            off, no second copy; without LoRA a frozen copy is taken instead) or
            "frozen_copy" (a copy snapshotted by ``enable_reference``).
        cfg_uncond_prompt: the caption of the unconditional CFG branch.
        forward_batch: every transformer call runs on exactly this many rows (padded),
            which makes results batch-composition invariant (see the module docstring).
            None runs whole batches and gives up the exact first-update ratio.
        max_length: token length of prompts (default: the tokenizer's model_max_length).
        position_channels: Wan only. The transformer's input is the sample plus 5 constant
            planes (``position_planes``: frame index, row, column in [-1, 1], frame x row,
            frame x column); its in_channels must be channels + 5. Wan sees positions only
            through RoPE, which is relative; the planes give a tiny Wan absolute
            positions, and the products make "moving right" a pairing of the direction
            word with one plane. Without them the tiny model never followed the
            direction word (BENCHMARKS.md, video demo).
    """

    def __init__(
        self,
        transformer: nn.Module,
        text_encoder: nn.Module,
        tokenizer,
        scheduler_shift: float = 3.0,
        *,
        image_size: int,
        channels: int = 3,
        num_frames: int | None = None,
        patch_size: int = 2,
        lora: dict | None = None,
        reference: str = "lora_disabled",
        cfg_uncond_prompt: str = "",
        forward_batch: int | None = 8,
        max_length: int | None = None,
        prompt_encoder: nn.Module | None = None,
        vae: nn.Module | None = None,
        scheduler_config: dict | None = None,
        embedded_guidance: float = 3.5,
        pipeline: dict | None = None,
        position_channels: bool = False,
    ):
        name = type(transformer).__name__
        if name not in _TRANSFORMERS:
            raise ValueError(
                f"unsupported transformer {name}; expected one of {sorted(_TRANSFORMERS)}"
            )
        if reference not in ("lora_disabled", "frozen_copy"):
            raise ValueError(
                f"reference must be 'lora_disabled' or 'frozen_copy', got {reference!r}"
            )
        if forward_batch is not None and forward_batch < 1:
            raise ValueError(f"forward_batch must be >= 1 or None, got {forward_batch}")
        self.family = _TRANSFORMERS[name]
        if (self.family == "wan") != (num_frames is not None):
            raise ValueError("num_frames is required for WanTransformer3DModel and only for it")
        self.position_channels = bool(position_channels)
        if self.position_channels:
            want = channels + POSITION_PLANES
            got = transformer.config.get("in_channels")
            if self.family != "wan" or got != want:
                raise ValueError(
                    f"position_channels needs a WanTransformer3DModel with in_channels = "
                    f"channels + {POSITION_PLANES} = {want}; got {name} with in_channels {got}"
                )
        self.transformer = transformer
        if prompt_encoder is None and (text_encoder is None or tokenizer is None):
            raise ValueError("FlowPolicy needs text_encoder and tokenizer, or a prompt_encoder")
        self.text_encoder = (
            None if text_encoder is None else text_encoder.eval().requires_grad_(False)
        )
        self.tokenizer = tokenizer
        self.prompt_encoder = (
            None if prompt_encoder is None else prompt_encoder.eval().requires_grad_(False)
        )
        if self.text_encoder is None:  # pipelines: all text encoders as one module
            self.text_encoder = self.prompt_encoder
        self.vae = vae  # latent codec (flow_pipeline.ImageVAE / VideoVAE) or None: pixels
        self.scheduler_config = scheduler_config  # a real pipeline's scheduler (its sigmas)
        self.embedded_guidance = float(embedded_guidance)
        self._pipeline = pipeline  # {"index": model_index, "components": {...}} when loaded
        self.shift = float(scheduler_shift)
        self.image_size, self.channels, self.num_frames = image_size, channels, num_frames
        self.patch_size = patch_size
        self.reference = reference
        self.cfg_uncond_prompt = cfg_uncond_prompt
        self.forward_batch = forward_batch
        self.max_length = (
            int(max_length or tokenizer.model_max_length) if tokenizer is not None else max_length
        )
        self._t_scale = float((scheduler_config or {}).get("num_train_timesteps", 1000))
        self.lora = None
        self._ref_model: nn.Module | None = None
        self._ema: dict[str, Tensor] | None = None
        # False: rollouts return the final samples (latents) as outputs and skip the VAE
        # decode, for rewards that read latents (rewards/image.py reads_latents)
        self.decode_outputs = True
        self.shared_group_noise = True  # one initial noise per group (see generate)
        if lora is not None:
            self._add_lora(lora)

    # ---- construction -----------------------------------------------------------------
    def _add_lora(self, lora: dict) -> None:
        from peft import LoraConfig

        unknown = set(lora) - {"r", "alpha", "target_modules", "init", "dropout"}
        if unknown:
            raise ValueError(f"unknown LoRA options {sorted(unknown)}")
        r = int(lora.get("r", 8))
        self.lora = {
            "r": r,
            "alpha": float(lora.get("alpha", 2 * r)),
            "target_modules": list(lora.get("target_modules", DEFAULT_LORA_TARGETS)),
            "init": lora.get("init", "gaussian"),
            "dropout": float(lora.get("dropout", 0.0)),
        }
        cfg = LoraConfig(
            r=r,
            lora_alpha=self.lora["alpha"],
            target_modules=self.lora["target_modules"],
            init_lora_weights=self.lora["init"],  # gaussian A, zero B: the adapter starts at 0
            lora_dropout=self.lora["dropout"],
        )
        self.transformer.requires_grad_(False)
        self.transformer.add_adapter(cfg)  # diffusers' PeftAdapterMixin: inject_adapter_in_model
        for n, p in self.transformer.named_parameters():
            p.requires_grad_(".lora_" in n)

    @classmethod
    def load(cls, path: str | Path, **kwargs) -> FlowPolicy:
        """Load a pipeline directory written by ``build_tiny_flow_model`` or ``save``.

        A ``pytorch_lora_weights.safetensors`` at its root is applied as a LoRA adapter on
        the base transformer (its config comes from the file's metadata); passing ``lora=``
        for a directory without one adds a fresh adapter. Other kwargs go to the
        constructor and override the geometry stored in model_index.json.
        """
        import diffusers
        import transformers

        root = Path(path)
        if not root.is_dir():
            raise FileNotFoundError(f"flow model directory {root} does not exist")
        index_file = root / "model_index.json"
        if not index_file.is_file():
            raise FileNotFoundError(f"{root}: missing component model_index.json")
        index = json.loads(index_file.read_text())
        from mmyatt.models.flow_pipeline import PIPELINE_FAMILIES

        cls_name = index.get("_class_name")
        if cls_name in PIPELINE_FAMILIES:
            return cls._load_pipeline(root, index, **kwargs)
        if cls_name not in (None, _OWN_PIPELINE):
            raise NotImplementedError(
                f"{index_file}: pipeline class {cls_name!r} is not supported by FlowPolicy yet "
                f"(issue #3); supported: {sorted(PIPELINE_FAMILIES)} and {_OWN_PIPELINE}"
            )
        for comp in _COMPONENTS:
            if comp not in index:
                raise FileNotFoundError(f"{index_file} names no '{comp}' component")
            if not (root / comp).is_dir():
                raise FileNotFoundError(f"{root}: missing component '{comp}/' ({index[comp][1]})")
        t_cls = index["transformer"][1]
        if t_cls not in _TRANSFORMERS:
            raise ValueError(f"{index_file}: unsupported transformer class {t_cls}")
        transformer = getattr(diffusers, t_cls).from_pretrained(root / "transformer")
        text_encoder = getattr(transformers, index["text_encoder"][1]).from_pretrained(
            root / "text_encoder"
        )
        tokenizer = getattr(transformers, index["tokenizer"][1]).from_pretrained(root / "tokenizer")
        sched = json.loads((root / "scheduler" / "scheduler_config.json").read_text())
        geo = dict(index.get("_mmyatt", {}))
        opts: dict[str, Any] = {
            "image_size": geo.get("image_size", transformer.config.get("sample_size")),
            "channels": geo.get("channels", 3),
            "num_frames": geo.get("num_frames"),
            "patch_size": geo.get("patch_size", 2),
            "max_length": geo.get("max_length"),
            "position_channels": bool(geo.get("position_channels", False)),
        }
        opts.update(kwargs)
        lora_file = root / LORA_WEIGHT_NAME
        lora_opts, state = cls._read_lora(root)
        if lora_opts is not None:
            opts["lora"] = lora_opts
        shift = opts.pop("scheduler_shift", sched.get("shift", 3.0))
        policy = cls(transformer, text_encoder, tokenizer, shift, **opts)
        policy._load_lora_state(lora_file, state)
        return policy

    @staticmethod
    def _read_lora(root: Path) -> tuple[dict | None, dict | None]:
        """(LoRA options, state dict without the "transformer." prefix) of a saved adapter."""
        lora_file = root / LORA_WEIGHT_NAME
        if not lora_file.is_file():
            return None, None
        from safetensors import safe_open

        with safe_open(str(lora_file), framework="pt") as f:
            meta = json.loads((f.metadata() or {}).get(LORA_METADATA_KEY, "{}"))
            state = {k.removeprefix("transformer."): f.get_tensor(k) for k in f.keys()}
        if not meta:
            raise ValueError(f"{lora_file}: no '{LORA_METADATA_KEY}' metadata (r, alpha, targets)")
        opts = {
            "r": meta["r"],
            "alpha": meta["lora_alpha"],
            "target_modules": sorted(meta["target_modules"]),
            "init": meta.get("init_lora_weights", "gaussian"),
            "dropout": meta.get("lora_dropout", 0.0),
        }
        return opts, state

    def _load_lora_state(self, lora_file: Path, state: dict | None) -> None:
        if state is None:
            return
        from peft.utils import set_peft_model_state_dict

        res = set_peft_model_state_dict(self.transformer, state, adapter_name="default")
        bad = [k for k in res.unexpected_keys if ".lora_" in k]
        if bad:
            raise ValueError(f"{lora_file}: keys that match no LoRA layer: {bad[:5]}")

    @classmethod
    def _load_pipeline(cls, root: Path, index: dict, **kwargs) -> FlowPolicy:
        """A standard diffusers pipeline folder (see ``flow_pipeline``): latent space.

        Extra kwargs: ``dtype`` (torch dtype of every component, default float32),
        ``image_size`` (square output side in pixels; default the transformer's
        sample_size times the VAE factor, or 1024 for Flux / 480 for Wan),
        ``num_frames`` (Wan, pixel frames, default 81), ``max_sequence_length`` (T5 /
        UMT5 tokens; default the pipeline's: 256 SD3, 512 Flux and Wan),
        ``embedded_guidance`` (Flux guidance-distilled models), and the constructor's
        options (lora, reference, cfg_uncond_prompt, forward_batch).
        """
        from mmyatt.models.flow_pipeline import (
            build_codec,
            build_prompt_encoder,
            load_pipeline_components,
        )

        dtype = kwargs.pop("dtype", torch.float32)
        saved = {k: v for k, v in index.get("_mmyatt", {}).items() if v is not None}
        kwargs = {**saved, **kwargs}  # what save() recorded, unless overridden
        max_seq = kwargs.pop("max_sequence_length", None)
        family, comps = load_pipeline_components(root, index, dtype)
        transformer = comps["transformer"]
        t_cls = type(transformer).__name__
        if _TRANSFORMERS.get(t_cls) != family:
            raise ValueError(f"{root}: transformer {t_cls} does not fit {index['_class_name']}")
        vae = build_codec(comps["vae"])
        encoder = build_prompt_encoder(family, comps, transformer, max_seq)
        sched_cfg = dict(comps["scheduler"].config)
        sched_cfg["_class_name"] = type(comps["scheduler"]).__name__
        in_ch = int(transformer.config.in_channels)
        opts: dict[str, Any] = {"patch_size": 2, "channels": in_ch, "num_frames": None}
        if family == "sd3":
            opts["image_size"] = int(transformer.config.sample_size) * vae.spatial
        elif family == "flux":
            opts.update(image_size=1024, channels=in_ch // 4)  # 2x2 packing outside the model
        else:
            opts.update(image_size=480, num_frames=81)
        if opts["channels"] != vae.latent_channels:
            raise ValueError(
                f"{root}: transformer expects {opts['channels']} latent channels, the VAE "
                f"gives {vae.latent_channels}"
            )
        opts.update(kwargs)
        lora_opts, state = cls._read_lora(root)
        if lora_opts is not None:  # a saved adapter wins over lora= (as for the built-ins)
            opts["lora"] = lora_opts
        if opts.pop("scheduler_shift", None) is not None:
            raise ValueError("scheduler_shift: a pipeline's sigmas come from its scheduler config")
        policy = cls(
            transformer,
            None,
            None,
            float(sched_cfg.get("shift", sched_cfg.get("flow_shift", 1.0))),
            prompt_encoder=encoder,
            vae=vae,
            scheduler_config=sched_cfg,
            pipeline={"index": index, "components": comps, "max_sequence_length": max_seq},
            **opts,
        )
        policy._load_lora_state(root / LORA_WEIGHT_NAME, state)
        return policy

    # ---- protocol ---------------------------------------------------------------------
    def module(self) -> nn.Module:
        return self.transformer

    def to(self, device: str | torch.device) -> FlowPolicy:
        """Move every module (transformer, text encoders, VAE, frozen reference) to device."""
        for m in (self.transformer, self.text_encoder, self.vae, self._ref_model):
            if m is not None:
                m.to(device)
        return self

    def _follow(self, module: nn.Module) -> nn.Module:
        """A frozen helper module on the transformer's device (moved on first use)."""
        p = next(module.parameters(), None)
        if p is not None and p.device != self.device:
            module.to(self.device)
        return module

    @property
    def device(self) -> torch.device:
        return next(self.transformer.parameters()).device

    @property
    def sample_shape(self) -> tuple[int, ...]:
        """Shape of one sample x_k: pixels (tiny built-ins) or VAE latents (pipelines)."""
        s, f = self.image_size, self.num_frames
        if self.vae is not None:
            s = s // self.vae.spatial
            if self.family == "flux":  # Flux packs 2x2 latent patches: even latent sizes
                s = 2 * (self.image_size // (self.vae.spatial * 2))
            if f is not None:
                f = (f - 1) // self.vae.temporal + 1
        if self.family == "wan":
            return (self.channels, f, s, s)
        return (self.channels, s, s)

    def _image_seq_len(self) -> int:
        """Image tokens the transformer sees (for resolution-dependent sigma shifts)."""
        shape = self.sample_shape
        if self.family == "flux":
            return (shape[-2] // self.patch_size) * (shape[-1] // self.patch_size)
        p = self.transformer.config.patch_size
        p = p[-1] if isinstance(p, list | tuple) else p
        return (shape[-2] // p) * (shape[-1] // p)

    def _sigmas(self, steps: int) -> Tensor:
        if self.scheduler_config is None:
            return flow_sigmas(steps, self.shift)
        from mmyatt.models.flow_pipeline import pipeline_sigmas

        return pipeline_sigmas(self.scheduler_config, self.family, steps, self._image_seq_len())

    def to_pixels(self, x: Tensor) -> Tensor:
        """Final samples -> pixels in [-1, 1] (VAE decode in chunks of forward_batch rows)."""
        if self.vae is None:
            return x
        chunk = self.forward_batch or max(1, x.shape[0])
        self._follow(self.vae)
        with torch.no_grad():
            return torch.cat([self.vae.decode(x[i : i + chunk]) for i in range(0, len(x), chunk)])

    def encode_prompts(self, prompts: list[str]) -> tuple[Tensor, Tensor]:
        """(B, L, D) token states and (B, Dp) pooled projections, fp32. Gradients flow
        only if the text encoder's weights require them (pretraining)."""
        if self.prompt_encoder is not None:
            return self._follow(self.prompt_encoder)(list(prompts), self.device)
        tok = self.tokenizer(
            list(prompts),
            padding="max_length",
            max_length=self.max_length,
            truncation=True,
            return_tensors="pt",
        ).to(self.device)
        out = self.text_encoder(input_ids=tok["input_ids"], attention_mask=tok["attention_mask"])
        return out.last_hidden_state.float(), out.text_embeds.float()

    def _encode_each(self, prompts: list[str]) -> tuple[Tensor, Tensor]:
        # One prompt per call: a prompt's embedding must not depend on its batch mates
        # (rank invariance); the text encoder is tiny next to the denoising loop.
        with torch.no_grad():
            parts = [self.encode_prompts([p]) for p in prompts]
        return torch.cat([c for c, _ in parts]), torch.cat([p for _, p in parts])

    def _forward(
        self, model: nn.Module, x: Tensor, sigma: Tensor, cond: Tensor, pooled: Tensor
    ) -> Tensor:
        """Raw velocity for rows x (R, ...), sigma (R,), cond (R, L, D), pooled (R, Dp)."""
        dt = model.dtype
        x, cond, pooled = x.to(dt), cond.to(dt), pooled.to(dt)
        if self.family == "sd3":
            return model(
                hidden_states=x,
                encoder_hidden_states=cond,
                pooled_projections=pooled,
                timestep=sigma * self._t_scale,  # diffusers SD3 takes scheduler timesteps
                return_dict=False,
            )[0]
        if self.family == "wan":
            if self.position_channels:
                x = torch.cat([x, position_planes(x)], dim=1)
            return model(
                hidden_states=x,
                timestep=sigma * self._t_scale,
                encoder_hidden_states=cond,
                return_dict=False,
            )[0]
        return self._forward_flux(model, x, sigma, cond, pooled)

    def _forward_flux(self, model, x, sigma, cond, pooled) -> Tensor:
        p, (b, c, h, w) = self.patch_size, x.shape
        hh, ww = h // p, w // p
        tokens = x.reshape(b, c, hh, p, ww, p).permute(0, 2, 4, 1, 3, 5).reshape(b, hh * ww, -1)
        img_ids = torch.zeros(hh, ww, 3, device=x.device)
        img_ids[..., 1] = torch.arange(hh, device=x.device)[:, None]
        img_ids[..., 2] = torch.arange(ww, device=x.device)[None, :]
        txt_ids = torch.zeros(cond.shape[1], 3, device=x.device)
        guidance = None
        if model.config.get("guidance_embeds", False):  # guidance-distilled (FLUX.1-dev)
            guidance = torch.full((b,), self.embedded_guidance, device=x.device)
        out = model(
            hidden_states=tokens,
            encoder_hidden_states=cond,
            pooled_projections=pooled,
            timestep=sigma.to(x.dtype),  # Flux scales by 1000 inside
            img_ids=img_ids.reshape(-1, 3),
            txt_ids=txt_ids,
            guidance=guidance,
            return_dict=False,
        )[0]
        return out.reshape(b, hh, ww, c, p, p).permute(0, 3, 1, 4, 2, 5).reshape(b, c, h, w)

    def _velocity(
        self, model: nn.Module, x: Tensor, sigma: Tensor, cond: Tensor, pooled: Tensor
    ) -> Tensor:
        """Velocity (R, ...) fp32, evaluated in padded chunks of exactly forward_batch rows."""
        n = x.shape[0]
        fb = self.forward_batch
        if fb is None or n == 0:
            return self._forward(model, x, sigma, cond, pooled).float()
        outs = []
        for i in range(0, n, fb):
            parts = [t[i : i + fb] for t in (x, sigma, cond, pooled)]
            pad = fb - parts[0].shape[0]
            if pad:  # copies of the chunk's first row; their outputs are dropped
                parts = [torch.cat([t, t[:1].expand(pad, *t.shape[1:])]) for t in parts]
            outs.append(self._forward(model, *parts)[: fb - pad].float())
        return torch.cat(outs)

    def _guided_velocity(
        self,
        model: nn.Module,
        x: Tensor,
        sigma: Tensor,
        cond: Tensor,
        pooled: Tensor,
        uncond: Tensor,
        uncond_pooled: Tensor,
        guidance: Tensor,
    ) -> Tensor:
        """CFG v = v_u + g (v_c - v_u) on rows with g > 1, v_c elsewhere; guidance (R,).
        The unconditional branch always runs without grad (flow_grpo detaches it)."""
        v_c = self._velocity(model, x, sigma, cond, pooled)
        use = guidance > 1.0
        if not bool(use.any()):
            return v_c
        with torch.no_grad():
            v_u = self._velocity(model, x, sigma, uncond, uncond_pooled)
        g = guidance.float().reshape(-1, *([1] * (x.ndim - 1)))
        return torch.where(use.reshape(g.shape), v_u + g * (v_c - v_u), v_c)

    def generate(
        self, prompts: list[dict], group_size: int, sampling: Sampling, seeds: list[int]
    ) -> Rollout:
        """Sample ``group_size`` images (clips) per prompt record ({"prompt": caption}).

        Uses ``sampling.denoise_steps`` steps of ``flow_sigmas``; steps in
        ``sampling.sde_steps`` (None = all) take the ``sampling.sde_type`` step with
        ``sampling.noise_level``, the others the Euler ODE step; ``greedy`` makes every
        step ODE (evaluation). CFG when ``guidance_scale`` > 1. All randomness of a
        prompt's group comes from a generator seeded with its seed: first the initial
        noise (one draw shared by the group), then per SDE step the group's noise.

        Returns a rollout whose A actions are x_{k+1} at the ``sampling.train_steps``
        (None = the SDE steps): actions (N, A, C, H, W) or (N, A, C, F, H, W); logprobs
        (N, A) fp32; mask 1 at stochastic steps, 0 at deterministic ones (greedy/noise 0);
        context {"x": x_k (N, A, ...), "sigma", "sigma_next", "noise_level": (N, A),
        "cond" (N, L, D), "pooled" (N, Dp), "uncond", "uncond_pooled" (the CFG branch's
        embeddings, per sample), "guidance_scale" (N,), "sde_type": str}; outputs PIL
        RGB images or lists of PIL frames.
        """
        if len(seeds) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(seeds)} seeds")
        if group_size < 1:
            raise ValueError(f"group_size must be >= 1, got {group_size}")
        steps = int(sampling.denoise_steps)
        sigmas = self._sigmas(steps).to(self.device)
        sde_set, train = _plan_steps(sampling, steps)
        step_fn = _step_fn(sampling.sde_type)
        a = 0.0 if sampling.greedy else float(sampling.noise_level)
        g_scale = float(sampling.guidance_scale)
        n, shape = len(prompts) * group_size, self.sample_shape
        dev = self.device

        cond1, pooled1 = self._encode_each([str(r["prompt"]) for r in prompts])
        cond = cond1.repeat_interleave(group_size, 0)
        pooled = pooled1.repeat_interleave(group_size, 0)
        un_c, un_p = self._encode_each([self.cfg_uncond_prompt])
        # contiguous copies: a stride-0 view could take another kernel path than the
        # contiguous rows that logprobs rebuilds, and change the last bits
        uncond = un_c.expand(n, *un_c.shape[1:]).contiguous()
        uncond_pooled = un_p.expand(n, -1).contiguous()
        guidance = torch.full((n,), g_scale, device=dev)

        gens = [seeded_generator(s, dev) for s in seeds]
        # One initial noise per prompt, shared by its group (flow_grpo same_latent): the
        # group's samples then differ only by the SDE noise, which sharpens advantages.
        # shared_group_noise=False draws one per sample (ODE rollouts: DiffusionNFT).
        draws = 1 if self.shared_group_noise else group_size
        x = torch.cat(
            [
                torch.randn((draws, *shape), generator=gen, device=dev).expand(group_size, *shape)
                for gen in gens
            ]
        )
        xs, acts, lps, sig, sig_next, levels = [], [], [], [], [], []
        with torch.no_grad():
            for k in range(steps):
                s_k = sigmas[k].repeat(n)
                s_n = sigmas[k + 1].repeat(n)
                v = self._guided_velocity(
                    self.transformer, x, s_k, cond, pooled, uncond, uncond_pooled, guidance
                )
                level = a if k in sde_set else 0.0
                if level > 0.0:
                    noise = torch.cat(
                        [
                            torch.randn((group_size, *shape), generator=gen, device=dev)
                            for gen in gens
                        ]
                    )
                    x_next, lp, _, _ = step_fn(
                        x, v, s_k, s_n, torch.full((n,), level, device=dev), noise=noise
                    )
                else:
                    x_next, lp = euler_step(x, v, s_k, s_n), torch.zeros(n, device=dev)
                if k in train:
                    xs.append(x)
                    acts.append(x_next)
                    lps.append(lp)
                    sig.append(s_k)
                    sig_next.append(s_n)
                    levels.append(torch.full((n,), level, device=dev))
                x = x_next

        def stack(ts: list[Tensor], tail: tuple[int, ...]) -> Tensor:
            return torch.stack(ts, 1) if ts else torch.zeros((n, 0, *tail), device=dev)

        level_t = stack(levels, ())
        records = [r for r in prompts for _ in range(group_size)]
        context = {
            "x": stack(xs, shape),
            "sigma": stack(sig, ()),
            "sigma_next": stack(sig_next, ()),
            "noise_level": level_t,  # (N, A): a at SDE steps, 0 at ODE ones
            "cond": cond,
            "pooled": pooled,
            "uncond": uncond,
            "uncond_pooled": uncond_pooled,
            "guidance_scale": guidance,  # (N,)
            "sde_type": sampling.sde_type,
            # the final samples before any VAE decode, and the sampler's noise levels:
            # what DiffusionNFT trains on (models/flow_nft.py) and latent rewards read
            "x0": x,
            "sampler_sigmas": sigmas[:-1].unsqueeze(0).expand(n, -1).contiguous(),
        }
        return Rollout(
            prompt_ids=[str(r.get("id", r["prompt"])) for r in records],
            actions=stack(acts, shape),
            logprobs=stack(lps, ()).float(),
            # a deterministic step (greedy, noise 0, or a trained step outside sde_steps
            # in eval) has no density: it is recorded but not an action
            mask=(level_t > 0).float(),
            context=context,
            outputs=tensor_to_images(self.to_pixels(x)) if self.decode_outputs else list(x),
            records=records,
            truncated=torch.zeros(n, dtype=torch.bool),
        )

    def _transitions(self, model: nn.Module, rollout: Rollout) -> tuple[Tensor, Tensor, Tensor]:
        """(log-probs (N, A), std (N, A), means (N, A, ...)) of the rollout's transitions
        under ``model``, with the sampler's fp32 math and per-row numerics."""
        ctx = rollout.context
        n, a = rollout.logprobs.shape
        if n * a == 0:
            z = torch.zeros(n, a, device=self.device)
            return z, z, torch.zeros(rollout.actions.shape, device=self.device)

        def per_action(t: Tensor) -> Tensor:  # (N, ...) -> (N*A, ...)
            return t.repeat_interleave(a, 0)

        v = self._guided_velocity(
            model,
            ctx["x"].flatten(0, 1),
            ctx["sigma"].reshape(-1),
            per_action(ctx["cond"]),
            per_action(ctx["pooled"]),
            per_action(ctx["uncond"]),
            per_action(ctx["uncond_pooled"]),
            per_action(ctx["guidance_scale"]),
        )
        _, lp, mu, std = _step_fn(ctx["sde_type"])(
            ctx["x"].flatten(0, 1),
            v,
            ctx["sigma"].reshape(-1),
            ctx["sigma_next"].reshape(-1),
            ctx["noise_level"].reshape(-1),
            prev_sample=rollout.actions.flatten(0, 1),
        )
        return lp.reshape(n, a), std.reshape(n, a), mu.reshape(rollout.actions.shape)

    def _transition_logprobs(self, model: nn.Module, rollout: Rollout) -> tuple[Tensor, Tensor]:
        lp, std, _ = self._transitions(model, rollout)
        return lp, std

    @staticmethod
    def _entropy(std: Tensor) -> Tensor:
        return torch.where(
            std > 0,
            torch.log(std.clamp_min(1e-30)) + 0.5 * (1.0 + math.log(2.0 * math.pi)),
            torch.zeros_like(std),
        )

    def logprobs(
        self, rollout: Rollout, with_entropy: bool = False
    ) -> Tensor | tuple[Tensor, Tensor]:
        """(N, A) log pi(x_{k+1} | x_k) under the current weights, with the sampler's fp32
        math and the same per-row numerics (see the module docstring).

        The entropy of a Gaussian step is per element 0.5 * log(2 pi e std^2): it depends
        only on the noise schedule, not on the weights (no gradient), and is 0 where the
        step was deterministic. For CPS the log-prob is unnormalised, but the entropy of
        its Gaussian N(mu, s^2) is reported the same way.
        """
        lp, std = self._transition_logprobs(self.transformer, rollout)
        if not with_entropy:
            return lp
        return lp, self._entropy(std)

    # ---- reference policy ---------------------------------------------------------------
    def enable_reference(self) -> None:
        """Fix the KL reference: with LoRA and reference="lora_disabled" the base model
        (adapters off) is the reference and nothing is copied; otherwise snapshot a frozen
        copy of the current transformer."""
        if self.reference == "lora_disabled" and self.lora is not None:
            self._ref_model = None
            return
        self._ref_model = copy.deepcopy(self.transformer).eval().requires_grad_(False)

    def _reference_transitions(self, rollout: Rollout) -> tuple[Tensor, Tensor, Tensor]:
        with torch.no_grad():
            if self._ref_model is not None:
                return self._transitions(self._ref_model, rollout)
            if self.reference == "lora_disabled" and self.lora is not None:
                self.transformer.disable_adapters()
                try:
                    return self._transitions(self.transformer, rollout)
                finally:
                    self.transformer.enable_adapters()
        raise RuntimeError("no reference policy: call enable_reference() first")

    def reference_logprobs(self, rollout: Rollout) -> Tensor:
        """(N, A) log pi_ref of the rollout's transitions, no grad."""
        return self._reference_transitions(rollout)[0]

    def attach_reference_means(self, rollout: Rollout) -> Rollout:
        """Store the reference policy's transition means (N, A, ...) in the rollout's
        context ("ref_mean", fp32, no grad) for the closed-form KL of
        ``logprobs_with_kl``; returns the same rollout."""
        rollout.context["ref_mean"] = self._reference_transitions(rollout)[2].detach()
        return rollout

    def logprobs_with_kl(self, rollout: Rollout, estimator: str = "closed_form", block: int = 0):
        """(log-probs, entropy, KL) each (N, A): ``logprobs(with_entropy=True)`` plus the
        closed-form KL(pi || pi_ref) of every transition from one forward pass.

        Policy and reference steps are Gaussians with the same std (it depends only on the
        schedule), so KL = mean over elements of (mu - mu_ref)^2 / (2 var):
        ``"closed_form"`` uses the step's variance (std^2 = s^2 |Delta| for the SDE step,
        s^2 for CPS), the exact per-element KL; ``"closed_form_flowgrpo"`` divides by
        s^2 without the step length |Delta|, as flow_grpo's loss does (so its beta values
        carry over); for CPS both are the same. ``block`` > 0 keeps only the components
        that vary within ``block`` x ``block`` spatial tiles (``flow_sde.kl_closed_form``).
        Needs ``attach_reference_means`` first.
        """
        from mmyatt.models.flow_sde import kl_closed_form
        from mmyatt.protocols import CLOSED_FORM_KL

        if estimator not in CLOSED_FORM_KL:
            raise ValueError(f"estimator must be one of {CLOSED_FORM_KL}, got {estimator!r}")
        ctx = rollout.context
        if "ref_mean" not in ctx:
            raise RuntimeError("no reference means: call attach_reference_means(rollout) first")
        lp, std, mu = self._transitions(self.transformer, rollout)
        kl_std = std
        if estimator == "closed_form_flowgrpo" and ctx["sde_type"] == "sde":
            step = (ctx["sigma"] - ctx["sigma_next"]).clamp_min(0.0).sqrt()  # sqrt|Delta|
            kl_std = torch.where(step > 0, std / step.clamp_min(1e-30), std)
        kl = kl_closed_form(
            mu.flatten(0, 1), ctx["ref_mean"].flatten(0, 1), kl_std.reshape(-1), block=block
        )
        return lp, self._entropy(std), kl.reshape(lp.shape)

    # ---- EMA ------------------------------------------------------------------------------
    def _trainable(self) -> dict[str, nn.Parameter]:
        return {n: p for n, p in self.transformer.named_parameters() if p.requires_grad}

    @torch.no_grad()
    def ema_update(self, decay: float = 0.9) -> None:
        """ema <- decay * ema + (1 - decay) * w over the trainable weights (the first call
        copies them). flow_grpo evaluates with EMA weights (decay 0.9 every 8 steps)."""
        if not 0.0 <= decay <= 1.0:
            raise ValueError(f"decay must be in [0, 1], got {decay}")
        params = self._trainable()
        if self._ema is None or set(self._ema) != set(params):
            self._ema = {n: p.detach().clone() for n, p in params.items()}
            return
        for n, p in params.items():
            self._ema[n].lerp_(p.detach(), 1.0 - decay)

    def ema_state(self) -> dict[str, Tensor] | None:
        """The EMA weights (name -> tensor) for checkpoints; None before any update."""
        return None if self._ema is None else {n: t.clone() for n, t in self._ema.items()}

    def load_ema_state(self, state: dict[str, Tensor] | None) -> None:
        self._ema = None if state is None else {n: t.clone() for n, t in state.items()}

    @contextlib.contextmanager
    def ema_weights(self):
        """Swap the EMA weights in (e.g. for evaluation sampling), restore on exit. Before
        any ``ema_update`` the weights are used unchanged."""
        if self._ema is None:
            yield self
            return
        params = self._trainable()
        backup = {n: p.detach().clone() for n, p in params.items()}
        with torch.no_grad():
            for n, p in params.items():
                p.copy_(self._ema[n])
        try:
            yield self
        finally:
            with torch.no_grad():
                for n, p in params.items():
                    p.copy_(backup[n])

    # ---- saving -----------------------------------------------------------------------
    def _base_state_dict(self, merged: bool) -> dict[str, Tensor]:
        """The transformer's weights under their original names: peft's ``base_layer``
        wrappers unwrapped, LoRA weights dropped or (merged) folded into W + scale*B@A."""
        sd = {}
        for k, v in self.transformer.state_dict().items():
            if ".lora_" in k:
                continue
            sd[k.replace(".base_layer.", ".")] = v.detach().clone()
        if merged and self.lora is not None:
            from peft.tuners.lora import LoraLayer

            for name, mod in self.transformer.named_modules():
                if isinstance(mod, LoraLayer) and "default" in mod.lora_A:
                    sd[f"{name}.weight"] = sd[f"{name}.weight"] + mod.get_delta_weight("default")
        return sd

    def save(self, path: str, merged: bool = False) -> None:
        """Write a diffusers-layout pipeline directory. With LoRA: the base transformer in
        transformer/ plus the adapter in ``pytorch_lora_weights.safetensors`` (diffusers
        key format ``transformer.<module>.lora_A.weight``, peft config in the metadata);
        ``merged=True`` folds the adapter into full weights and writes no LoRA file."""
        from diffusers import FlowMatchEulerDiscreteScheduler

        out = Path(path)
        out.mkdir(parents=True, exist_ok=True)
        (out / LORA_WEIGHT_NAME).unlink(missing_ok=True)
        if self.lora is None:
            self.transformer.save_pretrained(out / "transformer")
        else:
            base = type(self.transformer).from_config(self.transformer.config)
            base.to(self.transformer.dtype)
            base.load_state_dict(self._base_state_dict(merged), strict=True)
            base.save_pretrained(out / "transformer")
            if not merged:
                self._save_lora(out / LORA_WEIGHT_NAME)
        if self._pipeline is not None:
            self._save_pipeline_components(out)
            return
        self.text_encoder.save_pretrained(out / "text_encoder")
        self.tokenizer.save_pretrained(out / "tokenizer")
        FlowMatchEulerDiscreteScheduler(shift=self.shift).save_pretrained(out / "scheduler")
        kind = {"sd3": "sd3-image", "flux": "flux-image", "wan": "wan-video"}[self.family]
        geometry = {
            "kind": kind,
            "image_size": self.image_size,
            "channels": self.channels,
            "num_frames": self.num_frames,
            "patch_size": self.patch_size,
            "max_length": self.max_length,
            "position_channels": self.position_channels,
        }
        _write_model_index(out, self.transformer, self.text_encoder, geometry)

    def _save_pipeline_components(self, out: Path) -> None:
        """The loaded pipeline's other components and its model_index.json, so the folder
        loads again here and in diffusers' ``DiffusionPipeline.from_pretrained``."""
        from mmyatt.models.flow_pipeline import write_model_index

        comps = self._pipeline["components"]
        for name, obj in comps.items():
            if name != "transformer" and obj is not None:
                obj.save_pretrained(out / name)
        index = dict(self._pipeline["index"])
        # our geometry and prompt length, read back by load (diffusers ignores "_" keys)
        index["_mmyatt"] = {
            "image_size": self.image_size,
            "num_frames": self.num_frames,
            "max_sequence_length": self._pipeline["max_sequence_length"],
            "embedded_guidance": self.embedded_guidance,
        }
        write_model_index(out, index, comps)

    def _save_lora(self, file: Path) -> None:
        from peft.utils import get_peft_model_state_dict
        from safetensors.torch import save_file

        sd = get_peft_model_state_dict(self.transformer, adapter_name="default")
        sd = {f"transformer.{k}": v.detach().contiguous().clone() for k, v in sd.items()}
        meta = self.transformer.peft_config["default"].to_dict()
        meta = {k: sorted(v) if isinstance(v, set) else v for k, v in meta.items()}
        save_file(
            sd,
            str(file),
            metadata={"format": "pt", LORA_METADATA_KEY: json.dumps(meta, default=str)},
        )

    # ---- supervised flow matching -------------------------------------------------------
    def sft_loss(
        self,
        records: list[dict],
        *,
        cond_dropout: float = 0.1,
        t_dist: str = "logit_normal",
        generator: torch.Generator | None = None,
    ) -> Tensor:
        """Flow-matching loss on target media: records carry "prompt" and "image" (a PIL
        image or a path) or "frames" (a list of PIL frames) for video.

        x_t = (1 - t) x0 + t eps, target v = eps - x0, loss = mean (v_theta(x_t, t) - v)^2,
        t ~ logit-normal(0, 1) (SD3's choice: it favours the mid-noise steps where the
        velocity is hardest to predict). A fraction ``cond_dropout`` of captions is replaced
        by the unconditional prompt so the model also learns the CFG branch.
        """
        key = "frames" if self.family == "wan" else "image"
        missing = [i for i, r in enumerate(records) if key not in r]
        if missing:
            raise ValueError(f"sft_loss: records {missing[:5]} have no {key!r} target")
        dev = self.device
        x0 = images_to_tensor([r[key] for r in records], self.image_size).to(dev)
        if self.vae is not None:  # latent flow matching: targets are VAE latents
            with torch.no_grad():
                x0 = self._follow(self.vae).encode(x0, generator=generator)
            if tuple(x0.shape[1:]) != self.sample_shape:
                raise ValueError(
                    f"sft_loss: targets encode to latents {tuple(x0.shape[1:])}, the sampler "
                    f"uses {self.sample_shape}; check image_size / num_frames"
                )
        b = x0.shape[0]
        drop = torch.rand(b, generator=generator) < cond_dropout
        captions = [
            self.cfg_uncond_prompt if bool(d) else str(r["prompt"]) for r, d in zip(records, drop)
        ]
        cond, pooled = self.encode_prompts(captions)
        if t_dist == "logit_normal":
            t = torch.sigmoid(torch.randn(b, generator=generator)).to(dev)
        elif t_dist == "uniform":
            t = torch.rand(b, generator=generator).to(dev)
        else:
            raise ValueError(f"t_dist must be 'logit_normal' or 'uniform', got {t_dist!r}")
        eps = torch.randn(x0.shape, generator=generator).to(dev)
        tb = t.reshape(-1, *([1] * (x0.ndim - 1)))
        xt = (1.0 - tb) * x0 + tb * eps
        v = self._forward(self.transformer, xt, t, cond, pooled).float()
        return ((v - (eps - x0)) ** 2).mean()


def _plan_steps(sampling: Sampling, steps: int) -> tuple[set[int], set[int]]:
    """(sde steps, train steps) of a rollout; train steps must be stochastic unless greedy."""
    if steps < 1:
        raise ValueError(f"denoise_steps must be >= 1, got {steps}")
    everything = set(range(steps))
    sde = everything if sampling.sde_steps is None else set(sampling.sde_steps)
    train = sde if sampling.train_steps is None else set(sampling.train_steps)
    for name, s in (("sde_steps", sde), ("train_steps", train)):
        bad = sorted(s - everything)
        if bad:
            raise ValueError(f"Sampling.{name} {bad} outside 0..{steps - 1}")
    if sampling.greedy:
        return set(), train
    if not train <= sde:
        raise ValueError(
            f"Sampling.train_steps {sorted(train - sde)} are not in sde_steps: an ODE step has "
            "no log-prob to train"
        )
    if sampling.sde_type not in ("sde", "cps"):
        raise ValueError(f"Sampling.sde_type must be 'sde' or 'cps', got {sampling.sde_type!r}")
    return sde, train


def _step_fn(sde_type: str):
    if sde_type == "sde":
        return sde_step
    if sde_type == "cps":
        return cps_step
    raise ValueError(f"sde_type must be 'sde' or 'cps', got {sde_type!r}")
