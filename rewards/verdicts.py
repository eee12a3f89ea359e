"""Judge answers as numbers: P(yes) from a next-token distribution, a score parsed from
generated text, and the (token, logprob) pairs a chat-completions response carries.
Plain functions over plain data, shared by every GenRM mode (``genrm``: yes/no and
score; ``pairwise``; ``vqa``); they know nothing of the judge client.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence


def _logsumexp(values: list[float]) -> float:
    if not values:
        return -math.inf
    top = max(values)
    if top == -math.inf:
        return top
    return top + math.log(sum(math.exp(v - top) for v in values))


def yes_probability(
    top_logprobs: Sequence[tuple[str, float]],
    yes_tokens: Sequence[str],
    no_tokens: Sequence[str],
) -> float | None:
    """P(yes) / (P(yes) + P(no)) from (token, logprob) pairs; None if neither side appears.

    >>> round(yes_probability([("Yes", math.log(0.6)), ("No", math.log(0.2))], ["Yes"], ["No"]), 4)
    0.75
    """
    yes = [lp for tok, lp in top_logprobs if tok in yes_tokens]
    no = [lp for tok, lp in top_logprobs if tok in no_tokens]
    if not yes and not no:
        return None
    ly, ln = _logsumexp(yes), _logsumexp(no)
    if ln == -math.inf:
        return 1.0
    if ly == -math.inf:
        return 0.0
    return 1.0 / (1.0 + math.exp(ln - ly))


def parse_score(text: str, pattern: re.Pattern, score_max: float) -> float | None:
    """The last match of ``pattern`` (group 1, else the match) / score_max, or None."""
    matches = list(pattern.finditer(text or ""))
    if not matches:
        return None
    m = matches[-1]
    raw = m.group(1) if m.groups() else m.group(0)
    try:
        value = float(raw)
    except (TypeError, ValueError):
        return None
    if not 0.0 <= value <= score_max or not math.isfinite(value):
        return None
    return value / score_max


def top_pairs(response: dict) -> list[tuple[str, float]] | None:
    """The (token, logprob) pairs of a chat-completions response's first generated token:
    its top_logprobs and the token itself; None when the response has no log-probs."""
    try:
        entry = response["choices"][0]["logprobs"]["content"][0]
    except (KeyError, IndexError, TypeError):
        return None
    pairs = [(t["token"], float(t["logprob"])) for t in entry.get("top_logprobs") or []]
    if entry.get("token") is not None and entry["token"] not in {t for t, _ in pairs}:
        pairs.append((entry["token"], float(entry["logprob"])))
    return pairs
