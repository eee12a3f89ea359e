"""What a VLM prompt becomes before the model sees it: chat messages, token ids with the
vision placeholders expanded, and the per-sample pixel tensors, for
:class:`~mmyatt.models.vlm.VLMPolicy` (:class:`VLMPrompts`, an object the policy holds).

* **Media.** A record is ``{"prompt": str | messages, "image": path | PIL | data URL |
  list of those, "video": path | (T, H, W, 3) frames | list of frames, ...}``. Images go
  through the checkpoint's ``Qwen2VLImageProcessor`` (its PIL backend when torchvision
  is missing). Videos are sampled uniformly (:func:`mmyatt.datasets.media.load_video`)
  and patched by hand, without torchvision: frames are resized with the image
  processor's ``smart_resize`` bounds, rescaled and normalised with its mean/std, padded
  to a multiple of the temporal patch by repeating the last frame, and laid out as
  ``(T, C, H, W) -> (gt, tp, C, gh/m, m, p, gw/m, m, p) -> (gt, gh/m, gw/m, m, m, C, tp,
  p, p) -> (gt*gh*gw, C*tp*p*p)``, the layout of Qwen's own processors (a still
  two-frame video gives the image path's pixels).
* **Placeholders.** The chat template writes one ``<|image_pad|>`` / ``<|video_pad|>``
  per image/video; each is expanded to ``t*h*w / merge**2`` copies from its grid, and
  ``mm_token_type_ids`` marks them (0 text, 1 image, 2 video).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image
from torch import Tensor

from mmyatt.datasets.media import VIDEO_SUFFIXES, load_image, load_video_with_fps

MEDIA_KEYS = (  # the per-sample media tensors of a prompt (None when absent)
    "pixel_values",
    "image_grid_thw",
    "pixel_values_videos",
    "video_grid_thw",
    "second_per_grid_ts",
)


class PromptTooLongError(ValueError):
    """A prompt (image tokens included) has more tokens than ``max_prompt_tokens``."""


def smart_resize(
    height: int, width: int, factor: int, min_pixels: int, max_pixels: int
) -> tuple[int, int]:
    """Qwen2-VL's resize rule: sides divisible by ``factor``, area in [min, max] pixels,
    aspect ratio kept as closely as possible (same as transformers' ``smart_resize``)."""
    if max(height, width) / min(height, width) > 200:
        raise ValueError(f"aspect ratio must be below 200, got {height}x{width}")
    h = max(factor, round(height / factor) * factor)
    w = max(factor, round(width / factor) * factor)
    if h * w > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h = max(factor, math.floor(height / beta / factor) * factor)
        w = max(factor, math.floor(width / beta / factor) * factor)
    elif h * w < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h = math.ceil(height * beta / factor) * factor
        w = math.ceil(width * beta / factor) * factor
    return h, w


class VLMPrompts:
    """Prompt and media preparation of a VLM policy (an object ``VLMPolicy`` holds):
    the tokenizer and image processor, the placeholder tokens and the patch geometry of
    the vision tower, and how prompts and videos are limited."""

    def __init__(
        self,
        tokenizer,
        image_processor,
        *,
        image_token_id: int,
        video_token_id: int,
        vision_config,
        max_prompt_tokens: int,
        system_prompt: str | None = None,
        video_fps: float = 2.0,
        video_max_frames: int = 8,
    ):
        self.tokenizer, self.image_processor = tokenizer, image_processor
        self.image_token = tokenizer.convert_ids_to_tokens(image_token_id)
        self.video_token = tokenizer.convert_ids_to_tokens(video_token_id)
        self.merge = int(vision_config.spatial_merge_size)
        self.patch = int(getattr(image_processor, "patch_size", None) or vision_config.patch_size)
        self.temporal_patch = int(
            getattr(image_processor, "temporal_patch_size", None)
            or vision_config.temporal_patch_size
        )
        self.max_prompt_tokens = int(max_prompt_tokens)
        self.system_prompt = system_prompt
        self.video_fps, self.video_max_frames = float(video_fps), int(video_max_frames)

    def image_token_count(self, image: Any) -> int:
        """How many ``<|image_pad|>`` tokens an image becomes (4 for 56x56 with the tiny
        models: a 4x4 patch grid merged 2x2)."""
        return int(self.image_inputs([load_image(image)])[1].prod(-1).sum()) // self.merge**2

    def prepare(self, record: dict, index: int, *, limit: bool = True) -> dict:
        """{"ids": prompt token ids (placeholders expanded), "media": per-sample tensors};
        ``limit`` enforces ``max_prompt_tokens``."""
        source = record.get("_source") or f"index {record.get('_index', index)}"
        messages, images, videos = self.messages(record, source)
        text = self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True
        )
        media: dict[str, Tensor | None] = dict.fromkeys(MEDIA_KEYS)
        if images:
            media["pixel_values"], media["image_grid_thw"] = self.image_inputs(images)
            text = self._expand(text, self.image_token, media["image_grid_thw"], source)
        elif self.image_token in text:
            raise ValueError(f"prompt {source} has an image placeholder but no image")
        if videos:
            pv, grids, seconds = [], [], []
            for frames, fps in videos:
                values, grid = self.video_inputs(frames)
                pv.append(values)
                grids.append(grid)
                seconds.append(self.temporal_patch / fps)
            media["pixel_values_videos"] = torch.cat(pv)
            media["video_grid_thw"] = torch.cat(grids)
            media["second_per_grid_ts"] = torch.tensor(seconds, dtype=torch.float32)
            text = self._expand(text, self.video_token, media["video_grid_thw"], source)
        elif self.video_token in text:
            raise ValueError(f"prompt {source} has a video placeholder but no video")
        ids = list(self.tokenizer(text, add_special_tokens=False)["input_ids"])
        if not ids:
            raise ValueError(f"prompt {source} is empty after tokenization")
        if limit and len(ids) > self.max_prompt_tokens:
            raise PromptTooLongError(
                f"prompt {source} has {len(ids)} tokens (vision tokens included), over "
                f"max_prompt_tokens={self.max_prompt_tokens}; shorten it, shrink its media "
                "or raise the limit"
            )
        return {"ids": ids, "media": media}

    def messages(self, record: dict, source: str) -> tuple[list[dict], list[Image.Image], list]:
        """Chat messages with normalised parts, the images and the (frames, fps) videos
        in the order their placeholders appear."""
        pending_images = _as_list(record.get("image"), is_video=False)
        pending_video = _as_list(record.get("video"), is_video=True)
        video_fps = float(record.get("video_fps") or self.video_fps)
        images: list[Image.Image] = []
        videos: list[tuple[np.ndarray, float]] = []

        def take_video(payload) -> None:
            if isinstance(payload, np.ndarray) and payload.ndim == 4:
                frames, fps = payload, video_fps
            else:
                frames, fps = load_video_with_fps(
                    payload, fps=self.video_fps, max_frames=self.video_max_frames, source=source
                )
            videos.append((np.asarray(frames, dtype=np.uint8), fps))

        prompt = record["prompt"]
        if isinstance(prompt, str):
            parts: list[dict] = []
            for image in pending_images:
                images.append(load_image(image, source=source))
                parts.append({"type": "image"})
            for video in pending_video:
                take_video(video)
                parts.append({"type": "video"})
            parts.append({"type": "text", "text": prompt})
            messages = [{"role": "user", "content": parts}]
        else:
            messages = []
            for message in prompt:
                content = message.get("content")
                if isinstance(content, str) or content is None:
                    messages.append({"role": message["role"], "content": content or ""})
                    continue
                parts = []
                for part in content:
                    kind = part.get("type") or next(
                        (k for k in ("image", "image_url", "video", "text") if k in part), None
                    )
                    if kind in ("image", "image_url"):
                        payload = part.get("image")
                        if kind == "image_url" or payload is None and "image_url" in part:
                            url = part.get("image_url")
                            payload = url.get("url") if isinstance(url, dict) else url
                        if payload is None:
                            if not pending_images:
                                raise ValueError(f"prompt {source}: more image parts than images")
                            payload = pending_images.pop(0)
                        images.append(load_image(payload, source=source))
                        parts.append({"type": "image"})
                    elif kind == "video":
                        payload = part.get("video")
                        if payload is None:
                            if not pending_video:
                                raise ValueError(f"prompt {source}: more video parts than videos")
                            payload = pending_video.pop(0)
                        take_video(payload)
                        parts.append({"type": "video"})
                    elif kind == "text":
                        parts.append({"type": "text", "text": part.get("text", "")})
                    else:
                        raise ValueError(f"prompt {source}: unsupported content part {part!r:.80}")
                messages.append({"role": message["role"], "content": parts})
            if pending_images or pending_video:
                raise ValueError(f"prompt {source}: the record has media that no message part uses")
        if self.system_prompt is not None and (not messages or messages[0].get("role") != "system"):
            messages = [{"role": "system", "content": self.system_prompt}, *messages]
        return messages, images, videos

    def image_inputs(self, images: list[Image.Image]) -> tuple[Tensor, Tensor]:
        out = self.image_processor(images=images, return_tensors="pt")
        return out["pixel_values"].float(), out["image_grid_thw"].long()

    def video_inputs(self, frames: np.ndarray) -> tuple[Tensor, Tensor]:
        """(gt*gh*gw, C*tp*p*p) float pixels and (1, 3) grid, laid out as Qwen's processors."""
        ip = self.image_processor
        p, m, tp = self.patch, self.merge, self.temporal_patch
        size = getattr(ip, "size", None) or {}
        min_pixels = getattr(ip, "min_pixels", None) or _get(size, "shortest_edge", 56 * 56)
        max_pixels = getattr(ip, "max_pixels", None) or _get(size, "longest_edge", 28 * 28 * 1280)
        T, H, W = frames.shape[:3]
        h, w = smart_resize(H, W, p * m, int(min_pixels), int(max_pixels))
        if (h, w) != (H, W):
            resample = getattr(ip, "resample", Image.Resampling.BICUBIC)
            frames = np.stack(
                [np.asarray(Image.fromarray(f).resize((w, h), resample=resample)) for f in frames]
            )
        x = torch.from_numpy(np.ascontiguousarray(frames)).float()  # (T, h, w, C)
        if getattr(ip, "do_rescale", True):
            x = x * float(getattr(ip, "rescale_factor", 1 / 255))
        if getattr(ip, "do_normalize", True):
            mean = torch.tensor(ip.image_mean, dtype=torch.float32)
            std = torch.tensor(ip.image_std, dtype=torch.float32)
            x = (x - mean) / std
        x = x.permute(0, 3, 1, 2)  # (T, C, h, w)
        if T % tp:
            x = torch.cat([x, x[-1:].expand(tp - T % tp, -1, -1, -1)])
        C = x.shape[1]
        gt, gh, gw = x.shape[0] // tp, h // p, w // p
        x = x.reshape(gt, tp, C, gh // m, m, p, gw // m, m, p)
        x = x.permute(0, 3, 6, 4, 7, 2, 1, 5, 8)  # (gt, bh, bw, mh, mw, C, tp, ph, pw)
        return x.reshape(gt * gh * gw, C * tp * p * p).contiguous(), torch.tensor([[gt, gh, gw]])

    def _expand(self, text: str, token: str, grids: Tensor, source: str) -> str:
        pieces = text.split(token)
        if len(pieces) - 1 != len(grids):
            raise ValueError(
                f"prompt {source}: {len(pieces) - 1} {token} placeholders for {len(grids)} inputs"
            )
        counts = (grids.prod(-1) // self.merge**2).tolist()
        out = [pieces[0]]
        for n, piece in zip(counts, pieces[1:]):
            out.append(token * int(n))
            out.append(piece)
        return "".join(out)


def _as_list(value: Any, *, is_video: bool) -> list:
    """Record media as a list of items. Images: one item or a list. Videos: a path, a
    (T, H, W, 3) array or a list of frames is one video; a list of video paths is several."""
    if value is None:
        return []
    if not is_video:
        return list(value) if isinstance(value, (list, tuple)) else [value]
    suffixes = VIDEO_SUFFIXES
    if isinstance(value, (list, tuple)) and all(
        isinstance(v, (str, Path)) and str(v).lower().endswith(suffixes) for v in value
    ):
        return list(value)
    return [value]


def _get(size: Any, key: str, default: int) -> int:
    value = size.get(key) if isinstance(size, dict) else getattr(size, key, None)
    return value if value is not None else default
