"""Run checkpoints: async save, a completion marker written last, retention, exact resume.

A checkpoint is a directory ``<root>/step_XXXXXXXX/``::

    shared.safetensors  shared.json      state identical on every controller (model,
                                         optimizer, LR schedule, step, counters), rank 0 only
    local_rank{r}.safetensors/.json      controller r's own state (data cursor, RNG
                                         states, dynamic-sampling buffers)
    rank{r}.done                         rank r has fsync'ed its files
    COMPLETE                             written last by rank 0: {"step", "world_size",
                                         "time", "files": {name: bytes}}

Every rank writes into the same ``step_XXXXXXXX.tmp/`` directory; rank 0 waits for all
``rank*.done`` files, writes ``COMPLETE`` and renames the directory to its final name
(an atomic rename), so a reader sees either a whole checkpoint or none. Only final-named
directories holding ``COMPLETE`` count; a run killed (SIGKILL) mid-step or mid-save
resumes from the newest of those and never reads a partial one.

State trees are nested dicts / lists / tuples of tensors and JSON scalars. Tensors go to
safetensors, the rest to JSON with enough tags to restore int dict keys, tuples and
non-finite floats exactly. Nothing is ever unpickled: loading uses ``safetensors`` and
``json`` only. (``torch.distributed.checkpoint`` stores its ``.metadata`` with pickle,
which is why this module does not use it.)

Async save: ``save()`` only snapshots -- copies every tensor into CPU staging buffers
that are kept between saves (so after the first save a snapshot is a memcpy, not a page
fault storm) and encodes the non-tensor state -- then a background thread writes and
fsyncs. One save is in flight at a time; an error in the writer is raised by the next
``save()``, ``wait()`` or ``close()``.

Multi-controller use: every rank builds a ``Checkpointer`` on the same (shared) root
with its rank, the world size and ``barrier=dist.barrier``; rank 0 then removes the
leftovers of a killed run (``*.tmp``) before anyone writes. Every rank calls ``save``
at the same steps with the same ``shared`` state.
"""

from __future__ import annotations

import json
import math
import os
import random
import re
import shutil
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file

FORMAT = "mmyatt-checkpoint/1"
COMPLETE = "COMPLETE"
SHARED = "shared"
_STEP_RE = re.compile(r"^step_(\d+)$")
_TMP_RE = re.compile(r"^step_(\d+)\.tmp$")
_TAGS = ("__tensor__", "__tuple__", "__items__", "__float__")


