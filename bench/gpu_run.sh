#!/usr/bin/env bash
# Every GPU figure in one prepared run on one H100 or H200 with 16 CPU cores, inside
# TIME_LIMIT_S (default 530 s: the whole run, setup included, in at most 9 minutes); each
# part has its own cap and gets at most what the limit leaves:
#   1. `pytest -m gpu` (tests/test_gpu.py, tests/test_gpu_engines.py; the suite's quick
#      engines bench left out, part 3 runs it);
#   2. `mmyatt bench flow-real`: SD3.5-medium-shaped transformer, 512x512, 10 steps:
#      images/s of mmyatt's sampler against diffusers' StableDiffusion3Pipeline, one
#      Flow-GRPO and one DiffusionNFT update (seconds, MFU), peak memory per phase;
#   3. `mmyatt bench engines`: text rollout and update (Qwen2.5-0.5B shape, 16 prompts x
#      8 samples x 256 tokens), model FLOP/s and MFU per phase, and a Qwen2-VL step; the
#      update in micro-batches of 18,432 tokens (64 sequences: the chunked log-probs
#      leave room), where part 4's default arm keeps the former 4,608 (16 sequences);
#   4. the HF decode paths side by side (`python -m mmyatt.bench.engines --decode`):
#      the default steps, fixed-shape steps over a kept cache (rollout.hf_static_cache) and
#      those compiled as CUDA graphs (rollout.compile_decode), text and VLM, same shapes:
#      rollout tokens/s of each, their ratios, and whether they draw the same samples;
#   5. peak memory of scoring the taken tokens from 16 x 288 x 152 k bf16 logits: the
#      full float32 log-softmax against the chunked one (bench/logprob_memory.py);
#   6. the placement bench on the machine's CPU cores (no GPU visible to it): the
#      judge_heavy and drifting workloads, every mode side by side, 4 controllers, one
#      round, 4 steps per run (5 per drifting segment); what the time limit leaves it.
# Every figure goes into ONE JSON, $OUT/gpu_figures.json (bench_out/ when OUT is unset),
# with the GPU's name, the date and the code revision; each part's own JSON and log stay
# beside it. A part that fails or runs out of time is recorded with its exit status.
# Run from the repository root (wheels of docs/engines.md in .whl/ where needed):
#     bash bench/gpu_run.sh
#     bash bench/gpu_run.sh --dry-run    # or MMYATT_GPU_DRY_RUN=1: the same sequence on
#                                        # the CPU at tiny shapes, in the current Python
set -uo pipefail
DRY=${MMYATT_GPU_DRY_RUN:-0}
[ "${1:-}" = "--dry-run" ] && DRY=1
if [ "$DRY" = 1 ]; then
  OUT=${OUT:-bench_out}
  mkdir -p "$OUT"
  PY=${PYTHON:-python3}
  export MMYATT_FLOW_REAL_SIZE=tiny CUDA_VISIBLE_DEVICES=""
  LIMIT=${TIME_LIMIT_S:-1600}
  # pytest, flow_real, engines, decode, logprob_memory, placement: a slow shared CPU
  CAPS=(300 400 400 400 120 800)
  # tiny shapes: the quick engines benches (the compiled decode arms captured by
  # torch.compile's eager backend: inductor would take minutes on the CPU), small
  # logits, one placement workload with 2 controllers
  ENGINES=(--quick)
  DECODE=(--quick --compile-backend eager)
  LOGPROB=(--rows 2 --tokens 32 --vocab 2000 --dtype float32)
  PLACEMENT=(--workload judge_heavy --rounds 1 --steps 2 --set distributed.nproc=2)
else
  source bench/gpu_env.sh
  PY=python3
  LIMIT=${TIME_LIMIT_S:-530}
  CAPS=(100 140 110 160 20 240)
  ENGINES=(--micro-batch-tokens 18432)
  DECODE=()
  LOGPROB=(--rows 16 --tokens 288 --vocab 151936 --dtype bfloat16)
  PLACEMENT=(--workload judge_heavy --workload drifting --rounds 1 --steps 4
    --set distributed.nproc=4)
