"""The shared decode loop (models/decode.py) and the text adapter's prompt-once scoring:
hand-worked values, equality with the per-prompt ``torch.multinomial`` sampler and the
single-forward scorer they replace, and values recorded from the previous implementation."""

from __future__ import annotations

import math

import pytest
import torch
from test_text_policy import CORPUS, PROMPTS, _eos_bonus

from mmyatt.models import decode
from mmyatt.models.builtin.tiny import build_tiny_text_model
from mmyatt.models.text import TextPolicy
from mmyatt.protocols import Sampling

torch.set_num_threads(1)


# --- the logits math, by hand -----------------------------------------------------------
def test_chosen_logprob_by_hand():
    # p = (1/4, 3/4): log p of token 1 is log 0.75, of token 0 log 0.25
    logits = torch.tensor([[0.0, math.log(3.0)], [math.log(3.0), 0.0]])
    lp = decode.chosen_logprob(logits, torch.tensor([1, 1]))
    assert torch.allclose(lp, torch.tensor([math.log(0.75), math.log(0.25)]), atol=1e-7)


def test_chosen_logprob_matches_log_softmax():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 7, 50, generator=g) * 4
    tokens = torch.randint(0, 50, (5, 7), generator=g)
    ref = logits.log_softmax(-1).gather(-1, tokens[..., None]).squeeze(-1)
    assert torch.allclose(decode.chosen_logprob(logits, tokens), ref, atol=2e-6)


def test_temper_divides_and_bans_in_place_or_not():
    x = torch.tensor([[2.0, 4.0, 6.0]])
    out = decode.temper(x, 2.0, torch.tensor([1]))
    assert out.tolist()[0][0] == 1.0 and out.tolist()[0][2] == 3.0
    assert out[0, 1] == torch.finfo(torch.float32).min
    assert x.tolist() == [[2.0, 4.0, 6.0]]  # not in place by default
    same = decode.temper(x, 2.0, torch.tensor([], dtype=torch.long), inplace=True)
    assert same.data_ptr() == x.data_ptr() and x.tolist() == [[1.0, 2.0, 3.0]]
    # a banned id's entropy term is exactly 0 and its probability exactly 0
    ent = decode.entropy(decode.temper(torch.zeros(1, 4), 1.0, torch.tensor([3])))
    assert torch.allclose(ent, torch.tensor([math.log(3.0)]))


def test_share_prefix_rows_by_hand():
    ids = torch.tensor([[0, 5, 6], [0, 5, 6], [7, 5, 6], [7, 5, 6], [0, 5, 6]])
    attn = torch.tensor([[0, 1, 1], [0, 1, 1], [1, 1, 1], [1, 1, 1], [0, 1, 1]])
    first, owner = decode.share_prefix_rows(ids, attn)
    assert first.tolist() == [0, 2, 4]  # only consecutive equal rows share
    assert owner.tolist() == [0, 0, 1, 1, 2]
    attn2 = attn.clone()
    attn2[1, 0] = 1  # same ids, another mask: not the same prompt
    assert decode.share_prefix_rows(ids, attn2)[0].tolist() == [0, 1, 2, 4]


# --- the draw is torch.multinomial's, token for token ----------------------------------
def _multinomial_reference(probs, top_p, generators, group):
    """The sampler decode replaced: one multinomial per prompt and step."""
    if top_p < 1.0:
        sorted_probs, order = torch.sort(probs, dim=-1, descending=True, stable=True)
        drop_sorted = (sorted_probs.cumsum(-1) - sorted_probs) >= top_p
        probs = probs.masked_fill(torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted), 0)
    out = torch.empty(probs.shape[0], dtype=torch.long)
    for i, g in enumerate(generators):
        rows = slice(i * group, (i + 1) * group)
        out[rows] = torch.multinomial(probs[rows], 1, generator=g).squeeze(-1)
    return out


@pytest.mark.parametrize("top_p", [1.0, 0.8])
def test_draw_equals_multinomial_per_prompt_over_steps(top_p, monkeypatch):
    monkeypatch.setattr(decode, "_NOISE_CHUNK_ELEMS", 3 * 4 * 40 * 2)  # chunks of 2 steps
    B, G, V, steps = 3, 4, 40, 5
    gens_ref = [torch.Generator().manual_seed(s) for s in (1, 2, 3)]
    gens_new = [torch.Generator().manual_seed(s) for s in (1, 2, 3)]
    noise = decode.NoiseSource(gens_new, G, V, steps, "cpu")
    assert noise.chunk == 2
    g = torch.Generator().manual_seed(9)
    for t in range(steps):
        probs = (torch.randn(B * G, V, generator=g) * 3).softmax(-1)
        ref = _multinomial_reference(probs.clone(), top_p, gens_ref, G)
        assert torch.equal(decode.draw(probs.clone(), top_p, noise.at(t)), ref)


