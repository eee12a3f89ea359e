"""The one trajectory type shared by every modality.

A rollout is N samples x A actions with a log-probability per action: tokens for
text/VLM, denoising transitions for flow models. N = B prompts x G samples; the G
samples of a prompt are contiguous and carry the same ``prompt_ids`` entry, and they
are always generated on the same rank, so groups never span ranks.

Algorithms read only the tensor fields; ``context`` is the adapter's private state
for recomputing log-probs and never leaves the rank that made it.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import Any

import torch
from torch import Tensor


def prompt_id(record: dict, i: int) -> str:
    """The ``prompt_ids`` entry of the samples answering ``record``, the i-th prompt of a
    generate call (text and VLM adapters; placement partial names streamed groups so)."""
    return str(record.get("id", record.get("_index", i)))


@dataclass
class Rollout:
    prompt_ids: list[str]  # (N,) which prompt each sample answers; equal ids = one group
    actions: Tensor  # (N, A, ...) token ids, or latents x_{k+1} per denoising step
    logprobs: Tensor  # (N, A) log pi_old(a|s) recorded at sampling time (fp32)
    mask: Tensor  # (N, A) 1.0 where an action counts (padding/after-EOS/untrained = 0)
    context: dict[str, Any]  # adapter state, every value indexed by sample on dim 0
    outputs: list[Any]  # (N,) decoded text / images / frames, for rewards and logs
    records: list[dict]  # (N,) the manifest record each sample answers
    truncated: Tensor | None = None  # (N,) bool: hit the action budget without stopping
    rewards: Tensor | None = None  # (N,) combined reward
    reward_parts: dict[str, Tensor] = field(default_factory=dict)  # name -> (N,)
    # (N,) per sample {judge term: question, raw answer, parsed verdict}; for the rollout log
    verdicts: list[dict] | None = None
    advantages: Tensor | None = None  # (N,) or (N, A)
    ref_logprobs: Tensor | None = None  # (N, A) log pi_ref(a|s)

    def __len__(self) -> int:
        return len(self.prompt_ids)

    @property
    def num_actions(self) -> int:
        return int(self.actions.shape[1])

    def group_slices(self) -> list[slice]:
        """Contiguous slices, one per prompt group, in order."""
        out, start = [], 0
        for i in range(1, len(self.prompt_ids) + 1):
            if i == len(self.prompt_ids) or self.prompt_ids[i] != self.prompt_ids[start]:
                out.append(slice(start, i))
                start = i
        return out

    def select(self, index: Tensor | list[int]) -> Rollout:
        """Samples ``index`` (in that order) as a new rollout; tensors are indexed, not copied lazily."""
        idx = torch.as_tensor(index, dtype=torch.long)
        ids = idx.tolist()
        kw = {}
        for f in fields(self):
            v = getattr(self, f.name)
            kw[f.name] = _take(v, idx, ids)
        return Rollout(**kw)

    @staticmethod
    def concat(parts: list[Rollout]) -> Rollout:
        """Samples of all ``parts`` in order. Action and context shapes must agree."""
        if not parts:
            raise ValueError("Rollout.concat needs at least one rollout")
        if len(parts) == 1:
            return parts[0]
        kw = {}
        for f in fields(Rollout):
            kw[f.name] = _cat([getattr(p, f.name) for p in parts], f.name)
        return Rollout(**kw)

    def with_(self, **changes) -> Rollout:
        return replace(self, **changes)


def _take(v: Any, idx: Tensor, ids: list[int]) -> Any:
    if v is None:
        return None
    if isinstance(v, Tensor):
        return v[idx]
    if isinstance(v, dict):
        return {k: _take(x, idx, ids) for k, x in v.items()}
    if isinstance(v, list | tuple):
        return [v[i] for i in ids]
    return v  # scalars shared by all samples (e.g. a sigma schedule kept as a float)


def _cat(vs: list[Any], name: str) -> Any:
    first = vs[0]
    if first is None:
        if any(v is not None for v in vs):
            raise ValueError(f"Rollout.concat: field {name!r} is set on some parts only")
        return None
    if isinstance(first, Tensor):
        shapes = {tuple(v.shape[1:]) for v in vs}
        if len(shapes) != 1:
            raise ValueError(f"Rollout.concat: field {name!r} has mismatched shapes {shapes}")
        return torch.cat(vs, 0)
    if isinstance(first, dict):
        keys = set(first)
        if any(set(v) != keys for v in vs):
            raise ValueError(f"Rollout.concat: field {name!r} has different keys across parts")
        return {k: _cat([v[k] for v in vs], f"{name}.{k}") for k in first}
    if isinstance(first, list | tuple):
        return [x for v in vs for x in v]
    if any(v != first for v in vs[1:]):
        raise ValueError(f"Rollout.concat: shared value {name!r} differs across parts: {vs}")
    return first
