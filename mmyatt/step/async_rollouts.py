"""Rollouts made ahead of the update (``trainer.async``, docs/async.md).

A producer thread runs a step's whole collect phase (generation and scoring through the
placement in force, DAPO's refill rounds included) for the steps ahead, with a
rollout-side copy of the policy, while the main thread updates the trainer's. The
copy's weights are the trainer's at a *version* (the number of updates applied), taken
from a snapshot the trainer publishes after its update; every sample records the
version that made it (``context["policy_version"]``).

Which version makes step t's batch is fixed in advance, so a run is the same run
whatever the threads' timing, and a resumed run regenerates the queue exactly:

    w(t) = min(t - 1, N * ceil(max(t - 1 - S, 0) / N))

with S the steps the producer may run ahead (``max_staleness``; 1 at most for
one_step_off, 0 for sync) and N the versions between weight syncs (``sync_every``;
1 for one_step_off). Step t trains with version t - 1, so its samples are
t - 1 - w(t) <= S updates stale; ``max_staleness: 0`` gives w(t) = t - 1: the producer
waits for the update and the step is the synchronous step, bit for bit. Samples staler
than ``max_staleness`` (a queue restored under a tighter bound) are dropped and counted
before they reach the advantages or the loss (``drop_stale``).

The producer waits for version w(t) before it draws step t's records: the queue holds
at most S + 1 batches. It records the data cursor and placement state before each
batch's first draw; a checkpoint after step k saves batch k + 1's (``start_state``) and
the snapshots of every version a later batch still needs, so resume regenerates the
queue from saved cursors and weight versions instead of storing rollouts.

Leaves out the loss (``mmyatt.step.policy_loss``: decoupled PPO on the
``staleness`` this module writes into the rollout) and the step (``mmyatt.step.controller``).
"""

from __future__ import annotations

import copy
import logging
import math
import threading
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import torch

from mmyatt.config.trainer import async_settings
from mmyatt.outputs.metrics import PhaseTimer
from mmyatt.protocols import LoRAOptions, adapter_of
from mmyatt.rollout import Rollout

logger = logging.getLogger("mmyatt.async")

VERSION = "policy_version"  # context key: the weight version that made a sample (N,)
STALENESS = "staleness"  # context key: trainer version - sample version (N,), set at use


@dataclass(frozen=True)
class AsyncSettings:
    """``trainer.async`` (``mmyatt.config.trainer.AsyncConfig``) and the run's length."""

    mode: str = "sync"
    max_staleness: int = 1
    sync_every: int = 1
    steps: int = 1

    @property
    def ahead(self) -> int:
        """S: how many updates the producer may run ahead of the trainer."""
        if self.mode == "one_step_off":
            return min(self.max_staleness, 1)
        return self.max_staleness if self.mode == "fully_async" else 0

    @property
    def every(self) -> int:
        return self.sync_every if self.mode == "fully_async" else 1

    def version_for(self, step: int) -> int:
        """w(t): the weight version that makes the batch of (1-based) step ``step``.

        >>> s = AsyncSettings("fully_async", max_staleness=3, sync_every=2, steps=9)
        >>> [s.version_for(t) for t in range(1, 10)]
        [0, 0, 0, 0, 2, 2, 4, 4, 6]
        >>> [AsyncSettings("one_step_off", 1).version_for(t) for t in range(1, 5)]
        [0, 0, 1, 2]
        >>> [AsyncSettings("one_step_off", 0).version_for(t) for t in range(1, 5)]
        [0, 1, 2, 3]
        """
        lag = max(step - 1 - self.ahead, 0)
        return min(step - 1, self.every * math.ceil(lag / self.every))


def async_run(cfg) -> AsyncSettings | None:
    """The run's ``trainer.async`` settings; None when it is sync."""
    a = async_settings(cfg.trainer)
    if a.mode == "sync":
        return None
    return AsyncSettings(a.mode, a.max_staleness, a.sync_every, cfg.trainer.steps)


