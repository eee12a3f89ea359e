"""Judge models for the GenRM server: the next-token distribution and sampling.

:class:`JudgeModel` is the two-method protocol a judge backend implements;
:class:`TextJudge` implements it over any local Hugging Face causal LM (text only) and
``mmyatt.models.vlm.VLMPolicy`` over Qwen2-VL / Qwen2.5-VL. :func:`load_judge` picks
one for a model directory. The server (``mmyatt.serving.server``) only batches
requests and calls these two methods.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from mmyatt.models import decode  # the decode loop of the text and VLM adapters
from mmyatt.models.vlm import VLMPolicy

VLM_MODEL_TYPES = ("qwen2_vl", "qwen2_5_vl")


@runtime_checkable
class JudgeModel(Protocol):
    """What the server needs from a judge: the next-token distribution and sampling.

    ``messages_batch`` is a list of OpenAI chat conversations (content a string or a
    list of ``{"type": "text", "text": ...}`` / ``{"type": "image_url", "image_url":
    {"url": "data:image/png;base64,..."}}`` parts). Both methods look at the position
    right after the assistant generation prompt.

    A backend may set ``supports_images = False``; the server then refuses image
    parts with a 400 instead of failing inside the model.
    """

    def next_token_logprobs(
        self, messages_batch: list[list[dict]], top_k: int
    ) -> list[list[tuple[str, float]]]:
        """Top ``top_k`` (token string, log-probability) pairs per conversation, best first."""
        ...

    def generate_text(
        self,
        messages_batch: list[list[dict]],
        *,
        max_new_tokens: int,
        temperature: float,
        seeds: list[int],
    ) -> list[tuple[str, list[float]]]:
        """(text, log-probabilities of the generated tokens) per conversation.

        ``temperature == 0`` is greedy; otherwise row i samples from a generator seeded
        with ``seeds[i]``.
        """
        ...


def _text_of(content: Any) -> str:
    """The text of a message's content; image parts are an error for a text judge."""
    if isinstance(content, str):
        return content
    texts = []
    for part in content:
        if part.get("type") == "text":
            texts.append(part["text"])
        else:
            raise ValueError(
                f"this judge is a text-only model and cannot take {part.get('type')!r} parts; "
                "serve a VLM judge (Qwen2-VL / Qwen2.5-VL directory) to judge images"
            )
    return "\n".join(texts)


