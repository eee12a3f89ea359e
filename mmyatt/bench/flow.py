"""`mmyatt bench flow-grpo`: sampling and training throughput of Flow-GRPO, and the
speed-ups of denoising reduction and windowed training, measured side by side.

Workload: the built-in tiny text-to-image model (32x32 pixels), B = 4 prompts x G = 8
images per iteration, one PPO step over the trained transitions. Variants:

* ``full``: 20 SDE steps per rollout (the eval step count), every step trained;
* ``reduced``: 10 SDE steps per rollout (denoising reduction), every step trained;
* ``window``: 10 steps, SDE and training only in a 2-step window (Flow-GRPO-Fast).

Each variant also reports its ``profile`` (``mmyatt.step.profile``): the share of the
iteration in transformer/text-encoder forwards, backward, optimizer, SDE step math,
image conversion, loss math and the rest ("other": Python and glue outside the timers).

``speedup_denoising_reduction`` = time(full) / time(reduced);
``speedup_windowed_training`` = time(reduced) / time(window) (same rollout length, only
the trained window differs); ``speedup_window_over_full`` = time(full) / time(window).
"""

from __future__ import annotations

import statistics
import time

import torch

from mmyatt import algorithms as alg
from mmyatt.models.flow import FlowPolicy
from mmyatt.protocols import Sampling
from mmyatt.step.builders import resolve_builtin
from mmyatt.step.profile import StepProfile, instrument_common, instrument_flow_policy


def _iteration(policy, opt, prompts, group, sampling, seed) -> tuple[float, float, int]:
    t0 = time.perf_counter()
    r = policy.generate(prompts, group, sampling, [seed + i for i in range(len(prompts))])
    t1 = time.perf_counter()
    rewards = torch.randn(len(r))  # throughput only: the reward's value does not matter
    index = torch.arange(len(prompts)).repeat_interleave(group)
    adv = alg.grpo_advantages(rewards, index)
    lp = policy.logprobs(r)
    loss_mat, _ = alg.ppo_clip_loss(lp, r.logprobs, adv, r.mask, clip_low=1e-3, clip_high=1e-3)
    loss = alg.aggregate_loss(loss_mat, r.mask, "token-mean")
    opt.zero_grad()
    loss.backward()
    opt.step()
    t2 = time.perf_counter()
    return t1 - t0, t2 - t1, int(r.mask.sum())


def bench_flow_grpo(quick: bool = False) -> dict:

    torch.set_num_threads(1)
    torch.manual_seed(0)
    policy = FlowPolicy.load(resolve_builtin("builtin:tiny_t2i"))
    opt = torch.optim.AdamW([p for p in policy.module().parameters() if p.requires_grad], lr=1e-5)
    prompts = [
        {"prompt": p, "_index": i}
        for i, p in enumerate(
            ["a red circle", "a blue square", "a green triangle", "a yellow square"]
        )
    ]
    group, reps = 8, (1 if quick else 3)
    variants = {"full": (20, "all"), "reduced": (10, "all"), "window": (10, "window")}
    out: dict = {
        "benchmark": "flow-grpo",
        "prompts": len(prompts),
        "group_size": group,
        "image_size": policy.image_size,
        "threads": 1,
        "repetitions": reps,
    }
    times: dict[str, list[tuple[float, float, int]]] = {k: [] for k in variants}
    # where each variant's iteration goes (mmyatt.step.profile): timers on the real calls
    profiles = {k: StepProfile() for k in variants}
    _iteration(policy, opt, prompts[:1], 2, Sampling(denoise_steps=4), 0)  # warm-up
    for rep in range(reps):  # interleaved, so drift on a noisy machine hits every variant
        for name, (steps, mode) in variants.items():
            sde, train = alg.train_step_schedule(steps, mode=mode, window=2, window_start=0)
            s = Sampling(denoise_steps=steps, noise_level=0.7, sde_steps=sde, train_steps=train)
            prof = profiles[name]
            instrument_common(prof, opt)
            instrument_flow_policy(prof, policy)
            prof.begin_step()
            try:
                times[name].append(_iteration(policy, opt, prompts, group, s, 100 * rep))
            finally:
                prof.end_step()
                prof.restore()
    n = len(prompts) * group
    for name, rows in times.items():
        gen = statistics.median(r[0] for r in rows)
        upd = statistics.median(r[1] for r in rows)
        out[name] = {
            "sample_s": gen,
            "train_s": upd,
            "iteration_s": gen + upd,
            "trained_transitions": rows[0][2],
            "sampling_images_per_s": n / gen,
            "training_images_per_s": n / upd,
            "profile": profiles[name].summary(skip=0),
        }
    it = {k: out[k]["iteration_s"] for k in variants}
    out["sampling_images_per_s"] = out["reduced"]["sampling_images_per_s"]
    out["training_images_per_s"] = out["reduced"]["training_images_per_s"]
    out["speedup_denoising_reduction"] = it["full"] / it["reduced"]
    out["speedup_windowed_training"] = it["reduced"] / it["window"]
    out["speedup_window_over_full"] = it["full"] / it["window"]
    return out
