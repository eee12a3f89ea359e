"""Loading standard diffusers pipeline directories into ``FlowPolicy`` (latent space).

A directory written by ``DiffusionPipeline.save_pretrained`` has a ``model_index.json``
naming the pipeline class and, per component folder, the library and class to load.
Supported pipelines, and what ``FlowPolicy`` takes from them:

* ``StableDiffusion3Pipeline``: ``SD3Transformer2DModel``, ``AutoencoderKL``, CLIP-L and
  CLIP-G (``text_encoder``, ``text_encoder_2``, with projection) and an optional T5
  (``text_encoder_3``; absent -> zeros, as the pipeline does).
* ``FluxPipeline``: ``FluxTransformer2DModel``, ``AutoencoderKL``, CLIP (pooled) and T5
  (sequence). ``guidance_embeds`` models (FLUX.1-dev) get the embedded guidance
  ``embedded_guidance`` (default 3.5, the pipeline's default).
* ``WanPipeline`` (Wan 2.1 layout): ``WanTransformer3DModel``, ``AutoencoderKLWan``, UMT5.
  Wan 2.2's two-expert layout (``transformer_2`` / ``boundary_ratio``) and
  ``expand_timesteps`` are not supported.

Prompt encoding mirrors each pipeline's ``encode_prompt`` (CLIP penultimate hidden
states, pooled outputs concatenated, zero-padding to the joint width, T5 appended on
the sequence axis; Wan's UMT5 states trimmed to each prompt's length and zero padded).
Sigmas come from the pipeline's own scheduler config, set the way the pipeline sets
them (static ``shift``, or ``use_dynamic_shifting`` with the resolution-dependent ``mu``),
so a greedy (ODE) rollout reproduces the pipeline's Euler sampler. Latents are
scaled with the VAE's ``scaling_factor`` / ``shift_factor`` (SD3/Flux) or
``latents_mean`` / ``latents_std`` (Wan) exactly as the pipelines do before decoding.
"""

from __future__ import annotations

import importlib
import json
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from mmyatt.models.builtin.flow_tiny import position_planes

__all__ = [
    "PIPELINE_FAMILIES",
    "ImageVAE",
    "VideoVAE",
    "load_pipeline_components",
    "pipeline_sigmas",
    "transformer_forward",
]

PIPELINE_FAMILIES = {
    "StableDiffusion3Pipeline": "sd3",
    "FluxPipeline": "flux",
    "WanPipeline": "wan",
}
# component -> required?  (per family); components not named here are not loaded
_NEEDED = {
    "sd3": {
        "transformer": True,
        "scheduler": True,
        "vae": True,
        "text_encoder": True,
        "text_encoder_2": True,
        "text_encoder_3": False,
        "tokenizer": True,
        "tokenizer_2": True,
        "tokenizer_3": False,
    },
    "flux": {
        "transformer": True,
        "scheduler": True,
        "vae": True,
        "text_encoder": True,
        "text_encoder_2": True,
        "tokenizer": True,
        "tokenizer_2": True,
    },
    "wan": {
        "transformer": True,
        "scheduler": True,
        "vae": True,
        "text_encoder": True,
        "tokenizer": True,
    },
}
_MODEL_LIBS = ("diffusers", "transformers")


def _not_supported(what: str) -> NotImplementedError:
    return NotImplementedError(f"{what} is not supported by FlowPolicy")


def load_pipeline_components(
    root: Path, index: dict, dtype: torch.dtype = torch.float32
) -> tuple[str, dict[str, Any]]:
    """(family, {component name: loaded object or None}) of a diffusers pipeline folder."""
    cls_name = index.get("_class_name")
    if cls_name not in PIPELINE_FAMILIES:
        raise _not_supported(
            f"diffusers pipeline class {cls_name!r} (supported: {sorted(PIPELINE_FAMILIES)})"
        )
    family = PIPELINE_FAMILIES[cls_name]
    if family == "wan":
        if index.get("transformer_2", [None, None])[1] is not None or index.get("boundary_ratio"):
            raise _not_supported("a two-expert Wan 2.2 pipeline (transformer_2/boundary_ratio)")
        if index.get("expand_timesteps"):
            raise _not_supported("a Wan pipeline with expand_timesteps")
    comps: dict[str, Any] = {}
    for name, required in _NEEDED[family].items():
        lib, cls = (index.get(name) or [None, None])[:2]
        if lib is None or cls is None:
            if required:
                raise FileNotFoundError(f"{root}/model_index.json names no '{name}' component")
            comps[name] = None
            continue
        folder = root / name
        if not folder.is_dir():
            raise FileNotFoundError(f"{root}: missing component '{name}/' ({cls})")
        module = importlib.import_module(lib)
        klass = getattr(module, cls)
        if name == "scheduler" or name.startswith("tokenizer"):
            comps[name] = klass.from_pretrained(folder)
        elif lib == "diffusers":
            comps[name] = klass.from_pretrained(folder, torch_dtype=dtype)
        elif lib == "transformers":
            comps[name] = klass.from_pretrained(folder, dtype=dtype)
        else:
            raise ValueError(f"{root}: component {name} from unknown library {lib!r}")
    return family, comps


