"""DiffusionNFT: the loss against hand-worked values, its minimiser, the reward map, the
sampling policy's EMA, and the flow adapter's NFT path (ODE rollouts, no log-probs)."""

from __future__ import annotations

import pytest
import torch
from test_flow_policy import PROMPTS, _policy

from mmyatt.algorithms import nft
from mmyatt.config.schema import ConfigError, load_config
from mmyatt.models.flow_nft import FlowNFT, NFTSettings
from mmyatt.protocols import Sampling

torch.set_num_threads(1)


def _case():
    """One row of two elements: v_theta = [1, 0], v_old = 0, x0 = 0, noise = 1 (so the
    flow-matching target v* = noise - x0 = [1, 1]), t = 0.5, beta = 0.5, r = 0.75."""
    v = torch.tensor([[1.0, 0.0]], requires_grad=True)
    return v, torch.zeros(1, 2), torch.zeros(1, 2), torch.ones(1, 2), torch.tensor([0.5])


def test_velocity_loss_hand_worked():
    v, v_old, x0, noise, t = _case()
    # v+ = 0.5 * 0 + 0.5 * [1, 0] = [0.5, 0];  v- = 1.5 * 0 - 0.5 * [1, 0] = [-0.5, 0]
    # positive = mean((0.5 - 1)^2, (0 - 1)^2) = 0.625; negative = mean(2.25, 1) = 1.625
    # loss = (0.75 * 0.625 + 0.25 * 1.625) / beta = 0.875 / 0.5 = 1.75
    loss, st = nft.nft_loss(
        v, v_old, x0, noise, t, torch.tensor([0.75]), beta=0.5, weighting="velocity"
    )
    assert torch.allclose(loss, torch.tensor([1.75]))
    assert torch.isclose(st["positive"], torch.tensor(0.625))
    assert torch.isclose(st["negative"], torch.tensor(1.625))
    assert torch.isclose(st["old_deviation"], torch.tensor(0.5))
    loss.sum().backward()
    # d/dv = r (v+ - v*) - (1 - r) (v- - v*) (the 1/beta cancels the chain rule's beta,
    # the 1/2 of the element mean the square's 2):
    # [0.75 * (0.5 - 1) - 0.25 * (-0.5 - 1), 0.75 * (0 - 1) - 0.25 * (0 - 1)] = [0, -0.5]
    assert torch.allclose(v.grad, torch.tensor([[0.0, -0.5]]))
    # scale multiplies the loss
    loss3, _ = nft.nft_loss(
        v, v_old, x0, noise, t, torch.tensor([0.75]), beta=0.5, weighting="velocity", scale=3.0
    )
    assert torch.allclose(loss3, torch.tensor([5.25]))


def test_adaptive_x0_loss_hand_worked():
    v, v_old, x0, noise, t = _case()
    # x_t = 0.5 * 0 + 0.5 * 1 = [0.5, 0.5]; x0_hat = x_t - t v
    # positive: x0_hat+ = [0.5 - 0.25, 0.5] = [0.25, 0.5]; weight = mean|err| = 0.375;
    #   mean(0.0625, 0.25) / 0.375 = 0.15625 / 0.375 = 5/12
    # negative: x0_hat- = [0.75, 0.5]; weight 0.625; mean(0.5625, 0.25) / 0.625 = 0.65
    # loss = (0.75 * 5/12 + 0.25 * 0.65) / 0.5 = (0.3125 + 0.1625) / 0.5 = 0.95
    loss, st = nft.nft_loss(v, v_old, x0, noise, t, torch.tensor([0.75]), beta=0.5)
    assert torch.allclose(loss, torch.tensor([0.95]))
    assert torch.isclose(st["positive"], torch.tensor(5 / 12))
    assert torch.isclose(st["negative"], torch.tensor(0.65))


