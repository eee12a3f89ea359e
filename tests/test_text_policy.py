"""TextPolicy on a tiny locally built Qwen2: the adapter contract plus text specifics."""

from __future__ import annotations

import pytest
import torch
from adapter_contract import AdapterContract
from transformers import AutoModelForCausalLM

from mmyatt.models.builtin.tiny import TINY_TEXT_CONFIGS, build_tiny_text_model
from mmyatt.models.text import IGNORE_INDEX, PromptTooLongError, TextPolicy
from mmyatt.protocols import DecoderFlops, ReferenceKL, Sampling, SupervisedPolicy, TokenPolicy
from mmyatt.rollout import Rollout

torch.set_num_threads(1)

CORPUS = [f"What is {a} + {b}? The answer is {a + b}." for a in range(30) for b in range(10)] + [
    "The quick brown fox jumps over the lazy dog."
] * 10

PROMPTS = [
    {"prompt": "What is 3 + 4?", "id": "short"},
    {"prompt": "The quick brown fox jumps over the lazy dog. What is 12 + 7?", "id": "long"},
    {"prompt": "Hi", "_index": 5},
    {"prompt": "What is 20 + 9? The answer is", "_source": "demo:3"},
]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return build_tiny_text_model(tmp_path_factory.mktemp("tiny"), size="qwen2-0.1m", corpus=CORPUS)


@pytest.fixture
def policy(tiny_dir):
    return TextPolicy.load(tiny_dir, max_prompt_tokens=32)


class TestTextPolicyContract(AdapterContract):
    capabilities = (TokenPolicy, DecoderFlops, ReferenceKL, SupervisedPolicy)

    @pytest.fixture(autouse=True)
    def _model_dir(self, tiny_dir):
        self.model_dir = tiny_dir

    def make_policy(self):
        return TextPolicy.load(self.model_dir, max_prompt_tokens=32)

    def make_prompts(self):
        return [dict(p) for p in PROMPTS[:2]]

    def load_policy(self, path):
        return TextPolicy.load(path, max_prompt_tokens=32)


# --- the tiny model builder -------------------------------------------------------------
def test_tiny_model_loads_with_plain_transformers(tiny_dir):
    model = AutoModelForCausalLM.from_pretrained(str(tiny_dir))
    assert model.config.model_type == "qwen2" and model.config.tie_word_embeddings
    assert model.config.pad_token_id != model.config.eos_token_id
    assert model.generation_config.eos_token_id == model.config.eos_token_id
    assert (tiny_dir / "model.safetensors").is_file()


def test_unknown_tiny_size_lists_choices(tmp_path):
    with pytest.raises(ValueError, match="qwen2-1m"):
        build_tiny_text_model(tmp_path, size="qwen2-7b", corpus=CORPUS)
    assert {"qwen2-0.1m", "qwen2-1m", "qwen2-3m"} <= set(TINY_TEXT_CONFIGS)


# --- sampling and scoring ---------------------------------------------------------------
def _eos_bonus(policy: TextPolicy, bonus: float):
    """Raise the EOS logit so rows stop at varied steps (a random model rarely emits it)."""
    eos = policy.tokenizer.eos_token_id

    def hook(_module, _inputs, logits):
        return logits.index_add(-1, torch.tensor([eos]), torch.full_like(logits[..., :1], bonus))

    return policy.model.get_output_embeddings().register_forward_hook(hook)


@pytest.mark.parametrize(
    "temperature,top_p,stop",
    [(1.0, 1.0, ()), (0.7, 1.0, ()), (0.7, 0.9, ("e",)), (1.0, 0.5, ("e",))],
)
def test_first_ratio_is_one(policy, temperature, top_p, stop):
    _eos_bonus(policy, 3.0)
    sampling = Sampling(temperature=temperature, top_p=top_p, max_new_tokens=12, stop=stop)
    r = policy.generate(PROMPTS, 3, sampling, seeds=[1, 2, 3, 4])
    lengths = {len(ids) for ids in policy.tokenizer([p["prompt"] for p in PROMPTS])["input_ids"]}
    assert len(lengths) == len(PROMPTS)  # every prompt has its own amount of left padding
    m = r.mask.bool()
    assert 0 < m.sum() < m.numel()  # some rows stopped early: masked columns are exercised
    lp, ent = policy.logprobs(r, with_entropy=True)
    ratio = torch.exp(lp[m] - r.logprobs[m])
    assert torch.allclose(ratio, torch.ones_like(ratio), atol=1e-5), (ratio - 1).abs().max()
    assert torch.isfinite(lp).all() and torch.isfinite(ent).all()
    assert (lp[~m] == 0).all() and (r.logprobs[~m] == 0).all() and (ent[~m] == 0).all()
    assert (ent[m] > 0).all()


