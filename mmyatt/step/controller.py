"""The per-rank controller: shard -> rollout -> reward -> advantage -> update.

Every training process runs one ``Controller``. It reads only its own records,
generates its own rollouts (all G samples of a prompt on this rank), scores them,
computes advantages and takes optimizer steps whose gradients are summed over all
controllers. Between controllers travel gradients, scalar metrics and counts only.

What this file deliberately leaves out: process start-up, the run loop and run
preparation (``mmyatt.step.run``, ``mmyatt.distributed``), config -> object building
(``mmyatt.step.builders``), the math (``mmyatt.algorithms``), anything modality-specific
(the adapters in ``mmyatt.models``), who runs where and which records each call
generates (``mmyatt.placement``), grouping (``mmyatt.step.batches``), and the sampling
settings and rollout metrics (``mmyatt.step.parts``). Reading ``_step`` top to bottom is reading the
algorithm.

Equivalence across world sizes: a prompt's samples come from a generator seeded by
(seed, epoch, record index), the loss is normalised by global counts and gradients
are summed, so P controllers on 1/P of the data each take the same optimizer steps
as one controller on all of it (``tests/test_controller.py`` checks this).
"""

from __future__ import annotations

import json
import math
from contextlib import nullcontext
from functools import partial
from pathlib import Path

import torch

from mmyatt import algorithms as alg
from mmyatt.config.schema import RunConfig
from mmyatt.distributed import Dist
from mmyatt.outputs.metrics import MetricsLogger, PhaseTimer
from mmyatt.outputs.rollout_log import truncate_rollouts, write_rollouts
from mmyatt.outputs.trackers import make_logger
from mmyatt.placement.dispatch import record_seed
from mmyatt.protocols import (
    EMA,
    ClosedFormKL,
    LatentOutputs,
    ReferenceKL,
    Sampling,
    TokenPolicy,
    capable,
    prompt_seed,
    require,
)
from mmyatt.rewards.mixture import RewardMixture
from mmyatt.rollout import Rollout
from mmyatt.step.batches import first_groups, group_index
from mmyatt.step.lr_schedule import cosine_factor
from mmyatt.step.parts import (
    eval_sampling,
    in_micro_batches,
    micro_backward,
    micro_parts,
    pg_terms,
    rollout_metrics,
    train_sampling,
)


