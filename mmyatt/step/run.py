"""Start a run: resolve and save the config, prepare data and the initial model once,
then start P controllers (or join an external torchrun) and drive their loop."""

from __future__ import annotations

import json
import logging
import math
import os
import resource
import signal
import sys
import threading
import time
from pathlib import Path

import torch
import transformers

from mmyatt.checkpoint.checkpointer import Checkpointer
from mmyatt.cli import user_errors
from mmyatt.cli.user_errors import ControllerUserError, PeerErrors
from mmyatt.config.builtin import check_builtin_paths  # noqa: F401 (registers a config check)
from mmyatt.config.schema import ConfigError, RunConfig, dump_yaml, load_config
from mmyatt.datasets.manifest import ShardedManifest
from mmyatt.datasets.media import check_media
from mmyatt.distributed import Dist, init_from_env, launch, shutdown, under_launcher
from mmyatt.engines import close_engines, controller_dist, group_reward
from mmyatt.engines.megatron_group import MirrorCheckpointer
from mmyatt.outputs import run_identity
from mmyatt.outputs.metrics import read_metrics
from mmyatt.outputs.samples import save_samples
from mmyatt.outputs.trackers import check_tracker_packages  # noqa: F401 (registers one)
from mmyatt.placement.config import releases_judge
from mmyatt.placement.devices import check_judge_devices, device_lines
from mmyatt.report.inspect import metrics_frame, placement_table
from mmyatt.report.plots import save_run_plots
from mmyatt.rewards.rules import check_reward_names  # noqa: F401 (registers one)
from mmyatt.serving.client import JudgeError
from mmyatt.serving.pool import JudgePool
from mmyatt.step import builders
from mmyatt.step.profile import profile_controller
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


