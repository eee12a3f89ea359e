"""Start a run: resolve and save the config, prepare data and the initial model once
(:mod:`mmyatt.step.prepare`), then start P controllers (or join an external torchrun);
each builds its controller and drives the loop (:mod:`mmyatt.step.loop`), and the
finished run's summary is printed (:mod:`mmyatt.step.summary`)."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import torch
import transformers

from mmyatt.cli import user_errors
from mmyatt.cli.user_errors import ControllerUserError, PeerErrors
from mmyatt.config.builtin import check_builtin_paths  # noqa: F401 (registers a config check)
from mmyatt.config.schema import dump_yaml, load_config
from mmyatt.distributed import init_from_env, launch, shutdown, under_launcher
from mmyatt.engines import close_engines, controller_dist, group_reward
from mmyatt.outputs import run_identity
from mmyatt.outputs.trackers import check_tracker_packages  # noqa: F401 (registers one)
from mmyatt.placement.devices import check_judge_devices, device_lines
from mmyatt.rewards.rules import check_reward_names  # noqa: F401 (registers one)
from mmyatt.step import builders
from mmyatt.step.loop import loop
from mmyatt.step.prepare import prepare_run, resolve_run_dir, save_config, start_judges
from mmyatt.step.profile import profile_controller
from mmyatt.step.sft import run_sft
from mmyatt.step.summary import print_summary

logger = logging.getLogger("mmyatt.run")


def train(
    config: str | None,
    overrides: list[str],
    run_dir: str | None = None,
    *,
    overwrite: bool = False,
    resume: bool = False,
    print_config: bool = False,
) -> int:
    """`mmyatt train`: the launching process. Controllers re-enter through `controller_main`.

    ``overwrite`` / ``resume``: what to do with a run directory made with another model,
    data or recipe (mmyatt/outputs/run_identity.py); ``print_config``: print the
    resolved config (it is saved in the run directory either way)."""
    cfg = load_config(config, overrides)
    rd = resolve_run_dir(cfg, run_dir)
    quiet_libraries()
    check_judge_devices(cfg)  # GPUs the judge cannot have fail here, before anything starts
    if under_launcher():  # an external torchrun started us: every rank is a controller
        if int(os.environ.get("RANK", "0")) == 0:
            cfg = run_identity.claim(cfg, rd, overwrite=overwrite, resume=resume)
            for line in device_lines(cfg):
                logger.info(line)
        dist = init_from_env(cfg.distributed.backend, device=cfg.distributed.device)
        pool = None
        if dist.is_main:
            user_errors.clear(rd)
            cfg = prepare_run(cfg, rd)
            cfg, pool = start_judges(cfg, rd)
            save_config(cfg, rd, print_config)
        dist.barrier()
        try:
            return controller_main(str(rd / "config.yaml"), [], str(rd))
        finally:
            if pool is not None:
                pool.stop()
    cfg = run_identity.claim(cfg, rd, overwrite=overwrite, resume=resume)
    for line in device_lines(cfg):
        logger.info(line)
    cfg = prepare_run(cfg, rd)
    cfg, pool = start_judges(cfg, rd)
    save_config(cfg, rd, print_config)
    argv = ["_controller", str(rd / "config.yaml"), "--run-dir", str(rd)]
    try:
        if cfg.distributed.nproc > 1:
            user_errors.clear(rd)
            rc = launch(
                cfg.distributed.nproc,
                argv,
                # a restart resumes from the last checkpoint: without checkpoints there is
                # nothing to restart from, and a failure ends the run
                max_restarts=cfg.distributed.max_restarts if cfg.checkpoint.save_every else 0,
                saved_since=lambda t: saved_since(rd, t),
            )
            line = user_errors.take(rd)
            if line is not None:  # a controller found a user's mistake; the others left
                raise ControllerUserError(line)
            if rc == 0:
                print_summary(rd)
            return rc
        return controller_main(str(rd / "config.yaml"), [], str(rd))
    finally:
        if pool is not None:
            pool.stop()
            logger.debug("[judge] servers stopped")


def saved_since(rd: Path, t: float) -> bool:
    """A complete run-state checkpoint was written after time t."""
    marks = (rd / "checkpoints" / "state").glob("step_*/COMPLETE")
    return any(m.stat().st_mtime >= t for m in marks)


def quiet_libraries() -> None:
    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()


def controller_main(
    config: str, overrides: list[str], run_dir: str, *, launcher_reports: bool = False
) -> int:
    """One controller (one rank): build, loop, evaluate, export.

    With several controllers, a user's mistake found here is reported to the others,
    which leave quietly (mmyatt/cli/user_errors.py); ``launcher_reports``: our launcher
    prints its line, so this controller leaves quietly too (else it raises, for the CLI
    to print)."""
    peers = PeerErrors(run_dir) if int(os.environ.get("WORLD_SIZE", "1")) > 1 else None
    if peers is not None:
        peers.watch()
    try:
        return _controller(config, overrides, Path(run_dir), peers)
    except Exception:
        if peers is None:
            raise
        if peers.reported:
            if launcher_reports:
                peers.leave()
            raise
        if peers.peer_reported():
            peers.leave()  # a consequence of a peer's reported mistake, not news
        raise


def _controller(config: str, overrides: list[str], rd: Path, peers: PeerErrors | None) -> int:
    quiet_libraries()
    cfg = load_config(config, overrides)
    torch.set_num_threads(cfg.trainer.threads)
    dist = init_from_env(cfg.distributed.backend, device=cfg.distributed.device)
    try:
        # train.tensor_parallel / pipeline_parallel > 1: a model-parallel group of processes
        # is one controller; its first rank scores (group_reward), the others write only
        # into a private directory
        dist = controller_dist(cfg, dist)
        mirror = dist.mirror
        torch.manual_seed(cfg.trainer.seed)
        ctl = builders.build_controller(
            cfg,
            rd / ".mirror" / f"rank{dist.global_rank}" if mirror else rd,
            dist,
            policy=builders.build_policy(cfg.model, dist.device),
            reward=group_reward(builders.build_reward(cfg.reward), dist),
            shard=builders.build_shard(cfg, dist.rank, dist.world_size),
            eval_records=builders.eval_records(cfg, dist.rank, dist.world_size),
        )
        profile_file = os.environ.get("MMYATT_STEP_PROFILE")  # set by `mmyatt bench text-grpo`
        if profile_file:
            profile_controller(ctl, rd / f"{profile_file}_rank{dist.rank}.json")
        loop(ctl, cfg, dist)
    except Exception as error:
        # before the process group closes: the other controllers must see the report
        # before they see this one leave
        if peers is not None:
            peers.report(error)
        raise
    finally:
        close_engines()  # a vLLM rollout engine leaves before the process group it uses
        shutdown()
    if not dist.active and dist.processes == 1:  # else the launcher prints it
        print_summary(rd)
    return 0


def sft_command(config: str, overrides: list[str], run_dir: str | None) -> int:
    """`mmyatt sft`: prepare data and the initial model, run SFT, write an HF checkpoint."""
    cfg = load_config(config, overrides)
    rd = resolve_run_dir(cfg, run_dir)
    cfg = run_identity.claim(cfg, rd, overwrite=False, resume=False)
    quiet_libraries()
    no_sft = cfg.model_copy(update={"sft": cfg.sft.model_copy(update={"enabled": False})})
    cfg = prepare_run(no_sft, rd)
    out = rd / "checkpoints" / "sft"
    result = run_sft(cfg, out)
    (rd / "config.yaml").write_text(
        dump_yaml(cfg.model_copy(update={"model": cfg.model.model_copy(update={"path": str(out)})}))
    )
    (rd / "sft.json").write_text(json.dumps(result, indent=2))
    return 0
