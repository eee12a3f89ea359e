"""Pairwise GenRM rewards: win rates within a prompt's group (``genrm`` with
``mode: pairwise``).

A pointwise judge scores each sample on its own (P(Yes) or a parsed score); such
absolute scores drift and saturate. A pairwise judge sees two samples of the same
prompt and says which is better (Pref-GRPO's win rate, UnifiedReward's "Image 1 is
better"); the reward of a sample is its **win rate** against the other samples of its
group, a number in [0, 1] that is already relative to the group.

Verdicts (``verdict``):

``"judge"`` (default)
    One request per ordered pair over the served judge API (OpenAI chat completions):
    the two images as two ``image_url`` parts, then the template's question (default
    ``pairwise_alignment``: "... Which image shows it better? Answer 1 or 2."), one
    answer token with ``top_logprobs``. P(first better) = P(1) / (P(1) + P(2)) over the
    spelling variants in ``first_tokens`` / ``second_tokens``. Every pair is asked in
    both orders (position swapping): the win probability of a over b is
    (P(first | a, b) + 1 - P(first | b, a)) / 2, which cancels a judge's preference for
    a position. Any VLM that reads two images per message works (vLLM / SGLang serving
    Qwen2-VL, UnifiedReward, ...).
``"yes_prob"``
    Derived from a pointwise Yes/No judge, for judges that cannot compare two images
    (the built-in tiny judge was trained on one image per question): each sample gets
    its P(Yes) = p from the same request as ``mode: yes_prob``, and the pair's verdict
    is the Bradley-Terry probability that a's Yes is right and b's is not,
    p_a (1 - p_b) / (p_a (1 - p_b) + p_b (1 - p_a)). The judge never sees the two
    samples together; this is a relative reward built from absolute verdicts, and its
    swap consistency is 1 by construction (order never enters).

``max_opponents``: None compares every pair of a group (G (G - 1) / 2 pairs, each asked
twice); k compares each sample with about k others on a circulant schedule (sample i
with i +- 1, ..., i +- ceil(k / 2) within its group), which keeps every sample's number
of comparisons equal.

Reported next to the reward, per sample (the mean is the batch figure):
``<name>_swap_consistency``, the fraction of the sample's pairs whose winner is the
same in both orders (a tie, P = 1/2, counts as inconsistent); ``<name>_parse_failed``,
the fraction of its verdicts the judge's answer did not give (scored as a tie, 1/2).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from mmyatt.rewards.verdicts import top_pairs, yes_probability

VERDICTS = ("judge", "yes_prob")


def pair_schedule(group_sizes: Sequence[int], max_opponents: int | None = None) -> list[tuple]:
    """Unordered pairs (a, b), a < b, of sample indices within consecutive groups of the
    given sizes; all pairs, or the circulant schedule of ``max_opponents``.

    >>> pair_schedule([3, 1, 2])
    [(0, 1), (0, 2), (1, 2), (4, 5)]
    >>> sorted(pair_schedule([5], max_opponents=2))
    [(0, 1), (0, 4), (1, 2), (2, 3), (3, 4)]
    """
    if max_opponents is not None and max_opponents < 1:
        raise ValueError(f"max_opponents must be >= 1 or None, got {max_opponents}")
    pairs: list[tuple[int, int]] = []
    start = 0
    for g in group_sizes:
        if max_opponents is None or max_opponents >= g - 1:
            pairs += [(start + i, start + j) for i in range(g) for j in range(i + 1, g)]
        else:
            seen = set()
            for d in range(1, math.ceil(max_opponents / 2) + 1):
                for i in range(g):
                    a, b = sorted((i, (i + d) % g))
                    if a != b and (a, b) not in seen:
                        seen.add((a, b))
                        pairs.append((start + a, start + b))
        start += g
    return pairs


def bradley_terry(p_a: float, p_b: float) -> float:
    """P(a beats b) from two independent Yes probabilities: P(a right, b wrong | exactly
    one right); 1/2 when both are 0 or both 1.

    >>> bradley_terry(0.8, 0.5), bradley_terry(0.3, 0.3), bradley_terry(1.0, 1.0)
    (0.8, 0.5, 0.5)
    """
    x, y = p_a * (1.0 - p_b), p_b * (1.0 - p_a)
    return 0.5 if x + y <= 0 else x / (x + y)


def win_rates(
    n: int,
    pairs: Sequence[tuple[int, int]],
    p_first_ab: Sequence[float | None],
    p_first_ba: Sequence[float | None],
) -> tuple[list[float], list[float], list[float]]:
    """Per-sample (win rate, swap consistency, parse failures) from both orders of every
    pair: p_first_ab[k] = P(first better) with pairs[k][0] shown first, p_first_ba[k]
    the same with pairs[k][1] first; None = the judge's answer gave no verdict (a tie).

    Sample a's win probability over b is (p_ab + 1 - p_ba) / 2, b's is 1 minus that; a
    sample's win rate is the mean over its pairs (1/2 without pairs, e.g. a group of
    one). Consistent: the winner is the same in both orders (a tie is not).

    >>> w, c, f = win_rates(3, [(0, 1), (0, 2), (1, 2)], [0.9, 0.8, 0.5], [0.2, 0.6, 0.5])
    >>> [round(x, 4) for x in w], c, f
    ([0.725, 0.325, 0.45], [0.5, 0.5, 0.0], [0.0, 0.0, 0.0])
    """
    if not (len(pairs) == len(p_first_ab) == len(p_first_ba)):
        raise ValueError(f"{len(pairs)} pairs but {len(p_first_ab)} and {len(p_first_ba)} verdicts")
    wins, cons, fails, count = [0.0] * n, [0.0] * n, [0.0] * n, [0] * n
    for (a, b), ab, ba in zip(pairs, p_first_ab, p_first_ba):
        miss = (ab is None) + (ba is None)
        ab = 0.5 if ab is None else float(ab)
        ba = 0.5 if ba is None else float(ba)
        w_a = (ab + 1.0 - ba) / 2.0
        first = "a" if ab > 0.5 else "b" if ab < 0.5 else None
        second = "a" if ba < 0.5 else "b" if ba > 0.5 else None
        same = float(first is not None and first == second)
        for i, w in ((a, w_a), (b, 1.0 - w_a)):
            wins[i] += w
            cons[i] += same
            fails[i] += miss / 2.0
            count[i] += 1
    out_w = [w / c if c else 0.5 for w, c in zip(wins, count)]
    out_c = [x / c if c else 1.0 for x, c in zip(cons, count)]
    out_f = [x / c if c else 0.0 for x, c in zip(fails, count)]
    return out_w, out_c, out_f


def group_sizes(prompt_ids: Sequence[str]) -> list[int]:
    """Sizes of the runs of equal consecutive ids (a rollout's groups)."""
    sizes: list[int] = []
    for i, pid in enumerate(prompt_ids):
        if i and pid == prompt_ids[i - 1]:
            sizes[-1] += 1
        else:
            sizes.append(1)
    return sizes


def _pair_messages(reward, first: Any, second: Any, record: dict, index: int) -> list[dict]:
    if isinstance(first, str) or isinstance(second, str):
        raise NotImplementedError(
            "pairwise judging of text outputs is not implemented (images only): use a "
            "pointwise genrm mode (yes_prob, score) for text"
        )
    missing = sorted(f for f in reward.fields if f not in record)
    if missing:
        raise ValueError(
            f"judge template {reward.template_name!r} needs record field(s) {missing}, "
            f"absent from sample {index} (fields: {sorted(record)})"
        )
    parts = [
        {"type": "image_url", "image_url": {"url": reward.encode(first)}},
        {"type": "image_url", "image_url": {"url": reward.encode(second)}},
        {"type": "text", "text": reward.template.format_map(dict(record))},
    ]
    messages: list[dict] = []
    if reward.system_prompt:
        messages.append({"role": "system", "content": reward.system_prompt})
    messages.append({"role": "user", "content": parts})
    return messages


def _logprob_body(reward, messages: list[dict], seed: int) -> dict:
    body: dict[str, Any] = {"messages": messages, "max_tokens": 1, "temperature": 0.0}
    body.update(logprobs=True, top_logprobs=reward.top_logprobs, seed=seed)
    if reward.model is not None:
        body["model"] = reward.model
    return body


def judge_pairwise(reward, outputs, records, prompt_ids) -> tuple[list, list, list, dict]:
    """(win rates, swap consistency, parse failures, stats) for one batch; ``reward`` is
    the :class:`~mmyatt.rewards.genrm.GenRMReward` holding the client and options."""
    ids = list(prompt_ids) if prompt_ids is not None else [str(i) for i in range(len(outputs))]
    pairs = pair_schedule(group_sizes(ids), reward.max_opponents)
    n = len(outputs)
    if reward.verdict == "yes_prob":
        bodies = [
            _logprob_body(reward, reward.messages(o, rec, i), reward._seed(i, 0))
            for i, (o, rec) in enumerate(zip(outputs, records))
        ]
        responses = list(reward.client.chat_many(bodies)) if bodies else []
        p = []
        for resp in responses:
            top = top_pairs(resp)
            p.append(None if top is None else yes_probability(top, *reward.yes_no))
        ab, ba = [], []
        for a, b in pairs:
            if p[a] is None or p[b] is None:
                ab.append(None)
                ba.append(None)
            else:
                ab.append(bradley_terry(p[a], p[b]))
                ba.append(bradley_terry(p[b], p[a]))
        stats = {"requests": len(bodies), "judgements": n, "pointwise": p}
    else:
        bodies = []
        for k, (a, b) in enumerate(pairs):
            rec = records[a]
            bodies.append(
                _logprob_body(
                    reward,
                    _pair_messages(reward, outputs[a], outputs[b], rec, a),
                    reward._seed(k, 0),
                )
            )
            bodies.append(
                _logprob_body(
                    reward,
                    _pair_messages(reward, outputs[b], outputs[a], rec, a),
                    reward._seed(k, 1),
                )
            )
        responses = list(reward.client.chat_many(bodies)) if bodies else []
        verdicts = []
        for resp in responses:
            top = top_pairs(resp)
            verdicts.append(
                None
                if top is None
                else yes_probability(top, reward.first_tokens, reward.second_tokens)
            )
        ab, ba = verdicts[0::2], verdicts[1::2]
        stats = {"requests": len(bodies), "judgements": len(bodies)}
    w, c, f = win_rates(n, pairs, ab, ba)
    stats["pairs"] = len(pairs)
    stats["parse_failures"] = sum(v is None for v in ab) + sum(v is None for v in ba)
    return w, c, f, stats
