"""`mmyatt bench placement`: every placement mode side by side on 2 cores.

One invocation builds a tiny text policy and a tiny text judge, then runs `mmyatt
train` (2 controllers, the judge served by a child process) once per workload and mode,
one after another, and reads each run's own per-step measurements (metrics.jsonl):

- judge_heavy: a GenRM term whose judge writes ``JUDGE_TOKENS`` tokens per sample
  (score mode, greedy) next to a rule; the policy stops at any of a few common
  characters, so completion lengths are geometric with a cap (a long tail; the
  measured percentiles are in the JSON);
- judge_comparable: the same, with a judge that answers in ``COMPARABLE_JUDGE_TOKENS``
  tokens (a short score, as in the drifting workload's first segment): its model time is
  about its generation time when each has one core (partial), where judge_heavy's judge
  takes about twice its generation time (``judge_over_generation_s_*`` in the JSON);
- rollout_heavy: the same policy and lengths, a rule reward only (no judge);
- drifting: completion lengths grow mid-run, as with a staged length limit (DeepScaleR
  trains at 8k, then resumes at 16k and 24k) or as RL responses grow until most are
  truncated: ``S`` steps of the judge-heavy workload (geometric lengths, at most 48
  tokens), then the run is resumed from its checkpoint writing 96 tokens (no stop
  characters: every completion runs to the cap, so none finishes early to be streamed)
  for ``S`` more. One judge serves both segments, writing ``DRIFT_JUDGE_TOKENS`` tokens
  after the score template; its call grows with what it reads. Every arm runs the same
  two segments; auto re-profiles after the restart.
- drifting_judge: the judge's cost grows mid-run, from none to about the generation's, as
  when a run warms up on rule rewards and then resumes with a GenRM term added: ``S``
  steps of rollout_heavy, then ``S`` of judge_comparable, resumed from the checkpoint
  (the judge server starts with the second segment).

Figures: mean step seconds over the measured steps (the first step of every run or
segment is warm-up and left out, in every arm alike), ratios of those, per-role idle
fractions and CPU use (``placement/*``), per-mode peak RSS summed over controllers and
judge (the largest per-phase peak of a run), and auto's choices. Each figure is the mean
over rounds; each acceptance ratio also comes with its per-round values and a 95%
interval (``bench_figures.py``).
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
import time
from pathlib import Path

from mmyatt.bench.runs import machine
from mmyatt.config.schema import PlacementConfig
from mmyatt.datasets.synthetic import write_jsonl
from mmyatt.models.builtin.tiny import build_tiny_text_model
from mmyatt.placement.bench_arms import (
    COLOCATE_JUDGE_THREADS,
    COMPARABLE_JUDGE_TOKENS,
    CORPUS,
    DRIFT,
    DRIFT_JUDGE_TOKENS,
    JUDGE_TOKENS,
    RULE,
    arm_summary,
    base_overrides,
    judge_overrides,
    measured_rows,
    run_arm,
    train_arm_run,
)
from mmyatt.placement.bench_figures import (
    DRIFTING,
    MODES,
    balance_report,
    combine_rounds,
    derive_ratios,
    mean_of_numbers,
    paired_ratio,
)
from mmyatt.placement.bench_memory import memory_arms

logger = logging.getLogger(__name__)


def _drift_segments(wl: str, judge: Path) -> list[tuple[str, list[str]]]:
    """The two segments of a drifting workload: (name, overrides) each."""
    if wl == "drifting_judge":
        return [("rule", RULE), ("judged", judge_overrides(judge, COMPARABLE_JUDGE_TOKENS))]
    j = judge_overrides(judge, DRIFT_JUDGE_TOKENS)
    return [("short", j + DRIFT["short"]), ("long", j + DRIFT["long"])]


def _drift_arm(
    tmp: Path, name: str, base: list[str], segments: list[tuple[str, list[str]]], seg: int
) -> dict:
    """``seg`` steps of the first segment, then ``seg`` of the second, resumed from the
    first one's checkpoint (the first step of each is warm-up, left out)."""
    rd = tmp / name
    t0 = time.perf_counter()
    ck = ["checkpoint.save_every=" + str(seg), "checkpoint.async_save=false"]
    out: dict = {}
    for i, (label, overrides) in enumerate(segments):
        train_arm_run(rd, base + overrides + ck + [f"trainer.steps={(i + 1) * seg}"])
        out[f"segment_{label}"] = arm_summary(measured_rows(rd, first=i * seg + 2))
    parts = [out[f"segment_{label}"] for label, _ in segments]
    out["total_s"] = sum(p["total_s"] for p in parts)
    out["steps_measured"] = sum(p["steps_measured"] for p in parts)
    out["wall_s"] = time.perf_counter() - t0
    return out


