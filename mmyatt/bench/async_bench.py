"""`mmyatt bench async`: rollouts made one step ahead (``trainer.async.mode=one_step_off``)
against the best synchronous placement, side by side on the same machine, 3 seeds per arm.

Cases (each a whole ``mmyatt train`` run per arm and seed, one controller):

* ``genrm_remote``: the image GenRM recipe (``configs/flow_grpo_genrm_tiny.yaml``) with
  its judge across a network: the bench serves the built-in judge itself (a
  :class:`JudgePool` on loopback) behind :class:`DelayProxy`, which holds every judge
  call ``LATENCY_S`` = 300 ms before forwarding it. 300 ms is the round trip of a judge
  call to a hosted API or a vLLM judge in another region: tens of milliseconds of network
  each way plus queueing and a short prefill/decode of one verdict on a shared server
  (hosted chat APIs answer short prompts in ~0.2-1 s). Calls in flight overlap, as
  they would over a real link. Reported: the held-out reward at the end
  (``eval/reward/mean``, mean and spread over the seeds), the wall time of the run,
  and the async arm's time over the sync arm's.
* ``genrm_local``: the same recipe with its judge started by the run (no added latency).
* ``text``: ``configs/text_grpo_tiny.yaml`` (its SFT warm start made once by the bench,
  shared by every run).

The sync arm's placement is the fixed placement (shared, colocate, partial) whose
training steps ran fastest in a probe run of seed 0 with half the steps (a probe taking
more than ``PROBE_LIMIT`` times the fastest one's wall time so far is stopped and is no
candidate); every seed of the sync arm then runs with it. The async arm runs
``placement.mode=shared`` (it overlaps the phases itself). Per run the bench records the wall time (start-up and both
evaluations included), the training time (the sum of the steps' times), the held-out
reward at the start and the end, the CPU of the run's processes as a share of the
machine's cores (``idle_core_share = 1 - cpu / (wall x cores)``; a judge started by the
run counts, the remote case's judge does not, as on another machine), the mean seconds
per phase (``timing/*_s``, the first step left out) and the placement's per-step idle
fractions, as measured.

The full form (``quick=False``) is itself reduced to fit a 2-core machine: 4 prompts x 8
images a step (the recipe trains 120 steps of 12 prompts), ``REMOTE_STEPS`` = 20 steps
with the remote judge and 6 with the local one, 48 held-out prompts, 30 steps of the
text recipe (it trains 1200) from an SFT warm start of at most 800 steps; 3 seeds per
arm. The remote case runs longer because it is the one whose wall time is compared: the
start-up and both evaluations take about 16 s of every run, half of a 6-step run's wall
time and the same in both arms.

The figures are measured on a shared machine: ``load_average`` records the other work
running beside the bench at its start and end.
"""

from __future__ import annotations

import http.client
import json
import logging
import os
import resource
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import urlsplit

from mmyatt.bench.runs import CONFIGS, machine, train_run
from mmyatt.serving.pool import JudgePool
from mmyatt.step.builders import resolve_builtin

log = logging.getLogger(__name__)

LATENCY_S = 0.3  # per judge call (see the module docstring)
SEEDS = (0, 1, 2)
PROBE_LIMIT = 2.0
SYNC_PLACEMENTS = ("shared", "colocate", "partial")
TEXT_STEPS = 30  # a text step takes a second or less: more of them, for the same reason
REMOTE_STEPS = 20  # the remote judge's case (see the module docstring)
FLOW = CONFIGS / "flow_grpo_genrm_tiny.yaml"
TEXT = CONFIGS / "text_grpo_tiny.yaml"


