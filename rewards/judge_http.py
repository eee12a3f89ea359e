"""The judge client's HTTP/1.1 transport: pooled keep-alive connections per server.

Each connection is an asyncio protocol whose responses are parsed by ``httptools``
(llhttp, the C parser uvicorn uses: status, headers, ``Content-Length`` and chunked
bodies); requests are one ``write`` of a head built from a per-server template and the
JSON body. A response without a length ends at the connection's close.

Why not ``httpx``: on the GenRM bench's requests (2 cores) an ``httpx.AsyncClient``
spent 1.6-2.2 ms of client CPU per request at 1 in flight and 3.5-4.7 ms at 32 in
flight (``httpcore``'s connection pool alone: 1.1 and 3.2-4.3 ms), as much as the
judge's forward, and the client then starved the server of a core. This transport
spends 0.3 ms at 1 in flight and 0.16 ms at 32 (BENCHMARKS.md, "GenRM serving").

Errors: :class:`StaleConnection` when a pooled connection turns out closed before any
byte of the answer (the server dropped it while idle: the caller retries on a fresh
connection at once); :class:`TransportError` for a connection lost inside a response or
a response that is not HTTP.
"""

from __future__ import annotations

import asyncio
import ssl

import httptools


class TransportError(ConnectionError):
    """The connection broke inside a response, or the answer was not HTTP."""


class StaleConnection(TransportError):
    """A pooled connection closed before any byte of the answer arrived."""


class Response:
    __slots__ = ("status", "headers", "content")

    def __init__(self, status: int, headers: dict[str, str], content: bytes):
        self.status, self.headers, self.content = status, headers, content


class _Connection(asyncio.Protocol):
    """One HTTP/1.1 connection carrying one request at a time."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.waiter: asyncio.Future | None = None
        self.closed = False
        self._start()

    def _start(self) -> None:
        self.headers: dict[str, str] = {}
        self.body: list[bytes] = []
        self.headers_done = False
        self.received = False

    # --- asyncio.Protocol ---------------------------------------------------------
    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.received = True
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as error:
            self._fail(TransportError(f"the answer is not valid HTTP: {error}"))
            self.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self.waiter is None or self.waiter.done():
            return
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
        self.headers[name.decode("latin-1").lower()] = value.decode("latin-1")

    def on_headers_complete(self) -> None:
        self.headers_done = True

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        self._finish(keep=self.parser.should_keep_alive())

    # --- requests -----------------------------------------------------------------
    def _finish(self, keep: bool) -> None:
        response = Response(self.parser.get_status_code(), self.headers, b"".join(self.body))
        self._start()
        if not keep:
            self.close()
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
        head = f"{method} {path} HTTP/1.1\r\n{self._head}"
        if body is not None:
            head += f"Content-Type: {content_type}\r\nContent-Length: {len(body)}\r\n"
        data = (head + "\r\n").encode("latin-1") + (body or b"")
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
