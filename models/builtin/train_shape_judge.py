"""Train the flow demo's built-in judge so that it reads colour and shape apart.

A tiny Qwen2-VL (:func:`mmyatt.models.builtin.tiny_vlm.build_tiny_vlm`) is fine-tuned by SFT on
three kinds of records (``mmyatt.datasets``):

* the task's records of trained combinations (``vision_tasks``: colour / shape questions,
  "Does this image show a {colour} {shape}?", one-attribute checks);
* factored records (``factored_shapes``): task shapes in off-palette colours with shape
  questions, extra shapes in palette colours with colour questions, and judge questions
  about both answered No;
* nothing else: no record shows or asks about a combination in ``exclude``, and no label
  comes from a rule or from a generator's samples.

Two stages: colour and shape questions (task + factored) until both are read on the
trained combinations, then the judge mix. The checkpoint is chosen on the **validation**
held-out combinations (``shapes.HELDOUT_VAL``: shown to no training record); the test
combinations (``shapes.HELDOUT_TEST``) are scored once at the end.

    python -m mmyatt.models.builtin.train_shape_judge OUT [--minutes 25]
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from mmyatt.datasets import vision_tasks as vt
from mmyatt.datasets.factored_shapes import (
    corpus,
    factored_records,
    heldout_classification_records,
    named_records,
)
from mmyatt.datasets.shapes import HELDOUT, HELDOUT_TEST, HELDOUT_VAL
from mmyatt.models.builtin import train_tiny_judge as jt
from mmyatt.models.builtin.critic import augment_image
from mmyatt.models.builtin.judge_sft import JudgeSFT
from mmyatt.models.builtin.tiny_vlm import build_tiny_vlm
from mmyatt.models.builtin.train_tiny_judge import judge_corpus
from mmyatt.models.vlm import VLMPolicy
from mmyatt.step.lr_schedule import cosine_schedule


def judge_mix(
    n: int, *, seed: int, factored_fraction: float, exclude, sizes, named_fraction: float = 0.0
) -> list[dict]:

    n_fac = int(round(n * factored_fraction))
    n_named = int(round(n * named_fraction))
    records = vt.judge_training_mix(
        n - n_fac - n_named,
        seed=seed,
        classification_fraction=0.25,
        attribute_fraction=0.25,
        sizes=sizes,
        exclude=exclude,
    )
    records += factored_records(n_fac, seed=seed + 31, sizes=sizes, exclude=exclude)
    records += named_records(n_named, seed=seed + 43, sizes=sizes, exclude=exclude)
    order = np.random.default_rng([seed, 13]).permutation(len(records))
    return [records[i] for i in order]


def classification_mix(
    n: int, *, seed: int, factored_fraction: float, exclude, sizes, named_fraction: float = 0.0
) -> list[dict]:

    n_fac = int(round(n * factored_fraction))
    n_named = int(round(n * named_fraction))
    records = vt.shape_records(n - n_fac - n_named, seed=seed, sizes=sizes, exclude=exclude)
    named = named_records(3 * n_named + 3, seed=seed + 47, sizes=sizes, exclude=exclude)
    records += [r for r in named if r["task"] != "named_judge"][:n_named]
    # only the open questions of the factored kinds in this stage
    fac = [
        r
        for r in factored_records(3 * n_fac + 6, seed=seed + 37, sizes=sizes, exclude=exclude)
        if r["task"] in ("off_shape", "extra_colour")
    ]
    records += fac[:n_fac]
    order = np.random.default_rng([seed, 14]).permutation(len(records))
    return [records[i] for i in order]


def evaluate(policy, sets: dict[str, tuple[list[dict], list[dict]]]) -> dict[str, float]:
    """Per named set of (classification records, Yes/No records): colour / shape
    accuracy and the judge's accuracy, acceptance of correct claims and mean P(Yes)."""

    out: dict[str, float] = {}
    for name, (cls, yn) in sets.items():
        for task, acc in jt.classification_by_task(policy, cls).items():
            out[f"{name}/{task}"] = round(acc, 4)
        j = jt.judge_accuracy(policy, yn)
        out[f"{name}/judge_accuracy"] = round(j["accuracy"], 4)
        out[f"{name}/accept_positive"] = round(j["accept_positive"], 4)
        for t in ("colour", "shape", "both"):
            out[f"{name}/reject_{t}"] = round(j[f"reject_{t}"], 4)
    return out


