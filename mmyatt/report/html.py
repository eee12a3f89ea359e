"""``mmyatt inspect RUN --html``: one self-contained HTML page about what the reward rewarded.

Everything is inline (figures as PNG data URIs, generated images as PNG, clips as GIF),
so the file can be mailed or attached to an issue. Sections: the before/after eval
table, reward and eval curves, per-component rewards, phase timings, per-step reward
histograms, the spread within prompt groups, the best and worst logged samples with
their verdicts, the judge against every rule or critic logged next to it (scatter,
agreement, the samples where they disagree most), the first and last eval grids, and
a table of every logged sample with all its rewards and verdicts.

Reads only the run directory, through :func:`mmyatt.report.inspect.load_run`.
"""

from __future__ import annotations

import base64
import html
import io
import json
import math
from datetime import datetime, timezone
from pathlib import Path

import pandas as pd

from mmyatt.outputs.samples import GRID_COLUMNS, read_captions
from mmyatt.report import plots
from mmyatt.report.inspect import Run, load_run

CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,Helvetica,Arial,sans-serif;margin:24px;
  color:#222;max-width:1250px}
h1{margin-bottom:0} h2{border-bottom:1px solid #ddd;padding-bottom:4px;margin-top:36px}
.meta{color:#666;margin-top:4px}
table{border-collapse:collapse;font-size:13px} td,th{border:1px solid #ddd;padding:3px 6px;
  vertical-align:top} th{background:#f4f4f4;text-align:left}
td.num{text-align:right;font-variant-numeric:tabular-nums}
.samples img{width:64px;height:64px;image-rendering:pixelated}
.pos{color:#1a7f37} .neg{color:#b42318}
img.fig{max-width:100%}
"""
CARD_CSS = """
.cards{display:flex;flex-wrap:wrap;gap:10px}
.card{border:1px solid #ddd;border-radius:6px;padding:8px;width:230px;font-size:12px;
  background:#fafafa;color:#222}
.card img{width:128px;height:128px;display:block;margin-bottom:4px;image-rendering:pixelated}
.q{color:#666;font-style:italic} code{font-size:12px;background:#f0f0f0;padding:0 2px}
ul.reasons{margin:2px 0 4px 0;padding-left:16px}
"""


def _b64(data: bytes, mime: str) -> str:
    return f"data:{mime};base64," + base64.b64encode(data).decode("ascii")


def fig_uri(fig) -> str:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100)
    return _b64(buf.getvalue(), "image/png")


def _file_uri(path: Path) -> str | None:
    mime = {".png": "image/png", ".gif": "image/gif", ".jpg": "image/jpeg"}.get(path.suffix)
    if mime is None or not path.is_file():
        return None
    return _b64(path.read_bytes(), mime)


def _e(x) -> str:
    return html.escape("" if x is None else str(x))


def _f(x, digits: int = 3) -> str:
    if isinstance(x, int | float) and not isinstance(x, bool):
        return "nan" if isinstance(x, float) and math.isnan(x) else f"{x:.{digits}f}"
    return _e(x)


def _figure(fig, alt: str) -> str:
    return f'<img class="fig" alt="{_e(alt)}" src="{fig_uri(fig)}">'


# ---------------------------------------------------------------------------- sections
def summary_section(run: Run) -> str:
    m = run.metrics
    evals = [c for c in m if c.startswith("eval/")]
    rows = m.dropna(subset=evals, how="all") if evals else m.iloc[0:0]
    if rows.empty:
        return "<p>No eval rows in metrics.jsonl.</p>"
    first, last = rows.iloc[0], rows.iloc[-1]
    out = [
        "<table><tr><th>metric</th>"
        f"<th>step {int(first['step'])}</th><th>step {int(last['step'])}</th><th>change</th></tr>"
    ]
    for k in evals:
        a, b = first[k], last[k]
        if pd.isna(a) and pd.isna(b):
            continue
        ch = b - a
        cls = "pos" if ch > 0 else "neg" if ch < 0 else ""
        out.append(
            f"<tr><td>{_e(k)}</td><td class=num>{_f(a, 4)}</td><td class=num>{_f(b, 4)}</td>"
            f'<td class="num {cls}">{ch:+.4f}</td></tr>'
        )
    out.append("</table>")
    s = run.summary
    if s.get("steps_planned"):
        done, planned = s["steps_done"], s["steps_planned"]
        note = "" if done >= planned else " <b class=neg>INCOMPLETE: not the recipe's result</b>"
        out.append(f"<p>steps {done}/{planned}{note}</p>")
    return "".join(out)


def _media_html(run: Run, row: pd.Series, cls: str = "") -> str:
    f = row.get("output_file")
    if isinstance(f, str):
        uri = _file_uri(run.path / f)
        if uri:
            return f'<img class="{cls}" alt="{_e(f)}" src="{uri}">'
    out = row.get("output")
    return f"<div><b>output:</b> <code>{_e(out)}</code></div>" if isinstance(out, str) else ""


def _verdicts_html(run: Run, row: pd.Series) -> str:
    """Each judge's verdict and, under it, why: one line per question, repeat or text."""
    parts = []
    for term in run.judge_terms:
        v = row.get(f"verdict/{term}")
        if v is None or (isinstance(v, float) and math.isnan(v)):
            continue
        reasons = "".join(f"<li>{_e(x)}</li>" for x in run.reasons(row, term))
        parts.append(
            f'<div class=judge data-term="{_e(term)}"><b>{_e(term)}</b> verdict <b>{_f(v)}</b>'
            f"<ul class=reasons>{reasons}</ul></div>"
        )
    return "".join(parts)


def _card(run: Run, idx, row: pd.Series) -> str:
    comps = "".join(
        f"<div>{_e(p)} = {_f(row.get(f'part/{p}'))}</div>"
        for p in run.parts
        if not p.endswith("_parse_failed")
    )
    return (
        f'<div class="card" data-row="{idx}">{_media_html(run, row)}'
        f"<div><b>reward {_f(row['reward'])}</b> · adv {_f(row.get('advantage'))}</div>"
        f"<div>step {int(row['step'])} · rank {int(row['rank'])} · {_e(row['prompt_id'])}</div>"
        f'<div class="q">{_e(row.get("prompt"))}</div>{_verdicts_html(run, row)}{comps}</div>'
    )


def sample_cards(run: Run, rows) -> str:
    """HTML cards (image or text, prompt, reward, advantage, verdicts, every component)
    for rollout rows given by index; a notebook shows them with ``display(HTML(...))``."""
    cards = "".join(_card(run, i, run.rollouts.loc[i]) for i in rows)
    return f"<style>{CARD_CSS}</style><div class=cards>{cards}</div>"


def best_worst_section(run: Run, k: int = 8) -> str:
    r = run.rollouts
    if r.empty:
        return "<p>No rollouts logged (trainer.save_rollouts_every=0?).</p>"
    order = r["reward"].sort_values(ascending=False, kind="stable").index
    best = "".join(_card(run, i, r.loc[i]) for i in order[:k])
    worst = "".join(_card(run, i, r.loc[i]) for i in order[::-1][:k])
    return (
        f"<h3>Best {min(k, len(r))} by reward</h3><div class=cards>{best}</div>"
        f"<h3>Worst {min(k, len(r))} by reward</h3><div class=cards>{worst}</div>"
    )


def disagreement_section(run: Run, k: int = 8) -> str:
    judges, checks = run.judge_terms, run.check_terms
    if not judges:
        return "<p>No GenRM judge in this run's rewards: nothing to compare.</p>"
    if not checks:
        return "<p>No rule or critic was logged next to the judge (add one with weight 0).</p>"
    out = []
    for judge in judges:
        for check in checks:
            d = run.disagreements(judge, check)
            if d.empty:
                continue
            agree = ((d["judge"] >= 0.5) == (d["check"] >= 0.5)).mean()
            corr = d["judge"].corr(d["check"]) if d["check"].std() > 0 else float("nan")
            out.append(
                f"<h3>{_e(judge)} vs {_e(check)}</h3><p>{len(d)} samples: mean |gap| "
                f"{d['gap'].abs().mean():.3f}, same side of 0.5 on {agree:.1%}, "
                f"correlation {_f(corr)}. Judge above the check on "
                f"{(d['gap'] > 0.5).sum()} samples by more than 0.5, below it on "
                f"{(d['gap'] < -0.5).sum()}.</p>"
            )
            out.append(_figure(plots.judge_vs_check(d, judge, check), f"{judge} vs {check}"))
            cards = "".join(_card(run, i, run.rollouts.loc[i]) for i in d["row"][:k])
            out.append(f"<p>Largest disagreements first:</p><div class=cards>{cards}</div>")
    return "".join(out)


def _step_of(path: Path) -> int:
    return int(path.name.split("_")[1].split(".")[0])


def _grid_caption(path: Path, what: str) -> str:
    """What a grid or clip shows: its step, and each image's prompt and reward."""
    captions = path.parent / f"step_{_step_of(path):06d}.txt"
    head = f"{what} of the eval at step {_step_of(path)} (rank 0's share)"
    if not captions.is_file():
        return f"<figcaption>{_e(head)}</figcaption>"
    shown = read_captions(captions)
    if what == "grid":
        head += f", {GRID_COLUMNS} per row, left to right"
    items = "".join(f"<li>{_e(prompt)}: reward {reward:.3f}</li>" for _, reward, prompt in shown)
    return f"<figcaption>{_e(head)}:<ol start=0 class=captions>{items}</ol></figcaption>"


def _text_samples(path: Path, limit: int = 8) -> str:
    """A text or VLM eval's samples: the image or clip asked about, the prompt, the
    answer given and the one expected, the reward."""
    rows = [json.loads(x) for x in path.read_text().splitlines() if x.strip()][:limit]
    cards = []
    for row in rows:
        media = ""
        for key in ("image", "video"):
            uri = _file_uri(Path(row[key])) if isinstance(row.get(key), str) else None
            if uri:
                media += f'<img alt="{_e(row[key])}" src="{uri}">'
        expected = (
            f"<div>expected <code>{_e(row['answer'])}</code></div>" if "answer" in row else ""
        )
        cards.append(
            f'<div class="card eval">{media}<div class="q">{_e(row.get("prompt"))}</div>'
            f"<div>output <code>{_e(row.get('output'))}</code></div>{expected}"
            f"<div>reward {_f(row.get('reward'))}</div></div>"
        )
    head = f"<h3>The eval at step {_step_of(path)} (rank 0's share, first {len(rows)})</h3>"
    return f"{head}<div class=cards>{''.join(cards)}</div>"


def eval_grid_section(run: Run) -> str:
    grids = sorted((run.path / "samples").glob("step_*.png"))
    gifs = sorted((run.path / "samples").glob("step_*_clip0.gif"))
    texts = sorted((run.path / "samples").glob("step_*.jsonl"))
    shown = [(p, "grid") for p in ([grids[0], grids[-1]] if len(grids) > 1 else grids)]
    shown += [(p, "first clip") for p in ([gifs[0], gifs[-1]] if len(gifs) > 1 else gifs)]
    out = []
    for p, what in shown:
        uri = _file_uri(p)
        out.append(
            f'<figure style="display:inline-block;vertical-align:top"><img class=fig style='
            f'"image-rendering:pixelated;max-width:560px" alt="{_e(p.name)}" src="{uri}">'
            f"{_grid_caption(p, what)}</figure>"
        )
    for p in [texts[0], texts[-1]] if len(texts) > 1 else texts:
        out.append(_text_samples(p))
    return "".join(out) or "<p>No eval samples in samples/.</p>"


def all_samples_section(run: Run) -> str:
    r = run.rollouts
    if r.empty:
        return "<p>No rollouts logged.</p>"
    parts = [p for p in run.parts]
    head = ["step", "rank", "group", "sample", "prompt", "output", "reward", "advantage"]
    head += [f"part {p}" for p in parts]
    for t in run.judge_terms:
        head += [f"{t} verdict", f"{t} why"]
    out = ["<table class=samples><tr>" + "".join(f"<th>{_e(h)}</th>" for h in head) + "</tr>"]
    for i, row in r.iterrows():
        cells = [
            f"<td class=num>{int(row['step'])}</td>",
            f"<td class=num>{int(row['rank'])}</td>",
            f"<td class=num>{int(row['group'])}</td>",
            f"<td class=num>{int(row['sample'])}</td>",
            f"<td>{_e(row.get('prompt'))}</td>",
            f"<td>{_media_html(run, row)}</td>",
            f"<td class=num data-k=reward>{_f(row['reward'], 4)}</td>",
            f"<td class=num>{_f(row.get('advantage'), 4)}</td>",
        ]
        cells += [
            f"<td class=num data-k='part/{_e(p)}'>{_f(row.get(f'part/{p}'), 4)}</td>" for p in parts
        ]
        for t in run.judge_terms:
            cells.append(
                f"<td class=num data-k='verdict/{_e(t)}'>{_f(row.get(f'verdict/{t}'), 4)}</td>"
            )
            cells.append(f"<td>{_e('; '.join(run.reasons(row, t)))}</td>")
        out.append(f'<tr class=sample id="s{i}">' + "".join(cells) + "</tr>")
    out.append("</table>")
    return "".join(out)


def render(run: Run) -> str:
    m, r = run.metrics, run.rollouts
    spread = run.group_spread()
    cfg = run.config
    rewards = ", ".join(
        f"{f.get('name')} (weight {f.get('weight', 1.0)})"
        for f in (cfg.get("reward") or {}).get("functions", [])
    )
    model = cfg.get("model") or {}
    algo = cfg.get("algorithm") or {}
    sections = [
        ("Before and after (eval)", summary_section(run)),
        (
            "Reward and eval curves",
            _figure(plots.reward_curves(m, plots.reward_bounds(r)), "reward curves"),
        ),
        ("Reward components", _figure(plots.component_curves(m), "components")),
        ("Phase timings", _figure(plots.timing_plot(m), "timings")),
        ("Reward per step (logged samples)", _figure(plots.reward_histograms(r), "histograms")),
        (
            "Spread within prompt groups",
            _figure(plots.group_spread_plot(spread), "group spread") + _spread_table(spread),
        ),
        ("Best and worst samples", best_worst_section(run)),
        ("Judge against the checks logged next to it", disagreement_section(run)),
        ("Eval samples (rank 0's share)", eval_grid_section(run)),
        (f"Every logged sample ({len(r)})", all_samples_section(run)),
    ]
    body = "".join(f"<h2>{_e(t)}</h2>{s}" for t, s in sections)
    when = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    return (
        "<!doctype html><html><head><meta charset=utf-8>"
        f"<title>mmyatt run {_e(run.name)}</title><style>{CSS}{CARD_CSS}</style></head><body>"
        f"<h1>{_e(run.name)}</h1><div class=meta>{_e(run.path)} · model {_e(model.get('kind'))} "
        f"{_e(model.get('path') or '')} · advantage {_e(algo.get('advantage'))} · rewards: "
        f"{_e(rewards)} · {_e(run.header())} · report written {when}"
        f"</div>{body}</body></html>"
    )


def _spread_table(spread: pd.DataFrame) -> str:
    if spread.empty:
        return ""
    by = spread.groupby("step").agg(
        groups=("n", "size"), mean_std=("std", "mean"), flat=("flat", "mean")
    )
    rows = "".join(
        f"<tr><td class=num>{s}</td><td class=num>{int(x.groups)}</td>"
        f"<td class=num>{x.mean_std:.4f}</td><td class=num>{x.flat:.0%}</td></tr>"
        for s, x in by.iterrows()
    )
    return (
        "<table><tr><th>step</th><th>groups</th><th>mean within-group std</th>"
        f"<th>groups with equal rewards</th></tr>{rows}</table>"
    )


def write_report(run_dir: str | Path, out: str | Path | None = None) -> Path:
    """Write the report (default ``<run dir>/report.html``) and return its path."""
    run = load_run(run_dir)
    path = Path(out) if out else run.path / "report.html"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(render(run), encoding="utf-8")
    return path
