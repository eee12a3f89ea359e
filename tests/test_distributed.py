"""Process-group set-up: torchrun's elastic restarts, and which device each controller uses."""

from __future__ import annotations

import logging
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

import mmyatt.distributed as distributed
from mmyatt.distributed import (
    attempt_store,
    free_port,
    init_from_env,
    select_backend,
    select_device,
)


def test_each_restart_attempt_meets_in_its_own_store_keys(monkeypatch):
    port = free_port()
    agent = dist.TCPStore("127.0.0.1", port, 1, is_master=True, timeout=timedelta(seconds=10))
    agent.set("rank_0", "address of the dead attempt")  # what a dead group left behind
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")  # torchrun's c10d default
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    store = attempt_store(rank=0, world=1)
    assert not store.check(["rank_0"])  # the old key is not visible to attempt 1
    store.set("rank_0", "new address")
    assert agent.get("mmyatt/attempt_1/rank_0") == b"new address"
    assert agent.get("rank_0") == b"address of the dead attempt"


def test_no_store_of_our_own_outside_torchrun(monkeypatch):
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    assert attempt_store(rank=0, world=1) is None


# --------------------------------------------------------------------------- devices


@pytest.fixture
def gpus(monkeypatch):
    """Pretend this machine has ``n`` CUDA devices (0: none); set_device is recorded."""
    chosen: list[torch.device] = []

    def have(n: int) -> list[torch.device]:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: n > 0)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: n)
        monkeypatch.setattr(torch.cuda, "set_device", lambda d: chosen.append(torch.device(d)))
        return chosen

    for key in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setattr(distributed, "_announced", [])  # each test sees the start-up line
    return have


def test_auto_puts_one_controller_on_the_gpu(gpus, caplog):
    chosen = gpus(1)
    with caplog.at_level(logging.INFO, logger="mmyatt"):
        d = init_from_env()
    assert (d.rank, d.world_size, d.device) == (0, 1, torch.device("cuda:0"))
    assert chosen == [torch.device("cuda:0")]
    assert "[device] controller 0 of 1 on cuda:0" in caplog.text


def test_auto_without_cuda_is_the_cpu(gpus):
    gpus(0)
    assert init_from_env(device="auto").device == torch.device("cpu")
    assert select_device("auto", local_rank=3) == "cpu"


def test_cpu_forces_the_cpu_on_a_gpu_machine(gpus):
    chosen = gpus(2)
    assert init_from_env(device="cpu").device == torch.device("cpu")
    assert chosen == []
    assert select_backend("auto", "cpu") == "gloo"


def test_cuda_without_cuda_fails_naming_the_setting(gpus):
    gpus(0)
    with pytest.raises(RuntimeError, match=r"distributed\.device=cuda"):
        init_from_env(device="cuda")


def test_each_controller_takes_the_gpu_of_its_local_rank(gpus):
    gpus(2)
    assert select_device("auto", local_rank=1) == "cuda:1"
    assert select_device("cuda", local_rank=0) == "cuda:0"
    with pytest.raises(RuntimeError, match=r"local rank 2.*2 CUDA device"):
        select_device("auto", local_rank=2)
    with pytest.raises(ValueError, match=r"distributed\.device"):
        select_device("gpu")


def test_backend_follows_the_device():
    assert select_backend("auto", "cuda:0") == "nccl"
    assert select_backend("auto", "cpu") == "gloo"
    assert select_backend("gloo", "cuda:1") == "gloo"  # an explicit choice stands
    with pytest.raises(RuntimeError, match=r"distributed\.backend=nccl"):
        select_backend("nccl", "cpu")


def test_a_group_on_cuda_is_initialised_with_nccl(gpus, monkeypatch):
    chosen = gpus(2)
    seen = {}
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", lambda backend, **kw: seen.update(b=backend))
    monkeypatch.setattr(dist, "get_backend", lambda: seen["b"])
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("LOCAL_RANK", "1")
    d = init_from_env("auto", device="auto")
    assert seen == {"b": "nccl"} and d.backend == "nccl"
    assert (d.rank, d.world_size, d.device) == (1, 2, torch.device("cuda:1"))
    assert chosen == [torch.device("cuda:1")]
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("LOCAL_RANK", "0")
    d = init_from_env("auto", device="cpu")
    assert seen == {"b": "gloo"} and d.device == torch.device("cpu")
