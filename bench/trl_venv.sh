#!/usr/bin/env bash
# A throwaway virtual environment with TRL for bench/trl_side_by_side.py; TRL is not a
# dependency of mmyatt. torch is installed first (the CPU 2.13.0 build pip takes from
# local disk here) and pinned while trl, transformers, accelerate and datasets install,
# so nothing pulls a CUDA build.
# Usage: bash bench/trl_venv.sh [DIR]   (default /tmp/mmyatt-trl-venv)
set -euo pipefail
DIR="${1:-/tmp/mmyatt-trl-venv}"
PY="${PY:-python3.11}"
if [ -x "$DIR/bin/python" ] && "$DIR/bin/python" -c "import trl, torch" 2>/dev/null; then
  echo "$DIR"
  exit 0
fi
"$PY" -m venv "$DIR" || python3 -m venv "$DIR"
"$DIR/bin/pip" install -q --upgrade pip
"$DIR/bin/pip" install -q torch==2.13.0
PIN="$(mktemp)"
echo "torch==2.13.0" > "$PIN"
"$DIR/bin/pip" install -q -c "$PIN" "trl==${TRL_VERSION:-1.16.*}" transformers accelerate datasets
rm -f "$PIN"
"$DIR/bin/python" -c "import trl, torch, transformers; print('trl', trl.__version__, 'torch', torch.__version__, 'transformers', transformers.__version__)" >&2
echo "$DIR"
