#!/usr/bin/env bash
# Every GPU check in one prepared run on a GPU machine (one H200), inside a time limit
# (TIME_LIMIT_S, default 540 s; each part is capped and skipped when too little is left):
#   1. `pytest -m gpu`: the adapters' contract suites, training runs and the judge's
#      release on the device, and the engines (FSDP2, megatron-core, vLLM if carried);
#   2. `python -m mmyatt.placement.bench` on the device: colocate (and colocate with the
#      policy offloaded, placement.offload_policy) against partial and partial with the
#      judge released for training (placement.partial_release_judge) with a
#      25 M judge (peak device memory per phase; 4 arms x 2 policies, ~40 s each), then the judge-heavy workload in every
#      mode (one controller on cuda:0, the judge server on the same GPU; SKIP_JUDGE_HEAVY=1
#      leaves it out);
#   3. `mmyatt bench engines` with what time is left.
# Run from the repository root, with the wheels of docs/engines.md in .whl/:
#     bash bench/gpu_checks.sh        # results in $OUT, or bench_out/ when OUT is unset
set -uo pipefail
source bench/gpu_env.sh
DEADLINE=$((SECONDS + ${TIME_LIMIT_S:-540}))
within() {  # within CAP_S CMD...: run CMD for at most CAP_S s and what the time limit leaves
  local cap=$1 left=$((DEADLINE - SECONDS))
  shift
  if [ "$left" -lt 30 ]; then echo "[gpu_checks] no time left for: $*"; return 124; fi
  [ "$left" -lt "$cap" ] && cap=$left
  echo "[gpu_checks] $(date +%T) up to ${cap}s: $*"
  timeout "$cap" "$@"
}
GPU=(--set distributed.nproc=1 --set distributed.device=cuda)
# the suite's quick engines bench is left out: step 3 runs the full one
within 150 python3 -m pytest -q -m gpu -p no:cacheprovider --durations=8 \
  --deselect tests/test_gpu_engines.py::test_bench_engines_reports_every_figure \
  tests/test_gpu.py tests/test_gpu_engines.py 2>&1 | tee "$OUT/pytest_gpu.log" | tail -25
within 340 python3 -m mmyatt.placement.bench --workload judge_memory --rounds 1 --steps 4 \
  "${GPU[@]}" --out "$OUT/placement_gpu_memory.json" 2>&1 | grep -v "shards" | tee "$OUT/placement_gpu_memory.log" | grep "\[bench\]"
if [ -z "${SKIP_JUDGE_HEAVY:-}" ]; then  # measured 2026-12-04: results/gpu_h200/placement_judge_heavy.json
  within 230 python3 -m mmyatt.placement.bench --workload judge_heavy --rounds 2 --steps 6 \
    "${GPU[@]}" --out "$OUT/placement_gpu.json" 2>&1 | grep -v "shards" | tee "$OUT/placement_gpu.log" | grep "\[bench\]"
fi
within 400 python3 -m mmyatt bench engines --out "$OUT/engines.json" \
  2>&1 | tee "$OUT/bench_engines.log" | tail -5
ls -la "$OUT"
