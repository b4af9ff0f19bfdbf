"""Tests of llmbook.agents.dqn_loop (chapter 33): the replay buffer against collections.deque and a
chi-square test, the ensemble against torch.nn.Linear, the target refresh schedule, and the whole loop
against value iteration's Q* on a small chain."""

from __future__ import annotations

from collections import deque

import numpy as np
import pytest
import scipy.stats
import torch
from torch import nn

from llmbook.agents import dqn_loop as dl
from llmbook.agents.dynamic_programming import value_iteration
from llmbook.agents.envs import TabularMDP


def chain(n: int = 6, gamma: float = 0.9) -> TabularMDP:
    """States 0..n-2 live, n-1 terminal; LEFT (0) moves down (stays at 0), RIGHT (1) moves up; reward 1 for
    entering the terminal state; episodes start uniformly in a live state."""
    P = torch.zeros(n, 2, n, dtype=torch.float64)
    R = torch.zeros(n, 2, n, dtype=torch.float64)
    for s in range(n - 1):
        P[s, 0, max(s - 1, 0)] = 1.0
        P[s, 1, s + 1] = 1.0
    R[n - 2, 1, n - 1] = 1.0
    P[n - 1, :, n - 1] = 1.0
    term = torch.zeros(n, dtype=torch.bool)
    term[-1] = True
    mu0 = torch.zeros(n, dtype=torch.float64)
    mu0[:-1] = 1.0 / (n - 1)
    return TabularMDP(P=P, R=R, gamma=gamma, terminal=term, mu0=mu0, name="chain")


def test_replay_buffer_is_a_ring_and_samples_uniformly():
    buf = dl.ReplayBuffer(capacity=7, K=2)
    ref = deque(maxlen=7)  # the oracle: a deque that drops its oldest item
    for i in range(19):
        buf.add(torch.tensor([i, 100 + i]), torch.tensor([i % 3, 0]), torch.tensor([float(i), -1.0]),
                torch.tensor([i + 1, 0]), torch.tensor([i % 5 == 0, False]))
        ref.append(i)
        assert len(buf) == len(ref)
        assert sorted(buf.s[0, :len(buf)].tolist()) == sorted(ref)
        assert sorted(buf.s[1, :len(buf)].tolist()) == sorted(100 + j for j in ref)
    # each stored transition stays whole
    for s, a, r, s2, d in zip(*(x[0].tolist() for x in (buf.s, buf.a, buf.r, buf.s_next, buf.done)), strict=True):
        assert (a, r, s2, d) == (s % 3, float(s), s + 1, s % 5 == 0)
    # sampling: only the filled part, uniformly (chi-square goodness of fit, 7 cells)
    half = dl.ReplayBuffer(capacity=10, K=1)
    for i in range(4):
        half.add(torch.tensor([i]), torch.tensor([0]), torch.tensor([0.0]), torch.tensor([0]), torch.tensor([False]))
    s, *_ = half.sample(4000, torch.Generator().manual_seed(0))
    assert set(s.flatten().tolist()) <= {0, 1, 2, 3}
    s, *_ = buf.sample(7000, torch.Generator().manual_seed(1))
    counts = np.bincount(s[0].numpy() - 12, minlength=7)
    assert scipy.stats.chisquare(counts).pvalue > 1e-3
    with pytest.raises(ValueError, match="empty"):
        dl.ReplayBuffer(3).sample(1, torch.Generator())
    with pytest.raises(ValueError, match="one value per agent"):
        buf.add(torch.tensor([1]), torch.tensor([0]), torch.tensor([0.0]), torch.tensor([0]), torch.tensor([False]))


def test_ensemble_members_are_mlps():
    """Member k equals nn.Sequential(Linear, ReLU, Linear) holding its weights."""
    net = dl.EnsembleMLP(3, 5, 8, 4, generator=torch.Generator().manual_seed(0))
    x = torch.randn(3, 6, 5)
    out = net(x)
    for k in range(3):
        ref = nn.Sequential(nn.Linear(5, 8), nn.ReLU(), nn.Linear(8, 4))
        with torch.no_grad():
            ref[0].weight.copy_(net.W1[k].T), ref[0].bias.copy_(net.b1[k, 0])
            ref[2].weight.copy_(net.W2[k].T), ref[2].bias.copy_(net.b2[k, 0])
        torch.testing.assert_close(out[k], ref(x[k]), atol=1e-6, rtol=0)
    bound = 1 / np.sqrt(5)
    assert net.W1.abs().max().item() <= bound and net.W1.abs().max().item() > 0.9 * bound
    with pytest.raises(ValueError, match="K, B, d_in"):
        net(torch.zeros(2, 6, 5))


def _params(m):
    return torch.cat([p.detach().flatten() for p in m.parameters()])


def test_target_network_refresh_schedule():
    mdp = chain()
    X = torch.eye(mdp.S)
    kw = dict(K=2, learning_starts=10, batch_size=8, seed=3, eval_every=1000)
    # 50 steps, learning from step 9 on: 41 updates
    never = dl.run_dqn(mdp, X, 50, C=1000, **kw)
    assert never.n_updates == 41 and never.n_syncs == 0
    g = torch.Generator().manual_seed(3)
    init = dl.EnsembleMLP(2, mdp.S, 64, 2, generator=g)  # the loop's first draw from its generator: the network
    torch.testing.assert_close(_params(never.target), _params(init), atol=0, rtol=0)
    assert not torch.equal(_params(never.net), _params(init))
    exact = dl.run_dqn(mdp, X, 50, C=41, **kw)  # refreshed after the last update
    assert exact.n_syncs == 1 and torch.equal(_params(exact.target), _params(exact.net))
    between = dl.run_dqn(mdp, X, 50, C=20, **kw)  # refreshed after update 40, then one more update
    assert between.n_syncs == 2 and not torch.equal(_params(between.target), _params(between.net))


def test_dqn_learns_q_star_on_a_chain():
    """Seed 0, two agents, 1500 steps: the learned Q is value iteration's Q* within 0.02 on every live pair."""
    mdp = chain()
    vi = value_iteration(mdp.P, mdp.R, mdp.gamma)
    run = dl.run_dqn(mdp, torch.eye(mdp.S), 1500, K=2, lr=3e-3, C=25, eps_decay=500, batch_size=64,
                     capacity=2000, learning_starts=100, max_steps=50, seed=0)
    err = (run.Q_history[-1] - vi.Q)[:, :-1].abs()
    assert err.max().item() < 0.02
    assert (run.Q_history[0] - vi.Q)[:, :-1].abs().max().item() > 0.3  # it did learn
    assert run.Q_history.shape == (16, 2, mdp.S, 2) and run.eval_steps[-1].item() == 1500


def test_bad_arguments():
    mdp = chain()
    with pytest.raises(ValueError, match="features"):
        dl.run_dqn(mdp, torch.eye(3), 10)
    with pytest.raises(ValueError, match="C"):
        dl.run_dqn(mdp, torch.eye(mdp.S), 10, C=0)
    with pytest.raises(ValueError, match="loss"):
        dl.run_dqn(mdp, torch.eye(mdp.S), 10, loss="l1")
    with pytest.raises(ValueError, match="eps_end"):
        dl.run_dqn(mdp, torch.eye(mdp.S), 10, eps_end=2.0)