class TextJudge:
    """:class:`JudgeModel` over any local Hugging Face causal LM (text only).

    Conversations go through the tokenizer's chat template (with the generation
    prompt) when it has one; otherwise they are written as ``role: content`` lines
    followed by ``assistant:``. Text parts of one message are joined with newlines.
    Log-probabilities are those of the raw model (temperature 1), as vLLM reports them.
    """

    supports_images = False

    def __init__(self, model, tokenizer, *, name: str = "judge"):
        import torch

        self.model = model.eval()
        self.tokenizer = tokenizer
        self.name = name
        pad = tokenizer.pad_token_id
        self.pad_id = int(pad if pad is not None else (tokenizer.eos_token_id or 0))
        eos = set()
        for settings in (getattr(model, "generation_config", None), model.config, tokenizer):
            ids = getattr(settings, "eos_token_id", None)
            if ids is None:
                continue
            eos.update([ids] if isinstance(ids, int) else list(ids))
        self.eos_ids = torch.tensor(sorted(eos), dtype=torch.long)
        # Vocabulary rows past the tokenizer (padded embeddings) decode to nothing.
        self._n_real = len(tokenizer)
        self.max_positions = int(getattr(model.config, "max_position_embeddings", 0) or 0)
        import inspect

        params = inspect.signature(model.forward).parameters
        self._cache_kwarg = "cache" if "cache" in params else "past_key_values"
        self._has_logits_to_keep = "logits_to_keep" in params
        self._token_strs: dict[int, str] = {}  # id -> string; top-k lists repeat ids

    @classmethod
    def load(cls, path: str | Path, *, device: str = "cpu", dtype=None) -> TextJudge:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        p = Path(path)
        if not (p / "config.json").is_file():
            raise FileNotFoundError(f"no model config at {str(p / 'config.json')!r}")
        tokenizer = AutoTokenizer.from_pretrained(str(p), local_files_only=True)
        model = AutoModelForCausalLM.from_pretrained(
            str(p), dtype=dtype or torch.float32, local_files_only=True
        )
        return cls(model.to(device), tokenizer, name=p.name)

    # --- encoding -------------------------------------------------------------------
    def _encode(self, messages: list[dict]) -> list[int]:
        plain = [{"role": m["role"], "content": _text_of(m["content"])} for m in messages]
        if getattr(self.tokenizer, "chat_template", None):
            text = self.tokenizer.apply_chat_template(
                plain, add_generation_prompt=True, tokenize=False
            )
            ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        else:
            text = "".join(f"{m['role']}: {m['content']}\n" for m in plain) + "assistant:"
            ids = self.tokenizer(text)["input_ids"]
        return list(ids)

    def _batch(self, messages_batch: list[list[dict]], extra: int):
        import torch

        seqs = [self._encode(m) for m in messages_batch]
        for ids in seqs:
            if self.max_positions and len(ids) + extra > self.max_positions:
                raise ValueError(
                    f"prompt of {len(ids)} tokens + {extra} new tokens exceeds the judge's "
                    f"context of {self.max_positions} positions"
                )
        width = max(len(s) for s in seqs)
        device = next(self.model.parameters()).device
        # left padding: the last column is every row's last token
        pads = [width - len(s) for s in seqs]
        ids = torch.tensor([[self.pad_id] * p + s for p, s in zip(pads, seqs)], dtype=torch.long)
        attn = torch.tensor([[0] * p + [1] * (width - p) for p in pads], dtype=torch.long)
        return ids.to(device), attn.to(device)

    def _forward(self, ids, attn, positions, cache=None):
        kw: dict[str, Any] = {self._cache_kwarg: cache} if cache is not None else {}
        if self._has_logits_to_keep:
            kw["logits_to_keep"] = 1
        out = self.model(
            input_ids=ids,
            attention_mask=attn,
            position_ids=positions,
            use_cache=cache is not None,
            **kw,
        )
        logits = out.logits[:, -1].float()
        if logits.shape[-1] > self._n_real:
            logits[:, self._n_real :] = float("-inf")
        return logits

    def _token_str(self, token_id: int) -> str:
        text = self._token_strs.get(token_id)
        if text is None:
            text = self.tokenizer.decode([token_id], clean_up_tokenization_spaces=False)
            self._token_strs[token_id] = text
        return text

    # --- JudgeModel -----------------------------------------------------------------
    def next_token_logprobs(
        self, messages_batch: list[list[dict]], top_k: int
    ) -> list[list[tuple[str, float]]]:
        import torch

        with torch.no_grad():
            ids, attn = self._batch(messages_batch, extra=1)
            positions = (attn.cumsum(-1) - 1).clamp(min=0)
            logprobs = self._forward(ids, attn, positions).log_softmax(-1)
            k = max(1, min(int(top_k), self._n_real))
            values, indices = logprobs.topk(k, dim=-1)
        return [
            [(self._token_str(int(t)), float(v)) for v, t in zip(vs, ts)]
            for vs, ts in zip(values.tolist(), indices.tolist())
        ]

    def generate_text(
        self,
        messages_batch: list[list[dict]],
        *,
        max_new_tokens: int,
        temperature: float,
        seeds: list[int],
    ) -> list[tuple[str, list[float]]]:
        import torch

        if len(seeds) != len(messages_batch):
            raise ValueError(f"{len(messages_batch)} conversations but {len(seeds)} seeds")
        with torch.no_grad():
            ids, prompt_mask = self._batch(messages_batch, extra=max_new_tokens)
            device = ids.device
            positions = (prompt_mask.cumsum(-1) - 1).clamp(min=0)
            next_pos = prompt_mask.sum(-1, keepdim=True)
            cache = decode.new_cache(self.model)
            attn = decode.attention_buffer(prompt_mask, max_new_tokens)
            width = ids.shape[1]

            def forward_next(token, t: int):
                cols = attn[:, : width + t + 1]
                return self._forward(token[:, None], cols, next_pos + t, cache=cache)

            res = decode.decode(
                self._forward(ids, prompt_mask, positions, cache=cache),
                forward_next,
                group=1,
                max_new_tokens=max_new_tokens,
                temperature=temperature if temperature > 0 else 1.0,
                greedy=temperature <= 0,
                top_p=1.0,
                banned=torch.zeros(0, dtype=torch.long),
                generators=[torch.Generator(device=device).manual_seed(int(s)) for s in seeds],
                eos=self.eos_ids,
                pad_id=self.pad_id,
            )
        lengths = res.mask.sum(-1).long().tolist()
        # the log-prob of an end-of-sequence token is reported, the token is not written
        tokens = [
            row[: n - int(stop)]
            for row, n, stop in zip(res.actions.tolist(), lengths, res.stopped.tolist())
        ]
        lps = [row[:n] for row, n in zip(res.logprobs.tolist(), lengths)]
        texts = self.tokenizer.batch_decode(tokens, skip_special_tokens=True)
        return list(zip(texts, lps))


def load_judge(path: str | Path, *, device: str | None = None) -> JudgeModel:
    """A judge for a local model directory: VLMPolicy for Qwen2-VL / Qwen2.5-VL
    configs, :class:`TextJudge` for any other causal LM."""
    p = Path(path)
    config_file = p / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"no judge model at {str(p)!r} (missing config.json)")
    model_type = json.loads(config_file.read_text()).get("model_type", "")
    if device is None or device == "auto":
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    if model_type in VLM_MODEL_TYPES:
        return VLMPolicy.load(str(p), device=device)
    return TextJudge.load(p, device=device)
