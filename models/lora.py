"""LoRA adapters on the text and VLM policies' language models, and the two ways their
weights leave the trainer.

``add_lora`` injects a peft LoRA adapter in place (peft's ``inject_adapter_in_model``:
the model keeps its class and its parameter names, each targeted linear becoming
``<name>.base_layer`` plus ``<name>.lora_A.default`` / ``lora_B.default``); only the
adapter trains from then on. B starts at zero, so the adapted model starts as the base.

What leaves the trainer:

- ``adapter_tensors``: the adapter alone, in peft's file layout
  (``base_model.model.<name>.lora_A.weight``, (r, in); ``lora_B.weight``, (out, r)), with
  ``peft_config`` its ``adapter_config.json``. A rollout engine holding the base weights
  applies it as W x + (alpha / r) B A x -- vLLM's LoRA
  (:mod:`mmyatt.engines.vllm_rollout`);
- ``base_weights``: the model's weights under their original names, the adapter dropped
  or (``merged``) folded in as W + (alpha / r) B A: what ``save`` writes, a plain
  checkpoint any loader reads.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

# the language model's attention projections (Qwen2, Llama, Qwen2-VL's language model;
# peft matches them as name suffixes, so a VLM's vision tower -- attn.qkv / attn.proj --
# stays untouched)
DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
ADAPTER = "default"  # peft's adapter name
OPTIONS = {"r", "alpha", "target_modules", "dropout"}


def add_lora(model: nn.Module, lora: dict) -> dict:
    """Inject a fresh LoRA adapter (options ``r``, ``alpha``, ``target_modules``,
    ``dropout``) into ``model`` in place and freeze everything else; returns the
    options filled in (the policy's ``lora``)."""
    from peft import LoraConfig, inject_adapter_in_model

    unknown = set(lora) - OPTIONS
    if unknown:
        raise ValueError(f"unknown LoRA options {sorted(unknown)}; known: {sorted(OPTIONS)}")
    r = int(lora.get("r", 8))
    if r < 1:
        raise ValueError(f"LoRA rank r must be >= 1, got {r}")
    opts = {
        "r": r,
        "alpha": float(lora.get("alpha", 2 * r)),
        "target_modules": sorted(lora.get("target_modules") or DEFAULT_TARGETS),
        "dropout": float(lora.get("dropout", 0.0)),
    }
    cfg = LoraConfig(
        r=r,
        lora_alpha=opts["alpha"],
        target_modules=opts["target_modules"],
        lora_dropout=opts["dropout"],
        init_lora_weights=True,  # Kaiming A, zero B
    )
    model.requires_grad_(False)
    missing = ValueError(
        f"LoRA target_modules {opts['target_modules']} match no linear layer of "
        f"{type(model).__name__} (model.lora.target_modules names layers by suffix)"
    )
    try:
        inject_adapter_in_model(cfg, model, adapter_name=ADAPTER)
    except ValueError as e:  # peft: "Target modules ... not found in the base model"
        raise missing from e
    if not any(".lora_" in n for n, _ in model.named_parameters()):
        raise missing
    for n, p in model.named_parameters():
        p.requires_grad_(".lora_" in n)
    return opts


def peft_config(lora: dict) -> dict:
    """The adapter's ``adapter_config.json`` (what vLLM's ``PEFTHelper`` reads)."""
    return {
        "peft_type": "LORA",
        "r": int(lora["r"]),
        "lora_alpha": lora["alpha"],
        "target_modules": list(lora["target_modules"]),
        "lora_dropout": lora["dropout"],
        "bias": "none",
        "use_rslora": False,
        "use_dora": False,
        "modules_to_save": None,
    }


def _whole(t: Tensor) -> Tensor:
    """A (possibly FSDP2-sharded) weight, whole and detached."""
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach()


def adapter_tensors(model: nn.Module) -> dict[str, Tensor]:
    """The adapter's weights in peft's file layout (``base_model.model.<module>.lora_A.
    weight``), whole (a sharded weight is gathered): copies, as a receiver may change
    what it gets in place (vLLM folds alpha / r into its B)."""
    out = {}
    tag = f".{ADAPTER}."
    for n, p in model.named_parameters():
        if ".lora_A." in n or ".lora_B." in n:
            out["base_model.model." + n.replace(tag, ".")] = _whole(p).clone(
                memory_format=torch.contiguous_format
            )
    return out


def adapter_state(model: nn.Module) -> dict[str, Tensor]:
    """The adapter's parameters (``model``'s own names), cloned: what a copy of the same
    model with the same base needs to follow the trained one."""
    return {n: _whole(p).clone() for n, p in model.named_parameters() if ".lora_" in n}


@torch.no_grad()
def load_adapter_state(model: nn.Module, state: dict[str, Tensor]) -> None:
    """Copy ``adapter_state``'s entries into ``model`` (the same model with the same base);
    every adapter weight of ``model`` must be given, and nothing else."""
    own = {n: p for n, p in model.named_parameters() if ".lora_" in n}
    if set(own) != set(state):
        lost, extra = sorted(set(own) - set(state)), sorted(set(state) - set(own))
        raise ValueError(f"adapter state does not fit: missing {lost[:3]}, unexpected {extra[:3]}")
    for n, p in own.items():
        p.copy_(state[n])


@torch.no_grad()
def base_weights(model: nn.Module, merged: bool) -> dict[str, Tensor]:
    """The model's weights under their original names: peft's ``base_layer`` wrappers
    unwrapped, LoRA weights dropped or (``merged``) folded into W + scale * B @ A."""
    from peft.tuners.lora import LoraLayer

    sd = {}
    for k, v in model.state_dict().items():
        if ".lora_" in k:
            continue
        sd[k.replace(".base_layer.", ".")] = _whole(v).clone()
    if merged:
        for name, mod in model.named_modules():
            if isinstance(mod, LoraLayer) and ADAPTER in mod.lora_A:
                key = f"{name}.weight"
                sd[key] = sd[key] + mod.get_delta_weight(ADAPTER).to(sd[key].dtype)
    return sd
