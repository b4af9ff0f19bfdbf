"""Tests of llmbook.agents.ppo_control (chapter 34): GAE against a brute-force sum of discounted TD errors,
PPO's loss and diagnostics against direct NumPy formulas, and a short deterministic training run."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from llmbook.agents import ppo_control as pc
from llmbook.lm import rlhf


def _gae_brute(r, V, d, gamma, lam):
    B, T = r.shape
    A = np.zeros((B, T))
    for b in range(B):
        for t in range(T):
            total, weight = 0.0, 1.0
            for k in range(t, T):
                delta = r[b, k] + gamma * (1 - d[b, k]) * V[b, k + 1] - V[b, k]
                total += weight * delta
                if d[b, k]:
                    break
                weight *= gamma * lam
            A[b, t] = total
    return A


def test_gae_matches_brute_force_sum_of_td_errors():
    g = torch.Generator().manual_seed(0)
    B, T = 4, 9
    r = torch.randn(B, T, generator=g, dtype=torch.float64)
    V = torch.randn(B, T + 1, generator=g, dtype=torch.float64)
    d = torch.rand(B, T, generator=g) < 0.25
    for gamma, lam in ((0.99, 0.95), (0.9, 0.0), (0.8, 1.0)):
        A = pc.gae_advantages(r, V, d, gamma, lam)
        np.testing.assert_allclose(A.numpy(), _gae_brute(r.numpy(), V.numpy(), d.numpy(), gamma, lam), atol=1e-12)
    # without episode ends it is chapter 10's GAE
    nod = torch.zeros(B, T, dtype=torch.bool)
    torch.testing.assert_close(pc.gae_advantages(r, V, nod, 0.97, 0.9), rlhf.gae(r, V, 0.97, 0.9), rtol=0, atol=1e-12)
    with pytest.raises(TypeError, match="dones"):
        pc.gae_advantages(r, V, d.double(), 0.9, 0.9)


def test_ppo_losses_match_direct_formula():
    g = torch.Generator().manual_seed(1)
    K, M, eps, c_v, c_H = 3, 20, 0.2, 0.5, 0.01
    logp_old = -torch.rand(K, M, generator=g, dtype=torch.float64) * 2
    logp = (logp_old + 0.4 * torch.randn(K, M, generator=g, dtype=torch.float64)).requires_grad_(True)
    A, V, R, H = (torch.randn(K, M, generator=g, dtype=torch.float64) for _ in range(4))
    out = pc.ppo_losses(logp, logp_old, A, V, R, H, eps, c_v, c_H)
    rho = np.exp(logp.detach().numpy() - logp_old.numpy())
    a, v, R_, H_ = A.numpy(), V.numpy(), R.numpy(), H.numpy()
    per_seed = (-np.minimum(rho * a, np.clip(rho, 1 - eps, 1 + eps) * a).mean(1) + c_v * ((v - R_) ** 2).mean(1)
                - c_H * H_.mean(1))
    np.testing.assert_allclose(out["loss"].item(), per_seed.sum(), rtol=1e-12)
    np.testing.assert_allclose(out["clip_frac"].numpy(), (np.abs(rho - 1) > eps).mean(1), atol=0)
    np.testing.assert_allclose(out["approx_kl"].numpy(), (rho - 1 - np.log(rho)).mean(1), rtol=1e-12)
    assert 0 < out["clip_frac"].min() and out["clip_frac"].max() < 1  # both regimes occur
    # the gradient vanishes exactly where the clip is active on the advantage's side
    (grad,) = torch.autograd.grad(out["loss"], logp)
    clipped = ((rho > 1 + eps) & (a > 0)) | ((rho < 1 - eps) & (a < 0))
    assert clipped.any() and np.all(grad.numpy()[clipped] == 0)
    np.testing.assert_allclose(grad.numpy()[~clipped], -(rho * a)[~clipped] / M, rtol=1e-12)
    with pytest.raises(ValueError, match="K, M"):
        pc.ppo_losses(logp[0], logp_old[0], A[0], V[0], R[0], H[0])


def test_training_is_deterministic_and_logs_diagnostics():
    kw = dict(K=2, n_envs=2, T=16, iters=2, hidden=8)
    a, b = pc.train_ppo_cartpole(**kw), pc.train_ppo_cartpole(**kw)
    assert a == b
    assert len(a["return"]) == 2 and len(a["return"][0]) == 2 and a["steps"] == [32, 64]
    assert all(0 <= f <= 1 for f in a["clip_frac"][-1]) and all(k >= 0 for k in a["approx_kl"][-1])


def test_seed_mean_interval_matches_scipy():
    from scipy import stats

    x = np.array([120.0, 480.0, 500.0, 333.0, 410.0, 250.0])
    m, lo, hi = pc.seed_mean_interval(x, 0.95)
    ref = stats.t.interval(0.95, len(x) - 1, loc=x.mean(), scale=stats.sem(x))
    np.testing.assert_allclose([m, lo, hi], [x.mean(), *ref], rtol=1e-12)
    with pytest.raises(ValueError, match="at least 2"):
        pc.seed_mean_interval([1.0])
