"""One token-by-token decode loop for every autoregressive adapter (text, VLM, judge).

The adapter owns the model call (prefill, cache, positions, media; ``new_cache`` makes
its empty key/value cache); this module owns what happens to the logits: tempering,
token bans, the draw, the log-prob of the draw, stopping, and the bookkeeping of actions
and masks. Everything is done once per step on the whole (N, V) batch, in place where
the logits are ours:

* the draw is the exponential race that ``torch.multinomial(p, 1)`` itself uses
  (argmax of p / q with q ~ Exp(1)), with each prompt's q drawn from its own generator
  for a chunk of steps at once: the same q values, so the same tokens, as one
  ``multinomial`` per prompt and step, in one division and one argmax per step;
* the log-prob of the drawn token is its logit minus the row's logsumexp: the (N, V)
  log-softmax is never built;
* attention masks live in one pre-allocated (N, P + A) buffer that the adapter slices.

Shapes: B prompts, G samples per prompt, N = B * G rows (groups contiguous), A the
action budget, V the vocabulary.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor
from transformers import DynamicCache

# the functions `mmyatt.step.profile` times as "sampling" (the per-step logits math)
SAMPLING_KERNELS = ("temper", "draw", "chosen_logprob")

# noise drawn ahead per prompt: at most this many floats per chunk of steps
_NOISE_CHUNK_ELEMS = 1 << 22


def new_cache(model) -> DynamicCache:
    """An empty key/value cache for ``model`` (a transformers model)."""
    try:
        return DynamicCache(config=model.config)
    except TypeError:  # transformers releases whose DynamicCache takes no config
        return DynamicCache()


def temper(logits: Tensor, temperature: float, banned: Tensor, *, inplace: bool = False) -> Tensor:
    """(..., V) fp32 ``logits / temperature`` with ``banned`` ids at the most negative
    float (not -inf: exp still gives exactly 0, and p * log p stays 0 in entropies).

    ``inplace`` reuses ``logits`` when it is already fp32 (the caller must own it and
    it must not need gradients). Division by 1.0 is skipped (it is exact anyway).
    """
    if logits.dtype != torch.float32:
        logits, inplace = logits.float(), True
    if temperature != 1.0:
        logits = logits.div_(temperature) if inplace else logits / temperature
    if len(banned):
        banned = banned.to(logits.device)
        fill = torch.finfo(logits.dtype).min
        logits = (
            logits.index_fill_(-1, banned, fill) if inplace else logits.index_fill(-1, banned, fill)
        )
    return logits


def chosen_logprob(logits: Tensor, tokens: Tensor) -> Tensor:
    """log softmax(logits)[token] as logit[token] - logsumexp(logits): (..., V), (...) -> (...).

    Equal to ``logits.log_softmax(-1).gather(-1, tokens[..., None])`` up to rounding
    (the max is subtracted once, inside logsumexp, instead of from every logit)."""
    return logits.gather(-1, tokens.unsqueeze(-1)).squeeze(-1) - logits.logsumexp(-1)


def entropy(logits: Tensor) -> Tensor:
    """(..., V) -> (...) entropy of softmax(logits); banned ids (most negative float)
    contribute exactly 0."""
    logp = logits.log_softmax(-1)
    return -(logp.exp() * logp).sum(-1)


class NoiseSource:
    """Exp(1) noise per prompt for the exponential-race draw, ``chunk`` steps at a time.

    Prompt i's noise for steps t .. t + chunk - 1 is one ``exponential_`` call on its
    generator over a contiguous (chunk, G, V) block, which yields the same numbers as
    ``chunk`` successive (G, V) calls: what ``torch.multinomial`` would draw.
    """

    def __init__(
        self, generators: list[torch.Generator], group: int, vocab: int, steps: int, device
    ):
        self.generators, self.group, self.vocab = generators, group, vocab
        per_step = max(len(generators) * group * vocab, 1)
        self.chunk = max(1, min(steps, _NOISE_CHUNK_ELEMS // per_step))
        self.buf = torch.empty(len(generators), self.chunk, group, vocab, device=device)
        self._start = None

    def at(self, t: int) -> Tensor:
        """(B, G, V) noise of step t (steps are asked for in order)."""
        if self._start is None or t >= self._start + self.chunk:
            self._start = t
            for i, g in enumerate(self.generators):
                self.buf[i].exponential_(generator=g)
        return self.buf[:, t - self._start]


def draw(probs: Tensor, top_p: float, noise: Tensor) -> Tensor:
    """(N,) tokens from (N, V) probabilities given (B, G, V) Exp(1) noise, N = B * G.

    Top-p keeps the most likely tokens until their mass reaches ``top_p`` (at least one;
    stable sort so ties keep index order, like argmax). ``probs`` may be modified.
    """
    if top_p < 1.0:
        sorted_probs, order = torch.sort(probs, dim=-1, descending=True, stable=True)
        mass_before = sorted_probs.cumsum(-1) - sorted_probs
        drop = torch.zeros_like(mass_before, dtype=torch.bool).scatter_(
            -1, order, mass_before >= top_p
        )
        probs = probs.masked_fill_(drop, 0.0)
    b, g, v = noise.shape
    return (probs.view(b, g, v) / noise).argmax(-1).reshape(-1)


@dataclass
class Decoded:
    actions: Tensor  # (N, A) long, pad after the stop
    logprobs: Tensor  # (N, A) fp32, 0 where masked
    mask: Tensor  # (N, A) fp32, 1 on actions (the stop token included)
    stopped: Tensor  # (N,) bool: ended by EOS or a stop string (not the budget)


def decode(
    first_logits: Tensor,
    forward_next: Callable[[Tensor, int], Tensor],
    *,
    group: int,
    max_new_tokens: int,
    temperature: float,
    greedy: bool,
    top_p: float,
    banned: Tensor,
    generators: list[torch.Generator],
    eos: Tensor,
    pad_id: int,
    stop_hits: Callable[[Tensor, int, Tensor], Tensor] | None = None,
    complete_groups: int = 0,
    must_finish: tuple[int, ...] = (),
    on_finished: Callable[[list[int], Tensor, Tensor], None] | None = None,
    finished_unit: str = "group",
) -> Decoded:
    """Sample up to ``max_new_tokens`` tokens per row.

    ``first_logits`` (N, V): the logits after the prompt (they are overwritten).
    ``forward_next(token (N,), t)`` feeds action t to the model and returns the (N, V)
    logits that predict action t + 1 (also ours to overwrite). ``stop_hits(actions, t,
    rows)`` -> (N,) bool marks rows (among ``rows``) that a stop string ends at step t.
    Finished rows keep decoding so batch shapes stay fixed; their output is ignored.
    Rows ``i * group .. (i + 1) * group - 1`` draw only from ``generators[i]``.
    ``complete_groups`` > 0 (over-dispatch): stop once that many groups have all their
    rows finished and so have the groups ``must_finish``; the other rows are cut short
    (neither stopped nor at the budget).
    ``on_finished(rows, actions, mask)``: called at the step where ``rows`` finished,
    with the buffers as they stand (those rows are final); never for rows the budget
    cuts. ``finished_unit`` "group": a group's rows once every one of them has finished;
    "sample": each row as it finishes.
    """
    if finished_unit not in ("group", "sample"):
        raise ValueError(f"finished_unit must be 'group' or 'sample', not {finished_unit!r}")
    N, V = first_logits.shape
    A, device = max_new_tokens, first_logits.device
    actions = torch.full((N, A), pad_id, dtype=torch.long, device=device)
    logprobs = torch.zeros(N, A, dtype=torch.float32, device=device)
    mask = torch.zeros(N, A, dtype=torch.float32, device=device)
    finished = torch.zeros(N, dtype=torch.bool, device=device)
    stopped = torch.zeros(N, dtype=torch.bool, device=device)
    noise = None if greedy else NoiseSource(generators, group, V, A, device)
    reported = torch.zeros(N // group, dtype=torch.bool, device=device)
    eos = eos.to(device)
    raw = first_logits
    for t in range(A):
        logits = temper(raw, temperature, banned, inplace=True)
        if greedy:
            token = logits.argmax(-1)
        else:
            token = draw(logits.softmax(-1), top_p, noise.at(t))
        live = ~finished
        actions[:, t] = torch.where(live, token, pad_id)
        logprobs[:, t] = torch.where(live, chosen_logprob(logits, token), 0.0)
        mask[:, t] = live
        # The stop token is an action: it is kept (mask 1) and the row ends after it.
        hit = live & torch.isin(token, eos)
        if stop_hits is not None:
            hit |= stop_hits(actions, t, live & ~hit)
        stopped |= hit
        finished |= hit
        if on_finished is not None and bool(hit.any()):
            if finished_unit == "sample":
                on_finished(hit.nonzero().flatten().tolist(), actions, mask)
            else:
                new = finished.view(-1, group).all(1) & ~reported
                if bool(new.any()):
                    reported |= new
                    rows = (new.nonzero() * group + torch.arange(group, device=device)).flatten()
                    on_finished(rows.tolist(), actions, mask)
        if t == A - 1 or bool(finished.all()):
            break
        if complete_groups and bool(hit.any()):
            done = finished.view(-1, group).all(1)
            if int(done.sum()) >= complete_groups and bool(done[list(must_finish)].all()):
                break
        raw = forward_next(token, t)
    return Decoded(actions, logprobs, mask, stopped)


def sample(
    adapter,
    first_logits: Tensor,
    forward_next: Callable[[Tensor, int], Tensor],
    *,
    group: int,
    max_new_tokens: int,
    temperature: float,
    sampling,
    generators: list[torch.Generator],
    **options,
) -> tuple[Decoded, list[str]]:
    """:func:`decode` with an adapter's own vocabulary rules (``adapter.tokenizer``,
    ``banned_tokens``, ``eos_ids``, ``pad_id``), its stop strings (``sampling.stop``), greedy /
    top-p from ``sampling``, then the completions as text (each cut at its mask) and the
    adapter's ``samples_generated`` / ``tokens_generated`` counters updated. ``options``
    go to :func:`decode` (``complete_groups``, ``must_finish``). ``sampling.on_finished``
    receives the finished rows' completions as text, as they will be returned."""
    report = None
    if sampling.on_finished is not None:

        def report(rows: list[int], actions: Tensor, mask: Tensor) -> None:
            sampling.on_finished(rows, as_text(adapter.tokenizer, actions[rows], mask[rows]))

    res = decode(
        first_logits,
        forward_next,
        group=group,
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        greedy=sampling.greedy,
        top_p=sampling.top_p,
        banned=adapter.banned_tokens,
        generators=generators,
        eos=torch.tensor(sorted(adapter.eos_ids), dtype=torch.long),
        pad_id=adapter.pad_id,
        stop_hits=stop_hook(adapter.tokenizer, sampling.stop),
        on_finished=report,
        finished_unit=sampling.finished_unit,
        **options,
    )
    outputs = as_text(adapter.tokenizer, res.actions, res.mask)
    adapter.stats["samples_generated"] += res.actions.shape[0]
    adapter.stats["tokens_generated"] += int(res.mask.sum())
    return res, outputs