@dataclass
class Batch:
    """One step's collect phase, made by the producer."""

    step: int
    version: int
    rollout: Rollout | None = None
    dynamic: dict[str, float] = field(default_factory=dict)
    metrics: dict[str, float] = field(default_factory=dict)  # timings, placement/*
    consumed: list[int] = field(default_factory=list)  # manifest indices drawn
    error: BaseException | None = None


class AsyncRollouts:
    """The producer and its bounded queue for one controller.

    ``collect(timer)`` runs one step's collect phase on the rollout-side policy and
    returns (rollout, dynamic metrics, consumed indices); ``snapshot()`` returns the
    trainer's sampling weights now (main thread, between updates); ``load(policy,
    state)`` puts a snapshot into the rollout copy; ``local_state()`` is the data cursor
    and placement state a checkpoint keeps for the next batch."""

    def __init__(self, settings: AsyncSettings, *, make_copy, snapshot, load, collect, local_state):
        self.s = settings
        self.bound = settings.max_staleness  # the oldest sample the loss may see
        self._make_copy, self._snapshot, self._load = make_copy, snapshot, load
        self._collect, self._local_state = collect, local_state
        self.rollout_policy = None
        self._cv = threading.Condition()
        self._weights: dict[int, dict] = {}  # version -> snapshot, while a batch needs it
        self._ready: dict[int, Batch] = {}
        self._starts: dict[int, dict] = {}  # step -> local state before its first draw
        self._thread: threading.Thread | None = None
        self._stop = False
        self._version = 0  # the trainer's
        self.dropped_total = 0

    # ------------------------------------------------------------------ main thread
    def start(self, version: int) -> None:
        """Begin producing from step ``version + 1`` (a fresh run: 0; a resumed one: its
        step), the trainer's current weights published as ``version``."""
        self._version = version
        if self.rollout_policy is None:
            self.rollout_policy = self._make_copy()
        self._publish(version)
        self._thread = threading.Thread(
            target=self._run, args=(version + 1,), name="mmyatt-rollouts", daemon=True
        )
        self._thread.start()

    def started(self) -> bool:
        return self._thread is not None

    def take(self, step: int) -> Batch:
        """Step ``step``'s batch, waiting for the producer; its error re-raised here."""
        with self._cv:
            self._cv.wait_for(lambda: step in self._ready)
            b = self._ready.pop(step)
            self._starts = {k: x for k, x in self._starts.items() if k >= step}
        if b.error is not None:
            self.close()
            raise b.error
        return b

    def publish(self, version: int) -> None:
        """The trainer finished update ``version``: snapshot its weights if a later batch
        is made with them, and forget the versions no later batch needs."""
        self._version = version
        self._publish(version)

    def _publish(self, version: int) -> None:
        # only batches up to t = version + S + 1 can be made with weights this old (past
        # the run's last step too: a resumed run may go on further)
        needed = {self.s.version_for(t) for t in range(version + 1, version + self.s.ahead + 2)}
        snap = self._snapshot() if version in needed else None
        with self._cv:
            if snap is not None:
                self._weights[version] = snap
            for v in [v for v in self._weights if v not in needed]:
                del self._weights[v]
            self._cv.notify_all()

    def close(self) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify_all()

    # ------------------------------------------------------------------ run state
    def state_dict(self, step: int) -> dict:
        """What a checkpoint after step ``step`` needs to regenerate the queue: the
        snapshots of older versions later batches are made with (the current weights
        are the checkpoint's own)."""
        with self._cv:
            return {"weights": {v: w for v, w in self._weights.items() if v < step}}

    def load_state_dict(self, state: dict | None) -> None:
        if state:
            self._weights.update({int(v): w for v, w in state["weights"].items()})

    def start_state(self, step: int) -> dict:
        """The data cursor and placement state before batch ``step``'s first draw (the
        producer's; waits for it to begin that batch)."""
        with self._cv:
            self._cv.wait_for(lambda: step in self._starts or self._stop)
            if step not in self._starts:
                raise RuntimeError(f"the rollout producer stopped before batch {step} began")
            return self._starts[step]

    # ------------------------------------------------------------------ producer thread
    def _run(self, first: int) -> None:
        have = None  # the version in the rollout copy
        for t in range(first, self.s.steps + 2):
            v = self.s.version_for(t)
            with self._cv:
                # the queue's bound: batch t waits for update w(t) (and its snapshot)
                self._cv.wait_for(lambda v=v: self._stop or v in self._weights)
                if self._stop:
                    return
                self._starts[t] = self._local_state()
                self._cv.notify_all()
                weights = self._weights[v]
            if t > self.s.steps:
                return  # the cursor after the last batch is recorded
            batch = Batch(step=t, version=v)
            try:
                if have != v:
                    self._load(self.rollout_policy, weights)
                    have = v
                timer = PhaseTimer()
                batch.rollout, batch.dynamic, batch.consumed, batch.metrics = self._collect(
                    self.rollout_policy, t, timer
                )
                batch.metrics.update(timer.metrics())
                if batch.rollout is not None:
                    n = len(batch.rollout)
                    batch.rollout.context[VERSION] = torch.full((n,), v, dtype=torch.long)
            except BaseException as error:  # noqa: BLE001 (re-raised in the main thread)
                batch.error = error
            with self._cv:
                self._ready[t] = batch
                self._cv.notify_all()
            if batch.error is not None:
                return


