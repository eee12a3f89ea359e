"""A discrete-event model of one RL step under each placement mode.

Resources are ``units`` (CPU cores here, GPUs at scale). Rollout is P controllers, each
generating its chunks (prompt groups) one after another; while more controllers are
active than rollout units, they share them (processor sharing). Every finished chunk
joins the judge's queue (partial) or waits for the judge phase (colocate). The judge
serves whatever is queued as one batch (dynamic batching, up to ``judge_batch``
chunks) on its units. Training takes every unit for ``train_s``.

- colocate: rollout on all units; all wait for the slowest controller (the long tail);
  the judge reloads its weights (``reload_s``) and scores every chunk on all units.
- partial(r, j): rollout on r units and the judge on j at once, chunks streamed.
- shared: rollout on all units, nothing pinned; each controller sends its samples when
  its whole batch is done (no barrier), the judge serves them on its own
  ``shared_judge_units`` (its configured threads) while a slower controller may still
  generate.

Costs (``Profile``) are core-seconds per chunk of generation (one value per chunk, so a
measured length distribution enters through them) and per sample of judging, with a
parallel efficiency for the judge on more than one unit. ``calibrate`` reads them from
a ``mmyatt bench placement`` JSON; ``bench_placement_sim`` compares predictions with the
measured step times there and predicts 8 to 1024 GPUs, for the synchronous modes and for
rollouts made one step ahead on their own units (:func:`simulate_one_step_off`).
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field, replace
from pathlib import Path

from mmyatt.bench.registry import RESULTS
from mmyatt.bench.runs import machine


@dataclass
class Profile:
    chunk_gen_s: list[list[float]]  # per controller, core-seconds of each streamed chunk
    samples_per_chunk: int
    judge_sample_s: float  # core-seconds per judged sample on one unit
    judge_eff: float = 1.0  # speed-up per extra judge unit (1 = linear)
    reload_s: float = 0.0
    train_s: float = 0.0
    rest_s: dict = field(default_factory=dict)  # mode -> fixed per-step overhead
    judge_batch: int = 64  # chunks per judge batch
    batch_gen_s: list[list[float]] | None = None  # colocate, shared: one batch per controller
    shared_judge_units: int = 1  # shared: the judge's own threads (reward.judge.threads)
    train_by_mode: dict = field(default_factory=dict)  # mode -> train_s where it differs


@dataclass
class Result:
    step_s: float
    idle_frac_rollout: float  # of the rollout units, over generate + score
    idle_frac_judge: float  # of the judge units, over generate + score


def _judge_speed(units: int, eff: float) -> float:
    return 1.0 + (units - 1) * eff if units > 0 else 0.0


def _rollout(chunks: list[list[float]], units: int, on_done=None) -> float:
    """Processor sharing of P controllers over ``units``; calls on_done(t, i) for each
    chunk of controller i as it finishes. Returns when the last controller is done."""
    pos = [0] * len(chunks)
    left = [c[0] if c else 0.0 for c in chunks]
    t = 0.0
    while True:
        active = [i for i in range(len(chunks)) if pos[i] < len(chunks[i])]
        if not active:
            return t
        rate = min(1.0, units / len(active))
        dt = min(left[i] for i in active) / rate
        t += dt
        for i in active:
            left[i] -= dt * rate
            if left[i] <= 1e-12:
                if on_done is not None:
                    on_done(t, i)
                pos[i] += 1
                left[i] = chunks[i][pos[i]] if pos[i] < len(chunks[i]) else 0.0


def _judge(arrivals: list[float], p: Profile, units: int) -> tuple[float, float]:
    """FIFO dynamic batching: (finish time, busy seconds) for chunks arriving at times."""
    per_chunk = p.judge_sample_s * p.samples_per_chunk / _judge_speed(units, p.judge_eff)
    t, busy, i = 0.0, 0.0, 0
    arrivals = sorted(arrivals)
    while i < len(arrivals):
        t = max(t, arrivals[i])
        n = 0
        while i < len(arrivals) and arrivals[i] <= t and n < p.judge_batch:
            i += 1
            n += 1
        t += per_chunk * n
        busy += per_chunk * n
    return t, busy


def simulate(p: Profile, mode: str, units: int, rollout: int = 0, judge: int = 0) -> Result:
    has_judge = p.judge_sample_s > 0
    rest = p.rest_s.get(mode, 0.0)
    train = p.train_by_mode.get(mode, p.train_s)
    n = sum(len(c) for c in p.chunk_gen_s)
    if mode == "shared":
        batches = p.batch_gen_s or p.chunk_gen_s
        gen_work = sum(sum(c) for c in batches)
        done: dict[int, float] = {}
        gen = _rollout(batches, units, lambda t, i: done.__setitem__(i, t))
        # each controller's chunks reach the judge when its whole batch is done
        arrivals = [done[i] for i, c in enumerate(p.chunk_gen_s) for _ in c]
        if has_judge:
            jt, jb = _judge(arrivals, p, p.shared_judge_units)
        else:
            jt, jb = gen, 0.0
        collect = max(gen, jt)
        r_units = units
    elif mode == "colocate":
        batches = p.batch_gen_s or p.chunk_gen_s
        gen_work = sum(sum(c) for c in batches)
        gen = _rollout(batches, units)
        jt, jb = _judge([0.0] * n, p, units) if has_judge else (0.0, 0.0)
        collect = gen + (p.reload_s if has_judge else 0.0) + jt
        r_units = units
    else:
        gen_work = sum(sum(c) for c in p.chunk_gen_s)
        times: list[float] = []
        gen = _rollout(p.chunk_gen_s, rollout, lambda t, i: times.append(t))
        jt, jb = _judge(times, p, judge) if has_judge else (gen, 0.0)
        collect = max(gen, jt)
        r_units = rollout
    idle_r = 1.0 - gen_work / (r_units * collect) if collect else 0.0
    idle_j = 1.0 - jb / collect if collect and has_judge else 1.0
    return Result(collect + rest + train, idle_r, idle_j)


def simulate_one_step_off(p: Profile, units: int, rollout: int) -> Result:
    """Rollouts made one step ahead (``trainer.async.mode=one_step_off``) on a machine
    split in two: ``rollout`` units generate step t+1's batch and judge it (colocated
    there: generation, the judge's reload, judging) while the other ``units - rollout``
    update on step t's. The step lasts as long as the slower side. Training is
    ``train_s`` of work on all ``units`` and scales with the units it gets; the weight
    sync between the sides is not modelled (it is the same transfer a colocated run's
    rollout engine receives)."""
    if not 0 < rollout < units:
        raise ValueError(f"one_step_off needs 0 < rollout units < {units}, got {rollout}")
    side = simulate(replace(p, train_s=0.0, train_by_mode={}, rest_s={}), "colocate", rollout)
    train = p.train_s * units / (units - rollout)
    return Result(max(side.step_s, train), side.idle_frac_rollout, side.idle_frac_judge)


# ------------------------------------------------------------------ calibration


def finish_fractions(n: int, mean: float, truncated: float, cap: int) -> list[float]:
    """When each of a batch's ``n`` samples finishes, as a fraction of the batch's decode
    time, in order: lengths geometric (a stop token or string ends a completion with the
    same chance at every token) with the measured share ``truncated`` running to ``cap``
    tokens (else the measured ``mean``), taken at the quantiles (k - 1/2) / n; the batch
    decodes until its longest sample stops."""
    import math

    if 0.0 < truncated < 1.0:
        q = truncated ** (1.0 / cap)  # P(length > cap) = q ** cap
    else:
        q = 1.0 - 1.0 / max(mean, 1.0)
    lengths = [min(cap, max(1.0, math.log(1.0 - (k + 0.5) / n) / math.log(q))) for k in range(n)]
    return [x / lengths[-1] for x in lengths]


def calibrate(
    measured: dict, workload: str, controllers: int = 2, stream_samples: bool | None = None
) -> Profile:
    """A profile from a placement bench JSON. Per-role costs come from the arms that
    ran each role in that shape: batched generation from colocate (one core per
    controller), chunked generation from partial (the controllers shared one core, so
    one controller's core-seconds are half its wall time), the judge's per-sample cost
    on one core from partial and its 1 -> 2 core speed-up from colocate, reload from
    colocate; the training phase from colocate for colocate (it carries the judge's
    release), from partial for partial and shared. Shared mode reuses these: batched
    generation from colocate, the judge on its one thread (reward.judge.threads, as the
    bench runs it) at partial's per-sample cost. Nothing is fitted to step times, and
    nothing is read from the shared arm: what the simulator adds
    is how the phases compose (series, barrier, streaming overlap, queueing), and
    every overhead it does not model shows up as error. With ``stream_samples`` (by
    default: where partial streamed each sample as it finished, ``streaming`` in the
    JSON), partial's chunks are single samples arriving at :func:`finish_fractions` of
    the measured lengths; else chunks of ``stream_groups`` prompt groups. Partial's judge
    takes every core once generation is done (placement.widen_judge); the simulator
    keeps it on its share, so the per-sample cost read from partial is an effective one
    that folds those widened calls in."""
    arms = measured[workload]
    colo, part = arms["colocate"], arms["partial"]
    prompts = 8 // controllers
    samples = prompts * 8
    k = int(measured.get("stream_groups", 1))  # prompt groups per streamed chunk
    chunks = max(1, prompts // k)
    core_s = part["phase_s"]["gen_s"] / controllers  # one controller on a shared core
    judge1 = part["phase_s"]["judge_busy_s"] or 0.0
    judge2 = colo["phase_s"]["judge_busy_s"] or 0.0
    has_judge = judge1 > 0 and workload != "rollout_heavy"
    per_chunk = [core_s / chunks] * chunks
    if stream_samples is None:
        stream_samples = "each sample" in str(measured.get("streaming", ""))
    if stream_samples and has_judge:
        at = finish_fractions(
            samples,
            part.get("response_length_mean") or 1.0,
            part.get("response_truncated_frac") or 0.0,
            int(measured.get("max_new_tokens", 48)),
        )
        per_chunk = [core_s * (b - a) for a, b in zip([0.0, *at[:-1]], at)]
        chunks = samples
    return Profile(
        chunk_gen_s=[list(per_chunk) for _ in range(controllers)],
        batch_gen_s=[[colo["phase_s"]["gen_s"]] for _ in range(controllers)],
        samples_per_chunk=samples // chunks,
        judge_sample_s=judge1 / (samples * controllers) if has_judge else 0.0,
        judge_eff=max(0.0, judge1 / judge2 - 1.0) if has_judge and judge2 else 1.0,
        reload_s=colo.get("judge_reload_s") or 0.0,
        train_s=colo["phase_s"]["train_s"],
        shared_judge_units=int(measured.get("shared_judge_threads", 1)),
        train_by_mode={"partial": part["phase_s"]["train_s"], "shared": part["phase_s"]["train_s"]},
    )


def _shown(path: Path) -> str:
    """The measured file as the result names it: relative to the checkout when inside it,
    so a committed result holds no path of the machine it was made on."""
    try:
        return str(path.resolve().relative_to(RESULTS.parents[1]))
    except ValueError:
        return path.name


def bench_placement_sim(quick: bool = False, measured_path: str | Path | None = None) -> dict:
    path = Path(measured_path or RESULTS / "placement.json")
    if not path.is_file():
        raise FileNotFoundError(f"{path}: run `mmyatt bench placement --out {path}` first")
    measured = json.loads(path.read_text())
    out: dict = {"benchmark": "placement-sim", "machine": machine(), "measured": _shown(path)}
    rows = []
    controllers = int(measured.get("controllers", 2))  # the bench's --set distributed.nproc
    for wl in ("judge_heavy", "judge_comparable", "rollout_heavy"):
        if wl not in measured:
            continue
        prof = calibrate(measured, wl, controllers)
        for mode, r, j in (("shared", 2, 2), ("colocate", 2, 2), ("partial", 1, 1)):
            if mode not in measured[wl]:
                continue
            pred = simulate(prof, mode, 2, r, j).step_s
            real = measured[wl][mode]["step_s"]
            rows.append(
                {
                    "workload": wl,
                    "mode": mode,
                    "split": "all (unpinned)" if mode == "shared" else f"{r}:{j}",
                    "predicted_step_s": pred,
                    "measured_step_s": real,
                    "error": pred / real - 1.0,
                }
            )
    out["validation"] = rows
    out["max_abs_error"] = max(abs(r["error"]) for r in rows)
    # at scale: chunks of prompt groups (8 per GPU), the measured cost per sample
    out["at_scale"] = at_scale(calibrate(measured, "judge_heavy", stream_samples=False), quick)
    return out


def at_scale(base: Profile, quick: bool) -> list[dict]:
    """Weak scaling: 8 groups of 8 samples per GPU, heavy-tailed lengths (lognormal chunk
    costs around the measured mean), the measured judge/generate cost ratio."""
    rng = random.Random(0)
    mean_chunk = sum(base.chunk_gen_s[0]) / len(base.chunk_gen_s[0]) / 1.6487  # e^0.5
    judge_chunk = base.judge_sample_s * base.samples_per_chunk
    out = []
    for gpus in (8, 64, 256, 1024) if not quick else (8, 64):
        chunks = [
            [mean_chunk * rng.lognormvariate(-0.5, 1.0) for _ in range(8)] for _ in range(gpus)
        ]
        prof = Profile(
            chunk_gen_s=chunks,
            samples_per_chunk=base.samples_per_chunk,
            judge_sample_s=judge_chunk / base.samples_per_chunk,
            judge_eff=1.0,  # a GPU judge replica per device: linear
            reload_s=base.reload_s,
            train_s=base.train_s,
            judge_batch=8 * gpus,
        )
        colo = simulate(prof, "colocate", gpus)
        row: dict = {
            "gpus": gpus,
            "colocate_step_s": colo.step_s,
            "colocate_idle_frac_rollout": colo.idle_frac_rollout,
            "colocate_idle_frac_judge": colo.idle_frac_judge,
        }
        best = None
        for frac in (0.5, 0.75, 0.875):
            r = max(1, int(gpus * frac))
            res = simulate(prof, "partial", gpus, r, gpus - r)
            row[f"partial_{r}:{gpus - r}_step_s"] = res.step_s
            row[f"partial_{r}:{gpus - r}_idle_frac_rollout"] = res.idle_frac_rollout
            row[f"partial_{r}:{gpus - r}_idle_frac_judge"] = res.idle_frac_judge
            if best is None or res.step_s < best[1]:
                best = (f"{r}:{gpus - r}", res.step_s)
        row["best_partial_split"] = best[0]
        row["partial_over_colocate"] = best[1] / row["colocate_step_s"]
        ahead = None  # rollouts one step ahead on their own units, the update on the rest
        for frac in (0.25, 0.5, 0.75):
            r = max(1, int(gpus * frac))
            step = simulate_one_step_off(prof, gpus, r).step_s
            row[f"one_step_off_{r}:{gpus - r}_step_s"] = step
            if ahead is None or step < ahead[1]:
                ahead = (f"{r}:{gpus - r}", step)
        row["best_one_step_off_split"] = ahead[0]
        row["one_step_off_over_colocate"] = ahead[1] / row["colocate_step_s"]
        # a single controller holds every sample's media: 512 x 512 RGB images, uint8
        row["single_controller_driver_media_gb"] = gpus * 64 * 512 * 512 * 3 / 1e9
        row["per_controller_media_gb"] = 64 * 512 * 512 * 3 / 1e9
        out.append(row)
    return out
