"""What a sample earns: weighted reward functions and the GenRM judges behind ``genrm``."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from mmyatt.config.section import Bool, Float, Int, Section, Str, Strings


class RewardSpec(Section):
    name: Str = Field(min_length=1)
    """a rule (rewards/rules.py, rewards/image.py), "module:function", or "genrm\""""
    weight: Float = 1.0
    kwargs: dict[Str, Any] = Field(default_factory=dict)
    zscore: Bool = False
    """standardise this reward over the batch before weighting"""


class JudgeConfig(Section):
    """GenRM judges: started with the run (``model``) or already running (``urls``)."""

    model: Str | None = None
    """local judge directory, or builtin:<name>"""
    num_servers: Int = Field(1, ge=1)
    urls: Strings = ()
    """existing OpenAI-compatible servers (e.g. `vllm serve`)"""
    api_key_env: Str | None = None
    """name of the env var holding the key; keys never enter configs"""
    max_batch: Int = Field(32, ge=1)
    threads: Int = Field(1, ge=1)
    """torch threads per judge server (CPU)"""
    devices: Strings = ()
    """a GPU id per server, round robin ('0,1': 2 GPUs, one server)"""
    max_retries: Int = Field(8, ge=0)
    """per judge request; with the backoff (0.2 s doubling, at most 5 s between tries) the
    run waits ~10-20 s for a lost judge before it saves and stops"""
    timeout_s: Float = Field(30.0, gt=0)
    """per attempt"""
    max_restarts: Int = Field(3, ge=0)
    """a judge server started with the run that dies is restarted"""
    startup_timeout_s: Float = Field(120.0, gt=0)
    """how long a judge server started with the run may take to answer `/health` (a
    `vllm serve` child, or cores under other load, can need several minutes)"""
    backend: Literal["mmyatt", "vllm"] = "mmyatt"
    """who serves `model`: our GenRM server, or `vllm serve` children (same pool, health
    checks and restarts; pip install 'mmyatt[vllm]')"""
    vllm_args: Strings = ()
    """extra `vllm serve` arguments (backend vllm)"""


class RewardConfig(Section):
    functions: tuple[RewardSpec, ...] = Field((RewardSpec(name="numeric_match"),), min_length=1)
    nonfinite: Literal["skip_step", "fail"] = "skip_step"
    judge: JudgeConfig = Field(default_factory=JudgeConfig)