def test_rollout_fields_and_eos_masking(policy):
    _eos_bonus(policy, 3.0)
    eos, pad = policy.tokenizer.eos_token_id, policy.pad_id
    r = policy.generate(PROMPTS, 2, Sampling(max_new_tokens=10), seeds=[1, 2, 3, 4])
    assert r.prompt_ids == ["short"] * 2 + ["long"] * 2 + ["5"] * 2 + ["3"] * 2
    assert r.records[2] is PROMPTS[1]
    P = policy.max_prompt_tokens
    assert r.context["input_ids"].shape == r.context["attention_mask"].shape == (8, P + 10)
    assert torch.equal(r.context["input_ids"][:, P:], r.actions)
    assert torch.equal(r.context["attention_mask"][:, P:], r.mask.long())
    assert r.context["temperature"] == 1.0
    assert r.truncated is not None and r.truncated.any() and not r.truncated.all()
    for i in range(len(r)):
        n = int(r.mask[i].sum())
        assert torch.equal(r.mask[i, :n], torch.ones(n))  # a prefix of ones
        assert (r.actions[i, n:] == pad).all()
        assert bool(r.truncated[i]) == (r.actions[i, n - 1] != eos)
        assert (r.actions[i, : n - 1] != eos).all()
        assert r.outputs[i] == policy.tokenizer.decode(r.actions[i, :n], skip_special_tokens=True)
    assert not (r.actions[r.mask.bool()] == pad).any()
    assert policy.stats["samples_generated"] == 8
    assert policy.stats["tokens_generated"] == int(r.mask.sum())


def test_stop_strings_end_the_row_and_stay_in_the_output(policy):
    r = policy.generate(PROMPTS, 3, Sampling(max_new_tokens=10, stop=("e",)), seeds=[1, 2, 3, 4])
    stopped_by_string = [not t and "e" in o for o, t in zip(r.outputs, r.truncated.tolist())]
    assert sum(stopped_by_string) >= 3
    for i in range(len(r)):
        n = int(r.mask[i].sum())
        before = policy.tokenizer.decode(r.actions[i, : n - 1], skip_special_tokens=True)
        assert "e" not in before  # it did not run past an earlier stop
        if not r.truncated[i]:  # stopped by the stop string, or by EOS
            assert "e" in r.outputs[i] or r.actions[i, n - 1] == policy.tokenizer.eos_token_id
        else:
            assert n == 10 and "e" not in r.outputs[i]


def test_greedy_is_deterministic_and_is_the_argmax(policy):
    greedy = Sampling(greedy=True, max_new_tokens=8)
    a = policy.generate(PROMPTS, 2, greedy, seeds=[1, 2, 3, 4])
    b = policy.generate(PROMPTS, 2, greedy, seeds=[9, 8, 7, 6])
    assert torch.equal(a.actions, b.actions)
    ids, attn = a.context["input_ids"], a.context["attention_mask"]
    P = policy.max_prompt_tokens
    with torch.no_grad():
        logits = policy.model(
            input_ids=ids, attention_mask=attn, position_ids=(attn.cumsum(-1) - 1).clamp(min=0)
        ).logits[:, P - 1 : -1]
    logits[..., policy.pad_id] = -torch.inf
    m = a.mask.bool()
    assert torch.equal(logits.argmax(-1)[m], a.actions[m])


def test_tiny_top_p_is_greedy(policy):
    greedy = policy.generate(PROMPTS, 2, Sampling(greedy=True, max_new_tokens=8), [1, 2, 3, 4])
    nucleus = policy.generate(PROMPTS, 2, Sampling(top_p=1e-6, max_new_tokens=8), [1, 2, 3, 4])
    assert torch.equal(greedy.actions, nucleus.actions)


