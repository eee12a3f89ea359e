"""What README's and BENCHMARKS' headline tables hold, as the committed files under
``results/`` give it: each table's header and, for each row, the text of each figure cell
(``None`` marks a label cell: command, split, machine, date). Checked by
``tests/test_results_tables.py``."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "results"
ARROW = "→"
Rows = dict[str, list[str | None]]  # row name -> cells after the first, in header order

# ---------------------------------------------------------------------------- data


def load(rel: str):
    return json.loads((RESULTS / rel).read_text())


def run_dir(name: str) -> tuple[dict, list[dict]]:
    """A recipe run kept under results/recipes/NAME: its summary and eval rows."""
    d = RESULTS / "recipes" / name
    rows = [json.loads(x) for x in (d / "eval.jsonl").read_text().splitlines() if x.strip()]
    return json.loads((d / "summary.json").read_text()), rows


def change(a: float, b: float) -> str:
    return f"{a:.3f} {ARROW} {b:.3f} ({b - a:+.3f})"


def times(x: float, d: int = 2) -> str:
    return f"{x:.{d}f}x"


def ratio_ci(r: float, ci: list[float], d: int = 3) -> str:
    return f"{r:.{d}f} ({ci[0]:.2f}-{ci[1]:.2f})"


def first_last(summary: dict, key: str) -> tuple[float, float]:
    m = summary["metrics"][key]
    return m["first"], m["last"]


def recipe(name: str, judged: str, check: str, label: str, ratio: bool) -> list[str | None]:
    s, ev = run_dir(name)
    minutes = [r for r in ev if "train/minutes" in r][-1]["train/minutes"]
    bg = s["metrics"]["eval/quality/background_hf"]["ratio"] if ratio else None
    return [
        None,
        change(*first_last(s, judged)),
        f"{label} " + change(*first_last(s, check)),
        times(bg) if ratio else "-",
        f"{s['steps_done']}/{s['steps_planned']}",
        f"{minutes:.1f}",
        None,
        f"results/recipes/{name}/",
    ]


# ---------------------------------------------------------------------------- rows


def demo_readme() -> Rows:
    s, _ = run_dir("demo")

    def row(key: str) -> list[str | None]:
        a, b = first_last(s, key)
        return [f"{a:.3f}", f"{b:.3f}", f"{b - a:+.3f}"]

    a, b = first_last(s, "eval/quality/background_hf")
    return {
        "judged, held-out (`eval/reward/mean`)": row("eval/heldout/reward/genrm"),
        "judged, seen": row("eval/seen/reward/genrm"),
        "independent critic, held-out": row("eval/heldout/reward/shape_critic"),
        "rule check, held-out": row("eval/heldout/reward/prompt_alignment_rule"),
        "background texture": [f"{a:.4f}", f"{b:.4f}", times(b / a) + " the base's"],
    }


README_RECIPES = (
    "text_grpo_tiny vlm_grpo_image_tiny vlm_grpo_video_tiny vlm_genrm_tiny flow_grpo_tiny "
    "flow_grpo_genrm_tiny flow_nft_tiny flow_nft_pairwise_tiny flow_grpo_video_tiny"
).split()


def recipes_readme() -> Rows:
    """Label cells only; the one figure (DiffusionNFT's share of Flow-GRPO's time) is the
    only decimal allowed in them."""
    frac = load("recipes/nft_vs_flow_grpo.json")[1]["reaches_baseline_final"]
    rows: Rows = {f"`configs/{n}.yaml`": [None] * 3 for n in README_RECIPES}
    rows["`configs/flow_nft_genrm_tiny.yaml` (`make demo`)"] = [None] * 3
    # a fourth entry for three cells: not a cell, a figure the label cells may hold
    rows["`configs/flow_nft_tiny.yaml`"] = [None] * 3 + [
        f"{frac['fraction_of_baseline_minutes']:.3f}x"
    ]
    return rows


def recipe_rows() -> Rows:
    out = {
        "`flow_nft_genrm_tiny.yaml` (`make demo`)": recipe(
            "demo", "eval/heldout/reward/genrm", "eval/heldout/reward/shape_critic", "critic", True
        )
    }
    for d in sorted((RESULTS / "recipes").glob("vlm_genrm_seed*")):
        name = f"`vlm_genrm_tiny.yaml`, seed {d.name.removeprefix('vlm_genrm_seed')}"
        check = "eval/heldout/reward/describe_check"
        out[name] = recipe(d.name, "eval/heldout/reward/genrm", check, "`describe_check`", False)
    runs = load("recipes/nft_vs_flow_grpo.json")
    for name, run in (
        ("`flow_nft_tiny.yaml` (DiffusionNFT)", runs[1]),
        ("`flow_grpo_tiny.yaml` (Flow-GRPO)", runs[0]),
    ):
        a, b = run["evals"][0], run["evals"][-1]
        out[name] = [
            None,
            "rule " + change(a["heldout"], b["heldout"]),
            "critic " + change(a["critic_heldout"], b["critic_heldout"]),
            times(b["background_ratio"]),
            f"{int(run['steps_done'])}",
            f"{run['train_minutes']:.1f}",
            None,
            "results/recipes/nft_vs_flow_grpo.json",
        ]
    return out


def trl_rows() -> Rows:
    out: Rows = {}
    for name, f in (
        ("run 1", "trl/side_by_side_quiet3.json"),
        ("run 2", "trl/side_by_side_quiet4.json"),
    ):
        d = load(f)
        ratios = []
        for arm in ("1x2", "2x1"):
            per = d[f"ratio_mmyatt_{arm}_over_trl_per_round"]
            r = d[f"ratio_mmyatt_{arm}_over_trl"]
            ratios.append(f"{r:.2f}x ({min(per):.2f}-{max(per):.2f})")
        out[name] = [
            str(len(d["ratio_mmyatt_1x2_over_trl_per_round"])),
            *(
                f"{d[k]:.1f}"
                for k in (
                    "samples_per_s_trl_2threads",
                    "samples_per_s_mmyatt_1x2",
                    "samples_per_s_mmyatt_2x1",
                )
            ),
            *ratios,
            None,
            f"results/{f}",
        ]
    return out


def step_rows() -> Rows:
    t, f = load("bench/text_grpo.json"), load("bench/flow_grpo.json")
    out: Rows = {}
    for arm, name in (
        ("1proc", "1 controller x 1 thread"),
        ("1proc_2threads", "1 controller x 2 threads"),
        ("2proc", "2 controllers x 1 thread"),
    ):
        out[f"text-grpo: {name}"] = [
            f"{t[f'samples_per_s_{arm}']:.1f} samples/s",
            f"{t[f'step_s_{arm}']:.2f}",
            "results/bench/text_grpo.json",
        ]
    for arm, name in (
        ("full", "full trajectory (20 steps, all trained)"),
        ("reduced", "10 denoising steps, all trained"),
        ("window", "10 steps, a 2-step window trained"),
    ):
        a = f[arm]
        thr = f"{a['sampling_images_per_s']:.1f} sampled, {a['training_images_per_s']:.1f} trained images/s"
        out[f"flow-grpo: {name}"] = [thr, f"{a['iteration_s']:.2f}", "results/bench/flow_grpo.json"]
    return out


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
        for arm in ("sync", "one_step_off"):
            x = c[arm]
            r = x["eval_reward_end"]
            name = ASYNC_CASES[case].format(ms=round(a["latency_s"] * 1000))
            label = f"sync ({c['sync_placement']})" if arm == "sync" else arm
            out[f"{name}: {label}"] = [
                f"{r['mean']:.3f} ({r['min']:.3f}-{r['max']:.3f})",
                f"{x['train_s']['mean']:.1f}",
                f"{x['wall_s']['mean']:.1f}",
                times(c["train_ratio_async_over_sync"]) if arm != "sync" else "-",
                f"{x['idle_core_share']['mean']:.2f}",
                res,
            ]
    return out


def spread(mean: float, lo: float, hi: float) -> str:
    return f"{mean:+.3f} ({lo:+.3f} to {hi:+.3f})"


def seeded_rows() -> Rows:
    """Recipes over three seeds on the test split: gains from step 0 to the last step,
    the mean and the seeds' range."""
    vlm = load("vlm_genrm/clip_words.json")["test"]["summary"]

    def g(d: dict, key: str) -> str:
        return spread(d[key]["mean"], d[key]["min"], d[key]["max"])

    p = vlm["parse_rate_last_eval"]
    out: Rows = {
        "`vlm_genrm_tiny.yaml`": [
            None,
            g(vlm, "judged_heldout_gain"),
            f"images {g(vlm, 'check_heldout_images_gain')}; "
            f"clips {g(vlm, 'check_heldout_clips_gain')}",
            f"parse at the last eval {p['mean']:.3f} ({p['min']:.3f}-{p['max']:.3f})",
            "150/150",
            "results/vlm_genrm/clip_words.json",
        ]
    }
    for name in ("flow_nft_geneval_tiny", "flow_grpo_geneval_tiny"):
        run = load(f"geneval/{name}.json")
        sm = run["summary"]
        steps = {f"{r['steps_done']}/{r['steps_planned']}" for r in run["runs"]}
        assert len(steps) == 1, steps
        bg = sm["background_ratio/last"]
        first, last = sm["checker_heldout/first"]["mean"], sm["checker_heldout/last"]["mean"]
        out[f"`{name}.yaml`"] = [
            None,
            g(sm, "judged_heldout/gain"),
            f"checker {first:.3f} {ARROW} {last:.3f} ({g(sm, 'checker_heldout/gain')})",
            f"background {bg['mean']:.2f}x (max {bg['max']:.2f}x)",
            steps.pop(),
            f"results/geneval/{name}.json",
        ]
    return out