# --------------------------------------------------------------------------- state trees
def flatten_state(
    tree: Any, *, clone: bool = True, buffers: dict[str, torch.Tensor] | None = None
) -> tuple[dict[str, torch.Tensor], Any]:
    """Split a state tree into ``(tensors, meta)``: tensors for safetensors, meta for JSON.

    ``meta`` is the tree with every tensor replaced by ``{"__tensor__": key}``; tuples,
    dicts with non-string keys and non-finite floats are tagged so ``unflatten_state``
    rebuilds them exactly. Tensors come back contiguous, on CPU and detached: copies when
    ``clone`` (into ``buffers[key]`` when one of the right shape and dtype is there; new
    staging buffers are added to ``buffers``), else the tensors themselves where that is
    possible without a copy. The same tensor reached twice (tied weights) is stored once
    and comes back as one tensor. Anything that is not a tensor, dict, list, tuple, str,
    int, float, bool or None raises ``TypeError`` naming its key path.
    """
    tensors: dict[str, torch.Tensor] = {}
    by_view: dict[tuple, str] = {}
    storages: set[int] = set()

    def add_tensor(t: torch.Tensor, path: str) -> str:
        if t.layout != torch.strided or t.is_quantized or t.device.type == "meta":
            raise TypeError(f"cannot checkpoint a {t.layout}/{t.device} tensor at {path!r}")
        t = t.detach()
        try:
            ptr = t.untyped_storage().data_ptr()
        except Exception as e:  # tensor subclasses without storage (e.g. DTensor)
            raise TypeError(
                f"cannot checkpoint tensor of type {type(t).__name__} at {path!r}: {e}"
            ) from None
        view = (ptr, t.storage_offset(), tuple(t.shape), t.stride(), t.dtype, str(t.device))
        if t.numel() and view in by_view:
            return by_view[view]
        key, n = path, 1
        while key in tensors:
            key, n = f"{path}#{n}", n + 1
        if clone:
            buf = buffers.get(key) if buffers is not None else None
            if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
                buf = torch.empty(t.shape, dtype=t.dtype, device="cpu")
            out = buf.copy_(t)
            if buffers is not None:
                buffers[key] = out
        else:
            out = t.cpu()
            if not out.is_contiguous() or (out.numel() and ptr in storages):
                out = out.contiguous() if not out.is_contiguous() else out.clone()
        if t.numel():
            by_view[view] = key
            storages.add(ptr)
        tensors[key] = out
        return key

    def enc(x: Any, path: str) -> Any:
        if x is None or isinstance(x, bool):
            return x
        if isinstance(x, int):
            return int(x)
        if isinstance(x, float):
            return float(x) if math.isfinite(x) else {"__float__": repr(float(x))}
        if isinstance(x, str):
            return str.__str__(x)
        if isinstance(x, torch.Tensor):
            return {"__tensor__": add_tensor(x, path)}
        if isinstance(x, np.generic) and isinstance(x.item(), int | float | bool):
            return enc(x.item(), path)
        if isinstance(x, dict):
            if all(type(k) is str for k in x) and not (len(x) == 1 and next(iter(x)) in _TAGS):
                return {k: enc(v, f"{path}/{k}" if path else k) for k, v in x.items()}
            items = []
            for k, v in x.items():
                kp = f"{path}/{k!r}" if path else repr(k)
                items.append([enc_key(k, kp), enc(v, kp)])
            return {"__items__": items}
        if isinstance(x, list):
            return [enc(v, f"{path}/{i}") for i, v in enumerate(x)]
        if type(x) is tuple or isinstance(x, torch.Size):
            return {"__tuple__": [enc(v, f"{path}/{i}") for i, v in enumerate(x)]}
        raise TypeError(
            f"cannot checkpoint an object of type {type(x).__module__}.{type(x).__qualname__} "
            f"at {path or '<root>'!r}: checkpoint state may hold only tensors, dicts, lists, "
            "tuples, str, int, float, bool and None (nothing is pickled)"
        )

    def enc_key(k: Any, path: str) -> Any:
        if k is None or isinstance(k, bool | int | float | str):
            return enc(k, path)
        if type(k) is tuple:
            return {"__tuple__": [enc_key(v, path) for v in k]}
        raise TypeError(f"cannot checkpoint a dict key of type {type(k).__name__} at {path!r}")

    meta = enc(tree, "")
    if buffers is not None and clone:
        for k in [k for k in buffers if k not in tensors]:
            del buffers[k]
    return tensors, meta


def unflatten_state(tensors: dict[str, torch.Tensor], meta: Any) -> Any:
    """Inverse of ``flatten_state``."""

    def dec(x: Any) -> Any:
        if isinstance(x, list):
            return [dec(v) for v in x]
        if isinstance(x, dict):
            if len(x) == 1:
                ((k, v),) = x.items()
                if k == "__tensor__":
                    if v not in tensors:
                        raise ValueError(f"checkpoint metadata names a missing tensor {v!r}")
                    return tensors[v]
                if k == "__tuple__":
                    return tuple(dec(i) for i in v)
                if k == "__items__":
                    return {dec(a): dec(b) for a, b in v}
                if k == "__float__":
                    return float(v)
            return {k: dec(v) for k, v in x.items()}
        return x

    return dec(meta)


# --------------------------------------------------------------------------- RNG
def rng_state() -> dict:
    """This process's RNG states: torch CPU (and CUDA), Python ``random``, numpy global."""
    version, internal, gauss = random.getstate()
    name, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
    out = {
        "torch": torch.get_rng_state(),
        "python": {"version": version, "state": list(internal), "gauss_next": gauss},
        "numpy": {
            "name": name,
            "keys": [int(k) for k in keys],
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached),
        },
    }
    if torch.cuda.is_available():
        out["cuda"] = list(torch.cuda.get_rng_state_all())
    return out


