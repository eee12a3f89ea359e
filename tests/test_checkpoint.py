import json
import math
import os
import pickle
import random
import signal
import subprocess
import sys
import threading
from datetime import timedelta
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as tdist
import torch.multiprocessing as mp
from torch import nn

import mmyatt.checkpoint.checkpointer as ckpt
from mmyatt.checkpoint.checkpointer import (
    Checkpointer,
    flatten_state,
    load_optimizer_state,
    load_scheduler_state,
    optimizer_state,
    rng_state,
    scheduler_state,
    set_rng_state,
    unflatten_state,
)
from mmyatt.distributed import free_port

REPO = Path(__file__).resolve().parents[1]


def same(a, b, path="") -> None:
    """Exact equality including container, key and scalar types."""
    assert type(a) is type(b), f"{path}: {type(a)} != {type(b)}"
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape, path
        assert torch.equal(a, b), path
    elif isinstance(a, dict):
        assert len(a) == len(b), path
        for (ka, va), (kb, vb) in zip(a.items(), b.items()):
            assert type(ka) is type(kb) and ka == kb, f"{path}: key {ka!r} != {kb!r}"
            same(va, vb, f"{path}/{ka!r}")
    elif isinstance(a, list | tuple):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            same(x, y, f"{path}/{i}")
    elif isinstance(a, float) and math.isnan(a):
        assert math.isnan(b), path
    else:
        assert a == b and repr(a) == repr(b), f"{path}: {a!r} != {b!r}"


def sample_tree() -> dict:
    g = torch.Generator().manual_seed(0)
    base = torch.randn(2, 3, generator=g)
    tied = torch.randn(3, generator=g)
    return {
        "state": {
            0: {"step": torch.tensor(3.0), "exp_avg": torch.randn(3, 2, generator=g)},
            1: {},
        },
        "param_groups": [
            {"params": [0, 1], "betas": (0.9, 0.999), "lr": 1e-3, "fused": None, "amsgrad": False}
        ],
        "bf16": torch.randn(4, 3, generator=g).to(torch.bfloat16),
        "u8": torch.get_rng_state(),
        "i64": torch.arange(5),
        "bool": torch.tensor([True, False]),
        "empty": torch.zeros(0, 3),
        "noncontig": torch.randn(4, 5, generator=g).t(),
        "view_a": base[0],
        "view_b": base[1],
        "tied_a": tied,
        "tied_b": tied,
        "scalars": [1, -(2**70), 0.1, -0.0, float("inf"), float("-inf"), "s", None, True],
        "nested": ((1, (2, [3])), [], ()),
        "odd_keys": {(1, "a"): "x", None: 1, 2.5: 2, "s": 3, -4: [4]},
        "tag_like": {"__tensor__": "not a tensor"},
        "tag_like2": {"__tuple__": [1, 2]},
    }


def test_flatten_roundtrip_exact_in_memory_and_through_files(tmp_path):
    tree = sample_tree()
    tensors, meta = flatten_state(tree)
    json.dumps(meta, allow_nan=False)  # strictly JSON
    out = unflatten_state(tensors, json.loads(json.dumps(meta)))
    same(tree, out)
    assert out["tied_a"] is out["tied_b"]
    for mode in (False, True):
        ck = Checkpointer(tmp_path / str(mode), async_save=mode)
        ck.save(1, tree, {"nan": float("nan"), "t": torch.ones(2, dtype=torch.uint8)})
        ck.close()
        shared, local = ck.load(ck.latest())
        same(tree, shared)
        assert math.isnan(local["nan"]) and local["t"].dtype == torch.uint8
        assert shared["tied_a"] is shared["tied_b"]


def test_arbitrary_objects_are_refused_with_their_key_path():
    with pytest.raises(TypeError, match="a/b/1"):
        flatten_state({"a": {"b": [1, object()]}})
    with pytest.raises(TypeError, match="ndarray.*'x'"):
        flatten_state({"x": np.zeros(3)})
    with pytest.raises(TypeError, match="dict key"):
        flatten_state({"a": {object(): 1}})
    with pytest.raises(TypeError, match="function"):
        flatten_state({"fn": lambda s: s})


def test_load_never_unpickles(tmp_path, monkeypatch):
    ck = Checkpointer(tmp_path, async_save=False)
    tree = sample_tree()
    ck.save(1, tree, {"rng": rng_state()})

    def boom(*a, **k):
        raise AssertionError("checkpoint loading must not unpickle")

    for name in ("load", "loads", "Unpickler", "_Unpickler"):
        monkeypatch.setattr(pickle, name, boom)
    monkeypatch.setattr(torch, "load", boom)
    shared, local = Checkpointer(tmp_path, clean_stale=False).load(ck.latest())
    same(tree, shared)
    assert local["rng"]["torch"].dtype == torch.uint8


