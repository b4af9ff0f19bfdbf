"""Tests of llmbook.agents.multi_agent (chapter 39: Nash equilibria, the minimax value, potential shaping).

Oracles: ``scipy.optimize.linprog`` (the zero-sum game's LP: value and maximin strategy), brute-force loops
over pure strategies (saddle points, maximin), the best-response conditions written out in numpy, and value
iteration of ``llmbook.agents.dynamic_programming`` on gymnasium's FrozenLake table (chapter 37's code, a
different algorithm than the shaping identity it checks).
"""

import itertools

import numpy as np
import pytest
import scipy.optimize
import torch

from llmbook.agents import dynamic_programming as dp
from llmbook.agents import multi_agent as MA

RPS = [[0.0, -1.0, 1.0], [1.0, 0.0, -1.0], [-1.0, 1.0, 0.0]]
NONSYM = [[3.0, -1.0, 2.0], [-2.0, 4.0, 1.0]]  # value 1, x* = (0.6, 0.4), y* = (0.5, 0.5, 0)


def linprog_game(A):
    """max v s.t. (x^T A)_j >= v for all j, x in the simplex: scipy's LP (HiGHS)."""
    A = np.asarray(A, dtype=float)
    m, n = A.shape
    res = scipy.optimize.linprog(np.r_[np.zeros(m), -1.0], A_ub=np.c_[-A.T, np.ones(n)], b_ub=np.zeros(n),
                                 A_eq=np.r_[np.ones(m), 0.0][None], b_eq=[1.0],
                                 bounds=[(0, None)] * m + [(None, None)], method="highs")
    assert res.success
    return res.x[:m], res.x[m]


def best_response_gains(A, B, x, y):
    """Numpy oracle: each player's best pure deviation gain."""
    A, B, x, y = (np.asarray(t, dtype=float) for t in (A, B, x, y))
    return max(A @ y) - x @ A @ y, max(x @ B) - x @ B @ y


@pytest.mark.equation("39.01", oracle="scipy.optimize.linprog (value and maximin strategy) and numpy best responses")
@pytest.mark.parametrize("A", [RPS, NONSYM, [[2.0, -3.0, 1.0, 0.5], [-1.0, 2.0, -2.0, 1.5], [0.0, -1.0, 3.0, -2.0]]])
def test_nash_equilibrium_against_linprog(A):
    eq = MA.nash_equilibrium(torch.tensor(A))
    x_lp, v_lp = linprog_game(A)
    assert eq.value == pytest.approx(v_lp, abs=1e-9)
    np.testing.assert_allclose(eq.x.numpy(), x_lp, atol=1e-7)  # unique equilibria in these games
    x_col, v_col = linprog_game(-np.asarray(A).T)  # the column player's LP
    np.testing.assert_allclose(eq.y.numpy(), x_col, atol=1e-7)
    assert -v_col == pytest.approx(v_lp, abs=1e-9)  # von Neumann: max-min = min-max
    gx, gy = best_response_gains(A, -np.asarray(A), eq.x, eq.y)
    assert gx <= 1e-9 and gy <= 1e-9
    # a perturbed strategy is exploitable: the gap can fail
    bad = (eq.x + 0.05 * torch.eye(len(A), dtype=torch.float64)[0]) / 1.05
    assert MA.nash_gap(torch.tensor(A), -torch.tensor(A), bad, eq.y) > 1e-3 or len(A) == 1


def test_bimatrix_equilibria_best_response():
    """General-sum games: prisoner's dilemma (defect, defect) and matching-pennies-like mixing, by numpy."""
    A, B = [[3.0, 0.0], [5.0, 1.0]], [[3.0, 5.0], [0.0, 1.0]]
    eq = MA.nash_equilibrium(torch.tensor(A), torch.tensor(B))
    assert eq.x.tolist() == [0.0, 1.0] and eq.y.tolist() == [0.0, 1.0]
    gen = torch.Generator().manual_seed(0)
    for _ in range(20):
        A, B = torch.randn(2, 3, 4, generator=gen, dtype=torch.float64)
        eq = MA.nash_equilibrium(A, B)
        gx, gy = best_response_gains(A, B, eq.x, eq.y)
        assert gx <= 1e-9 and gy <= 1e-9
        assert eq.x.sum().item() == pytest.approx(1, abs=1e-12) and (eq.x >= 0).all() and (eq.y >= 0).all()
    with pytest.raises(ValueError, match="same shape"):
        MA.nash_equilibrium(torch.zeros(2, 3), torch.zeros(3, 2))
    with pytest.raises(ValueError, match="limited to 10"):
        MA.nash_equilibrium(torch.zeros(11, 2))


