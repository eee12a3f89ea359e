"""Placement: mapping checks and their messages, the core pool, the judge's release.
Auto's choice on synthetic cost profiles: tests/test_placement_auto.py."""

from __future__ import annotations

import gc
import os

import pytest

from mmyatt.config.schema import ConfigError, RunConfig, apply_override, build, load_config
from mmyatt.placement import resources as res
from mmyatt.placement.config import check_placement, make_plan

JUDGE = [
    "reward.functions=[{name: genrm}]",
    "reward.judge.model=/some/judge",
]


def check(overrides, cores=(0, 1)):
    """Build the config without load_config's own check (which looks at this machine's
    cores), then check placement against a machine with ``cores``."""
    tree: dict = {}
    for o in overrides:
        apply_override(tree, o)
    c = build(RunConfig, tree)
    check_placement(c, available=list(cores))
    return c


def test_shared_is_the_default_and_pins_nothing():
    assert load_config(None, []).placement.mode == "shared"
    with pytest.raises(ConfigError, match="placement.mode=shared pins nothing"):
        check(["placement.cores=[0]"])


def test_more_cores_than_exist_is_refused_with_the_cores_named():
    with pytest.raises(ConfigError, match=r"names core\(s\) \[2\].*cores \[0, 1\].*more cores"):
        check(["placement.mode=colocate", "placement.cores=[0, 1, 2]"])
    with pytest.raises(
        ConfigError, match=r"rollout_cores \(2\) \+ placement.judge_cores \(1\) = 3"
    ):
        check(
            [
                *JUDGE,
                "placement.mode=partial",
                "placement.rollout_cores=2",
                "placement.judge_cores=1",
            ]
        )


def test_partial_that_leaves_the_judge_or_rollout_nothing_is_refused():
    with pytest.raises(ConfigError, match="gives the judge nothing: rollout_cores=2 takes all 2"):
        check([*JUDGE, "placement.mode=partial", "placement.rollout_cores=2"])
    with pytest.raises(ConfigError, match="gives rollout nothing: judge_cores=2"):
        check([*JUDGE, "placement.mode=partial", "placement.judge_cores=2"])
    with pytest.raises(ConfigError, match="needs at least 2 cores, the run has 1"):
        check([*JUDGE, "placement.mode=partial"], cores=(0,))


def test_partial_needs_a_judge_started_with_the_run_and_no_batch_zscore():
    with pytest.raises(ConfigError, match="judge must be started with the run"):
        check(
            [
                "reward.functions=[{name: genrm}]",
                "reward.judge.urls=[http://127.0.0.1:9]",
                "placement.mode=partial",
            ]
        )
    with pytest.raises(ConfigError, match=r"zscore.*whole batch"):
        check(
            [
                *JUDGE,
                "reward.functions=[{name: genrm, zscore: true}]",
                "placement.mode=partial",
            ]
        )


def test_a_valid_split_and_its_plan():
    c = check([*JUDGE, "placement.mode=partial", "placement.cores=[0, 1]"])
    assert c.placement.mode == "partial"
    plan = make_plan("partial", (0, 1, 2, 3), 3, 1)
    assert plan.rollout == (0, 1, 2) and plan.judge == (3,) and plan.train == (0, 1, 2, 3)
    assert plan.split == "3:1"
    colo = make_plan("colocate", (0, 1))
    assert colo.rollout == colo.judge == colo.train == (0, 1)


def test_load_config_checks_placement_before_anything_starts():
    n = len(os.sched_getaffinity(0))
    with pytest.raises(ConfigError, match="more cores than exist"):
        load_config(None, ["placement.mode=colocate", f"placement.cores={list(range(n + 1))}"])


def test_pin_process_moves_every_thread_and_sets_threads():
    import threading

    import torch

    before, threads = sorted(os.sched_getaffinity(0)), torch.get_num_threads()
    stop = threading.Event()
    t = threading.Thread(target=stop.wait)
    t.start()
    try:
        one = before[:1]
        assert res.use_cores(one, sharers=1) == 1
        tid = t.native_id
        assert sorted(os.sched_getaffinity(tid)) == one  # a thread that already existed
        assert torch.get_num_threads() == 1
    finally:
        stop.set()
        t.join()
        res.pin_process(before)
        torch.set_num_threads(threads)
    assert sorted(os.sched_getaffinity(0)) == before


