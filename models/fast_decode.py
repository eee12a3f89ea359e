"""Decode steps of one fixed shape, over a key/value cache kept between rollouts, and
compiled (``rollout.hf_static_cache``, ``rollout.compile_decode``).

``models.decode.StaticKVDecoder`` attends the cache columns written so far, so each
step has new shapes. Here every step attends all P + A columns of the cache, the
columns not yet written masked out (an additive float32 bias, as for the prompt's
padding): token, positions and the column index are the only inputs that change, so
the step can be compiled once and, on CUDA, replayed as a CUDA graph
(``torch.compile`` mode "reduce-overhead"; the default inductor mode on the CPU).
The cache buffers are allocated once per shape (rows, heads, P + A, head_dim) and
refilled in place by each rollout's prefill: the compiled step sees the same
addresses every time and is not recompiled while the shapes stay.

The same model modules compute the same numbers as ``StaticKVDecoder`` (masked
columns weigh exactly 0 after the softmax), so a fixed seed draws the same samples up
to float rounding in the attention's sums.
"""

from __future__ import annotations

import logging
import sys

import torch
from torch import Tensor

from .decode import StaticKVDecoder, decoder_stack, project_qkv

log = logging.getLogger(__name__)

_MIN = torch.finfo(torch.float32).min


class FixedShapeStep:
    """The decode step over one cache shape: buffers and the (compiled) step function."""

    def __init__(self, model, shape: tuple[int, int, int, int], dtype, device):
        self.model, self.base = model, decoder_stack(model)
        self.layers = list(self.base.layers)
        self.rope = sys.modules[type(self.layers[0].self_attn).__module__].apply_rotary_pos_emb
        n, _, width, _ = shape
        # zeros, not empty: masked columns still enter the products (weight 0 x value)
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in self.layers]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in self.layers]
        self.bias = torch.zeros(n, 1, 1, width, dtype=torch.float32, device=device)
        self.cols = torch.arange(width, device=device)
        self.col = torch.zeros((), dtype=torch.long, device=device)
        for buf in (*self.keys, *self.values, self.bias, self.cols, self.col):
            torch._dynamo.mark_static_address(buf)
        self.fn = self.step

    def load(self, cache, prompt_mask: Tensor) -> None:
        """The prefill's keys and values (cache layers (N, Hkv, P, D)) into columns
        [0, P); the prompt's padding masked."""
        p = prompt_mask.shape[1]
        for i, (layer, ks, vs) in enumerate(zip(cache.layers, self.keys, self.values)):
            if layer.keys.shape[0] != ks.shape[0] or layer.keys.shape[2] != p:
                raise ValueError(
                    f"cache layer {i} has shape {tuple(layer.keys.shape)}, "
                    f"rows {ks.shape[0]} x {p} needed"
                )
            ks[:, :, :p].copy_(layer.keys)
            vs[:, :, :p].copy_(layer.values)
        self.bias.zero_()
        self.bias[:, 0, 0, :p].masked_fill_(prompt_mask == 0, _MIN)

    def step(self, token: Tensor, positions: Tensor, col: Tensor) -> Tensor:
        """Logits (N, V) after writing ``token`` (N,) at ``positions`` (N, 1) into cache
        column ``col`` (a 0-d long tensor), attending columns [0, col]."""
        h = self.base.embed_tokens(token[:, None])  # (N, 1, D)
        cos, sin = self.base.rotary_emb(h, positions)
        n = h.shape[0]
        bias = torch.where(self.cols <= col, self.bias, _MIN)  # (N, 1, 1, P + A)
        index = col.view(1)
        for layer, ks, vs in zip(self.layers, self.keys, self.values):
            a = layer.self_attn
            q, k, v = project_qkv(a, layer.input_layernorm(h), cos, sin, self.rope)
            ks.index_copy_(2, index, k)
            vs.index_copy_(2, index, v)
            qg = q.reshape(n, ks.shape[1], -1, a.head_dim)  # (N, Hkv, group, D)
            scores = torch.matmul(qg, ks.transpose(-1, -2)) * a.scaling
            scores = (scores.float() + bias).softmax(-1).to(q.dtype)
            out = torch.matmul(scores, vs)  # (N, Hkv, group, D)
            h = h + a.o_proj(out.reshape(n, 1, -1))
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        return self.model.lm_head(self.base.norm(h))[:, -1]


class FastDecode:
    """An adapter's fixed-shape decode: options and what persists between rollouts.

    ``compile_step``: compile the step with ``torch.compile`` (``mode`` "reduce-overhead"
    on CUDA, the default mode elsewhere; ``backend`` overrides the compiler, e.g.
    "eager" to check the capture alone, or "cudagraphs" for CUDA graphs of the uncompiled
    operations, quick to build). One step per cache shape is kept (the last one: a new
    shape replaces it).
    """

    def __init__(self, compile_step: bool = False, backend: str | None = None):
        self.compile_step, self.backend = compile_step, backend
        self.current: tuple | None = None  # (key, FixedShapeStep)

    @staticmethod
    def check(model) -> None:
        """Raise where the fixed-shape step cannot run ``model``."""
        if not StaticKVDecoder.supports(model):
            cfg = getattr(decoder_stack(model), "config", None)
            raise ValueError(
                "rollout.hf_static_cache needs a Llama-family decoder (Llama, Qwen2, Qwen3, "
                "Mistral without a sliding window, or the language model of Qwen2-VL / "
                f"Qwen2.5-VL), unwrapped; got model_type={getattr(cfg, 'model_type', None)!r}"
                f" ({type(model).__name__}); set rollout.hf_static_cache=false"
            )

    def stepper(self, model, cache, prompt_mask: Tensor, max_new_tokens: int):
        """``forward_next(token, positions, t)`` for ``models.decode.decode``'s loop,
        after loading this rollout's prefill ``cache`` (rows of ``prompt_mask``)."""
        self.check(model)
        k0 = cache.layers[0].keys  # (N, Hkv, P, D)
        n, heads, p, dim = k0.shape
        shape = (n, heads, p + max_new_tokens, dim)
        key = (id(model), shape, k0.dtype, str(k0.device))
        if self.current is None or self.current[0] != key:
            step = FixedShapeStep(model, shape, k0.dtype, k0.device)
            if self.compile_step:
                cuda = k0.device.type == "cuda"
                mode = "reduce-overhead" if cuda and self.backend is None else None
                step.fn = torch.compile(
                    step.step,
                    backend=self.backend or "inductor",
                    mode=mode,
                    fullgraph=True,
                    dynamic=False,
                )
                log.info("fast decode: compiling the decode step for cache %s", shape)
            self.current = (key, step)
        step = self.current[1]
        step.load(cache, prompt_mask)
        # CUDA graphs: inductor's "reduce-overhead" mode, or the "cudagraphs" backend
        graphs = (
            self.compile_step and k0.device.type == "cuda" and self.backend in (None, "cudagraphs")
        )

        def forward_next(token: Tensor, positions: Tensor, t: int) -> Tensor:
            step.col.fill_(p + t)
            if graphs:  # a new replay of the CUDA graph: its last outputs may be reused
                torch.compiler.cudagraph_mark_step_begin()
            logits = step.fn(token, positions, step.col)
            # a CUDA graph's output is overwritten by its next replay, and the decode
            # loop writes into the logits it gets: hand it its own copy
            return logits.clone() if graphs else logits

        return forward_next