# --- the text adapter: prompt-once scoring and values of the previous implementation ----
@pytest.fixture(scope="module")
def policy(tmp_path_factory):
    d = build_tiny_text_model(tmp_path_factory.mktemp("tiny"), size="qwen2-0.1m", corpus=CORPUS)
    return TextPolicy.load(d, max_prompt_tokens=32)


def _single_forward_logprobs(policy, r):
    """The scorer before prompt sharing: one forward over every row."""
    ids, attn = r.context["input_ids"], r.context["attention_mask"]
    A = r.actions.shape[1]
    positions = (attn.cumsum(-1) - 1).clamp(min=0)
    logits = policy._forward(ids[:, :-1], attn[:, :-1], positions[:, :-1], keep=A).logits
    logits = policy.tempered(logits[:, -A:], r.context["temperature"])
    lp = logits.log_softmax(-1).gather(-1, r.actions[..., None]).squeeze(-1)
    return torch.where(r.mask.bool(), lp, 0.0)


def test_shared_prompt_scoring_equals_one_forward_values_and_gradients(policy):
    s = Sampling(temperature=0.8, max_new_tokens=6)
    with torch.no_grad():
        r = policy.generate([dict(p) for p in PROMPTS], 3, s, [1, 2, 3, 4])
    weights = torch.linspace(-1.0, 1.0, len(r))[:, None]
    values, grads = [], []
    for fn in (policy.logprobs, lambda x: _single_forward_logprobs(policy, x)):
        policy.model.zero_grad()
        lp = fn(r)
        (lp * weights).sum().backward()
        values.append(lp.detach())
        grads.append([p.grad.clone() for p in policy.model.parameters()])
    shared, single = values
    assert torch.allclose(shared, single, atol=1e-5)
    for a, b in zip(*grads):
        assert torch.allclose(a, b, atol=1e-4, rtol=1e-4)
    # and the rows of a group really did share one prompt pass
    first, _ = decode.share_prefix_rows(
        r.context["input_ids"][:, :32], r.context["attention_mask"][:, :32]
    )
    assert len(first) == len(PROMPTS)


# Recorded from the implementation before models/decode.py (per-prompt multinomial,
# full log-softmax, one forward per row in scoring), same model, seeds and prompts.
RECORDED = {
    "t1": (
        Sampling(temperature=1.0, max_new_tokens=8),
        0.0,
        [[98, 78, 257, 234, 39, 126, 264, 175], [216, 73, 85, 96, 275, 277, 295, 93],
         [155, 47, 166, 102, 33, 195, 169, 127], [153, 145, 104, 32, 185, 222, 233, 208],
         [226, 120, 272, 23, 229, 9, 292, 154], [130, 97, 44, 157, 210, 228, 223, 247],
         [237, 47, 109, 245, 145, 181, 288, 224], [47, 276, 165, 259, 63, 207, 16, 169],
         [137, 285, 85, 61, 107, 45, 245, 277], [44, 195, 228, 298, 55, 128, 211, 175],
         [81, 241, 238, 54, 157, 216, 140, 170], [263, 254, 81, 284, 282, 8, 66, 170]],
        -548.1709,
        54.6847,
    ),
    "t07_p09_eos": (
        Sampling(temperature=0.7, top_p=0.9, max_new_tokens=8),
        4.0,
        [[0, 1, 1, 1, 1, 1, 1, 1], [216, 0, 1, 1, 1, 1, 1, 1], [0, 1, 1, 1, 1, 1, 1, 1],
         [153, 145, 0, 1, 1, 1, 1, 1], [226, 120, 0, 1, 1, 1, 1, 1], [130, 0, 1, 1, 1, 1, 1, 1],
         [237, 0, 1, 1, 1, 1, 1, 1], [103, 276, 0, 1, 1, 1, 1, 1], [0, 1, 1, 1, 1, 1, 1, 1],
         [0, 1, 1, 1, 1, 1, 1, 1], [0, 1, 1, 1, 1, 1, 1, 1], [0, 1, 1, 1, 1, 1, 1, 1]],
        -65.9729,
        19.4543,
    ),
}  # fmt: skip


@pytest.mark.parametrize("case", sorted(RECORDED))
def test_same_tokens_logprobs_and_loss_as_before(policy, case):
    sampling, bonus, actions, lp_sum, loss = RECORDED[case]
    hook = _eos_bonus(policy, bonus) if bonus else None
    try:
        r = policy.generate([dict(p) for p in PROMPTS], 3, sampling, [11, 12, 13, 14])
        lp, ent = policy.logprobs(r, with_entropy=True)
    finally:
        if hook is not None:
            hook.remove()
    assert r.actions.tolist() == actions
    assert float(r.logprobs.sum()) == pytest.approx(lp_sum, abs=2e-3)
    assert float(lp.detach().sum()) == pytest.approx(lp_sum, abs=2e-3)
    weights = torch.linspace(-1, 1, lp.shape[0])[:, None]
    total = (lp * weights).sum() + 0.1 * ent.sum()
    assert float(total.detach()) == pytest.approx(loss, abs=2e-3)


