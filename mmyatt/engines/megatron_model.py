"""A megatron-core ``GPTModel`` of a Hugging Face Qwen2 / Llama config: the parallel
groups, the CPU shims, building, weight conversion both ways (whole or split over a
tensor-parallel group), optimizer state in HF names, and forwards and log-probs with
the text adapter's conventions. What trains it is ``megatron.MegatronEngine``; the
policy over it, ``megatron_policy``.

CPU: megatron-core targets CUDA; three shims make it run on the CPU over gloo: its
global memory buffer allocates on ``torch.cuda.current_device()`` and its CUDA RNG
tracker's ``fork()`` needs CUDA (``cpu_shims``: a CPU buffer, and megatron's own
inference RNG tracker whose ``fork`` is a no-op; dropout is 0 in RL), and its RoPE
moves frequencies to ``torch.cuda.current_device()`` in every forward
(``cpu_current_device``, around forwards only). None of them applies when CUDA is there.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import Tensor

from mmyatt.distributed import free_port
from mmyatt.engines.megatron_convert import check_tp, hf_to_megatron, megatron_to_hf
from mmyatt.protocols import TokenPolicy


def cpu_shims() -> None:
    """Let megatron-core's layers run on the CPU (see the module docstring)."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import random
    from megatron.core.utils import GlobalMemoryBuffer

    class CPUBuffer(GlobalMemoryBuffer):
        def get_tensor(self, tensor_shape, dtype, name, mem_alloc_context=None):
            n = 1
            for d in tensor_shape:
                n *= d
            key = (name, dtype)
            if key not in self.buffer or self.buffer[key].numel() < n:
                self.buffer[key] = torch.empty(n, dtype=dtype)
            return self.buffer[key][:n].view(*tensor_shape)

    parallel_state._GLOBAL_MEMORY_BUFFER = CPUBuffer()
    random.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)


@contextmanager
def cpu_current_device():
    """While megatron-core runs a forward on a CPU-only torch: its RoPE (and a few
    allocations) ask ``torch.cuda.current_device()`` for where to put tensors; answer
    the CPU instead of failing. Does nothing when CUDA is available."""
    if torch.cuda.is_available():
        yield
        return
    original = torch.cuda.current_device
    torch.cuda.current_device = lambda: torch.device("cpu")
    try:
        yield
    finally:
        torch.cuda.current_device = original


def init_parallel(tp: int = 1, pp: int = 1) -> None:
    """megatron-core's model-parallel groups over the running process group (one
    started here when none is: a lone process)."""
    import torch.distributed as tdist
    from megatron.core import parallel_state

    if not tdist.is_initialized():
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        tdist.init_process_group(
            backend, init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1
        )
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp
        )
    rng_states()


def rng_states() -> None:
    """The RNG states megatron-core's layers draw from: on CUDA its tracked states
    (``model-parallel-rng`` and the rest, which building a layer asks for; seeded from
    torch's seed, torch's own CUDA state kept as it was), on the CPU the shims."""
    if not torch.cuda.is_available():
        cpu_shims()
        return
    from megatron.core import tensor_parallel

    state = torch.cuda.get_rng_state()
    tensor_parallel.model_parallel_cuda_manual_seed(torch.initial_seed() % 2**31)
    torch.cuda.set_rng_state(state)


def transformer_config(hf_cfg, tp: int = 1, dtype: torch.dtype = torch.float32):
    """megatron-core ``TransformerConfig`` equal to a HF Qwen2 / Llama config."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    act = getattr(hf_cfg, "hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"megatron conversion supports SwiGLU (hidden_act=silu), not {act!r}")
    heads = hf_cfg.num_attention_heads
    return TransformerConfig(
        num_layers=hf_cfg.num_hidden_layers,
        hidden_size=hf_cfg.hidden_size,
        ffn_hidden_size=hf_cfg.intermediate_size,
        num_attention_heads=heads,
        num_query_groups=hf_cfg.num_key_value_heads,
        kv_channels=getattr(hf_cfg, "head_dim", None) or hf_cfg.hidden_size // heads,
        normalization="RMSNorm",
        layernorm_epsilon=hf_cfg.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=hf_cfg.model_type == "qwen2",
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tensor_model_parallel_size=tp,
        use_cpu_initialization=not torch.cuda.is_available(),
        params_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        persist_layer_norm=False,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        masked_softmax_fusion=False,
        gradient_accumulation_fusion=False,
    )


def rope_theta(hf_cfg) -> float:
    rp = getattr(hf_cfg, "rope_parameters", None) or {}
    return float(rp.get("rope_theta", getattr(hf_cfg, "rope_theta", 10000.0)))


def build_gpt(hf_cfg, tp: int = 1, dtype: torch.dtype = torch.float32):
    """A megatron-core GPTModel with the HF config's architecture (this TP rank's shard);
    logits are gathered to the full vocabulary."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    check_tp(hf_cfg, tp)
    return GPTModel(
        config=transformer_config(hf_cfg, tp, dtype),
        transformer_layer_spec=get_gpt_layer_local_spec(normalization="RMSNorm"),
        vocab_size=hf_cfg.vocab_size,
        max_sequence_length=hf_cfg.max_position_embeddings,
        parallel_output=False,
        share_embeddings_and_output_weights=bool(hf_cfg.tie_word_embeddings),
        position_embedding_type="rope",
        rotary_base=int(rope_theta(hf_cfg)),
    )


def weights(model) -> dict[str, Tensor]:
    """The model's parameters and tensor buffers by name (no ``_extra_state``)."""
    return {k: v for k, v in model.state_dict().items() if isinstance(v, Tensor)}