def test_rollouts_from_different_rounds_concatenate(policy):
    s = Sampling(max_new_tokens=6)
    a = policy.generate(PROMPTS[:1], 2, s, [1])  # short prompt only
    b = policy.generate(PROMPTS[1:2], 2, s, [2])  # long prompt only
    both = Rollout.concat([a, b])
    with torch.no_grad():
        lp = policy.logprobs(both)
    m = both.mask.bool()
    assert torch.allclose(lp[m], both.logprobs[m], atol=1e-5)


def test_padding_columns_are_left_out_of_generation_and_kept_in_the_rollout(tiny_dir):
    # the same prompts at P = 32 and P = 200: the forward passes of the second leave out
    # its extra padding columns (every prompt is far shorter), so the samples are the same
    # and so are their log-probs up to float rounding; the rollout is still P wide
    s = Sampling(max_new_tokens=6)
    narrow, wide = (TextPolicy.load(tiny_dir, max_prompt_tokens=n) for n in (32, 200))
    a = narrow.generate(PROMPTS[:2], 3, s, [5, 6])
    calls = []
    forward = wide.model.forward
    wide.model.forward = lambda *x, **k: calls.append(k["input_ids"].shape) or forward(*x, **k)
    b = wide.generate(PROMPTS[:2], 3, s, [5, 6])
    longest = max(len(ids) for ids in wide.encode_prompts(PROMPTS[:2]))
    assert calls[0] == (2, longest)  # the prefill: the longest prompt's width, not 200
    assert torch.equal(a.actions, b.actions) and torch.equal(a.mask, b.mask)
    assert torch.allclose(a.logprobs, b.logprobs, atol=1e-5)
    assert b.context["input_ids"].shape == (6, 200 + 6)
    assert torch.equal(b.context["input_ids"][:, -38:], a.context["input_ids"])
    assert torch.equal(b.context["attention_mask"][:, -38:], a.context["attention_mask"])
    assert int(b.context["attention_mask"][:, :-38].sum()) == 0
    with torch.no_grad():  # the update reads the P-wide rollout as the sampler computed it
        lp = wide.logprobs(b)
    m = b.mask.bool()
    assert torch.allclose(lp[m], b.logprobs[m], atol=1e-5)


# --- prompts ----------------------------------------------------------------------------
def test_too_long_prompt_is_rejected_with_its_name(tiny_dir):
    policy = TextPolicy.load(tiny_dir, max_prompt_tokens=8)
    s = Sampling(max_new_tokens=2)
    with pytest.raises(PromptTooLongError, match=r"demo:3.*max_prompt_tokens=8") as err:
        policy.generate([PROMPTS[0], PROMPTS[3]], 1, s, [1, 2])
    n = len(policy.tokenizer(PROMPTS[3]["prompt"])["input_ids"])
    assert f"{n} tokens" in str(err.value) and isinstance(err.value, ValueError)
    with pytest.raises(PromptTooLongError, match="index 0"):
        policy.generate([{"prompt": PROMPTS[1]["prompt"]}], 1, s, [1])


def test_too_long_prompt_truncates_to_its_end(tiny_dir):
    policy = TextPolicy.load(tiny_dir, max_prompt_tokens=8, prompt_overflow="truncate")
    r = policy.generate([PROMPTS[1], PROMPTS[0]], 1, Sampling(max_new_tokens=2), [1, 2])
    assert policy.stats["prompts_truncated"] == 1
    full = policy.tokenizer(PROMPTS[1]["prompt"])["input_ids"]
    assert r.context["input_ids"][0, :8].tolist() == full[-8:]
    assert r.context["attention_mask"][0, :8].all()


def test_chat_template_for_message_lists(policy):
    messages = [{"role": "user", "content": "What is 2 + 2?"}]
    r = policy.generate([{"prompt": messages}], 1, Sampling(max_new_tokens=2), [1])
    P = policy.max_prompt_tokens
    prompt = r.context["input_ids"][0, :P][r.context["attention_mask"][0, :P].bool()]
    assert policy.tokenizer.decode(prompt) == (
        "<|im_start|>user\nWhat is 2 + 2?<|im_end|>\n<|im_start|>assistant\n"
    )