def _draws():
    return (
        torch.rand(4),
        torch.randn(2),
        random.random(),
        random.gauss(0, 1),
        np.random.rand(3),
        np.random.standard_normal(),
    )


def test_rng_roundtrip_reproduces_draws(tmp_path):
    torch.manual_seed(1)
    random.seed(2)
    np.random.seed(3)
    random.gauss(0, 1)  # leaves a cached gaussian in both generators
    np.random.standard_normal()
    ck = Checkpointer(tmp_path, async_save=True)
    ck.save(1, {}, {"rng": rng_state()})
    ck.wait()
    first = _draws()
    _draws()  # move every generator on
    _, local = ck.load(ck.latest())
    set_rng_state(local["rng"])
    again = _draws()
    for a, b in zip(first, again):
        if isinstance(a, torch.Tensor):
            assert torch.equal(a, b)
        else:
            assert np.array_equal(a, b)


class _Schedule:
    def __init__(self, total):
        self.total = total
        self.lock = threading.Lock()  # not checkpointable; never needs to be

    def factor(self, step):
        warm = min(1.0, (step + 1) / 3)
        return warm * 0.5 * (1 + math.cos(math.pi * min(step / self.total, 1.0)))


class _Decay:  # a callable object: LambdaLR saves its __dict__
    def __init__(self):
        self.rate = 0.9
        self.lock = threading.Lock()

    def __call__(self, step):
        return self.rate**step


def _make_trainer(seed):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    opt = torch.optim.AdamW(
        [
            {"params": model[0].parameters()},
            {"params": model[2].parameters(), "lr": 3e-3},
        ],
        lr=1e-2,
        weight_decay=0.1,
    )
    sched = torch.optim.lr_scheduler.LambdaLR(opt, [_Schedule(10).factor, _Decay()])
    return model, opt, sched


def _train_step(model, opt, sched):
    x, y = torch.randn(16, 8), torch.randn(16, 1)
    scale = 1 + 0.1 * random.random() + 0.1 * float(np.random.rand())
    loss = ((model(x) - y) ** 2).mean() * scale
    loss.backward()
    opt.step()
    sched.step()
    opt.zero_grad(set_to_none=True)
    return loss.item(), sched.get_last_lr()


def _seed_all(s):
    torch.manual_seed(s)
    random.seed(s)
    np.random.seed(s)


def test_adamw_lambdalr_resume_is_bitwise_exact(tmp_path):
    n, k = 7, 3
    _seed_all(0)
    model, opt, sched = _make_trainer(0)
    ref = [_train_step(model, opt, sched) for _ in range(n)]
    ref_params = [p.detach().clone() for p in model.parameters()]

    _seed_all(0)
    model, opt, sched = _make_trainer(0)
    for _ in range(k):
        _train_step(model, opt, sched)
    ck = Checkpointer(tmp_path, async_save=True)
    shared = {
        "model": model.state_dict(),
        "optimizer": optimizer_state(opt),
        "scheduler": scheduler_state(sched),
        "step": k,
    }
    ck.save(k, shared, {"rng": rng_state()})
    ck.close()
    del model, opt, sched

    _seed_all(99)  # a fresh process: other init, other RNG
    model, opt, sched = _make_trainer(1)
    shared, local = Checkpointer(tmp_path, clean_stale=False).load(ck.resolve("auto"))
    model.load_state_dict(shared["model"])
    load_optimizer_state(opt, shared["optimizer"])
    load_scheduler_state(sched, shared["scheduler"])
    set_rng_state(local["rng"])
    assert shared["step"] == k
    rest = [_train_step(model, opt, sched) for _ in range(n - k)]
    assert rest == ref[k:]  # losses and learning rates, bitwise
    for a, b in zip(ref_params, model.parameters()):
        assert torch.equal(a, b)


