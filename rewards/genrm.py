"""Generative reward models (GenRM): a (V)LM judge asked a question about each sample.

:class:`GenRMReward` is a reward function with the same call signature as
:class:`~mmyatt.rewards.rules.WeightedReward`: ``reward(outputs, records, prompt_ids)
-> (rewards (N,) float32, parts)``. It builds one judge conversation per sample from
a prompt template, sends them through a judge client (:class:`~mmyatt.serving.
client.JudgeClient`, which talks to ``mmyatt serve-genrm`` or ``vllm serve``)
and turns the answers into numbers with one of two modes:

``yes_prob``
    ``P(Yes) / (P(Yes) + P(No))`` from the judge's next-token distribution (one
    forward pass, ``max_tokens=1`` with ``top_logprobs``): continuous, in [0, 1].
    Probabilities are summed over the spelling variants in ``yes_tokens`` /
    ``no_tokens``. When only one side appears in the top-k the other side's mass is
    below the top-k cut-off and the value is 1.0 (or 0.0); when neither appears the
    answer counts as a parse failure and ``fallback`` is used.
``score``
    The judge generates text; the last match of ``score_regex`` (group 1) is the
    score, divided by ``score_max``. A missing match or a score outside
    ``[0, score_max]`` is a parse failure and gives ``fallback``.

With ``repeats=K`` each sample is judged K times with different seeds and the K
values (fallbacks included) are averaged. ``score`` asks for the K samples in one
request (``n=K``); ``yes_prob`` sends K requests (a deterministic judge returns the
same distribution each time, so K > 1 only helps with a sampling or otherwise
nondeterministic judge).

Outputs may be PIL images (image-generation rewards; sent as PNG data URLs, or
through ``encode``), numpy uint8 arrays (H, W, C), or strings (text answers, which
reach the judge through the template's ``{output}`` field). ``image_key`` adds the
record's own image (a path or a PIL image), e.g. to judge a VLM's answer about it.

Templates are ``str.format`` strings filled with the record's fields plus ``output``
(write literal braces as ``{{`` ``}}``). Built-in ones live in ``rewards/templates``:
``yes_no_alignment``, ``score_1_10`` (images), ``yes_no_correct``,
``score_text_1_10`` (text answers); any other value is read as a file path.

``self.stats`` counts ``requests`` (HTTP requests), ``samples``, ``judgements``
(samples x repeats), ``parse_failures`` (judgements that gave no value) and
``fallback_used`` (samples whose reward includes a fallback value).
"""

from __future__ import annotations

import base64
import io
import math
import re
import string
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from PIL import Image

from mmyatt.rewards import vqa
from mmyatt.rewards.pairwise import VERDICTS, judge_pairwise
from mmyatt.rewards.rules import check_batch
from mmyatt.rewards.verdicts import parse_score, top_pairs, yes_probability
from mmyatt.serving.client import JudgeClient

if TYPE_CHECKING:
    from torch import Tensor

TEMPLATE_DIR = Path(__file__).resolve().parent / "templates"
MODES = ("yes_prob", "score", "pairwise", "vqa")  # pairwise.py: win rates; vqa.py: questions
DEFAULT_TEMPLATES = {
    "yes_prob": "yes_no_alignment",
    "score": "score_1_10",
    "pairwise": "pairwise_alignment",
}


def available_templates() -> list[str]:
    return sorted(p.stem for p in TEMPLATE_DIR.glob("*.txt"))


def load_template(name_or_path: str | Path) -> str:
    """A built-in template by name (``"yes_no_alignment"``) or a template file's text."""
    text = str(name_or_path)
    builtin = TEMPLATE_DIR / f"{text}.txt"
    if "/" not in text and "\\" not in text and builtin.is_file():
        return builtin.read_text(encoding="utf-8").rstrip("\n")
    path = Path(text)
    if path.is_file():
        return path.read_text(encoding="utf-8").rstrip("\n")
    raise ValueError(
        f"no judge template {text!r}: not a built-in ({', '.join(available_templates())}) "
        "and no such file"
    )