def drop_stale(r: Rollout, version: int, max_staleness: int) -> tuple[Rollout | None, dict]:
    """The samples of ``r`` at most ``max_staleness`` versions older than ``version`` (the
    trainer's), their staleness written into ``r.context``; and the staleness figures:
    mean, max, a count per staleness, the samples dropped.

    >>> r = Rollout(["a", "a", "b", "b"], torch.zeros(4, 1), torch.zeros(4, 1),
    ...             torch.ones(4, 1), {VERSION: torch.tensor([3, 3, 1, 1])}, [0] * 4, [{}] * 4)
    >>> kept, m = drop_stale(r, 4, 2)
    >>> len(kept), kept.context[STALENESS].tolist(), m["async/dropped_samples"]
    (2, [1, 1], 2.0)
    """
    st = version - r.context[VERSION]
    keep = (st <= max_staleness).nonzero().flatten().tolist()
    counts = Counter(st.tolist())
    out: dict[str, Any] = {
        f"async/staleness_count_{k}": float(c) for k, c in sorted(counts.items())
    }
    out["async/dropped_samples"] = float(len(r) - len(keep))
    kept = r if len(keep) == len(r) else (r.select(keep) if keep else None)
    if kept is not None:
        kept.context[STALENESS] = version - kept.context[VERSION]
        s = kept.context[STALENESS].float()
        out["async/staleness_mean"] = float(s.mean()) if len(s) else 0.0
        out["async/staleness_max"] = float(s.max()) if len(s) else 0.0
    return kept, out


def rollout_copy(policy, sampling):
    """The rollout side's policy: a deep copy of the trainer's, made inside ``sampling``
    (DiffusionNFT's context: the copy samples as its old policy does). An attribute
    that cannot be copied (a ``mappingproxy``, such as ``inspect`` signature
    parameters) is read-only; the copy shares it."""
    with sampling():
        memo: dict = {}
        for value in vars(policy).values():
            try:
                copy.deepcopy(value, memo)
            except TypeError:
                memo[id(value)] = value
        return copy.deepcopy(policy, memo)


def _has_adapter(policy) -> bool:
    adapter = adapter_of(policy)
    return isinstance(adapter, LoRAOptions) and adapter.lora is not None


def sampling_weights(policy, sampling) -> dict:
    """The weights the policy samples with now (inside ``sampling``), cloned; a LoRA
    policy's adapter only (the copy has the base, which never moves)."""
    lora = _has_adapter(policy)
    with sampling(), torch.no_grad():
        state = policy.module().state_dict().items()
        return {k: v.detach().clone() for k, v in state if not lora or ".lora_" in k}


def load_weights(policy, state: dict) -> None:
    lora = _has_adapter(policy)
    with torch.no_grad():
        missing, unexpected = policy.module().load_state_dict(state, strict=not lora)
    if unexpected or any(".lora_" in k for k in missing):  # the adapter must fit, whole
        raise ValueError(f"adapter state does not fit: missing {missing[:3]}, {unexpected[:3]}")
