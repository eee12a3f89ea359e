"""``train.backend: fsdp2``: torch ``fully_shard`` over the controllers.

Every controller holds 1/P of each parameter, its gradient and its AdamW state (DTensors
on a 1-D device mesh). What is sharded: each block the model names in
``_no_split_modules`` (decoder layers, vision blocks, diffusion transformer blocks), and
the root module for the rest (embeddings, tied heads, norms), so tied weights stay in
one unit.

Numerics match the replica backend: gradients are reduce-scattered as sums (FSDP's
default is a mean; the controller normalises the loss by global counts, so the divide
factor is set to 1 and reductions are plain sums, which gloo also supports), the
gradient norm is the global norm over all shards, and AdamW is elementwise.

Generation and evaluation run different numbers of forwards on different ranks (a
rank's samples stop early, ranks hold different eval chunks). Inside
``rollout_weights`` every unit is gathered once and kept whole, so those forwards
involve no collective; on leaving, the units are resharded.

Training forwards and backwards are collectives: a rank with no samples in a minibatch
still runs one (``lockstep``; the controller runs a zero-weight pass on the filler, two
samples this engine keeps from the rank's last generation).

Options (``train.*``):

- ``mixed_precision``: ``MixedPrecisionPolicy(param_dtype=..., reduce_dtype=float32)``.
  bfloat16 runs on CPU too; float16 matmuls are slow or missing on CPU (GPU option).
- ``cpu_offload``: ``CPUOffloadPolicy`` (sharded parameters, gradients and optimizer
  state in pinned host memory, copied to the GPU per unit). GPU only: on the CPU the
  weights already live in host memory, and the option is refused there.
- ``activation_checkpointing``: the model's own gradient checkpointing (transformers
  and diffusers), non-reentrant, so it composes with FSDP's hooks. Works on CPU.
- ``reshard_after_forward``: False keeps gathered weights between forward and backward
  (ZeRO-2 like: more memory, one all-gather less per unit).

Run-state checkpoints use ``torch.distributed.checkpoint.state_dict``
(``get_model_state_dict`` / ``get_optimizer_state_dict`` with full state dicts, keyed by
parameter names), written by ``mmyatt.checkpoint.checkpointer`` in safetensors like every other run.
"""

from __future__ import annotations

import dataclasses
from contextlib import contextmanager

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor, distribute_tensor

from mmyatt.distributed import free_port
from mmyatt.engines.wrapper import WrappedPolicy
from mmyatt.protocols import Policy, Sampling
from mmyatt.rollout import Rollout

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}


def block_classes(module: nn.Module) -> set[type]:
    """Classes of the blocks to shard one by one: those named in any submodule's
    ``_no_split_modules`` (transformers, diffusers)."""
    names: set[str] = set()
    for m in module.modules():
        names.update(getattr(m, "_no_split_modules", None) or [])
    return {type(m) for m in module.modules() if type(m).__name__ in names}


def shard_units(module: nn.Module) -> list[nn.Module]:
    """The submodules ``fully_shard`` wraps before the root: every instance of a block
    class, outermost first; without ``_no_split_modules``, the items of the module's
    ModuleLists."""
    classes = block_classes(module)
    units: list[nn.Module] = []
    if classes:
        for _, m in module.named_modules():
            if type(m) in classes and not any(_contains(u, m) for u in units):
                units.append(m)
    else:
        for m in module.modules():
            if isinstance(m, nn.ModuleList):
                units.extend(m)
    return units


def _contains(outer: nn.Module, inner: nn.Module) -> bool:
    return any(m is inner for m in outer.modules())


class EnginePolicy(WrappedPolicy):
    """The policy as the controller sees it under a sharding engine: ``generate`` runs
    inside ``engine.rollout_weights`` and hands the engine two samples (the filler a rank
    without samples runs its zero-weight passes on); EMA state is whole in checkpoints."""

    def __init__(self, inner: Policy, engine):
        super().__init__(inner)
        self._engine = engine

    def generate(
        self, prompts: list[dict], group_size: int, sampling: Sampling, seeds: list[int]
    ) -> Rollout:
        with self._engine.rollout_weights(self._inner):
            out = self._inner.generate(prompts, group_size, sampling, seeds)
        self._engine.keep_filler(out)
        return out

    # EMA (model.ema_decay): the adapter's EMA is elementwise over its parameters, so over
    # sharded parameters it is a sharded EMA (each rank averages its own shard, no
    # communication). Checkpoints hold it whole, like the weights.
    def ema_state(self) -> dict[str, Tensor] | None:
        state = self._inner.ema_state()
        return None if state is None else {k: _full(v) for k, v in state.items()}

    def load_ema_state(self, state: dict[str, Tensor] | None) -> None:
        if state is None:
            return self._inner.load_ema_state(None)
        params = dict(self._inner.module().named_parameters())
        self._inner.load_ema_state({k: _shard_like(v, params[k]) for k, v in state.items()})


