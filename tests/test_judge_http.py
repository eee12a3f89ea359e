"""The judge client's HTTP transport against servers that answer in every way HTTP/1.1
allows (chunked, no length, closing idle connections) and ways it does not."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time

import httpx
import pytest

from mmyatt.rewards.judge_client import JudgeClient, JudgeUnavailableError
from mmyatt.rewards.judge_http import (
    BlockingTransport,
    HostPool,
    PooledTransport,
    StaleConnection,
    TransportError,
)

BODY = json.dumps({"choices": [{"message": {"content": "Yes"}}]}).encode()


class RawServer:
    """Answers each request on a connection with the next of ``replies`` (bytes, or
    None to close the connection without answering); records the requests."""

    def __init__(self, replies: list[bytes | None], *, keep: bool = True):
        self.replies, self.keep = list(replies), keep
        self.requests: list[bytes] = []
        self.connections = 0
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.connections += 1
            threading.Thread(target=self._handle, args=(conn,), daemon=True).start()

    def _handle(self, conn: socket.socket) -> None:
        with conn:
            buf = b""
            while self.replies:
                while b"\r\n\r\n" not in buf:
                    chunk = conn.recv(65536)
                    if not chunk:
                        return
                    buf += chunk
                head, _, rest = buf.partition(b"\r\n\r\n")
                length = 0
                for line in head.split(b"\r\n")[1:]:
                    name, _, value = line.partition(b":")
                    if name.strip().lower() == b"content-length":
                        length = int(value)
                while len(rest) < length:
                    rest += conn.recv(65536)
                self.requests.append(head + b"\r\n\r\n" + rest[:length])
                buf = rest[length:]
                reply = self.replies.pop(0)
                if reply is None:
                    return
                conn.sendall(reply)
                if not self.keep:
                    return

    def close(self) -> None:
        self.sock.close()


def ok(body: bytes = BODY, extra: str = "") -> bytes:
    return f"HTTP/1.1 200 OK\r\nContent-Length: {len(body)}\r\n{extra}\r\n".encode() + body


def chunked(body: bytes = BODY) -> bytes:
    a, b = body[:7], body[7:]
    return (
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
        + f"{len(a):x}\r\n".encode()
        + a
        + f"\r\n{len(b):x};ext=1\r\n".encode()
        + b
        + b"\r\n0\r\nTrailer: x\r\n\r\n"
    )


def run(coro):
    return asyncio.run(coro)


def test_content_length_chunked_and_close_delimited_bodies_on_one_pool():
    server = RawServer([ok(), chunked(), b"HTTP/1.1 200 OK\r\n\r\n" + BODY])

    async def go():
        pool = HostPool("127.0.0.1", server.port, False, {"Authorization": "Bearer k"})
        out = [await pool.request("POST", "/x", b'{"a": 1}', "application/json")]
        out.append(await pool.request("GET", "/y"))
        out.append(await pool.request("GET", "/z"))  # no length: the body ends at close
        idle = len(pool.idle)
        pool.close()
        return out, idle

    try:
        responses, idle = run(go())
    finally:
        server.close()
    assert [r.status for r in responses] == [200, 200, 200]
    assert all(r.content == BODY for r in responses)
    assert server.connections == 1 and idle == 0  # kept alive, then closed by the server
    first = server.requests[0].decode()
    assert first.startswith("POST /x HTTP/1.1\r\n") and "Content-Length: 8\r\n" in first
    assert "Authorization: Bearer k" in first and first.endswith('{"a": 1}')
    assert server.requests[1].decode().startswith("GET /y HTTP/1.1\r\n")


def test_a_pooled_connection_closed_while_idle_is_replaced_at_once():
    server = RawServer([ok(), None, ok(), ok()])  # the 2nd request finds the socket closed

    async def go():
        pool = HostPool("127.0.0.1", server.port, False, {})
        first = await pool.request("GET", "/a")
        second = await pool.request("GET", "/b")  # stale: answered on a new connection
        pool.close()
        return first, second

    try:
        first, second = run(go())
    finally:
        server.close()
    assert first.status == second.status == 200 and server.connections == 2


def test_fresh_connection_closed_and_broken_answers_raise_transport_errors():
    server = RawServer([None, ok()[:30], b"SPDY/9 banana\r\n\r\n"], keep=False)

    async def go():
        pool = HostPool("127.0.0.1", server.port, False, {})
        errors = []
        for _ in range(3):
            with pytest.raises(TransportError) as info:
                await pool.request("GET", "/a")
            errors.append(info.value)
        return errors

    try:
        stale, cut, garbage = run(go())
    finally:
        server.close()
    assert isinstance(stale, StaleConnection)  # not pooled: not retried by the pool itself
    assert "inside the response" in str(cut) and "not valid HTTP" in str(garbage)


def test_client_retries_broken_answers_and_reads_error_bodies():
    error = json.dumps({"error": {"message": "busy"}}).encode()
    busy = f"HTTP/1.1 503 Busy\r\nContent-Length: {len(error)}\r\n\r\n".encode() + error
    server = RawServer([ok()[:30], busy, chunked()], keep=False)
    try:
        with JudgeClient([f"http://127.0.0.1:{server.port}"], model="m", backoff_s=0.01) as c:
            answer = c.chat({"messages": [{"role": "user", "content": "hi"}]})
            assert answer["choices"][0]["message"]["content"] == "Yes"
            assert c.metrics()["retries"] == 2 and c.metrics()["failures"] == 0
        assert json.loads(server.requests[0].partition(b"\r\n\r\n")[2])["model"] == "m"
    finally:
        server.close()
    server = RawServer([busy] * 3, keep=False)
    try:
        with JudgeClient([f"http://127.0.0.1:{server.port}"], model="m", max_retries=2) as c:
            with pytest.raises(JudgeUnavailableError, match="HTTP 503: busy"):
                c.chat({"messages": [{"role": "user", "content": "hi"}]})
    finally:
        server.close()


def _head(request: bytes) -> tuple[bytes, dict[bytes, bytes]]:
    head, _, body = request.partition(b"\r\n\r\n")
    line, *fields = head.split(b"\r\n")
    headers = {k.lower(): v for k, _, v in (f.partition(b": ") for f in fields)}
    assert int(headers[b"content-length"]) == len(body)
    return line, headers


def test_chat_sends_the_request_the_httpx_path_sends():
    """chat() writes its request head itself (no httpx.Request per call): the request
    line and headers must be those the loop path's httpx.Request puts on the wire."""
    server = RawServer([ok(), ok()])
    url = f"http://127.0.0.1:{server.port}/v1"
    body = {"messages": [{"role": "user", "content": "hi"}]}
    try:
        with JudgeClient([url], model="m", api_key="k") as c:
            assert c.chat(body) == c.chat_many([body])[0] == json.loads(BODY)
    finally:
        server.close()
    blocking, loop = (_head(r) for r in server.requests)
    assert blocking == loop
    assert blocking[0] == b"POST /v1/chat/completions HTTP/1.1"
    assert blocking[1][b"authorization"] == b"Bearer k"
    assert blocking[1][b"host"] == f"127.0.0.1:{server.port}".encode()


