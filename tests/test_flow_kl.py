"""Closed-form KL of Flow-GRPO: the math on hand-built inputs, the flow adapter's
policy/reference means, and the config check for non-flow models."""

from __future__ import annotations

import math

import pytest
import torch
from test_flow_policy import LORA, PROMPTS, _bump_lora, _policy

from mmyatt.algorithms import kl_penalty
from mmyatt.config.schema import ConfigError, load_config
from mmyatt.models.flow_sde import kl_closed_form, sde_step
from mmyatt.protocols import Sampling

torch.set_num_threads(1)


def test_kl_closed_form_hand_computed():
    mean = torch.tensor([[1.0, 2.0, 3.0, 4.0], [0.0, 0.0, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0]])
    ref = torch.tensor([[1.0, 1.0, 1.0, 1.0], [0.5, -0.5, 0.0, 0.0], [3.0, 3.0, 3.0, 3.0]])
    std = torch.tensor([0.5, 2.0, 0.0])
    # row 0: sq diffs 0, 1, 4, 9 -> mean 3.5; / (2 * 0.25) = 7
    # row 1: 0.25, 0.25, 0, 0 -> mean 0.125; / (2 * 4) = 0.015625
    # row 2: std 0 (a deterministic step) -> 0
    kl = kl_closed_form(mean, ref, std)
    assert torch.allclose(kl, torch.tensor([7.0, 0.015625, 0.0]))
    assert torch.equal(kl_closed_form(mean, mean.clone(), std), torch.zeros(3))
    # images (B, C, H, W): the mean runs over every non-batch element
    m4 = torch.zeros(2, 1, 2, 2)
    r4 = torch.zeros(2, 1, 2, 2)
    r4[0, 0, 0, 0] = 2.0  # sq 4 over 4 elements -> 1; / (2 * 1) = 0.5
    assert torch.allclose(kl_closed_form(m4, r4, 1.0), torch.tensor([0.5, 0.0]))
    with pytest.raises(ValueError, match="logprobs_with_kl"):
        kl_penalty(torch.zeros(1), torch.zeros(1), "closed_form")


