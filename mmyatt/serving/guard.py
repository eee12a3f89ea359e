"""The judge server's HTTP edge: OpenAI-shaped errors (:class:`APIError`, and pydantic's
validation errors as one 400) and :class:`Guard`, the ASGI middleware that checks the API
key and bounds the body before a route sees the request."""

from __future__ import annotations

import hmac
from collections.abc import Sequence

from fastapi.responses import JSONResponse

DRAIN_FACTOR = 4  # how much of a too-large body is read and dropped before the 413
OPEN_PATHS = ("/health",)  # liveness probes need no key, as in vLLM


class APIError(Exception):
    """Answered with ``status`` and an OpenAI error body."""

    def __init__(self, message: str, status: int = 400, code: str | None = None, param=None):
        super().__init__(message)
        self.status, self.code, self.param = status, code, param

    def response(self) -> JSONResponse:
        kind = "invalid_request_error" if self.status < 500 else "server_error"
        body = {"message": str(self), "type": kind, "param": self.param, "code": self.code}
        headers = {"WWW-Authenticate": "Bearer"} if self.status == 401 else None
        return JSONResponse({"error": body}, status_code=self.status, headers=headers)


def validation_error(errors: Sequence[dict]) -> APIError:
    """pydantic's (or FastAPI's) validation errors as one OpenAI-style 400."""
    # the most specific error: a union (string or list of parts) reports every branch
    first = max(errors, key=lambda e: len(e.get("loc", ()))) if errors else {}
    if first.get("type") == "json_invalid":
        why = first.get("ctx", {}).get("error") or first.get("msg")
        return APIError(f"the request body is not valid JSON: {why}")
    loc = [str(x) for x in first.get("loc", ()) if x != "body"]
    loc = [x for x in loc if x != "str" and "[" not in x]  # union branch tags
    text = str(first.get("msg", "invalid request")).removeprefix("Value error, ")
    return APIError(f"{'.'.join(loc) or 'body'}: {text}", param=loc[0] if loc else None)


class Guard:
    """ASGI middleware in front of the app: the API key (401) and the body limit (413).
    A refused body is read and dropped (up to ``DRAIN_FACTOR`` times the limit) before
    the answer goes out, so that a client still sending it reads the answer instead of a
    reset connection."""

    def __init__(self, app, api_key: str | None, max_body_bytes: int):
        self.app, self.key, self.limit = app, api_key, max_body_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        if self.key is not None and scope["path"].rstrip("/") not in OPEN_PATHS:
            scheme, _, token = headers.get(b"authorization", b"").decode("latin-1").partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(
                token.strip().encode("utf-8"), self.key.encode("utf-8")
            ):
                await _drain(receive, self.limit * DRAIN_FACTOR)
                message = "missing or incorrect API key: send 'Authorization: Bearer <key>'"
                error = APIError(message, 401, "invalid_api_key")
                return await error.response()(scope, receive, send)
        if scope["method"] != "POST":
            return await self.app(scope, receive, send)
        length = headers.get(b"content-length", b"")
        if length.isdigit() and int(length) > self.limit * DRAIN_FACTOR:  # cut off, unread
            return await self._too_large(scope, receive, send)
        chunks, size, more = [], 0, True
        while more:  # the whole body, bounded, then replayed to the app
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            more = message.get("more_body", False)
            if size > self.limit:
                if more:
                    await _drain(receive, self.limit * DRAIN_FACTOR - size)
                return await self._too_large(scope, receive, send)
        queued = [{"type": "http.request", "body": b"".join(chunks), "more_body": False}]

        async def replay():
            return queued.pop() if queued else await receive()

        return await self.app(scope, replay, send)

    async def _too_large(self, scope, receive, send):
        response = APIError(f"request body over {self.limit} bytes", 413).response()
        response.headers["connection"] = "close"
        await response(scope, receive, send)


async def _drain(receive, budget: int) -> None:
    """Read and drop up to ``budget`` bytes of the request body."""
    while budget > 0:
        message = await receive()
        if message["type"] != "http.request":
            return
        budget -= len(message.get("body", b""))
        if not message.get("more_body", False):
            return
