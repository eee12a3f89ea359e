"""Balanced controllers: split a step's samples over P ranks so that every rank gets the
same number of samples and nearly the same training work.

Work per sample comes from a cost model that counts what training costs: text tokens
(policy forward/backward per token), vision tokens (the vision tower, per patch token)
and denoising transitions (one transformer call per trained step of a flow sample),
plus a quadratic attention term for long sequences. The partition is Karmarkar-Karp's
largest differencing method for k-way partitions with equal sizes (as verl's and
G-Core's sequence-length balancing): items are taken k at a time in cost order, each
k-tuple is one partial solution with one item per rank, and the two partial solutions
with the largest spread are merged, heaviest rank of one with lightest of the other,
until one remains.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class CostWeights:
    text_token: float = 1.0
    vision_token: float = 1.0
    transition: float = 1.0  # per trained denoising transition (flow)
    attention: float = 0.0  # per (text + vision tokens)^2: attention, for long sequences


def sample_cost(
    text_tokens: float = 0,
    vision_tokens: float = 0,
    transitions: float = 0,
    w: CostWeights = CostWeights(),  # noqa: B008 - frozen
) -> float:
    seq = text_tokens + vision_tokens
    return (
        w.text_token * text_tokens
        + w.vision_token * vision_tokens
        + w.transition * transitions
        + w.attention * seq * seq
    )


class _State:
    """A partial solution: k sets (item ids and sums), ordered by sum, heaviest first."""

    __slots__ = ("sets", "sums")

    def __init__(self, sets: list[list[int]], sums: list[float]):
        order = sorted(range(len(sums)), key=lambda i: -sums[i])
        self.sets = [sets[i] for i in order]
        self.sums = [sums[i] for i in order]

    @property
    def spread(self) -> float:
        return self.sums[0] - self.sums[-1]

    def merge(self, other: _State) -> _State:
        k = len(self.sums)
        sets = [self.sets[i] + other.sets[k - 1 - i] for i in range(k)]
        sums = [self.sums[i] + other.sums[k - 1 - i] for i in range(k)]
        return _State(sets, sums)


def karmarkar_karp(costs: Sequence[float], k: int, equal_size: bool = True) -> list[list[int]]:
    """Indices of ``costs`` in ``k`` parts with near-equal sums (largest differencing).

    ``equal_size``: every part gets the same number of items (``len(costs)`` must be a
    multiple of ``k``). Parts come back heaviest first, each part's indices sorted."""
    n = len(costs)
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    if equal_size and n % k:
        raise ValueError(f"equal-size partition of {n} items into {k} parts: {n} % {k} != 0")
    order = sorted(range(n), key=lambda i: costs[i])
    heap: list[tuple[float, int, _State]] = []
    if equal_size:
        seeds = [order[i : i + k] for i in range(0, n, k)]
        for s in seeds:
            st = _State([[i] for i in s], [float(costs[i]) for i in s])
            heapq.heappush(heap, (-st.spread, len(heap), st))
    else:
        for i in order:
            sets = [[i]] + [[] for _ in range(k - 1)]
            st = _State(sets, [float(costs[i])] + [0.0] * (k - 1))
            heapq.heappush(heap, (-st.spread, len(heap), st))
    if not heap:
        return [[] for _ in range(k)]
    tick = len(heap)
    while len(heap) > 1:
        _, _, a = heapq.heappop(heap)
        _, _, b = heapq.heappop(heap)
        m = a.merge(b)
        heapq.heappush(heap, (-m.spread, tick, m))
        tick += 1
    return [sorted(s) for s in heap[0][2].sets]


def max_over_mean(sums: Sequence[float]) -> float:
    """max / mean of per-rank sums (1.0 = perfectly balanced, and when all are zero)."""
    mean = sum(sums) / len(sums)
    return max(sums) / mean if mean > 0 else 1.0


def imbalance(costs: Sequence[float], parts: Sequence[Sequence[int]]) -> float:
    """max / mean of the parts' summed costs (1.0 = perfectly balanced)."""
    return max_over_mean([sum(costs[i] for i in p) for p in parts])


def choose_parts(costs: list[float], owner: list[int], P: int) -> list[list[int]]:
    """The groups in ``P`` parts (Karmarkar-Karp, equal sizes where the count allows),
    or as the ranks hold them when that partition's heaviest part is no lighter: a
    move that balances nothing costs a transfer and buys nothing."""
    equal = len(costs) % P == 0
    parts = karmarkar_karp(costs, P, equal_size=equal)
    held = [[g for g in range(len(costs)) if owner[g] == r] for r in range(P)]
    even = not equal or len({len(h) for h in held}) == 1
    if even and _heaviest(costs, parts) >= _heaviest(costs, held) - 1e-9:
        return held
    return parts


def _heaviest(costs: list[float], parts: list[list[int]]) -> float:
    return max(sum(costs[g] for g in p) for p in parts)


def assign_parts(parts: list[list[int]], owner: list[int], P: int) -> list[int]:
    """Rank for each part: greedily the pairs (part, rank) sharing the most samples
    first, so that as few samples as possible move."""
    pairs = []
    for p, items in enumerate(parts):
        count = [0] * P
        for g in items:
            count[owner[g]] += 1
        pairs += [(-count[r], p, r) for r in range(P)]
    rank_of, used = [-1] * len(parts), set()
    for _, p, r in sorted(pairs):
        if rank_of[p] < 0 and r not in used:
            rank_of[p], used = r, used | {r}
    return rank_of
