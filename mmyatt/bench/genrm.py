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
that other work hits both alike.

:func:`side_by_side` (``python -m mmyatt.bench.genrm --baseline DIR --pairs 8 --out F``)
sets this checkout's judge serving beside another checkout's (``DIR``, e.g. ``git
worktree add /tmp/old REV``): the same requests, each arm's own server, pool and client
(:mod:`mmyatt.bench.genrm_arm`, one process per arm, the same Python environment), in
pairs of rounds whose order alternates; the ratio of each pair and their median per
in-flight level, with the load average around each pair.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from mmyatt.bench import genrm_arm
from mmyatt.bench.genrm_arm import CORPUS, request_bodies, requests_per_s
from mmyatt.bench.runs import ROOT, measured_on
from mmyatt.models.builtin.tiny import build_tiny_text_model
from mmyatt.models.judge import TextJudge
from mmyatt.serving.pool import JudgePool


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


_MISSING_HINT = (
    " (the arm runs that checkout's code in this Python environment: install what its"
    " pyproject.toml needs and this one lacks, e.g. pip install 'httpx>=0.27' for a"
    " revision whose judge client was on httpx)"
)


def _arm(root: Path, n1: int, n32: int, threads: int) -> subprocess.Popen:
    """One arm's process (:mod:`mmyatt.bench.genrm_arm` on ``root``'s code), started;
    its error output goes to a temporary file, read back when it fails to start."""
    log = tempfile.TemporaryFile()
    if root != ROOT and not (root / "mmyatt" / "rewards").exists():
        # pyproject maps mmyatt.models / .rewards / .datasets to top-level folders, and
        # the installed package maps them to this checkout's: linked into the other
        # checkout's package so that its own are found first
        for name in ("models", "rewards", "datasets"):
            (root / "mmyatt" / name).symlink_to(Path("..") / name)
    env = dict(os.environ, PYTHONPATH=str(root), OMP_NUM_THREADS=str(threads))
    cmd = [sys.executable, genrm_arm.__file__, str(n1), str(n32), str(threads)]
    proc = subprocess.Popen(
        cmd, cwd=root, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log
    )
    hello = json.loads(proc.stdout.readline() or "{}")
    if not hello.get("ready"):
        proc.kill()
        proc.wait()
        log.seek(0)
        tail = log.read().decode(errors="replace").strip().splitlines()[-1:]
        raise RuntimeError(
            f"the genrm arm on {root} did not start: {tail[0] if tail else 'no error output'}"
            + _MISSING_HINT * any("No module named" in line for line in tail)
        )
    if not Path(hello["client_file"]).resolve().is_relative_to(root.resolve()):
        proc.kill()  # an installed package found first would time this checkout twice
        raise RuntimeError(
            f"the genrm arm on {root} imported its judge client from {hello['client_file']}"
        )
    return proc


def _round(proc: subprocess.Popen) -> dict:
    proc.stdin.write(b"round\n")
    proc.stdin.flush()
    return json.loads(proc.stdout.readline())


def side_by_side(baseline: str | Path, pairs: int = 8, quick: bool = False) -> dict:
    """This checkout's judge serving against ``baseline``'s (see the module docstring)."""
    n1, n32 = (20, 64) if quick else (200, 512)
    threads = 1 if (os.cpu_count() or 1) <= 4 else 4
    roots = {"baseline": Path(baseline).resolve(), "this": ROOT}
    procs: dict[str, subprocess.Popen] = {}
    rows = []
    try:
        for name, root in roots.items():
            procs[name] = _arm(root, n1, n32, threads)
        for p in range(pairs):
            order = ("baseline", "this") if p % 2 == 0 else ("this", "baseline")
            load = [round(x, 2) for x in os.getloadavg()]
            row = {"order": order, "load_average_before": load}
            row |= {name: _round(procs[name]) for name in order}
            row["load_average_after"] = [round(x, 2) for x in os.getloadavg()]
            for n in ("1", "32"):
                key = f"req_per_s_{n}"
                row[f"ratio_{n}"] = row["this"][key] / row["baseline"][key]
            rows.append(row)
    finally:
        for proc in procs.values():
            proc.stdin.close()
            proc.wait(timeout=60)
    out: dict = {"benchmark": "genrm side by side", "requests_1": n1, "requests_32": n32}
    out["server_threads"] = threads
    for n in ("1", "32"):
        out[f"median_ratio_{n}"] = statistics.median(r[f"ratio_{n}"] for r in rows)
        for name in roots:
            figures = [r[name][f"req_per_s_{n}"] for r in rows]
            out[f"{name}_median_req_per_s_{n}"] = statistics.median(figures)
    return {**out, "pairs": rows}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=side_by_side.__doc__)
    parser.add_argument("--baseline", required=True, help="another checkout's root")
    parser.add_argument("--pairs", type=int, default=8)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    result = side_by_side(args.baseline, args.pairs, args.quick)
    result["baseline_revision"] = subprocess.run(
        ["git", "rev-parse", "HEAD"], cwd=args.baseline, capture_output=True, text=True
    ).stdout.strip()
    Path(args.out).write_text(json.dumps({**result, "measured_on": measured_on()}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
