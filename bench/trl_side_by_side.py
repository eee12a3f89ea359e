"""mmyatt against TRL's GRPOTrainer on the same text GRPO workload, side by side in one run.

Workload (configs/bench_text_grpo.yaml): the tiny random-init ``qwen2-3m`` Qwen2 that
mmyatt builds, 16 plain arithmetic prompts x 8 samples x 16 new tokens per step,
temperature 1, no reference model, lr 1e-4, one optimizer step per batch. Both sides
use the same model directory and the same prompt file. Arms, each on the machine's
2 cores:

* ``trl_2threads``: TRL ``GRPOTrainer`` in its own venv (bench/trl_venv.sh), 2 torch threads;
* ``mmyatt_1x2``: ``mmyatt train`` with 1 controller x 2 threads;
* ``mmyatt_2x1``: ``mmyatt train`` with 2 controllers x 1 thread.

The arms run one after another, ``--rounds`` times in turn, so drift of a shared machine
hits each of them; every arm drops its first (warm-up) step, and ``--warmup-rounds``
whole rounds of every arm run first and are reported apart (``warmup_rounds``), not in
the ratios (the first process of each kind pays for cold file caches). samples/s = completions
trained per second of step time (generation + reward + update). Ratios are mmyatt's
samples/s over TRL's, per round (adjacent runs) and over all rounds.

    bash bench/trl_venv.sh                    # once: /tmp/mmyatt-trl-venv
    .venv/bin/python bench/trl_side_by_side.py --out results/trl/side_by_side.json
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

ROOT = Path(__file__).resolve().parent.parent
CONFIG = ROOT / "configs" / "bench_text_grpo.yaml"
MMYATT_ARMS = (("mmyatt_1x2", 1, 2), ("mmyatt_2x1", 2, 1))


def prepare(tmp: Path) -> tuple[Path, Path]:
    """The bench's tiny model and its arithmetic prompts, made once for both sides."""
    from mmyatt.config.schema import load_config
    from mmyatt.step.prepare import prepare_run
    from mmyatt.step.run import quiet_libraries

    quiet_libraries()
    cfg = prepare_run(load_config(str(CONFIG), []), tmp / "prepared", log=lambda *a, **k: None)
    return Path(cfg.model.path), Path(cfg.data.train)


def run_trl(python: str, model: Path, prompts: Path, steps: int, out: Path) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "2", "TOKENIZERS_PARALLELISM": "false"}
    cmd = [python, str(ROOT / "bench" / "trl_grpo_arm.py"), "--model", str(model)]
    cmd += ["--prompts", str(prompts), "--steps", str(steps), "--threads", "2", "--out", str(out)]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=out.parent)
    if proc.returncode != 0:
        raise RuntimeError(f"TRL arm failed ({' '.join(cmd)}):\n{proc.stderr[-3000:]}")
    res = json.loads(out.read_text())
    secs = res["step_seconds"][1:]  # drop the warm-up step
    samples = res["prompts_per_step"] * res["group_size"]
    return {
        "samples_per_s": samples * len(secs) / sum(secs),
        "step_s": sum(secs) / len(secs),
        "step_seconds": res["step_seconds"],
        "wall_s": time.perf_counter() - t0,
        "versions": {k: res[k] for k in ("trl", "transformers", "torch")},
    }


def run_mmyatt(model: Path, nproc: int, threads: int, steps: int, run_dir: Path) -> dict:
    from mmyatt.bench.runs import merge_profiles as _merge_profiles
    from mmyatt.bench.runs import train_run as _train
    from mmyatt.outputs.metrics import read_metrics

    overrides = [f"model.path={model}", f"distributed.nproc={nproc}"]
    overrides += [f"trainer.threads={threads}", f"trainer.steps={steps}"]
    wall = _train(CONFIG, run_dir, overrides, env={"MMYATT_STEP_PROFILE": "step_profile"})
    rows = [r for r in read_metrics(run_dir) if "timing/step_s" in r][1:]  # drop warm-up
    secs = sum(r["timing/step_s"] for r in rows)
    profiles = [json.loads(f.read_text()) for f in sorted(run_dir.glob("step_profile_rank*.json"))]
    return {
        "samples_per_s": sum(r["rollout/samples"] for r in rows) / secs,
        "step_s": secs / len(rows),
        "step_seconds": [r["timing/step_s"] for r in rows],
        "wall_s": wall,
        "profile": _merge_profiles(profiles),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=str(ROOT / "results" / "trl" / "side_by_side.json"))
    ap.add_argument("--steps", type=int, default=8, help="steps per arm (the first is dropped)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--warmup-rounds", type=int, default=0)
    ap.add_argument("--trl-python", default="/tmp/mmyatt-trl-venv/bin/python")
    a = ap.parse_args()
    if not Path(a.trl_python).exists():
        raise SystemExit(f"no TRL venv at {a.trl_python}: run `bash bench/trl_venv.sh` first")
    from mmyatt.bench.runs import machine as _machine

    out: dict = {
        "benchmark": "trl-side-by-side",
        "workload": "configs/bench_text_grpo.yaml: qwen2-3m (random init), 16 prompts x 8 "
        "samples x 16 new tokens, temperature 1, no reference model, 1 optimizer step/batch",
        "machine": _machine(),
        "steps_per_arm": a.steps,
        "warmup_steps_excluded": 1,
        "rounds": [],
        "warmup_rounds": [],
    }
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        model, prompts = prepare(tmp)
        for i in range(a.warmup_rounds + a.rounds):
            rnd = {
                "trl_2threads": run_trl(a.trl_python, model, prompts, a.steps, tmp / f"trl{i}.json")
            }
            for label, nproc, threads in MMYATT_ARMS:
                rnd[label] = run_mmyatt(model, nproc, threads, a.steps, tmp / f"{label}_{i}")
            for label, _, _ in MMYATT_ARMS:
                rnd[f"ratio_{label}_over_trl"] = (
                    rnd[label]["samples_per_s"] / rnd["trl_2threads"]["samples_per_s"]
                )
            out["warmup_rounds" if i < a.warmup_rounds else "rounds"].append(rnd)
            print(json.dumps({k: v for k, v in rnd.items() if k.startswith("ratio")}), flush=True)
    out["machine"]["load_average_at_end"] = [round(x, 2) for x in os.getloadavg()]
    arms = ["trl_2threads", *(label for label, _, _ in MMYATT_ARMS)]
    for arm in arms:
        vals = [r[arm]["samples_per_s"] for r in out["rounds"]]
        out[f"samples_per_s_{arm}"] = statistics.median(vals)
    for label, _, _ in MMYATT_ARMS:
        per_round = [r[f"ratio_{label}_over_trl"] for r in out["rounds"]]
        out[f"ratio_{label}_over_trl_per_round"] = per_round
        out[f"ratio_{label}_over_trl"] = statistics.median(per_round)
        out[f"model_compute_share_{label}"] = statistics.median(
            r[label]["profile"].get("model_compute_share", float("nan")) for r in out["rounds"]
        )
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(out, indent=2) + "\n")
    print(json.dumps({k: v for k, v in out.items() if not isinstance(v, dict | list)}, indent=2))


if __name__ == "__main__":
    sys.exit(main())
