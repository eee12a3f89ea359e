"""The judge pool restarts a judge server that dies during a run, on the same port, a
bounded number of times; clients retrying against the dead server find it back."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
from test_judge_server import YES_NO

from mmyatt.serving.client import JudgeClient, JudgeUnavailableError
from mmyatt.serving.pool import JudgePool, check_health


@pytest.fixture(scope="module")
def judge_dir(tmp_path_factory) -> Path:
    from mmyatt.models.builtin.tiny import build_tiny_text_model

    return build_tiny_text_model(
        tmp_path_factory.mktemp("pooljudge"), size="qwen2-0.1m", corpus=["Yes No"] * 20
    )


def _wait_dead(proc, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)


def test_a_killed_judge_is_restarted_on_its_port_and_a_retrying_client_gets_its_answer(
    judge_dir,
):
    with JudgePool(judge_dir, n=1, threads=1, max_restarts=1, watch_interval_s=0.1) as pool:
        (url,) = pool.urls
        first = pool.processes[0]
        # a budget long enough to outlast a restart (process start + model load: over 30 s
        # on 2 cores shared with other work)
        with JudgeClient(pool.urls, max_retries=240, backoff_s=0.05, backoff_max_s=0.5) as c:
            assert c.chat(YES_NO)["choices"]
            os.kill(first.pid, signal.SIGKILL)
            _wait_dead(first)
            assert not check_health(url)
            answer = c.chat(YES_NO)  # retried until the restarted server answers
            assert answer["choices"][0]["logprobs"]["content"][0]["top_logprobs"]
            assert c.metrics()["retries"] > 0 and c.metrics()["failures"] == 0
        assert pool.urls == [url] and pool.restarts == [1]
        second = pool.processes[0]
        assert second.pid != first.pid and second.poll() is None
        assert "restarting it on the same port (1/1)" in pool.events[0]
        # the budget is spent: the next death is final, and said once
        os.kill(second.pid, signal.SIGKILL)
        _wait_dead(second)
        deadline = time.monotonic() + 5
        while len(pool.events) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.3)
        assert len(pool.events) == 2 and "budget of 1 used up" in pool.events[1]
        assert pool.processes[0] is second and pool.restarts == [1]
        with JudgeClient(pool.urls, max_retries=1, backoff_s=0.01) as c:
            with pytest.raises(JudgeUnavailableError, match=url):
                c.chat(YES_NO)
    assert not check_health(url)


def test_stop_does_not_restart_the_servers_it_stops(judge_dir):
    pool = JudgePool(judge_dir, n=1, threads=1, max_restarts=3, watch_interval_s=0.05)
    proc = pool.processes[0]
    pool.stop()
    time.sleep(0.3)
    assert proc.poll() is not None and pool.processes == [] and pool.events == []
