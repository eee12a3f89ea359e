"""Karmarkar-Karp balancing of training work across controllers, against hand-worked
partitions, and the max/mean rank work before and after on a skewed workload."""

from __future__ import annotations

import random

import pytest

from mmyatt.placement.balance import CostWeights, imbalance, karmarkar_karp, sample_cost


def test_two_way_equal_size_by_hand():
    # sorted 3 4 5 6 7 8 -> pairs (4|3) (6|5) (8|7), spread 1 each; merge the first two,
    # heaviest with lightest: (4+5 | 3+6) = (9 | 9), kept in that order; then (8|7) with
    # it: 8 joins the last set (3+6), 7 the first (4+5): {8, 3, 6} = 17 | {7, 4, 5} = 16
    costs = [8, 7, 6, 5, 4, 3]
    assert karmarkar_karp(costs, 2) == [[0, 2, 5], [1, 3, 4]]
    assert imbalance(costs, karmarkar_karp(costs, 2)) == pytest.approx(17 / 16.5)


def test_three_way_equal_size_by_hand():
    # (3|2|1) + (6|5|4) -> 3+4 | 2+5 | 1+6 = 7 | 7 | 7
    costs = [1, 2, 3, 4, 5, 6]
    assert karmarkar_karp(costs, 3) == [[2, 3], [1, 4], [0, 5]]
    assert imbalance(costs, karmarkar_karp(costs, 3)) == 1.0


def test_unequal_sizes_allowed_when_asked():
    # one big item against many small ones: 9 | 3+3+3
    parts = karmarkar_karp([9, 3, 3, 3], 2, equal_size=False)
    assert sorted(map(sorted, parts)) == [[0], [1, 2, 3]]
    with pytest.raises(ValueError, match="5 % 2 != 0"):
        karmarkar_karp([1] * 5, 2)


def test_cost_model_counts_text_vision_and_transitions():
    w = CostWeights(text_token=1.0, vision_token=0.5, transition=20.0, attention=0.01)
    # 30 text + 10 vision tokens: 30 + 5 + 0.01 * 40^2 = 51; 6 transitions: 120
    assert sample_cost(30, 10, 0, w) == pytest.approx(51.0)
    assert sample_cost(0, 0, 6, w) == pytest.approx(120.0)


def test_skewed_workload_balanced_within_ten_percent():
    rng = random.Random(0)
    P, per = 4, 32
    # rank r drew prompts whose completions are (r + 1) times longer, plus images on rank 3
    costs = []
    for r in range(P):
        for _ in range(per):
            text = rng.randint(8, 64) * (r + 1)
            vision = 256 if r == 3 else 0
            costs.append(sample_cost(text, vision))
    before = [list(range(r * per, (r + 1) * per)) for r in range(P)]
    after = karmarkar_karp(costs, P)
    assert all(len(p) == per for p in after)  # every rank trains the same number of samples
    assert imbalance(costs, before) > 1.5
    assert imbalance(costs, after) <= 1.10
