"""The judge server's HTTP API: pydantic request models and the FastAPI app.

An OpenAI chat-completions subset (what GenRM rewards send; what ``vllm serve``
answers): ``GET /health``, ``GET /v1/models``, ``POST /v1/chat/completions``,
``GET /stats``, and the placement routes ``POST /sleep``, ``POST /wake_up`` (vLLM's
names) and ``POST /mmyatt/placement``. Errors have OpenAI's shape
``{"error": {"message", "type", "param", "code"}}``; a request that fails validation
is a 400 (as in vLLM), not FastAPI's 422.

A pure ASGI middleware in front of the app logs requests (request line and status,
never headers: the API key), checks the key and bounds the body. A body over the limit
is read and dropped before the 413 goes out, so that a client still sending it reads
the answer instead of a reset connection (bodies far over the limit are cut off).

The hot route, ``POST /v1/chat/completions``, is answered by that middleware itself
(:func:`chat_completion`): the body it has read is validated in one pass by pydantic's
JSON parser and the answer written as JSON bytes, without FastAPI's routing, dependency
solving and response classes (the largest Python items in a profile of the request
path; BENCHMARKS.md, "GenRM serving"). Errors keep the same OpenAI shape and status
codes as on the FastAPI routes; the answer is written by orjson.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import hmac
import io
import sys
import time
import uuid
from typing import TYPE_CHECKING, Annotated, Any, Literal

import orjson
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from mmyatt.rewards.judge_batcher import BatcherStopped, Result, Work
from mmyatt.rewards.judge_http import within

if TYPE_CHECKING:
    from mmyatt.rewards.judge_server import JudgeServer

MAX_TOKENS = 8192
# how much of a too-large body is read and dropped so that the client sees the 413
DRAIN_FACTOR = 4


# --------------------------------------------------------------------------------------
# Request models
# --------------------------------------------------------------------------------------
class _Strict(BaseModel):
    model_config = ConfigDict(extra="ignore")


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ImageURL(_Strict):
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


class ImagePart(_Strict):
    type: Literal["image_url"]
    image_url: ImageURL


Part = Annotated[TextPart | ImagePart, Field(discriminator="type")]


class Message(_Strict):
    role: Literal["system", "user", "assistant"]
    content: str | list[Part]


class ChatRequest(_Strict):
    """The chat-completions fields the judge server reads; others are ignored."""

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


class APIError(Exception):
    """Answered with ``status`` and an OpenAI error body."""

    def __init__(self, message: str, status: int = 400, code: str | None = None, param=None):
        super().__init__(message)
        self.status, self.code, self.param = status, code, param


def error_body(message: str, status: int, code: str | None = None, param=None) -> dict:
    kind = "invalid_request_error" if status < 500 else "server_error"
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def _error_response(error: APIError) -> JSONResponse:
    headers = {"WWW-Authenticate": "Bearer"} if error.status == 401 else None
    body = error_body(str(error), error.status, error.code, error.param)
    return JSONResponse(body, status_code=error.status, headers=headers)


def validation_error(errors: list[dict]) -> APIError:
    """pydantic's (or FastAPI's) validation errors as one OpenAI-style 400."""
    # the most specific error: a union (string or list of parts) reports every branch
    first = max(errors, key=lambda e: len(e.get("loc", ()))) if errors else {}
    if first.get("type") == "json_invalid":
        why = first.get("ctx", {}).get("error") or first.get("msg")
        return APIError(f"the request body is not valid JSON: {why}")
    loc = [str(x) for x in first.get("loc", ()) if x != "body"]
    loc = [x for x in loc if x != "str" and "[" not in x]  # union branch tags
    param = loc[0] if loc else None
    text = str(first.get("msg", "invalid request")).removeprefix("Value error, ")
    return APIError(f"{'.'.join(loc) or 'body'}: {text}", param=param)


def _check_image(url: str) -> None:
    from PIL import Image, UnidentifiedImageError

    data = base64.b64decode(url.split(",", 1)[1])
    try:
        with Image.open(io.BytesIO(data)) as image:
            image.verify()
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError) as error:
        raise APIError(f"an image part is not a readable image: {error}") from error


def to_work(req: ChatRequest, server: JudgeServer) -> Work:
    """Check what the request models cannot (this server's model, limits, images)."""
    if req.model is not None and req.model not in server.model_names:
        raise APIError(
            f"the model {req.model!r} does not exist; this server serves {server.model_name!r}",
            404,
            "model_not_found",
            "model",
        )
    if req.stream:
        raise APIError("streaming is not supported by the embedded judge server", param="stream")
    messages = []
    for i, m in enumerate(req.messages):
        if isinstance(m.content, list):
            for j, part in enumerate(m.content):
                if isinstance(part, ImagePart):
                    if not server.allow_images:
                        raise APIError(
                            f"messages[{i}].content[{j}]: this judge is a text-only model; "
                            "serve a VLM judge (Qwen2-VL / Qwen2.5-VL) to judge images",
                            param="messages",
                        )
                    _check_image(part.image_url.url)
            content: Any = [p.model_dump() for p in m.content]
        else:
            content = m.content
        messages.append({"role": m.role, "content": content})
    max_tokens = req.max_completion_tokens or req.max_tokens or 128
    top = req.top_logprobs or 0
    if top > server.max_logprobs:
        raise APIError(
            f"'top_logprobs' must be an integer in [0, {server.max_logprobs}], got {top}",
            param="top_logprobs",
        )
    if top and not req.logprobs:
        raise APIError("'top_logprobs' needs 'logprobs': true", param="top_logprobs")
    if req.logprobs and max_tokens > 1:
        raise APIError(
            "logprobs are only available with max_tokens=1 on the embedded judge server "
            "(next-token distribution); use vLLM for per-token logprobs of generated text",
            param="logprobs",
        )
    temperature = 1.0 if req.temperature is None else float(req.temperature)
    return Work(messages, max_tokens, temperature, bool(req.logprobs), top, req.n, req.seed)


def _entry(token: str, logprob: float) -> dict:
    # -inf (a token the model cannot emit) as vLLM writes it: JSON has no infinity
    logprob = max(logprob, -9999.0)
    return {"token": token, "logprob": logprob, "bytes": list(token.encode("utf-8"))}


def choices(work: Work, result: Result) -> list[dict]:
    out = []
    top = result.top
    for j in range(work.n):
        if work.next_token_only:
            assert top is not None
            token, lp = top[0]
            finish = "length"
        else:
            text, lps = result.generations[j]
            token, lp = text, (lps[0] if lps else 0.0)
            finish = "length" if len(lps) >= work.max_tokens else "stop"
        choice: dict[str, Any] = {
            "index": j,
            "message": {"role": "assistant", "content": token},
            "logprobs": None,
            "finish_reason": finish,
        }
        if work.logprobs and top is not None:
            entry = _entry(token, lp)
            entry["top_logprobs"] = [_entry(t, v) for t, v in top[: work.top_logprobs]]
            choice["logprobs"] = {"content": [entry]}
        out.append(choice)
    return out


async def chat_completion(
    body: bytes, server: JudgeServer, alone=lambda: False
) -> tuple[bytes, float]:
    """The answer to a chat-completions body (JSON bytes) and the model ms it took;
    :class:`APIError` for anything the client is told about. ``alone()`` says whether
    this is the only chat request the server holds (then it may be served at once, in
    this thread: ``Batcher.serve_now``)."""
    try:
        work = to_work(ChatRequest.model_validate_json(body), server)
    except ValidationError as error:
        raise validation_error(error.errors()) from None
    batcher = server.batcher
    try:
        inline = batcher.inline and work.next_token_only and alone()
        if inline:  # requests read in the same pass of the loop get here first
            await asyncio.sleep(0)
        if inline and alone() and batcher.serve_now(work):
            result = work.future.result()
        else:
            result = await within(
                asyncio.wrap_future(batcher.submit(work)), server.request_timeout_s
            )
    except BatcherStopped as error:
        raise APIError(str(error), 503) from error
    except asyncio.TimeoutError as error:
        raise APIError("the judge model did not answer in time", 504) from error
    except ValueError as error:  # the model refused the input
        raise APIError(str(error)) from error
    except Exception as error:  # noqa: BLE001 - reported to the client as a 500
        raise APIError(f"judge model error: {type(error).__name__}: {error}", 500) from error
    ms = result.model_time_s * 1000.0
    response = {
        "id": f"chatcmpl-{uuid.uuid4().hex}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": server.model_name,
        "choices": choices(work, result),
        "mmyatt": {
            "model_time_ms": ms,
            "batch_size": result.batch_size,
            "queue_ms": result.queue_s * 1000.0,
        },
    }
    return orjson.dumps(response), ms


# --------------------------------------------------------------------------------------
# The app
# --------------------------------------------------------------------------------------
_OPEN_PATHS = ("/health",)  # liveness probes need no key, as in vLLM
CHAT_PATH = "/v1/chat/completions"


class Guard:
    """Pure ASGI middleware: request log, API key, body limit (see the module docstring)."""

    def __init__(self, app, server: JudgeServer):
        self.app, self.server = app, server
        self.chats = 0  # chat requests read and not yet answered
        self._warm_until = 0.0  # the event loop polls without sleeping until then
        self._warm: asyncio.Task | None = None

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        status_seen: list[int] = []

        async def send_logged(message):
            if message["type"] == "http.response.start":
                status_seen.append(message["status"])
            await send(message)

        try:
            await self._guarded(scope, receive, send_logged)
        finally:
            if self.server.log_requests:  # the request line and status only, never headers
                client = scope.get("client") or ("-", 0)
                sys.stderr.write(
                    f'judge {client[0]}:{client[1]} "{scope["method"]} {scope["path"]}" '
                    f"{status_seen[0] if status_seen else '-'}\n"
                )

    async def _guarded(self, scope, receive, send):
        headers = dict(scope["headers"])
        path = scope["path"].rstrip("/") or "/"
        limit = self.server.max_body_bytes
        length = headers.get(b"content-length")
        declared = int(length) if length is not None and length.isdigit() else None
        key = self.server.api_key
        if key is not None and path not in _OPEN_PATHS:
            scheme, _, token = headers.get(b"authorization", b"").decode("latin-1").partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(
                token.strip().encode("utf-8"), key.encode("utf-8")
            ):
                await self._drain(receive, limit * DRAIN_FACTOR)
                error = APIError(
                    "missing or incorrect API key: send 'Authorization: Bearer <key>'",
                    401,
                    "invalid_api_key",
                )
                return await _error_response(error)(scope, receive, send)
        if scope["method"] != "POST":
            return await self.app(scope, receive, send)
        if declared is not None and declared > limit * DRAIN_FACTOR:  # cut off, unread
            return await self._too_large(scope, receive, send)
        chunks, size = [], 0
        while True:  # the whole body, bounded, then replayed to the app
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                if message.get("more_body", False):
                    await self._drain(receive, limit * DRAIN_FACTOR - size)
                return await self._too_large(scope, receive, send)
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        if path == CHAT_PATH:  # the hot route, answered here (see the module docstring)
            return await self._chat(body, scope, receive, send)
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        return await self.app(scope, replay, send)

    async def _chat(self, body: bytes, scope, receive, send):
        self.chats += 1
        try:
            payload, ms = await chat_completion(body, self.server, lambda: self.chats == 1)
        except APIError as error:
            return await _error_response(error)(scope, receive, send)
        finally:
            self.chats -= 1
        headers = [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(payload)).encode("latin-1")),
            (b"x-mmyatt-model-time-ms", f"{ms:.3f}".encode("latin-1")),
        ]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": payload})
        if self.server.keep_warm_s > 0:
            self._warm_until = time.perf_counter() + self.server.keep_warm_s
            if self._warm is None or self._warm.done():
                self._warm = asyncio.ensure_future(self._keep_warm())

    async def _keep_warm(self) -> None:
        """Poll the sockets without sleeping until ``_warm_until`` (``--keep-warm-ms``
        after the last answer): a client that sends its next request within the window
        finds the loop running on a warm core instead of waking an idle one."""
        while time.perf_counter() < self._warm_until:
            self.server.warm_polls += 1
            await asyncio.sleep(0)

    async def _too_large(self, scope, receive, send):
        error = APIError(f"request body over {self.server.max_body_bytes} bytes", 413)
        response = _error_response(error)
        response.headers["connection"] = "close"
        await response(scope, receive, send)

    @staticmethod
    async def _drain(receive, budget: int) -> None:
        """Read and drop up to ``budget`` bytes of the request body."""
        while budget > 0:
            message = await receive()
            if message["type"] != "http.request":
                return
            budget -= len(message.get("body", b""))
            if not message.get("more_body", False):
                return


