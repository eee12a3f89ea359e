"""Engines behind the adapters: who trains (replica, FSDP2, Megatron-core) and who
generates (the adapter itself, or vLLM).

The controller talks to a training engine through a handful of calls and never
branches on the backend:

``wrap(policy)``                 shard / convert the policy's module; returns the policy the
                                 controller uses from then on
``reduce_and_clip(params, c)``   make gradients global (sum over controllers), clip their
                                 global norm to ``c``; returns that norm (a float tensor)
``rollout_weights(policy)``      context in which the policy may run any number of forwards
                                 on this rank alone (generation, evaluation)
``lockstep``                     every forward/backward is a collective: a rank without
                                 samples still runs a zero-weight pass
``model_state`` / ``load_model_state`` / ``optimizer_state`` / ``load_optimizer_state``
                                 full (unsharded) states for the run checkpoint
``export(policy, path)``         Hugging Face layout, written by rank 0 (all ranks call)

Optional backends (megatron-core, vllm) are imported only when a config asks for them;
``check_engines`` runs inside config validation, so a run that asks for a missing one
stops before anything starts and says what to install.
"""

from __future__ import annotations

import importlib.util
from contextlib import nullcontext

import torch

from mmyatt.config.checks import register_check
from mmyatt.config.errors import ConfigError

INSTALL = {
    "megatron": ("megatron.core", "pip install 'mmyatt[megatron]'  (megatron-core>=0.16)"),
    "vllm": ("vllm", "pip install 'mmyatt[vllm]'  (vllm on CUDA; see docs/engines.md for CPU)"),
}


OPEN: list = []  # rollout engines this process started (closed by close_engines)


def close_engines() -> None:
    """Shut down the rollout engines this process started; the run calls it before it
    destroys the process group (a vLLM engine tears its own groups down on exit)."""
    while OPEN:
        OPEN.pop().close()


class MissingEngineError(RuntimeError):
    """A config asks for an engine whose package is not installed."""


def available(name: str) -> bool:
    module = INSTALL[name][0]
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def require(name: str, key: str) -> None:
    """Raise ``MissingEngineError`` naming the config key and the install command."""
    if not available(name):
        module, cmd = INSTALL[name]
        raise MissingEngineError(
            f"{key} needs the Python package {module.split('.')[0]!r}, which is not installed "
            f"in this environment; install it with: {cmd}"
        )


