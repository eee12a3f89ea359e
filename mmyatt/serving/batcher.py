"""Dynamic batching for the judge server: requests gathered on the event loop, model
calls on one model thread.

Route handlers ``await batcher.submit(work)``. Requests that arrive while the model is
busy queue up, and the next call takes all of them (up to ``max_batch``); with fewer
queued than came together last time it waits up to ``batch_wait_ms`` for company, so a
lone client is served at once. Requests of one kind share a call (greedy
``max_tokens=1``: the next-token distribution only); a failed call is retried one
request at a time, so that one bad request fails alone. A lone one-forward request is
served on the event loop's own thread: the model thread would add two thread wake-ups
to a request of a few milliseconds. The weights can be dropped and reloaded between
judge phases (:meth:`Batcher.sleep`, :meth:`Batcher.wake`; ``mmyatt.placement``); all
model work holds ``model_lock``.
"""

from __future__ import annotations

import asyncio
import gc
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from mmyatt.placement.resources import release_free_memory


class BatcherStopped(RuntimeError):
    """The judge server is shutting down: the request was not served (HTTP 503)."""


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
    """See the module docstring. ``loader()`` reloads the model after :meth:`sleep`."""

    def __init__(self, model, max_batch: int = 32, batch_wait_ms: float = 5.0, loader=None):
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        self.model = model
        self.loader = loader
        self.max_batch = int(max_batch)
        self.batch_wait_s = max(0.0, float(batch_wait_ms) / 1000.0)
        self.threads: int | None = None  # torch threads, set by each thread that computes
        self.model_lock = threading.Lock()
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
        self._queue: list[tuple[Work, asyncio.Future]] = []
        self._arrived: asyncio.Event | None = None
        self._draining = False
        self._expected = 1  # requests seen together last time
        self._stopped = False
        self._model_thread = ThreadPoolExecutor(1, thread_name_prefix="judge-model")

    # --- requests (on the event loop) ----------------------------------------------
    def submit(self, work: Work) -> asyncio.Future:
        """A future of ``work``'s :class:`Result`, resolved on the calling event loop."""
        if self._stopped:
            raise BatcherStopped("the judge server is shutting down")
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._queue.append((work, future))
        if self._arrived is not None:
            self._arrived.set()
        if not self._draining:
            self._draining = True
            loop.create_task(self._drain())
        return future

    async def _drain(self) -> None:
        try:
            while self._queue and not self._stopped:
                batch = await self._gather()
                works = [w for w, _ in batch]
                if len(works) == 1 and works[0].next_token_only and self._claim_model():
                    try:  # alone and one forward: on this thread (module docstring)
                        results = self._run_locked(works)
                    finally:
                        self.model_lock.release()
                else:
                    results = await self._on_model_thread(works)
                for (_, future), result in zip(batch, results):
                    if future.done():  # the handler gave up (timeout, closed connection)
                        continue
                    if isinstance(result, BaseException):
                        future.set_exception(result)
                    else:
                        future.set_result(result)
                self._expected = len(batch) + len(self._queue)
        finally:
            self._draining = False
            if self._stopped:
                self._fail_queued()

    async def _on_model_thread(self, works: list[Work]) -> list[Result | BaseException]:
        loop = asyncio.get_running_loop()
        try:
            return await loop.run_in_executor(self._model_thread, self._run, works)
        except Exception as error:  # noqa: BLE001 - a failed reload, or stopped
            stopped = BatcherStopped("the judge server stopped")
            return [stopped if self._stopped else error] * len(works)

    async def _gather(self) -> list[tuple[Work, asyncio.Future]]:
        """Everything queued (up to ``max_batch``); with fewer than expected, wait for
        company until ``batch_wait_ms`` after the first arrived."""
        want = min(self.max_batch, self._expected)
        if len(self._queue) < want and self.batch_wait_s > 0:
            with self.lock:
                self.stats["waited_batches"] += 1
            deadline = self._queue[0][0].enqueued + self.batch_wait_s
            self._arrived = asyncio.Event()
            while len(self._queue) < want and (left := deadline - time.perf_counter()) > 0:
                self._arrived.clear()
                try:
                    await asyncio.wait_for(self._arrived.wait(), left)
                except asyncio.TimeoutError:
                    break
            self._arrived = None
        batch, self._queue = self._queue[: self.max_batch], self._queue[self.max_batch :]
        return batch

    def _claim_model(self) -> bool:
        return self.model is not None and self.model_lock.acquire(blocking=False)

    def stop(self) -> None:
        """Refuse new requests, fail queued ones (:class:`BatcherStopped`) once the
        current batch is done, and end the model thread."""
        self._stopped = True
        self._model_thread.shutdown(wait=False, cancel_futures=True)
        if not self._draining:
            self._fail_queued()

    def _fail_queued(self) -> None:
        queued, self._queue = self._queue, []
        for _, future in queued:
            if not future.done():
                future.get_loop().call_soon_threadsafe(
                    _fail, future, BatcherStopped("the judge server stopped")
                )

    # --- sleep / wake (any thread) --------------------------------------------------
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
        self.model = None
        gc.collect()
        # what survives a full collection is long-lived (the server, its imports): moved
        # out of the collector's sight, so the next drop scans only what was made since
        # (the reloaded model): ~0.25 s less per release
        gc.freeze()
        release_free_memory()

    def settle(self) -> float:
        """Drop the weights, collect once and freeze what survives, then reload, so that
        the first release does not pay the full collection of the server's long-lived
        objects (some 390,000, 0.25 s); returns seconds (0 for a model object)."""
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

    # --- model calls (the model thread, or the loop for a lone forward) -------------
    def _run(self, works: list[Work]) -> list[Result | BaseException]:
        with self.model_lock:  # a sleeping judge reloads before it serves
            return self._run_locked(works)

    def _run_locked(self, works: list[Work]) -> list[Result | BaseException]:
        if self.threads and torch.get_num_threads() != self.threads:
            torch.set_num_threads(self.threads)  # per thread, as OpenMP counts them
        self._wake_locked()
        with self.lock:
            stats = self.stats
            stats["requests"] += len(works)
            stats["batches"] += 1
            stats["max_batch_seen"] = max(stats["max_batch_seen"], len(works))
            stats["batch_sizes"][len(works)] = stats["batch_sizes"].get(len(works), 0) + 1
        groups: dict[tuple, list[int]] = {}
        for i, w in enumerate(works):
            key = ("next",) if w.next_token_only else ("gen", w.max_tokens, w.temperature)
            groups.setdefault(key, []).append(i)
        results: list[Result | BaseException] = [BatcherStopped("not served")] * len(works)
        for key, rows in groups.items():
            try:
                for i, result in zip(rows, self._serve(key, [works[i] for i in rows])):
                    results[i] = result
            except Exception as error:  # noqa: BLE001 - isolate the request that broke it
                for i in rows:
                    try:
                        results[i] = self._serve(key, [works[i]])[0] if len(rows) > 1 else error
                    except Exception as single:  # noqa: BLE001 - reported to its client
                        results[i] = single
        with self.lock:
            stats["errors"] += sum(isinstance(r, BaseException) for r in results)
        return results

    def _timed(self, fn, *args, **kwargs):
        t0 = time.perf_counter()
        result = fn(*args, **kwargs)
        elapsed = time.perf_counter() - t0
        with self.lock:
            self.stats["model_calls"] += 1
            self.stats["model_time_s"] += elapsed
        return result, elapsed

    def _serve(self, key: tuple, works: list[Work]) -> list[Result]:
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
            for i, generated in zip(owner, out):
                gens[i].append(generated)
        now = time.perf_counter()
        return [
            Result(
                top=tops[i] if tops is not None else None,
                generations=gens[i],
                model_time_s=model_time,
                batch_size=len(works),
                queue_s=now - w.enqueued - model_time,
            )
            for i, w in enumerate(works)
        ]


def _fail(future: asyncio.Future, error: BaseException) -> None:
    if not future.done():
        future.set_exception(error)
