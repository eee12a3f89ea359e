"""The judge client's HTTP/1.1 transport: an ``httpx`` transport on pooled keep-alive
connections.

:class:`PooledTransport` is an ``httpx.AsyncBaseTransport``: ``httpx.AsyncClient(
transport=PooledTransport())`` sends ``httpx.Request`` objects and gets ``httpx.Response``
objects, with httpx's headers, URL handling, content decoding and exceptions
(``httpx.ConnectError``, ``httpx.RemoteProtocolError``). Underneath, one
:class:`HostPool` per ``scheme://host:port`` keeps keep-alive connections, each an
asyncio protocol whose responses are parsed by ``httptools`` (llhttp, the C parser
uvicorn uses: status, headers, ``Content-Length`` and chunked bodies); a request is one
``write`` of its head and body. A response without a length ends at the connection's
close.

Why not httpx's own transport (``httpcore``): on the GenRM bench's requests (2 cores)
an ``httpx.AsyncClient`` on it spent 1.6-2.2 ms of client CPU per request at 1 in
flight and 3.5-4.7 ms at 32 in flight (``httpcore``'s connection pool alone: 1.1 and
3.2-4.3 ms), as much as the judge's forward, and the client then starved the server of
a core. The pooled connections spend 0.3 ms at 1 in flight and 0.3 ms at 32, and the
``httpx.Request``/``httpx.Response`` objects around them 0.04-0.12 ms more
(BENCHMARKS.md, "GenRM serving").

:class:`BlockingTransport` is the synchronous twin (an ``httpx.BaseTransport`` on
blocking sockets, thread-safe, with the same parsing and errors, plus
``httpx.ReadTimeout`` past a request's deadline): ``JudgeClient.chat`` sends a lone
request on it without an event loop.

Errors of :class:`HostPool`: :class:`StaleConnection` when a pooled connection turns
out closed before any byte of the answer (the server dropped it while idle: the pool
retries on a fresh connection at once); :class:`TransportError` for a connection lost
inside a response or a response that is not HTTP. :class:`PooledTransport` raises
them as httpx's exceptions.
"""

from __future__ import annotations

import asyncio
import socket
import ssl
import sys
import threading
import time
from contextlib import contextmanager

import httptools
import httpx

if sys.version_info >= (3, 11):

    async def within(awaitable, seconds: float):
        """``await awaitable``, cancelled after ``seconds`` (TimeoutError). Unlike
        ``asyncio.wait_for`` before Python 3.12, it runs in the calling task: no task
        and no extra loop passes per call."""
        async with asyncio.timeout(seconds):
            return await awaitable

else:  # pragma: no cover - Python 3.10
    within = asyncio.wait_for


class TransportError(ConnectionError):
    """The connection broke inside a response, or the answer was not HTTP."""


class StaleConnection(TransportError):
    """A pooled connection closed before any byte of the answer arrived."""


class Response:
    """``headers``: lower-case names to values (the last of repeated ones); ``raw``: every
    header line as sent, ``(name, value)`` bytes."""

    __slots__ = ("status", "headers", "content", "raw")

    def __init__(self, status: int, headers: dict[str, str], content: bytes, raw=()):
        self.status, self.headers, self.content, self.raw = status, headers, content, raw

    @property
    def status_code(self) -> int:  # httpx.Response's name, for code that reads either
        return self.status


