"""Rules between keys of different sections, which no single field's type or range can
state. Each names every key involved and the way out."""

from __future__ import annotations

from typing import TYPE_CHECKING

from mmyatt.config.errors import ConfigError

if TYPE_CHECKING:
    from mmyatt.config.run import RunConfig

# advantages measured against the other samples of the prompt's group
GROUP_BASELINES = ("grpo", "drgrpo", "rloo", "reinforce_pp_baseline")


def check_rules(cfg: RunConfig) -> None:
    """Raise ConfigError for the first rule ``cfg`` breaks."""
    a, s = cfg.algorithm, cfg.sampling
    kind = cfg.model.kind
    closed_form = a.kl_estimator.startswith("closed_form")
    rules = [
        (
            cfg.data.prompts_per_step % cfg.distributed.nproc == 0,
            f"data.prompts_per_step ({cfg.data.prompts_per_step}) must be divisible by "
            f"distributed.nproc ({cfg.distributed.nproc})",
        ),
        (
            a.advantage not in GROUP_BASELINES or s.group_size >= 2,
            f"algorithm.advantage={a.advantage} compares each sample with its group, so "
            f"sampling.group_size must be >= 2, got {s.group_size} (or use reinforce_pp)",
        ),
        (
            not a.dynamic_sampling or s.group_size >= 2,
            "algorithm.dynamic_sampling drops groups whose rewards do not vary, which needs "
            f"sampling.group_size >= 2, got {s.group_size}",
        ),
        (
            kind == "flow" or not closed_form,
            f"algorithm.kl_estimator={a.kl_estimator} needs a flow model (Gaussian "
            f"denoising steps), not model.kind={kind}; use k1, k2 or k3",
        ),
        (
            a.kl_block == 0 or closed_form,
            f"algorithm.kl_block={a.kl_block} needs kl_estimator closed_form or "
            f"closed_form_flowgrpo (got {a.kl_estimator})",
        ),
        (
            a.name != "diffusion_nft" or kind == "flow",
            f"algorithm.name=diffusion_nft trains flow models, not model.kind={kind}",
        ),
        (
            a.name != "diffusion_nft"
            or a.nft.timesteps != "sampler"
            or a.nft.timesteps_per_sample <= s.denoise_steps,
            f"algorithm.nft.timesteps_per_sample={a.nft.timesteps_per_sample} "
            f"exceeds sampling.denoise_steps={s.denoise_steps} (timesteps=sampler "
            "draws distinct sampler steps)",
        ),
        (
            a.overlong == "none" or a.overlong_buffer <= s.max_new_tokens,
            f"algorithm.overlong_buffer={a.overlong_buffer} must be in [1, "
            f"sampling.max_new_tokens={s.max_new_tokens}]",
        ),
        (
            len(set(cfg.logging.trackers)) == len(cfg.logging.trackers),
            f"logging.trackers={list(cfg.logging.trackers)} names a tracker twice",
        ),
        (
            not any(f.name == "genrm" for f in cfg.reward.functions)
            or cfg.reward.judge.model is not None
            or bool(cfg.reward.judge.urls),
            "reward.functions has genrm but no judge is configured: set reward.judge.model "
            "(servers started with the run) or reward.judge.urls",
        ),
    ]
    for ok, message in rules:
        if not ok:
            raise ConfigError(message)