def as_text(tokenizer, actions: Tensor, mask: Tensor) -> list[str]:
    """Each row's actions as text, cut at its mask (special tokens dropped)."""
    lengths = mask.sum(-1).long().tolist()
    return tokenizer.batch_decode(
        [row[:n] for row, n in zip(actions.tolist(), lengths)], skip_special_tokens=True
    )


def stop_string_hits(
    tokenizer, actions: Tensor, t: int, rows: Tensor, stops: tuple[str, ...]
) -> Tensor:
    """(N,) bool: rows (among ``rows``) whose completion (actions[:, : t + 1]) now
    contains a stop string.

    "Contains", not "ends with": one byte-level token can carry the stop string and
    more (stop "\\n", token "\\n\\n"). Any occurrence must involve the newest token
    (an older one would have stopped the row already), so only a recent window is
    decoded, wide enough for the longest stop string even at one byte per token.
    """
    hits = torch.zeros_like(rows)
    index = rows.nonzero().flatten().tolist()
    if not index:
        return hits
    window = 4 * max(len(s) for s in stops) + 8
    start = max(0, t + 1 - window)
    tails = actions[index, start : t + 1].tolist()
    texts = tokenizer.batch_decode(tails, skip_special_tokens=True)
    for i, text in zip(index, texts):
        if any(s in text for s in stops):
            hits[i] = True
    return hits


