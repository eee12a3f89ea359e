"""Micro-batches of a bounded padded width (``algorithm.micro_batch_tokens``,
mmyatt/step/batches.py) against hand-worked cuts; every row once, the budget kept; as many
micro-batches on every rank (``to_count``, ``batches.micro_parts``)."""

from __future__ import annotations

import random

import pytest
import torch

from mmyatt.rollout import Rollout
from mmyatt.step.batches import (
    group_index,
    micro_batch_cost,
    micro_parts,
    row_widths,
    to_count,
    token_micro_batches,
)

P, A = 4, 4  # prompt and action columns


def _rollout(rows: list[tuple[str, int, int]]) -> Rollout:
    """One sample per (prompt id, prompt tokens, completion tokens); prompts left-padded
    to P columns, completions right-padded to A."""
    n = len(rows)
    attn = torch.zeros(n, P + A, dtype=torch.long)
    mask = torch.zeros(n, A)
    for i, (_, p, a) in enumerate(rows):
        attn[i, P - p : P + a] = 1
        mask[i, :a] = 1
    return Rollout(
        [pid for pid, _, _ in rows],
        torch.zeros(n, A, dtype=torch.long),
        torch.zeros(n, A),
        mask,
        {"input_ids": attn.clone(), "attention_mask": attn, "temperature": 1.0},
        [""] * n,
        [{}] * n,
    )


# groups: a (prompt 3; completions 2, 1), b (prompt 1; 4, 4), c (prompt 4; 4)
ROWS = [("a", 3, 2), ("a", 3, 1), ("b", 1, 4), ("b", 1, 4), ("c", 4, 4)]


def _random_rows(rng: random.Random) -> list[tuple[str, int, int]]:
    """1-6 groups of 1-5 rows, each group one prompt width, each row its own length."""
    rows = []
    for g in range(rng.randint(1, 6)):
        p = rng.randint(1, P)
        rows += [(f"g{g}", p, rng.randint(0, A)) for _ in range(rng.randint(1, 5))]
    return rows


def test_row_widths():
    assert row_widths(_rollout(ROWS)) == ([3, 3, 1, 1, 4], [2, 1, 4, 4, 4])


def test_cuts_by_hand():
    r = _rollout(ROWS)
    # cost = prompts x widest prompt + rows x longest completion. Completions 2 1 4 4 4:
    # longest first, ties in order: 2 3 4 0 1. Budget 16: 2 + 3 (one prompt, b) = 1 x 1 +
    # 2 x 4 = 9; + 4 = 2 x 4 + 3 x 4 = 20 > 16. 4 + 0 = 2 x 4 + 2 x 4 = 16; + 1 = 20.
    # Each micro-batch keeps the rows' order.
    assert token_micro_batches(r, 16) == [[2, 3], [0, 4], [1]]
    # budget 24: 2 3 4 = 20 fits, + 0 = 3 x 4 + 4 x 4 = 28 does not; 0 + 1 = 3 + 2 x 2 = 7
    assert token_micro_batches(r, 24) == [[2, 3, 4], [0, 1]]
    # budget 6: no two rows fit (0 + 1, one prompt, is 7); row 4 (8) alone
    assert token_micro_batches(r, 6) == [[2], [3], [4], [0], [1]]
    # 0: one pass over everything, in order
    assert token_micro_batches(r, 0) == [[0, 1, 2, 3, 4]]


def test_a_group_shares_its_prompt_in_the_cost():
    r = _rollout(ROWS)
    prompt, action = row_widths(r)
    assert micro_batch_cost(r, [0, 1], prompt, action) == 1 * 3 + 2 * 2
    assert micro_batch_cost(r, [0, 2, 4], prompt, action) == 3 * 4 + 3 * 4


def test_every_row_once_and_the_budget_kept():
    rng = random.Random(0)
    for trial in range(50):
        rows = _random_rows(rng)
        r, budget = _rollout(rows), rng.randint(1, 40)
        parts = token_micro_batches(r, budget)
        assert sorted(i for part in parts for i in part) == list(range(len(rows))), trial
        prompt, action = row_widths(r)
        for part in parts:
            cost = micro_batch_cost(r, part, prompt, action)
            assert cost <= budget or len(part) == 1, (trial, part, cost)
            assert part == sorted(part)


