"""Asynchronous client for GenRM judge servers speaking OpenAI chat completions.

The same client talks to the embedded server (``mmyatt serve-genrm``) and to vLLM
unchanged. A vLLM judge for ``yes_prob`` rewards (top-k next-token logprobs) is::

    vllm serve /path/to/judge --host 127.0.0.1 --port 8000 --api-key K --max-logprobs 20

(``--max-logprobs`` must be at least the ``top_logprobs`` the reward asks for; for a
VLM judge add e.g. ``--limit-mm-per-prompt '{"image": 1}'``). Then
``JudgeClient(["http://127.0.0.1:8000"], api_key="K")``. SGLang's OpenAI server works
the same way.

* **Async core, sync facade.** Requests are ``httpx.Request`` objects sent through an
  httpx transport on the client's private asyncio event loop; answers are
  ``httpx.Response`` objects. A synchronous call (``chat_many``, ``health``) runs that
  loop on the caller's own thread while no other thread uses it, which saves two
  thread wake-ups per call (caller to loop and back); the first asynchronous call, or a
  second thread calling while the loop is in use, hands the loop to a daemon thread for
  good, which then serves every call.
* **One request, no loop.** ``chat(request)`` sends its one request on blocking sockets
  in the calling thread (:class:`mmyatt.rewards.judge_http.BlockingTransport`, the same
  connections, parser and errors as the pooled transport), with the same retries,
  balancing and counters, and a ``max_in_flight`` bound of its own across the threads
  calling ``chat``. Its head is built once per server and its answer read as bytes (no
  ``httpx.Request``/``Response`` per call), and tenacity is entered only after a first
  attempt failed: at 1 in flight the client's work sits between two of the judge's
  forwards, on a core gone cold (BENCHMARKS.md, "GenRM serving: a leaner chat()"). A
  given ``transport=`` that is also synchronous (``httpx.MockTransport``) serves ``chat``
  with httpx objects; an async-only one sends it through the loop. The default transport is
  :class:`mmyatt.rewards.judge_http.PooledTransport`: pooled HTTP/1.1 keep-alive
  connections per server, responses parsed by ``httptools`` (the C parser uvicorn
  uses); ``transport=`` takes any other (``httpx.AsyncHTTPTransport(verify=...,
  proxy=..., http2=True)``, ``httpx.MockTransport``), which the client then owns and
  closes. The requests go to the transport directly, not through an
  ``httpx.AsyncClient``, whose layer (cookies, auth and redirect handling, header
  merging) cost 0.1-0.34 ms of client CPU per request on the GenRM bench's requests,
  about as much as the whole transport (BENCHMARKS.md, "GenRM serving").
  ``chat_many(requests)`` blocks the caller and returns responses in order;
  ``await client.achat(request)`` / ``achat_many`` serve async callers on any loop
  (e.g. streaming each finished rollout sample to the judge).
* **Bounded in-flight.** At most ``max_in_flight`` requests are on the wire at once
  from the loop's calls, and as many from the threads calling ``chat``; the server
  batches the ones that arrive together.
* **Least-in-flight balancing.** Each attempt goes to the server with the fewest
  requests in flight (ties rotate), skipping servers that failed recently.
* **Retries** (tenacity). Connection errors, timeouts (``timeout_s`` per attempt),
  HTTP 5xx, 408 and 429 are retried: at once on another healthy server when there is
  one, otherwise after an exponential backoff (``backoff_s * 2**k`` with jitter, capped
  at ``backoff_max_s``). After ``max_retries`` retries the request fails with
  :class:`JudgeUnavailableError`, naming the servers and the last error. Other 4xx
  answers (bad request, wrong key, unknown model) are not retried:
  :class:`JudgeRequestError`.
* **Model name.** A request without ``"model"`` gets ``model=`` from the constructor,
  or else the first id the server lists at ``/v1/models`` (vLLM names a model by the
  path it was served from).
* ``metrics()`` returns counters: requests, attempts, retries, failures, mean latency,
  and per-server requests, errors and in flight.
"""

from __future__ import annotations

import asyncio
import json
import random
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import httpx
import orjson
from tenacity import (
    AsyncRetrying,
    RetryError,
    Retrying,
    retry_if_exception_type,
    stop_after_attempt,
)

from mmyatt.rewards.judge_http import BlockingTransport, PooledTransport, post_head, within

RETRYABLE_STATUS = frozenset({408, 429, 500, 502, 503, 504})


class JudgeError(RuntimeError):
    """Base class of judge client errors."""


