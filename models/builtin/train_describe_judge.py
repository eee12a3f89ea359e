"""Training and measuring the built-in description judge (``builtin:describe_judge``).

The judge of ``configs/vlm_genrm_tiny.yaml``: a tiny Qwen2-VL that reads an image (or a
clip's frames as images), a question and an answer, and says whether the answer is
correct ("Yes" / "No"); the reward is P(Yes) / (P(Yes) + P(No)) of its first token.

It is trained only on records drawn from the synthetic data's ground truth
(:func:`mmyatt.datasets.describe.judge_records`: correct descriptions in varied
phrasings and deliberately wrong ones), never on a policy's outputs and never on labels
from the recipe's independent check; no record shows or names a held-out combination.
The checkpoint is chosen on the validation split (trained combinations plus the
``HELDOUT_VAL`` / ``MOTION_HELDOUT_VAL`` ones) and reported on the test combinations,
which nothing chose on. See ``models/builtin/describe_judge/README.md`` for the command
and the figures.
"""

from __future__ import annotations

import inspect
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from mmyatt.datasets.describe import (
    DIRECTION_QUESTION,
    FRAMES,
    JUDGE_NEGATIVES,
    JUDGE_TEMPLATE,
    VAL_FOLD2_PAIRS,
    VAL_FOLD2_TRIPLES,
    clip_frames,
    describe_records,
    judge_records,
)
from mmyatt.datasets.describe_motion import direction_contrast_records
from mmyatt.datasets.factored_shapes import named_records
from mmyatt.datasets.shapes import (
    DIRECTIONS,
    HELDOUT,
    HELDOUT_TEST,
    HELDOUT_VAL,
    MOTION_HELDOUT_TEST,
    MOTION_HELDOUT_VAL,
    SHAPES,
)
from mmyatt.datasets.vision_tasks import judge_training_mix
from mmyatt.models.builtin.judge_sft import JudgeSFT
from mmyatt.models.vlm import VLMPolicy
from mmyatt.rewards.genrm import yes_probability
from mmyatt.step.freeze import freeze_parameters
from mmyatt.step.lr_schedule import cosine_schedule

YES, NO = ("Yes", " Yes"), ("No", " No")


def _messages(record: dict) -> list[dict]:
    images = record["image"] if isinstance(record["image"], list) else [record["image"]]
    parts = [{"type": "image", "image": im} for im in images]
    return [{"role": "user", "content": [*parts, {"type": "text", "text": record["prompt"]}]}]


def _checkpoint_dir(path: str) -> str:
    """A VLM directory, or ``builtin:<name>`` for one shipped in models/builtin/."""
    if path.startswith("builtin:"):
        return str(Path(__file__).resolve().parent / path.split(":", 1)[1])
    return path


def judge_scores(policy, records: list[dict], *, batch_size: int = 64) -> list[float]:
    """P(Yes) / (P(Yes) + P(No)) of the first answer token for each record (0.5 when
    neither is in the top 20)."""

    out: list[float] = []
    for start in range(0, len(records), batch_size):
        chunk = records[start : start + batch_size]
        for top in policy.next_token_logprobs([_messages(r) for r in chunk], 20):
            p = yes_probability(top, YES, NO)
            out.append(0.5 if p is None else p)
    return out


def judge_metrics(policy, records: list[dict]) -> dict[str, float]:
    """Accuracy (P(Yes) > 0.5 against the label), acceptance of correct answers,
    rejection per negative type, and the mean P(Yes) paid to correct and to wrong
    answers (what a reward reads)."""
    p = np.asarray(judge_scores(policy, records))
    yes = np.asarray([r["answer"] == "Yes" for r in records])
    out = {
        "n": float(len(records)),
        "accuracy": float(np.mean((p > 0.5) == yes)),
        "accept_correct": float(np.mean(p[yes] > 0.5)) if yes.any() else math.nan,
        "p_yes_correct": float(np.mean(p[yes])) if yes.any() else math.nan,
        "p_yes_wrong": float(np.mean(p[~yes])) if (~yes).any() else math.nan,
    }
    kinds = np.asarray([r["negative_type"] or "" for r in records])
    for k in JUDGE_NEGATIVES:
        sel = kinds == k
        if sel.any():
            out[f"reject_{k}"] = float(np.mean(p[sel] <= 0.5))
    return out


