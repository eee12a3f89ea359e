"""How a step's samples are grouped and cut: group indices, the first groups of a
batch, the minibatches of an update (whole groups, or as ``placement.balance`` moved
them), and micro-batches of a bounded padded width run as many on every rank. Leaves out
what runs on each cut (``mmyatt.step.trainer``, ``mmyatt.step.policy_loss``) and how the
groups move between ranks (``mmyatt.placement.exchange``)."""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import nullcontext

import torch

from mmyatt.distributed import Lockstep
from mmyatt.outputs.metrics import PhaseTimer
from mmyatt.rollout import Rollout


def group_index(r: Rollout) -> torch.Tensor:
    """(N,) long: the prompt group of each sample (groups are contiguous)."""
    index = torch.empty(len(r), dtype=torch.long)
    for g, sl in enumerate(r.group_slices()):
        index[sl] = g
    return index


def first_groups(parts: list[Rollout], n_groups: int) -> Rollout:
    """The first ``n_groups`` prompt groups of ``parts`` concatenated."""
    r = Rollout.concat(parts)
    slices = r.group_slices()[:n_groups]
    return r.select([i for sl in slices for i in range(sl.start, sl.stop)])


def minibatches(r: Rollout, m: int) -> list[Rollout | None]:
    """m chunks of whole groups, in order; a rank with fewer groups gets empty chunks,
    so every rank takes the same number of optimizer steps."""
    slices = r.group_slices()
    per, extra = divmod(len(slices), m)
    out, start = [], 0
    for i in range(m):
        k = per + (1 if i < extra else 0)
        chunk = slices[start : start + k]
        start += k
        idx = [j for sl in chunk for j in range(sl.start, sl.stop)]
        out.append(r.select(idx) if idx else None)
    return out


def row_widths(r: Rollout) -> tuple[list[int], list[int]]:
    """Per sample, the prompt columns it uses and the action columns up to its last
    counted action. Text and VLM contexts: ``attention_mask`` over prompt + actions,
    prompt left-padded; a context without one (flow latents) counts no prompt."""
    A = r.num_actions
    attn = r.context.get("attention_mask")
    if isinstance(attn, torch.Tensor) and attn.dim() == 2 and attn.shape[1] >= A:
        prompt = attn[:, : attn.shape[1] - A].sum(1).tolist()
    else:
        prompt = [0] * len(r)
    live = r.mask.reshape(len(r), A) > 0
    cols = torch.arange(1, A + 1, device=live.device).expand_as(live)
    actions = torch.where(live, cols, 0).max(1).values.tolist() if A else [0] * len(r)
    return [int(p) for p in prompt], [int(a) for a in actions]


def micro_batch_cost(r: Rollout, rows: list[int], prompt: list[int], action: list[int]) -> int:
    """Padded tokens a text policy's forward over ``rows`` pays: its prompt pass runs
    each prompt of the micro-batch once (the rows of a group share it), padded to the
    widest, and its completion pass every row, padded to the longest counted completion."""
    prompts = len({r.prompt_ids[i] for i in rows})
    return prompts * max(prompt[i] for i in rows) + len(rows) * max(action[i] for i in rows)


def _units(rows: list[int], index: list[int] | None) -> list[list[int]]:
    """``rows`` as the units a cut moves: single rows, or with ``index`` (each row's
    prompt group, ``group_index``) the rows of each group."""
    if index is None:
        return [[i] for i in rows]
    units: dict[int, list[int]] = {}
    for i in rows:
        units.setdefault(index[i], []).append(i)
    return list(units.values())


