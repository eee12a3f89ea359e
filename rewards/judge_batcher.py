"""Dynamic batching for the judge server: a queue and one worker thread.

Request handlers :meth:`Batcher.submit` a :class:`Work` and wait on its future. The
worker takes the first queued request and everything already queued behind it, up to
``max_batch``. It waits for more (at most ``batch_wait_ms`` after the first arrived)
only while it expects company: the requests seen together last time (the previous
batch plus those that queued up while it ran) outnumber what is queued now. A lone
client (1 in flight) is therefore served at once, and concurrent clients are gathered
into one call even when their requests trickle in. Requests needing the same kind of model call are
grouped (greedy 1-token requests need only the next-token distribution); a call that
fails is retried request by request so that one bad request fails alone.

A request that would be served alone anyway (one forward: greedy ``max_tokens=1``;
the only chat request the server holds, nothing queued, the model awake and idle) is
served by :meth:`Batcher.serve_now` in the calling thread, the server's event loop
(``judge_api.chat_completion`` decides), without the two thread hops through the
queue (a wake-up of the worker, then of the event loop, each waiting for a core on a
busy machine). Requests arriving meanwhile wait in their sockets for one forward, as
they would wait in the queue for the busy model; anything longer than one forward (text
generation, reloading a sleeping model) always goes through the worker.

The model (a :class:`mmyatt.models.judge.JudgeModel`) can be dropped and reloaded
between judge phases (:meth:`Batcher.sleep`, :meth:`Batcher.wake`, used by
``mmyatt.placement``).
"""

from __future__ import annotations

import queue
import random
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

_STOP = object()  # queued by stop(): the worker returns


class BatcherStopped(RuntimeError):
    """The batcher is shutting down: the request was not served (HTTP 503)."""


@dataclass
class Work:
    """One chat-completion request, validated."""

    messages: list[dict]
    max_tokens: int
    temperature: float
    logprobs: bool
    top_logprobs: int
    n: int
    seed: int | None
    enqueued: float = field(default_factory=time.perf_counter)
    future: Future = field(default_factory=Future)

    @property
    def next_token_only(self) -> bool:
        return self.max_tokens == 1 and self.temperature == 0


@dataclass
class Result:
    """What the model gave one request: the next-token top list (when asked or needed)
    and ``n`` generations (text, token log-probs), with timing."""

    top: list[tuple[str, float]] | None
    generations: list[tuple[str, list[float]]]
    model_time_s: float
    batch_size: int
    queue_s: float