def set_rng_state(state: dict) -> None:
    """Restore what ``rng_state`` returned (after a trip through a checkpoint)."""
    torch.set_rng_state(state["torch"].to("cpu", torch.uint8))
    p = state["python"]
    random.setstate((p["version"], tuple(p["state"]), p["gauss_next"]))
    n = state["numpy"]
    np.random.set_state(
        (
            n["name"],
            np.asarray(n["keys"], dtype=np.uint32),
            n["pos"],
            n["has_gauss"],
            n["cached_gaussian"],
        )
    )
    if "cuda" in state and torch.cuda.is_available():
        cuda = list(state["cuda"])
        if len(cuda) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all([t.to("cpu", torch.uint8) for t in cuda])


# --------------------------------------------------------------------------- torch objects
def optimizer_state(optimizer: torch.optim.Optimizer) -> dict:
    return optimizer.state_dict()


def load_optimizer_state(optimizer: torch.optim.Optimizer, state: dict) -> None:
    optimizer.load_state_dict(state)


def scheduler_state(scheduler) -> dict:
    """``scheduler.state_dict()`` made checkpointable.

    ``LambdaLR``/``MultiplicativeLR`` keep ``None`` for plain functions and the
    ``__dict__`` of callable objects in ``lr_lambdas``; a ``__dict__`` that holds
    non-checkpointable objects is replaced by ``None`` (the function comes from the code
    on resume; only its attributes would have been restored).
    """
    sd = dict(scheduler.state_dict())
    if isinstance(sd.get("lr_lambdas"), list):
        fns = []
        for fn in sd["lr_lambdas"]:
            try:
                flatten_state(fn, clone=False)
            except TypeError:
                fn = None
            fns.append(fn)
        sd["lr_lambdas"] = fns
    return sd


def load_scheduler_state(scheduler, state: dict) -> None:
    scheduler.load_state_dict(dict(state))  # LambdaLR pops keys from the dict it gets


# --------------------------------------------------------------------------- files
def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(path: Path) -> None:
    try:
        _fsync_file(path)
    except OSError:  # some file systems do not allow fsync on directories
        pass


