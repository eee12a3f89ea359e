"""mmyatt/step/flops.py: the FLOPs formula checked by hand on a tiny Qwen2 config."""

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from mmyatt.rollout import Rollout
from mmyatt.step.flops import ModelFlops, causal_keys, mfu, peak_bf16_flops, rollout_flops


def _tiny(tied: bool) -> Qwen2ForCausalLM:
    cfg = Qwen2Config(
        hidden_size=8,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        intermediate_size=16,
        vocab_size=32,
        tie_word_embeddings=tied,
    )
    torch.manual_seed(0)
    return Qwen2ForCausalLM(cfg)


@pytest.mark.parametrize("tied", [True, False])
def test_counts_of_a_tiny_qwen2_by_hand(tied):
    # per layer (head_dim 4, 2 query heads, 1 kv head): q 8x8 = 64, k 8x4 = 32, v 32,
    # o 64, MLP gate/up/down 3 x 8x16 = 384 -> 576; 2 layers 1152; the head 32x8 = 256.
    # The input embedding (a lookup) is not counted, tied or not; biases add no product.
    f = ModelFlops.of(_tiny(tied))
    assert f == ModelFlops(matmul_params=1152 + 256, layers=2, attn_width=8)
    # one causal sequence of T = 4 tokens: keys 1 + 2 + 3 + 4 = 10
    assert causal_keys(0, 4) == 10
    # forward: 2 N T + 4 L d keys = 2 * 1408 * 4 + 4 * 2 * 8 * 10 = 11264 + 640
    assert f.forward(4, 10) == 11904
    # training: 6 N T + 6 L d T (T + 1) = 33792 + 1920
    assert f.train(4, 10) == 35712 == 6 * 1408 * 4 + 6 * 2 * 8 * 4 * 5


def test_rows_prefill_each_prompt_once_and_feed_all_but_the_last_action():
    f = ModelFlops(matmul_params=10, layers=1, attn_width=1)
    # group 0 (prompt 3 tokens): prefill 3 tokens, 6 keys; row 0 feeds 1 action after 3
    # cached (4 keys), row 1 none; group 1 (prompt 2): 2 tokens, 3 keys, row 2 feeds 3
    # after 2 cached: 3 x 2 + 6 = 12 keys.
    assert f.rows([3, 3, 2], [2, 1, 4], [0, 0, 1]) == (3 + 1 + 2 + 3, 6 + 4 + 3 + 12)


def test_vlm_language_model_scope_and_mfu():
    model = _tiny(True)
    whole = ModelFlops.of(model)
    # scoped to one decoder layer: its 576 weights and the head's 256
    one = ModelFlops.of(model, language_model=model.model.layers[0])
    assert one.matmul_params == 576 + 256 and one.layers == whole.layers
    assert mfu(2e12, 2.0, 1e12) == 1.0
    assert mfu(1.0, 1.0, None) is None
    assert peak_bf16_flops("NVIDIA H200") == 989e12 and peak_bf16_flops("cpu") is None


def test_rollout_flops_reads_real_lengths_and_groups_from_a_rollout():
    # rows 0-1 answer prompt "a" (3 real tokens of a width-4 prompt), row 2 prompt "b"
    # (2 real tokens): the rows() case above, read from the tensors a rollout holds
    attn = torch.tensor(
        [[0, 1, 1, 1, 1, 1, 0, 0], [0, 1, 1, 1, 1, 0, 0, 0], [0, 0, 1, 1, 1, 1, 1, 1]]
    )
    mask = attn[:, 4:].float()
    r = Rollout(
        prompt_ids=["a", "a", "b"],
        actions=torch.zeros(3, 4, dtype=torch.long),
        logprobs=torch.zeros(3, 4),
        mask=mask,
        context={"attention_mask": attn},
        outputs=["", "", ""],
        records=[{}, {}, {}],
    )
    f = ModelFlops(matmul_params=10, layers=1, attn_width=1)
    tokens, keys = 3 + 1 + 2 + 3, 6 + 4 + 3 + 12
    assert rollout_flops(r, f) == (f.forward(tokens, keys), f.train(tokens, keys))
