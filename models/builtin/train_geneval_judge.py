"""Train the tiny GenEval's judge: the built-in shape judge, fine-tuned to answer
GenEval's questions about drawn scenes.

The judge of ``configs/flow_grpo_geneval_tiny.yaml`` and ``flow_nft_geneval_tiny.yaml``
(GenRM ``mode: vqa``) is asked two questions per prompt (``datasets/geneval.py``,
``judge_questions``): "How many red circles?" ("0" to "4"), "Is there a red circle?",
"What colour is the circle?", "Is the red circle left of the blue square?". It starts
from ``builtin:shape_judge`` (it reads colour and shape of one object) and is trained by
SFT on ``geneval.judge_records`` only: scenes drawn from training prompts and random
scenes of one to four objects, every answer read from how the scene was drawn. No
scene the judge sees is exactly a held-out prompt of either split; no label comes from a
rule, the checker or a generator's samples. 70% of the images get ``critic.augment_image``
(blur, brightness, noise), as a generator's samples look.

Images are shown at ``--side`` pixels (the image processor upscales the 48x48 scenes; at
84, the default, a scene is a 6x6 grid of vision patches, 9 image tokens), written into the
judge's ``preprocessor_config.json``.

Checkpoint selection: every ``eval_every`` steps, greedy answer accuracy on fresh
training-distribution questions and on questions about scenes of the **validation**
held-out prompts (``geneval.heldout_judge_records``); the best mean is kept. The test
held-out prompts are scored once at the end, as is the reward the judge pays (the
product of P(expected answer) of the two questions) for a drawn scene of the prompt and
for one of another prompt of the same kind.

    python -m mmyatt.models.builtin.train_geneval_judge OUT --minutes 22
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from mmyatt.datasets import geneval as ge
from mmyatt.models.builtin.critic import augment_image
from mmyatt.models.builtin.judge_sft import JudgeSFT
from mmyatt.models.builtin.train_tiny_judge import judge_messages
from mmyatt.models.vlm import VLMPolicy
from mmyatt.rewards.vqa import answer_probability
from mmyatt.step.lr_schedule import cosine_schedule


def _builtin(name: str) -> Path:
    return Path(__file__).resolve().parent / name


def set_image_side(model_dir: str | Path, side: int) -> None:
    """Make the judge's image processor resize every image to ``side`` x ``side``."""
    path = Path(model_dir) / "preprocessor_config.json"
    cfg = json.loads(path.read_text())
    cfg["size"] = {"shortest_edge": side * side, "longest_edge": side * side}
    path.write_text(json.dumps(cfg, indent=2) + "\n")


def answer_accuracy(policy, records: list[dict], batch_size: int = 64) -> dict[str, float]:
    """Greedy first-token accuracy, overall and per ``task``."""

    hits: dict[str, list[bool]] = {}
    for start in range(0, len(records), batch_size):
        chunk = records[start : start + batch_size]
        tops = policy.next_token_logprobs([judge_messages(r) for r in chunk], 1)
        for r, top in zip(chunk, tops):
            hits.setdefault(r["task"], []).append(top[0][0].strip() == r["answer"])
    out = {k: float(np.mean(v)) for k, v in sorted(hits.items())}
    out["all"] = float(np.mean([h for v in hits.values() for h in v]))
    return out


def reward_separation(policy, split: str, *, n: int = 100, seed: int = 0) -> dict[str, float]:
    """What the judge pays (GenRM vqa, product of the two questions) for scenes drawn
    for ``split``'s held-out prompts ("pos") and for the same prompts with a scene of
    another prompt of the same kind ("neg"); "pairs": how often pos > neg."""

    recs = ge.geneval_records(n, seed, heldout=split)
    g = np.random.default_rng([seed, 56])
    pays = {"pos": [], "neg": []}
    for which in ("pos", "neg"):
        rows = []
        for i, r in enumerate(recs):
            shown = r if which == "pos" else recs[(i + 5 * len(ge.KINDS)) % len(recs)]
            image, _ = ge.draw_scene(shown, rng=g)
            rows += [{"image": image, "prompt": r["q1"]}, {"image": image, "prompt": r["q2"]}]
        tops = []
        for s in range(0, len(rows), 64):
            tops += policy.next_token_logprobs([judge_messages(x) for x in rows[s : s + 64]], 20)
        for i, r in enumerate(recs):
            p1 = answer_probability(tops[2 * i], r["a1"])
            p2 = answer_probability(tops[2 * i + 1], r["a2"])
            pays[which].append(p1 * p2)
    pos, neg = np.array(pays["pos"]), np.array(pays["neg"])
    out = {"pos": float(pos.mean()), "neg": float(neg.mean()), "pairs": float((pos > neg).mean())}
    for kind in ge.KINDS:
        idx = [i for i, r in enumerate(recs) if r["kind"] == kind]
        out[f"pos_{kind}"] = float(pos[idx].mean())
        out[f"neg_{kind}"] = float(neg[idx].mean())
    return out


