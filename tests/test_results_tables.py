"""README's and BENCHMARKS' headline tables against the committed result files.

Every headline table is described here once: its header, its rows, and for each figure
cell the text that the committed files under ``results/`` give (formatted as the tables
print it). The test parses the Markdown, finds each table by its header, and checks

* the rows: the same row names as the data describes, no more, no fewer;
* every figure cell: equal to the text made from the result file;
* every other cell (commands, splits, machines, dates): no decimal figure in it that
  the row's data does not give;
* the result column: the files it names exist.

So a number in these tables cannot drift from its data, and a figure without a committed
file cannot enter them. ``python tests/test_results_tables.py`` prints every table's rows
as the data gives them.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "results"
ARROW = "→"


# ---------------------------------------------------------------------------- data


def load(rel: str):
    return json.loads((RESULTS / rel).read_text())


def run_dir(name: str) -> tuple[dict, list[dict]]:
    """A recipe run kept under results/recipes/NAME: its summary and eval rows."""
    d = RESULTS / "recipes" / name
    summary = json.loads((d / "summary.json").read_text())
    rows = [json.loads(x) for x in (d / "eval.jsonl").read_text().splitlines() if x.strip()]
    return summary, rows


def f3(x: float) -> str:
    return f"{x:.3f}"


def change(a: float, b: float) -> str:
    return f"{a:.3f} {ARROW} {b:.3f} ({b - a:+.3f})"


def times(x: float, d: int = 2) -> str:
    return f"{x:.{d}f}x"


def ratio_ci(r: float, ci: list[float], d: int = 3) -> str:
    return f"{r:.{d}f} ({ci[0]:.2f}-{ci[1]:.2f})"


def metric(summary: dict, key: str) -> dict:
    return summary["metrics"][key]


def minutes(rows: list[dict]) -> str:
    return f"{[r for r in rows if 'train/minutes' in r][-1]['train/minutes']:.1f}"


def steps(summary: dict) -> str:
    return f"{summary['steps_done']}/{summary['steps_planned']}"


# ---------------------------------------------------------------------------- tables


@dataclass
class Table:
    doc: str
    header: list[str]
    rows: Callable[[], dict[str, dict[str, str]]]  # row name -> {column: expected text}
    result_column: str | None = None  # cells naming files under the repository
    source: str | None = None  # without a result column: the file the doc must name
    allow: set[str] = field(default_factory=set)  # decimals allowed in label cells


def demo_readme() -> dict[str, dict[str, str]]:
    s, _ = run_dir("demo")

    def row(key: str) -> dict[str, str]:
        m = metric(s, key)
        return {
            "step 0": f3(m["first"]),
            "step 100": f3(m["last"]),
            "change": f"{m['change']:+.3f}",
        }

    bg = metric(s, "eval/quality/background_hf")
    return {
        "judged, held-out (`eval/reward/mean`)": row("eval/heldout/reward/genrm"),
        "judged, seen": row("eval/seen/reward/genrm"),
        "independent critic, held-out": row("eval/heldout/reward/shape_critic"),
        "rule check, held-out": row("eval/heldout/reward/prompt_alignment_rule"),
        "background texture": {
            "step 0": f"{bg['first']:.4f}",
            "step 100": f"{bg['last']:.4f}",
            "change": times(bg["ratio"]) + " the base's",
        },
    }


def recipes_readme() -> dict[str, dict[str, str]]:
    nft = load("recipes/nft_vs_flow_grpo.json")[1]
    frac = nft["reaches_baseline_final"]["fraction_of_baseline_minutes"]
    names = [
        "text_grpo_tiny",
        "vlm_grpo_image_tiny",
        "vlm_grpo_video_tiny",
        "vlm_genrm_tiny",
        "flow_grpo_tiny",
        "flow_nft_genrm_tiny",
        "flow_grpo_genrm_tiny",
        "flow_nft_tiny",
        "flow_nft_pairwise_tiny",
        "flow_grpo_video_tiny",
    ]
    rows = {f"`configs/{n}.yaml`": {} for n in names}
    rows["`configs/flow_nft_genrm_tiny.yaml` (`make demo`)"] = rows.pop(
        "`configs/flow_nft_genrm_tiny.yaml`"
    )
    rows["`configs/flow_nft_tiny.yaml`"] = {"_figures": f"{frac:.3f}x"}
    return rows


def recipe_rows() -> dict[str, dict[str, str]]:
    out = {}
    s, ev = run_dir("demo")
    out["`flow_nft_genrm_tiny.yaml` (`make demo`)"] = {
        "held-out: judged or reward": change(*_fl(metric(s, "eval/heldout/reward/genrm"))),
        "held-out: independent check": "critic "
        + change(*_fl(metric(s, "eval/heldout/reward/shape_critic"))),
        "background texture": times(metric(s, "eval/quality/background_hf")["ratio"]),
        "steps": steps(s),
        "training minutes": minutes(ev),
        "result": "results/recipes/demo/",
    }
    for d in sorted((RESULTS / "recipes").glob("vlm_genrm_seed*")):
        s, ev = run_dir(d.name)
        out[f"`vlm_genrm_tiny.yaml`, seed {d.name.removeprefix('vlm_genrm_seed')}"] = {
            "held-out: judged or reward": change(*_fl(metric(s, "eval/heldout/reward/genrm"))),
            "held-out: independent check": "`describe_check` "
            + change(*_fl(metric(s, "eval/heldout/reward/describe_check"))),
            "background texture": "-",
            "steps": steps(s),
            "training minutes": minutes(ev),
            "result": f"results/recipes/{d.name}/",
        }
    runs = load("recipes/nft_vs_flow_grpo.json")
    for name, run in (
        ("`flow_nft_tiny.yaml` (DiffusionNFT)", runs[1]),
        ("`flow_grpo_tiny.yaml` (Flow-GRPO)", runs[0]),
    ):
        a, b = run["evals"][0], run["evals"][-1]
        out[name] = {
            "held-out: judged or reward": "rule " + change(a["heldout"], b["heldout"]),
            "held-out: independent check": "critic "
            + change(a["critic_heldout"], b["critic_heldout"]),
            "background texture": times(b["background_ratio"]),
            "steps": f"{int(run['steps_done'])}",
            "training minutes": f"{run['train_minutes']:.1f}",
            "result": "results/recipes/nft_vs_flow_grpo.json",
        }
    return out


def _fl(m: dict) -> tuple[float, float]:
    return m["first"], m["last"]


def trl_rows() -> dict[str, dict[str, str]]:
    out = {}
    for name, f in (
        ("run 1", "trl/side_by_side_quiet3.json"),
        ("run 2", "trl/side_by_side_quiet4.json"),
    ):
        d = load(f)
        cells = {
            "rounds": str(len(d["ratio_mmyatt_1x2_over_trl_per_round"])),
            "TRL `GRPOTrainer`, 2 threads": f"{d['samples_per_s_trl_2threads']:.1f}",
            "mmyatt, 1 controller x 2 threads": f"{d['samples_per_s_mmyatt_1x2']:.1f}",
            "mmyatt, 2 controllers x 1 thread": f"{d['samples_per_s_mmyatt_2x1']:.1f}",
            "result": f"results/{f}",
        }
        for arm, col in (("1x2", "1x2 / TRL"), ("2x1", "2x1 / TRL")):
            per = d[f"ratio_mmyatt_{arm}_over_trl_per_round"]
            cells[col] = f"{d[f'ratio_mmyatt_{arm}_over_trl']:.2f}x ({min(per):.2f}-{max(per):.2f})"
        out[name] = cells
    return out


def step_rows() -> dict[str, dict[str, str]]:
    t = load("bench/text_grpo.json")
    f = load("bench/flow_grpo.json")
    out = {}
    for arm, name in (
        ("1proc", "text-grpo: 1 controller x 1 thread"),
        ("1proc_2threads", "text-grpo: 1 controller x 2 threads"),
        ("2proc", "text-grpo: 2 controllers x 1 thread"),
    ):
        out[name] = {
            "throughput": f"{t[f'samples_per_s_{arm}']:.1f} samples/s",
            "seconds per step": f"{t[f'step_s_{arm}']:.2f}",
            "result": "results/bench/text_grpo.json",
        }
    for arm, name in (
        ("full", "flow-grpo: full trajectory (20 steps, all trained)"),
        ("reduced", "flow-grpo: 10 denoising steps, all trained"),
        ("window", "flow-grpo: 10 steps, a 2-step window trained"),
    ):
        a = f[arm]
        out[name] = {
            "throughput": f"{a['sampling_images_per_s']:.1f} sampled, "
            f"{a['training_images_per_s']:.1f} trained images/s",
            "seconds per step": f"{a['iteration_s']:.2f}",
            "result": "results/bench/flow_grpo.json",
        }
    return out


def genrm_rows() -> dict[str, dict[str, str]]:
    g = load("bench/genrm.json")

    def pct(x: float | None) -> str:
        return "-" if x is None else f"{100 * x:.1f}%"

    out = {}
    for arm, name in (
        ("new", "the server and client, `chat()` on blocking sockets"),
        ("new_loop_client", "the same, `chat()` through the event loop"),
        ("baseline", "the server before FastAPI, the same client"),
    ):
        if arm not in g:  # the arms the file holds
            continue
        a = g[arm]
        out[name] = {
            "req/s, 1 in flight": f"{a['req_per_s_1']:.1f}",
            "req/s, 32 in flight": f"{a['req_per_s_32']:.1f}",
            "overhead at 1 in flight, paired": pct(a.get("server_overhead_1_paired")),
            "overhead by the server's model timer": pct(a["server_overhead_1_by_server_model"]),
            "result": "results/bench/genrm.json",
        }
    m = g["model_only"]
    out["the judge's model alone"] = {
        "req/s, 1 in flight": f"{1000 / m['model_ms_1']:.1f}",
        "req/s, 32 in flight": f"{m['model_req_per_s_32']:.1f}",
        "overhead at 1 in flight, paired": "-",
        "overhead by the server's model timer": "-",
        "result": "results/bench/genrm.json",
    }
    return out


MODES = ("shared", "colocate", "partial", "auto")


def _placement_row(d: dict, wl: str, figure: str, f: str) -> dict[str, str]:
    arms = d[wl]
    cells = {
        m: f"{arms[m][figure]:.3f}" if figure == "step_s" else f"{arms[m][figure]:.2f}"
        for m in MODES
    }
    cells["controllers"] = str(d.get("controllers", 2))
    cells["rounds"] = str(arms["rounds"])
    po = d.get(f"partial_over_colocate_{wl}")
    cells["partial / colocate (95% interval)"] = (
        ratio_ci(po, d[f"partial_over_colocate_{wl}_rounds"]["ci95"]) if po is not None else "-"
    )
    key = "auto_over_best_fixed_" + wl if wl.startswith("drifting") else "auto_over_best_" + wl
    cells["auto / best fixed (95% interval)"] = ratio_ci(d[key], d[key + "_rounds"]["ci95"])
    cells["result"] = f"results/{f}"
    return cells


def placement_rows() -> dict[str, dict[str, str]]:
    main = load("bench/placement.json")
    out = {
        "judge-heavy (16-token judge), s/step": _placement_row(
            main, "judge_heavy", "step_s", "bench/placement.json"
        ),
        "judge about as costly as generation (4-token judge), s/step": _placement_row(
            main, "judge_comparable", "step_s", "bench/placement.json"
        ),
        "rollout-heavy (rule reward, no judge), s/step": _placement_row(
            main, "rollout_heavy", "step_s", "bench/placement.json"
        ),
        "the judge joins after 15 steps, s per run": _placement_row(
            main, "drifting_judge", "total_s", "bench/placement.json"
        ),
        "completions grow to the cap after 15 steps, s per run": _placement_row(
            main, "drifting", "total_s", "bench/placement.json"
        ),
        "the judge joins after 40 steps, s per run": _placement_row(
            load("placement/drifting_judge_40_steps_resumed.json"),
            "drifting_judge",
            "total_s",
            "placement/drifting_judge_40_steps_resumed.json",
        ),
        "judge-heavy, one controller, s/step": _placement_row(
            load("placement/one_controller.json"),
            "judge_heavy",
            "step_s",
            "placement/one_controller.json",
        ),
    }
    for tag in ("", "_b", "_c"):
        f = f"placement/one_controller_comparable{tag}.json"
        name = f"4-token judge, one controller, s/step ({'run ' + (tag[1:] or 'a')})"
        out[name] = _placement_row(load(f), "judge_comparable", "step_s", f)
    return out


def placement_option_rows() -> dict[str, dict[str, str]]:
    main = load("bench/placement.json")
    mem = main["judge_memory"]["policy_25m"]
    od = load("placement/over_dispatch_redraw_long_tail.json")["over_dispatch_run"]
    bal = main["balance_run"]
    sim = load("bench/placement_sim.json")

    def ci(key: str) -> str:
        r = mem[key + "_rounds"]
        return ratio_ci(mem[key], r["ci95"])

    return {
        "colocate against partial, peak memory": {
            "figure": f"colocate's peak {ci('colocate_over_partial_peak_rss')} of partial's",
            "result": "results/bench/placement.json",
        },
        "`placement.partial_release_judge: true`": {
            "figure": f"peak {ci('partial_release_over_partial_peak_rss')} of plain partial's, "
            f"{ci('partial_release_over_colocate_peak_rss')} of colocate's; "
            f"step {ci('partial_release_over_partial_step_s')}",
            "result": "results/bench/placement.json",
        },
        "`rollout.over_dispatch_ratio: 1.5`": {
            "figure": f"step {times(od['step_ratio'])} ratio 1's, "
            f"generation {times(od['generate_ratio'])}",
            "result": "results/placement/over_dispatch_redraw_long_tail.json",
        },
        "the same with `rollout.redraw_carried: true`": {
            "figure": f"step {times(od['redraw_step_ratio'])} ratio 1's; mean completion "
            f"{od['1.0']['response_length_mean']:.2f} {ARROW} "
            f"{od['1.5_redraw']['response_length_mean']:.2f} tokens (a length bias)",
            "result": "results/placement/over_dispatch_redraw_long_tail.json",
        },
        "`placement.balance: true`": {
            "figure": f"max/mean rank work {bal['on']['work_max_over_mean_before']:.3f} {ARROW} "
            f"{bal['on']['work_max_over_mean_after']:.3f}; training phase "
            f"{ratio_ci(bal['train_s_on_over_off']['geo_mean'], bal['train_s_on_over_off']['ci95'], 2)}"
            f" alone, {ratio_ci(bal['train_s_on_micro_over_off']['geo_mean'], bal['train_s_on_micro_over_off']['ci95'], 2)}"
            " with micro-batches",
            "result": "results/bench/placement.json",
        },
        "the simulator (`mmyatt bench placement-sim`)": {
            "figure": f"largest error {100 * sim['max_abs_error']:.1f}% over every mode and split",
            "result": "results/bench/placement_sim.json",
        },
    }


def checkpoint_rows() -> dict[str, dict[str, str]]:
    c = load("bench/checkpoint.json")

    def rng(key: str) -> str:
        return f"{c[key]:.2f} s ({c[key[:-2] + '_min_s']:.2f}-{c[key[:-2] + '_max_s']:.2f})"

    res = "results/bench/checkpoint.json"
    return {
        "synchronous save: the step waits": {"seconds": rng("sync_save_s"), "result": res},
        "asynchronous save: the step waits": {"seconds": rng("async_stall_s"), "result": res},
        "asynchronous save: written in the background": {
            "seconds": f"{c['async_complete_s']:.2f} s",
            "result": res,
        },
        "resume (find, load, load_state_dict)": {
            "seconds": f"{c['resume_s']:.3f} s",
            "result": res,
        },
    }


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


def fault_rows() -> dict[str, dict[str, str]]:
    f = load("bench/faults.json")
    out = {}
    for s in f["scenarios"]:
        w = s.get("exact_weights")
        out[FAULT_NAMES[s["fault"]]] = {
            "survived": "yes" if s["survived"] else "no",
            "records lost": str(s["records_lost"]),
            "weights equal to the uninterrupted run's": {True: "yes", False: "no"}.get(w, "n/a"),
            "result": "results/bench/faults.json",
        }
    return out


def sharding_rows() -> dict[str, dict[str, str]]:
    d = load("bench/data_sharding.json")

    def held(p: int) -> str:
        ranks = d[f"controllers_p{p}"]["ranks"]
        return f"{max(r['bytes_held'] for r in ranks) / 1e6:.1f}"

    res = "results/bench/data_sharding.json"
    workers = d["driver_p4"]["workers"]
    return {
        "1 controller": {
            "MB held per process (max)": held(1),
            "peak RSS per process, MB (max)": f"{d['controller_peak_rss_mb_p1']:.0f}",
            "result": res,
        },
        "2 controllers": {
            "MB held per process (max)": held(2),
            "peak RSS per process, MB (max)": f"{d['controller_peak_rss_mb_p2']:.0f}",
            "result": res,
        },
        "4 controllers": {
            "MB held per process (max)": held(4),
            "peak RSS per process, MB (max)": f"{d['controller_peak_rss_mb_p4']:.0f}",
            "result": res,
        },
        "a driver that reads everything and sends to 4 workers": {
            "MB held per process (max)": f"{d['driver_bytes_held'] / 1e6:.1f}",
            "peak RSS per process, MB (max)": f"{d['driver_peak_rss_mb']:.0f}",
            "result": res,
        },
        "its 4 workers": {
            "MB held per process (max)": f"{max(w['bytes_held'] for w in workers) / 1e6:.1f}",
            "peak RSS per process, MB (max)": f"{d['worker_peak_rss_mb_p4']:.0f}",
            "result": res,
        },
    }


def gpu_rows() -> dict[str, dict[str, str]]:
    eng = load("gpu_h200/engines.json")
    tail = (RESULTS / "gpu_h200/pytest_gpu_run3.txt").read_text().strip().splitlines()[-1]
    m = re.match(r"(\d+) passed, (\d+) skipped", tail)
    probe = (RESULTS / "gpu_h200/judge_release_probe.txt").read_text()
    loaded = re.search(r"loaded: allocated ([\d.]+) MB, reserved ([\d.]+) MB", probe)
    slept = re.search(r"released \(sleep\): allocated ([\d.]+) MB, reserved ([\d.]+) MB", probe)
    pl = load("gpu_h200/placement_judge_heavy.json")["judge_heavy"]

    def engine(a: dict) -> str:
        return (
            f"rollout {a['rollout_tokens_per_s']:.0f} tokens/s, update "
            f"{a['update_tokens_per_s']:.0f} tokens/s, MFU {100 * a['update_mfu']:.1f}%, "
            f"peak {a['peak_memory_mb'] / 1000:.1f} GB"
        )

    return {
        "`pytest -m gpu tests/test_gpu.py tests/test_gpu_engines.py`": {
            "figure": f"{m.group(1)} passed, {m.group(2)} skipped (2 GPUs; vLLM)",
            "result": "results/gpu_h200/pytest_gpu_run3.txt",
        },
        "`mmyatt bench engines`: HF generate, replica update": {
            "figure": engine(eng["arms"]["hf_replica"]),
            "result": "results/gpu_h200/engines.json",
        },
        "the same, FSDP2 update on one GPU": {
            "figure": engine(eng["arms"]["hf_fsdp2"])
            + f"; update {times(eng['update_speed_fsdp2_over_replica'])} replica's",
            "result": "results/gpu_h200/engines.json",
        },
        "Qwen2-VL (1.77 B), HF generate, FSDP2 update, images": {
            "figure": engine(eng["vlm_fsdp2"]),
            "result": "results/gpu_h200/engines.json",
        },
        "a released judge (`POST /sleep`), 25 M parameters": {
            "figure": f"reserved {loaded.group(2)} MB {ARROW} {slept.group(2)} MB",
            "result": "results/gpu_h200/judge_release_probe.txt",
        },
        "placement, judge-heavy, policy and judge on one GPU": {
            "figure": ", ".join(f"{mode} {pl[mode]['step_s']:.3f}" for mode in MODES)
            + f" s/step; partial / colocate "
            f"{pl['partial']['step_s'] / pl['colocate']['step_s']:.2f}",
            "result": "results/gpu_h200/placement_judge_heavy.json",
        },
    }


TABLES = {
    "README demo": Table(
        "README.md",
        ["`make demo`, test split", "step 0", "step 100", "change"],
        demo_readme,
        source="results/recipes/demo/",
    ),
    "README recipes": Table(
        "README.md",
        ["config", "what it trains", "reward", "eval/reward/mean"],
        recipes_readme,
        source="results/recipes/nft_vs_flow_grpo.json",
    ),
    "recipes": Table(
        "BENCHMARKS.md",
        [
            "recipe",
            "split, seed",
            "held-out: judged or reward",
            "held-out: independent check",
            "background texture",
            "steps",
            "training minutes",
            "machine, date",
            "result",
        ],
        recipe_rows,
        result_column="result",
    ),
    "TRL": Table(
        "BENCHMARKS.md",
        [
            "run",
            "rounds",
            "TRL `GRPOTrainer`, 2 threads",
            "mmyatt, 1 controller x 2 threads",
            "mmyatt, 2 controllers x 1 thread",
            "1x2 / TRL",
            "2x1 / TRL",
            "machine, date",
            "result",
        ],
        trl_rows,
        result_column="result",
    ),
    "step": Table(
        "BENCHMARKS.md",
        ["bench, arm", "throughput", "seconds per step", "result"],
        step_rows,
        result_column="result",
    ),
    "genrm": Table(
        "BENCHMARKS.md",
        [
            "arm",
            "req/s, 1 in flight",
            "req/s, 32 in flight",
            "overhead at 1 in flight, paired",
            "overhead by the server's model timer",
            "result",
        ],
        genrm_rows,
        result_column="result",
    ),
    "placement": Table(
        "BENCHMARKS.md",
        [
            "workload",
            "controllers",
            "rounds",
            "shared",
            "colocate",
            "partial",
            "auto",
            "partial / colocate (95% interval)",
            "auto / best fixed (95% interval)",
            "result",
        ],
        placement_rows,
        result_column="result",
    ),
    "placement options": Table(
        "BENCHMARKS.md",
        ["option", "workload", "figure", "result"],
        placement_option_rows,
        result_column="result",
        allow={"1.5"},
    ),
    "checkpoint": Table(
        "BENCHMARKS.md",
        ["figure", "seconds", "result"],
        checkpoint_rows,
        result_column="result",
    ),
    "faults": Table(
        "BENCHMARKS.md",
        [
            "scenario",
            "survived",
            "records lost",
            "weights equal to the uninterrupted run's",
            "result",
        ],
        fault_rows,
        result_column="result",
    ),
    "sharding": Table(
        "BENCHMARKS.md",
        ["processes", "MB held per process (max)", "peak RSS per process, MB (max)", "result"],
        sharding_rows,
        result_column="result",
    ),
    "gpu": Table(
        "BENCHMARKS.md",
        ["check", "figure", "result"],
        gpu_rows,
        result_column="result",
        allow={"1.77"},
    ),
}


# ---------------------------------------------------------------------------- parsing


def clean(cell: str) -> str:
    return re.sub(r"\s+", " ", cell.replace("**", "")).strip()


def split_row(line: str) -> list[str]:
    # cells are split on | outside backticks
    cells, cur, tick = [], "", False
    for ch in line.strip().strip("|"):
        if ch == "`":
            tick = not tick
        if ch == "|" and not tick:
            cells.append(cur)
            cur = ""
        else:
            cur += ch
    cells.append(cur)
    return [clean(c) for c in cells]


def find_table(text: str, header: list[str]) -> list[list[str]]:
    lines = text.splitlines()
    for i, line in enumerate(lines):
        if line.lstrip().startswith("|") and split_row(line) == header:
            rows = []
            for row in lines[i + 2 :]:
                if not row.lstrip().startswith("|"):
                    break
                rows.append(split_row(row))
            return rows
    raise AssertionError(f"no table with the header {header}")


DECIMAL = re.compile(r"(?<![\w.])\d+\.\d+x?")


def check(name: str, text: str | None = None) -> list[str]:
    """The differences between a table as written and as its data gives it."""
    t = TABLES[name]
    text = text if text is not None else (ROOT / t.doc).read_text()
    want = t.rows()
    got = {r[0]: dict(zip(t.header, r)) for r in find_table(text, t.header)}
    errors = []
    if set(got) != set(want):
        errors.append(
            f"{name}: rows {sorted(set(got) - set(want))} have no data here; "
            f"rows {sorted(set(want) - set(got))} are missing"
        )
    for key in set(got) & set(want):
        row, exp = got[key], want[key]
        figures = set(DECIMAL.findall(" ".join(exp.values())))
        for col in t.header[1:]:
            cell = row.get(col, "")
            if col in exp:
                if cell != exp[col]:
                    errors.append(f"{name} / {key} / {col}: {cell!r}, the data gives {exp[col]!r}")
            else:
                extra = set(DECIMAL.findall(cell)) - figures - t.allow
                if extra:
                    errors.append(f"{name} / {key} / {col}: {sorted(extra)} not from the data")
        if t.result_column:
            for path in re.findall(r"results/[\w./-]+", row.get(t.result_column, "")):
                if not (ROOT / path).exists():
                    errors.append(f"{name} / {key}: {path} does not exist")
    if t.source and t.source not in text:
        errors.append(f"{name}: {t.doc} does not name {t.source}")
    return errors


# ---------------------------------------------------------------------------- tests


@pytest.mark.parametrize("name", sorted(TABLES))
def test_table_matches_its_committed_results(name):
    errors = check(name)
    assert not errors, "\n".join(errors)


def test_a_changed_number_fails():
    """Each kind of edit to a table is caught: a figure, a row without data, a decimal
    in a label cell."""
    t = TABLES["recipes"]
    text = (ROOT / t.doc).read_text()
    demo = t.rows()["`flow_nft_genrm_tiny.yaml` (`make demo`)"]["held-out: judged or reward"]
    last = demo.split(ARROW)[1].split()[0]
    bumped = f"{float(last) + 0.001:.3f}"
    assert check("recipes", text.replace(f"{ARROW} {last}", f"{ARROW} {bumped}", 1))
    lines = text.splitlines()
    i = next(n for n, x in enumerate(lines) if x.startswith("| `flow_nft_tiny.yaml`"))
    extra = lines[i].replace("`flow_nft_tiny.yaml` (DiffusionNFT)", "`flow_nft_tiny.yaml`, again")
    assert check("recipes", "\n".join([*lines[: i + 1], extra, *lines[i + 1 :]]))
    label = lines[i].replace("| test,", "| test (0.731),", 1)
    assert label != lines[i]
    assert check("recipes", "\n".join([*lines[:i], label, *lines[i + 1 :]]))


def test_every_results_file_is_named_somewhere():
    """No orphan data: each file under results/ is named by README, BENCHMARKS, the docs
    or another result's folder name."""
    text = "\n".join(
        (ROOT / p).read_text()
        for p in ["README.md", "BENCHMARKS.md", *(str(p) for p in (ROOT / "docs").glob("*.md"))]
    )
    orphans = []
    for p in sorted(RESULTS.rglob("*")):
        if not p.is_file() or p.name == "README.md":
            continue
        rel = str(p.relative_to(ROOT))
        if rel not in text and f"{p.parent.relative_to(ROOT)}/" not in text:
            orphans.append(rel)
    assert not orphans, orphans


def main() -> None:
    for name, t in TABLES.items():
        print(f"\n{name} ({t.doc})\n| " + " | ".join(t.header) + " |")
        try:
            rows = t.rows()
        except OSError as e:
            print(f"(no data yet: {e})")
            continue
        for key, cells in rows.items():
            print("| " + " | ".join([key, *(cells.get(c, "?") for c in t.header[1:])]) + " |")


if __name__ == "__main__":
    main()