def stop_hook(tokenizer, stops: tuple[str, ...]) -> Callable | None:
    """The ``stop_hits`` argument of :func:`decode` for stop strings ``stops`` (None when
    there are none): :func:`stop_string_hits` with the adapter's tokenizer."""
    if not stops:
        return None
    return lambda actions, t, rows: stop_string_hits(tokenizer, actions, t, rows, stops)


def attention_buffer(prompt_mask: Tensor, max_new_tokens: int) -> Tensor:
    """(N, P + A) attention mask: the prompt's, then ones for every action slot. At
    decode step t the model sees columns ``[: P + t + 1]`` (finished rows included:
    their outputs are ignored)."""
    n, _ = prompt_mask.shape
    return torch.cat([prompt_mask, prompt_mask.new_ones(n, max_new_tokens)], 1)


def first_used_column(prompt_mask: Tensor) -> int:
    """The first column of a left-padded (rows, P) prompt mask that is not padding in
    every row (P - 1 when every column is): the columns before it weigh exactly 0 in
    every softmax and shift no position, so a forward may leave them out."""
    used = prompt_mask.any(0).nonzero()
    return int(used[0]) if len(used) else prompt_mask.shape[1] - 1


def share_prefix_rows(ids: Tensor, attn: Tensor) -> tuple[Tensor, Tensor]:
    """Rows whose (ids, attention mask) equal the previous row's share its prefix.

    Returns (first row of each run (U,), run index of every row (N,)): the prefix is
    computed on ``ids[first]`` and row i takes run ``owner[i]``'s result."""
    if ids.shape[0] == 0:
        empty = torch.zeros(0, dtype=torch.long, device=ids.device)
        return empty, empty
    same = (ids[1:] == ids[:-1]).all(-1) & (attn[1:] == attn[:-1]).all(-1)
    starts = torch.cat([same.new_ones(1), ~same])
    return starts.nonzero().squeeze(-1), starts.long().cumsum(0) - 1


