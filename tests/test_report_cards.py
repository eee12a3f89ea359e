"""The HTML report's cards say why a judge paid what it paid: a question-answering (VQA)
judge's answer, expected answer and value per question, read from the parsed page (the
DOM, not a regular expression over the text); the header counts logged steps against
the run's planned steps; eval grids carry their captions; a VLM's eval samples show the
image asked about and the expected answer."""

from __future__ import annotations

import json
import math
from html.parser import HTMLParser
from pathlib import Path

import pytest
import torch
from PIL import Image

from mmyatt.outputs.rollout_log import write_rollouts
from mmyatt.outputs.samples import save_samples
from mmyatt.report import plots
from mmyatt.report.html import write_report
from mmyatt.report.inspect import load_run
from mmyatt.rewards.genrm import GenRMReward
from mmyatt.rollout import Rollout

QUESTIONS = [
    {"question": "What colour is the shape?", "answer": "{colour}"},
    {"question": "What shape is it?", "answer": "{shape}"},
]


def one_token(probabilities: dict[str, float]) -> dict:
    """A chat response whose one token has these top log-probabilities."""
    top = [{"token": t, "logprob": math.log(p)} for t, p in probabilities.items()]
    best = max(top, key=lambda x: x["logprob"])
    return {"choices": [{"logprobs": {"content": [{**best, "top_logprobs": top}]}}]}


class CannedClient:
    def __init__(self, responses: list[dict]):
        self.responses = list(responses)

    def chat_many(self, bodies):
        out, self.responses = self.responses[: len(bodies)], self.responses[len(bodies) :]
        return out


class Cards(HTMLParser):
    """The judge reasons (the ``li`` items under ``ul.reasons``) of every ``div.card``,
    by the rollout row the card shows (``data-row``): one list per card (a sample may
    have a card in several sections)."""

    def __init__(self):
        super().__init__()
        self.cards: dict[str, list[list[str]]] = {}
        self.captions: list[str] = []
        self.eval_images: list[str] = []
        self._stack: list[tuple[str, dict]] = []
        self._card: str | None = None
        self._item: list[str] | None = None
        self._caption: list[str] | None = None

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        self._stack.append((tag, a))
        classes = (a.get("class") or "").split()
        if tag == "div" and "card" in classes and "data-row" in a:
            self._card = a["data-row"]
            self.cards.setdefault(self._card, []).append([])
        if tag == "div" and "eval" in classes:
            self._card = None
        if tag == "img" and any("eval" in (x.get("class") or "") for _, x in self._stack):
            self.eval_images.append(a.get("src", ""))
        parent = self._stack[-2][1] if len(self._stack) > 1 else {}
        if tag == "li" and self._card is not None and "reasons" in (parent.get("class") or ""):
            self._item = []
        if tag == "figcaption":
            self._caption = []

    def handle_endtag(self, tag):
        while self._stack:
            open_tag, a = self._stack.pop()
            if open_tag == tag:
                break
        if tag == "li" and self._item is not None:
            self.cards[self._card][-1].append("".join(self._item).strip())
            self._item = None
        if tag == "figcaption" and self._caption is not None:
            self.captions.append("".join(self._caption).strip())
            self._caption = None

    def handle_startendtag(self, tag, attrs):
        self.handle_starttag(tag, attrs)
        self.handle_endtag(tag)

    def handle_data(self, data):
        if self._item is not None:
            self._item.append(data)
        if self._caption is not None:
            self._caption.append(data)


