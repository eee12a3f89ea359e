"""The Flow-GRPO step math of models/flow_sde.py, checked by hand and on 1-D Gaussians."""

from __future__ import annotations

import math

import pytest
import torch

from mmyatt.algorithms import train_step_schedule
from mmyatt.models.flow_sde import cps_step, euler_step, flow_sigmas, sde_step

torch.set_num_threads(1)


def test_sde_log_prob_matches_hand_computed_gaussian():
    # x = [1, 0], v = [0.5, -1], sigma = 0.5, sigma' = 0.25, a = 0.5:
    #   Delta = -0.25,  s = 0.5 * sqrt(0.5 / 0.5) = 0.5,  s^2 / (2 sigma) = 0.25
    #   elem 1: eps_hat = 1 + 0.5 * 0.5 = 1.25;  bracket = 0.5 + 0.25 * 1.25 = 0.8125
    #           mu = 1 + 0.8125 * (-0.25) = 0.796875
    #   elem 2: eps_hat = 0 + 0.5 * (-1) = -0.5; bracket = -1 + 0.25 * (-0.5) = -1.125
    #           mu = 0 + (-1.125) * (-0.25) = 0.28125
    #   std = s * sqrt(0.25) = 0.25
    # log-density of x' = [1, 0]: residuals 0.203125, -0.28125, squared 0.041259765625 and
    # 0.0791015625, each over 2 std^2 = 0.125 -> 0.330078125 and 0.6328125, mean 0.4814453125:
    #   log_prob = -0.4814453125 - log(0.25) - 0.5 log(2 pi)
    x = torch.tensor([[1.0, 0.0]])
    v = torch.tensor([[0.5, -1.0]])
    x_next, lp, mu, std = sde_step(x, v, 0.5, 0.25, 0.5, prev_sample=torch.tensor([[1.0, 0.0]]))
    assert torch.allclose(mu, torch.tensor([[0.796875, 0.28125]]))
    assert torch.allclose(std.flatten(), torch.tensor([0.25]))
    expected = -0.4814453125 - math.log(0.25) - 0.5 * math.log(2 * math.pi)
    assert lp.shape == (1,)
    assert lp.item() == pytest.approx(expected, abs=1e-6)
    assert torch.equal(x_next, torch.tensor([[1.0, 0.0]]))


def test_sde_first_step_uses_next_sigma_in_denominator():
    # sigma = 1: s = a * sqrt(1 / (1 - 0.8)) = 0.7 * sqrt(5); std = s * sqrt(0.2) = 0.7
    x, v = torch.zeros(2, 3), torch.ones(2, 3)
    _, lp, _, std = sde_step(x, v, 1.0, 0.8, 0.7, generator=torch.Generator().manual_seed(0))
    assert torch.allclose(std.flatten(), torch.full((2,), 0.7))
    assert torch.isfinite(lp).all()


def test_sde_per_row_sigmas_and_sampled_log_prob():
    # rows with different sigmas equal separate calls; the log-prob of the drawn sample is
    # that of its standard-normal noise z: mean(-z^2 / 2) - log std - log sqrt(2 pi)
    g = torch.Generator().manual_seed(1)
    x, v, z = (
        torch.randn(2, 3, 4, generator=g),
        torch.randn(2, 3, 4, generator=g),
        torch.randn(2, 3, 4, generator=g),
    )
    sig, sig_n = torch.tensor([0.9, 0.5]), torch.tensor([0.8, 0.3])
    xn, lp, mu, std = sde_step(x, v, sig, sig_n, 0.7, noise=z)
    for i in range(2):
        xi, lpi, _, _ = sde_step(
            x[i : i + 1], v[i : i + 1], sig[i].item(), sig_n[i].item(), 0.7, noise=z[i : i + 1]
        )
        assert torch.allclose(xi, xn[i : i + 1]) and torch.allclose(lpi, lp[i : i + 1])
    s = std.flatten()
    want = (-(z**2) / 2).mean(dim=(1, 2)) - torch.log(s) - 0.5 * math.log(2 * math.pi)
    assert torch.allclose(lp, want, atol=1e-5)
    # recomputing with prev_sample reproduces the sampled log-prob bit for bit
    _, lp2, _, _ = sde_step(x, v, sig, sig_n, 0.7, prev_sample=xn)
    assert torch.equal(lp, lp2)


def test_cps_log_prob_matches_hand_computed():
    # x = [1, 0], v = [0.5, -1], sigma = 0.5, sigma' = 0.25, a = 0.5:
    #   s = 0.25 sin(pi / 4);  x0 = x - 0.5 v = [0.75, 0.5];  x1 = x + 0.5 v = [1.25, -0.5]
    #   sqrt(sigma'^2 - s^2) = sqrt(0.0625 - 0.03125) = sqrt(0.03125)
    #   mu = 0.75 * x0 + sqrt(0.03125) * x1;  log pi([1, 0]) = -mean((x' - mu)^2)
    x, v = torch.tensor([[1.0, 0.0]]), torch.tensor([[0.5, -1.0]])
    _, lp, mu, s = cps_step(x, v, 0.5, 0.25, 0.5, prev_sample=torch.tensor([[1.0, 0.0]]))
    c = math.sqrt(0.03125)
    mu_hand = [0.75 * 0.75 + c * 1.25, 0.75 * 0.5 - c * 0.5]
    assert torch.allclose(mu, torch.tensor([mu_hand]))
    assert s.item() == pytest.approx(0.25 * math.sin(math.pi / 4))
    want = -((1 - mu_hand[0]) ** 2 + (0 - mu_hand[1]) ** 2) / 2
    assert lp.item() == pytest.approx(want, abs=1e-6)


