"""A newcomer's mistakes, each run the way a user runs it (`mmyatt train ...` in a
subprocess, recipes with 2 controllers as shipped), each answered by one line on stderr
that names the file, line or key, exit code 2, no traceback, and nothing trained.

The fast cases fail before any controller starts (about 6 s of CPU each, mostly
imports); they run side by side, 4 at a time, in one module fixture. The case a controller finds (an image that exists but does
not decode, read only inside the controller that owns its record) starts 2 controllers
and the tiny VLM, about a minute and a half on a loaded 2-core machine: marked slow.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest
from PIL import Image

from mmyatt.config.schema import load_config
from mmyatt.outputs import run_identity

ROOT = Path(__file__).resolve().parent.parent
TEXT = "text_grpo_tiny"  # a shipped recipe named without its path, as a user may
VLM = str(ROOT / "configs" / "vlm_grpo_image_tiny.yaml")
VLM_FOLDER = str(ROOT / "models" / "builtin" / "shape_judge")  # a Qwen2-VL checkpoint
TWO = "distributed.nproc=2"


@dataclass(frozen=True)
class Mistake:
    name: str
    args: tuple[str, ...]  # after `mmyatt`; {tmp} is the module's data folder, {run} the case's
    says: tuple[str, ...]  # what the one line must name
    command: str = "train"


MISTAKES = [
    Mistake(
        "missing image",
        (VLM, "data.train={tmp}/missing_image.jsonl", "data.eval={tmp}/missing_image.jsonl", TWO),
        ("missing_image.jsonl:2", "image file not found", "nosuch.png"),
    ),
    Mistake(
        "malformed JSON line",
        (TEXT, "data.train={tmp}/malformed.jsonl", "data.eval={tmp}/malformed.jsonl", TWO),
        ("malformed.jsonl:3", "invalid JSON at column"),
    ),
    Mistake(
        "record without a prompt",
        (TEXT, "data.train={tmp}/no_prompt.jsonl", "data.eval={tmp}/no_prompt.jsonl", TWO),
        ("no_prompt.jsonl:2", "'prompt'"),
    ),
    Mistake(
        "missing manifest",
        (TEXT, "data.train={tmp}/none.jsonl", "data.eval={tmp}/none.jsonl", TWO),
        ("none.jsonl",),
    ),
    Mistake(
        "unknown reward name",
        (TEXT, "reward.functions=[{name: nosuchreward}]", TWO),
        ("nosuchreward",),
    ),
    Mistake("negative steps", (TEXT, "trainer.steps=-3", TWO), ("trainer.steps",)),
    Mistake("negative KL coefficient", (TEXT, "algorithm.kl_coef=-1", TWO), ("kl_coef",)),
    Mistake("no controllers", (TEXT, "distributed.nproc=0"), ("distributed.nproc",)),
    Mistake(
        "text recipe at a VLM folder",
        (TEXT, f"model.path={VLM_FOLDER}", TWO),
        ("model.path", "vision-language model", "model.kind=text"),
    ),
    Mistake(
        "unknown key", (TEXT, "algorithm.kl_coeff=0.1", TWO), ("algorithm.kl_coeff", "kl_coef")
    ),
    Mistake("bad override syntax", (TEXT, "trainer.steps:5", TWO), ("trainer.steps:5", "key")),
    Mistake("not a number", (TEXT, "trainer.steps=many", TWO), ("trainer.steps", "integer")),
    Mistake("missing config file", ("{tmp}/nosuch.yaml", TWO), ("nosuch.yaml",)),
    Mistake("unknown recipe name", ("text_grpo_huge", TWO), ("text_grpo_huge", TEXT)),
    Mistake("invalid YAML recipe", ("{tmp}/broken.yaml", TWO), ("broken.yaml", "YAML")),
    Mistake(
        "reused run directory with another model",
        (TEXT, TWO, "--run-dir", "{tmp}/made_with_another_model"),
        ("model.path", "old_model", "--overwrite", "--resume"),
    ),
    Mistake(
        "--overwrite and --resume together",
        (TEXT, TWO, "--overwrite", "--resume"),
        ("--overwrite", "--resume"),
    ),
    Mistake("unknown option", (TEXT, TWO, "--steps", "3"), ("--steps",)),
    Mistake("inspect a folder that is not a run", ("{tmp}",), ("not a run",), command="inspect"),
]


def write_inputs(tmp: Path) -> None:
    """The files the mistakes point at."""
    Image.new("RGB", (16, 16), (200, 0, 0)).save(tmp / "red.png")
    vqa = {"prompt": "What colour is the shape?", "answer": "red"}
    (tmp / "missing_image.jsonl").write_text(
        json.dumps({**vqa, "image": "red.png"}) + "\n" + json.dumps({**vqa, "image": "nosuch.png"})
    )
    (tmp / "malformed.jsonl").write_text(
        '{"prompt": "1+1=", "answer": "2"}\n\n{"prompt": "2+2=", "answer": "4"\n'
    )
    (tmp / "no_prompt.jsonl").write_text('{"prompt": "1+1=", "answer": "2"}\n{"answer": "4"}\n')
    (tmp / "broken.yaml").write_text("name: broken\ntrainer: {steps: 3\n")
    made = tmp / "made_with_another_model"
    cfg = load_config(ROOT / "configs" / f"{TEXT}.yaml")
    old = cfg.model.model_copy(update={"path": str(tmp / "old_model")})
    run_identity.record(cfg.model_copy(update={"model": old}), made)  # what that run left
    (made / "config.yaml").write_text("name: text_grpo_tiny\n")


def run_mistake(m: Mistake, tmp: Path) -> tuple[subprocess.CompletedProcess, Path]:
    run = tmp / "runs" / m.name.replace(" ", "_")
    args = [a.replace("{tmp}", str(tmp)) for a in m.args]
    if m.command == "train" and "--run-dir" not in args:
        args += ["--run-dir", str(run)]
    proc = subprocess.run(
        [sys.executable, "-m", "mmyatt", m.command, *args],
        capture_output=True,
        text=True,
        cwd=tmp,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
        timeout=600,
    )
    return proc, run


@pytest.fixture(scope="module")
def answers(tmp_path_factory) -> dict[str, tuple[subprocess.CompletedProcess, Path]]:
    tmp = tmp_path_factory.mktemp("mistakes")
    write_inputs(tmp)
    with ThreadPoolExecutor(max_workers=4) as pool:
        done = {m.name: pool.submit(run_mistake, m, tmp) for m in MISTAKES}
        return {name: future.result() for name, future in done.items()}


def one_clean_line(proc: subprocess.CompletedProcess) -> str:
    """The one line a mistake gets: exit 2, one line on stderr, no traceback anywhere."""
    both = proc.stdout + proc.stderr
    assert proc.returncode == 2, both[-3000:]
    assert "Traceback" not in both and "ChildFailedError" not in both, both[-3000:]
    lines = [x for x in proc.stderr.splitlines() if x.strip()]
    assert len(lines) == 1, proc.stderr[-3000:]
    return lines[0]


def nothing_trained(run: Path) -> bool:
    return not (run / "metrics.jsonl").exists() and not (run / "checkpoints").exists()


# the first case waits for the whole table: 19 processes of about 6 s of CPU each (most of
# it importing torch and transformers), 4 at a time; under a load of 30 on 2 cores the
# whole table took 618 s
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("mistake", MISTAKES, ids=[m.name for m in MISTAKES])
def test_a_mistake_is_one_line_and_exit_2(mistake, answers):
    proc, run = answers[mistake.name]
    line = one_clean_line(proc)
    assert line.startswith("mmyatt"), line
    for word in mistake.says:
        assert word in line, line
    assert nothing_trained(run)


def test_the_table_holds_at_least_15_mistakes():
    assert len(MISTAKES) >= 15


@pytest.mark.slow
def test_a_mistake_found_inside_one_controller(tmp_path):
    """An image that exists but does not decode is found when the controller that owns
    its record reads it (rank 1 here): the other controller leaves quietly, no gloo
    "Connection closed by peer", no launcher failure box."""
    for i in range(4):
        Image.new("RGB", (16, 16), (200, 40 * i, 0)).save(tmp_path / f"img{i}.png")
    (tmp_path / "img1.png").write_bytes(b"not a png")
    vqa = {"prompt": "What colour is the shape?", "answer": "red"}
    lines = [json.dumps({**vqa, "image": f"img{i}.png"}) for i in range(4)]
    (tmp_path / "vlm.jsonl").write_text("\n".join(lines) + "\n")
    m = Mistake(
        "corrupt image",
        (
            VLM,
            "data.train={tmp}/vlm.jsonl",
            "data.eval={tmp}/vlm.jsonl",
            "data.prompts_per_step=2",
            "sft.enabled=false",
            "trainer.progress=false",
            TWO,
        ),
        ("vlm.jsonl:2", "cannot decode image file"),
    )
    proc, run = run_mistake(m, tmp_path)
    line = one_clean_line(proc)
    for word in m.says:
        assert word in line, line
    assert "Connection closed" not in proc.stdout + proc.stderr
    assert nothing_trained(run)
    assert not (run / "controller_error.txt").exists()  # the launcher took it
