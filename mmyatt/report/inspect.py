"""Read a run directory into pandas: ``run = load_run("runs/demo")``.

The one reader that ``mmyatt inspect --html``, the plots and the notebooks share.

``run.metrics``
    metrics.jsonl, one row per logged step (``step`` plus one column per metric; texts
    such as ``"nan"`` become NaN). Training and eval rows of the same step are merged.
``run.rollouts``
    the rollout logs of every rank (docs/rollout_logs.md), one row per logged sample:
    ``step, rank, prompt_id, group, sample, prompt, output, output_file, reward,
    advantage, length, ...``; each reward component as ``part/<name>``; for every GenRM
    term ``verdict/<term>`` (the value it paid), ``raw/<term>`` (the judge's answer token
    or texts), ``question/<term>``, ``values/<term>`` (one value per judgement: per
    repeat, or per question in mode vqa), for mode vqa ``questions/<term>``,
    ``expected/<term>`` and ``answers/<term>`` (per question), for mode pairwise
    ``swap_consistency/<term>``, and ``judgement/<term>``, the whole logged verdict;
    :func:`judge_reasons` puts it in words.
``run.config``, ``run.summary``
    config.yaml and summary.json as dicts (empty when absent).

Helpers: :meth:`Run.group_spread` (reward spread per prompt group),
:meth:`Run.placement` (step time and its phases per placement mode the steps ran in),
:meth:`Run.placement_switches` (where auto changed mode, predicted against measured),
:meth:`Run.disagreements` (judge verdict against a rule or critic logged next to it,
largest gaps first), :meth:`Run.media` (a sample's image or clip frames).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd

from mmyatt.placement.config import MODE_IDS

NOT_CHECKS = ("overlong_penalty",)  # parts that are not a judgement of the output


def load_metrics(run_dir: str | Path) -> pd.DataFrame:
    """metrics.jsonl as a DataFrame with one row per step, sorted by step."""
    path = Path(run_dir) / "metrics.jsonl"
    rows = (
        [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.exists() else []
    )
    return metrics_frame(rows)


def metrics_frame(rows: list[dict]) -> pd.DataFrame:
    """Metric rows (as metrics.jsonl holds them) as :func:`load_metrics` gives them."""
    if not rows:
        return pd.DataFrame({"step": pd.Series(dtype=int)})
    df = pd.DataFrame(rows)
    # every column at once: one by one fragments the frame (pandas warns past ~100)
    values = df.drop(columns="step").apply(pd.to_numeric, errors="coerce")
    df = pd.concat([df[["step"]], values], axis=1)
    # a step can have a training row and an eval row (eval_every, the final eval)
    df = df.groupby("step", as_index=False, sort=True).first()
    return df


def load_rollouts(run_dir: str | Path) -> pd.DataFrame:
    """Every rank's rollouts/rank<r>.jsonl as one DataFrame (see the module docstring)."""
    files = sorted((Path(run_dir) / "rollouts").glob("rank*.jsonl"))
    rows = []
    for f in files:
        rank = int(f.stem[4:])
        for line in f.read_text().splitlines():
            if line.strip():
                rows.append(_flat(json.loads(line), rank))
    if not rows:
        return pd.DataFrame(columns=["step", "rank", "prompt_id", "sample", "reward"])
    df = pd.DataFrame(rows)
    for c in ["reward", "advantage", *[c for c in df if c.startswith(("part/", "verdict/"))]]:
        if c in df:
            df[c] = pd.to_numeric(df[c], errors="coerce")
    return df.sort_values(["step", "rank", "group", "sample"], kind="stable").reset_index(drop=True)


def _flat(row: dict, rank: int) -> dict:
    out = {k: v for k, v in row.items() if k not in ("parts", "verdicts", "media")}
    out.setdefault("rank", rank)
    for k, v in (row.get("media") or {}).items():
        out[f"media/{k}"] = v
    for k, v in (row.get("parts") or {}).items():
        out[f"part/{k}"] = v
    for term, v in (row.get("verdicts") or {}).items():
        out[f"verdict/{term}"] = v.get("verdict")
        raw = v.get("raw")
        out[f"raw/{term}"] = raw[0] if isinstance(raw, list) and len(raw) == 1 else raw
        out[f"question/{term}"] = v.get("question")
        out[f"judgement/{term}"] = v
        for key in ("values", "questions", "expected", "answers", "swap_consistency"):
            if v.get(key) is not None:
                out[f"{key}/{term}"] = v[key]
        if v.get("top_logprobs") is not None:
            out[f"top_logprobs/{term}"] = v["top_logprobs"]
    return out


def _num(x: Any) -> str:
    return f"{x:.3f}" if isinstance(x, int | float) and not isinstance(x, bool) else "failed"