def _write_text(path: Path, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def _write_part(dirpath: Path, name: str, tensors: dict[str, torch.Tensor], meta: Any) -> None:
    st = dirpath / f"{name}.safetensors"
    save_file(tensors, str(st), metadata={"format": "pt"})
    _fsync_file(st)
    doc = {"format": FORMAT, "tree": meta}
    _write_text(dirpath / f"{name}.json", json.dumps(doc, allow_nan=False))


def _read_part(dirpath: Path, name: str) -> Any:
    doc = json.loads((dirpath / f"{name}.json").read_text())
    if doc.get("format") != FORMAT:
        raise ValueError(f"{dirpath / name}.json: unknown checkpoint format {doc.get('format')!r}")
    tensors = load_file(str(dirpath / f"{name}.safetensors"))
    return unflatten_state(tensors, doc["tree"])


def _step_of(path: Path) -> int | None:
    m = _STEP_RE.match(path.name)
    return int(m.group(1)) if m else None


def _rmtree(path: Path) -> None:
    """Remove a checkpoint dir so that no crash leaves a half-deleted one looking valid."""
    if not path.exists():
        return
    if not path.name.endswith((".tmp", ".deleting")):
        gone = path.with_name(path.name + ".deleting")
        os.rename(path, gone)
        path = gone
    shutil.rmtree(path, ignore_errors=True)


class Checkpointer:
    """Save and load run checkpoints under ``root`` for one controller (rank)."""

    def __init__(
        self,
        root: str | Path,
        *,
        rank: int = 0,
        world_size: int = 1,
        keep_last: int = 2,
        keep_every: int = 0,
        async_save: bool = True,
        barrier: Callable[[], None] | None = None,
        done_timeout_s: float = 600.0,
        clean_stale: bool = True,
    ):
        if keep_last < 1:
            raise ValueError(f"keep_last must be >= 1, got {keep_last}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside world_size {world_size}")
        self.root = Path(root)
        self.rank, self.world_size = rank, world_size
        self.keep_last, self.keep_every = keep_last, keep_every
        self.async_save = async_save
        self.done_timeout_s = done_timeout_s
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._error_step: int | None = None
        self._buffers: dict[str, dict[str, torch.Tensor]] = {SHARED: {}, "local": {}}
        # A killed run can leave step_X.tmp dirs holding rank*.done files; a new save of
        # step X must not mistake them for this run's. Rank 0 removes them before any
        # rank writes (the barrier orders that; pass clean_stale=False to only read).
        if clean_stale and rank == 0 and self.root.is_dir():
            for p in self.root.iterdir():
                if p.is_dir() and p.name.endswith((".tmp", ".deleting")):
                    shutil.rmtree(p, ignore_errors=True)
        if barrier is not None:
            barrier()

    # ------------------------------------------------------------------ save
    def save(self, step: int, shared: Any, local: Any) -> None:
        """Checkpoint ``step``. ``shared`` must be the same on every rank (only rank 0
        writes it); ``local`` is this rank's own state. Returns once the state is
        snapshotted (async) or written (sync)."""
        self.wait()
        if self._complete_info(self._final(step)) is not None:
            return  # this step is already checkpointed (e.g. saved again right after resume)
        clone = self.async_save
        parts = {}
        if self.rank == 0:
            parts[SHARED] = flatten_state(shared, clone=clone, buffers=self._buffers[SHARED])
        parts[f"local_rank{self.rank}"] = flatten_state(
            local, clone=clone, buffers=self._buffers["local"]
        )
        if not self.async_save:
            self._write(step, parts)
            return

        def run() -> None:
            try:
                self._write(step, parts)
            except BaseException as e:  # handed to the next save/wait/close
                self._error, self._error_step = e, step

        self._thread = threading.Thread(target=run, name=f"checkpoint-step{step}", daemon=False)
        self._thread.start()

    def wait(self) -> None:
        """Block until this rank's save in flight is written; raise its error if it failed.

        On rank 0 that means the checkpoint is complete (all ranks' files, ``COMPLETE``,
        renamed); on other ranks only that their own files are down. Call ``close()``
        (or ``wait()``) before the process exits, or a failed last save goes unreported."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            err, step = self._error, self._error_step
            self._error = self._error_step = None
            if hasattr(err, "add_note"):
                err.add_note(f"(raised by the background save of checkpoint step {step})")
            raise err

    def close(self) -> None:
        self.wait()
        self._buffers = {SHARED: {}, "local": {}}

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _final(self, step: int) -> Path:
        return self.root / f"step_{step:08d}"

    def _write(self, step: int, parts: dict) -> None:
        final = self._final(step)
        tmp = final.with_name(final.name + ".tmp")
        tmp.mkdir(parents=True, exist_ok=True)
        for name, (tensors, meta) in parts.items():
            _write_part(tmp, name, tensors, meta)
        done = {"step": step, "rank": self.rank, "time": time.time()}
        _write_text(tmp / f"rank{self.rank}.done", json.dumps(done))
        _fsync_dir(tmp)
        if self.rank != 0:
            return
        self._wait_for_ranks(tmp, step)
        files = {p.name: p.stat().st_size for p in sorted(tmp.iterdir()) if p.is_file()}
        info = {"step": step, "world_size": self.world_size, "time": time.time(), "files": files}
        _write_text(tmp / COMPLETE, json.dumps(info, indent=1))
        _fsync_dir(tmp)
        os.rename(tmp, final)
        _fsync_dir(self.root)
        self._retain()

    def _wait_for_ranks(self, tmp: Path, step: int) -> None:
        deadline = time.monotonic() + self.done_timeout_s
        delay = 0.005
        while True:
            missing = []
            for r in range(self.world_size):
                try:
                    if json.loads((tmp / f"rank{r}.done").read_text()).get("step") == step:
                        continue
                except (OSError, ValueError):
                    pass
                missing.append(r)
            if not missing:
                return
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"checkpoint step {step}: rank(s) {missing} did not finish writing into "
                    f"{tmp} within {self.done_timeout_s:.0f} s (no rank<r>.done); the "
                    "checkpoint was not marked complete"
                )
            time.sleep(delay)
            delay = min(delay * 2, 0.2)

    def _retain(self) -> None:
        done = self.complete_steps()
        if not done:
            return
        steps = [s for s, _ in done]
        newest = steps[-1]
        keep = set(steps[-self.keep_last :]) | {newest}
        if self.keep_every > 0:
            keep |= {s for s in steps if s % self.keep_every == 0}
        for s, p in done:
            if s not in keep:
                _rmtree(p)
        for p in self.root.iterdir():
            m = _TMP_RE.match(p.name)
            if (m and int(m.group(1)) < newest) or p.name.endswith(".deleting"):
                shutil.rmtree(p, ignore_errors=True)

    # ------------------------------------------------------------------ find
    @staticmethod
    def _complete_info(path: Path) -> dict | None:
        try:
            info = json.loads((Path(path) / COMPLETE).read_text())
        except (OSError, ValueError):
            return None
        return info if isinstance(info, dict) and "world_size" in info else None

    def complete_steps(self) -> list[tuple[int, Path]]:
        """``(step, dir)`` of every complete checkpoint, oldest first."""
        if not self.root.is_dir():
            return []
        out = []
        for p in self.root.iterdir():
            s = _step_of(p)
            if s is not None and p.is_dir() and self._complete_info(p) is not None:
                out.append((s, p))
        return sorted(out)

    def latest(self) -> Path | None:
        """The newest complete checkpoint, or None."""
        done = self.complete_steps()
        return done[-1][1] if done else None

    def resolve(self, resume: str | os.PathLike) -> Path | None:
        """``resume`` setting -> checkpoint dir: "auto" (newest complete, or None to start
        fresh), "never" (None), or a path that must be a complete checkpoint."""
        if resume == "never":
            return None
        if resume == "auto":
            return self.latest()
        path = Path(resume)
        self.check(path)
        return path

    def check(self, path: str | Path) -> dict:
        """The ``COMPLETE`` info of ``path``; ValueError saying what is missing if it is
        not a complete checkpoint."""
        path = Path(path)
        if not path.is_dir():
            raise ValueError(f"checkpoint {path} does not exist (or is not a directory)")
        info = self._complete_info(path)
        if info is None:
            hint = " (an unfinished save)" if path.name.endswith(".tmp") else ""
            raise ValueError(
                f"checkpoint {path} is not complete{hint}: its {COMPLETE} marker is missing "
                "or unreadable, so it may be partial and is never loaded"
            )
        need = [f"{SHARED}.safetensors", f"{SHARED}.json"]
        for r in range(int(info["world_size"])):
            need += [f"local_rank{r}.safetensors", f"local_rank{r}.json"]
        sizes = info.get("files", {})
        missing = [n for n in need if not (path / n).is_file()]
        wrong = [
            n
            for n, size in sizes.items()
            if (path / n).is_file() and (path / n).stat().st_size != size
        ]
        if missing or wrong:
            raise ValueError(
                f"checkpoint {path} is damaged: missing {missing or 'nothing'}, "
                f"size differs from {COMPLETE} for {wrong or 'nothing'}"
            )
        return info

    # ------------------------------------------------------------------ load
    def load(self, path: str | Path | None = None, rank: int | None = None) -> tuple[Any, Any]:
        """``(shared, local)`` of a complete checkpoint (default: the newest) for ``rank``
        (default: this one). Reads safetensors and JSON only."""
        path = self.latest() if path is None else Path(path)
        if path is None:
            raise FileNotFoundError(f"no complete checkpoint under {self.root}")
        rank = self.rank if rank is None else rank
        info = self.check(path)
        saved = int(info["world_size"])
        if saved != self.world_size:
            raise ValueError(
                f"checkpoint {path} was written by {saved} controller(s) but this run has "
                f"{self.world_size}; resuming with a different number of controllers is not "
                "supported (each controller's data cursor and RNG state belong to its own "
                f"shard). Restart with distributed.nproc={saved}, or start fresh."
            )
        return _read_part(path, SHARED), _read_part(path, f"local_rank{rank}")