@pytest.mark.parametrize("step", [sde_step, cps_step])
def test_zero_noise_is_the_euler_step_exactly(step):
    from diffusers import FlowMatchEulerDiscreteScheduler

    g = torch.Generator().manual_seed(0)
    x, v = torch.randn(3, 2, 5, 5, generator=g), torch.randn(3, 2, 5, 5, generator=g)
    sig = flow_sigmas(10)
    sched = FlowMatchEulerDiscreteScheduler(shift=3.0)
    sched.set_timesteps(10)
    for k in (0, 4, 9):
        x_next, lp, mu, _ = step(x, v, sig[k], sig[k + 1], 0.0, generator=g)
        assert torch.equal(x_next, x + v * (sig[k + 1] - sig[k]))
        assert torch.equal(x_next, euler_step(x, v, sig[k], sig[k + 1]))
        assert torch.equal(mu, x_next)
        assert torch.equal(lp, torch.zeros(3))  # no density for a deterministic step
        sched._step_index = k  # diffusers' own Euler step
        assert torch.equal(x_next, sched.step(v, sched.timesteps[k], x).prev_sample)


def test_flow_sigmas_match_diffusers():
    s = flow_sigmas(10, shift=3.0)
    assert s.shape == (11,) and s.dtype == torch.float32
    assert s[0].item() == 1.0 and s[-1].item() == 0.0
    assert torch.allclose(s[:4], torch.tensor([1.0, 0.9601, 0.9133, 0.8577]), atol=1e-4)
    assert (s[1:] < s[:-1]).all()
    with pytest.raises(ValueError):
        flow_sigmas(0)


# 1-D data x0 ~ N(m, s^2), noise eps ~ N(0, 1), x_t = (1 - t) x0 + t eps, v = eps - x0.
# (x_t, v) are jointly Gaussian:
#   E[x_t] = (1 - t) m,  Var[x_t] = (1 - t)^2 s^2 + t^2,  E[v] = -m,
#   Cov(v, x_t) = Cov(eps - x0, (1 - t) x0 + t eps) = t - (1 - t) s^2,
# so the exact (regression) velocity is
#   E[v | x_t] = -m + (t - (1 - t) s^2) / ((1 - t)^2 s^2 + t^2) * (x_t - (1 - t) m).
M, S = 1.0, 0.5


def _analytic_velocity(x, t):
    return -M + (t - (1 - t) * S**2) / ((1 - t) ** 2 * S**2 + t**2) * (x - (1 - t) * M)


def _sample_1d(step, a, steps=1000, n=20000):
    g = torch.Generator().manual_seed(0)
    sig = flow_sigmas(steps)
    x = torch.randn(n, 1, generator=g)
    for k in range(steps):
        x, lp, _, _ = step(x, _analytic_velocity(x, sig[k]), sig[k], sig[k + 1], a, generator=g)
        assert torch.isfinite(lp).all()
    return x


@pytest.mark.parametrize("a", [0.0, 0.7])
def test_sde_preserves_the_data_marginal(a):
    # the Flow-GRPO SDE has the ODE's marginals: both end at N(1, 0.5^2)
    x = _sample_1d(sde_step, a)
    assert abs(x.std().item() - S) < 0.02 * S
    assert abs(x.mean().item() - M) < 0.02


def test_cps_does_not_preserve_the_marginal():
    # known (reference report): CPS at a = 0.8 ends near std 0.40, not 0.50
    x = _sample_1d(cps_step, 0.8, steps=200)
    assert x.std().item() < 0.45


def test_schedule_all_and_fraction():
    assert train_step_schedule(4) == ((0, 1, 2, 3), (0, 1, 2, 3))
    # flow_grpo timestep_fraction 0.99 of 10 steps trains steps 0..8
    sde, train = train_step_schedule(10, mode="fraction", fraction=0.99)
    assert sde == tuple(range(10)) and train == tuple(range(9))
    with pytest.raises(ValueError, match="trains no step"):
        train_step_schedule(10, mode="fraction", fraction=0.05)
    with pytest.raises(ValueError):
        train_step_schedule(10, mode="fraction", fraction=1.5)


def test_schedule_window():
    assert train_step_schedule(10, mode="window", window=3, window_start=2) == (
        (2, 3, 4),
        (2, 3, 4),
    )
    with pytest.raises(ValueError, match="window_start"):
        train_step_schedule(10, mode="window", window=3, window_start=8)
    with pytest.raises(ValueError, match="window"):
        train_step_schedule(10, mode="window", window=0)


def test_schedule_sliding_moves_toward_low_noise_and_wraps():
    # 5 steps, window 2: starts 0..3, one move every 2 training steps, then back to 0
    starts = [
        train_step_schedule(5, mode="sliding", window=2, step=s, slide_every=2)[1][0]
        for s in range(10)
    ]
    assert starts == [0, 0, 1, 1, 2, 2, 3, 3, 0, 0]
    sde, train = train_step_schedule(5, mode="sliding", window=2, step=3)
    assert sde == train == (3, 4)
    assert train_step_schedule(5, mode="sliding", window=2, window_start=3, step=1)[1] == (0, 1)
    with pytest.raises(ValueError, match="slide_every"):
        train_step_schedule(5, mode="sliding", slide_every=0)
    with pytest.raises(ValueError, match="mode"):
        train_step_schedule(5, mode="random")