class Controller:
    def __init__(
        self,
        cfg: RunConfig,
        run_dir: Path,
        dist: Dist,
        *,
        policy,
        reward,
        shard,
        eval_records: list[dict],
        logger: MetricsLogger | None = None,
    ):
        self.cfg, self.run_dir, self.dist = cfg, Path(run_dir), dist
        self.policy, self.reward, self.shard = policy, reward, shard
        self.eval_records = eval_records
        self.logger = logger or make_logger(cfg, run_dir, enabled=dist.is_main)
        self.local_prompts = cfg.data.prompts_per_step // dist.world_size
        from mmyatt.engines import build_engines
        from mmyatt.step.builders import build_nft

        # DiffusionNFT's sampling policy and loss (models/flow_nft.py), else None; its
        # sampling copy is taken before an engine shards the transformer (a plain module)
        self.nft = build_nft(cfg, policy)
        # replica / fsdp2 / megatron training, hf / vllm rollouts (mmyatt/engines)
        self.engine, self.policy = build_engines(cfg, dist, policy)
        params = [p for p in self.policy.module().parameters() if p.requires_grad]
        self.params = params
        o = cfg.optim
        self.optimizer = torch.optim.AdamW(
            params, lr=o.lr, betas=o.betas, weight_decay=o.weight_decay
        )
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, self._lr_factor)
        self.step_count = 0
        self.last_rollout: Rollout | None = None
        self.consumed: list[int] = []  # manifest indices drawn in the current step
        self.eval_outputs: list = []  # (output, prompt, reward) of the last eval on this rank
        self.counters = {"faults/nonfinite_reward_steps": 0, "faults/nonfinite_loss_steps": 0}
        from mmyatt.placement.runner import Placement

        # which cores each phase runs on (placement.*), which records each call generates
        self.placement = Placement(
            cfg, dist, shard, streams_finished=capable(self.policy, TokenPolicy)
        )
        if cfg.model.ema_decay is not None:
            require(policy, EMA, f"model.ema_decay={cfg.model.ema_decay}")
        if cfg.algorithm.kl_coef > 0:
            a = cfg.algorithm
            why = f"algorithm.kl_coef={a.kl_coef} with kl_estimator={a.kl_estimator}"
            require(policy, ClosedFormKL if self._closed_form_kl else ReferenceKL, why)
            self.engine.enable_reference(policy)
        if getattr(reward, "reads_latents", False):  # every reward reads latents: no decode
            require(policy, LatentOutputs, "rewards that read latents (flow models only)")
            policy.decode_outputs = False

    @property
    def _closed_form_kl(self) -> bool:
        a = self.cfg.algorithm
        nft = a.name == "diffusion_nft"  # its KL is on velocities (models/flow_nft.py)
        return not nft and a.kl_coef > 0 and a.kl_estimator in alg.CLOSED_FORM_KL

    # ------------------------------------------------------------------ the step
    def step(self) -> dict[str, float]:
        """One RL step on this rank; returns globally reduced metrics."""
        # the state before the step's first draw: what a checkpoint holds when the step
        # fails before its update (a judge that stays down; see `call_reward`)
        self.step_start_local = self.local_state()
        out = self._step()
        out.update(self.placement.end_step())
        self.step_count += 1  # counts skipped steps too: it is the loop's step number
        return out

    def _step(self) -> dict[str, float]:
        timer = PhaseTimer()
        self.consumed = []
        self.last_rollout = None  # a skipped step logs no rollout
        rollout, dyn = self.collect(timer)  # generate + reward (+ DAPO refill rounds)
        if rollout is None:  # every group everywhere had equal rewards
            return {**dyn, **timer.metrics()}
        if self.dist.any(not torch.isfinite(rollout.rewards).all()):
            self.counters["faults/nonfinite_reward_steps"] += 1
            if self.cfg.reward.nonfinite == "fail":
                raise FloatingPointError("non-finite reward in this step (reward.nonfinite=fail)")
            return {**dyn, **timer.metrics(), "step/skipped_nonfinite_reward": 1.0}
        with timer("advantage"):
            rollout.advantages = self.advantages(rollout)
        # placement.balance: samples re-partitioned over the controllers (token tensors move)
        train, bal = self.placement.balance(rollout, timer, self.policy)
        with timer("logprob"):
            train = self.old_and_reference_logprobs(train)
        with timer("update"):
            upd = self.update(train)
            if self.nft is not None:  # the sampling policy trails the trained one
                upd["nft/old_decay"] = self.nft.update_old(self.step_count + 1)
        self.last_rollout = rollout if bal else train  # this rank's own samples
        return {
            **rollout_metrics(rollout, self.dist, self.policy),
            **dyn,
            **upd,
            **bal,
            **timer.metrics(),
        }

    # ------------------------------------------------------------------ phases
    def collect(self, timer: PhaseTimer) -> tuple[Rollout | None, dict]:
        """Generate and score this rank's prompts; with dynamic sampling, refill until the
        global batch holds ``prompts_per_step`` groups with non-zero reward variance."""
        a = self.cfg.algorithm
        target = self.cfg.data.prompts_per_step
        kept: list[Rollout] = []
        candidate_groups = dropped_groups = rounds = 0
        reward_sum = samples_scored = 0.0
        while True:
            # draw, generate, then score (how: placement.mode; partial streams groups to the
            # judge; rollout.over_dispatch_ratio > 1 dispatches more and keeps the rest)
            scored = self.placement.generate_and_score(
                self,
                self.local_prompts,
                train_sampling(self.cfg, self.step_count, nft=self.nft is not None),
                timer,
            )
            last_scored = scored  # gives an empty rollout its shapes if no group is kept
            reward_sum += float(scored.rewards.sum())
            samples_scored += len(scored)
            survivors: Rollout | None = scored
            if a.dynamic_sampling:
                survivors, n_drop = self.drop_zero_variance_groups(scored)
                dropped_groups += n_drop
            if survivors is not None:
                kept.append(survivors)
                candidate_groups += len(survivors.group_slices())
            global_groups = int(self.dist.sum(candidate_groups).item())
            if not a.dynamic_sampling or global_groups >= target or rounds >= a.max_refill_rounds:
                break
            rounds += 1
        counts = self.dist.gather_ints(candidate_groups)
        quota = alg.allocate_quota(counts, target)[self.dist.rank]
        # a rank may keep no group while others do: it still takes part in every collective
        # of the step, with an empty (N = 0) rollout of the right shapes
        rollout = first_groups(kept or [last_scored], quota)
        total = self.dist.sum_many(
            {
                "kept_groups": quota,
                "dropped_groups": dropped_groups,
                "candidate_groups": candidate_groups,
                "reward_sum": reward_sum,
                "samples_scored": samples_scored,
            }
        )
        # every generated sample, before dynamic-sampling filters: the learning curve
        dyn = {
            "reward/generated_mean": total["reward_sum"] / max(total["samples_scored"], 1.0),
            "dynamic/refill_rounds": float(rounds),
        }
        if a.dynamic_sampling:
            dyn.update(
                {
                    "dynamic/kept_groups": total["kept_groups"],
                    "dynamic/dropped_groups": total["dropped_groups"],
                    # candidates beyond the quota (refill overshoot)
                    "dynamic/discarded_groups": total["candidate_groups"] - total["kept_groups"],
                }
            )
        if int(self.dist.sum(quota).item()) == 0:
            return None, dyn
        return rollout, dyn

    def generate(self, records: list[dict], sampling: Sampling) -> Rollout:
        redraw, base = self.cfg.rollout.redraw_carried, self.cfg.trainer.seed
        seeds = [record_seed(base, r, redraw) for r in records]
        with self.nft.sampling() if self.nft is not None else nullcontext():
            return self.policy.generate(records, self.cfg.sampling.group_size, sampling, seeds)

    def call_reward(self, outputs, records, prompt_ids):
        """``self.reward``; a judge that stays down past its client's retry budget stops
        every controller at the same point (all raise JudgeError), none is left waiting
        in a collective."""
        from mmyatt.rewards.judge_client import JudgeError

        error = None
        try:
            out = self.reward(outputs, records, prompt_ids)
        except JudgeError as e:
            error, out = e, None
        self.agree_on_judge_error(error)
        return out

    def agree_on_judge_error(self, error: BaseException | None) -> None:
        from mmyatt.rewards.judge_client import JudgeError

        if self.dist.any(error is not None):
            if error is not None:
                raise error
            raise JudgeError("the judge calls of another controller failed (see its error)")

    def score(self, r: Rollout, scored=None) -> Rollout:
        """Rewards of ``r``; ``scored``: its (rewards, parts), already computed (placement
        partial scores each chunk as it is generated)."""
        if scored is None:
            scored = self.call_reward(r.outputs, r.records, r.prompt_ids)
        rewards, parts = scored
        a = self.cfg.algorithm
        if a.overlong == "penalty":
            lengths = r.mask.sum(1).long()
            pen = alg.overlong_penalty(
                lengths, self.cfg.sampling.max_new_tokens, a.overlong_buffer, a.overlong_penalty
            )
            parts = {**parts, "overlong_penalty": pen}
            rewards = rewards + pen
        r.rewards, r.reward_parts = rewards.float(), parts
        if isinstance(self.reward, RewardMixture):  # the judges' answers, for the rollout log
            r.verdicts = self.reward.last_verdicts
        return r

    def drop_zero_variance_groups(self, r: Rollout) -> tuple[Rollout | None, int]:
        index = group_index(r)
        keep = alg.group_has_variance(r.rewards, index)
        # non-finite rewards must reach the skip check in `step`, so such groups stay
        keep[index[~torch.isfinite(r.rewards)]] = True
        idx = [i for i, g in enumerate(index.tolist()) if keep[g]]
        n_drop = int((~keep).sum())
        return (r.select(idx) if idx else None), n_drop

    def advantages(self, r: Rollout) -> torch.Tensor:
        a = self.cfg.algorithm
        reduce = self.dist.sum if self.dist.active else None
        kw = (
            {"std_mode": a.advantage_std, "clip": a.advantage_clip} if a.advantage == "grpo" else {}
        )
        return alg.compute_advantages(a.advantage, r.rewards, group_index(r), reduce=reduce, **kw)

    def old_and_reference_logprobs(self, r: Rollout) -> Rollout:
        a = self.cfg.algorithm
        if self.nft is not None:  # NFT: no log-probs, its KL is on velocities
            return r
        micro = a.micro_batch_tokens > 0  # every rank joins each pass's micro-batch count
        if len(r) == 0 and not micro:
            if self.engine.lockstep:  # sharded: all join
                self.engine.idle_logprob_passes(self.policy, a, self._closed_form_kl)
            return r
        with torch.no_grad():
            if a.recompute_old_logprobs:
                r.logprobs = self._in_micro_batches(self.policy.logprobs, r)
            if self._closed_form_kl:  # the reference's transition means, into the context
                if len(r):
                    r = self.policy.attach_reference_means(r)
                elif self.engine.lockstep:
                    self.engine.idle_reference_means(self.policy)
            elif a.kl_coef > 0:
                r.ref_logprobs = self._in_micro_batches(self.policy.reference_logprobs, r)
        if a.overlong == "filter" and r.truncated is not None:
            r.mask = alg.overlong_filter_mask(r.mask, r.truncated)
        return r

    def _micro_parts(self, r: Rollout | None) -> list[list[int]]:
        budget = self.cfg.algorithm.micro_batch_tokens
        return micro_parts(r, budget, self.dist, self.engine.lockstep)

    def _in_micro_batches(self, fn, r: Rollout) -> torch.Tensor:
        idle = partial(self.engine.idle_rollout, self.policy) if self.engine.lockstep else None
        return in_micro_batches(fn, r, self._micro_parts(r), idle)

    def update(self, r: Rollout) -> dict[str, float]:
        """PPO epochs x minibatches; each minibatch is one optimizer step on every rank."""
        a = self.cfg.algorithm
        sums: dict[str, float] = {}
        steps = skipped = 0
        for _ in range(a.ppo_epochs):
            for mb in self.placement.minibatches(r, a.minibatches):
                stats = self._minibatch_step(mb)
                if stats is None:
                    skipped += 1
                    continue
                steps += 1
                for k, v in stats.items():
                    sums[k] = sums.get(k, 0.0) + v
        # the gradients are not needed again before the next update: on a GPU their
        # memory (the size of the trained weights) is free for generation and the judge
        self.optimizer.zero_grad(set_to_none=True)
        out = {k: v / max(steps, 1) for k, v in sums.items()}
        out["train/optimizer_steps"] = float(steps)
        out["train/lr"] = self.scheduler.get_last_lr()[0]
        if skipped:
            self.counters["faults/nonfinite_loss_steps"] += 1
            out["step/skipped_nonfinite_loss_minibatches"] = float(skipped)
        return out

    def _minibatch_step(self, mb: Rollout | None) -> dict[str, float] | None:
        a = self.cfg.algorithm
        self.optimizer.zero_grad(set_to_none=True)
        # the same keys on every rank, whether or not this rank has samples in this minibatch
        local = dict.fromkeys(
            ("tokens", "den", "num", "entropy", "clip_frac", "ratio_mean", "approx_kl", "kl"), 0.0
        )
        num = None
        if self.nft is not None:
            num = self._nft_terms(mb, local)
        elif a.micro_batch_tokens > 0:  # gradients accumulate over micro-batches
            args = (self._micro_parts(mb), a, self._closed_form_kl, local)
            if not micro_backward(self.policy, mb, *args, self.dist, self.engine):
                return {}
        elif mb is not None and len(mb):
            num = pg_terms(self.policy, mb, a, self._closed_form_kl, local)
        if num is None and self.engine.lockstep and a.micro_batch_tokens <= 0:  # all join
            num = self.engine.zero_weight_loss(self.policy)
        g = self.dist.sum_many(local)
        if g["den"] <= 0:
            return {}
        if num is not None:
            (num / g["den"]).backward()
        grad_norm = self.engine.reduce_and_clip(self.params, self.cfg.optim.grad_clip)
        if self.dist.any(not (math.isfinite(g["num"]) and torch.isfinite(grad_norm))):
            self.optimizer.zero_grad(set_to_none=True)  # never apply a NaN/inf update
            return None
        self.optimizer.step()
        self.scheduler.step()
        if capable(self.policy, EMA) and self.cfg.model.ema_decay is not None:
            self.policy.ema_update(self.cfg.model.ema_decay)
        tok = max(g["tokens"], 1.0)
        out = {"train/loss": g["num"] / g["den"], "train/grad_norm": float(grad_norm)}
        for k in ("entropy", "clip_frac", "ratio_mean", "approx_kl"):
            out[f"train/{k}"] = g[k] / tok
        if a.kl_coef > 0:
            out["train/kl"] = g["kl"] / tok
        if "micro_batches" in g:  # summed over the controllers
            out["train/micro_batches"] = g["micro_batches"]
        for k in g:
            if k.startswith("nft/"):
                out[k] = g[k] / tok
        return out

    def _nft_terms(self, mb: Rollout | None, local: dict):
        """DiffusionNFT's numerator (sum of per-sample losses) and counts into ``local``;
        the same keys on every rank, with or without samples."""
        a = self.cfg.algorithm
        for k in ("positive", "negative", "old_deviation", "r_mean"):
            local[f"nft/{k}"] = 0.0
        samples = None  # sharded forwards: every rank runs the fullest rank's row count
        if self.engine.lockstep:
            samples = max(self.dist.gather_ints(0 if mb is None else len(mb)))
        idle = mb is None or not len(mb)
        if idle:
            if samples is None:
                return None
            mb = self.engine.idle_rollout(self.policy)  # zero-weight pass on the filler
        rows, stats = self.nft.loss(
            mb,
            self.step_count,
            kl_coef=a.kl_coef,
            kl_block=a.kl_block,
            reference=self.nft.reference_fn() if a.kl_coef > 0 else None,
            samples=samples,
        )
        if idle:
            return rows.sum() * 0.0
        n = float(len(mb))
        local.update({"tokens": n, "den": n, "num": float(rows.detach().sum())})
        for k in ("positive", "negative", "old_deviation", "r_mean"):
            local[f"nft/{k}"] = float(stats[k]) * n
        if "kl" in stats:
            local["kl"] = float(stats["kl"]) * n
        return rows.sum()

    # ------------------------------------------------------------------ run state
    def shared_state(self) -> dict:
        """State identical on every controller: weights, optimizer, schedule, step, counters."""
        from mmyatt.checkpoint.checkpointer import scheduler_state

        ema = self.policy.ema_state() if capable(self.policy, EMA) else None
        return {
            "model": self.engine.model_state(self.policy),
            "optimizer": self.engine.optimizer_state(self.policy, self.optimizer),
            "scheduler": scheduler_state(self.scheduler),
            "step": self.step_count,
            "counters": dict(self.counters),
            "ema": ema,
            "nft_old": None if self.nft is None else self.nft.state_dict(),
        }

    def local_state(self) -> dict:
        """This controller's own state: its data cursor and RNG streams."""
        from mmyatt.checkpoint.checkpointer import rng_state

        local = {"cursor": self.shard.state_dict(), "rng": rng_state()}
        local.update(self.placement.state_dict())  # carried prompts, auto's measurements
        return local

    def load_state(self, shared: dict, local: dict) -> int:
        from mmyatt.checkpoint.checkpointer import load_scheduler_state, set_rng_state

        self.engine.load_model_state(self.policy, shared["model"])
        self.engine.load_optimizer_state(self.policy, self.optimizer, shared["optimizer"])
        load_scheduler_state(self.scheduler, shared["scheduler"])
        self.step_count = int(shared["step"])
        self.counters.update(shared["counters"])
        if shared.get("ema") is not None:
            require(self.policy, EMA, "a checkpoint with EMA weights")
            self.policy.load_ema_state(shared["ema"])
        if self.nft is not None and shared.get("nft_old") is not None:
            self.nft.load_state_dict(shared["nft_old"])
        self.shard.load_state_dict(local["cursor"])
        self.placement.load_state_dict(local)
        set_rng_state(local["rng"])
        return self.step_count

    # ------------------------------------------------------------------ evaluation
    def evaluate(self) -> dict[str, float]:
        """Held-out prompts, one sample each; this rank scores its own share. Greedy by
        default; with trainer.eval_sampling=sample, sampled at the training temperature
        (greedy accuracy saturates early and hides learning) plus a greedy pass."""
        out = self._evaluate(eval_sampling(self.cfg), "eval/reward")
        if self.cfg.trainer.eval_sampling == "sample":
            greedy = self._evaluate(eval_sampling(self.cfg, greedy=True), "eval/greedy")
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
        recs = self.eval_records
        # a rank may hold no eval records while others do: it still joins every collective
        if not self.dist.any(bool(recs)):
            return {}
        from mmyatt.rewards.judge_client import JudgeError

        names = list(getattr(self.reward, "names", []))
        # the same groups on every rank, for the all-reduce
        tasks = self.dist.union(x["task"] for x in recs if x.get("task"))
        by_task = [f"{g}/{t}" for g in ("heldout", "seen") for t in tasks] if len(tasks) > 1 else []
        groups = ("all", "heldout", "seen", *by_task)
        sums = {f"{g}/{k}": 0.0 for g in groups for k in ("total", "count", *names)}
        quality = {"background_hf": 0.0, "background_n": 0.0, "object_hf": 0.0, "object_n": 0.0}
        shown = []
        bs = 64
        ema = capable(self.policy, EMA) and self.cfg.model.ema_decay is not None
        salt = "eval" if self.cfg.data.eval_split == "test" else "val"
        error = None
        with torch.no_grad(), self.policy.ema_weights() if ema else nullcontext():
            for i in range(0, len(recs), bs):
                chunk = recs[i : i + bs]
                seeds = [prompt_seed(self.cfg.trainer.seed + 1, salt, x["_index"]) for x in chunk]
                out = self.policy.generate(chunk, 1, s, seeds)
                try:  # ranks may hold different numbers of chunks: agree after the loop
                    rewards, parts = self.reward(out.outputs, out.records, out.prompt_ids)
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
                if self._visual(out.outputs):
                    from mmyatt.rewards.quality import texture_metrics

                    for k, (total, n) in texture_metrics(out.outputs).items():
                        quality[k] += total
                        quality[k.replace("_hf", "_n")] += n
                shown += [
                    (o, x.get("prompt"), float(v))
                    for o, x, v in zip(out.outputs, out.records, rewards)
                ]
        self.agree_on_judge_error(error)
        self.eval_outputs = shown
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

    @staticmethod
    def _visual(outputs: list) -> bool:
        from PIL import Image

        first = outputs[0] if outputs else None
        if isinstance(first, list) and first:
            first = first[0]
        return isinstance(first, Image.Image)

    # ------------------------------------------------------------------ metrics and helpers
    def _lr_factor(self, step: int) -> float:
        """The shared schedule (mmyatt/step/lr_schedule.py): linear warm-up over
        ``optim.warmup_steps``, then constant, or a cosine to 0 at ``trainer.steps``."""
        o, total = self.cfg.optim, max(self.cfg.trainer.steps, 1)
        floor = 0.0 if o.schedule == "cosine" else 1.0
        return cosine_factor(step, total, warmup=o.warmup_steps, floor=floor)

    def trace_records(self, step: int) -> None:
        """Append which manifest records this step drew (the audit trail for faults)."""
        path = self.run_dir / "rollouts" / f"records_rank{self.dist.rank}.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("a") as f:
            f.write(json.dumps({"step": step, "records": self.consumed}) + "\n")

    def truncate_trace(self, step: int) -> None:
        path = self.run_dir / "rollouts" / f"records_rank{self.dist.rank}.jsonl"
        if path.exists():
            rows = [x for x in path.read_text().splitlines() if x.strip()]
            path.write_text("".join(x + "\n" for x in rows if json.loads(x)["step"] <= step))
        truncate_rollouts(self.run_dir, self.dist.rank, step)

    def save_rollouts(self, step: int, r: Rollout) -> None:
        """The rollout log (mmyatt/outputs/rollout_log.py, docs/rollout_logs.md); rank 0's rows also
        go to the trackers' rollout table."""
        cap = self.cfg.trainer.rollouts_per_step
        rows = write_rollouts(self.run_dir, self.dist.rank, step, r, cap)
        self.logger.log_rollouts(step, rows)