class FSDP2Engine:
    """Sharded training (module docstring); the ``LockstepEngine`` protocol: every pass
    is a collective, so a rank without samples runs the same passes with weight 0."""

    name = "fsdp2"
    lockstep = True

    def __init__(
        self,
        dist,
        *,
        mixed_precision: str = "none",
        cpu_offload: bool = False,
        activation_checkpointing: bool = False,
        reshard_after_forward: bool = True,
    ):
        """The options are ``train.*``'s of the same names (module docstring)."""
        self.dist = dist
        self.mixed_precision, self.cpu_offload = mixed_precision, cpu_offload
        self.activation_checkpointing = activation_checkpointing
        self.reshard_after_forward = reshard_after_forward
        self.units: list = []
        self.root = None
        self.filler: Rollout | None = None  # two samples of this rank's last generation
        self.reference_taken = False

    def enable_reference(self, policy: Policy) -> None:
        if not self.reference_taken:  # taken before sharding (see build_engines)
            policy.enable_reference()
            self.reference_taken = True

    # ------------------------------------------------------------------ wrapping
    def wrap(self, policy):
        import torch.distributed as tdist
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import (
            CPUOffloadPolicy,
            FSDPModule,
            MixedPrecisionPolicy,
            fully_shard,
        )

        module = policy.module()
        device = next(module.parameters()).device
        if self.cpu_offload and device.type != "cuda":
            raise ValueError(
                "train.cpu_offload=true offloads sharded weights from the GPU to host memory; "
                f"the policy is on {device} already (it is a GPU option)"
            )
        if self.activation_checkpointing:
            enable_activation_checkpointing(module)
        if not tdist.is_initialized():  # a lone controller: a process group of one
            _init_single_process_group(device)
        mesh = init_device_mesh(device.type, (tdist.get_world_size(),))
        kw: dict = {"mesh": mesh, "reshard_after_forward": self.reshard_after_forward}
        if self.mixed_precision != "none":
            kw["mp_policy"] = MixedPrecisionPolicy(
                param_dtype=DTYPES[self.mixed_precision], reduce_dtype=torch.float32
            )
        if self.cpu_offload:
            kw["offload_policy"] = CPUOffloadPolicy()
        for unit in shard_units(module):
            fully_shard(unit, **kw)
        fully_shard(module, **kw)
        self.root = module
        self.units = [m for m in module.modules() if isinstance(m, FSDPModule)]
        for m in self.units:  # sums, not means: the loss is normalised by global counts
            m.set_gradient_divide_factor(1.0)
            m.set_force_sum_reduction_for_comms(True)
        return EnginePolicy(policy, self)

    # ------------------------------------------------------------------ update
    def reduce_and_clip(self, params, max_norm: float) -> torch.Tensor:
        """Gradients are already reduce-scattered by backward; clip their global norm."""
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
        return _full(norm).float()

    # ------------------------------------------------------------------ lockstep
    def keep_filler(self, rollout: Rollout) -> None:
        """Two rows: a one-row pass can hang FSDP2's backward (``zero_weight_loss``). Rows
        a vLLM engine cut short (no live action) are avoided when there are enough."""
        if len(rollout) < 2:
            return
        live = [i for i in range(len(rollout)) if rollout.mask[i].any()][:2]
        self.filler = rollout.select(live if len(live) == 2 else [0, 1])

    def _filler(self) -> Rollout:
        if self.filler is None:
            raise RuntimeError(
                "a controller without samples must still join the sharded forward/backward, "
                "but it has generated nothing yet to run it on"
            )
        return self.filler

    def zero_weight_loss(self, policy: Policy) -> Tensor:
        """A loss of exactly 0 whose backward runs every collective a real one does.

        Seen with torch 2.13 on gloo: when one rank's sharded forward has a single row
        and another's more, FSDP2 on the one-row rank skips a pre-backward all-gather
        (it warns that a module "returned a view tensor") and the ranks hang in backward.
        So the filler has two rows, and ``check_engines`` asks for sampling.group_size
        >= 2 with fsdp2 (minibatches hold whole groups)."""
        lp = policy.logprobs(self._filler())
        return lp.sum() * 0.0

    def idle_rollout(self, policy: Policy) -> Rollout:
        """The filler with zero advantages and rewards, for a loss that reads them (the
        DiffusionNFT loss of a rank without samples; its result is multiplied by 0)."""
        filler = self._filler()
        zero = torch.zeros(len(filler))
        return dataclasses.replace(filler, advantages=zero, rewards=zero.clone())

    @contextmanager
    def rollout_weights(self, policy):
        """Every unit gathered and kept whole: forwards inside make no collective call."""
        for m in self.units:
            m.unshard()
        for m in self.units:
            m.set_reshard_after_forward(False, recurse=False)
        try:
            yield
        finally:
            for m in self.units:
                m.reshard()
            for m in self.units:
                m.set_reshard_after_forward(self.reshard_after_forward, recurse=False)

    # ------------------------------------------------------------------ state
    def model_state(self, policy) -> dict:
        """The full state dict on rank 0 (empty elsewhere: only rank 0 writes it)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
        return get_model_state_dict(policy.module(), options=opts)

    def full_weights(self, policy) -> dict:
        """Whole weights on every rank (a rollout engine's weight sync): an all-gather."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        opts = StateDictOptions(full_state_dict=True, cpu_offload=False)
        return get_model_state_dict(policy.module(), options=opts)

    def load_model_state(self, policy, state: dict) -> None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        set_model_state_dict(policy.module(), state, options=StateDictOptions(full_state_dict=True))

    def optimizer_state(self, policy, optimizer) -> dict:
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_optimizer_state_dict,
        )

        opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
        return get_optimizer_state_dict(policy.module(), optimizer, options=opts)

    def load_optimizer_state(self, policy, optimizer, state: dict) -> None:
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_optimizer_state_dict,
        )

        set_optimizer_state_dict(
            policy.module(), optimizer, state, options=StateDictOptions(full_state_dict=True)
        )

    def export(self, policy, path: str) -> None:
        """All ranks gather the full weights; rank 0 writes the adapter's usual layout."""
        full = self.model_state(policy)
        if self.dist.is_main:
            with full_state_dict_view(policy.module(), full):
                policy.save(str(path))
        self.dist.barrier()