def train_geneval_judge(
    out_dir: str | Path,
    *,
    start: str | Path | None = None,
    minutes: float = 20.0,
    seed: int = 0,
    lr: float = 5e-4,
    batch_size: int = 16,
    steps: int = 1500,
    augment: float = 0.7,
    side: int = 84,
    eval_every: int = 100,
    n_eval: int = 200,
    max_prompt_tokens: int = 64,
    log=print,
) -> dict[str, Any]:
    """Fine-tune ``start`` (default ``builtin:shape_judge``) into ``out_dir``; returns
    {"best", "test", "reward_val", "reward_test", "steps", "seconds"}."""
    torch.manual_seed(seed)
    work = Path(out_dir)
    if work.exists():
        shutil.rmtree(work)
    shutil.copytree(Path(start) if start else _builtin("shape_judge"), work)
    for stale in ("README.md", "training.json"):
        (work / stale).unlink(missing_ok=True)
    set_image_side(work, side)
    policy = VLMPolicy.load(work, max_prompt_tokens=max_prompt_tokens)
    run = JudgeSFT(policy, lr=lr, log=log)
    sched = cosine_schedule(run.opt, steps, warmup=50, floor=0.1)
    sets = {
        "seen": ge.judge_records(n_eval, seed=50_000 + seed),
        "val_heldout": ge.heldout_judge_records(n_eval, seed=52_000 + seed, split="val"),
    }
    run.started = time.perf_counter()  # the clock starts with the first step
    best: dict[str, Any] = {"select": -1.0}
    step = 0
    while step < steps:
        batch = ge.judge_records(batch_size, seed=1_000_000 * (seed + 1) + step)
        rng = np.random.default_rng([seed, step, 17])
        batch = [
            {**r, "image": augment_image(r["image"], rng)} if rng.random() < augment else r
            for r in batch
        ]
        loss = run.step(batch)
        sched.step()
        step += 1
        out_of_time = run.seconds() > 60 * minutes
        if step % eval_every and not out_of_time and step < steps:
            continue
        with run.evaluating():
            m: dict[str, Any] = {k: answer_accuracy(policy, v) for k, v in sets.items()}
        select = (m["seen"]["all"] + m["val_heldout"]["all"]) / 2
        run.record(m, step=step, loss=float(loss.detach()), select=select)
        if m["select"] > best["select"]:
            best = m
            policy.save(str(work))
        if out_of_time:
            break
    final = VLMPolicy.load(work, max_prompt_tokens=max_prompt_tokens)
    with torch.no_grad():
        test_set = ge.heldout_judge_records(n_eval, seed=54_000 + seed, split="test")
        result = {
            "best": best,
            "test": {"test_heldout": answer_accuracy(final, test_set)},
            "reward_val": reward_separation(final, "val", seed=60_000 + seed),
            "reward_test": reward_separation(final, "test", seed=61_000 + seed),
            "steps": step,
            "seconds": round(run.seconds(), 1),
            "side": side,
            "history": run.history,
        }
    log(json.dumps({k: result[k] for k in ("test", "reward_val", "reward_test")}))
    return result


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("out")
    ap.add_argument("--start", default=None, help="judge to start from (builtin shape_judge)")
    ap.add_argument("--minutes", type=float, default=20.0)
    ap.add_argument("--steps", type=int, default=1500)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--lr", type=float, default=5e-4)
    ap.add_argument("--side", type=int, default=84)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--augment", type=float, default=0.7)
    ap.add_argument(
        "--max-prompt-tokens",
        type=int,
        default=64,
        help="training prompt width, image tokens included (raise it with --side)",
    )
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    r = train_geneval_judge(
        a.out,
        start=a.start,
        minutes=a.minutes,
        steps=a.steps,
        seed=a.seed,
        lr=a.lr,
        side=a.side,
        augment=a.augment,
        batch_size=a.batch_size,
        max_prompt_tokens=a.max_prompt_tokens,
    )
    keep = ("best", "test", "reward_val", "reward_test", "steps", "seconds", "side")
    Path(a.out, "training.json").write_text(json.dumps({k: r[k] for k in keep}, indent=1) + "\n")


if __name__ == "__main__":
    main()
