"""The notebooks run top to bottom on the embedded defaults, and `mmyatt inspect --html`
on a tiny GenRM job holds every logged sample with its rewards and verdicts.

One tiny GenRM job (Flow-GRPO on builtin:tiny_t2i judged by builtin:tiny_judge, 3 steps,
2 controllers) serves both the report test and reward_inspection.ipynb (through
MMYATT_RUN; without it the notebook trains the same job itself). Notebooks are stored
with the outputs of a run (checked here), reward_inspection's from a run of the demo."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = ROOT / "notebooks"
NAMES = ["quickstart.ipynb", "reward_inspection.ipynb", "try_a_judge.ipynb"]
TINY_GENRM = [  # the same shrunken job reward_inspection.ipynb trains without MMYATT_RUN
    "trainer.steps=3",
    "trainer.max_minutes=null",
    "trainer.progress=false",
    "trainer.eval_every=0",
    "trainer.save_rollouts_every=1",
    "distributed.nproc=2",
    "data.prompts_per_step=4",
    "sampling.group_size=4",
    "data.eval_prompts=8",
    "data.synthetic_eval_size=8",
    "data.synthetic_train_size=32",
    "sampling.denoise_steps=3",
    "sampling.eval_denoise_steps=3",
]


def mmyatt(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, "-m", "mmyatt", *args], capture_output=True, text=True, env=env, cwd=cwd
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


@pytest.fixture(scope="module")
def genrm_run(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("genrm")
    run = tmp / "run"
    recipe = str(ROOT / "configs" / "flow_grpo_genrm_tiny.yaml")
    mmyatt("train", recipe, *TINY_GENRM, "--run-dir", str(run), cwd=tmp)
    return run


def test_notebooks_are_stored_with_outputs_that_hold_no_machine_paths():
    """Readable on a code host without running them: every notebook is stored with the
    outputs of a run (reward_inspection's of a run of the shipped demo), a figure among
    them, and no path of the machine that ran it."""
    for name in NAMES:
        nb = nbformat.read(NOTEBOOKS / name, as_version=4)
        code = [c for c in nb.cells if c.cell_type == "code"]
        assert all(c.execution_count is not None for c in code), f"{name} is not run"
        outputs = [o for c in code for o in c.outputs]
        assert not [o for o in outputs if o.get("output_type") == "error"], name
        assert any("image/png" in o.get("data", {}) for o in outputs), name
        text = "".join(  # what a reader sees, without the images' base64 data
            re.sub(r"data:[a-z/]+;base64,[A-Za-z0-9+/=]+", "", "".join(v))
            for o in outputs
            for k, v in [("text", o.get("text", "")), *o.get("data", {}).items()]
            if k == "text" or k.startswith("text/")
        )
        for path in (str(ROOT), "/tmp/", "/home/"):
            assert path not in text, f"notebooks/{name} shows a machine path ({path})"


def test_rollout_log_and_html_report_of_a_genrm_job(genrm_run):
    from test_inspect import check_report

    from mmyatt.report.inspect import load_run

    # every rank logged every step, with the judge's answer next to each reward
    rows = []
    for rank in (0, 1):
        lines = (genrm_run / "rollouts" / f"rank{rank}.jsonl").read_text().splitlines()
        rows += [json.loads(x) for x in lines]
    assert {(r["rank"], r["step"]) for r in rows} == {(k, s) for k in (0, 1) for s in (1, 2, 3)}
    for r in rows:
        v = r["verdicts"]["genrm"]
        assert v["raw"] in ("Yes", "No") or v["values"] == [None]
        assert v["verdict"] == pytest.approx(r["parts"]["genrm"], abs=1e-6)
        assert "Does this image show" in v["question"]
        assert {"prompt_alignment_rule", "shape_critic"} <= set(r["parts"])
        assert (genrm_run / r["output_file"]).is_file()
        assert isinstance(r["advantage"], float)
    assert {p.name for p in (genrm_run / "plots").iterdir()} >= {
        "rewards.png",
        "reward_components.png",
        "timings.png",
    }

    out = genrm_run.parent / "report.html"
    proc = mmyatt("inspect", str(genrm_run), "--html", "--out", str(out), cwd=genrm_run.parent)
    assert "[summary]" in proc.stdout and str(out) in proc.stdout
    html = out.read_text()
    run = load_run(genrm_run)
    assert len(run.rollouts) == len(rows)
    check_report(html, run)
    assert "genrm vs shape_critic" in html and "genrm vs prompt_alignment_rule" in html
    # the images themselves are inline: one per logged sample at least
    assert html.count("data:image/png;base64,") >= len(rows)


@pytest.mark.parametrize("name", NAMES)
def test_notebook_runs_top_to_bottom(name, genrm_run, monkeypatch):
    if name == "reward_inspection.ipynb":
        monkeypatch.setenv("MMYATT_RUN", str(genrm_run))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    nb = nbformat.read(NOTEBOOKS / name, as_version=4)
    client = nbclient.NotebookClient(
        nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(NOTEBOOKS)}}
    )
    client.execute()
    errors = [
        o
        for c in nb.cells
        if c.cell_type == "code"
        for o in c.outputs
        if o.get("output_type") == "error"
    ]
    assert not errors
    figures = [
        o
        for c in nb.cells
        if c.cell_type == "code"
        for o in c.outputs
        if "image/png" in o.get("data", {})
    ]
    assert figures, f"{name} drew no figure"
