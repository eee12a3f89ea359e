"""The placement bench's arithmetic on measured arms: each mode's figures averaged over
rounds (``combine_rounds``), and the acceptance ratios with their round-by-round spread
(``derive_ratios``, ``paired_ratio``). Runs nothing; ``mmyatt.placement.bench`` measures."""

from __future__ import annotations

import math
import statistics
from collections import Counter

from mmyatt.placement.balance import CostWeights, imbalance, karmarkar_karp, sample_cost

MODES = ("shared", "colocate", "partial", "auto")
JUDGED = ("judge_heavy", "judge_comparable")  # the workloads with a GenRM judge
DRIFTING = ("drifting", "drifting_judge")  # two segments each, the second resumed

# an arm's scalar figures that combine_rounds averages over rounds
ROUND_MEANS = (
    "cpu_util",
    "rollout_s",
    "judge_reload_s",
    "peak_rss_mb",
    "response_length_mean",
    "response_truncated_frac",
)


def combine_rounds(per_round: dict[str, list], wl: str) -> dict:
    """Each mode's arms: the last round's details (modes run, auto's predictions), with
    every figure averaged over rounds: the step figure, the rollout phase, CPU use,
    reload time, peak memory (each run's peak), lengths, phase times, idle fractions."""
    key = "total_s" if wl in DRIFTING else "step_s"
    out = {}
    for mode, arms in per_round.items():
        if not arms:
            continue
        vals = [a[key] for a in arms]
        out[mode] = {**arms[-1], key: statistics.fmean(vals), f"{key}_per_round": vals}
        for k in ROUND_MEANS:
            if k in arms[-1]:
                out[mode][k] = mean_of_numbers([a.get(k) for a in arms])
                out[mode][f"{k}_per_round"] = [a.get(k) for a in arms]
        for group in ("phase_s", "idle_frac", "peak_rss_mb_by_phase"):
            if group in arms[-1]:
                out[mode][group] = {
                    k: mean_of_numbers([a[group].get(k) for a in arms]) for k in arms[-1][group]
                }
        out[mode]["modes_run_per_round"] = [
            a.get("modes_run") or a.get("segment_long", {}).get("modes_run") for a in arms
        ]
        for seg in (k for k in arms[-1] if k.startswith("segment_")):  # drifting
            per = [a[seg]["step_s"] for a in arms]
            out[mode][seg] = {
                **arms[-1][seg],
                "step_s": statistics.fmean(per),
                "step_s_per_round": per,
                "modes_run_per_round": [a[seg]["modes_run"] for a in arms],
            }
    return out


def _ratio(phase_s: dict) -> float | None:
    judge, gen = phase_s.get("judge_busy_s"), phase_s.get("gen_s")
    ok = isinstance(judge, int | float) and isinstance(gen, int | float) and gen > 0
    return judge / gen if ok else None


def mean_of_numbers(vals: list) -> float | None:
    vals = [v for v in vals if isinstance(v, int | float)]
    return statistics.fmean(vals) if vals else None


# two-sided 95% quantiles of Student's t by degrees of freedom (beyond the table: t95)
T95 = {
    1: 12.706,
    2: 4.303,
    3: 3.182,
    4: 2.776,
    5: 2.571,
    6: 2.447,
    7: 2.365,
    8: 2.306,
    9: 2.262,
    10: 2.228,
    11: 2.201,
    12: 2.179,
    13: 2.160,
    14: 2.145,
    15: 2.131,
}


def t95(df: int) -> float:
    """The two-sided 95% quantile of Student's t: the table, else the Cornish-Fisher
    expansion about the normal's 1.96 (within 0.001 from 16 degrees of freedom on)."""
    if df in T95:
        return T95[df]
    z = 1.959964
    return z + (z**3 + z) / (4 * df) + (5 * z**5 + 16 * z**3 + 3 * z) / (96 * df**2)


def paired_ratio(num: list[float], den: list[float]) -> dict:
    """A ratio measured round by round: the arms of one round ran one after another, so
    they shared the machine's load of those minutes, and ``num[k] / den[k]`` cancels
    what moved between rounds. Returns the per-round ratios, their geometric mean and a
    95% interval for it (Student's t on the logs; None with fewer than two rounds). An
    interval that holds a goal says these rounds cannot tell whether it was met."""
    ratios = [a / b for a, b in zip(num, den, strict=True)]
    logs = [math.log(r) for r in ratios]
    mean = statistics.fmean(logs)
    out = {"per_round": ratios, "geo_mean": math.exp(mean), "ci95": None}
    if len(logs) >= 2:
        half = t95(len(logs) - 1) * statistics.stdev(logs) / math.sqrt(len(logs))
        out["ci95"] = [math.exp(mean - half), math.exp(mean + half)]
    return out


FIXED = ("shared", "colocate", "partial")


