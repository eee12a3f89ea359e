"""The placement modes inside a controller's step.

The controller asks ``Placement.produce`` for a number of scored prompt groups; the
placement draws their records, generates them with the policy and scores them with the
step's ``Scorer``, as the mode in force says, and hands back a scored rollout. It is
given plain objects by ``mmyatt.step.builders`` and never sees the controller. Per mode:

- shared: generate, then score, nothing pinned (the behaviour before placement existed).
- colocate: every controller generates on all cores (threads = cores / controllers);
  all wait for the slowest; the judge wakes (its weights reloaded if they were dropped)
  and scores on every core while the controllers wait; its weights are dropped again;
  training takes every core.
- partial: controllers generate on the rollout cores while the judge serves on the
  judge cores; each sample (each prompt group, for rewards that compare a group's
  samples) goes to the judge as it finishes (a background thread sends it), so judging
  overlaps generation; training then takes every core. The judge keeps its weights (on
  CPU an idle judge uses no core), or with ``partial_release_judge`` drops them while
  training runs and reloads them when the next partial step starts. With ``merge`` the
  first controller generates every controller's groups in one batch.
- auto: one of the above per step, chosen by ``AutoPlacer`` from measured costs.

Every mode scores the same samples with the same seeds: generation is seeded per prompt
and the judge answers each sample on its own, so the rewards do not depend on the mode
(tests/test_placement_modes.py). Only rank 0 talks to the judges; every decision is
computed from all-reduced measurements, so all controllers take the same one.

Leaves out which cores each plan holds (``placement.config``), how auto chooses
(``placement.auto``) and the judge stream (``placement.stream``).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

from mmyatt.distributed import Dist
from mmyatt.outputs.metrics import PhaseTimer
from mmyatt.placement import config
from mmyatt.placement import resources as res
from mmyatt.placement.auto import AutoPlacer, Measure
from mmyatt.placement.config import CorePlan
from mmyatt.placement.dispatch import OverDispatch, record_seed
from mmyatt.placement.dispatch_balance import DispatchBalance
from mmyatt.placement.judge_threads import JudgeThreads
from mmyatt.placement.offload import PolicyOffload
from mmyatt.placement.stream import (
    FIELDS,
    JudgeStream,
    gather_records,
    in_row_order,
    rank_parts,
    scatter_parts,
)
from mmyatt.protocols import Sampling
from mmyatt.rollout import Rollout


@dataclass(frozen=True)
class PlacementSettings:
    """The knobs of ``placement.*`` a step reads (``mmyatt.config.schema.PlacementConfig``),
    and the run's sizes they need."""

    mode: str = "shared"
    group_size: int = 1
    seed: int = 0  # trainer.seed: the base of every record's generation seed
    redraw_carried: bool = False  # rollout.redraw_carried
    streams: bool = False  # partial sends each sample as it finishes (see Placement)
    merge: bool = False  # partial: the first controller generates for all (merge_rollout)
    has_judge: bool = False  # a GenRM term with a judge to place
    stream_groups: int = 1
    stream_max_samples: int = 0
    widen_judge: bool = True
    release_judge: bool = False
    partial_release_judge: bool = False
    log_memory: bool = False
    trainer_threads: int = 1  # torch threads of a controller in shared mode
    shared_judge_threads: int = 1  # the judge's threads in shared mode, over its servers
    judge_servers: int = 1
    run_cores: int = 1  # cores of the run (placement.cores, or every core)


