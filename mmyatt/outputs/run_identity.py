"""What a run directory was made with, so that reusing it for something else is an error.

A run directory keeps what was prepared once for it (the tiny base model, the SFT warm
start, the synthetic data) and its checkpoints, and a later run in the same directory
picks them up: that is how a stopped run resumes. Started with another model, other data
or another recipe, it would pick them up too and train something the user did not ask
for. So ``made_with.json`` records the settings that make a run what it is
(:data:`IDENTITY_KEYS`), and a run started in a directory made with other ones stops
with an error naming every difference, unless the user says what they want:
``overwrite`` (start over: the directory's run is deleted) or ``resume`` (continue the
run that is there, with what it was made with).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from mmyatt.config.schema import RunConfig

IDENTITY_FILE = "made_with.json"
IDENTITY_KEYS = ("name", "model.kind", "model.path", "data.train", "data.eval")


class RunDirError(ValueError):
    """A run directory that cannot take this run (made with something else, or not a run)."""


def _normal(spec: str | None) -> str | None:
    """A model path or data spec with each file path made absolute (``builtin:`` and
    ``synthetic:`` names as they are), so ``data/x.jsonl`` and ``./data/x.jsonl`` agree."""
    if spec is None:
        return None
    parts = []
    for part in spec.split(","):
        part = part.strip()
        named = part.startswith(("builtin:", "synthetic:")) or not part
        parts.append(part if named else os.path.abspath(os.path.expanduser(part)))
    return ",".join(parts)


def identity(cfg: RunConfig) -> dict[str, str | None]:
    """The settings that make a run what it is, as the user gave them."""
    return {
        "name": cfg.name,
        "model.kind": cfg.model.kind,
        "model.path": _normal(cfg.model.path),
        "data.train": _normal(cfg.data.train),
        "data.eval": _normal(cfg.data.eval),
    }


def is_run(run_dir: Path) -> bool:
    return (run_dir / IDENTITY_FILE).is_file() or (run_dir / "config.yaml").is_file()


def recorded(run_dir: Path) -> dict | None:
    path = run_dir / IDENTITY_FILE
    return json.loads(path.read_text()) if path.is_file() else None


def differences(made: dict, wanted: dict) -> list[str]:
    """``key: was -> now`` for each identity setting that differs."""
    return [
        f"{k}={made.get(k)} (now {wanted[k]})" for k in IDENTITY_KEYS if made.get(k) != wanted[k]
    ]


def claim(cfg: RunConfig, run_dir: Path, *, overwrite: bool, resume: bool) -> RunConfig:
    """Check ``run_dir`` can take the run ``cfg`` describes, before anything is prepared
    in it; returns the config to run (under ``resume``, with what the directory was made
    with). Raises :class:`RunDirError` naming what differs."""
    if overwrite and resume:
        raise RunDirError("--overwrite and --resume contradict each other: choose one")
    if not is_run(run_dir):
        if resume:
            raise RunDirError(f"--resume: {run_dir} holds no run to resume")
        return cfg
    if overwrite:
        shutil.rmtree(run_dir)
        return cfg
    made = recorded(run_dir)
    if made is None:
        raise RunDirError(
            f"{run_dir} holds a run that did not record what it was made with; "
            "--overwrite to start over in it, or choose another --run-dir"
        )
    wanted = identity(cfg)
    changed = differences(made, wanted)
    if not changed:
        return cfg
    if not resume:
        raise RunDirError(
            f"{run_dir} was made with {', '.join(changed)}; --overwrite to start over in "
            "it, --resume to continue the run it holds, or choose another --run-dir"
        )
    return _as_made(cfg, made)


def _as_made(cfg: RunConfig, made: dict) -> RunConfig:
    model = cfg.model.model_copy(update={"kind": made["model.kind"], "path": made["model.path"]})
    data = cfg.data.model_copy(update={"train": made["data.train"], "eval": made["data.eval"]})
    return cfg.model_copy(update={"name": made["name"], "model": model, "data": data})


def record(cfg: RunConfig, run_dir: Path) -> None:
    """Write what ``run_dir`` is made with (once its run is prepared)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / IDENTITY_FILE).write_text(json.dumps(identity(cfg), indent=1) + "\n")
