"""The benchmark tables of BENCHMARKS.md as the committed files under ``results/bench/``
(and the placement and GPU folders) give them. Part of ``tests/results_tables.py``."""

from __future__ import annotations

import re

from results_common import ARROW, RESULTS, Rows, load, ratio_ci, times


def genrm_rows() -> Rows:
    g, res = load("bench/genrm.json"), "results/bench/genrm.json"
    a, m = g["new"], g["model_only"]
    out: Rows = {
        "this revision's server and client, best of 5 rounds": [
            f"{a['req_per_s_1']:.1f}",
            f"{a['req_per_s_32']:.1f}",
            f"{100 * a['server_overhead_1_by_server_model']:.1f}%",
            res,
        ],
        "the judge's model alone, best of 5 rounds": [
            f"{1000 / m['model_ms_1']:.1f}",
            f"{m['model_req_per_s_32']:.1f}",
            "-",
            res,
        ],
    }
    s, res = load("genrm/side_by_side.json"), "results/genrm/side_by_side.json"
    n = len(s["pairs"])
    for arm, name in (("baseline", "before (52d040b)"), ("this", "this revision")):
        out[f"side by side: {name}, median of {n} pairs"] = [
            *(f"{s[f'{arm}_median_req_per_s_{k}']:.1f}" for k in ("1", "32")),
            "-",
            res,
        ]
    ratios = [
        f"{s[f'median_ratio_{k}']:.2f} ({min(r[f'ratio_{k}'] for r in s['pairs']):.2f}-"
        f"{max(r[f'ratio_{k}'] for r in s['pairs']):.2f})"
        for k in ("1", "32")
    ]
    out[f"side by side: this revision / before, median of {n} pairs (range)"] = [
        *ratios,
        "-",
        res,
    ]
    return out


MODES = ("shared", "colocate", "partial", "auto")


def placement_row(f: str, wl: str, figure: str) -> list[str | None]:
    d = load(f)
    arms = d[wl]
    po = d.get(f"partial_over_colocate_{wl}")
    key = ("auto_over_best_fixed_" if wl.startswith("drifting") else "auto_over_best_") + wl
    return [
        str(d.get("controllers", 2)),
        str(arms["rounds"]),
        *(f"{arms[m][figure]:.{3 if figure == 'step_s' else 2}f}" for m in MODES),
        ratio_ci(po, d[f"partial_over_colocate_{wl}_rounds"]["ci95"]) if po is not None else "-",
        ratio_ci(d[key], d[key + "_rounds"]["ci95"]),
        f"results/{f}",
    ]


def placement_rows() -> Rows:
    main = "bench/placement.json"
    out = {
        "judge-heavy (16-token judge), s/step": placement_row(main, "judge_heavy", "step_s"),
        "judge about as costly as generation (4-token judge), s/step": placement_row(
            main, "judge_comparable", "step_s"
        ),
        "rollout-heavy (rule reward, no judge), s/step": placement_row(
            main, "rollout_heavy", "step_s"
        ),
        "the judge joins after 15 steps, s per run": placement_row(
            main, "drifting_judge", "total_s"
        ),
        "completions grow to the cap after 15 steps, s per run": placement_row(
            main, "drifting", "total_s"
        ),
        "the judge joins after 40 steps, s per run": placement_row(
            "placement/drifting_judge_40_steps_resumed.json", "drifting_judge", "total_s"
        ),
        "judge-heavy, one controller, s/step": placement_row(
            "placement/one_controller.json", "judge_heavy", "step_s"
        ),
    }
    for tag, run in (("", "a"), ("_b", "b"), ("_c", "c")):
        out[f"4-token judge, one controller, s/step (run {run})"] = placement_row(
            f"placement/one_controller_comparable{tag}.json", "judge_comparable", "step_s"
        )
    return out


