"""The embedded GenRM judge server: an OpenAI-compatible chat-completions subset.

``mmyatt serve-genrm MODEL_DIR --host 127.0.0.1 --port 8000 [--api-key K]`` (or
``python -m mmyatt.rewards.judge_server ...``) serves a local judge model so that
controllers can call it over HTTP exactly as they would call ``vllm serve``:

=================================  ==========================================================
``GET /health``                    200 ``{"status": "ok", "model": NAME}`` (no key needed, as
                                   in vLLM, so that liveness probes work)
``GET /v1/models``                 the one served model, OpenAI list format
``POST /v1/chat/completions``      ``model``, ``messages`` (text parts and ``image_url`` parts
                                   holding ``data:`` URLs), ``max_tokens``, ``temperature``,
                                   ``logprobs``, ``top_logprobs``, ``n``, ``seed``
``GET /stats``                     batching and timing counters (needs the key when one is set)
=================================  ==========================================================

With ``max_tokens=1, logprobs=true, top_logprobs=k`` a response carries the top-k
next-token distribution after the assistant generation prompt, which is what a
``yes_prob`` GenRM needs (one forward pass). Longer ``max_tokens`` generate text (the
``score`` mode). Per-token logprobs of generated text are only available with
``max_tokens=1``: the judge model API returns no token strings for generated text,
so a longer request that asks for logprobs is refused (400) rather than answered
with made-up token strings.

Dynamic batching: request handler threads put work on a queue; one worker thread
takes up to ``max_batch`` requests, waiting at most ``batch_wait_ms`` for more after
the first, and runs them as one model call (requests needing the same kind of call
are grouped). Every response reports the model time of the call that served it in
the ``x-mmyatt-model-time-ms`` header and an extra ``mmyatt`` body field, which
OpenAI clients ignore.

Security: the server binds to loopback unless told otherwise (a warning is printed
for any other address). With an API key, every ``/v1/*`` and ``/stats`` request must
carry ``Authorization: Bearer <key>`` or gets an OpenAI-style 401. The key is never
logged. Images are only accepted inline as ``data:`` URLs; nothing is fetched.

Judge models: :class:`JudgeModel` is the two-method protocol a judge backend
implements. :func:`load_judge` picks ``mmyatt.models.vlm.VLMPolicy`` for Qwen2-VL /
Qwen2.5-VL directories and :class:`TextJudge` (any local Hugging Face causal LM,
text only) otherwise.
"""

from __future__ import annotations

import argparse
import base64
import hmac
import ipaddress
import json
import os
import queue
import random
import socket
import sys
import threading
import time
import uuid
from collections.abc import Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

API_KEY_ENV = "MMYATT_GENRM_API_KEY"  # how JudgePool hands the key to child servers
VLM_MODEL_TYPES = ("qwen2_vl", "qwen2_5_vl")
MAX_BODY_BYTES = 64 * 1024 * 1024
_ROLES = ("system", "user", "assistant")


