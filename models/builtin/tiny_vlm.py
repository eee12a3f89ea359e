"""Tiny randomly initialised Qwen2-VL / Qwen2.5-VL models, built locally for tests and demos.

A tiny VLM is a real ``Qwen2VLForConditionalGeneration`` (or ``Qwen2_5_VL...``), a locally
trained byte-level BPE tokenizer with the Qwen2-VL special tokens and chat template, and a
``Qwen2VLImageProcessor`` config, all saved with ``save_pretrained``: plain transformers
loads each of them from the directory, and so does :meth:`mmyatt.models.vlm.VLMPolicy.load`.

Vision: patch 14, spatial merge 2, temporal patch 2, so a 56x56 image is a 4x4 patch grid
and 4 image tokens. The image processor resizes anything to between 56x56 and 112x112
pixels (4 to 16 image tokens; Qwen2-VL's own minimum is 56x56 too): 56x56 images stay as
they are and smaller ones, such as the 32x32 images of the flow recipes, are upscaled.

Sizes (parameters with a ~400-token vocabulary; text embeddings are tied):

==========  ===========  ===========  ===========  ==============  ==========
name        text hidden  text layers  heads / kv   vision depth    parameters
==========  ===========  ===========  ===========  ==============  ==========
small                64            2        4 / 2  1 (embed 32)       ~0.19 M
base                128            4        4 / 2  2 (embed 64)       ~0.88 M
==========  ===========  ===========  ===========  ==============  ==========
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import torch
from transformers import GenerationConfig

from .tokenizer import train_bpe_tokenizer

VISION_START = "<|vision_start|>"
VISION_END = "<|vision_end|>"
IMAGE_PAD = "<|image_pad|>"
VIDEO_PAD = "<|video_pad|>"
VISION_TOKENS = (VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD)
IM_END = "<|im_end|>"
ANSWER_WORDS = ("Yes", "No")  # judges read P(Yes) / P(No): each must be one token

# Qwen2-VL's chat template without the default system message (the tiny models are
# trained without one; a caller that wants one passes a system message). Content is a
# string or a list of parts: {"type": "text"}, {"type": "image"} / "image_url" and
# {"type": "video"}; every image part becomes <|vision_start|><|image_pad|><|vision_end|>.
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' -}}"
    "{%- if message['content'] is string -%}{{- message['content'] -}}"
    "{%- else -%}{%- for part in message['content'] -%}"
    "{%- if part.get('type') == 'image' or part.get('type') == 'image_url' or 'image' in part"
    " or 'image_url' in part -%}{{- '<|vision_start|><|image_pad|><|vision_end|>' -}}"
    "{%- elif part.get('type') == 'video' or 'video' in part -%}"
    "{{- '<|vision_start|><|video_pad|><|vision_end|>' -}}"
    "{%- elif 'text' in part -%}{{- part['text'] -}}"
    "{%- endif -%}{%- endfor -%}{%- endif -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)

ARCHS = ("qwen2-vl", "qwen2.5-vl")

TINY_VLM_SIZES: dict[str, dict] = {
    "small": dict(
        text=dict(
            hidden_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            intermediate_size=192,
        ),
        vision=dict(depth=1, embed_dim=32, num_heads=2),
    ),
    "base": dict(
        text=dict(
            hidden_size=128,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            intermediate_size=256,
        ),
        vision=dict(depth=2, embed_dim=64, num_heads=4),
    ),
}

# Image processor: 56x56 stays 56x56 (4 tokens); smaller grow to it, larger shrink to <= 112x112.
MIN_PIXELS = 56 * 56
MAX_PIXELS = 112 * 112

# Words that must be cheap to emit for the built-in tasks (answers and questions);
# repeated in the tokenizer corpus so BPE merges them whole.
_TASK_WORDS = (
    "Yes No red green blue yellow purple orange cyan white black circle square triangle "
    "left right up down colour shape image video Answer What Which Does this show "
    "the is it way move"
)


def _mrope_section(head_dim: int) -> list[int]:
    """Temporal/height/width split of head_dim / 2 rotary frequencies, Qwen's 2:1:1 ratio
    (Qwen2-VL-7B: head_dim 128 -> [16, 24, 24]; any split summing to head_dim / 2 works)."""
    half = head_dim // 2
    t = half // 2
    h = (half - t) // 2
    return [t, h, half - t - h]


def _config(arch: str, size: str, tokenizer, ids: dict[str, int]):
    spec = TINY_VLM_SIZES[size]
    text = dict(spec["text"])
    head_dim = text["hidden_size"] // text["num_attention_heads"]
    text.update(
        vocab_size=len(tokenizer),
        max_position_embeddings=1024,
        rms_norm_eps=1e-6,
        hidden_act="silu",
        attention_dropout=0.0,
        initializer_range=0.02,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 10000.0,
            "mrope_section": _mrope_section(head_dim),
        },
        eos_token_id=ids["eos"],
        bos_token_id=ids["endoftext"],
        pad_token_id=ids["pad"],
        tie_word_embeddings=True,
    )
    vis = spec["vision"]
    common = dict(
        image_token_id=ids[IMAGE_PAD],
        video_token_id=ids[VIDEO_PAD],
        vision_start_token_id=ids[VISION_START],
        vision_end_token_id=ids[VISION_END],
        tie_word_embeddings=True,
    )
    if arch == "qwen2-vl":
        from transformers import Qwen2VLConfig

        vision = dict(
            depth=vis["depth"],
            embed_dim=vis["embed_dim"],
            hidden_size=text["hidden_size"],  # the merger's output: the LM's width
            mlp_ratio=2,
            num_heads=vis["num_heads"],
            patch_size=14,
            spatial_merge_size=2,
            temporal_patch_size=2,
            initializer_range=0.02,
        )
        return Qwen2VLConfig(text_config=text, vision_config=vision, **common)
    from transformers import Qwen2_5_VLConfig

    vision = dict(
        depth=vis["depth"],
        hidden_size=vis["embed_dim"],
        intermediate_size=2 * vis["embed_dim"],
        num_heads=vis["num_heads"],
        out_hidden_size=text["hidden_size"],
        patch_size=14,
        spatial_merge_size=2,
        temporal_patch_size=2,
        window_size=112,
        fullatt_block_indexes=[vis["depth"] - 1],
        tokens_per_second=2,
        initializer_range=0.02,
    )
    return Qwen2_5_VLConfig(text_config=text, vision_config=vision, **common)


def _model_class(arch: str):
    if arch == "qwen2-vl":
        from transformers import Qwen2VLForConditionalGeneration

        return Qwen2VLForConditionalGeneration
    from transformers import Qwen2_5_VLForConditionalGeneration

    return Qwen2_5_VLForConditionalGeneration


def _image_processor():
    # Qwen2VLImageProcessor needs torchvision; without it transformers falls back to the
    # PIL backend with a warning. Build the PIL class directly; it saves the same
    # preprocessor_config.json ("image_processor_type": "Qwen2VLImageProcessor").
    try:
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
            Qwen2VLImageProcessorPil as Processor,
        )
    except ImportError:  # transformers releases without the split backends
        from transformers import Qwen2VLImageProcessor as Processor
    return Processor(
        min_pixels=MIN_PIXELS,
        max_pixels=MAX_PIXELS,
        patch_size=14,
        merge_size=2,
        temporal_patch_size=2,
    )


def build_tiny_vlm(
    out_dir: str | Path,
    *,
    arch: str = "qwen2-vl",
    size: str = "small",
    corpus: Iterable[str] = (),
    seed: int = 0,
    vocab_size: int = 400,
) -> Path:
    """Build and save a tiny seeded VLM (model, tokenizer, image processor) to ``out_dir``.

    ``corpus`` trains the tokenizer (the task words, including "Yes" and "No", are added
    so they are single tokens whatever the corpus). The same arguments give
    bit-identical files. Returns ``out_dir`` as a Path.
    """
    if arch not in ARCHS:
        raise ValueError(f"unknown arch {arch!r}; choose one of {list(ARCHS)}")
    if size not in TINY_VLM_SIZES:
        raise ValueError(f"unknown tiny VLM size {size!r}; choose one of {sorted(TINY_VLM_SIZES)}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    # The task words alone too: an answer starts a turn, with no space before it.
    texts = [*corpus, *([_TASK_WORDS] * 64), *(_TASK_WORDS.split() * 64)]
    tokenizer = train_bpe_tokenizer(texts, out, vocab_size=vocab_size, seed=seed)
    tokenizer.add_special_tokens(
        {"additional_special_tokens": [*_special_list(tokenizer), *VISION_TOKENS]}
    )
    # Chat models end a turn with <|im_end|>: it is the EOS the policy stops on and the
    # token SFT appends (as in Qwen2-VL-Instruct); <|endoftext|> also stops generation.
    tokenizer.eos_token = IM_END
    tokenizer.chat_template = CHAT_TEMPLATE
    for word in ANSWER_WORDS:
        got = tokenizer(word, add_special_tokens=False)["input_ids"]
        if len(got) != 1:
            raise RuntimeError(f"tokenizer splits {word!r} into {got}; raise vocab_size")
    tokenizer.save_pretrained(str(out))

    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in VISION_TOKENS}
    ids.update(
        eos=tokenizer.convert_tokens_to_ids(IM_END),
        endoftext=tokenizer.convert_tokens_to_ids("<|endoftext|>"),
        pad=tokenizer.pad_token_id,
    )
    config = _config(arch, size, tokenizer, ids)
    with torch.random.fork_rng(devices=[]):  # never move the caller's global RNG
        torch.manual_seed(seed)
        model = _model_class(arch)(config)
    model.generation_config = GenerationConfig(
        eos_token_id=[ids["eos"], ids["endoftext"]],
        bos_token_id=ids["endoftext"],
        pad_token_id=ids["pad"],
        do_sample=True,
    )
    model.save_pretrained(str(out), safe_serialization=True)
    _image_processor().save_pretrained(str(out))
    return out


def _special_list(tokenizer) -> list[str]:
    """The tokenizer's current additional special tokens (kept when adding more)."""
    current = getattr(tokenizer, "additional_special_tokens", None) or []
    return [str(t) for t in current if str(t) not in VISION_TOKENS]