def test_static_kv_decode_equals_model_forward_decode(policy, monkeypatch):
    """The pre-allocated-cache decode step against the model's own forward with a
    Hugging Face cache: same tokens, log-probs equal to rounding; left-padded prompts."""
    assert decode.StaticKVDecoder.supports(policy.model)
    calls = []
    step = decode.StaticKVDecoder.step
    monkeypatch.setattr(
        decode.StaticKVDecoder, "step", lambda self, *a: calls.append(1) or step(self, *a)
    )
    s = Sampling(temperature=0.9, max_new_tokens=7)
    fast = policy.generate([dict(p) for p in PROMPTS], 2, s, [5, 6, 7, 8])
    assert len(calls) == 6  # every step after the first came from the static decoder
    policy.static_decode = False
    try:
        slow = policy.generate([dict(p) for p in PROMPTS], 2, s, [5, 6, 7, 8])
    finally:
        policy.static_decode = True
    assert len(calls) == 6
    assert torch.equal(fast.actions, slow.actions)
    assert torch.allclose(fast.logprobs, slow.logprobs, atol=1e-5)


def _reported(policy, unit):
    """(plain rollout, streamed rollout, [(rows, texts, decode step)]) with an EOS bonus
    that lets rows finish apart."""
    A, G = 12, 2
    steps = []  # the decode step of every model call, to place each report in time
    calls = []
    handle = _eos_bonus(policy, 6.0)
    counter = policy.model.get_output_embeddings().register_forward_hook(
        lambda *a: steps.append(len(steps))
    )
    try:
        plain = policy.generate(
            [dict(p) for p in PROMPTS], G, Sampling(max_new_tokens=A), [1, 2, 3, 4]
        )
        steps.clear()

        def done(rows, texts):
            calls.append((list(rows), list(texts), len(steps)))

        s = Sampling(max_new_tokens=A, on_finished=done, finished_unit=unit)
        r = policy.generate([dict(p) for p in PROMPTS], G, s, [1, 2, 3, 4])
    finally:
        handle.remove()
        counter.remove()
    assert torch.equal(r.actions, plain.actions) and r.outputs == plain.outputs
    for rows, texts, at in calls:
        assert texts == [r.outputs[i] for i in rows]
        # reported at the step its last row stopped: the prefill plus one model call per
        # action before it
        last = max(int(r.mask[i].sum()) for i in rows)
        assert at == last, (rows, at, last)
    return r, calls


def test_finished_groups_are_reported_once_as_they_finish_with_their_final_text(policy):
    """``Sampling.on_finished`` by group (placement partial streams groups to a judge
    that compares a group's samples): every group whose samples all stop is reported
    once, at the step where its last sample stops, with the text ``generate`` returns for
    it; a group the budget cuts is never reported; the samples are those of a run without
    the callback."""
    G = 2
    r, calls = _reported(policy, "group")
    stopped = ~r.truncated
    finished = [g for g in range(len(PROMPTS)) if bool(stopped[g * G : (g + 1) * G].all())]
    for rows, _, _ in calls:  # whole groups, in order
        assert len(rows) % G == 0 and all(
            rows[k] == rows[k - k % G] + k % G for k in range(len(rows))
        )
    reported = [rows[k] // G for rows, _, _ in calls for k in range(0, len(rows), G)]
    assert sorted(reported) == finished and len(set(reported)) == len(reported)
    assert len(finished) >= 2, "the EOS bonus should let several groups finish"
    assert len({at for *_, at in calls}) >= 2, "groups that finish apart are reported apart"


def test_finished_samples_are_reported_once_each_at_the_step_it_stops(policy):
    """``Sampling.on_finished`` by sample (a pointwise judge): every row that stops is
    reported once, at its own step, whatever its group's other rows do; rows the budget
    cuts are never reported."""
    G = 2
    r, calls = _reported(policy, "sample")
    reported = [i for rows, _, _ in calls for i in rows]
    stopped = (~r.truncated).nonzero().flatten().tolist()
    assert sorted(reported) == stopped and len(set(reported)) == len(reported)
    for rows, _, at in calls:  # a row's own stop step, not its group's last
        assert all(int(r.mask[i].sum()) == at for i in rows), (rows, at)
    # some row went before its group's last row: per sample is not per group
    assert any(
        at < max(int(r.mask[j].sum()) for j in range(i - i % G, i - i % G + G))
        for rows, _, at in calls
        for i in rows
    )
