"""Figures of a run, saved with it in ``runs/<name>/plots/`` and reused by the HTML report
and the notebooks: reward and eval curves, per-component rewards, phase timings, and
from the rollout log per-step reward histograms, the spread within prompt groups and
the judge against the checks logged next to it.

Every function takes the DataFrames of :func:`mmyatt.report.inspect.load_run` and returns a
matplotlib ``Figure`` built without pyplot (no display, no global backend switch; a
notebook shows it with ``display(fig)``); :func:`save_run_plots` writes the three run
figures as PNG.
"""

from __future__ import annotations

import math
from pathlib import Path

import pandas as pd
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from mmyatt.report.inspect import load_metrics, load_rollouts

SUMMARY_KEYS = ("reward/mean", "reward/std", "reward/generated_mean")


def _subplots(nrows: int = 1, ncols: int = 1, *, figsize, **kw):
    fig = Figure(figsize=figsize)
    return fig, fig.subplots(nrows, ncols, **kw)


def _series(df: pd.DataFrame, key: str) -> pd.Series:
    rows = df[["step", key]].dropna()
    return rows.set_index("step")[key]


def _empty(ax, text: str) -> None:
    ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes, color="grey")
    ax.set_xticks([])
    ax.set_yticks([])


def _step_axis(ax, title: str, **title_style) -> None:
    """``title`` over an x-axis of whole steps."""
    ax.set_title(title, **title_style)
    ax.set_xlabel("step")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))


def plot_distinct(ax, curves: list[tuple[pd.Series, str]], **style) -> None:
    """Plot each (series, label); a series equal to one already drawn is not drawn again
    on top of it (where it would hide, or be hidden by, the other) but named in that
    line's label: ``a = b``."""
    drawn: list[tuple[pd.Series, object]] = []
    for series, label in curves:
        same = next(
            (
                line
                for other, line in drawn
                if other.index.equals(series.index)
                and ((other - series).abs() <= 1e-9 * (1 + other.abs())).all()
            ),
            None,
        )
        if same is not None:
            same.set_label(f"{same.get_label()} = {label}")
            continue
        (line,) = ax.plot(series.index, series.values, label=label, **style)
        drawn.append((series, line))


def reward_bounds(rollouts: pd.DataFrame | None) -> tuple[float, float] | None:
    """The lowest and highest reward of the logged samples: where a ± std band of the
    reward may go (None without a rollout log)."""
    if rollouts is None or "reward" not in rollouts or rollouts.empty:
        return None
    values = pd.to_numeric(rollouts["reward"], errors="coerce").dropna()
    return (float(values.min()), float(values.max())) if len(values) else None


def reward_curves(metrics: pd.DataFrame, bounds: tuple[float, float] | None = None) -> Figure:
    """Training reward (kept groups, and every generated sample) and the eval reward.
    ``bounds``: the reward's range (:func:`reward_bounds`), which the ± std band stays in."""
    fig, (ax, bx) = _subplots(1, 2, figsize=(10, 3.6))
    curves = [
        (_series(metrics, key), label)
        for key, label in (
            ("reward/mean", "train reward (kept groups)"),
            ("reward/generated_mean", "train reward (all generated)"),
        )
        if key in metrics
    ]
    plot_distinct(ax, curves, lw=1.2)
    if "reward/mean" in metrics and "reward/std" in metrics:
        m, sd = _series(metrics, "reward/mean"), _series(metrics, "reward/std")
        sd = sd.reindex(m.index)
        low, high = m - sd, m + sd
        if bounds is not None:
            low, high = low.clip(lower=bounds[0]), high.clip(upper=bounds[1])
        ax.fill_between(m.index, low, high, alpha=0.15, label="± std")
    _step_axis(ax, "training reward")
    if ax.lines:
        ax.legend(fontsize=8)
    else:
        _empty(ax, "no training rows")
    evals = [k for k in metrics if k.startswith("eval/") and k.endswith("/mean")]
    evals = [k for k in evals if k.count("/") == 2]  # eval/reward/mean, eval/greedy/mean
    for k in ("eval/heldout/reward/mean", "eval/seen/reward/mean"):
        if k in metrics:
            evals.append(k)
    plot_distinct(bx, [(_series(metrics, k), k) for k in evals], marker="o", lw=1.2)
    _step_axis(bx, "evaluation")
    if bx.lines:
        bx.legend(fontsize=8)
    else:
        _empty(bx, "no eval rows")
    fig.tight_layout()
    return fig


def component_names(metrics: pd.DataFrame) -> list[str]:
    """Reward components logged in training (``reward/<name>``)."""
    skip = set(SUMMARY_KEYS)
    return [k[7:] for k in metrics if k.startswith("reward/") and k not in skip]