@register_check
def check_engines(cfg) -> None:
    """Config checks for the engine settings (run by ``load_config``)."""
    t, r, j = cfg.train, cfg.rollout, cfg.reward.judge
    micro = cfg.algorithm.micro_batch_tokens
    if micro and (t.backend == "megatron" or cfg.algorithm.name == "diffusion_nft"):
        raise ConfigError(  # megatron: not built for its model-parallel groups
            f"algorithm.micro_batch_tokens={micro} needs train.backend=replica or fsdp2 (got "
            f"{t.backend}) and a policy-gradient loss (got algorithm.name="
            f"{cfg.algorithm.name}); set it to 0"
        )
    if t.backend == "megatron":
        if cfg.model.kind != "text":
            raise ConfigError(
                f"train.backend=megatron trains text LLMs (megatron-core GPTModel), not "
                f"model.kind={cfg.model.kind}; use train.backend=fsdp2"
            )
        if t.tensor_parallel < 1 or t.pipeline_parallel < 1:
            raise ConfigError(
                f"train.tensor_parallel and train.pipeline_parallel must be >= 1, got "
                f"{t.tensor_parallel} and {t.pipeline_parallel}"
            )
        if t.tensor_parallel * t.pipeline_parallel > 1:
            _check_tensor_parallel(cfg)
        _require(cfg, "megatron", "train.backend=megatron")
    if t.backend == "fsdp2" and cfg.sampling.group_size < 2:
        raise ConfigError(
            "train.backend=fsdp2 needs sampling.group_size >= 2 (a one-row "
            "sharded forward on one rank against more rows on another hangs FSDP2's "
            "backward here; minibatches hold whole groups)"
        )
    if t.backend == "fsdp2" and cfg.algorithm.name == "diffusion_nft" and t.cpu_offload:
        raise ConfigError(
            "train.cpu_offload with algorithm.name=diffusion_nft is not implemented ("
            "the sampling policy's EMA gathers each offloaded shard, untested on a GPU); "
            "drop train.cpu_offload"
        )
    if t.backend != "fsdp2" and (
        t.mixed_precision != "none" or t.cpu_offload or t.activation_checkpointing
    ):
        raise ConfigError(
            "train.mixed_precision / cpu_offload / activation_checkpointing are FSDP2 options; "
            f"set train.backend=fsdp2 (got {t.backend})"
        )
    if r.backend == "vllm":
        if cfg.model.kind not in ("text", "vlm"):
            raise ConfigError(
                f"rollout.backend=vllm generates text (text and VLM policies), not "
                f"model.kind={cfg.model.kind}; use rollout.backend=hf"
            )
        if r.is_cap < 0 or not 0 < r.gpu_memory_utilization <= 1:
            raise ConfigError("rollout.is_cap must be >= 0, gpu_memory_utilization in (0, 1]")
        _require(cfg, "vllm", "rollout.backend=vllm")
    if j.backend == "vllm" and j.model is not None:
        import shutil

        if shutil.which("vllm") is None and not available("vllm"):
            raise ConfigError(
                "reward.judge.backend=vllm starts `vllm serve`, which is not installed; "
                f"install it with: {INSTALL['vllm'][1]}"
            )


