"""What a released judge leaves on the device: ``python3 bench/gpu_judge_release_probe.py``
on a CUDA machine. Loads the placement bench's 25 M judge on cuda, releases it as
colocate does (``Batcher.sleep``), and prints the allocator's allocated and reserved MB at
each stage, then every CUDA tensor still alive after the release with what refers to it."""

from __future__ import annotations

import gc
import sys
import tempfile
from pathlib import Path

import torch

from mmyatt.placement.bench_memory import big_model
from mmyatt.rewards.judge_server import JudgeServer


def mb(x: float) -> str:
    return f"{x / 2**20:.1f}"


def show(stage: str) -> None:
    a, r = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
    print(f"{stage:>28}: allocated {mb(a)} MB, reserved {mb(r)} MB", flush=True)


def live_cuda_tensors() -> list:
    gc.collect()
    return [o for o in gc.get_objects() if isinstance(o, torch.Tensor) and o.is_cuda]


def main() -> int:
    if not torch.cuda.is_available():
        print("no CUDA device")
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        path, params = big_model(Path(tmp) / "judge", seed=1)
        print(f"judge: {params} parameters, {mb(params * 4)} MB in float32")
        show("before load")
        server = JudgeServer(str(path), device="cuda")
        show("loaded")
        server.batcher.sleep()
        show("released (sleep)")
        gc.unfreeze()
        alive = live_cuda_tensors()
        show("unfrozen, collected")
        print(
            f"CUDA tensors alive after the release: {len(alive)}, "
            f"{mb(sum(t.numel() * t.element_size() for t in alive))} MB"
        )
        for t in sorted(alive, key=lambda t: -t.numel())[:5]:
            refs = [type(x).__name__ for x in gc.get_referrers(t)][:6]
            print(f"  {tuple(t.shape)} {t.dtype} referred to by {refs}")
        torch.cuda.empty_cache()
        show("emptied again")
        server.batcher.wake()
        show("woken")
        # the same release with the module's tensors first moved off the device
        server.model.model.to("meta")
        show("module moved to meta")
        server.batcher.sleep()
        show("released (sleep)")
        server.batcher.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