def build_app(server: JudgeServer) -> Any:
    """The FastAPI app of ``server`` wrapped in its :class:`Guard`."""
    app = FastAPI(title="mmyatt judge", docs_url=None, redoc_url=None, openapi_url=None)

    @app.exception_handler(APIError)
    async def _api_error(_: Request, error: APIError):
        return _error_response(error)

    @app.exception_handler(RequestValidationError)
    @app.exception_handler(ValidationError)
    async def _invalid(_: Request, error: RequestValidationError | ValidationError):
        return _error_response(validation_error(error.errors()))

    @app.exception_handler(404)
    async def _no_route(request: Request, _):
        return _error_response(
            APIError(f"no route {request.method} {request.url.path}", 404, "not_found")
        )

    @app.exception_handler(405)
    async def _no_method(request: Request, _):
        return _error_response(
            APIError(f"no route {request.method} {request.url.path}", 404, "not_found")
        )

    @app.get("/health")
    async def health():
        return {"status": "ok", "model": server.model_name}

    @app.get("/v1/models")
    async def models():
        card = {"object": "model", "created": server.created, "owned_by": "mmyatt"}
        return {"object": "list", "data": [{"id": server.model_name, **card}]}

    @app.get("/stats")
    def stats():
        return server.stats

    # POST /v1/chat/completions is answered by the Guard (chat_completion)

    @app.post("/sleep")
    def sleep():
        try:
            return {"sleep_s": server.batcher.sleep()}
        except ValueError as error:
            raise APIError(f"/sleep: {error}") from error

    @app.post("/wake_up")
    def wake_up():
        return {"reload_s": server.batcher.wake()}

    @app.post("/mmyatt/placement")
    def placement(body: dict[str, Any] | None = None):
        """{"cores": [...], "threads": n, "reset_peak": bool}: pin this server to cores and
        set its torch threads (mmyatt/placement)."""
        from mmyatt.placement import resources

        body = body or {}
        try:
            if body.get("cores"):
                resources.pin_process([int(c) for c in body["cores"]])
            if body.get("threads"):
                server.batcher.threads = int(body["threads"])
            if body.get("reset_peak"):
                resources.reset_peak_rss()
                resources.reset_device_peak()
        except (ValueError, TypeError, OSError) as error:
            raise APIError(f"/mmyatt/placement: {error}") from error
        return {"cores": resources.process_cores(), "threads": server.batcher.threads}

    return Guard(app, server)