def test_chat_without_retries_fails_after_one_attempt():
    server = RawServer([ok()[:30]], keep=False)  # a broken answer: retryable
    try:
        with JudgeClient([f"http://127.0.0.1:{server.port}"], model="m", max_retries=0) as c:
            with pytest.raises(JudgeUnavailableError, match="after 1 attempts"):
                c.chat({"messages": [{"role": "user", "content": "hi"}]})
            m = c.metrics()
            assert (m["attempts"], m["retries"], m["failures"]) == (1, 0, 1)
    finally:
        server.close()


def test_pooled_transport_serves_an_httpx_client_and_raises_httpx_errors():
    server = RawServer([ok(extra="X-Judge: a\r\n"), chunked(), ok()[:30]])

    async def go():
        async with httpx.AsyncClient(transport=PooledTransport()) as client:
            first = await client.post(
                f"http://127.0.0.1:{server.port}/v1/x", json={"a": 1}, headers={"X-Key": "k"}
            )
            second = await client.get(f"http://127.0.0.1:{server.port}/y?q=1")
            with pytest.raises(httpx.RemoteProtocolError, match="inside the response"):
                await client.get(f"http://127.0.0.1:{server.port}/z")
            return first, second

    try:
        first, second = run(go())
    finally:
        server.close()
    assert first.status_code == second.status_code == 200
    assert first.json() == second.json() == json.loads(BODY)
    assert first.headers["x-judge"] == "a" and server.connections == 1
    head = server.requests[0].decode()
    assert head.startswith("POST /v1/x HTTP/1.1\r\n") and "X-Key: k\r\n" in head
    assert f"Host: 127.0.0.1:{server.port}\r\n" in head and head.endswith('{"a":1}')
    assert server.requests[1].decode().startswith("GET /y?q=1 HTTP/1.1\r\n")

    closed = socket.create_server(("127.0.0.1", 0))  # a port nobody listens on
    port = closed.getsockname()[1]
    closed.close()

    async def refused():
        transport = PooledTransport()
        with pytest.raises(httpx.ConnectError):
            await transport.handle_async_request(httpx.Request("GET", f"http://127.0.0.1:{port}/"))

    run(refused())


