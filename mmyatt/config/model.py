"""The policy's model: which one, how it is loaded, what of it trains."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from mmyatt.config.section import Bool, Float, Int, Section, Str, Strings


class LoraConfig(Section):
    rank: Int = Field(0, ge=0)
    """0: full-weight training"""
    alpha: Float = Field(16.0, gt=0)
    target_modules: Strings = ()
    """empty: the adapter's default attention projections"""


class ModelConfig(Section):
    kind: Literal["text", "vlm", "flow"] = "text"
    """the policy: a text LLM, a vision-language model, or a flow-matching image/video
    generator; a model.path folder must hold that kind"""
    path: Str | None = None
    """local HF / diffusers directory, or builtin:<name>; None builds the tiny built-in"""
    tiny_size: Str = "qwen2-1m"
    """built-in size when path is None (text; vlm: small/...)"""
    vlm_arch: Literal["qwen2-vl", "qwen2.5-vl"] = "qwen2-vl"
    """built-in VLM architecture"""
    video_fps: Float = Field(2.0, gt=0)
    """VLM: uniform frame sampling rate for videos"""
    video_max_frames: Int = Field(8, ge=1)
    lora: LoraConfig = Field(default_factory=LoraConfig)
    reference: Literal["lora_disabled", "frozen_copy"] = "lora_disabled"
    """flow KL reference"""
    ema_decay: Float | None = Field(None, ge=0, lt=1)
    """flow: EMA of trained weights, used for eval when set"""
    freeze: Strings = ()
    """parameter-name prefixes of policy.module() kept frozen (e.g. the flow transformer's
    output head [norm_out, proj_out], whose token-independent part tiles every patch)"""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    max_prompt_tokens: Int = Field(64, ge=1)
    prompt_overflow: Literal["reject", "truncate"] = "reject"
    use_chat_template: Bool = False