class Placement:
    """``policy``: what generates (its ``generate`` seeded per record); ``scorer``: the
    step's rewards (``mmyatt.step.scoring.Scorer``); ``dispatch``: which records each
    generate call gets (over-dispatch, ``placement/dispatch.py``); ``plan``: the cores of
    a fixed mode (None: shared), or ``auto`` choosing one per step; ``judges``: the judge
    servers' control (rank 0 of a run with a judge), ``offload``: the policy's moves off
    the device in colocate steps (``placement.offload_policy``); ``dispatch_balance``: the records
    moved between the controllers before generation (``placement/dispatch_balance.py``)."""

    def __init__(
        self,
        settings: PlacementSettings,
        dist: Dist,
        *,
        policy,
        scorer,
        dispatch: OverDispatch,
        plan: CorePlan | None = None,
        auto: AutoPlacer | None = None,
        colocate_threads: JudgeThreads,
        judges=None,
        offload: PolicyOffload | None = None,
        dispatch_balance: DispatchBalance | None = None,
        log: Callable = print,
    ):
        self.s, self.dist, self.mode = settings, dist, settings.mode
        self.G = settings.group_size
        self.policy, self.scorer, self.dispatch = policy, scorer, dispatch
        self.dispatch_balance = dispatch_balance
        self.plan, self.auto, self.judges = plan, auto, judges
        # processes that train: a Megatron model-parallel group (train.tensor_parallel /
        # pipeline_parallel > 1) is one controller of several processes; only its first
        # rank generates and scores (mmyatt/engines/megatron_group.py)
        self.group = dist.model_parallel
        self.train_procs = dist.processes
        self.log = log if dist.is_main else (lambda *a, **k: None)
        self.has_judge = settings.has_judge
        # colocate's judge threads: set, or measured (placement.judge_threads=-1)
        self.colocate_threads = colocate_threads
        self._offload = offload  # made ready at the first colocate step
        self.offload: PolicyOffload | None = None
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
        return self.colocate_threads.for_plan(plan, self.s.shared_judge_threads)

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
        if self.s.log_memory:
            res.reset_peak_rss()
            res.reset_device_peak()
            if judge_too and self.judges is not None:
                self.judges.reset_peak()

    def _phase_end(self, name: str) -> None:
        """The phase's peak RSS, and on CUDA its peak device memory (the allocators'
        reserved bytes), of this controller plus the judge servers it drives."""
        if not self.s.log_memory:
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
    def produce(self, groups: int, sampling: Sampling, timer: PhaseTimer) -> Rollout:
        """``groups`` prompt groups generated on this rank and scored, as the mode says:
        the next records (over-dispatched when ``dispatch`` is active, then cut to the
        first complete groups), G samples each, with their rewards."""
        if not self._in_step:
            self._begin_step()
        plan = self.plan
        if plan is None or plan.mode == "shared":  # shared (auto may choose it too)
            r = self._shared(groups, sampling, timer, plan)
        elif plan.mode == "partial":
            partial = self._partial_merged if self.s.merge else self._partial
            r = partial(groups, sampling, timer, plan)
        else:
            r = self._colocate(groups, sampling, timer, plan)
        self._collect_end = time.perf_counter()
        self._acc["scored"] += len(r)
        if r.truncated is not None:
            self._acc["cut"] += float(r.truncated.sum())
        return r

    # the generation of a mode: ``_draw``, ``policy.generate`` with ``_seeds``, ``_kept``
    def _draw(self, n: int, sampling: Sampling, stream=None) -> tuple[list[dict], Sampling]:
        """The records of ``n`` prompt groups and their sampling: over-dispatched (more
        records, decoding stops at ``n`` complete groups), or with ``stream`` = (the
        ``on_finished`` callback for records, its unit) each finished sample streamed."""
        d = self.dispatch
        records = d.draw(n)
        if self.dispatch_balance is not None:  # placement.balance_at=dispatch
            records = self.dispatch_balance.exchange(records, sampling.max_new_tokens)
        if d.active:
            must = d.must_finish(records)
            sampling = replace(sampling, complete_groups=n, must_finish=must)
        elif stream is not None:
            send, unit = stream
            sampling = replace(sampling, on_finished=send(records), finished_unit=unit)
        return records, sampling

    def _seeds(self, records: list[dict]) -> list[int]:
        """Each record's generation seed: its epoch and index (and how often it was
        carried, with ``redraw_carried``), so a prompt yields the same samples anywhere."""
        return [record_seed(self.s.seed, r, self.s.redraw_carried) for r in records]

    def _kept(self, r: Rollout, records: list[dict], n: int, sampling: Sampling) -> Rollout:
        """The first ``n`` complete groups of ``r`` (over-dispatch keeps the rest for the
        next step); ``r`` itself otherwise."""
        return self.dispatch.select(r, records, n, sampling.max_new_tokens)[0]

    def _generate(self, n: int, sampling: Sampling, timer: PhaseTimer) -> Rollout:
        """``n`` groups drawn, generated in one call under the "generate" timer and kept
        (``_kept``); the seconds count in the phase's ``gen_s``."""
        t0 = time.perf_counter()
        with timer("generate"):
            records, s = self._draw(n, sampling)
            r = self._kept(
                self.policy.generate(records, self.G, s, self._seeds(records)), records, n, s
            )
        self._acc["gen_s"] += time.perf_counter() - t0
        return r

    def _shared(self, n: int, sampling: Sampling, timer: PhaseTimer, plan) -> Rollout:
        if plan is not None:
            self._unpin(plan)
        self._phase_start()
        r = self._generate(n, sampling, timer)
        self._phase_end("generate")
        self._phase_start()
        with timer("reward"):
            r = self.scorer.score(r)
        self._phase_end("judge")
        self._phase_start()
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
        res.set_threads(self.s.trainer_threads)
        if self.judges is not None:  # placed before it reloads (see _partial)
            self._place_judge(plan.cores, self.judge_threads(plan))
            self.judges.wake()  # a no-op unless colocate dropped the weights

    def _colocate(self, n: int, sampling: Sampling, timer: PhaseTimer, plan: CorePlan):
        release = self.judges is not None and self.s.release_judge
        if release:
            self.judges.sleep()  # the first colocate step (or one after partial/shared)
        self._pinned = True
        self.offload = off = self._offload  # placement.offload_policy, from now on
        if off is not None:
            with timer("policy_offload"):  # generation needs the weights only
                off.optimizer_off()
        self._phase_start()
        res.use_cores(plan.rollout, sharers=self.dist.world_size)
        r = self._generate(n, sampling, timer)
        self._wait(timer)  # the long tail: the judge phase starts when all have generated
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
                if release:
                    with timer("judge_reload"):
                        self.judges.wake()
            t0 = time.perf_counter()
            with timer("reward"):
                r = self.scorer.score(r)
            self.dist.barrier()  # every controller's requests answered: the judge phase ends
            self._acc["reward_s"] += time.perf_counter() - t0
            self._phase_end("judge")
            if release:
                with timer("judge_release"):
                    self.judges.sleep()
        finally:  # the policy back on its device, whatever the judge's phase did
            if off is not None:
                with timer("policy_reload"):
                    off.on()
        self._phase_start()
        res.use_cores(plan.train, sharers=self.train_procs)
        return r

    def _wait(self, timer: PhaseTimer) -> None:
        """Every controller has got here (a barrier), timed as waiting."""
        with timer("wait"):
            t0 = time.perf_counter()
            self.dist.barrier()
            self._acc["wait_s"] += time.perf_counter() - t0

    def _judge(self, outputs, records, ids):
        """One streamed judge call: its (rewards, parts) and the judges' verdicts."""
        return self.scorer(outputs, records, ids), self.scorer.verdicts()

    def _unit(self) -> str:
        """What is streamed as it finishes: a reward that compares a group's samples
        (pairwise) waits for the whole group, any other gets each sample."""
        return "group" if self.scorer.compares_groups else "sample"

    def _partial_start(self, timer: PhaseTimer, plan: CorePlan) -> None:
        """The judge on its cores (woken if its weights were dropped), generation on the
        rollout's."""
        self._pinned = True
        self._phase_start()
        if self.judges is not None:
            # placed, then woken: weights reloaded on 2 threads and 2 cores before the judge
            # was moved to 1 core and 1 thread made its next model calls 8x slower (1.04 s
            # against 0.13 s in the first partial step after colocate, drifting bench)
            self._place_judge(plan.judge, len(plan.judge))
            with timer("judge_reload"):  # a no-op unless colocate or partial_release_judge
                self.judges.wake()  # dropped the weights
        res.use_cores(plan.rollout, sharers=self.dist.world_size)

    def _partial(self, n: int, sampling: Sampling, timer: PhaseTimer, plan: CorePlan):
        self._partial_start(timer, plan)
        G = self.G
        stream = JudgeStream(self._judge, self.s.stream_max_samples)
        t0 = time.perf_counter()
        with stream:
            with timer("generate"):
                if self.s.streams:  # each sample (or group) as it finishes
                    sends = (lambda recs: stream.on_finished(recs, G), self._unit())
                    records, s = self._draw(n, sampling, stream=sends)
                    r = self.policy.generate(records, G, s, self._seeds(records))
                    r = self._kept(r, records, n, s)
                    stream.send_unreported(r)
                else:  # chunks of placement.stream_groups groups, one generate call each
                    k, parts = self.s.stream_groups, []
                    for chunk in [min(k, n - i) for i in range(0, n, k)]:
                        records, s = self._draw(chunk, sampling)
                        part = self.policy.generate(records, G, s, self._seeds(records))
                        part = self._kept(part, records, chunk, s)
                        start = sum(len(p) for p in parts)
                        parts.append(part)
                        rows = range(start, start + len(part))
                        stream.send(rows, *(getattr(part, f) for f in FIELDS))
                    r = Rollout.concat(parts)
            self._acc["gen_s"] += time.perf_counter() - t0
            if self.has_judge and self.s.widen_judge:
                self._widen_judge(plan, timer)
            results, error = self._judge_rest(stream, timer)
        self.scorer.agree(error)
        scored, verdicts = in_row_order(results)
        return self._scored(r, scored, verdicts, plan, timer)

    def _partial_merged(self, n: int, sampling: Sampling, timer: PhaseTimer, plan: CorePlan):
        """``merge``: every controller sends its records to the first, which generates all
        of them in one batch (one process on the rollout cores instead of one per
        controller taking turns) and streams each finished sample to the judge; then each
        controller gets back its own samples with their rewards. The samples are those
        each controller would have generated (generation is seeded per prompt, not per
        controller) and its data stays its own: only its records (text) and its samples'
        tensors travel."""
        self._partial_start(timer, plan)
        W, first, G = self.dist.world_size, self.dist.is_main, self.G
        records = self.dispatch.draw(n)
        t0 = time.perf_counter()
        with timer("generate"):
            boxes = gather_records(records, W, first)
        parts, error = [None] * W, None
        if first:
            flat = [rec for box in boxes for rec in box]
            # each controller's stream would have sent up to stream_max_samples per call
            # at once: the one stream sends as many as all of theirs
            stream = JudgeStream(self._judge, self.s.stream_max_samples * W)
            with stream:
                with timer("generate"):
                    send = stream.on_finished(flat, G)
                    s = replace(sampling, on_finished=send, finished_unit=self._unit())
                    r = self.policy.generate(flat, G, s, self._seeds(flat))
                    stream.send_unreported(r)
                self._acc["gen_s"] += time.perf_counter() - t0
                if self.has_judge and self.s.widen_judge:  # generation is done
                    self._place_judge(plan.cores, len(plan.cores))
                results, error = self._judge_rest(stream, timer)
            if error is None:
                parts = rank_parts(r, *in_row_order(results), [len(b) * G for b in boxes])
        t0 = time.perf_counter()
        with timer("wait"):  # the others wait here while the first generates
            mine = scatter_parts(parts, first)
        if not first:  # idle: its samples were generated (and judged) by the first
            self._acc["wait_s"] += time.perf_counter() - t0
        self.scorer.agree(error if first else None)
        r, scored, verdicts = mine
        return self._scored(r, scored, verdicts, plan, timer)

    def _judge_rest(
        self, stream: JudgeStream, timer: PhaseTimer
    ) -> tuple[list, BaseException | None]:
        """Generation is done: what is left of judging, in one call (on every core, when
        the judge was widened); the answers by call and the first error of a call."""
        stream.finish()
        t1 = time.perf_counter()
        with timer("reward"):  # what is left of judging once generation is done
            results, error = stream.results()
        self._acc["reward_s"] += time.perf_counter() - t1
        self._acc["chunks"] += len(results)
        return results, error

    def _widen_judge(self, plan: CorePlan, timer: PhaseTimer) -> None:
        """Partial, generation done on every controller: the rollout's cores would idle
        until the judge answers, so the judge takes them (every core of the run, one
        thread per core) for the calls still queued; the next step places it back. The
        call under way keeps its thread count (torch applies it per call)."""
        self._wait(timer)  # the last controller has generated
        self._place_judge(plan.cores, len(plan.cores))

    def _scored(self, r: Rollout, scored, verdicts, plan: CorePlan, timer: PhaseTimer):
        r = self.scorer.finish(r, scored, verdicts)
        self._phase_end("generate")
        if self.s.partial_release_judge and self.has_judge:
            self._wait(timer)  # every controller holds its rewards: the judge may sleep
            if self.judges is not None:  # training takes its memory too (on a GPU, its device)
                with timer("judge_release"):
                    self.judges.sleep()
        self._phase_start(judge_too=True)
        res.use_cores(plan.train, sharers=self.train_procs)
        return r

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
            # 1 where the judges' counters were read (rank 0, a judge that has them)
            "judge_read": float(self.judges is not None and self.judges.readable),
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
        cores = self.s.run_cores if self.mode != "shared" else os.cpu_count()
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
            n = max(1, self.s.judge_servers)
            if total["judge_read"]:  # not of a judge at reward.judge.urls, nor of vLLM's
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
        callers = 1 if self.s.merge else W
        if plan is not None and plan.mode == "partial":
            out["placement/judge_calls"] = total["chunks"] / callers
            # 1: the first controller generated every controller's groups in one batch
            out["placement/rollout_merged"] = float(self.s.merge)
        if self.dispatch.active:
            out.update(self.dist.sum_many(carry))
        if self.dispatch_balance is not None:
            out.update(self.dispatch_balance.end_step())
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
        if not self.s.log_memory:
            return []
        phases = ("generate", "judge", "train")
        return [f"peak_{p}" for p in phases] + [f"peak_device_{p}" for p in phases]
