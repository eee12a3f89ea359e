"""Faults in real runs: a judge that stays down past the retry budget stops the run with
an error naming it, after a checkpoint a rerun resumes from exactly; a VLM manifest's
missing or corrupt images are bad records (skipped and counted, or an error naming
manifest line and file). The full suite is `mmyatt bench faults`."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from PIL import Image
from test_cli import ROOT, TINY
from test_genrm import FakeJudge
from test_resume import CFG, assert_same_run

from mmyatt.serving.server import JudgeServer

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def _start(tmp_path: Path, *args: str):
    import os
    import subprocess
    import sys

    (tmp_path / "lenreward.py").write_text(
        "def reward(completion, record):\n    return len(completion) / 10.0\n"
    )
    env = dict(os.environ, PYTHONPATH=str(tmp_path), OMP_NUM_THREADS="1")
    log = open(tmp_path / f"{len(list(tmp_path.glob('*.log')))}.log", "w+")
    cmd = [sys.executable, "-m", "mmyatt", "train", CFG, *args]
    return subprocess.Popen(cmd, env=env, cwd=tmp_path, stdout=log, stderr=subprocess.STDOUT), log


def _logged(run: Path, step: int) -> bool:
    p = run / "metrics.jsonl"
    return p.exists() and any(
        json.loads(x).get("step") == step and "reward/mean" in json.loads(x)
        for x in p.read_text().splitlines()
        if x.strip()
    )


def test_judge_gone_past_the_budget_checkpoints_names_the_url_and_resumes_exactly(tmp_path):
    server = JudgeServer(FakeJudge()).start()
    port, url = server.port, server.url
    genrm = "{name: genrm, kwargs: {mode: yes_prob, template: yes_no_correct}}"
    args = [
        *TINY,
        "trainer.steps=4",
        "trainer.progress=false",
        "distributed.nproc=1",
        "checkpoint.save_every=0",  # the only checkpoint is the one taken on the way out
        f"reward.functions=[{genrm}, {{name: 'lenreward:reward'}}]",
        f"reward.judge.urls=[{url}]",
        "reward.judge.max_retries=2",
    ]
    try:
        ref, run = tmp_path / "ref", tmp_path / "run"
        proc, _ = _start(tmp_path, *args, "--run-dir", str(ref))
        assert proc.wait(timeout=300) == 0
        proc, log = _start(tmp_path, *args, "--run-dir", str(run))
        deadline = time.monotonic() + 300
        while not _logged(run, 2) and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)
        server.stop()  # the judge is gone for good
        rc = proc.wait(timeout=300)
        log.seek(0)
        out = log.read()
        assert rc != 0
        assert "JudgeUnavailableError" in out and url in out, out[-3000:]
        state = run / "checkpoints" / "state"
        (ck,) = [p.parent for p in state.glob("step_*/COMPLETE")]
        step = int(ck.name[5:])
        assert step >= 2 and f"checkpoint of step {step} in {state}" in out
        assert not (run / "checkpoints" / "final").exists()
        server = JudgeServer(FakeJudge(), port=port).start()  # the judge is back
        proc, log = _start(tmp_path, *args, "--run-dir", str(run))
        assert proc.wait(timeout=300) == 0
        log.seek(0)
        assert f"continuing at step {step + 1}" in log.read()
        assert_same_run(ref, run)
        trace = [json.loads(x) for x in (run / "rollouts" / "records_rank0.jsonl").open()]
        ref_trace = [json.loads(x) for x in (ref / "rollouts" / "records_rank0.jsonl").open()]
        assert trace == ref_trace and [r["step"] for r in trace] == [1, 2, 3, 4]
    finally:
        server.stop()


def _vlm_manifest(tmp_path: Path) -> Path:
    (tmp_path / "images").mkdir()
    rows = []
    for i in range(6):
        Image.new("RGB", (8, 8), (i * 40, 0, 0)).save(tmp_path / "images" / f"{i}.png")
        rows.append({"prompt": f"colour {i}?", "answer": "red", "image": f"images/{i}.png"})
    (tmp_path / "images" / "1.png").write_bytes(b"\x89PNG\r\n\x1a\n garbage")
    (tmp_path / "images" / "4.png").unlink()
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.mark.parametrize("policy", ["skip", "fail"])
def test_vlm_records_with_missing_or_corrupt_images_are_bad_records(tmp_path, policy):
    from mmyatt.config.schema import load_config
    from mmyatt.datasets.manifest import ManifestError
    from mmyatt.step.builders import build_shard

    path = _vlm_manifest(tmp_path)
    cfg = load_config(
        str(ROOT / "configs" / "vlm_grpo_image_tiny.yaml"),
        [
            f"data.train={path}",
            f"data.eval={path}",
            "data.shuffle=false",
            f"data.bad_lines={policy}",
        ],
    )
    shard = build_shard(cfg, 0, 1)
    if policy == "fail":
        with pytest.raises(ManifestError) as info:
            shard.next_batch(4)
        message = str(info.value)
        assert message.startswith(f"{path}:2: ") and "1.png" in message
        return
    batch = shard.next_batch(4)
    assert [r["_index"] for r in batch] == [0, 2, 3, 5] and shard.num_skipped == 2
    assert all(isinstance(r["image"], Image.Image) for r in batch)  # decoded by the shard
