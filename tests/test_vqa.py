"""GenRM's question-answering mode (rewards/vqa.py): requests per question, the expected
answer's probability against hand-computed values, product/mean, failures, config errors."""

from __future__ import annotations

import math

import pytest

from mmyatt.rewards.genrm import GenRMReward
from mmyatt.rewards.vqa import answer_probability, combine, parse_questions

QUESTIONS = [
    {"question": "What colour is the shape?", "answer": "{colour}"},
    {"question": "What shape is it?", "answer": "{shape}"},
]


def _response(pairs):
    top = [{"token": t, "logprob": math.log(p)} for t, p in pairs]
    return {"choices": [{"logprobs": {"content": [{**top[0], "top_logprobs": top}]}}]}


class ScriptedClient:
    """Answers each question from a table keyed by (question, image tag)."""

    def __init__(self, table):
        self.table, self.bodies = table, []

    def chat_many(self, bodies):
        self.bodies += bodies
        out = []
        for b in bodies:
            parts = b["messages"][-1]["content"]
            text = next(p["text"] for p in parts if p["type"] == "text")
            out.append(self.table[text])
        return out


def test_product_and_mean_against_hand_worked_values():
    table = {
        "What colour is the shape?": _response([("red", 0.6), (" Red", 0.1), ("blue", 0.3)]),
        "What shape is it?": _response([("circle", 0.2), ("square", 0.8)]),
    }
    records = [
        {"prompt": "a red square", "colour": "red", "shape": "square"},
        {"prompt": "a blue circle", "colour": "blue", "shape": "circle"},
    ]
    images = [b"x", b"y"]
    for how, want in (("product", [0.7 * 0.8, 0.3 * 0.2]), ("mean", [0.75, 0.25])):
        client = ScriptedClient(table)
        g = GenRMReward(
            client, mode="vqa", questions=QUESTIONS, combine=how, encode=lambda _: "data:"
        )
        reward, extra = g(images, records)
        assert reward.tolist() == pytest.approx(want)
        assert extra["genrm_parse_failed"].tolist() == [0.0, 0.0]
        # sample-major: 2 samples x 2 questions, one token each with log-probs
        assert len(client.bodies) == 4
        assert all(b["max_tokens"] == 1 and b["logprobs"] for b in client.bodies)
        assert g.stats["judgements"] == 4


def test_missing_logprobs_is_a_failure_and_takes_the_fallback():
    table = {
        "What colour is the shape?": {"choices": [{"message": {"content": "red"}}]},
        "What shape is it?": _response([("square", 0.5)]),
    }
    g = GenRMReward(
        ScriptedClient(table),
        mode="vqa",
        questions=QUESTIONS,
        fallback=0.2,
        encode=lambda _: "data:",
    )
    reward, extra = g([b"x"], [{"colour": "red", "shape": "square"}])
    assert reward.tolist() == pytest.approx([0.2 * 0.5])
    assert extra["genrm_parse_failed"].tolist() == [0.5]


def test_answer_probability_matches_words_not_letters():
    pairs = [("c", math.log(0.5)), ("cyan", math.log(0.3)), ("cir", math.log(0.1))]
    assert answer_probability(pairs, "circle") == pytest.approx(0.1)
    assert answer_probability(pairs, "cyan") == pytest.approx(0.3)
    assert combine([0.5, 0.5, 0.5], "product") == pytest.approx(0.125)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"questions": None}, "needs 'questions'"),
        ({"questions": [{"question": "What?"}]}, "exactly the keys"),
        ({"questions": QUESTIONS, "combine": "max"}, "combine must be one of"),
        ({"questions": QUESTIONS, "template": "yes_no_alignment"}, "not a 'template'"),
    ],
)
def test_config_errors_name_the_key(kwargs, match):
    with pytest.raises(ValueError, match=match):
        GenRMReward(ScriptedClient({}), mode="vqa", **kwargs)


def test_questions_only_for_vqa():
    with pytest.raises(ValueError, match="for mode 'vqa'"):
        GenRMReward(ScriptedClient({}), mode="yes_prob", questions=QUESTIONS)
    assert parse_questions(QUESTIONS) == QUESTIONS