def eval_sets(n: int, *, split: str, seed: int = 0, frames: int = 4) -> dict[str, list[dict]]:
    """{"seen": trained combinations, "heldout": the split's held-out combinations}; clips
    sent as ``frames`` frames."""
    pairs, triples = (
        (HELDOUT_VAL, MOTION_HELDOUT_VAL) if split == "val" else (HELDOUT_TEST, MOTION_HELDOUT_TEST)
    )
    base = 50_000 if split == "val" else 60_000
    return {
        "seen": judge_records(n, seed=base + seed, frames=frames),
        "heldout": judge_records(
            n, seed=base + 1 + seed, only_pairs=pairs, only_triples=triples, frames=frames
        ),
    }


def direction_records(n: int, *, seed: int, frames: int = FRAMES, **kwargs) -> list[dict]:
    """``n`` clips asked ``DIRECTION_QUESTION``, answered with the true direction (a
    judge's drill in reading motion; drawn from ground truth, held-out triples and pairs
    excluded by default). ``kwargs`` go to ``describe_records``."""
    out = []
    for r in describe_records(n, seed=seed, video_fraction=1.0, **kwargs):
        out.append(
            {
                **{k: r[k] for k in ("id", "colour", "shape", "direction", "task")},
                "image": clip_frames(r["video"], frames),
                "prompt": DIRECTION_QUESTION,
                "answer": r["direction"],
                "verdict": None,
                "negative_type": None,
            }
        )
    return out