class DelayProxy:
    """An HTTP proxy on loopback that holds each request ``latency_s`` seconds, then
    forwards it to ``target`` (``http://host:port``) and returns the answer; one thread
    per connection, so calls in flight overlap."""

    def __init__(self, target: str, latency_s: float):
        parts = urlsplit(target)
        host, port, delay = parts.hostname, parts.port, latency_s
        self.calls = 0
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def _forward(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", 0) or 0))
                time.sleep(delay)
                proxy.calls += 1
                conn = http.client.HTTPConnection(host, port, timeout=300)
                try:
                    headers = {k: v for k, v in self.headers.items() if k.lower() != "host"}
                    conn.request(self.command, self.path, body=body or None, headers=headers)
                    answer = conn.getresponse()
                    data = answer.read()
                    self.send_response(answer.status)
                    for k, v in answer.getheaders():
                        if k.lower() not in ("content-length", "transfer-encoding", "connection"):
                            self.send_header(k, v)
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                finally:
                    conn.close()

            do_GET = do_POST = _forward

            def log_message(self, *args) -> None:  # quiet
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def last(rows: list[dict], key: str) -> float | None:
    vals = [r[key] for r in rows if key in r]
    return vals[-1] if vals else None


def mean_of(rows: list[dict], prefix: str) -> dict[str, float]:
    """Per key under ``prefix``, its mean over the training steps past the first (warm-up)."""
    steps = [r for r in rows if "timing/step_s" in r][1:]
    keys = sorted({k for r in steps for k in r if k.startswith(prefix)})
    out = {}
    for k in keys:
        vals = [r[k] for r in steps if isinstance(r.get(k), int | float)]
        if vals:
            out[k] = statistics.fmean(vals)
    return out


def limited_run(config: Path, run_dir: Path, overrides: list[str], limit_s: float) -> float:
    """``mmyatt train`` stopped (with every process it started) after ``limit_s``."""
    cmd = [sys.executable, "-m", "mmyatt", "train", str(config), "--run-dir", str(run_dir)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    t0 = time.perf_counter()
    proc = subprocess.Popen(
        [*cmd, *overrides],
        env=env,
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        rc = proc.wait(timeout=limit_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        raise RuntimeError(f"stopped at the probe's time limit, {limit_s:.0f} s") from None
    if rc != 0:
        raise RuntimeError(f"exit status {rc}")
    return time.perf_counter() - t0


def one_run(
    config: Path, run_dir: Path, overrides: list[str], limit_s: float | None = None
) -> dict:
    """One ``mmyatt train`` run and what the bench reads from it; ``limit_s``: a probe's
    time limit."""
    if run_dir.exists():
        shutil.rmtree(run_dir)
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    if limit_s is None:
        wall = train_run(config, run_dir, overrides, env={"OMP_NUM_THREADS": "1"})
    else:
        wall = limited_run(config, run_dir, overrides, limit_s)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "timing/step_s" in r]
    cores = os.cpu_count() or 1
    return {
        "wall_s": wall,
        "train_s": sum(r["timing/step_s"] for r in steps),
        "eval_reward_start": rows[0].get("eval/reward/mean"),
        "eval_reward_end": last(rows, "eval/reward/mean"),
        "cpu_s": cpu,
        "idle_core_share": 1.0 - cpu / (wall * cores),
        "phase_s": mean_of(rows, "timing/"),
        "placement": {
            k: v for k, v in mean_of(rows, "placement/").items() if "idle" in k or "util" in k
        },
        "async": mean_of(rows, "async/"),
    }


def spread(vals: list[float]) -> dict:
    return {"mean": statistics.fmean(vals), "min": min(vals), "max": max(vals), "runs": vals}


def run_case(
    name: str, config: Path, base: list[str], work: Path, seeds, placements, probe_steps: int
) -> dict:
    """The sync arm over ``seeds`` with the fixed placement (of ``placements``) that ran
    fastest in a ``probe_steps``-step run of the first seed, and the one_step_off arm."""
    first = seeds[0]
    probe, failed = {}, {}
    for mode in placements if len(placements) > 1 else ():
        ov = [*base, f"placement.mode={mode}", f"trainer.seed={first}"]
        if len(placements) > 1:
            ov.append(f"trainer.steps={probe_steps}")
        # a placement more than PROBE_LIMIT x slower than the first probe's is not the best
        limit = PROBE_LIMIT * min(p["wall_s"] for p in probe.values()) if probe else None
        try:
            probe[mode] = one_run(config, work / f"{name}_probe_{mode}", ov, limit)
        except RuntimeError as error:  # a placement this case cannot run is not a candidate
            failed[mode] = str(error).splitlines()[-1][-300:]
            log.info("[async bench] %s probe %s failed: %s", name, mode, failed[mode])
            continue
        log.info("[async bench] %s probe %s: %.1f s", name, mode, probe[mode]["train_s"])
    best = min(probe, key=lambda m: probe[m]["train_s"]) if probe else placements[0]
    arms: dict[str, dict[int, dict]] = {"sync": {}, "one_step_off": {}}
    for seed in seeds:
        ov = [*base, f"placement.mode={best}", f"trainer.seed={seed}"]
        arms["sync"][seed] = one_run(config, work / f"{name}_sync_s{seed}", ov)
    for seed in seeds:
        ov = [*base, "placement.mode=shared", "trainer.async.mode=one_step_off"]
        ov.append(f"trainer.seed={seed}")
        arms["one_step_off"][seed] = one_run(config, work / f"{name}_async_s{seed}", ov)
        log.info(
            "[async bench] %s one_step_off seed %d: %.1f s",
            name,
            seed,
            arms["one_step_off"][seed]["wall_s"],
        )
    out: dict = {
        "sync_placement": best,
        "probe_steps": probe_steps if len(placements) > 1 else None,
        "probe_train_s": {m: p["train_s"] for m, p in probe.items()},
        "probe_failed": failed,
    }
    for arm, runs in arms.items():
        out[arm] = {
            "runs": {str(s): r for s, r in runs.items()},
            "wall_s": spread([r["wall_s"] for r in runs.values()]),
            "train_s": spread([r["train_s"] for r in runs.values()]),
            "eval_reward_end": spread([r["eval_reward_end"] for r in runs.values()]),
            "idle_core_share": spread([r["idle_core_share"] for r in runs.values()]),
        }
    out["wall_ratio_async_over_sync"] = (
        out["one_step_off"]["wall_s"]["mean"] / out["sync"]["wall_s"]["mean"]
    )
    out["train_ratio_async_over_sync"] = (
        out["one_step_off"]["train_s"]["mean"] / out["sync"]["train_s"]["mean"]
    )
    return out


def flow_overrides(steps: int, prompts: int, eval_prompts: int) -> list[str]:
    return [
        "distributed.nproc=1",
        f"trainer.steps={steps}",
        f"data.prompts_per_step={prompts}",
        f"data.eval_prompts={eval_prompts}",
        "trainer.eval_every=0",
        "trainer.max_minutes=null",
        "trainer.progress=false",
        "trainer.save_rollouts_every=0",
    ]


def bench_async(
    quick: bool = False,
    seeds=SEEDS,
    steps: int | None = None,
    remote_steps: int | None = None,
    latency_s: float = LATENCY_S,
    cases: tuple[str, ...] = ("genrm_remote", "genrm_local", "text"),
) -> dict:
    """The three cases, each arm over ``seeds``. ``quick``: 2 steps, 1 seed, a few
    prompts (the test suite's form; its figures mean nothing). ``steps``: the local image
    case's steps (6); ``remote_steps``: the remote case's (``REMOTE_STEPS``)."""
    placements = SYNC_PLACEMENTS
    if quick:
        seeds, steps, remote_steps, placements = seeds[:1], 2, 2, ("shared",)
    steps = steps or 6
    remote_steps = remote_steps or REMOTE_STEPS
    prompts, eval_prompts = (2, 8) if quick else (4, 48)
    probe = max(2, steps // 2)
    load0 = [round(x, 2) for x in os.getloadavg()]
    out: dict = {
        "benchmark": "async",
        "machine": machine(),
        "seeds": list(seeds),
        "steps": steps,
        "text_steps": 2 if quick else TEXT_STEPS,
        "prompts_per_step": prompts,
        "eval_prompts": eval_prompts,
        "latency_s": latency_s,
        "cases": {},
    }
    with tempfile.TemporaryDirectory(prefix="mmyatt_async_bench_") as tmp:
        work = Path(tmp)
        base = flow_overrides(steps, prompts, eval_prompts)
        if "genrm_remote" in cases:
            pool = JudgePool(
                resolve_builtin("builtin:tiny_judge"),
                1,
                max_batch=64,
                threads=1,
                log_dir=str(work / "judges"),
            )
            proxy = DelayProxy(pool.urls[0], latency_s)
            try:
                n = remote_steps
                remote = flow_overrides(n, prompts, eval_prompts)
                remote += ["reward.judge.model=null", f"reward.judge.urls=[{proxy.url}]"]
                out["cases"]["genrm_remote"] = run_case(
                    "genrm_remote", FLOW, remote, work, seeds, placements, max(2, n // 2)
                )
                out["cases"]["genrm_remote"]["steps"] = n
                out["cases"]["genrm_remote"]["judge_calls_delayed"] = proxy.calls
            finally:
                proxy.close()
                pool.stop()
        if "genrm_local" in cases:
            out["cases"]["genrm_local"] = run_case(
                "genrm_local", FLOW, base, work, seeds, placements, probe
            )
        if "text" in cases:
            text = text_overrides(work, 2 if quick else TEXT_STEPS, quick)
            out["cases"]["text"] = run_case(
                "text", TEXT, text, work, seeds, placements, TEXT_STEPS // 2
            )
    out["load_average"] = {"start": load0, "end": [round(x, 2) for x in os.getloadavg()]}
    return out


def text_overrides(work: Path, steps: int, quick: bool) -> list[str]:
    """The text recipe on one controller, from an SFT warm start made once here."""
    sft = work / "text_sft"
    size = "qwen2-0.1m" if quick else "qwen2-1m"
    common = ["distributed.nproc=1", f"model.tiny_size={size}", "trainer.progress=false"]
    # the warm start bounded (its stop at 0.3 held-out accuracy usually comes first)
    common += (
        ["sft.max_steps=20", "data.synthetic_train_size=200"] if quick else ["sft.max_steps=800"]
    )
    train_run(
        TEXT, sft, [*common, "trainer.steps=1", "trainer.eval_every=0", "data.eval_prompts=16"]
    )
    warm = sft / "sft_model"
    return [
        *common,
        f"model.path={warm}",
        "sft.enabled=false",
        f"trainer.steps={steps}",
        "trainer.eval_every=0",
        "trainer.max_minutes=null",
        "trainer.save_rollouts_every=0",
        f"data.eval_prompts={16 if quick else 200}",
    ]
