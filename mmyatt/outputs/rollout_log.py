"""The rollout log: what each controller generated, how it was scored, what it learned from.

Every ``trainer.save_rollouts_every`` steps each controller appends the samples of that
step's rollout to ``rollouts/rank<r>.jsonl``, one JSON object per sample (the fields are
documented in ``docs/rollout_logs.md`` and :data:`FIELDS`). Images and clips are written
next to it under ``rollouts/media/step_<step>/`` (PNG, GIF) and the row holds their path
relative to the run directory, so the log stays small and greppable.

Size bound: at most ``trainer.rollouts_per_step`` samples per controller per logged step,
taken as whole prompt groups in the order the controller drew them (its shard order, a
seeded shuffle): the spread within a group is always complete. A run of S steps on P
controllers logs at most ``S / save_rollouts_every * P * rollouts_per_step`` rows.

Nothing here crosses ranks: each controller writes its own file and its own media.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch

from mmyatt.rollout import Rollout

FIELDS = {
    "step": "the training step whose rollout this is",
    "rank": "the controller that generated and scored it",
    "prompt_id": "the prompt (equal ids = one group)",
    "group": "index of the prompt group within this rank's logged samples of the step",
    "sample": "index of the sample within its group (0..G-1)",
    "prompt": "the prompt text",
    "split": "the record's split label (heldout / seen) when it has one",
    "answer": "the record's reference answer when it has one (text and VLM tasks)",
    "media": "the record's own inputs, {'image': path, 'video': path} (VLM prompts)",
    "output": "the generated text (text and VLM policies)",
    "output_file": "the generated image (PNG) or clip (GIF), relative to the run directory",
    "reward": "the combined reward the advantage was computed from",
    "parts": "every reward component by name, weight 0 checks included",
    "verdicts": "per GenRM term: question, raw answer, top log-probs, parsed values, verdict",
    "advantage": "the sample's advantage (mean over its actions when per-action)",
    "length": "actions that counted: tokens, or trained denoising steps",
    "truncated": "hit the token budget without stopping",
}


def rollout_path(run_dir: Path, rank: int) -> Path:
    return Path(run_dir) / "rollouts" / f"rank{rank}.jsonl"


def select_groups(r: Rollout, cap: int) -> list[slice]:
    """Whole groups in order while the total stays within ``cap`` (at least one group).

    >>> from types import SimpleNamespace
    >>> r = SimpleNamespace(group_slices=lambda: [slice(0, 4), slice(4, 8), slice(8, 12)])
    >>> select_groups(r, 9)
    [slice(0, 4, None), slice(4, 8, None)]
    >>> select_groups(r, 2)
    [slice(0, 4, None)]
    """
    chosen, total = [], 0
    for sl in r.group_slices():
        size = sl.stop - sl.start
        if chosen and total + size > cap:
            break
        chosen.append(sl)
        total += size
    return chosen


def write_rollouts(run_dir: Path, rank: int, step: int, r: Rollout, cap: int) -> list[dict]:
    """Append this rank's logged samples of ``step``; returns the rows written."""
    path = rollout_path(run_dir, rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    rows = []
    for g, sl in enumerate(select_groups(r, cap)):
        for j, i in enumerate(range(sl.start, sl.stop)):
            rows.append(_row(run_dir, rank, step, r, i, g, j))
    with path.open("a") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    return rows


def _row(run_dir: Path, rank: int, step: int, r: Rollout, i: int, group: int, j: int) -> dict:
    rec = r.records[i]
    row: dict[str, Any] = {
        "step": step,
        "rank": rank,
        "prompt_id": r.prompt_ids[i],
        "group": group,
        "sample": j,
        "prompt": rec.get("prompt"),
    }
    for key in ("split", "answer"):
        if rec.get(key) is not None:
            row[key] = rec[key]
    media = {k: str(rec[k]) for k in ("image", "video") if isinstance(rec.get(k), str | Path)}
    if media:
        row["media"] = media
    out = r.outputs[i]
    if isinstance(out, str):
        row["output"] = out
    else:
        row["output_file"] = _save_media(run_dir, rank, step, i, out)
    row["reward"] = _num(r.rewards[i])
    row["parts"] = {k: _num(v[i]) for k, v in r.reward_parts.items()}
    if r.verdicts is not None and r.verdicts[i]:
        row["verdicts"] = r.verdicts[i]
    if r.advantages is not None:
        adv = r.advantages[i]
        if adv.dim() > 0:  # per-action advantages: their mean over the counted actions
            m = r.mask[i].to(adv.device)
            adv = (adv * m).sum() / m.sum().clamp(min=1)
        row["advantage"] = _num(adv)
    row["length"] = int(r.mask[i].sum())
    if r.truncated is not None:
        row["truncated"] = bool(r.truncated[i])
    return row


def _num(x: Any) -> float | str:
    """A float, or its text when not finite (JSON has no NaN)."""
    v = float(x.item() if isinstance(x, torch.Tensor) else x)
    return v if v == v and abs(v) != float("inf") else str(v)


def _save_media(run_dir: Path, rank: int, step: int, i: int, out: Any) -> str | None:
    from PIL import Image

    folder = Path(run_dir) / "rollouts" / "media" / f"step_{step:06d}"
    folder.mkdir(parents=True, exist_ok=True)
    stem = f"rank{rank}_{i:04d}"
    if isinstance(out, Image.Image):
        path = folder / f"{stem}.png"
        out.save(path)
    elif isinstance(out, list) and out and isinstance(out[0], Image.Image):
        path = folder / f"{stem}.gif"
        out[0].save(path, save_all=True, append_images=out[1:], duration=150, loop=0)
    else:
        return None
    return str(path.relative_to(run_dir))


def truncate_rollouts(run_dir: Path, rank: int, step: int) -> None:
    """Drop this rank's rows (and media) logged after ``step``: a resumed or restarted
    run rewrites them."""
    path = rollout_path(run_dir, rank)
    if path.exists():
        rows = [x for x in path.read_text().splitlines() if x.strip()]
        path.write_text("".join(x + "\n" for x in rows if json.loads(x)["step"] <= step))
    media = Path(run_dir) / "rollouts" / "media"
    if media.is_dir():
        for folder in media.glob("step_*"):
            if int(folder.name[5:]) > step:
                for f in folder.glob(f"rank{rank}_*"):
                    f.unlink()
                if not any(folder.iterdir()):
                    shutil.rmtree(folder, ignore_errors=True)


# the logged rows as a table (TensorBoard's Markdown text, wandb's and mlflow's tables)
TABLE_COLUMNS = ("step", "rank", "prompt_id", "sample", "prompt", "output", "reward", "advantage")


def table_rows(rows: list[dict]) -> list[list]:
    """Rollout rows as table cells in TABLE_COLUMNS order, reward parts and verdicts
    flattened to text (``name=value``)."""
    out = []
    for r in rows:
        cells = [r.get(c) for c in TABLE_COLUMNS]
        cells[TABLE_COLUMNS.index("output")] = r.get("output", r.get("output_file"))
        parts = ", ".join(f"{k}={v:.3f}" for k, v in r.get("parts", {}).items() if is_number(v))
        verdicts = "; ".join(f"{k}: {verdict_text(v)}" for k, v in r.get("verdicts", {}).items())
        out.append([*cells, parts, verdicts])
    return out


def markdown_table(rows: list[dict]) -> str:
    head = [*TABLE_COLUMNS, "parts", "verdicts"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for cells in table_rows(rows):
        text = [str(c).replace("|", "\\|").replace("\n", " ") for c in cells]
        lines.append("| " + " | ".join(text) + " |")
    return "\n".join(lines)


def is_number(v) -> bool:
    return isinstance(v, int | float)


def verdict_text(v: dict) -> str:
    raw = v.get("raw")
    raw = raw[0] if isinstance(raw, list) and raw else raw
    verdict = v.get("verdict")
    value = f"{verdict:.3f}" if is_number(verdict) else str(verdict)
    return f"{raw!r} -> {value}"