def _check_tensor_parallel(cfg) -> None:
    """train.tensor_parallel > 1: a tensor-parallel group of processes is one controller
    (mmyatt/engines/megatron_group.py); what that does not cover is refused here."""
    t, n = cfg.train, cfg.distributed.nproc
    # a pipeline group, or a TP x PP model-parallel group, is one controller the same way
    tp = t.tensor_parallel * t.pipeline_parallel
    key = " x ".join(
        f"train.{k}={v}"
        for k, v in (
            ("tensor_parallel", t.tensor_parallel),
            ("pipeline_parallel", t.pipeline_parallel),
        )
        if v > 1
    )
    if n % tp:
        raise ConfigError(
            f"{key} needs distributed.nproc to be a multiple of it (got {n}): each group of "
            f"{tp} processes is one controller"
        )
    if cfg.data.prompts_per_step % (n // tp):
        raise ConfigError(
            f"{key}: data.prompts_per_step ({cfg.data.prompts_per_step}) must divide over the "
            f"{n // tp} controller(s) (distributed.nproc / the group's processes)"
        )
    if cfg.rollout.backend != "hf":
        raise ConfigError(
            f"{key} with rollout.backend={cfg.rollout.backend} is not implemented "
            "(the vLLM engine's weight sync is not fed from a Megatron model split "
            "over a group of processes); use rollout.backend=hf"
        )
    if cfg.placement.balance:
        raise ConfigError(
            f"{key} with placement.balance=true is not implemented (the exchange "
            "moves samples between processes of the whole process group, not between the "
            "data-parallel controllers that model-parallel groups form); set "
            "placement.balance=false"
        )


def _require(cfg, name: str, key: str) -> None:
    try:
        require(name, key)
    except MissingEngineError as e:
        raise ConfigError(str(e)) from None


# --------------------------------------------------------------------------- replica
class ReplicaEngine:
    """A full copy of the policy on every controller; gradients summed in one flat
    all-reduce (``Dist.sum_grads``). The default, and the reference the others match."""

    name = "replica"
    lockstep = False

    def __init__(self, dist):
        self.dist = dist

    def wrap(self, policy):
        return policy

    def enable_reference(self, policy) -> None:
        policy.enable_reference()

    def reduce_and_clip(self, params, max_norm: float) -> torch.Tensor:
        self.dist.sum_grads(params)
        return torch.nn.utils.clip_grad_norm_(params, max_norm)

    def rollout_weights(self, policy):
        return nullcontext()

    def model_state(self, policy) -> dict:
        return policy.module().state_dict()

    def full_weights(self, policy) -> dict:
        """Whole HF-named weights on every rank (for a rollout engine's weight sync)."""
        return policy.module().state_dict()

    def load_model_state(self, policy, state: dict) -> None:
        policy.module().load_state_dict(state)

    def optimizer_state(self, policy, optimizer) -> dict:
        from mmyatt.checkpoint.checkpointer import optimizer_state

        return optimizer_state(optimizer)

    def load_optimizer_state(self, policy, optimizer, state: dict) -> None:
        from mmyatt.checkpoint.checkpointer import load_optimizer_state

        load_optimizer_state(optimizer, state)

    def export(self, policy, path: str) -> None:
        if self.dist.is_main:
            policy.save(str(path))


class EnginePolicy:
    """The policy as the controller sees it under a sharding engine: ``generate`` runs
    inside ``engine.rollout_weights`` and remembers one sample (the filler a rank without
    samples runs its zero-weight pass on); everything else is the adapter's own."""

    def __init__(self, inner, engine):
        self._inner, self._engine = inner, engine
        self.filler = None

    def __getattr__(self, name):
        return getattr(self._inner, name)

    @property
    def inner(self):
        return self._inner

    # EMA (model.ema_decay): the adapter's EMA is elementwise over its parameters, so over
    # sharded parameters it is a sharded EMA (each rank averages its own shard, no
    # communication). Checkpoints hold it whole, like the weights.
    def ema_state(self):
        state = self._inner.ema_state()
        return None if state is None else {k: _full_tensor(v) for k, v in state.items()}

    def load_ema_state(self, state) -> None:
        if state is None:
            return self._inner.load_ema_state(None)
        params = dict(self._inner.module().named_parameters())
        self._inner.load_ema_state({k: _shard_like(v, params[k]) for k, v in state.items()})

    def generate(self, prompts, group_size, sampling, seeds):
        with self._engine.rollout_weights(self._inner):
            out = self._inner.generate(prompts, group_size, sampling, seeds)
        if len(out) >= 2:  # two rows: a one-row pass can hang FSDP2's backward (below)
            self.filler = out.select([0, 1])
        return out


def adapter_of(policy):
    """The model adapter under the engine wrappers (a sharding engine's
    :class:`EnginePolicy`, a vLLM rollout engine's ``VLLMRolloutPolicy``)."""
    from mmyatt.engines.vllm_rollout import VLLMRolloutPolicy

    while isinstance(policy, (EnginePolicy, VLLMRolloutPolicy)):
        policy = policy.inner
    return policy


def _full_tensor(t):
    """A DTensor's whole value (a collective: every rank calls it); others as they are."""
    full = getattr(t, "full_tensor", None)
    return full() if full is not None else t


def _shard_like(full, param):
    """``full`` laid out like ``param`` (this rank's shard when it is a DTensor)."""
    mesh = getattr(param, "device_mesh", None)
    if mesh is None:
        return full.to(param.dtype)
    from torch.distributed.tensor import distribute_tensor

    return distribute_tensor(full.to(param.dtype), mesh, param.placements)


class LockstepMixin:
    """What engines whose forwards and backwards are collectives add to the controller's
    step: a rank with no samples runs the same passes on a filler sample, weight 0."""

    lockstep = True
    reference_taken = False

    def enable_reference(self, policy) -> None:
        if not self.reference_taken:  # taken before sharding (see build_engines)
            policy.enable_reference()
            self.reference_taken = True

    def _filler(self, policy):
        filler = getattr(policy, "filler", None)
        if filler is None:
            raise RuntimeError(
                "a controller without samples must still join the sharded forward/backward, "
                "but it has generated nothing yet to run it on"
            )
        return filler

    def zero_weight_loss(self, policy) -> torch.Tensor:
        """A loss of exactly 0 whose backward runs every collective a real one does.

        Seen with torch 2.13 on gloo: when one rank's sharded forward has a single row
        and another's more, FSDP2 on the one-row rank skips a pre-backward all-gather
        (it warns that a module "returned a view tensor") and the ranks hang in backward.
        So the filler has two rows, and ``check_engines`` asks for sampling.group_size
        >= 2 with fsdp2 (minibatches hold whole groups)."""
        lp = policy.logprobs(self._filler(policy))
        return lp.sum() * 0.0

    def idle_rollout(self, policy):
        """The filler with zero advantages and rewards, for a loss that reads them (the
        DiffusionNFT loss of a rank without samples; its result is multiplied by 0)."""
        import dataclasses

        filler = self._filler(policy)
        zero = torch.zeros(len(filler))
        return dataclasses.replace(filler, advantages=zero, rewards=zero.clone())

    @torch.no_grad()
    def idle_logprob_passes(self, policy, algorithm, closed_form_kl: bool) -> None:
        """The forwards ``old_and_reference_logprobs`` makes, on the filler, results dropped."""
        filler = self._filler(policy)
        if algorithm.recompute_old_logprobs:
            policy.logprobs(filler)
        if closed_form_kl:
            self.idle_reference_means(policy)
        elif algorithm.kl_coef > 0:
            policy.reference_logprobs(filler)

    @torch.no_grad()
    def idle_reference_means(self, policy) -> None:
        """The reference forward ``attach_reference_means`` makes, on the filler."""
        policy.attach_reference_means(self._filler(policy).select([0]))


def controller_dist(cfg, dist):
    """The controller's ``Dist``: ``dist``, or with ``train.backend=megatron`` and
    ``train.tensor_parallel > 1`` a data-parallel view in which a tensor-parallel group
    of processes is one controller (``megatron_group.GroupDist``)."""
    t = cfg.train
    if t.backend != "megatron" or t.tensor_parallel * t.pipeline_parallel == 1:
        return dist
    from mmyatt.engines.megatron_group import controller_dist as group_dist

    return group_dist(cfg, dist)


def group_reward(reward, dist):
    """The controller's reward: ``reward``, or where a model-parallel group of processes
    is one controller, the group's first rank scores and broadcasts
    (``megatron_group.GroupReward``)."""
    if not dist.model_parallel:
        return reward
    from mmyatt.engines.megatron_group import group_reward as wrap

    return wrap(reward, dist)


def build_engines(cfg, dist, policy):
    """``(engine, policy)``: the training engine for ``cfg.train.backend`` and the policy
    the controller uses (sharded / converted, generating through ``cfg.rollout.backend``).
    A frozen reference snapshot is taken here, before any sharding."""
    engine = build_train_engine(cfg, dist)
    if cfg.algorithm.kl_coef > 0 and engine.lockstep:
        engine.enable_reference(policy)
    wrapped = engine.wrap(policy)
    if cfg.rollout.backend == "vllm":
        from mmyatt.engines.vllm_rollout import VLLMRolloutPolicy

        wrapped = VLLMRolloutPolicy(wrapped, engine, cfg.rollout, dist, model_path=cfg.model.path)
    return engine, wrapped


def build_train_engine(cfg, dist):
    """The training engine ``cfg.train.backend`` names, for this controller."""
    backend = cfg.train.backend
    if backend == "replica":
        return ReplicaEngine(dist)
    if backend == "fsdp2":
        from mmyatt.engines.fsdp2 import FSDP2Engine

        return FSDP2Engine(dist, cfg.train)
    if backend == "megatron":
        require("megatron", "train.backend=megatron")
        from mmyatt.engines.megatron import MegatronEngine

        return MegatronEngine(dist, cfg.train)
    raise ValueError(f"train.backend={backend!r}: expected replica, fsdp2 or megatron")
