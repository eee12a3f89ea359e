"""The embedded judge server, the async client and the judge pool: wire format, API
key, dynamic batching, retries against a killed server, balancing, OpenAI client."""

from __future__ import annotations

import json
import logging
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from test_genrm import LOGITS, FakeJudge

from mmyatt.serving.api import ChatCompletion
from mmyatt.serving.client import JudgeClient, JudgeRequestError, JudgeUnavailableError
from mmyatt.serving.pool import JudgePool, JudgePoolError, check_health
from mmyatt.serving.server import JudgeServer

YES_NO = {
    "messages": [{"role": "user", "content": "Is it red? Answer Yes or No."}],
    "max_tokens": 1,
    "temperature": 0,
    "logprobs": True,
    "top_logprobs": 3,
}


def http(url: str, body=None, *, key: str | None = None, raw: bytes | None = None):
    """(status, parsed JSON) of a GET (no body) or POST."""
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    headers = {"Content-Type": "application/json"}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    request = urllib.request.Request(url, data=data, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=10) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


@pytest.fixture
def server():
    s = JudgeServer(FakeJudge(), model_name="fake-judge").start()
    yield s
    s.stop()


def test_endpoints_and_openai_wire_format(server):
    assert http(f"{server.url}/health") == (200, {"status": "ok", "model": "fake-judge"})
    status, models = http(f"{server.url}/v1/models")
    assert status == 200 and models["data"][0]["id"] == "fake-judge"
    status, body = http(f"{server.url}/v1/chat/completions", YES_NO)
    assert status == 200 and body["object"] == "chat.completion"
    choice = body["choices"][0]
    assert choice["message"] == {"role": "assistant", "content": "Yes"}
    first = choice["logprobs"]["content"][0]
    assert [t["token"] for t in first["top_logprobs"]] == ["Yes", "maybe", " Yes"]
    assert first["logprob"] == pytest.approx(2.0 - _log_norm(LOGITS["red"]))
    assert body["mmyatt"]["model_time_ms"] >= 0 and body["mmyatt"]["batch_size"] == 1
    generated = {"messages": YES_NO["messages"], "max_tokens": 8, "n": 2, "seed": 4}
    for answer in (body, http(f"{server.url}/v1/chat/completions", generated)[1]):
        # the route writes its answer with orjson: it must still be the declared model's
        assert ChatCompletion.model_validate(answer).model_dump(mode="json") == answer


def _log_norm(logits):
    import math

    return math.log(sum(math.exp(v) for v in logits))


@pytest.mark.parametrize(
    ("raw", "status", "needle"),
    [
        (b"{not json", 400, "not valid JSON"),
        (json.dumps({"messages": []}).encode(), 400, "non-empty"),
        (json.dumps({**YES_NO, "max_tokens": 4}).encode(), 400, "max_tokens=1"),
        (json.dumps({**YES_NO, "model": "gpt-9"}).encode(), 404, "does not exist"),
        (json.dumps({**YES_NO, "temperature": "hot"}).encode(), 400, "temperature"),
    ],
)
def test_bad_requests_get_clear_errors(server, raw, status, needle):
    got, body = http(f"{server.url}/v1/chat/completions", raw=raw)
    assert got == status and needle in body["error"]["message"]


def test_a_body_that_is_not_json_gets_a_400(server):
    data = json.dumps(YES_NO).encode()
    request = urllib.request.Request(f"{server.url}/v1/chat/completions", data=data)
    request.add_header("Content-Type", "text/plain")
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(request, timeout=10)
    body = json.loads(info.value.read())
    assert info.value.code == 400 and "Content-Type: application/json" in body["error"]["message"]


def test_api_key_required_and_never_logged(capfd, caplog):
    key = "sk-test-secret-42"
    caplog.set_level(logging.INFO, logger="uvicorn.access")
    s = JudgeServer(FakeJudge(), api_key=key, log_requests=True).start()
    try:
        url = f"{s.url}/v1/chat/completions"
        status, body = http(url, YES_NO)
        assert status == 401 and body["error"]["code"] == "invalid_api_key"
        assert http(url, YES_NO, key="wrong")[0] == 401
        assert http(f"{s.url}/v1/models")[0] == 401
        assert http(url, YES_NO, key=key)[0] == 200
        assert http(f"{s.url}/health")[0] == 200  # liveness probes need no key (as in vLLM)
        with JudgeClient([s.url], api_key=key) as c:
            assert c.chat(YES_NO)["choices"][0]["message"]["content"] == "Yes"
            assert key not in repr(c)
        with JudgeClient([s.url], max_retries=3) as c, pytest.raises(JudgeRequestError) as info:
            c.chat(YES_NO)
        assert info.value.status == 401 and c.metrics()["retries"] == 0  # not retried
    finally:
        s.stop()
    out, err = capfd.readouterr()
    assert "POST /v1/chat/completions" in caplog.text  # uvicorn's access log
    assert key not in out + err + caplog.text


def test_openai_python_client_talks_to_the_server():
    openai = pytest.importorskip("openai")
    s = JudgeServer(FakeJudge(), api_key="k1", model_name="fake-judge").start()
    try:
        client = openai.OpenAI(base_url=s.url + "/v1", api_key="k1", max_retries=0)
        response = client.chat.completions.create(
            model="fake-judge",
            messages=[{"role": "user", "content": "Is it red?"}],
            max_tokens=1,
            temperature=0,
            logprobs=True,
            top_logprobs=5,
        )
        top = response.choices[0].logprobs.content[0].top_logprobs
        assert [t.token for t in top] == ["Yes", "maybe", " Yes", "Score", "No"]
        assert response.choices[0].message.content == "Yes"
        generated = client.chat.completions.create(
            model="fake-judge",
            messages=[{"role": "user", "content": "a good one"}],
            max_tokens=8,
            temperature=1.0,
            n=2,
            seed=4,
        )
        assert [c.message.content for c in generated.choices] == [
            "Looks fine. Score: 7",
            "Looks fine. Score: 8",
        ]
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=s.url + "/v1", api_key="bad", max_retries=0).models.list()
    finally:
        s.stop()


