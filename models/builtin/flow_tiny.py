"""Tiny pixel-space flow models built in code: the built-in generators' layout.

``build_tiny_flow_model`` writes a randomly initialised SD3, Flux or Wan transformer
with a CLIP text encoder as a pipeline directory (model_index class
``MMYattFlowPipeline``) that :meth:`mmyatt.models.flow.FlowPolicy.load` reads. They work
in pixel space (images scaled to [-1, 1], no VAE): on a CPU a 32x32x3 image with patch 2
is 256 tokens, as cheap as a real model's latent, and no autoencoder has to be
pretrained.

Text conditioning of the built-ins is a ``transformers.CLIPTextModelWithProjection``
built from a small ``CLIPTextConfig`` with a word-level tokenizer made in code (``tokenizers`` WordLevel
over the caption vocabulary, saved as a ``PreTrainedTokenizerFast``). CLIP gives both
what SD3/Flux need: per-token states (B, L, D) for joint attention and a pooled
projection (B, Dp) for the timestep modulation; Wan uses the per-token states only.
The text encoder is frozen during RL; a prompt's embedding is computed once per
``generate`` and stored in the rollout context.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import Tensor

SPECIAL_TOKENS = ("<pad>", "<unk>", "<bos>", "<eos>")  # ids 0..3
# CLIP picks the pooled token at the first eos id, except for the legacy id 2 (argmax);
# eos is therefore 3.
PAD_ID, UNK_ID, BOS_ID, EOS_ID = 0, 1, 2, 3
KINDS = {"sd3-image": "sd3", "flux-image": "flux", "wan-video": "wan"}
OWN_PIPELINE = "MMYattFlowPipeline"  # the tiny built-ins' model_index class
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
    vae: str | Path | None = None,
) -> Path:
    """Write a randomly initialised tiny flow model as a pipeline directory: pixel space,
    or the latent space of ``vae`` (a saved ``AutoencoderKL`` folder, sd3-image only).

    ``kind``: "sd3-image" (SD3Transformer2DModel, default 32x32), "flux-image"
    (FluxTransformer2DModel on 2x2-packed pixels), "wan-video" (WanTransformer3DModel,
    default ``num_frames`` x 16 x 16). ``position_channels`` (wan-video only): the
    transformer takes 5 more input channels, the position planes that the policy appends
    to every input (``position_planes``, ``FlowPolicy``). Layout: transformer/,
    scheduler/, text_encoder/, tokenizer/, model_index.json (which class lives in each
    folder, plus an ``_mmyatt`` entry with the pixel geometry), and vae/ when ``vae`` is
    given: the transformer then reads and writes its ``latent_channels`` at 1/``2**(levels
    - 1)`` of ``image_size``, and ``channels`` is ignored. Returns the directory.
    """
    from diffusers import (
        AutoencoderKL,
        FlowMatchEulerDiscreteScheduler,
        FluxTransformer2DModel,
        SD3Transformer2DModel,
        WanTransformer3DModel,
    )
    from transformers import CLIPTextConfig, CLIPTextModelWithProjection

    if kind not in KINDS:
        raise ValueError(f"kind must be one of {sorted(KINDS)}, got {kind!r}")
    family = KINDS[kind]
    if position_channels and family != "wan":
        raise ValueError("position_channels is for wan-video (SD3 and Flux embed positions)")
    if image_size is None:
        image_size = 16 if family == "wan" else 32
    codec, sample_size = None, image_size
    if vae is not None:
        if family != "sd3":
            raise ValueError(f"vae is for sd3-image (got kind {kind!r})")
        codec = AutoencoderKL.from_pretrained(vae)
        factor = 2 ** (len(codec.config.block_out_channels) - 1)
        if image_size % factor:
            raise ValueError(f"image_size {image_size} is not a multiple of the VAE's {factor}")
        channels, sample_size = int(codec.config.latent_channels), image_size // factor
    if sample_size % patch_size:
        raise ValueError(
            f"sample size {sample_size} (image_size {image_size}) is not a multiple of "
            f"patch_size {patch_size}"
        )
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
            sample_size=sample_size,
            patch_size=patch_size,
            in_channels=channels,
            out_channels=channels,
            num_layers=num_layers,
            attention_head_dim=attention_head_dim,
            num_attention_heads=num_attention_heads,
            joint_attention_dim=text_dim,
            caption_projection_dim=inner,  # SD3's context stream runs at the inner width
            pooled_projection_dim=text_dim,
            pos_embed_max_size=sample_size // patch_size,
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
    if codec is not None:
        codec.save_pretrained(out / "vae")
    geometry = {
        "kind": kind,
        "image_size": image_size,
        "channels": channels,
        "num_frames": num_frames if family == "wan" else None,
        "patch_size": patch_size,
        "max_length": max_length,
        "position_channels": bool(position_channels),
    }
    write_tiny_model_index(out, transformer, text_encoder, geometry, codec)
    return out


def write_tiny_model_index(out: Path, transformer, text_encoder, geometry: dict, vae=None) -> None:
    """model_index.json of a tiny built-in: which class lives in each component folder
    (vae/ only for a latent-space one), plus the pixel geometry under ``_mmyatt``."""
    import diffusers

    index = {
        # No diffusers pipeline takes one CLIP encoder (and no VAE, or a VAE with it), so
        # the pipeline class is ours; every component folder still loads with its own from_pretrained.
        "_class_name": OWN_PIPELINE,
        "_diffusers_version": diffusers.__version__,
        "transformer": ["diffusers", type(transformer).__name__],
        "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
        "text_encoder": ["transformers", type(text_encoder).__name__],
        "tokenizer": ["transformers", "PreTrainedTokenizerFast"],
        "_mmyatt": geometry,
    }
    if vae is not None:
        index["vae"] = ["diffusers", type(vae).__name__]
    (out / "model_index.json").write_text(json.dumps(index, indent=2) + "\n")
