"""The judge client against servers that answer in every way HTTP/1.1 allows (chunked,
no length, closing idle connections) and ways it does not: retries, failover, timeouts,
kept-alive connections, any httpx2 transport, callers on any thread or loop."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time

import httpx2
import pytest

from mmyatt.serving.client import JudgeClient, JudgeUnavailableError

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


MESSAGE = {"messages": [{"role": "user", "content": "hi"}]}


def test_every_body_kind_on_one_kept_alive_connection_and_a_dropped_one_replaced():
    """Length, chunked and close-delimited answers, the requests reusing one connection
    until the server closes it; a connection the server drops with a request on it is
    replaced by the retry."""
    server = RawServer([ok(), chunked(), b"HTTP/1.1 200 OK\r\n\r\n" + BODY])
    url = f"http://127.0.0.1:{server.port}"
    try:
        with JudgeClient([url], model="m", api_key="k", max_retries=0) as c:
            answers = [c.chat(MESSAGE) for _ in range(3)]  # the 3rd ends at close
    finally:
        server.close()
    assert answers == [json.loads(BODY)] * 3 and server.connections == 1
    head = server.requests[0].decode()
    assert head.startswith("POST /v1/chat/completions HTTP/1.1\r\n")
    assert "\r\nauthorization: Bearer k\r\n" in head.replace("Authorization", "authorization")
    assert json.loads(server.requests[0].partition(b"\r\n\r\n")[2])["model"] == "m"

    server = RawServer([ok(), None, ok()])  # the 2nd request finds its connection dropped
    try:
        with JudgeClient([f"http://127.0.0.1:{server.port}"], model="m", backoff_s=0.01) as c:
            assert [c.chat(MESSAGE) for _ in range(2)] == [json.loads(BODY)] * 2
            assert c.metrics()["retries"] == 1 and c.metrics()["failures"] == 0
    finally:
        server.close()
    assert server.connections == 2


def test_client_retries_broken_answers_and_reads_error_bodies():
    error = json.dumps({"error": {"message": "busy"}}).encode()
    busy = f"HTTP/1.1 503 Busy\r\nContent-Length: {len(error)}\r\n\r\n".encode() + error
    server = RawServer([ok()[:30], busy, chunked()], keep=False)
    try:
        with JudgeClient([f"http://127.0.0.1:{server.port}"], model="m", backoff_s=0.01) as c:
            answer = c.chat(MESSAGE)
            assert answer["choices"][0]["message"]["content"] == "Yes"
            assert c.metrics()["retries"] == 2 and c.metrics()["failures"] == 0
        assert json.loads(server.requests[0].partition(b"\r\n\r\n")[2])["model"] == "m"
    finally:
        server.close()
    server = RawServer([busy] * 3, keep=False)
    try:
        with JudgeClient([f"http://127.0.0.1:{server.port}"], model="m", max_retries=2) as c:
            with pytest.raises(JudgeUnavailableError, match="HTTP 503: busy"):
                c.chat(MESSAGE)
    finally:
        server.close()


def test_chat_without_retries_fails_after_one_attempt():
    server = RawServer([ok()[:30]], keep=False)  # a broken answer: retryable
    try:
        with JudgeClient([f"http://127.0.0.1:{server.port}"], model="m", max_retries=0) as c:
            with pytest.raises(JudgeUnavailableError, match="after 1 attempts"):
                c.chat(MESSAGE)
            m = c.metrics()
            assert (m["attempts"], m["retries"], m["failures"]) == (1, 0, 1)
    finally:
        server.close()


def test_a_refused_connection_is_retried_and_then_reported():
    closed = socket.create_server(("127.0.0.1", 0))  # a port nobody listens on
    url = f"http://127.0.0.1:{closed.getsockname()[1]}"
    closed.close()
    with JudgeClient([url], model="m", max_retries=1, backoff_s=0.01) as c:
        with pytest.raises(JudgeUnavailableError, match="ConnectError") as info:
            c.chat(MESSAGE)
        assert c.metrics()["attempts"] == 2 and info.value.urls == [url]


def test_client_on_any_httpx2_transport_mock_and_httpcore2():
    seen = []

    def handler(request: httpx2.Request) -> httpx2.Response:
        seen.append(request)
        if len(seen) == 1:
            return httpx2.Response(503, json={"error": {"message": "warming up"}})
        if request.url.path == "/v1/models":
            return httpx2.Response(200, json={"object": "list", "data": [{"id": "served"}]})
        return httpx2.Response(200, content=BODY)

    with JudgeClient(
        "http://judge:8000/v1", api_key="K", backoff_s=0.01, transport=httpx2.MockTransport(handler)
    ) as c:
        answer = c.chat(MESSAGE)
        assert answer["choices"][0]["message"]["content"] == "Yes"
        assert c.metrics()["retries"] == 1
    # the first /v1/models was refused and retried; the served name went into the body
    assert [r.url.path for r in seen] == ["/v1/models", "/v1/models", "/v1/chat/completions"]
    assert str(seen[-1].url) == "http://judge:8000/v1/chat/completions"
    assert seen[-1].headers["authorization"] == "Bearer K"
    assert json.loads(seen[-1].content)["model"] == "served"

    # httpx2's own transport, given explicitly (e.g. for proxies or TLS settings)
    server = RawServer([ok(), chunked()])
    try:
        with JudgeClient(
            [f"http://127.0.0.1:{server.port}"], model="m", transport=httpx2.AsyncHTTPTransport()
        ) as c:
            answers = c.chat_many([MESSAGE] * 2)
        assert [a["choices"][0]["message"]["content"] for a in answers] == ["Yes", "Yes"]
    finally:
        server.close()


def test_callers_on_any_thread_and_inside_a_running_loop():
    """chat/chat_many/health from several threads at once, chat from inside a running
    event loop (it cannot run a loop of its own there), and achat on a caller's loop; no
    thread of the client's own is left behind."""
    import concurrent.futures

    server = RawServer([ok()] * 40)

    def client_threads() -> int:
        return sum(t.name.startswith("judge-client") for t in threading.enumerate())

    try:
        c = JudgeClient([f"http://127.0.0.1:{server.port}"], model="m")
        assert c.chat(MESSAGE)["choices"][0]["message"]["content"] == "Yes"
        assert len(c.chat_many([MESSAGE] * 3)) == 3
        assert list(c.health().values()) == [True]
        c.close()
        assert c.chat(MESSAGE)  # and opens again

        with concurrent.futures.ThreadPoolExecutor(4) as pool:  # concurrent sync callers
            futures = [pool.submit(c.chat_many, [MESSAGE] * 2) for _ in range(4)]
            assert all(len(f.result(timeout=30)) == 2 for f in futures)

        async def inside_a_loop():
            assert c.chat(MESSAGE)  # on a helper thread's loop
            return await c.achat(MESSAGE)  # on this loop

        assert asyncio.run(inside_a_loop())["choices"][0]["message"]["content"] == "Yes"
        assert c.metrics()["failures"] == 0 and c.metrics()["completed"] == 15
        c.close()
        assert client_threads() == 0
    finally:
        server.close()


def test_a_silent_server_times_out_and_the_request_fails_over_at_once():
    """A server that accepts and never answers: the attempt times out after timeout_s and
    the request goes to the other server without a backoff."""
    silent = socket.create_server(("127.0.0.1", 0))  # accepts (backlog), never answers
    live = RawServer([ok()])
    urls = [f"http://127.0.0.1:{silent.getsockname()[1]}", f"http://127.0.0.1:{live.port}"]
    try:
        with JudgeClient(urls, model="m", timeout_s=0.3, backoff_s=5.0) as c:
            c._rr = 0  # the silent server first
            t0 = time.perf_counter()
            answer = c.chat(MESSAGE)
            assert time.perf_counter() - t0 < 3  # no 5 s backoff
            metrics = c.metrics()
        assert answer["choices"][0]["message"]["content"] == "Yes"
        assert metrics["retries"] == 1 and metrics["servers"][urls[0]]["errors"] == 1
        assert metrics["in_flight"] == {urls[0]: 0, urls[1]: 0}
    finally:
        silent.close()
        live.close()
