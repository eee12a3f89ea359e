"""models/cpu_kernels.py: grouped-query attention against Hugging Face's eager attention
and by hand, the switch restoring what it changed, and the text adapter with it on against
off (same tokens, log-probs and gradients up to rounding)."""

from __future__ import annotations

import pytest
import torch
from test_text_policy import CORPUS, PROMPTS
from transformers.models.qwen2.modeling_qwen2 import eager_attention_forward

from mmyatt.models import cpu_kernels
from mmyatt.models.builtin.tiny import build_tiny_text_model
from mmyatt.models.text import TextPolicy
from mmyatt.protocols import Sampling

torch.set_num_threads(1)


class _Heads(torch.nn.Module):
    def __init__(self, groups: int):
        super().__init__()
        self.num_key_value_groups = groups


def test_grouped_attention_equals_eager_attention():
    g = torch.Generator().manual_seed(0)
    n, h, hkv, lq, lk, d = 3, 6, 2, 4, 7, 8
    q = torch.randn(n, h, lq, d, generator=g)
    k = torch.randn(n, hkv, lk, d, generator=g)
    v = torch.randn(n, hkv, lk, d, generator=g)
    mask = torch.zeros(n, 1, lq, lk)
    mask[0, :, :, :2] = torch.finfo(torch.float32).min  # row 0: two padded keys
    mask[:, :, 0, -1] = torch.finfo(torch.float32).min  # query 0 never sees the last key
    ref, _ = eager_attention_forward(_Heads(h // hkv), q, k, v, mask, scaling=0.3)
    out, weights = cpu_kernels.grouped_attention(None, q, k, v, mask, 0.3)
    assert weights is None and out.shape == (n, lq, h, d)
    assert torch.allclose(out, ref, atol=1e-6)
    # query head 5 uses key/value head 5 // 3 = 1: by hand for row 1, query 2
    s = (q[1, 5, 2] @ k[1, 1].T) * 0.3 + mask[1, 0, 2]
    assert torch.allclose(out[1, 2, 5], s.softmax(-1) @ v[1, 1], atol=1e-6)


def test_fast_forward_switches_and_restores(tiny):
    model = tiny.model
    before = model.config._attn_implementation
    assert before != cpu_kernels.GROUPED
    with cpu_kernels.fast_forward(model):
        assert model.config._attn_implementation == cpu_kernels.GROUPED
        with cpu_kernels.fast_forward(model):  # nested: restores its own
            pass
        assert model.config._attn_implementation == cpu_kernels.GROUPED
    assert model.config._attn_implementation == before
    with pytest.raises(RuntimeError), cpu_kernels.fast_forward(model):
        raise RuntimeError("restored on errors too")
    assert model.config._attn_implementation == before


def test_applies_only_to_short_llama_family_rows_on_cpu(tiny):
    assert cpu_kernels.applies(tiny.model, 64)
    assert not cpu_kernels.applies(tiny.model, cpu_kernels.MAX_GROUPED_LENGTH + 1)
    assert not cpu_kernels.applies(torch.nn.Linear(2, 2), 8)  # no config: not a causal LM


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = build_tiny_text_model(tmp_path_factory.mktemp("tiny"), size="qwen2-0.1m", corpus=CORPUS)
    return TextPolicy.load(d, max_prompt_tokens=32)


def test_text_adapter_with_kernels_equals_without(tiny, monkeypatch):
    calls = {"attention": 0}
    attention = cpu_kernels.grouped_attention

    def counted_attention(*a, **k):
        calls["attention"] += 1
        return attention(*a, **k)

    from transformers import AttentionInterface

    monkeypatch.setitem(AttentionInterface._global_mapping, cpu_kernels.GROUPED, counted_attention)
    s = Sampling(temperature=0.9, max_new_tokens=8)
    runs = []
    for on in (False, True):
        tiny.cpu_kernels = on
        cpu_kernels._register()
        with torch.no_grad():
            r = tiny.generate([dict(p) for p in PROMPTS], 3, s, [5, 6, 7, 8])
        tiny.model.zero_grad()
        lp, ent = tiny.logprobs(r, with_entropy=True)
        (lp * torch.linspace(-1, 1, len(r))[:, None]).sum().backward()
        grads = [p.grad.clone() for p in tiny.model.parameters()]
        runs.append((r, lp.detach(), ent.detach(), grads))
    tiny.cpu_kernels = True
    # it ran, only in the second run, in the 3 Hugging Face forwards (the prefill, the
    # prompt and the completions of scoring), 2 attention layers each
    assert calls["attention"] == 2 * 3
    (r0, lp0, ent0, g0), (r1, lp1, ent1, g1) = runs
    assert torch.equal(r0.actions, r1.actions) and torch.equal(r0.mask, r1.mask)
    assert torch.allclose(r0.logprobs, r1.logprobs, atol=1e-5)
    assert torch.allclose(lp0, lp1, atol=1e-5) and torch.allclose(ent0, ent1, atol=1e-5)
    assert torch.allclose(lp1, r1.logprobs, atol=1e-5)  # first ratio 1 with the kernels on
    for a, b in zip(g0, g1):
        assert torch.allclose(a, b, atol=1e-5, rtol=1e-4)