class _Reader:
    """httptools callbacks that collect one response at a time: the part of a connection
    that both kinds (:class:`_Connection` on an event loop, :class:`_BlockingConnection`
    on a blocking socket) share. ``_deliver`` / ``_fail`` hand over the outcome."""

    def _start(self) -> None:
        self.headers: dict[str, str] = {}
        self.raw: list[tuple[bytes, bytes]] = []
        self.body: list[bytes] = []
        self.headers_done = False
        self.received = False

    def _feed(self, data: bytes) -> None:
        self.received = True
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as error:
            self._fail(TransportError(f"the answer is not valid HTTP: {error}"))
            self.close()

    def _ended(self) -> None:
        """The connection closed while a request waited for its answer."""
        length_known = (
            "content-length" in self.headers
            or "chunked" in self.headers.get("transfer-encoding", "").lower()
        )
        if self.headers_done and not length_known:  # the body ends with the connection
            self._finish(keep=False)
        elif not self.received:
            self._fail(StaleConnection("the server closed the connection"))
        else:
            self._fail(TransportError("the connection closed inside the response"))

    # --- httptools callbacks ------------------------------------------------------
    def on_header(self, name: bytes, value: bytes) -> None:
        self.raw.append((name, value))
        self.headers[name.decode("latin-1").lower()] = value.decode("latin-1")

    def on_headers_complete(self) -> None:
        self.headers_done = True

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        self._finish(keep=self.parser.should_keep_alive())

    def _finish(self, keep: bool) -> None:
        status = self.parser.get_status_code()
        response = Response(status, self.headers, b"".join(self.body), self.raw)
        self._start()
        if not keep:
            self.close()
        self._deliver(response)


class _Connection(_Reader, asyncio.Protocol):
    """One HTTP/1.1 connection on an event loop, carrying one request at a time."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.waiter: asyncio.Future | None = None
        self.closed = False
        self._start()

    # --- asyncio.Protocol ---------------------------------------------------------
    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self._feed(data)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self.waiter is not None and not self.waiter.done():
            self._ended()

    # --- requests -----------------------------------------------------------------
    def _deliver(self, response: Response) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(response)

    def _fail(self, error: Exception) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_exception(error)

    async def send(self, data: bytes) -> Response:
        self.waiter = self.loop.create_future()
        try:
            self.transport.write(data)
            return await self.waiter
        except BaseException:  # a timeout or cancel mid-request: the connection is unusable
            self.close()
            raise
        finally:
            self.waiter = None

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()


class HostPool:
    """Keep-alive connections to one ``http(s)://host:port``; one request per connection
    at a time, as many connections as requests in flight."""

    def __init__(self, host: str, port: int, tls: bool, headers: dict[str, str]):
        self.host, self.port, self.tls = host, port, tls
        self.idle: list[_Connection] = []
        fixed = {"Host": f"{host}:{port}", "Connection": "keep-alive", **headers}
        self._head = "".join(f"{k}: {v}\r\n" for k, v in fixed.items())

    async def _connect(self) -> _Connection:
        loop = asyncio.get_running_loop()
        context = ssl.create_default_context() if self.tls else None
        _, conn = await loop.create_connection(
            lambda: _Connection(loop), self.host, self.port, ssl=context
        )
        return conn

    async def request(
        self, method: str, path: str, body: bytes | None = None, content_type: str = ""
    ) -> Response:
        """Send ``method path`` with this pool's fixed headers (and ``body``)."""
        head = f"{method} {path} HTTP/1.1\r\n{self._head}"
        if body is not None:
            head += f"Content-Type: {content_type}\r\nContent-Length: {len(body)}\r\n"
        return await self.send((head + "\r\n").encode("latin-1") + (body or b""))

    async def send(self, data: bytes) -> Response:
        """Send one whole request (head and body, as bytes) on a pooled connection (a new
        one when none is idle, or when the pooled one turns out closed)."""
        while True:
            conn = None
            while self.idle and conn is None:
                conn = self.idle.pop()
                if conn.closed:
                    conn = None
            pooled = conn is not None
            if conn is None:
                conn = await self._connect()
            try:
                response = await conn.send(data)
            except StaleConnection:
                if pooled:  # closed by the server while idle: not its answer, try afresh
                    continue
                raise
            if not conn.closed:
                self.idle.append(conn)
            return response

    def close(self) -> None:
        while self.idle:
            self.idle.pop().close()


