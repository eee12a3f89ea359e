"""What a run does once, in the launching process, before any controller starts: the
run directory, the synthetic task's data files and the check of every record, the tiny
built-in model and the SFT warm start, the GenRM judges, and the resolved config saved
with the run."""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

from mmyatt.config.schema import ConfigError, RunConfig, dump_yaml
from mmyatt.datasets.manifest import ShardedManifest
from mmyatt.datasets.media import check_media
from mmyatt.outputs import run_identity
from mmyatt.placement.config import releases_judge
from mmyatt.serving.pool import JudgePool
from mmyatt.step import builders
from mmyatt.step.sft import run_sft

logger = logging.getLogger("mmyatt.run")
SCAN_MAX_BYTES = 64 << 20  # manifests up to this size are read whole before controllers start


def resolve_run_dir(cfg: RunConfig, run_dir: str | None) -> Path:
    return Path(run_dir) if run_dir else Path("runs") / cfg.name


def check_data(cfg: RunConfig, log=logger.info) -> None:
    """Read every record of the run's manifests (those small enough, ``SCAN_MAX_BYTES``)
    once before any controller starts: a bad line or a missing image is one error
    naming its file and line now, not a failure inside one controller minutes later.
    Under ``data.bad_lines=skip`` the bad records are counted and skipped instead."""
    check = check_media if cfg.model.kind == "vlm" else None
    specs = {"data.train": cfg.data.train, "data.eval": cfg.data.eval, "data.val": cfg.data.val}
    seen = set()
    for key, spec in specs.items():
        if spec is None or spec in seen:
            continue
        seen.add(spec)
        manifest = ShardedManifest(
            builders.manifest_paths(spec),
            shuffle=False,
            bad_lines=cfg.data.bad_lines,
            transform=check,
        )
        if manifest.num_bytes() <= SCAN_MAX_BYTES:
            bad = manifest.check_records()
            if bad:
                log(f"[data] {key}: {bad} bad record(s) of {len(manifest)} skipped")
        manifest.close()


def prepare_run(cfg: RunConfig, run_dir: Path, log=logger.info) -> RunConfig:
    """Everything done once per run before controllers start: synthetic data files,
    the check of every record, the tiny built-in model, the SFT warm start. Returns the
    resolved config."""
    made = cfg
    run_dir.mkdir(parents=True, exist_ok=True)
    data = cfg.data
    if data.train.startswith("synthetic:") or data.eval.startswith("synthetic:"):
        if data.train != data.eval:
            raise ConfigError(
                f"data.train={data.train!r}, data.eval={data.eval!r}: a synthetic task makes "
                "both splits; set data.eval to the same task"
            )
        train, ev, val = builders.synthetic_task(data.train, run_dir / "data", cfg)
        log(f"[prepare] synthetic task {data.train}: {train} and {ev}")
        val = str(val) if val is not None else data.val
        data = data.model_copy(update={"train": str(train), "eval": str(ev), "val": val})
        warm = run_dir / "data" / "sft.jsonl"  # a task with its own warm-start split
        if warm.exists() and cfg.sft.data is None:
            cfg = cfg.model_copy(update={"sft": cfg.sft.model_copy(update={"data": str(warm)})})
    cfg = cfg.model_copy(update={"data": data})
    check_data(cfg, log)
    run_identity.record(made, run_dir)
    model = cfg.model.model_copy(update={"path": builders.resolve_builtin(cfg.model.path)})
    cfg = cfg.model_copy(update={"model": model})
    if model.path is None:
        tiny = builders.build_tiny(cfg, run_dir / "base_model", log)
        model = model.model_copy(update={"path": str(tiny)})
        cfg = cfg.model_copy(update={"model": model})
    if cfg.sft.enabled:
        out = run_dir / "sft_model"
        if (out / "config.json").exists():  # a resumed run keeps its warm start
            log(f"[prepare] reusing the SFT warm start in {out}")
        else:
            run_sft(cfg, out, log=log)
        cfg = cfg.model_copy(update={"model": cfg.model.model_copy(update={"path": str(out)})})
    return cfg


def start_judges(cfg: RunConfig, rd: Path):
    """Start the GenRM servers a run asks for; their URLs go into the resolved config."""
    j = cfg.reward.judge
    if j.model is None:
        if j.urls:
            JudgePool.external(list(j.urls))  # fail now, not at the first reward call
        return cfg, None
    key = os.environ.get(j.api_key_env) if j.api_key_env else None
    model = builders.resolve_builtin(j.model)
    t0 = time.perf_counter()
    pool = JudgePool(
        model,
        j.num_servers,
        api_key=key,
        devices=list(j.devices) or None,
        max_batch=j.max_batch,
        threads=j.threads,
        log_dir=str(rd / "judges"),
        max_restarts=j.max_restarts,
        startup_timeout_s=j.startup_timeout_s,
        backend=j.backend,
        vllm_args=list(j.vllm_args),
        settle=releases_judge(cfg.placement),
    )
    logger.info(
        f"[judge] {j.num_servers} server(s) for {model} at {', '.join(pool.urls)} "
        f"({time.perf_counter() - t0:.1f}s)"
    )
    judge = j.model_copy(update={"urls": tuple(pool.urls)})
    return cfg.model_copy(update={"reward": cfg.reward.model_copy(update={"judge": judge})}), pool


def save_config(cfg: RunConfig, rd: Path, show: bool = False) -> None:
    """The resolved config, saved with the run; printed in full under ``--print-config``,
    else as one line."""
    (rd / "config.yaml").write_text(dump_yaml(cfg))
    if show:
        logger.info("[config] resolved:\n" + dump_yaml(cfg))
    else:
        logger.info(f"[config] resolved config in {rd / 'config.yaml'} (--print-config shows it)")