def placement_option_rows() -> Rows:
    main = load("bench/placement.json")
    mem, bal = main["judge_memory"]["policy_25m"], main["balance_run"]
    od = load("placement/over_dispatch_redraw_long_tail.json")["over_dispatch_run"]
    sim = load("bench/placement_sim.json")

    def ci(key: str) -> str:
        return ratio_ci(mem[key], mem[key + "_rounds"]["ci95"])

    def geo(key: str) -> str:
        return ratio_ci(bal[key]["geo_mean"], bal[key]["ci95"], 2)

    res, res_od = (
        "results/bench/placement.json",
        "results/placement/over_dispatch_redraw_long_tail.json",
    )
    length = f"{od['1.0']['response_length_mean']:.2f} {ARROW} {od['1.5_redraw']['response_length_mean']:.2f}"
    work = f"{bal['on']['work_max_over_mean_before']:.3f} {ARROW} {bal['on']['work_max_over_mean_after']:.3f}"
    return {
        "colocate against partial, peak memory": [
            None,
            f"colocate's peak {ci('colocate_over_partial_peak_rss')} of partial's",
            res,
        ],
        "`placement.partial_release_judge: true`": [
            None,
            f"peak {ci('partial_release_over_partial_peak_rss')} of plain partial's, "
            f"{ci('partial_release_over_colocate_peak_rss')} of colocate's; "
            f"step {ci('partial_release_over_partial_step_s')}",
            res,
        ],
        "`rollout.over_dispatch_ratio: 1.5`": [
            None,
            f"step {times(od['step_ratio'])} ratio 1's, generation {times(od['generate_ratio'])}",
            res_od,
        ],
        "the same with `rollout.redraw_carried: true`": [
            None,
            f"step {times(od['redraw_step_ratio'])} ratio 1's; mean completion {length} tokens (a length bias)",
            res_od,
        ],
        "`placement.balance_when: always`": [
            None,
            f"max/mean rank work {work}; training phase {geo('train_s_on_over_off')} alone, "
            f"{geo('train_s_on_micro_over_off')} with micro-batches",
            res,
        ],
        "the simulator (`mmyatt bench placement-sim`)": [
            None,
            f"largest error {100 * sim['max_abs_error']:.1f}% over every mode and split",
            "results/bench/placement_sim.json",
        ],
    }


def checkpoint_rows() -> Rows:
    c, res = load("bench/checkpoint.json"), "results/bench/checkpoint.json"

    def rng(k: str) -> str:
        return f"{c[k + '_s']:.2f} s ({c[k + '_min_s']:.2f}-{c[k + '_max_s']:.2f})"

    return {
        "synchronous save: the step waits": [rng("sync_save"), res],
        "asynchronous save: the step waits": [rng("async_stall"), res],
        "asynchronous save: written in the background": [f"{c['async_complete_s']:.2f} s", res],
        "resume (find, load, load_state_dict)": [f"{c['resume_s']:.3f} s", res],
    }


def lora_sync_rows() -> Rows:
    d, res = load("bench/lora_sync.json"), "results/bench/lora_sync.json"

    def ms(row: dict, arm: str) -> str:
        return f"{row[arm]['seconds'] * 1e3:.1f} ms" if arm in row else "not timed"

    return {
        name: [
            None,
            f"{r['lora_bytes']:,}",
            f"{r['full_bytes']:,}",
            f"{r['bytes_ratio']:.3f}",
            ms(r, "lora_sync"),
            ms(r, "full_sync"),
            res,
        ]
        for name, r in d["models"].items()
    }


def balance_rows() -> Rows:
    d, res = load("bench/balance.json"), "results/bench/balance.json"
    names = {
        "text_skewed": "skewed text: rank 0 prompts of 20-40 terms, rank 1 of 1-2",
        "text_skewed_long": "skewed text, long prompts: rank 0 prompts of 100-200 terms, rank 1 of 1-2",
        "vlm_mixed": "images and clips: rank 0 the clips, rank 1 the images",
        "text_balanced": "balanced text: prompts of 1-40 terms on both ranks",
    }

    def geo(w: dict, key: str) -> str:
        return ratio_ci(w[key]["geo_mean"], w[key]["ci95"], 3)

    out = {}
    for wl, name in names.items():
        w = d[wl]
        on, off = w["on"], w["off"]
        out[name] = [
            str(w["rounds"]),
            geo(w, "step_s_on_over_off"),
            geo(w, "train_s_on_over_off"),
            f"{off['idle_s']:.3f} {ARROW} {on['idle_s']:.3f}",
            f"{on['applied']:.2f}",
            f"{on['predicted_s']:.3f} / {on['measured_s']:.3f}, {100 * on['model_error']:.0f}%",
            res,
        ]
        if "dispatch" in w:  # records moved before generation (placement.balance_at)
            a = w["dispatch"]
            out[f"{name}; balance_at: dispatch"] = [
                str(w["rounds"]),
                geo(w, "step_s_dispatch_over_off"),
                geo(w, "train_s_dispatch_over_off"),
                f"{off['idle_s']:.3f} {ARROW} {a['idle_s']:.3f}",
                f"every step, {a['dispatch_moved']:.1f} records",
                f"max/mean rank cost {a['dispatch_max_over_mean_before']:.2f} {ARROW} "
                f"{a['dispatch_max_over_mean_after']:.2f}",
                res,
            ]
    return out


FAULT_NAMES = {
    "kill_during_step": "SIGKILL of every process inside a step",
    "nan_reward": "NaN reward for one step",
    "kill_during_save": "SIGKILL while a checkpoint is written",
    "sigterm": "SIGTERM to every process inside a step",
    "controller_dies_rank0": "SIGKILL of controller 0 only",
    "controller_dies_rank1": "SIGKILL of controller 1 only",
    "judge_crash": "SIGKILL of the judge server",
    "judge_gone": "the judge killed for good, then a rerun",
    "corrupt_media": "10 truncated, 10 garbage, 10 missing images",
}


