"""Process groups and the few collectives controllers need.

Controllers exchange gradients, scalar metrics and counts — never rollouts or media.
Where a training engine's every forward and backward is a collective (FSDP2), ranks
must also run the same passes: ``Lockstep`` pads a rank with fewer rows (a zero-weight
pass on a filler sample), so the step itself never asks which engine it runs on.
Each controller's device comes from ``distributed.device`` (``select_device``): by
default ``cuda:<local rank>`` when CUDA is available, a lone controller included, else
the CPU. On CPU the backend is gloo; under CUDA, NCCL. ``launch`` starts P controllers with
torchrun's launcher (the same thing an external ``torchrun`` does), so a run started
by hand under torchrun and one started by ``mmyatt train distributed.nproc=P`` take
the same code path.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import Tensor

logger = logging.getLogger(__name__)


class Dist:
    """This controller's place in the group, and sums over all controllers."""

    group = None  # the process group sums run over (None: every process)
    # a controller that spans a model-parallel group of processes (Megatron TP / PP,
    # engines/megatron_group.GroupDist); mirror: a rank of such a group other than its
    # first, which runs the loop and writes nothing
    model_parallel = False
    mirror = False
    idle_s = 0.0  # waited at gradient all-reduces since the last idle_metrics()

    def __init__(
        self, rank: int = 0, world_size: int = 1, device: str = "cpu", backend: str | None = None
    ):
        self.rank, self.world_size, self.device = rank, world_size, torch.device(device)
        self.backend = backend  # the process group's backend; None for a lone controller
        self.processes = world_size  # processes that train (a group's: all of its ranks)

    def describe(self) -> str:
        """One line saying where this controller trains (printed by rank 0 at start)."""
        group = f", backend {self.backend}" if self.backend else ""
        return f"[device] controller {self.rank} of {self.world_size} on {self.device}{group}"

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def active(self) -> bool:
        return self.world_size > 1

    def sum(self, t: Tensor | float) -> Tensor:
        """Sum of ``t`` over controllers (a new tensor; ``t`` is left alone)."""
        out = torch.as_tensor(t, dtype=torch.float64, device=self.device).clone()
        if self.active:
            dist.all_reduce(out, group=self.group)
        return out

    def sum_many(self, values: dict[str, float]) -> dict[str, float]:
        """One all-reduce for a dict of scalars."""
        if not values:
            return {}
        keys = sorted(values)
        vec = self.sum(torch.tensor([float(values[k]) for k in keys], dtype=torch.float64))
        return dict(zip(keys, vec.tolist()))

    def any(self, flag: bool) -> bool:
        return bool(self.sum(1.0 if flag else 0.0).item() > 0)

    def gather_floats(self, value: float) -> list[float]:
        """``value`` of every controller, in rank order (a one-hot sum, on the device the
        process group takes: NCCL reduces device tensors only)."""
        t = torch.zeros(self.world_size, dtype=torch.float64, device=self.device)
        t[self.rank] = value
        return self.sum(t).tolist()

    def gather_ints(self, value: int) -> list[int]:
        return [int(v) for v in self.gather_floats(value)]

    def sum_grads(self, params: Iterable[torch.nn.Parameter]) -> None:
        """All-reduce (sum) gradients in one flat buffer; a missing grad counts as zero."""
        params = [p for p in params if p.requires_grad]
        if not self.active or not params:
            return
        flat = torch.cat(
            [(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in params]
        )
        dist.all_reduce(flat, group=self.group)
        offset = 0
        for p in params:
            n = p.numel()
            p.grad = flat[offset : offset + n].view_as(p).clone()
            offset += n

    def wait_for_slowest(self) -> None:
        """Wait for every controller before a gradient all-reduce, timed: what this rank
        waits here is its idle time, the slowest rank's extra work (a one-scalar
        all-reduce; on CUDA the queued work is finished first, so it is not counted)."""
        if not self.active:
            return
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        t0 = time.perf_counter()
        float(self.sum(0.0))
        self.idle_s += time.perf_counter() - t0

    def idle_metrics(self) -> dict[str, float]:
        """Each rank's wait at the gradient all-reduces since the last call
        (``dist/idle_s/rank{i}``) and their sum (``dist/idle_s``); {} for one controller."""
        if not self.active:
            return {}
        waits = self.gather_floats(self.idle_s)
        self.idle_s = 0.0
        out = {f"dist/idle_s/rank{i}": w for i, w in enumerate(waits)}
        out["dist/idle_s"] = sum(waits)
        return out

    def barrier(self) -> None:
        if self.active:
            dist.barrier()

    def union(self, values) -> list[str]:
        """The sorted union of every controller's ``values`` (strings)."""
        mine = sorted({str(v) for v in values})
        if not self.active:
            return mine
        boxes: list = [None] * self.world_size
        dist.all_gather_object(boxes, mine, group=self.group)
        return sorted({v for box in boxes for v in box})

    def broadcast_object(self, obj=None):
        if not self.active:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]