def _head(method: bytes, raw_path: bytes, headers) -> bytes:
    """A request line and ``(name, value)`` header lines, each ended by CRLF (the blank
    line that ends the head is not included)."""
    lines = [b"%s %s HTTP/1.1" % (method, raw_path), *(b"%s: %s" % h for h in headers)]
    return b"".join(line + b"\r\n" for line in lines)


def _wire(request: httpx.Request, body: bytes) -> bytes:
    """The whole HTTP/1.1 request: request line, the request's headers, body."""
    head = _head(request.method.encode("ascii"), request.url.raw_path, request.headers.raw)
    return b"%s\r\n%s" % (head, body)


def post_head(url: httpx.URL, headers: httpx.Headers) -> bytes:
    """A POST's request line and headers as an ``httpx.Request`` sends them (``Host``,
    then ``headers``), without ``Content-Length`` and the blank line: for
    :meth:`BlockingTransport.post`."""
    return _head(b"POST", url.raw_path, [(b"Host", url.netloc), *headers.raw])


@contextmanager
def _as_httpx_errors(request: httpx.Request | None):
    try:
        yield
    except TransportError as error:
        raise httpx.RemoteProtocolError(str(error), request=request) from error
    except TimeoutError as error:  # a blocking socket's deadline (socket.timeout)
        raise httpx.ReadTimeout(f"no answer in time: {error}", request=request) from error
    except OSError as error:  # refused, unreachable, reset
        raise httpx.ConnectError(f"{type(error).__name__}: {error}", request=request) from error


def _httpx_response(answer: Response, request: httpx.Request) -> httpx.Response:
    return httpx.Response(
        answer.status, headers=answer.raw, stream=httpx.ByteStream(answer.content), request=request
    )


class _Pools:
    """One connection pool per ``scheme://host:port`` (``_new_pool(host, port, tls)``)."""

    def __init__(self) -> None:
        self.pools: dict = {}

    def _pool(self, url: httpx.URL):
        key = (url.raw_scheme, url.raw_host, url.port or 0)
        pool = self.pools.get(key)
        if pool is None:
            if url.scheme not in ("http", "https"):
                raise httpx.UnsupportedProtocol(f"{url.scheme!r} URLs are not HTTP: {url}")
            tls = url.scheme == "https"
            pool = self.pools[key] = self._new_pool(url.host, url.port or (443 if tls else 80), tls)
        return pool

    def close(self) -> None:
        """Close every pooled connection (an async transport's: from its loop)."""
        for pool in list(self.pools.values()):
            pool.close()
        self.pools.clear()


class PooledTransport(_Pools, httpx.AsyncBaseTransport):
    """An httpx transport on :class:`HostPool` connections (see the module docstring).

    A transport belongs to the event loop it first serves (its connections do)."""

    @staticmethod
    def _new_pool(host: str, port: int, tls: bool) -> HostPool:
        return HostPool(host, port, tls, {})

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        pool = self._pool(request.url)
        with _as_httpx_errors(request):
            answer = await pool.send(_wire(request, await request.aread()))
        return _httpx_response(answer, request)

    async def aclose(self) -> None:
        self.close()