def fault_rows() -> Rows:
    return {
        FAULT_NAMES[s["fault"]]: [
            "yes" if s["survived"] else "no",
            str(s["records_lost"]),
            {True: "yes", False: "no"}.get(s.get("exact_weights"), "n/a"),
            "results/bench/faults.json",
        ]
        for s in load("bench/faults.json")["scenarios"]
    }


def sharding_rows() -> Rows:
    d, res = load("bench/data_sharding.json"), "results/bench/data_sharding.json"

    def mb(records: list[dict]) -> str:
        return f"{max(r['bytes_held'] for r in records) / 1e6:.1f}"

    out: Rows = {}
    for p in (1, 2, 4):
        name = "1 controller" if p == 1 else f"{p} controllers"
        out[name] = [
            mb(d[f"controllers_p{p}"]["ranks"]),
            f"{d[f'controller_peak_rss_mb_p{p}']:.0f}",
            res,
        ]
    drv = d["driver_p4"]
    out["a driver that reads everything and sends to 4 workers"] = [
        mb([drv["driver"]]),
        f"{d['driver_peak_rss_mb']:.0f}",
        res,
    ]
    out["its 4 workers"] = [mb(drv["workers"]), f"{d['worker_peak_rss_mb_p4']:.0f}", res]
    return out


def gpu_rows() -> Rows:
    eng = load("gpu_h200/engines.json")
    tail = (RESULTS / "gpu_h200/pytest_gpu_run3.txt").read_text().strip().splitlines()[-1]
    m = re.match(r"(\d+) passed, (\d+) skipped", tail)
    probe = (RESULTS / "gpu_h200/judge_release_probe.txt").read_text()
    loaded = re.search(r"loaded: allocated [\d.]+ MB, reserved ([\d.]+) MB", probe)
    slept = re.search(r"released \(sleep\): allocated [\d.]+ MB, reserved ([\d.]+) MB", probe)
    pl = load("gpu_h200/placement_judge_heavy.json")["judge_heavy"]
    res = "results/gpu_h200/engines.json"

    def engine(a: dict) -> str:
        return (
            f"rollout {a['rollout_tokens_per_s']:.0f} tokens/s, update "
            f"{a['update_tokens_per_s']:.0f} tokens/s, MFU {100 * a['update_mfu']:.1f}%, "
            f"peak {a['peak_memory_mb'] / 1000:.1f} GB"
        )

    modes = ", ".join(f"{mode} {pl[mode]['step_s']:.3f}" for mode in MODES)
    fsdp2 = f"; update {times(eng['update_speed_fsdp2_over_replica'])} replica's"
    return {
        "`pytest -m gpu tests/test_gpu.py tests/test_gpu_engines.py`": [
            f"{m.group(1)} passed, {m.group(2)} skipped (2 GPUs; vLLM)",
            "results/gpu_h200/pytest_gpu_run3.txt",
        ],
        "`mmyatt bench engines`: HF generate, replica update": [
            engine(eng["arms"]["hf_replica"]),
            res,
        ],
        "the same, FSDP2 update on one GPU": [engine(eng["arms"]["hf_fsdp2"]) + fsdp2, res],
        "Qwen2-VL (1.77 B), HF generate, FSDP2 update, images": [engine(eng["vlm_fsdp2"]), res],
        "a released judge (`POST /sleep`), 25 M parameters": [
            f"reserved {loaded.group(1)} MB {ARROW} {slept.group(1)} MB",
            "results/gpu_h200/judge_release_probe.txt",
        ],
        "placement, judge-heavy, policy and judge on one GPU": [
            f"{modes} s/step; partial / colocate {pl['partial']['step_s'] / pl['colocate']['step_s']:.2f}",
            "results/gpu_h200/placement_judge_heavy.json",
        ],
    }


ASYNC_CASES = {
    "genrm_remote": "image GenRM, judge +{ms} ms",
    "genrm_local": "image GenRM, local judge",
    "text": "text GRPO",
}


def async_rows() -> Rows:
    a, res = load("bench/async.json"), "results/bench/async.json"
    out: Rows = {}
    for case, c in a["cases"].items():
        steps = c.get("steps") or (a["text_steps"] if case == "text" else a["steps"])
        for arm in ("sync", "one_step_off"):
            x = c[arm]
            r = x["eval_reward_end"]
            name = ASYNC_CASES[case].format(ms=round(a["latency_s"] * 1000))
            label = f"sync ({c['sync_placement']})" if arm == "sync" else arm
            out[f"{name}: {label}"] = [
                str(steps),
                f"{r['mean']:.3f} ({r['min']:.3f}-{r['max']:.3f})",
                f"{x['train_s']['mean']:.1f}",
                f"{x['wall_s']['mean']:.1f}",
                times(c["train_ratio_async_over_sync"]) if arm != "sync" else "-",
                times(c["wall_ratio_async_over_sync"]) if arm != "sync" else "-",
                f"{x['idle_core_share']['mean']:.2f}",
                res,
            ]
    return out
