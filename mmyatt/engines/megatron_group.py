"""A tensor-parallel group as one controller (``train.backend: megatron`` with
``train.tensor_parallel > 1`` inside ``mmyatt train``; a pipeline group with
``train.pipeline_parallel > 1`` is one controller the same way, see ``megatron_pp_train``).

``distributed.nproc`` processes form ``nproc / tp`` data-parallel controllers; the ``tp``
consecutive ranks of a tensor-parallel group (megatron-core's layout) are one controller:

- Every rank of the group runs the controller's loop on the same data: its ``Dist`` is
  a :class:`GroupDist` whose ``rank`` / ``world_size`` are the data-parallel ones, so the
  group's ranks draw the same prompts, and sums (metrics, advantages, gradient
  all-reduce) run over the data-parallel group, where each controller counts once.
- Generation runs on the group's first rank only; the rollout (and that rank's RNG
  state, so every later draw agrees) is broadcast to the others
  (``MegatronTextPolicy.generate``). Scoring too: the group's first rank calls the
  rewards (rules and judges) and broadcasts rewards, parts and verdicts, or its judge
  error, over a gloo group of its own (:class:`GroupReward`), so the group agrees on
  rewards even where two calls to a judge could answer differently, and the judges see
  one request per sample, as with one process per controller.
- The Megatron forward and backward of the loss are the tensor-parallel collectives;
  the gradient norm adds the squared norms of split weights over the group and counts
  replicated ones (RMSNorm weights) once (:func:`clip_grad_norm_tp`).
- Only the group's first rank writes: the others run with a private run directory
  (trace and rollout files) and a :class:`MirrorCheckpointer` that reads the run's
  checkpoints but writes none (their state equals the first rank's: run-state
  checkpoints hold whole, HF-named weights and optimizer moments).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as tdist
from torch import Tensor

from mmyatt.checkpoint.checkpointer import Checkpointer, rng_state, set_rng_state
from mmyatt.distributed import Dist
from mmyatt.engines.megatron_model import init_parallel
from mmyatt.protocols import Reward
from mmyatt.serving.client import JudgeError


class GroupDist(Dist):
    """A controller that spans a tensor-parallel group: data-parallel rank and size,
    sums over the data-parallel group; barriers, ``any`` and object broadcasts over
    every process (the group's ranks must take the same branches); only global rank 0
    is ``is_main``."""

    model_parallel = True

    def __init__(self, base: Dist, tp: int, pp: int = 1):
        from megatron.core import parallel_state as ps

        init_parallel(tp, pp)
        super().__init__(
            ps.get_data_parallel_rank(), ps.get_data_parallel_world_size(), str(base.device)
        )
        self.backend = base.backend
        self.global_rank, self.processes = tdist.get_rank(), tdist.get_world_size()
        self.tp, self.tp_rank = tp, ps.get_tensor_model_parallel_rank()
        self.pp, self.pp_rank = pp, ps.get_pipeline_model_parallel_rank()
        self.group = ps.get_data_parallel_group()
        self.mirror = self.tp_rank != 0 or self.pp_rank != 0  # runs the loop, writes nothing

    def describe(self) -> str:
        return (
            f"[device] controller {self.rank} of {self.world_size} (model-parallel group of "
            f"{self.tp * self.pp} processes: tensor {self.tp} x pipeline {self.pp}) on "
            f"{self.device}, backend {self.backend}"
        )

    @property
    def is_main(self) -> bool:
        return self.global_rank == 0

    def any(self, flag: bool) -> bool:
        t = torch.tensor([1.0 if flag else 0.0], dtype=torch.float64, device=self.device)
        tdist.all_reduce(t)
        return bool(t.item() > 0)

    def barrier(self) -> None:
        tdist.barrier()

    def broadcast_object(self, obj=None):
        box = [obj]
        tdist.broadcast_object_list(box, src=0)
        return box[0]


def controller_dist(dist: Dist, tensor_parallel: int, pipeline_parallel: int) -> Dist:
    """The controller's ``Dist``: a :class:`GroupDist` when a Megatron model-parallel
    group (``tensor_parallel`` x ``pipeline_parallel`` processes) is one controller, else
    ``dist`` itself."""
    tp, pp = int(tensor_parallel), int(pipeline_parallel)
    if tp * pp == 1:
        return dist
    procs = tdist.get_world_size() if tdist.is_initialized() else 1
    if procs % (tp * pp):
        raise ValueError(
            f"train.tensor_parallel={tp} x train.pipeline_parallel={pp} does "
            f"not divide the {procs} processes (distributed.nproc)"
        )
    return GroupDist(dist, tp, pp)


class MirrorCheckpointer(Checkpointer):
    """What a non-writing rank of a tensor-parallel group uses: it joins the
    constructor's barrier and reads the run's checkpoints, and ``save`` writes nothing
    (the group's first rank writes the same state)."""

    def __init__(self, root, **kw):
        kw["clean_stale"] = False
        super().__init__(root, **kw)

    def save(self, step: int, shared, local) -> None:
        return None


def broadcast_rollout(out, tp_group_first: int, group):
    """The group's first rank's rollout and RNG state on every rank of ``group``."""
    box = [(out, rng_state()) if out is not None else None]
    tdist.broadcast_object_list(box, src=tp_group_first, group=group)
    rollout, rng = box[0]
    set_rng_state(rng)
    return rollout


def clip_grad_norm_tp(params, max_norm: float, *, skip=None, stages: bool = False) -> Tensor:
    """``clip_grad_norm_`` over a model-parallel model: split weights' squared norms
    summed over the tensor-parallel group, replicated ones counted once; with
    ``stages`` (pipeline parallel) the result summed over the pipeline group too, with
    ``skip`` (a parameter: the last stage's copy of tied embeddings) left out of the
    norm but scaled. Every rank scales its shards by the same factor. Returns the
    global norm (float32)."""
    from megatron.core import parallel_state as ps

    split = torch.zeros((), dtype=torch.float64)
    replicated = torch.zeros((), dtype=torch.float64)
    grads = []
    for p in params:
        if p.grad is None:
            continue
        grads.append(p.grad)
        if p is skip:
            continue
        sq = p.grad.detach().double().square().sum().cpu()
        if getattr(p, "tensor_model_parallel", False):
            split += sq
        else:
            replicated += sq
    dev = grads[0].device if grads else torch.device("cpu")
    if ps.get_tensor_model_parallel_world_size() > 1:
        s = split.to(dev)
        tdist.all_reduce(s, group=ps.get_tensor_model_parallel_group())
        split = s.cpu()
    total = split + replicated
    if stages:
        s = total.to(dev)
        tdist.all_reduce(s, group=ps.get_pipeline_model_parallel_group())
        total = s.cpu()
    norm = math.sqrt(float(total))
    coef = max_norm / (norm + 1e-6)
    if coef < 1.0:
        for g in grads:
            g.detach().mul_(coef)
    return torch.tensor(norm, dtype=torch.float32)


class GroupReward:
    """The rewards of a model-parallel group that is one controller: the group's first
    rank scores (its judge calls go out once) and broadcasts ``(rewards, parts,
    verdicts)`` to the group; a judge error there is raised on every rank of the group
    as a ``JudgeError``, any other error as a ``RuntimeError``, so no rank waits in a
    broadcast that never comes. The broadcasts run over a gloo group of their own:
    placement.mode=partial scores chunks in a background thread while the main thread
    broadcasts the next chunk's rollout over the model-parallel group."""

    def __init__(self, inner: Reward, src: int, group):
        self.inner, self.src, self.group = inner, src, group
        self.last_verdicts: list[dict] = []

    @property
    def names(self) -> list[str]:
        return self.inner.names

    @property
    def reads_latents(self) -> bool:
        return self.inner.reads_latents

    @property
    def compares_groups(self) -> bool:
        return self.inner.compares_groups

    def __call__(self, outputs, records, prompt_ids=None):
        box: list = [None]
        if tdist.get_rank() == self.src:
            try:
                out = self.inner(outputs, records, prompt_ids)
            except Exception as e:
                box[0] = ("judge" if isinstance(e, JudgeError) else "error", repr(e))
                tdist.broadcast_object_list(box, src=self.src, group=self.group)
                raise
            box[0] = ("ok", out, self.inner.last_verdicts)
        tdist.broadcast_object_list(box, src=self.src, group=self.group)
        kind, *rest = box[0]
        if kind == "judge":
            raise JudgeError(f"the judge calls of this group's first rank failed: {rest[0]}")
        if kind == "error":
            raise RuntimeError(f"the rewards of this group's first rank failed: {rest[0]}")
        out, self.last_verdicts = rest
        return out


def group_reward(reward: Reward, dist) -> Reward:
    """``reward`` as the controller calls it: a :class:`GroupReward` on every process of a
    model-parallel group when ``dist`` is a :class:`GroupDist`, else ``reward`` itself.
    Every process must call this (it creates one gloo group per model-parallel group)."""
    if not isinstance(dist, GroupDist):
        return reward
    from megatron.core import parallel_state as ps

    mine = sorted(tdist.get_process_group_ranks(ps.get_model_parallel_group()))
    every: list = [None] * tdist.get_world_size()
    tdist.all_gather_object(every, mine)
    groups = sorted({tuple(g) for g in every})
    own = None
    for ranks in groups:  # every process creates every group, in the same order
        g = tdist.new_group(list(ranks), backend="gloo")
        if list(ranks) == mine:
            own = g
    return GroupReward(reward, mine[0], own)
