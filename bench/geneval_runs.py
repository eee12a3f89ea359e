"""Summarise finished tiny-GenEval runs (configs/flow_*_geneval_tiny.yaml): first and last
eval of each run, then mean and spread over the runs (seeds) of one recipe.

    python bench/geneval_runs.py RUN_DIR [RUN_DIR ...] --out results/geneval/NAME.json
    python bench/geneval_runs.py --base PIPELINE --out results/geneval/base.json

Per run, at the first eval (step 0, the base model) and the last: the judged reward on the
held-out prompts (``genrm``), the independent checker (``geneval_check``) on held-out
prompts overall and per kind and on seen ones, the one-object rule (``geneval_rule``),
and the background texture as a ratio to the run's step-0 figure. The split is whatever
the runs evaluated (``data.eval_split``, read from each run's config). From the rollout log
(``rollouts/rank*.jsonl``), how often the judge orders two samples of one group as the
checker does, over the pairs the checker tells apart (``rollout_agreement``): whether the
reward the policy trains on points where the checker does on the policy's own samples.

``--base``: the base generator alone, the checker per kind on the validation and the test
split (``pretrain_flow.evaluate_geneval``: ODE 20 steps, CFG 1, 80 held-out prompts and
40 trained ones per split) and the background texture of the held-out samples.
"""

from __future__ import annotations

import argparse
import itertools
import json
from pathlib import Path

import numpy as np

from mmyatt.report.inspect import load_rollouts

KINDS = ("single", "counting", "two_objects", "colour_attr", "position")


def _figures(row: dict, base_bg: float) -> dict:
    out = {
        "judged_heldout": row.get("eval/heldout/reward/genrm"),
        "checker_heldout": row.get("eval/heldout/reward/geneval_check"),
        "checker_seen": row.get("eval/seen/reward/geneval_check"),
        "rule_heldout": row.get("eval/heldout/reward/geneval_rule"),
        "background_ratio": row["eval/quality/background_hf"] / base_bg,
    }
    for kind in KINDS:
        out[f"checker_heldout_{kind}"] = row.get(f"eval/heldout/{kind}/reward/geneval_check")
    return out


def rollout_agreement(run: Path, judge: str = "genrm", check: str = "geneval_check") -> dict:
    """Over the pairs of samples of one group (one prompt at one step) that ``check``
    scores differently: the share that ``judge`` orders the same way (ties count half).
    The rollout log is read by :func:`mmyatt.report.inspect.load_rollouts`."""
    df = load_rollouts(run)
    j, c = f"part/{judge}", f"part/{check}"
    groups = df.groupby(["step", "rank", "group"]) if len(df) else []
    same, pairs = 0.0, 0
    if j in df and c in df:
        for _, g in groups:
            scored = g.dropna(subset=[j])
            for (ja, ca), (jb, cb) in itertools.combinations(zip(scored[j], scored[c]), 2):
                if ca == cb:
                    continue
                pairs += 1
                same += 0.5 if ja == jb else float((ja > jb) == (ca > cb))
    return {
        "groups": len(groups),
        "pairs": pairs,
        "agreement": round(same / pairs, 4) if pairs else None,
    }


def read_run(run: Path) -> dict:
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x.strip()]
    evals = {r["step"]: r for r in rows if "eval/reward/mean" in r}  # a step's last row wins
    first, last = evals[min(evals)], evals[max(evals)]
    base_bg = first["eval/quality/background_hf"]
    summary = json.loads((run / "summary.json").read_text())
    import yaml

    cfg = yaml.safe_load((run / "config.yaml").read_text())
    return {
        "run": run.name,
        "recipe": cfg.get("name"),
        "split": cfg["data"].get("eval_split", "test"),
        "seed": cfg["trainer"].get("seed"),
        "cut_by_time": summary.get("cut_by_time"),
        "steps_done": summary.get("steps_done"),
        "steps_planned": summary.get("steps_planned"),
        "first_step": min(evals),
        "last_step": max(evals),
        "first": _figures(first, base_bg),
        "last": _figures(last, base_bg),
        "rollout_agreement": rollout_agreement(run),
    }


def aggregate(runs: list[dict]) -> dict:
    """Mean, standard deviation, min and max over runs of each first / last / gain figure."""
    out: dict = {}
    for key in runs[0]["first"]:
        for name, vals in (
            ("first", [r["first"][key] for r in runs]),
            ("last", [r["last"][key] for r in runs]),
            ("gain", [r["last"][key] - r["first"][key] for r in runs]),
        ):
            v = [x for x in vals if x is not None]
            if v:
                out[f"{key}/{name}"] = {
                    "mean": round(float(np.mean(v)), 4),
                    "std": round(float(np.std(v)), 4),
                    "min": round(float(np.min(v)), 4),
                    "max": round(float(np.max(v)), 4),
                }
    return out


def base_figures(path: str) -> dict:
    """The checker per kind on both eval splits for a pipeline (``--base``)."""
    import torch

    from mmyatt.models.builtin.pretrain_flow import evaluate_geneval
    from mmyatt.models.flow import FlowPolicy

    torch.set_num_threads(1)
    policy = FlowPolicy.load(path)
    out: dict = {"model": path, "sampling": "ODE, 20 steps, CFG 1"}
    for split in ("val", "test"):
        out[split] = evaluate_geneval(policy, split=split, with_texture=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", nargs="*", type=Path)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--base", help="a pipeline directory: figures of the base generator")
    a = ap.parse_args()
    if a.base:
        result = base_figures(a.base)
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(result, indent=1) + "\n")
        print(json.dumps(result))
        return
    runs = [read_run(r) for r in a.runs]
    result = {"n_runs": len(runs), "summary": aggregate(runs), "runs": runs}
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(result, indent=1) + "\n")
    for k in ("checker_heldout", "judged_heldout", "background_ratio"):
        s = result["summary"]
        print(k, "first", s[f"{k}/first"], "last", s[f"{k}/last"])


if __name__ == "__main__":
    main()