def template_fields(template: str) -> set[str]:
    """Top-level field names a ``str.format`` template uses."""
    fields = set()
    for _, name, _, _ in string.Formatter().parse(template):
        if name is not None:
            if name == "" or name.isdigit():
                raise ValueError(f"judge template uses a positional field {{{name}}}; name it")
            fields.add(re.split(r"[.\[]", name, maxsplit=1)[0])
    return fields


def image_data_url(image: Any) -> str:
    """A PIL image, a numpy uint8 array (H, W[, C]) or an image file path as a data URL."""
    if isinstance(image, (str, Path)):
        path = Path(image)
        mime = {".jpg": "jpeg", ".jpeg": "jpeg", ".png": "png", ".webp": "webp", ".gif": "gif"}
        kind = mime.get(path.suffix.lower())
        if kind is None:  # unknown suffix: decode and re-encode as PNG
            with Image.open(path) as img:
                return image_data_url(img.copy())
        return f"data:image/{kind};base64," + base64.b64encode(path.read_bytes()).decode("ascii")
    if isinstance(image, Image.Image):
        img = image
    elif isinstance(image, np.ndarray):
        img = Image.fromarray(image)
    else:
        raise TypeError(
            f"cannot send a {type(image).__name__} to the judge as an image; pass "
            "encode=fn(output) -> data URL for this output type"
        )
    if img.mode not in ("RGB", "RGBA", "L"):
        img = img.convert("RGB")
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode("ascii")


def _question_text(messages: list[dict]) -> str:
    """The text the judge read in the last user turn (images left out)."""
    content = messages[-1]["content"]
    if isinstance(content, str):
        return content
    return " ".join(p.get("text", "") for p in content if p.get("type") == "text")