def token_micro_batches(r: Rollout, max_tokens: int, whole_groups: bool = False) -> list[list[int]]:
    """Rows of ``r`` cut into micro-batches of at most ``max_tokens`` padded tokens each
    (``micro_batch_cost``).

    Rows go longest completion first, so long completions share micro-batches and short
    ones are not padded to them; within a micro-batch the rows keep their order, so the
    rows of one prompt group that land together stay adjacent and share one prompt
    pass. A single row over the budget is a micro-batch of its own. With
    ``whole_groups``, the cut moves whole prompt groups instead of rows (a group over
    the budget alone): on a sharded engine every forward is a collective, and a
    micro-batch of whole groups makes the same forwards as a minibatch does, whatever
    the adapter. With ``max_tokens <= 0``, every row in one micro-batch."""
    n = len(r)
    if max_tokens <= 0 or n == 0:
        return [list(range(n))] if n else []
    prompt, action = row_widths(r)
    out: list[list[int]] = []
    cur: list[int] = []
    ids: set[str] = set()
    wide = long = 0  # the current micro-batch's widest prompt, longest completion
    units = _units(list(range(n)), group_index(r).tolist() if whole_groups else None)
    for u in sorted(units, key=lambda u: -max(action[i] for i in u)):  # stable
        k = len(ids | {r.prompt_ids[i] for i in u})
        w = max(wide, *(prompt[i] for i in u))
        a = max(long, *(action[i] for i in u))
        if cur and k * w + (len(cur) + len(u)) * a > max_tokens:  # micro_batch_cost with u
            out.append(sorted(cur))
            cur, ids = [], set()
            w, a = max(prompt[i] for i in u), max(action[i] for i in u)
        cur += u
        ids |= {r.prompt_ids[i] for i in u}
        wide, long = w, a
    out.append(sorted(cur))
    return out


def _halve(r: Rollout, units: list[list[int]], prompt: list[int], action: list[int]):
    """A micro-batch of two or more ``units`` cut in two, its units longest completion
    first, at the point that leaves the costlier side cheapest; each side in order."""
    order = sorted(units, key=lambda u: -max(action[i] for i in u))  # stable
    best, cut = None, 1
    for k in range(1, len(order)):
        left = [i for u in order[:k] for i in u]
        right = [i for u in order[k:] for i in u]
        worst = max(
            micro_batch_cost(r, left, prompt, action), micro_batch_cost(r, right, prompt, action)
        )
        if best is None or worst < best:
            best, cut = worst, k
    return sorted(i for u in order[:cut] for i in u), sorted(i for u in order[cut:] for i in u)


def to_count(
    r: Rollout, parts: list[list[int]], count: int, whole_groups: bool = False
) -> list[list[int]]:
    """``parts`` (micro-batches of ``r``) made exactly ``count``, so that every rank runs
    the same number of micro-batches (``count`` is the fullest rank's).

    While there are too few, the costliest micro-batch of two or more units (rows, or
    with ``whole_groups`` prompt groups) is cut in two (``_halve``); when none has two
    (a rank with fewer units than the count), empty micro-batches make up the rest, and
    the controller runs nothing or, on a sharded engine, a zero-weight pass for each."""
    if count < len(parts):
        raise ValueError(f"cannot make {len(parts)} micro-batches into {count}")
    out = [list(p) for p in parts]
    prompt, action = row_widths(r) if out else ([], [])
    index = group_index(r).tolist() if whole_groups and out else None
    while len(out) < count:
        units = [_units(p, index) for p in out]
        cand = [j for j in range(len(out)) if len(units[j]) >= 2]
        if not cand:
            return out + [[] for _ in range(count - len(out))]
        j = max(cand, key=lambda j: (micro_batch_cost(r, out[j], prompt, action), -j))
        out[j : j + 1] = list(_halve(r, units[j], prompt, action))
    return out


def micro_parts(r: Rollout | None, budget: int, dist, lockstep: bool) -> list[list[int]]:
    """This rank's micro-batches of ``r`` (``algorithm.micro_batch_tokens``), as many as
    the fullest rank's (one all-reduce): every rank runs the same number, some of them
    empty where a rank has too few rows (``to_count``). On a sharded engine they hold
    whole prompt groups, so each makes the forwards a minibatch makes, on every rank.
    ``budget <= 0``: one pass, no collective."""
    n = 0 if r is None else len(r)
    if budget <= 0:
        return [list(range(n))] if n else []
    parts = token_micro_batches(r, budget, lockstep) if n else []
    count = max(dist.gather_ints(len(parts)))
    return to_count(r, parts, count, lockstep) if n else [[] for _ in range(count)]


def in_micro_batches(fn, r: Rollout, parts: list[list[int]], idle) -> torch.Tensor:
    """(N, A) ``fn(r)`` with no gradient, run over ``parts``; an empty part runs
    ``idle(fn)`` (a sharded engine's filler pass, its result dropped)."""
    if len(parts) == 1 and parts[0]:  # one pass over every row
        return fn(r).detach()
    out = None
    for rows in parts:
        if not rows:
            idle(fn)
            continue
        lp = fn(r.select(rows)).detach()
        if out is None:
            out = lp.new_zeros((len(r), *lp.shape[1:]))
        out[torch.as_tensor(rows, device=lp.device)] = lp
    return out if out is not None else r.mask.new_zeros(r.mask.shape)


