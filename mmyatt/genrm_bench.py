"""GenRM serving benchmark: dynamic batching on vs off, and the client's overhead.

``bench_genrm()`` builds a tiny judge, serves it from a child process (so the client
and the server do not share a GIL, as in a real run), and

* sends M concurrent ``yes_prob`` judgements (a :class:`GenRMReward` over a
  :class:`JudgeClient`) to a server with dynamic batching (``max_batch=32``) and to
  one that runs requests one at a time (``max_batch=1``): ``samples_per_s_batched``,
  ``samples_per_s_unbatched`` and their ratio ``batching_speedup``;
* sends requests one after another to the unbatched server and subtracts the model
  time the server reports for each (``mmyatt.model_time_ms``) from the client's
  round trip: ``client_overhead_ms`` (median; HTTP, JSON, queueing, the client's
  event loop), with the mean and p90 beside it.

Both servers run at once on the same ~0.6 M-parameter judge; rounds alternate
between them so load from other processes hits both alike, and each keeps its best
round. A tiny judge on CPU is, like a real judge on a GPU at small batches, dominated
by per-call costs, which is what dynamic batching removes; a CPU-bound larger model
gains less. ``batched_server`` reports the batch sizes the server actually formed.
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from pathlib import Path

CORPUS = [
    "Question: what is 12 plus 34? Answer: 46. Is the answer correct? Yes",
    "Question: what is 7 times 8? Answer: 54. Is the answer correct? No",
    "Does this image show a red square? Answer Yes or No.",
] * 40


def _records(m: int) -> tuple[list[str], list[dict]]:
    outputs = [f"{(i * 37) % 200}" for i in range(m)]
    records = [{"prompt": f"what is {i % 50} plus {(i * 7) % 50}?"} for i in range(m)]
    return outputs, records


def _round(url: str, m: int) -> float:
    """Samples/s of one round of M concurrent yes_prob judgements (after a warm-up)."""
    from mmyatt.rewards.genrm import GenRMReward
    from mmyatt.rewards.judge_client import JudgeClient

    outputs, records = _records(m)
    with JudgeClient([url], max_in_flight=m, timeout_s=120) as client:
        reward = GenRMReward(client, template="yes_no_correct")
        reward(outputs[:4], records[:4])  # warm-up: connections, first forward
        t0 = time.perf_counter()
        reward(outputs, records)
        return m / (time.perf_counter() - t0)


def _overhead(url: str, n: int) -> dict:
    from mmyatt.rewards.genrm import GenRMReward
    from mmyatt.rewards.judge_client import JudgeClient

    outputs, records = _records(n)
    with JudgeClient([url], max_in_flight=1) as client:
        reward = GenRMReward(client, template="yes_no_correct")
        bodies = reward.requests(outputs, records)
        client.chat(bodies[0])
        overheads, models = [], []
        for body in bodies:
            t0 = time.perf_counter()
            response = client.chat(body)
            rtt_ms = (time.perf_counter() - t0) * 1000.0
            model_ms = float(response["mmyatt"]["model_time_ms"])
            overheads.append(rtt_ms - model_ms)
            models.append(model_ms)
    overheads.sort()
    return {
        "median": statistics.median(overheads),
        "mean": statistics.fmean(overheads),
        "p90": overheads[int(0.9 * (len(overheads) - 1))],
        "model_ms_median": statistics.median(models),
    }


def bench_genrm(quick: bool = False) -> dict:
    """Measure batching speedup and client overhead on a tiny judge; returns a dict."""
    from mmyatt.models.tiny import build_tiny_text_model
    from mmyatt.rewards.judge_pool import JudgePool

    m = 32 if quick else 128
    rounds = 1 if quick else 5
    size = "qwen2-1m"
    # Two torch threads on a shared two-core machine run ~10x slower than one.
    threads = 1 if (os.cpu_count() or 1) <= 4 else 4
    result: dict = {"workload": {"requests": m, "rounds": rounds, "judge": size}}
    with tempfile.TemporaryDirectory(prefix="mmyatt-genrm-bench-") as tmp:
        model_dir = build_tiny_text_model(Path(tmp) / "judge", size=size, corpus=CORPUS)
        with (
            JudgePool(model_dir, n=1, max_batch=32, batch_wait_ms=5, threads=threads) as on,
            JudgePool(model_dir, n=1, max_batch=1, threads=threads) as off,
        ):
            # Alternate the variants so that load from other processes hits both alike;
            # keep each one's best round.
            batched = unbatched = 0.0
            for _ in range(rounds):
                batched = max(batched, _round(on.urls[0], m))
                unbatched = max(unbatched, _round(off.urls[0], m))
            stats = on.stats()[0]
            overhead = _overhead(off.urls[0], 20 if quick else 100)
    result.update(
        batching_speedup=batched / unbatched,
        client_overhead_ms=overhead["median"],
        samples_per_s_batched=batched,
        samples_per_s_unbatched=unbatched,
        client_overhead={k: v for k, v in overhead.items()},
        batched_server={
            "max_batch_seen": stats.get("max_batch_seen"),
            "batches": stats.get("batches"),
            "requests": stats.get("requests"),
            "model_ms_per_sample": 1000.0
            * stats.get("model_time_s", 0.0)
            / max(stats.get("requests", 0), 1),
        },
        server_threads=threads,
    )
    return result


if __name__ == "__main__":
    import json

    print(json.dumps(bench_genrm(), indent=2))
