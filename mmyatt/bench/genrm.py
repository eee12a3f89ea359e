"""GenRM serving benchmark: requests/s at 1 and 32 in flight, and the model's share.

``bench_genrm()`` builds a tiny text judge, serves it from a child process (so that the
client and the server do not share a GIL, as in a real run: a :class:`JudgePool`) and
sends it the ``yes_prob`` requests of a :class:`GenRMReward` through the
:class:`JudgeClient` a training run uses:

* ``req_per_s_1``: one request in flight (``chat()``, one after another);
* ``req_per_s_32``: 32 in flight (``chat_many``);
* ``client_cpu_ms_1`` / ``client_cpu_ms_32``: CPU of this process per request;
* ``model_only``: the judge's forward on the same requests in this process (the code and
  torch threads the server runs), one at a time (``model_ms_1``) and in batches of 32
  (``model_req_per_s_32``), and ``server_overhead_1 = 1 - model_ms_1 / wall_ms_1``:
  the share of a lone request's time that is not the model (HTTP, JSON, validation,
  batching on both sides);
* ``server_reported_model_ms_1``: the model time the server reports for those requests
  (its own timer around the model call), and ``server_overhead_1_by_server_model`` the
  same share with it: a machine busy with other work slows a process that computes
  without pause (the model alone) more than one that sleeps between requests.

Each figure keeps its best round (``runs`` holds every round's): these machines are
shared, and the model alone is measured in every round between the server's turns so
that other work hits both alike. The side-by-side with an earlier revision of the code
is a second checkout's ``mmyatt bench genrm`` run in alternating rounds.
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

from mmyatt.models.builtin.tiny import build_tiny_text_model
from mmyatt.models.judge import TextJudge
from mmyatt.rewards.genrm import GenRMReward
from mmyatt.serving.client import JudgeClient
from mmyatt.serving.pool import JudgePool

CORPUS = [
    "Question: what is 12 plus 34? Answer: 46. Is the answer correct? Yes",
    "Question: what is 7 times 8? Answer: 54. Is the answer correct? No",
    "Does this image show a red square? Answer Yes or No.",
] * 40


def request_bodies(n: int) -> list[dict]:
    """``n`` chat-completion bodies of a ``yes_prob`` GenRMReward, without ``model``
    (the client asks the server's ``/v1/models`` for the served name)."""
    outputs = [f"{(i * 37) % 200}" for i in range(n)]
    records = [{"prompt": f"what is {i % 50} plus {(i * 7) % 50}?"} for i in range(n)]
    reward = GenRMReward("http://127.0.0.1:9", template="yes_no_correct", model="judge")
    return [{k: v for k, v in b.items() if k != "model"} for b in reward.requests(outputs, records)]


def requests_per_s(url: str, bodies: list[dict], in_flight: int) -> tuple[float, float, list]:
    """(req/s, client CPU ms per request, the server-reported model ms of each answer) of
    ``bodies`` sent with ``in_flight`` requests at once, after a warm-up."""
    with JudgeClient([url], max_in_flight=in_flight, timeout_s=120) as client:
        client.chat_many(bodies[: min(len(bodies), in_flight, 8)])  # connections, model name
        cpu0, t0 = time.process_time(), time.perf_counter()
        if in_flight == 1:
            answers = [client.chat(b) for b in bodies]
        else:
            answers = client.chat_many(bodies)
        elapsed = time.perf_counter() - t0
        cpu_ms = (time.process_time() - cpu0) / len(bodies) * 1000.0
    return len(bodies) / elapsed, cpu_ms, [a["mmyatt"]["model_time_ms"] for a in answers]


class ModelOnly:
    """The judge's forward on the same requests in this process, one at a time and in
    batches of 32 (best round of each)."""

    def __init__(self, model_dir: Path, bodies_1: list[dict], bodies_32: list[dict]):
        self.judge = TextJudge.load(model_dir)
        self.one = [b["messages"] for b in bodies_1]
        self.many = [b["messages"] for b in bodies_32]
        self.k = int(bodies_1[0]["top_logprobs"])
        self.judge.next_token_logprobs(self.one[:4], self.k)  # warm-up
        self.ms_1 = self.s_per_req_32 = float("inf")

    def round(self) -> None:
        t0 = time.perf_counter()
        for messages in self.one:
            self.judge.next_token_logprobs([messages], self.k)
        self.ms_1 = min(self.ms_1, (time.perf_counter() - t0) / len(self.one) * 1000.0)
        t0 = time.perf_counter()
        for i in range(0, len(self.many), 32):
            self.judge.next_token_logprobs(self.many[i : i + 32], self.k)
        self.s_per_req_32 = min(self.s_per_req_32, (time.perf_counter() - t0) / len(self.many))


def bench_genrm(quick: bool = False) -> dict:
    """Measure the judge server and client (see the module docstring)."""
    n1, n32 = (20, 64) if quick else (200, 512)
    rounds = 1 if quick else 5
    threads = 1 if (os.cpu_count() or 1) <= 4 else 4  # 2 threads on 2 shared cores: slower
    torch.set_num_threads(threads)
    bodies = request_bodies(max(n1, n32))
    result: dict = {
        "benchmark": "genrm",
        "workload": {
            "judge": "qwen2-1m",
            "requests_1": n1,
            "requests_32": n32,
            "rounds": rounds,
            "server_threads": threads,
            "request": "yes_prob: max_tokens=1, logprobs, top_logprobs=20 (GenRMReward)",
        },
        # other work on the cores (1, 5, 15-minute load averages) before and after
        "load_average_at_start": [round(x, 2) for x in os.getloadavg()],
    }
    runs = []
    with tempfile.TemporaryDirectory(prefix="mmyatt-genrm-bench-") as tmp:
        model_dir = build_tiny_text_model(Path(tmp) / "judge", size="qwen2-1m", corpus=CORPUS)
        model = ModelOnly(model_dir, bodies[:n1], bodies[:n32])
        with JudgePool(model_dir, n=1, max_batch=32, batch_wait_ms=5, threads=threads) as pool:
            (url,) = pool.urls
            for _ in range(rounds):
                model.round()
                r1, cpu1, model_ms = requests_per_s(url, bodies[:n1], 1)
                r32, cpu32, _ = requests_per_s(url, bodies[:n32], 32)
                runs.append(
                    {
                        "req_per_s_1": r1,
                        "req_per_s_32": r32,
                        "client_cpu_ms_1": cpu1,
                        "client_cpu_ms_32": cpu32,
                        "server_reported_model_ms_1": statistics.median(model_ms),
                    }
                )
            stats = pool.stats()[0]
    best_1 = max(runs, key=lambda r: r["req_per_s_1"])
    wall_ms = 1000.0 / best_1["req_per_s_1"]
    result["new"] = {
        "req_per_s_1": best_1["req_per_s_1"],
        "req_per_s_32": max(r["req_per_s_32"] for r in runs),
        "wall_ms_1": wall_ms,
        "server_overhead_1": 1.0 - model.ms_1 / wall_ms,
        "server_reported_model_ms_1": best_1["server_reported_model_ms_1"],
        "server_overhead_1_by_server_model": 1.0 - best_1["server_reported_model_ms_1"] / wall_ms,
        "client_cpu_ms_1": statistics.median(r["client_cpu_ms_1"] for r in runs),
        "client_cpu_ms_32": statistics.median(r["client_cpu_ms_32"] for r in runs),
        "runs": runs,
    }
    result["model_only"] = {"model_ms_1": model.ms_1, "model_req_per_s_32": 1 / model.s_per_req_32}
    keys = ("requests", "batches", "max_batch_seen", "waited_batches", "cpu_s")
    result["new_server"] = {k: stats.get(k) for k in keys}
    result["load_average_at_end"] = [round(x, 2) for x in os.getloadavg()]
    return result