WORKLOADS = (
    "judge_heavy",
    "judge_comparable",
    "rollout_heavy",
    "drifting",
    "drifting_judge",
    "balance",
    "over_dispatch",
    "judge_memory",
)


def _models(tmp: Path) -> tuple[Path, Path]:
    """The bench's policy and judge: two qwen2-1m models (random init, seeds 0 and 1) built
    under ``tmp``. The probe scripts in bench/ use the same pair."""

    policy = build_tiny_text_model(tmp / "policy", size="qwen2-1m", corpus=CORPUS, seed=0)
    judge = build_tiny_text_model(tmp / "judge", size="qwen2-1m", corpus=CORPUS, seed=1)
    return policy, judge


def _arm_rounds(
    tmp: Path, label: str, base: list[str], arms: dict[str, list[str]], rounds: int, figures: dict
) -> dict[str, list[dict]]:
    """Each arm (name -> overrides added to ``base``) trained ``rounds`` times, in an order
    rotated every round (alternating for two arms). Per run: the mean over steps 2 on of
    each metric ``figures`` names (figure -> metrics.jsonl key), the steps measured and
    the run's wall time."""
    runs: dict[str, list[dict]] = {a: [] for a in arms}
    names = list(arms)
    for k in range(rounds):
        for a in names[k % len(names) :] + names[: k % len(names)]:
            rd = tmp / f"{label}_{a}_r{k}"
            t0 = time.perf_counter()
            train_arm_run(rd, base + arms[a])
            rows = measured_rows(rd, first=2)
            rec = {f: mean_of_numbers([r.get(key) for r in rows]) for f, key in figures.items()}
            rec.update(steps_measured=len(rows), wall_s=time.perf_counter() - t0)
            runs[a].append(rec)
            logger.info(f"[bench] {label} round {k + 1} {a}: {rec}")
    return runs


def _arm_means(runs: dict[str, list[dict]], per_round: str) -> dict[str, dict]:
    """Each arm's figures averaged over its rounds, with ``per_round``'s list kept."""
    out = {}
    for a, per in runs.items():
        out[a] = {k: mean_of_numbers([p[k] for p in per]) for k in per[0]}
        out[a][f"{per_round}_per_round"] = [p[per_round] for p in per]
    return out


def _dispatch_arms(tmp: Path, base: list[str], steps: int, rounds: int) -> dict:
    """Long-tail over-dispatch on the heavy-tailed rule workload (shared mode):
    rollout.over_dispatch_ratio 1 (every prompt drawn is trained on) against 1.5, with the
    carried prompts drawn again from their seed and from a new one (rollout.redraw_carried),
    in rotated rounds, ``rounds`` times each."""
    shared = base + [*RULE, "placement.mode=shared"]
    arms = {r: [f"rollout.over_dispatch_ratio={r}"] for r in ("1.0", "1.5")}
    arms["1.5_redraw"] = [*arms["1.5"], "rollout.redraw_carried=true"]
    figures = {
        "step_s": "timing/step_s",
        "generate_s": "timing/generate_s",
        "response_length_mean": "response_length/mean",
        "truncated_frac": "response_length/truncated_frac",
        "cut_short_prompts": "rollout/cut_short_prompts",
        "carried_prompts": "rollout/carried_prompts",
    }
    out = _arm_means(_arm_rounds(tmp, "dispatch", shared, arms, rounds, figures), "step_s")
    out["generate_ratio"] = out["1.5"]["generate_s"] / out["1.0"]["generate_s"]
    out["step_ratio"] = out["1.5"]["step_s"] / out["1.0"]["step_s"]
    for k in ("generate", "step"):
        out[f"redraw_{k}_ratio"] = out["1.5_redraw"][f"{k}_s"] / out["1.0"][f"{k}_s"]
    return out