class JudgeUnavailableError(JudgeError):
    """No server answered within the retry budget."""

    def __init__(self, message: str, urls: Sequence[str], last_error: BaseException | None):
        super().__init__(message)
        self.urls = list(urls)
        self.last_error = last_error


class JudgeRequestError(JudgeError):
    """The server refused the request (4xx other than 408/429): retrying will not help."""

    def __init__(self, message: str, status: int, url: str, body: Any = None):
        super().__init__(message)
        self.status, self.url, self.body = status, url, body


class _RetryableError(Exception):
    """An attempt failed in a way that another attempt may not."""


@dataclass
class _Server:
    url: str
    host: str
    port: int
    tls: bool
    base_path: str
    in_flight: int = 0
    requests: int = 0
    errors: int = 0
    consecutive_failures: int = 0
    down_until: float = 0.0
    model: str | None = None

    def __post_init__(self) -> None:
        self.chat_url = httpx.URL(self.url + "/v1/chat/completions")  # parsed once


@dataclass
class _Attempts:
    """One request's way through the servers: which were tried since the last backoff."""

    tried: set[int] = field(default_factory=set)
    sleeps: int = 0
    last_error: BaseException | None = None
    last_url: str = ""


def _parse_url(url: str) -> _Server:
    parts = urlsplit(url if "://" in url else f"http://{url}")
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"judge URL {url!r} must look like http://host:port")
    tls = parts.scheme == "https"
    base = parts.path.rstrip("/")
    if base.endswith("/v1"):  # accept OpenAI-style base URLs too
        base = base[: -len("/v1")]
    root = f"{parts.scheme}://{parts.netloc}{base}"
    return _Server(root, parts.hostname, parts.port or (443 if tls else 80), tls, base)


def _dumps(body: dict) -> bytes:
    """JSON bytes of a request body: orjson, or json for what orjson does not take
    (integers over 64 bits, non-string keys)."""
    try:
        return orjson.dumps(body)
    except TypeError:
        return json.dumps(body).encode("utf-8")


def _loop_running_here() -> bool:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


def _new_loop() -> asyncio.AbstractEventLoop:
    try:  # uvloop (a dependency where it builds): less CPU per request
        import uvloop

        return uvloop.new_event_loop()
    except ImportError:
        return asyncio.new_event_loop()


