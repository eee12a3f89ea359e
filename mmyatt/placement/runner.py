"""The placement modes inside a controller's step.

``Controller.collect`` hands generation and scoring of each batch of records to
``Placement.generate_and_score``; ``Controller.step`` calls ``Placement.end_step`` after
the update. Per mode:

- shared: generate, then score, nothing pinned (the behaviour before placement existed).
- colocate: every controller generates on all cores (threads = cores / controllers);
  all wait for the slowest; the judge wakes (its weights reloaded if they were dropped)
  and scores on every core while the controllers wait; its weights are dropped again;
  training takes every core.
- partial: controllers generate on the rollout cores while the judge serves on the
  judge cores; each sample (each prompt group, for rewards that compare a group's
  samples) goes to the judge as it finishes (a background thread sends it), so judging
  overlaps generation; training then takes every core. The judge keeps its weights (on
  CPU an idle judge uses no core), or with ``placement.partial_release_judge`` drops them
  while training runs and reloads them when the next partial step starts.
- auto: one of the above per step, chosen by ``AutoPlacer`` from measured costs.

Every mode scores the same samples with the same seeds: generation is seeded per prompt
and the judge answers each sample on its own, so the rewards do not depend on the mode
(tests/test_placement_modes.py). Only rank 0 talks to the judges; every decision is
computed from all-reduced measurements, so all controllers take the same one.
"""

from __future__ import annotations

import os
import time
from dataclasses import replace

from mmyatt.placement import config
from mmyatt.placement import resources as res
from mmyatt.placement.auto import AutoPlacer, Measure
from mmyatt.placement.config import (
    CorePlan,
    candidate_plans,
    partial_split,
    plan_for,
    run_cores,
    work_key,
)
from mmyatt.placement.dispatch import OverDispatch
from mmyatt.placement.judge_threads import JudgeThreads
from mmyatt.placement.merged import partial_merged
from mmyatt.placement.stream import (
    FIELDS,
    JudgeStream,
    finished_unit,
    in_row_order,
)
from mmyatt.rollout import Rollout