def test_client_on_any_httpx_transport_mock_and_httpcore():
    seen = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        if len(seen) == 1:
            return httpx.Response(503, json={"error": {"message": "warming up"}})
        return httpx.Response(200, content=BODY)

    with JudgeClient(
        "http://judge:8000/v1",
        api_key="K",
        model="m",
        backoff_s=0.01,
        transport=httpx.MockTransport(handler),
    ) as c:
        answer = c.chat({"messages": [{"role": "user", "content": "hi"}]})
        assert answer["choices"][0]["message"]["content"] == "Yes"
        assert c.metrics()["retries"] == 1
    assert [str(r.url) for r in seen] == ["http://judge:8000/v1/chat/completions"] * 2
    assert seen[0].headers["authorization"] == "Bearer K"
    assert json.loads(seen[0].content)["model"] == "m"

    # httpx's own transport (httpcore), e.g. for proxies or TLS settings
    server = RawServer([ok(), chunked()])
    try:
        with JudgeClient(
            [f"http://127.0.0.1:{server.port}"], model="m", transport=httpx.AsyncHTTPTransport()
        ) as c:
            answers = c.chat_many([{"messages": [{"role": "user", "content": "hi"}]}] * 2)
        assert [a["choices"][0]["message"]["content"] for a in answers] == ["Yes", "Yes"]
    finally:
        server.close()


def test_sync_calls_run_on_the_callers_thread_until_a_daemon_is_needed():
    """chat_many/health run the client's loop on the calling thread (no thread hops;
    chat needs no loop); concurrent callers, async callers and callers inside a running
    loop are served by the daemon thread, which then serves every call."""
    import concurrent.futures

    server = RawServer([ok()] * 40)
    message = {"messages": [{"role": "user", "content": "hi"}]}

    def daemons() -> int:
        return sum(t.name == "judge-client" for t in threading.enumerate())

    try:
        before = daemons()
        c = JudgeClient([f"http://127.0.0.1:{server.port}"], model="m")
        assert c.chat(message)["choices"][0]["message"]["content"] == "Yes"
        assert len(c.chat_many([message] * 3)) == 3
        assert list(c.health().values()) == [True]
        assert c._thread is None and daemons() == before  # all on this thread
        c.close()  # closes on this thread too
        assert c.chat(message)  # and opens again

        slow = threading.Event()

        def caller(i):
            if i == 0:
                slow.wait(5)
            return c.chat_many([message] * 2)

        with concurrent.futures.ThreadPoolExecutor(4) as pool:  # concurrent sync callers
            futures = [pool.submit(caller, i) for i in range(4)]
            slow.set()
            assert all(len(f.result(timeout=30)) == 2 for f in futures)

        async def inside_a_loop():
            c.chat(message)  # blocks this loop (blocking sockets, no daemon needed)
            return await c.achat(message)

        assert run(inside_a_loop())["choices"][0]["message"]["content"] == "Yes"
        assert c._thread is not None and c.chat(message)
        c.close()
        assert daemons() == before and c.metrics()["failures"] == 0
    finally:
        server.close()