def test_closed_form_is_the_exact_gaussian_kl_of_sde_steps():
    """For two SDE steps with the same std, KL(N(mu1, s^2) || N(mu2, s^2)) per element is
    also E_{x'~pi}[log pi - log pi_ref]: check it by Monte Carlo with the step's log-prob."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, 64, generator=g)
    v1, v2 = torch.randn(1, 64, generator=g), torch.randn(1, 64, generator=g)
    _, _, mu1, std = sde_step(x, v1, 0.8, 0.6, 0.7)
    _, _, mu2, _ = sde_step(x, v2, 0.8, 0.6, 0.7)
    exact = kl_closed_form(mu1, mu2, std.reshape(-1))
    xs = x.expand(4000, -1)
    samples, lp1, _, _ = sde_step(xs, v1.expand(4000, -1), 0.8, 0.6, 0.7, generator=g)
    _, lp2, _, _ = sde_step(xs, v2.expand(4000, -1), 0.8, 0.6, 0.7, prev_sample=samples)
    mc = (lp1 - lp2).mean()
    assert math.isclose(float(exact), float(mc), rel_tol=0.05), (float(exact), float(mc))


def _rollout(policy):
    s = Sampling(denoise_steps=3, noise_level=0.7, guidance_scale=2.0)
    return policy.generate(PROMPTS, 2, s, seeds=[3, 4])


@pytest.mark.parametrize("sde_type", ["sde", "cps"])
def test_policy_kl_is_zero_at_the_reference_and_matches_the_means(sde_type):
    policy = _policy(lora=LORA)
    policy.enable_reference()  # LoRA disabled = the reference
    s = Sampling(denoise_steps=3, noise_level=0.7, guidance_scale=2.0, sde_type=sde_type)
    r = policy.generate(PROMPTS, 2, s, seeds=[3, 4])
    policy.attach_reference_means(r)
    lp, ent, kl = policy.logprobs_with_kl(r, "closed_form")
    assert torch.equal(kl, torch.zeros_like(kl))  # LoRA B = 0: policy == reference
    assert torch.equal(lp.detach(), r.logprobs)
    assert torch.equal(ent, policy.logprobs(r, with_entropy=True)[1])

    _bump_lora(policy)
    lp, _, kl = policy.logprobs_with_kl(r, "closed_form")
    _, std, mu = policy._transitions(policy.transformer, r)
    # CPS's last step into sigma = 0 has std 0: no density, its KL is reported as 0
    assert ((kl > 0) == (std > 0)).all() and (std > 0).any()
    # by hand from the two models' means and the step std
    ref = r.context["ref_mean"]
    hand = ((mu - ref) ** 2).flatten(2).mean(-1) / (2 * std**2)
    assert torch.allclose(kl[std > 0], hand[std > 0], rtol=1e-5)
    (kl.sum()).backward()  # the KL trains the adapter
    assert any(
        p.grad is not None and p.grad.abs().sum() > 0
        for n, p in policy.module().named_parameters()
        if "lora_" in n
    )
    with torch.no_grad():
        _, _, kl_fg = policy.logprobs_with_kl(r, "closed_form_flowgrpo")
    dt = r.context["sigma"] - r.context["sigma_next"]
    expect = kl.detach() * (dt if sde_type == "sde" else 1.0)  # s^2 instead of s^2 |dt|
    assert torch.allclose(kl_fg, expect, rtol=1e-5)


def test_reference_means_need_a_reference():
    policy = _policy(lora=LORA)
    r = _rollout(policy)
    with pytest.raises(RuntimeError, match="attach_reference_means"):
        policy.logprobs_with_kl(r)
    policy.enable_reference()
    policy.attach_reference_means(r)
    with pytest.raises(ValueError, match="estimator"):
        policy.logprobs_with_kl(r, "k3")


def test_config_rejects_closed_form_for_non_flow_models():
    with pytest.raises(ConfigError, match="needs a flow model"):
        load_config(None, ["algorithm.kl_estimator=closed_form", "algorithm.kl_coef=0.04"])
    cfg = load_config(
        None,
        [
            "model.kind=flow",
            "algorithm.kl_estimator=closed_form_flowgrpo",
            "algorithm.kl_coef=0.04",
        ],
    )
    assert cfg.algorithm.kl_estimator == "closed_form_flowgrpo"


def bright(image, record) -> float:
    import numpy as np

    return float(np.asarray(image, dtype=np.float32).mean() / 255.0)


def _flow_controller(tmp_path, policy, estimator: str):
    from mmyatt.datasets.manifest import ShardedManifest
    from mmyatt.datasets.synthetic import write_jsonl
    from mmyatt.distributed import Dist
    from mmyatt.rewards.rules import WeightedReward
    from mmyatt.step.builders import build_controller

    manifest = tmp_path / "m.jsonl"
    write_jsonl(manifest, [dict(p) for p in PROMPTS])
    cfg = load_config(
        None,
        [
            "model.kind=flow",
            "sampling.group_size=2",
            "data.prompts_per_step=2",
            "sampling.denoise_steps=3",
            "algorithm.kl_coef=0.5",
            f"algorithm.kl_estimator={estimator}",
            "reward.functions=[{name: 'test_flow_kl:bright'}]",
        ],
    )
    return build_controller(
        cfg,
        tmp_path,
        Dist(),
        policy=policy,
        reward=WeightedReward([{"name": "test_flow_kl:bright"}]),
        shard=ShardedManifest([str(manifest)], rank=0, world_size=1, seed=0, shuffle=False),
        eval_records=[],
    )


def test_controller_step_with_closed_form_kl(tmp_path):
    policy = _policy(lora=LORA)
    ctl = _flow_controller(tmp_path, policy, "closed_form")
    m1 = ctl.step()
    assert m1["train/kl"] == 0.0  # first update: the adapter is still the reference
    assert "ref_mean" in ctl.last_rollout.context
    m2 = ctl.step()
    assert m2["train/kl"] > 0.0 and math.isfinite(m2["train/kl"])


def test_controller_rejects_closed_form_kl_without_a_flow_policy(tmp_path):
    from bandit_policy import BanditPolicy

    with pytest.raises(TypeError, match="logprobs_with_kl"):
        _flow_controller(tmp_path, BanditPolicy(seed=0), "closed_form")
