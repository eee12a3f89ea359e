"""Checkpoint bench: training stall per save (sync vs async) and resume time.

One model (a stack of ``Linear`` layers) with AdamW state is saved with
``Checkpointer(async_save=False)`` (the stall is the whole write + fsync) and with
``async_save=True`` (the stall is the snapshot into staging buffers; a background thread
writes), then resumed (load + ``load_state_dict`` into model and optimizer). Both arms
are warmed alike: ``warmup`` saves each are discarded (the first async save allocates
the staging buffers; the first sync save creates files in a cold directory), then
``reps`` saves each (5 by default), the two arms alternating, and the median of each
arm is reported, with the discarded warm-up saves beside it (``warmup_samples``).

    mmyatt bench checkpoint --out bench/checkpoint.json
"""

from __future__ import annotations

import os
import platform
import resource
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

from mmyatt.checkpoint.checkpointer import (
    Checkpointer,
    load_optimizer_state,
    optimizer_state,
    rng_state,
    set_rng_state,
)


def _dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.iterdir() if p.is_file())


def _machine(root: Path) -> dict:
    info = {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "checkpoint_dir": str(root),
    }
    try:
        import psutil

        info["ram_gb"] = round(psutil.virtual_memory().total / 2**30, 1)
    except ImportError:  # pragma: no cover
        pass
    return info


def bench_checkpoint(
    quick: bool = False, reps: int = 5, warmup: int = 1, root: str | Path | None = None
) -> dict:
    """Sync vs async save stall and resume time on one model + AdamW state.

    The full size (8 x Linear(4096, 4096), 134 M parameters; 1.6 GB of model + AdamW
    state) makes a sync save take well over 1 s on local disk while keeping peak memory
    near 4 GB (state + staging buffers). ``quick`` uses a tiny model for tests.
    """
    width, depth = (128, 2) if quick else (4096, 8)
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(width, width) for _ in range(depth)])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    with torch.no_grad():
        for p in model.parameters():
            p.grad = torch.randn_like(p).mul_(1e-3)
    opt.step()  # creates exp_avg / exp_avg_sq
    opt.zero_grad(set_to_none=True)
    n_params = sum(p.numel() for p in model.parameters())

    tmp = Path(tempfile.mkdtemp(prefix="mmyatt-ckpt-bench-", dir=root))
    try:
        step = 0

        def state() -> tuple[dict, dict]:
            shared = {"model": model.state_dict(), "optimizer": optimizer_state(opt), "step": step}
            return shared, {"rng": rng_state(), "cursor": {"epoch": 0, "index": step}}

        sync_ck = Checkpointer(tmp / "sync", async_save=False, keep_last=1)
        async_ck = Checkpointer(tmp / "async", async_save=True, keep_last=1)

        def sync_save() -> float:
            nonlocal step
            step += 1
            shared, local = state()
            t0 = time.perf_counter()
            sync_ck.save(step, shared, local)
            return time.perf_counter() - t0

        def async_save() -> tuple[float, float]:
            nonlocal step
            step += 1
            shared, local = state()
            t0 = time.perf_counter()
            async_ck.save(step, shared, local)  # the first one allocates the staging buffers
            stall = time.perf_counter() - t0
            async_ck.wait()
            return stall, time.perf_counter() - t0

        # Both arms alike: `warmup` discarded saves each (cold page cache, first file
        # creation, the async staging buffers), then `reps` timed saves each, the arms
        # alternating so that load from other processes hits both.
        warm_sync, warm_async = [], []
        for _ in range(warmup):
            warm_sync.append(sync_save())
            warm_async.append(async_save())
        sync_s, stall_s, complete_s = [], [], []
        for _ in range(reps):
            sync_s.append(sync_save())
            stall, complete = async_save()
            stall_s.append(stall)
            complete_s.append(complete)
        sync_ck.close()
        async_ck.close()
        ckpt_bytes = _dir_bytes(sync_ck.latest())
        shutil.rmtree(tmp / "sync")

        resume_s = []
        expect = {k: v.clone() for k, v in model.state_dict().items()}
        for _ in range(reps):
            t0 = time.perf_counter()
            ck = Checkpointer(tmp / "async", async_save=True, clean_stale=False)
            path = ck.resolve("auto")
            shared, local = ck.load(path)
            model.load_state_dict(shared["model"])
            load_optimizer_state(opt, shared["optimizer"])
            set_rng_state(local["rng"])
            resume_s.append(time.perf_counter() - t0)
        exact = all(torch.equal(v, model.state_dict()[k]) for k, v in expect.items())
        del shared, local, expect
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    sync_med, stall_med = statistics.median(sync_s), statistics.median(stall_s)
    return {
        "sync_save_s": round(sync_med, 4),
        "async_stall_s": round(stall_med, 4),
        "async_complete_s": round(statistics.median(complete_s), 4),
        "async_over_sync_stall": round(stall_med / sync_med, 4),
        "sync_save_min_s": round(min(sync_s), 4),
        "sync_save_max_s": round(max(sync_s), 4),
        "async_stall_min_s": round(min(stall_s), 4),
        "async_stall_max_s": round(max(stall_s), 4),
        "resume_s": round(statistics.median(resume_s), 4),
        "resume_exact": exact,
        "checkpoint_bytes": ckpt_bytes,
        "params": n_params,
        "reps": reps,
        "warmup_saves_discarded": warmup,
        "samples": {
            "sync_save_s": sync_s,
            "async_stall_s": stall_s,
            "async_complete_s": complete_s,
            "resume_s": resume_s,
        },
        "warmup_samples": {
            "sync_save_s": warm_sync,
            "async_stall_s": [a for a, _ in warm_async],
            "async_complete_s": [b for _, b in warm_async],
        },
        "peak_rss_mb": int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024),
        "machine": _machine(Path(tempfile.gettempdir() if root is None else root)),
        "notes": (
            "stall = wall time of Checkpointer.save(); sync includes serialisation and "
            "fsync, async only the snapshot into reused CPU staging buffers; resume = "
            "Checkpointer + resolve('auto') + load + load_state_dict (model, AdamW) + RNG, "
            "file in page cache (just written)"
        ),
    }


if __name__ == "__main__":  # pragma: no cover
    import json

    print(json.dumps(bench_checkpoint(), indent=2))