class Batcher:
    def __init__(self, model, max_batch: int = 32, batch_wait_ms: float = 5.0):
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        self.model = model
        self.max_batch = int(max_batch)
        self.batch_wait_s = max(0.0, float(batch_wait_ms) / 1000.0)
        self.queue: queue.Queue[Work] = queue.Queue()
        self.lock = threading.Lock()  # guards stats
        self.stats: dict[str, Any] = {
            "requests": 0,
            "batches": 0,
            "model_calls": 0,
            "max_batch_seen": 0,
            "batch_sizes": {},
            "model_time_s": 0.0,
            "errors": 0,
            "waited_batches": 0,
            "sleeping": False,
            "reloads": 0,
            "reload_s": 0.0,
            "sleeps": 0,
        }
        # requests seen together last time (previous batch + what queued meanwhile)
        self._expected = 1
        self._stop = threading.Event()
        self._submit_lock = threading.Lock()
        self.loader = None  # reloads the model after sleep()
        self.model_lock = threading.Lock()
        self.threads: int | None = None  # torch threads, applied by the worker itself
        self.inline = True  # serve_now may serve lone one-forward requests in the caller
        self.thread = threading.Thread(target=self._loop, name="judge-batcher", daemon=True)
        self.thread.start()

    # --- requests ----------------------------------------------------------------
    def submit(self, work: Work) -> Future:
        with self._submit_lock:  # nothing is queued after stop() has drained the queue
            if self._stop.is_set():
                raise BatcherStopped("the judge server is shutting down")
            self.queue.put(work)
        return work.future

    def serve_now(self, work: Work) -> bool:
        """Serve ``work`` in the calling thread if it would be served alone anyway (see the
        module docstring); False (nothing done) otherwise: then :meth:`submit` it."""
        if not (self.inline and work.next_token_only) or self.model is None:
            return False
        if not self.queue.empty() or not self.model_lock.acquire(blocking=False):
            return False
        try:
            if self._stop.is_set():
                raise BatcherStopped("the judge server is shutting down")
            self._run_locked([work])
        finally:
            self.model_lock.release()
        return True

    def stop(self) -> None:
        with self._submit_lock:
            self._stop.set()
            self.queue.put(_STOP)  # wakes the worker, which sleeps on the queue
        self.thread.join(timeout=30)
        while True:  # fail whatever is still queued
            try:
                work = self.queue.get_nowait()
            except queue.Empty:
                break
            if work is not _STOP:
                work.future.set_exception(BatcherStopped("the judge server stopped"))

    def _gather(self, first: Work) -> list[Work]:
        batch = [first]
        while len(batch) < self.max_batch:  # everything already waiting
            try:
                work = self.queue.get_nowait()
            except queue.Empty:
                break
            if work is _STOP:
                self.queue.put(work)  # seen by the loop after this batch
                return batch
            batch.append(work)
        want = min(self.max_batch, self._expected)
        if len(batch) < want and self.batch_wait_s > 0:
            with self.lock:
                self.stats["waited_batches"] += 1
            deadline = first.enqueued + self.batch_wait_s
            while len(batch) < want:
                remaining = deadline - time.perf_counter()
                if remaining <= 0:
                    break
                try:
                    work = self.queue.get(timeout=remaining)
                except queue.Empty:
                    break
                if work is _STOP:
                    self.queue.put(work)
                    break
                batch.append(work)
        return batch

    def _loop(self) -> None:
        while True:  # blocks on the queue: no wake-ups while idle
            first = self.queue.get()
            if first is _STOP or self._stop.is_set():
                if first is not _STOP:
                    self.queue.put(first)  # failed by stop(), as everything still queued
                return
            batch = self._gather(first)
            try:
                self._run(batch)
            except Exception as error:  # noqa: BLE001 - the worker must survive anything
                for work in batch:
                    self._fail(work, error)
            self._expected = len(batch) + self.queue.qsize()

    # --- sleep / wake ------------------------------------------------------------
    def sleep(self) -> float:
        """Drop the model's weights (after the batch being served); returns seconds."""
        if self.loader is None:
            raise ValueError("this judge was given as an object and cannot reload")
        t0 = time.perf_counter()
        with self.model_lock:
            if self.model is not None:
                self._drop_locked()
                with self.lock:
                    self.stats["sleeps"] += 1
                    self.stats["sleeping"] = True
        return time.perf_counter() - t0

    def _drop_locked(self) -> None:
        """Drop the model and give its memory back (``model_lock`` held)."""
        import gc

        from mmyatt.placement.resources import release_free_memory

        self.model = None
        gc.collect()
        # what survives a full collection is long-lived (the server, its imports): moved
        # out of the collector's sight, so the next drop scans only what was made since
        # (the reloaded model): ~0.25 s less per release
        gc.freeze()
        release_free_memory()

    def settle(self) -> float:
        """Drop the weights, collect once and freeze what survives, then reload: a server
        that starts this way never pays the full collection of its long-lived objects (the
        server, torch, transformers: some 390,000 of them, 0.25 s) in a judge phase, so its
        first release costs what every later one does. Returns seconds; a no-op for a
        judge given as an object."""
        if self.loader is None:
            return 0.0
        t0 = time.perf_counter()
        with self.model_lock:
            self._drop_locked()
            self.model = self.loader()
        return time.perf_counter() - t0

    def wake(self) -> float:
        """Reload the weights if they were dropped; returns the reload seconds (0 if awake)."""
        with self.model_lock:
            return self._wake_locked()

    def _wake_locked(self) -> float:
        if self.model is not None:
            return 0.0
        t0 = time.perf_counter()
        self.model = self.loader()
        dt = time.perf_counter() - t0
        with self.lock:
            self.stats["reloads"] += 1
            self.stats["reload_s"] += dt
            self.stats["sleeping"] = False
        return dt

    # --- model calls -------------------------------------------------------------
    def _run(self, batch: list[Work]) -> None:
        with self.model_lock:  # a sleeping judge reloads before it serves
            self._run_locked(batch)

    def _run_locked(self, batch: list[Work]) -> None:
        if self.threads:  # per calling thread (OpenMP's thread count is)
            import torch

            if torch.get_num_threads() != self.threads:
                torch.set_num_threads(self.threads)
        self._wake_locked()
        with self.lock:
            self.stats["requests"] += len(batch)
            self.stats["batches"] += 1
            self.stats["max_batch_seen"] = max(self.stats["max_batch_seen"], len(batch))
            sizes = self.stats["batch_sizes"]
            sizes[len(batch)] = sizes.get(len(batch), 0) + 1
        groups: dict[tuple, list[Work]] = {}
        for w in batch:
            key = ("next",) if w.next_token_only else ("gen", w.max_tokens, w.temperature)
            groups.setdefault(key, []).append(w)
        for key, works in groups.items():
            try:
                self._serve(key, works, len(batch))
            except Exception as error:
                if len(works) == 1:
                    self._fail(works[0], error)
                    continue
                for w in works:  # isolate the request that broke the call
                    try:
                        self._serve(key, [w], 1)
                    except Exception as single:
                        self._fail(w, single)

    def _fail(self, work: Work, error: Exception) -> None:
        with self.lock:
            self.stats["errors"] += 1
        if not work.future.done():
            work.future.set_exception(error)

    def _timed(self, fn, *args, **kwargs):
        t0 = time.perf_counter()
        result = fn(*args, **kwargs)
        elapsed = time.perf_counter() - t0
        with self.lock:
            self.stats["model_calls"] += 1
            self.stats["model_time_s"] += elapsed
        return result, elapsed

    def _serve(self, key: tuple, works: list[Work], batch_size: int) -> None:
        model_time = 0.0
        tops: list | None = None
        if key[0] == "next" or any(w.logprobs for w in works):
            k = max([w.top_logprobs for w in works] + [1])
            tops, dt = self._timed(self.model.next_token_logprobs, [w.messages for w in works], k)
            model_time += dt
        gens: list[list[tuple[str, list[float]]]] = [[] for _ in works]
        if key[0] == "gen":
            rows, seeds, owner = [], [], []
            for i, w in enumerate(works):
                base = w.seed if w.seed is not None else random.getrandbits(31)
                for j in range(w.n):
                    rows.append(w.messages)
                    seeds.append((base + j) % (2**63))
                    owner.append(i)
            out, dt = self._timed(
                self.model.generate_text,
                rows,
                max_new_tokens=key[1],
                temperature=key[2],
                seeds=seeds,
            )
            model_time += dt
            for i, result in zip(owner, out):
                gens[i].append(result)
        now = time.perf_counter()
        for i, w in enumerate(works):
            if not w.future.done():
                w.future.set_result(
                    Result(
                        top=tops[i] if tops is not None else None,
                        generations=gens[i],
                        model_time_s=model_time,
                        batch_size=batch_size,
                        queue_s=now - w.enqueued - model_time,
                    )
                )