# --------------------------------------------------------------------------------------
# Judge models
# --------------------------------------------------------------------------------------
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
        for source in (getattr(model, "generation_config", None), model.config, tokenizer):
            ids = getattr(source, "eos_token_id", None)
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
        ids = torch.full((len(seqs), width), self.pad_id, dtype=torch.long)
        attn = torch.zeros((len(seqs), width), dtype=torch.long)
        for i, s in enumerate(seqs):  # left padding: the last column is every row's last token
            ids[i, width - len(s) :] = torch.tensor(s, dtype=torch.long)
            attn[i, width - len(s) :] = 1
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

    def _new_cache(self):
        from transformers import DynamicCache

        try:
            return DynamicCache(config=self.model.config)
        except TypeError:
            return DynamicCache()

    def _token_str(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], clean_up_tokenization_spaces=False)

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
        n = len(messages_batch)
        with torch.no_grad():
            ids, attn = self._batch(messages_batch, extra=max_new_tokens)
            device = ids.device
            generators = [torch.Generator(device=device).manual_seed(int(s)) for s in seeds]
            eos = self.eos_ids.to(device)
            positions = (attn.cumsum(-1) - 1).clamp(min=0)
            next_pos = attn.sum(-1, keepdim=True)
            cache = self._new_cache()
            logits = self._forward(ids, attn, positions, cache=cache)
            tokens: list[list[int]] = [[] for _ in range(n)]
            lps: list[list[float]] = [[] for _ in range(n)]
            done = [False] * n
            for t in range(max_new_tokens):
                if temperature > 0:
                    scaled = (logits / temperature).log_softmax(-1)
                    token = torch.stack(
                        [
                            torch.multinomial(scaled[i].exp(), 1, generator=generators[i])[0]
                            for i in range(n)
                        ]
                    )
                else:
                    scaled = logits.log_softmax(-1)
                    token = scaled.argmax(-1)
                chosen = scaled.gather(-1, token[:, None]).squeeze(-1).tolist()
                is_eos = torch.isin(token, eos).tolist()
                for i in range(n):
                    if done[i]:
                        continue
                    lps[i].append(float(chosen[i]))
                    if is_eos[i]:
                        done[i] = True
                    else:
                        tokens[i].append(int(token[i]))
                if all(done) or t == max_new_tokens - 1:
                    break
                attn = torch.cat([attn, attn.new_ones(n, 1)], 1)
                logits = self._forward(token[:, None], attn, next_pos + t, cache=cache)
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
        from mmyatt.models.vlm import VLMPolicy  # lazy: heavy, and only for VLM judges

        return VLMPolicy.load(str(p), device=device)
    return TextJudge.load(p, device=device)


# --------------------------------------------------------------------------------------
# Requests
# --------------------------------------------------------------------------------------
class RequestError(ValueError):
    """A client error: answered with ``status`` and an OpenAI-style error body."""

    def __init__(self, message: str, status: int = 400, code: str | None = None, param=None):
        super().__init__(message)
        self.status, self.code, self.param = status, code, param


@dataclass
class _Work:
    messages: list[dict]
    max_tokens: int
    temperature: float
    logprobs: bool
    top_logprobs: int
    n: int
    seed: int | None
    enqueued: float = field(default_factory=time.perf_counter)
    future: Future = field(default_factory=Future)


def _check_messages(messages: Any, allow_images: bool) -> list[dict]:
    if not isinstance(messages, list) or not messages:
        raise RequestError("'messages' must be a non-empty list", param="messages")
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise RequestError(f"{where} must be an object", param="messages")
        role, content = m.get("role"), m.get("content")
        if role not in _ROLES:
            raise RequestError(f"{where}.role must be one of {list(_ROLES)}", param="messages")
        if isinstance(content, list):
            for j, part in enumerate(content):
                kind = part.get("type") if isinstance(part, dict) else None
                if kind == "text":
                    if not isinstance(part.get("text"), str):
                        raise RequestError(f"{where}.content[{j}].text must be a string")
                elif kind == "image_url":
                    url = (part.get("image_url") or {}).get("url")
                    if not isinstance(url, str) or not url.startswith("data:image/"):
                        raise RequestError(
                            f"{where}.content[{j}]: only inline images as "
                            "'data:image/...;base64,' URLs are accepted (nothing is fetched)"
                        )
                    if not allow_images:
                        raise RequestError(
                            f"{where}.content[{j}]: this judge is a text-only model; serve a "
                            "VLM judge (Qwen2-VL / Qwen2.5-VL) to judge images"
                        )
                    try:
                        base64.b64decode(url.split(",", 1)[1], validate=True)
                    except Exception as error:
                        raise RequestError(f"{where}.content[{j}]: bad base64 image") from error
                else:
                    raise RequestError(
                        f"{where}.content[{j}].type must be 'text' or 'image_url', got {kind!r}"
                    )
        elif not isinstance(content, str):
            raise RequestError(f"{where}.content must be a string or a list of parts")
        out.append({"role": role, "content": content})
    return out


