"""How a step's samples are grouped and cut: group indices, the first groups of a
batch, minibatches of whole groups. Plain functions of a rollout, shared by the
controller (mmyatt/controller.py) and balanced placement (mmyatt/placement/runner.py)."""

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
