"""`mmyatt bench NAME --out F.json`: measured figures and the ratios that matter.

These machines are noisy, so every benchmark runs its variants side by side in one
invocation and reports ratios next to the raw figures.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from mmyatt.outputs.metrics import read_metrics
from mmyatt.step.profile import MODEL_KINDS

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


# every benchmark, in the order `mmyatt bench all` runs them; bench NAME writes
# bench/<NAME with _ for ->.json
BENCHES = (
    "text-grpo",
    "flow-grpo",
    "checkpoint",
    "faults",
    "genrm",
    "data-sharding",
    "engines",
    "placement",
    "placement-sim",  # after placement: it is validated against placement.json
)


def bench_file(name: str) -> str:
    """The committed JSON file of benchmark ``name``: ``data-sharding`` -> ``data_sharding.json``."""
    return name.replace("-", "_") + ".json"


def write_result(result: dict, out: str | Path) -> Path:
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    return out


def run_all(out_dir: str | Path, quick: bool = False, names=BENCHES) -> dict[str, Path]:
    """Run every benchmark one after another and write each one's JSON into ``out_dir``
    as soon as it is measured (``bench/text_grpo.json``, ...). Returns {name: file}."""
    written = {}
    for name in names:
        t0 = time.perf_counter()
        print(f"[bench] {name} ...", flush=True)
        result = run_bench(name, quick=quick)
        written[name] = write_result(result, Path(out_dir) / bench_file(name))
        print(f"[bench] {name}: {time.perf_counter() - t0:.0f} s -> {written[name]}", flush=True)
    return written


def run_bench(name: str, quick: bool = False) -> dict:
    if name == "text-grpo":
        return bench_text_grpo(quick)
    if name == "checkpoint":
        from mmyatt.bench.checkpoint import bench_checkpoint

        return bench_checkpoint(quick)
    if name == "genrm":
        from mmyatt.bench.genrm import bench_genrm

        return bench_genrm(quick)
    if name == "data-sharding":
        from mmyatt.bench.data import bench_data_sharding

        return bench_data_sharding(quick)
    if name == "flow-grpo":
        from mmyatt.bench.flow import bench_flow_grpo

        return bench_flow_grpo(quick)
    if name == "engines":  # rollout and update engines
        from mmyatt.bench.engines import bench_engines

        return bench_engines(quick)
    if name == "faults":
        from mmyatt.bench.faults import bench_faults

        return bench_faults(quick)
    if name == "placement":
        from mmyatt.placement.bench import bench_placement

        return bench_placement(quick)
    if name == "placement-sim":
        from mmyatt.placement.simulate import bench_placement_sim

        return bench_placement_sim(quick)
    raise ValueError(f"unknown benchmark {name!r}")


def _machine() -> dict:
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpus": os.cpu_count(),
        "platform": platform.platform(),
        # other work on the cores while the bench ran (1, 5, 15-minute load averages)
        "load_average_at_start": [round(x, 2) for x in os.getloadavg()],
    }


def _train(config: Path, run_dir: Path, overrides: list[str], env: dict | None = None) -> float:
    t0 = time.perf_counter()
    cmd = [
        sys.executable,
        "-m",
        "mmyatt",
        "train",
        str(config),
        "--run-dir",
        str(run_dir),
        *overrides,
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, **(env or {})})
    if proc.returncode != 0:
        raise RuntimeError(
            f"benchmark run failed ({' '.join(cmd)}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
        )
    return time.perf_counter() - t0


# (label, controllers, torch threads per controller): 1 core, and 2 cores used by threads
# or by controllers
TEXT_GRPO_ARMS = (("1proc", 1, 1), ("1proc_2threads", 1, 2), ("2proc", 2, 1))


def bench_text_grpo(quick: bool) -> dict:
    """The same GRPO workload (B=16 prompts x G=8 samples, 16 new tokens, tiny Qwen2) on
    1 controller x 1 thread, 1 controller x 2 threads (``trainer.threads=2``) and 2
    controllers x 1 thread each: the 2-core arms differ only in how the cores are used."""
    steps = 3 if quick else 8
    out: dict = {
        "benchmark": "text-grpo",
        "machine": _machine(),
        "steps": steps,
        "warmup_steps_excluded": 1,
        "arms": {label: {"controllers": p, "threads": th} for label, p, th in TEXT_GRPO_ARMS},
    }
    with tempfile.TemporaryDirectory() as tmp:
        for label, p, threads in TEXT_GRPO_ARMS:
            rd = Path(tmp) / label
            wall = _train(
                CONFIGS / "bench_text_grpo.yaml",
                rd,
                [
                    f"distributed.nproc={p}",
                    f"trainer.threads={threads}",
                    f"trainer.steps={steps}",
                ],
                env={"MMYATT_STEP_PROFILE": "step_profile"},
            )
            rows = [r for r in read_metrics(rd) if "timing/step_s" in r][1:]  # drop warm-up step
            secs = sum(r["timing/step_s"] for r in rows)
            samples = sum(r["rollout/samples"] for r in rows)
            tokens = sum(r["rollout/tokens"] for r in rows)
            phases = sorted(
                {
                    k[7:-6]
                    for r in rows
                    for k in r
                    if k.startswith("timing/") and k.endswith("_share")
                }
            )
            last = read_metrics(rd)[-1]
            rss = [v for k, v in sorted(last.items()) if k.startswith("memory/peak_rss_mb_rank")]
            out[f"samples_per_s_{label}"] = samples / secs
            out[f"tokens_per_s_{label}"] = tokens / secs
            out[f"step_s_{label}"] = secs / len(rows)
            out[f"phase_share_{label}"] = {
                ph: sum(r.get(f"timing/{ph}_share", 0) for r in rows) / len(rows) for ph in phases
            }
            out[f"peak_rss_mb_{label}"] = rss
            out[f"profile_{label}"] = _merge_profiles(
                [json.loads(f.read_text()) for f in sorted(rd.glob("step_profile_rank*.json"))]
            )
            out[f"wall_s_{label}"] = wall
    out["load_average_at_end"] = [round(x, 2) for x in os.getloadavg()]
    out["peak_rss_mb_per_controller"] = out["peak_rss_mb_2proc"]
    one = out["samples_per_s_1proc"]
    out["speedup_2proc_over_1proc"] = out["samples_per_s_2proc"] / one
    out["speedup_1proc_2threads_over_1proc"] = out["samples_per_s_1proc_2threads"] / one
    out["speedup_2proc_over_1proc_2threads"] = (
        out["samples_per_s_2proc"] / out["samples_per_s_1proc_2threads"]
    )
    return out


def _merge_profiles(ranks: list[dict]) -> dict:
    """The step profile of an arm (``mmyatt.step.profile``): every controller's mean
    seconds per step by kind (warm-up step dropped), averaged over controllers, with
    shares of the step and the model-compute share (forward + backward + optimizer +
    sampling kernels); "other" is Python and glue outside every timed call."""
    sums = [r["summary"] for r in ranks if r.get("summary")]
    if not sums:
        return {}
    kinds = list(dict.fromkeys(k for s in sums for k in s["seconds"]))
    seconds = {k: sum(s["seconds"].get(k, 0.0) for s in sums) / len(sums) for k in kinds}
    step = sum(s["step_s"] for s in sums) / len(sums)
    share = {k: v / step for k, v in seconds.items()}
    return {
        "controllers": len(sums),
        "steps_profiled": sums[0]["steps_profiled"],
        "step_s": step,
        "seconds": seconds,
        "share": share,
        "model_compute_share": sum(share.get(k, 0.0) for k in MODEL_KINDS),
        "model_compute_share_per_controller": [s["model_compute_share"] for s in sums],
    }
