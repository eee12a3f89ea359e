"""The text adapter with the CPU attention of models/cpu_kernels.py off and on, in one process.

Same tiny model weights and workload as ``mmyatt bench text-grpo`` (16 prompts x 8
samples x 16 new tokens, temperature 1): per step and arm, generate under no_grad, then
log-probs with entropy, a policy-gradient loss, backward and an AdamW step. Arms:

* ``off``: ``TextPolicy.cpu_kernels = False`` (the model's own ``sdpa`` attention), what
  the adapter did before;
* ``on``: grouped-query attention in the prefill and in scoring (the default).

Each arm has its own copy of the weights and optimizer, all from the same start; the arms
alternate step by step (order reversed every other step), medians over the steps after the
first. Also reported: whether every arm sampled the same tokens as ``off`` at every step
and the largest difference of the recorded log-probs (the weights drift apart by rounding
only).

    flock /tmp/mmyatt-heavy.lock .venv/bin/python bench/cpu_kernels_ab.py --threads 1 \\
        --out bench/trl/cpu_kernels_ab_1thread.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ARMS = ("off", "on")
PARTS = ("generate_s", "forward_s", "backward_s", "optimizer_s")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--steps", type=int, default=9)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    import torch

    torch.set_num_threads(a.threads)
    from mmyatt.config.schema import load_config
    from mmyatt.protocols import Sampling
    from mmyatt.models.text import TextPolicy
    from mmyatt.step.run import prepare_run, quiet_libraries

    quiet_libraries()
    with tempfile.TemporaryDirectory() as tmp:
        cfg = load_config(str(ROOT / "configs" / "bench_text_grpo.yaml"), [])
        cfg = prepare_run(cfg, Path(tmp) / "prepared", log=lambda *x, **k: None)
        recs = [json.loads(x) for x in Path(cfg.data.train).read_text().splitlines() if x]
        pols = {arm: TextPolicy.load(cfg.model.path, max_prompt_tokens=8) for arm in ARMS}
        pols["off"].cpu_kernels = False
        opts = {arm: torch.optim.AdamW(p.model.parameters(), lr=1e-4) for arm, p in pols.items()}
        s = Sampling(temperature=1.0, max_new_tokens=16)
        times: dict[str, list] = {arm: [] for arm in ARMS}
        same = dict.fromkeys(ARMS, True)
        lp_diff = dict.fromkeys(ARMS, 0.0)
        for i in range(a.steps):
            batch = [dict(r, _index=16 * i + j) for j, r in enumerate(recs[16 * i : 16 * i + 16])]
            seeds = list(range(16 * i, 16 * i + 16))
            rollouts = {}
            for arm in ARMS if i % 2 else ARMS[::-1]:
                p = pols[arm]
                t0 = time.perf_counter()
                with torch.no_grad():
                    r = p.generate(batch, 8, s, seeds)
                t1 = time.perf_counter()
                lp, ent = p.logprobs(r, with_entropy=True)
                adv = torch.randn(len(r), generator=torch.Generator().manual_seed(i))[:, None]
                loss = -(lp * adv * r.mask).sum() / r.mask.sum() - 1e-3 * (ent * r.mask).sum()
                t2 = time.perf_counter()
                opts[arm].zero_grad()
                loss.backward()
                t3 = time.perf_counter()
                opts[arm].step()
                t4 = time.perf_counter()
                times[arm].append((t1 - t0, t2 - t1, t3 - t2, t4 - t3))
                rollouts[arm] = r
            for arm in ARMS:
                same[arm] &= bool(torch.equal(rollouts[arm].actions, rollouts["off"].actions))
                d = (rollouts[arm].logprobs - rollouts["off"].logprobs).abs().max()
                lp_diff[arm] = max(lp_diff[arm], float(d))
    out: dict = {
        "workload": "configs/bench_text_grpo.yaml: 16 prompts x 8 samples x 16 new tokens",
        "threads": a.threads,
        "steps_excluding_first": a.steps - 1,
        "load_average_at_end": [round(x, 2) for x in os.getloadavg()],
    }
    for arm in ARMS:
        med = {k: statistics.median(x[j] for x in times[arm][1:]) for j, k in enumerate(PARTS)}
        med["step_s"] = sum(med.values())
        med["samples_per_s"] = 128 / med["step_s"]
        med["same_tokens_as_off"] = same[arm]
        med["max_abs_logprob_diff_vs_off"] = lp_diff[arm]
        out[arm] = med
    for arm in ARMS[1:]:
        out[f"speedup_{arm}"] = {
            k[:-2]: out["off"][k] / out[arm][k] for k in (*PARTS, "step_s") if out[arm][k] > 0
        }
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(out, indent=2) + "\n")
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    sys.exit(main())