def _int(body: dict, key: str, default: int, lo: int, hi: int) -> int:
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise RequestError(f"'{key}' must be an integer in [{lo}, {hi}], got {value!r}", param=key)
    return value


def parse_request(
    body: Any, *, model_names: Sequence[str], allow_images: bool, max_logprobs: int
) -> _Work:
    """Validate a chat-completions body; raises :class:`RequestError`."""
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    model = body.get("model")
    if model is not None and model not in model_names:
        raise RequestError(
            f"the model {model!r} does not exist; this server serves {model_names[0]!r}",
            status=404,
            code="model_not_found",
            param="model",
        )
    if body.get("stream"):
        raise RequestError("streaming is not supported by the embedded judge server")
    messages = _check_messages(body.get("messages"), allow_images)
    max_tokens = _int(body, "max_tokens", 128, 1, 8192)
    if body.get("max_completion_tokens") is not None:
        max_tokens = _int(body, "max_completion_tokens", 128, 1, 8192)
    temperature = body.get("temperature", 1.0)
    if temperature is None:
        temperature = 1.0
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)):
        raise RequestError("'temperature' must be a number", param="temperature")
    if not 0.0 <= temperature <= 2.0:
        raise RequestError("'temperature' must be in [0, 2]", param="temperature")
    logprobs = bool(body.get("logprobs") or False)
    top_logprobs = _int(body, "top_logprobs", 0, 0, max_logprobs)
    if top_logprobs and not logprobs:
        raise RequestError("'top_logprobs' needs 'logprobs': true", param="top_logprobs")
    if logprobs and max_tokens > 1:
        raise RequestError(
            "logprobs are only available with max_tokens=1 on the embedded judge server "
            "(next-token distribution); use vLLM for per-token logprobs of generated text",
            param="logprobs",
        )
    n = _int(body, "n", 1, 1, 64)
    seed = body.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise RequestError("'seed' must be an integer", param="seed")
    return _Work(messages, max_tokens, float(temperature), logprobs, top_logprobs, n, seed)


def _entry(token: str, logprob: float) -> dict:
    return {"token": token, "logprob": logprob, "bytes": list(token.encode("utf-8"))}


