"""What a rank's update costs, in seconds, from the shapes its passes run.

A pass over a micro-batch pays for what the policy computes, padding included: the
prompt pass runs each prompt of the micro-batch once, padded to the widest, and the
completion pass every row, padded to the longest counted completion (the shapes
``mmyatt.step.batches.micro_batch_cost`` counts); attention pays per query-key pair, each
prompt over itself and each completion token over the padded prompt and completion (on
a small model as costly as the rest: a long prompt slows every completion); a VLM's vision tower runs over every
patch of an image or a clip whose pixels the sample still carries (a clip's frames make
many more patches than an image); a flow sample pays per trained denoising transition;
and every call pays a fixed overhead. These are the features of a micro-batch
(``FEATURES``); its time is a non-negative linear combination of them, one set of
coefficients per kind of pass (``train``: forward and backward, ``no_grad``: a forward
for log-probs), fitted by least squares on measured micro-batch times.

Micro-batches are cut by length (``length_buckets``): a rank's prompt groups sorted by
width and split where the model says one more call is cheaper than the padding it
saves, so groups of very different lengths on one rank (what balancing makes) do not
pad each other. The balancer (``balancer.py``) predicts each rank's update from these
shapes, and the same cut is what the update runs.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from operator import mul

import numpy as np
import torch

from mmyatt.rollout import Rollout

FEATURES = ("calls", "padded_tokens", "attention", "image_patches", "clip_patches", "transitions")
PASSES = ("train", "no_grad")
# before the first fit: a call costs as much as 64 padded tokens, a query-key pair 1/64
# of a token, a patch a token, a transition 64 tokens (seconds per padded token: the
# scale does not matter for cuts)
PRIOR = (64e-5, 1e-5, 1e-5 / 64, 1e-5, 1e-5, 64e-5)


@dataclass(frozen=True)
class GroupShape:
    """One prompt group as the update runs it: its rows, its prompt's columns, each
    row's action columns up to its last counted one, the vision tower's patches where
    the group still carries pixels (an image's and a clip's apart), its trained
    transitions (flow) and the elements that travel when it changes rank."""

    rows: int
    prompt: int
    actions: tuple[int, ...]
    image_patches: int = 0
    clip_patches: int = 0
    transitions: int = 0
    elements: int = 0

    @property
    def width(self) -> int:
        return self.prompt + max(self.actions, default=0)


def _patches(m: dict | None) -> tuple[int, int]:
    """Vision-tower patches of a media dict whose pixels are still there (an encoded
    sample's tower has run: 0, 0), images and clips apart."""
    if not m:
        return 0, 0
    out = []
    for pixels, grid in (
        ("pixel_values", "image_grid_thw"),
        ("pixel_values_videos", "video_grid_thw"),
    ):
        g = m.get(grid)
        if m.get(pixels) is None or g is None:
            out.append(0)
        else:
            out.append(int(torch.as_tensor(g).reshape(-1, 3).prod(1).sum()))
    return out[0], out[1]


def group_shapes(r: Rollout | None, kind: str) -> list[GroupShape]:
    """The shape of each prompt group of ``r`` (groups in order)."""
    if r is None or len(r) == 0:
        return []
    A = r.num_actions
    live = r.mask.reshape(len(r), A) > 0
    cols = torch.arange(1, A + 1, device=live.device).expand_as(live)
    actions = torch.where(live, cols, 0).max(1).values.tolist() if A else [0] * len(r)
    trained = r.mask.reshape(len(r), -1).sum(1).tolist()
    attn = r.context.get("attention_mask")
    text = isinstance(attn, torch.Tensor) and attn.dim() == 2 and attn.shape[1] >= A
    prompt = attn[:, : attn.shape[1] - A].sum(1).tolist() if text else [0] * len(r)
    media = r.context.get("media") if kind == "vlm" else None
    per_row = sum(
        v[0].numel() for v in r.context.values() if isinstance(v, torch.Tensor) and v.dim() >= 1
    ) + 3 * (r.actions[0].numel() if len(r) else 0)
    out = []
    flow = kind == "flow"  # no tokens: a sample's cost is its trained transitions
    for sl in r.group_slices():
        image, clip = _patches(media[sl.start]) if media is not None else (0, 0)
        rows = sl.stop - sl.start
        out.append(
            GroupShape(
                rows=rows,
                prompt=0 if flow else int(max(prompt[sl])),
                actions=() if flow else tuple(int(a) for a in actions[sl]),
                image_patches=image,
                clip_patches=clip,
                transitions=int(sum(trained[sl])) if flow else 0,
                elements=rows * per_row,
            )
        )
    return out


def features(groups: Sequence[GroupShape]) -> list[float]:
    """``FEATURES`` of one pass over ``groups`` together (one call)."""
    if not groups:
        return [0.0] * len(FEATURES)
    return _pass_features(
        len(groups),
        max(g.prompt for g in groups),
        max(max(g.actions, default=0) for g in groups),
        sum(g.rows for g in groups),
        sum(g.image_patches for g in groups),
        sum(g.clip_patches for g in groups),
        sum(g.transitions for g in groups),
    )


def _pass_features(
    groups: int, wide: int, long: int, rows: int, image: int, clip: int, steps: int
) -> list[float]:
    """``FEATURES`` of a pass over ``groups`` prompt groups of ``rows`` rows in all, padded
    to the widest prompt ``wide`` and the longest completion ``long``."""
    return [
        1.0,
        float(groups * wide + rows * long),
        # query-key pairs: each prompt over itself, each completion over prompt and itself
        float(groups * wide * wide + rows * long * (wide + long)),
        float(image),
        float(clip),
        float(steps),
    ]


def length_buckets(
    groups: Sequence[GroupShape], cost: Callable[[list[float]], float], budget: int = 0
) -> list[list[int]]:
    """Indices of ``groups`` cut into micro-batches by length: sorted by width, then
    split into consecutive runs so that the summed ``cost`` of the runs' ``features``
    is least (dynamic programming over the sorted order). With ``budget`` > 0 no run
    of two or more groups pads to more than ``budget`` tokens. Each run's indices in
    the groups' order; runs shortest first."""
    n = len(groups)
    if n == 0:
        return []
    order = sorted(range(n), key=lambda i: (groups[i].width, groups[i].prompt, i))
    g = [groups[i] for i in order]
    longest = [max(x.actions, default=0) for x in g]
    best = [0.0] + [float("inf")] * n
    cut = [0] * (n + 1)
    for end in range(1, n + 1):
        # the features of run [start, end), its maxima and sums grown one group at a
        # time instead of ``features`` over the whole run for every start
        wide = long = rows = image = clip = steps = 0
        for start in range(end - 1, -1, -1):
            x_g = g[start]
            wide, long = max(wide, x_g.prompt), max(long, longest[start])
            rows += x_g.rows
            image, clip = image + x_g.image_patches, clip + x_g.clip_patches
            steps += x_g.transitions
            k = end - start
            x = _pass_features(k, wide, long, rows, image, clip, steps)
            if budget > 0 and k > 1 and x[1] > budget:
                break  # a longer run pads to more still
            c = best[start] + cost(x)
            if c < best[end]:
                best[end], cut[end] = c, start
    runs, end = [], n
    while end > 0:
        runs.append(sorted(order[cut[end] : end]))
        end = cut[end]
    return runs[::-1]


def nnls(X: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Non-negative least squares for a few columns: the best of the least-squares
    fits on every subset of columns whose coefficients are all non-negative (exact for
    the handful of features here). A column that is zero in every row gets 0."""
    k = X.shape[1]
    used = [j for j in range(k) if np.any(X[:, j] != 0)]
    best, best_err = np.zeros(k), float(np.sum(y**2))
    for size in range(1, len(used) + 1):
        for cols in itertools.combinations(used, size):
            sub = X[:, cols]
            coef, *_ = np.linalg.lstsq(sub, y, rcond=None)
            if np.any(coef < 0):
                continue
            err = float(np.sum((sub @ coef - y) ** 2))
            if err < best_err - 1e-15:
                best = np.zeros(k)
                best[list(cols)] = coef
                best_err = err
    return best


class CostModel:
    """Seconds per micro-batch pass from its ``FEATURES``: one coefficient vector per
    pass kind (``PASSES``), the prior until fitted. ``fit`` takes measured
    ``(pass, features, seconds)`` observations."""

    def __init__(self, coef: dict[str, list[float]] | None = None):
        self.coef = {p: list(PRIOR) for p in PASSES}
        self.fitted = False
        if coef:
            self.coef.update({p: list(c) for p, c in coef.items()})
            self.fitted = True

    def predict(self, x: Sequence[float], kind: str = "train") -> float:
        return float(sum(map(mul, self.coef[kind], x)))

    def fit(self, observations: Sequence[tuple[str, Sequence[float], float]]) -> None:
        """Each pass kind with observations gets its least-squares coefficients; a kind
        never observed keeps its coefficients."""
        for kind in PASSES:
            rows = [(x, t) for k, x, t in observations if k == kind]
            if not rows:
                continue
            X = np.array([x for x, _ in rows], dtype=np.float64)
            y = np.array([t for _, t in rows], dtype=np.float64)
            self.coef[kind] = nnls(X, y).tolist()
        self.fitted = True

    def state_dict(self) -> dict:
        return {"coef": {k: list(v) for k, v in self.coef.items()}, "fitted": self.fitted}

    def load_state_dict(self, state: dict) -> None:
        self.coef = {k: list(v) for k, v in state["coef"].items()}
        self.fitted = bool(state["fitted"])


def rank_seconds(
    model: CostModel,
    minibatches: Sequence[Sequence[GroupShape]],
    epochs: int,
    no_grad_passes: int,
    budget: int = 0,
    bucketed: bool = True,
) -> tuple[list[float], float]:
    """A rank's predicted update: per minibatch, ``epochs`` training passes over its
    micro-batches (``cut``); and the no-grad passes (recomputed log-probs, reference)
    over all its groups at once, ``no_grad_passes`` of them."""
    train = [
        epochs
        * sum(model.predict(features([mb[i] for i in b])) for b in cut(model, mb, budget, bucketed))
        for mb in minibatches
    ]
    every = [g for mb in minibatches for g in mb]
    ng = no_grad_passes * sum(
        model.predict(features([every[i] for i in b]), "no_grad")
        for b in cut(model, every, budget, bucketed)
    )
    return train, ng


def cut(
    model: CostModel, groups: Sequence[GroupShape], budget: int = 0, bucketed: bool = True
) -> list[list[int]]:
    """The micro-batches the update runs ``groups`` in: length buckets by ``model``'s
    training cost; or, ``bucketed`` False (a step that moved nothing runs as without
    balancing), one pass, or with a ``budget`` the fewest runs within it."""
    if bucketed:
        return length_buckets(groups, model.predict, budget)
    if budget <= 0:
        return [list(range(len(groups)))] if groups else []
    return length_buckets(groups, lambda x: x[0], budget)
