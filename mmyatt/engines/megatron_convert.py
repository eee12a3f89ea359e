"""Hugging Face Qwen2 (and Llama-layout) weights <-> megatron-core GPTModel weights.

Pure tensor reshuffles, no process group: ``hf_to_megatron(sd, cfg, tp, rank)`` gives
tensor-parallel rank ``rank``'s shard under the names of megatron-core's local layer
spec; ``megatron_to_hf(shards, cfg)`` joins the shards of all ranks back. Both
directions only slice, concatenate and reshape, so a round trip is exact.

Megatron layout (per layer ``i``, prefix ``decoder.layers.i.``):

===========================================  ==========================================
``self_attention.linear_qkv.weight/bias``    q, k, v fused per query group: for each of
                                             the G = num_key_value_heads groups, its
                                             H/G query heads, then its k head, then v;
                                             column parallel (rank r holds G/tp groups)
``self_attention.linear_proj.weight``        o_proj, row parallel (split on inputs)
``mlp.linear_fc1.weight``                    [gate; up] of this rank's slice (SwiGLU)
``mlp.linear_fc2.weight``                    down_proj, row parallel
``input_layernorm.weight``,                  RMSNorm weights, replicated
``pre_mlp_layernorm.weight``
===========================================  ==========================================

plus ``embedding.word_embeddings.weight`` (vocab parallel), ``decoder.final_layernorm.weight``
and, for untied embeddings, ``output_layer.weight`` (vocab parallel).
"""

from __future__ import annotations

import torch
from torch import Tensor


def _dims(cfg) -> tuple[int, int, int, int]:
    heads, groups = cfg.num_attention_heads, cfg.num_key_value_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    return heads, groups, head_dim, cfg.num_hidden_layers


def check_tp(cfg, tp: int) -> None:
    heads, groups, _, _ = _dims(cfg)
    bad = [
        name
        for name, n in (
            ("num_key_value_heads", groups),
            ("num_attention_heads", heads),
            ("intermediate_size", cfg.intermediate_size),
            ("vocab_size", cfg.vocab_size),
        )
        if n % tp
    ]
    if bad:
        raise ValueError(f"tensor parallel size {tp} does not divide {', '.join(bad)} of the model")


