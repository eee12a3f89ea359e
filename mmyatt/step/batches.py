"""How a step's samples are grouped and cut: group indices, the first groups of a
batch, minibatches of whole groups. Plain functions of a rollout, shared by the
controller (mmyatt/step/controller.py) and balanced placement (mmyatt/placement/runner.py)."""

from __future__ import annotations

import torch

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