def eval_sets(seed: int, *, exclude, sizes, n: int = 300) -> dict:

    return {
        "seen": (
            vt.shape_records(n // 2, seed=50_000 + seed, sizes=sizes, exclude=exclude),
            vt.judge_records(n, seed=51_000 + seed, sizes=sizes, exclude=exclude),
        ),
        "val_heldout": (
            heldout_classification_records(
                n // 2, seed=52_000 + seed, combos=HELDOUT_VAL, sizes=sizes
            ),
            vt.heldout_judge_records(n, seed=53_000 + seed, combos=HELDOUT_VAL, sizes=sizes),
        ),
        "test_heldout": (
            heldout_classification_records(
                n // 2, seed=54_000 + seed, combos=HELDOUT_TEST, sizes=sizes
            ),
            vt.heldout_judge_records(n, seed=55_000 + seed, combos=HELDOUT_TEST, sizes=sizes),
        ),
    }


def train_shape_judge(
    out_dir: str | Path,
    *,
    minutes: float = 25.0,
    seed: int = 0,
    size: str = "base",
    lr: float = 1e-3,
    batch_size: int = 32,
    factored_fraction: float = 0.5,
    named_fraction: float = 0.0,
    augment: float = 0.0,
    select: str = "yes_no",
    sizes: tuple[int, ...] = (32, 56),
    stage_target: float = 0.95,
    max_stage_steps: int = 1500,
    judge_steps: int = 3000,
    eval_every: int = 150,
    n_eval: int = 300,
    log: Callable[[str], None] | None = print,
) -> dict[str, Any]:
    """Train and save the judge; return {"best": ..., "test": ..., "history": ...}.

    ``augment``: that share of training images gets a random blur, a brightness change
    and Gaussian pixel noise (``shape_critic``'s augmentation), as generated images have.

    Selection (``select``): the judge-stage checkpoint with the best mean of Yes/No
    accuracy on the trained combinations and on the validation held-out combinations
    (``yes_no``), or with the best mean colour and shape accuracy on both, Yes/No
    breaking ties (``questions``, what GenRM's vqa mode reads)."""
    say = log or (lambda _m: None)
    torch.manual_seed(seed)
    work = Path(out_dir)

    words = judge_corpus() + (corpus() * 2 if named_fraction else [])
    build_tiny_vlm(work, arch="qwen2-vl", size=size, corpus=words, seed=seed)
    policy = VLMPolicy.load(work, max_prompt_tokens=64)
    run = JudgeSFT(policy, lr=lr, log=log)
    ex = tuple(HELDOUT)
    sets = eval_sets(seed, exclude=ex, sizes=sizes, n=n_eval)
    stages = [("classification", classification_mix), ("judge", judge_mix)]
    best: dict[str, Any] = {"select": -1.0}
    step, stage, stage_start = 0, 0, 0
    sched = None
    while True:
        name, make = stages[stage]
        if name == "judge" and sched is None:
            sched = cosine_schedule(run.opt, judge_steps, floor=0.1)  # lr to lr / 10
        batch = make(
            batch_size,
            seed=1_000_000 * (seed + 1) + step,
            factored_fraction=factored_fraction,
            named_fraction=named_fraction,
            exclude=ex,
            sizes=sizes,
        )
        if augment:  # soft edges and noise, as a generator's samples have
            rng = np.random.default_rng([seed, step, 17])
            batch = [
                {**r, "image": augment_image(r["image"], rng)} if rng.random() < augment else r
                for r in batch
            ]
        loss = run.step(batch)
        if sched is not None and step - stage_start < judge_steps:
            sched.step()
        step += 1
        out_of_time = run.seconds() > minutes * 60
        if step % eval_every and not out_of_time:
            continue
        with run.evaluating():
            m: dict[str, Any] = evaluate(
                policy, {k: v for k, v in sets.items() if k != "test_heldout"}
            )
        run.record(m, step=step, loss=round(float(loss.detach()), 4), stage=name)
        if name == "judge":
            yes_no = (m["seen/judge_accuracy"] + m["val_heldout/judge_accuracy"]) / 2
            if select == "questions":  # what GenRM's vqa mode reads; Yes/No breaks ties
                keys = ("seen/colour", "seen/shape", "val_heldout/colour", "val_heldout/shape")
                m["select"] = sum(m[k] for k in keys) / 4 + 0.01 * yes_no
            else:
                m["select"] = yes_no
            if m["select"] > best["select"]:
                best = m
                policy.save(str(work))
            if step - stage_start >= judge_steps:
                break
        elif (m["seen/shape"] >= stage_target and m["seen/colour"] >= stage_target) or (
            step - stage_start >= max_stage_steps
        ):
            stage, stage_start = stage + 1, step
        if out_of_time:
            break
    final = VLMPolicy.load(work, max_prompt_tokens=64)
    with torch.no_grad():
        test = evaluate(final, sets)
    say(json.dumps({"final": test}))
    return {
        "best": best,
        "test": test,
        "history": run.history,
        "steps": step,
        "seconds": run.seconds(),
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("out")
    ap.add_argument("--minutes", type=float, default=25.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--factored-fraction", type=float, default=0.5)
    ap.add_argument("--named-fraction", type=float, default=0.0)
    ap.add_argument(
        "--augment", type=float, default=0.0, help="share of training images blurred and noised"
    )
    ap.add_argument("--judge-steps", type=int, default=3000)
    ap.add_argument("--select", choices=("yes_no", "questions"), default="yes_no")
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    r = train_shape_judge(
        a.out,
        minutes=a.minutes,
        seed=a.seed,
        factored_fraction=a.factored_fraction,
        named_fraction=a.named_fraction,
        augment=a.augment,
        select=a.select,
        judge_steps=a.judge_steps,
    )
    Path(a.out, "training.json").write_text(
        json.dumps({k: r[k] for k in ("best", "test", "steps", "seconds")}, indent=1)
    )


if __name__ == "__main__":
    main()
