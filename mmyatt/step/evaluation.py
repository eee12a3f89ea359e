"""Evaluation on held-out prompts: one sample each, scored by the run's reward, with
figures per split (held-out combinations against seen ones) and per task, and the
texture checks of image and video outputs.

Leaves out training and the rollout log; what each reward computes is ``mmyatt.rewards``.
"""

from __future__ import annotations

from contextlib import nullcontext

import torch
from PIL import Image

from mmyatt.distributed import Dist
from mmyatt.protocols import Sampling, prompt_seed
from mmyatt.rewards.quality import texture_metrics
from mmyatt.serving.client import JudgeError
from mmyatt.step.sampling import SamplingSchedule
from mmyatt.step.scoring import Scorer


class Evaluator:
    """``records``: this rank's held-out records; ``seed`` and ``salt``: their generation
    seeds (``prompt_seed(seed, salt, index)``: the test and validation splits draw apart);
    ``ema``: evaluate the policy's EMA weights."""

    def __init__(
        self,
        policy,
        scorer: Scorer,
        dist: Dist,
        records: list[dict],
        schedule: SamplingSchedule,
        *,
        seed: int,
        salt: str = "eval",
        ema: bool = False,
    ):
        self.policy, self.scorer, self.dist, self.records = policy, scorer, dist, records
        self.schedule, self.seed, self.salt, self.ema = schedule, seed, salt, ema
        self.outputs: list = []  # (output, prompt, reward, record): last eval, this rank

    def __call__(self) -> dict[str, float]:
        """Held-out prompts, one sample each; this rank scores its own share. Greedy by
        default; sampled at the training temperature (``schedule.eval_greedy`` False:
        greedy accuracy saturates early and hides learning) plus a greedy pass."""
        out = self._evaluate(self.schedule.evaluation(), "eval/reward")
        if not self.schedule.eval_greedy:
            greedy = self._evaluate(self.schedule.evaluation(greedy=True), "eval/greedy")
            out["eval/greedy_accuracy"] = greedy.get("eval/greedy/mean", float("nan"))
        return out

    def _evaluate(self, s: Sampling, prefix: str) -> dict[str, float]:
        """Eval records may carry "split": "heldout" (combinations no training saw) or
        "seen". Then ``{prefix}/mean`` and its components are the held-out figures, and
        ``eval/heldout/...`` and ``eval/seen/...`` report both. When the eval records
        carry more than one "task" (images and clips of one recipe), every reward term is
        also reported per split and task, ``eval/heldout/<task>/reward/<term>``: a policy
        that games its judge on one kind of record shows there. Image and video outputs
        also get the texture checks of :mod:`mmyatt.rewards.quality` as
        ``eval/quality/background_hf`` and ``eval/quality/object_hf``."""
        recs = self.records
        # a rank may hold no eval records while others do: it still joins every collective
        if not self.dist.any(bool(recs)):
            return {}
        names = list(self.scorer.reward.names)
        # the same groups on every rank, for the all-reduce
        tasks = self.dist.union(x["task"] for x in recs if x.get("task"))
        by_task = [f"{g}/{t}" for g in ("heldout", "seen") for t in tasks] if len(tasks) > 1 else []
        groups = ("all", "heldout", "seen", *by_task)
        sums = {f"{g}/{k}": 0.0 for g in groups for k in ("total", "count", *names)}
        quality = {"background_hf": 0.0, "background_n": 0.0, "object_hf": 0.0, "object_n": 0.0}
        shown = []
        bs = 64
        error = None
        with torch.no_grad(), self.policy.ema_weights() if self.ema else nullcontext():
            for i in range(0, len(recs), bs):
                chunk = recs[i : i + bs]
                seeds = [prompt_seed(self.seed, self.salt, x["_index"]) for x in chunk]
                out = self.policy.generate(chunk, 1, s, seeds)
                try:  # ranks may hold different numbers of chunks: agree after the loop
                    rewards, parts = self.scorer(out.outputs, out.records, out.prompt_ids)
                except JudgeError as e:
                    error = e
                    break
                for j, rec in enumerate(out.records):
                    split = rec.get("split")
                    for g in ("all", split, f"{split}/{rec.get('task')}"):
                        if g not in groups:
                            continue
                        sums[f"{g}/total"] += float(rewards[j])
                        sums[f"{g}/count"] += 1
                        for k in names:  # the same keys on every rank, for the all-reduce
                            if k in parts:
                                sums[f"{g}/{k}"] += float(parts[k][j])
                if _visual(out.outputs):
                    for k, (total, n) in texture_metrics(out.outputs).items():
                        quality[k] += total
                        quality[k.replace("_hf", "_n")] += n
                shown += [
                    (o, x.get("prompt"), float(v), x)
                    for o, x, v in zip(out.outputs, out.records, rewards)
                ]
        self.scorer.agree(error)
        self.outputs = shown
        g = self.dist.sum_many({**sums, **quality})
        report = {}
        for group in groups:
            n = g[f"{group}/count"]
            if n == 0:
                continue
            report[group] = {"mean": g[f"{group}/total"] / n}
            if prefix == "eval/reward":
                report[group].update({k: g[f"{group}/{k}"] / n for k in names})
        main = report.get("heldout", report.get("all", {"mean": 0.0}))
        out_metrics = {f"{prefix}/{k}": v for k, v in main.items()}
        if prefix == "eval/reward":
            for group in ("heldout", "seen", *by_task):
                split, _, task = group.partition("/")
                name = f"eval/{split}/{task}/reward" if task else f"eval/{split}/reward"
                for k, v in report.get(group, {}).items():
                    out_metrics[f"{name}/{k}"] = v
            for k in ("background_hf", "object_hf"):
                n = g[k.replace("_hf", "_n")]
                if n > 0:
                    out_metrics[f"eval/quality/{k}"] = g[k] / n
        return out_metrics


def _visual(outputs: list) -> bool:
    first = outputs[0] if outputs else None
    if isinstance(first, list) and first:
        first = first[0]
    return isinstance(first, Image.Image)