def loop(ctl, cfg: RunConfig, dist: Dist) -> None:
    t, c = cfg.trainer, cfg.checkpoint
    log = ctl.logger
    say = logger.info if dist.is_main else (lambda *a, **k: None)
    # a megatron mirror reads the run's checkpoints and writes none
    checkpointer = MirrorCheckpointer if dist.mirror else Checkpointer
    ck = checkpointer(
        ctl.run_dir / "checkpoints" / "state",
        rank=dist.rank,
        world_size=dist.world_size,
        keep_last=c.keep_last,
        keep_every=c.keep_every,
        async_save=c.async_save,
        barrier=dist.barrier,
    )
    found = ck.resolve(c.resume) if dist.is_main else None
    path = dist.broadcast_object(str(found) if found else None)
    first = 1
    if path is None:  # a fresh start in an existing run directory rewrites its history
        log.truncate_after(-1)
        ctl.truncate_trace(-1)
    else:
        first = ctl.load_state(*ck.load(path)) + 1
        log.truncate_after(first - 1)  # rows a killed run logged after its last checkpoint
        ctl.truncate_trace(first - 1)
        say(f"[resume] from {path}: continuing at step {first}")
    say(
        f"[train] {dist.world_size} controller(s), {cfg.data.prompts_per_step} prompts x "
        f"{cfg.sampling.group_size} samples per step, steps {first}..{t.steps}"
    )

    def judge_down(error: JudgeError, step: int, local: dict) -> None:
        """A judge stayed down past the client's retry budget: checkpoint the last
        complete state, say where it is, and stop with the client's error (it names the
        judge URLs). A restart resumes from that checkpoint."""
        if step > 0:
            ck.save(step, ctl.shared_state(), local)
            note = f"checkpoint of step {step} in {ck.root}; rerun to resume once the judge is back"
        else:
            note = "no step completed, nothing to checkpoint"
        ck.close()
        log.close()
        say(f"\n[train] stopping: {error}\n[train] {note}")
        error.add_note(note)
        raise error

    if first == 1:
        ev = ctl.evaluate()
        write_samples(ctl, 0)
        log.log(0, ev)
        say("[eval] step 0: " + fmt(ev))
    stop_signal = StopSignal()
    bar = None
    if dist.is_main and t.progress:
        from tqdm import tqdm

        bar = tqdm(
            total=t.steps,
            initial=first - 1,
            desc="train",
            file=sys.stdout,
            dynamic_ncols=True,
            mininterval=0.5 if sys.stdout.isatty() else 15.0,  # keep captured logs short
        )
        # placement's decision lines above the bar, not glued to its end
        ctl.placement.log = lambda line, **_: bar.write(line, file=sys.stdout)
    start = time.perf_counter()
    step = first - 1
    cut_by_time = False
    for step in range(first, t.steps + 1):
        t0 = time.perf_counter()
        try:
            m = ctl.step()
        except JudgeError as error:  # raised before the update: step - 1 is the state
            judge_down(error, step - 1, ctl.step_start_local)
        dt = time.perf_counter() - t0
        m["timing/step_s"] = dt
        if "rollout/samples" in m:
            m["throughput/samples_per_s"] = m["rollout/samples"] / dt
            m["throughput/tokens_per_s"] = m["rollout/tokens"] / dt
        m["data/skipped"] = float(dist.sum(ctl.shard.num_skipped).item())
        m.update({k: float(v) for k, v in ctl.counters.items()})
        if t.eval_every and step % t.eval_every == 0 and step < t.steps:
            try:
                m.update(ctl.evaluate())
            except JudgeError as error:  # the step itself is complete
                log.log(step, m)
                ctl.trace_records(step)
                judge_down(error, step, ctl.local_state())
            write_samples(ctl, step)
        if step % t.log_every == 0:
            log.log(step, m)
        ctl.trace_records(step)
        if t.save_rollouts_every and step % t.save_rollouts_every == 0 and ctl.last_rollout:
            ctl.save_rollouts(step, ctl.last_rollout)
        if bar is not None:
            bar.update(1)
            bar.set_postfix_str(progress_note(m, cfg.model.kind))
        terminate = dist.any(stop_signal.received)
        if c.export_every and step % c.export_every == 0:  # all ranks: FSDP gathers weights
            export = ctl.run_dir / "checkpoints" / f"export_step_{step:08d}"
            ctl.engine.export(ctl.policy, str(export))
        if (c.save_every and step % c.save_every == 0) or terminate:
            ck.save(step, ctl.shared_state(), ctl.local_state())
        if terminate:
            ck.close()
            say(f"\n[train] SIGTERM: saved step {step} in {ck.root}; exiting")
            log.close()
            raise SystemExit(0)
        elapsed_min = (time.perf_counter() - start) / 60
        if t.max_minutes is not None and step < t.steps and dist.any(elapsed_min >= t.max_minutes):
            cut_by_time = True
            say(
                red(
                    f"\n[train] STOPPED EARLY: trainer.max_minutes={t.max_minutes} reached at "
                    f"step {step} of {t.steps}; the evaluation below is not the recipe's result"
                )
            )
            break
    ck.close()
    stop_signal.restore()
    if bar is not None:
        bar.close()
    try:
        ev = ctl.evaluate()
    except JudgeError as error:
        judge_down(error, step, ctl.local_state())
    write_samples(ctl, step)
    rss = dist.gather_ints(peak_rss_mb())
    mem = {f"memory/peak_rss_mb_rank{r}": float(v) for r, v in enumerate(rss)}
    done = {
        "train/steps_done": float(step),
        "train/steps_planned": float(t.steps),
        "train/cut_by_time": float(cut_by_time),
    }
    log.log(step, {**ev, **mem, **done, "train/minutes": (time.perf_counter() - start) / 60})
    say(f"[eval] step {step}: " + fmt(ev))
    out = ctl.run_dir / "checkpoints" / "final"
    ctl.engine.export(ctl.policy, str(out))  # all ranks: FSDP gathers the weights, rank 0 writes
    say(f"[export] policy saved in Hugging Face layout at {out}")
    log.close()
    if dist.is_main:
        save_plots(ctl.run_dir)
    dist.barrier()


class StopSignal:
    """SIGTERM sets a flag; the loop saves a checkpoint at the end of the step and exits."""

    def __init__(self):
        self.received = False
        self._old = None
        if threading.current_thread() is threading.main_thread():
            self._old = signal.signal(signal.SIGTERM, self._handle)

    def _handle(self, signum, frame):
        self.received = True

    def restore(self) -> None:
        if self._old is not None:
            signal.signal(signal.SIGTERM, self._old)


def write_samples(ctl, step: int) -> None:
    """Rank 0 shows its own share of the eval (no media crosses ranks)."""
    if not ctl.dist.is_main:
        return
    grid = save_samples(ctl.run_dir / "samples", step, ctl.eval_outputs)
    if grid is not None:
        ctl.logger.add_image("samples/eval", grid, step)


def save_plots(run_dir: Path) -> None:
    """plots/rewards.png, reward_components.png, timings.png (mmyatt/report/plots.py). A figure
    that cannot be drawn is reported, not raised: the run itself is finished."""
    try:
        paths = save_run_plots(run_dir)
    except Exception as e:  # noqa: BLE001 (a plot never fails a finished run)
        logger.info(f"[plots] not written: {type(e).__name__}: {e}")
        return
    logger.info(f"[plots] {', '.join(p.name for p in paths)} in {run_dir / 'plots'}")