# --------------------------------------------------------------------------------------
# Batching engine
# --------------------------------------------------------------------------------------
class _Engine:
    """The queue and the worker thread that turns queued requests into model calls."""

    def __init__(self, model: JudgeModel, max_batch: int, batch_wait_ms: float):
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        self.model = model
        self.max_batch = int(max_batch)
        self.batch_wait_s = max(0.0, float(batch_wait_ms) / 1000.0)
        self.queue: queue.Queue[_Work] = queue.Queue()
        self.lock = threading.Lock()
        self.stats: dict[str, Any] = {
            "requests": 0,
            "batches": 0,
            "model_calls": 0,
            "max_batch_seen": 0,
            "batch_sizes": {},
            "model_time_s": 0.0,
            "errors": 0,
        }
        self._stop = threading.Event()
        self._submit_lock = threading.Lock()
        # placement (mmyatt/placement): the weights can be dropped between judge phases
        # and reloaded by ``loader``; ``threads`` is applied by the worker thread itself
        self.loader = None
        self.model_lock = threading.Lock()
        self.threads: int | None = None
        self.stats.update({"sleeping": False, "reloads": 0, "reload_s": 0.0, "sleeps": 0})
        self.thread = threading.Thread(target=self._loop, name="judge-batcher", daemon=True)
        self.thread.start()

    def submit(self, work: _Work) -> Future:
        with self._submit_lock:  # nothing is queued after stop() has drained the queue
            if self._stop.is_set():
                raise RequestError("the judge server is shutting down", status=503)
            self.queue.put(work)
        return work.future

    def stop(self) -> None:
        with self._submit_lock:
            self._stop.set()
        self.thread.join(timeout=30)
        while True:  # fail whatever is still queued
            try:
                work = self.queue.get_nowait()
            except queue.Empty:
                break
            work.future.set_exception(RequestError("the judge server stopped", status=503))

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                first = self.queue.get(timeout=0.05)
            except queue.Empty:
                continue
            batch = [first]
            deadline = time.perf_counter() + self.batch_wait_s
            while len(batch) < self.max_batch:
                remaining = deadline - time.perf_counter()
                try:
                    if remaining > 0:
                        batch.append(self.queue.get(timeout=remaining))
                    else:
                        batch.append(self.queue.get_nowait())
                except queue.Empty:
                    break
            try:
                self._run(batch)
            except Exception as error:  # noqa: BLE001 - the worker must survive anything
                for work in batch:
                    self._fail(work, error)

    def _timed(self, fn, *args, **kwargs):
        t0 = time.perf_counter()
        result = fn(*args, **kwargs)
        elapsed = time.perf_counter() - t0
        with self.lock:
            self.stats["model_calls"] += 1
            self.stats["model_time_s"] += elapsed
        return result, elapsed

    def sleep(self) -> float:
        """Drop the model's weights (after the batch being served); returns seconds."""
        if self.loader is None:
            raise RequestError("this judge was given as an object and cannot reload", 400)
        t0 = time.perf_counter()
        with self.model_lock:
            if self.model is not None:
                self.model = None
                import gc

                gc.collect()
                from mmyatt.placement.resources import release_free_memory

                release_free_memory()
                with self.lock:
                    self.stats["sleeps"] += 1
                    self.stats["sleeping"] = True
        return time.perf_counter() - t0

    def wake(self) -> float:
        """Reload the weights if they were dropped; returns the reload seconds (0 if awake)."""
        with self.model_lock:
            return self._wake_locked()

    def _wake_locked(self) -> float:
        if self.model is not None:
            return 0.0
        t0 = time.perf_counter()
        self.model = self.loader()
        dt = time.perf_counter() - t0
        with self.lock:
            self.stats["reloads"] += 1
            self.stats["reload_s"] += dt
            self.stats["sleeping"] = False
        return dt

    def _run(self, batch: list[_Work]) -> None:
        with self.model_lock:  # a sleeping judge reloads before it serves
            if self.threads:
                import torch

                if torch.get_num_threads() != self.threads:
                    torch.set_num_threads(self.threads)
            self._wake_locked()
            self._run_awake(batch)

    def _run_awake(self, batch: list[_Work]) -> None:
        with self.lock:
            self.stats["requests"] += len(batch)
            self.stats["batches"] += 1
            self.stats["max_batch_seen"] = max(self.stats["max_batch_seen"], len(batch))
            sizes = self.stats["batch_sizes"]
            sizes[len(batch)] = sizes.get(len(batch), 0) + 1
        # Greedy single-token requests need only the next-token distribution.
        groups: dict[tuple, list[_Work]] = {}
        for w in batch:
            key = (
                ("next",)
                if (w.max_tokens == 1 and w.temperature == 0)
                else (
                    "gen",
                    w.max_tokens,
                    w.temperature,
                )
            )
            groups.setdefault(key, []).append(w)
        for key, works in groups.items():
            try:
                self._serve(key, works, len(batch))
            except Exception as error:
                if len(works) > 1:  # isolate the request that broke the call
                    for w in works:
                        try:
                            self._serve(key, [w], 1)
                        except Exception as single:
                            self._fail(w, single)
                else:
                    self._fail(works[0], error)

    def _fail(self, work: _Work, error: Exception) -> None:
        with self.lock:
            self.stats["errors"] += 1
        if not work.future.done():
            work.future.set_exception(error)

    def _serve(self, key: tuple, works: list[_Work], batch_size: int) -> None:
        model_time = 0.0
        tops: list[list[tuple[str, float]]] | None = None
        need_top = key[0] == "next" or any(w.logprobs for w in works)
        if need_top:
            k = max([w.top_logprobs for w in works] + [1])
            tops, dt = self._timed(self.model.next_token_logprobs, [w.messages for w in works], k)
            model_time += dt
        gens: list[list[tuple[str, list[float]]]] = [[] for _ in works]
        if key[0] == "gen":
            rows, seeds, owner = [], [], []
            for i, w in enumerate(works):
                base = w.seed if w.seed is not None else random.getrandbits(31)
                for j in range(w.n):
                    rows.append(w.messages)
                    seeds.append((base + j) % (2**63))
                    owner.append(i)
            out, dt = self._timed(
                self.model.generate_text,
                rows,
                max_new_tokens=key[1],
                temperature=key[2],
                seeds=seeds,
            )
            model_time += dt
            for i, result in zip(owner, out):
                gens[i].append(result)
        for i, w in enumerate(works):
            choices = []
            top = tops[i] if tops is not None else None
            for j in range(w.n):
                if key[0] == "next":
                    assert top is not None
                    token, lp = top[0]
                    finish = "length"
                else:
                    text, lps = gens[i][j]
                    token, lp = text, (lps[0] if lps else 0.0)
                    finish = "length" if len(lps) >= w.max_tokens else "stop"
                choice: dict[str, Any] = {
                    "index": j,
                    "message": {"role": "assistant", "content": token},
                    "logprobs": None,
                    "finish_reason": finish,
                }
                if w.logprobs and top is not None:
                    entry = _entry(token, lp)
                    entry["top_logprobs"] = [_entry(t, v) for t, v in top[: w.top_logprobs]]
                    choice["logprobs"] = {"content": [entry]}
                choices.append(choice)
            if not w.future.done():
                w.future.set_result(
                    {
                        "choices": choices,
                        "mmyatt": {
                            "model_time_ms": model_time * 1000.0,
                            "batch_size": batch_size,
                            "queue_ms": (time.perf_counter() - w.enqueued - model_time) * 1000.0,
                        },
                    }
                )


