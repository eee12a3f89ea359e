"""Question-answering GenRM (``genrm`` with ``mode: vqa``): a judge answers questions about
each output, and the reward is how likely its answers are the expected ones.

A prompt is broken into questions with known answers, as TIFA (Hu et al., 2023) and DSG
(Cho et al., 2024) evaluate text-to-image models: "a red square" asks "What colour is
the shape?" (expected "red") and "What shape is it?" (expected "square"). The judge
(any chat-completions server that returns top log-probabilities: the built-in one, or
``vllm serve --max-logprobs``) answers each with one token; a question's value is the
probability of the expected answer's first token, summed over its spellings (case, a
leading space); the reward combines the questions (``combine``: ``product``, the
probability that every answer is right if they were independent, or ``mean``, TIFA's
fraction). A judge that reads each attribute apart can then grade combinations of them
it never saw together, where one holistic "Does this image show a red square?" needs the
judge itself to compose.

Config (``reward.functions``)::

    - name: genrm
      kwargs:
        mode: vqa
        questions:
          - {question: "What colour is the shape?", answer: "{colour}"}
          - {question: "What shape is it?", answer: "{shape}"}
        combine: product

``question`` and ``answer`` are ``str.format`` templates over the record's fields (and
``output`` for a text output). A response without log-probabilities is a parse failure
(the reward's fallback); an expected answer outside the top log-probabilities is worth
0 (the judge found it unlikely), which is no failure.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from mmyatt.rewards.verdicts import top_pairs

COMBINE = ("product", "mean")


def parse_questions(questions: Any) -> list[dict[str, str]]:
    """Validate the ``questions`` kwarg: a non-empty list of {question, answer} templates.

    >>> parse_questions([{"question": "What colour is it?", "answer": "{colour}"}])
    [{'question': 'What colour is it?', 'answer': '{colour}'}]
    """
    if not isinstance(questions, (list, tuple)) or not questions:
        raise ValueError(
            "GenRM mode 'vqa' needs 'questions': a list of {question: ..., answer: ...} "
            "templates, e.g. [{question: 'What shape is it?', answer: '{shape}'}]"
        )
    out = []
    for i, q in enumerate(questions):
        if not isinstance(q, dict) or set(q) != {"question", "answer"}:
            raise ValueError(
                f"GenRM 'questions'[{i}] must have exactly the keys 'question' and 'answer', "
                f"got {q!r}"
            )
        if not all(isinstance(q[k], str) and q[k].strip() for k in q):
            raise ValueError(f"GenRM 'questions'[{i}]: question and answer must be non-empty text")
        out.append({"question": q["question"], "answer": q["answer"]})
    return out


def answer_probability(pairs: Sequence[tuple[str, float]], expected: str) -> float:
    """P(first answer token spells ``expected``) from (token, logprob) pairs: the tokens
    equal to the answer's first word (case-insensitive, surrounding spaces ignored),
    or to a prefix of it of at least 3 letters (a word split into several tokens).

    >>> round(answer_probability([("red", math.log(0.5)), (" Red", math.log(0.2)),
    ...                           ("blue", math.log(0.3))], "red"), 4)
    0.7
    >>> round(answer_probability([("tri", math.log(0.4)), ("t", math.log(0.5))], "triangle"), 4)
    0.4
    >>> answer_probability([("blue", 0.0)], "red")
    0.0
    """
    words = expected.strip().lower().split()
    if not words:
        raise ValueError("an expected answer is empty")
    word = words[0]
    total = 0.0
    seen: set[str] = set()
    for tok, lp in pairs:
        t = tok.strip().lower()
        if tok in seen or not t:
            continue
        if t == word or (len(t) >= 3 and word.startswith(t)):
            seen.add(tok)
            total += math.exp(lp)
    return min(1.0, total)


def combine(values: Sequence[float], how: str) -> float:
    """Combine the questions' values of one sample.

    >>> combine([0.5, 0.8], "product"), combine([0.5, 0.8], "mean")
    (0.4, 0.65)
    """
    if how == "product":
        return float(math.prod(values))
    if how == "mean":
        return float(sum(values) / len(values))
    raise ValueError(f"GenRM combine must be one of {COMBINE}, got {how!r}")


def vqa_requests(genrm, outputs: Sequence[Any], records: Sequence[dict]) -> list[dict]:
    """One request per sample and question (max_tokens 1, top log-probabilities), in
    sample-major order."""
    bodies = []
    for i, (output, record) in enumerate(zip(outputs, records)):
        for q in genrm.questions:
            messages = genrm.messages(output, record, i, template=q["question"])
            body: dict[str, Any] = {
                "messages": messages,
                "max_tokens": 1,
                "temperature": 0.0,
                "logprobs": True,
                "top_logprobs": genrm.top_logprobs,
                "seed": genrm._seed(i, 0),
            }
            if genrm.model is not None:
                body["model"] = genrm.model
            bodies.append(body)
    return bodies


def expected_and_judged(
    genrm, responses: Sequence[dict], records: Sequence[dict], outputs: Sequence[Any]
) -> list[list[tuple[str, Any]]]:
    """Per sample, per question: (the expected answer, from the record's fields and a text
    output; the judge's top (token, log-probability) pairs, None without them)."""
    nq = len(genrm.questions)
    out = []
    for i, record in enumerate(records):
        fields = dict(record)
        if isinstance(outputs[i], str):
            fields["output"] = outputs[i]
        out.append(
            [
                (q["answer"].format_map(fields), top_pairs(responses[i * nq + k]))
                for k, q in enumerate(genrm.questions)
            ]
        )
    return out


def vqa_values(
    genrm, responses: Sequence[dict], records: Sequence[dict], outputs: Sequence[Any]
) -> list[list[float | None]]:
    """Per sample, per question: P(expected answer), None where the response carries no
    log-probabilities."""
    return [
        [None if pairs is None else answer_probability(pairs, expected) for expected, pairs in row]
        for row in expected_and_judged(genrm, responses, records, outputs)
    ]


def vqa_answers(
    genrm, responses: Sequence[dict], records: Sequence[dict], outputs: Sequence[Any]
) -> list[dict[str, list]]:
    """Per sample, what each question expected and what the judge answered (its most
    likely token, None without log-probabilities): ``{"expected": [...], "answers":
    [...]}``, for the rollout log next to the values."""
    return [
        {
            "expected": [expected for expected, _ in row],
            "answers": [max(p, key=lambda t: t[1])[0].strip() if p else None for _, p in row],
        }
        for row in expected_and_judged(genrm, responses, records, outputs)
    ]
