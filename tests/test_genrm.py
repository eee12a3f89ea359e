"""GenRM scoring: yes_prob against hand-computed softmaxes, score parsing and fallbacks,
templates and images, and the TextJudge backend against a tiny model's own logits."""

from __future__ import annotations

import base64
import io
import json
import math
import re
import threading
import time
from pathlib import Path

import pytest
import torch

from mmyatt.models import judge as judge_module
from mmyatt.models.judge import JudgeModel, TextJudge, load_judge
from mmyatt.rewards.genrm import GenRMReward, load_template, parse_score, yes_probability
from mmyatt.serving.client import JudgeClient, JudgeRequestError
from mmyatt.serving.server import JudgeServer

# Fake judge vocabulary and logits: "red" prompts lean Yes, others lean No.
VOCAB = ["Yes", " Yes", "yes", "No", " No", "no", "maybe", "Score", "\n"]
LOGITS = {
    "red": [2.0, 0.5, -1.0, 0.0, -0.5, -2.0, 1.0, 0.3, -0.2],
    "other": [-1.0, -2.0, -3.0, 1.5, 0.7, 0.1, 0.4, 0.0, 0.0],
    "none": [-9.0, -9.0, -9.0, -9.0, -9.0, -9.0, 5.0, 4.0, 3.0],  # Yes/No fall out of top-3
}


def _text(messages: list[dict]) -> str:
    out = []
    for m in messages:
        content = m["content"]
        if isinstance(content, str):
            out.append(content)
        else:
            out += [p["text"] for p in content if p["type"] == "text"]
    return "\n".join(out)


class FakeJudge:
    """A JudgeModel with known logits and scripted generations; records its calls."""

    supports_images = True
    name = "fake-judge"

    def __init__(self, delay_s: float = 0.0):
        self.delay_s = delay_s
        self.calls: list[tuple[str, int]] = []  # (method, batch size)
        self.seen: list[list[dict]] = []
        self.lock = threading.Lock()

    def _record(self, method: str, batch: list[list[dict]]) -> None:
        with self.lock:
            self.calls.append((method, len(batch)))
            self.seen.extend(batch)
        if self.delay_s:
            time.sleep(self.delay_s)

    @staticmethod
    def logits_for(messages: list[dict]) -> list[float]:
        text = _text(messages)
        key = "none" if "nothing" in text else "red" if "red" in text else "other"
        return LOGITS[key]

    def next_token_logprobs(self, messages_batch, top_k):
        self._record("next", messages_batch)
        out = []
        for messages in messages_batch:
            logits = self.logits_for(messages)
            norm = math.log(sum(math.exp(v) for v in logits))
            pairs = sorted(((t, v - norm) for t, v in zip(VOCAB, logits)), key=lambda p: -p[1])
            out.append(pairs[:top_k])
        return out

    def generate_text(self, messages_batch, *, max_new_tokens, temperature, seeds):
        self._record("gen", messages_batch)
        out = []
        for messages, seed in zip(messages_batch, seeds):
            text = _text(messages)
            if "good" in text:
                answer = f"Looks fine. Score: {7 + seed % 2}"
            elif "huge" in text:
                answer = "Score: 15"
            else:
                answer = "I cannot tell."
            out.append((answer, [-0.5] * 3))
        return out


@pytest.fixture
def fake_server():
    judge = FakeJudge()
    server = JudgeServer(judge, model_name=judge.name).start()
    yield server, judge
    server.stop()


@pytest.fixture
def client(fake_server):
    c = JudgeClient([fake_server[0].url], timeout_s=10)
    yield c
    c.close()


def test_the_shipped_judges_are_judge_models(tiny_judge_dir):
    """Both kinds of judge load_judge returns satisfy the server's protocol, and an object
    that lacks its methods does not (the check can fail)."""
    builtin = Path(__file__).resolve().parents[1] / "models" / "builtin"
    vlm = load_judge(builtin / "tiny_judge", device="cpu")
    assert isinstance(vlm, JudgeModel) and not isinstance(vlm, TextJudge)
    text = load_judge(tiny_judge_dir, device="cpu")
    assert isinstance(text, TextJudge) and isinstance(text, JudgeModel)
    assert not isinstance(object(), JudgeModel)


