"""Training and evaluating the tiny built-in Yes/No judge (a :class:`~mmyatt.models.vlm.VLMPolicy`).

The data it learns from is made in :mod:`mmyatt.datasets.vision_tasks`; this module holds
what trains or scores a judge on it:

* :func:`train_judge`: the curriculum that trains ``models/builtin/tiny_judge`` from
  scratch (see its docstring for the recipe);
* :func:`finetune_judge_on_generator`: fine-tuning on a flow generator's own samples
  (:func:`generator_samples`) labelled by the rule check (:func:`rule_judge_records`);
* :func:`judge_accuracy`, :func:`classification_accuracy`,
  :func:`classification_by_task`, :func:`rule_agreement`: the held-out measures both
  select checkpoints with.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from mmyatt.datasets.shapes import COLOURS, SHAPES, is_heldout
from mmyatt.datasets.shapes import shape_records as caption_records
from mmyatt.datasets.vision_tasks import (
    COLOUR_CHECK,
    COLOUR_QUESTION,
    IMAGE_SIZE,
    JUDGE_NO,
    JUDGE_QUESTION,
    JUDGE_YES,
    MOTION_QUESTION,
    NEGATIVE_TYPES,
    SHAPE_CHECK,
    SHAPE_QUESTION,
    grey_shape_records,
    judge_records,
    judge_training_mix,
    other_value,
    shape_records,
)
from mmyatt.models.builtin.judge_sft import JudgeSFT
from mmyatt.models.builtin.tiny_vlm import build_tiny_vlm
from mmyatt.models.flow import FlowPolicy
from mmyatt.models.vlm import VLMPolicy
from mmyatt.protocols import Sampling, prompt_seed
from mmyatt.rewards.genrm import yes_probability
from mmyatt.rewards.image import prompt_alignment_rule, shape_fill
from mmyatt.step.lr_schedule import cosine_schedule


# --- judge evaluation ------------------------------------------------------------------
def judge_messages(record: dict) -> list[dict]:
    return [
        {
            "role": "user",
            "content": [
                {"type": "image", "image": record["image"]},
                {"type": "text", "text": record["prompt"]},
            ],
        }
    ]


def judge_accuracy(
    policy, records: list[dict], *, batch_size: int = 64, top_k: int = 20
) -> dict[str, Any]:
    """Held-out Yes/No accuracy of ``policy`` (a :class:`~mmyatt.models.vlm.VLMPolicy`)
    reading P(Yes) vs P(No) of the first answer token (``next_token_logprobs``), overall,
    on positives and per negative type (``reject_<type>`` = rejection rate); and, as a
    reward model is read, the mean P(Yes) / (P(Yes) + P(No)) on the positives of each
    shape (``p_yes_<shape>``): a judge can accept every square and still pay little for
    one."""

    correct: dict[str, list[bool]] = {"positive": [], **{t: [] for t in NEGATIVE_TYPES}}
    p_yes: dict[str, list[float]] = {s: [] for s in SHAPES}
    for start in range(0, len(records), batch_size):
        chunk = records[start : start + batch_size]
        tops = policy.next_token_logprobs([judge_messages(r) for r in chunk], top_k)
        for rec, top in zip(chunk, tops):
            scores = {tok.strip(): lp for tok, lp in reversed(top)}  # most likely wins
            yes, no = scores.get("Yes", -np.inf), scores.get("No", -np.inf)
            said_yes = yes > no
            key = rec["negative_type"] or "positive"
            correct[key].append(said_yes == (rec["answer"] == "Yes"))
            if key == "positive" and (p := yes_probability(top, JUDGE_YES, JUDGE_NO)) is not None:
                p_yes[rec["shape"]].append(p)
    every = [c for v in correct.values() for c in v]
    out: dict[str, Any] = {
        "accuracy": float(np.mean(every)) if every else float("nan"),
        "n": len(every),
    }
    out["accept_positive"] = (
        float(np.mean(correct["positive"])) if correct["positive"] else float("nan")
    )
    for t in NEGATIVE_TYPES:
        out[f"reject_{t}"] = float(np.mean(correct[t])) if correct[t] else float("nan")
    for shape, ps in p_yes.items():
        out[f"p_yes_{shape}"] = float(np.mean(ps)) if ps else float("nan")
    return out


def classification_accuracy(policy, records: list[dict], *, batch_size: int = 64) -> float:
    """Greedy first-token accuracy on colour/shape questions (answers are single words)."""
    hits = []
    for start in range(0, len(records), batch_size):
        chunk = records[start : start + batch_size]
        tops = policy.next_token_logprobs([judge_messages(r) for r in chunk], 1)
        hits += [top[0][0].strip() == r["answer"] for r, top in zip(chunk, tops)]
    return float(np.mean(hits))


def classification_by_task(policy, records: list[dict]) -> dict[str, float]:
    """Greedy first-token accuracy per question type ({"colour": ..., "shape": ...})."""
    out = {}
    for task in ("colour", "shape"):
        subset = [r for r in records if r["task"] == task]
        if subset:
            out[task] = classification_accuracy(policy, subset)
    return out


def train_judge(
    out_dir: str | Path | None = None,
    *,
    minutes: float = 30.0,
    seed: int = 0,
    size: str = "base",
    target: float = 0.98,
    lr: float = 1e-3,
    batch_size: int = 32,
    stage_target: float = 0.95,
    max_stage_steps: int = 800,
    sizes: tuple[int, ...] = (IMAGE_SIZE,),
    classification_fraction: float = 0.25,
    attribute_fraction: float = 0.25,
    judge_steps: int = 3000,
    n_eval: int = 600,
    n_test: int = 1200,
    eval_every: int = 100,
    exclude=(),
    grey_fraction: float = 0.0,
    log: Callable[[str], None] | None = print,
) -> dict[str, Any]:
    """Train the tiny Yes/No judge with ``VLMPolicy.sft_loss``; save the best to ``out_dir``.

    ``grey_fraction``: that share of every batch (all stages) is achromatic shape
    questions (:func:`grey_shape_records`), so shape is learned apart from colour.

    ``exclude``: (colour, shape) combinations no training or selection record shows or
    asks about (the built-in judge excludes ``shapes.HELDOUT``, the flow recipes'
    held-out combinations); the final test reports them separately.

    Recipe (one CPU thread is enough): a tiny Qwen2-VL of ``size``
    (:func:`mmyatt.models.builtin.tiny_vlm.build_tiny_vlm`, seeded), AdamW at ``lr`` without
    weight decay, gradient norm clipped to 1, batches of ``batch_size`` freshly drawn
    records with images of sides ``sizes``. A curriculum of three stages:

    1. "What shape is it?" only, until held-out shape accuracy reaches ``stage_target``
       (shape is the hard attribute: mixed with colour questions from the start, 3-way
       shape accuracy stalled near 0.85, while alone it passes 0.95 in ~300 steps);
    2. colour and shape questions, until both reach ``stage_target``;
    3. the judge mix (:func:`judge_training_mix`): ``classification_fraction`` colour /
       shape questions, ``attribute_fraction`` one-attribute Yes/No checks ("Is the
       shape red?"), the rest judge questions; the learning rate follows a cosine from
       ``lr`` to ``lr / 10`` over ``judge_steps``.

    A stage also ends after ``max_stage_steps``. Every ``eval_every`` steps the stage's
    metric is measured; in stage 3 that is :func:`judge_accuracy` on ``n_eval`` held-out
    Yes/No records (their own seed stream). Training stops when it reaches ``target`` or
    after ``minutes``; the best stage-3 checkpoint is saved (Hugging Face layout) and
    scored once more on ``n_test`` fresh Yes/No records per image side in ``sizes``
    (the eval set picked the checkpoint, so its score is optimistic; this one is not).
    Returns {"best": metrics, "test": {side: metrics}, "history": [...], "steps": int,
    "seconds": float}.
    """
    say = log or (lambda _msg: None)
    torch.manual_seed(seed)
    work = Path(out_dir) if out_dir is not None else None
    build_dir = Path(f"/tmp/mmyatt-judge-build-{seed}") if work is None else work
    build_tiny_vlm(build_dir, arch="qwen2-vl", size=size, corpus=judge_corpus(), seed=seed)
    policy = VLMPolicy.load(build_dir, max_prompt_tokens=64)
    run = JudgeSFT(policy, lr=lr, log=log)
    ex = tuple(exclude)
    eval_records = judge_records(n_eval, seed=10_000 + seed, sizes=sizes, exclude=ex)
    cls_eval = shape_records(192, seed=20_000 + seed, sizes=sizes, exclude=ex)
    n_grey = int(round(batch_size * grey_fraction))

    def with_grey(records: list[dict], s: int) -> list[dict]:
        return records + grey_shape_records(n_grey, seed=s + 7, sizes=sizes) if n_grey else records

    stages: list[tuple[str, Callable[[int], list[dict]]]] = [
        (
            "shape",
            lambda s: with_grey(
                shape_records(
                    batch_size - n_grey, seed=s, questions=("shape",), sizes=sizes, exclude=ex
                ),
                s,
            ),
        ),
        (
            "classification",
            lambda s: with_grey(
                shape_records(batch_size - n_grey, seed=s, sizes=sizes, exclude=ex), s
            ),
        ),
        (
            "judge",
            lambda s: judge_training_mix(
                batch_size,
                seed=s,
                sizes=sizes,
                classification_fraction=classification_fraction,
                attribute_fraction=attribute_fraction,
                exclude=ex,
                grey_fraction=grey_fraction,
            ),
        ),
    ]
    best: dict[str, Any] = {"accuracy": -1.0}
    step, stage, stage_start = 0, 0, 0
    schedule = None  # the judge stage's: a cosine from lr to lr / 10 over judge_steps, then flat
    while True:
        name, make = stages[stage]
        if name == "judge" and schedule is None:
            schedule = cosine_schedule(run.opt, judge_steps, floor=0.1)
        loss = run.step(make(1_000_000 * (seed + 1) + step))
        if schedule is not None:
            schedule.step()
        step += 1
        out_of_time = run.seconds() > minutes * 60
        if step % eval_every and not out_of_time:
            continue
        with run.evaluating():
            metrics: dict[str, Any] = classification_by_task(policy, cls_eval)
            if name == "judge":
                metrics.update(judge_accuracy(policy, eval_records))
        run.record(metrics, step=step, loss=float(loss.detach()), stage=name)
        if name == "judge":
            if metrics["accuracy"] > best["accuracy"]:
                best = metrics
                if work is not None:
                    policy.save(str(work))
            if metrics["accuracy"] >= target:
                break
        else:
            passed = metrics["shape"] >= stage_target
            if name == "classification":
                passed = passed and metrics["colour"] >= stage_target
            if passed or step - stage_start >= max_stage_steps:
                stage, stage_start = stage + 1, step
        if out_of_time:
            break
    seconds = run.seconds()
    test: dict[int, dict] = {}
    if work is not None and best["accuracy"] >= 0:
        final = VLMPolicy.load(work, max_prompt_tokens=64)
        with torch.no_grad():
            for side in sizes:
                test[side] = judge_accuracy(
                    final, judge_records(n_test, seed=30_000 + seed, sizes=(side,))
                )
                say(json.dumps({"test_image_side": side, **test[side]}))
    return {"best": best, "test": test, "history": run.history, "steps": step, "seconds": seconds}


def judge_corpus() -> list[str]:
    """Tokenizer corpus: every question and answer the judge sees."""
    texts = [COLOUR_QUESTION, SHAPE_QUESTION, MOTION_QUESTION, "Yes", "No", *COLOURS, *SHAPES]
    texts += [JUDGE_QUESTION.format(colour=c, shape=s) for c in COLOURS for s in SHAPES]
    texts += [COLOUR_CHECK.format(colour=c) for c in COLOURS]
    texts += [SHAPE_CHECK.format(shape=s) for s in SHAPES]
    return texts * 4


# --- judge data from a generator's own samples ------------------------------------------
def generator_samples(
    generator_dir: str | Path,
    n: int,
    *,
    seed: int,
    noise_levels: tuple[float, ...] = (0.0, 0.4, 0.7, 1.0),
    denoise_steps: tuple[int, ...] = (10, 20),
    batch: int = 32,
    exclude=(),
) -> list[dict]:
    """``n`` images drawn by the flow model at ``generator_dir`` for random shape
    captions: {"id", "prompt", "colour", "shape", "image"} (the caption's attributes, not
    what was drawn). Chunks of ``batch`` cycle through ``noise_levels`` (0 = ODE) and
    ``denoise_steps``, so the pool covers what RL rollouts and ODE evals look like.
    No caption is a (colour, shape) in ``exclude``."""
    policy = FlowPolicy.load(generator_dir)
    records = caption_records(n, seed, tuple(exclude))
    out: list[dict] = []
    with torch.no_grad():
        for k, start in enumerate(range(0, n, batch)):
            chunk = records[start : start + batch]
            level = noise_levels[k % len(noise_levels)]
            steps = denoise_steps[(k // len(noise_levels)) % len(denoise_steps)]
            sampling = Sampling(denoise_steps=steps, noise_level=level, greedy=level == 0.0)
            seeds = [prompt_seed(seed, r["id"]) for r in chunk]
            images = policy.generate(chunk, 1, sampling, seeds).outputs
            out += [{**r, "image": img} for r, img in zip(chunk, images)]
    return out


def rule_judge_records(
    samples: list[dict],
    *,
    seed: int,
    threshold: float = 0.5,
    ambiguous: tuple[float, float] | None = None,
    exclude=(),
) -> list[dict]:
    """Two judge questions per generated image, answered by the rule check
    (:func:`mmyatt.rewards.image.prompt_alignment_rule` >= ``threshold`` -> "Yes"): the
    image's own caption, and another claim (same colour and another shape half of the
    time, another colour a quarter, both the rest). The rule's verdict, not the caption,
    is the label: a square drawn as a blob is not a square.

    ``ambiguous`` = (lo, hi) leaves out images whose blob fill
    (:func:`mmyatt.rewards.image.shape_fill`) lies in [lo, hi): the band around the
    rule's square/circle boundary (0.89) where a ragged square and a round blob overlap,
    so the rule's verdict there is a coin the judge should not be taught. A claim in
    ``exclude`` is replaced by another drawn the same way."""

    if ambiguous is not None and not ambiguous[0] < ambiguous[1]:
        raise ValueError(f"ambiguous must be (lo, hi) with lo < hi, got {ambiguous}")
    rng = np.random.default_rng([seed, 6])
    colours = list(COLOURS)
    out = []
    for i, s in enumerate(samples):
        while True:  # drawn for every sample, so the claims do not depend on the band
            u = rng.random()
            other_colour = other_value(colours, s["colour"], rng) if u >= 0.5 else s["colour"]
            other_shape = (
                other_value(list(SHAPES), s["shape"], rng) if u < 0.5 or u >= 0.75 else s["shape"]
            )
            if not is_heldout((other_colour, other_shape), exclude):
                break
        if ambiguous is not None:
            fill = shape_fill(s["image"])
            if fill is not None and ambiguous[0] <= fill < ambiguous[1]:
                continue
        for j, (colour, shape) in enumerate(
            ((s["colour"], s["shape"]), (other_colour, other_shape))
        ):
            score = prompt_alignment_rule(s["image"], {"colour": colour, "shape": shape})
            out.append(
                {
                    "id": f"g{seed}-{i}-{j}",
                    "prompt": JUDGE_QUESTION.format(colour=colour, shape=shape),
                    "image": s["image"],
                    "answer": "Yes" if score >= threshold else "No",
                    "task": "judge_generated",
                    "rule_score": float(score),
                    "claimed_colour": colour,
                    "claimed_shape": shape,
                }
            )
    return out


def rule_agreement(policy, records: list[dict], *, batch_size: int = 64) -> dict[str, float]:
    """How often the judge's Yes/No (P(Yes) > P(No)) matches the records' rule answers;
    also the Pearson correlation of P(Yes) with the rule score."""

    p_yes: list[float] = []
    for start in range(0, len(records), batch_size):
        chunk = records[start : start + batch_size]
        for top in policy.next_token_logprobs([judge_messages(r) for r in chunk], 20):
            p = yes_probability(top, JUDGE_YES, JUDGE_NO)
            p_yes.append(0.5 if p is None else p)  # neither answer among the top tokens
    p = np.array(p_yes)
    said = p > 0.5
    truth = np.array([r["answer"] == "Yes" for r in records])
    rule = np.array([r["rule_score"] for r in records])
    corr = float(np.corrcoef(p, rule)[0, 1]) if p.std() > 0 and rule.std() > 0 else 0.0
    return {
        "agreement": float(np.mean(said == truth)),
        "accept_rule_yes": float(np.mean(said[truth])) if truth.any() else float("nan"),
        "reject_rule_no": float(np.mean(~said[~truth])) if (~truth).any() else float("nan"),
        "corr_rule": corr,
        "n": len(records),
    }


def finetune_judge_on_generator(
    judge_dir: str | Path,
    generator_dir: str | Path | list,
    out_dir: str | Path,
    *,
    seed: int = 0,
    pool: int = 4000,
    steps: int = 600,
    batch_size: int = 32,
    generated_fraction: float = 0.5,
    lr: float = 3e-4,
    n_eval: int = 600,
    eval_every: int = 100,
    sizes: tuple[int, ...] = (IMAGE_SIZE,),
    ambiguous: tuple[float, float] | None = None,
    exclude=(),
    grey_fraction: float = 0.0,
    log: Callable[[str], None] | None = print,
) -> dict[str, Any]:
    """Fine-tune a Yes/No judge on the generator's own samples, labelled by the rule.
    ``grey_fraction`` of the clean mix is achromatic shape questions.
    No sample's caption, claim or clean record is a (colour, shape) in ``exclude``.

    A judge trained only on clean drawn shapes agrees with the rule check on the tiny
    generator's blobby samples barely above chance, and RL against it finds textures it
    likes (reward hacking). ``generator_dir`` may list several flow models (e.g. the base
    and a policy already trained against an earlier judge, whose samples show what RL
    drifts towards); the pool is split evenly between them. Each batch mixes
    ``generated_fraction`` rule-labelled questions about images from a pool of ``pool``
    generator samples (:func:`generator_samples`, :func:`rule_judge_records`) with the
    clean judge mix (:func:`judge_training_mix`, image sides from ``sizes``) so the clean
    skills stay; ``ambiguous`` leaves out of the pool and the held-out set the images
    whose blob fill is in that band (:func:`rule_judge_records`): the judge is taught, and
    selected on, the rule's verdicts where the rule is reliable. AdamW at ``lr`` with a cosine
    to ``lr / 10``; every ``eval_every`` steps: rule agreement on ``n_eval`` questions
    about held-out generator samples (their own seed) and clean held-out accuracy; the
    checkpoint with the best agreement whose clean accuracy stays >= 0.95 is saved to
    ``out_dir``. Returns {"start", "best", "history", "seconds"}.
    """
    say = log or (lambda _msg: None)
    torch.manual_seed(seed)
    started = time.perf_counter()
    gens = [generator_dir] if isinstance(generator_dir, str | Path) else list(generator_dir)
    say(f"drawing {pool} + {n_eval // 2} samples from {len(gens)} generator(s) ...")
    train_pool, held = [], []
    for k, gen in enumerate(gens):  # the pool and the held-out set split evenly
        s_train, s_held = seed + 1000 * k, 50_000 + seed + 1000 * k
        n_k, h_k = pool // len(gens), (n_eval // 2) // len(gens)
        train_pool += rule_judge_records(
            generator_samples(gen, n_k, seed=s_train, exclude=exclude),
            seed=s_train,
            ambiguous=ambiguous,
            exclude=exclude,
        )
        held += rule_judge_records(
            generator_samples(gen, h_k, seed=s_held, exclude=exclude),
            seed=s_held,
            ambiguous=ambiguous,
            exclude=exclude,
        )
    clean_eval = judge_records(n_eval, seed=10_000 + seed, sizes=sizes, exclude=exclude)
    yes = np.mean([r["answer"] == "Yes" for r in train_pool])
    say(f"pool: {len(train_pool)} questions, {yes:.2f} answered Yes by the rule")
    policy = VLMPolicy.load(judge_dir, max_prompt_tokens=64)
    run = JudgeSFT(policy, lr=lr, log=log)
    run.started = started  # the clock includes drawing the pool
    rng = np.random.default_rng([seed, 7])
    n_gen = int(round(batch_size * generated_fraction))

    def measure(step: int, loss: float | None) -> dict[str, Any]:
        with run.evaluating():
            m = {f"gen_{k}": v for k, v in rule_agreement(policy, held).items()}
            m["clean_accuracy"] = judge_accuracy(policy, clean_eval)["accuracy"]
        return run.record(m, step=step, loss=loss)

    start = measure(0, None)
    best: dict[str, Any] = {"gen_agreement": -1.0}
    schedule = cosine_schedule(run.opt, steps - 1, floor=0.1)  # lr / 10 at the last step
    for step in range(1, steps + 1):
        picks = rng.choice(len(train_pool), size=n_gen, replace=False)
        batch = [train_pool[int(i)] for i in picks]
        batch += judge_training_mix(
            batch_size - n_gen,
            seed=2_000_000 * (seed + 1) + step,
            sizes=sizes,
            classification_fraction=0.25,
            attribute_fraction=0.25,
            exclude=exclude,
            grey_fraction=grey_fraction,
        )
        loss = run.step(batch)
        schedule.step()
        if step % eval_every == 0 or step == steps:
            m = measure(step, float(loss.detach()))
            if m["clean_accuracy"] >= 0.95 and m["gen_agreement"] > best["gen_agreement"]:
                best = m
                policy.save(str(out_dir))
    return {
        "start": start,
        "best": best,
        "history": run.history,
        "seconds": round(run.seconds(), 1),
    }
