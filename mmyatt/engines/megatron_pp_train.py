"""A pipeline-parallel group as one controller (``train.backend: megatron`` with
``train.pipeline_parallel > 1`` inside ``mmyatt train``).

The ``pp`` processes of a pipeline group (megatron-core's layout) are one controller, as
a tensor-parallel group is (``megatron_group``): the same data on every stage, the
group's first rank generates and broadcasts the rollout with its RNG state, and only it
writes. Each process holds one stage of the GPTModel (``megatron_pp.build_stage``).

Generation: the first rank generates with the policy's Hugging Face model, into which
the whole trained weights are gathered from every stage after each update
(``join_stages``). Every process of the group holds that whole HF copy on top of its
stage, so on a GPU each one needs the memory of the whole model in the rollout dtype
besides its stage's weights, gradients and AdamW moments.

The update: the controller computes its RL loss from the log-probs (and entropies) the
policy returns, on every rank of the group alike. Those log-probs come from
megatron-core's pipeline schedule (``forward_backward``, 1F1B) run forward-only; the
last stage turns each microbatch's logits into log-probs and broadcasts them. Their
backward runs the schedule again with forward and backward: the loss of a microbatch on
the last stage is ``sum(lp * dL/dlp) + sum(entropy * dL/dentropy)`` with ``dL/d...``
the controller's loss gradient for those rows, whose parameter gradient is the RL
loss's exactly (the chain rule). The price is one more forward of the minibatch (the
schedule recomputes what the forward-only pass computed). Tied embeddings' gradients
are summed over the first and last stage; the gradient norm adds every stage's squared
norm once (the last stage's copy of tied embeddings not counted).

Checkpoints hold the whole HF-named weights and AdamW moments (every stage's), like
the tensor-parallel ones, so a run resumes exactly.
"""

from __future__ import annotations

import torch
import torch.distributed as tdist
import torch.nn.functional as F
from torch import Tensor

from mmyatt.engines.megatron_convert import hf_to_megatron
from mmyatt.engines.megatron_group import broadcast_rollout, clip_grad_norm_tp
from mmyatt.engines.megatron_model import MOMENTS, token_logprobs, trimmed_inputs, weights
from mmyatt.engines.megatron_policy import MegatronTextPolicy
from mmyatt.engines.megatron_pp import (
    forward_backward,
    join_stages,
    layer_key,
    load_stage_weights,
    stage_range,
    stage_weights,
)


def _stage_offset(hf_cfg) -> int:
    from megatron.core import parallel_state as ps

    pp, stage = ps.get_pipeline_model_parallel_world_size(), ps.get_pipeline_model_parallel_rank()
    return stage_range(hf_cfg.num_hidden_layers, pp, stage).start


def _tied_copy(model) -> bool:
    """True on the last stage of a pipeline whose output layer is a copy of the embedding."""
    from megatron.core import parallel_state as ps

    return (
        ps.get_pipeline_model_parallel_world_size() > 1
        and not ps.is_pipeline_first_stage()
        and bool(getattr(model, "share_embeddings_and_output_weights", False))
    )


class _PipelineLogprobs(torch.autograd.Function):
    """Log-probs and entropies from the pipeline (forward-only schedule); backward runs
    the schedule with the RL loss's gradient as the last stage's loss (module docstring)."""

    @staticmethod
    def forward(ctx, anchor, pipeline, batches):
        ctx.pipeline, ctx.batches = pipeline, batches
        return pipeline.pipeline_forward(batches)

    @staticmethod
    def backward(ctx, g_lp, g_ent):
        ctx.pipeline.pipeline_backward(ctx.batches, g_lp, g_ent)
        return None, None, None


