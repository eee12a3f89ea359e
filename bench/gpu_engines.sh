#!/usr/bin/env bash
# The engine checks for a lent GPU (one H200): `pytest -m gpu` on the engines and
# `mmyatt bench engines` (Qwen2.5-0.5B config, random weights; a 2B-shaped Qwen2-VL step
# with images). About 6-9 minutes; run from the repository root:
#     bash bench/gpu_engines.sh            # results in $OUT (device tool) or bench_out/
# The device image has torch, transformers, peft, accelerate but not megatron-core,
# diffusers or vllm: carry wheels in .whl/ (docs/engines.md says how); without vllm the
# vLLM arms are reported as skipped, with the reason.
set -uo pipefail
OUT=${OUT:-bench_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site
fi
# mmyatt itself (models/, rewards/, datasets/ import as mmyatt.*): an editable install, or,
# where the image's setuptools cannot build it, the same layout from links on PYTHONPATH
if ! python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . \
    > "$OUT/install.log" 2>&1; then
  echo "editable install failed (see install.log); using a linked source tree"
  rm -rf /tmp/mmsrc && mkdir -p /tmp/mmsrc/mmyatt && cp -r mmyatt/. /tmp/mmsrc/mmyatt/
  for d in models rewards datasets; do ln -s "$PWD/$d" "/tmp/mmsrc/mmyatt/$d"; done
  export PYTHONPATH=/tmp/mmsrc${PYTHONPATH:+:$PYTHONPATH}
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
timeout 240 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_gpu_engines.py \
  2>&1 | tee "$OUT/pytest_gpu_engines.log" | tail -15
timeout 300 python3 -m mmyatt bench engines --out "$OUT/engines.json" \
  2>&1 | tee "$OUT/bench_engines.log" | tail -5
python3 - "$OUT/engines.json" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
for name, a in {**r["arms"], "vlm_fsdp2": r.get("vlm_fsdp2", {})}.items():
    print(name, {k: round(v, 4) if isinstance(v, float) else v for k, v in a.items() if k != "overrides"})
print("skipped:", r["skipped"])
PY
