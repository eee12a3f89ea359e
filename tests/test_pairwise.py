"""Pairwise GenRM: win-rate bookkeeping, position swapping against a biased judge, swap
consistency, parse failures, groups kept apart, and the verdict derived from P(Yes)."""

from __future__ import annotations

import math

import pytest
import torch

from mmyatt.rewards.genrm import GenRMReward
from mmyatt.rewards.pairwise import bradley_terry, pair_schedule, win_rates


def _sig(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x))


def _resp(tokens: dict[str, float] | None) -> dict:
    """A chat-completions response whose first answer token has these probabilities."""
    if tokens is None:  # a server that returned no logprobs: no verdict
        return {"choices": [{"message": {"content": "?"}}]}
    top = [{"token": t, "logprob": math.log(p)} for t, p in tokens.items()]
    best = max(top, key=lambda x: x["logprob"])
    content = [{"token": best["token"], "logprob": best["logprob"], "top_logprobs": top}]
    return {"choices": [{"logprobs": {"content": content}}]}


class PairJudge:
    """Outputs are quality numbers sent as 'q:<value>'; the judge says "1" with
    probability sigmoid(q_first - q_second + bias): bias > 0 favours the first position."""

    def __init__(self, bias: float = 0.0, fail_every: int = 0):
        self.bias, self.fail_every, self.bodies = bias, fail_every, []

    def chat_many(self, bodies):
        out = []
        for body in bodies:
            self.bodies.append(body)
            imgs = [
                float(p["image_url"]["url"][2:])
                for p in body["messages"][-1]["content"]
                if p["type"] == "image_url"
            ]
            if self.fail_every and len(self.bodies) % self.fail_every == 0:
                out.append(_resp(None))
            elif len(imgs) == 2:
                p1 = _sig(imgs[0] - imgs[1] + self.bias)
                out.append(_resp({"1": p1, "2": 1 - p1}))
            else:  # pointwise Yes/No: P(Yes) = sigmoid(q)
                py = _sig(imgs[0])
                out.append(_resp({"Yes": py, "No": 1 - py}))
        return out


def _reward(judge, **kw) -> GenRMReward:
    return GenRMReward(judge, mode="pairwise", encode=lambda q: f"q:{q}", **kw)


RECORDS = [{"prompt": "a red circle"}] * 3 + [{"prompt": "a blue square"}] * 2
IDS = ["a", "a", "a", "b", "b"]
QUALITY = [2.0, 0.0, 1.0, -1.0, 0.5]


def test_win_rates_hand_worked():
    # pair (0,1): a first 0.9, b first 0.2 -> a wins (0.9 + 0.8) / 2 = 0.85, consistent
    # pair (0,2): 0.8 / 0.6 -> a wins (0.8 + 0.4) / 2 = 0.6; first order says a, the
    #   swapped order says its first (2): inconsistent
    # pair (1,2): 0.5 / 0.5 -> 0.5 each, a tie: inconsistent
    w, c, f = win_rates(3, [(0, 1), (0, 2), (1, 2)], [0.9, 0.8, 0.5], [0.2, 0.6, 0.5])
    assert w == pytest.approx([(0.85 + 0.6) / 2, (0.15 + 0.5) / 2, (0.4 + 0.5) / 2])
    assert c == [0.5, 0.5, 0.0] and f == [0.0, 0.0, 0.0]
    # a missing verdict is a tie and counted; a sample without pairs gets 1/2
    w, c, f = win_rates(3, [(0, 1)], [None], [0.3])
    assert w == pytest.approx([(0.5 + 0.7) / 2, 1 - 0.6, 0.5])
    assert f == [0.5, 0.5, 0.0] and c == [0.0, 0.0, 1.0]


def test_pair_schedule_stays_in_groups_and_balances():
    assert pair_schedule([2, 2]) == [(0, 1), (2, 3)]
    pairs = pair_schedule([8, 8], max_opponents=4)
    counts = [sum(i in p for p in pairs) for i in range(16)]
    assert counts == [4] * 16
    assert all((a < 8) == (b < 8) for a, b in pairs)
    assert len(pair_schedule([8])) == 28