def test_multiplicative_weights_converges_on_rps():
    """From a lopsided start the average strategies approach the equilibrium (1/3, 1/3, 1/3) of linprog."""
    A = torch.tensor(RPS, dtype=torch.float64)
    xbar, ybar = MA.multiplicative_weights(A, 4000, eta=0.1, x0=[0.8, 0.1, 0.1], y0=[0.1, 0.1, 0.8])
    gaps = [MA.nash_gap(A, -A, xbar[t], ybar[t]) for t in (9, 99, 999, 3999)]
    assert gaps == sorted(gaps, reverse=True) and gaps[0] > 1.0 and gaps[-1] < 0.03
    np.testing.assert_allclose(xbar[-1].numpy(), linprog_game(RPS)[0], atol=0.02)


@pytest.mark.equation("39.02", oracle="brute-force loops over pure strategies; scipy linprog for the mixed value")
def test_minimax_value_pure_brute_force():
    gen = torch.Generator().manual_seed(1)
    Q = torch.randn(5, 4, 3, generator=gen, dtype=torch.float64)
    V, a = MA.minimax_value(Q)
    for s in range(5):
        ref = max(min(Q[s, i, j].item() for j in range(3)) for i in range(4))
        assert V[s].item() == ref and min(Q[s, a[s]].tolist()) == ref
    # lower value <= mixed value <= upper value, strict on rock-paper-scissors
    Vm, _ = MA.minimax_value(Q, mixed=True)
    upper = Q.max(-2).values.min(-1).values
    assert (V <= Vm + 1e-12).all() and (Vm <= upper + 1e-12).all()
    for s in range(5):  # the mixed value (support enumeration) against scipy's LP
        assert Vm[s].item() == pytest.approx(linprog_game(Q[s].numpy())[1], abs=1e-9)
    assert MA.minimax_value(torch.tensor(RPS))[0].item() == -1.0


def test_saddle_point_games_agree_with_linprog():
    """Games with a pure saddle point: pure maximin == min-max over pure strategies == LP value."""
    gen = torch.Generator().manual_seed(2)
    found = 0
    for _ in range(200):
        A = torch.randint(-5, 6, (3, 4), generator=gen).double()
        lower = max(min(A[i, j].item() for j in range(4)) for i in range(3))
        upper = min(max(A[i, j].item() for i in range(3)) for j in range(4))
        if lower != upper:
            continue
        found += 1
        assert MA.minimax_value(A)[0].item() == lower
        assert MA.nash_equilibrium(A).value == pytest.approx(lower, abs=1e-9)
        assert linprog_game(A.numpy())[1] == pytest.approx(lower, abs=1e-9)
    assert found >= 10


def _lake():
    pytest.importorskip("gymnasium")
    from llmbook.agents.envs import from_gymnasium

    return from_gymnasium("FrozenLake-v1", is_slippery=True, gamma=0.95)


