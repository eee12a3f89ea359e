"""One arm of the GenRM serving bench: the requests, their timing, and a serving loop that
an earlier checkout can run too.

``python PATH/genrm_arm.py`` (run as a file, with a checkout's root first on
``PYTHONPATH``) builds a tiny judge with that checkout's code, serves it from that
checkout's judge pool and, for each line ``round`` on stdin, prints one JSON line: the
requests/s of that checkout's judge client at 1 and at 32 in flight
(:func:`requests_per_s`). :func:`mmyatt.bench.genrm.side_by_side` drives two of them in
alternating rounds. Revisions before ``mmyatt/serving/`` kept the judge in
``mmyatt.rewards.judge_*`` and the tiny models in ``mmyatt.models.tiny``; both layouts
are found here.
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path

import torch

from mmyatt.rewards.genrm import GenRMReward

try:
    from mmyatt.models.builtin.tiny import build_tiny_text_model
    from mmyatt.serving.client import JudgeClient
    from mmyatt.serving.pool import JudgePool
except ImportError:  # a revision before mmyatt/serving/
    from mmyatt.models.tiny import build_tiny_text_model
    from mmyatt.rewards.judge_client import JudgeClient
    from mmyatt.rewards.judge_pool import JudgePool

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
    ``bodies`` sent with ``in_flight`` requests at once (``chat()`` one after another, or
    ``chat_many``), after a warm-up."""
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


def serve_rounds(n1: int, n32: int, threads: int) -> None:
    """The arm's loop (see the module docstring)."""
    torch.set_num_threads(threads)
    bodies = request_bodies(max(n1, n32))
    with tempfile.TemporaryDirectory(prefix="mmyatt-genrm-arm-") as tmp:
        model_dir = build_tiny_text_model(Path(tmp) / "judge", size="qwen2-1m", corpus=CORPUS)
        with JudgePool(model_dir, n=1, max_batch=32, batch_wait_ms=5, threads=threads) as pool:
            # where the client's code came from: the driver checks it is the arm's checkout
            source = sys.modules[JudgeClient.__module__].__file__
            print(json.dumps({"ready": True, "client_file": source}), flush=True)
            for line in sys.stdin:
                if line.strip() != "round":
                    break
                r1, cpu1, _ = requests_per_s(pool.urls[0], bodies[:n1], 1)
                r32, cpu32, _ = requests_per_s(pool.urls[0], bodies[:n32], 32)
                row = {"req_per_s_1": r1, "req_per_s_32": r32}
                print(json.dumps({**row, "client_cpu_ms_1": cpu1, "client_cpu_ms_32": cpu32}))
                sys.stdout.flush()


if __name__ == "__main__":
    serve_rounds(*(int(x) for x in sys.argv[1:4]))