def _full(t: Tensor) -> Tensor:
    """A DTensor's whole value (a collective: every rank calls it); others as they are."""
    return t.full_tensor() if isinstance(t, DTensor) else t


def _shard_like(full: Tensor, param: Tensor) -> Tensor:
    """``full`` laid out like ``param`` (this rank's shard when it is a DTensor)."""
    if not isinstance(param, DTensor):
        return full.to(param.dtype)
    return distribute_tensor(full.to(param.dtype), param.device_mesh, param.placements)


def _init_single_process_group(device: torch.device) -> None:
    import torch.distributed as tdist

    backend = "nccl" if device.type == "cuda" else "gloo"
    tdist.init_process_group(
        backend, init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1
    )


@contextmanager
def full_state_dict_view(module: nn.Module, full: dict):
    """``module.state_dict()`` returns ``full`` (plain tensors) inside, so the adapters'
    ``save_pretrained`` / peft exports write whole weights of a sharded module."""

    # a tied weight is one parameter under two names; the full state dict holds both as
    # separate copies, which save_pretrained would write twice: keep the first name only
    first = {n for n, _ in module.named_parameters()}
    every = {n for n, _ in module.named_parameters(remove_duplicate=False)}
    tied = every - first

    def state_dict(*args, destination=None, prefix: str = "", keep_vars: bool = False):
        out = {} if destination is None else destination
        for k, v in full.items():
            if k not in tied:
                out[prefix + k] = v
        return out

    module.state_dict = state_dict
    try:
        yield
    finally:
        del module.state_dict


def enable_activation_checkpointing(module: nn.Module) -> None:
    """The model's own gradient checkpointing, non-reentrant (composes with FSDP)."""
    kw = {"use_reentrant": False}
    if hasattr(module, "activation_checkpointing_enable"):  # transformers >= 5.2x
        module.activation_checkpointing_enable(activation_checkpointing_kwargs=kw)
    elif hasattr(module, "gradient_checkpointing_enable"):  # older transformers
        module.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kw)
    elif hasattr(module, "enable_gradient_checkpointing"):  # diffusers
        module.enable_gradient_checkpointing()
    else:
        raise ValueError(
            f"train.activation_checkpointing: {type(module).__name__} has no gradient "
            "checkpointing switch (gradient_checkpointing_enable / enable_gradient_checkpointing)"
        )
