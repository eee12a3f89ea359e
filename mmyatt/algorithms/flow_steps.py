"""Flow models: which denoising steps of a rollout are stochastic (SDE) and which are
trained (Flow-GRPO, Flow-GRPO-Fast, MixGRPO). Leaves out the SDE step itself
(``mmyatt.models.flow_sde``).
"""

from __future__ import annotations

_MODES = ("all", "fraction", "window", "sliding")


def train_step_schedule(
    num_steps: int,
    *,
    mode: str = "all",
    fraction: float = 1.0,
    window: int = 2,
    window_start: int = 0,
    step: int = 0,
    slide_every: int = 1,
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Which denoising steps are stochastic (SDE) and which are trained.

    Steps are indexed 0..num_steps-1 from high noise to low noise. Returns
    ``(sde_steps, train_steps)``, sorted tuples, train_steps a subset of sde_steps; the
    engine copies them into ``Sampling.sde_steps`` / ``Sampling.train_steps``.

    * ``"all"``: every step is SDE and trained (Flow-GRPO).
    * ``"fraction"``: every step is SDE; the first int(num_steps * fraction) are trained
      (flow_grpo ``timestep_fraction``: 0.99 of 10 steps trains steps 0-8).
    * ``"window"``: SDE and training only in [window_start, window_start + window), ODE
      elsewhere (Flow-GRPO-Fast).
    * ``"sliding"``: MixGRPO. Like "window", but the start moves one step toward low noise
      every ``slide_every`` training steps (``step`` is the engine's training step), and
      wraps around to step 0 after the last position num_steps - window.
    """
    if num_steps < 1:
        raise ValueError(f"num_steps must be >= 1, got {num_steps}")
    if mode not in _MODES:
        raise ValueError(f"mode must be one of {_MODES}, got {mode!r}")
    everything = tuple(range(num_steps))
    if mode == "all":
        return everything, everything
    if mode == "fraction":
        if not 0.0 < fraction <= 1.0:
            raise ValueError(f"fraction must be in (0, 1], got {fraction}")
        n = int(num_steps * fraction)
        if n < 1:
            raise ValueError(
                f"fraction {fraction} of {num_steps} steps trains no step; raise it to "
                f">= {1.0 / num_steps:.4g}"
            )
        return everything, everything[:n]
    if not 1 <= window <= num_steps:
        raise ValueError(f"window must be in [1, num_steps={num_steps}], got {window}")
    positions = num_steps - window + 1  # valid window starts: 0..num_steps-window
    if not 0 <= window_start < positions:
        raise ValueError(
            f"window_start must be in [0, {positions - 1}] for window {window} of "
            f"{num_steps} steps, got {window_start}"
        )
    start = window_start
    if mode == "sliding":
        if slide_every < 1:
            raise ValueError(f"slide_every must be >= 1, got {slide_every}")
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        start = (window_start + step // slide_every) % positions
    steps = tuple(range(start, start + window))
    return steps, steps