def test_async_snapshot_equals_sync_and_survives_later_updates(tmp_path):
    g = torch.Generator().manual_seed(0)
    live = {"w": torch.randn(256, 256, generator=g), "b": torch.randn(256, generator=g)}
    frozen = {k: v.clone() for k, v in live.items()}
    sync = Checkpointer(tmp_path / "sync", async_save=False)
    sync.save(1, {"model": frozen, "step": 1}, {"cursor": 5})
    asy = Checkpointer(tmp_path / "async", async_save=True)
    asy.save(1, {"model": live, "step": 1}, {"cursor": 5})
    for v in live.values():  # training goes on while the writer runs
        v.add_(1.0)
    asy.save(2, {"model": live, "step": 2}, {"cursor": 6})  # reuses the staging buffers
    asy.close()
    for name in ("shared.safetensors", "shared.json", "local_rank0.safetensors"):
        a = (tmp_path / "sync" / "step_00000001" / name).read_bytes()
        assert a == (tmp_path / "async" / "step_00000001" / name).read_bytes()
    s1, _ = asy.load(tmp_path / "async" / "step_00000001")
    s2, l2 = asy.load()
    same(s1["model"], frozen)
    same(s2["model"], live)
    assert l2 == {"cursor": 6}


def test_incomplete_dirs_are_ignored_and_refused(tmp_path):
    ck = Checkpointer(tmp_path, async_save=False)
    ck.save(2, {"x": torch.ones(2)}, {})
    tmp = tmp_path / "step_00000005.tmp"
    tmp.mkdir()
    (tmp / "shared.json").write_text("{")
    nomark = tmp_path / "step_00000007"
    nomark.mkdir()
    assert ck.latest() == tmp_path / "step_00000002"
    for p in (tmp, nomark):
        with pytest.raises(ValueError, match="COMPLETE"):
            ck.load(p)
        with pytest.raises(ValueError, match=str(p.name)):
            ck.resolve(str(p))


_CHILD = r"""
import sys, time, torch
import mmyatt.checkpoint.checkpointer as ckpt
root = sys.argv[1]
ck = ckpt.Checkpointer(root, keep_last=2)
real = ckpt._write_text
for step in range(1, 4):
    if step == 3:  # hang just before the completion marker of step 3
        def slow(path, text):
            if path.name == "COMPLETE":
                print("completing", flush=True)
                time.sleep(60)
            real(path, text)
        ckpt._write_text = slow
    shared = {"w": torch.full((500_000,), float(step)), "step": step}
    ck.save(step, shared, {"v": torch.full((10,), float(step))})
    ck.wait()
    print("done", step, flush=True)
"""


def test_sigkill_mid_save_resumes_from_last_complete(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    proc = subprocess.Popen(
        [sys.executable, "-c", _CHILD, str(tmp_path)], stdout=subprocess.PIPE, text=True, env=env
    )
    try:
        lines = []
        for line in proc.stdout:
            lines.append(line.strip())
            if line.strip() == "completing":
                break
        assert lines == ["done 1", "done 2", "completing"], lines
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait(timeout=30)
    partial = tmp_path / "step_00000003.tmp"
    assert (partial / "rank0.done").exists() and not (partial / "COMPLETE").exists()
    ck = Checkpointer(tmp_path, clean_stale=False)
    assert ck.latest() == tmp_path / "step_00000002"
    with pytest.raises(ValueError, match="COMPLETE"):
        ck.load(partial)
    shared, local = ck.load(ck.resolve("auto"))
    assert shared["step"] == 2 and bool((shared["w"] == 2.0).all())
    assert bool((local["v"] == 2.0).all())
    # the restarted run clears the leftovers and saves step 3 again
    ck = Checkpointer(tmp_path, async_save=False)
    assert not partial.exists()
    ck.save(3, {"w": torch.zeros(2), "step": 3}, {})
    assert ck.latest() == tmp_path / "step_00000003"


def test_retention_keeps_last_k_plus_every_m(tmp_path):
    ck = Checkpointer(tmp_path, async_save=False, keep_last=2, keep_every=3)
    for step in range(1, 11):
        if step == 6:
            (tmp_path / "step_00000004.tmp").mkdir()  # stale: older than newest complete
            (tmp_path / "step_00000099.tmp").mkdir()  # newer: may be another rank writing
        ck.save(step, {"step": step}, {})
    assert [s for s, _ in ck.complete_steps()] == [3, 6, 9, 10]
    assert not (tmp_path / "step_00000004.tmp").exists()
    assert (tmp_path / "step_00000099.tmp").exists()
    assert not list(tmp_path.glob("*.deleting"))
    ck1 = Checkpointer(tmp_path / "one", async_save=True, keep_last=1)
    for step in range(1, 4):
        ck1.save(step, {"step": step}, {})
    ck1.close()
    assert [s for s, _ in ck1.complete_steps()] == [3]


def test_resolve(tmp_path):
    ck = Checkpointer(tmp_path, async_save=False)
    assert ck.resolve("auto") is None and ck.resolve("never") is None
    ck.save(1, {"x": 1}, {})
    ck.save(2, {"x": 2}, {})
    assert ck.resolve("auto") == tmp_path / "step_00000002"
    assert ck.resolve("never") is None
    assert ck.resolve(str(tmp_path / "step_00000001")) == tmp_path / "step_00000001"
    with pytest.raises(ValueError, match="does not exist"):
        ck.resolve(str(tmp_path / "nope"))
    (tmp_path / "step_00000001" / "local_rank0.json").unlink()
    with pytest.raises(ValueError, match="step_00000001.*local_rank0.json"):
        ck.resolve(str(tmp_path / "step_00000001"))


def _rank_body(rank, world, port, root):
    tdist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=60),
    )
    try:
        ck = Checkpointer(root, rank=rank, world_size=world, keep_last=1, barrier=tdist.barrier)
        for step in (1, 2):
            w = torch.full((4,), float(step))
            tdist.all_reduce(w)  # identical on every rank, like summed-gradient training
            local = {"rank": rank, "x": torch.full((3,), float(10 * rank + step))}
            ck.save(step, {"w": w, "step": step}, local)
        ck.close()
        tdist.barrier()  # rank 0's close() returned: step 2 is complete
        shared, local = ck.load(ck.resolve("auto"))
        assert local["rank"] == rank and torch.equal(local["x"], torch.full((3,), 10.0 * rank + 2))
        assert torch.equal(shared["w"], torch.full((4,), 4.0))
    finally:
        tdist.destroy_process_group()