def write_model_index(out: Path, index: dict, comps: dict[str, Any]) -> None:
    """The pipeline's model_index.json with each saved component's class; unused -> null."""
    idx = dict(index)
    for name, obj in comps.items():
        if obj is None:
            idx[name] = [None, None]
        else:
            lib = type(obj).__module__.split(".")[0]
            idx[name] = [lib, type(obj).__name__]
    (out / "model_index.json").write_text(json.dumps(idx, indent=2) + "\n")


# --------------------------------------------------------------------------------------
# sigmas
# --------------------------------------------------------------------------------------
def _calculate_shift(seq_len: int, cfg: dict) -> float:
    """The pipelines' resolution-dependent shift mu (linear in the image token count)."""
    base_len = cfg.get("base_image_seq_len", 256)
    max_len = cfg.get("max_image_seq_len", 4096)
    base_shift = cfg.get("base_shift", 0.5)
    max_shift = cfg.get("max_shift", 1.15)
    m = (max_shift - base_shift) / (max_len - base_len)
    return seq_len * m + (base_shift - m * base_len)


def pipeline_sigmas(sched_config: dict, family: str, steps: int, image_seq_len: int) -> Tensor:
    """(steps + 1,) fp32 sigmas from 1 to 0, set the way the family's pipeline sets them.

    ``FlowMatchEulerDiscreteScheduler`` configs are used as they are (shift, dynamic
    shifting, shift_terminal, ...). A ``UniPCMultistepScheduler`` with flow sigmas (the
    Wan 2.1 checkpoints) contributes its ``flow_shift``: the SDE/ODE steps here are
    first-order, so they run on the Euler scheduler's sigmas with that shift.
    """
    from diffusers import FlowMatchEulerDiscreteScheduler

    if steps < 1:
        raise ValueError(f"denoise_steps must be >= 1, got {steps}")
    cls = sched_config.get("_class_name", "FlowMatchEulerDiscreteScheduler")
    if cls == "FlowMatchEulerDiscreteScheduler":
        sched = FlowMatchEulerDiscreteScheduler.from_config(sched_config)
    elif cls == "UniPCMultistepScheduler" and sched_config.get("use_flow_sigmas"):
        sched = FlowMatchEulerDiscreteScheduler(shift=float(sched_config.get("flow_shift", 1.0)))
    else:
        raise _not_supported(f"scheduler {cls} (flow-matching sigmas are needed)")
    cfg = dict(sched.config)
    kwargs: dict[str, Any] = {}
    if family == "flux":
        # FluxPipeline: explicit linear sigmas and always a mu (used if dynamic shifting)
        sig = None if cfg.get("use_flow_sigmas") else np.linspace(1.0, 1.0 / steps, steps)
        mu = _calculate_shift(image_seq_len, cfg)
        if sig is None:
            sched.set_timesteps(steps, device="cpu", mu=mu)
        else:
            sched.set_timesteps(sigmas=sig, device="cpu", mu=mu)
    else:
        if cfg.get("use_dynamic_shifting"):
            if family == "wan":
                raise _not_supported("use_dynamic_shifting in a Wan scheduler")
            kwargs["mu"] = _calculate_shift(image_seq_len, cfg)
        sched.set_timesteps(steps, device="cpu", **kwargs)
    return sched.sigmas.to(torch.float32).clone()


# --------------------------------------------------------------------------------------
# prompt encoders: prompts -> (cond (B, L, D), pooled (B, Dp)), fp32
# --------------------------------------------------------------------------------------
def _tokenize(tokenizer, prompts: list[str], max_length: int, device, mask: bool = False):
    tok = tokenizer(
        prompts,
        padding="max_length",
        max_length=max_length,
        truncation=True,
        add_special_tokens=True,
        return_tensors="pt",
    )
    ids = tok.input_ids.to(device)
    return (ids, tok.attention_mask.to(device)) if mask else ids


