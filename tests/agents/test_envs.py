"""Tests of llmbook.agents.envs: gymnasium's tables converted exactly, terminals absorbing, seeded sampling."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from llmbook.agents import envs

gym = pytest.importorskip("gymnasium")

ENVS = [("FrozenLake-v1", dict(is_slippery=True)), ("FrozenLake-v1", dict(is_slippery=False)),
        ("CliffWalking-v1", {}), ("Taxi-v4", {})]


@pytest.mark.parametrize("name,kw", ENVS)
def test_tables_are_stochastic_and_terminals_absorb(name, kw):
    mdp = envs.from_gymnasium(name, **kw)
    assert mdp.P.dtype == torch.float64 and (mdp.P >= 0).all()
    torch.testing.assert_close(mdp.P.sum(-1), torch.ones(mdp.S, mdp.A, dtype=torch.float64), atol=1e-12, rtol=0)
    t = mdp.terminal.nonzero().flatten()
    assert len(t) > 0
    assert (mdp.P[t, :, t] == 1).all() and (mdp.R[t] == 0).all()
    assert abs(mdp.mu0.sum().item() - 1) < 1e-12


@pytest.mark.parametrize("name,kw", ENVS)
def test_table_matches_gymnasium_entries(name, kw):
    """Summing gymnasium's own list for every non-terminal (s, a) gives P and the mean reward."""
    mdp = envs.from_gymnasium(name, **kw)
    table = gym.make(name, **kw).unwrapped.P
    live = ~mdp.terminal.numpy()
    P_ref, r_ref = np.zeros((mdp.S, mdp.A, mdp.S)), np.zeros((mdp.S, mdp.A))
    for s in np.flatnonzero(live):
        for a in range(mdp.A):
            for prob, s2, rew, _ in table[s][a]:
                P_ref[s, a, s2] += prob
                r_ref[s, a] += prob * rew
    np.testing.assert_allclose(mdp.P.numpy()[live], P_ref[live], atol=1e-12, rtol=0)
    np.testing.assert_allclose(mdp.r_sa.numpy()[live], r_ref[live], atol=1e-9, rtol=0)


def test_frozenlake_slippery_matches_env_step_statistics():
    """Seeded env.step samples from one state: frequencies within 5 standard errors of P."""
    env = gym.make("FrozenLake-v1", is_slippery=True)
    mdp = envs.from_gymnasium(env)
    s, a, n = 6, 2, 3000
    counts = np.zeros(mdp.S)
    env.reset(seed=0)
    for _ in range(n):
        env.unwrapped.s = s
        s2, *_ = env.step(a)
        counts[s2] += 1
    p = mdp.P[s, a].numpy()
    se = np.sqrt(p * (1 - p) / n) + 1e-12
    assert np.all(np.abs(counts / n - p) <= 5 * se + 1e-9)
    assert np.count_nonzero(counts) == 3  # three possible outcomes, each drawn


def test_terminal_sets():
    fl = envs.from_gymnasium("FrozenLake-v1", is_slippery=False)
    holes_goal = [i for i, c in enumerate("".join(fl.desc)) if c in "HG"]
    assert fl.terminal.nonzero().flatten().tolist() == holes_goal
    cw = envs.from_gymnasium("CliffWalking-v1")
    assert cw.terminal.nonzero().flatten().tolist() == [47]
    assert cw.r_sa[36, 1].item() == -100.0  # stepping right from the start falls off the cliff


def test_sample_episodes_frequencies_and_absorption():
    mdp = envs.from_gymnasium("FrozenLake-v1", is_slippery=True)
    g = torch.Generator().manual_seed(0)
    pi = torch.full((mdp.S, mdp.A), 0.25, dtype=torch.float64)
    ep = envs.sample_episodes(mdp, pi, n=4000, T=1, generator=g, s0=0)
    freq = torch.bincount(ep.states[:, 1], minlength=mdp.S).double() / 4000
    ref = (pi[0, :, None] * mdp.P[0]).sum(0)
    assert (freq - ref).abs().max().item() < 5 * (0.25 / 4000) ** 0.5
    ep = envs.sample_episodes(mdp, pi, n=200, T=60, generator=g)
    # once done, always done and no more reward
    d = ep.done
    assert (d[:, 1:] >= d[:, :-1]).all()
    assert (ep.rewards[d[:, :-1]] == 0).all()
    ep2 = envs.sample_episodes(mdp, pi, n=200, T=60, generator=torch.Generator().manual_seed(0))
    ep3 = envs.sample_episodes(mdp, pi, n=200, T=60, generator=torch.Generator().manual_seed(0))
    assert torch.equal(ep2.states, ep3.states)