def judge_reasons(judgement: dict | None) -> list[str]:
    """Why a judge paid what it paid, one line per judgement, from a logged verdict
    (``judgement/<term>``): per question in mode vqa, the judge's answer, the expected
    one and P(expected); in mode yes_prob the question, the answer token and P(Yes) of
    each repeat; in mode score the generated texts and the score read from each; in mode
    pairwise the win rate and swap consistency.

    >>> judge_reasons({"mode": "vqa", "questions": ["What colour is the shape?"],
    ...                "expected": ["red"], "answers": ["blue"], "values": [0.02]})
    ['What colour is the shape? blue (expected red): 0.020']
    >>> judge_reasons({"mode": "pairwise", "verdict": 0.75, "swap_consistency": 1.0})
    ['won 0.750 of its comparisons in the group (swap consistency 1.000)']
    """
    if not isinstance(judgement, dict):
        return []
    mode, values = judgement.get("mode"), judgement.get("values") or []
    if mode == "vqa":
        questions = judgement.get("questions") or []
        expected = judgement.get("expected") or [None] * len(questions)
        answers = judgement.get("answers") or [None] * len(questions)
        lines = []
        for q, want, said, v in zip(questions, expected, answers, values):
            answer = "" if said is None and want is None else f" {said or '?'}"
            wanted = f" (expected {want})" if want is not None else ""
            lines.append(f"{q}{answer}{wanted}: {_num(v)}")
        return lines
    if mode == "pairwise":
        return [
            f"won {_num(judgement.get('verdict'))} of its comparisons in the group "
            f"(swap consistency {_num(judgement.get('swap_consistency'))})"
        ]
    raw = judgement.get("raw")
    if mode == "score":
        texts = raw if isinstance(raw, list) else [raw]
        return [f"{str(t).strip()!r}: {_num(v)}" for t, v in zip(texts, values)]
    question = judgement.get("question") or ""
    return [f"{question} {raw}: P(Yes) {_num(v)}" for v in values] or [f"{question} {raw}"]