class SD3PromptEncoder(nn.Module):
    """StableDiffusion3Pipeline.encode_prompt: CLIP-L and CLIP-G penultimate states
    concatenated on channels, zero padded to the T5 width, T5 (or zeros) appended on the
    sequence; pooled = concat of both CLIP projections."""

    def __init__(self, comps: dict, joint_dim: int, max_sequence_length: int = 256):
        super().__init__()
        self.te1, self.te2, self.te3 = (comps["text_encoder"], comps["text_encoder_2"],
                                        comps["text_encoder_3"])  # fmt: skip
        self.tok1, self.tok2, self.tok3 = (
            comps["tokenizer"],
            comps["tokenizer_2"],
            comps["tokenizer_3"],
        )
        self.clip_len = int(self.tok1.model_max_length)
        self.joint_dim, self.t5_len = joint_dim, int(max_sequence_length)

    def _clip(self, te, tok, prompts, device):
        out = te(_tokenize(tok, prompts, self.clip_len, device), output_hidden_states=True)
        return out.hidden_states[-2].float(), out[0].float()

    def forward(self, prompts: list[str], device) -> tuple[Tensor, Tensor]:
        c1, p1 = self._clip(self.te1, self.tok1, prompts, device)
        c2, p2 = self._clip(self.te2, self.tok2, prompts, device)
        clip = torch.cat([c1, c2], dim=-1)
        if self.te3 is None:
            t5 = torch.zeros(len(prompts), self.t5_len, self.joint_dim, device=device)
        else:
            t5 = self.te3(_tokenize(self.tok3, prompts, self.t5_len, device))[0].float()
        clip = nn.functional.pad(clip, (0, t5.shape[-1] - clip.shape[-1]))
        return torch.cat([clip, t5], dim=-2), torch.cat([p1, p2], dim=-1)


class FluxPromptEncoder(nn.Module):
    """FluxPipeline.encode_prompt: CLIP pooler output, T5 last hidden state."""

    def __init__(self, comps: dict, max_sequence_length: int = 512):
        super().__init__()
        self.clip, self.t5 = comps["text_encoder"], comps["text_encoder_2"]
        self.tok_clip, self.tok_t5 = comps["tokenizer"], comps["tokenizer_2"]
        self.clip_len = int(self.tok_clip.model_max_length)
        self.t5_len = int(max_sequence_length)

    def forward(self, prompts: list[str], device) -> tuple[Tensor, Tensor]:
        pooled = self.clip(
            _tokenize(self.tok_clip, prompts, self.clip_len, device), output_hidden_states=False
        ).pooler_output.float()
        cond = self.t5(_tokenize(self.tok_t5, prompts, self.t5_len, device))[0].float()
        return cond, pooled


class WanPromptEncoder(nn.Module):
    """WanPipeline.encode_prompt: cleaned prompts, UMT5 states with the attention mask,
    each trimmed to its length and zero padded; Wan has no pooled embedding (zeros)."""

    def __init__(self, comps: dict, max_sequence_length: int = 512):
        super().__init__()
        self.te, self.tok = comps["text_encoder"], comps["tokenizer"]
        self.max_len = int(max_sequence_length)

    def forward(self, prompts: list[str], device) -> tuple[Tensor, Tensor]:
        from diffusers.pipelines.wan.pipeline_wan import prompt_clean

        ids, mask = _tokenize(self.tok, [prompt_clean(p) for p in prompts], self.max_len, device,
                              mask=True)  # fmt: skip
        states = self.te(ids, mask).last_hidden_state.float()
        keep = torch.arange(self.max_len, device=device)[None, :] < mask.gt(0).sum(1)[:, None]
        cond = states * keep[..., None].to(states.dtype)
        return cond, torch.zeros(len(prompts), 1, device=device)


def build_prompt_encoder(family: str, comps: dict, transformer, max_sequence_length=None):
    kw = {} if max_sequence_length is None else {"max_sequence_length": max_sequence_length}
    if family == "sd3":
        return SD3PromptEncoder(comps, int(transformer.config.joint_attention_dim), **kw)
    if family == "flux":
        return FluxPromptEncoder(comps, **kw)
    return WanPromptEncoder(comps, **kw)


