"""The engine-owned adapter protocols, re-exported under their old import path.

The definitions live in :mod:`mmyatt.protocols`; adapters and tests import them from
there or from here.
"""

from mmyatt.protocols import (
    CLOSED_FORM_KL,
    EMA,
    ClosedFormKL,
    Policy,
    ReferenceKL,
    Sampling,
    SupervisedPolicy,
    prompt_seed,
    seeded_generator,
)

__all__ = [
    "CLOSED_FORM_KL",
    "EMA",
    "ClosedFormKL",
    "Policy",
    "ReferenceKL",
    "Sampling",
    "SupervisedPolicy",
    "prompt_seed",
    "seeded_generator",
]
