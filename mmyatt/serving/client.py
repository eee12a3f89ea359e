"""Client for GenRM judge servers speaking OpenAI chat completions: the embedded server
(``mmyatt serve-genrm``) and ``vllm serve`` alike. A vLLM judge for ``yes_prob``
rewards is ``vllm serve /path/to/judge --api-key K --max-logprobs 20`` (at least the
``top_logprobs`` asked for; a VLM judge adds ``--limit-mm-per-prompt '{"image": 1}'``),
then ``JudgeClient(["http://127.0.0.1:8000"], api_key="K")``; SGLang works the same way.

* **httpx2 and tenacity.** Requests go through an ``httpx2.AsyncClient`` (httpx's API;
  its pool keeps connections alive) on the caller's event loop: ``await achat`` /
  ``achat_many`` on any loop (e.g. streaming each finished rollout sample to the
  judge), and ``chat``, ``chat_many`` and ``health`` on a loop of the calling thread's
  own, so that no call hops threads. Each loop has its own ``AsyncClient``
  (connections belong to a loop). httpx2 rather than httpx 1.x: httpcore 1.x's pool
  scans every connection for every queued request, 4.8 ms of client CPU per request
  at 32 in flight on the GenRM bench's requests against httpx2's 0.9-1.0 ms.
  ``transport=`` takes any httpx2 transport (``AsyncHTTPTransport(proxy=...)``,
  ``MockTransport``).
* **Bounded in-flight**: at most ``max_in_flight`` requests of one event loop at once.
* **Least-in-flight balancing**: each attempt goes to the server with the fewest
  requests in flight (ties rotate), skipping servers that failed recently.
* **Retries**: connection errors, timeouts (``timeout_s``), HTTP 5xx, 408 and 429 are
  retried at once on another healthy server when there is one, else after an
  exponential backoff (``backoff_s * 2**k`` with jitter, at most ``backoff_max_s``); a
  killed server that comes back on its address is found again (dead connections are
  dropped). After ``max_retries`` retries: :class:`JudgeUnavailableError`, naming the
  servers and the last error. Other 4xx (bad request, wrong key, unknown model) are not
  retried: :class:`JudgeRequestError`.
* **Model name**: a request without ``"model"`` gets ``model=``, or else the first id
  of the server's ``/v1/models`` (vLLM names a model by the path it was served from).
* ``metrics()``: requests, attempts, retries, failures, mean latency; per server
  requests, errors and in flight.
"""

from __future__ import annotations

import asyncio
import random
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import httpx2
import orjson
from tenacity import AsyncRetrying, RetryError, retry_if_exception_type, stop_after_attempt

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
        transport: httpx2.AsyncBaseTransport | None = None,
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
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.counters = dict.fromkeys(
            ("requests", "completed", "attempts", "retries", "failures"), 0
        )
        self._latency_s = 0.0
        self._lock = threading.Lock()  # counters, servers, loops
        self._loops: dict[int, asyncio.AbstractEventLoop] = {}  # sync callers' own, by thread
        self._clients: dict[asyncio.AbstractEventLoop, tuple] = {}  # see _http
        self._rr = 0

    def __repr__(self) -> str:  # never shows the key
        return f"JudgeClient({self.urls}, max_in_flight={self.max_in_flight})"

    # --- event loops -------------------------------------------------------------------
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
                loop = self._loops[threading.get_ident()] = asyncio.new_event_loop()
        return loop.run_until_complete(coro)

    def _http(self) -> tuple[httpx2.AsyncClient, asyncio.Semaphore]:
        """The running loop's httpx client (its connections belong to that loop) and its
        in-flight bound."""
        loop = asyncio.get_running_loop()
        pair = self._clients.get(loop)
        if pair is None:
            limits = httpx2.Limits(
                max_connections=self.max_in_flight,
                max_keepalive_connections=self.max_in_flight,
                keepalive_expiry=300.0,
            )
            http = httpx2.AsyncClient(
                headers=self._headers,
                timeout=self.timeout_s,
                limits=limits,
                transport=self._transport,
            )
            pair = self._clients[loop] = (http, asyncio.Semaphore(self.max_in_flight))
        return pair

    def close(self) -> None:
        """Close every loop's connections and this client's own loops (a later call
        starts anew)."""
        with self._lock:
            clients, self._clients = self._clients, {}
            loops, self._loops = self._loops, {}
        for loop, (http, _) in clients.items():
            if loop.is_running():  # a caller's loop in another thread
                asyncio.run_coroutine_threadsafe(http.aclose(), loop).result(timeout=10)
            elif not loop.is_closed():
                loop.run_until_complete(http.aclose())
        for loop in loops.values():
            loop.close()

    def __enter__(self) -> JudgeClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # --- public API ---------------------------------------------------------------------
    def chat(self, request: dict) -> dict:
        """Send one chat-completion body and wait for its answer."""
        return self._run(self._chat(request))

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

        async def check(server: Server) -> bool:
            try:
                return (await self._http()[0].get(server.url + "/health")).status_code == 200
            except httpx2.HTTPError:
                return False

        async def check_all() -> list[bool]:
            return list(await asyncio.gather(*(check(s) for s in self.servers)))

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

    # --- requests (on the caller's loop) ------------------------------------------------
    async def _chat_many(self, requests: list[dict], return_exceptions: bool) -> list:
        tasks = [asyncio.ensure_future(self._chat(r)) for r in requests]
        try:
            return list(await asyncio.gather(*tasks, return_exceptions=return_exceptions))
        finally:
            for task in tasks:  # on the first error, do not leave the rest running
                task.cancel()

    async def _chat(self, request: dict) -> dict:
        http, slots = self._http()
        self._count("requests")
        state = Attempts()
        retrying = AsyncRetrying(
            stop=stop_after_attempt(self.max_retries + 1),
            wait=lambda _: self._wait_before_retry(state),
            retry=retry_if_exception_type(RetryableError),
            before_sleep=lambda _: self._count("retries"),  # not after the last try
        )
        t0 = time.perf_counter()
        try:
            async with slots:
                answer = await retrying(self._attempt, http, request, state)
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
        return answer

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

    def _wait_before_retry(self, state: Attempts) -> float:
        """0 when a healthy server is still untried (fail over at once), else a backoff
        after which every server may be tried again."""
        now = time.monotonic()
        if any(i not in state.tried and s.down_until <= now for i, s in enumerate(self.servers)):
            return 0.0
        delay = self._backoff(state.sleeps)
        state.sleeps += 1
        state.tried.clear()
        return delay

    async def _attempt(self, http: httpx2.AsyncClient, request: dict, state: Attempts) -> dict:
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
            body = dict(request)
            if body.get("model") is None:
                body["model"] = self.model or await self._model_name(http, server)
            response = await http.post(
                server.url + "/v1/chat/completions",
                content=orjson.dumps(body),
                headers={"Content-Type": "application/json"},
            )
            answer = self._answer(server, response)
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
        finally:
            with self._lock:
                server.in_flight -= 1
        server.consecutive_failures = 0
        server.down_until = 0.0
        return answer

    async def _model_name(self, http: httpx2.AsyncClient, server: Server) -> str:
        if server.model is None:
            listing = self._answer(server, await http.get(server.url + "/v1/models"))
            try:
                server.model = listing["data"][0]["id"]
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