def component_curves(metrics: pd.DataFrame) -> Figure:
    """One panel per reward component: its training mean and its eval mean."""
    names = [n for n in component_names(metrics) if not n.endswith("_parse_failed")]
    evals = [k[12:] for k in metrics if k.startswith("eval/reward/") and k != "eval/reward/mean"]
    names += [n for n in evals if n not in names and not n.endswith("_parse_failed")]
    cols = min(3, max(len(names), 1))
    rows = max(1, math.ceil(len(names) / cols))
    fig, axes = _subplots(rows, cols, figsize=(4 * cols, 3 * rows), squeeze=False)
    for ax in axes.flat[len(names) :]:
        ax.axis("off")
    if not names:
        _empty(axes.flat[0], "no reward components logged")
    for ax, name in zip(axes.flat, names):
        if f"reward/{name}" in metrics:
            s = _series(metrics, f"reward/{name}")
            ax.plot(s.index, s.values, lw=1.2, label="train")
        if f"eval/reward/{name}" in metrics:
            s = _series(metrics, f"eval/reward/{name}")
            ax.plot(s.index, s.values, marker="o", lw=1.2, label="eval")
        _step_axis(ax, name, fontsize=10)
        ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def timing_plot(metrics: pd.DataFrame) -> Figure:
    """Seconds per phase of each step, stacked."""
    keys = [
        k for k in metrics if k.startswith("timing/") and k.endswith("_s") and k != "timing/step_s"
    ]
    fig, ax = _subplots(figsize=(7, 3.6))
    rows = metrics.dropna(subset=keys, how="all") if keys else metrics.iloc[0:0]
    if rows.empty:
        _empty(ax, "no timings logged")
    else:
        values = [rows[k].fillna(0.0).to_numpy() for k in keys]
        ax.stackplot(rows["step"], values, labels=[k[7:-2] for k in keys], alpha=0.85)
        if "timing/step_s" in rows:
            ax.plot(rows["step"], rows["timing/step_s"], color="black", lw=1, label="whole step")
        ax.legend(fontsize=8, loc="upper left", ncol=3)
    _step_axis(ax, "seconds per step, by phase")
    fig.tight_layout()
    return fig


def reward_histograms(rollouts: pd.DataFrame, max_steps: int = 12) -> Figure:
    """Histogram of the logged samples' rewards, one panel per logged step (at most
    ``max_steps`` panels, spread evenly over the run)."""
    steps = sorted(rollouts["step"].unique()) if len(rollouts) else []
    if len(steps) > max_steps:
        pick = [round(i * (len(steps) - 1) / (max_steps - 1)) for i in range(max_steps)]
        steps = [steps[i] for i in sorted(set(pick))]
    cols = min(4, max(len(steps), 1))
    rows = max(1, math.ceil(len(steps) / cols))
    fig, axes = _subplots(rows, cols, figsize=(3.2 * cols, 2.4 * rows), squeeze=False, sharex=True)
    for ax in axes.flat[len(steps) :]:
        ax.axis("off")
    if not steps:
        _empty(axes.flat[0], "no rollouts logged")
    values = pd.to_numeric(rollouts["reward"], errors="coerce") if len(rollouts) else None
    lo, hi = (values.min(), values.max()) if values is not None and len(values) else (0, 1)
    bins = 20 if hi > lo else 1
    for ax, step in zip(axes.flat, steps):
        v = values[rollouts["step"] == step].dropna()
        ax.hist(v, bins=bins, range=(lo, hi) if hi > lo else None, color="#4c72b0")
        ax.set_title(f"step {step}  (n={len(v)}, mean {v.mean():.3f})", fontsize=9)
    fig.suptitle("reward of the logged samples, per step", fontsize=11)
    fig.tight_layout()
    return fig


def group_spread_plot(spread: pd.DataFrame) -> Figure:
    """Within-group reward spread per step: mean std across groups, and the share of
    groups whose samples all got the same reward (no learning signal in GRPO)."""
    fig, (ax, bx) = _subplots(1, 2, figsize=(10, 3.4))
    if spread.empty:
        _empty(ax, "no rollouts logged")
        _empty(bx, "no rollouts logged")
        return fig
    by_step = spread.groupby("step")
    ax.plot(by_step["std"].mean(), marker="o", label="mean within-group std")
    ax.plot(by_step["range"].mean(), marker="s", label="mean within-group range")
    _step_axis(ax, "spread within prompt groups")
    ax.legend(fontsize=8)
    bx.plot(by_step["flat"].mean(), marker="o", color="#c44e52")
    bx.set_ylim(-0.05, 1.05)
    _step_axis(bx, "share of groups with equal rewards")
    fig.tight_layout()
    return fig


def judge_vs_check(pairs: pd.DataFrame, judge: str, check: str) -> Figure:
    """Scatter of the judge's verdict against a check's value on the same samples."""
    fig, ax = _subplots(figsize=(4.2, 4.0))
    if pairs.empty:
        _empty(ax, "nothing to compare")
        return fig
    sc = ax.scatter(pairs["check"], pairs["judge"], c=pairs["step"], cmap="viridis", s=14)
    ax.plot([0, 1], [0, 1], color="grey", lw=0.8, ls="--")
    ax.set_xlabel(check)
    ax.set_ylabel(f"{judge} verdict")
    ax.set_title(f"{judge} vs {check}", fontsize=10)
    fig.colorbar(sc, ax=ax, label="step")
    fig.tight_layout()
    return fig


RUN_PLOTS = {
    "rewards.png": reward_curves,
    "reward_components.png": component_curves,
    "timings.png": timing_plot,
}


def save_run_plots(run_dir: str | Path) -> list[Path]:
    """Write plots/rewards.png, plots/reward_components.png and plots/timings.png."""
    metrics = load_metrics(run_dir)
    bounds = reward_bounds(load_rollouts(run_dir))
    out_dir = Path(run_dir) / "plots"
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for name, draw in RUN_PLOTS.items():
        fig = draw(metrics, bounds) if draw is reward_curves else draw(metrics)
        fig.savefig(out_dir / name, dpi=110)
        written.append(out_dir / name)
    return written