# ---------------------------------------------------------------------------- tables


@dataclass
class Table:
    doc: str
    header: str  # the header cells joined by " | "
    rows: Callable[[], Rows]
    source: str | None = None  # a table without a result column: the file the doc must name
    allow: set[str] = field(default_factory=set)  # decimals allowed in label cells

    @property
    def columns(self) -> list[str]:
        return self.header.split(" | ")


B, R = "BENCHMARKS.md", "README.md"
TABLES = {
    "README demo": Table(
        R,
        "`make demo`, test split | step 0 | step 100 | change",
        demo_readme,
        "results/recipes/demo/",
    ),
    "README recipes": Table(
        R,
        "config | what it trains | reward | eval/reward/mean",
        recipes_readme,
        "results/recipes/nft_vs_flow_grpo.json",
    ),
    "recipes": Table(
        B,
        "recipe | split, seed | held-out: judged or reward | held-out: independent check | "
        "background texture | steps | training minutes | machine, date | result",
        recipe_rows,
    ),
    "seeds": Table(
        B,
        "recipe | split, seeds | judged held-out, gain | independent check held-out, gain | "
        "sample quality | steps | result",
        seeded_rows,
    ),
    "TRL": Table(
        B,
        "run | rounds | TRL `GRPOTrainer`, 2 threads | mmyatt, 1 controller x 2 threads | "
        "mmyatt, 2 controllers x 1 thread | 1x2 / TRL | 2x1 / TRL | machine, date | result",
        trl_rows,
    ),
    "step": Table(B, "bench, arm | throughput | seconds per step | result", step_rows),
    "genrm": Table(
        B,
        "arm | req/s, 1 in flight | req/s, 32 in flight | overhead by the server's model timer "
        "at 1 in flight | result",
        genrm_rows,
    ),
    "placement": Table(
        B,
        "workload | controllers | rounds | shared | colocate | partial | auto | "
        "partial / colocate (95% interval) | auto / best fixed (95% interval) | result",
        placement_rows,
    ),
    "placement options": Table(
        B, "option | workload | figure | result", placement_option_rows, allow={"1.5"}
    ),
    "balance": Table(
        B,
        "workload | rounds | step, on / off (95% interval) | training phase, on / off | "
        f"idle at the all-reduce, s a step, off {ARROW} on | share of steps that moved | "
        "predicted / measured s, mean error | result",
        balance_rows,
    ),
    "checkpoint": Table(B, "figure | seconds | result", checkpoint_rows),
    "LoRA sync": Table(
        B,
        "model | recipes | LoRA sync, bytes | full sync, bytes | LoRA / full | "
        "LoRA sync, median | full sync, median | result",
        lora_sync_rows,
    ),
    "faults": Table(
        B,
        "scenario | survived | records lost | weights equal to the uninterrupted run's | result",
        fault_rows,
    ),
    "sharding": Table(
        B,
        "processes | MB held per process (max) | peak RSS per process, MB (max) | result",
        sharding_rows,
    ),
    "gpu": Table(B, "check | figure | result", gpu_rows, allow={"1.77"}),
    "async": Table(
        B,
        "case, arm | held-out reward at the end | training s | wall s | async / sync "
        "training time | idle core share | result",
        async_rows,
    ),
}