class PipelineTextPolicy(MegatronTextPolicy):
    """A text policy trained as one pipeline stage per process (module docstring)."""

    def __init__(self, inner, model, hf_cfg):
        super().__init__(inner, model, hf_cfg)
        self._anchor = torch.zeros((), requires_grad=True)  # makes the log-probs differentiable

    def whole_weights(self) -> dict[str, Tensor]:
        return join_stages({k: v for k, v in weights(self.model).items()}, self.hf_cfg)

    def load_whole(self, state: dict[str, Tensor]) -> None:
        load_stage_weights(self.model, state, self.hf_cfg)

    def _group(self):
        from megatron.core import parallel_state as ps

        return ps.get_model_parallel_group()

    def generate(self, prompts, group_size, sampling, seeds):
        self.sync_weights()  # every stage joins the gather
        group = self._group()
        first = min(tdist.get_process_group_ranks(group))
        out = None
        if tdist.get_rank() == first:
            out = self._inner.generate(prompts, group_size, sampling, seeds)
        return broadcast_rollout(out, first, group)

    # ------------------------------------------------------------------ log-probs
    def _batches(self, rollout) -> tuple[list[dict], int]:
        """The minibatch as equal microbatches (``pp`` when the rows divide, else one),
        trimmed as ``MegatronTextPolicy.logprobs`` trims it; and the kept action length."""
        from megatron.core import parallel_state as ps

        ids, attn, actions, kept, temperature, last = trimmed_inputs(rollout)
        n = ids.shape[0]
        pp = ps.get_pipeline_model_parallel_world_size()
        m = pp if n % pp == 0 else 1
        b = n // m
        batches = [
            {
                "ids": ids[i * b : (i + 1) * b],
                "attn": attn[i * b : (i + 1) * b],
                "actions": actions[i * b : (i + 1) * b],
                "kept": kept[i * b : (i + 1) * b],
                "rows": slice(i * b, (i + 1) * b),
                "temperature": temperature,
                "last": last,
            }
            for i in range(m)
        ]
        return batches, last

    def _head(self, logits: Tensor, batch: dict) -> tuple[Tensor, Tensor]:
        """(lp, entropy) of one microbatch's logits, the adapter's conventions."""
        return token_logprobs(
            self._inner,
            logits,
            batch["actions"],
            batch["kept"],
            batch["temperature"],
            batch["last"],
        )

    def pipeline_forward(self, batches: list[dict]) -> tuple[Tensor, Tensor]:
        from megatron.core import parallel_state as ps

        outs: list[tuple[Tensor, Tensor]] = []

        def loss_fn(logits, batch):
            lp, ent = self._head(logits, batch)
            outs.append((lp.detach(), ent.detach()))
            return lp.sum().detach() * 0.0

        with torch.no_grad():
            forward_backward(self.model, batches, loss_fn, forward_only=True)
        n = sum(b["ids"].shape[0] for b in batches)
        shape = (n, batches[0]["last"])
        if outs:  # the last stage
            both = torch.stack([torch.cat([o[0] for o in outs]), torch.cat([o[1] for o in outs])])
        else:
            both = torch.empty((2, *shape), dtype=torch.float32)
        both = both.float().contiguous()
        # over this rank's pipeline: with TP x PP, each tensor-parallel rank's last stage
        # holds the same whole-vocabulary log-probs (parallel_output=False)
        tdist.broadcast(
            both,
            src=ps.get_pipeline_model_parallel_last_rank(),
            group=ps.get_pipeline_model_parallel_group(),
        )
        return both[0].clone(), both[1].clone()

    def pipeline_backward(self, batches: list[dict], g_lp: Tensor, g_ent: Tensor) -> None:
        m = len(batches)

        def loss_fn(logits, batch):
            lp, ent = self._head(logits, batch)
            rows = batch["rows"]
            value = (lp * g_lp[rows].to(lp)).sum() + (ent * g_ent[rows].to(ent)).sum()
            return value * m  # the schedule divides each microbatch's loss by m

        with torch.enable_grad():
            forward_backward(self.model, batches, loss_fn)

    def logprobs(self, rollout, with_entropy: bool = False):
        batches, last = self._batches(rollout)
        lp, ent = _PipelineLogprobs.apply(self._anchor, self, batches)
        A = rollout.actions.shape[1]
        lp = F.pad(lp, (0, A - last))
        if not with_entropy:
            return lp
        return lp, F.pad(ent, (0, A - last))


# --------------------------------------------------------------------- update pieces
def clip_grad_norm_pp(model, params, max_norm: float) -> Tensor:
    """``clip_grad_norm_`` over the pipeline's stages: every stage's squared norm summed
    over the pipeline group, the last stage's copy of tied embeddings not counted;
    with TP inside the stages, split weights' squared norms summed over the
    tensor-parallel group first, replicated ones counted once; every rank scales by the
    same factor. Returns the global norm (float32)."""
    skip = model.shared_embedding_or_output_weight() if _tied_copy(model) else None
    return clip_grad_norm_tp(params, max_norm, skip=skip, stages=True)


def optimizer_state_pp(model, optimizer, hf_cfg) -> dict:
    """AdamW's state of every stage, moments whole and HF-named (``join_stages``), steps
    by whole-model Megatron name; the same on every rank."""
    from megatron.core import parallel_state as ps

    sd = optimizer.state_dict()
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    state = {names[i]: s for i, s in sd["state"].items()}
    out = {"format": "hf-pp", "param_groups": sd["param_groups"], "step": {}}
    if not state:  # before the first step, on every stage alike
        return out
    offset = _stage_offset(hf_cfg)
    steps = {layer_key(n, offset): s["step"] for n, s in state.items()}
    gathered: list = [None] * ps.get_pipeline_model_parallel_world_size()
    tdist.all_gather_object(gathered, steps, group=ps.get_pipeline_model_parallel_group())
    out["step"] = {k: v for g in gathered for k, v in g.items()}
    for m in MOMENTS:
        out[m] = join_stages({n: s[m] for n, s in state.items()}, hf_cfg)
    return out


def load_optimizer_state_pp(model, optimizer, state: dict, hf_cfg) -> None:
    """This stage's part of ``optimizer_state_pp``'s state (its own parameter indices)."""
    from megatron.core import parallel_state as ps

    tp, pp = ps.get_tensor_model_parallel_world_size(), ps.get_pipeline_model_parallel_world_size()
    stage = ps.get_pipeline_model_parallel_rank()
    offset = _stage_offset(hf_cfg)
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    local = {}
    for m in MOMENTS:
        if m in state:
            full = hf_to_megatron(state[m], hf_cfg, tp, ps.get_tensor_model_parallel_rank())
            local[m] = stage_weights(full, hf_cfg, pp, stage)
    per = {}
    for i, n in enumerate(names):
        key = layer_key(n, offset)
        if key in state["step"]:
            per[i] = {"step": state["step"][key], **{m: local[m][n].clone() for m in local}}
    own = optimizer.state_dict()["param_groups"]
    groups = [{**g, "params": o["params"]} for g, o in zip(state["param_groups"], own)]
    optimizer.load_state_dict({"state": per, "param_groups": groups})
