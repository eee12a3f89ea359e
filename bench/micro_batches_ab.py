"""Micro-batches of a bounded padded width (``algorithm.micro_batch_tokens``) against one
pass per minibatch, on the placement bench's rule-reward workload (qwen2-1m policy, 2
controllers, 8 prompts x 8 samples, geometric completion lengths capped at 48 tokens,
shared mode). The two arms alternate round by round; the training phase
(``placement/train_s``: advantages, log-probs, update) and the step are compared
round by round (paired ratios with a 95% interval), steps after the first. Both arms
train with the backend named last (``replica`` by default; ``fsdp2``: micro-batches of
whole prompt groups).

    .venv/bin/python bench/micro_batches_ab.py 13 6 bench/placement/micro_batches_ab.json   # ~5 min
    .venv/bin/python bench/micro_batches_ab.py 13 6 bench/placement/micro_batches_ab_fsdp2.json fsdp2
"""

import json
import sys
import tempfile
from pathlib import Path

from mmyatt.placement import bench as B
from mmyatt.placement.bench_figures import paired_ratio

ARMS = {"one_pass": 0, "micro": B.MICRO_BATCH_TOKENS}
FIGURES = {
    "train_s": "placement/train_s",
    "update_s": "timing/update_s",
    "step_s": "timing/step_s",
    "micro_batches": "train/micro_batches",
    "response_length_mean": "response_length/mean",
}


def main(steps: int, rounds: int, out_path: str, backend: str = "replica") -> None:
    arms = {a: [f"algorithm.micro_batch_tokens={n}"] for a, n in ARMS.items()}
    with tempfile.TemporaryDirectory(prefix="mmyatt-micro-") as t:
        tmp = Path(t)
        policy, _ = B._models(tmp)
        base = B._base(policy, steps) + [*B.RULE, "placement.mode=shared"]
        base.append(f"train.backend={backend}")
        per = B._arm_rounds(tmp, "micro", base, arms, rounds, FIGURES)
    out = {
        "benchmark": "micro_batches_ab",
        "micro_batch_tokens": B.MICRO_BATCH_TOKENS,
        "train_backend": backend,
        "steps": steps,
        "rounds": rounds,
        "arms": B._arm_means(per, "train_s"),
    }
    for key in ("train_s", "update_s", "step_s"):
        out[f"{key}_micro_over_one_pass"] = paired_ratio(
            [p[key] for p in per["micro"]], [p[key] for p in per["one_pass"]]
        )
    Path(out_path).write_text(json.dumps(out, indent=2) + "\n")
    print(json.dumps({k: v for k, v in out.items() if k.endswith("one_pass")}, indent=1))


if __name__ == "__main__":
    backend = sys.argv[4] if len(sys.argv) > 4 else "replica"
    main(*B.probe_argv(sys.argv[1:4], 13, 4, "bench/placement/micro_batches_ab.json"), backend)