@pytest.mark.parametrize("r,beta", [(0.6, 0.5), (1.0, 1.0), (0.2, 2.0)])
def test_minimiser_moves_old_velocity_towards_or_away_from_the_target(r, beta):
    """For one target the velocity loss is minimised at v_old + (2r - 1)/beta (v* - v_old)."""
    g = torch.Generator().manual_seed(0)
    v_old, x0, noise = (torch.randn(1, 6, generator=g) for _ in range(3))
    v = v_old.clone().requires_grad_(True)
    opt = torch.optim.SGD([v], lr=0.2)
    for _ in range(400):
        opt.zero_grad()
        loss, _ = nft.nft_loss(
            v, v_old, x0, noise, torch.tensor([0.5]), torch.tensor([r]), beta=beta,
            weighting="velocity",
        )  # fmt: skip
        loss.sum().backward()
        opt.step()
    want = v_old + (2 * r - 1) / beta * ((noise - x0) - v_old)
    assert torch.allclose(v.detach(), want, atol=1e-4)


@pytest.mark.parametrize("weighting", nft.NFT_WEIGHTINGS)
def test_half_reward_gives_no_gradient_at_the_old_policy(weighting):
    g = torch.Generator().manual_seed(1)
    v_old, x0, noise = (torch.randn(3, 2, 4, 4, generator=g) for _ in range(3))
    v = v_old.clone().requires_grad_(True)
    loss, _ = nft.nft_loss(
        v, v_old, x0, noise, torch.rand(3, generator=g), torch.full((3,), 0.5), weighting=weighting
    )
    loss.sum().backward()
    assert v.grad.abs().max() < 1e-6
    # and a good sample (r = 1) pulls v towards its target
    v.grad = None
    loss, _ = nft.nft_loss(
        v, v_old, x0, noise, torch.full((3,), 0.3), torch.ones(3), weighting=weighting
    )
    loss.sum().backward()
    assert float((v.grad * (v_old - (noise - x0))).sum()) > 0


def test_reward_weight_old_decay_and_timesteps():
    adv = torch.tensor([-7.0, -1.0, 0.0, 2.0, 9.0])
    assert torch.allclose(
        nft.reward_weight(adv, None, "advantage", 2.0), torch.tensor([0.0, 0.25, 0.5, 1.0, 1.0])
    )
    with pytest.raises(ValueError, match="needs advantages"):
        nft.reward_weight(None, torch.zeros(2), "advantage")
    assert nft.old_decay(1, 0.001, 0.5) == 0.001
    assert nft.old_decay(10_000, 0.001, 0.5) == 0.5
    with pytest.raises(ValueError):
        nft.old_decay(1, 0.1, 1.0)
    sig = torch.tensor([1.0, 0.8, 0.5, 0.2])
    t = nft.sample_timesteps(50, 3, "sampler", sig, torch.Generator().manual_seed(0))
    assert t.shape == (50, 3)
    assert all(len(set(row.tolist())) == 3 and set(row.tolist()) <= set(sig.tolist()) for row in t)
    with pytest.raises(ValueError, match="exceeds"):
        nft.sample_timesteps(1, 5, "sampler", sig)
    u = nft.sample_timesteps(100, 2, "uniform", generator=torch.Generator().manual_seed(0))
    assert float(u.min()) > 0 and float(u.max()) <= 1


# --- the flow adapter's NFT path -------------------------------------------------------
def _ode_rollout(policy, seeds=(3, 4)):
    s = Sampling(denoise_steps=3, noise_level=0.0, train_steps=())
    r = policy.generate([dict(p, _index=i) for i, p in enumerate(PROMPTS)], 3, s, list(seeds))
    r.rewards = torch.tensor([1.0, 0.0, 0.5, 0.2, 0.9, 0.4])
    r.advantages = torch.tensor([2.0, -2.0, 0.0, -1.0, 1.5, 0.5])
    return r


