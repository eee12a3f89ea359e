"""One controller's training loop: resume from the last checkpoint, then per step
train, log, evaluate, save rollouts, export and checkpoint on their schedules; stop on
SIGTERM (after a checkpoint), on a judge that stays down (after a checkpoint) or at
``trainer.max_minutes``; end with the final evaluation, the exported policy and the
run's plots."""

from __future__ import annotations

import logging
import math
import resource
import signal
import sys
import threading
import time
from pathlib import Path

from mmyatt.checkpoint.checkpointer import Checkpointer
from mmyatt.config.schema import RunConfig
from mmyatt.distributed import Dist
from mmyatt.engines.megatron_group import MirrorCheckpointer
from mmyatt.outputs.samples import save_samples
from mmyatt.report.plots import save_run_plots
from mmyatt.serving.client import JudgeError
from mmyatt.step.summary import red

logger = logging.getLogger("mmyatt.run")


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