class JudgeClient:
    """See the module docstring. ``urls`` are server roots (``http://127.0.0.1:8000``)."""

    def __init__(
        self,
        urls: Sequence[str] | str,
        *,
        api_key: str | None = None,
        max_in_flight: int = 16,
        timeout_s: float = 30.0,
        max_retries: int = 5,
        backoff_s: float = 0.2,
        backoff_max_s: float = 5.0,
        model: str | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
    ):
        if isinstance(urls, str):
            urls = [urls]
        if not urls:
            raise ValueError("JudgeClient needs at least one server URL")
        if max_in_flight < 1:
            raise ValueError(f"max_in_flight must be >= 1, got {max_in_flight}")
        if max_retries < 0:
            raise ValueError(f"max_retries must be >= 0, got {max_retries}")
        self.servers = [_parse_url(u) for u in urls]
        self.urls = [s.url for s in self.servers]
        self._api_key = api_key or None
        self.max_in_flight = int(max_in_flight)
        self.timeout_s = float(timeout_s)
        self.max_retries = int(max_retries)
        self.backoff_s = float(backoff_s)
        self.backoff_max_s = float(backoff_max_s)
        self.model = model
        self._transport = transport  # the default one is made on the client's loop
        # chat() on blocking sockets: ours, or the given transport when it is also sync
        # (httpx.MockTransport); an async-only transport sends chat() through the loop
        if transport is None:
            self._blocking: httpx.BaseTransport | None = BlockingTransport(self.timeout_s)
        else:
            self._blocking = transport if isinstance(transport, httpx.BaseTransport) else None
        self._timeouts = {
            "timeout": dict.fromkeys(("connect", "read", "write", "pool"), self.timeout_s)
        }
        self._sync_slots = threading.BoundedSemaphore(self.max_in_flight)
        headers = {"Accept": "application/json", "User-Agent": "mmyatt-judge-client"}
        if api_key:
            headers["Authorization"] = f"Bearer {api_key}"
        self._headers = httpx.Headers(headers)
        self._post_headers = httpx.Headers({**headers, "Content-Type": "application/json"})
        self._lean = type(self._blocking) is BlockingTransport  # ours: bytes, no httpx objects
        self._heads = {s.url: post_head(s.chat_url, self._post_headers) for s in self.servers}
        self.counters = {
            "requests": 0,
            "completed": 0,
            "attempts": 0,
            "retries": 0,
            "failures": 0,
            "latency_s_sum": 0.0,
        }
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None  # the daemon thread, once needed
        self._runner = threading.Lock()  # held by a caller running the loop itself
        self._sem: asyncio.Semaphore | None = None
        self._rr = 0

    def __repr__(self) -> str:  # never shows the key
        return f"JudgeClient({self.urls}, max_in_flight={self.max_in_flight})"

    # --- event loop -----------------------------------------------------------------
    def _ensure_loop(self) -> asyncio.AbstractEventLoop:
        """The client's loop, run forever by the daemon thread (started here, once a
        caller running the loop itself has finished)."""
        with self._lock:
            if self._thread is not None:
                return self._loop
        with self._runner:
            with self._lock:
                if self._thread is None:
                    self._loop = self._loop or _new_loop()
                    self._thread = threading.Thread(
                        target=self._loop.run_forever, name="judge-client", daemon=True
                    )
                    self._thread.start()
                return self._loop

    def _run(self, make_coro):
        """Run ``make_coro()`` to its end for a synchronous caller: on the caller's thread
        when the loop is free (no daemon thread, no other caller running it, no event
        loop already running in this thread), else on the daemon thread."""
        if self._thread is None and not _loop_running_here() and self._runner.acquire(False):
            try:
                with self._lock:
                    loop = self._loop = self._loop or _new_loop()
                    free = self._thread is None
                if free:
                    return loop.run_until_complete(make_coro())
            finally:
                self._runner.release()
        return self._submit(make_coro()).result()

    def _submit(self, coro) -> Future:
        return asyncio.run_coroutine_threadsafe(coro, self._ensure_loop())

    async def _send(self, method: str, url: httpx.URL | str, body: bytes | None = None):
        """One HTTP exchange through the transport (made on the client's own loop, where
        its connections live); the answer is read whole. No timeout of its own: each
        attempt is bounded by ``timeout_s`` (:func:`judge_http.within`)."""
        if self._transport is None:
            self._transport = PooledTransport()
        headers = self._headers if body is None else self._post_headers
        request = httpx.Request(method, url, content=body, headers=headers)
        response = await self._transport.handle_async_request(request)
        try:
            await response.aread()
        finally:
            await response.aclose()
        return response

    async def _get(self, server: _Server, path: str) -> httpx.Response:
        return await within(self._send("GET", server.url + path), self.timeout_s)

    def close(self) -> None:
        """Close pooled connections and stop the client's loop (and its thread)."""
        if self._blocking is not None and (self._transport is None or self._loop is None):
            self._blocking.close()  # ours; or a given one that no loop will close
        if self._loop is not None and self._thread is None and _loop_running_here():
            self._ensure_loop()  # this thread cannot run a second loop: the daemon closes
        with self._runner:  # after a caller running the loop itself
            with self._lock:
                loop, thread = self._loop, self._thread
                self._loop = self._thread = None
            if loop is None:
                return
            try:
                if thread is None:
                    loop.run_until_complete(self._close_all())
                else:
                    asyncio.run_coroutine_threadsafe(self._close_all(), loop).result(timeout=5)
            finally:
                if thread is not None:
                    loop.call_soon_threadsafe(loop.stop)
                    thread.join(timeout=5)
                loop.close()
                self._sem = None

    async def _close_all(self) -> None:
        if self._transport is not None:
            await self._transport.aclose()

    def __enter__(self) -> JudgeClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # --- public API -----------------------------------------------------------------
    def chat_many(
        self, requests: Sequence[dict], *, return_exceptions: bool = False
    ) -> list[dict | BaseException]:
        """Send chat-completion bodies concurrently; responses come back in order."""
        if self._thread is not None and threading.current_thread() is self._thread:
            raise RuntimeError("chat_many cannot be called from the client's own loop")
        return self._run(lambda: self._chat_many(list(requests), return_exceptions))

    def chat(self, request: dict) -> dict:
        """Send one chat-completion body and wait for its answer: on blocking sockets
        (:class:`~mmyatt.rewards.judge_http.BlockingTransport`) in the calling thread,
        with the same retries, balancing and counters as the async path."""
        if self._thread is not None and threading.current_thread() is self._thread:
            raise RuntimeError("chat cannot be called from the client's own loop")
        if self._blocking is None:  # an async-only transport was given
            return self._run(lambda: self._chat(request))
        self._count("requests")
        with self._sync_slots, self._timed(), self._final_errors(state := _Attempts()):
            try:  # the first attempt outside tenacity: most requests need no other
                return self._attempt_sync(request, state)
            except _RetryableError as error:
                if not self.max_retries:
                    raise RetryError(None) from error  # out of attempts, as tenacity says
            self._count("retries")  # then as tenacity's loop: wait, count, try again
            time.sleep(self._wait_before_retry(state))
            retries = self._retrying(Retrying, state, self.max_retries)
            return retries(self._attempt_sync, request, state)

    async def achat(self, request: dict) -> dict:
        return await asyncio.wrap_future(self._submit(self._chat(request)))

    async def achat_many(
        self, requests: Sequence[dict], *, return_exceptions: bool = False
    ) -> list[dict | BaseException]:
        return await asyncio.wrap_future(
            self._submit(self._chat_many(list(requests), return_exceptions))
        )

    def health(self) -> dict[str, bool]:
        """``{url: healthy}`` from ``GET /health`` (one attempt each, no retries)."""

        async def check(server: _Server) -> bool:
            try:
                return (await self._get(server, "/health")).status_code == 200
            except Exception:  # noqa: BLE001 - any failure means not healthy
                return False

        async def run() -> list[bool]:
            return list(await asyncio.gather(*(check(s) for s in self.servers)))

        return dict(zip(self.urls, self._run(run)))

    def metrics(self) -> dict:
        with self._lock:
            out = dict(self.counters)
        done = max(out["completed"], 1)
        out["mean_latency_ms"] = out.pop("latency_s_sum") / done * 1000.0
        out["servers"] = {
            s.url: {"requests": s.requests, "errors": s.errors, "in_flight": s.in_flight}
            for s in self.servers
        }
        out["in_flight"] = {s.url: s.in_flight for s in self.servers}
        return out

    # --- internals ------------------------------------------------------------------
    def _count(self, key: str, value: float = 1) -> None:
        with self._lock:
            self.counters[key] += value

    async def _chat_many(self, requests: list[dict], return_exceptions: bool) -> list:
        tasks = [asyncio.ensure_future(self._chat(r)) for r in requests]
        try:
            return list(await asyncio.gather(*tasks, return_exceptions=return_exceptions))
        finally:
            for t in tasks:  # on the first error, do not leave the rest running
                t.cancel()

    async def _chat(self, request: dict) -> dict:
        if self._sem is None:
            self._sem = asyncio.Semaphore(self.max_in_flight)
        self._count("requests")
        async with self._sem:
            with self._timed():
                return await self._with_retries(request)

    @contextmanager
    def _timed(self):
        """Count a request that completes, and its latency."""
        t0 = time.perf_counter()
        yield
        self._count("completed")
        self._count("latency_s_sum", time.perf_counter() - t0)

    def _pick(self, exclude: set[int]) -> int:
        now = time.monotonic()
        n = len(self.servers)
        candidates = [i for i in range(n) if i not in exclude] or list(range(n))
        up = [i for i in candidates if self.servers[i].down_until <= now]
        pool = up or candidates
        start = self._rr
        self._rr = (self._rr + 1) % n
        return min(pool, key=lambda i: (self.servers[i].in_flight, (i - start) % n))

    def _backoff(self, k: int) -> float:
        delay = min(self.backoff_max_s, self.backoff_s * (2**k))
        return delay * (0.5 + 0.5 * random.random())

    def _wait_before_retry(self, state: _Attempts) -> float:
        """0 when a healthy server is still untried (fail over at once), else a backoff
        after which every server may be tried again."""
        now = time.monotonic()
        if any(i not in state.tried and s.down_until <= now for i, s in enumerate(self.servers)):
            return 0.0
        delay = self._backoff(state.sleeps)
        state.sleeps += 1
        state.tried.clear()
        return delay

    def _retrying(self, cls, state: _Attempts, attempts: int | None = None):
        """tenacity's ``Retrying`` / ``AsyncRetrying`` with the client's policy, for
        ``attempts`` attempts (default: the first and ``max_retries`` retries)."""
        return cls(
            stop=stop_after_attempt(attempts or self.max_retries + 1),
            wait=lambda _: self._wait_before_retry(state),
            retry=retry_if_exception_type(_RetryableError),
            before_sleep=lambda _: self._count("retries"),  # not called after the last try
        )

    @contextmanager
    def _final_errors(self, state: _Attempts):
        """Count a request that failed for good; out of retries: JudgeUnavailableError."""
        try:
            yield
        except JudgeRequestError:
            self._count("failures")
            raise
        except RetryError:
            self._count("failures")
            last = state.last_error
            raise JudgeUnavailableError(
                f"no judge server answered after {self.max_retries + 1} attempts "
                f"({self.max_retries} retries) over {self.urls}; last error from "
                f"{state.last_url}: {type(last).__name__}: {last}",
                self.urls,
                last,
            ) from None

    async def _with_retries(self, request: dict) -> dict:
        state = _Attempts()
        with self._final_errors(state):
            return await self._retrying(AsyncRetrying, state)(self._attempt, request, state)

    @contextmanager
    def _attempt_on(self, state: _Attempts):
        """One attempt: yields the server it goes to; a failure that another attempt may
        not meet marks that server down for a while and is raised as _RetryableError."""
        with self._lock:
            index = self._pick(state.tried)
            server = self.servers[index]
            server.in_flight += 1
            server.requests += 1
            self.counters["attempts"] += 1
        state.tried.add(index)
        try:
            yield server
        except (_RetryableError, httpx.TransportError, OSError, asyncio.TimeoutError) as error:
            if isinstance(error, asyncio.TimeoutError):
                error = _RetryableError(f"no answer within {self.timeout_s:g} s")
            elif not isinstance(error, _RetryableError):
                error = _RetryableError(f"{type(error).__name__}: {error}")
            state.last_error, state.last_url = error, server.url
            with self._lock:
                server.errors += 1
                server.consecutive_failures += 1
                server.down_until = time.monotonic() + min(
                    self.backoff_max_s, self.backoff_s * 2 ** (server.consecutive_failures - 1)
                )
            raise error from None
        finally:
            with self._lock:
                server.in_flight -= 1
        server.consecutive_failures = 0
        server.down_until = 0.0

    async def _attempt(self, request: dict, state: _Attempts) -> dict:
        with self._attempt_on(state) as server:
            body = dict(request)
            if body.get("model") is None:
                body["model"] = self.model or await self._model_name(server)
            response = await within(
                self._send("POST", server.chat_url, _dumps(body)), self.timeout_s
            )
            return self._chat_answer(server, response)

    def _attempt_sync(self, request: dict, state: _Attempts) -> dict:
        with self._attempt_on(state) as server:
            body = dict(request)
            if body.get("model") is None:
                if self.model is None and server.model is None:
                    self._models_answer(server, self._send_sync("GET", server.url + "/v1/models"))
                body["model"] = self.model or server.model
            if self._lean:
                response = self._blocking.post(
                    server.chat_url, self._heads[server.url], _dumps(body), self.timeout_s
                )
            else:
                response = self._send_sync("POST", server.chat_url, _dumps(body))
            return self._chat_answer(server, response)

    def _send_sync(self, method: str, url: httpx.URL | str, body: bytes | None = None):
        """One HTTP exchange on the blocking transport, bounded by ``timeout_s``."""
        headers = self._headers if body is None else self._post_headers
        request = httpx.Request(
            method, url, content=body, headers=headers, extensions=self._timeouts
        )
        response = self._blocking.handle_request(request)
        try:
            response.read()
        finally:
            response.close()
        return response

    async def _model_name(self, server: _Server) -> str:
        if server.model is None:
            self._models_answer(server, await self._get(server, "/v1/models"))
        return server.model

    def _models_answer(self, server: _Server, response: httpx.Response) -> None:
        """``server.model`` from a ``/v1/models`` answer: the first id it lists."""
        self._check_status(server, response)
        try:
            server.model = json.loads(response.content)["data"][0]["id"]
        except (ValueError, KeyError, IndexError, TypeError) as error:
            raise _RetryableError(f"bad /v1/models answer from {server.url}") from error

    def _chat_answer(self, server: _Server, response: httpx.Response) -> dict:
        self._check_status(server, response)
        try:
            return orjson.loads(response.content)
        except ValueError as error:
            n = len(response.content)
            raise _RetryableError(f"{server.url} sent invalid JSON ({n} bytes)") from error

    @staticmethod
    def _check_status(server: _Server, response: httpx.Response) -> None:
        status = response.status_code
        if status == 200:
            return
        data = response.content
        try:
            parsed = json.loads(data)
            message = (parsed.get("error") or {}).get("message") or data[:300].decode()
        except Exception:  # noqa: BLE001
            parsed, message = None, data[:300].decode("utf-8", "replace")
        if status in RETRYABLE_STATUS or status >= 500:
            raise _RetryableError(f"HTTP {status}: {message}")
        raise JudgeRequestError(
            f"judge server {server.url} refused the request: HTTP {status}: {message}",
            status,
            server.url,
            parsed,
        )
