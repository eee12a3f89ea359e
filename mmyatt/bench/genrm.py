"""GenRM serving benchmark: req/s at 1 and 32 in flight, and the model's share of it.

``bench_genrm()`` builds a tiny text judge, serves it from a child process (so the
client and the server do not share a GIL, as in a real run) and sends it the
``yes_prob`` requests of a :class:`GenRMReward` through the :class:`JudgeClient` a
training run uses:

* ``req_per_s_1``: one request in flight (sent one after another);
* ``req_per_s_32``: 32 in flight;
* ``model_ms_1``: the judge's forward on the same requests, one at a time, in this
  process (the same code and torch threads as the server: chat template, tokenizer,
  forward, top-k and token strings; no HTTP, no queue), and
  ``server_overhead_1 = 1 - model_ms_1 / wall_ms_1`` with ``wall_ms_1 = 1000 /
  req_per_s_1``: the share of a lone request's time that is not the model (the
  client's and server's HTTP, JSON, validation, queue and thread hops);
* arm ``new_loop_client``: the ``new`` server, with ``chat()`` sent through the client's
  event loop (an async-only transport) instead of blocking sockets;
  ``ratio_blocking_chat_req_per_s_{1,32}`` compares ``new`` with it (at 32 in flight
  both use the loop: ``chat_many``);
* arms ``new`` (the judge server as it runs by default and as a training run's judge
  pool starts it: no keep-warm window) and ``new_keep_warm`` (``--keep-warm-ms``
  ``judge_server.BENCH_KEEP_WARM_MS``: after each answer the event loop polls before it
  sleeps, so a lone client's next request may find a warm core);
  ``ratio_keep_warm_req_per_s_{1,32}`` compares them, and ``new_keep_warm_server``
  reports the CPU seconds both servers used;
* ``server_overhead_1_paired`` (arms ``new`` and ``baseline``): the same share with each request timed
  both ways one right after the other, the forward alone in this process and then the
  request to the server, over the ``requests_1`` requests of a round; the round of
  median overhead is reported with its ``model_ms_1_paired`` and ``wall_ms_1_paired``,
  and every round's figure in ``server_overhead_1_paired_rounds``. The best-round
  figures compare a model time and a wall time measured up to minutes apart, and the
  speed of these machines drifts over minutes (the model alone: 3.0-4.4 ms a request
  across runs of one day); paired, a drift hits both sides alike. The forward alone is
  then not in a tight loop, so it meets the caches the client's work left, as the
  server's forward meets those its idle wait left;
* ``client_cpu_ms_1``: CPU of this process per request at 1 in flight (median over
  rounds);
* ``model_req_per_s_32``: the forward alone on the same requests in batches of 32;
* ``server_overhead_1_by_server_model``: the same share with the model time the server
  itself reports for each answer (its timer around the same model call), median over
  the best round at 1 in flight: on a loaded machine a process that computes without
  pause (the model alone) is slowed more than one that sleeps between requests (the
  server), so the two figures can differ there.

The model alone is measured in every round, between the servers' turns, so that load
from other processes hits it and the servers alike; each figure keeps its best round.
The arms' order rotates from round to round, so that no arm always runs first (two arms
on the same server and path differed by 7-28% at 32 in flight with a fixed order).

``baseline=PATH`` also serves the judge with another server implementation (a
``judge_server.py`` file run as a script, e.g. an earlier commit's, taken with
``git show REV:rewards/judge_server.py``) side by side, on the same judge, with the
same client and requests; with ``baseline_client`` (a ``judge_client.py``) that
server is also driven by its own client. ``mmyatt bench genrm`` takes both from
:data:`BASELINE_REV` (the server and client before the move to FastAPI) when this is
a git checkout: arms ``new`` (this server, this client), ``baseline`` (that server,
this client) and ``baseline_with_its_client`` (the previous pair, end to end).
``python -m mmyatt.bench.genrm --baseline-rev REV --out FILE`` picks another revision.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# the judge server and client before the move to FastAPI + uvicorn (commit 412a52b)
BASELINE_REV = "412a52b~1"

CORPUS = [
    "Question: what is 12 plus 34? Answer: 46. Is the answer correct? Yes",
    "Question: what is 7 times 8? Answer: 54. Is the answer correct? No",
    "Does this image show a red square? Answer Yes or No.",
] * 40


def _bodies(n: int) -> list[dict]:
    from mmyatt.rewards.genrm import GenRMReward

    outputs = [f"{(i * 37) % 200}" for i in range(n)]
    records = [{"prompt": f"what is {i % 50} plus {(i * 7) % 50}?"} for i in range(n)]
    reward = GenRMReward("http://127.0.0.1:9", template="yes_no_correct", model="judge")
    return reward.requests(outputs, records)


def _strip_model(bodies: list[dict]) -> list[dict]:
    return [{k: v for k, v in b.items() if k != "model"} for b in bodies]


def _load_client(path: Path | None):
    """The JudgeClient class of a judge_client.py file (an earlier revision's), or ours."""
    if path is None:
        from mmyatt.rewards.judge_client import JudgeClient

        return JudgeClient
    import importlib.util

    spec = importlib.util.spec_from_file_location("baseline_judge_client", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look themselves up there
    spec.loader.exec_module(module)
    return module.JudgeClient


def _loop_client(urls, **kwargs):
    """Our client with an async-only transport: ``chat()`` then runs the client's event
    loop (as before :class:`~mmyatt.rewards.judge_http.BlockingTransport`)."""
    from mmyatt.rewards.judge_client import JudgeClient
    from mmyatt.rewards.judge_http import PooledTransport

    return JudgeClient(urls, transport=PooledTransport(), **kwargs)


def _req_per_s(
    url: str, bodies: list[dict], in_flight: int, client_cls=None
) -> tuple[float, list[float], float]:
    """(req/s, server-reported model ms per response, client CPU ms per request) of one
    round (after a warm-up)."""
    client_cls = client_cls or _load_client(None)
    with client_cls([url], max_in_flight=in_flight, timeout_s=120) as client:
        if in_flight == 1:
            for b in bodies[:8]:  # the connection, the first calls
                client.chat(b)
        else:
            client.chat_many(bodies[: min(len(bodies), in_flight, 8)])
        cpu0, t0 = time.process_time(), time.perf_counter()
        if in_flight == 1:
            responses = [client.chat(b) for b in bodies]
        else:
            responses = client.chat_many(bodies)
        elapsed = time.perf_counter() - t0
        cpu_ms = (time.process_time() - cpu0) / len(bodies) * 1000.0
    models = [float(r.get("mmyatt", {}).get("model_time_ms", "nan")) for r in responses]
    return len(bodies) / elapsed, models, cpu_ms


def _cpu_ms_per_request(before: dict, after: dict) -> float:
    """A server's CPU ms per request served between two of its /stats answers."""
    served = max(after["requests"] - before["requests"], 1)
    return 1000.0 * (after["cpu_s"] - before["cpu_s"]) / served


def _paired_overhead(url: str, bodies: list[dict], model: _ModelOnly) -> tuple[float, ...]:
    """(overhead, model ms, wall ms): 1 - (model alone) / (a lone request's wall time),
    and the two means per request, each request of ``bodies`` timed
    both ways one after the other: the forward in this process, then the request to the
    server. Drift in the machine's speed (other work, a core's clock) hits both alike,
    which the best-round figures, taken minutes apart, cannot promise."""
    from mmyatt.rewards.judge_client import JudgeClient

    judge, k = model.judge, model.k
    alone = wall = 0.0
    with JudgeClient([url], max_in_flight=1, timeout_s=120) as client:
        for b in bodies[:8]:
            client.chat(b)
        for b in bodies:
            t0 = time.perf_counter()
            judge.next_token_logprobs([b["messages"]], k)
            t1 = time.perf_counter()
            client.chat(b)
            t2 = time.perf_counter()
            alone, wall = alone + (t1 - t0), wall + (t2 - t1)
    return 1.0 - alone / wall, alone / len(bodies) * 1000.0, wall / len(bodies) * 1000.0


class _ModelOnly:
    """The judge's forward on the same requests, one at a time and in batches of 32,
    in this process (the server's code, one torch thread pool of the same size)."""

    def __init__(self, model_dir: Path, bodies_1: list[dict], bodies_32: list[dict], threads):
        import torch

        from mmyatt.models.judge import TextJudge

        torch.set_num_threads(threads)
        self.judge = TextJudge.load(model_dir)
        self.one = [b["messages"] for b in bodies_1]
        self.many = [b["messages"] for b in bodies_32]
        self.k = int(bodies_1[0].get("top_logprobs") or 1)
        self.judge.next_token_logprobs(self.one[:4], self.k)  # warm-up
        self.ms_1 = self.s_per_req_32 = float("inf")

    def round(self) -> None:
        judge, k = self.judge, self.k
        t0 = time.perf_counter()
        for m in self.one:
            judge.next_token_logprobs([m], k)
        self.ms_1 = min(self.ms_1, (time.perf_counter() - t0) / len(self.one) * 1000.0)
        t0 = time.perf_counter()
        for i in range(0, len(self.many), 32):
            judge.next_token_logprobs(self.many[i : i + 32], k)
        self.s_per_req_32 = min(self.s_per_req_32, (time.perf_counter() - t0) / len(self.many))

    def result(self) -> dict:
        return {"model_ms_1": self.ms_1, "model_req_per_s_32": 1.0 / self.s_per_req_32}


def _start_script(script: Path, model_dir: Path, tmp: Path, threads: int) -> tuple:
    """Serve ``model_dir`` with the server in ``script`` (run as a file): (process, url)."""
    port_file = tmp / f"{script.stem}.port"
    log = open(tmp / f"{script.stem}.log", "w")
    cmd = [sys.executable, str(script), str(model_dir), "--host", "127.0.0.1", "--port", "0"]
    cmd += ["--max-batch", "32", "--batch-wait-ms", "5", "--threads", str(threads)]
    cmd += ["--port-file", str(port_file)]
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    deadline = time.monotonic() + 120
    while not port_file.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"the baseline server {script} did not start; see {log.name}")
        time.sleep(0.05)
    return proc, f"http://127.0.0.1:{int(port_file.read_text())}"


def baseline_files(rev: str, out_dir: Path) -> tuple[Path, Path]:
    """(judge_server.py, judge_client.py) of git revision ``rev`` of this repository,
    written into ``out_dir``; RuntimeError when this is not a git checkout or ``rev``
    does not exist."""
    root = Path(__file__).resolve().parents[2]
    files = []
    for name in ("judge_server", "judge_client"):
        try:
            source = subprocess.run(
                ["git", "show", f"{rev}:rewards/{name}.py"],
                cwd=root,
                check=True,
                capture_output=True,
                text=True,
            ).stdout
        except (OSError, subprocess.CalledProcessError) as error:
            why = getattr(error, "stderr", "") or error
            raise RuntimeError(f"no rewards/{name}.py at git revision {rev!r}: {why}") from None
        path = out_dir / f"baseline_{name}.py"
        path.write_text(source)
        files.append(path)
    return files[0], files[1]


def bench_genrm(
    quick: bool = False,
    baseline: str | Path | None = None,
    baseline_client: str | Path | None = None,
    baseline_rev: str | None = BASELINE_REV,
) -> dict:
    """Measure the judge server and the model alone (and ``baseline``, a
    judge_server.py, beside them; with ``baseline_client``, a judge_client.py, also that
    client against that server). Without ``baseline``, both are taken from git revision
    ``baseline_rev`` when this is a git checkout (None: no baseline)."""
    with tempfile.TemporaryDirectory(prefix="mmyatt-genrm-baseline-") as tmp:
        note = None
        if baseline is None and baseline_rev:
            try:
                baseline, baseline_client = baseline_files(baseline_rev, Path(tmp))
            except RuntimeError as error:
                note = f"no baseline: {error}"
                baseline_rev = None
        else:
            baseline_rev = None
        result = _bench(quick, baseline, baseline_client)
    if baseline_rev:
        result["baseline_rev"] = baseline_rev
    if note:
        result["baseline_note"] = note
    return result


def _bench(quick: bool, baseline, baseline_client) -> dict:
    from mmyatt.models.builtin.tiny import build_tiny_text_model
    from mmyatt.rewards.judge_pool import JudgePool
    from mmyatt.rewards.judge_server import BENCH_KEEP_WARM_MS

    n1, n32 = (20, 64) if quick else (200, 512)
    rounds = 1 if quick else 5
    size = "qwen2-1m"
    threads = 1 if (os.cpu_count() or 1) <= 4 else 4  # 2 threads on 2 shared cores: slower
    bodies = _bodies(max(n1, n32))
    result: dict = {
        "workload": {
            "judge": size,
            "requests_1": n1,
            "requests_32": n32,
            "rounds": rounds,
            "server_threads": threads,
            "request": "yes_prob: max_tokens=1, logprobs, top_logprobs=20 (GenRMReward)",
        },
        # other work on the cores (1, 5, 15-minute load averages) before and after
        "load_average_at_start": [round(x, 2) for x in os.getloadavg()],
    }
    with tempfile.TemporaryDirectory(prefix="mmyatt-genrm-bench-") as tmp:
        model_dir = build_tiny_text_model(Path(tmp) / "judge", size=size, corpus=CORPUS)
        bodies = _strip_model(bodies)  # the client asks /v1/models for the served name
        model = _ModelOnly(model_dir, bodies[:n1], bodies[:n32], threads)
        servers: dict[str, str] = {}
        procs = []
        common = dict(n=1, max_batch=32, batch_wait_ms=5, threads=threads)
        with (
            JudgePool(model_dir, keep_warm_ms=0, **common) as pool,
            JudgePool(model_dir, keep_warm_ms=BENCH_KEEP_WARM_MS, **common) as warm_pool,
        ):
            servers["new"] = pool.urls[0]
            servers["new_keep_warm"] = warm_pool.urls[0]
            loop_arm = ("new_loop_client", servers["new"], _loop_client)
            try:
                if baseline is not None:
                    proc, url = _start_script(Path(baseline), model_dir, Path(tmp), threads)
                    procs.append(proc)
                    servers["baseline"] = url
                arms = [(name, url, None) for name, url in servers.items()]
                arms.insert(1, loop_arm)
                if baseline is not None and baseline_client is not None:
                    old_client = _load_client(Path(baseline_client))
                    arms.append(("baseline_with_its_client", servers["baseline"], old_client))
                # arm ``new``, and the baseline server (a yardstick check: its thread
                # hops and batch waits must show)
                paired: dict[str, list[tuple[float, ...]]] = {
                    n: [] for n in ("new", "baseline") if n in servers
                }
                best = {
                    name: {
                        "1": 0.0,
                        "32": 0.0,
                        "model_ms": [],
                        "same_round": 0.0,
                        "client_cpu_ms": [],
                    }
                    for name, _, _ in arms
                }
                start = pool.stats()[0], warm_pool.stats()[0]  # CPU: of the rounds only
                for r in range(rounds):
                    model.round()
                    for name, taken in paired.items():
                        taken.append(_paired_overhead(servers[name], bodies[:n1], model))
                    # the arms' order rotates from round to round: each gets every place
                    for name, url, client_cls in arms[r % len(arms) :] + arms[: r % len(arms)]:
                        r1, ms1, cpu1 = _req_per_s(url, bodies[:n1], 1, client_cls)
                        r32, _, _ = _req_per_s(url, bodies[:n32], 32, client_cls)
                        b = best[name]
                        b["client_cpu_ms"].append(cpu1)
                        if r1 > b["1"]:  # the server's own model time in the best round
                            b["same_round"] = statistics.median(ms1)
                        b["1"], b["32"] = max(b["1"], r1), max(b["32"], r32)
                        b["model_ms"] += ms1
                stats = pool.stats()[0]
                warm_stats = warm_pool.stats()[0]
            finally:
                for proc in procs:
                    proc.terminate()
                    proc.wait(timeout=30)
    model_only = model.result()
    for name, b in best.items():
        wall_ms = 1000.0 / b["1"]
        result[name] = {
            "req_per_s_1": b["1"],
            "req_per_s_32": b["32"],
            "wall_ms_1": wall_ms,
            "server_overhead_1": 1.0 - model_only["model_ms_1"] / wall_ms,
            "server_reported_model_ms_1": statistics.median(b["model_ms"]),
            # the same share with the model time the server measured around its model
            # call for these very requests (median of the best round): immune to the
            # benchmark process and the server being slowed differently by other work
            "server_overhead_1_by_server_model": 1.0 - b["same_round"] / wall_ms,
            # CPU of the client's process per lone request (median over rounds)
            "client_cpu_ms_1": statistics.median(b["client_cpu_ms"]),
        }
    # the round of median overhead: its overhead and the model's and the wall's ms
    for name, taken in paired.items():
        overhead, model_ms, wall_ms = sorted(taken)[len(taken) // 2]
        result[name]["server_overhead_1_paired"] = overhead
        result[name]["model_ms_1_paired"] = model_ms
        result[name]["wall_ms_1_paired"] = wall_ms
        result[name]["server_overhead_1_paired_rounds"] = [p[0] for p in taken]
    result["model_only"] = model_only
    keys = ("requests", "batches", "max_batch_seen", "waited_batches")
    result["new_server_batches"] = {k: stats.get(k) for k in keys}
    result["new_keep_warm_server"] = {
        **{k: warm_stats.get(k) for k in keys},
        "keep_warm_ms": warm_stats.get("keep_warm_ms"),
        "keep_warm_polls": warm_stats.get("keep_warm_polls"),
        "cpu_s": warm_stats.get("cpu_s"),
        # per request served: the server without the window serves two arms
        "cpu_ms_per_request": _cpu_ms_per_request(start[1], warm_stats),
        "cpu_ms_per_request_without_keep_warm": _cpu_ms_per_request(start[0], stats),
    }
    new = result["new"]
    for arm, key in (("baseline", "ratio"), ("baseline_with_its_client", "ratio_pair")):
        if arm in result:  # this server (and client) over the baseline's
            for n in ("1", "32"):
                result[f"{key}_req_per_s_{n}"] = (
                    new[f"req_per_s_{n}"] / result[arm][f"req_per_s_{n}"]
                )
    for n in ("1", "32"):  # chat() on blocking sockets over chat() through the event loop
        result[f"ratio_blocking_chat_req_per_s_{n}"] = (
            new[f"req_per_s_{n}"] / result["new_loop_client"][f"req_per_s_{n}"]
        )
    for n in ("1", "32"):  # the keep-warm window over none
        result[f"ratio_keep_warm_req_per_s_{n}"] = (
            result["new_keep_warm"][f"req_per_s_{n}"] / new[f"req_per_s_{n}"]
        )
    result["load_average_at_end"] = [round(x, 2) for x in os.getloadavg()]
    return result


def main(argv: list[str] | None = None) -> int:
    import argparse
    import json

    p = argparse.ArgumentParser(prog="python -m mmyatt.bench.genrm", description=__doc__)
    p.add_argument("--out", required=True, help="JSON file for the figures")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--baseline", default=None, help="a judge_server.py to serve beside")
    p.add_argument(
        "--baseline-rev",
        default=BASELINE_REV,
        help="git revision to take the baseline server and client from ('' for none)",
    )
    args = p.parse_args(argv)
    result = bench_genrm(args.quick, args.baseline, None, args.baseline_rev or None)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