@pytest.mark.parametrize("kind", ["sd3-image", "flux-image", "wan-video"])
def test_flow_nft_rollout_loss_and_gradient(kind):
    policy = _policy(kind)
    r = _ode_rollout(policy)
    assert r.num_actions == 0 and r.logprobs.shape == (6, 0)  # no transition, no log-prob
    assert r.context["x0"].shape == (6, *policy.sample_shape)
    assert r.context["sampler_sigmas"].shape == (6, 3)
    trainer = FlowNFT(policy, NFTSettings(timesteps_per_sample=2), seed=0)
    rows, st = trainer.loss(r, step=0)
    assert rows.shape == (6,) and torch.isfinite(rows).all()
    assert float(st["old_deviation"]) == 0.0  # old == current before any update
    rows.sum().backward()
    grads = [p.grad for p in policy.module().parameters() if p.grad is not None]
    assert grads and any(float(gr.abs().sum()) > 0 for gr in grads)
    # the same (seed, step, record) draws the same noise: a sample's loss does not depend
    # on the other groups of its batch (P controllers draw what one would)
    one = trainer.loss(r.select([3, 4, 5]), step=0)[0]
    assert torch.allclose(one.detach(), rows.detach()[3:], atol=1e-6)
    # the KL to a reference adds kl_coef x the mean squared velocity gap (texture only
    # with kl_block); a reference equal to the policy adds nothing
    same = trainer.loss(
        r, step=0, kl_coef=3.0, kl_block=4, reference=lambda *a: policy.velocity(trainer.old, *a)
    )
    assert torch.allclose(same[0], rows) and float(same[1]["kl"]) == 0.0
    shifted = trainer.loss(
        r, step=0, kl_coef=3.0, reference=lambda *a: policy.velocity(trainer.old, *a) + 0.5
    )
    assert torch.allclose(shifted[0], rows + 3.0 * 0.25, atol=1e-5)
    # a constant shift is the same in every 4x4 tile: the texture-only KL ignores it
    flat = trainer.loss(
        r,
        step=0,
        kl_coef=3.0,
        kl_block=4,
        reference=lambda *a: policy.velocity(trainer.old, *a) + 0.5,
    )
    assert float(flat[1]["kl"]) < 1e-10
    # half rewards everywhere: no gradient at the old policy
    policy.module().zero_grad()
    r.advantages = torch.zeros(6)
    trainer.loss(r, step=0)[0].sum().backward()
    assert max(float(p.grad.abs().max()) for p in policy.module().parameters()) < 1e-6


def test_flow_nft_old_policy_samples_and_trails():
    policy = _policy()
    trainer = FlowNFT(policy, NFTSettings(decay_rate=0.25, decay_max=0.5), seed=0)
    with trainer.sampling():
        before = _ode_rollout(policy).context["x0"]
    with torch.no_grad():
        for p in policy.module().parameters():
            p.add_(0.01)
    with trainer.sampling():
        assert torch.equal(_ode_rollout(policy).context["x0"], before)  # old weights sample
    policy.shared_group_noise = False  # the same noise, the current weights: other images
    assert not torch.equal(_ode_rollout(policy).context["x0"], before)
    policy.shared_group_noise = True
    cur = {n: p.detach().clone() for n, p in policy.module().named_parameters()}
    old = {n: p.detach().clone() for n, p in trainer.old.named_parameters()}
    assert trainer.update_old(step=1) == 0.25
    for n, p in trainer.old.named_parameters():
        assert torch.allclose(p, 0.25 * old[n] + 0.75 * cur[n])


def test_config_checks():
    cfg = load_config("configs/flow_nft_tiny.yaml")
    assert cfg.algorithm.name == "diffusion_nft"
    with pytest.raises(ConfigError, match="diffusion_nft trains flow models"):
        load_config(None, ["algorithm.name=diffusion_nft"])
    with pytest.raises(ConfigError, match="timesteps_per_sample"):
        load_config(
            "configs/flow_nft_tiny.yaml",
            ["algorithm.nft.timesteps_per_sample=50", "sampling.denoise_steps=4"],
        )
    with pytest.raises(ConfigError, match=r"algorithm.nft.beta must be > 0, got 0"):
        load_config("configs/flow_nft_tiny.yaml", ["algorithm.nft.beta=0"])


