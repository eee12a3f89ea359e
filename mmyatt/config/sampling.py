"""How rollouts are sampled: G samples per prompt, decoding, and the flow SDE."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from mmyatt.config.section import Float, Int, Section, Strings


class SamplingConfig(Section):
    group_size: Int = Field(8, ge=1)
    """G, samples per prompt (>= 2 for an advantage with a group baseline)"""
    temperature: Float = Field(1.0, gt=0)
    top_p: Float = Field(1.0, gt=0, le=1)
    max_new_tokens: Int = Field(8, ge=1)
    stop: Strings = ()
    denoise_steps: Int = Field(10, ge=1)
    """flow models (Flow-GRPO, models/flow_sde.py): steps of training rollouts"""
    eval_denoise_steps: Int = Field(20, ge=1)
    """eval (ODE); more steps than training = denoising reduction"""
    noise_level: Float = Field(0.7, ge=0)
    sde_type: Literal["sde", "cps"] = "sde"
    guidance_scale: Float = Field(1.0, ge=0)
    """1.0 = no CFG"""
    train_steps: Literal["all", "fraction", "window", "sliding"] = "all"
    train_fraction: Float = Field(1.0, gt=0, le=1)
    window: Int = Field(2, ge=1)
    window_start: Int = Field(0, ge=0)
    slide_every: Int = Field(1, ge=1)