def test_unbiased_judge_ranks_by_quality():
    judge = PairJudge()
    total, parts = _reward(judge)(QUALITY, RECORDS, IDS)
    # 3 + 1 pairs, each asked in both orders; never across groups
    assert len(judge.bodies) == 8
    # swapped order of an unbiased judge gives 1 - p, so a's win probability is sigmoid(qa - qb)
    want = [
        (_sig(2.0) + _sig(1.0)) / 2,
        (_sig(-2.0) + _sig(-1.0)) / 2,
        (_sig(-1.0) + _sig(1.0)) / 2,
        _sig(-1.5),
        _sig(1.5),
    ]
    assert total.tolist() == pytest.approx(want, abs=1e-6)
    assert torch.equal(parts["genrm"], total)
    assert parts["genrm_swap_consistency"].tolist() == [1.0] * 5
    assert parts["genrm_parse_failed"].tolist() == [0.0] * 5
    # each group's win rates average 1/2
    assert float(total[:3].mean()) == pytest.approx(0.5)
    assert float(total[3:].mean()) == pytest.approx(0.5)


def test_position_swap_cancels_a_first_position_bias():
    plain = _reward(PairJudge())(QUALITY, RECORDS, IDS)[0]
    biased, parts = _reward(PairJudge(bias=3.0))(QUALITY, RECORDS, IDS)
    # still ordered like the quality within each group, and still centred on 1/2
    assert torch.argsort(biased[:3]).tolist() == torch.argsort(plain[:3]).tolist()
    assert biased[4] > biased[3] and float(biased[:3].mean()) == pytest.approx(0.5)
    # pair (3, 4): d = -1.5; w_3 = (sig(d + 3) + 1 - sig(-d + 3)) / 2
    assert float(biased[3]) == pytest.approx((_sig(1.5) + 1 - _sig(4.5)) / 2, abs=1e-6)
    # the bias makes the judge pick the first image in both orders of every pair here
    assert parts["genrm_swap_consistency"].tolist() == [0.0] * 5
    # a judge that always says "1" gives no signal: every win rate is exactly 1/2
    always_first = _reward(PairJudge(bias=30.0))(QUALITY, RECORDS, IDS)[0]
    assert always_first.tolist() == pytest.approx([0.5] * 5, abs=1e-6)


def test_parse_failures_are_ties_and_reported():
    judge = PairJudge(fail_every=2)  # every swapped-order request fails
    reward = _reward(judge)
    total, parts = reward(QUALITY, RECORDS, IDS)
    assert parts["genrm_parse_failed"].tolist() == [0.5] * 5
    assert reward.stats["parse_failures"] == 4
    assert float(total[0]) == pytest.approx(((_sig(2) + 0.5) / 2 + (_sig(1) + 0.5) / 2) / 2)


def test_pairwise_requests_carry_two_images_and_the_question():
    judge = PairJudge()
    _reward(judge)(QUALITY[:2], RECORDS[:2], IDS[:2])
    first, swapped = judge.bodies
    parts = first["messages"][-1]["content"]
    assert [p["type"] for p in parts] == ["image_url", "image_url", "text"]
    assert [p["image_url"]["url"] for p in parts[:2]] == ["q:2.0", "q:0.0"]
    assert [p["image_url"]["url"] for p in swapped["messages"][-1]["content"][:2]] == [
        "q:0.0",
        "q:2.0",
    ]
    assert "a red circle" in parts[2]["text"] and "Answer 1 or 2" in parts[2]["text"]
    assert first["max_tokens"] == 1 and first["logprobs"] is True


def test_verdict_derived_from_yes_probabilities():
    judge = PairJudge()
    total, parts = _reward(judge, verdict="yes_prob")(QUALITY, RECORDS, IDS)
    assert len(judge.bodies) == 5  # one pointwise P(Yes) request per sample
    p = [_sig(q) for q in QUALITY]
    want0 = (bradley_terry(p[0], p[1]) + bradley_terry(p[0], p[2])) / 2
    assert float(total[0]) == pytest.approx(want0, abs=1e-6)
    assert float(total[4]) == pytest.approx(bradley_terry(p[4], p[3]), abs=1e-6)
    # order never enters a derived verdict: consistent by construction
    assert parts["genrm_swap_consistency"].tolist() == [1.0] * 5
    with pytest.raises(ValueError, match="verdict"):
        _reward(judge, verdict="coin")


def test_only_a_pairwise_term_makes_the_mixture_compare_groups():
    """Placement partial streams single samples to the judge unless a term's reward of a
    sample depends on its group (pairwise win rates): then it waits for whole groups."""
    from mmyatt.rewards.mixture import RewardMixture
    from mmyatt.rewards.rules import WeightedReward

    rule = ("rule", WeightedReward([{"name": "numeric_match"}]), 1.0, False)
    pointwise = GenRMReward(PairJudge(), mode="yes_prob", encode=lambda q: f"q:{q}")
    assert not RewardMixture([rule]).compares_groups
    assert not RewardMixture([rule, ("genrm", pointwise, 0.5, False)]).compares_groups
    assert RewardMixture([rule, ("genrm", _reward(PairJudge()), 0.5, False)]).compares_groups