def test_chat_template_for_strings_with_system_prompt(tiny_dir):
    policy = TextPolicy.load(
        tiny_dir, max_prompt_tokens=48, use_chat_template=True, system_prompt="Be brief."
    )
    r = policy.generate([{"prompt": "Hi"}], 1, Sampling(max_new_tokens=2), [1])
    text = policy.tokenizer.decode(r.context["input_ids"][0][r.context["attention_mask"][0] > 0])
    assert text.startswith(
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>"
    )
    with pytest.raises(ValueError, match="use_chat_template"):
        TextPolicy.load(tiny_dir, system_prompt="Be brief.")


# --- loading ----------------------------------------------------------------------------
def test_load_missing_dir_names_the_path(tmp_path):
    missing = tmp_path / "no-such-model"
    with pytest.raises(FileNotFoundError, match="no-such-model"):
        TextPolicy.load(missing)


def test_load_incomplete_dir_names_what_is_missing(tmp_path, tiny_dir):
    (tmp_path / "config.json").write_text((tiny_dir / "config.json").read_text())
    with pytest.raises(FileNotFoundError, match="weights.*tokenizer") as err:
        TextPolicy.load(tmp_path)
    assert str(tmp_path) in str(err.value)


# --- SFT ----------------------------------------------------------------------------------
SFT_RECORDS = [
    {"prompt": f"What is {a} + {b}?", "answer": f" {a + b}"}
    for a, b in [(1, 2), (3, 4), (10, 5), (7, 7)]
]


def test_sft_labels_cover_only_the_answer_and_eos(policy):
    batch = policy.sft_inputs(SFT_RECORDS)
    tok = policy.tokenizer
    for i, rec in enumerate(SFT_RECORDS):
        target = tok(rec["answer"], add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        labels = batch["labels"][i]
        kept = labels[labels != IGNORE_INDEX].tolist()
        assert kept == target
        assert labels[-len(target) :].tolist() == target  # at the end, after the prompt
        assert batch["input_ids"][i, -len(target) :].tolist() == target
        n_prompt = len(tok(rec["prompt"])["input_ids"])
        assert int(batch["attention_mask"][i].sum()) == n_prompt + len(target)


def test_sft_loss_decreases(policy):
    torch.manual_seed(0)
    opt = torch.optim.Adam(policy.module().parameters(), lr=1e-2)
    losses = []
    for _ in range(6):
        loss = policy.sft_loss(SFT_RECORDS)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.5, losses


def test_reference_snapshot_is_frozen(tiny_dir):

    policy = TextPolicy.load(tiny_dir)
    with pytest.raises(RuntimeError, match="enable_reference"):
        policy.reference_logprobs(None)
    policy.enable_reference()
    r = policy.generate([{"prompt": "12+3="}], 2, Sampling(max_new_tokens=3), [1])
    torch.testing.assert_close(policy.reference_logprobs(r), policy.logprobs(r).detach())
    with torch.no_grad():
        for p in policy.module().parameters():
            p.add_(0.01)
    assert not torch.allclose(policy.reference_logprobs(r), policy.logprobs(r).detach())


@pytest.mark.parametrize("new_tokens", [1, 3])
def test_scoring_groups_makes_two_forwards_whatever_the_length(policy, monkeypatch, new_tokens):
    """A pass over whole groups runs the prompt once, then the completions: two forwards
    whether the completions are one token or more (a sharded engine's forwards are
    collectives, so every rank's pass must make the same ones). Its log-probs are those
    of the sampling pass and of each row scored alone, and its gradient reaches the
    prompt pass."""
    sampling = Sampling(temperature=1.0, max_new_tokens=new_tokens)
    r = policy.generate(PROMPTS[:2], 2, sampling, seeds=[1, 2])
    calls = []
    forward = policy._forward
    monkeypatch.setattr(policy, "_forward", lambda *a, **k: calls.append(1) or forward(*a, **k))
    lp = policy.logprobs(r)
    assert len(calls) == 2
    m = r.mask.bool()
    torch.testing.assert_close(lp[m], r.logprobs[m], atol=1e-5, rtol=1e-5)
    alone = torch.cat([policy.logprobs(r.select([i])) for i in range(len(r))])
    torch.testing.assert_close(lp, alone, atol=1e-5, rtol=1e-5)
    policy.model.zero_grad(set_to_none=True)
    policy.logprobs(r)[m].sum().backward()
    emb = policy.model.get_input_embeddings().weight.grad
    assert emb is not None and bool(emb.abs().sum() > 0)
