"""One partial step with ``placement.merge_rollout``: the first controller generates
for all of them (``Placement._partial`` hands the step here). Kept apart from
``runner.py`` so that the modes there read in one sitting."""

from __future__ import annotations

import time
from dataclasses import replace
from typing import TYPE_CHECKING

from mmyatt.placement.stream import (
    JudgeStream,
    finished_unit,
    gather_records,
    in_row_order,
    rank_parts,
    scatter_parts,
)

if TYPE_CHECKING:
    from mmyatt.placement.config import CorePlan


def partial_merged(pl, ctl, n, sampling, timer, plan: CorePlan, judge):
    """placement.merge_rollout: every controller sends its records to the first, which
    generates all of them in one batch (one process on the rollout cores instead of
    one per controller taking turns) and streams each finished sample to the judge;
    then each controller gets back its own samples with their rewards. The samples
    are those each controller would have generated (generation is seeded per prompt,
    not per controller) and its data stays its own: only its records (text) and its
    samples' tensors travel. ``pl``: the controller's ``Placement``."""
    W, first = pl.dist.world_size, pl.dist.is_main
    G = pl.cfg.sampling.group_size
    records = pl.dispatch.draw(n)
    ctl.consumed += [rec["_index"] for rec in records]
    t0 = time.perf_counter()
    with timer("generate"):
        boxes = gather_records(records, W, first)
    parts, error = [None] * W, None
    if first:
        flat = [rec for box in boxes for rec in box]
        # each controller's stream would have sent up to stream_max_samples per call
        # at once: the one stream sends as many as all of theirs
        stream = JudgeStream(judge, pl.cfg.placement.stream_max_samples * W)
        try:
            with timer("generate"):
                send = stream.on_finished(flat, G)
                s = replace(sampling, on_finished=send, finished_unit=finished_unit(ctl.reward))
                r = ctl.generate(flat, s)
                stream.send_unreported(r)
            pl._acc["gen_s"] += time.perf_counter() - t0
            if pl.has_judge and pl.cfg.placement.widen_judge:
                pl._place_judge(plan.cores, len(plan.cores))  # generation is done
            stream.finish()
            t1 = time.perf_counter()
            with timer("reward"):
                results, error = stream.results()
            pl._acc["reward_s"] += time.perf_counter() - t1
        finally:
            stream.close()
        pl._acc["chunks"] += len(results)
        if error is None:
            parts = rank_parts(r, *in_row_order(results), [len(b) * G for b in boxes])
    t0 = time.perf_counter()
    with timer("wait"):  # the others wait here while the first generates
        mine = scatter_parts(parts, first)
    if not first:  # idle: its samples were generated (and judged) by the first
        pl._acc["wait_s"] += time.perf_counter() - t0
    pl._agree(ctl, error if first else None)
    r, scored, verdicts = mine
    return pl._scored(ctl, r, scored, verdicts, plan, timer)
