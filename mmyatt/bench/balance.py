"""`mmyatt bench balance`: ``placement.balance`` on (at the update) and, on the text
workloads, at dispatch (``placement.balance_at=dispatch``: prompt records move before
generation) against off, 2 controllers, three workloads, in paired rounds (the arms of a
round run one after the other, in an order that rotates from round to round, so they
share the machine's load of those minutes):

- text_skewed: rank 0 draws prompts of 20-40 terms, rank 1 prompts of 1-2 terms (the
  placement bench's balance workload): rank 0's update is the slow one, though on this
  small model a call's fixed cost outweighs its 40-80 prompt tokens;
- text_skewed_long: rank 0 draws prompts of 100-200 terms (200-400 tokens), rank 1
  prompts of 1-2: the skew where the update's time goes (its tokens, not its calls);
- vlm_mixed: a tiny Qwen2-VL on a batch of images and clips (8-frame mp4s, about four
  times an image's vision tokens), rank 0 drawing the clips and rank 1 the images;
  the vision tower is frozen in both arms (balancing moves its features);
- text_balanced: prompts of 1-40 terms drawn alike on both ranks, where balancing has
  nothing to gain and its cost (planning every step) is all it adds.

Figures per workload and arm (means over the measured steps, the first step of every
run left out): step seconds, the training phase (``placement/train_s``), the summed wait
of the ranks at the gradient all-reduce (``dist/idle_s``), the share of steps that moved
groups (``balance/applied``) and, with balancing on, the cost model's predicted and
measured seconds of the slowest rank's passes and its relative error (the steps after
its first fit); at dispatch, the records moved per step and the predicted max / mean
rank cost before and after. Ratios of each arm to off are paired round by round
(``paired_ratio``).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import statistics
import tempfile
import time
from pathlib import Path

from mmyatt.bench.registry import write_result
from mmyatt.bench.runs import CONFIGS, machine, train_run
from mmyatt.datasets.synthetic import write_jsonl
from mmyatt.datasets.vision_tasks import write_motion_task, write_shape_task
from mmyatt.models.builtin.tiny import build_tiny_text_model
from mmyatt.outputs.metrics import read_metrics
from mmyatt.placement.bench_arms import CORPUS, RULE, STOP, run_overrides
from mmyatt.placement.bench_figures import paired_ratio

logger = logging.getLogger(__name__)

WORKLOADS = ("text_skewed", "text_skewed_long", "vlm_mixed", "text_balanced")
ARMS = {
    "off": ["placement.balance=false"],
    "on": ["placement.balance=true"],
    "dispatch": ["placement.balance=true", "placement.balance_at=dispatch"],
}
TEXT_ONLY = ("dispatch",)  # balance_at=dispatch moves text records only
FIGURES = {
    "step_s": "timing/step_s",
    "train_s": "placement/train_s",
    "idle_s": "dist/idle_s",
    "idle_s_rank0": "dist/idle_s/rank0",
    "idle_s_rank1": "dist/idle_s/rank1",
    "applied": "balance/applied",
    "plan_s": "timing/balance_plan_s",
    "exchange_s": "balance/exchange_s",
    "work_max_over_mean_before": "placement/balance_before",
    "work_max_over_mean_after": "placement/balance_after",
    "dispatch_moved": "balance/dispatch_moved",
    "dispatch_max_over_mean_before": "balance/dispatch_before",
    "dispatch_max_over_mean_after": "balance/dispatch_after",
}
MODEL = {  # the cost model's figures: steps planned with a fitted model
    "predicted_s": "balance/predicted_s",
    "measured_s": "balance/measured_s",
    "model_error": "balance/model_error",
}


def _mean(vals: list) -> float | None:
    nums = [v for v in vals if isinstance(v, int | float)]
    return statistics.fmean(nums) if nums else None


LONG_TERMS = {"text_skewed": (20, 40), "text_skewed_long": (100, 200)}  # rank 0's prompts


def _text_data(tmp: Path, wl: str) -> Path:
    rng = random.Random(0)
    recs = []
    for i in range(400):
        if wl in LONG_TERMS:  # even records (rank 0) long, odd (rank 1) short
            n = rng.randint(*LONG_TERMS[wl]) if i % 2 == 0 else rng.randint(1, 2)
        else:
            n = rng.randint(1, 40)
        recs.append({"prompt": "+".join(["1"] * n) + "=", "answer": str(n)})
    return write_jsonl(tmp / f"{wl}.jsonl", recs)


def _vlm_data(tmp: Path, n: int) -> Path:
    """Even records (rank 0) a clip, odd ones (rank 1) an image, paths relative to the
    manifest's folder."""
    clips = write_motion_task(tmp / "clips", n_train=n, n_eval=2)["train"]
    images = write_shape_task(tmp / "images", n_train=n, n_eval=2)["train"]
    vids = [json.loads(x) for x in clips.read_text().splitlines() if x.strip()]
    imgs = [json.loads(x) for x in images.read_text().splitlines() if x.strip()]
    recs = []
    for v, im in zip(vids, imgs):
        recs.append({**v, "video": f"clips/{v['video']}"})
        recs.append({**im, "image": f"images/{im['image']}"})
    return write_jsonl(tmp / "vlm_mixed.jsonl", recs)


