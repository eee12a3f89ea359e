"""The CPU resource pool: pin a process (every thread of it) to a core set, give torch
the matching thread count, and read what a process used (CPU seconds, peak RSS).

``os.sched_setaffinity(pid)`` moves one thread on Linux; the threads a process already
has (torch's OpenMP pool, HTTP handlers) keep their old mask. ``pin_process`` therefore
sets the mask of every task under ``/proc/<pid>/task``.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path


def pin_process(cores: Sequence[int], pid: int | None = None) -> int:
    """Run every thread of process ``pid`` (this one by default) on ``cores`` only.
    A thread already on exactly ``cores`` is left alone (no affinity call), so pinning to
    the mask a process already has costs only the reads. Returns the threads moved."""
    pid = os.getpid() if pid is None else pid
    mask = set(int(c) for c in cores)
    if not mask:
        raise ValueError("pin_process: an empty core set")
    tasks = Path(f"/proc/{pid}/task")
    tids = [int(t) for t in os.listdir(tasks)] if tasks.is_dir() else [pid]
    moved = 0
    for tid in tids:
        try:
            if os.sched_getaffinity(tid) == mask:
                continue
            os.sched_setaffinity(tid, mask)
            moved += 1
        except (ProcessLookupError, FileNotFoundError):  # a thread that just ended
            pass
    return moved


def process_cores(pid: int | None = None) -> list[int]:
    return sorted(os.sched_getaffinity(0 if pid is None else pid))


def set_threads(n: int) -> None:
    """torch's intra-op threads for this process's next phase (at least 1)."""
    import torch

    n = max(1, int(n))
    if torch.get_num_threads() != n:
        torch.set_num_threads(n)


def use_cores(cores: Sequence[int], sharers: int = 1) -> int:
    """Pin this process to ``cores`` shared with ``sharers - 1`` other processes of the
    same role, and give torch ``len(cores) // sharers`` threads (at least 1). Returns
    the thread count."""
    pin_process(cores)
    n = max(1, len(cores) // max(1, sharers))
    set_threads(n)
    return n


def _status(pid: int | str = "self") -> dict[str, int]:
    out = {}
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            key, _, rest = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                out[key] = int(rest.split()[0])  # kB
    except (OSError, ValueError, IndexError):
        pass
    return out


def rss_mb(pid: int | str = "self") -> float:
    return _status(pid).get("VmRSS", 0) / 1024.0


def peak_rss_mb(pid: int | str = "self") -> float:
    """Peak resident memory since the last ``reset_peak_rss`` (VmHWM)."""
    return _status(pid).get("VmHWM", 0) / 1024.0


def reset_peak_rss(pid: int | str = "self") -> bool:
    """Start a new peak-RSS window (writing 5 to clear_refs resets VmHWM; Linux >= 4.0).
    False where the kernel does not allow it, and the peak then runs from process start."""
    try:
        Path(f"/proc/{pid}/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def cpu_seconds() -> float:
    """CPU time (user + system) this process has used, all threads."""
    t = os.times()
    return t.user + t.system


def release_free_memory() -> None:
    """Give freed heap pages back to the OS (glibc malloc_trim), so dropped weights show
    up as lower RSS; a no-op where there is no glibc. A process that uses CUDA also hands
    its allocator's cached blocks back to the device (``torch.cuda.empty_cache``), so
    dropped weights leave the device to the other processes on it."""
    cuda = _cuda()
    if cuda is not None:
        cuda.empty_cache()
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _cuda():
    """``torch.cuda`` where this process has already put something on a CUDA device, else
    None (the device memory figures are then absent: nothing is initialised for them)."""
    import sys

    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return None
    return torch.cuda


def reset_device_peak() -> None:
    """Start a new window for ``device_peak_mb`` (every device of this process)."""
    cuda = _cuda()
    if cuda is not None:
        for d in range(cuda.device_count()):
            cuda.reset_peak_memory_stats(d)


def device_mb() -> float:
    """Device memory this process's allocator holds now (reserved, every device), MB; 0
    without CUDA. The CUDA context itself (some hundreds of MB) is not in it."""
    return _reserved_mb("memory_reserved")


def device_peak_mb() -> float:
    """Peak device memory this process's allocator held since ``reset_device_peak``
    (reserved, every device), MB; 0 without CUDA."""
    return _reserved_mb("max_memory_reserved")


def _reserved_mb(reading: str) -> float:
    """``torch.cuda.<reading>(device)`` summed over this process's devices, MB."""
    cuda = _cuda()
    if cuda is None:
        return 0.0
    read = getattr(cuda, reading)
    return sum(read(d) for d in range(cuda.device_count())) / 2**20


def sum_over_processes(value: float, device) -> float:
    """``value`` summed over every process of the run (a model-parallel group's other
    ranks too, where the controllers' own reductions count one per controller)."""
    import torch
    import torch.distributed as tdist

    t = torch.tensor([value], dtype=torch.float64, device=device)
    tdist.all_reduce(t)
    return float(t.item())