fi
export PYTHONUNBUFFERED=1
DEADLINE=$LIMIT  # from the script's start: the setup above counts too
: > "$OUT/gpu_run_parts.tsv"
part() {  # part NAME CAP_S CMD...: run CMD for at most CAP_S s and what the limit leaves
  local name=$1 cap=$2 left=$((DEADLINE - SECONDS)) t0=$SECONDS rc
  shift 2
  if [ "$left" -lt 20 ]; then
    echo "[gpu_run] no time left for $name"
    printf '%s\t%s\t%s\n' "$name" 124 0 >> "$OUT/gpu_run_parts.tsv"
    return
  fi
  [ "$left" -lt "$cap" ] && cap=$left
  echo "[gpu_run] $(date +%T) $name: up to ${cap}s"
  timeout "$cap" "$@" > "$OUT/$name.log" 2>&1
  rc=$?
  printf '%s\t%s\t%s\n' "$name" "$rc" "$((SECONDS - t0))" >> "$OUT/gpu_run_parts.tsv"
  echo "[gpu_run] $name: exit $rc after $((SECONDS - t0))s"
  tail -3 "$OUT/$name.log"
}
part pytest_gpu "${CAPS[0]}" "$PY" -m pytest -q -m gpu -p no:cacheprovider \
  --junitxml="$OUT/pytest_gpu.xml" \
  --deselect tests/test_gpu_engines.py::test_bench_engines_reports_every_figure \
  tests/test_gpu.py tests/test_gpu_engines.py
part flow_real "${CAPS[1]}" "$PY" -m mmyatt bench flow-real --out "$OUT/flow_real.json"
# the module's own entry point: it writes what it has measured after each arm
# (engines.json.partial), should its cap cut it short
part engines "${CAPS[2]}" "$PY" -m mmyatt.bench.engines "${ENGINES[@]}" --out "$OUT/engines.json"
part decode "${CAPS[3]}" "$PY" -m mmyatt.bench.engines --decode "${DECODE[@]}" \
  --out "$OUT/engines_decode.json"
part logprob_memory "${CAPS[4]}" "$PY" bench/logprob_memory.py "${LOGPROB[@]}" \
  --out "$OUT/logprob_memory.json"
# the CPU cores only: no GPU visible to the controllers or the judge server; main()
# directly, not `python -m`, so that the bench module is imported once
part placement "${CAPS[5]}" env CUDA_VISIBLE_DEVICES= "$PY" -c \
  'import logging, sys; from mmyatt.placement.bench import main
logging.basicConfig(level=logging.INFO, format="%(message)s"); sys.exit(main(sys.argv[1:]))' \
  "${PLACEMENT[@]}" --set distributed.device=cpu --out "$OUT/placement_cpu.json"
"$PY" - "$OUT" "$DRY" <<'PY'
"""Merge every part's figures into gpu_figures.json."""
import datetime, json, os, subprocess, sys, xml.etree.ElementTree as ET
from pathlib import Path

out, dry = Path(sys.argv[1]), sys.argv[2] == "1"


def load(name):
    for p in (out / name, out / (name + ".partial")):
        if p.is_file():
            try:
                return json.loads(p.read_text()), p.name
            except ValueError:
                pass
    return None, None


def gpu_name():
    try:
        import torch

        if torch.cuda.is_available():
            return torch.cuda.get_device_name(0)
    except Exception:  # the merge must write what it has
        pass
    return None


def revision():
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


parts = {}
for line in (out / "gpu_run_parts.tsv").read_text().splitlines():
    name, rc, secs = line.split("\t")
    parts[name] = {"exit_status": int(rc), "seconds": int(secs),
                   "timed_out": int(rc) in (124, 137)}
tests = None
if (out / "pytest_gpu.xml").is_file():
    suite = ET.parse(out / "pytest_gpu.xml").getroot()
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    n = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    n["passed"] = n["tests"] - n["failures"] - n["errors"] - n["skipped"]
    n["seconds"] = float(suite.get("time", "nan"))
    failed = [c.get("classname", "") + "::" + c.get("name", "") for c in suite.iter("testcase")
              if c.find("failure") is not None or c.find("error") is not None]
    tests = {**n, "failed": failed}
figures = {
    "gpu": gpu_name(),
    "dry_run": dry,
    "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
    "revision": revision(),
    "cpu_cores": len(os.sched_getaffinity(0)),
    "command": "bash bench/gpu_run.sh" + (" --dry-run" if dry else ""),
    "parts": parts,
    "pytest_gpu": tests,
}
for key, file in (("flow_real", "flow_real.json"), ("engines", "engines.json"),
                  ("decode", "engines_decode.json"), ("logprob_memory", "logprob_memory.json"),
                  ("placement", "placement_cpu.json")):
    data, src = load(file)
    figures[key] = data
    if data is not None:
        parts.setdefault(key, {})["source"] = src
(out / "gpu_figures.json").write_text(
    json.dumps(figures, indent=2, default=str) + "\n"
)
print(f"[gpu_run] figures -> {out / 'gpu_figures.json'}")
if figures["decode"]:
    print("[gpu_run]   decode tokens/s over the default path:",
          figures["decode"].get("rollout_speed_over_default"))
for name, p in parts.items():
    print(f"[gpu_run]   {name}: {p}")
PY