# --------------------------------------------------------------------------------------
# HTTP
# --------------------------------------------------------------------------------------
def _error_body(message: str, status: int, code: str | None = None, param=None) -> dict:
    kind = {
        401: "invalid_request_error",
        404: "invalid_request_error",
        413: "invalid_request_error",
    }.get(status, "invalid_request_error" if status < 500 else "server_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


class _HTTPServer(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    # socketserver's default listen backlog is 5: a burst of new client connections
    # overflows it and the dropped SYNs are only retried after a second.
    request_queue_size = 1024

    def __init__(self, address, handler, judge: JudgeServer):
        self.judge = judge
        self._conns: set[socket.socket] = set()
        self._conns_lock = threading.Lock()
        super().__init__(address, handler)

    def process_request(self, request, client_address):
        with self._conns_lock:
            self._conns.add(request)
        super().process_request(request, client_address)

    def shutdown_request(self, request):
        with self._conns_lock:
            self._conns.discard(request)
        super().shutdown_request(request)

    def close_connections(self) -> None:
        """Drop open keep-alive connections, as a killed process would."""
        with self._conns_lock:
            conns = list(self._conns)
        for conn in conns:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive: clients reuse connections
    server_version = "mmyatt-judge/0.1"
    timeout = 300  # idle keep-alive connections are closed after this many seconds
    # Headers and body are two writes: with Nagle's algorithm the body would wait for
    # the client's delayed ACK of the headers (~40 ms per response).
    disable_nagle_algorithm = True
    server: _HTTPServer

    def log_message(self, format: str, *args) -> None:  # noqa: A002 (stdlib signature)
        # Only the request line and status are ever logged, never headers (the API key).
        if self.server.judge.log_requests:
            sys.stderr.write(f"judge {self.address_string()} {format % args}\n")

    def _send(self, status: int, body: dict, headers: dict | None = None) -> None:
        data = json.dumps(body).encode("utf-8")
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.end_headers()
        self.wfile.write(data)

    def _error(self, status: int, message: str, code=None, param=None) -> None:
        extra = {"WWW-Authenticate": "Bearer"} if status == 401 else None
        self._send(status, _error_body(message, status, code, param), extra)

    def _authorized(self) -> bool:
        key = self.server.judge.api_key
        if key is None:
            return True
        given = self.headers.get("Authorization", "")
        scheme, _, token = given.partition(" ")
        if scheme.lower() == "bearer" and hmac.compare_digest(
            token.strip().encode("utf-8"), key.encode("utf-8")
        ):
            return True
        self._error(
            401,
            "missing or incorrect API key: send 'Authorization: Bearer <key>'",
            code="invalid_api_key",
        )
        return False

    def do_GET(self) -> None:  # noqa: N802 (stdlib name)
        judge = self.server.judge
        path = self.path.split("?", 1)[0].rstrip("/")
        if path == "/health":
            self._send(200, {"status": "ok", "model": judge.model_name})
        elif path == "/v1/models":
            if self._authorized():
                self._send(
                    200,
                    {
                        "object": "list",
                        "data": [
                            {
                                "id": judge.model_name,
                                "object": "model",
                                "created": judge.created,
                                "owned_by": "mmyatt",
                            }
                        ],
                    },
                )
        elif path == "/stats":
            if self._authorized():
                self._send(200, judge.stats)
        else:
            self._error(404, f"no route GET {path}", code="not_found")

    def _placement(self, path: str) -> None:
        """``POST /sleep`` drops the weights, ``POST /wake_up`` reloads them (vLLM's names);
        ``POST /mmyatt/placement`` with {"cores": [...], "threads": n, "reset_peak": bool}
        pins this server to cores and sets its torch threads (mmyatt/placement)."""
        from mmyatt.placement import resources

        engine = self.server.judge.engine
        length = int(self.headers.get("Content-Length") or 0)
        try:
            body = json.loads(self.rfile.read(length)) if 0 < length <= MAX_BODY_BYTES else {}
            if path == "/sleep":
                out = {"sleep_s": engine.sleep()}
            elif path == "/wake_up":
                out = {"reload_s": engine.wake()}
            else:
                if body.get("cores"):
                    resources.pin_process([int(c) for c in body["cores"]])
                if body.get("threads"):
                    engine.threads = int(body["threads"])
                if body.get("reset_peak"):
                    resources.reset_peak_rss()
                out = {"cores": resources.process_cores(), "threads": engine.threads}
        except RequestError as error:
            self._error(error.status, str(error), error.code)
            return
        except (ValueError, TypeError, OSError) as error:
            self._error(400, f"{path}: {error}")
            return
        self._send(200, out)

    def do_POST(self) -> None:  # noqa: N802
        path = self.path.split("?", 1)[0].rstrip("/")
        if path in ("/sleep", "/wake_up", "/mmyatt/placement"):
            if self._authorized():
                self._placement(path)
            else:
                self._drain()
            return
        if path != "/v1/chat/completions":
            self._drain()
            self._error(404, f"no route POST {path}", code="not_found")
            return
        if not self._authorized():
            self._drain()
            return
        length = self.headers.get("Content-Length")
        if length is None:
            self.close_connection = True
            self._error(411, "a Content-Length header is required")
            return
        try:
            size = int(length)
        except ValueError:
            self.close_connection = True
            self._error(400, "bad Content-Length")
            return
        if size > MAX_BODY_BYTES:
            self.close_connection = True
            self._error(413, f"request body over {MAX_BODY_BYTES} bytes")
            return
        raw = self.rfile.read(size)
        judge = self.server.judge
        try:
            body = json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError) as error:
            self._error(400, f"the request body is not valid JSON: {error}")
            return
        try:
            work = parse_request(
                body,
                model_names=judge.model_names,
                allow_images=judge.allow_images,
                max_logprobs=judge.max_logprobs,
            )
            result = judge.engine.submit(work).result(timeout=judge.request_timeout_s)
        except RequestError as error:
            self._error(error.status, str(error), error.code, error.param)
            return
        except FutureTimeout:
            self._error(504, "the judge model did not answer in time")
            return
        except ValueError as error:  # the model refused the input
            self._error(400, str(error))
            return
        except Exception as error:  # noqa: BLE001 - reported to the client as a 500
            self._error(500, f"judge model error: {type(error).__name__}: {error}")
            return
        response = {
            "id": f"chatcmpl-{uuid.uuid4().hex}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": judge.model_name,
            **result,
        }
        ms = result["mmyatt"]["model_time_ms"]
        self._send(200, response, {"x-mmyatt-model-time-ms": f"{ms:.3f}"})

    def _drain(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        if 0 < length <= MAX_BODY_BYTES:
            self.rfile.read(length)
        elif length:
            self.close_connection = True


def is_loopback(host: str) -> bool:
    if host in ("localhost", ""):
        return host == "localhost"
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class JudgeServer:
    """The judge server, in-process: ``JudgeServer(model_dir_or_model).start()``.

    ``model`` is a model directory (loaded with :func:`load_judge`) or a ready
    :class:`JudgeModel`. ``port=0`` picks a free port; ``.url`` says which.
    ``start()`` serves from a background thread; ``serve_forever()`` blocks.
    ``stop()`` closes the listening socket and every open connection and fails
    queued requests with 503, like a killed server.
    """

    def __init__(
        self,
        model: str | Path | JudgeModel,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        api_key: str | None = None,
        max_batch: int = 32,
        batch_wait_ms: float = 5.0,
        max_logprobs: int = 20,
        model_name: str | None = None,
        request_timeout_s: float = 600.0,
        log_requests: bool = False,
        device: str | None = None,
    ):
        if isinstance(model, (str, Path)):
            path = str(model)
            self.model: JudgeModel = load_judge(path, device=device)
            self.model_name = model_name or path
            self.model_names = tuple(dict.fromkeys([self.model_name, path, Path(path).name]))
        else:
            self.model = model
            self.model_name = model_name or getattr(model, "name", None) or "judge"
            self.model_names = (self.model_name,)
        self.allow_images = bool(getattr(self.model, "supports_images", True))
        self.api_key = api_key or None
        self.max_logprobs = int(max_logprobs)
        self.request_timeout_s = float(request_timeout_s)
        self.log_requests = log_requests
        self.created = int(time.time())
        if not is_loopback(host):
            print(
                f"WARNING: the judge server listens on {host}, not loopback: anyone who can "
                "reach this address can use it"
                + ("" if self.api_key else " (and no API key is set)"),
                file=sys.stderr,
                flush=True,
            )
        self.engine = _Engine(self.model, max_batch, batch_wait_ms)
        if isinstance(model, (str, Path)):
            self.engine.loader = lambda: load_judge(str(model), device=device)
        self._initial_model = None  # the engine holds the only reference (sleep frees it)
        try:
            self.httpd = _HTTPServer((host, port), _Handler, self)
        except BaseException:
            self.engine.stop()
            raise
        self.host = host
        self.port = int(self.httpd.server_address[1])
        self._thread: threading.Thread | None = None

    @property
    def model(self) -> JudgeModel | None:
        """The served model (None while asleep, see ``POST /sleep``)."""
        engine = self.__dict__.get("engine")
        return engine.model if engine is not None else self._initial_model

    @model.setter
    def model(self, value) -> None:
        self._initial_model = value

    @property
    def url(self) -> str:
        host = self.host if ":" not in self.host else f"[{self.host}]"
        if host in ("0.0.0.0", "[::]"):
            host = "127.0.0.1"
        return f"http://{host}:{self.port}"

    @property
    def stats(self) -> dict:
        from mmyatt.placement.resources import cpu_seconds, peak_rss_mb, rss_mb

        with self.engine.lock:
            stats = json.loads(json.dumps(self.engine.stats))  # a deep copy, JSON keys
        stats.update(
            pid=os.getpid(), cpu_s=cpu_seconds(), rss_mb=rss_mb(), peak_rss_mb=peak_rss_mb()
        )
        stats["max_batch"] = self.engine.max_batch
        stats["batch_wait_ms"] = self.engine.batch_wait_s * 1000.0
        return stats

    def start(self) -> JudgeServer:
        self._thread = threading.Thread(
            target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        )
        self._thread.start()
        return self

    def serve_forever(self) -> None:
        self.httpd.serve_forever(poll_interval=0.2)

    def stop(self) -> None:
        if self._thread is not None:
            self.httpd.shutdown()
            self._thread.join(timeout=10)
            self._thread = None
        self.httpd.server_close()
        self.httpd.close_connections()
        self.engine.stop()

    def __enter__(self) -> JudgeServer:
        return self.start() if self._thread is None else self

    def __exit__(self, *exc) -> None:
        self.stop()


def serve(
    model_dir: str | Path,
    host: str = "127.0.0.1",
    port: int = 8000,
    api_key: str | None = None,
    max_batch: int = 32,
    batch_wait_ms: float = 5.0,
    **kwargs,
) -> None:
    """Serve ``model_dir`` in the foreground until interrupted."""
    server = JudgeServer(
        model_dir,
        host=host,
        port=port,
        api_key=api_key,
        max_batch=max_batch,
        batch_wait_ms=batch_wait_ms,
        **kwargs,
    )
    print(f"judge server for {server.model_name} on {server.url}", file=sys.stderr, flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.stop()


def _watch_parent(parent_pid: int) -> None:
    """Exit when the process that started us is gone (no orphaned judges holding GPUs)."""

    def watch() -> None:
        while True:
            time.sleep(1.0)
            if os.getppid() != parent_pid:
                os._exit(0)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def cli_main(args: argparse.Namespace) -> int:
    """``mmyatt serve-genrm``: ``args`` has model_dir, host, port and api_key.

    The key may also come from the environment variable ``MMYATT_GENRM_API_KEY``,
    which keeps it out of ``ps`` output.
    """
    api_key = getattr(args, "api_key", None) or os.environ.get(API_KEY_ENV) or None
    threads = getattr(args, "threads", None)
    if threads:
        import torch

        torch.set_num_threads(int(threads))
    server = JudgeServer(
        args.model_dir,
        host=args.host,
        port=int(args.port),
        api_key=api_key,
        max_batch=int(getattr(args, "max_batch", 32)),
        batch_wait_ms=float(getattr(args, "batch_wait_ms", 5.0)),
        max_logprobs=int(getattr(args, "max_logprobs", 20)),
        log_requests=bool(getattr(args, "log_requests", False)),
        device=getattr(args, "device", None),
    )
    port_file = getattr(args, "port_file", None)
    if port_file:  # written last and atomically: its presence means "listening"
        tmp = Path(str(port_file) + ".tmp")
        tmp.write_text(str(server.port))
        tmp.replace(port_file)
    parent = getattr(args, "parent_pid", None)
    if parent:
        _watch_parent(int(parent))
    print(f"judge server for {server.model_name} on {server.url}", file=sys.stderr, flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.stop()
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="mmyatt serve-genrm", description="serve a GenRM judge (OpenAI API subset)"
    )
    p.add_argument("model_dir")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000, help="0 picks a free port")
    p.add_argument("--api-key", default=None, help=f"or set ${API_KEY_ENV} (kept out of ps)")
    p.add_argument("--max-batch", type=int, default=32)
    p.add_argument("--batch-wait-ms", type=float, default=5.0)
    p.add_argument("--max-logprobs", type=int, default=20)
    p.add_argument("--device", default=None, help="cpu | cuda | auto (default)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    p.add_argument("--log-requests", action="store_true")
    p.add_argument("--port-file", default=None, help=argparse.SUPPRESS)
    p.add_argument("--parent-pid", type=int, default=None, help=argparse.SUPPRESS)
    return p


def main(argv: list[str] | None = None) -> int:
    return cli_main(build_parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
