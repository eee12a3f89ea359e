"""The engines on a CUDA device (``pytest -m gpu``; skipped without one).

MMYATT_TEST_DEVICE=cpu runs the same checks on the CPU (a dry run: the CUDA-only
figures, MFU and device memory, are then absent and not asserted). bench/gpu_engines.sh
runs this file and `mmyatt bench engines` on a GPU machine.
"""

from __future__ import annotations

import os

import pytest
import torch
from test_engines_vllm import real_engine
from test_text_policy import CORPUS

from mmyatt.config.schema import load_config
from mmyatt.distributed import Dist
from mmyatt.engines import available, build_engines
from mmyatt.models.builtin.tiny import build_tiny_text_model
from mmyatt.models.text import TextPolicy
from mmyatt.protocols import Sampling

DEV = os.environ.get("MMYATT_TEST_DEVICE", "cuda")
assert DEV in ("cuda", "cpu"), f"MMYATT_TEST_DEVICE={DEV!r}: cuda or cpu"
DEVICE = "cuda:0" if DEV == "cuda" else "cpu"
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        DEV == "cuda" and not torch.cuda.is_available(), reason="needs a CUDA device"
    ),
]
PROMPTS = [{"prompt": f"What is {a} + 3?", "_index": a} for a in range(4)]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_text_model(tmp_path_factory.mktemp("m"), size="qwen2-1m", corpus=CORPUS)


def _destroy():
    import torch.distributed as tdist

    if tdist.is_initialized():
        tdist.destroy_process_group()


def test_fsdp2_step_on_device_matches_replica(model_dir):
    """One sharded (group of one) update on the device equals the replica update."""
    out = {}
    for backend in ("replica", "fsdp2"):
        torch.manual_seed(0)
        policy = TextPolicy.load(model_dir, max_prompt_tokens=16, device=DEVICE)
        cfg = load_config(None, [f"train.backend={backend}"])
        engine, p = build_engines(cfg, Dist(0, 1, DEVICE), policy)
        params = [x for x in p.module().parameters() if x.requires_grad]
        opt = torch.optim.AdamW(params, lr=1e-3)
        r = p.generate(PROMPTS, 4, Sampling(max_new_tokens=8), [1, 2, 3, 4])
        loss = -(p.logprobs(r) * r.mask.to(DEVICE)).sum() / r.mask.sum()
        loss.backward()
        engine.reduce_and_clip(params, 1.0)
        opt.step()
        state = engine.model_state(p)
        out[backend] = {k: v.detach().float().cpu() for k, v in state.items()}
        _destroy()
    for k, v in out["replica"].items():
        torch.testing.assert_close(out["fsdp2"][k], v, atol=1e-5, rtol=1e-4, msg=k)


@pytest.mark.skipif(not available("megatron"), reason="megatron-core not installed")
def test_megatron_logits_on_device(model_dir):
    from mmyatt.engines import megatron_model as M

    hf = TextPolicy.load(model_dir, max_prompt_tokens=16, device=DEVICE).module()
    M.init_parallel(1)
    model = M.build_gpt(hf.config, 1).to(DEVICE)
    M.load_hf_weights(model, hf.state_dict(), hf.config)
    ids = torch.randint(0, 300, (2, 12), device=DEVICE)
    attn = torch.ones_like(ids)
    with torch.no_grad():
        ref = hf(input_ids=ids, attention_mask=attn).logits
        got = M.forward_logits(model, ids, attn)
    torch.testing.assert_close(got, ref, atol=2e-3, rtol=1e-3)
    _destroy()


@pytest.mark.skipif(not available("vllm"), reason="vllm not installed")
def test_vllm_rollout_greedy_equals_hf_and_syncs_weights(model_dir):
    """vLLM on the device: greedy samples equal the adapter's, log-probs within
    tolerance, and after an update the in-place sync gives the new model's samples."""
    policy = TextPolicy.load(model_dir, max_prompt_tokens=16, device=DEVICE)
    hf = TextPolicy.load(model_dir, max_prompt_tokens=16, device=DEVICE)
    v = real_engine(policy, model_dir, gpu_memory_utilization=0.2, sleep_level=1)
    s = Sampling(max_new_tokens=8, greedy=True)
    got, want = v.generate(PROMPTS, 1, s, [1, 2, 3, 4]), hf.generate(PROMPTS, 1, s, [1, 2, 3, 4])
    assert torch.equal(got.actions.cpu(), want.actions.cpu())
    eng = got.context["engine_logprobs"].cpu()
    torch.testing.assert_close(eng, want.logprobs.cpu(), atol=1e-2, rtol=0)
    with torch.no_grad():
        for p in policy.module().parameters():
            p.add_(torch.randn_like(p) * 0.05)
    hf.module().load_state_dict(policy.module().state_dict())
    got, want = v.generate(PROMPTS, 1, s, [1, 2, 3, 4]), hf.generate(PROMPTS, 1, s, [1, 2, 3, 4])
    assert torch.equal(got.actions.cpu(), want.actions.cpu())
    m = v.rollout_stats(got)
    assert m["rollout/weight_sync_s"] > 0
    if DEV == "cuda":
        assert m["rollout/sleep_s"] > 0 and m["rollout/wake_s"] > 0


def test_bench_engines_reports_every_figure():
    """`mmyatt bench engines --quick` on the device: every arm that can run here runs,
    with rollout tokens/s, update seconds, peak memory (and MFU on CUDA)."""
    from mmyatt.bench.engines import bench_engines

    r = bench_engines(quick=True)
    assert {"hf_replica", "hf_fsdp2"} <= set(r["arms"]), r["skipped"]
    assert "vlm_fsdp2" in r, r["skipped"]
    for arm in [*r["arms"].values(), r["vlm_fsdp2"]]:
        assert arm["rollout_tokens_per_s"] > 0 and arm["update_s"] > 0
        assert arm["peak_memory_mb"] > 0
        if DEV == "cuda":
            assert 0 < arm["update_mfu"] < 1
    if available("vllm"):
        assert "vllm_fsdp2" in r["arms"], r["skipped"]
        assert r["arms"]["vllm_fsdp2"]["weight_sync_s"] > 0