# --- a decode step over a pre-allocated KV cache (Llama-family causal LMs) -------------
# Llama-family decoders, and the language models of Qwen2-VL / Qwen2.5-VL (the same
# blocks; their M-RoPE tables come from the model's own rotary module)
_STATIC_TYPES = ("llama", "qwen2", "qwen3", "mistral", "qwen2_vl_text", "qwen2_5_vl_text")


def decoder_stack(model):
    """The decoder stack (embed_tokens, layers, norm, rotary_emb) of a causal LM
    (``model.model``) or of a VLM (``model.model.language_model``); None if neither."""
    base = getattr(model, "model", None)
    lm = getattr(base, "language_model", None)
    return lm if lm is not None else base


def project_qkv(attn, x: Tensor, cos: Tensor, sin: Tensor, rope) -> tuple[Tensor, Tensor, Tensor]:
    """q (N, H, 1, D), k and v (N, Hkv, 1, D) of one new token: ``attn``'s projections,
    Qwen3's q/k norms where present, RoPE on q and k."""
    n = x.shape[0]
    q = attn.q_proj(x).view(n, 1, -1, attn.head_dim)
    k = attn.k_proj(x).view(n, 1, -1, attn.head_dim)
    if hasattr(attn, "q_norm"):  # Qwen3
        q, k = attn.q_norm(q), attn.k_norm(k)
    q, k = rope(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
    v = attn.v_proj(x).view(n, 1, -1, attn.head_dim).transpose(1, 2)
    return q, k, v


class StaticKVDecoder:
    """One-token decode steps of a Llama-family model (Llama, Qwen2, Qwen3, Mistral) over
    keys and values pre-allocated for the whole rollout.

    The model's own modules compute everything (embeddings, norms, projections, RoPE
    tables, MLPs, head); what is ours is the cache (written in place, never
    concatenated) and the attention of the one new query against it: grouped matmuls
    and a softmax in fp32 with an additive mask for the prompt's left padding. Built
    from the Hugging Face cache after the prefill. ``supports(model)`` says when it
    applies; otherwise the adapter decodes with the model's ``forward``. Each step
    attends the columns written so far (shapes grow by one a step);
    ``models.fast_decode`` has the fixed-shape variant that can be compiled.
    """

    @staticmethod
    def supports(model) -> bool:
        base = decoder_stack(model)
        cfg = getattr(base, "config", None)
        if cfg is None or getattr(cfg, "model_type", None) not in _STATIC_TYPES:
            return False
        if getattr(cfg, "use_sliding_window", False) or (
            cfg.model_type == "mistral" and getattr(cfg, "sliding_window", None)
        ):
            return False
        if model.training and getattr(cfg, "attention_dropout", 0.0):
            return False
        needed = ("embed_tokens", "layers", "norm", "rotary_emb")
        if not (all(hasattr(base, k) for k in needed) and hasattr(model, "lm_head")):
            return False
        parts = ("self_attn", "mlp", "input_layernorm", "post_attention_layernorm")
        for m in (model, *base.layers):  # plain layers only: no sharding or checkpoint wrappers
            if "FSDP" in type(m).__name__:
                return False
        return all(hasattr(layer, k) for layer in base.layers for k in parts)

    def __init__(self, model, cache, prompt_mask: Tensor, max_new_tokens: int):
        import sys

        self.model, self.base = model, decoder_stack(model)
        self.layers = list(self.base.layers)
        attn0 = self.layers[0].self_attn
        self.rope = sys.modules[type(attn0).__module__].apply_rotary_pos_emb
        n, p = prompt_mask.shape
        self.P = p
        self.keys, self.values = [], []
        for i, layer in enumerate(cache.layers[: len(self.layers)]):
            k, v = layer.keys, layer.values  # (N, Hkv, P, D)
            if k.shape[0] != n or k.shape[2] != p:
                raise ValueError(
                    f"cache layer {i} has shape {tuple(k.shape)}, rows {n} x {p} needed"
                )
            buf_k = k.new_empty(n, k.shape[1], p + max_new_tokens, k.shape[3])
            buf_v = v.new_empty(n, v.shape[1], p + max_new_tokens, v.shape[3])
            buf_k[:, :, :p] = k
            buf_v[:, :, :p] = v
            self.keys.append(buf_k)
            self.values.append(buf_v)
        # additive mask over cache columns: the prompt's padding never attends
        self.bias = torch.zeros(n, 1, 1, p + max_new_tokens, dtype=torch.float32, device=k.device)
        self.bias[:, 0, 0, :p].masked_fill_(prompt_mask == 0, torch.finfo(torch.float32).min)

    def step(self, token: Tensor, positions: Tensor, t: int) -> Tensor:
        """Logits (N, V) after feeding ``token`` (N,) at ``positions`` (N, 1) into cache
        column P + t (action t)."""
        col = self.P + t
        h = self.base.embed_tokens(token[:, None])  # (N, 1, D)
        cos, sin = self.base.rotary_emb(h, positions)
        n = h.shape[0]
        for layer, ks, vs in zip(self.layers, self.keys, self.values):
            a = layer.self_attn
            q, k, v = project_qkv(a, layer.input_layernorm(h), cos, sin, self.rope)
            ks[:, :, col : col + 1] = k
            vs[:, :, col : col + 1] = v
            kv_heads = ks.shape[1]
            qg = q.reshape(n, kv_heads, -1, a.head_dim)  # (N, Hkv, group, D)
            scores = torch.matmul(qg, ks[:, :, : col + 1].transpose(-1, -2)) * a.scaling
            scores = (scores.float() + self.bias[..., : col + 1]).softmax(-1).to(q.dtype)
            out = torch.matmul(scores, vs[:, :, : col + 1])  # (N, Hkv, group, D)
            h = h + a.o_proj(out.reshape(n, 1, -1))
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        return self.model.lm_head(self.base.norm(h))[:, -1]
