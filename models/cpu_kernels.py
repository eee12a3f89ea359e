"""A CPU kernel for the short rows RL trains on: grouped-query attention, switched on per
forward by the text adapter (``fast_forward``).

On a CPU, for rows of tens of tokens, ``sdpa`` dispatches to a flash-attention kernel
whose per-call cost dwarfs the arithmetic, and ``eager`` first copies every key/value head
``group`` times (``repeat_kv``) and sums the copies' gradients back. ``grouped_attention``
(registered with Hugging Face as ``GROUPED``) lets each key/value head attend for its whole
group of query heads in one matmul over (group x queries) rows, with the additive mask
``eager`` uses: the same arithmetic as ``eager`` (fp32 softmax, no dropout), without the
copies.

It applies to Llama-family models (Llama, Qwen2, Qwen3, Mistral) on the CPU with keys up
to ``MAX_GROUPED_LENGTH`` long; longer contexts and accelerators keep the model's own
kernel. (oneDNN's fp32 matmul in place of MKL's for the linear layers was tried: a few
per cent faster on 1 thread, two to four times slower on 2 threads of a busy machine.)
"""

from __future__ import annotations

import contextlib

import torch
from torch import Tensor

GROUPED = "mmyatt_grouped"
MAX_GROUPED_LENGTH = 256  # key length up to which the (rows, heads, L, L) scores are cheap
_TYPES = ("llama", "qwen2", "qwen3", "mistral")


# --- attention --------------------------------------------------------------------------
def grouped_attention(
    module, query: Tensor, key: Tensor, value: Tensor, attention_mask, scaling: float, **_
):
    """query (N, H, Lq, D), key/value (N, Hkv, Lk, D), attention_mask (N, 1, Lq, Lk)
    additive or None -> ((N, Lq, H, D), None). Query head ``j * group + r`` uses key/value
    head ``j`` (as ``repeat_kv``)."""
    n, h, lq, d = query.shape
    hkv, lk = key.shape[1], key.shape[2]
    g = h // hkv
    q = query.reshape(n, hkv, g * lq, d)
    scores = torch.matmul(q, key.transpose(-1, -2)) * scaling  # (N, Hkv, g * Lq, Lk)
    if attention_mask is not None:
        scores = scores.view(n, hkv, g, lq, lk) + attention_mask[:, :, None, :, :lk]
    probs = scores.softmax(-1, dtype=torch.float32).to(query.dtype).view(n, hkv, g * lq, lk)
    out = torch.matmul(probs, value).view(n, h, lq, d)
    return out.transpose(1, 2).contiguous(), None


_registered = False


def _register() -> None:
    global _registered
    if _registered:
        return
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, eager_mask

    AttentionInterface.register(GROUPED, grouped_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(GROUPED, eager_mask)
    _registered = True


# --- the switch -------------------------------------------------------------------------
def applies(model, length: int) -> bool:
    """Whether a forward of ``model`` over keys of ``length`` should use these kernels: a
    Llama-family model on the CPU running ``sdpa`` or ``eager`` attention (no dropout in
    training), keys at most ``MAX_GROUPED_LENGTH`` long."""
    cfg = getattr(model, "config", None)
    if cfg is None or getattr(cfg, "model_type", None) not in _TYPES:
        return False
    if length > MAX_GROUPED_LENGTH or getattr(cfg, "_attn_implementation", None) not in (
        "sdpa",
        "eager",
    ):
        return False
    if model.training and getattr(cfg, "attention_dropout", 0.0):
        return False
    try:
        return next(model.parameters()).device.type == "cpu"
    except StopIteration:
        return False


@contextlib.contextmanager
def fast_forward(model):
    """Inside the block ``model`` runs ``GROUPED`` attention; outside, its own."""
    cfg = model.config
    before = cfg._attn_implementation  # nested blocks restore their own
    _register()
    cfg._attn_implementation = GROUPED
    try:
        yield
    finally:
        cfg._attn_implementation = before
