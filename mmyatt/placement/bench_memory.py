"""The placement bench's judge_memory workload: a judge big enough (~25 M parameters,
~100 MB in float32) that what each mode does with its weights shows in the processes'
peak memory. Colocate drops them outside its judge phase, partial keeps them next to
rollout and training, and partial with ``placement.partial_release_judge`` drops them
while training runs: peak RSS per phase and step time, side by side in rotated rounds."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import torch

from mmyatt.models.builtin.tiny import build_tiny_text_model
from mmyatt.placement.bench_arms import COLOCATE_JUDGE_THREADS, CORPUS, run_arm
from mmyatt.placement.bench_figures import combine_rounds, paired_ratio

logger = logging.getLogger(__name__)

# a judge whose weights outweigh the noise of the processes' memory
# (~25 M parameters, ~100 MB in float32; random init, built here from a config)
BIG = dict(
    hidden_size=512,
    num_hidden_layers=8,
    num_attention_heads=8,
    num_key_value_heads=4,
    intermediate_size=1536,
)


def big_model(out_dir: Path, seed: int) -> tuple[Path, int]:
    """A qwen2-1m model's tokenizer with a ``BIG``-sized seeded Qwen2 model in place of
    its weights. Returns the directory and the parameter count."""
    import torch
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    out = build_tiny_text_model(out_dir, size="qwen2-1m", corpus=CORPUS, seed=seed)
    d = Qwen2Config.from_pretrained(out).to_dict()
    for k in ("layer_types", "head_dim", "architectures", "transformers_version"):
        d.pop(k, None)  # derived from the sizes; rebuilt by the constructor
    config = Qwen2Config(**{**d, **BIG})
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(config)
    model.generation_config = GenerationConfig.from_pretrained(out)
    model.save_pretrained(str(out), safe_serialization=True)
    return out, sum(p.numel() for p in model.parameters())


def memory_arms(tmp: Path, base: list[str], steps: int, rounds: int = 1) -> dict:
    """colocate (judge weights dropped outside its phase, reloaded for it) and partial
    (judge resident next to rollout and training) with the big judge, side by side, for
    the qwen2-1m policy and for a policy of the judge's size (whose training phase,
    gradients and activations, is where the controllers' memory peaks): peak RSS summed
    over the 2 controllers and the judge, per phase, the reload cost and the step time,
    ``rounds`` times in alternating order; the ratios come with their per-round spread."""
    judge, params = big_model(tmp / "judge_big", seed=1)
    big_policy, _ = big_model(tmp / "policy_big", seed=0)
    small = [
        "data.prompts_per_step=4",
        "sampling.group_size=4",  # 16 samples per controller: the big judge stays cheap
        "reward.functions=[{name: numeric_match, weight: 1.0}, {name: genrm, weight: 0.5, "
        "kwargs: {mode: score, template: score_text_1_10, max_tokens: 2}}]",
        f"reward.judge.model={judge}",
        "reward.judge.max_batch=64",
    ]
    out: dict = {
        "judge": f"Qwen2 {BIG} (random init), score mode, 2 greedy tokens per sample",
        "judge_params": params,
        "judge_weights_mb": params * 4 / 2**20,
        "samples_per_step": 2 * 4 * 4,
        "rounds": rounds,
        "colocate_judge_threads": COLOCATE_JUDGE_THREADS,
    }
    policies = {"policy_qwen2_1m": [], "policy_25m": [f"model.path={big_policy}"]}
    modes = {"colocate": ["placement.mode=colocate"], "partial": ["placement.mode=partial"]}
    # partial with the judge asleep while training takes everything (reloaded each step)
    modes["partial_release"] = ["placement.mode=partial", "placement.partial_release_judge=true"]
    if torch.cuda.is_available():  # the policy off the device in colocate's judge phase too
        modes["colocate_offload"] = ["placement.mode=colocate", "placement.offload_policy=true"]
    for name, pol in policies.items():
        per_round: dict[str, list] = {m: [] for m in modes}
        names = list(modes)
        for k in range(rounds):
            for mode in names[k % len(names) :] + names[: k % len(names)]:
                over = base + modes[mode] + small + pol
                arm = run_arm(tmp, f"judge_memory_{name}_{mode}_r{k}", over, steps)
                per_round[mode].append(arm)
                logger.info(
                    f"[bench] placement judge_memory {name} round {k + 1} {mode}: peak "
                    f"{arm['peak_rss_mb']:.0f} MB, {arm['step_s']:.3f} s/step"
                )
        arms = combine_rounds(per_round, "judge_memory")
        c, p = arms["colocate"], arms["partial"]
        arms["colocate_minus_partial_peak_rss_mb"] = c["peak_rss_mb"] - p["peak_rss_mb"]
        arms["colocate_over_partial_peak_rss"] = c["peak_rss_mb"] / p["peak_rss_mb"]
        arms["colocate_over_partial_peak_rss_rounds"] = paired_ratio(
            c["peak_rss_mb_per_round"], p["peak_rss_mb_per_round"]
        )
        arms["partial_over_colocate_step_s"] = p["step_s"] / c["step_s"]
        arms["partial_over_colocate_step_s_rounds"] = paired_ratio(
            p["step_s_per_round"], c["step_s_per_round"]
        )
        q = arms["partial_release"]
        for key, (a, b) in {
            "partial_release_over_partial_peak_rss": (q, p),
            "partial_release_over_colocate_peak_rss": (q, c),
        }.items():
            arms[key] = a["peak_rss_mb"] / b["peak_rss_mb"]
            arms[f"{key}_rounds"] = paired_ratio(
                a["peak_rss_mb_per_round"], b["peak_rss_mb_per_round"]
            )
        arms["partial_release_over_partial_step_s"] = q["step_s"] / p["step_s"]
        arms["partial_release_over_partial_step_s_rounds"] = paired_ratio(
            q["step_s_per_round"], p["step_s_per_round"]
        )
        out[name] = arms
    out["load_average_at_end"] = [round(x, 2) for x in os.getloadavg()]
    return out
