"""Pipeline parallelism for the megatron-core GPT (``train.backend: megatron``).

``init_parallel(tp, pp)`` builds megatron-core's groups; ``build_stage(hf_cfg, tp, pp)``
builds this rank's stage of the GPTModel: its ``num_layers / pp`` consecutive decoder
layers, plus the embedding on the first stage and the final norm and output layer on the
last. Stage ``s`` holds HF layers ``s * L/pp ...``; megatron numbers them from 0 inside
the stage (``decoder.layers.0`` of stage 1 is HF layer ``L/pp``).

``forward_backward(model, batches, loss_fn)`` runs megatron-core's own schedule
(``get_forward_backward_func``): ``forward_backward_no_pipelining`` with one stage,
``forward_backward_pipelining_without_interleaving`` (1F1B) with more. Activations go
between stages by point-to-point sends on the pipeline group (gloo on CPU). The loss of
each microbatch is ``loss_fn(logits, batch)``; the schedule divides it by the number of
microbatches before its backward, so the gradients are those of the mean microbatch loss.

Tied embeddings with more than one stage: megatron keeps a copy of the word embeddings
as the last stage's output layer (initialised from the first stage's through the
embedding group); after a backward their gradients are summed over that group
(``allreduce_tied_embedding_grads``), as megatron's ``finalize_model_grads`` does.

CPU: besides ``megatron_model.cpu_shims``, two more, each only around megatron's own calls on
a CPU-only torch: ``cpu_tensors`` (building a stage: the tied-embedding set-up calls
``.cuda()``) and ``cpu_schedule`` (the schedules count tokens in a ``torch.zeros(device="cuda")`` and the
p2p path may call ``torch.cuda.synchronize``; gloo's sends complete on the CPU).
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from torch import Tensor

from mmyatt.engines.megatron_convert import check_tp, hf_to_megatron, megatron_to_hf
from mmyatt.engines.megatron_model import (
    attention_inputs,
    cpu_current_device,
    rng_states,
    rope_theta,
    transformer_config,
)


def init_parallel(tp: int = 1, pp: int = 1) -> None:
    """megatron-core's tensor- and pipeline-parallel groups over the running process group."""
    from megatron.core import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp
        )
    rng_states()


def stage_range(num_layers: int, pp: int, stage: int) -> range:
    if num_layers % pp:
        raise ValueError(
            f"pipeline parallel size {pp} does not divide num_hidden_layers={num_layers}"
        )
    per = num_layers // pp
    return range(stage * per, (stage + 1) * per)


def build_stage(hf_cfg, tp: int = 1, pp: int = 1, dtype: torch.dtype = torch.float32):
    """This rank's stage (and TP shard) of the GPTModel for the HF config."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    check_tp(hf_cfg, tp)
    stage_range(hf_cfg.num_hidden_layers, pp, 0)
    config = transformer_config(hf_cfg, tp, dtype)
    config.pipeline_model_parallel_size = pp
    config.pipeline_dtype = dtype
    config.batch_p2p_comm = False  # plain isend/irecv pairs (gloo)
    with cpu_tensors():
        return GPTModel(
            config=config,
            transformer_layer_spec=get_gpt_layer_local_spec(normalization="RMSNorm"),
            vocab_size=hf_cfg.vocab_size,
            max_sequence_length=hf_cfg.max_position_embeddings,
            pre_process=parallel_state.is_pipeline_first_stage(),
            post_process=parallel_state.is_pipeline_last_stage(),
            parallel_output=False,
            share_embeddings_and_output_weights=bool(hf_cfg.tie_word_embeddings),
            position_embedding_type="rope",
            rotary_base=int(rope_theta(hf_cfg)),
        )


def layer_key(key: str, offset: int) -> str:
    """``decoder.layers.i.rest`` with ``i`` shifted by ``offset`` (other keys unchanged)."""
    if not key.startswith("decoder.layers."):
        return key
    _, _, i, rest = key.split(".", 3)
    return f"decoder.layers.{int(i) + offset}.{rest}"


def stage_weights(full: dict[str, Tensor], hf_cfg, pp: int, stage: int) -> dict[str, Tensor]:
    """One stage's part of a full (one TP rank's) Megatron state dict, layers renumbered."""
    layers = stage_range(hf_cfg.num_hidden_layers, pp, stage)
    last = stage == pp - 1
    out: dict[str, Tensor] = {}
    for k, v in full.items():
        if k.startswith("decoder.layers."):
            i = int(k.split(".")[2])
            if i in layers:
                out[layer_key(k, -layers.start)] = v
        elif k.startswith("embedding."):
            if stage == 0:
                out[k] = v
        elif last:  # final norm, untied output layer
            out[k] = v
    if last and pp > 1 and hf_cfg.tie_word_embeddings:
        out["output_layer.weight"] = full["embedding.word_embeddings.weight"]
    return out


def load_stage_weights(model, hf_sd: dict[str, Tensor], hf_cfg) -> None:
    """This rank's stage and TP shard of ``hf_sd``; every weight must land."""
    from megatron.core import parallel_state as ps

    tp, pp = ps.get_tensor_model_parallel_world_size(), ps.get_pipeline_model_parallel_world_size()
    full = hf_to_megatron(hf_sd, hf_cfg, tp, ps.get_tensor_model_parallel_rank())
    local = stage_weights(full, hf_cfg, pp, ps.get_pipeline_model_parallel_rank())
    missing, unexpected = model.load_state_dict(local, strict=False)
    missing = [k for k in missing if not k.endswith("_extra_state")]
    if missing or unexpected:
        raise ValueError(f"megatron stage weights: missing {missing}, unexpected {unexpected}")


