"""Tests of llmbook.agents.dynamic_programming: numpy.linalg.solve, brute force over deterministic policies,
value iteration and policy iteration agreeing on gymnasium's FrozenLake and CliffWalking."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from llmbook.agents import dynamic_programming as dp
from llmbook.agents import envs

from .test_mdp import np_optimal_value, np_policy_value, random_mdp

T_ = lambda x: torch.tensor(x, dtype=torch.float64)  # noqa: E731
pytest.importorskip("gymnasium")


@pytest.mark.equation("37.01", oracle="brute force over all A^S deterministic policies with numpy.linalg.solve"
                                      " (1e-8); the gamma^k bound")
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_value_iteration_reaches_brute_force_optimum(seed):
    P, R, _ = random_mdp(S=4, A=3, seed=seed)
    gamma = 0.9
    res = dp.value_iteration(T_(P), T_(R), gamma, tol=1e-11)
    V_star = np_optimal_value(P, R, gamma)
    np.testing.assert_allclose(res.V.numpy(), V_star, atol=1e-8)
    # the greedy policy is optimal: its exact value is V*
    np.testing.assert_allclose(np_policy_value(P, R, np.eye(3)[res.policy.numpy()], gamma), V_star, atol=1e-8)
    err = np.abs(res.history.numpy() - V_star).max(-1)
    k = np.arange(len(err))
    assert np.all(err <= gamma**k * err[0] + 1e-9)


@pytest.mark.equation("37.02", oracle="numpy.linalg.solve(I - gamma P_pi, r_pi) (1e-9), on random MDPs and slippery"
                                      " FrozenLake")
def test_policy_evaluation_against_solve():
    for seed in range(3):
        P, R, pi = random_mdp(seed=seed)
        np.testing.assert_allclose(dp.policy_evaluation(T_(P), T_(R), T_(pi), 0.95).numpy(),
                                   np_policy_value(P, R, pi, 0.95), atol=1e-9)
    fl = envs.from_gymnasium("FrozenLake-v1", is_slippery=True)
    pi = np.full((16, 4), 0.25)
    np.testing.assert_allclose(dp.policy_evaluation(fl.P, fl.R, T_(pi), 0.99).numpy(),
                               np_policy_value(fl.P.numpy(), fl.R.numpy(), pi, 0.99), atol=1e-9)
    acts = torch.tensor([1, 2, 3, 0] * 4)  # a deterministic policy as actions
    np.testing.assert_allclose(dp.policy_evaluation(fl.P, fl.R, acts, 0.9).numpy(),
                               np_policy_value(fl.P.numpy(), fl.R.numpy(), np.eye(4)[acts.numpy()], 0.9), atol=1e-9)


@pytest.mark.equation("37.03", oracle="a loop argmax over one-step lookaheads; the improvement theorem checked with"
                                      " numpy.linalg.solve")
def test_policy_improvement():
    P, R, pi = random_mdp(S=4, A=3, seed=8)
    gamma = 0.9
    V = np_policy_value(P, R, pi, gamma)
    new = dp.policy_improvement(T_(P), T_(R), T_(V), gamma).numpy()
    look = [[sum(P[s, a, t] * (R[s, a, t] + gamma * V[t]) for t in range(4)) for a in range(3)] for s in range(4)]
    assert new.tolist() == [int(np.argmax(row)) for row in look]
    assert np.all(np_policy_value(P, R, np.eye(3)[new], gamma) >= V - 1e-12)


@pytest.mark.parametrize("name,kw", [("FrozenLake-v1", dict(is_slippery=True)),
                                     ("FrozenLake-v1", dict(is_slippery=False)), ("CliffWalking-v1", {})])
def test_value_iteration_and_policy_iteration_agree(name, kw):
    m = envs.from_gymnasium(name, **kw)
    gamma = 0.95
    vi, pi = dp.value_iteration(m.P, m.R, gamma, tol=1e-12), dp.policy_iteration(m.P, m.R, gamma)
    V_exact = np_policy_value(m.P.numpy(), m.R.numpy(), np.eye(4)[pi.policy.numpy()], gamma)
    np.testing.assert_allclose(pi.V.numpy(), V_exact, atol=1e-9)
    np.testing.assert_allclose(vi.V.numpy(), V_exact, atol=1e-9)
    # both greedy policies attain V* (ties may pick different actions)
    Q = vi.Q.numpy()
    for p in (vi.policy.numpy(), pi.policy.numpy()):
        np.testing.assert_allclose(Q[np.arange(m.S), p], Q.max(-1), atol=1e-8)


def test_policy_iteration_on_a_random_mdp_is_brute_force_optimal():
    P, R, _ = random_mdp(S=3, A=4, seed=11)
    res = dp.policy_iteration(T_(P), T_(R), 0.8)
    best = max(itertools.product(range(4), repeat=3),
               key=lambda acts: np_policy_value(P, R, np.eye(4)[list(acts)], 0.8).sum())
    assert res.policy.tolist() == list(best)
    assert res.policies.shape[0] == res.n_iter + 1


def test_non_convergence_is_reported():
    P, R, _ = random_mdp(seed=0)
    with pytest.raises(ValueError, match="did not converge"):
        dp.value_iteration(T_(P), T_(R), 1.0, max_iter=20)
    with pytest.raises(ValueError, match="deterministic pi"):
        dp.policy_evaluation(T_(P), T_(R), torch.tensor([0, 5, 0, 0]), 0.9)


def test_try_it_numbers_of_chapter_32():
    """The Try-it solutions of book/32-mdp.ipynb: V*(start) of both lakes at gamma 0.9, CliffWalking's sweeps."""
    from tests.try_it import assert_states
    ice = envs.from_gymnasium("FrozenLake-v1", is_slippery=False)
    lake = envs.from_gymnasium("FrozenLake-v1", is_slippery=True)
    cliff = envs.from_gymnasium("CliffWalking-v1")
    v_ice = dp.value_iteration(ice.P, ice.R, 0.9).V[0].item()
    assert abs(v_ice - 0.9**5) < 1e-12
    v_lake = dp.value_iteration(lake.P, lake.R, 0.9, tol=1e-12).V[0].item()
    n = dp.value_iteration(cliff.P, cliff.R, 0.95, tol=1e-12).n_iter
    assert_states("32-mdp.ipynb", [f"{v_ice:.4f}", f"{v_lake:.4f}", f"{n} sweeps"])
