"""Tests of llmbook.agents.mdp against independent oracles: numpy.linalg.solve, scipy.signal.lfilter,
explicit loops over (s, a, s'), brute force over deterministic policies, Monte Carlo on gymnasium."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from scipy.signal import lfilter

from llmbook.agents import envs, mdp

gym = pytest.importorskip("gymnasium")


def random_mdp(S=4, A=3, seed=0, sparse=False):
    rng = np.random.default_rng(seed)
    P = rng.random((S, A, S)) ** (4 if sparse else 1)
    P /= P.sum(-1, keepdims=True)
    R = rng.normal(size=(S, A, S))
    pi = rng.random((S, A))
    pi /= pi.sum(-1, keepdims=True)
    return P, R, pi


def np_policy_value(P, R, pi, gamma):
    """The oracle: V = numpy.linalg.solve(I - gamma P_pi, r_pi), with P_pi and r_pi built by loops."""
    S, A, _ = P.shape
    P_pi, r_pi = np.zeros((S, S)), np.zeros(S)
    for s, a, t in itertools.product(range(S), range(A), range(S)):
        P_pi[s, t] += pi[s, a] * P[s, a, t]
        r_pi[s] += pi[s, a] * P[s, a, t] * R[s, a, t]
    return np.linalg.solve(np.eye(S) - gamma * P_pi, r_pi)


def np_optimal_value(P, R, gamma):
    """Brute force: the best of all A^S deterministic policies, each solved by numpy.linalg.solve."""
    S, A, _ = P.shape
    best = np.full(S, -np.inf)
    for acts in itertools.product(range(A), repeat=S):
        best = np.maximum(best, np_policy_value(P, R, np.eye(A)[list(acts)], gamma))
    return best


T_ = lambda x: torch.tensor(x, dtype=torch.float64)  # noqa: E731


@pytest.mark.equation("32.01", oracle="the MDP's own tables: stored exactly, R (S, A) broadcast, invalid"
                                      " P/gamma/terminal rejected")
def test_make_mdp_checks_the_definition():
    P, R, _ = random_mdp()
    m = mdp.make_mdp(T_(P), T_(R), 0.9)
    assert np.array_equal(m.P.numpy(), P) and np.array_equal(m.R.numpy(), R) and m.gamma == 0.9
    m2 = mdp.make_mdp(T_(P), T_(R[..., 0]), 0.9)
    assert np.array_equal(m2.R.numpy()[:, :, 3], R[..., 0])
    with pytest.raises(ValueError, match="sum to 1"):
        mdp.make_mdp(T_(P * 1.1), T_(R), 0.9)
    with pytest.raises(ValueError, match="gamma"):
        mdp.make_mdp(T_(P), T_(R), 1.5)
    with pytest.raises(ValueError, match="absorbing"):
        mdp.make_mdp(T_(P), T_(R), 0.9, terminal=torch.tensor([True, False, False, False]))
    fl = envs.from_gymnasium("FrozenLake-v1")
    m3 = mdp.make_mdp(fl.P, fl.R, 0.95, terminal=fl.terminal, mu0=fl.mu0)  # absorbing terminals accepted
    assert m3.terminal.sum().item() == 5


@pytest.mark.equation("32.02", oracle="gymnasium env.step frequencies on slippery FrozenLake (5 standard errors) and"
                                      " exact counts")
def test_empirical_transition_matches_env_step():
    env = gym.make("FrozenLake-v1", is_slippery=True)
    table = envs.from_gymnasium(env)
    env.reset(seed=1)
    rng = np.random.default_rng(1)
    s_list, a_list, s2_list = [], [], []
    s = 0
    for _ in range(20000):
        a = int(rng.integers(4))
        s2, _, term, trunc, _ = env.step(a)
        s_list.append(s)
        a_list.append(a)
        s2_list.append(s2)
        s = s2
        if term or trunc:
            s, _ = env.reset()
    P_hat, N = mdp.empirical_transition(torch.tensor(s_list), torch.tensor(a_list), torch.tensor(s2_list), 16, 4)
    seen = N > 200
    assert seen.sum() >= 16  # the first rows of the lake, visited hundreds of times
    P = table.P
    se = (P * (1 - P) / N.clamp_min(1)[..., None]).sqrt()
    assert ((P_hat - P).abs() <= 5 * se + 1e-12)[seen].all()
    # exact counts on a hand-made list
    P_hat, N = mdp.empirical_transition(torch.tensor([0, 0, 1]), torch.tensor([0, 0, 1]), torch.tensor([1, 0, 1]), 2, 2)
    assert P_hat[0, 0].tolist() == [0.5, 0.5] and N.tolist() == [[2, 0], [0, 1]] and P_hat[1, 0].tolist() == [0, 0]


@pytest.mark.equation("32.03", oracle="scipy.signal.lfilter([1], [1, -gamma]) on the reversed rewards, and a Python"
                                      " loop")
@pytest.mark.parametrize("gamma", [0.0, 0.5, 0.99, 1.0])
def test_discounted_return(gamma):
    r = np.random.default_rng(0).normal(size=(3, 17))
    G = mdp.discounted_return(T_(r), gamma).numpy()
    ref = lfilter([1.0], [1.0, -gamma], r[:, ::-1], axis=-1)[:, ::-1]
    np.testing.assert_allclose(G, ref, rtol=1e-12, atol=1e-12)
    loop = [sum(gamma**k * r[0, t + k] for k in range(17 - t)) for t in range(17)]
    np.testing.assert_allclose(G[0], loop, rtol=1e-12, atol=1e-12)


@pytest.mark.equation("32.04", oracle="numpy.linalg.solve(I - gamma P_pi, r_pi) (1e-10) and Monte Carlo returns on"
                                      " FrozenLake (5 SE)")
def test_state_value_against_solve_and_monte_carlo():
    for seed in range(3):
        P, R, pi = random_mdp(seed=seed)
        V = mdp.state_value(T_(P), T_(R), T_(pi), 0.9).numpy()
        np.testing.assert_allclose(V, np_policy_value(P, R, pi, 0.9), rtol=0, atol=1e-10)
    # Monte Carlo: the mean discounted return of seeded episodes from the start state
    fl = envs.from_gymnasium("FrozenLake-v1", is_slippery=True)
    pi = torch.full((16, 4), 0.25, dtype=torch.float64)
    gamma, H, n = 0.9, 60, 20000
    ep = envs.sample_episodes(fl, pi, n=n, T=H, generator=torch.Generator().manual_seed(0), s0=0)
    G0 = mdp.discounted_return(ep.rewards, gamma)[:, 0]
    V_H = mdp.state_value(fl.P, fl.R, pi, gamma, horizon=H)[0].item()
    se = G0.std().item() / n**0.5
    assert abs(G0.mean().item() - V_H) < 5 * se
    assert abs(V_H - mdp.state_value(fl.P, fl.R, pi, gamma)[0].item()) < gamma**H / (1 - gamma)


@pytest.mark.equation("32.05", oracle="numpy.linalg.solve of the (S*A) system Q = r + gamma P Pi Q (1e-10); V ="
                                      " sum_a pi Q")
def test_action_value():
    P, R, pi = random_mdp(seed=3)
    S, A, _ = P.shape
    gamma = 0.8
    r = (P * R).sum(-1).reshape(S * A)
    M = np.einsum("sat,tb->satb", P, pi).reshape(S * A, S * A)
    Q_ref = np.linalg.solve(np.eye(S * A) - gamma * M, r).reshape(S, A)
    Q = mdp.action_value(T_(P), T_(R), T_(pi), gamma).numpy()
    np.testing.assert_allclose(Q, Q_ref, rtol=0, atol=1e-10)
    np.testing.assert_allclose((pi * Q).sum(-1), np_policy_value(P, R, pi, gamma), atol=1e-10)


@pytest.mark.equation("32.06", oracle="a loop over (s, a, s'); V^pi from numpy.linalg.solve is its fixed point (1e-10)")
def test_bellman_expectation():
    P, R, pi = random_mdp(seed=4)
    S, A, _ = P.shape
    V = np.random.default_rng(0).normal(size=S)
    out = mdp.bellman_expectation(T_(V), T_(P), T_(R), T_(pi), 0.7).numpy()
    loop = [sum(pi[s, a] * P[s, a, t] * (R[s, a, t] + 0.7 * V[t]) for a in range(A) for t in range(S))
            for s in range(S)]
    np.testing.assert_allclose(out, loop, atol=1e-12)
    V_pi = np_policy_value(P, R, pi, 0.7)
    TV_pi = mdp.bellman_expectation(T_(V_pi), T_(P), T_(R), T_(pi), 0.7).numpy()
    np.testing.assert_allclose(TV_pi, V_pi, atol=1e-10)
    # a gamma-contraction in the max norm, and batched V
    W = np.random.default_rng(1).normal(size=(5, S))
    TW = mdp.bellman_expectation(T_(W), T_(P), T_(R), T_(pi), 0.7).numpy()
    TV = mdp.bellman_expectation(T_(V), T_(P), T_(R), T_(pi), 0.7).numpy()
    assert np.all(np.abs(TW - TV).max(-1) <= 0.7 * np.abs(W - V).max(-1) + 1e-12)


@pytest.mark.equation("32.07", oracle="a loop with max over a; V* by brute force over all A^S deterministic policies"
                                      " (numpy.linalg.solve) is its fixed point")
def test_bellman_optimality_v():
    P, R, _ = random_mdp(S=4, A=3, seed=5)
    V = np.random.default_rng(2).normal(size=4)
    out = mdp.bellman_optimality_v(T_(V), T_(P), T_(R), 0.9).numpy()
    loop = [max(sum(P[s, a, t] * (R[s, a, t] + 0.9 * V[t]) for t in range(4)) for a in range(3)) for s in range(4)]
    np.testing.assert_allclose(out, loop, atol=1e-12)
    V_star = np_optimal_value(P, R, 0.9)
    np.testing.assert_allclose(mdp.bellman_optimality_v(T_(V_star), T_(P), T_(R), 0.9).numpy(), V_star, atol=1e-10)


@pytest.mark.equation("32.08", oracle="a loop with max over a'; Q* = r + gamma P V* from the brute-force V* is its"
                                      " fixed point")
def test_bellman_optimality_q():
    P, R, _ = random_mdp(S=3, A=3, seed=6)
    Q = np.random.default_rng(3).normal(size=(3, 3))
    out = mdp.bellman_optimality_q(T_(Q), T_(P), T_(R), 0.6).numpy()
    loop = [[sum(P[s, a, t] * (R[s, a, t] + 0.6 * Q[t].max()) for t in range(3)) for a in range(3)] for s in range(3)]
    np.testing.assert_allclose(out, loop, atol=1e-12)
    V_star = np_optimal_value(P, R, 0.6)
    Q_star = (P * R).sum(-1) + 0.6 * P @ V_star
    np.testing.assert_allclose(mdp.bellman_optimality_q(T_(Q_star), T_(P), T_(R), 0.6).numpy(), Q_star, atol=1e-10)
    np.testing.assert_allclose(Q_star.max(-1), V_star, atol=1e-10)


def test_helpers_and_errors():
    P, R, pi = random_mdp(seed=7)
    P_pi, r_pi = mdp.policy_matrices(T_(P), T_(R), T_(pi))
    np.testing.assert_allclose(P_pi.sum(-1).numpy(), np.ones(4), atol=1e-12)
    assert mdp.greedy_policy(torch.tensor([[0.0, 2.0], [3.0, 1.0]])).tolist() == [1, 0]
    with pytest.raises(ValueError, match="pi must"):
        mdp.state_value(T_(P), T_(R), T_(pi[:, :2]), 0.9)
    with pytest.raises(ValueError, match="did not converge"):  # gamma = 1 with no absorbing state
        mdp.state_value(T_(P), T_(R), T_(pi), 1.0, max_iter=50)
