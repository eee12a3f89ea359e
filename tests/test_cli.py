"""`mmyatt train` end to end on a tiny model: the run-directory contract, and two
controllers ending with the same parameters as one."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parent.parent

TINY = [
    "model.tiny_size=qwen2-0.1m",
    "data.synthetic_train_size=200",
    "data.synthetic_eval_size=16",
    "data.eval_prompts=16",
    "data.prompts_per_step=4",
    "sampling.group_size=4",
    "sampling.max_new_tokens=4",
    "algorithm.dynamic_sampling=false",
    "sft.enabled=false",
    "trainer.steps=2",
    "trainer.max_minutes=null",
    "trainer.save_rollouts_every=1",
    "trainer.progress=false",
    "optim.lr=0.01",
    "reward.functions=[{name: 'lenreward:reward'}]",
]


def mmyatt(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    (tmp_path / "lenreward.py").write_text(
        "def reward(completion, record):\n    return len(completion) / 10.0\n"
    )
    path = os.pathsep.join(p for p in (str(tmp_path), os.environ.get("PYTHONPATH")) if p)
    env = dict(os.environ, PYTHONPATH=path, OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, "-m", "mmyatt", *args],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=1200,  # a hung collective fails the test instead of the whole suite
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return proc


def weights(run: Path) -> dict[str, torch.Tensor]:
    return load_file(str(run / "checkpoints" / "final" / "model.safetensors"))


def test_two_controllers_match_one_and_write_the_run_contract(tmp_path):
    cfg = str(ROOT / "configs" / "text_grpo_tiny.yaml")
    one, two = tmp_path / "one", tmp_path / "two"
    mmyatt(tmp_path, "train", cfg, *TINY, "distributed.nproc=1", "--run-dir", str(one))
    out = mmyatt(tmp_path, "train", cfg, *TINY, "distributed.nproc=2", "--run-dir", str(two))
    assert "[summary]" in out.stdout

    # same data, same per-prompt seeds, global loss normalisation: same parameters, up to
    # the order of float sums (a group's prompt pass sums its samples' gradients, and each
    # controller sums its own share before the all-reduce). Adam at lr 0.01 turns that
    # rounding, on weights whose gradient is near zero (embedding rows of unused tokens),
    # into up to ~0.3% of one step (3.3e-5 seen): 1e-4 is 1% of a step, while a wrong
    # shard, seed or normalisation moves weights by whole steps (1e-2)
    w1, w2 = weights(one), weights(two)
    assert w1.keys() == w2.keys()
    for k in w1:
        torch.testing.assert_close(w1[k], w2[k], atol=1e-4, rtol=1e-5, msg=k)
    m1 = [json.loads(x) for x in (one / "metrics.jsonl").read_text().splitlines()]
    m2 = [json.loads(x) for x in (two / "metrics.jsonl").read_text().splitlines()]
    r1 = [r["reward/mean"] for r in m1 if "reward/mean" in r]
    r2 = [r["reward/mean"] for r in m2 if "reward/mean" in r]
    assert r1 == pytest.approx(r2, abs=1e-6)  # the same samples, step by step
    base = load_file(str(one / "base_model" / "model.safetensors"))
    assert any(not torch.equal(base[k], w1[k]) for k in w1), "training changed nothing"

    # the run directory contract
    assert (two / "config.yaml").exists()
    rows = [json.loads(x) for x in (two / "metrics.jsonl").read_text().splitlines()]
    assert all(next(iter(r)) == "step" for r in rows)
    train_rows = [r for r in rows if "reward/mean" in r]
    assert [r["step"] for r in train_rows] == [1, 2]
    for key in ("timing/generate_s", "timing/update_s", "throughput/tokens_per_s", "train/loss"):
        assert key in train_rows[0], key
    assert "eval/reward/mean" in rows[0] and "eval/reward/mean" in rows[-1]
    assert (two / "rollouts" / "rank0.jsonl").exists() and (
        two / "rollouts" / "rank1.jsonl"
    ).exists()
    assert list((two / "tensorboard").glob("events.*"))
    r1 = [
        r["reward/mean"]
        for r in (json.loads(x) for x in (one / "metrics.jsonl").read_text().splitlines())
        if "reward/mean" in r
    ]
    assert r1 == pytest.approx([r["reward/mean"] for r in train_rows])


def test_unknown_key_fails_before_start(tmp_path):
    env = dict(os.environ)
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "mmyatt",
            "train",
            str(ROOT / "configs" / "text_grpo_tiny.yaml"),
            "algorithm.kl_coeff=0.1",
            "--run-dir",
            str(tmp_path / "x"),
        ],
        capture_output=True,
        text=True,
        env=env,
    )
    assert proc.returncode == 2
    assert "algorithm.kl_coeff" in proc.stderr and "kl_coef" in proc.stderr
    assert not (tmp_path / "x").exists()


def _one_clean_line(err: str) -> str:
    lines = [x for x in err.splitlines() if x.strip()]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def test_user_errors_print_one_line_naming_file_line_or_key(tmp_path, capsys):
    from mmyatt.cli import main as cli

    cfg = str(ROOT / "configs" / "text_grpo_tiny.yaml")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "a", "answer": "1"}\n{not json\n')
    run = ["--run-dir", str(tmp_path / "r"), "trainer.steps=1"]
    assert cli.main(["train", cfg, f"data.train={bad}", f"data.eval={bad}", *run]) == 2
    line = _one_clean_line(capsys.readouterr().err)
    assert line.startswith("mmyatt: data error:") and f"{bad}:2: invalid JSON" in line
    assert cli.main(["train", cfg, f"data.train={bad}", *run]) == 2  # eval stays synthetic
    line = _one_clean_line(capsys.readouterr().err)
    assert "config error" in line and "data.train=" in line and "data.eval=" in line
    missing = tmp_path / "none.jsonl"
    assert cli.main(["train", cfg, f"data.train={missing}", f"data.eval={missing}", *run]) == 2
    assert str(missing) in _one_clean_line(capsys.readouterr().err)
    assert cli.main(["inspect", str(tmp_path / "no_such_run")]) == 2
    assert "no_such_run" in _one_clean_line(capsys.readouterr().err)
    assert cli.main(["train", cfg, "algorithm.kl_coeff=0.1", *run]) == 2
    assert "algorithm.kl_coeff" in _one_clean_line(capsys.readouterr().err)


def test_a_missing_media_file_is_one_line_and_debug_shows_the_traceback(
    tmp_path, capsys, monkeypatch
):
    from mmyatt.cli import main as cli
    from mmyatt.datasets.media import MediaError

    def train(*_, **__):
        raise MediaError("train.jsonl:3: image 'img/cat.png' not found")

    monkeypatch.setattr(cli, "train", train)
    monkeypatch.delenv("MMYATT_DEBUG", raising=False)
    assert cli.main(["train", "text_grpo_tiny"]) == 2
    assert "train.jsonl:3: image 'img/cat.png'" in _one_clean_line(capsys.readouterr().err)
    with pytest.raises(MediaError):
        cli.main(["train", "text_grpo_tiny", "--debug"])
    assert os.environ.pop("MMYATT_DEBUG") == "1"  # what controller processes inherit

    def crash(*_, **__):
        raise RuntimeError("a bug, not the user's error")

    monkeypatch.setattr(cli, "train", crash)
    with pytest.raises(RuntimeError):  # not a user error: the traceback stays
        cli.main(["train", "text_grpo_tiny"])


def test_help_lists_no_internal_command_and_train_help_lists_the_recipes(capsys):
    from mmyatt.cli import main as cli

    with pytest.raises(SystemExit):
        cli.main(["--help"])
    out = capsys.readouterr().out
    assert "_controller" not in out and "SUPPRESS" not in out
    with pytest.raises(SystemExit):
        cli.main(["train", "--help"])
    out = capsys.readouterr().out
    assert "docs/configuration.md" in out and "CONFIG" in out
    for recipe in Path(ROOT / "configs").glob("*.yaml"):
        assert recipe.stem in out
    assert "[key=value ...]" in out  # optional overrides
    with pytest.raises(SystemExit) as exit_:
        cli.main(["train"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and len(err.strip().splitlines()) == 1
    assert "CONFIG" in err and "overrides" not in err and "key=value" not in err


def test_a_recipe_is_found_by_name():
    from mmyatt.cli.main import resolve_recipe

    assert resolve_recipe("text_grpo_tiny") == str(ROOT / "configs" / "text_grpo_tiny.yaml")
    assert resolve_recipe("text_grpo_tiny.yaml") == str(ROOT / "configs" / "text_grpo_tiny.yaml")