def training_batch(
    n: int,
    *,
    seed: int,
    extra_colours: bool = True,
    base_share=0.3,
    score_share=0.15,
    named_share: float = 0.0,
    split_negatives: bool = False,
    video_fraction: float = 0.25,
    frames: int = 4,
    negative_weights: dict[str, float] | None = None,
    direction_share: float = 0.0,
    extra_shapes: float = 0.0,
    contrast_share: float = 0.0,
    contrast_wrong: int = 1,
    contrast_other: float = 0.0,
) -> list[dict]:
    """One shuffled batch: description checks (:func:`judge_records`), ``score_share`` of
    the batch asked in the score variant's form (answered "Score: 9" / "Score: 2"), and,
    ``base_share`` of it, the base judge's own records ("Does this image show a red circle?" with its
    colour / shape questions and one-attribute checks,
    :func:`mmyatt.datasets.vision_tasks.judge_training_mix`), so what it knows of colour
    and shape is kept, and, ``named_share`` of it, the same question about any named
    colour on any task or extra shape (:func:`mmyatt.datasets.factored_shapes.named_records`:
    80 combinations, too many to learn one by one); none shows or names a held-out
    combination."""

    n_base = int(round(n * base_share))
    n_score = int(round(n * score_share))
    n_named = int(round(n * named_share))
    n_dir = int(round(n * direction_share))
    n_con = int(round(n * contrast_share))
    out = judge_records(
        n - n_base - n_score - n_named - n_dir - n_con,
        seed=seed,
        extra_colours=extra_colours,
        split_negatives=split_negatives,
        video_fraction=video_fraction,
        frames=frames,
        negative_weights=negative_weights,
        extra_shapes=extra_shapes,
    )
    if n_score:
        out += judge_records(
            n_score,
            seed=seed + 41,
            extra_colours=extra_colours,
            score=True,
            frames=frames,
            negative_weights=negative_weights,
            extra_shapes=extra_shapes,
        )
    if n_dir:
        out += direction_records(n_dir, seed=seed + 67, frames=frames, extra_colours=extra_colours)
    if n_con:
        clips = -(-n_con // (contrast_wrong + 1)) + 1  # one spare: a skipped held-out name
        out += direction_contrast_records(
            clips,
            seed=seed + 71,
            wrong=contrast_wrong,
            frames=frames,
            other_kinds=contrast_other,
            extra_colours=extra_colours,
        )[:n_con]
    if n_base:
        out += judge_training_mix(n_base, seed=seed + 29, exclude=HELDOUT, attribute_fraction=0.25)
    if n_named:
        out += named_records(n_named, seed=seed + 53, exclude=HELDOUT)
    order = np.random.default_rng([seed, 14]).permutation(len(out))
    return [out[i] for i in order]


def train_describe_judge(
    out_dir: str | Path,
    *,
    start: str = "builtin:tiny_judge",
    steps: int = 1500,
    batch_size: int = 32,
    lr: float = 5e-4,
    eval_every: int = 100,
    n_eval: int = 256,
    seed: int = 0,
    max_prompt_tokens: int = 160,
    frames: int = 4,
    freeze: tuple[str, ...] = (),
    select_directions: bool = False,
    select_clips: int = 4,
    log: Callable[[str], None] | None = print,
    **mix: Any,
) -> dict[str, Any]:
    """Fine-tune ``start`` (a VLM directory or ``builtin:<name>``) on fresh batches of
    :func:`training_batch` (``mix``: its keyword arguments, the batch's shares and kinds:
    ``extra_colours``, ``base_share``, ``named_share``, ``score_share``,
    ``negative_weights``, ``contrast_share``, ...; ``frames``: frames sent per clip;
    ``freeze``: the parameter-name prefixes kept as ``start`` has them, as
    ``model.freeze``) with
    ``VLMPolicy.sft_loss``: AdamW at ``lr`` (cosine to
    ``lr / 10``), gradient norm clipped to 1. Every ``eval_every`` steps the mean of the
    validation accuracies (seen + held-out-val) is measured (``select_directions``: with,
    as a third term, how often it pays the true direction most on clips of the
    validation split's held-out triples, ``select_clips`` clips of each,
    :func:`direction_table`); the best checkpoint is
    saved to ``out_dir`` and then measured once on the test sets (and, with
    ``select_directions``, the test triples' direction table). Returns {"best_step",
    "val": {...}, "test": {...}, "seconds"}."""
    unknown = sorted(set(mix) - set(inspect.signature(training_batch).parameters))
    if unknown:
        raise TypeError(f"train_describe_judge: unknown training_batch arguments {unknown}")
    say = log or (lambda _m: None)
    torch.manual_seed(seed)
    policy = VLMPolicy.load(_checkpoint_dir(start), max_prompt_tokens=max_prompt_tokens)
    freeze_parameters(policy.module(), freeze)
    params = [p for p in policy.module().parameters() if p.requires_grad]
    run = JudgeSFT(policy, lr=lr, params=params, log=log)
    val = eval_sets(n_eval, split="val", seed=seed, frames=frames)
    best: dict[str, Any] = {"score": -1.0}
    run.started = time.perf_counter()  # the clock starts with the first step
    schedule = cosine_schedule(run.opt, steps, floor=0.1)
    for step in range(1, steps + 1):
        batch = training_batch(batch_size, seed=1_000 * (seed + 1) + step, frames=frames, **mix)
        loss = run.step(batch)
        schedule.step()
        if step % eval_every == 0 or step == steps:
            with run.evaluating():
                m: dict[str, Any] = {k: judge_metrics(policy, v) for k, v in val.items()}
                if select_directions:
                    m["directions"] = direction_table(
                        policy, MOTION_HELDOUT_VAL, n=select_clips, frames=frames
                    )
            terms = [m["seen"]["accuracy"], m["heldout"]["accuracy"]]
            if select_directions:
                terms.append(m["directions"]["pick_right"])
            score = float(np.mean(terms))
            say(
                f"[describe-judge] step {step} loss {float(loss.detach()):.3f} val seen "
                f"{m['seen']['accuracy']:.3f} held-out {m['heldout']['accuracy']:.3f}"
                + (
                    f" direction picked {m['directions']['pick_right']:.3f}"
                    if select_directions
                    else ""
                )
                + f" ({run.seconds():.0f}s)"
            )
            if score > best["score"]:
                best = {"score": score, "step": step, "val": m}
                policy.save(str(out_dir))
    final = VLMPolicy.load(str(out_dir), max_prompt_tokens=max_prompt_tokens)
    test: dict[str, Any] = {
        k: judge_metrics(final, v)
        for k, v in eval_sets(n_eval, split="test", frames=frames).items()
    }
    if select_directions:
        test["directions"] = direction_table(
            final, MOTION_HELDOUT_TEST, n=select_clips, frames=frames
        )
    say(f"[describe-judge] kept step {best['step']}; test {test}")
    return {
        "best_step": best["step"],
        "val": best["val"],
        "test": test,
        "seconds": run.seconds(),
    }


def direction_table(
    policy, triples, *, n: int = 8, seed: int = 888, frames: int = FRAMES, verb: str = "moving"
) -> dict[str, Any]:
    """Whether the judge reads motion: on ``n`` fresh clips of each (colour, shape,
    direction) triple it is asked "a {colour} {shape} moving {D}" for each direction D.
    Returns {"per_triple": {"colour shape direction": {D: mean P(Yes)}}, "p_yes_right",
    "p_yes_wrong" (means over clips), "pick_right": share of clips whose true direction
    is paid most}. A judge that reads no motion pays every direction alike and picks the
    right one a quarter of the time. ``verb``: the word before the direction (a misspelt
    one, "movnvng", asks whether the judge pays malformed clip text)."""

    directions = list(DIRECTIONS)
    recs = describe_records(
        4 * n * len(triples), seed=seed, video_fraction=1.0, only_triples=list(triples)
    )
    per_triple: dict[str, dict[str, float]] = {}
    right, wrong, picks = [], [], []
    for c, s, d in triples:
        clips = [r for r in recs if (r["colour"], r["shape"], r["direction"]) == (c, s, d)][:n]
        if len(clips) < n:
            raise ValueError(f"direction_table: drew {len(clips)} clips of {c} {s} {d}, wanted {n}")
        queries = [
            {
                "image": clip_frames(r["video"], frames),
                "prompt": JUDGE_TEMPLATE.format(output=f"a {c} {s} {verb} {named}"),
            }
            for r in clips
            for named in directions
        ]
        p = np.asarray(judge_scores(policy, queries)).reshape(n, len(directions))
        truth = directions.index(d)
        per_triple[f"{c} {s} {d}"] = {k: float(v) for k, v in zip(directions, p.mean(axis=0))}
        right += p[:, truth].tolist()
        wrong += np.delete(p, truth, axis=1).ravel().tolist()
        picks += (p.argmax(axis=1) == truth).tolist()
    return {
        "per_triple": per_triple,
        "p_yes_right": float(np.mean(right)),
        "p_yes_wrong": float(np.mean(wrong)),
        "pick_right": float(np.mean(picks)),
    }


PHRASINGS = ("a {c} {s}", "a {s} that is {c}", "one {c} {s}", "a single {c} {s}", "the {c} {s}")


def pair_table(
    policy, pairs, *, n: int = 8, seed: int = 777, phrasings=PHRASINGS
) -> dict[str, dict[str, dict[str, float]]]:
    """What the judge pays for each task shape named on fresh images of each pair:
    {"colour shape": {named shape: {phrasing: mean P(Yes)}}}. Read on held-out pairs it
    shows whether the judge tells their shapes apart (a judge that pays "a red circle"
    for a red square lets a policy name the shape from the colour)."""

    recs = describe_records(
        4 * n * len(pairs), seed=seed, only_pairs=list(pairs), video_fraction=0.0
    )
    out: dict[str, dict[str, dict[str, float]]] = {}
    for c, s in pairs:
        images = [r["image"] for r in recs if (r["colour"], r["shape"]) == (c, s)][:n]
        if len(images) < n:
            raise ValueError(f"pair_table: drew {len(images)} images of {c} {s}, wanted {n}")
        asked = [(named, ph) for named in SHAPES for ph in phrasings]
        queries = [
            {"image": im, "prompt": JUDGE_TEMPLATE.format(output=ph.format(c=c, s=named))}
            for named, ph in asked
            for im in images
        ]
        scores = np.asarray(judge_scores(policy, queries)).reshape(len(asked), n).mean(axis=1)
        table: dict[str, dict[str, float]] = {}
        for (named, ph), v in zip(asked, scores, strict=True):
            table.setdefault(named, {})[ph] = float(v)
        out[f"{c} {s}"] = table
    return out


def main(argv: list[str] | None = None) -> None:
    """``python -m mmyatt.models.builtin.train_describe_judge pairs JUDGE --split val|fold2|test``: the
    judge's :func:`pair_table` on the split's held-out pairs, as JSON; ``directions JUDGE
    --split val|fold2|test``: its :func:`direction_table` on the split's held-out triples;
    ``metrics JUDGE --split val|test``: its :func:`judge_metrics` on the split's
    :func:`eval_sets` (256 records each, as ``training.json``; images and clips apart too)
    and what it pays the true direction after a misspelt verb ("a red circle movnvng
    down") on the clips of ``directions``."""
    import argparse
    import json

    p = argparse.ArgumentParser(prog="python -m mmyatt.models.builtin.train_describe_judge")
    p.add_argument("command", choices=["pairs", "directions", "metrics"])
    p.add_argument("judge", help="a judge directory or builtin:<name>")
    p.add_argument("--split", choices=["val", "fold2", "test"], default="val")
    p.add_argument("--n", type=int, default=8, help="images per pair (clips per triple)")
    a = p.parse_args(argv)
    policy = VLMPolicy.load(_checkpoint_dir(a.judge), max_prompt_tokens=160)
    policy.module().eval()
    if a.command == "metrics":
        if a.split == "fold2":
            raise SystemExit("metrics: --split val or test")
        triples = MOTION_HELDOUT_VAL if a.split == "val" else MOTION_HELDOUT_TEST
        out: dict[str, Any] = {}
        with torch.no_grad():
            for k, v in eval_sets(256, split=a.split).items():
                out[k] = judge_metrics(policy, v)
                for task in ("describe_image", "describe_video"):  # images and clips apart
                    part = [r for r in v if r["task"] == task]
                    out[k][task] = {
                        m: x
                        for m, x in judge_metrics(policy, part).items()
                        if m in ("n", "accept_correct", "p_yes_correct", "p_yes_wrong")
                        or m.startswith("reject_")
                    }
            bad = direction_table(policy, triples, n=a.n, verb="movnvng")
        out["misspelt_verb"] = {
            "p_yes_right": bad["p_yes_right"],
            "p_yes_wrong": bad["p_yes_wrong"],
        }
        print(json.dumps(out, indent=1))
        return
    if a.command == "directions":
        triples = {
            "val": MOTION_HELDOUT_VAL,
            "fold2": VAL_FOLD2_TRIPLES,
            "test": MOTION_HELDOUT_TEST,
        }[a.split]
        print(json.dumps(direction_table(policy, triples, n=a.n), indent=1))
        return
    pairs = {"val": HELDOUT_VAL, "fold2": VAL_FOLD2_PAIRS, "test": HELDOUT_TEST}[a.split]
    print(json.dumps(pair_table(policy, pairs, n=a.n), indent=1))


if __name__ == "__main__":
    main()
