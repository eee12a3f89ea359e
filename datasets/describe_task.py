"""The describe task on disk (``synthetic:describe``, ``configs/vlm_genrm_tiny.yaml``): the
train, SFT, test and validation splits of :mod:`mmyatt.datasets.describe`'s records, and
which combinations each holds out (:func:`write_describe_task`); the warm start's
direction drill (:func:`direction_drill`)."""

from __future__ import annotations

from pathlib import Path

from .describe import (
    DIRECTION_QUESTION,
    VAL_FOLD2_PAIRS,
    VAL_FOLD2_TRIPLES,
    describe_records,
)
from .shapes import (
    DIRECTIONS,
    HELDOUT,
    HELDOUT_TEST,
    HELDOUT_VAL,
    MOTION_HELDOUT,
    MOTION_HELDOUT_TEST,
    MOTION_HELDOUT_VAL,
    mix_eval_split,
)
from .vision_tasks import write_split


def _eval_split(
    n: int,
    seed: int,
    pairs,
    triples,
    video_fraction: float,
    exclude_pairs=HELDOUT,
    exclude_triples=MOTION_HELDOUT,
) -> list[dict]:
    """2/3 held-out (``pairs`` for images, ``triples`` for clips), then 1/3 trained
    combinations (none in ``exclude_*``), interleaved two held-out then one seen."""
    held = describe_records(
        n, seed=seed, video_fraction=video_fraction, only_pairs=pairs, only_triples=triples
    )
    seen = describe_records(
        n // 2,
        seed=seed + 1,
        video_fraction=video_fraction,
        exclude_pairs=exclude_pairs,
        exclude_triples=exclude_triples,
    )
    return mix_eval_split(
        [{**r, "split": "heldout"} for r in held], [{**r, "split": "seen"} for r in seen]
    )


