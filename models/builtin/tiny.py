"""Tiny randomly initialised Qwen2 models, built locally for tests, demos and CI.

A tiny model is a real ``Qwen2ForCausalLM`` plus a locally trained tokenizer, saved
in Hugging Face layout: everything that loads a hub checkpoint loads it too, so the
code paths under test are the production ones.

Sizes (parameters with the default 320-token vocabulary; embeddings are tied):

=============  ======  ======  =====  ========  ============  ==========
name           hidden  layers  heads  kv heads  intermediate  parameters
=============  ======  ======  =====  ========  ============  ==========
qwen2-0.1m         64       2      4         2           128     ~94 k
qwen2-1m          128       4      4         2           256    ~0.63 M
qwen2-3m          256       4      8         4           512     ~2.4 M
=============  ======  ======  =====  ========  ============  ==========
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, GenerationConfig, Qwen2Config

from .tokenizer import train_bpe_tokenizer

# Shared by every size: no dropout (train/eval mode must not change the numerics the
# RL ratio depends on), tied embeddings (most of a tiny model would otherwise be the
# two vocab matrices).
_COMMON = dict(
    tie_word_embeddings=True,
    attention_dropout=0.0,
    max_position_embeddings=512,
    rope_theta=10000.0,
    hidden_act="silu",
    rms_norm_eps=1e-6,
    initializer_range=0.02,
)

TINY_TEXT_CONFIGS: dict[str, dict] = {
    "qwen2-0.1m": dict(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
    ),
    "qwen2-1m": dict(
        hidden_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=256,
    ),
    "qwen2-3m": dict(
        hidden_size=256,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        intermediate_size=512,
    ),
}


def build_tiny_text_model(
    out_dir: str | Path,
    *,
    size: str = "qwen2-1m",
    corpus: Iterable[str],
    seed: int = 0,
    vocab_size: int = 320,
) -> Path:
    """Train a tokenizer on ``corpus``, build a seeded ``Qwen2ForCausalLM`` of ``size``,
    and save both (safetensors) to ``out_dir``. Returns ``out_dir`` as a Path.

    The model's vocabulary is the tokenizer's actual size, which can be below
    ``vocab_size`` when the corpus has too few repeated pairs to fill the merges.
    The same corpus, size and seed give bit-identical weights and vocabulary.
    """
    if size not in TINY_TEXT_CONFIGS:
        raise ValueError(
            f"unknown tiny model size {size!r}; choose one of {sorted(TINY_TEXT_CONFIGS)}"
        )
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = train_bpe_tokenizer(corpus, out, vocab_size=vocab_size, seed=seed)
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        eos_token_id=eos,
        bos_token_id=eos,  # Qwen convention: no BOS is prepended, the id names <|endoftext|>
        pad_token_id=pad,
        **_COMMON,
        **TINY_TEXT_CONFIGS[size],
    )
    # Seed a private RNG stream so building a model never moves the caller's global RNG.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config)  # the class loads on first use
    model.generation_config = GenerationConfig(
        eos_token_id=eos, bos_token_id=eos, pad_token_id=pad, do_sample=True
    )
    model.save_pretrained(str(out), safe_serialization=True)
    return out
