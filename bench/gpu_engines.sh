#!/usr/bin/env bash
# The engine checks on a GPU machine (one H200): `pytest -m gpu` on the engines,
# `mmyatt bench engines` (Qwen2.5-0.5B config, random weights; a 2B-shaped Qwen2-VL step
# with images) and its decode arms (the default HF decode, fixed-shape, compiled as CUDA
# graphs: `python -m mmyatt.bench.engines --decode`). About 9-12 minutes; run from the
# repository root:
#     bash bench/gpu_engines.sh            # results in $OUT, or bench_out/ when OUT is unset
# Where the machine has torch, transformers, peft, accelerate but not megatron-core,
# diffusers or vllm, put their wheels in .whl/ (docs/engines.md says how); without vllm the
# vLLM arms are reported as skipped, with the reason.
set -uo pipefail
source bench/gpu_env.sh
timeout 240 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_gpu_engines.py \
  2>&1 | tee "$OUT/pytest_gpu_engines.log" | tail -15
timeout 300 python3 -m mmyatt bench engines --out "$OUT/engines.json" \
  2>&1 | tee "$OUT/bench_engines.log" | tail -5
timeout 300 python3 -m mmyatt.bench.engines --decode --out "$OUT/engines_decode.json" \
  2>&1 | tee "$OUT/bench_decode.log" | tail -5
python3 - "$OUT/engines.json" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
for name, a in {**r["arms"], "vlm_fsdp2": r.get("vlm_fsdp2", {})}.items():
    print(name, {k: round(v, 4) if isinstance(v, float) else v for k, v in a.items() if k != "overrides"})
print("skipped:", r["skipped"])
PY
python3 - "$OUT/engines_decode.json" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
for name, a in {**r["arms"], **r.get("vlm_arms", {})}.items():
    print(name, round(a["rollout_tokens_per_s"], 1), "tokens/s", a.get("same_samples_as_default"))
print("over the default path:", r.get("rollout_speed_over_default"), "skipped:", r["skipped"])
PY