def test_yes_prob_equals_softmax_over_yes_no_logits(client):
    reward = GenRMReward(client, template="yes_no_correct")
    outputs = ["it is red", "it is blue"]
    records = [{"prompt": "What colour?"}, {"prompt": "What colour?"}]
    total, parts = reward(outputs, records, ["a", "b"])
    # By hand: the softmax restricted to the six Yes/No logits, summed over the Yes side.
    expected = []
    for key in ("red", "other"):
        yes_no = torch.tensor(LOGITS[key][:6], dtype=torch.float64)
        expected.append(float(torch.softmax(yes_no, 0)[:3].sum()))
    assert total.dtype == torch.float32 and total.shape == (2,)
    assert total.tolist() == pytest.approx(expected, abs=1e-6)
    assert expected[0] > 0.5 > expected[1]
    assert parts["genrm"].tolist() == pytest.approx(expected, abs=1e-6)
    assert parts["genrm_parse_failed"].tolist() == [0.0, 0.0]
    assert reward.stats["requests"] == 2 and reward.stats["parse_failures"] == 0


def test_yes_prob_without_yes_or_no_in_top_k_uses_fallback(client):
    reward = GenRMReward(client, template="yes_no_correct", top_logprobs=3, fallback=-1.0)
    total, parts = reward(["nothing here", "it is red"], [{"prompt": "q"}, {"prompt": "q"}])
    assert total[0].item() == -1.0
    assert parts["genrm_parse_failed"].tolist() == [1.0, 0.0]
    # only "Yes" survives the top-3 cut for "red": its P(No) is below the cut-off
    assert total[1].item() == 1.0
    assert reward.stats["parse_failures"] == 1 and reward.stats["fallback_used"] == 1


def test_score_mode_parses_averages_repeats_and_counts_failures(fake_server, client):
    _, judge = fake_server
    reward = GenRMReward(
        client, mode="score", template="score_text_1_10", repeats=2, temperature=1.0, fallback=-1.0
    )
    outputs = ["good answer", "bad answer", "huge answer"]
    records = [{"prompt": "p"}] * 3
    total, parts = reward(outputs, records)
    # seeds s and s+1 give one "Score: 7" and one "Score: 8"; the others never parse
    assert total.tolist() == pytest.approx([0.75, -1.0, -1.0])
    assert parts["genrm_parse_failed"].tolist() == [0.0, 1.0, 1.0]
    assert reward.stats == {
        "requests": 3,
        "samples": 3,
        "judgements": 6,
        "parse_failures": 4,
        "fallback_used": 2,
    }
    assert judge.calls and all(method == "gen" for method, _ in judge.calls)


def test_score_regex_and_scale_are_configurable():
    assert yes_probability([("maybe", -0.1)], ["Yes"], ["No"]) is None
    pattern = re.compile(r"<Score>(\d+)</Score>")
    assert parse_score("a <Score>3</Score> b <Score>4</Score>", pattern, 5.0) == 0.8
    assert parse_score("<Score>9</Score>", pattern, 5.0) is None  # out of range
    assert parse_score("", pattern, 5.0) is None


def test_templates_builtin_and_user_file(tmp_path, client):
    assert load_template("yes_no_alignment") == "Does this image show {prompt}? Answer Yes or No."
    user = tmp_path / "mine.txt"
    user.write_text("Is {output} the capital of {country}? Answer Yes or No.\n")
    reward = GenRMReward(client, template=str(user))
    assert reward.messages("Paris", {"country": "France"}) == [
        {"role": "user", "content": "Is Paris the capital of France? Answer Yes or No."}
    ]
    with pytest.raises(ValueError, match="country"):
        reward(["Paris"], [{"prompt": "x", "_source": "m.jsonl:3"}])
    with pytest.raises(ValueError, match="no judge template"):
        GenRMReward(client, template="no_such_template")
    with pytest.raises(ValueError, match=r"no \{output\} field"):
        GenRMReward(client, template="yes_no_alignment").messages("text", {"prompt": "p"})


