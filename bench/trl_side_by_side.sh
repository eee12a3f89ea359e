#!/usr/bin/env bash
# TRL GRPOTrainer vs mmyatt on the text GRPO bench workload, side by side in one run:
# makes TRL's throwaway venv (bench/trl_venv.sh, under the pip lock), then runs
# bench/trl_side_by_side.py under the heavy-job lock. Extra arguments go to the script.
#   bash bench/trl_side_by_side.sh --out bench/trl/side_by_side.json
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${TRL_VENV:-/tmp/mmyatt-trl-venv}"
flock /tmp/mmyatt-pip.lock bash bench/trl_venv.sh "$VENV" >/dev/null
exec flock /tmp/mmyatt-heavy.lock .venv/bin/python bench/trl_side_by_side.py --trl-python "$VENV/bin/python" "$@"
