"""The learning algorithm: advantages, the PPO-clip loss family or DiffusionNFT, the
optimizer."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from mmyatt.config.section import Bool, Float, Int, Section


class NFTConfig(Section):
    """DiffusionNFT knobs (``algorithm.name: diffusion_nft``; math in mmyatt/algorithms/nft.py)."""

    beta: Float = Field(1.0, gt=0)
    """implicit policies v+- = v_old +- beta (v_theta - v_old); loss / beta"""
    reward_norm: Literal["advantage", "raw"] = "advantage"
    """r = A / (2 adv_clip) + 1/2, or the reward clamped to [0, 1] (win rates, probabilities)"""
    adv_clip: Float = Field(5.0, gt=0)
    """advantages clipped to +-adv_clip before the map to [0, 1]"""
    weighting: Literal["adaptive_x0", "velocity"] = "adaptive_x0"
    """NVlabs' x0-space error over its mean |error|, or the plain velocity MSE"""
    loss_scale: Float | None = Field(None, gt=0)
    """multiplies the loss; None: adv_clip (NVlabs)"""
    timesteps: Literal["sampler", "uniform", "logit_normal"] = "sampler"
    """training t: the rollout sampler's own sigmas (random, without replacement), U(0,1) or
    logit-normal"""
    timesteps_per_sample: Int = Field(2, ge=1)
    """forward-noised copies of each clean sample per step"""
    decay_rate: Float = Field(0.001, ge=0)
    """sampling ("old") policy: old <- d old + (1-d) theta after every step,
    d = min(decay_rate * step, decay_max); 0, 0: on-policy"""
    decay_max: Float = Field(0.5, ge=0, lt=1)


class AlgorithmConfig(Section):
    name: Literal["grpo", "diffusion_nft"] = "grpo"
    """grpo: the GRPO family (PPO-clip on log-prob ratios, advantages below); diffusion_nft:
    flow models only, forward-process RL on clean samples from any sampler (ODE included)"""
    nft: NFTConfig = Field(default_factory=NFTConfig)
    advantage: Literal["grpo", "drgrpo", "rloo", "reinforce_pp", "reinforce_pp_baseline"] = "grpo"
    advantage_std: Literal["group", "batch"] = "group"
    """grpo only; batch = Flow-GRPO global std"""
    advantage_clip: Float | None = Field(None, gt=0)
    """grpo only; Flow-GRPO clips to 5"""
    clip_low: Float = Field(0.2, ge=0)
    clip_high: Float = Field(0.28, ge=0)
    """DAPO clip-higher; equal to clip_low for symmetric PPO"""
    dual_clip: Float | None = Field(None, gt=1)
    loss_agg: Literal[
        "token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"
    ] = "token-mean"
    kl_coef: Float = Field(0.0, ge=0)
    """0 skips the reference entirely"""
    kl_estimator: Literal["k1", "k2", "k3", "closed_form", "closed_form_flowgrpo"] = "k3"
    """k1/k2/k3: sample estimators on log-probs. Flow models only: closed_form (exact KL of
    the Gaussian SDE/CPS steps from policy and reference means) or closed_form_flowgrpo
    (the same divided by s^2 instead of s^2*|dt|, as flow_grpo's loss; its betas carry over)"""
    kl_block: Int = Field(0, ge=0)
    """closed-form KL only: k > 0 penalises only the part of each step's mean that varies
    within k x k pixel (latent) tiles, i.e. texture; 0 penalises the whole step"""
    entropy_coef: Float = Field(0.0, ge=0)
    ppo_epochs: Int = Field(1, ge=1)
    """passes over each step's rollouts"""
    minibatches: Int = Field(1, ge=1)
    """optimizer steps per pass (each on whole prompt groups)"""
    micro_batch_tokens: Int = Field(0, ge=0)
    """> 0: micro-batches of at most this many padded tokens, as many on every rank
    (batches.py)"""
    dynamic_sampling: Bool = False
    """DAPO: drop zero-variance groups and refill"""
    max_refill_rounds: Int = Field(3, ge=0)
    overlong: Literal["none", "filter", "penalty"] = "none"
    overlong_buffer: Int = Field(4, ge=1)
    overlong_penalty: Float = Field(1.0, ge=0)
    recompute_old_logprobs: Bool = False
    """use a fresh forward instead of sampling-time log-probs"""


Beta = Annotated[Float, Field(ge=0, lt=1)]


class OptimConfig(Section):
    lr: Float = Field(1e-4, gt=0)
    """AdamW learning rate"""
    weight_decay: Float = Field(0.0, ge=0)
    betas: tuple[Beta, Beta] = (0.9, 0.999)
    """AdamW betas"""
    grad_clip: Float = Field(1.0, gt=0)
    """global gradient-norm clip"""
    warmup_steps: Int = Field(0, ge=0)
    """steps of linear warm-up of the learning rate"""
    schedule: Literal["constant", "cosine"] = "constant"
    """after warm-up: the learning rate as it is, or a cosine to 0 at the run's last step"""