def test_blocking_transport_reads_every_body_kind_and_replaces_a_stale_connection():
    """BlockingTransport (chat()'s transport) on the same servers as the pooled one:
    length, chunked and close-delimited bodies; a pooled connection the server closed
    is replaced at once; a fresh one that breaks raises httpx's errors."""
    server = RawServer([ok(), chunked(), None, ok(), b"HTTP/1.1 200 OK\r\n\r\n" + BODY])
    transport = BlockingTransport(timeout_s=5)
    url = f"http://127.0.0.1:{server.port}"
    try:
        post = transport.handle_request(httpx.Request("POST", url + "/x", json={"a": 1}))
        chunk = transport.handle_request(httpx.Request("GET", url + "/y?q=1"))
        stale = transport.handle_request(httpx.Request("GET", url + "/z"))  # new connection
        closing = transport.handle_request(httpx.Request("GET", url + "/w"))  # ends at close
        assert [r.read() for r in (post, chunk, stale, closing)] == [BODY] * 4
        assert server.connections == 2 and not transport.pools[next(iter(transport.pools))].idle
        head = server.requests[0].decode()
        assert head.startswith("POST /x HTTP/1.1\r\n") and head.endswith('{"a":1}')
        assert server.requests[1].decode().startswith("GET /y?q=1 HTTP/1.1\r\n")
    finally:
        transport.close()
        server.close()

    broken = RawServer([None, ok()[:30], b"SPDY/9 banana\r\n\r\n"], keep=False)
    transport = BlockingTransport(timeout_s=5)
    try:
        for needle in ("closed the connection", "inside the response", "not valid HTTP"):
            request = httpx.Request("GET", f"http://127.0.0.1:{broken.port}/a")
            with pytest.raises(httpx.RemoteProtocolError, match=needle):
                transport.handle_request(request)
    finally:
        broken.close()

    closed = socket.create_server(("127.0.0.1", 0))  # a port nobody listens on
    port = closed.getsockname()[1]
    closed.close()
    with pytest.raises(httpx.ConnectError):
        transport.handle_request(httpx.Request("GET", f"http://127.0.0.1:{port}/"))


def test_blocking_transport_deadline_and_a_sync_chat_that_times_out_then_fails_over():
    """A server that never answers: the request's deadline (httpx's timeout extension)
    raises httpx.ReadTimeout; chat() retries it on the other server at once."""
    silent = socket.create_server(("127.0.0.1", 0))  # accepts (backlog), never answers
    live = RawServer([ok()])
    transport = BlockingTransport(timeout_s=30)
    request = httpx.Request(
        "GET",
        f"http://127.0.0.1:{silent.getsockname()[1]}/",
        extensions={"timeout": {"read": 0.2}},
    )
    t0 = time.perf_counter()
    with pytest.raises(httpx.ReadTimeout):
        transport.handle_request(request)
    assert time.perf_counter() - t0 < 5
    urls = [f"http://127.0.0.1:{silent.getsockname()[1]}", f"http://127.0.0.1:{live.port}"]
    try:
        with JudgeClient(urls, model="m", timeout_s=0.3) as c:
            c._rr = 0  # the silent server first
            answer = c.chat({"messages": [{"role": "user", "content": "hi"}]})
            metrics = c.metrics()
        assert answer["choices"][0]["message"]["content"] == "Yes"
        assert metrics["retries"] == 1 and metrics["servers"][urls[0]]["errors"] == 1
        assert metrics["in_flight"] == {urls[0]: 0, urls[1]: 0}
    finally:
        silent.close()
        live.close()


def test_chat_uses_blocking_sockets_unless_the_transport_is_async_only():
    """chat() on BlockingTransport (no event loop), or on a given transport that is also
    synchronous (MockTransport); with an async-only one it goes through the loop. The
    answers and the counters are those of the async path."""
    server = RawServer([ok()] * 6)
    message = {"messages": [{"role": "user", "content": "hi"}]}
    url = f"http://127.0.0.1:{server.port}"
    try:
        with JudgeClient(url, model="m") as c:
            assert isinstance(c._blocking, BlockingTransport)
            sync = c.chat(message)
            assert c._loop is None  # no event loop was made
            (concurrent,) = c.chat_many([message])
            assert sync == concurrent == json.loads(BODY)
            m = c.metrics()
            assert (m["requests"], m["completed"], m["attempts"], m["failures"]) == (2, 2, 2, 0)
        with JudgeClient(url, model="m", transport=httpx.AsyncHTTPTransport()) as c:
            assert c._blocking is None and c.chat(message) == json.loads(BODY)
            assert c._loop is not None
    finally:
        server.close()
    seen = []
    mock = httpx.MockTransport(lambda r: seen.append(r) or httpx.Response(200, content=BODY))
    with JudgeClient("http://judge:1", transport=mock) as c:
        models = {"object": "list", "data": [{"id": "served-name"}]}
        mock.handler = lambda r: (
            seen.append(r)
            or httpx.Response(200, json=models if r.url.path == "/v1/models" else json.loads(BODY))
        )
        assert c._blocking is mock and c.chat(message) == json.loads(BODY)
    assert [r.url.path for r in seen] == ["/v1/models", "/v1/chat/completions"]
    assert json.loads(seen[1].content)["model"] == "served-name"