def test_image_outputs_travel_as_png_data_urls(fake_server, client):
    from PIL import Image

    _, judge = fake_server
    image = Image.new("RGB", (8, 6), (255, 0, 0))
    reward = GenRMReward(client)  # yes_no_alignment
    total, _ = reward([image], [{"prompt": "a red square"}])
    expected = float(torch.softmax(torch.tensor(LOGITS["red"][:6]), 0)[:3].sum())
    assert total.item() == pytest.approx(expected, abs=1e-6)
    content = judge.seen[-1][0]["content"]
    assert content[0]["type"] == "image_url" and content[1] == {
        "type": "text",
        "text": "Does this image show a red square? Answer Yes or No.",
    }
    url = content[0]["image_url"]["url"]
    assert url.startswith("data:image/png;base64,")
    decoded = Image.open(io.BytesIO(base64.b64decode(url.split(",", 1)[1])))
    assert decoded.size == (8, 6) and decoded.getpixel((0, 0)) == (255, 0, 0)


@pytest.fixture(scope="module")
def tiny_judge_dir(tmp_path_factory):
    from mmyatt.models.builtin.tiny import build_tiny_text_model

    corpus = ["Is the answer correct? Yes", "Is the answer correct? No", "Yes No yes no"] * 30
    return build_tiny_text_model(
        tmp_path_factory.mktemp("judge"), size="qwen2-0.1m", corpus=corpus, seed=0
    )


def test_text_judge_matches_hand_computed_logits(tiny_judge_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    judge = load_judge(tiny_judge_dir, device="cpu")
    assert isinstance(judge, TextJudge)
    tok = AutoTokenizer.from_pretrained(str(tiny_judge_dir))
    model = AutoModelForCausalLM.from_pretrained(str(tiny_judge_dir)).eval()
    yes_id, no_id = (tok.convert_tokens_to_ids(t) for t in ("Yes", "No"))
    assert tok.unk_token_id not in (yes_id, no_id) and yes_id != no_id
    convs = [
        [{"role": "user", "content": "Is the answer correct?"}],
        [{"role": "system", "content": "Be strict."}, {"role": "user", "content": "Yes or no?"}],
    ]
    top = judge.next_token_logprobs(convs, top_k=len(tok))  # batched, left-padded
    for conv, pairs in zip(convs, top):
        text = tok.apply_chat_template(conv, add_generation_prompt=True, tokenize=False)
        ids = torch.tensor([tok(text, add_special_tokens=False)["input_ids"]])
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0, -1]
        expected = float(torch.softmax(logits[[yes_id, no_id]], 0)[0])
        got = yes_probability(pairs, ["Yes"], ["No"])
        assert got == pytest.approx(expected, abs=1e-4)
        best = int(logits.argmax())
        assert pairs[0][0] == tok.decode([best])
    # greedy generation is deterministic; sampling follows the seeds
    g1 = judge.generate_text(convs, max_new_tokens=4, temperature=0.0, seeds=[0, 1])
    g2 = judge.generate_text(convs[:1], max_new_tokens=4, temperature=0.0, seeds=[5])
    assert g1[0][0] == g2[0][0]  # batched (left-padded) == alone
    s1 = judge.generate_text(convs, max_new_tokens=4, temperature=1.0, seeds=[3, 4])
    s2 = judge.generate_text(convs, max_new_tokens=4, temperature=1.0, seeds=[3, 4])
    assert [t for t, _ in s1] == [t for t, _ in s2]
    assert all(len(lps) <= 4 and all(v <= 0 for v in lps) for _, lps in s1)


def test_text_judge_rejects_images_with_a_clear_error(tiny_judge_dir):
    server = JudgeServer(tiny_judge_dir).start()
    try:
        with JudgeClient([server.url], max_retries=0) as c:
            image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
            body = {"messages": [{"role": "user", "content": [image]}], "max_tokens": 1}
            with pytest.raises(JudgeRequestError, match="text-only") as info:
                c.chat(body)
            assert info.value.status == 400
    finally:
        server.stop()
    judge = load_judge(tiny_judge_dir, device="cpu")
    with pytest.raises(ValueError, match="text-only"):
        judge.next_token_logprobs([[{"role": "user", "content": [image]}]], top_k=1)


def test_load_judge_picks_vlm_policy_for_qwen2_vl(tmp_path, monkeypatch):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen2_5_vl"}))
    loaded = []

    class VLMPolicy:
        @classmethod
        def load(cls, path, **kwargs):
            loaded.append(path)
            return "vlm-judge"

    monkeypatch.setattr(judge_module, "VLMPolicy", VLMPolicy)
    assert load_judge(tmp_path) == "vlm-judge" and loaded == [str(tmp_path)]