def test_a_judge_without_placement_routes_keeps_shared_running_and_fails_pinning_clearly():
    import http.server
    import threading

    from mmyatt.placement.judges import JudgeControl

    class NotFound(http.server.BaseHTTPRequestHandler):  # e.g. `vllm serve`: no such routes
        def do_GET(self):  # noqa: N802
            self.send_response(404)
            self.end_headers()

        do_POST = do_GET  # noqa: N815

        def log_message(self, *args):
            pass

    srv = http.server.HTTPServer(("127.0.0.1", 0), NotFound)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        jc = JudgeControl([f"http://127.0.0.1:{srv.server_port}/v1"])
        assert jc.stats()["model_time_s"] == 0.0 and not jc.readable
        jc.reset_peak()  # no error: shared mode just has no judge figures
        with pytest.raises(RuntimeError, match="does not take POST /mmyatt/placement"):
            jc.place([0], 1)
    finally:
        srv.shutdown()


def test_judge_sleep_gives_the_weights_memory_back_and_wake_reloads(tmp_path):
    """colocate's release on CPU: a ~97 MB judge's resident memory goes when its weights
    are dropped and comes back when they are reloaded (and used), the reload timed."""
    from mmyatt.placement.bench_memory import big_model
    from mmyatt.serving.server import JudgeServer

    path, params = big_model(tmp_path / "judge", seed=1)
    weights_mb = params * 4 / 2**20

    def touch(server):  # a forward reads every weight page; summing them does the same
        return float(sum(p.detach().double().sum() for p in server.model.model.parameters()))

    server = JudgeServer(str(path))
    try:
        before = touch(server)
        awake = res.rss_mb()
        server.batcher.sleep()
        assert server.model is None
        asleep = res.rss_mb()
        reload_s = server.batcher.wake()
        assert touch(server) == before  # the same weights, read back from disk
        again = res.rss_mb()
        # the first release froze what survived it (gc.freeze); the reloaded weights are
        # newer, so the second release still finds and frees them, and quickly
        sleep_s = server.batcher.sleep()
        asleep2 = res.rss_mb()
    finally:
        server.batcher.stop()
        gc.unfreeze()  # the rest of the test session collects as before
    assert reload_s > 0 and server.batcher.stats["reloads"] == 1
    assert awake - asleep > 0.8 * weights_mb, (awake, asleep, weights_mb)
    assert again - asleep > 0.8 * weights_mb, (again, asleep, weights_mb)
    assert again - asleep2 > 0.8 * weights_mb, (again, asleep2, weights_mb)
    assert sleep_s < 0.1, sleep_s  # a full collection of pytest's heap takes longer


def test_a_settled_judge_pays_no_full_collection_at_its_first_release(tmp_path):
    """``Batcher.settle`` (run by every served judge before it serves): the first release
    is as fast as later ones and still gives the weights' memory back; settling counts
    as neither a release nor a reload."""
    from mmyatt.placement.bench_memory import big_model
    from mmyatt.serving.server import JudgeServer

    path, params = big_model(tmp_path / "judge", seed=1)
    weights_mb = params * 4 / 2**20
    server = JudgeServer(str(path))
    try:
        assert server.batcher.settle() > 0
        float(sum(p.detach().double().sum() for p in server.model.model.parameters()))
        awake = res.rss_mb()
        sleep_s = server.batcher.sleep()
        asleep = res.rss_mb()
        stats = dict(server.batcher.stats)
    finally:
        server.batcher.stop()
        gc.unfreeze()  # the rest of the test session collects as before
    assert sleep_s < 0.1, sleep_s  # a full collection of pytest's heap takes longer
    assert awake - asleep > 0.8 * weights_mb, (awake, asleep, weights_mb)
    assert stats["sleeps"] == 1 and stats["reloads"] == 0


