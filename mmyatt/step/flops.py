"""Model FLOPs of a decoder-only transformer, for model FLOPs utilisation (MFU).

Counted from the model's own modules and config, per token fed:

* matmuls: 2 x N multiply-adds, N the weights of every linear layer the token goes
  through (attention and MLP projections, the output head; an input embedding is a
  lookup, not a matmul, and a tied one is counted once, as the head);
* attention: 4 x layers x (heads x head_dim) x keys, for the two products q.k and
  p.v over the ``keys`` the token attends (itself and every earlier token of its row).

A forward over ``t`` tokens that attend ``k`` keys in all costs
``2 N t + 4 L d k``; training (forward + backward) three times that:
``6 N t + 12 L d k``, which for one causal sequence of T tokens
(k = T (T + 1) / 2) is ``6 N T + 6 L d T (T + 1)``. The 6N rule of thumb is the
first term alone. Norms, activations, RoPE and the softmax are not counted (a few
per cent at most), and neither is the work of padding or of finished rows that a
fixed-shape batch carries: these are the FLOPs the model needs, not the ones a kernel
happened to run.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from mmyatt.rollout import Rollout

# dense bf16 tensor-core peak (FLOP/s) by GPU name, from the vendors' data sheets (SXM)
PEAK_BF16 = {"H100": 989e12, "H200": 989e12, "A100": 312e12, "B200": 2250e12}


def peak_bf16_flops(device_name: str) -> float | None:
    """The dense bf16 peak of a GPU named ``device_name`` (e.g. "NVIDIA H200"), or None
    for a device not in ``PEAK_BF16``."""
    for key, flops in PEAK_BF16.items():
        if key in device_name:
            return flops
    return None


def causal_keys(cached: int, new: int) -> int:
    """Keys attended in all by ``new`` tokens fed after ``cached`` ones, each attending
    itself and every token before it: new x cached + new (new + 1) / 2.

    >>> causal_keys(0, 3), causal_keys(5, 1)
    (6, 6)
    """
    return new * cached + new * (new + 1) // 2


@dataclass(frozen=True)
class ModelFlops:
    """What a decoder's FLOPs per token depend on (see the module docstring)."""

    matmul_params: int  # N: weights of every linear layer a token goes through
    layers: int  # L
    attn_width: int  # d: query heads x head_dim

    @classmethod
    def of(cls, model: nn.Module, language_model: nn.Module | None = None) -> ModelFlops:
        """From a Hugging Face causal LM: N from its linear layers, L and d from its
        (text) config. For a VLM pass its language model (with the head) as ``model``'s
        part to count: ``language_model`` restricts N to that module and ``model``'s
        head (the vision tower's work per image is not counted)."""
        cfg = getattr(model.config, "text_config", None) or model.config
        heads = cfg.num_attention_heads
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
        scope = language_model if language_model is not None else model
        seen, n = set(), 0
        for m in (*scope.modules(), model.get_output_embeddings()):
            if isinstance(m, nn.Linear) and id(m.weight) not in seen:
                seen.add(id(m.weight))
                n += m.weight.numel()
        return cls(n, int(cfg.num_hidden_layers), int(heads * head_dim))

    def forward(self, tokens: int, keys: int) -> float:
        """FLOPs of a forward over ``tokens`` tokens attending ``keys`` keys in all."""
        return 2.0 * self.matmul_params * tokens + 4.0 * self.layers * self.attn_width * keys

    def train(self, tokens: int, keys: int) -> float:
        """Forward + backward (three forwards' worth)."""
        return 3.0 * self.forward(tokens, keys)

    def rows(self, prompts: list[int], actions: list[int], group: list[int]) -> tuple[int, int]:
        """(tokens, keys) to prefill each distinct prompt once and then feed each row's
        actions after it: ``prompts`` / ``actions`` the real (unpadded) lengths per row,
        ``group`` the index of the row's prompt (rows of a group share one prefill).
        A row's last action is never fed (nothing is predicted after it)."""
        tokens = keys = 0
        seen = set()
        for p, a, g in zip(prompts, actions, group):
            if g not in seen:
                seen.add(g)
                tokens, keys = tokens + p, keys + causal_keys(0, p)
            fed = max(a - 1, 0)
            tokens, keys = tokens + fed, keys + causal_keys(p, fed)
        return tokens, keys


def rollout_flops(r: Rollout, flops: ModelFlops) -> tuple[float, float]:
    """(generate, update) model FLOPs of a text or VLM rollout ``r``: each distinct
    prompt (consecutive equal ``prompt_ids``) prefilled once over its real tokens, then
    each row's actions but the last fed after it (``ModelFlops.rows``); one update pass
    scores the same tokens forward and backward."""
    A = r.num_actions
    attn = r.context["attention_mask"]
    prompts = attn[:, : attn.shape[1] - A].sum(1).tolist()
    actions = r.mask.sum(1).long().tolist()
    group, g = [], -1
    for i, pid in enumerate(r.prompt_ids):
        g += 1 if i == 0 or pid != r.prompt_ids[i - 1] else 0
        group.append(g)
    tokens, keys = flops.rows([int(p) for p in prompts], actions, group)
    return flops.forward(tokens, keys), flops.train(tokens, keys)


def mfu(flops: float, seconds: float, peak: float | None) -> float | None:
    """Model FLOPs utilisation: ``flops`` / ``seconds`` / ``peak`` (None without a peak)."""
    if peak is None or seconds <= 0:
        return None
    return flops / seconds / peak
