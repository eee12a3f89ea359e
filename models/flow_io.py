"""Loading, saving and LoRA adapters of :class:`~mmyatt.models.flow.FlowPolicy`, and the
conversion of images to and from the policy's pixel tensors.

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

LoRA: an adapter on the attention projections (``DEFAULT_LORA_TARGETS``, flow_grpo's)
is saved next to the base transformer as ``pytorch_lora_weights.safetensors`` in
diffusers' key format, with its peft config in the file's metadata; loading a folder
with one applies it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image
from torch import Tensor

from mmyatt.models.builtin.flow_tiny import OWN_PIPELINE, write_tiny_model_index
from mmyatt.models.flow_pipeline import (
    PIPELINE_FAMILIES,
    build_codec,
    build_prompt_encoder,
    load_pipeline_components,
    write_model_index,
)
from mmyatt.models.lora import base_weights

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
TRANSFORMERS = {  # the transformer classes FlowPolicy runs, and their family
    "SD3Transformer2DModel": "sd3",
    "FluxTransformer2DModel": "flux",
    "WanTransformer3DModel": "wan",
}
COMPONENTS = ("transformer", "scheduler", "text_encoder", "tokenizer")  # a tiny built-in's


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
# LoRA, loading, saving
# --------------------------------------------------------------------------------------
def add_lora(policy, lora: dict) -> None:
    """Add a fresh peft LoRA adapter (options r, alpha, target_modules, init, dropout) to
    the policy's transformer; only the adapter's weights train from then on."""
    from peft import LoraConfig

    unknown = set(lora) - {"r", "alpha", "target_modules", "init", "dropout"}
    if unknown:
        raise ValueError(f"unknown LoRA options {sorted(unknown)}")
    r = int(lora.get("r", 8))
    policy.lora = {
        "r": r,
        "alpha": float(lora.get("alpha", 2 * r)),
        "target_modules": list(lora.get("target_modules", DEFAULT_LORA_TARGETS)),
        "init": lora.get("init", "gaussian"),
        "dropout": float(lora.get("dropout", 0.0)),
    }
    cfg = LoraConfig(
        r=r,
        lora_alpha=policy.lora["alpha"],
        target_modules=policy.lora["target_modules"],
        init_lora_weights=policy.lora["init"],  # gaussian A, zero B: the adapter starts at 0
        lora_dropout=policy.lora["dropout"],
    )
    policy.transformer.requires_grad_(False)
    policy.transformer.add_adapter(cfg)  # diffusers' PeftAdapterMixin: inject_adapter_in_model
    for n, p in policy.transformer.named_parameters():
        p.requires_grad_(".lora_" in n)


def load(cls, path: str | Path, **kwargs):
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
    cls_name = index.get("_class_name")
    if cls_name in PIPELINE_FAMILIES:
        return load_pipeline(cls, root, index, **kwargs)
    if cls_name not in (None, OWN_PIPELINE):
        raise NotImplementedError(
            f"{index_file}: pipeline class {cls_name!r} is not supported by FlowPolicy; "
            f"supported: {sorted(PIPELINE_FAMILIES)} and {OWN_PIPELINE}"
        )
    for comp in COMPONENTS:
        if comp not in index:
            raise FileNotFoundError(f"{index_file} names no '{comp}' component")
        if not (root / comp).is_dir():
            raise FileNotFoundError(f"{root}: missing component '{comp}/' ({index[comp][1]})")
    t_cls = index["transformer"][1]
    if t_cls not in TRANSFORMERS:
        raise ValueError(f"{index_file}: unsupported transformer class {t_cls}")
    transformer = getattr(diffusers, t_cls).from_pretrained(root / "transformer")
    text_encoder = getattr(transformers, index["text_encoder"][1]).from_pretrained(
        root / "text_encoder"
    )
    tokenizer = getattr(transformers, index["tokenizer"][1]).from_pretrained(root / "tokenizer")
    vae = None
    if "vae" in index:  # a latent-space built-in: its own small AutoencoderKL
        if not (root / "vae").is_dir():
            raise FileNotFoundError(f"{root}: missing component 'vae/' ({index['vae'][1]})")
        vae = build_codec(getattr(diffusers, index["vae"][1]).from_pretrained(root / "vae"))
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
    lora_opts, state = read_lora(root)
    if lora_opts is not None:
        opts["lora"] = lora_opts
    shift = opts.pop("scheduler_shift", sched.get("shift", 3.0))
    policy = cls(transformer, text_encoder, tokenizer, shift, vae=vae, **opts)
    load_lora_state(policy, lora_file, state)
    return policy


def read_lora(root: Path) -> tuple[dict | None, dict | None]:
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


def load_lora_state(policy, lora_file: Path, state: dict | None) -> None:
    if state is None:
        return
    from peft.utils import set_peft_model_state_dict

    res = set_peft_model_state_dict(policy.transformer, state, adapter_name="default")
    bad = [k for k in res.unexpected_keys if ".lora_" in k]
    if bad:
        raise ValueError(f"{lora_file}: keys that match no LoRA layer: {bad[:5]}")


def load_pipeline(cls, root: Path, index: dict, **kwargs):
    """A standard diffusers pipeline folder (see ``flow_pipeline``): latent space.

    Extra kwargs: ``dtype`` (torch dtype of every component, default float32),
    ``image_size`` (square output side in pixels; default the transformer's
    sample_size times the VAE factor, or 1024 for Flux / 480 for Wan),
    ``num_frames`` (Wan, pixel frames, default 81), ``max_sequence_length`` (T5 /
    UMT5 tokens; default the pipeline's: 256 SD3, 512 Flux and Wan),
    ``embedded_guidance`` (Flux guidance-distilled models), and the constructor's
    options (lora, reference, cfg_uncond_prompt, forward_batch).
    """
    dtype = kwargs.pop("dtype", torch.float32)
    saved = {k: v for k, v in index.get("_mmyatt", {}).items() if v is not None}
    kwargs = {**saved, **kwargs}  # what save() recorded, unless overridden
    max_seq = kwargs.pop("max_sequence_length", None)
    family, comps = load_pipeline_components(root, index, dtype)
    transformer = comps["transformer"]
    t_cls = type(transformer).__name__
    if TRANSFORMERS.get(t_cls) != family:
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
    lora_opts, state = read_lora(root)
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
    load_lora_state(policy, root / LORA_WEIGHT_NAME, state)
    return policy


def base_state_dict(policy, merged: bool) -> dict[str, Tensor]:
    """The transformer's weights under their original names: peft's ``base_layer``
    wrappers unwrapped, LoRA weights dropped or (merged) folded into W + scale*B@A."""
    return base_weights(policy.transformer, merged and policy.lora is not None)


def save(policy, path: str, merged: bool = False) -> None:
    """Write a diffusers-layout pipeline directory. With LoRA: the base transformer in
    transformer/ plus the adapter in ``pytorch_lora_weights.safetensors`` (diffusers
    key format ``transformer.<module>.lora_A.weight``, peft config in the metadata);
    ``merged=True`` folds the adapter into full weights and writes no LoRA file."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    (out / LORA_WEIGHT_NAME).unlink(missing_ok=True)
    if policy.lora is None:
        policy.transformer.save_pretrained(out / "transformer")
    else:
        base = type(policy.transformer).from_config(policy.transformer.config)
        base.to(policy.transformer.dtype)
        base.load_state_dict(base_state_dict(policy, merged), strict=True)
        base.save_pretrained(out / "transformer")
        if not merged:
            save_lora(policy, out / LORA_WEIGHT_NAME)
    if policy._pipeline is not None:
        save_pipeline_components(policy, out)
        return
    policy.text_encoder.save_pretrained(out / "text_encoder")
    policy.tokenizer.save_pretrained(out / "tokenizer")
    FlowMatchEulerDiscreteScheduler(shift=policy.shift).save_pretrained(out / "scheduler")
    codec = None if policy.vae is None else policy.vae.vae
    if codec is not None:
        codec.save_pretrained(out / "vae")
    kind = {"sd3": "sd3-image", "flux": "flux-image", "wan": "wan-video"}[policy.family]
    geometry = {
        "kind": kind,
        "image_size": policy.image_size,
        "channels": policy.channels,
        "num_frames": policy.num_frames,
        "patch_size": policy.patch_size,
        "max_length": policy.max_length,
        "position_channels": policy.position_channels,
    }
    write_tiny_model_index(out, policy.transformer, policy.text_encoder, geometry, codec)


def save_pipeline_components(policy, out: Path) -> None:
    """The loaded pipeline's other components and its model_index.json, so the folder
    loads again here and in diffusers' ``DiffusionPipeline.from_pretrained``."""
    comps = policy._pipeline["components"]
    for name, obj in comps.items():
        if name != "transformer" and obj is not None:
            obj.save_pretrained(out / name)
    index = dict(policy._pipeline["index"])
    # our geometry and prompt length, read back by load (diffusers ignores "_" keys)
    index["_mmyatt"] = {
        "image_size": policy.image_size,
        "num_frames": policy.num_frames,
        "max_sequence_length": policy._pipeline["max_sequence_length"],
        "embedded_guidance": policy.embedded_guidance,
    }
    write_model_index(out, index, comps)


def save_lora(policy, file: Path) -> None:
    from peft.utils import get_peft_model_state_dict
    from safetensors.torch import save_file

    sd = get_peft_model_state_dict(policy.transformer, adapter_name="default")
    sd = {f"transformer.{k}": v.detach().contiguous().clone() for k, v in sd.items()}
    meta = policy.transformer.peft_config["default"].to_dict()
    meta = {k: sorted(v) if isinstance(v, set) else v for k, v in meta.items()}
    save_file(
        sd,
        str(file),
        metadata={"format": "pt", LORA_METADATA_KEY: json.dumps(meta, default=str)},
    )