MICRO_BATCH_TOKENS = 512  # the micro-batch arms (balance workload; bench/micro_batches_ab.py)


def _balance_arms(tmp: Path, base: list[str], steps: int, rounds: int = 1) -> dict:
    """Balanced controllers on a skewed step: rank 0 draws the long prompts (20-40
    terms), rank 1 the short ones (1-2 terms). Four arms in rotated rounds:
    placement.balance off and on, each with one pass per minibatch and with
    micro-batches of at most MICRO_BATCH_TOKENS padded tokens."""
    import random

    rng = random.Random(0)
    recs = []
    for i in range(400):
        n = rng.randint(20, 40) if i % 2 == 0 else rng.randint(1, 2)
        recs.append({"prompt": "+".join(["1"] * n) + "=", "answer": str(n)})
    data = tmp / "skewed.jsonl"
    write_jsonl(data, recs)
    skew = [f"data.train={data}", f"data.eval={data}", "data.shuffle=false"]
    skew += ["model.max_prompt_tokens=128", *RULE, "placement.mode=shared"]
    arms = {
        name: [f"placement.balance={on}", f"algorithm.micro_batch_tokens={tokens}"]
        for name, on, tokens in (
            ("off", "false", 0),
            ("on", "true", 0),
            ("off_micro", "false", MICRO_BATCH_TOKENS),
            ("on_micro", "true", MICRO_BATCH_TOKENS),
        )
    }
    figures = {
        "step_s": "timing/step_s",
        "train_s": "placement/train_s",
        "balance_s": "timing/balance_s",  # the exchange
        "update_s": "timing/update_s",
        "work_max_over_mean_before": "placement/balance_before",
        "work_max_over_mean_after": "placement/balance_after",
        "samples_moved_per_step": "placement/balance_moved",
        "micro_batches_per_minibatch": "train/micro_batches",
    }
    runs = _arm_rounds(tmp, "balance", base + skew, arms, rounds, figures)
    out: dict = {"rounds": rounds, "micro_batch_tokens": MICRO_BATCH_TOKENS}
    out.update(_arm_means(runs, "train_s"))
    pairs = (("on", "off"), ("on_micro", "off_micro"), ("off_micro", "off"), ("on_micro", "off"))
    for num, den in pairs:  # training phase, paired round by round
        out[f"train_s_{num}_over_{den}"] = paired_ratio(
            [p["train_s"] for p in runs[num]], [p["train_s"] for p in runs[den]]
        )
    return out


