"""The judge server against clients that misbehave (raw sockets), the `openai` client's
error types, served model names, and the batcher's lone-request path."""

from __future__ import annotations

import asyncio
import base64
import io
import json
import socket
import threading
import time

import pytest
from PIL import Image
from test_genrm import FakeJudge
from test_judge_server import YES_NO, http

from mmyatt.serving.batcher import Batcher, BatcherStopped, Work
from mmyatt.serving.client import JudgeClient, JudgeRequestError
from mmyatt.serving.server import JudgeServer

LIMIT = 256 * 1024


@pytest.fixture
def server():
    s = JudgeServer(FakeJudge(), api_key="k", max_body_bytes=LIMIT).start()
    yield s
    s.stop()


def raw(server: JudgeServer, data: bytes, *, timeout: float = 10.0) -> tuple[int, dict]:
    """Send ``data`` as is on a fresh connection; (status, JSON body) of the answer."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=timeout) as s:
        s.sendall(data)
        reply = b""
        while b"\r\n\r\n" not in reply:
            chunk = s.recv(65536)
            if not chunk:
                break
            reply += chunk
        head, _, body = reply.partition(b"\r\n\r\n")
        headers = dict(
            line.split(": ", 1) for line in head.decode("latin-1").split("\r\n")[1:] if ": " in line
        )
        length = int({k.lower(): v for k, v in headers.items()}.get("content-length", 0))
        while len(body) < length:
            chunk = s.recv(65536)
            if not chunk:
                break
            body += chunk
    status = int(head.split(b" ", 2)[1])
    return status, json.loads(body) if body else {}


def post(body: bytes, key: str = "k", length: int | None = None) -> bytes:
    n = len(body) if length is None else length
    return (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        + f"Authorization: Bearer {key}\r\nContent-Length: {n}\r\n\r\n".encode()
        + body
    )


def test_raw_socket_abuse_gets_openai_errors_and_the_server_stays_up(server):
    status, body = raw(server, post(b"{not json"))
    assert status == 400 and "not valid JSON" in body["error"]["message"]
    assert body["error"]["type"] == "invalid_request_error"
    status, body = raw(server, post(json.dumps(YES_NO).encode(), key="wrong"))
    assert status == 401 and body["error"]["code"] == "invalid_api_key"
    # a body over the limit: the 413 reaches the client that is still sending it
    big = json.dumps({**YES_NO, "pad": "x" * (2 * LIMIT)}).encode()
    status, body = raw(server, post(big))
    assert status == 413 and str(LIMIT) in body["error"]["message"]
    # a wrong key on a large body is answered too, not cut off
    assert raw(server, post(big, key="wrong"))[0] in (401, 413)
    # far over the limit (declared): answered at once, the body never read
    status, _ = raw(server, post(b"", length=100 * LIMIT))
    assert status == 413
    # not HTTP at all
    with socket.create_connection(("127.0.0.1", server.port), timeout=5) as s:
        s.sendall(b"\x16\x03\x01 hello, this is not HTTP\r\n\r\n")
        assert s.recv(4096).startswith(b"HTTP/1.1 400")
    status, body = raw(server, post(json.dumps(YES_NO).encode()))
    assert status == 200 and body["choices"][0]["message"]["content"] == "Yes"


def test_the_client_receives_the_413(server):
    big = {**YES_NO, "messages": [{"role": "user", "content": "x" * (2 * LIMIT)}]}
    with JudgeClient([server.url], api_key="k", max_retries=2) as c:
        with pytest.raises(JudgeRequestError) as info:
            c.chat(big)
        assert info.value.status == 413 and c.metrics()["retries"] == 0
        assert c.chat(YES_NO)["choices"]  # the client's pool still works


def test_slow_clients_do_not_hold_up_others(server):
    stalled = []
    try:
        for _ in range(8):  # half a request line, half a body: then nothing
            s = socket.create_connection(("127.0.0.1", server.port), timeout=5)
            s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Len")
            stalled.append(s)
        s = socket.create_connection(("127.0.0.1", server.port), timeout=5)
        s.sendall(post(b'{"messages": [')[:-2])
        stalled.append(s)
        t0 = time.perf_counter()
        status, body = raw(server, post(json.dumps(YES_NO).encode()))
        assert status == 200 and time.perf_counter() - t0 < 2.0
    finally:
        for s in stalled:
            s.close()


def _png_url(ok: bool = True) -> str:
    if not ok:
        return "data:image/png;base64," + base64.b64encode(b"\x89PNG\r\n\x1a\n garbage").decode()
    buf = io.BytesIO()
    Image.new("RGB", (4, 4), (255, 0, 0)).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


@pytest.mark.parametrize(
    ("url", "needle"),
    [
        ("data:image/png;base64,@@@not-base64@@@", "bad base64"),
        (_png_url(ok=False), "not a readable image"),
        ("https://example.com/cat.png", "nothing is fetched"),
    ],
)
def test_bad_images_are_400s(server, url, needle):
    parts = [{"type": "text", "text": "red?"}, {"type": "image_url", "image_url": {"url": url}}]
    body = {**YES_NO, "messages": [{"role": "user", "content": parts}]}
    status, answer = http(f"{server.url}/v1/chat/completions", body, key="k")
    assert status == 400 and needle in answer["error"]["message"]
    good = [parts[0], {"type": "image_url", "image_url": {"url": _png_url()}}]
    body = {**YES_NO, "messages": [{"role": "user", "content": good}]}
    assert http(f"{server.url}/v1/chat/completions", body, key="k")[0] == 200


def test_openai_client_error_types_and_served_model_names():
    openai = pytest.importorskip("openai")
    s = JudgeServer(FakeJudge(), model_name=["judge-a", "alias-b"]).start()
    try:
        client = openai.OpenAI(base_url=s.url + "/v1", api_key="none", max_retries=0)
        assert [m.id for m in client.models.list().data] == ["judge-a"]
        for name in ("judge-a", "alias-b"):
            r = client.chat.completions.create(
                model=name, messages=[{"role": "user", "content": "red?"}], max_tokens=1
            )
            assert r.model == "judge-a"
        with pytest.raises(openai.NotFoundError) as info:
            client.chat.completions.create(
                model="gpt-9", messages=[{"role": "user", "content": "red?"}], max_tokens=1
            )
        assert info.value.body["code"] == "model_not_found"
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(model="judge-a", messages=[], max_tokens=1)
        assert "non-empty" in info.value.body["message"]
        with pytest.raises(openai.BadRequestError):
            client.chat.completions.create(
                model="judge-a", messages=[{"role": "user", "content": "x"}], temperature=7
            )
    finally:
        s.stop()


def test_a_lone_request_does_not_wait_for_company():
    """At 1 in flight the batcher dispatches at once, however long it may wait for a
    batch; a burst right after is still gathered into one call."""
    judge = FakeJudge(delay_s=0.02)
    s = JudgeServer(judge, max_batch=16, batch_wait_ms=400).start()
    try:
        with JudgeClient([s.url]) as c:
            c.chat(YES_NO)
            t0 = time.perf_counter()
            for _ in range(3):
                c.chat(YES_NO)
            assert (time.perf_counter() - t0) / 3 < 0.2  # never the 0.4 s wait
            assert s.stats["waited_batches"] == 0
            with JudgeClient([s.url], max_in_flight=8) as burst:
                burst.chat_many([YES_NO] * 8)
                burst.chat_many([YES_NO] * 8)
        assert s.stats["max_batch_seen"] > 1
    finally:
        s.stop()


def test_a_lone_one_forward_request_is_served_in_the_event_loop():
    """Alone, a next-token request skips the worker thread (two thread hops); text
    generation, and any request while others are held, go through the worker."""

    class WhereJudge(FakeJudge):
        def __init__(self):
            super().__init__(delay_s=0.01)
            self.threads: list[tuple[str, int]] = []

        def _record(self, kind, batch):
            super()._record(kind, batch)
            self.threads.append((threading.current_thread().name, len(batch)))

    judge = WhereJudge()
    s = JudgeServer(judge, max_batch=16).start()
    try:
        with JudgeClient([s.url]) as c:
            c.chat(YES_NO)
            c.chat({**YES_NO, "max_tokens": 4, "logprobs": False, "top_logprobs": None})
        names = [name for name, _ in judge.threads]
        assert names[0] == "judge-http" and names[1].startswith("judge-model")
        judge.threads.clear()
        with JudgeClient([s.url], max_in_flight=16) as c:
            c.chat_many([YES_NO] * 16)
        assert max(n for _, n in judge.threads) > 1  # concurrent requests are still batched
        assert s.stats["requests"] == 18 and s.stats["errors"] == 0
    finally:
        s.stop()


def test_stop_fails_what_is_queued_and_the_call_in_progress_finishes():
    """stop() while a batch is in the model: that batch is answered, what queued behind
    it fails with BatcherStopped (the server's 503), and nothing new is taken. Nothing
    runs while the batcher is idle (no task, no polling)."""
    release = threading.Event()

    class Blocking(FakeJudge):
        def generate_text(self, batch, **kwargs):
            release.wait(10)
            return super().generate_text(batch, **kwargs)

    batcher = Batcher(Blocking(), max_batch=1, batch_wait_ms=0)

    def work() -> Work:  # text generation: always on the model thread
        return Work([{"role": "user", "content": "a good one"}], 4, 1.0, False, 0, 1, 3)

    async def main():
        release.set()
        assert (await batcher.submit(work())).generations
        await asyncio.sleep(0)
        assert not batcher._draining  # idle: no task left behind
        release.clear()
        busy = batcher.submit(work())
        await asyncio.sleep(0.1)  # the model thread is inside generate_text
        queued = batcher.submit(work())
        batcher.stop()
        release.set()
        assert (await busy).generations[0][0] == "Looks fine. Score: 8"
        with pytest.raises(BatcherStopped):
            await queued
        with pytest.raises(BatcherStopped):
            batcher.submit(work())

    asyncio.run(main())
