"""Client for GenRM judge servers speaking OpenAI chat completions: the embedded server
(``mmyatt serve-genrm``) and ``vllm serve`` alike. A vLLM judge for ``yes_prob``
rewards is ``vllm serve /path/to/judge --api-key K --max-logprobs 20`` (a VLM judge adds
``--limit-mm-per-prompt '{"image": 1}'``), then ``JudgeClient(["http://127.0.0.1:8000"],
api_key="K")``; SGLang works the same way.

* **httpx2 and tenacity.** ``chat`` sends on an ``httpx2.Client`` (blocking sockets: no
  event loop, no thread hop); ``await achat`` / ``achat_many`` on the caller's loop, and
  ``chat_many`` / ``health`` on a uvloop loop of the calling thread's own, on
  ``httpx2.AsyncClient``s (connections belong to a loop). httpx2 rather than httpx 1.x:
  httpcore 1.x's pool scans every connection for every queued request (4.8 ms of client
  CPU per request at 32 in flight against 0.9-1.0 ms). ``transport=`` takes any httpx2
  transport (``MockTransport``; an async-only one such as
  ``AsyncHTTPTransport(proxy=...)`` sends ``chat`` through the event loop too).
* **Bounded in-flight**: at most ``max_in_flight`` requests of one event loop at once.
* **Least-in-flight balancing**: each attempt goes to the server with the fewest
  requests in flight (ties rotate), skipping servers that failed recently.
* **Retries**: connection errors, timeouts (``timeout_s``), HTTP 5xx, 408 and 429 are
  retried at once on another healthy server when there is one, else after an
  exponential backoff (``backoff_s * 2**k`` with jitter, at most ``backoff_max_s``).
  After ``max_retries`` retries: :class:`JudgeUnavailableError`, naming the servers and
  the last error. Other 4xx are not retried: :class:`JudgeRequestError`.
* **Model name**: a request without ``"model"`` gets ``model=``, or else the first id
  of the server's ``/v1/models`` (vLLM names a model by the path it was served from).
* ``metrics()``: requests, attempts, retries, failures, mean latency; per server
  requests, errors and in flight.
"""

from __future__ import annotations

import asyncio
import random
import ssl
import threading
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import httpx2
import orjson
from tenacity import (
    AsyncRetrying,
    RetryCallState,
    RetryError,
    Retrying,
    retry_if_exception_type,
    stop_after_attempt,
)

try:  # the client's own event loops (chat_many from synchronous callers)
    from uvloop import new_event_loop
except ImportError:  # pragma: no cover - Windows
    from asyncio import new_event_loop

RETRYABLE_STATUS = frozenset({408, 429, 500, 502, 503, 504})
CHAT_PATH = "/v1/chat/completions"


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


class RetryableError(Exception):
    """An attempt failed in a way that another attempt may not."""


@dataclass
class Server:
    url: str  # the root, without /v1
    in_flight: int = 0
    requests: int = 0
    errors: int = 0
    consecutive_failures: int = 0
    down_until: float = 0.0
    model: str | None = None


@dataclass
class Attempts:
    """One request's way through the servers: which were tried since the last backoff."""

    tried: set[int] = field(default_factory=set)
    sleeps: int = 0
    last_error: BaseException | None = None
    last_url: str = ""


