"""The independent critic as a reward: ``shape_critic``, a CNN trained only on clean
drawn shapes with their drawing labels (``mmyatt.models.builtin.critic``). No judge,
rule or RL training reads it, so it checks a judged reward from outside.

This module imports torch (the critic is a torch model); the reward registry
(``rewards.rules.resolve_reward``) imports it by name when a run asks for it, so
processes that only score rules stay free of torch.
"""

from __future__ import annotations

import functools
from pathlib import Path

from mmyatt.datasets.shapes import COLOURS, SHAPES
from mmyatt.models import builtin
from mmyatt.models.builtin.critic import ShapeCritic, load_shape_critic
from mmyatt.rewards.image import Output, _frames, _target

BUILTIN_CRITIC = Path(builtin.__file__).resolve().parent / "shape_critic"


@functools.lru_cache(maxsize=4)
def _critic(path: str) -> ShapeCritic:
    return load_shape_critic(path)


def shape_critic(output: Output, record: dict, *, path: str | None = None) -> float:
    """The critic's P(colour) x P(shape) for the record's colour and shape (mean over
    frames for clips), in [0, 1] (``builtin:shape_critic`` unless ``path`` names
    another); log it with weight 0."""
    colour = _target(record, "colour", COLOURS)
    shape = _target(record, "shape", SHAPES)
    frames = _frames(output)
    critic = _critic(path or str(BUILTIN_CRITIC))
    return float(critic.score(frames, [colour] * len(frames), [shape] * len(frames)).mean())
