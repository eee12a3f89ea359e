"""Installed layout: top-level folders map to ``mmyatt.*`` and never shadow other packages.

Runs fresh interpreters (subprocesses) because what matters is what ``import`` resolves to
from a given working directory, which an already-running pytest process cannot show.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
OUR_DATASETS = REPO_ROOT / "datasets"


def run_python(code: str, *, cwd: Path, pythonpath: Path | None = None):
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["OMP_NUM_THREADS"] = "1"
    if pythonpath is not None:
        env["PYTHONPATH"] = str(pythonpath)
    return subprocess.run(
        [sys.executable, "-c", code], cwd=cwd, env=env, capture_output=True, text=True, timeout=120
    )


def test_import_datasets_from_repo_root_is_not_our_folder():
    code = (
        "try:\n"
        "    import datasets\n"
        "except ModuleNotFoundError as e:\n"
        "    assert e.name == 'datasets', e.name\n"
        "    print('absent')\n"
        "else:\n"
        "    print(datasets.__file__)\n"
    )
    result = run_python(code, cwd=REPO_ROOT)
    assert result.returncode == 0, result.stderr
    out = result.stdout.strip()
    assert out == "absent" or not Path(out).resolve().is_relative_to(OUR_DATASETS), out


def test_import_datasets_from_repo_root_finds_the_third_party_package(tmp_path):
    fake = tmp_path / "datasets"  # stands in for Hugging Face datasets
    fake.mkdir()
    (fake / "__init__.py").write_text('MARK = "hf"\n')
    (fake / "arrow.py").write_text('KIND = "arrow"\n')
    code = "import datasets, datasets.arrow; print(datasets.MARK, datasets.arrow.KIND)"
    result = run_python(code, cwd=REPO_ROOT, pythonpath=tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["hf", "arrow"]
    # Also with the repo root placed explicitly ahead of the real package.
    code = f"import sys; sys.path.insert(0, {str(REPO_ROOT)!r}); {code}"
    result = run_python(code, cwd=tmp_path, pythonpath=tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["hf", "arrow"]


@pytest.mark.parametrize("where", ["repo_root", "elsewhere"])
def test_mmyatt_datasets_imports_from_any_cwd(tmp_path, where):
    cwd = REPO_ROOT if where == "repo_root" else tmp_path
    code = (
        "import mmyatt.datasets.manifest as m, mmyatt.datasets as d, sys\n"
        "assert d.ShardedManifest is m.ShardedManifest\n"
        "assert 'datasets' not in sys.modules, sys.modules.get('datasets')\n"
        "print(m.__file__)"
    )
    result = run_python(code, cwd=cwd)
    assert result.returncode == 0, result.stderr
    assert Path(result.stdout.strip()).resolve() == OUR_DATASETS / "manifest.py"


def test_packages_import():
    code = "import mmyatt, mmyatt.models, mmyatt.rewards, mmyatt.datasets; print('ok')"
    result = run_python(code, cwd=REPO_ROOT)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"


def test_rewards_package_does_not_pull_in_torch():
    # Reward functions run in light processes too; only WeightedReward.__call__ needs torch.
    # Both imports are checked: were `import mmyatt` to pull in torch, the second check
    # could not tell anything, so that fails too instead of passing.
    code = (
        "import sys, mmyatt\n"
        "print('mmyatt', 'torch' in sys.modules)\n"
        "import mmyatt.rewards, mmyatt.rewards.rules\n"
        "print('mmyatt.rewards', 'torch' in sys.modules)"
    )
    result = run_python(code, cwd=REPO_ROOT)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == ["mmyatt False", "mmyatt.rewards False"]


def test_cli_help():  # `python -m mmyatt --help` is documented: no skip when it is missing
    result = subprocess.run(
        [sys.executable, "-m", "mmyatt", "--help"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("usage: mmyatt"), result.stdout
    for cmd in ("train", "sft", "inspect", "bench"):
        assert cmd in result.stdout, cmd