def _fuse_qkv(q: Tensor, k: Tensor, v: Tensor, heads: int, groups: int, head_dim: int) -> Tensor:
    """(G, (H/G + 2) * head_dim, ...) grouped layout, flattened on dim 0."""
    rest = q.shape[1:]
    q = q.reshape(groups, heads // groups * head_dim, *rest)
    k = k.reshape(groups, head_dim, *rest)
    v = v.reshape(groups, head_dim, *rest)
    return torch.cat([q, k, v], 1)


def _split_qkv(w: Tensor, heads: int, groups: int, head_dim: int) -> tuple[Tensor, Tensor, Tensor]:
    per = heads // groups * head_dim
    w = w.reshape(groups, per + 2 * head_dim, *w.shape[1:])
    q, k, v = w.split([per, head_dim, head_dim], 1)
    flat = (lambda t: t.reshape(-1, *t.shape[2:])) if w.dim() > 2 else (lambda t: t.reshape(-1))
    return flat(q), flat(k), flat(v)


def hf_to_megatron(sd: dict[str, Tensor], cfg, tp: int = 1, rank: int = 0) -> dict[str, Tensor]:
    """Tensor-parallel rank ``rank`` of ``tp``: its Megatron state dict from a HF one."""
    check_tp(cfg, tp)
    heads, groups, head_dim, layers = _dims(cfg)
    tied = bool(getattr(cfg, "tie_word_embeddings", False))

    def col(t: Tensor) -> Tensor:  # split on outputs (dim 0)
        return t.chunk(tp, 0)[rank].clone()

    def row(t: Tensor) -> Tensor:  # split on inputs (dim 1)
        return t.chunk(tp, 1)[rank].clone()

    out = {"embedding.word_embeddings.weight": col(sd["model.embed_tokens.weight"])}
    for i in range(layers):
        h, m = f"model.layers.{i}.", f"decoder.layers.{i}."
        a = h + "self_attn."
        for kind in ("weight", "bias"):
            if f"{a}q_proj.{kind}" not in sd:
                continue
            fused = _fuse_qkv(
                sd[f"{a}q_proj.{kind}"],
                sd[f"{a}k_proj.{kind}"],
                sd[f"{a}v_proj.{kind}"],
                heads,
                groups,
                head_dim,
            )  # (G, per-group rows, ...): rank r takes G/tp whole groups
            local = fused.chunk(tp, 0)[rank]
            out[f"{m}self_attention.linear_qkv.{kind}"] = local.reshape(-1, *fused.shape[2:])
        out[f"{m}self_attention.linear_proj.weight"] = row(sd[f"{a}o_proj.weight"])
        gate, up = sd[f"{h}mlp.gate_proj.weight"], sd[f"{h}mlp.up_proj.weight"]
        out[f"{m}mlp.linear_fc1.weight"] = torch.cat([col(gate), col(up)], 0)
        out[f"{m}mlp.linear_fc2.weight"] = row(sd[f"{h}mlp.down_proj.weight"])
        out[f"{m}input_layernorm.weight"] = sd[f"{h}input_layernorm.weight"].clone()
        out[f"{m}pre_mlp_layernorm.weight"] = sd[f"{h}post_attention_layernorm.weight"].clone()
    out["decoder.final_layernorm.weight"] = sd["model.norm.weight"].clone()
    if not tied:
        out["output_layer.weight"] = col(sd["lm_head.weight"])
    return out


def megatron_to_hf(shards: list[dict[str, Tensor]], cfg) -> dict[str, Tensor]:
    """Join the state dicts of all tensor-parallel ranks (in rank order) into HF names."""
    heads, groups, head_dim, layers = _dims(cfg)
    tied = bool(getattr(cfg, "tie_word_embeddings", False))

    def cat0(key: str) -> Tensor:
        return torch.cat([s[key] for s in shards], 0)

    def cat1(key: str) -> Tensor:
        return torch.cat([s[key] for s in shards], 1)

    out = {"model.embed_tokens.weight": cat0("embedding.word_embeddings.weight")}
    for i in range(layers):
        h, m = f"model.layers.{i}.", f"decoder.layers.{i}."
        for kind in ("weight", "bias"):
            key = f"{m}self_attention.linear_qkv.{kind}"
            if key not in shards[0]:
                continue
            q, k, v = _split_qkv(cat0(key), heads, groups, head_dim)
            out[f"{h}self_attn.q_proj.{kind}"] = q
            out[f"{h}self_attn.k_proj.{kind}"] = k
            out[f"{h}self_attn.v_proj.{kind}"] = v
        out[f"{h}self_attn.o_proj.weight"] = cat1(f"{m}self_attention.linear_proj.weight")
        fc1 = [s[f"{m}mlp.linear_fc1.weight"].chunk(2, 0) for s in shards]
        out[f"{h}mlp.gate_proj.weight"] = torch.cat([g for g, _ in fc1], 0)
        out[f"{h}mlp.up_proj.weight"] = torch.cat([u for _, u in fc1], 0)
        out[f"{h}mlp.down_proj.weight"] = cat1(f"{m}mlp.linear_fc2.weight")
        out[f"{h}input_layernorm.weight"] = shards[0][f"{m}input_layernorm.weight"].clone()
        out[f"{h}post_attention_layernorm.weight"] = shards[0][
            f"{m}pre_mlp_layernorm.weight"
        ].clone()
    out["model.norm.weight"] = shards[0]["decoder.final_layernorm.weight"].clone()
    out["lm_head.weight"] = (
        out["model.embed_tokens.weight"] if tied else cat0("output_layer.weight")
    )
    return out