def peak_rss_mb() -> int:
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)  # Linux: KiB


def progress_note(m: dict, kind: str) -> str:
    """The progress bar's note on a step: its reward and, for text and VLM policies, the
    mean response length in tokens (an image or a clip has no length worth showing);
    a figure the step did not produce (every group dropped by dynamic sampling) is left
    out, not shown as nan.

    >>> progress_note({"reward/generated_mean": 0.5, "response_length/mean": 12.0}, "text")
    'reward 0.500 len 12.0 tok'
    >>> progress_note({"reward/generated_mean": 0.5, "response_length/mean": 0.0}, "flow")
    'reward 0.500'
    >>> progress_note({"reward/generated_mean": 0.5, "dynamic/kept_groups": 0.0}, "text")
    'reward 0.500, every group dropped'
    """
    parts = []
    reward = m.get("reward/generated_mean")
    if isinstance(reward, float) and math.isfinite(reward):
        parts.append(f"reward {reward:.3f}")
    length = m.get("response_length/mean")
    if kind in ("text", "vlm") and isinstance(length, float) and math.isfinite(length):
        parts.append(f"len {length:.1f} tok")
    note = " ".join(parts)
    if m.get("dynamic/kept_groups") == 0.0:
        note += ", every group dropped"
    return note


def fmt(m: dict) -> str:
    return ", ".join(f"{k}={v:.4f}" if isinstance(v, float) else f"{k}={v}" for k, v in m.items())


def red(text: str) -> str:
    """ANSI red on a terminal, plain text in logs."""
    return f"\033[31m{text}\033[0m" if sys.stdout.isatty() else text


def print_summary(run_dir: Path) -> dict:
    """The before/after table for a finished run, with the steps it finished and, for
    image and video runs, the texture checks as a ratio to the base model's (step 0).
    Also written to ``summary.json``: {"steps_done", "steps_planned", "cut_by_time",
    "placement": {mode: {"steps", "step_s"}} (placement metrics only),
    "metrics": {name: {"first", "last", "change"(, "ratio")}}}."""
    rows = read_metrics(run_dir)
    evals = [r for r in rows if any(k.startswith("eval/") for k in r)]
    if not evals:
        logger.info(f"[summary] no eval rows in {run_dir}/metrics.jsonl")
        return {}
    first, last = evals[0], evals[-1]
    keys = [k for k in last if k.startswith("eval/")]
    logger.info(f"\n[summary] {run_dir}")
    width = max([40, *(len(k) + 1 for k in keys)])  # per-task names run longer
    logger.info(
        f"  {'metric':<{width}}{'step ' + str(first['step']):>12}"
        f"{'step ' + str(last['step']):>12}{'change':>10}"
    )
    metrics = {}
    for k in keys:
        a, b = first.get(k), last.get(k)
        if isinstance(a, int | float) and isinstance(b, int | float):
            line = f"  {k:<{width}}{a:>12.4f}{b:>12.4f}{b - a:>+10.4f}"
            metrics[k] = {"first": a, "last": b, "change": b - a}
            if k.startswith("eval/quality/") and a > 0:
                metrics[k]["ratio"] = b / a
                line += f"   x{b / a:.2f} of the base"
            logger.info(line)
    final = next((r for r in reversed(rows) if "train/steps_planned" in r), None)
    out: dict = {}
    if final is not None:
        done, planned = int(final["train/steps_done"]), int(final["train/steps_planned"])
        cut = bool(final.get("train/cut_by_time", 0.0))
        out = {"steps_done": done, "steps_planned": planned, "cut_by_time": cut}
        line = f"  steps {done}/{planned}"
        if done < planned:
            why = "time budget (trainer.max_minutes)" if cut else "stopped early"
            line = red(f"{line}: INCOMPLETE, {why}; this is not the recipe's result")
        logger.info(line)
    train_rows = [r for r in rows if "timing/step_s" in r]
    if train_rows:
        sps = sum(r.get("throughput/samples_per_s", 0) for r in train_rows) / len(train_rows)
        logger.info(f"  mean samples/s {sps:.1f}")
    placed = placement_table(metrics_frame(rows))
    if not placed.empty:
        out["placement"] = {
            p.mode: {"steps": int(p.steps), "step_s": float(p.actual_step_s)}
            for p in placed.itertuples()
        }
        logger.info(
            "  placement: "
            + ", ".join(
                f"{p.mode} x{p.steps} ({p.actual_step_s:.3f} s/step)" for p in placed.itertuples()
            )
        )
    out["metrics"] = metrics
    (run_dir / "summary.json").write_text(json.dumps(out, indent=2))
    return out


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
