"""Forward + backward of the bench's qwen2-1m text policy over synthetic rollouts (4
prompt groups x 8 samples, geometric completion lengths of mean 13.5 capped at 48), in
one process on one thread, arms in random order per trial, medians over trials after
the first two.

1. ``budgets``: one pass against micro-batches of 256, 512 and 1024 padded tokens, with
   short prompts (4-8 tokens) and with half the groups' prompts 40-90 tokens long. The
   placement bench's micro-batch arms use the budget chosen here (512).
2. ``ranks``: the balance workload's rank shapes, 4 long-prompt groups (40-80 tokens;
   rank 0 before balancing), 4 short (2-4; rank 1) and 2 long + 2 short (either rank
   after balancing by groups), one pass and 512.

    .venv/bin/python bench/micro_batches_probe.py bench/placement/micro_batches_probe.json   # ~2 min
"""

import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from mmyatt.step.batches import token_micro_batches
from mmyatt.models.text import TextPolicy
from mmyatt.placement.bench import _models
from mmyatt.rollout import Rollout

A, G, P = 48, 8, 96  # completion cap, group size, prompt columns
rng = random.Random(0)


def rollout(prompt_lengths: list[tuple[int, int]], vocab: int) -> Rollout:
    """One group per (shortest, longest) prompt length range."""
    n = G * len(prompt_lengths)
    ids = torch.randint(3, vocab, (n, P + A))
    attn = torch.zeros(n, P + A, dtype=torch.long)
    mask = torch.zeros(n, A)
    pids = []
    for g, (lo, hi) in enumerate(prompt_lengths):
        p = rng.randint(lo, hi)
        for k in range(G):
            i, a = g * G + k, 1
            while a < A and rng.random() > 1 / 13.5:
                a += 1
            attn[i, P - p : P + a] = 1
            mask[i, :a] = 1
            pids.append(f"p{g}")
        ids[g * G : (g + 1) * G, :P] = ids[g * G, :P]
    ctx = {"input_ids": ids, "attention_mask": attn, "temperature": 1.0}
    return Rollout(pids, ids[:, P:].clone(), torch.zeros(n, A), mask, ctx, [""] * n, [{}] * n)


def timed(policy: TextPolicy, r: Rollout, budget: int) -> float:
    t = time.perf_counter()
    for rows in token_micro_batches(r, budget):
        lp, ent = policy.logprobs(r.select(rows), with_entropy=True)
        (lp.sum() + ent.sum()).backward()
    return time.perf_counter() - t


def medians(policy, shapes: dict, budgets: tuple, trials: int = 14) -> dict:
    vocab = policy.model.config.vocab_size
    times: dict[str, list[float]] = {}
    for trial in range(trials):
        arms = [(s, b) for s in shapes for b in budgets]
        rng.shuffle(arms)
        made = {s: rollout(shapes[s], vocab) for s in shapes}
        for s, b in arms:
            t = timed(policy, made[s], b)
            if trial >= 2:
                times.setdefault(f"{s}_{b}", []).append(t)
    return {k: statistics.median(v) for k, v in sorted(times.items())}


def main(out_path: str) -> None:
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(prefix="mmyatt-micro-probe-") as t:
        policy = TextPolicy.load(_models(Path(t))[0])
        short, long = (4, 8), (40, 90)
        budgets = medians(
            policy, {"short": [short] * 4, "long_half": [long, short] * 2}, (0, 256, 512, 1024)
        )
        L, S = (40, 80), (2, 4)
        ranks = medians(policy, {"LLLL": [L] * 4, "SSSS": [S] * 4, "LLSS": [L, L, S, S]}, (0, 512))
    out = {"budgets_s": budgets, "ranks_s": ranks}
    Path(out_path).write_text(json.dumps(out, indent=2) + "\n")
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "bench/placement/micro_batches_probe.json")
