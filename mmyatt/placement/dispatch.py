"""Long-tail over-dispatch (``rollout.over_dispatch_ratio``, G-Core's
``rollout_over_dispatch_ratio`` / ``reuse_unused_prompts``).

A generate call that needs ``n`` prompt groups is given ``ceil(r * n)`` prompts. Decoding
stops as soon as ``n`` groups have every sample finished (EOS, a stop string or the
token budget); the first ``n`` complete groups in dispatch order are the batch, the other
prompts (cut short, or complete beyond the ``n``) are kept and dispatched first at the
next step. With r = 1 nothing changes: every prompt drawn is trained on.

Data order: a step's prompts are the carried ones, oldest first, then fresh records in
manifest order. A prompt whose samples are long tends to be cut short and trained on a
step or two later than its place in the manifest (with the weights of that step: its
samples are drawn again, from the same per-prompt seed, or with ``redraw_carried`` from a
new seed that adds its times carried); this is a bias towards short completions in any
one step, stronger with ``redraw_carried`` (a long draw is replaced rather than
replayed). ``max_carries`` bounds it: a prompt cut short that many times is dispatched
with "must finish", and the decode does not stop before it has.
With ``reuse_unused_prompts=false`` every prompt left over is dropped for this epoch.

The carried prompts are run state: ``state_dict`` holds their (index, epoch, carries),
saved in each controller's checkpoint; the records are read again from the manifest on
resume, so a resumed run draws exactly what an uninterrupted one does.
"""

from __future__ import annotations

import math

import torch

from mmyatt.protocols import prompt_seed

CARRIES = "_carries"  # times the record was cut short and carried (0 for fresh records)


def record_seed(base_seed: int, record: dict, redraw: bool = False) -> int:
    """The seed of a record's prompt group: from (epoch, index), so a prompt yields the
    same samples on any rank and in any mode. With ``redraw`` (rollout.redraw_carried) a
    record cut short ``k`` > 0 times adds ``("carried", k)``: its next draw is a new one."""
    keys = (record.get("_epoch", 0), record["_index"])
    if redraw and record.get(CARRIES, 0) > 0:
        keys += ("carried", int(record[CARRIES]))
    return prompt_seed(base_seed, *keys)


class OverDispatch:
    def __init__(self, ratio: float, shard, *, reuse: bool = True, max_carries: int = 2):
        if ratio < 1:
            raise ValueError(f"rollout.over_dispatch_ratio must be >= 1, got {ratio}")
        self.ratio, self.shard, self.reuse, self.max_carries = ratio, shard, reuse, max_carries
        self.carried: list[dict] = []  # dispatched first at the next draw
        self._unused: list[dict] = []  # this step's leftovers, carried at `end_step`
        self.stats = {"dispatched": 0, "cut_short": 0, "unused_complete": 0}

    @property
    def active(self) -> bool:
        return self.ratio > 1

    def dispatch_count(self, n: int) -> int:
        return math.ceil(self.ratio * n - 1e-9) if self.active else n

    def draw(self, n: int) -> list[dict]:
        """The records to generate for a call that needs ``n`` groups: carried ones first
        (oldest first), then fresh ones from the shard."""
        d = self.dispatch_count(n)
        take, self.carried = self.carried[:d], self.carried[d:]
        fresh = self.shard.next_batch(d - len(take))
        for r in fresh:
            r[CARRIES] = 0
        self.stats["dispatched"] += d
        return take + fresh

    def must_finish(self, records: list[dict]) -> tuple[int, ...]:
        cap = self.max_carries
        return tuple(i for i, r in enumerate(records) if cap and r.get(CARRIES, 0) >= cap)

    def select(self, rollout, records: list[dict], n: int, max_new_tokens: int):
        """The first ``n`` complete groups of ``rollout`` (generated for ``records`` with
        ``complete_groups = n``) as a rollout; the other records are kept for the next
        step. Returns (rollout of the batch, its records)."""
        if not self.active:
            return rollout, records
        ok = complete_groups(rollout, len(records), max_new_tokens)
        keep = [i for i in range(len(records)) if ok[i]][:n]
        if len(keep) < n:  # cannot happen with a decode that honours complete_groups
            raise RuntimeError(
                f"over-dispatch: {len(keep)} of {len(records)} groups complete, {n} needed "
                "(the policy adapter ignores Sampling.complete_groups)"
            )
        kept = set(keep)
        for i, r in enumerate(records):
            if i in kept:
                continue
            if ok[i]:  # complete but beyond the batch: carried as it was
                self.stats["unused_complete"] += 1
                if self.reuse:
                    self._unused.append(r)
            else:
                self.stats["cut_short"] += 1
                if self.reuse:
                    self._unused.append({**r, CARRIES: r.get(CARRIES, 0) + 1})
        G = len(rollout) // max(len(records), 1)
        rows = [i * G + g for i in keep for g in range(G)]
        return rollout.select(rows), [records[i] for i in keep]

    def end_step(self) -> dict[str, float]:
        """Carry this step's leftovers (after any still waiting) and report the step."""
        self.carried += self._unused
        self._unused = []
        out = {f"rollout/{k}_prompts": float(v) for k, v in self.stats.items()}
        out["rollout/carried_prompts"] = float(len(self.carried))
        self.stats = dict.fromkeys(self.stats, 0)
        return out

    # ------------------------------------------------------------------ run state
    def state_dict(self) -> list[list[int]]:
        return [[int(r["_index"]), int(r.get("_epoch", 0)), int(r[CARRIES])] for r in self.carried]

    def load_state_dict(self, state: list) -> None:
        self.carried, self._unused = [], []
        for index, epoch, carries in state:
            record = self.shard.load_record(int(index), int(epoch))
            record[CARRIES] = int(carries)
            self.carried.append(record)


def complete_groups(rollout, groups: int, max_new_tokens: int) -> list[bool]:
    """Per group: every sample ended (stopped, or used the whole token budget)."""
    if groups == 0:
        return []
    lengths = rollout.mask.sum(1)
    done = (
        ~rollout.truncated
        if rollout.truncated is not None
        else torch.ones(len(lengths), dtype=torch.bool)
    )
    done = done | (lengths >= max_new_tokens)
    return done.view(groups, -1).all(1).tolist()