def server_root(url: str) -> str:
    """``http://host:port`` from a server URL, also an OpenAI-style ``.../v1`` one."""
    url = (url if "://" in url else f"http://{url}").rstrip("/")
    parsed = httpx2.URL(url)
    if parsed.scheme not in ("http", "https") or not parsed.host:
        raise ValueError(f"judge URL {url!r} must look like http://host:port")
    return url.removesuffix("/v1")


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
        transport: httpx2.BaseTransport | httpx2.AsyncBaseTransport | None = None,
    ):
        urls = [urls] if isinstance(urls, str) else list(urls)
        if not urls:
            raise ValueError("JudgeClient needs at least one server URL")
        if max_in_flight < 1:
            raise ValueError(f"max_in_flight must be >= 1, got {max_in_flight}")
        if max_retries < 0:
            raise ValueError(f"max_retries must be >= 0, got {max_retries}")
        self.servers = [Server(server_root(u)) for u in urls]
        self.urls = [s.url for s in self.servers]
        self.max_in_flight = int(max_in_flight)
        self.timeout_s = float(timeout_s)
        self.max_retries = int(max_retries)
        self.backoff_s = float(backoff_s)
        self.backoff_max_s = float(backoff_max_s)
        self.model = model
        self._transport = transport
        self._blocking = transport is None or isinstance(transport, httpx2.BaseTransport)
        self._headers = {"Content-Type": "application/json"}
        if api_key:
            self._headers["Authorization"] = f"Bearer {api_key}"
        self.counters = dict.fromkeys(
            ("requests", "completed", "attempts", "retries", "failures"), 0
        )
        self._latency_s = 0.0
        self._lock = threading.Lock()  # counters, servers, loops
        self._loops: dict[int, asyncio.AbstractEventLoop] = {}  # sync callers' own, by thread
        self._slots: dict[asyncio.AbstractEventLoop, tuple] = {}  # see _slots_here
        self._client: httpx2.Client | None = None  # chat(): blocking sockets
        self._ssl: ssl.SSLContext | None = None  # one for all (making one takes ~0.1 s)
        self._rr = 0
        # built once: tenacity keeps a call's iteration state per thread, and with these
        # synchronous callbacks an iteration never suspends, so calls do not mix
        retry = dict(
            stop=stop_after_attempt(self.max_retries + 1),
            wait=self._wait_before_retry,
            retry=retry_if_exception_type(RetryableError),
            before_sleep=lambda _: self._count("retries"),  # not after the last try
        )
        self._retrying, self._aretrying = Retrying(**retry), AsyncRetrying(**retry)

    def __repr__(self) -> str:  # never shows the key
        return f"JudgeClient({self.urls}, max_in_flight={self.max_in_flight})"

    # --- HTTP clients and event loops --------------------------------------------------
    def _httpx(self, cls, connections: int):
        if self._ssl is None:
            self._ssl = httpx2.create_ssl_context()
        return cls(
            headers=self._headers,
            timeout=self.timeout_s,
            limits=httpx2.Limits(
                max_connections=connections,
                max_keepalive_connections=connections,
                keepalive_expiry=300.0,
            ),
            transport=self._transport,
            verify=self._ssl,
        )

    def _blocking_client(self) -> httpx2.Client:
        with self._lock:
            if self._client is None:
                self._client = self._httpx(httpx2.Client, self.max_in_flight)
            return self._client

    def _run(self, coro):
        """Run ``coro`` for a synchronous caller on this thread's own loop (a helper
        thread's when a loop already runs in this one)."""
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            pass
        else:
            with ThreadPoolExecutor(1, thread_name_prefix="judge-client") as helper:
                return helper.submit(self._run, coro).result()
        with self._lock:
            loop = self._loops.get(threading.get_ident())
            if loop is None:
                loop = self._loops[threading.get_ident()] = new_event_loop()
        return loop.run_until_complete(coro)

    def _slots_here(self) -> asyncio.Queue:
        """The running loop's ``max_in_flight`` slots, each an httpx client with one
        connection per server (connections belong to a loop): a request holds a slot.
        One client per slot rather than one for all: httpcore's pool scans every one of
        its connections for each request (15-25% of the client's CPU at 32 in flight)."""
        loop = asyncio.get_running_loop()
        pair = self._slots.get(loop)
        if pair is None:
            n = len(self.servers)
            clients = [self._httpx(httpx2.AsyncClient, n) for _ in range(self.max_in_flight)]
            pair = self._slots[loop] = (asyncio.Queue(), clients)
            for http in clients:
                pair[0].put_nowait(http)
        return pair[0]

    def close(self) -> None:
        """Close every connection and this client's own loops (a later call starts anew)."""
        with self._lock:
            slots, self._slots = self._slots, {}
            loops, self._loops = self._loops, {}
            client, self._client = self._client, None
        if client is not None:
            client.close()
        for loop, (_, clients) in slots.items():  # in use or not
            if loop.is_running():  # a caller's loop in another thread
                asyncio.run_coroutine_threadsafe(_close_all(clients), loop).result(timeout=10)
            elif not loop.is_closed():
                loop.run_until_complete(_close_all(clients))
        for loop in loops.values():
            loop.close()

    def __enter__(self) -> JudgeClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # --- public API ---------------------------------------------------------------------
    def chat(self, request: dict) -> dict:
        """Send one chat-completion body and wait for its answer (on blocking sockets: no
        event loop, no thread hop)."""
        if not self._blocking:  # an async-only transport was given
            return self._run(self._chat(request))
        with self._request() as state:
            return self._retrying(self._attempt, self._blocking_client(), request, state)

    def chat_many(
        self, requests: Sequence[dict], *, return_exceptions: bool = False
    ) -> list[dict | BaseException]:
        """Send chat-completion bodies concurrently; answers come back in order."""
        return self._run(self._chat_many(list(requests), return_exceptions))

    async def achat(self, request: dict) -> dict:
        return await self._chat(request)

    async def achat_many(
        self, requests: Sequence[dict], *, return_exceptions: bool = False
    ) -> list[dict | BaseException]:
        return await self._chat_many(list(requests), return_exceptions)

    def health(self) -> dict[str, bool]:
        """``{url: healthy}`` from ``GET /health`` (one attempt each, no retries)."""

        async def check(http: httpx2.AsyncClient, server: Server) -> bool:
            try:
                return (await http.get(server.url + "/health")).status_code == 200
            except httpx2.HTTPError:
                return False

        async def check_all() -> list[bool]:
            slots = self._slots_here()
            http = await slots.get()
            try:
                return list(await asyncio.gather(*(check(http, s) for s in self.servers)))
            finally:
                slots.put_nowait(http)

        return dict(zip(self.urls, self._run(check_all())))

    def metrics(self) -> dict:
        out: dict[str, Any] = dict(self.counters)
        out["mean_latency_ms"] = self._latency_s / max(out["completed"], 1) * 1000.0
        out["servers"] = {
            s.url: {"requests": s.requests, "errors": s.errors, "in_flight": s.in_flight}
            for s in self.servers
        }
        out["in_flight"] = {s.url: s.in_flight for s in self.servers}
        return out

    # --- requests -----------------------------------------------------------------------
    async def _chat_many(self, requests: list[dict], return_exceptions: bool) -> list:
        tasks = [asyncio.ensure_future(self._chat(r)) for r in requests]
        try:
            return list(await asyncio.gather(*tasks, return_exceptions=return_exceptions))
        finally:
            for task in tasks:  # on the first error, do not leave the rest running
                task.cancel()

    async def _chat(self, request: dict) -> dict:
        slots = self._slots_here()
        with self._request() as state:
            http = await slots.get()
            try:
                return await self._aretrying(self._aattempt, http, request, state)
            finally:
                slots.put_nowait(http)

    @contextmanager
    def _request(self) -> Iterator[Attempts]:
        """Count one request and its outcome; tenacity's RetryError becomes
        JudgeUnavailableError."""
        self._count("requests")
        state, t0 = Attempts(), time.perf_counter()
        try:
            yield state
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
        with self._lock:
            self.counters["completed"] += 1
            self._latency_s += time.perf_counter() - t0

    def _count(self, key: str) -> None:
        with self._lock:
            self.counters[key] += 1

    def _pick(self, exclude: set[int]) -> int:
        """The server with the fewest requests in flight among those not tried yet and
        not down (ties rotate)."""
        now = time.monotonic()
        n = len(self.servers)
        candidates = [i for i in range(n) if i not in exclude] or list(range(n))
        up = [i for i in candidates if self.servers[i].down_until <= now] or candidates
        start, self._rr = self._rr, (self._rr + 1) % n
        return min(up, key=lambda i: (self.servers[i].in_flight, (i - start) % n))

    def _backoff(self, k: int) -> float:
        return min(self.backoff_max_s, self.backoff_s * 2**k) * (0.5 + 0.5 * random.random())

    def _wait_before_retry(self, retry_state: RetryCallState) -> float:
        """0 when a healthy server is still untried (fail over at once), else a backoff
        after which every server may be tried again."""
        state: Attempts = retry_state.args[-1]
        now = time.monotonic()
        if any(i not in state.tried and s.down_until <= now for i, s in enumerate(self.servers)):
            return 0.0
        delay = self._backoff(state.sleeps)
        state.sleeps += 1
        state.tried.clear()
        return delay

    def _attempt(self, http: httpx2.Client, request: dict, state: Attempts) -> dict:
        with self._attempt_on(state) as server:
            model = request.get("model") or self.model or server.model
            if model is None:
                model = self._model_name(server, http.get(server.url + "/v1/models"))
            response = http.post(server.url + CHAT_PATH, content=_body(request, model))
            return self._answer(server, response)

    async def _aattempt(self, http: httpx2.AsyncClient, request: dict, state: Attempts) -> dict:
        with self._attempt_on(state) as server:
            model = request.get("model") or self.model or server.model
            if model is None:
                model = self._model_name(server, await http.get(server.url + "/v1/models"))
            response = await http.post(server.url + CHAT_PATH, content=_body(request, model))
            return self._answer(server, response)

    @contextmanager
    def _attempt_on(self, state: Attempts) -> Iterator[Server]:
        """One attempt on the server :meth:`_pick` chooses; a failure that another attempt
        may not meet marks that server down for a while and raises RetryableError."""
        with self._lock:
            index = self._pick(state.tried)
            server = self.servers[index]
            server.in_flight += 1
            server.requests += 1
            self.counters["attempts"] += 1
        state.tried.add(index)
        try:
            yield server
        except (RetryableError, httpx2.TransportError) as error:
            if isinstance(error, httpx2.TimeoutException):
                error = RetryableError(f"no answer within {self.timeout_s:g} s")
            elif not isinstance(error, RetryableError):
                error = RetryableError(f"{type(error).__name__}: {error}")
            state.last_error, state.last_url = error, server.url
            with self._lock:
                server.errors += 1
                server.consecutive_failures += 1
                failures = server.consecutive_failures
                server.down_until = time.monotonic() + self._backoff(failures - 1)
            raise error from None
        else:
            server.consecutive_failures = 0
            server.down_until = 0.0
        finally:
            with self._lock:
                server.in_flight -= 1

    def _model_name(self, server: Server, listing: httpx2.Response) -> str:
        """The first id of a server's ``/v1/models`` answer (remembered)."""
        try:
            server.model = self._answer(server, listing)["data"][0]["id"]
        except (KeyError, IndexError, TypeError) as error:
            raise RetryableError(f"bad /v1/models answer from {server.url}") from error
        return server.model

    @staticmethod
    def _answer(server: Server, response: httpx2.Response) -> dict:
        """The JSON of a 200; RetryableError or JudgeRequestError otherwise."""
        status, content = response.status_code, response.content
        if status == 200:
            try:
                return orjson.loads(content)
            except orjson.JSONDecodeError as error:
                raise RetryableError(
                    f"{server.url} sent invalid JSON ({len(content)} bytes)"
                ) from error
        try:
            parsed = orjson.loads(content)
            message = parsed["error"]["message"]
        except (orjson.JSONDecodeError, KeyError, TypeError):
            parsed, message = None, content[:300].decode("utf-8", "replace")
        if status in RETRYABLE_STATUS or status >= 500:
            raise RetryableError(f"HTTP {status}: {message}")
        raise JudgeRequestError(
            f"judge server {server.url} refused the request: HTTP {status}: {message}",
            status,
            server.url,
            parsed,
        )


def _body(request: dict, model: str) -> bytes:
    if request.get("model") == model:
        return orjson.dumps(request)
    return orjson.dumps({**request, "model": model})


async def _close_all(clients: list[httpx2.AsyncClient]) -> None:
    await asyncio.gather(*(http.aclose() for http in clients))
