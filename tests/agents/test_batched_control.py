"""Tests of llmbook.agents.batched_control (chapter 34): the batched CartPole and Pendulum dynamics against
gymnasium's own environments step by step, and the seed-axis MLP against per-seed torch.nn.functional.linear."""

from __future__ import annotations

import gymnasium as gym
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from llmbook.agents import batched_control as bc


def test_cartpole_matches_gymnasium_step_by_step():
    env = gym.make("CartPole-v1").unwrapped
    rng = np.random.default_rng(0)
    n_steps, n_ends = 0, 0
    for episode in range(6):
        obs, _ = env.reset(seed=episode)
        state = torch.tensor(env.state, dtype=torch.float64)[None]
        for _ in range(500):
            a = int(rng.integers(2))
            obs, reward, terminated, _, _ = env.step(a)
            state, done = bc.cartpole_step(state, torch.tensor([a]))
            np.testing.assert_allclose(state[0].numpy(), env.state, rtol=0, atol=1e-12)
            np.testing.assert_allclose(bc.cartpole_obs(state)[0].numpy(), obs, rtol=0, atol=1e-6)  # gym: float32
            assert bool(done[0]) == terminated and reward == 1.0
            n_steps += 1
            if terminated:
                n_ends += 1
                break
    assert n_ends == 6 and n_steps > 60


def test_pendulum_matches_gymnasium_step_by_step():
    env = gym.make("Pendulum-v1").unwrapped
    rng = np.random.default_rng(1)
    for episode in range(3):
        obs, _ = env.reset(seed=episode)
        state = torch.tensor(env.state, dtype=torch.float64)[None]
        for _ in range(200):
            # torques on a grid of 1/8 (exact in float32, whose arithmetic gymnasium mixes in), also outside the box
            u = (rng.integers(-24, 25, size=1) / 8).astype(np.float32)
            obs, reward, _, _, _ = env.step(u)
            state, r = bc.pendulum_step(state, torch.tensor(u, dtype=torch.float64))
            np.testing.assert_allclose(state[0].numpy(), env.state, rtol=0, atol=1e-10)
            np.testing.assert_allclose(r[0].item(), reward, rtol=0, atol=1e-8)  # gym: 0.001 u^2 in float32
            np.testing.assert_allclose(bc.pendulum_obs(state)[0].numpy(), obs, rtol=0, atol=1e-5)


def test_batched_envs_auto_reset_and_shapes():
    env = bc.BatchedCartPole((3, 4), torch.Generator().manual_seed(0))
    assert env.obs().shape == (3, 4, 4) and env.obs().abs().max() <= 0.05
    returns = []
    for _ in range(60):  # always push right: every episode falls within about 10 steps
        _, r, term, trunc, ep = env.step(torch.ones(3, 4, dtype=torch.long))
        assert r.shape == (3, 4) and not trunc.any()
        returns += ep[term].tolist()
    assert len(returns) >= 12 and all(5 <= g <= 20 for g in returns)
    pend = bc.BatchedPendulum((2,), torch.Generator().manual_seed(0))
    obs, r = pend.step(torch.zeros(2))
    assert obs.shape == (2, 3) and r.shape == (2,) and pend.t == 1


def test_seed_mlp_is_k_independent_networks():
    K, N = 3, 5
    net = bc.SeedMLP(K, (4, 6, 2), torch.Generator().manual_seed(0))
    x = torch.randn(K, N, 4, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    y = net(x)
    for k in range(K):
        h = torch.tanh(F.linear(x[k], net.W[0][k].T, net.b[0][k, 0]))
        torch.testing.assert_close(y[k], F.linear(h, net.W[1][k].T, net.b[1][k, 0]), rtol=0, atol=1e-12)
    # a loss summed over seeds gives seed 0 the gradient of its own loss alone
    (g_all,) = torch.autograd.grad((y**2).sum(), net.W[0])
    (g_0,) = torch.autograd.grad((net(x)[0] ** 2).sum(), net.W[0])
    torch.testing.assert_close(g_all[0], g_0[0], rtol=0, atol=1e-12)
    assert g_0[1:].abs().max() == 0


def test_bad_input():
    with pytest.raises(ValueError, match="state"):
        bc.cartpole_step(torch.zeros(2, 3), torch.zeros(2))
    with pytest.raises(ValueError, match="action"):
        bc.cartpole_step(torch.zeros(2, 4), torch.zeros(3))
    with pytest.raises(ValueError, match="u must"):
        bc.pendulum_step(torch.zeros(2, 2), torch.zeros(3))
    with pytest.raises(ValueError, match="x must"):
        bc.SeedMLP(2, (3, 1), torch.Generator())(torch.zeros(3, 1, 3))
    with pytest.raises(ValueError, match="SeedMLP"):
        bc.SeedMLP(0, (3, 1), torch.Generator())
