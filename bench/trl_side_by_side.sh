#!/usr/bin/env bash
# TRL GRPOTrainer vs mmyatt on the text GRPO bench workload, side by side in one run:
# makes TRL's throwaway venv (bench/trl_venv.sh), then runs bench/trl_side_by_side.py.
# Extra arguments go to the script. Run it with nothing else on the cores.
#   bash bench/trl_side_by_side.sh --rounds 3 --warmup-rounds 1 --out results/trl/side_by_side.json
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${TRL_VENV:-/tmp/mmyatt-trl-venv}"
bash bench/trl_venv.sh "$VENV" >/dev/null
exec .venv/bin/python bench/trl_side_by_side.py --trl-python "$VENV/bin/python" "$@"
