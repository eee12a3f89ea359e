"""Process-group set-up under torchrun's elastic restarts."""

from __future__ import annotations

from datetime import timedelta

import torch.distributed as dist

from mmyatt.distributed import attempt_store, free_port


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
