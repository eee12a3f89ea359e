"""Records that teach a description judge to read motion: the same clip asked in the same
words with its true direction ("Yes") and with other directions ("No"), so that only the
frames tell them apart (:func:`direction_contrast_records`). Drawn from ground truth,
labelled by how the clip was drawn, never naming a held-out combination
(:func:`~mmyatt.datasets.describe.names_heldout`). ``builtin:describe_judge_motion`` was
trained with them (its README)."""

from __future__ import annotations

import numpy as np

from .describe import (
    FRAMES,
    JUDGE_TEMPLATE,
    VIDEO_PHRASES,
    clip_frames,
    describe_records,
    names_heldout,
)
from .factored_shapes import EXTRA_COLOURS
from .shapes import COLOURS, DIRECTIONS, SHAPES


def direction_contrast_records(
    n_clips: int,
    *,
    seed: int,
    wrong: int = 1,
    frames: int = FRAMES,
    other_kinds: float = 0.0,
    **kwargs,
) -> list[dict]:
    """The judge's question about ``n_clips`` clips, each asked in one phrasing with its
    true direction ("Yes") and with ``wrong`` (1 to 3) other directions ("No", kind
    ``direction``): records that differ in the direction word alone, so that only the
    motion in the frames tells them apart (a description drawn whole carries a wrong
    direction in a few records of a hundred). A wrong direction that would name a
    held-out triple (a trained pair moving a held-out way) is skipped, so a clip may
    come with fewer; the clips themselves exclude the held-out combinations by default
    (``kwargs`` go to :func:`~mmyatt.datasets.describe.describe_records`). ``other_kinds``: that share of the clips
    is asked, instead of its wrong directions, with ``wrong`` wrong colours or shapes (half
    each; kinds ``colour`` / ``shape``, the wrong colour from the clip's own group as
    :func:`~mmyatt.datasets.describe.judge_records` draws it, never one that names a held-out pair), in the same words
    too, so that a clip's colour and shape keep counting. Returns the records clip by
    clip, the true one first.

    >>> recs = direction_contrast_records(2, seed=0, wrong=3)
    >>> [r["verdict"] for r in recs][:2], recs[0]["direction"] in recs[0]["output"]
    (['Yes', 'No'], True)
    """
    if not 1 <= wrong <= len(DIRECTIONS) - 1:
        raise ValueError(f"wrong must be in [1, {len(DIRECTIONS) - 1}], got {wrong}")
    rng = np.random.default_rng([seed, 15])
    kind_rng = np.random.default_rng([seed, 16])  # its own stream: other_kinds=0 draws as before
    out = []
    for rec in describe_records(n_clips, seed=seed, video_fraction=1.0, **kwargs):
        c, s, d = rec["colour"], rec["shape"], rec["direction"]
        phrase = VIDEO_PHRASES[int(rng.integers(len(VIDEO_PHRASES)))]
        others = [x for x in DIRECTIONS if x != d]
        asked = [(c, s, d, None)] + [
            (c, s, others[int(i)], "direction") for i in rng.permutation(len(others))[:wrong]
        ]
        if other_kinds and kind_rng.random() < other_kinds:
            attr = "colour" if kind_rng.random() < 0.5 else "shape"
            palette = list(COLOURS) if c in COLOURS else list(EXTRA_COLOURS)
            values = [v for v in (palette if attr == "colour" else SHAPES) if v != rec[attr]]
            values = [
                v
                for v in values
                if not names_heldout(
                    phrase.format(
                        colour=v if attr == "colour" else c,
                        shape=v if attr == "shape" else s,
                        direction=d,
                    ),
                    rec,
                )
            ]
            picked = [values[int(i)] for i in kind_rng.permutation(len(values))[:wrong]]
            asked = asked[:1] + [
                (v, s, d, attr) if attr == "colour" else (c, v, d, attr) for v in picked
            ]
        media = clip_frames(rec["video"], frames)
        for colour, shape, direction, kind in asked:
            text = phrase.format(colour=colour, shape=shape, direction=direction)
            if kind and names_heldout(text, rec):
                continue
            verdict = "No" if kind else "Yes"
            out.append(
                {
                    **{key: rec[key] for key in ("id", "colour", "shape", "direction", "task")},
                    "image": media,
                    "prompt": JUDGE_TEMPLATE.format(output=text),
                    "output": text,
                    "answer": verdict,
                    "verdict": verdict,
                    "negative_type": kind,
                }
            )
    return out


def direction_shortcut(train: list[dict], evaluated: list[dict]) -> dict:
    """How far a clip's colour and shape alone predict its direction. For each (colour,
    shape) the most common direction of ``train``'s clips is the guess (ties: the first
    met); returns the share of ``train``'s clips and of ``evaluated``'s clips (overall
    and per ``"split"``) whose true direction it is. Chance is 0.25. A policy that learns
    the guess instead of reading the frames gains on training clips and loses on held-out
    triples, whose direction a pair never moves in training."""
    counts: dict[tuple, dict[str, int]] = {}
    for r in train:
        if r.get("direction"):
            seen = counts.setdefault((r["colour"], r["shape"]), {})
            seen[r["direction"]] = seen.get(r["direction"], 0) + 1
    guess = {pair: max(seen, key=seen.get) for pair, seen in counts.items()}

    def share(records: list[dict]) -> float | None:
        clips = [r for r in records if r.get("direction")]
        hits = [guess.get((r["colour"], r["shape"])) == r["direction"] for r in clips]
        return round(float(np.mean(hits)), 4) if clips else None

    out = {"pairs": len(guess), "train": share(train), "evaluated": share(evaluated)}
    for split in sorted({r["split"] for r in evaluated if r.get("split")}):
        out[split] = share([r for r in evaluated if r.get("split") == split])
    return out