# --- the engine: an NFT step, and latent rewards that skip the decode ------------------
def _controller(tmp_path, reward_specs, overrides=()):
    from mmyatt.datasets.manifest import ShardedManifest
    from mmyatt.datasets.synthetic import write_jsonl
    from mmyatt.distributed import Dist
    from mmyatt.rewards.rules import WeightedReward
    from mmyatt.step.builders import build_controller

    recs = [{"prompt": p["prompt"], "id": p["id"]} for p in PROMPTS] * 2
    write_jsonl(tmp_path / "m.jsonl", recs)
    cfg = load_config(
        None,
        [
            "model.kind=flow",
            "algorithm.name=diffusion_nft",
            "algorithm.advantage_std=batch",
            "sampling.group_size=3",
            "sampling.denoise_steps=3",
            "sampling.noise_level=0.0",
            "data.prompts_per_step=2",
            "optim.lr=1e-3",
            "algorithm.nft.decay_rate=0.25",
            *overrides,
        ],
    )
    shard = ShardedManifest([str(tmp_path / "m.jsonl")], rank=0, world_size=1, seed=0)
    policy = _policy()
    ctl = build_controller(
        cfg, tmp_path, Dist(), policy=policy, reward=WeightedReward(reward_specs), shard=shard,
        eval_records=[],
    )  # fmt: skip
    return ctl, policy


def test_nft_controller_step_with_a_latent_reward_skips_the_decode(tmp_path, monkeypatch):
    ctl, policy = _controller(tmp_path, [{"name": "latent_brightness"}])
    assert policy.decode_outputs is False
    calls = []
    monkeypatch.setattr(policy, "to_pixels", lambda x: calls.append(x) or x)
    before = {n: p.detach().clone() for n, p in policy.module().named_parameters()}
    m1 = ctl.step()
    assert calls == []  # the rollout never decoded its samples
    x0 = ctl.last_rollout.context["x0"]
    assert not torch.equal(x0[0], x0[1])  # ODE samples of a group: each its own noise
    assert policy.shared_group_noise is True  # restored after the rollout
    assert ctl.last_rollout.num_actions == 0  # NFT: no transitions, no log-probs
    assert all(o.shape == policy.sample_shape for o in ctl.last_rollout.outputs)
    assert m1["train/optimizer_steps"] == 1.0 and m1["nft/old_decay"] == 0.25
    assert 0.0 < m1["nft/r_mean"] < 1.0 and m1["nft/old_deviation"] == 0.0
    moved = [n for n, p in policy.module().named_parameters() if not torch.equal(p, before[n])]
    assert moved
    # the sampling policy took 3/4 of the step: old = 0.25 old + 0.75 theta
    cur = dict(policy.module().named_parameters())
    n0 = moved[0]
    want = 0.25 * before[n0] + 0.75 * cur[n0].detach()
    assert torch.allclose(dict(ctl.loss.nft.old.named_parameters())[n0], want)
    m2 = ctl.step()
    assert m2["nft/old_deviation"] > 0.0  # the trained policy now differs from the sampler
    # the sampling policy is part of the run state: a resumed run samples as before
    state, local = ctl.shared_state(), ctl.local_state()
    saved = {k: v.clone() for k, v in state["nft_old"].items()}
    with torch.no_grad():
        for p in ctl.loss.nft.old.parameters():
            p.add_(1.0)
    ctl.load_state(state, local)
    assert all(torch.equal(v, saved[k]) for k, v in ctl.loss.nft.old.state_dict().items())


def test_pixel_rewards_decode_and_mixing_is_refused(tmp_path):
    from mmyatt.rewards.rules import WeightedReward

    _, policy = _controller(tmp_path, [{"name": "brightness"}])
    assert policy.decode_outputs is True
    with pytest.raises(ValueError, match="read latents"):
        WeightedReward([{"name": "latent_brightness"}, {"name": "brightness"}])