def _auto_over_best(out: dict, wl: str, key: str, name: str) -> tuple[str, dict]:
    """The best fixed mode of ``wl`` by its mean ``key`` (``best_fixed_<wl>``), auto's
    ratio to it (``name``) with the paired rounds (``<name>_rounds``); returns the best
    mode and every mode's mean."""
    v = {m: out[wl][m][key] for m in MODES}
    best = min(FIXED, key=lambda m: v[m])
    out[f"best_fixed_{wl}"] = best
    out[name] = v["auto"] / v[best]
    out[f"{name}_rounds"] = paired_ratio(
        out[wl]["auto"][f"{key}_per_round"], out[wl][best][f"{key}_per_round"]
    )
    return best, v


def derive_ratios(out: dict) -> None:
    """The acceptance ratios from whatever workloads the JSON holds: each a ratio of the
    modes' means over rounds, with its round-by-round spread in ``<key>_rounds``."""
    for wl in JUDGED + ("rollout_heavy",):
        if not all(m in out.get(wl, {}) for m in MODES):
            continue
        best, s = _auto_over_best(out, wl, "step_s", f"auto_over_best_{wl}")
        per = {m: out[wl][m].get("step_s_per_round") for m in MODES}
        # auto's choice: the mode it ran in most measured steps over all rounds (a
        # re-evaluation may measure another plan for a few steps, even the last ones)
        runs = out[wl]["auto"].get("modes_run_per_round") or [out[wl]["auto"]["modes_run"]]
        ran = Counter(m for r in runs for m in r)
        out[f"auto_choice_{wl}"] = ran.most_common(1)[0][0]
        out[f"auto_steps_per_mode_{wl}"] = dict(ran)
        out[f"auto_last_mode_{wl}"] = out[wl]["auto"]["modes_run"][-1]
        out[f"auto_picked_best_fixed_{wl}"] = out[f"auto_choice_{wl}"] == best
        placed = min(("colocate", "partial"), key=lambda m: s[m])
        out[f"auto_picked_faster_placement_{wl}"] = out[f"auto_choice_{wl}"] == placed
        out[f"peak_rss_mb_{wl}"] = {m: out[wl][m]["peak_rss_mb"] for m in MODES}
        out[f"idle_frac_{wl}"] = {m: out[wl][m]["idle_frac"] for m in MODES}
        if wl in JUDGED:
            out[f"partial_over_colocate_{wl}"] = s["partial"] / s["colocate"]
            out[f"partial_over_colocate_{wl}_rounds"] = paired_ratio(
                per["partial"], per["colocate"]
            )
            ro = {m: out[wl][m].get("rollout_s") for m in ("partial", "colocate")}
            if all(isinstance(v, float) and v > 0 for v in ro.values()):
                out[f"partial_over_colocate_rollout_{wl}"] = ro["partial"] / ro["colocate"]
            # how judge-heavy the workload is: the judge's model time over the generation
            # time, in partial (each on one core while both run) and colocate (each on all)
            out[f"judge_over_generation_s_{wl}"] = {
                m: _ratio(out[wl][m].get("phase_s") or {}) for m in ("partial", "colocate")
            }
    for wl in DRIFTING:
        if not all(m in out.get(wl, {}) for m in MODES):
            continue
        _auto_over_best(out, wl, "total_s", f"auto_over_best_fixed_{wl}")
        # the drift must change the best fixed mode: each fixed mode is slower than
        # another on at least one segment (mean s/step of the segment)
        names = [k.removeprefix("segment_") for k in out[wl]["auto"] if k.startswith("segment_")]
        seg = {name: {m: out[wl][m][f"segment_{name}"]["step_s"] for m in FIXED} for name in names}
        out[f"{wl}_best_fixed_per_segment"] = {
            name: min(FIXED, key=lambda m: v[m]) for name, v in seg.items()
        }
        out[f"{wl}_segment_step_s"] = seg
        # one best per segment: if they differ, every fixed mode is slower on a segment
        out[f"{wl}_best_fixed_changes"] = len(set(out[f"{wl}_best_fixed_per_segment"].values())) > 1


def balance_report(P: int = 4, per: int = 32) -> dict:
    """Max/mean rank work (cost-model units) before and after Karmarkar-Karp on a skewed
    step: rank r's completions are r + 1 times longer, rank 3's samples carry 256 vision
    tokens each, and a flow step whose ranks train 2 to 8 denoising transitions."""
    import random

    rng = random.Random(0)
    w = CostWeights(text_token=1.0, vision_token=1.0, transition=100.0)
    vlm = [
        sample_cost(rng.randint(8, 64) * (r + 1), 256 if r == 3 else 0, 0, w)
        for r in range(P)
        for _ in range(per)
    ]
    flow = [sample_cost(16, 0, 2 * (r + 1), w) for r in range(P) for _ in range(per)]
    out = {}
    for name, costs in (("text_vision", vlm), ("flow", flow)):
        before = [list(range(r * per, (r + 1) * per)) for r in range(P)]
        after = karmarkar_karp(costs, P)
        out[name] = {
            "ranks": P,
            "samples_per_rank": per,
            "max_over_mean_before": imbalance(costs, before),
            "max_over_mean_after": imbalance(costs, after),
        }
    return out