@dataclass
class Run:
    path: Path
    metrics: pd.DataFrame
    rollouts: pd.DataFrame
    config: dict = field(default_factory=dict)
    summary: dict = field(default_factory=dict)

    @property
    def name(self) -> str:
        return str(self.config.get("name") or self.path.name)

    @property
    def steps_planned(self) -> int | None:
        """The run's planned steps (summary.json, else config.yaml)."""
        planned = self.summary.get("steps_planned") or (self.config.get("trainer") or {}).get(
            "steps"
        )
        return int(planned) if planned else None

    def header(self) -> str:
        """``N logged samples over K logged steps of a T-step run``."""
        r = self.rollouts
        logged = r["step"].nunique() if len(r) else 0
        planned = self.steps_planned
        of = f" of a {planned}-step run" if planned else ""
        return f"{len(r)} logged samples over {logged} logged steps{of}"

    def reasons(self, row: int | pd.Series, term: str) -> list[str]:
        """:func:`judge_reasons` of judge ``term`` on a rollout row."""
        rec = self.rollouts.loc[row] if not isinstance(row, pd.Series) else row
        return judge_reasons(rec.get(f"judgement/{term}"))

    @property
    def judge_terms(self) -> list[str]:
        """Reward terms with judge verdicts in the rollout log."""
        return [c[8:] for c in self.rollouts if c.startswith("verdict/")]

    @property
    def parts(self) -> list[str]:
        return [c[5:] for c in self.rollouts if c.startswith("part/")]

    @property
    def check_terms(self) -> list[str]:
        """Components that judge the output but are not a GenRM term: rules and critics."""
        judges = set(self.judge_terms)
        return [
            p
            for p in self.parts
            if p not in judges
            and not p.endswith("_parse_failed")
            and p not in NOT_CHECKS
            and not any(p.startswith(f"{j}#") for j in judges)
        ]

    def group_spread(self) -> pd.DataFrame:
        """One row per (step, rank, prompt group): n, mean, std, min, max, range of the
        reward, and ``flat`` (every sample got the same reward)."""
        r = self.rollouts
        if r.empty:
            return pd.DataFrame(
                columns=["step", "rank", "prompt_id", "n", "mean", "std", "min", "max"]
            )
        g = r.groupby(["step", "rank", "group", "prompt_id"], sort=True)["reward"]
        out = g.agg(n="count", mean="mean", std=lambda x: x.std(ddof=0), min="min", max="max")
        out = out.reset_index()
        out["range"] = out["max"] - out["min"]
        out["flat"] = out["range"] <= 1e-9
        return out

    def disagreements(self, judge: str | None = None, check: str | None = None) -> pd.DataFrame:
        """Samples scored by a judge and a check, largest |verdict - check| first: columns
        step, rank, prompt, judge, check, gap (judge - check), why (the judge's reasons,
        :func:`judge_reasons`, in one line), plus the row index in ``rollouts`` (``row``). Meaningful when both are in [0, 1] (P(Yes), rule hits,
        critic probabilities)."""
        judge = judge or (self.judge_terms[0] if self.judge_terms else None)
        check = check or (self.check_terms[0] if self.check_terms else None)
        cols = ["row", "step", "rank", "prompt", "judge", "check", "gap", "why"]
        if judge is None or check is None:
            return pd.DataFrame(columns=cols)
        r = self.rollouts
        df = pd.DataFrame(
            {
                "row": r.index,
                "step": r["step"],
                "rank": r["rank"],
                "prompt": r["prompt"],
                "judge": r[f"verdict/{judge}"],
                "check": r[f"part/{check}"],
                "why": [
                    "; ".join(judge_reasons(v))
                    for v in r.get(f"judgement/{judge}", [None] * len(r))
                ],
            }
        ).dropna(subset=["judge", "check"])
        df["gap"] = df["judge"] - df["check"]
        order = df["gap"].abs().sort_values(ascending=False, kind="stable").index
        return df.loc[order, cols].reset_index(drop=True)

    def placement(self) -> pd.DataFrame:
        """:func:`placement_table` of this run's metrics."""
        return placement_table(self.metrics)

    def placement_switches(self) -> pd.DataFrame:
        """The steps where the placement mode changed (the first step included): step,
        mode, and auto's predicted against the measured step time there."""
        rows, modes = _placement_steps(self.metrics)
        changed = modes.ne(modes.shift())
        rows, modes = rows[changed], modes[changed]
        nan = pd.Series(float("nan"), index=rows.index)
        return pd.DataFrame(
            {
                "step": rows["step"].to_numpy(),
                "mode": modes.to_numpy(),
                "predicted_step_s": rows.get("placement/predicted_step_s", nan).to_numpy(),
                "actual_step_s": rows.get("placement/actual_step_s", nan).to_numpy(),
            }
        )

    def media(self, row: int | pd.Series) -> Any:
        """The generated image (PIL) or clip (list of PIL frames) of a rollout row, or
        None for text outputs."""
        from PIL import Image, ImageSequence

        rec = self.rollouts.loc[row] if not isinstance(row, pd.Series) else row
        f = rec.get("output_file")
        if not isinstance(f, str):
            return None
        with Image.open(self.path / f) as im:
            if getattr(im, "n_frames", 1) > 1:
                return [fr.convert("RGB") for fr in ImageSequence.Iterator(im)]
            return im.convert("RGB")


def _placement_steps(m: pd.DataFrame) -> tuple[pd.DataFrame, pd.Series]:
    """The metric rows of steps with placement figures, and the mode each ran in (named
    from ``placement/mode_id``: the metrics frame keeps numbers only)."""
    if "placement/mode_id" not in m:
        return m.iloc[0:0], pd.Series(dtype=object)
    rows = m.dropna(subset=["placement/mode_id"])
    names = {v: k for k, v in MODE_IDS.items()}
    modes = rows["placement/mode_id"].map(lambda v: names.get(int(v), f"mode {int(v)}"))
    return rows, modes


def placement_table(m: pd.DataFrame) -> pd.DataFrame:
    """One row per placement mode the steps of metrics frame ``m`` ran in
    (``placement.mode``, or auto's choices), in the order first run: ``steps`` and the
    mean over those steps of each ``placement/*`` figure (step, generation, judge,
    training seconds, idle fractions, CPU use, peak memory; auto's
    ``predicted_step_s``). Empty without placement."""
    rows, modes = _placement_steps(m)
    if rows.empty:
        return pd.DataFrame(columns=["mode", "steps"])
    cols = [
        c
        for c in rows
        if c.startswith("placement/") and c != "placement/mode_id" and rows[c].notna().any()
    ]
    g = rows[cols].groupby(modes, sort=False)
    out = g.mean().rename(columns=lambda c: c[len("placement/") :])
    out.insert(0, "steps", g.size())
    return out.rename_axis("mode").reset_index()


def load_run(path: str | Path) -> Run:
    """A run directory as DataFrames; see the module docstring."""
    import yaml

    p = Path(path)
    if not p.is_dir():
        raise FileNotFoundError(f"no run directory at {p}")
    config = yaml.safe_load((p / "config.yaml").read_text()) if (p / "config.yaml").exists() else {}
    summary = json.loads((p / "summary.json").read_text()) if (p / "summary.json").exists() else {}
    return Run(p, load_metrics(p), load_rollouts(p), config or {}, summary)
