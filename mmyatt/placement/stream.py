"""Partial's side of the judge: the stream that sends finished samples to it while
generation goes on, the answers put back in the rollout's order, and, for
``placement.merge_rollout``, the records gathered to the first controller and each
controller's samples sent back to it (``Placement._partial_merged``)."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import torch
import torch.distributed as tdist

from mmyatt.rollout import prompt_id

FIELDS = ("outputs", "records", "prompt_ids")  # what the judge is sent of each sample


class JudgeStream:
    """Partial's sender: pieces of a step's samples go to ``judge(outputs, records, ids)``
    from one background thread, and a piece sent while the judge answers an earlier call
    waits and goes with the others in the next call. The first piece is judged at once,
    and the judge gets batches as large as the overlap allows (a call per prompt group
    cost the judge 1.4x the model time of whole-step calls, judge-heavy bench).

    ``max_call`` > 0: while generation runs, a call takes pieces up to that many samples
    (at least one piece; a piece, e.g. a group a pairwise judge compares, is never
    split), so the call under way when generation ends is short and what is left goes in
    one call after :meth:`finish` (on every core, when the judge is widened: a call keeps
    the thread count it started with)."""

    def __init__(self, judge, max_call: int = 0):
        self._judge = judge
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="stream-to-judge")
        self._lock = threading.Lock()
        self._pending: list[list[tuple]] = []  # pieces: (row, output, record, id) each
        self._cap = max(0, int(max_call))
        self._calls = []
        self._reported: set[int] = set()  # rows an on_finished callback sent

    def on_finished(self, records: list[dict], group_size: int):
        """A generate call's ``Sampling.on_finished`` for ``records``: the samples it
        reports (row ``i`` of the call is prompt ``records[i // group_size]``) are sent."""

        def send(rows, texts):
            self._reported.update(rows)
            recs = [records[i // group_size] for i in rows]
            ids = [prompt_id(records[i // group_size], i // group_size) for i in rows]
            self.send(rows, texts, recs, ids)

        return send

    def send_unreported(self, r) -> None:
        """The samples of ``r`` that no ``on_finished`` reported (those the token budget
        cut, which the call returns without reporting)."""
        cut = [i for i in range(len(r)) if i not in self._reported]
        if cut:
            self.send(cut, *([getattr(r, f)[i] for i in cut] for f in FIELDS))

    def send(self, rows, outputs, records, ids) -> None:
        """Samples at ``rows`` of the step's rollout, to be judged."""
        with self._lock:
            self._pending.append(list(zip(rows, outputs, records, ids, strict=True)))
        self._calls.append(self._pool.submit(self._flush))

    def finish(self) -> None:
        """Generation is over: what is pending goes in one call, whatever ``max_call``."""
        with self._lock:
            self._cap = 0
        self._calls.append(self._pool.submit(self._flush))

    def _flush(self):
        with self._lock:
            k, n = 0, 0
            while k < len(self._pending) and (
                not self._cap or k == 0 or n + len(self._pending[k]) <= self._cap
            ):
                n += len(self._pending[k])
                k += 1
            batch = [x for piece in self._pending[:k] for x in piece]
            self._pending = self._pending[k:]
        if not batch:  # an earlier call took it
            return None
        rows, outputs, records, ids = (list(x) for x in zip(*batch, strict=True))
        return rows, self._judge(outputs, records, ids)

    def results(self) -> tuple[list, BaseException | None]:
        """(rows, answer) of every call, once all are done, and the first error raised."""
        out, error = [], None
        for f in self._calls:
            try:
                if (got := f.result()) is not None:
                    out.append(got)
            except Exception as e:  # noqa: BLE001 - agreed on by the caller, then raised
                error = error or e
        return out, error

    def close(self) -> None:
        self._pool.shutdown(wait=True)

    def __enter__(self) -> JudgeStream:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def in_row_order(results) -> tuple[tuple, list]:
    """Partial's judge answers ((rows, (out, verdicts)) per call, in the order the calls
    finished) as (rewards, named parts) and verdicts in the rollout's row order."""
    order = torch.tensor([i for rows, _ in results for i in rows], dtype=torch.long)
    back = torch.empty_like(order)
    back[order] = torch.arange(len(order))
    outs = [out for _, (out, _) in results]
    rewards = torch.cat([o[0] for o in outs])[back]
    names = outs[0][1].keys()
    scored = (rewards, {n: torch.cat([o[1][n] for o in outs])[back] for n in names})
    verdicts = [v for _, (_, vs) in results for v in vs]
    return scored, ([verdicts[i] for i in back.tolist()] if verdicts else [])


def gather_records(records: list[dict], world: int, first: bool) -> list[list[dict]] | None:
    """Every controller's records, on the first controller (in rank order); None elsewhere."""
    boxes = [None] * world if first else None
    tdist.gather_object(records, boxes, dst=0)
    return boxes


def rank_parts(r, scored: tuple, verdicts: list, sizes: list[int]) -> list[tuple]:
    """The first controller's merged rollout ``r`` and its answers, cut into each
    controller's block of rows (``sizes`` samples each, in rank order)."""
    rewards, named = scored
    out, start = [], 0
    for n in sizes:
        rows = list(range(start, start + n))
        start += n
        sel = torch.tensor(rows, dtype=torch.long)
        part = (rewards[sel], {m: v[sel] for m, v in named.items()})
        out.append((r.select(rows), part, [verdicts[i] for i in rows] if verdicts else []))
    return out


def scatter_parts(parts: list | None, first: bool):
    """Controller k's entry of the first controller's ``parts``, on controller k."""
    mine = [None]
    tdist.scatter_object_list(mine, parts if first else None, src=0)
    return mine[0]