def bench_placement(
    quick: bool = False,
    progress: str | Path | None = None,
    *,
    workloads: tuple[str, ...] = WORKLOADS,
    rounds: int | None = None,
    steps: int | None = None,
    previous: dict | None = None,
    overrides: tuple[str, ...] = (),
) -> dict:
    """The arms of ``workloads``, ``rounds`` times each, the modes in a rotated order per
    round (the machine's load moves over minutes; every mode sees every position); a
    mode's figure is the mean over its rounds. ``previous``: a JSON of an earlier
    invocation whose other workloads are kept (each workload can be run on its own).
    With ``progress``, what is measured so far is written there after each arm.
    ``overrides`` (``key=value``) go to every run after the bench's own settings: on a GPU
    machine, ``distributed.nproc=1 distributed.device=cuda`` (one controller, the judge on
    the same device)."""
    steps = steps or (3 if quick else 9)
    rounds = rounds or (1 if quick else 2)
    seg = 3 if quick else max(5, (steps + 1) // 2)  # drifting: steps per segment
    out: dict = dict(previous or {})
    out.update(
        {
            "benchmark": "placement",
            "machine": machine(),
            "cores": sorted(os.sched_getaffinity(0)),
            "controllers": int(
                dict(o.split("=", 1) for o in overrides).get("distributed.nproc", 2)
            ),
            "overrides": list(overrides),
            "warmup_steps_excluded": 1,
            "judge_tokens_per_sample": JUDGE_TOKENS,
            "stream_groups": 2,  # = placement.stream_groups in _base
            "policy": "qwen2-1m (random init), 8 prompts x 8 samples per step, up to 48 tokens",
            "judge": f"qwen2-1m (random init), score mode, {JUDGE_TOKENS} greedy tokens per sample",
            "judge_tokens_per_sample_drifting": DRIFT_JUDGE_TOKENS,
            "judge_tokens_per_sample_comparable": COMPARABLE_JUDGE_TOKENS,
            "max_new_tokens": 48,  # = sampling.max_new_tokens in _base
            "streaming": "text policy, pointwise judge: each sample as it finishes",
            # partial's judge: calls of at most stream_max_samples while generation runs,
            # then every core for the rest (the config's defaults)
            "partial_judge": _partial_judge(),
        }
    )
    with tempfile.TemporaryDirectory(prefix="mmyatt-placement-") as tmp_s:
        tmp = Path(tmp_s)
        policy, judge = _models(tmp)
        base = base_overrides(policy, steps) + list(overrides)
        for wl in workloads:
            if wl == "over_dispatch":
                out["over_dispatch_run"] = _dispatch_arms(tmp, base, steps, rounds)
                logger.info(f"[bench] placement over-dispatch: {out['over_dispatch_run']}")
                _save(out, progress)
                continue
            if wl == "judge_memory":
                out["judge_memory"] = memory_arms(tmp, base, steps, rounds)
                _save(out, progress)
                continue
            if wl == "balance":
                out["balance_run"] = _balance_arms(tmp, base, steps, rounds)
                logger.info(f"[bench] placement balance: {out['balance_run']}")
                _save(out, progress)
                continue
            per_round: dict[str, list] = {m: [] for m in MODES}
            t0 = time.perf_counter()
            for k in range(rounds):
                for mode in MODES[k % len(MODES) :] + MODES[: k % len(MODES)]:
                    name = f"{wl}_{mode}_r{k}"
                    arm_base = base + [f"placement.mode={mode}"]
                    if wl in DRIFTING:
                        arm = _drift_arm(tmp, name, arm_base, _drift_segments(wl, judge), seg)
                        fig = f"{arm['total_s']:.2f} s"
                    else:
                        extra = {
                            "judge_heavy": judge_overrides(judge),
                            "judge_comparable": judge_overrides(judge, COMPARABLE_JUDGE_TOKENS),
                        }.get(wl, RULE)
                        arm = run_arm(tmp, name, arm_base + extra, steps)
                        fig = f"{arm['step_s']:.3f} s/step"
                    per_round[mode].append(arm)
                    logger.info(f"[bench] placement {wl} round {k + 1} {mode}: {fig}")
                    out[wl] = combine_rounds(per_round, wl)
                    out[wl]["rounds"] = k + 1
                    out[wl]["colocate_judge_threads"] = COLOCATE_JUDGE_THREADS
                    out[wl]["steps_per_run"] = 2 * seg if wl in DRIFTING else steps
                    out[wl]["wall_s"] = time.perf_counter() - t0
                    _save(out, progress)
    derive_ratios(out)
    out["balance"] = balance_report()
    out["load_average_at_end"] = [round(x, 2) for x in os.getloadavg()]
    return out


def _partial_judge() -> dict:

    p = PlacementConfig()
    return {"widen_judge": p.widen_judge, "stream_max_samples": p.stream_max_samples}


def _save(out: dict, progress) -> None:
    if progress is not None:
        Path(progress).write_text(json.dumps(out, indent=2) + "\n")


def main(argv: list[str] | None = None) -> int:
    """``python -m mmyatt.placement.bench --workload judge_heavy --out bench/placement.json``:
    one workload (or several) at a time, merged into the JSON at ``--out``."""
    import argparse

    ap = argparse.ArgumentParser(prog="python -m mmyatt.placement.bench")
    ap.add_argument("--workload", action="append", choices=WORKLOADS)
    ap.add_argument("--rounds", type=int, default=None)
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--out", required=True)
    ap.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a config override for every run (e.g. distributed.device=cuda)",
    )
    args = ap.parse_args(argv)
    path = Path(args.out)
    previous = json.loads(path.read_text()) if path.exists() else None
    out = bench_placement(
        workloads=tuple(args.workload or WORKLOADS),
        rounds=args.rounds,
        steps=args.steps,
        previous=previous,
        progress=str(path) + ".partial",
        overrides=tuple(args.set),
    )
    path.write_text(json.dumps(out, indent=2) + "\n")
    Path(str(path) + ".partial").unlink(missing_ok=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
