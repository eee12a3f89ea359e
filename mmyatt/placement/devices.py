"""The device side of the resource pool: which GPU each role uses, checked before start.

On a GPU machine the controllers sit on ``cuda:<local rank>`` (``distributed.device``,
checked by ``mmyatt.distributed.select_device``) and each judge server started with the
run on the GPUs ``reward.judge.devices`` names (round robin, one ``CUDA_VISIBLE_DEVICES``
per server; ``"0,1"`` gives one server two GPUs). Without ``devices`` a server sees every
GPU and loads on the first, controller 0's.

``check_judge_devices`` fails before the run prepares anything when that mapping cannot
work: an id that is not a GPU id, a GPU this machine does not have, ids on a machine
with no CUDA device (the server would hide every GPU and quietly load on the CPU), more
devices than servers to use them. ``device_lines`` says where each role runs, and what
partial (or auto) does where the judge sits on a controller's GPU: rollout and the judge
time-slice it when that controller generates; with ``placement.merge_rollout`` only the
first controller generates, so a judge on another controller's GPU runs beside rollout
and training then takes that GPU too (docs/placement.md, "On a GPU machine").
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from mmyatt.config.errors import ConfigError

if TYPE_CHECKING:
    from mmyatt.config.schema import RunConfig


def cuda_count() -> int:
    """CUDA devices this process sees (0 without a CUDA build or device)."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def judge_device_sets(devices) -> list[tuple[int, ...]]:
    """``reward.judge.devices`` as GPU id tuples, one per entry; raises on a malformed id."""
    out = []
    for i, entry in enumerate(devices):
        ids = [s.strip() for s in str(entry).split(",")]
        if not ids or not all(s.isdigit() for s in ids):
            raise ConfigError(
                f"reward.judge.devices[{i}]={entry!r} is not a GPU id: give an integer, or "
                "ids joined by commas for one server on several GPUs (e.g. '0,1')"
            )
        out.append(tuple(int(s) for s in ids))
    return out


def check_judge_devices(cfg: RunConfig, count: int | None = None) -> None:
    """Raise ConfigError, naming the key, when ``reward.judge.devices`` cannot work on a
    machine with ``count`` CUDA devices (default: this one's)."""
    j = cfg.reward.judge
    if not j.devices:
        return
    sets = judge_device_sets(j.devices)
    if j.model is None:
        raise ConfigError(
            f"reward.judge.devices={list(j.devices)} places judge servers the run starts, "
            "but reward.judge.model is not set (judges at reward.judge.urls run elsewhere): "
            "set reward.judge.model or drop reward.judge.devices"
        )
    n = cuda_count() if count is None else count
    if n == 0:
        raise ConfigError(
            f"reward.judge.devices={list(j.devices)} names GPUs, but this machine has no "
            "CUDA device: the servers would hide every GPU and load on the CPU. Drop "
            "reward.judge.devices to run the judge on the CPU"
        )
    missing = sorted({d for s in sets for d in s if d >= n})
    if missing:
        raise ConfigError(
            f"reward.judge.devices={list(j.devices)} names GPU(s) {missing}, but this "
            f"machine has {n} CUDA device(s) (ids 0-{n - 1})"
        )
    if len(sets) > j.num_servers:
        raise ConfigError(
            f"reward.judge.devices names {len(sets)} device sets but reward.judge.num_servers"
            f"={j.num_servers}: {[list(s) for s in sets[j.num_servers :]]} would serve "
            "nothing; raise num_servers or drop those devices"
        )


def controller_devices(cfg: RunConfig, count: int) -> list[int]:
    """The GPU ids the controllers on this machine use ([] when they run on the CPU)."""
    if cfg.distributed.device == "cpu" or count == 0:
        return []
    local = int(os.environ.get("LOCAL_WORLD_SIZE", cfg.distributed.nproc))
    return list(range(min(local, count)))


def device_lines(cfg: RunConfig, count: int | None = None) -> list[str]:
    """Where each role runs on a GPU machine (nothing on a CPU-only one), and a note when
    partial or auto places the judge on a controller's GPU."""
    n = cuda_count() if count is None else count
    ctl = controller_devices(cfg, n)
    if not ctl:
        return []
    lines = [f"[placement] controllers (rollout, train) on {_names(ctl)}"]
    j = cfg.reward.judge
    if j.model is None:
        return lines
    sets = judge_device_sets(j.devices) or [(0,)]  # no devices: each server loads on GPU 0
    servers = [sets[i % len(sets)] for i in range(j.num_servers)]
    where = ", ".join(f"{i}: {'+'.join(f'cuda:{d}' for d in s)}" for i, s in enumerate(servers))
    lines.append(f"[placement] judge servers on {where}")
    p = cfg.placement
    shared = {d for s in servers for d in s} & set(ctl)
    if p.mode not in ("partial", "auto") or not shared:
        return lines
    gen = set(ctl[:1] if p.merge_rollout else ctl)  # merged: only the first generates
    if sliced := sorted(shared & gen):
        lines.append(
            f"[placement] the judge shares {_names(sliced)} with generating controllers: in "
            "partial steps rollout and the judge time-slice it; give the judge GPUs of its "
            "own (reward.judge.devices) to overlap them"
        )
    if apart := sorted(shared - gen):
        asleep = (
            "the judge asleep (placement.partial_release_judge)"
            if p.partial_release_judge
            else "the judge's weights kept there (placement.partial_release_judge frees them)"
        )
        lines.append(
            f"[placement] partial steps: rollout on {_names(sorted(gen))} (merge_rollout) "
            f"beside the judge on {_names(apart)}, then training on every GPU with {asleep}"
        )
    return lines


def _names(ids) -> str:
    return ", ".join(f"cuda:{d}" for d in ids)