def test_sample_episodes_rejects_bad_policy():
    mdp = envs.from_gymnasium("FrozenLake-v1", is_slippery=False)
    with pytest.raises(ValueError, match="pi must be"):
        envs.sample_episodes(mdp, torch.ones(3, 4), n=1, T=1, generator=torch.Generator())
    with pytest.raises(ValueError, match="deterministic pi"):
        envs.sample_episodes(mdp, torch.full((16,), 4), n=1, T=1, generator=torch.Generator())


def test_tiger_pomdp_is_stochastic():
    p = envs.tiger_pomdp()
    torch.testing.assert_close(p.T.sum(-1), torch.ones(2, 3, dtype=torch.float64))
    torch.testing.assert_close(p.O.sum(-1), torch.ones(3, 2, dtype=torch.float64))
    assert p.O[0, 1, 1].item() == 0.85 and p.R[1, 1].item() == 10.0


def test_values_of_converted_tables_match_returns_in_gymnasium():
    """The absorbing-terminal convention end to end: V^pi from the converted table (numpy.linalg.solve) equals
    the discounted return of episodes run in gymnasium's own env.step and stopped at ``terminated``."""
    gamma = 0.9
    # CliffWalking, deterministic: up, right along row 2, down into the goal; 13 steps of reward -1
    cw = envs.from_gymnasium("CliffWalking-v1")
    pi = torch.zeros(cw.S, dtype=torch.long)
    pi[24:35], pi[35] = 1, 2  # RIGHT along row 2, DOWN at its end; UP (0) from the start state 36
    rows = torch.arange(cw.S)
    V = np.linalg.solve(np.eye(cw.S) - gamma * cw.P[rows, pi].numpy(), cw.r_sa[rows, pi].numpy())
    env = gym.make("CliffWalking-v1").unwrapped
    s, _ = env.reset(seed=0)
    G, k, term = 0.0, 0, False
    while not term:
        s, r, term, _, _ = env.step(int(pi[s]))
        G += gamma**k * r
        k += 1
    assert k == 13 and abs(V[36] - G) < 1e-12
    # slippery FrozenLake: Monte Carlo over gymnasium episodes (no time limit) within 5 standard errors
    fl = envs.from_gymnasium("FrozenLake-v1", is_slippery=True)
    pi = torch.tensor([0, 3, 0, 3, 0, 0, 0, 0, 3, 1, 0, 0, 0, 2, 1, 0])  # walks along the walls
    rows = torch.arange(fl.S)
    V = np.linalg.solve(np.eye(fl.S) - gamma * fl.P[rows, pi].numpy(), fl.r_sa[rows, pi].numpy())
    env = gym.make("FrozenLake-v1", is_slippery=True).unwrapped
    env.reset(seed=0)
    returns = []
    for _ in range(2000):
        s, _ = env.reset()
        G, disc = 0.0, 1.0
        for _ in range(300):  # gamma^300 < 1e-13: the truncated tail is negligible
            s, r, term, _, _ = env.step(int(pi[s]))
            G += disc * r
            disc *= gamma
            if term:
                break
        returns.append(G)
    returns = np.array(returns)
    assert abs(returns.mean() - V[0]) < 5 * returns.std() / np.sqrt(len(returns))


def test_sample_episodes_rejects_a_policy_that_is_not_a_distribution():
    import pytest
    import torch

    from llmbook.agents import envs

    mdp = envs.from_gymnasium("FrozenLake-v1", is_slippery=False)
    with pytest.raises(ValueError, match="summing to 1"):
        envs.sample_episodes(mdp, torch.full((mdp.S, mdp.A), 0.3), n=2, T=3, generator=torch.Generator().manual_seed(0))