# --------------------------------------------------------------------------------------
# latent codecs
# --------------------------------------------------------------------------------------
class ImageVAE(nn.Module):
    """AutoencoderKL as SD3/Flux use it: z = (E(x) - shift) * scale; x = D(z / scale + shift)."""

    def __init__(self, vae):
        super().__init__()
        self.vae = vae.eval().requires_grad_(False)
        cfg = vae.config
        self.spatial = 2 ** (len(cfg.block_out_channels) - 1)
        self.temporal = 1
        self.scaling = float(cfg.scaling_factor)
        self.shift = float(cfg.shift_factor or 0.0)
        self.latent_channels = int(cfg.latent_channels)

    def encode(self, x: Tensor, generator: torch.Generator | None = None) -> Tensor:
        dist = self.vae.encode(x.to(self.vae.dtype)).latent_dist
        z = dist.sample(generator=generator).float()
        return (z - self.shift) * self.scaling

    def decode(self, z: Tensor) -> Tensor:
        z = (z / self.scaling + self.shift).to(self.vae.dtype)
        return self.vae.decode(z, return_dict=False)[0].float()


class VideoVAE(nn.Module):
    """AutoencoderKLWan as WanPipeline uses it: z = (E(x) - mean) / std; x = D(z * std + mean),
    with the per-channel ``latents_mean`` / ``latents_std`` of its config."""

    def __init__(self, vae):
        super().__init__()
        self.vae = vae.eval().requires_grad_(False)
        cfg = vae.config
        self.spatial = int(cfg.scale_factor_spatial)
        self.temporal = int(cfg.scale_factor_temporal)
        self.latent_channels = int(cfg.z_dim)
        self.register_buffer("mean", torch.tensor(cfg.latents_mean).view(1, -1, 1, 1, 1))
        self.register_buffer("inv_std", 1.0 / torch.tensor(cfg.latents_std).view(1, -1, 1, 1, 1))

    def encode(self, x: Tensor, generator: torch.Generator | None = None) -> Tensor:
        dist = self.vae.encode(x.to(self.vae.dtype)).latent_dist
        z = dist.sample(generator=generator).float()
        return (z - self.mean) * self.inv_std

    def decode(self, z: Tensor) -> Tensor:
        z = (z / self.inv_std + self.mean).to(self.vae.dtype)
        return self.vae.decode(z, return_dict=False)[0].float()


def build_codec(vae) -> nn.Module:
    name = type(vae).__name__
    if name == "AutoencoderKL":
        return ImageVAE(vae)
    if name == "AutoencoderKLWan":
        return VideoVAE(vae)
    raise _not_supported(f"VAE class {name}")


def transformer_forward(
    family: str,
    model: nn.Module,
    x: Tensor,
    sigma: Tensor,
    cond: Tensor,
    pooled: Tensor,
    *,
    t_scale: float,
    patch_size: int = 2,
    embedded_guidance: float = 3.5,
    position_channels: bool = False,
) -> Tensor:
    """Raw velocity of ``model`` (a ``family`` transformer: "sd3", "flux", "wan") for rows
    x (R, ...), sigma (R,), cond (R, L, D), pooled (R, Dp), called the way each pipeline
    calls it: SD3 and Wan take scheduler timesteps (sigma * ``t_scale``); Wan with
    ``position_channels`` gets the position planes appended (``flow_tiny``); Flux takes
    2x2-packed tokens with their ids and, if guidance-distilled, the embedded guidance.
    The tiny built-ins are called the same way."""
    dt = model.dtype
    x, cond, pooled = x.to(dt), cond.to(dt), pooled.to(dt)
    if family == "sd3":
        return model(
            hidden_states=x,
            encoder_hidden_states=cond,
            pooled_projections=pooled,
            timestep=sigma * t_scale,  # diffusers SD3 takes scheduler timesteps
            return_dict=False,
        )[0]
    if family == "wan":
        if position_channels:
            x = torch.cat([x, position_planes(x)], dim=1)
        return model(
            hidden_states=x,
            timestep=sigma * t_scale,
            encoder_hidden_states=cond,
            return_dict=False,
        )[0]
    return _forward_flux(model, x, sigma, cond, pooled, patch_size, embedded_guidance)


def _forward_flux(model, x, sigma, cond, pooled, patch_size: int, embedded_guidance: float):
    p, (b, c, h, w) = patch_size, x.shape
    hh, ww = h // p, w // p
    tokens = x.reshape(b, c, hh, p, ww, p).permute(0, 2, 4, 1, 3, 5).reshape(b, hh * ww, -1)
    img_ids = torch.zeros(hh, ww, 3, device=x.device)
    img_ids[..., 1] = torch.arange(hh, device=x.device)[:, None]
    img_ids[..., 2] = torch.arange(ww, device=x.device)[None, :]
    txt_ids = torch.zeros(cond.shape[1], 3, device=x.device)
    guidance = None
    if model.config.get("guidance_embeds", False):  # guidance-distilled (FLUX.1-dev)
        guidance = torch.full((b,), embedded_guidance, device=x.device)
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
