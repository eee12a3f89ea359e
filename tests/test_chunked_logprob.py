"""models/logprobs.py: the taken tokens' log-probs and entropies chunk by chunk equal the
full float32 computation (values and gradients), on a hand-worked case and on random
logits with temperature, banned ids and chunks that do not divide the rows."""

import math

import pytest
import torch

from mmyatt.models import decode
from mmyatt.models.logprobs import token_logprobs


def _full(logits, tokens, temperature, banned):
    """The computation the adapters made before: one fp32 log-softmax over everything."""
    z = decode.temper(logits, temperature, banned)
    logp = z.log_softmax(-1)
    lp = logp.gather(-1, tokens[..., None]).squeeze(-1)
    return lp, -(logp.exp() * logp).sum(-1)


def test_hand_worked_two_token_case():
    # logits (0, ln 3) at T = 1: p = (1/4, 3/4); at T = 2 logits (0, ln 9) give the same
    for logits, t in (([0.0, math.log(3.0)], 1.0), ([0.0, math.log(9.0)], 2.0)):
        x = torch.tensor([logits, logits])
        lp, ent = token_logprobs(x, torch.tensor([1, 0]), t, with_entropy=True)
        assert lp.tolist() == pytest.approx([math.log(0.75), math.log(0.25)], abs=1e-6)
        h = -(0.25 * math.log(0.25) + 0.75 * math.log(0.75))
        assert ent.tolist() == pytest.approx([h, h], abs=1e-6)
    # a banned id takes no mass: (0, ln 3, 5) with id 2 banned is the two-token case
    x = torch.tensor([[0.0, math.log(3.0), 5.0]], requires_grad=True)
    lp, ent = token_logprobs(x, torch.tensor([1]), 1.0, torch.tensor([2]), with_entropy=True)
    assert lp.item() == pytest.approx(math.log(0.75), abs=1e-6)
    assert ent.item() == pytest.approx(h, abs=1e-6)
    lp.sum().backward()  # d logp_1 / dz = onehot(1) - p = (-1/4, 1/4, 0)
    assert x.grad[0].tolist() == pytest.approx([-0.25, 0.25, 0.0], abs=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_chunked_equals_full_in_values_and_gradients(dtype, temperature):
    g = torch.Generator().manual_seed(0)
    N, L, V = 3, 7, 50
    base = (3 * torch.randn(N, L, V, generator=g)).to(dtype)
    tokens = torch.randint(0, V - 2, (N, L), generator=g)
    banned = torch.tensor([V - 2, V - 1])
    # entropy weights below 1: the full path's gradient at a banned id is 0 * (w x the
    # most negative float), which is 0 * -inf = NaN once |w| > 1 (the chunked one is 0)
    w_lp, w_ent = torch.randn(N, L, generator=g), torch.rand(N, L, generator=g) - 0.5
    grads, outs = [], []
    for chunked in (False, True):
        x = base.clone().requires_grad_(True)
        if chunked:  # 2 rows of V per chunk: 21 rows in 11 chunks, the last a single row
            lp, ent = token_logprobs(
                x, tokens, temperature, banned, with_entropy=True, chunk_elems=2 * V
            )
        else:
            lp, ent = _full(x, tokens, temperature, banned)
        ((lp * w_lp).sum() + (ent * w_ent).sum()).backward()
        outs.append((lp.detach(), ent.detach()))
        grads.append(x.grad.float())
        assert x.grad.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 1e-2  # bf16 gradients round at ~3 digits
    torch.testing.assert_close(outs[1][0], outs[0][0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(outs[1][1], outs[0][1], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(grads[1], grads[0], atol=tol, rtol=tol)
    assert grads[1][..., banned].abs().sum() == 0
    x = base.clone().requires_grad_(True)
    _, ent = token_logprobs(x, tokens, temperature, banned, with_entropy=True, chunk_elems=2 * V)
    (4.0 * ent).sum().backward()
    assert torch.isfinite(x.grad).all()


def test_log_probs_alone_and_the_input_is_left_unchanged():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(4, 9, generator=g, requires_grad=True)
    before = x.detach().clone()
    tokens = torch.randint(0, 9, (4,), generator=g)
    lp = token_logprobs(x, tokens, chunk_elems=9)  # one row per chunk, T = 1, no bans
    torch.testing.assert_close(lp, torch.log_softmax(before, -1)[torch.arange(4), tokens])
    lp.sum().backward()
    assert torch.equal(x.detach(), before)  # fp32 at T = 1: the chunk must be a copy
    want = torch.nn.functional.one_hot(tokens, 9) - before.softmax(-1)
    torch.testing.assert_close(x.grad, want)
    with pytest.raises(ValueError, match="do not match"):
        token_logprobs(x, tokens[:3])