class MicroBatches:
    """``algorithm.micro_batch_tokens``: a minibatch's passes cut into micro-batches of at
    most that many padded tokens, as many on every rank; 0 runs one pass. With a
    ``planner`` (``placement.balance``: the balancer's cost model) every pass is timed for
    the model, and on a step that moved groups the passes run in length buckets of whole
    groups instead (``cost_model.length_buckets``, within the budget when there is one),
    so that long and short groups on one rank do not pad each other."""

    def __init__(self, budget: int, lockstep: Lockstep, planner=None):
        self.budget, self.lockstep, self.planner = budget, lockstep, planner

    @property
    def active(self) -> bool:
        return self.budget > 0 or self.planner is not None

    def parts(self, r: Rollout | None) -> list[list[int]]:
        parts = self.planner.parts(r) if self.planner is not None else None
        if parts is None:  # no planner, or a step that moved no groups
            return micro_parts(r, self.budget, self.lockstep.dist, self.lockstep.active)
        if not self.lockstep.active:  # passes are local: each rank runs its own count
            return parts
        count = max(self.lockstep.dist.gather_ints(len(parts)))
        return to_count(r, parts, count, True) if parts else [[] for _ in range(count)]

    def timed(self, r: Rollout | None):
        """Context for one training pass over ``r``: timed for the cost model."""
        return self.planner.timed(r) if self.planner is not None else nullcontext()

    def no_grad(self, fn: Callable[[Rollout], torch.Tensor], r: Rollout) -> torch.Tensor | None:
        """(N, A) ``fn(r)`` without gradient, micro-batch by micro-batch; None when this
        rank has no rows to run (after joining the pass a sharded engine needs)."""
        parts = self.parts(r)
        if not parts:
            self.lockstep.idle(fn)
            return None
        run = self.planner.no_grad_fn(fn) if self.planner is not None else fn
        return in_micro_batches(run, r, parts, self.lockstep.idle)


class Minibatches:
    """The minibatches of a step's update: ``m`` chunks of whole prompt groups, in order,
    or with ``exchange`` (``placement.balance``) the groups re-partitioned over the
    controllers after advantages. ``encode_media``: a VLM's vision tower, run once per
    prompt before its samples move (features travel, never pixels)."""

    def __init__(self, m: int, exchange=None, encode_media: Callable | None = None):
        self.m, self.exchange, self.encode_media = m, exchange, encode_media
        self._balanced = False

    def balance(self, r: Rollout, timer: PhaseTimer) -> tuple[Rollout, dict[str, float]]:
        """This rank's share of the step's samples after the exchange (``r`` itself where
        there is none, or the plan moves nothing), and the plan's figures."""
        self._balanced = False
        if self.exchange is None:
            return r, {}
        with timer("balance_plan"):
            plan = self.exchange.plan(minibatches(r, self.m))
        if not plan.applied:
            return r, dict(plan.stats)
        t0 = time.perf_counter()
        if self.encode_media is not None:
            with timer("encode_media"):  # the frozen vision tower, once per prompt
                r = self.encode_media(r)
        with timer("balance"):
            out = self.exchange.apply(minibatches(r, self.m), plan)
        seconds = time.perf_counter() - t0
        self.exchange.balancer.exchanged(plan.moved_elements, seconds)
        self._balanced = True
        stats = {**plan.stats, "balance/exchange_s": seconds}
        return (out if out is not None else r.select([])), stats

    def report(self, dist) -> dict[str, float]:
        """After the update: every rank's wait at the gradient all-reduce
        (``Dist.wait_for_slowest``) and, with balancing, the cost model's prediction
        against the measured passes (``Balancer.report``)."""
        out = dist.idle_metrics()
        if self.exchange is not None:
            out.update(self.exchange.balancer.report())
        return out

    def state_dict(self) -> dict:
        """The balancer's measurements and fitted model (run state: a resumed run plans
        as the uninterrupted one would)."""
        return {"balance": self.exchange.balancer.state_dict()} if self.exchange else {}

    def load_state_dict(self, local: dict) -> None:
        if self.exchange is not None:
            self.exchange.balancer.load_state_dict(local.get("balance"))

    @property
    def balanced(self) -> bool:
        """The last step's samples were exchanged (this rank trains on others' samples)."""
        return self._balanced

    def split(self, r: Rollout) -> list[Rollout | None]:
        if self._balanced:
            return self.exchange.split(r)
        return minibatches(r, self.m)
