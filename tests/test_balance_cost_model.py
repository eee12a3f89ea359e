"""The balancer's cost model (mmyatt/placement/cost_model.py) and its decisions
(balancer.py) against hand-worked shapes, fits and plans; no process group."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mmyatt.distributed import Dist
from mmyatt.placement.balancer import Balancer, Settings
from mmyatt.placement.cost_model import (
    CostModel,
    GroupShape,
    features,
    group_shapes,
    length_buckets,
    nnls,
    rank_seconds,
)
from mmyatt.placement.exchange import token_plan
from mmyatt.rollout import Rollout


def _group(prompt: int, actions: list[int], elements: int = 10) -> GroupShape:
    return GroupShape(rows=len(actions), prompt=prompt, actions=tuple(actions), elements=elements)


def test_features_count_the_padding_a_pass_runs():
    a, b = _group(10, [4, 2]), _group(3, [6, 6, 1])
    # one call; prompts 2 x widest 10 + rows 5 x longest completion 6 = 50 tokens;
    # query-key pairs 2 x 10 x 10 + 5 x 6 x (10 + 6) = 680
    assert features([a, b]) == [1.0, 50.0, 680.0, 0.0, 0.0, 0.0]
    assert features([a]) == [1.0, 10 + 2 * 4, 100 + 2 * 4 * 14, 0.0, 0.0, 0.0]
    assert features([]) == [0.0] * 6


def test_group_shapes_of_a_text_rollout():
    # two groups: p0 (prompt 3 of width 4, 2 rows) and p1 (prompt 1, 1 row), 3 actions
    attn = torch.tensor([[0, 1, 1, 1, 1, 1, 1], [0, 1, 1, 1, 1, 1, 1], [0, 0, 0, 1, 1, 1, 1]])
    mask = torch.tensor([[1.0, 1, 0], [1, 1, 1], [1, 0, 0]])
    r = Rollout(
        ["p0", "p0", "p1"],
        torch.zeros(3, 3, dtype=torch.long),
        torch.zeros(3, 3),
        mask,
        {"input_ids": attn.clone(), "attention_mask": attn},
        ["x"] * 3,
        [{}] * 3,
    )
    a, b = group_shapes(r, "text")
    assert (a.rows, a.prompt, a.actions) == (2, 3, (2, 3))
    assert (b.rows, b.prompt, b.actions) == (1, 1, (1,))
    # what travels per row: input_ids + attention_mask (7 each) + 3 action tensors of 3
    assert a.elements == 2 * (7 + 7 + 9)


def test_length_buckets_split_where_a_call_is_cheaper_than_padding():
    long_a, long_b = _group(40, [8] * 4), _group(38, [8] * 4)
    short_a, short_b = _group(2, [8] * 4), _group(3, [8] * 4)
    groups = [long_a, short_a, long_b, short_b]
    # a call costing 20 tokens: together 4 x 40 + 16 x 8 = 288 + 20; apart the shorts
    # pay 2 x 3 + 8 x 8 = 70 + 20 and the longs 2 x 40 + 64 = 144 + 20: 254 < 308
    cost = lambda x: 20 * x[0] + x[1]  # noqa: E731
    assert length_buckets(groups, cost) == [[1, 3], [0, 2]]
    # a call costing 200 tokens: one pass is cheaper (488 against 614)
    cost = lambda x: 200 * x[0] + x[1]  # noqa: E731
    assert length_buckets(groups, cost) == [[0, 1, 2, 3]]
    # a budget of 140 padded tokens: no run of two or more groups pads over it (the
    # longs together pad to 144)
    assert length_buckets(groups, cost, budget=140) == [[1, 3], [2], [0]]


def _buckets_by_features(groups, cost, budget=0):
    """The cut ``length_buckets`` makes, with every run's features computed from scratch
    by ``features`` (the definition its one-group-at-a-time sums must agree with)."""
    n = len(groups)
    order = sorted(range(n), key=lambda i: (groups[i].width, groups[i].prompt, i))
    best, cut = [0.0] + [float("inf")] * n, [0] * (n + 1)
    for end in range(1, n + 1):
        for start in range(end - 1, -1, -1):
            x = features([groups[i] for i in order[start:end]])
            if budget > 0 and end - start > 1 and x[1] > budget:
                break
            if best[start] + cost(x) < best[end]:
                best[end], cut[end] = best[start] + cost(x), start
    runs, end = [], n
    while end > 0:
        runs.append(sorted(order[cut[end] : end]))
        end = cut[end]
    return runs[::-1]


@pytest.mark.parametrize("seed", range(20))
def test_length_buckets_agree_with_features_of_every_run(seed):
    rng = np.random.default_rng(seed)
    groups = [
        GroupShape(
            rows=int(rng.integers(1, 9)),
            prompt=int(rng.integers(1, 80)),
            actions=tuple(int(a) for a in rng.integers(0, 48, size=int(rng.integers(1, 9)))),
            image_patches=int(rng.integers(0, 3)) * 64,
            clip_patches=int(rng.integers(0, 3)) * 256,
            transitions=int(rng.integers(0, 4)),
        )
        for _ in range(int(rng.integers(1, 13)))
    ]
    coef = rng.uniform(0, 1, size=6) * np.array([500, 1, 1e-2, 1, 1, 50])
    cost = lambda x: float(np.dot(coef, x))  # noqa: E731
    for budget in (0, 400, 2000):
        assert length_buckets(groups, cost, budget) == _buckets_by_features(groups, cost, budget)


def test_nnls_by_hand():
    X = np.array([[1.0, 0], [1, 10], [1, 20], [1, 30]])
    y = 0.5 + 0.1 * X[:, 1]
    assert nnls(X, y) == pytest.approx([0.5, 0.1])
    # a line falling with x: a negative slope is not allowed, the mean is the best
    assert nnls(X, np.array([4.0, 3, 2, 1])) == pytest.approx([2.5, 0.0])


def test_cost_model_fits_each_pass_kind_on_its_own():
    obs = [("train", [1.0, t, 0, 0, 0, 0], 0.01 + 0.001 * t) for t in (10, 50, 200)]
    obs += [("no_grad", [1.0, t, 0, 0, 0, 0], 0.002 + 0.0002 * t) for t in (10, 100)]
    m = CostModel()
    m.fit(obs)
    assert m.predict([1, 100, 0, 0, 0, 0]) == pytest.approx(0.11)
    assert m.predict([1, 100, 0, 0, 0, 0], "no_grad") == pytest.approx(0.022)
    # a rank: 2 epochs over one minibatch of one group (width 10 + 2 x 5 = 20 tokens),
    # and one no-grad pass over it
    train, ng = rank_seconds(m, [[_group(10, [5, 5])]], epochs=2, no_grad_passes=1)
    assert train == [pytest.approx(2 * (0.01 + 0.02))] and ng == pytest.approx(0.006)


def _balancer(when="pays", **kw) -> Balancer:
    b = Balancer(Dist(0, 2), "text", Settings(when=when, fit_steps=1, **kw), token_plan)
    # a call 5 ms, a padded token 0.1 ms
    b.model.fit([("train", [1.0, t, 0, 0, 0, 0], 0.005 + 1e-4 * t) for t in (50, 200, 400)])
    b.steps = 5
    return b


def _skewed():
    # rank 0 holds two long-prompt groups, rank 1 two short ones; all 8 rows x 8 actions
    long_, short = _group(60, [8] * 8, elements=100), _group(2, [8] * 8, elements=100)
    return [([[long_, long_]], [[2.0, 2.0]]), ([[short, short]], [[1.0, 1.0]])]


def test_a_skewed_step_moves_a_long_group_when_the_exchange_is_cheap():
    b = _balancer()
    b.exchanges = [(100.0, 1e-4), (300.0, 3e-4)]  # measured: 1 us per element moved
    plan = b._decide(_skewed())
    assert plan.applied and plan.stats["balance/applied"] == 1.0
    # one long and one short group per rank, whichever moved
    assert sorted(plan.dest[0][:2]) == [0, 1] and sorted(plan.dest[0][2:]) == [0, 1]
    # before, rank 0 in one pass: 2 x 60 + 16 x 8 = 248 tokens, 0.0298 s; after, each
    # rank in two buckets: 5 ms x 2 + 0.1 ms x (60 + 64 + 2 + 64) = 0.029 s
    assert plan.predicted == pytest.approx([0.029, 0.029])
    assert plan.stats["balance/predicted_gain_s"] == pytest.approx(0.0008)
    assert plan.stats["balance/predicted_exchange_s"] == pytest.approx(200e-6)


def test_no_move_when_the_exchange_costs_more_than_it_saves():
    b = _balancer()
    b.exchanges = [(100.0, 1.0), (300.0, 3.0)]  # 10 ms per element moved
    plan = b._decide(_skewed())
    assert not plan.applied and plan.dest == plan.owner
    assert plan.stats["balance/applied"] == 0.0


def test_no_move_for_a_gain_within_the_models_recent_error():
    # the skewed step's predicted gain is 0.8 ms and its exchange 0.2 ms (above); the
    # update with the groups held is predicted at 29.8 ms
    b = _balancer()
    b.exchanges = [(100.0, 1e-4), (300.0, 3e-4)]
    b.errors = [0.02, 0.04]  # the model has been off by 3% lately: 0.894 ms of noise
    plan = b._decide(_skewed())
    assert plan.stats["balance/predicted_margin_s"] == pytest.approx(0.03 * 0.0298)
    assert not plan.applied and plan.dest == plan.owner
    b.errors = [0.01]  # 0.298 ms: 0.8 ms beats 0.2 + 0.298
    assert b._decide(_skewed()).applied
    again = Balancer(Dist(0, 2), "text", Settings(fit_steps=1), token_plan)
    again.load_state_dict(b.state_dict())  # the errors are run state: resume plans alike
    assert again.errors == [0.01]


def test_no_move_on_a_balanced_step_or_while_fitting():
    b = _balancer()
    g = _group(30, [8] * 8)
    even = [([[g, g]], [[1.0, 1.0]]), ([[g, g]], [[1.0, 1.0]])]
    assert not b._decide(even).applied
    b.steps = 0  # the first steps measure
    plan = b._decide(_skewed())
    assert not plan.applied and plan.stats["placement/balance_before"] == pytest.approx(4 / 3)


def test_always_moves_by_token_counts():
    plan = _balancer(when="always")._decide(_skewed())
    assert plan.applied and plan.stats["placement/balance_after"] == 1.0


def test_state_round_trip_plans_the_same():
    b = _balancer()
    b.exchanges = [(100.0, 1e-4), (300.0, 3e-4)]
    b.observations = [("train", [1.0, 50.0, 0, 0, 0, 0], 0.01)]
    again = Balancer(Dist(0, 2), "text", Settings(fit_steps=1), token_plan)
    again.load_state_dict(b.state_dict())
    assert again.model.coef == b.model.coef and again.steps == b.steps
    assert again._decide(_skewed()).dest == b._decide(_skewed()).dest


def test_idle_is_nothing_for_one_controller():
    d = Dist()
    d.wait_for_slowest()
    assert d.idle_metrics() == {} and d.idle_s == 0.0


def test_moving_goes_on_only_while_it_measures_faster():
    b = _balancer()
    b.exchanges = [(100.0, 1e-4), (300.0, 3e-4)]
    b.realized = {"applied": [1.0], "held": []}  # moved once; holding not measured yet
    assert not b._decide(_skewed()).applied
    b.realized = {"applied": [1.2, 1.1], "held": [1.0]}  # moving measured slower
    assert not b._decide(_skewed()).applied and b.declined == 2
    b.realized = {"applied": [0.9], "held": [1.0, 1.05]}  # moving measured faster
    assert b._decide(_skewed()).applied
    b.realized = {"applied": [1.2], "held": [1.0]}
    b.declined = 10  # after 10 declined steps, moving is tried once more
    assert b._decide(_skewed()).applied and b.declined == 0
