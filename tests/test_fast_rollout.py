"""models/fast_decode.py: fixed-shape decode steps over a kept cache, compiled or not,
draw the same samples as the default decode (text: the growing static-cache step; VLM: the
model's own forward) for a fixed seed, greedy and sampled, with left-padded prompts."""

from __future__ import annotations

import pytest
import torch
from test_text_policy import CORPUS, PROMPTS
from test_vlm_policy import CORPUS as VLM_CORPUS
from test_vlm_policy import square

from mmyatt.config.schema import load_config
from mmyatt.distributed import Dist
from mmyatt.engines import build_engines
from mmyatt.models.builtin.tiny import build_tiny_text_model
from mmyatt.models.builtin.tiny_vlm import build_tiny_vlm
from mmyatt.models.fast_decode import FastDecode, FixedShapeStep
from mmyatt.models.text import TextPolicy
from mmyatt.models.vlm import VLMPolicy
from mmyatt.protocols import Sampling

torch.set_num_threads(1)

SAMPLINGS = {
    "sampled": Sampling(temperature=0.9, max_new_tokens=9),
    "greedy": Sampling(greedy=True, max_new_tokens=9),
    "top_p": Sampling(temperature=1.2, top_p=0.8, max_new_tokens=9),
}


@pytest.fixture(scope="module")
def text_policy(tmp_path_factory):
    path = build_tiny_text_model(tmp_path_factory.mktemp("tiny"), corpus=CORPUS)
    return TextPolicy.load(path, max_prompt_tokens=24)


@pytest.fixture(scope="module")
def vlm_policy(tmp_path_factory):
    path = build_tiny_vlm(tmp_path_factory.mktemp("vlm"), arch="qwen2-vl", corpus=VLM_CORPUS)
    return VLMPolicy.load(path, max_prompt_tokens=48)


def _vlm_prompts():
    return [
        {"prompt": "What colour is the shape?", "image": square("red"), "_index": 0},
        {"prompt": "Is it a circle?", "image": square("blue", x=20), "_index": 1},
        {"prompt": "Which way?", "_index": 2},  # no image: a shorter, more padded prompt
    ]


def _both(policy, prompts, sampling, static_cache=True, compile_step=False, backend=None):
    """(the default rollout, the fixed-shape one), same prompts and seeds."""
    seeds = list(range(3, 3 + len(prompts)))
    policy.set_decode(False)
    base = policy.generate([dict(p) for p in prompts], 2, sampling, seeds)
    policy.set_decode(static_cache, compile_step)
    if backend is not None:
        policy.fast_decode.backend = backend
    try:
        fast = policy.generate([dict(p) for p in prompts], 2, sampling, seeds)
    finally:
        policy.set_decode(False)
    return base, fast


def _same(base, fast):
    assert torch.equal(fast.actions, base.actions)
    assert torch.equal(fast.mask, base.mask)
    torch.testing.assert_close(fast.logprobs, base.logprobs, atol=1e-5, rtol=1e-5)
    assert fast.outputs == base.outputs


@pytest.mark.parametrize("case", sorted(SAMPLINGS))
def test_text_fixed_shape_draws_the_same_samples(text_policy, case, monkeypatch):
    calls = []
    step = FixedShapeStep.step
    monkeypatch.setattr(FixedShapeStep, "step", lambda self, *a: calls.append(1) or step(self, *a))
    base, fast = _both(text_policy, PROMPTS, SAMPLINGS[case])
    _same(base, fast)
    assert len(calls) == int(fast.mask.sum(1).max()) - 1  # every step after the first


@pytest.mark.parametrize("case", ["sampled", "greedy"])
def test_vlm_fixed_shape_draws_the_same_samples_as_the_model_forward(vlm_policy, case):
    base, fast = _both(vlm_policy, _vlm_prompts(), SAMPLINGS[case])
    _same(base, fast)


def test_cache_buffers_are_kept_between_rollouts_of_one_shape(text_policy):
    s = SAMPLINGS["sampled"]
    text_policy.set_decode(True)
    try:
        a = text_policy.generate([dict(p) for p in PROMPTS], 2, s, [1, 2, 3, 4])
        first = text_policy.fast_decode.current
        b = text_policy.generate([dict(p) for p in PROMPTS], 2, s, [1, 2, 3, 4])
        assert text_policy.fast_decode.current is first  # same buffers: no recompile
        c = text_policy.generate([dict(p) for p in PROMPTS[:2]], 2, s, [1, 2])
        assert text_policy.fast_decode.current is not first  # a new shape
    finally:
        text_policy.set_decode(False)
    assert torch.equal(a.actions, b.actions)  # the kept cache holds nothing over
    assert torch.equal(c.actions, a.actions[:4])


def test_compiled_step_captures_whole_and_draws_the_same(text_policy, vlm_policy):
    """torch.compile with fullgraph=True (any graph break fails); the "eager" backend
    checks the capture without the minutes a C++ compile takes on the CPU."""
    torch._dynamo.reset()
    _same(*_both(text_policy, PROMPTS, SAMPLINGS["sampled"], True, True, "eager"))
    _same(*_both(vlm_policy, _vlm_prompts(), SAMPLINGS["greedy"], True, True, "eager"))


def test_unsupported_settings_fail_with_what_to_do(text_policy):
    with pytest.raises(ValueError, match="needs hf_static_cache"):
        text_policy.set_decode(False, True)

    class Other(torch.nn.Module):
        config = None

    with pytest.raises(ValueError, match="Llama-family.*hf_static_cache=false"):
        FastDecode.check(Other())


def test_run_config_turns_it_on_through_the_engines(text_policy):
    cfg = load_config(None, ["rollout.hf_static_cache=true", "rollout.compile_decode=true"])
    try:
        build_engines(cfg, Dist(0, 1, "cpu"), text_policy)
        assert text_policy.fast_decode is not None and text_policy.fast_decode.compile_step
    finally:
        text_policy.set_decode(False)
    with pytest.raises(TypeError, match="FixedShapeDecode capability"):
        build_engines(cfg, Dist(0, 1, "cpu"), object())


def test_lora_layers_run_in_the_fixed_shape_step(tmp_path):
    """LoRA injected in place (models/lora.py): the step calls the wrapped projections,
    whose adapters (made non-zero here) change the samples as in the default path."""
    path = build_tiny_text_model(tmp_path / "tiny", corpus=CORPUS)
    policy = TextPolicy.load(path, max_prompt_tokens=24, lora={"r": 4})
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in policy.model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)
    base, fast = _both(policy, PROMPTS, SAMPLINGS["sampled"])
    _same(base, fast)
    plain = TextPolicy.load(path, max_prompt_tokens=24)
    other = plain.generate([dict(p) for p in PROMPTS], 2, SAMPLINGS["sampled"], [3, 4, 5, 6])
    assert not torch.equal(other.actions, fast.actions)  # the adapters did act
