"""Experiment trackers next to metrics.jsonl: ``logging.trackers: [tensorboard, wandb, mlflow]``.

Each tracker receives the same three things from :class:`~mmyatt.outputs.metrics.MetricsLogger`
on the main controller: scalars per logged step, eval sample grids (images, and the
first clip as a filmstrip) and a table of the logged rollouts (the rows of
``rollouts/rank0.jsonl`` for that step, with the generated image when there is one).

TensorBoard is a dependency and is written by the logger itself (``tensorboard/``; the
rollout table goes in as a Markdown text). wandb and mlflow are optional
(``pip install 'mmyatt[trackers]'``) and offline by default: wandb runs with
``mode=offline`` under ``<run dir>/wandb`` (upload later with ``wandb sync``), mlflow
writes a file store under ``<run dir>/mlruns`` (mlflow 3 keeps that store behind
``MLFLOW_ALLOW_FILE_STORE``, which is set for it) unless ``logging.mlflow_uri`` names a
server or database. A tracker that is requested but not installed fails when the config is
validated, before anything starts, with the command that installs it.

Left out on purpose: resuming the same wandb/mlflow run after a restart (a resumed run
opens a new tracker run; metrics.jsonl and TensorBoard are truncated and continued).
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import Any, Protocol

from mmyatt.config.checks import register_check
from mmyatt.config.errors import ConfigError
from mmyatt.config.schema import to_dict
from mmyatt.outputs.metrics import MetricsLogger
from mmyatt.outputs.rollout_log import TABLE_COLUMNS, table_rows

MODULES = {"wandb": "wandb", "mlflow": "mlflow"}
INSTALL = {
    "wandb": "pip install 'mmyatt[trackers]'   (or just: pip install wandb)",
    "mlflow": "pip install 'mmyatt[trackers]'   (or just: pip install mlflow-skinny)",
}


class Tracker(Protocol):
    def log_scalars(self, step: int, metrics: dict[str, float]) -> None: ...
    def log_image(self, tag: str, image: Any, step: int) -> None: ...
    def log_rollouts(self, step: int, rows: list[dict], run_dir: Path) -> None: ...
    def close(self) -> None: ...


def check_trackers(logging_cfg) -> None:
    """Fail now, naming the install command, for a requested tracker that is missing."""
    for name in logging_cfg.trackers:
        module = MODULES.get(name)
        if module is not None and importlib.util.find_spec(module) is None:
            raise ConfigError(
                f"logging.trackers includes {name!r} but the {module!r} package is not "
                f"installed; install it with: {INSTALL[name]}"
            )


@register_check
def check_tracker_packages(cfg) -> None:
    """``check_trackers`` on a whole run config (run by ``load_config``)."""
    check_trackers(cfg.logging)


def build_trackers(cfg, run_dir: Path) -> list[Tracker]:
    """The optional trackers a run asks for (TensorBoard is the logger's own)."""
    out: list[Tracker] = []
    for name in cfg.logging.trackers:
        if name == "wandb":
            out.append(WandbTracker(cfg, run_dir))
        elif name == "mlflow":
            out.append(MlflowTracker(cfg, run_dir))
    return out


def make_logger(cfg, run_dir: Path, enabled: bool):
    """The run's MetricsLogger with the trackers of ``logging.trackers`` (main rank only)."""
    tb = "tensorboard" in cfg.logging.trackers
    trackers = build_trackers(cfg, Path(run_dir)) if enabled else []
    return MetricsLogger(run_dir, enabled=enabled, tensorboard=tb, trackers=trackers)


class WandbTracker:
    def __init__(self, cfg, run_dir: Path):
        import wandb

        self.wandb = wandb
        self.run = wandb.init(
            project=cfg.logging.project,
            name=cfg.name,
            dir=str(run_dir),
            mode="offline" if cfg.logging.offline else "online",
            config=to_dict(cfg),
            reinit="finish_previous",
        )

    def log_scalars(self, step: int, metrics: dict[str, float]) -> None:
        self.run.log(metrics, step=step)

    def log_image(self, tag: str, image: Any, step: int) -> None:
        import numpy as np

        self.run.log({tag: self.wandb.Image(np.asarray(image))}, step=step)

    def log_rollouts(self, step: int, rows: list[dict], run_dir: Path) -> None:
        table = self.wandb.Table(columns=[*TABLE_COLUMNS, "parts", "verdicts", "image"])
        for row, cells in zip(rows, table_rows(rows)):
            f = row.get("output_file")
            image = self.wandb.Image(str(run_dir / f)) if f and f.endswith(".png") else None
            table.add_data(*cells, image)
        self.run.log({"rollouts": table}, step=step)

    def close(self) -> None:
        self.run.finish()


class MlflowTracker:
    def __init__(self, cfg, run_dir: Path):
        import mlflow

        self.mlflow = mlflow
        uri = cfg.logging.mlflow_uri
        if uri is None:  # the local file store: mlflow 3 keeps it behind an explicit opt-in
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
            uri = (Path(run_dir).resolve() / "mlruns").as_uri()
        mlflow.set_tracking_uri(uri)
        mlflow.set_experiment(cfg.logging.project)
        self.run = mlflow.start_run(run_name=cfg.name)
        params = _flatten(to_dict(cfg))
        mlflow.log_params({k: str(v)[:500] for k, v in params.items()})

    def log_scalars(self, step: int, metrics: dict[str, float]) -> None:
        self.mlflow.log_metrics(metrics, step=step)

    def log_image(self, tag: str, image: Any, step: int) -> None:
        import numpy as np

        self.mlflow.log_image(np.asarray(image), artifact_file=f"{tag}/step_{step:06d}.png")

    def log_rollouts(self, step: int, rows: list[dict], run_dir: Path) -> None:
        head = [*TABLE_COLUMNS, "parts", "verdicts"]
        cells = table_rows(rows)
        data = {h: [str(c[i]) for c in cells] for i, h in enumerate(head)}
        self.mlflow.log_table(data=data, artifact_file=f"rollouts/step_{step:06d}.json")

    def close(self) -> None:
        self.mlflow.end_run()


def _flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(tree, dict):
        out = {}
        for k, v in tree.items():
            out.update(_flatten(v, f"{prefix}{k}."))
        return out
    return {prefix[:-1]: tree}