class Lockstep:
    """Passes that are collectives on a sharded training engine (``engine.lockstep``):
    every rank runs as many, a rank short of rows pads with the engine's filler (two
    samples it generated) at weight 0. On an engine whose passes are local (replica,
    Megatron's data-parallel controllers) each call below is a no-op or passes through,
    and no collective is added.

    The engine supplies the filler passes (``zero_weight_loss``, ``idle_rollout``); this
    class decides when a rank runs them."""

    def __init__(self, dist: Dist, engine, policy):
        self.dist, self.engine, self.policy = dist, engine, policy
        self.active = bool(engine.lockstep)

    def count(self, local: int) -> int:
        """The fullest rank's count (one all-reduce, on every engine): how many passes
        every rank runs."""
        return max(self.dist.gather_ints(local))

    def rows(self, local: int) -> int | None:
        """The fullest rank's row count that a sharded forward pads to; None (and no
        collective) where passes are local."""
        return max(self.dist.gather_ints(local)) if self.active else None

    def filler(self):
        """The engine's filler sample, zero advantages and rewards (a sharded engine only)."""
        return self.engine.idle_rollout(self.policy)

    def idle(self, fn: Callable) -> None:
        """``fn(filler)`` with its result dropped where this rank must still join a
        pass it has no rows for."""
        if self.active:
            fn(self.filler())

    def zero_loss(self) -> torch.Tensor | None:
        """A loss of exactly 0 whose backward joins every collective a real one makes,
        for a rank with no rows; None where a rank without rows runs nothing."""
        return self.engine.zero_weight_loss(self.policy) if self.active else None


DEVICES = ("auto", "cpu", "cuda")


def select_device(device: str = "auto", local_rank: int = 0) -> str:
    """Where this controller's policy lives, from the ``distributed.device`` setting.

    ``auto``: ``cuda:<local rank>`` when CUDA is available (one controller included),
    else ``cpu``; ``cpu``: the CPU even on a GPU machine; ``cuda``: ``cuda:<local rank>``,
    and an error naming the setting when there is no CUDA device for this controller.
    """
    if device not in DEVICES:
        raise ValueError(f"distributed.device={device!r}; expected one of {list(DEVICES)}")
    if device == "cpu":
        return "cpu"
    if not torch.cuda.is_available():
        if device == "cuda":
            raise RuntimeError(
                "distributed.device=cuda but CUDA is not available (torch "
                f"{torch.__version__}, CUDA build: {torch.version.cuda or 'no'}); "
                "set distributed.device=auto or cpu to run on the CPU"
            )
        return "cpu"
    count = torch.cuda.device_count()
    if local_rank >= count:
        raise RuntimeError(
            f"distributed.device={device}: controller with local rank {local_rank} needs "
            f"cuda:{local_rank} but this machine has {count} CUDA device(s); start at most "
            f"{count} controller(s) per machine (distributed.nproc) or set "
            "distributed.device=cpu"
        )
    return f"cuda:{local_rank}"