def write_describe_task(
    out_dir: str | Path,
    *,
    n_train: int = 2000,
    n_eval: int = 96,
    seed: int = 0,
    video_fraction: float = 0.25,
    extra_colours: float = 0.0,
    val_fold: int = 1,
    shape_first: float = 0.0,
    extra_shapes: float = 0.0,
    sft_holdout: bool = False,
    clip_heldout: str = "triples",
    sft_direction_drill: bool = False,
) -> dict[str, Path]:
    """``train.jsonl`` (trained combinations only), ``test.jsonl`` (``n_eval`` held-out
    records of HELDOUT_TEST / MOTION_HELDOUT_TEST + ``n_eval // 2`` seen) and
    ``val.jsonl`` (the same for the _VAL combinations, other seeds). Media under
    ``media/`` (PNG images, GIF clips at 2 fps); ``sft.jsonl``: the SFT warm start's
    records, every combination included, and ``sft_heldout.jsonl`` the same draw with
    the held-out combinations excluded, as RL's split (a warm start that never saw
    them: ``sft.data=<run>/data/sft_heldout.jsonl``; ``sft_holdout=True`` makes it
    ``sft.jsonl``). ``extra_colours``: the share of train and SFT
    records drawn in :data:`EXTRA_COLOURS` (the judge's extra colours, with every shape;
    the eval splits keep the palette). ``val_fold=2``: a second validation fold, for
    checking that a choice carries over to other held-out pairs: the validation pairs
    join RL training and :data:`VAL_FOLD2_PAIRS` / :data:`VAL_FOLD2_TRIPLES` (trained
    combinations of the validation colours) are held out of it and make ``val.jsonl``;
    the test split and its exclusions do not change. ``shape_first``: the share of the
    train and SFT records whose reference answer names the shape before the colour (the
    SFT warm start learns to write the shape first); ``extra_shapes``: the share of their
    images showing an extra shape. ``clip_heldout="pairs"``: the held-out clips are those
    of the held-out colour x shape pairs, in every direction, and the trained pairs move
    every way in training, so that a clip's colour and shape tell nothing of its direction
    (with ``"triples"``, each trained pair misses in training the one direction its
    held-out triple moves in: :func:`mmyatt.datasets.describe_motion.direction_shortcut`).
    ``sft_direction_drill``: each clip of the SFT files is also asked
    :data:`DIRECTION_QUESTION` and answered with its direction (``"task":
    "direction_drill"``), so that the warm start learns to read the motion its
    descriptions name. Returns {"train", "sft", "sft_heldout", "test", "val"}."""
    if val_fold not in (1, 2):
        raise ValueError(f"val_fold must be 1 or 2, got {val_fold}")
    if clip_heldout not in ("triples", "pairs"):
        raise ValueError(f"clip_heldout must be 'triples' or 'pairs', got {clip_heldout!r}")
    if clip_heldout == "pairs" and val_fold != 1:
        raise ValueError("clip_heldout='pairs' has one validation fold (val_fold=1)")
    root = Path(out_dir)
    excl_p, excl_t = HELDOUT, MOTION_HELDOUT
    val_pairs, val_triples, val_seed = HELDOUT_VAL, MOTION_HELDOUT_VAL, 2000 + seed
    test_triples, test_excl = MOTION_HELDOUT_TEST, MOTION_HELDOUT
    if clip_heldout == "pairs":
        excl_t = test_excl = ()
        val_triples = tuple((c, s, d) for c, s in HELDOUT_VAL for d in DIRECTIONS)
        test_triples = tuple((c, s, d) for c, s in HELDOUT_TEST for d in DIRECTIONS)
    if val_fold == 2:
        excl_p = HELDOUT_TEST + VAL_FOLD2_PAIRS
        excl_t = MOTION_HELDOUT_TEST + VAL_FOLD2_TRIPLES
        val_pairs, val_triples, val_seed = VAL_FOLD2_PAIRS, VAL_FOLD2_TRIPLES, 3000 + seed
    splits = {
        "train": describe_records(
            n_train,
            seed=2 * seed,
            video_fraction=video_fraction,
            exclude_pairs=excl_p,
            exclude_triples=excl_t,
            extra_fraction=extra_colours,
            shape_first=shape_first,
            extra_shapes=extra_shapes,
        ),
        # the warm start's split: every combination, as the flow recipes' base models saw
        # them ("held-out" means unseen by RL and by the judge); the same draw without the
        # held-out combinations is written beside it (docs/vlm_genrm.md: both measured on
        # the validation split, this one chosen)
        **{
            name: describe_records(
                n_train,
                seed=2 * seed + 1,
                video_fraction=video_fraction,
                exclude_pairs=excl_p if held else (),
                exclude_triples=excl_t if held else (),
                extra_fraction=extra_colours,
                shape_first=shape_first,
                extra_shapes=extra_shapes,
            )
            for name, held in (("sft", sft_holdout), ("sft_heldout", True))
        },
        "test": _eval_split(
            n_eval, 1000 + seed, HELDOUT_TEST, test_triples, video_fraction, HELDOUT, test_excl
        ),
        "val": _eval_split(
            n_eval, val_seed, val_pairs, val_triples, video_fraction, excl_p, excl_t
        ),
    }
    if sft_direction_drill:
        for name in ("sft", "sft_heldout"):
            splits[name] = splits[name] + direction_drill(splits[name])
    return {name: write_split(recs, root, name, folder="media") for name, recs in splits.items()}


def direction_drill(records: list[dict]) -> list[dict]:
    """Each clip of ``records`` asked :data:`DIRECTION_QUESTION`, answered with its
    direction.

    >>> r = direction_drill([{"id": "a", "direction": "up", "prompt": "p", "answer": "x"}])
    >>> r[0]["prompt"] == DIRECTION_QUESTION, r[0]["answer"], r[0]["id"]
    (True, 'up', 'a-direction')
    """
    return [
        {
            **r,
            "id": f"{r['id']}-direction",
            "prompt": DIRECTION_QUESTION,
            "answer": r["direction"],
            "task": "direction_drill",
        }
        for r in records
        if r.get("direction")
    ]
