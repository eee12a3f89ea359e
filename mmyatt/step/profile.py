"""Where the time of a training step goes: wall-clock timers around the real calls.

``StepProfile`` wraps callables (a model's ``forward``, ``Tensor.backward``, an
optimizer's ``step``, the reward, the collectives, ...) with timers, each under one
*kind*. Only the outermost timed call counts, so a forward inside a timed reward is
reward time, and nothing is counted twice. Whatever a step spends outside every timed
call is ``other``: Python between the calls, tensor glue, logging.

The kinds that are model compute (``MODEL_KINDS``) are the ones the step exists for:
forward, backward, optimizer (including gradient clipping) and the sampling kernels
(tempering, drawing tokens, the SDE step and its log-prob). Turning samples into
what the reward reads (detokenizing, tensors to images) is ``outputs``. Framework code
that runs inside a timed call (e.g. the mask building inside a Hugging Face
``forward``) counts as that call's kind; the figures say where the step waits, not
which instruction runs.

``mmyatt bench text-grpo`` turns it on in every controller through the environment
variable ``MMYATT_STEP_PROFILE`` (see ``profile_controller``); ``mmyatt bench flow-grpo``
uses it in-process. A timer costs about a microsecond per call.
"""

from __future__ import annotations

import functools
import json
import time
from pathlib import Path

import torch

from mmyatt.algorithms import advantages, kl, losses
from mmyatt.engines import adapter_of
from mmyatt.models import decode, flow
from mmyatt.models.text import TextPolicy

MODEL_KINDS = ("forward", "backward", "optimizer", "sampling")
# reported in this order; "other" is the step time outside every timed call
KINDS = (*MODEL_KINDS, "reward", "communication", "outputs", "loss", "other")


class StepProfile:
    def __init__(self):
        self._depth = 0
        self._seconds: dict[str, float] = {}
        self._step_t0: float | None = None
        self.steps: list[dict[str, float]] = []  # per finished step: kind -> seconds, "step"
        self._patched: list[tuple[object, str, object, bool]] = []

    # --- wrapping -------------------------------------------------------------------
    def timed(self, kind: str, fn):
        """``fn`` with its wall time added to ``kind`` (outermost timed call only)."""

        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            if self._depth:
                return fn(*args, **kwargs)
            self._depth += 1
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self._seconds[kind] = self._seconds.get(kind, 0.0) + time.perf_counter() - t0
                self._depth -= 1

        return wrapper

    def patch(self, owner, attr: str, kind: str) -> None:
        """Replace ``owner.attr`` by its timed version until ``restore``."""
        had = attr in vars(owner) if hasattr(owner, "__dict__") else False
        original = getattr(owner, attr)
        self._patched.append((owner, attr, vars(owner).get(attr) if had else None, had))
        setattr(owner, attr, self.timed(kind, original))

    def restore(self) -> None:
        for owner, attr, original, had in reversed(self._patched):
            if had:
                setattr(owner, attr, original)
            else:
                delattr(owner, attr)
        self._patched.clear()

    # --- steps ----------------------------------------------------------------------
    def begin_step(self) -> None:
        self._seconds = {}
        self._step_t0 = time.perf_counter()

    def end_step(self) -> None:
        total = time.perf_counter() - self._step_t0
        row = dict(self._seconds)
        row["other"] = max(total - sum(row.values()), 0.0)
        row["step"] = total
        self.steps.append(row)

    def summary(self, skip: int = 1) -> dict:
        """Mean seconds per step and share of step time of every kind, over the steps
        after the first ``skip`` (warm-up), and the model-compute share."""
        rows = self.steps[skip:] or self.steps
        if not rows:
            return {}
        n = len(rows)
        step = sum(r["step"] for r in rows) / n
        kinds = [k for k in KINDS if any(k in r for r in rows)]
        kinds += sorted({k for r in rows for k in r} - set(kinds) - {"step"})
        seconds = {k: sum(r.get(k, 0.0) for r in rows) / n for k in kinds}
        share = {k: v / step for k, v in seconds.items()}
        return {
            "steps_profiled": n,
            "step_s": step,
            "seconds": seconds,
            "share": share,
            "model_compute_share": sum(share.get(k, 0.0) for k in MODEL_KINDS),
        }


def instrument_common(prof: StepProfile, optimizer=None, reward=None) -> None:
    """Timers on what every step has: ``Tensor.backward``, gradient clipping, the
    optimizer's ``step`` and ``zero_grad``, and the loss math of ``mmyatt.algorithms``."""
    prof.patch(torch.Tensor, "backward", "backward")
    prof.patch(torch.nn.utils, "clip_grad_norm_", "optimizer")
    if optimizer is not None:
        prof.patch(optimizer, "step", "optimizer")
        prof.patch(optimizer, "zero_grad", "optimizer")
    for module, names in (
        (losses, ("ppo_clip_loss", "aggregate_loss", "loss_terms", "masked_mean")),
        (kl, ("kl_penalty",)),
        (advantages, ("compute_advantages", "grpo_advantages")),
    ):
        for name in names:
            prof.patch(module, name, "loss")


def instrument_text_policy(prof: StepProfile, policy) -> None:
    """Model forwards (sampling and scoring), the sampling kernels and detokenization."""
    prof.patch(policy.model, "forward", "forward")
    prof.patch(decode.StaticKVDecoder, "step", "forward")  # decode steps past model.forward
    for name in decode.SAMPLING_KERNELS:
        prof.patch(decode, name, "sampling")
    prof.patch(policy.tokenizer, "batch_decode", "outputs")


def instrument_flow_policy(prof: StepProfile, policy) -> None:
    """Transformer, text encoder and VAE calls (forward), the SDE/ODE step math and its
    noise (sampling), and the conversion of samples to PIL images (outputs)."""
    prof.patch(policy.transformer, "forward", "forward")
    if policy.text_encoder is not None:
        prof.patch(policy.text_encoder, "forward", "forward")
    if policy.vae is not None:
        prof.patch(policy, "to_pixels", "forward")
    for name in ("sde_step", "cps_step", "euler_step"):
        prof.patch(flow, name, "sampling")
    prof.patch(flow, "tensor_to_images", "outputs")


def profile_controller(ctl, out: str | Path) -> StepProfile:
    """Timers on a controller's step (text policies); each finished step rewrites ``out``
    (JSON: per-step seconds by kind and the summary)."""
    prof = StepProfile()
    instrument_common(prof, ctl.optimizer)
    policy = adapter_of(ctl.policy)  # under a sharding or a vLLM rollout engine
    if isinstance(policy, TextPolicy):
        instrument_text_policy(prof, policy)
    prof.patch(type(ctl.scorer.reward), "__call__", "reward")
    for name in ("sum", "sum_many", "sum_grads", "any", "gather_ints", "barrier"):
        prof.patch(ctl.dist, name, "communication")
    step = ctl.step
    out = Path(out)

    def profiled_step():
        prof.begin_step()
        try:
            return step()
        finally:
            prof.end_step()
            out.write_text(json.dumps({"steps": prof.steps, "summary": prof.summary()}) + "\n")

    ctl.step = profiled_step
    return prof
