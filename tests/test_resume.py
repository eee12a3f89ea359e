"""Exact resume: a run stopped after step k and resumed reaches step n with the same
parameters and metrics (bitwise on CPU) as a run that never stopped."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from test_cli import ROOT, TINY, mmyatt

CFG = str(ROOT / "configs" / "text_grpo_tiny.yaml")


# the vLLM rollout engine's seconds (weight sync, sleep, wake), also the machine's
ENGINE_TIMES = ("rollout/weight_sync_s", "rollout/sleep_s", "rollout/wake_s", "sync/seconds")


def train_rows(run: Path) -> dict[int, dict]:
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    out = {}
    for r in rows:
        if "reward/mean" in r:
            out[r["step"]] = {
                k: v
                for k, v in r.items()
                # measurements of the machine, not of the run: they differ between runs
                if not k.startswith(
                    ("timing/", "perf/", "throughput/", "placement/", "dist/idle_s")
                )
                and k not in ENGINE_TIMES
            }
    return out


def assert_same_run(a: Path, b: Path) -> None:
    files = sorted(p.relative_to(a) for p in (a / "checkpoints" / "final").rglob("*.safetensors"))
    assert files
    for f in files:
        wa, wb = load_file(str(a / f)), load_file(str(b / f))
        assert wa.keys() == wb.keys()
        for k in wa:
            assert torch.equal(wa[k], wb[k]), (f, k)
    assert train_rows(a) == train_rows(b)


def stop_and_resume(tmp_path, *train_args, steps: int = 4, stop: int = 2):
    """``mmyatt train *train_args`` (a config path first) run ``steps`` steps uninterrupted
    (``tmp_path/full``), and ``stop`` steps then resumed to ``steps`` (``tmp_path/parts``);
    checks that the resume went on at step ``stop + 1``. Returns (full, parts, the resumed
    run's stdout)."""
    full, parts = tmp_path / "full", tmp_path / "parts"
    mmyatt(tmp_path, "train", *train_args, f"trainer.steps={steps}", "--run-dir", str(full))
    mmyatt(tmp_path, "train", *train_args, f"trainer.steps={stop}", "--run-dir", str(parts))
    out = mmyatt(tmp_path, "train", *train_args, f"trainer.steps={steps}", "--run-dir", str(parts))
    assert f"continuing at step {stop + 1}" in out.stdout
    return full, parts, out.stdout


def test_stop_and_resume_equals_uninterrupted(tmp_path):
    args = [*TINY, "distributed.nproc=2", "checkpoint.save_every=2", "data.shuffle=true"]
    full, parts, out = stop_and_resume(tmp_path, CFG, *args)
    assert "[resume]" in out
    assert_same_run(full, parts)
    assert sorted(train_rows(parts)) == [1, 2, 3, 4]


def test_sigterm_saves_then_exits_and_resumes(tmp_path):
    # the reward function sends SIGTERM to its own controller once, during step 2 (16 eval
    # prompts at step 0, then 16 samples per step: call 40 falls in step 2)
    (tmp_path / "termreward.py").write_text(
        "import os, signal\n"
        "from pathlib import Path\n"
        "calls = 0\n"
        "def reward(completion, record):\n"
        "    global calls\n"
        "    calls += 1\n"
        "    flag = Path(os.environ['TERM_FLAG'])\n"
        "    if calls == 40 and not flag.exists():\n"
        "        flag.write_text('sent')\n"
        "        os.kill(os.getpid(), signal.SIGTERM)\n"
        "    return len(completion) / 10.0\n"
    )
    import os

    os.environ["TERM_FLAG"] = str(tmp_path / "flag")
    try:
        args = [
            *TINY,
            "distributed.nproc=1",
            "trainer.steps=4",
            "reward.functions=[{name: 'termreward:reward'}]",
        ]
        a, b = tmp_path / "a", tmp_path / "b"
        (tmp_path / "flag").write_text("already")  # uninterrupted reference run
        mmyatt(tmp_path, "train", CFG, *args, "--run-dir", str(a))
        (tmp_path / "flag").unlink()
        out = mmyatt(tmp_path, "train", CFG, *args, "--run-dir", str(b))
        assert "SIGTERM: saved step 2" in out.stdout
        assert not (b / "checkpoints" / "final").exists()
        out = mmyatt(tmp_path, "train", CFG, *args, "--run-dir", str(b))
        assert "continuing at step 3" in out.stdout
        assert_same_run(a, b)
    finally:
        del os.environ["TERM_FLAG"]


@pytest.mark.parametrize(
    "recipe", ["flow_grpo_tiny.yaml", "vlm_grpo_image_tiny.yaml"], ids=["flow", "vlm"]
)
def test_exact_resume_flow_and_vlm(tmp_path, recipe):
    from test_recipes import RECIPES, SMALL

    cfg = str(ROOT / "configs" / recipe)
    args = [
        *SMALL,
        *RECIPES[recipe],
        "checkpoint.save_every=1",
        "distributed.nproc=2",
        "data.prompts_per_step=2",
    ]
    full, parts, _ = stop_and_resume(tmp_path, cfg, *args, steps=2, stop=1)
    assert_same_run(full, parts)