def _workload(tmp: Path, wl: str, steps: int, policy: Path | None) -> tuple[Path, list[str]]:
    """(config, overrides) of workload ``wl``."""
    common = [
        *run_overrides(steps),
        "data.shuffle=false",
        "data.prompts_per_step=8",
        "data.eval_prompts=2",
        "sampling.group_size=8",
        "placement.mode=shared",
    ]
    if wl == "vlm_mixed":
        data = _vlm_data(tmp, 64)
        over = [f"data.train={data}", f"data.eval={data}", "model.freeze=[model.visual]"]
        return CONFIGS / "vlm_grpo_video_tiny.yaml", common + over + ["model.max_prompt_tokens=256"]
    data = _text_data(tmp, wl)
    over = [
        f"model.path={policy}",
        f"data.train={data}",
        f"data.eval={data}",
        f"model.max_prompt_tokens={480 if wl == 'text_skewed_long' else 128}",
        "sampling.max_new_tokens=48",
        f"sampling.stop={json.dumps(STOP)}",
        *RULE,
    ]
    return CONFIGS / "text_grpo_tiny.yaml", common + over


def _run_figures(run_dir: Path) -> dict:
    rows = [r for r in read_metrics(run_dir) if "timing/step_s" in r][1:]  # warm-up out
    out = {f: _mean([r.get(k) for r in rows]) for f, k in FIGURES.items()}
    fitted = [r for r in rows if "balance/model_error" in r]
    out.update({f: _mean([r.get(k) for r in fitted]) for f, k in MODEL.items()})
    out["steps_measured"] = len(rows)
    out["steps_with_model"] = len(fitted)
    return out


def _arms(tmp: Path, wl: str, steps: int, rounds: int, policy: Path | None) -> dict:
    config, base = _workload(tmp, wl, steps, policy)
    names = [a for a in ARMS if wl.startswith("text") or a not in TEXT_ONLY]
    runs: dict[str, list[dict]] = {a: [] for a in names}
    for k in range(rounds):
        turn = k % len(names)
        for a in names[turn:] + names[:turn]:  # rotating order
            rd = tmp / f"{wl}_{a}_r{k}"
            wall = train_run(config, rd, base + ARMS[a], env={"OMP_NUM_THREADS": "1"})
            rec = {**_run_figures(rd), "wall_s": wall, "load_average": os.getloadavg()[0]}
            runs[a].append(rec)
            logger.info(f"[bench] balance {wl} round {k + 1} {a}: {rec}")
    out: dict = {"rounds": rounds, "steps_per_run": steps}
    for a, per in runs.items():
        out[a] = {f: _mean([p[f] for p in per]) for f in per[0]}
        out[a]["per_round"] = per
    for a in names[1:]:
        for f in ("step_s", "train_s", "idle_s"):
            num, den = [p[f] for p in runs[a]], [p[f] for p in runs["off"]]
            if all(isinstance(v, float) and v > 0 for v in num + den):
                out[f"{f}_{a}_over_off"] = paired_ratio(num, den)
    on = out["on"]
    if isinstance(on.get("model_error"), float):
        out["model_error_on"] = on["model_error"]
    return out


def bench_balance(
    quick: bool = False,
    *,
    workloads: tuple[str, ...] = WORKLOADS,
    rounds: int | None = None,
    steps: int | None = None,
    progress: str | Path | None = None,
) -> dict:
    """Balancing on against off on ``workloads``, ``rounds`` paired rounds of ``steps``
    steps each (decided before the run: 1 round of 4 steps in the quick form, 3 rounds
    of 10 steps otherwise)."""
    steps = steps or (4 if quick else 10)
    rounds = rounds or (1 if quick else 3)
    out: dict = {
        "benchmark": "balance",
        "machine": machine(),
        "cores": sorted(os.sched_getaffinity(0)),
        "controllers": 2,
        "warmup_steps_excluded": 1,
        "policy_text": "qwen2-1m (random init), 8 prompts x 8 samples per step, up to 48 tokens",
        "policy_vlm": "tiny Qwen2-VL (vlm_grpo_video_tiny), 8 prompts x 8 samples, 4 tokens",
        "load_average_at_start": [round(x, 2) for x in os.getloadavg()],
    }
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="mmyatt-balance-") as tmp_s:
        tmp = Path(tmp_s)
        policy = None
        if any(w.startswith("text") for w in workloads):
            policy = build_tiny_text_model(tmp / "policy", size="qwen2-1m", corpus=CORPUS, seed=0)
        for wl in workloads:
            out[wl] = _arms(tmp, wl, steps, rounds, policy)
            if progress is not None:
                Path(progress).write_text(json.dumps(out, indent=2) + "\n")
    out["wall_s"] = time.perf_counter() - t0
    out["load_average_at_end"] = [round(x, 2) for x in os.getloadavg()]
    return out


def main(argv: list[str] | None = None) -> int:
    """``python -m mmyatt.bench.balance --workload text_skewed --out F.json``: some
    workloads at a time, merged into the JSON at ``--out``."""
    ap = argparse.ArgumentParser(prog="python -m mmyatt.bench.balance")
    ap.add_argument("--workload", action="append", choices=WORKLOADS)
    ap.add_argument("--rounds", type=int, default=None)
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    path = Path(args.out)
    previous = json.loads(path.read_text()) if path.exists() else {}
    out = bench_balance(
        workloads=tuple(args.workload or WORKLOADS),
        rounds=args.rounds,
        steps=args.steps,
        progress=str(path) + ".partial",
    )
    write_result({**previous, **out}, path)
    Path(str(path) + ".partial").unlink(missing_ok=True)
    return 0


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO)
    raise SystemExit(main())