# --------------------------------------------------------------------------------------
# The same on blocking sockets, for a synchronous caller with one request at a time
# --------------------------------------------------------------------------------------
class _BlockingConnection(_Reader):
    """One HTTP/1.1 connection on a blocking socket, carrying one request at a time."""

    def __init__(self, host: str, port: int, tls: bool, timeout_s: float):
        sock = socket.create_connection((host, port), timeout=timeout_s)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if tls:
            sock = ssl.create_default_context().wrap_socket(sock, server_hostname=host)
        self.sock = sock
        self.parser = httptools.HttpResponseParser(self)
        self.closed = False
        self.outcome: Response | Exception | None = None
        self._start()

    def _deliver(self, response: Response) -> None:
        self.outcome = response

    def _fail(self, error: Exception) -> None:
        if self.outcome is None:
            self.outcome = error

    def send(self, data: bytes, timeout_s: float) -> Response:
        """Send one whole request and read its answer, all within ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        self.outcome = None
        try:
            self.sock.settimeout(timeout_s)
            try:
                self.sock.sendall(data)
            except (BrokenPipeError, ConnectionResetError) as error:
                raise StaleConnection(f"the server closed the connection ({error})") from None
            while self.outcome is None:
                self.sock.settimeout(max(deadline - time.monotonic(), 1e-3))
                try:
                    chunk = self.sock.recv(65536)
                except ConnectionResetError:
                    chunk = b""
                if chunk:
                    self._feed(chunk)
                else:
                    self.closed = True
                    self._ended()
        except BaseException:  # a timeout mid-request: the connection is unusable
            self.close()
            raise
        if isinstance(self.outcome, Exception):
            self.close()
            raise self.outcome
        return self.outcome

    def close(self) -> None:
        self.closed = True
        self.sock.close()


class _BlockingPool:
    """Keep-alive connections to one host for threads that block on them (thread-safe:
    a connection serves one thread at a time)."""

    def __init__(self, host: str, port: int, tls: bool):
        self.host, self.port, self.tls = host, port, tls
        self.idle: list[_BlockingConnection] = []
        self.lock = threading.Lock()

    def send(self, data: bytes, timeout_s: float) -> Response:
        while True:
            with self.lock:
                conn = self.idle.pop() if self.idle else None
            pooled = conn is not None
            if conn is None:
                conn = _BlockingConnection(self.host, self.port, self.tls, timeout_s)
            try:
                response = conn.send(data, timeout_s)
            except StaleConnection:
                if pooled:  # closed by the server while idle: not its answer, try afresh
                    continue
                raise
            if not conn.closed:
                with self.lock:
                    self.idle.append(conn)
            return response

    def close(self) -> None:
        with self.lock:
            while self.idle:
                self.idle.pop().close()


class BlockingTransport(_Pools, httpx.BaseTransport):
    """:class:`PooledTransport`'s synchronous twin, an ``httpx.BaseTransport`` on blocking
    sockets: the connections, the ``httptools`` parsing and the errors are the same, and
    no event loop runs. ``JudgeClient.chat`` uses it for a caller waiting on one request,
    where an event loop's wake-ups and bookkeeping cost more than the request's HTTP
    (BENCHMARKS.md, "GenRM serving"). The deadline of each request is
    ``request.extensions["timeout"]["read"]`` (httpx's timeout extension), else
    ``timeout_s``; past it, ``httpx.ReadTimeout``."""

    def __init__(self, timeout_s: float = 30.0) -> None:
        super().__init__()
        self.timeout_s = float(timeout_s)
        self._lock = threading.Lock()

    def _new_pool(self, host: str, port: int, tls: bool) -> _BlockingPool:
        return _BlockingPool(host, port, tls)

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        with self._lock:
            pool = self._pool(request.url)
        timeout = (request.extensions.get("timeout") or {}).get("read") or self.timeout_s
        with _as_httpx_errors(request):
            answer = pool.send(_wire(request, request.read()), timeout)
        return _httpx_response(answer, request)

    def post(self, url: httpx.URL, head: bytes, body: bytes, timeout_s: float) -> Response:
        """POST ``body`` to ``url`` with a head made once by :func:`post_head`: the same
        connections, parsing and httpx exceptions as :meth:`handle_request`, and the
        answer as a :class:`Response` (status, headers, bytes), without building an
        ``httpx.Request`` and an ``httpx.Response`` (and decoding its content) per call.
        ``JudgeClient.chat`` sends its lone requests this way: at 1 in flight that work
        runs between two of the judge's forwards, on a core gone cold (BENCHMARKS.md,
        "GenRM serving: a leaner chat()")."""
        with self._lock:
            pool = self._pool(url)
        data = b"%sContent-Length: %d\r\n\r\n%s" % (head, len(body), body)
        with _as_httpx_errors(None):
            return pool.send(data, timeout_s)

    def close(self) -> None:
        with self._lock:
            super().close()
