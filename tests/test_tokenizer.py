"""The locally trained byte-level BPE tokenizer."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from mmyatt.models.builtin.tokenizer import train_bpe_tokenizer

CORPUS = [f"What is {a} + {b}? The answer is {a + b}." for a in range(30) for b in range(10)] + [
    "The quick brown fox jumps over the lazy dog."
] * 10


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("tok")
    train_bpe_tokenizer(CORPUS, out)
    return out


def test_auto_tokenizer_loads_it(tok_dir):
    tok = AutoTokenizer.from_pretrained(str(tok_dir))
    assert tok.eos_token == "<|endoftext|>" and tok.pad_token == "<|pad|>"
    assert tok.eos_token_id != tok.pad_token_id
    assert tok.convert_tokens_to_ids("<|im_start|>") != tok.unk_token_id
    assert len(tok) <= 320
    text = "What is 17 + 5? héllo 日本"
    assert tok.decode(tok(text)["input_ids"]) == text  # byte-level: anything round-trips


def test_digits_are_one_token_each(tok_dir):
    tok = AutoTokenizer.from_pretrained(str(tok_dir))
    ids = tok("1234567890", add_special_tokens=False)["input_ids"]
    assert [tok.decode([i]) for i in ids] == list("1234567890")
    # digits inside text too, although "12" etc. are frequent in the corpus
    pieces = [tok.decode([i]) for i in tok(" 12 + 30", add_special_tokens=False)["input_ids"]]
    assert "1" in pieces and "12" not in pieces and " 12" not in pieces


def test_special_tokens_are_atomic(tok_dir):
    tok = AutoTokenizer.from_pretrained(str(tok_dir))
    ids = tok("a<|im_start|>b<|endoftext|>", add_special_tokens=False)["input_ids"]
    assert tok.convert_tokens_to_ids("<|im_start|>") in ids and tok.eos_token_id in ids


def test_chat_template_renders(tok_dir):
    tok = AutoTokenizer.from_pretrained(str(tok_dir))
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 2 + 2?"},
    ]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nWhat is 2 + 2?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    no_prompt = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
    assert not no_prompt.endswith("assistant\n")


def test_deterministic_vocab(tmp_path):
    a = train_bpe_tokenizer(CORPUS, tmp_path / "a")
    b = train_bpe_tokenizer(CORPUS, tmp_path / "b")
    assert a.get_vocab() == b.get_vocab()
    assert (tmp_path / "a" / "tokenizer.json").read_text() == (
        tmp_path / "b" / "tokenizer.json"
    ).read_text()


def test_vocab_size_below_byte_alphabet_is_rejected(tmp_path):
    with pytest.raises(ValueError, match="vocab_size"):
        train_bpe_tokenizer(CORPUS, tmp_path, vocab_size=100)