def load_hf_weights(model, hf_sd: dict[str, Tensor], hf_cfg) -> None:
    """This TP rank's shard of ``hf_sd`` into ``model``; every weight must land."""
    from megatron.core import parallel_state

    tp = parallel_state.get_tensor_model_parallel_world_size()
    rank = parallel_state.get_tensor_model_parallel_rank()
    local = hf_to_megatron(hf_sd, hf_cfg, tp, rank)
    missing, unexpected = model.load_state_dict(local, strict=False)
    missing = [k for k in missing if not k.endswith("_extra_state")]
    if missing or unexpected:
        raise ValueError(f"megatron conversion: missing {missing}, unexpected {unexpected}")


def gather_hf_weights(model, hf_cfg) -> dict[str, Tensor]:
    """All TP ranks' shards joined into one HF state dict (on every rank)."""
    return _join_tp({k: v.detach() for k, v in weights(model).items()}, hf_cfg)


def _join_tp(local: dict[str, Tensor], hf_cfg) -> dict[str, Tensor]:
    """Megatron-named shards of this TP rank -> whole HF-named tensors (every rank)."""
    import torch.distributed as tdist
    from megatron.core import parallel_state

    tp = parallel_state.get_tensor_model_parallel_world_size()
    if tp == 1:
        return megatron_to_hf([local], hf_cfg)
    group = parallel_state.get_tensor_model_parallel_group()
    shards: list[dict] = [dict() for _ in range(tp)]
    for k, v in local.items():
        parts = [torch.empty_like(v) for _ in range(tp)]
        tdist.all_gather(parts, v.contiguous(), group=group)
        for r in range(tp):
            shards[r][k] = parts[r]
    return megatron_to_hf(shards, hf_cfg)


MOMENTS = ("exp_avg", "exp_avg_sq")


def optimizer_state_hf(model, optimizer, hf_cfg) -> dict:
    """AdamW's state with its moments whole and HF-named (like the weights), so the
    run checkpoint holds every tensor-parallel rank's part and resumes on any of them."""
    sd = optimizer.state_dict()
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    state = {names[i]: s for i, s in sd["state"].items()}
    out = {"format": "hf", "param_groups": sd["param_groups"], "step": {}}
    if not state:
        return out
    out["step"] = {n: s["step"] for n, s in state.items()}
    for m in MOMENTS:
        out[m] = _join_tp({n: s[m] for n, s in state.items()}, hf_cfg)
    return out


def load_optimizer_state_hf(model, optimizer, state: dict, hf_cfg) -> None:
    from megatron.core import parallel_state

    tp = parallel_state.get_tensor_model_parallel_world_size()
    rank = parallel_state.get_tensor_model_parallel_rank()
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    local = {m: hf_to_megatron(state[m], hf_cfg, tp, rank) for m in MOMENTS if m in state}
    per = {}
    for i, n in enumerate(names):
        if n in state["step"]:
            per[i] = {"step": state["step"][n], **{m: local[m][n] for m in local}}
    optimizer.load_state_dict({"state": per, "param_groups": state["param_groups"]})


def attention_inputs(attn: Tensor) -> tuple[Tensor, Tensor]:
    """``(mask, positions)`` for a left-padded batch: padding masked out of attention
    (causal and padding mask combined, (N, 1, L, L), True = masked), RoPE positions
    relative (a constant shift per row leaves every attention score unchanged)."""
    L = attn.shape[1]
    causal = torch.ones(L, L, dtype=torch.bool, device=attn.device).tril()
    allowed = causal[None] & attn.bool()[:, None, :]
    positions = torch.arange(L, device=attn.device).expand_as(attn)
    return ~allowed[:, None], positions


def forward_logits(model, ids: Tensor, attn: Tensor) -> Tensor:
    """(N, L, V) logits with the adapter's conventions (see ``attention_inputs``)."""
    mask, positions = attention_inputs(attn)
    with cpu_current_device():
        return model(input_ids=ids, position_ids=positions, attention_mask=mask)


def trimmed_inputs(rollout):
    """(ids, attn, actions, kept, temperature, last) of a text rollout for a forward:
    prompt + completion without the left-padding columns no row uses and without the
    completion columns after the last live token (``last`` of them kept); ``actions``
    and ``kept`` (the completion mask, bool) cut to those ``last`` columns."""
    ids = rollout.context["input_ids"]
    attn = rollout.context["attention_mask"]
    temperature = float(rollout.context["temperature"])
    actions, mask = rollout.actions, rollout.mask.bool()
    P = ids.shape[1] - actions.shape[1]
    used = attn[:, :P].any(0).nonzero()
    first = int(used[0]) if len(used) else P - 1
    live = mask.any(0).nonzero()
    last = int(live[-1]) + 1 if len(live) else 1
    ids, attn = ids[:, first : P + last - 1], attn[:, first : P + last - 1]
    return ids, attn, actions[:, :last], mask[:, :last], temperature, last


def token_logprobs(inner: TokenPolicy, logits, actions, kept, temperature, last, with_entropy=True):
    """(log-prob of each action, entropy or None) from the logits of a trimmed forward,
    at ``temperature`` as the adapter ``inner`` tempers them; 0 outside ``kept``."""
    logits = inner.tempered(logits[:, -last:], temperature)
    logp_all = logits.log_softmax(-1)
    lp = torch.where(kept, logp_all.gather(-1, actions[..., None]).squeeze(-1), 0.0)
    if not with_entropy:
        return lp, None
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    return lp, torch.where(kept, entropy, 0.0)
