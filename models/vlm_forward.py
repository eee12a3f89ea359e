"""How a Qwen2-VL-family model is called, for :class:`~mmyatt.models.vlm.VLMPolicy`
(:class:`VLMForward`, an object the policy holds): the M-RoPE positions from the model's
own ``get_rope_index``, the rows' media batched into the tensors a forward takes, and the
forward itself, over a KV cache, keeping only the last logits it needs, on pixels or on
the vision features encoded in their place (``vlm_features``).

The keyword names differ between transformers versions (``cache`` / ``past_key_values``,
``logits_to_keep``, ``mm_token_type_ids``, ``second_per_grid_ts``): they are read once
from the model's signatures.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import Tensor, nn

from .vlm_features import VisionFeatures, is_encoded
from .vlm_inputs import MEDIA_KEYS

__all__ = ["VLMForward"]


class VLMForward:
    """Positions and forwards for one Qwen2-VL-family ``model`` (or a copy of it, such
    as the frozen reference: the forward takes the module it runs)."""

    def __init__(self, model: nn.Module, image_token_id: int, video_token_id: int):
        self.model = model
        self.image_token_id, self.video_token_id = image_token_id, video_token_id
        params = inspect.signature(model.forward).parameters
        self.cache_kwarg = "cache" if "cache" in params else "past_key_values"
        self.has_logits_to_keep = "logits_to_keep" in params
        self.has_mm_types = "mm_token_type_ids" in params
        self.rope_params = frozenset(inspect.signature(_rope_fn(model)).parameters)
        # vision features in place of pixels, for placement.balance (vlm_features)
        self.features = VisionFeatures(
            model, image_token_id, video_token_id, cache_kwarg=self.cache_kwarg
        )

    def __call__(self, model, ids, attn, positions, *, media=None, cache=None, keep: int = 0):
        """``model``'s output for rows ``ids`` / ``attn`` at ``positions``, with the rows'
        ``media`` (pixels or encoded features), appending to ``cache``; ``keep``: the
        logits of the last ``keep`` positions only (where the model can)."""
        kw: dict[str, Any] = {self.cache_kwarg: cache}
        if keep and self.has_logits_to_keep:
            kw["logits_to_keep"] = keep
        if media is not None and any(is_encoded(m) for m in media):  # encode_media's features
            return self.features.forward_encoded(model, ids, attn, positions, media, kw)
        if media is not None:
            batched = self.batch_media(media, ids.device)
            for key in ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw"):
                if key in batched:
                    kw[key] = batched[key]
            if self.has_mm_types:
                kw["mm_token_type_ids"] = self.mm_types(ids)
        return model(
            input_ids=ids,
            attention_mask=attn,
            position_ids=positions,
            use_cache=cache is not None,
            **kw,
        )

    def positions(self, ids: Tensor, attn: Tensor, media: list[dict]) -> Tensor:
        """(3, N, L) M-RoPE positions from the model's own ``get_rope_index``."""
        batched = self.batch_media(media, ids.device)
        kw: dict[str, Any] = {
            "image_grid_thw": batched.get("image_grid_thw"),
            "video_grid_thw": batched.get("video_grid_thw"),
            "attention_mask": attn,
        }
        if "mm_token_type_ids" in self.rope_params:
            kw["mm_token_type_ids"] = self.mm_types(ids)
        if "second_per_grid_ts" in self.rope_params:
            kw["second_per_grid_ts"] = batched.get("second_per_grid_ts")
        positions, _ = _rope_fn(self.model)(ids, **kw)
        return positions

    def mm_types(self, ids: Tensor) -> Tensor:
        """Each token's kind: 0 text, 1 image placeholder, 2 video placeholder."""
        types = torch.zeros_like(ids, dtype=torch.int32)
        types[ids == self.image_token_id] = 1
        types[ids == self.video_token_id] = 2
        return types

    @staticmethod
    def batch_media(media: list[dict], device) -> dict[str, Tensor]:
        """The rows' per-sample media tensors joined along the first dimension, by key."""
        out: dict[str, Tensor] = {}
        for key in MEDIA_KEYS:
            parts = [m[key] for m in media if m.get(key) is not None]
            if parts:
                out[key] = torch.cat(parts).to(device)
        return out


def _rope_fn(model):
    fn = getattr(model, "get_rope_index", None)
    return fn if fn is not None else model.model.get_rope_index
