"""The layout shows the architecture: no source file over 600 lines, the engine reaches
the adapters only through ``mmyatt/step/adapters.py`` (which the run's builders import),
importing the step's parts (controller, trainer, checkpointer, engines, placement) does
not import an adapter, and the adapters take only leaf helpers of the engine."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("mmyatt", "models", "rewards", "datasets", "tests")
# engine-side tools that measure or instrument the adapters themselves, not the engine
TOOLS = {
    "mmyatt/step/adapters.py",  # config -> adapters: the one door
    "mmyatt/step/profile.py",  # patches timers onto models.decode / models.flow functions
    "mmyatt/placement/bench.py",
    "mmyatt/placement/bench_memory.py",
    "mmyatt/serving/server.py",  # the judge server's process: it runs a judge model
}


def _sources():
    for package in PACKAGES:
        yield from sorted((ROOT / package).rglob("*.py"))


def test_no_source_file_over_600_lines():
    long = {
        str(p.relative_to(ROOT)): n
        for p in _sources()
        if (n := len(p.read_text().splitlines())) > 600
    }
    assert not long, long


def _adapter_imports(path: Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            continue
        if any(n == "mmyatt.models" or n.startswith("mmyatt.models.") for n in names):
            found.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    return found


def test_the_engine_imports_adapters_only_through_the_builders():
    engine = [
        p
        for p in sorted((ROOT / "mmyatt").rglob("*.py"))
        if str(p.relative_to(ROOT)) not in TOOLS and "bench" not in p.relative_to(ROOT).parts
    ]
    assert (
        ROOT / "mmyatt" / "step" / "controller.py" in engine
        and ROOT / "mmyatt" / "step" / "run.py" in engine
    )
    assert [hit for p in engine for hit in _adapter_imports(p)] == []
    assert _adapter_imports(ROOT / "mmyatt" / "step" / "adapters.py")  # the check can see an import


def test_no_import_cycle_between_the_engine_and_the_adapters():
    code = (
        "import sys\n"
        "import mmyatt.step.controller, mmyatt.step.trainer, mmyatt.step.data\n"
        "import mmyatt.checkpoint.checkpointer, mmyatt.engines, mmyatt.placement.runner\n"
        "print(sorted(m for m in sys.modules if m.startswith('mmyatt.models')))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    # the step's parts pull in no adapter when imported: only the run's builders
    # (mmyatt.step.run, mmyatt.step.sft through mmyatt.step.builders) do
    assert out.stdout.strip() == "[]"
    code = (
        "import sys\n"
        "import mmyatt.models.text, mmyatt.models.vlm, mmyatt.models.flow\n"
        "import mmyatt.models.flow_nft, mmyatt.models.builtin.train_tiny_judge\n"
        "print(sorted(m for m in sys.modules if m.startswith('mmyatt.')\n"
        "             and m.split('.')[1] not in ('models', 'rewards', 'datasets')))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    # the adapters take the protocols, the rollout and leaf helpers, nothing that drives them
    # the algorithms package is pure tensor math (importing algorithms.nft imports it)
    algorithms = ("advantages", "dynamic_sampling", "flow_steps", "groups", "kl", "losses")
    leaves = {
        "mmyatt.protocols",
        "mmyatt.rollout",
        "mmyatt.algorithms",
        "mmyatt.algorithms.nft",
        "mmyatt.algorithms.overlong",
        *(f"mmyatt.algorithms.{name}" for name in algorithms),
        "mmyatt.step",
        "mmyatt.step.lr_schedule",
        # the config package imports nothing else of the project; models/builtin names its
        # checkpoints through it
        "mmyatt.config",
        "mmyatt.config.builtin",
        "mmyatt.config.checks",
        "mmyatt.config.errors",
        "mmyatt.config.model_folder",
        # the judge client: the built-in judges' training asks a served judge
        "mmyatt.serving",
        "mmyatt.serving.client",
    }
    assert set(ast.literal_eval(out.stdout)) <= leaves, out.stdout
