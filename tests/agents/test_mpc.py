"""Tests of llmbook.agents.mpc: exhaustive planning against itertools.product loops and backward induction,
the receding-horizon policy against the brute-force optimum, and LQ-MPC against scipy's Riccati solution."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import scipy.linalg
import torch

from llmbook.agents import envs, mpc

from .test_mdp import np_optimal_value, np_policy_value, random_mdp

T_ = lambda x: torch.tensor(x, dtype=torch.float64)  # noqa: E731


def np_open_loop(P, R, d0, seq, gamma, Vt):
    """Expected discounted return of one action sequence, by loops over states (the oracle)."""
    S = P.shape[0]
    d, total = np.array(d0, dtype=float), 0.0
    for k, a in enumerate(seq):
        nd = np.zeros(S)
        for s in range(S):
            for t in range(S):
                total += gamma**k * d[s] * P[s, a, t] * R[s, a, t]
                nd[t] += d[s] * P[s, a, t]
        d = nd
    return total + gamma ** len(seq) * d @ Vt


@pytest.mark.equation("37.06", oracle="all sequences from itertools.product, expectation by loops over states (1e-12)")
@pytest.mark.parametrize("seed", [0, 1])
def test_mpc_plan_against_enumeration(seed):
    P, R, _ = random_mdp(S=4, A=3, seed=seed)
    rng = np.random.default_rng(seed)
    d0 = rng.dirichlet(np.ones(4), size=2)
    Vt = rng.normal(size=4)
    plan = mpc.mpc_plan(T_(P), T_(R), T_(d0), 3, 0.8, T_(Vt))
    seqs = list(itertools.product(range(3), repeat=3))
    for b in range(2):
        ref = np.array([np_open_loop(P, R, d0[b], s, 0.8, Vt) for s in seqs])
        np.testing.assert_allclose(plan.returns[b].numpy(), ref, atol=1e-12)
        assert plan.actions[b].tolist() == list(seqs[int(ref.argmax())])
        assert abs(plan.value[b].item() - ref.max()) < 1e-12


def backward_induction(P, R, gamma, H):
    """Finite-horizon optimal values by H backward steps of the Bellman optimality operator, in numpy."""
    r = (P * R).sum(-1)
    V = np.zeros(P.shape[0])
    for _ in range(H):
        V = (r + gamma * P @ V).max(-1)
    return V


@pytest.mark.equation("37.06", oracle="H-step backward induction in numpy, deterministic FrozenLake, CliffWalking")
def test_open_loop_equals_closed_loop_on_deterministic_models():
    pytest.importorskip("gymnasium")
    for name, kw, H in (("FrozenLake-v1", dict(is_slippery=False), 7), ("CliffWalking-v1", {}, 5)):
        m = envs.from_gymnasium(name, gamma=0.95, **kw)
        P, R = m.P.numpy(), m.R.numpy()
        plan = mpc.mpc_plan(m.P, m.R, torch.eye(m.S, dtype=torch.float64), H, 0.95)
        np.testing.assert_allclose(plan.value.numpy(), backward_induction(P, R, 0.95, H), atol=1e-12)


@pytest.mark.equation("37.06", oracle="brute force over all deterministic policies with numpy.linalg.solve (1e-9)")
def test_receding_horizon_with_optimal_terminal_value_is_optimal():
    P, R, _ = random_mdp(S=4, A=3, seed=3)
    V_star = np_optimal_value(P, R, 0.9)
    for H in (1, 2):
        pi = mpc.mpc_policy(T_(P), T_(R), H, 0.9, T_(V_star))
        np.testing.assert_allclose(np_policy_value(P, R, np.eye(3)[pi.numpy()], 0.9), V_star, atol=1e-9)


def test_mpc_plan_errors_and_ties():
    P, R = torch.ones(1, 2, 1, dtype=torch.float64), torch.zeros(1, 2, dtype=torch.float64)
    assert mpc.mpc_plan(P, R, torch.ones(1), 3, 0.9).actions.tolist() == [0, 0, 0]  # ties: the first sequence
    with pytest.raises(ValueError, match="exceed"):
        mpc.mpc_plan(P, R, torch.ones(1), 23, 0.9)
    with pytest.raises(ValueError):
        mpc.mpc_plan(P, R, torch.tensor([0.5]), 2, 0.9)
    with pytest.raises(ValueError):
        mpc.mpc_plan(P, R, torch.ones(2) / 2, 2, 0.9)


def double_integrator(dt=0.1):
    A = np.array([[1.0, dt], [0.0, 1.0]])
    B = np.array([[0.5 * dt**2], [dt]])
    return A, B, np.diag([1.0, 0.1]), np.array([[0.01]])


@pytest.mark.equation("37.06", oracle="scipy.linalg.solve_discrete_are; the backward Riccati recursion in numpy (1e-8)")
def test_lq_mpc_against_riccati():
    A, B, Q, R = double_integrator()
    P_inf = scipy.linalg.solve_discrete_are(A, B, Q, R)
    K_lqr = np.linalg.solve(R + B.T @ P_inf @ B, B.T @ P_inf @ A)
    for H in (1, 5, 30):  # with the Riccati terminal cost the receding-horizon gain is LQR's, for every H
        K = mpc.lq_mpc_gain(T_(A), T_(B), T_(Q), T_(R), H, T_(P_inf)).numpy()
        np.testing.assert_allclose(K, K_lqr, rtol=1e-8, atol=1e-8)
    Pk = np.zeros((2, 2))  # without it: the backward recursion started from P_H = 0
    for H in range(1, 41):
        K_ref = np.linalg.solve(R + B.T @ Pk @ B, B.T @ Pk @ A)
        Pk = Q + A.T @ Pk @ A - A.T @ Pk @ B @ K_ref
        if H in (1, 10, 40):
            np.testing.assert_allclose(mpc.lq_mpc_gain(T_(A), T_(B), T_(Q), T_(R), H).numpy(), K_ref,
                                       rtol=1e-8, atol=1e-10)
    gaps = [np.abs(mpc.lq_mpc_gain(T_(A), T_(B), T_(Q), T_(R), H).numpy() - K_lqr).max() for H in (5, 20, 80)]
    assert gaps[0] > gaps[1] > gaps[2] and gaps[2] < 1e-3
    with pytest.raises(ValueError):
        mpc.lq_mpc_gain(T_(A), T_(B), T_(Q), T_(np.eye(2)), 3)


def test_try_it_numbers():
    pytest.importorskip("gymnasium")
    from llmbook.agents import dynamic_programming as dp
    from tests.try_it import assert_states

    det = envs.from_gymnasium("FrozenLake-v1", is_slippery=False, gamma=0.99)
    reach = [dp.policy_evaluation(det.P, det.R, mpc.mpc_policy(det.P, det.R, H, 0.99), 0.99)[0].item() > 0
             for H in range(1, 8)]
    assert reach.index(True) + 1 == 6 and all(reach[5:])
    assert mpc.mpc_policy(det.P, det.R, 5, 0.99)[0].item() == 0  # LEFT, the first of the tied plans
    lake = envs.from_gymnasium("FrozenLake-v1", is_slippery=True, gamma=0.99)
    v7 = dp.policy_evaluation(lake.P, lake.R, mpc.mpc_policy(lake.P, lake.R, 7, 0.99), 0.99)[0].item()
    v_star = dp.value_iteration(lake.P, lake.R, 0.99, tol=1e-10).V[0].item()
    assert_states("37-planning.ipynb", ["$H = 6$", f"{v7:.4f}", f"{v_star:.4f}"])
