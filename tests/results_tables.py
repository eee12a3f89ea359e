"""What README's and BENCHMARKS' headline tables hold, as the committed files under
``results/`` give it: each table's header and, for each row, the text of each figure cell
(``None`` marks a label cell: command, split, machine, date). Checked by
``tests/test_results_tables.py``."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from results_bench import (
    async_rows,
    balance_rows,
    checkpoint_rows,
    fault_rows,
    genrm_rows,
    gpu_rows,
    lora_sync_rows,
    placement_option_rows,
    placement_rows,
    sharding_rows,
)
from results_common import (
    ARROW,
    RESULTS,
    Rows,
    change,
    first_last,
    load,
    run_dir,
    times,
)


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
        "case, arm | steps | held-out reward at the end | training s | wall s | async / sync "
        "training time | async / sync wall time | idle core share | result",
        async_rows,
    ),
}