def join_stages(tensors: dict[str, Tensor], hf_cfg) -> dict[str, Tensor]:
    """HF names for per-stage tensors (weights or gradients) of the whole model, on every
    rank: TP shards gathered within each stage, stages gathered over the pipeline group.
    The last stage's copy of tied embeddings is dropped (stage 0's is the weight)."""
    import torch.distributed as tdist
    from megatron.core import parallel_state as ps

    tp, pp = ps.get_tensor_model_parallel_world_size(), ps.get_pipeline_model_parallel_world_size()
    stage = ps.get_pipeline_model_parallel_rank()
    offset = stage_range(hf_cfg.num_hidden_layers, pp, stage).start
    local = {layer_key(k, offset): v.detach().contiguous() for k, v in tensors.items()}
    if pp > 1 and hf_cfg.tie_word_embeddings and stage == pp - 1:
        local.pop("output_layer.weight", None)
    shards: list[dict[str, Tensor]] = [dict() for _ in range(tp)]
    if tp == 1:
        shards[0] = local
    else:
        group = ps.get_tensor_model_parallel_group()
        for k, v in local.items():
            parts = [torch.empty_like(v) for _ in range(tp)]
            tdist.all_gather(parts, v, group=group)
            for r in range(tp):
                shards[r][k] = parts[r]
    if pp > 1:
        gathered: list = [None] * pp
        tdist.all_gather_object(gathered, shards, group=ps.get_pipeline_model_parallel_group())
        shards = [{k: v for g in gathered for k, v in g[r].items()} for r in range(tp)]
    return megatron_to_hf(shards, hf_cfg)


def allreduce_tied_embedding_grads(model) -> None:
    """Sum the gradients of the tied word embeddings over the first and last stage."""
    import torch.distributed as tdist
    from megatron.core import parallel_state as ps

    if ps.get_pipeline_model_parallel_world_size() == 1 or not ps.is_rank_in_embedding_group():
        return
    if not getattr(model, "share_embeddings_and_output_weights", False):
        return
    weight = model.shared_embedding_or_output_weight()
    if weight.grad is not None:
        tdist.all_reduce(weight.grad, group=ps.get_embedding_group())


@contextmanager
def cpu_tensors():
    """While a stage is built on a CPU-only torch: megatron's tied-embedding set-up moves
    the last stage's copy with ``.cuda()`` before its all-reduce; keep it on the CPU."""
    if torch.cuda.is_available():
        yield
        return
    cuda = torch.Tensor.cuda
    torch.Tensor.cuda = lambda self, *a, **k: self
    try:
        yield
    finally:
        torch.Tensor.cuda = cuda


@contextmanager
def cpu_schedule():
    """See the module docstring: no CUDA synchronisation on a CPU-only torch."""
    if torch.cuda.is_available():
        yield
        return
    sync, zeros = torch.cuda.synchronize, torch.zeros

    def cpu_zeros(*args, **kw):  # the schedules count tokens in torch.zeros(device="cuda")
        if str(kw.get("device", "")).startswith("cuda"):
            kw["device"] = "cpu"
        return zeros(*args, **kw)

    torch.cuda.synchronize = lambda *a, **k: None
    torch.zeros = cpu_zeros
    try:
        with cpu_current_device():
            yield
    finally:
        torch.cuda.synchronize, torch.zeros = sync, zeros


def forward_backward(model, batches: list[dict], loss_fn, *, forward_only: bool = False):
    """megatron-core's schedule over ``batches`` (each ``{"ids": (b, L), "attn": (b, L)}``,
    one microbatch; all the same shape). Returns the microbatch losses on the last stage
    (an empty list elsewhere). Tied-embedding gradients are summed after the backward."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    def step(data_iterator, model):
        batch = next(data_iterator)
        mask, positions = attention_inputs(batch["attn"])
        out = model(input_ids=batch["ids"], position_ids=positions, attention_mask=mask)

        def loss(output):
            value = loss_fn(output, batch)
            return value, {"loss": value.detach().clone()}  # the schedule divides value in place

        return out, loss

    b, L = batches[0]["ids"].shape
    with cpu_schedule():
        losses = get_forward_backward_func()(
            forward_step_func=step,
            data_iterator=iter(batches),
            model=[model],
            num_microbatches=len(batches),
            seq_length=L,
            micro_batch_size=b,
            forward_only=forward_only,
        )
    if not forward_only:
        allreduce_tied_embedding_grads(model)
    return [d["loss"] for d in losses]


__all__ = [
    "allreduce_tied_embedding_grads",
    "build_stage",
    "forward_backward",
    "init_parallel",
    "join_stages",
    "load_stage_weights",
    "stage_range",
    "stage_weights",
]