def test_whole_groups_cut_by_hand():
    r = _rollout(ROWS)
    # groups by longest completion: b (4), c (4), a (2). Budget 16: b = 1 x 1 + 2 x 4 = 9;
    # + c = 2 x 4 + 3 x 4 = 20 > 16; c + a = 2 x 4 + 3 x 4 = 20 > 16.
    assert token_micro_batches(r, 16, whole_groups=True) == [[2, 3], [4], [0, 1]]
    # budget 24: b + c = 20 fits; + a = 3 x 4 + 5 x 4 = 32 does not
    assert token_micro_batches(r, 24, whole_groups=True) == [[2, 3, 4], [0, 1]]
    # budget 6: a group over the budget is a micro-batch of its own, never split
    assert token_micro_batches(r, 6, whole_groups=True) == [[2, 3], [4], [0, 1]]


def test_to_count_by_hand():
    r = _rollout(ROWS)
    parts = [[2, 3, 4], [0, 1]]  # the budget-24 cut
    # 3: the costlier (20) is cut. Longest first 2 3 4: after 2, 1 + 4 = 5 and two
    # prompts 2 x 4 + 2 x 4 = 16; after 3, 1 + 2 x 4 = 9 and 4 + 4 = 8: worst 9, taken.
    assert to_count(r, parts, 3) == [[2, 3], [4], [0, 1]]
    # 4: [2, 3] (9) before [0, 1] (3 + 2 x 2 = 7); [4] is one row. 5: then [0, 1].
    assert to_count(r, parts, 4) == [[2], [3], [4], [0, 1]]
    assert to_count(r, parts, 5) == [[2], [3], [4], [0], [1]]
    # 6: no micro-batch has two rows left; an empty one makes up the count
    assert to_count(r, parts, 6) == [[2], [3], [4], [0], [1], []]
    # whole groups: [2, 3, 4] holds b and c, cut between them; then no part has two groups
    assert to_count(r, parts, 3, whole_groups=True) == [[2, 3], [4], [0, 1]]
    assert to_count(r, parts, 5, whole_groups=True) == [[2, 3], [4], [0, 1], [], []]
    assert to_count(r, parts, 2) == parts
    with pytest.raises(ValueError, match="cannot make 2 micro-batches into 1"):
        to_count(r, parts, 1)


class _Ranks:
    """A stand-in for ``Dist``: this rank's count beside another rank's."""

    def __init__(self, other: int):
        self.other = other

    def gather_ints(self, value: int) -> list[int]:
        return [value, self.other]


def test_every_rank_runs_the_fullest_ranks_count():
    r = _rollout(ROWS)  # 2 micro-batches here at budget 24; the other rank has 5
    assert micro_parts(r, 24, _Ranks(5), lockstep=False) == [[2], [3], [4], [0], [1]]
    # a sharded engine keeps groups whole: empty micro-batches (zero-weight passes)
    assert micro_parts(r, 24, _Ranks(5), lockstep=True) == [[2, 3], [4], [0, 1], [], []]
    assert micro_parts(None, 24, _Ranks(3), lockstep=True) == [[], [], []]
    assert micro_parts(r, 24, _Ranks(1), lockstep=False) == [[2, 3, 4], [0, 1]]
    assert micro_parts(r, 0, None, lockstep=False) == [[0, 1, 2, 3, 4]]  # no collective


def test_to_count_every_row_once_groups_whole():
    rng = random.Random(1)
    for trial in range(50):
        rows = _random_rows(rng)
        r, whole = _rollout(rows), bool(trial % 2)
        parts = token_micro_batches(r, rng.randint(1, 40), whole_groups=whole)
        count = len(parts) + rng.randint(0, 6)
        out = to_count(r, parts, count, whole_groups=whole)
        assert len(out) == count, trial
        assert sorted(i for part in out for i in part) == list(range(len(rows))), trial
        assert all(part == sorted(part) for part in out)
        if whole:
            index = group_index(r).tolist()
            for part in parts + out:
                groups = {index[i] for i in part}
                assert sum(index.count(g) for g in groups) == len(part), (trial, part)