def vqa_run(tmp_path: Path) -> Path:
    """A run whose rollout log holds a VQA judge's verdicts on two drawings, as
    GenRMReward (mode vqa) and the rollout log write them."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text("name: vqa\ntrainer: {steps: 100}\n")
    metrics = [
        {"step": 0, "eval/reward/mean": 0.1},
        {"step": 10, "reward/mean": 0.5, "reward/std": 0.5, "reward/generated_mean": 0.5},
        {"step": 20, "reward/mean": 0.9, "reward/std": 0.5, "reward/generated_mean": 0.9},
    ]
    (run / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in metrics))
    responses = [  # sample 0 asked about a red square, sample 1 about a blue circle
        one_token({"red": 0.9, "blue": 0.1}),
        one_token({"square": 0.8, "circle": 0.2}),
        one_token({"red": 0.7, "blue": 0.3}),
        one_token({"square": 0.6, "circle": 0.4}),
    ]
    judge = GenRMReward(
        CannedClient(responses), mode="vqa", questions=QUESTIONS, encode=lambda _: "data:"
    )
    records = [
        {"prompt": "a red square", "colour": "red", "shape": "square"},
        {"prompt": "a blue circle", "colour": "blue", "shape": "circle"},
    ]
    images = [Image.new("RGB", (8, 8), (200, 0, 0)), Image.new("RGB", (8, 8), (200, 0, 0))]
    rewards, parts = judge(images, records)
    rollout = Rollout(
        prompt_ids=["a", "b"],
        actions=torch.zeros(2, 1),
        logprobs=torch.zeros(2, 1),
        mask=torch.ones(2, 1),
        context={},
        outputs=images,
        records=records,
        rewards=rewards,
        reward_parts=parts,
        advantages=torch.tensor([0.5, -0.5]),
        verdicts=[{"genrm": v} for v in judge.last_verdicts],
    )
    for step in (10, 20):
        write_rollouts(run, 0, step, rollout, cap=8)
    return run


def test_vqa_cards_show_each_questions_answer_expected_answer_and_value(tmp_path):
    run_dir = vqa_run(tmp_path)
    page = Cards()
    page.feed(write_report(run_dir).read_text())
    run = load_run(run_dir)
    first = run.rollouts.index[run.rollouts["prompt"] == "a red square"][0]
    second = run.rollouts.index[run.rollouts["prompt"] == "a blue circle"][0]
    # the judge said red (0.9) and square (0.8): right on both for the red square ...
    assert page.cards[str(first)][0] == [
        "What colour is the shape? red (expected red): 0.900",
        "What shape is it? square (expected square): 0.800",
    ]
    # ... and red (0.7), square (0.6) for the one asked as a blue circle: P(blue) = 0.3,
    # P(circle) = 0.4, the reward 0.3 x 0.4 = 0.12
    assert page.cards[str(second)][0] == [
        "What colour is the shape? red (expected blue): 0.300",
        "What shape is it? square (expected circle): 0.400",
    ]
    for row in (first, second):  # every card of a sample says the same
        assert all(card == page.cards[str(row)][0] for card in page.cards[str(row)])
    assert run.rollouts.loc[second, "reward"] == pytest.approx(0.12, abs=1e-6)


def test_header_counts_logged_steps_of_the_planned_run(tmp_path):
    run = load_run(vqa_run(tmp_path))
    assert run.header() == "4 logged samples over 2 logged steps of a 100-step run"
    assert run.header() in write_report(run.path).read_text()


def test_eval_grids_are_captioned_and_vlm_samples_show_image_and_expected_answer(tmp_path):
    run_dir = vqa_run(tmp_path)
    red = Image.new("RGB", (8, 8), (200, 0, 0))
    shown = [(red, "a red square", 0.9, {}), (red, "a blue circle", 0.1, {})]
    save_samples(run_dir / "samples", 0, shown)
    page = Cards()
    page.feed(write_report(run_dir).read_text())
    (caption,) = page.captions
    assert "step 0" in caption and "a red square: reward 0.900" in caption

    (tmp_path / "img.png").write_bytes((run_dir / "samples" / "step_000000.png").read_bytes())
    (tmp_path / "vlm.jsonl").write_text('{"prompt": "What colour?", "image": "img.png"}\n')
    record = {
        "prompt": "What colour?",
        "answer": "red",
        "image": red,
        "image_path": "img.png",
        "_source": f"{tmp_path / 'vlm.jsonl'}:1",
    }
    save_samples(run_dir / "samples", 5, [("blue", "What colour?", 0.0, record)])
    (row,) = [json.loads(x) for x in (run_dir / "samples" / "step_000005.jsonl").open()]
    assert row["answer"] == "red" and row["image"] == str((tmp_path / "img.png").resolve())
    html = write_report(run_dir).read_text()
    page = Cards()
    page.feed(html)
    assert page.eval_images and page.eval_images[0].startswith("data:image/png;base64,")
    assert "expected <code>red</code>" in html


def test_identical_curves_are_named_together_and_the_band_stays_in_the_rewards_range(tmp_path):
    run = load_run(vqa_run(tmp_path))
    bounds = plots.reward_bounds(run.rollouts)  # the logged rewards: 0.12 to 0.72
    assert bounds == pytest.approx((0.12, 0.72), abs=1e-6)
    fig = plots.reward_curves(run.metrics, bounds=(0.0, 1.0))
    train = fig.axes[0]
    # reward/mean and reward/generated_mean are the same series: one line, both names
    (line,) = train.get_lines()
    assert line.get_label() == "train reward (kept groups) = train reward (all generated)"
    # mean 0.9 +- std 0.5 would reach 1.4 and 0.0 - 0.5 at step 10; the band stays in [0, 1]
    (band,) = train.collections
    ys = band.get_paths()[0].vertices[:, 1]
    assert ys.max() == pytest.approx(1.0) and ys.min() == pytest.approx(0.0)
