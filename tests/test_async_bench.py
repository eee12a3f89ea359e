"""`mmyatt bench async`'s quick form: both arms of the image GenRM recipe with its judge
behind the added latency run to the end, every judge call passes the delaying proxy, and
the async arm's batches were made ahead (staleness 1)."""

from __future__ import annotations

import http.client
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from mmyatt.bench.async_bench import DelayProxy, bench_async


def test_delay_proxy_holds_each_call_and_overlaps_calls_in_flight():
    class Echo(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_POST(self):
            body = self.rfile.read(int(self.headers["Content-Length"]))
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Echo)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    proxy = DelayProxy(f"http://127.0.0.1:{server.server_address[1]}", 0.3)
    answers = []

    def call(i: int) -> None:
        port = int(proxy.url.rsplit(":", 1)[1])
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        conn.request("POST", "/v1/chat", body=f"hello {i}".encode())
        answers.append(conn.getresponse().read().decode())

    t0 = time.perf_counter()
    threads = [threading.Thread(target=call, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    took = time.perf_counter() - t0
    proxy.close()
    server.shutdown()
    assert sorted(answers) == [f"hello {i}" for i in range(4)]
    assert proxy.calls == 4
    assert 0.3 <= took < 1.2  # held 0.3 s each, the four at once


@pytest.mark.slow
def test_quick_async_bench_runs_both_arms_behind_the_latency():
    out = bench_async(quick=True, cases=("genrm_remote",))
    case = out["cases"]["genrm_remote"]
    assert case["judge_calls_delayed"] > 0
    for arm in ("sync", "one_step_off"):
        (run,) = case[arm]["runs"].values()
        assert run["eval_reward_end"] is not None and run["wall_s"] > 0
    (a,) = case["one_step_off"]["runs"].values()
    assert a["async"]["async/staleness_max"] == 1.0  # step 2 trained on version 0
