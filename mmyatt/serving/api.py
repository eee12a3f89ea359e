"""The judge server's wire format: a pydantic model for every route's request and answer.

An OpenAI chat-completions subset (what GenRM rewards send; what ``vllm serve``
answers), vLLM's ``/sleep`` and ``/wake_up``, and mmyatt's ``/stats`` and
``/mmyatt/placement``. Errors have OpenAI's shape ``{"error": {"message", "type",
"param", "code"}}`` (:class:`ErrorBody`). Unknown request fields are ignored, as
OpenAI-compatible servers do.
"""

from __future__ import annotations

import base64
import binascii
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

MAX_TOKENS = 8192


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="ignore")


# --- POST /v1/chat/completions ---------------------------------------------------------
class TextPart(_Lenient):
    type: Literal["text"]
    text: str


class ImageURL(_Lenient):
    url: str

    @field_validator("url")
    @classmethod
    def _inline(cls, url: str) -> str:
        if not url.startswith("data:image/") or "," not in url:
            raise ValueError(
                "only inline images as 'data:image/...;base64,' URLs are accepted "
                "(nothing is fetched)"
            )
        try:
            base64.b64decode(url.split(",", 1)[1], validate=True)
        except (binascii.Error, ValueError) as error:
            raise ValueError("bad base64 image") from error
        return url


class ImagePart(_Lenient):
    type: Literal["image_url"]
    image_url: ImageURL


Part = Annotated[TextPart | ImagePart, Field(discriminator="type")]


class Message(_Lenient):
    role: Literal["system", "user", "assistant"]
    content: str | list[Part]


class ChatRequest(_Lenient):
    """The chat-completions fields the judge server reads."""

    model: str | None = None
    messages: list[Message]
    max_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS)
    max_completion_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    logprobs: bool | None = False
    top_logprobs: int | None = Field(None, ge=0)
    n: int = Field(1, ge=1, le=64)
    seed: int | None = None
    stream: bool | None = False

    @field_validator("messages")
    @classmethod
    def _non_empty(cls, messages: list[Message]) -> list[Message]:
        if not messages:
            raise ValueError("'messages' must be a non-empty list")
        return messages


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChoiceLogprobs(BaseModel):
    content: list[TokenLogprob]


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class Choice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChoiceLogprobs | None = None
    finish_reason: Literal["stop", "length"]


class Timing(BaseModel):
    """mmyatt's extra field (OpenAI clients ignore it): the model call that served it."""

    model_time_ms: float
    batch_size: int
    queue_ms: float


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[Choice]
    mmyatt: Timing


# --- the other routes ------------------------------------------------------------------
class Health(BaseModel):
    status: Literal["ok"] = "ok"
    model: str


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "mmyatt"


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class Slept(BaseModel):
    sleep_s: float


class Woken(BaseModel):
    reload_s: float


class PlacementRequest(_Lenient):
    """Pin the server to ``cores``, set its torch ``threads``, reset its peak counters."""

    cores: list[int] = []
    threads: int | None = Field(None, ge=1)
    reset_peak: bool = False


class Placement(BaseModel):
    cores: list[int]
    threads: int | None


class Stats(BaseModel):
    """Batching, timing and memory counters of one server."""

    requests: int
    batches: int
    model_calls: int
    max_batch_seen: int
    batch_sizes: dict[int, int]
    model_time_s: float
    errors: int
    waited_batches: int
    sleeping: bool
    reloads: int
    reload_s: float
    sleeps: int
    pid: int
    cpu_s: float
    rss_mb: float
    peak_rss_mb: float
    device_mb: float
    device_peak_mb: float
    max_batch: int
    batch_wait_ms: float


class ErrorDetail(BaseModel):
    message: str
    type: Literal["invalid_request_error", "server_error"]
    param: str | None = None
    code: str | None = None


class ErrorBody(BaseModel):
    error: ErrorDetail