class GenRMReward:
    """A GenRM reward (the ``Reward`` protocol); see the module docstring.

    ``client`` is anything with ``chat_many(list_of_request_dicts) -> list_of_responses``
    (a :class:`JudgeClient`), or a URL / list of URLs to build one from.
    """

    def __init__(
        self,
        client: Any,
        *,
        mode: str = "yes_prob",
        template: str | Path | None = None,
        repeats: int = 1,
        yes_tokens: Sequence[str] = ("Yes", " Yes", "yes"),
        no_tokens: Sequence[str] = ("No", " No", "no"),
        score_regex: str = r"Score:\s*(\d+(?:\.\d+)?)",
        score_max: float = 10.0,
        fallback: float = 0.0,
        temperature: float = 0.0,
        max_tokens: int = 16,
        top_logprobs: int = 20,
        image_key: str | None = None,
        max_frames: int = 4,
        encode: Callable[[Any], str] | None = None,
        system_prompt: str | None = None,
        model: str | None = None,
        seed: int = 0,
        name: str = "genrm",
        verdict: str = "judge",
        max_opponents: int | None = None,
        first_tokens: Sequence[str] = ("1", " 1"),
        second_tokens: Sequence[str] = ("2", " 2"),
        questions: Sequence[dict] | None = None,
        combine: str = "product",
    ):
        if mode not in MODES:
            raise ValueError(f"GenRM mode must be one of {MODES}, got {mode!r}")
        if repeats < 1:
            raise ValueError(f"repeats must be >= 1, got {repeats}")
        if score_max <= 0:
            raise ValueError(f"score_max must be > 0, got {score_max}")
        if not math.isfinite(fallback):
            raise ValueError(f"fallback must be a finite number, got {fallback}")
        if top_logprobs < 1:  # servers cap it: OpenAI at 20, vLLM at --max-logprobs
            raise ValueError(f"top_logprobs must be >= 1, got {top_logprobs}")
        if isinstance(client, (str, list, tuple)):
            client = JudgeClient(client)
        self.client = client
        self.mode = mode
        # pairwise (rewards/pairwise.py): verdicts of the judge on two images, or derived
        # from each sample's P(Yes) (asked with the yes_prob template)
        if verdict not in VERDICTS:
            raise ValueError(f"pairwise verdict must be one of {VERDICTS}, got {verdict!r}")
        self.verdict, self.max_opponents = verdict, max_opponents
        self.first_tokens, self.second_tokens = tuple(first_tokens), tuple(second_tokens)
        if mode == "pairwise" and verdict == "yes_prob" and template is None:
            template = DEFAULT_TEMPLATES["yes_prob"]
        self.questions: list[dict[str, str]] = []
        if mode == "vqa":  # rewards/vqa.py: questions with expected answers, no template
            if template is not None:
                raise ValueError("GenRM mode 'vqa' takes 'questions', not a 'template'")
            if combine not in vqa.COMBINE:
                raise ValueError(f"GenRM combine must be one of {vqa.COMBINE}, got {combine!r}")
            self.questions, self.combine = vqa.parse_questions(questions), combine
            template = self.questions[0]["question"]
        elif questions is not None:
            raise ValueError(f"GenRM 'questions' is for mode 'vqa', not {mode!r}")
        self.template_name = str(template or DEFAULT_TEMPLATES[mode])
        self.template = template if mode == "vqa" else load_template(self.template_name)
        self.fields = template_fields(self.template)
        self.repeats = int(repeats)
        self.yes_tokens, self.no_tokens = tuple(yes_tokens), tuple(no_tokens)
        self.score_pattern = re.compile(score_regex)
        self.score_max = float(score_max)
        self.fallback = float(fallback)
        self.temperature = float(temperature)
        self.max_tokens = int(max_tokens)
        self.top_logprobs = int(top_logprobs)
        self.image_key = image_key
        if max_frames < 2:
            raise ValueError(f"max_frames must be >= 2, got {max_frames}")
        self.max_frames = int(max_frames)
        self.encode = encode or image_data_url
        self.system_prompt = system_prompt
        self.model = model
        self.seed = int(seed)
        self.name = name
        self._calls = 0
        self.last_verdicts: list[dict] = []  # per sample of the last call (see _verdicts)
        self.stats = {
            "requests": 0,
            "samples": 0,
            "judgements": 0,
            "parse_failures": 0,
            "fallback_used": 0,
        }

    reads_latents = False  # the judge reads decoded images or text

    @property
    def compares_groups(self) -> bool:
        """A sample's reward depends on the other samples of its group (pairwise win
        rates): it can be judged only once its whole group has finished."""
        return self.mode == "pairwise"

    @property
    def names(self) -> list[str]:
        extra = [f"{self.name}_swap_consistency"] if self.mode == "pairwise" else []
        return [self.name, f"{self.name}_parse_failed", *extra]

    @property
    def yes_no(self) -> tuple[tuple[str, ...], tuple[str, ...]]:
        return self.yes_tokens, self.no_tokens

    # --- building requests ------------------------------------------------------------
    def messages(
        self, output: Any, record: dict, index: int = 0, template: str | None = None
    ) -> list[dict]:
        """The judge conversation for one sample (``template``: instead of the reward's)."""
        is_text = isinstance(output, str)
        template_text = self.template if template is None else template
        fields = self.fields if template is None else template_fields(template)
        if is_text and "output" not in fields:
            raise ValueError(
                f"judge template {self.template_name!r} has no {{output}} field, so a text "
                "output would never reach the judge; use e.g. 'yes_no_correct'"
            )
        if not is_text and "output" in fields:
            raise ValueError(
                f"judge template {self.template_name!r} puts {{output}} in the text, but the "
                f"output is a {type(output).__name__} (sent as an image)"
            )
        values = dict(record)
        if is_text:
            values["output"] = output
        missing = sorted(f for f in fields if f not in values)
        if missing:
            where = record.get("_source", f"sample {index}")
            raise ValueError(
                f"judge template {self.template_name!r} needs record field(s) {missing}, "
                f"absent from {where} (fields: {sorted(record)})"
            )
        text = template_text.format_map(values)
        parts: list[dict] = []
        if self.image_key is not None:
            for image in self._record_images(record, index):
                parts.append({"type": "image_url", "image_url": {"url": image_data_url(image)}})
        if not is_text:
            parts.append({"type": "image_url", "image_url": {"url": self.encode(output)}})
        messages: list[dict] = []
        if self.system_prompt:
            messages.append({"role": "system", "content": self.system_prompt})
        if parts:
            parts.append({"type": "text", "text": text})
            messages.append({"role": "user", "content": parts})
        else:
            messages.append({"role": "user", "content": text})
        return messages

    def _record_images(self, record: dict, index: int) -> list:
        """The record's media sent next to a text output: ``image_key`` names a record
        field holding an image, a list of images or a (T, H, W, 3) clip; ``"media"``
        takes the record's "image", else its "video". A clip goes as up to
        ``max_frames`` evenly spaced frames, one image part each (a VLM judge reads them
        in order; a served Qwen2-VL takes several images per message)."""
        key = self.image_key
        if key == "media":
            key = "image" if record.get("image") is not None else "video"
        value = record.get(key)
        if value is None:
            raise ValueError(f"record of sample {index} has no {self.image_key!r} media")
        if isinstance(value, (list, tuple)):
            return list(value)
        if getattr(value, "ndim", 0) == 4:  # (T, H, W, 3) frames
            t = value.shape[0]
            if t > self.max_frames:
                keep = sorted(
                    {round(i * (t - 1) / (self.max_frames - 1)) for i in range(self.max_frames)}
                )
                value = value[keep]
            return list(value)
        return [value]

    def _seed(self, sample: int, repeat: int) -> int:
        return (self.seed * 1_000_003 + self._calls * 65_537 + sample * 101 + repeat) % (2**31)

    def requests(self, outputs: Sequence[Any], records: Sequence[dict]) -> list[dict]:
        """The request bodies for a batch: one per sample (score) or per repeat (yes_prob)."""
        bodies = []
        for i, (output, record) in enumerate(zip(outputs, records)):
            base: dict[str, Any] = {"messages": self.messages(output, record, i)}
            if self.model is not None:
                base["model"] = self.model
            if self.mode == "yes_prob":
                for k in range(self.repeats):
                    body = dict(base, max_tokens=1, temperature=0.0, logprobs=True)
                    body.update(top_logprobs=self.top_logprobs, seed=self._seed(i, k))
                    bodies.append(body)
            else:
                body = dict(base, max_tokens=self.max_tokens, temperature=self.temperature)
                body.update(n=self.repeats, seed=self._seed(i, 0))
                bodies.append(body)
        return bodies

    # --- verdicts for the rollout log ---------------------------------------------------
    def _verdicts(
        self, bodies: list[dict], responses: list[dict], values: list, rewards: list[float]
    ) -> list[dict]:
        """Per sample, what the judge was asked and answered: ``question`` (the template's
        text), ``raw`` (yes_prob: the answer token of the first judgement; score: the
        generated texts), ``top_logprobs`` (yes_prob: up to 5 (token, logprob) pairs),
        ``values`` (the parsed P(Yes) or score / score_max per judgement, None = parse
        failure) and ``verdict`` (their mean with fallbacks: the reward)."""
        per = self.repeats if self.mode == "yes_prob" else 1
        out = []
        for i, (row, reward) in enumerate(zip(values, rewards)):
            body, resp = bodies[i * per], responses[i * per]
            v: dict[str, Any] = {
                "mode": self.mode,
                "question": _question_text(body["messages"]),
                "values": row,
                "verdict": reward,
            }
            if self.mode == "yes_prob":
                pairs = top_pairs(resp) or []
                try:
                    v["raw"] = resp["choices"][0]["logprobs"]["content"][0]["token"]
                except (KeyError, IndexError, TypeError):
                    v["raw"] = None
                top = sorted(pairs, key=lambda p: -p[1])[:5]
                v["top_logprobs"] = [[t, round(lp, 4)] for t, lp in top]
            else:
                choices = resp.get("choices") or []
                v["raw"] = [(c.get("message") or {}).get("content") or "" for c in choices]
            out.append(v)
        return out

    # --- scoring ----------------------------------------------------------------------
    def _values(self, responses: list[dict], n: int) -> list[list[float | None]]:
        values: list[list[float | None]] = []
        if self.mode == "yes_prob":
            for i in range(n):
                row = []
                for k in range(self.repeats):
                    pairs = top_pairs(responses[i * self.repeats + k])
                    row.append(
                        None
                        if pairs is None
                        else yes_probability(pairs, self.yes_tokens, self.no_tokens)
                    )
                values.append(row)
        else:
            for i in range(n):
                choices = responses[i].get("choices") or []
                texts = [(c.get("message") or {}).get("content") or "" for c in choices]
                texts += [""] * (self.repeats - len(texts))  # missing choices: failures
                values.append(
                    [parse_score(t, self.score_pattern, self.score_max) for t in texts][
                        : self.repeats
                    ]
                )
        return values

    def __call__(
        self,
        outputs: Sequence[Any],
        records: Sequence[dict],
        prompt_ids: Sequence[str] | None = None,
    ) -> tuple[Tensor, dict[str, Tensor]]:
        """Judge N samples: returns (N,) float32 rewards and {name, name_parse_failed}."""
        import torch

        check_batch(outputs, records, prompt_ids)
        if self.mode == "pairwise":
            return self._pairwise(outputs, records, prompt_ids)
        if self.mode == "vqa":
            bodies = vqa.vqa_requests(self, outputs, records)
        else:
            bodies = self.requests(outputs, records)
        self._calls += 1
        responses = self.client.chat_many(bodies) if bodies else []
        self.stats["requests"] += len(bodies)
        if self.mode == "vqa":
            values = vqa.vqa_values(self, list(responses), records, outputs)
        else:
            values = self._values(list(responses), len(outputs))
        rewards, failed = [], []
        for row in values:
            misses = sum(v is None for v in row)
            filled = [self.fallback if v is None else v for v in row]
            if self.mode == "vqa":
                rewards.append(vqa.combine(filled, self.combine))
            else:
                rewards.append(sum(filled) / len(filled))
            failed.append(misses / len(row))
            self.stats["parse_failures"] += misses
            self.stats["fallback_used"] += int(misses > 0)
        self.stats["samples"] += len(outputs)
        self.stats["judgements"] += len(outputs) * (
            len(self.questions) if self.mode == "vqa" else self.repeats
        )
        if self.mode == "vqa":
            answers = vqa.vqa_answers(self, list(responses), records, outputs)
            self.last_verdicts = [
                {
                    "mode": "vqa",
                    "questions": [q["question"] for q in self.questions],
                    **said,  # expected and answers, per question
                    "values": row,
                    "verdict": r,
                }
                for row, r, said in zip(values, rewards, answers)
            ]
        else:
            self.last_verdicts = self._verdicts(bodies, list(responses), values, rewards)
        total = torch.tensor(rewards, dtype=torch.float32)
        return total, {
            self.name: total.clone(),
            f"{self.name}_parse_failed": torch.tensor(failed, dtype=torch.float32),
        }

    def _pairwise(self, outputs, records, prompt_ids) -> tuple[Tensor, dict[str, Tensor]]:
        """Win rates within each group (rewards/pairwise.py), swap consistency beside."""
        import torch

        self._calls += 1
        wins, consistency, failed, st = judge_pairwise(self, outputs, records, prompt_ids)
        self.stats["requests"] += st["requests"]
        self.stats["samples"] += len(outputs)
        self.stats["judgements"] += st["judgements"]
        self.stats["parse_failures"] += st["parse_failures"]
        self.stats["fallback_used"] += sum(f > 0 for f in failed)
        self.last_verdicts = [
            {"mode": "pairwise", "verdict": w, "swap_consistency": c, "values": None}
            for w, c in zip(wins, consistency)
        ]
        total = torch.tensor(wins, dtype=torch.float32)
        return total, {
            self.name: total.clone(),
            f"{self.name}_parse_failed": torch.tensor(failed, dtype=torch.float32),
            f"{self.name}_swap_consistency": torch.tensor(consistency, dtype=torch.float32),
        }