def select_backend(backend: str, device: str) -> str:
    """The process-group backend: ``auto`` is NCCL for a CUDA device, else gloo."""
    if backend == "auto":
        return "nccl" if device.startswith("cuda") else "gloo"
    if backend == "nccl" and not device.startswith("cuda"):
        raise RuntimeError(
            f"distributed.backend=nccl needs CUDA devices, but the controllers are on {device} "
            "(distributed.device); use distributed.backend=auto or gloo"
        )
    return backend


_announced: list[str] = []


def init_from_env(backend: str = "auto", device: str = "auto") -> Dist:
    """Join the process group described by torchrun's env vars, or run alone.

    ``device`` is ``distributed.device`` (see ``select_device``), ``backend`` is
    ``distributed.backend`` (see ``select_backend``; unused by a lone controller). Rank 0
    prints once which device and backend the controllers use.
    """
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local = int(os.environ.get("LOCAL_RANK", "0"))
    dev = select_device(device, local)
    if dev.startswith("cuda"):
        torch.cuda.set_device(torch.device(dev))
    if world <= 1:
        out = Dist(0, 1, dev)
    else:
        backend = select_backend(backend, dev)
        if not dist.is_initialized():
            store = attempt_store(rank, world)
            if store is None:
                dist.init_process_group(backend=backend)
            else:
                dist.init_process_group(backend=backend, store=store, rank=rank, world_size=world)
        out = Dist(rank, world, dev, backend=dist.get_backend())
    line = out.describe()
    if out.is_main and line not in _announced:
        _announced.append(line)
        logger.info(line)
    return out


def attempt_store(rank: int, world: int):
    """Under torchrun, the store the process group meets in, with keys private to this
    restart attempt (None outside torchrun).

    torchrun's c10d rendezvous hands every attempt of the group the same agent-hosted
    TCPStore without a per-attempt prefix, so after an elastic restart the gloo mesh
    keys of the dead group are still there: a new rank that reads its peer's key before
    the peer rewrites it gets the old, dead address (connection refused and the restart
    fails, or a connection to whatever listens there now and the group hangs). A
    ``mmyatt/attempt_<TORCHELASTIC_RESTART_COUNT>/`` key prefix gives each attempt clean keys.
    """
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    if attempt is None or "MASTER_ADDR" not in os.environ or "MASTER_PORT" not in os.environ:
        return None
    agent_hosts = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == str(True)
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        world,
        is_master=not agent_hosts and rank == 0,
        timeout=timedelta(minutes=10),
    )
    return dist.PrefixStore(f"mmyatt/attempt_{attempt}", store)


def shutdown() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def under_launcher() -> bool:
    return "WORLD_SIZE" in os.environ and "RANK" in os.environ


def launch(nproc: int, argv: list[str], *, max_restarts: int = 0, saved_since=None) -> int:
    """Run ``python -m mmyatt <argv>`` as ``nproc`` controllers under torchrun's launcher.

    With ``max_restarts`` > 0 a controller that dies makes torchrun restart the whole
    group (each attempt meets in its own store keys, see ``attempt_store``), and the
    restarted controllers resume from the last complete checkpoint.

    On SIGTERM the signal is passed on and the launcher waits; torchrun then exits
    non-zero because it was signalled, so ``saved_since(t)`` (did the controllers write a
    complete checkpoint after time t?) decides whether that was a clean stop (exit 0).
    """
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc-per-node={nproc}",
        "--nnodes=1",
        f"--rdzv-endpoint=127.0.0.1:{free_port()}",
        "--rdzv-backend=c10d",
        f"--max-restarts={max_restarts}",
        "-m",
        "mmyatt",
        *argv,
    ]
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("TORCHELASTIC_ERROR_FILE", "")
    proc = subprocess.Popen(cmd, env=env)
    term: list[float] = []

    def forward(*_):  # pass SIGTERM on and wait: controllers finish the step and save first
        term.append(time.time())
        proc.send_signal(signal.SIGTERM)

    old = signal.signal(signal.SIGTERM, forward)
    try:
        rc = proc.wait()
    finally:
        signal.signal(signal.SIGTERM, old)
    if rc != 0 and term and saved_since is not None and saved_since(term[0]):
        return 0
    return rc
