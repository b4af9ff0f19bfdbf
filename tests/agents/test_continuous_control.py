"""Tests of llmbook.agents.continuous_control (chapter 34) against float64 closed forms, autograd,
torch.distributions.TransformedDistribution and brute-force V-trace loops."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch.distributions import Normal, TransformedDistribution
from torch.distributions.transforms import TanhTransform

from llmbook.agents import continuous_control as cc
from llmbook.agents import returns as ret


def _g(seed=0):
    return torch.Generator().manual_seed(seed)


@pytest.mark.equation("34.07", oracle="float64 closed form with explicit loops; no gradient into the target")
def test_ddpg_critic_loss():
    g = _g()
    B, gamma = 7, 0.9
    Q = torch.randn(B, generator=g, dtype=torch.float64, requires_grad=True)
    r, Qn = torch.randn(B, generator=g, dtype=torch.float64), torch.randn(B, generator=g, dtype=torch.float64)
    Qn.requires_grad_(True)
    d = torch.tensor([0, 1, 0, 0, 1, 0, 0], dtype=torch.bool)
    loss = cc.ddpg_critic_loss(Q, r, Qn, gamma, d)
    expected = sum((Q[i].item() - (r[i].item() + (0 if d[i] else gamma * Qn[i].item()))) ** 2 for i in range(B)) / B
    assert abs(loss.item() - expected) < 1e-12
    loss.backward()
    assert Qn.grad is None and Q.grad.abs().max() > 0


@pytest.mark.equation("34.08", oracle="autograd of -Q(s, mu_theta(s)).mean() through small torch networks")
def test_deterministic_policy_gradient_matches_autograd():
    torch.manual_seed(0)
    B, ds, da = 5, 3, 2
    actor = torch.nn.Linear(ds, da).double()
    critic = torch.nn.Sequential(torch.nn.Linear(ds + da, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1)).double()
    s = torch.randn(B, ds, dtype=torch.float64)
    params = list(actor.parameters())
    a = actor(s)
    J = critic(torch.cat([s, a], -1)).mean()
    auto = torch.cat([p.flatten() for p in torch.autograd.grad(J, params)])
    a0 = a.detach().requires_grad_(True)
    dQ_da = torch.autograd.grad(critic(torch.cat([s, a0], -1)).sum(), a0)[0]  # per-sample action gradient
    Jac = []
    for b in range(B):
        rows = []
        for i in range(da):
            gi = torch.autograd.grad(actor(s[b:b + 1])[0, i], params)
            rows.append(torch.cat([x.flatten() for x in gi]))
        Jac.append(torch.stack(rows))
    dpg = cc.deterministic_policy_gradient(dQ_da, torch.stack(Jac))
    assert torch.allclose(dpg, auto, atol=1e-12)


@pytest.mark.equation("34.09", oracle="float64 closed form with min over the two critics, and the clipped-noise action")
def test_td3_target():
    g = _g(1)
    B, gamma = 6, 0.95
    r = torch.randn(B, generator=g, dtype=torch.float64)
    Q1, Q2 = torch.randn(B, generator=g, dtype=torch.float64), torch.randn(B, generator=g, dtype=torch.float64)
    d = torch.tensor([0, 0, 1, 0, 0, 1])
    y = cc.td3_target(r, Q1, Q2, gamma, d)
    for i in range(B):
        exp = r[i].item() + (0.0 if d[i] else gamma * min(Q1[i].item(), Q2[i].item()))
        assert abs(y[i].item() - exp) < 1e-14
    mu = torch.tensor([0.9, -0.2, 0.0], dtype=torch.float64)
    eps = torch.tensor([5.0, -0.5, 1.0], dtype=torch.float64)
    a = cc.td3_target_action(mu, eps, sigma=0.2, noise_clip=0.5, a_max=1.0)
    assert torch.allclose(a, torch.tensor([1.0, -0.3, 0.2], dtype=torch.float64), atol=1e-14)


def _td3_target_action_reference(mu_next, xi, sigma, noise_clip, low, high):
    """TD3's smoothing as in Fujimoto et al. (2018), Algorithm 1 and the authors' TD3.py, written in numpy:
    noise = clip(sigma * xi, -c, c); next_action = clip(mu'(s') + noise, low, high), elementwise."""
    noise = np.clip(sigma * xi, -noise_clip, noise_clip)
    return np.clip(mu_next + noise, low, high)


def test_td3_target_action_matches_the_paper_and_a_gymnasium_box():
    import gymnasium as gym

    rng = np.random.default_rng(0)
    # a symmetric box [-a_max, a_max], actions and noise large enough that both clips bind often
    mu = rng.uniform(-1.2, 1.2, size=(500, 3))
    xi = rng.normal(size=(500, 3)) * 3
    a = cc.td3_target_action(torch.tensor(mu), torch.tensor(xi), sigma=0.2, noise_clip=0.5, a_max=1.0)
    ref = _td3_target_action_reference(mu, xi, 0.2, 0.5, -1.0, 1.0)
    np.testing.assert_allclose(a.numpy(), ref, rtol=0, atol=1e-15)
    noise_clipped = np.abs(0.2 * xi) > 0.5
    box_clipped = np.abs(mu + np.clip(0.2 * xi, -0.5, 0.5)) > 1.0
    assert noise_clipped.mean() > 0.2 and box_clipped.mean() > 0.05  # both clips are exercised
    # the order matters: clipping only the sum, or only the noise, gives other actions
    assert not np.allclose(a.numpy(), np.clip(mu + 0.2 * xi, -1.0, 1.0))
    assert not np.allclose(a.numpy(), mu + np.clip(0.2 * xi, -0.5, 0.5))
    # an asymmetric per-dimension box, read from a gymnasium Box
    box = gym.spaces.Box(low=np.array([-2.0, 0.0, -0.5]), high=np.array([2.0, 1.0, 0.25]), dtype=np.float64)
    mu_b = rng.uniform(box.low - 0.3, box.high + 0.3, size=(500, 3))
    a_b = cc.td3_target_action(torch.tensor(mu_b), torch.tensor(xi), sigma=0.3, noise_clip=0.4,
                               a_low=torch.tensor(box.low), a_high=torch.tensor(box.high))
    np.testing.assert_allclose(a_b.numpy(), _td3_target_action_reference(mu_b, xi, 0.3, 0.4, box.low, box.high),
                               rtol=0, atol=1e-15)
    assert all(box.contains(x) for x in a_b.numpy())
    # the smoothing noise is N(0, sigma^2) clipped to [-c, c]: its mean is 0 and its second moment matches the
    # truncation formula E[min(sigma^2 xi^2, c^2)] (scipy.stats), within 5 standard errors
    from scipy import stats
    xi_big = torch.randn(200_000, generator=_g(7), dtype=torch.float64)
    eps = cc.td3_target_action(torch.zeros(200_000, dtype=torch.float64), xi_big, sigma=0.2, noise_clip=0.3,
                               a_max=10.0).numpy()
    z = 0.3 / 0.2
    m2 = 0.2**2 * (stats.norm.cdf(z) - stats.norm.cdf(-z) - 2 * z * stats.norm.pdf(z)) + 0.3**2 * 2 * stats.norm.sf(z)
    assert abs(eps.mean()) < 5 * eps.std() / math.sqrt(len(eps))
    assert abs((eps**2).mean() - m2) < 5 * (eps**2).std() / math.sqrt(len(eps))
    assert eps.max() <= 0.3 and eps.min() >= -0.3
    with pytest.raises(ValueError, match="a_low <= a_high"):
        cc.td3_target_action(torch.zeros(2), torch.zeros(2), a_low=1.0, a_high=-1.0)
    with pytest.raises(ValueError, match="a_low and a_high must"):
        cc.td3_target_action(torch.zeros(4, 2), torch.zeros(4, 2), a_low=torch.zeros(3), a_high=torch.ones(3))
    with pytest.raises(ValueError, match="must have the same shape|same shape"):
        cc.td3_target_action(torch.zeros(4, 2), torch.zeros(4, 3))


@pytest.mark.equation("34.10", oracle="float64 closed form sum_t gamma^t (r_t + alpha H_t) by a loop")
def test_sac_objective():
    g = _g(2)
    r, H = torch.randn(3, 5, generator=g, dtype=torch.float64), torch.rand(3, 5, generator=g, dtype=torch.float64)
    J = cc.sac_objective(r, H, alpha=0.3, gamma=0.9)
    for b in range(3):
        exp = sum(0.9**t * (r[b, t].item() + 0.3 * H[b, t].item()) for t in range(5))
        assert abs(J[b].item() - exp) < 1e-12


@pytest.mark.equation("34.11", oracle="TransformedDistribution(Normal, TanhTransform).log_prob; a closed-form mean")
def test_sac_soft_value_with_tanh_gaussian():
    g = _g(3)
    B, K, da, alpha = 4, 6, 2, 0.2
    mu = torch.randn(B, 1, da, generator=g, dtype=torch.float64)
    log_std = 0.3 * torch.randn(B, 1, da, generator=g, dtype=torch.float64)
    u = mu + log_std.exp() * torch.randn(B, K, da, generator=g, dtype=torch.float64)
    logp = cc.tanh_gaussian_log_prob(u, mu.expand_as(u), log_std.expand_as(u))
    dist = TransformedDistribution(Normal(mu, log_std.exp()), [TanhTransform()])
    ref = dist.log_prob(torch.tanh(u)).sum(-1)
    assert torch.allclose(logp, ref, atol=1e-9)
    Q = torch.randn(B, K, generator=g, dtype=torch.float64)
    V = cc.sac_soft_value(Q, logp, alpha)
    assert torch.allclose(V, (Q - alpha * ref).mean(-1), atol=1e-9)


def test_tanh_gaussian_stable_for_large_u():
    u = torch.tensor([[30.0]], dtype=torch.float64)
    lp = cc.tanh_gaussian_log_prob(u, u.clone(), torch.zeros(1, 1, dtype=torch.float64))
    naive = Normal(30.0, 1.0).log_prob(u) - torch.log(1 - torch.tanh(u) ** 2)
    assert torch.isfinite(lp).all() and not torch.isfinite(naive).all()
    assert abs(lp.item() - (-0.5 * math.log(2 * math.pi) - 2 * (0.6931471805599453 - 30.0))) < 1e-9


def _vtrace_loop(r, V, log_rho, gamma, rho_bar, c_bar):
    """The definition summed term by term: v_s = V_s + sum_t gamma^(t-s) (prod_{i<t} c_i) delta_t."""
    B, T = r.shape
    ratio = log_rho.exp()
    out = torch.zeros(B, T, dtype=torch.float64)
    for b in range(B):
        for s in range(T):
            total = V[b, s].item()
            for t in range(s, T):
                prod = 1.0
                for i in range(s, t):
                    prod *= min(c_bar, ratio[b, i].item())
                td = r[b, t].item() + gamma * V[b, t + 1].item() - V[b, t].item()
                delta = min(rho_bar, ratio[b, t].item()) * td
                total += gamma ** (t - s) * prod * delta
            out[b, s] = total
    return out


@pytest.mark.equation("34.12", oracle="brute-force loop of the V-trace sum; on-policy it equals returns.n_step_return")
@pytest.mark.parametrize("rho_bar,c_bar", [(1.0, 1.0), (2.0, 0.5)])
def test_vtrace_brute_force(rho_bar, c_bar):
    g = _g(5)
    B, T, gamma = 3, 7, 0.9
    r = torch.randn(B, T, generator=g, dtype=torch.float64)
    V = torch.randn(B, T + 1, generator=g, dtype=torch.float64)
    log_rho = 0.7 * torch.randn(B, T, generator=g, dtype=torch.float64)
    v = cc.vtrace(r, V, log_rho, gamma, rho_bar, c_bar)
    assert torch.allclose(v, _vtrace_loop(r, V, log_rho, gamma, rho_bar, c_bar), atol=1e-12)


def test_vtrace_on_policy_is_n_step_return():
    g = _g(6)
    r, V = torch.randn(2, 5, generator=g, dtype=torch.float64), torch.randn(2, 6, generator=g, dtype=torch.float64)
    d = torch.tensor([[0, 1, 0, 0, 0], [0, 0, 0, 1, 0]], dtype=torch.bool)
    v = cc.vtrace(r, V, torch.zeros(2, 5, dtype=torch.float64), 0.9, dones=d)
    assert torch.allclose(v, ret.n_step_return(r, V, 5, 0.9, d), atol=1e-12)
