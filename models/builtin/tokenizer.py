"""A small byte-level BPE tokenizer trained locally, for tiny test and demo models.

Nothing is downloaded: the vocabulary is learned from the texts passed in, in about a
second, and saved in Hugging Face layout so ``AutoTokenizer.from_pretrained(out_dir)``
loads it like any hub tokenizer.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

EOS_TOKEN = "<|endoftext|>"
PAD_TOKEN = "<|pad|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = (EOS_TOKEN, PAD_TOKEN, IM_START, IM_END)  # ids 0..3, in this order

# Qwen's ChatML layout, without Qwen's default system message: the policy adds a
# system prompt only when it is configured to.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def train_bpe_tokenizer(
    texts: Iterable[str], out_dir: str | Path, *, vocab_size: int = 320, seed: int = 0
) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE on ``texts`` and save it to ``out_dir``.

    Digits are split one per token before BPE runs, so no merge can glue digits
    together: arithmetic rewards and models need ``"123"`` to be three tokens.
    The 256 byte symbols are always in the vocabulary, so any string encodes.

    ``vocab_size`` counts the 4 special tokens and the 256 bytes; the rest are merges.
    ``seed`` is accepted so callers can pass one seed to every builder; BPE training
    is deterministic for the same texts in the same order (ties break by pair order),
    so it has nothing to seed.
    """
    del seed
    min_size = len(SPECIAL_TOKENS) + len(pre_tokenizers.ByteLevel.alphabet())
    if vocab_size < min_size:
        raise ValueError(
            f"vocab_size={vocab_size} is below the byte alphabet + specials ({min_size})"
        )
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(list(texts), trainer=trainer)

    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        additional_special_tokens=[IM_START, IM_END],
        padding_side="left",  # causal LMs are batched with left padding for generation
        clean_up_tokenization_spaces=False,  # keep decode(encode(s)) == s
        model_max_length=512,
    )
    hf.chat_template = CHAT_TEMPLATE
    hf.save_pretrained(str(out_dir))
    return hf