class Placement:
    def __init__(self, cfg, dist, shard=None, log=print, streams_finished: bool = False):
        p = cfg.placement
        self.cfg, self.dist, self.mode = cfg, dist, p.mode
        # processes that train: a Megatron model-parallel group (train.tensor_parallel /
        # pipeline_parallel > 1) is one controller of several processes; only its first
        # rank generates and scores (mmyatt/engines/megatron_group.py)
        self.group = dist.model_parallel
        self.train_procs = dist.processes
        ro = cfg.rollout
        # which records each generate call gets (rollout.over_dispatch_ratio; dispatch.py)
        self.dispatch = OverDispatch(
            ro.over_dispatch_ratio, shard, reuse=ro.reuse_unused_prompts, max_carries=ro.max_carries
        )
        self.log = log if dist.is_main else (lambda *a, **k: None)
        # partial sends each sample (or prompt group) to the judge the moment it finishes,
        # from inside one generate call (the policy's ``streams_finished``: text and VLM
        # adapters); otherwise (flow models, vLLM, over-dispatch) it generates chunks of
        # placement.stream_groups groups, one call each, and sends each chunk
        self.streams = streams_finished and not self.dispatch.active
        # placement.merge_rollout (checked in config): in partial steps the first
        # controller generates every controller's groups in one batch
        self.merge = p.merge_rollout and dist.world_size > 1 and not dist.model_parallel
        self.has_judge = any(f.name == "genrm" for f in cfg.reward.functions) and bool(
            cfg.reward.judge.model or cfg.reward.judge.urls
        )
        self.exchange = None  # placement.balance with more than one controller
        if p.balance and dist.world_size > 1:
            from mmyatt.placement.exchange import Exchange

            self.exchange = Exchange(dist, cfg.model.kind)
        self._balanced = False
        self.judges = None
        if dist.is_main and self.has_judge and (p.mode != "shared" or p.log_memory):
            # shared mode only reads the judges' counters (CPU, busy time, memory)
            from mmyatt.placement.judges import JudgeControl

            j = cfg.reward.judge
            key = os.environ.get(j.api_key_env) if j.api_key_env else None
            self.judges = JudgeControl(j.urls, api_key=key)
        self.plan: CorePlan | None = plan_for(cfg)
        # colocate's judge threads: set, or measured (placement.judge_threads=-1)
        self.colocate_threads = JudgeThreads(p.judge_threads, len(run_cores(p)), p.profile_steps)
        self.auto = None
        if p.mode == "auto":
            cores = run_cores(p)
            start = None
            if len(cores) >= 2:
                r, _ = partial_split(p, len(cores))
                start = next(
                    c for c in candidate_plans(cfg) if c.mode == "partial" and len(c.rollout) == r
                )
            groups = max(1, cfg.data.prompts_per_step // max(1, dist.world_size))
            self.auto = AutoPlacer(
                candidate_plans(cfg),
                has_judge=self.has_judge,
                start_partial=start,
                profile=p.profile_steps,
                every=p.reevaluate_every,
                drift_threshold=p.drift_threshold,
                profile_all=p.profile_all_modes,
                explore_margin=p.explore_margin,
                judge_threads=self.judge_threads,
                # partial's judge calls per step
                chunks=(groups * (dist.world_size if self.merge else 1))
                if self.streams
                else -(-groups // p.stream_groups),
                widen=p.widen_judge,
                partial_reload=p.partial_release_judge and self.has_judge,
                shared_cores=dist.processes * cfg.trainer.threads,
                work=work_key(cfg),
            )
        self.offload = None  # placement.offload_policy: made at the first colocate step
        self.judge_plan: tuple | None = None  # (cores, threads) the judge was last given
        # a pinned plan (colocate, partial) ran since the last shared step: shared must
        # put the processes back; a run starts as shared leaves it (nothing pinned)
        self._pinned = False
        self.predicted: float | None = None
        self._in_step = False
        self._acc: dict[str, float] = {}
        self._peaks: dict[str, float] = {}

    def state_dict(self) -> dict:
        """This controller's placement state for its checkpoint: the prompts carried to
        the next step (over-dispatch) and what auto has measured."""
        out: dict = {}
        if self.dispatch.active:
            out["carried"] = self.dispatch.state_dict()
        if self.auto is not None:
            out["auto"] = self.auto.state_dict()
        out.update(self.colocate_threads.checkpoint_entry())  # when it measures
        return out

    def load_state_dict(self, local: dict) -> None:
        self.dispatch.load_state_dict(local.get("carried", []))
        self.colocate_threads.load_state_dict(local.get("judge_threads"))
        if self.auto is not None and (line := self.auto.load_state_dict(local.get("auto"))):
            self.log(f"[placement] {line}", flush=True)

    def judge_threads(self, plan: CorePlan | None) -> int:
        """The judge's torch threads (over all its servers) when ``plan`` runs."""
        j = self.cfg.reward.judge
        if plan is None or plan.mode == "shared":
            return j.threads * max(1, j.num_servers)
        if plan.mode == "colocate":
            return self.colocate_threads.current()
        return len(plan.judge)

    # ------------------------------------------------------------------ step bookkeeping
    def _begin_step(self) -> None:
        self._in_step = True
        self._acc = {"gen_s": 0.0, "reward_s": 0.0, "wait_s": 0.0, "chunks": 0.0}
        self._acc.update(cut=0.0, scored=0.0)  # samples cut by the token budget, scored
        self._peaks = {}
        self._t0 = time.perf_counter()
        self._cpu0 = res.cpu_seconds()
        self._judge0 = self._judge_stats()
        if self.auto is not None:
            self.plan, line = self.auto.next_plan()
            if self.group:  # a group's ranks sum other measurements: global rank 0 decides
                self.plan = self.dist.broadcast_object(self.plan)
            self.predicted = self.auto.predicted(self.plan)
            if line:
                self.log(f"[placement] {line}", flush=True)

    def _judge_stats(self) -> dict[str, float]:
        if self.judges is None:
            return {}
        return self.judges.stats()

    def _phase_start(self, judge_too: bool = True) -> None:
        if self.cfg.placement.log_memory:
            res.reset_peak_rss()
            res.reset_device_peak()
            if judge_too and self.judges is not None:
                self.judges.reset_peak()

    def _phase_end(self, name: str) -> None:
        """The phase's peak RSS, and on CUDA its peak device memory (the allocators'
        reserved bytes), of this controller plus the judge servers it drives."""
        if not self.cfg.placement.log_memory:
            return
        peak, dpeak = res.peak_rss_mb(), res.device_peak_mb()
        if self.judges is not None:
            s = self.judges.stats()
            peak += s["peak_rss_mb"]
            dpeak += s.get("device_peak_mb", 0.0)
        self._peaks[name] = max(self._peaks.get(name, 0.0), peak)
        self._peaks[f"device_{name}"] = max(self._peaks.get(f"device_{name}", 0.0), dpeak)

    def _place_judge(self, cores, threads) -> None:
        if self.judges is not None and self.judge_plan != (tuple(cores), threads):
            self.judges.place(cores, threads)
            self.judge_plan = (tuple(cores), threads)

    # ------------------------------------------------------------------ the modes
    def _generate(self, ctl, n: int, sampling, stream=None):
        """``n`` prompt groups: the next records (over-dispatched when
        rollout.over_dispatch_ratio > 1, then cut to the first ``n`` complete groups).
        ``stream``: (the ``on_finished`` callback for these records, its unit)."""
        d = self.dispatch
        records = d.draw(n)
        if d.active:
            must = d.must_finish(records)
            sampling = replace(sampling, complete_groups=n, must_finish=must)
        elif stream is not None:
            send, unit = stream
            sampling = replace(sampling, on_finished=send(records), finished_unit=unit)
        r = ctl.generate(records, sampling)
        r, used = d.select(r, records, n, sampling.max_new_tokens)
        ctl.consumed += [rec["_index"] for rec in used]
        return r

    def generate_and_score(self, ctl, n, sampling, timer):
        """Generate ``n`` prompt groups on this rank and score them, as the mode says."""
        if not self._in_step:
            self._begin_step()
        plan = self.plan
        if plan is None or plan.mode == "shared":  # shared (auto may choose it too)
            if plan is not None:
                self._unpin(plan)
            self._phase_start()
            t0 = time.perf_counter()
            with timer("generate"):
                r = self._generate(ctl, n, sampling)
            self._acc["gen_s"] += time.perf_counter() - t0
            self._phase_end("generate")
            self._phase_start()
            with timer("reward"):
                r = ctl.score(r)
            self._phase_end("judge")
            self._phase_start()
        elif plan.mode == "partial":
            r = self._partial(ctl, n, sampling, timer, plan)
        else:
            r = self._colocate(ctl, n, sampling, timer, plan)
        self._collect_end = time.perf_counter()
        self._acc["scored"] += len(r)
        if getattr(r, "truncated", None) is not None:
            self._acc["cut"] += float(r.truncated.sum())
        return r

    def _unpin(self, plan: CorePlan) -> None:
        """Shared under auto: every process back on all the run's cores with the thread
        counts of shared mode (trainer.threads, reward.judge.threads), the judge awake.
        Only after a pinned plan: a shared step after a shared step (or at the start)
        finds everything as shared mode has it, and makes no affinity or judge call, so
        auto running shared runs the fixed shared arm's step."""
        if not self._pinned:
            return
        self._pinned = False
        res.pin_process(plan.cores)
        res.set_threads(self.cfg.trainer.threads)
        if self.judges is not None:  # placed before it reloads (see _partial)
            self._place_judge(plan.cores, self.judge_threads(plan))
            self.judges.wake()  # a no-op unless colocate dropped the weights

    def _offload(self, ctl):
        """placement.offload_policy: this controller's PolicyOffload (placement/offload.py),
        made at its first colocate step; None when not asked for."""
        if not self.cfg.placement.offload_policy:
            return None
        if self.offload is None:
            from mmyatt.placement.offload import PolicyOffload

            self.offload = PolicyOffload(ctl.policy.module(), ctl.optimizer)
        return self.offload

    def _colocate(self, ctl, n, sampling, timer, plan: CorePlan):
        P = self.dist.world_size
        if self.judges is not None and self.cfg.placement.release_judge:
            self.judges.sleep()  # the first colocate step (or one after partial/shared)
        self._pinned = True
        off = self._offload(ctl)
        if off is not None:
            with timer("policy_offload"):  # generation needs the weights only
                off.optimizer_off()
        self._phase_start()
        res.use_cores(plan.rollout, sharers=P)
        t0 = time.perf_counter()
        with timer("generate"):
            r = self._generate(ctl, n, sampling)
        self._acc["gen_s"] += time.perf_counter() - t0
        with timer("wait"):  # the long tail: the judge phase starts when all have generated
            t0 = time.perf_counter()
            self.dist.barrier()
            self._acc["wait_s"] += time.perf_counter() - t0
        self._phase_end("generate")
        if off is not None:
            with timer("policy_offload"):  # the judge's phase: the policy waits off the device
                off.weights_off()
        # the controllers keep their freed heap: handing it back (malloc_trim) lowered no
        # measured peak and made the update that follows re-fault its pages, 0.6 s of a
        # 5 s flow step (the GenRM image recipe, colocate, 2026-12-02)
        try:
            self._phase_start()
            if self.judges is not None:
                self._place_judge(plan.judge, self.judge_threads(plan))
                if self.cfg.placement.release_judge:
                    with timer("judge_reload"):
                        self.judges.wake()
            t0 = time.perf_counter()
            with timer("reward"):
                r = ctl.score(r)
            self.dist.barrier()  # every controller's requests answered: the judge phase ends
            self._acc["reward_s"] += time.perf_counter() - t0
            self._phase_end("judge")
            if self.judges is not None and self.cfg.placement.release_judge:
                with timer("judge_release"):
                    self.judges.sleep()
        finally:  # the policy back on its device, whatever the judge's phase did
            if off is not None:
                with timer("policy_reload"):
                    off.on()
        self._phase_start()
        res.use_cores(plan.train, sharers=self.train_procs)
        return r

    def _partial(self, ctl, n, sampling, timer, plan: CorePlan):
        P = self.dist.world_size
        G = self.cfg.sampling.group_size
        self._pinned = True
        self._phase_start()
        if self.judges is not None:
            # placed, then woken: weights reloaded on 2 threads and 2 cores before the judge
            # was moved to 1 core and 1 thread made its next model calls 8x slower (1.04 s
            # against 0.13 s in the first partial step after colocate, drifting bench)
            self._place_judge(plan.judge, len(plan.judge))
            with timer("judge_reload"):  # a no-op unless colocate or partial_release_judge
                self.judges.wake()  # dropped the weights
        res.use_cores(plan.rollout, sharers=P)

        def judge(outputs, records, ids):
            out = ctl.reward(outputs, records, ids)
            return out, list(getattr(ctl.reward, "last_verdicts", None) or [])

        if self.merge:
            return partial_merged(self, ctl, n, sampling, timer, plan, judge)
        stream = JudgeStream(judge, self.cfg.placement.stream_max_samples)
        t0 = time.perf_counter()
        try:
            with timer("generate"):
                if self.streams:  # each sample (or group) as it finishes
                    sends = (lambda recs: stream.on_finished(recs, G), finished_unit(ctl.reward))
                    r = self._generate(ctl, n, sampling, stream=sends)
                    stream.send_unreported(r)
                else:  # chunks of placement.stream_groups groups, one generate call each
                    k, parts = self.cfg.placement.stream_groups, []
                    for chunk in [min(k, n - i) for i in range(0, n, k)]:
                        part = self._generate(ctl, chunk, sampling)
                        start = sum(len(p) for p in parts)
                        parts.append(part)
                        stream.send(
                            range(start, start + len(part)), *(getattr(part, f) for f in FIELDS)
                        )
                    r = Rollout.concat(parts)
            self._acc["gen_s"] += time.perf_counter() - t0
            if self.has_judge and self.cfg.placement.widen_judge:
                self._widen_judge(plan, timer)
            stream.finish()  # the rest in one call (on every core, widened)
            t1 = time.perf_counter()
            with timer("reward"):  # what is left of judging once generation is done
                results, error = stream.results()
            self._acc["reward_s"] += time.perf_counter() - t1
        finally:
            stream.close()
        self._acc["chunks"] += len(results)
        self._agree(ctl, error)
        scored, verdicts = in_row_order(results)
        return self._scored(ctl, r, scored, verdicts, plan, timer)

    def _agree(self, ctl, error) -> None:
        """Every controller raises if any one's judge calls failed (a collective)."""
        from mmyatt.rewards.judge_client import JudgeError

        if error is not None and not isinstance(error, JudgeError):
            raise error
        ctl.agree_on_judge_error(error)

    def _scored(self, ctl, r, scored, verdicts, plan: CorePlan, timer):
        r = ctl.score(r, scored=scored)
        if verdicts and hasattr(r, "verdicts"):
            r.verdicts = verdicts
        self._phase_end("generate")
        if self.cfg.placement.partial_release_judge and self.has_judge:
            with timer("wait"):  # every controller holds its rewards: the judge may sleep
                t0 = time.perf_counter()
                self.dist.barrier()
                self._acc["wait_s"] += time.perf_counter() - t0
            if self.judges is not None:  # training takes its memory too (on a GPU, its device)
                with timer("judge_release"):
                    self.judges.sleep()
        self._phase_start(judge_too=True)
        res.use_cores(plan.train, sharers=self.train_procs)
        return r

    def _widen_judge(self, plan: CorePlan, timer) -> None:
        """Partial, generation done on every controller: the rollout's cores would idle
        until the judge answers, so the judge takes them (every core of the run, one
        thread per core) for the calls still queued; the next step places it back. The
        call under way keeps its thread count (torch applies it per call)."""
        with timer("wait"):
            t0 = time.perf_counter()
            self.dist.barrier()  # the last controller has generated
            self._acc["wait_s"] += time.perf_counter() - t0
        self._place_judge(plan.cores, len(plan.cores))

    # ------------------------------------------------------------------ balancing
    def balance(self, r, timer, policy=None):
        """placement.balance: this rank's share of the step's samples after the
        Karmarkar-Karp exchange, and max/mean rank work before and after; else ``r``.
        A VLM's samples travel with their vision features (``policy.encode_media``)."""
        from mmyatt.step.batches import minibatches

        self._balanced = False
        if self.exchange is None:
            return r, {}
        if self.cfg.model.kind == "vlm":
            with timer("encode_media"):  # the frozen vision tower, once per prompt
                r = policy.encode_media(r)
        with timer("balance"):
            out, stats = self.exchange.balance(minibatches(r, self.cfg.algorithm.minibatches))
        self._balanced = True
        stats["placement/balance_moved"] = float(self.dist.sum(stats["placement/balance_moved"]))
        return (out if out is not None else r.select([])), stats

    def minibatches(self, r, m: int):
        """The step's minibatches: as the exchange left them when balanced, else m
        chunks of whole groups (mmyatt/step/batches.py)."""
        from mmyatt.step.batches import minibatches

        if self._balanced:
            return self.exchange.split(r)
        return minibatches(r, m)

    def end_step(self) -> dict:
        """Metrics of the step that just ended: placement/* (mode, split, phase times,
        per-role idle fractions, CPU use, per-phase peak RSS; auto's prediction)."""
        if not self._in_step:
            return {}
        self._in_step = False
        carry = self.dispatch.end_step()
        end = time.perf_counter()
        step_s = end - self._t0
        train_s = end - self._collect_end  # advantages, log-probs, update: every core
        self._phase_end("train")
        j1 = self._judge_stats()
        jd = {k: j1.get(k, 0.0) - self._judge0.get(k, 0.0) for k in j1}
        W = self.dist.world_size
        local = {
            "cpu_s": res.cpu_seconds() - self._cpu0,
            "judge_cpu_s": jd.get("cpu_s", 0.0),
            "judge_busy_s": jd.get("model_time_s", 0.0),
            "reload_s": jd.get("reload_s", 0.0),
            "gen_s": self._acc["gen_s"],
            "train_s": train_s,
            "offload_s": self.offload.take_seconds() if self.offload is not None else 0.0,
            "chunks": self._acc["chunks"],
            "cut": self._acc["cut"],
            "scored": self._acc["scored"],
        }
        for name, v in self._peaks.items():
            local[f"peak_{name}"] = v
        local = {k: local.get(k, 0.0) for k in sorted(set(local) | set(self._peak_keys()))}
        total = self.dist.sum_many(local)
        if self.group:  # every process's CPU, the model-parallel groups' other ranks too
            total["cpu_s"] = res.sum_over_processes(local["cpu_s"], self.dist.device)
        mx = {
            k: max(self.dist.gather_floats(v))
            for k, v in (
                ("step", step_s),
                ("gen", self._acc["gen_s"]),
                ("train", train_s),
                ("collect", self._collect_end - self._t0),
            )
        }
        cores = len(run_cores(self.cfg.placement)) if self.mode != "shared" else os.cpu_count()
        step = mx["step"]
        plan = self.plan
        out = {
            "placement/mode": plan.mode if plan else "shared",
            "placement/mode_id": float(config.MODE_IDS[plan.mode if plan else "shared"]),
            "placement/split": plan.split if plan else "shared",
            "placement/actual_step_s": step,
            "placement/gen_s": mx["gen"],
            "placement/rollout_s": mx["collect"],  # generate + judge, until all hold rewards
            "placement/train_s": mx["train"],
            "placement/judge_busy_s": total["judge_busy_s"],
            "placement/judge_reload_s": total["reload_s"],
            "placement/idle_frac_rollout": 1.0 - total["gen_s"] / W / step,
            "placement/idle_frac_train": 1.0 - total["train_s"] / W / step,
            "placement/cpu_util": (total["cpu_s"] + total["judge_cpu_s"]) / (cores * step),
        }
        out["placement/idle_frac_cores"] = 1.0 - out["placement/cpu_util"]
        threads = self.judge_threads(plan)
        if self.has_judge:
            n = max(1, self.cfg.reward.judge.num_servers)
            out["placement/idle_frac_judge"] = 1.0 - total["judge_busy_s"] / n / step
            out["placement/judge_threads"] = float(threads)
            if plan is not None and plan.mode == "colocate":
                ct, busy = self.colocate_threads, total["judge_busy_s"]
                if seen := ct.observe(threads, busy, total["scored"]):
                    self.log(f"[placement] {seen}", flush=True)
        peaks = {k[5:]: v for k, v in total.items() if k.startswith("peak_") and v > 0}
        device = {k[7:]: peaks.pop(k) for k in list(peaks) if k.startswith("device_")}
        for name, v in peaks.items():
            out[f"placement/peak_rss_mb_{name}"] = v
        if peaks:
            out["placement/peak_rss_mb"] = max(peaks.values())
        for name, v in device.items():  # on CUDA only (0, so left out, on the CPU)
            out[f"placement/peak_device_mb_{name}"] = v
        if device:
            out["placement/peak_device_mb"] = max(device.values())
        if self.offload is not None and self.offload.active:  # the moves, both ways
            out["placement/policy_offload_s"] = total["offload_s"] / W
        # judge calls per controller that calls the judge (merged: the first alone)
        callers = 1 if self.merge else W
        if plan is not None and plan.mode == "partial":
            out["placement/judge_calls"] = total["chunks"] / callers
            # 1: the first controller generated every controller's groups in one batch
            out["placement/rollout_merged"] = float(self.merge)
        if self.dispatch.active:
            out.update(self.dist.sum_many(carry))
        if self.auto is not None:
            if self.predicted is not None:
                out["placement/predicted_step_s"] = self.predicted
            m = Measure(
                mode=plan.mode,
                rollout_cores=self.auto.rollout_cores(plan),
                judge_cores=len(plan.judge),
                gen_s=mx["gen"],
                judge_s=total["judge_busy_s"],
                reload_s=total["reload_s"],
                train_s=mx["train"],
                collect_s=mx["collect"],
                step_s=step,
                chunks=int(total["chunks"] / callers),
                judge_threads=threads,
                cut_frac=total["cut"] / total["scored"] if total["scored"] else 0.0,
            )
            self.auto.observe(m)
        return out

    def _peak_keys(self) -> list[str]:
        if not self.cfg.placement.log_memory:
            return []
        phases = ("generate", "judge", "train")
        return [f"peak_{p}" for p in phases] + [f"peak_device_{p}" for p in phases]
