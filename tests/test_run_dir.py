"""A run directory remembers what it was made with; the launcher reads every record of a
small manifest before controllers start; ``data.bad_lines=skip`` holds where the tiny
model's tokenizer is built from the manifest."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mmyatt.config.schema import load_config
from mmyatt.datasets.manifest import ManifestError
from mmyatt.outputs.run_identity import IDENTITY_FILE, RunDirError, claim, record
from mmyatt.step import builders
from mmyatt.step.prepare import check_data

ROOT = Path(__file__).resolve().parent.parent
RECIPE = ROOT / "configs" / "text_grpo_tiny.yaml"


def manifest(tmp_path: Path, bad_line: bool) -> Path:
    lines = [json.dumps({"prompt": f"{i}+1=", "answer": str(i + 1)}) for i in range(6)]
    if bad_line:
        lines.insert(2, '{"prompt": "cut short"')
    path = tmp_path / "data.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def test_a_run_directory_made_with_another_model_or_data_is_an_error_naming_it(tmp_path):
    run = tmp_path / "run"
    data = manifest(tmp_path, bad_line=False)
    made = load_config(RECIPE, [f"data.train={data}", f"data.eval={data}"])
    assert claim(made, run, overwrite=False, resume=False) is made  # a new directory
    record(made, run)
    assert claim(made, run, overwrite=False, resume=False) is made  # the same run again

    other = tmp_path / "other.jsonl"
    other.write_text(data.read_text())
    changed = load_config(RECIPE, [f"data.train={other}", f"data.eval={data}"])
    with pytest.raises(RunDirError) as error:
        claim(changed, run, overwrite=False, resume=False)
    message = str(error.value)
    assert f"data.train={data} (now {other})" in message
    assert "data.eval" not in message  # only what differs
    assert "--overwrite" in message and "--resume" in message

    resumed = claim(changed, run, overwrite=False, resume=True)  # the run as it was made
    assert resumed.data.train == str(data) and resumed.data.eval == str(data)
    assert claim(changed, run, overwrite=True, resume=False) is changed
    assert not run.exists()  # started over: the old run is gone
    with pytest.raises(RunDirError, match="contradict"):
        claim(changed, run, overwrite=True, resume=True)
    with pytest.raises(RunDirError, match="no run to resume"):
        claim(changed, run, overwrite=False, resume=True)


def test_a_run_that_did_not_record_what_it_was_made_with_is_not_reused(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text("name: text_grpo_tiny\n")
    cfg = load_config(RECIPE)
    with pytest.raises(RunDirError, match="did not record"):
        claim(cfg, run, overwrite=False, resume=False)
    record(cfg, run)
    assert json.loads((run / IDENTITY_FILE).read_text())["name"] == "text_grpo_tiny"


def test_every_record_is_read_before_controllers_start(tmp_path):
    data = manifest(tmp_path, bad_line=True)
    fail = load_config(RECIPE, [f"data.train={data}", f"data.eval={data}"])
    with pytest.raises(ManifestError, match=r"data.jsonl:3: invalid JSON at column 23"):
        check_data(fail)
    skip = load_config(RECIPE, [f"data.train={data}", f"data.eval={data}", "data.bad_lines=skip"])
    said: list[str] = []
    check_data(skip, said.append)
    assert said == ["[data] data.train: 1 bad record(s) of 7 skipped"]


def test_bad_lines_skip_holds_where_the_tiny_tokenizer_reads_the_manifest(tmp_path):
    data = manifest(tmp_path, bad_line=True)
    overrides = [f"data.train={data}", f"data.eval={data}", "model.tiny_size=qwen2-0.1m"]
    with pytest.raises(ManifestError, match="data.jsonl:3"):
        builders.build_tiny(load_config(RECIPE, overrides), tmp_path / "fail", lambda _: None)
    cfg = load_config(RECIPE, [*overrides, "data.bad_lines=skip"])
    out = builders.build_tiny(cfg, tmp_path / "skip", lambda _: None)
    assert (out / "config.json").is_file()
