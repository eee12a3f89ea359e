"""CPU kernels for the short rows RL trains on: grouped-query attention and oneDNN
matmuls, switched on per forward by the text adapter (``fast_forward``).

* **Attention.** On a CPU, for rows of tens of tokens, ``sdpa`` dispatches to a
  flash-attention kernel whose per-call cost dwarfs the arithmetic, and ``eager`` first
  copies every key/value head ``group`` times (``repeat_kv``) and sums the copies'
  gradients back. ``grouped_attention`` (registered with Hugging Face as ``GROUPED``)
  lets each key/value head attend for its whole group of query heads in one matmul over
  (group x queries) rows, with the additive mask ``eager`` uses: the same arithmetic as
  ``eager`` (fp32 softmax, no dropout), without the copies.
* **Linear layers.** PyTorch's fp32 CPU matmul goes to MKL's sgemm; oneDNN's fp32
  matmul (``torch.ops.mkldnn._linear_pointwise``, full fp32, no reduced-precision math)
  runs the same products faster on the shapes of these models' layers over whole rows
  (thousands of tokens); on the 128-token products of a decode step it is not faster, so
  the adapter's decode steps keep MKL.
  ``OneDNNLinear`` computes ``F.linear`` and both of its gradients (input and weight,
  each one more oneDNN matmul) with it; inside ``fast_forward`` every fp32 CPU
  ``F.linear`` call goes through it. Values differ from MKL's by rounding only (the
  products are summed in another order).

Both apply to Llama-family models (Llama, Qwen2, Qwen3, Mistral) on the CPU with keys up
to ``MAX_GROUPED_LENGTH`` long; longer contexts and accelerators keep the model's own
kernels.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
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


# --- linear layers ----------------------------------------------------------------------
_ONEDNN = getattr(torch.ops.mkldnn, "_linear_pointwise", None)


def _mm(x: Tensor, w: Tensor, b: Tensor | None) -> Tensor:
    """x (..., K) @ w (N, K)^T + b with oneDNN."""
    return _ONEDNN(x, w, b, "none", [], "")


class OneDNNLinear(torch.autograd.Function):
    """``F.linear(x, w, b)`` and its gradients, each product a oneDNN matmul."""

    @staticmethod
    def forward(ctx, x: Tensor, w: Tensor, b: Tensor | None) -> Tensor:
        ctx.save_for_backward(x, w)
        ctx.has_bias = b is not None
        return _mm(x, w, b)

    @staticmethod
    def backward(ctx, grad: Tensor):
        x, w = ctx.saved_tensors
        need_x, need_w, need_b = ctx.needs_input_grad
        g2 = grad.reshape(-1, grad.shape[-1])  # (M, N)
        dx = _mm(grad, w.t(), None) if need_x else None  # (..., N) @ (N, K)
        dw = _mm(g2.t(), x.reshape(-1, x.shape[-1]).t(), None) if need_w else None  # (N, K)
        db = g2.sum(0) if ctx.has_bias and need_b else None
        return dx, dw, db


def _plain(t) -> bool:
    return type(t) in (torch.Tensor, torch.nn.Parameter)


def onednn_linear(x: Tensor, w: Tensor, b: Tensor | None = None) -> Tensor:
    """``F.linear`` through oneDNN for fp32 CPU tensors; anything else, ``F.linear``."""
    if not (
        _plain(x)
        and _plain(w)
        and (b is None or _plain(b))
        and x.dtype == w.dtype == torch.float32
        and x.device.type == "cpu"
        and w.device.type == "cpu"
        and x.dim() >= 2
        and x.shape[-1] > 0
        and (b is None or b.dtype == torch.float32)
    ):
        return _LINEAR(x, w, b)
    grads = x.requires_grad or w.requires_grad or (b is not None and b.requires_grad)
    if grads and torch.is_grad_enabled():
        return OneDNNLinear.apply(x, w, b)
    return _mm(x, w, b)


_LINEAR = F.linear


# --- the switch -------------------------------------------------------------------------
def applies(model, length: int) -> bool:
    """Whether a forward of ``model`` over keys of ``length`` should use these kernels: a
    Llama-family model on the CPU running ``sdpa`` or ``eager`` attention (no dropout in
    training), keys at most ``MAX_GROUPED_LENGTH`` long, and oneDNN present."""
    cfg = getattr(model, "config", None)
    if _ONEDNN is None or not torch.backends.mkldnn.is_available():
        return False
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
def fast_forward(model, *, attention: bool = True, linear: bool = True):
    """Inside the block ``model`` runs ``GROUPED`` attention (``attention``) and every
    fp32 CPU ``F.linear`` call runs through oneDNN; outside, the model's own kernels."""
    cfg = model.config
    before, linear = cfg._attn_implementation, F.linear  # nested blocks restore their own
    if attention:
        _register()
        cfg._attn_implementation = GROUPED
    if linear:
        F.linear = onednn_linear
    try:
        yield
    finally:
        F.linear = linear
        if attention:
            cfg._attn_implementation = before
