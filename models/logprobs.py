"""Log-probabilities of the taken tokens, and entropies, without a float32 copy of all
the logits.

A scoring forward returns (N, L, V) logits in the model's dtype (bfloat16 on a GPU).
The plain way to score them, ``(logits.float() / T).log_softmax(-1).gather(...)``, makes
float32 copies of the whole tensor (the cast, the tempered logits, the log-softmax) and
autograd keeps them for the backward: for 16 sequences x 288 tokens x a 152 k
vocabulary that is 2.8 GB per copy. Here the rows are taken a chunk at a time: each
chunk is cast to float32, tempered, banned ids filled, its logsumexp, taken-token
log-prob and entropy computed, and the chunk freed. The backward recomputes each
chunk's softmax from the logits themselves (saved in their own dtype) and the (R,)
float32 logsumexps, and writes the gradient in the logits' dtype. The peak is the
logits, their gradient and one float32 chunk, whatever N x L.

Values are those of ``models.decode.temper`` then ``chosen_logprob`` / ``entropy``
(the log-prob of the taken token under softmax(logits / T) with banned ids at the most
negative float), up to float32 rounding.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .decode import temper

# float32 elements of one chunk (64 MiB): 110 rows of a 152 k vocabulary
CHUNK_ELEMS = 1 << 24


def _rows(n: int, vocab: int, chunk_elems: int) -> int:
    return max(1, min(n, chunk_elems // max(vocab, 1)))


def _tempered(chunk: Tensor, temperature: float, banned: Tensor) -> Tensor:
    """A float32 tempered copy of ``chunk`` (never ``chunk`` itself: it is written)."""
    z = temper(chunk, temperature, banned)
    return z.clone() if z.data_ptr() == chunk.data_ptr() else z


class _TokenLogprob(torch.autograd.Function):
    """(R, V) logits, (R,) tokens -> (R,) log-probs and (R,) entropies (fp32)."""

    @staticmethod
    def forward(ctx, logits, tokens, temperature, banned, chunk_elems, with_entropy):
        R, V = logits.shape
        lp = logits.new_empty(R, dtype=torch.float32)
        lse = torch.empty_like(lp)
        ent = torch.empty_like(lp) if with_entropy else lp.new_empty(0)
        step = _rows(R, V, chunk_elems)
        for lo in range(0, R, step):
            hi = min(lo + step, R)
            z = _tempered(logits[lo:hi], temperature, banned)
            s = z.logsumexp(-1)
            lse[lo:hi] = s
            lp[lo:hi] = z.gather(-1, tokens[lo:hi, None]).squeeze(-1) - s
            if with_entropy:
                logp = z.sub_(s[:, None])
                ent[lo:hi] = -(logp.exp() * logp).sum(-1)  # banned ids: 0 * finite = 0
        ctx.save_for_backward(logits, tokens, lse, ent)
        ctx.temperature, ctx.banned, ctx.step = temperature, banned, step
        ctx.set_materialize_grads(False)
        return lp, ent

    @staticmethod
    def backward(ctx, grad_lp, grad_ent):
        logits, tokens, lse, ent = ctx.saved_tensors
        if not ctx.needs_input_grad[0]:
            return (None,) * 6
        R, V = logits.shape
        grad = torch.empty_like(logits)
        banned = ctx.banned.to(logits.device) if len(ctx.banned) else None
        with_entropy = grad_ent is not None and ent.numel() > 0
        if grad_lp is None:
            grad_lp = lse.new_zeros(R)
        for lo in range(0, R, ctx.step):
            hi = min(lo + ctx.step, R)
            logp = _tempered(logits[lo:hi], ctx.temperature, ctx.banned).sub_(lse[lo:hi, None])
            p = logp.exp()
            # d logp[token] / dz = onehot - p
            g = p.mul(-grad_lp[lo:hi, None])
            g.scatter_add_(-1, tokens[lo:hi, None], grad_lp[lo:hi, None].to(g.dtype))
            if with_entropy:  # dH / dz_j = -p_j (logp_j + H)
                g.sub_(p.mul_(logp.add_(ent[lo:hi, None])).mul_(grad_ent[lo:hi, None]))
            if ctx.temperature != 1.0:
                g.div_(ctx.temperature)
            if banned is not None:  # filled ids take no gradient (as index_fill's backward)
                g.index_fill_(-1, banned, 0.0)
            grad[lo:hi] = g
        return grad, None, None, None, None, None


def token_logprobs(
    logits: Tensor,
    tokens: Tensor,
    temperature: float = 1.0,
    banned: Tensor | None = None,
    *,
    with_entropy: bool = False,
    chunk_elems: int = CHUNK_ELEMS,
) -> Tensor | tuple[Tensor, Tensor]:
    """log softmax(logits / T)[token] for (..., V) logits and (...) tokens -> (...) fp32,
    with ``banned`` ids at the most negative float (``models.decode.temper``); with
    ``with_entropy`` also the (...) entropies of those distributions.

    Differentiable in ``logits``; computed ``chunk_elems`` float32 elements at a time,
    never the whole (..., V) in float32 (module docstring).

    >>> import math
    >>> lp = token_logprobs(torch.tensor([[0.0, math.log(3.0)]]), torch.tensor([1]))
    >>> round(lp.item(), 6) == round(math.log(0.75), 6)
    True
    """
    V = logits.shape[-1]
    lead = tokens.shape
    if logits.shape[:-1] != lead:
        raise ValueError(f"logits {tuple(logits.shape)} and tokens {tuple(lead)} do not match")
    banned = banned if banned is not None else torch.zeros(0, dtype=torch.long)
    lp, ent = _TokenLogprob.apply(
        logits.reshape(-1, V),
        tokens.reshape(-1).to(logits.device),
        float(temperature),
        banned,
        int(chunk_elems),
        bool(with_entropy),
    )
    if not with_entropy:
        return lp.view(lead)
    return lp.view(lead), ent.view(lead)
