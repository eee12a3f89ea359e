"""Where prompts come from: manifests or a synthetic task, and how many per step."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from mmyatt.config.section import Bool, Int, Section, Str


class DataConfig(Section):
    train: Str = "synthetic:arithmetic"
    """JSONL path(s, comma separated) or synthetic:<task>"""
    eval: Str = "synthetic:arithmetic"
    val: Str | None = None
    """JSONL for choices made during a run (the SFT stopping check), never the reported
    eval; synthetic tasks write and fill it in"""
    synthetic_train_size: Int = Field(20000, ge=1)
    synthetic_eval_size: Int = Field(500, ge=1)
    synthetic_kwargs: dict[Str, Any] = Field(default_factory=dict)
    """keyword arguments of the synthetic task's writer (synthetic:describe:
    extra_colours, the share of train and SFT records in colours outside the eval
    palette; val_fold: 2 for the second validation fold; shape_first, the share of
    reference answers that name the shape before the colour; extra_shapes, the share
    of train and SFT images showing a shape outside the eval's three; clip_heldout:
    pairs to hold out whole colour x shape pairs for clips, triples (default) for
    colour x shape x direction; video_fraction, the share of clips, 0.25;
    sft_direction_drill: true to ask each SFT clip its direction too)"""
    prompts_per_step: Int = Field(16, ge=1)
    """B, global over all controllers"""
    shuffle: Bool = True
    bad_lines: Literal["fail", "skip"] = "fail"
    eval_prompts: Int = Field(500, ge=1)
    """global, split over controllers"""
    eval_split: Literal["test", "val"] = "test"
    """which eval split a synthetic task reports: test (the reported figures) or val (the
    split recipes and judges are chosen on; its own prompts, combinations and seeds)"""
