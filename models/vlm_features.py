"""Vision features in place of pixels (``placement.balance`` for VLM policies).

``VisionFeatures.encode_media`` runs the frozen vision tower once over a rollout's media and
keeps its output, one row per placeholder token, beside the grids M-RoPE needs;
``forward_encoded`` puts those rows where the model would put the tower's output. The
samples can then train on any controller, and only their token tensors move
(mmyatt/placement/exchange.py). ``VLMForward`` (models/vlm_forward.py), which ``VLMPolicy``
holds, holds one over its model.
"""

from __future__ import annotations

import torch
from torch import nn

from mmyatt.rollout import Rollout


class VisionFeatures:
    """The vision tower's output in place of a rollout's pixels, and the forward that
    reads it, for one Qwen2-VL-family ``model``."""

    def __init__(
        self, model: nn.Module, image_token_id: int, video_token_id: int, *, cache_kwarg: str
    ):
        self.model = model
        self.image_token_id, self.video_token_id = image_token_id, video_token_id
        self.cache_kwarg = cache_kwarg

    @torch.no_grad()
    def encode_media(self, rollout: Rollout) -> Rollout:
        """``rollout`` with each sample's pixels replaced by its vision tower's output
        (``image_embeds`` / ``video_embeds``: one row per placeholder token) beside the
        grids M-RoPE needs. This is what ``placement.balance`` moves between controllers:
        vision tokens, never media. Needs a frozen vision tower (``model.freeze:
        [model.visual]``): the features are then what every later forward of these
        samples, the reference's included, would compute from the pixels."""
        visual = [n for n, p in self.model.named_parameters() if p.requires_grad and "visual." in n]
        if visual:
            raise ValueError(
                "placement.balance moves a VLM sample's vision features between "
                "controllers, never its pixels, so the vision tower must be frozen "
                f"(model.freeze: [model.visual]); trainable: {visual[:3]}"
            )
        done: dict[int, dict] = {}  # a prompt's G samples share one media dict
        media = []
        for m in rollout.context["media"]:
            if id(m) not in done:
                done[id(m)] = self._encode_one(m)
            media.append(done[id(m)])
        return rollout.with_(context={**rollout.context, "media": media})

    def _encode_one(self, m: dict) -> dict:
        if is_encoded(m):
            return m
        out = {k: m.get(k) for k in ("image_grid_thw", "video_grid_thw", "second_per_grid_ts")}
        out["encoded"] = True
        dev = next(self.model.parameters()).device
        for pixels, grid, key, fn in (
            ("pixel_values", "image_grid_thw", "image_embeds", "get_image_features"),
            ("pixel_values_videos", "video_grid_thw", "video_embeds", "get_video_features"),
        ):
            if m.get(pixels) is not None:
                got = getattr(self.model, fn)(m[pixels].to(dev), m[grid].to(dev))
                got = getattr(got, "pooler_output", got)  # transformers 5: an output object
                if isinstance(got, list | tuple):
                    got = torch.cat(list(got))
                out[key] = got.float().cpu()
        return out

    def forward_encoded(self, model, ids, attn, positions, media, kw):
        """The forward of samples whose vision features came with them (``encode_media``):
        the features take their placeholder tokens' place in the input embeddings, in
        row order, as the model itself places the vision tower's output."""
        if not all(is_encoded(m) for m in media):
            raise RuntimeError("a VLM batch mixes pixels and encoded vision features")
        emb = model.get_input_embeddings()(ids)
        for key, token in (
            ("image_embeds", self.image_token_id),
            ("video_embeds", self.video_token_id),
        ):
            parts = [m[key] for m in media if m.get(key) is not None]
            if parts:
                feats = torch.cat(parts).to(emb.device, emb.dtype)
                emb = emb.masked_scatter((ids == token).unsqueeze(-1).expand_as(emb), feats)
        return model(
            inputs_embeds=emb,
            attention_mask=attn,
            position_ids=positions,
            use_cache=kw.get(self.cache_kwarg) is not None,
            **kw,
        )


def is_encoded(m: dict) -> bool:
    """A sample's media as ``encode_media`` left it (marked ``encoded``): vision features
    and grids, no pixels; a sample that had no media has nothing but the mark."""
    return "encoded" in m