def test_dynamic_batching_batches_concurrent_requests():
    judge = FakeJudge(delay_s=0.03)
    batched = JudgeServer(judge, max_batch=8, batch_wait_ms=5).start()
    single = JudgeServer(FakeJudge(delay_s=0.0), max_batch=1).start()
    try:
        with JudgeClient([batched.url], max_in_flight=16) as c:
            responses = c.chat_many([YES_NO] * 16)
        assert all(r["choices"][0]["message"]["content"] == "Yes" for r in responses)
        stats = batched.stats
        assert stats["requests"] == 16 and stats["max_batch_seen"] > 1
        assert stats["batches"] < 16 and max(n for _, n in judge.calls) <= 8
        assert max(r["mmyatt"]["batch_size"] for r in responses) > 1
        with JudgeClient([single.url], max_in_flight=16) as c:
            c.chat_many([YES_NO] * 8)
        assert single.stats["max_batch_seen"] == 1 and single.stats["batches"] == 8
    finally:
        batched.stop()
        single.stop()


def test_client_retries_a_killed_server_until_it_is_back():
    first = JudgeServer(FakeJudge()).start()
    port = first.port
    client = JudgeClient([first.url], max_retries=40, backoff_s=0.02, backoff_max_s=0.1)
    try:
        assert client.chat(YES_NO)["choices"]  # a pooled keep-alive connection now exists
        first.stop()  # "killed": listening socket and open connections closed
        result: dict = {}
        worker = threading.Thread(target=lambda: result.update(r=client.chat(YES_NO)))
        worker.start()
        time.sleep(0.4)
        assert "r" not in result  # still retrying
        second = JudgeServer(FakeJudge(), port=port).start()  # back on the same port
        try:
            worker.join(timeout=10)
            assert result["r"]["choices"][0]["message"]["content"] == "Yes"
        finally:
            second.stop()
        metrics = client.metrics()
        assert metrics["retries"] > 0 and metrics["failures"] == 0
    finally:
        client.close()


def test_client_gives_up_with_a_clear_error_after_its_budget(server):
    url = server.url
    server.stop()
    with JudgeClient([url], max_retries=2, backoff_s=0.01, backoff_max_s=0.02) as c:
        t0 = time.perf_counter()
        with pytest.raises(JudgeUnavailableError) as info:
            c.chat(YES_NO)
        assert time.perf_counter() - t0 < 5
        assert c.metrics()["retries"] == 2 and c.metrics()["failures"] == 1
    message = str(info.value)
    assert url in message and "3 attempts" in message and "last error" in message
    assert info.value.urls == [url] and info.value.last_error is not None


def test_least_in_flight_balancing_and_failover():
    a, b = JudgeServer(FakeJudge(0.01)).start(), JudgeServer(FakeJudge(0.01)).start()
    try:
        with JudgeClient([a.url, b.url], max_in_flight=8) as c:
            c.chat_many([YES_NO] * 24)
            per_server = c.metrics()["servers"]
        assert a.stats["requests"] > 0 and b.stats["requests"] > 0
        assert a.stats["requests"] + b.stats["requests"] == 24
        assert per_server[a.url]["requests"] > 0 and per_server[b.url]["requests"] > 0
        b.stop()  # one server dies: every request still succeeds, on the other
        with JudgeClient([b.url, a.url], max_retries=3, backoff_s=0.01) as c:
            assert len(c.chat_many([YES_NO] * 6)) == 6
            assert c.metrics()["failures"] == 0
    finally:
        a.stop()
        b.stop()


def test_non_loopback_bind_warns(caplog):
    s = JudgeServer(FakeJudge(), host="0.0.0.0")
    s.stop()
    (record,) = [r for r in caplog.records if "not loopback" in r.getMessage()]
    assert record.levelname == "WARNING" and "no API key" in record.getMessage()


@pytest.fixture(scope="module")
def tiny_judge_dir(tmp_path_factory) -> Path:
    from mmyatt.models.builtin.tiny import build_tiny_text_model

    return build_tiny_text_model(
        tmp_path_factory.mktemp("pooljudge"), size="qwen2-0.1m", corpus=["Yes No"] * 20
    )


def test_pool_starts_and_stops_a_child_server(tiny_judge_dir):
    key = "pool-secret-7"
    with JudgePool(tiny_judge_dir, n=1, api_key=key, threads=1, startup_timeout_s=60) as pool:
        (url,) = pool.urls
        assert check_health(url)
        pid = pool.processes[0].pid
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        assert key.encode() not in cmdline  # the key travels in the environment
        assert http(f"{url}/v1/chat/completions", YES_NO)[0] == 401
        with JudgeClient(pool.urls, api_key=key) as c:
            body = c.chat(YES_NO)
        assert len(body["choices"][0]["logprobs"]["content"][0]["top_logprobs"]) == 3
        assert pool.stats()[0]["requests"] == 1
        proc = pool.processes[0]
    assert proc.poll() is not None and not check_health(url)
    with pytest.raises(JudgePoolError, match="not healthy"):
        JudgePool.external([url], timeout_s=0.3)


def test_pool_reports_a_child_that_fails_to_start(tmp_path):
    (tmp_path / "config.json").write_text("{}")  # no weights, no tokenizer
    with pytest.raises(JudgePoolError, match="exited with code"):
        JudgePool(tmp_path, n=1, startup_timeout_s=60)