@pytest.mark.parametrize(
    "mode,release,partial_release,settle",
    [
        ("shared", True, False, False),
        ("partial", True, False, False),
        ("colocate", True, False, True),
        ("auto", True, False, True),
        ("colocate", False, False, False),
        ("partial", True, True, True),  # placement.partial_release_judge
        ("auto", False, True, True),
    ],
)
def test_the_run_settles_its_judge_only_where_placement_releases_it(
    monkeypatch, tmp_path, mode, release, partial_release, settle
):
    """A settled judge pays one extra load at start (seconds for a large judge), so the
    run asks for it only where the judge will be released between phases."""
    from mmyatt.config.schema import load_config
    from mmyatt.step import prepare

    seen = {}

    class Pool:
        def __init__(self, model, n, **kw):
            seen.update(kw)
            self.urls = ["http://127.0.0.1:1/v1"]

    monkeypatch.setattr(prepare, "JudgePool", Pool)  # the name the run starts its judges with
    (tmp_path / "judge").mkdir()
    cfg = load_config(
        None,
        [
            f"reward.judge.model={tmp_path / 'judge'}",
            f"placement.mode={mode}",
            f"placement.release_judge={str(release).lower()}",
            f"placement.partial_release_judge={str(partial_release).lower()}",
            "reward.functions=[{name: genrm}]",
        ],
    )
    prepare.start_judges(cfg, tmp_path)
    assert seen["settle"] is settle


def test_device_memory_figures_read_the_cuda_allocator_and_release_empties_its_cache(
    monkeypatch,
):
    """On CUDA the release hands the allocator's cache back to the device and the figures
    sum every device's reserved bytes (a stand-in ``torch.cuda`` with two devices); where
    nothing was put on a device they are 0 and nothing is called."""
    import torch

    calls = []
    fake = {
        "is_available": lambda: True,
        "is_initialized": lambda: True,
        "device_count": lambda: 2,
        "empty_cache": lambda: calls.append("empty"),
        "memory_reserved": lambda d: (d + 1) * 2**20,
        "max_memory_reserved": lambda d: (d + 3) * 2**20,
        "reset_peak_memory_stats": lambda d: calls.append(f"reset{d}"),
    }
    with monkeypatch.context() as m:
        m.setattr(torch.cuda, "is_initialized", lambda: False)
        res.release_free_memory()
        res.reset_device_peak()
        assert res.device_mb() == res.device_peak_mb() == 0.0 and calls == []
    for name, fn in fake.items():
        monkeypatch.setattr(torch.cuda, name, fn)
    res.release_free_memory()
    res.reset_device_peak()
    assert calls == ["empty", "reset0", "reset1"]
    assert res.device_mb() == 3.0 and res.device_peak_mb() == 7.0


def test_work_key_changes_with_the_work_not_with_budgets_or_how_auto_chooses():
    from mmyatt.placement.config import work_key

    base = work_key(load_config(None, []))
    for same in ("trainer.steps=7", "placement.reevaluate_every=3", "placement.mode=auto"):
        assert work_key(load_config(None, [same])) == base, same
    for other in ("sampling.max_new_tokens=64", "data.prompts_per_step=3", "trainer.threads=2"):
        assert work_key(load_config(None, [other])) != base, other


def test_partial_release_judge_needs_partial_steps_and_a_judge():
    with pytest.raises(ConfigError, match="placement.mode=colocate has none: use partial or auto"):
        check([*JUDGE, "placement.mode=colocate", "placement.partial_release_judge=true"])
    with pytest.raises(ConfigError, match="no reward.functions entry is genrm"):
        check(["placement.mode=partial", "placement.partial_release_judge=true"])
    for mode in ("partial", "auto"):
        check([*JUDGE, f"placement.mode={mode}", "placement.partial_release_judge=true"])


def test_a_judge_that_cannot_release_is_reported_once_and_kept_loaded(caplog):
    """A server without /sleep (e.g. `vllm serve` without its sleep mode): the first
    release reports it, and later releases and wakes make no call and cost nothing."""
    import threading
    from http.server import BaseHTTPRequestHandler, HTTPServer

    from mmyatt.placement.judges import JudgeControl

    paths: list[str] = []

    class NoSleep(BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802 (the http.server name)
            paths.append(self.path)
            self.send_response(404)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = HTTPServer(("127.0.0.1", 0), NoSleep)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        control = JudgeControl([f"http://127.0.0.1:{server.server_port}/v1"])
        assert control.sleep() == 0.0 and control.can_release is False
        assert control.sleep() == 0.0 and control.wake() == 0.0
    finally:
        server.shutdown()
    assert paths == ["/sleep"]  # one call: the refusal is remembered
    err = caplog.text
    assert err.count("cannot release its weights (HTTP 404)") == 1
    assert "the run keeps them loaded (colocate, partial_release_judge)" in err