def _spawned_rank(i, world, port, root):
    torch.set_num_threads(1)
    _rank_body(i + 1, world, port, root)


def test_two_ranks_gloo(tmp_path):
    # rank 1 is a spawned process, rank 0 is this one (one torch import less to wait for)
    root, port = tmp_path / "ck", free_port()
    ctx = mp.start_processes(
        _spawned_rank, args=(2, port, str(root)), nprocs=1, start_method="spawn", join=False
    )
    try:
        _rank_body(0, 2, port, str(root))
        while not ctx.join(timeout=60):
            pass
    finally:
        for proc in ctx.processes:
            if proc.is_alive():
                proc.kill()
    assert sorted(p.name for p in root.iterdir()) == ["step_00000002"]
    d = root / "step_00000002"
    assert sorted(p.name for p in d.iterdir()) == [
        "COMPLETE",
        "local_rank0.json",
        "local_rank0.safetensors",
        "local_rank1.json",
        "local_rank1.safetensors",
        "rank0.done",
        "rank1.done",
        "shared.json",
        "shared.safetensors",
    ]
    info = json.loads((d / "COMPLETE").read_text())
    assert info["step"] == 2 and info["world_size"] == 2
    _, local = Checkpointer(root, rank=1, world_size=2, clean_stale=False).load(d)
    assert local["rank"] == 1
    with pytest.raises(ValueError, match=r"2 controller\(s\).*has 1.*not supported"):
        Checkpointer(root, clean_stale=False).load(d)


def test_missing_rank_times_out_and_nothing_is_complete(tmp_path):
    ck = Checkpointer(tmp_path, world_size=2, done_timeout_s=0.2)
    ck.save(1, {"x": 1}, {})
    with pytest.raises(TimeoutError, match=r"rank\(s\) \[1\]"):
        ck.wait()
    assert ck.latest() is None


def test_background_error_is_raised_at_wait_and_next_save(tmp_path, monkeypatch):
    real = ckpt.save_file

    def full(*a, **k):
        raise OSError("disk full (test)")

    ck = Checkpointer(tmp_path, async_save=True)
    monkeypatch.setattr(ckpt, "save_file", full)
    ck.save(1, {"x": torch.ones(2)}, {})
    with pytest.raises(OSError, match="disk full"):
        ck.wait()
    ck.save(2, {"x": torch.ones(2)}, {})
    with pytest.raises(OSError, match="disk full"):
        ck.save(3, {"x": torch.ones(2)}, {})  # raises step 2's error, starts nothing
    monkeypatch.setattr(ckpt, "save_file", real)
    ck.save(3, {"x": torch.ones(2)}, {})
    ck.close()
    assert ck.latest() == tmp_path / "step_00000003"


def test_quick_bench_reports_keys(tmp_path):
    from mmyatt.bench.checkpoint import bench_checkpoint

    out = bench_checkpoint(quick=True, root=tmp_path)
    for key in ("sync_save_s", "async_stall_s", "async_complete_s", "async_over_sync_stall"):
        assert out[key] > 0
    assert out["resume_s"] > 0 and out["resume_exact"] is True
    assert out["params"] > 0 and out["checkpoint_bytes"] > 0
    assert list(tmp_path.iterdir()) == []