def _distance_potential(lake):
    rows, cols = lake.shape
    s = torch.arange(lake.S)
    return -((rows - 1 - s // cols) + (cols - 1 - s % cols)).double() / (rows + cols)


@pytest.mark.equation("39.06", oracle="value iteration (llmbook.agents.dynamic_programming) on gymnasium FrozenLake")
def test_potential_shaping_keeps_optimal_policy():
    lake = _lake()
    vi = dp.value_iteration(lake.P, lake.R, lake.gamma, tol=1e-13)
    gen = torch.Generator().manual_seed(0)
    for Phi in (_distance_potential(lake), torch.randn(lake.S, generator=gen, dtype=torch.float64)):
        Rs = MA.potential_shaping(lake.R, Phi, lake.gamma)
        # the shaping term itself, written out by loops
        s, a, s2 = 5, 2, 9
        assert (Rs - lake.R)[s, a, s2].item() == pytest.approx(lake.gamma * Phi[s2].item() - Phi[s].item(), abs=1e-15)
        vs = dp.value_iteration(lake.P, Rs, lake.gamma, tol=1e-13)
        torch.testing.assert_close(vs.Q, vi.Q - Phi[:, None], atol=1e-9, rtol=0)
        assert torch.equal(vs.policy, vi.policy)


def test_non_potential_shaping_changes_policy():
    """A bonus for moving closer to the goal, with no penalty for moving away, is not potential-based."""
    lake = _lake()
    vi = dp.value_iteration(lake.P, lake.R, lake.gamma, tol=1e-13)
    Phi = _distance_potential(lake)
    closer = (Phi[None, None, :] > Phi[:, None, None]).double()
    vb = dp.value_iteration(lake.P, lake.R + 0.1 * closer, lake.gamma, tol=1e-13)
    assert not torch.equal(vb.policy, vi.policy)
    # ... and the changed policy is worse on the true reward (exact values by numpy.linalg.solve)
    pi = torch.nn.functional.one_hot(vb.policy, lake.A).double()
    P_pi = torch.einsum("sa,sat->st", pi, lake.P).numpy()
    r_pi = (pi * lake.r_sa).sum(-1).numpy()
    V = np.linalg.solve(np.eye(lake.S) - lake.gamma * P_pi, r_pi)
    assert V[0] < vi.V[0].item() - 1e-3


def test_shaping_checks():
    with pytest.raises(ValueError, match="one S"):
        MA.potential_shaping(torch.zeros(3, 2, 3), torch.zeros(4), 0.9)
    with pytest.raises(ValueError):
        MA.potential_shaping(torch.zeros(3, 2, 3), torch.zeros(3), 1.5)
    assert list(itertools.chain(*MA.potential_shaping(torch.zeros(1, 1, 1), torch.ones(1), 1.0)[0].tolist())) == [0.0]


def test_try_it_numbers_of_chapter_39():
    """The Try-it solutions of book/39-multi-agent.ipynb, computed."""
    from tests.try_it import assert_states

    A = torch.tensor([[2.0, -1.0], [-1.0, 1.0]], dtype=torch.float64)
    eq = MA.nash_equilibrium(A)
    x_lp, v_lp = linprog_game(A.numpy())
    assert eq.value == pytest.approx(v_lp, abs=1e-12) and MA.minimax_value(A)[0].item() == -1.0
    F = MA.potential_shaping(torch.zeros(2, 1, 2, dtype=torch.float64), torch.tensor([1.0, 2.0]).double(), 0.9)
    stated = [f"x^*=({x_lp[0]:.1f}, {x_lp[1]:.1f})", f"y^*=({eq.y[0]:.1f}, {eq.y[1]:.1f})",
              f"the value is {eq.value:.1f}",
              f"F = 0.9\\cdot 2 - 1 = {F[0, 0, 1].item():.1f}", f"Q'^*(s,a) = 0.5 - 1 = {0.5 - 1.0:.1f}"]
    assert_states("39-multi-agent.ipynb", stated)


def test_hedge_current_strategies_match_numpy_and_spiral_outwards():
    """The current strategies against the recursion x_{t+1} ∝ x_t exp(eta A y_t) written in numpy; on
    rock-paper-scissors KL(x*||x_t) + KL(y*||y_t) grows at every round (Bailey and Piliouras, 2018)."""
    from scipy.stats import entropy

    A = torch.tensor([[0.0, -1.0, 1.0], [1.0, 0.0, -1.0], [-1.0, 1.0, 0.0]], dtype=torch.float64)
    x0, y0 = np.array([0.8, 0.1, 0.1]), np.array([0.1, 0.1, 0.8])
    T, eta = 500, 0.1
    xbar, ybar, x, y = MA.multiplicative_weights(A, T, eta, x0=torch.tensor(x0), y0=torch.tensor(y0), current=True)
    xs, ys, An = x0.copy(), y0.copy(), A.numpy()
    for t in range(T):
        np.testing.assert_allclose(x[t].numpy(), xs, atol=1e-12)
        np.testing.assert_allclose(y[t].numpy(), ys, atol=1e-12)
        xs, ys = xs * np.exp(eta * An @ ys), ys * np.exp(-eta * An.T @ xs)
        xs, ys = xs / xs.sum(), ys / ys.sum()
    np.testing.assert_allclose(xbar.numpy(), np.cumsum(x.numpy(), 0) / np.arange(1, T + 1)[:, None], atol=1e-12)
    u = np.full(3, 1 / 3)
    kl = np.array([entropy(u, x[t]) + entropy(u, y[t]) for t in range(T)])
    assert (np.diff(kl) > 0).all()
