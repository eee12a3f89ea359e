"""Micro-batches of a bounded padded width (``algorithm.micro_batch_tokens``) against one
pass per minibatch, on the placement bench's rule-reward workload (qwen2-1m policy, 2
controllers, 8 prompts x 8 samples, geometric completion lengths capped at 48 tokens,
shared mode). The two arms alternate round by round; the training phase
(``placement/train_s``: advantages, log-probs, update) and the step are compared
round by round (paired ratios with a 95% interval), steps after the first.

    .venv/bin/python bench/micro_batches_ab.py 13 4 bench/placement/micro_batches_ab.json   # ~5 min
"""

import json
import sys
import tempfile
from pathlib import Path

from mmyatt.placement import bench as B
from mmyatt.placement.bench_figures import _mean, paired_ratio

ARMS = {"one_pass": 0, "micro": B.MICRO_BATCH_TOKENS}


def main(steps: int, rounds: int, out_path: str) -> None:
    per: dict[str, list[dict]] = {k: [] for k in ARMS}
    with tempfile.TemporaryDirectory(prefix="mmyatt-micro-") as t:
        tmp = Path(t)
        policy, _ = B._models(tmp)
        base = B._base(policy, steps) + [*B.RULE, "placement.mode=shared"]
        for k in range(rounds):
            for arm in list(ARMS) if k % 2 == 0 else list(ARMS)[::-1]:
                rd = tmp / f"{arm}_{k}"
                B._train(rd, base + [f"algorithm.micro_batch_tokens={ARMS[arm]}"])
                rows = B._rows(rd, first=2)
                per[arm].append(
                    {
                        "steps_measured": len(rows),
                        "train_s": _mean([r.get("placement/train_s") for r in rows]),
                        "update_s": _mean([r.get("timing/update_s") for r in rows]),
                        "step_s": _mean([r.get("timing/step_s") for r in rows]),
                        "micro_batches": _mean([r.get("train/micro_batches") for r in rows]),
                        "response_length_mean": _mean(
                            [r.get("response_length/mean") for r in rows]
                        ),
                    }
                )
                print(f"[micro] round {k} {arm}: {per[arm][-1]}", flush=True)
    out = {
        "benchmark": "micro_batches_ab",
        "micro_batch_tokens": B.MICRO_BATCH_TOKENS,
        "steps": steps,
        "rounds": rounds,
        "arms": {a: {k: _mean([p[k] for p in v]) for k in v[0]} for a, v in per.items()},
    }
    for key in ("train_s", "update_s", "step_s"):
        out[f"{key}_micro_over_one_pass"] = paired_ratio(
            [p[key] for p in per["micro"]], [p[key] for p in per["one_pass"]]
        )
    Path(out_path).write_text(json.dumps(out, indent=2) + "\n")
    print(json.dumps({k: v for k, v in out.items() if k.endswith("one_pass")}, indent=1))


if __name__ == "__main__":
    steps = int(sys.argv[1]) if len(sys.argv) > 1 else 13
    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 4
    main(
        steps, rounds, sys.argv[3] if len(sys.argv) > 3 else "bench/placement/micro_batches_ab.json"
    )
