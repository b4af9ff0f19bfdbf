"""Tests of llmbook.agents.offpolicy_control (chapter 34): Polyak averaging against the hand formula, the
reparameterised tanh-Gaussian against torch.distributions.TransformedDistribution (values and gradients), SAC's
target, actor and temperature losses against direct formulas and closed-form gradients, and short runs."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch import nn
from torch.distributions import Normal, TransformedDistribution
from torch.distributions.transforms import TanhTransform

from llmbook.agents import continuous_control as cc
from llmbook.agents import offpolicy_control as oc


def _g(seed=0):
    return torch.Generator().manual_seed(seed)


def test_polyak_matches_hand_formula():
    torch.manual_seed(0)
    target, online = nn.Linear(3, 2).double(), nn.Linear(3, 2).double()
    before = [p.detach().clone() for p in target.parameters()]
    oc.polyak_update(target, online, 0.05)
    for b, p_t, p in zip(before, target.parameters(), online.parameters(), strict=True):
        np.testing.assert_allclose(p_t.detach().numpy(), 0.05 * p.detach().numpy() + 0.95 * b.numpy(), atol=1e-15)
    oc.polyak_update(target, online, 1.0)
    assert all(torch.equal(p_t, p) for p_t, p in zip(target.parameters(), online.parameters(), strict=True))
    with pytest.raises(ValueError, match="tau"):
        oc.polyak_update(target, online, 1.5)


def test_tanh_gaussian_sample_matches_transformed_distribution():
    g = _g(1)
    mu = torch.randn(6, 2, generator=g, dtype=torch.float64).requires_grad_(True)
    log_std = (0.5 * torch.randn(6, 2, generator=g, dtype=torch.float64)).requires_grad_(True)
    xi = torch.randn(6, 2, generator=g, dtype=torch.float64)
    a, logp = oc.tanh_gaussian_sample(mu, log_std, xi)
    dist = TransformedDistribution(Normal(mu, log_std.exp()), [TanhTransform()])
    a_ref = torch.tanh(mu + log_std.exp() * xi)
    logp_ref = dist.log_prob(a_ref).sum(-1)
    torch.testing.assert_close(a, a_ref, rtol=0, atol=1e-14)
    torch.testing.assert_close(logp, logp_ref, rtol=0, atol=1e-9)
    # the reparameterised gradients (through the sample and the log-det) agree too
    w = torch.tensor([[0.3, -1.2]], dtype=torch.float64)
    ours = torch.autograd.grad((logp + (a * w).sum(-1)).sum(), (mu, log_std))
    ref = torch.autograd.grad((logp_ref + (a_ref * w).sum(-1)).sum(), (mu, log_std))
    for x, y in zip(ours, ref, strict=True):
        torch.testing.assert_close(x, y, rtol=0, atol=1e-8)


def test_sac_critic_target_formula_and_soft_value():
    g = _g(2)
    r, Q1, Q2, logp = (torch.randn(2, 5, generator=g, dtype=torch.float64) for _ in range(4))
    alpha = torch.tensor([[0.1], [0.7]], dtype=torch.float64)
    d = torch.tensor([[0, 0, 1, 0, 0], [1, 0, 0, 0, 0]], dtype=torch.bool)
    y = oc.sac_critic_target(r, Q1, Q2, logp, alpha, 0.9, d)
    expected = r.numpy() + 0.9 * (1 - d.numpy()) * (np.minimum(Q1.numpy(), Q2.numpy()) - alpha.numpy() * logp.numpy())
    np.testing.assert_allclose(y.numpy(), expected, atol=1e-14)
    # one seed, scalar alpha: r + gamma * the chapter's soft value with one sample of the minimum critic
    V = cc.sac_soft_value(torch.minimum(Q1[0], Q2[0])[:, None], logp[0][:, None], alpha=0.3)
    torch.testing.assert_close(oc.sac_critic_target(r[0], Q1[0], Q2[0], logp[0], 0.3, 0.9), r[0] + 0.9 * V)
    with pytest.raises(ValueError, match="one shape"):
        oc.sac_critic_target(r, Q1, Q2[:, :3], logp, 0.1)


def test_sac_actor_loss_and_temperature_loss():
    g = _g(3)
    K, B = 3, 8
    Q1, Q2 = (torch.randn(K, B, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(2))
    logp = torch.randn(K, B, generator=g, dtype=torch.float64, requires_grad=True)
    log_alpha = torch.tensor([[-1.0], [0.0], [0.5]], dtype=torch.float64, requires_grad=True)
    loss = oc.sac_actor_loss(Q1, Q2, logp, log_alpha.exp())
    al = log_alpha.exp().detach().numpy()
    expected = (al * logp.detach().numpy() - np.minimum(Q1.detach().numpy(), Q2.detach().numpy())).mean(1).sum()
    np.testing.assert_allclose(loss.item(), expected, rtol=1e-12)
    loss.backward()
    assert log_alpha.grad is None  # the temperature is held fixed in the actor's loss
    np.testing.assert_allclose(logp.grad.numpy(), np.broadcast_to(al / B, (K, B)), rtol=1e-12)
    # temperature: dJ/dlog(alpha) = -alpha * mean(logp + target), closed form; entropy below target raises alpha
    target = -1.0
    J = oc.sac_temperature_loss(log_alpha, logp, target)
    (grad,) = torch.autograd.grad(J, log_alpha)
    np.testing.assert_allclose(grad.numpy()[:, 0], -al[:, 0] * (logp.detach().numpy() + target).mean(1), rtol=1e-12)
    low_entropy = torch.full((1, 4), 2.0, dtype=torch.float64)  # -log pi = -2 < -1
    la = torch.zeros(1, 1, dtype=torch.float64, requires_grad=True)
    (g_low,) = torch.autograd.grad(oc.sac_temperature_loss(la, low_entropy, target), la)
    assert g_low.item() < 0  # gradient descent increases log alpha
    with pytest.raises(ValueError, match="K, B"):
        oc.sac_actor_loss(Q1[0], Q2[0], logp[0], 0.1)
    with pytest.raises(ValueError, match="log_alpha"):
        oc.sac_temperature_loss(torch.zeros(2), logp, target)


@pytest.mark.parametrize("algo", oc.ALGOS)
def test_short_runs_are_deterministic(algo):
    kw = dict(K=2, steps=60, start_steps=20, batch=8, hidden=8, eval_every=30)
    a, b = oc.train_pendulum(algo, **kw), oc.train_pendulum(algo, **kw)
    assert a == b and a["steps"] == [0, 30, 60] and len(a["eval"][0]) == 2
    assert all(-200 * 17 < x < 0 for row in a["eval"] for x in row)  # a step's cost is at most pi^2 + 6.4 + 0.004
    if algo == "sac":
        assert a["alpha"][-1] != a["alpha"][0]
    with pytest.raises(ValueError, match="algo"):
        oc.train_pendulum("ppo")
    assert math.isfinite(a["eval"][-1][0])
