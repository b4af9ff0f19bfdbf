"""Tests of llmbook.agents.td (chapter 33) against numpy.linalg.solve, value iteration and brute-force loops."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from llmbook.agents import envs, td
from llmbook.agents.dynamic_programming import value_iteration

EPS = 0.1


@pytest.fixture(scope="module")
def cliff():
    return envs.from_gymnasium("CliffWalking-v1", gamma=1.0)


@pytest.fixture(scope="module")
def lake():
    return envs.from_gymnasium("FrozenLake-v1", gamma=0.95, is_slippery=True)


def lake_policy():
    """The chapter's fixed policy on the 4x4 lake: the optimal action w.p. 0.7, each action 0.1 besides."""
    best = torch.tensor([0, 3, 0, 3, 0, 0, 0, 0, 3, 1, 0, 0, 0, 2, 1, 0])
    pi = torch.full((16, 4), 0.1, dtype=torch.float64)
    pi[torch.arange(16), best] += 0.6
    return pi


def v_pi_solve(mdp, pi):
    """V^pi = numpy.linalg.solve(I - gamma P_pi, r_pi)."""
    P, r = mdp.P.numpy(), mdp.r_sa.numpy()
    P_pi = np.einsum("sa,sat->st", pi.numpy(), P)
    return np.linalg.solve(np.eye(mdp.S) - mdp.gamma * P_pi, (pi.numpy() * r).sum(1))


def q_eps_star(mdp, eps):
    """The fixed point of the epsilon-greedy Bellman operator Q = r + gamma P [eps mean Q + (1 - eps) max Q],
    by numpy iteration; then checked: Q equals Q^pi of its own epsilon-greedy policy by numpy.linalg.solve."""
    P, r, g = mdp.P.numpy(), mdp.r_sa.numpy(), mdp.gamma
    Q = np.zeros(r.shape)
    for _ in range(10_000):
        Qn = r + g * P @ (eps * Q.mean(1) + (1 - eps) * Q.max(1))
        if np.abs(Qn - Q).max() < 1e-12:
            break
        Q = Qn
    best = Q == Q.max(1, keepdims=True)
    pi = eps / Q.shape[1] + (1 - eps) * best / best.sum(1, keepdims=True)
    P_pi = np.einsum("sa,sat->st", pi, P)
    V = np.linalg.solve(np.eye(mdp.S) - g * P_pi + np.diag(mdp.terminal.numpy()), (pi * r).sum(1))
    assert np.abs(r + g * P @ V - Qn).max() < 1e-8
    return torch.tensor(Qn)


def greedy_path(mdp, Q, s=36, limit=60):
    path = [s]
    for _ in range(limit):
        s = int(mdp.P[s, int(Q[s].argmax())].argmax())
        path.append(s)
        if mdp.terminal[s]:
            break
    return path


# --------------------------------------------------------------------------- 33.01 TD error


@pytest.mark.equation("33.01", oracle="float64 closed form in numpy, elementwise loop")
def test_td_error_matches_loop():
    g = torch.Generator().manual_seed(0)
    r, V, Vn = (torch.randn(4, 5, generator=g, dtype=torch.float64) for _ in range(3))
    d = torch.rand(4, 5, generator=g) < 0.3
    delta = td.td_error(r, V, Vn, 0.9, d).numpy()
    ref = np.array([[r[i, j].item() + (0.0 if d[i, j] else 0.9 * Vn[i, j].item()) - V[i, j].item()
                     for j in range(5)] for i in range(4)])
    np.testing.assert_allclose(delta, ref, atol=1e-15)


@pytest.mark.equation("33.01", oracle="numpy.linalg.solve: the expected TD error of V^pi is 0 in every state")
def test_expected_td_error_of_true_values_is_zero(lake):
    pi = lake_policy()
    V = torch.tensor(v_pi_solve(lake, pi))
    S = lake.S
    delta = td.td_error(lake.R, V[:, None, None].expand(S, 4, S), V[None, None, :].expand(S, 4, S), lake.gamma,
                        lake.terminal[None, None, :].expand(S, 4, S))
    expected = (pi[:, :, None] * lake.P * delta).sum((1, 2))
    assert expected[~lake.terminal].abs().max() < 1e-12
    # a wrong V has a non-zero expected TD error somewhere (the test can fail)
    d2 = td.td_error(lake.R, (V + 0.1)[:, None, None].expand(S, 4, S), (V + 0.1)[None, None, :].expand(S, 4, S),
                     lake.gamma, lake.terminal[None, None, :].expand(S, 4, S))
    assert (pi[:, :, None] * lake.P * d2).sum((1, 2))[~lake.terminal].abs().max() > 1e-3


def test_td_error_terminal_ignores_nonfinite_bootstrap():
    assert td.td_error(1.0, 0.5, torch.tensor(float("inf")), 0.9, True).item() == 0.5


# --------------------------------------------------------------------------- 33.02 TD(0)


@pytest.mark.equation("33.02", oracle="numpy loop: synchronous increments summed per state")
def test_td0_update_batch_matches_loop():
    g = torch.Generator().manual_seed(1)
    V = torch.randn(5, generator=g, dtype=torch.float64)
    s, s2 = torch.randint(5, (20,), generator=g), torch.randint(5, (20,), generator=g)
    r = torch.randn(20, generator=g, dtype=torch.float64)
    d = torch.rand(20, generator=g) < 0.3
    new = td.td0_update(V, s, r, s2, d, alpha=0.3, gamma=0.9)
    ref = V.numpy().copy()
    for i in range(20):
        delta = r[i].item() + (0.0 if d[i] else 0.9 * V[s2[i]].item()) - V[s[i]].item()
        ref[s[i]] += 0.3 * delta
    np.testing.assert_allclose(new.numpy(), ref, atol=1e-14)
    assert torch.equal(V, V.clone())  # the argument is left alone


@pytest.mark.equation("33.02", oracle="numpy.linalg.solve(I - gamma P_pi, r_pi) on slippery FrozenLake")
def test_td0_converges_to_v_pi(lake):
    pi = lake_policy()
    run = td.run_episodes(lake, "td0", 2000, pi=pi, alpha=0.05, seed=0)
    err = np.abs(run.values.numpy() - v_pi_solve(lake, pi)).max()
    assert err < 0.08, err  # values lie in [0, 0.6]; constant alpha leaves a noise floor


def test_run_episodes_replays_through_pure_updates(lake, cliff):
    """The training loop's Python-float updates equal the tensor functions applied transition by transition."""
    pi = lake_policy()
    run = td.run_episodes(lake, "td0", 30, pi=pi, alpha=0.2, seed=3, record=True)
    V = torch.zeros(16, dtype=torch.float64)
    for (s, _a, s2, _a2, d, _t), r in zip(run.transitions.tolist(), run.rewards.tolist(), strict=True):
        V = td.td0_update(V, s, torch.tensor(r, dtype=torch.float64), s2, bool(d), alpha=0.2, gamma=0.95)
    torch.testing.assert_close(V, run.values, atol=1e-12, rtol=0)
    for method in ("q_learning", "sarsa", "expected_sarsa"):
        run = td.run_episodes(cliff, method, 5, alpha=0.5, epsilon=EPS, seed=1, record=True)
        Q = torch.zeros(48, 4, dtype=torch.float64)
        for (s, a, s2, a2, d, _t), r in zip(run.transitions.tolist(), run.rewards.tolist(), strict=True):
            r = torch.tensor(r, dtype=torch.float64)
            if method == "q_learning":
                Q = td.q_learning_update(Q, s, a, r, s2, bool(d), alpha=0.5, gamma=1.0)
            elif method == "sarsa":
                Q = td.sarsa_update(Q, s, a, r, s2, a2, bool(d), alpha=0.5, gamma=1.0)
            else:
                Q = td.expected_sarsa_update(Q, s, a, r, s2, td.epsilon_greedy_probs(Q[s2], EPS), bool(d),
                                             alpha=0.5, gamma=1.0)
        torch.testing.assert_close(Q, run.values, atol=1e-9, rtol=0)


# --------------------------------------------------------------------------- 33.03 Q-learning


@pytest.mark.equation("33.03", oracle="value iteration (Q*) on CliffWalking")
def test_q_learning_converges_on_cliff(cliff):
    vi = value_iteration(cliff.P, cliff.R, 1.0)
    run = td.run_episodes(cliff, "q_learning", 500, alpha=0.5, epsilon=EPS, seed=0)
    seen = run.visits >= 50
    assert seen.sum() >= 20
    assert (run.values - vi.Q)[seen].abs().max() < 0.05
    path = greedy_path(cliff, run.values)
    assert len(path) - 1 == 13 == -vi.V[36].item()  # the shortest path along the cliff edge


@pytest.mark.equation("33.03", oracle="value iteration: one synchronous alpha = 1 sweep is the optimality operator")
def test_q_learning_sweep_is_value_iteration():
    fd = envs.from_gymnasium("FrozenLake-v1", gamma=0.9, is_slippery=False)
    vi = value_iteration(fd.P, fd.R, 0.9)
    s, a = torch.meshgrid(torch.arange(16), torch.arange(4), indexing="ij")
    s2 = fd.P.argmax(-1)  # deterministic
    r = fd.R[s, a, s2]
    live = ~fd.terminal[s]
    Q = torch.zeros(16, 4, dtype=torch.float64)
    for _ in range(30):
        Q = td.q_learning_update(Q, s[live], a[live], r[live], s2[live], fd.terminal[s2[live]], alpha=1.0, gamma=0.9)
    torch.testing.assert_close(Q, vi.Q, atol=1e-9, rtol=0)


@pytest.mark.equation("33.03", oracle="value iteration: off-policy learning from a uniformly random behaviour")
def test_q_learning_off_policy_on_lake():
    fd = envs.from_gymnasium("FrozenLake-v1", gamma=0.95, is_slippery=False)
    vi = value_iteration(fd.P, fd.R, 0.95)
    run = td.run_episodes(fd, "q_learning", 2000, alpha=0.5, epsilon=1.0, seed=0)
    seen = run.visits >= 20
    assert (run.values - vi.Q)[seen].abs().max() < 1e-3
    reach = run.visits.sum(1) > 0
    assert (vi.Q.gather(1, run.values.argmax(1, keepdim=True)).squeeze(1) >= vi.V - 1e-9)[reach].all()


# --------------------------------------------------------------------------- 33.04 SARSA and 33.05 Expected SARSA


@pytest.mark.equation("33.04", oracle="numpy: fixed point of the eps-greedy Bellman operator, checked by linalg.solve")
def test_sarsa_converges_to_epsilon_soft_optimum(cliff):
    Qe = q_eps_star(cliff, EPS)
    # alpha_n = 1 / n^0.6: sum alpha_n = inf and sum alpha_n^2 < inf (Robbins-Monro; 1/sqrt(n) would break the second)
    run = td.run_episodes(cliff, "sarsa", 3000, alpha=1.0, alpha_power=0.6, epsilon=EPS, seed=0)
    seen = run.visits >= 1000
    assert (run.values - Qe)[seen].abs().max() < 0.5  # sampled a' noise, decaying step size
    often = run.visits.sum(1) >= 1000
    assert (Qe.gather(1, run.values.argmax(1, keepdim=True)).squeeze(1) >= Qe.max(1).values - 1e-6)[often].all()


@pytest.mark.equation("33.04", oracle="brute-force Python loop over the batch")
def test_sarsa_update_matches_loop():
    g = torch.Generator().manual_seed(2)
    Q = torch.randn(4, 3, generator=g, dtype=torch.float64)
    s, a, s2, a2 = (torch.randint(n, (10,), generator=g) for n in (4, 3, 4, 3))
    r = torch.randn(10, generator=g, dtype=torch.float64)
    new = td.sarsa_update(Q, s, a, r, s2, a2, alpha=0.4, gamma=0.8)
    ref = Q.numpy().copy()
    for i in range(10):
        ref[s[i], a[i]] += 0.4 * (r[i].item() + 0.8 * Q[s2[i], a2[i]].item() - Q[s[i], a[i]].item())
    np.testing.assert_allclose(new.numpy(), ref, atol=1e-14)


@pytest.mark.equation("33.05", oracle="numpy: fixed point of the eps-greedy Bellman operator, checked by linalg.solve")
def test_expected_sarsa_converges_to_epsilon_soft_optimum(cliff):
    Qe = q_eps_star(cliff, EPS)
    run = td.run_episodes(cliff, "expected_sarsa", 3000, alpha=0.9, epsilon=EPS, seed=0)
    seen = run.visits >= 100
    assert (run.values - Qe)[seen].abs().max() < 0.1
    often = run.visits.sum(1) >= 1000
    assert (Qe.gather(1, run.values.argmax(1, keepdim=True)).squeeze(1) >= Qe.max(1).values - 1e-6)[often].all()


@pytest.mark.equation("33.05", oracle="brute-force loop; a greedy pi_next reduces to the max of Q-learning")
def test_expected_sarsa_update_matches_loop():
    g = torch.Generator().manual_seed(4)
    Q = torch.randn(4, 3, generator=g, dtype=torch.float64)
    s, a, s2 = (torch.randint(n, (10,), generator=g) for n in (4, 3, 4))
    r = torch.randn(10, generator=g, dtype=torch.float64)
    p = torch.softmax(torch.randn(10, 3, generator=g, dtype=torch.float64), -1)
    new = td.expected_sarsa_update(Q, s, a, r, s2, p, alpha=0.4, gamma=0.8)
    ref = Q.numpy().copy()
    for i in range(10):
        exp = sum(p[i, b].item() * Q[s2[i], b].item() for b in range(3))
        ref[s[i], a[i]] += 0.4 * (r[i].item() + 0.8 * exp - Q[s[i], a[i]].item())
    np.testing.assert_allclose(new.numpy(), ref, atol=1e-14)
    onehot = torch.nn.functional.one_hot(Q[s2].argmax(-1), 3).double()
    ql = Q.numpy().copy()
    for i in range(10):
        ql[s[i], a[i]] += 0.4 * (r[i].item() + 0.8 * Q[s2[i]].max().item() - Q[s[i], a[i]].item())
    np.testing.assert_allclose(td.expected_sarsa_update(Q, s, a, r, s2, onehot, alpha=0.4, gamma=0.8).numpy(), ql,
                               atol=1e-14)


def test_sarsa_takes_the_safe_path(cliff):
    """Sutton and Barto's Example 6.6: SARSA's online return beats Q-learning's; Q-learning hugs the cliff."""
    means = {}
    for method in ("q_learning", "sarsa"):
        runs = [td.run_episodes(cliff, method, 500, alpha=0.5, epsilon=EPS, seed=k) for k in range(3)]
        means[method] = np.mean([run.returns[100:].mean() for run in runs])
    assert means["sarsa"] > means["q_learning"] + 10
    run = td.run_episodes(cliff, "sarsa", 500, alpha=0.5, epsilon=EPS, seed=0)
    assert not set(greedy_path(cliff, run.values)[1:-2]) & set(range(25, 35))  # never walks the cliff edge


def test_epsilon_greedy_probs_and_errors(cliff):
    p = td.epsilon_greedy_probs(torch.tensor([[0.0, 1.0, 1.0]]), 0.3)
    torch.testing.assert_close(p, torch.tensor([[0.1, 0.45, 0.45]], dtype=torch.float64))
    with pytest.raises(ValueError, match="pi"):
        td.run_episodes(cliff, "td0", 1)
    with pytest.raises(ValueError, match="method"):
        td.run_episodes(cliff, "sarsa_lambda", 1)
    with pytest.raises(ValueError, match="s must hold indices"):
        td.q_learning_update(torch.zeros(2, 2), 2, 0, 0.0, 0)
    run = td.run_episodes(cliff, "q_learning", 4, seed=0, every=2)
    assert run.history.shape == (3, 48, 4) and torch.equal(run.history[-1], run.values)


def test_try_it_numbers(cliff):
    """The numbers stated in the Try-it solutions of book/33-td-learning.ipynb."""
    from tests.try_it import assert_states

    # 1. one Q-learning and one SARSA update by hand
    Q = torch.tensor([[0.0, 0.0], [2.0, 4.0]], dtype=torch.float64)
    ql = td.q_learning_update(Q, 0, 0, -1.0, 1, alpha=0.5, gamma=0.9)[0, 0].item()
    sa = td.sarsa_update(Q, 0, 0, -1.0, 1, 0, alpha=0.5, gamma=0.9)[0, 0].item()
    pi1 = td.epsilon_greedy_probs(Q[1], 0.1)
    es = td.expected_sarsa_update(Q, 0, 0, -1.0, 1, pi1, alpha=0.5, gamma=0.9)[0, 0].item()
    # 2. epsilon = 0: SARSA is greedy; its online return on the cliff
    run0 = td.run_episodes(cliff, "sarsa", 500, alpha=0.5, epsilon=0.0, seed=0)
    path0 = greedy_path(cliff, run0.values)
    assert_states("33-td-learning.ipynb", [
        f"Q-learning gives ${ql:.2f}$", f"SARSA gives ${sa:.2f}$", f"Expected SARSA gives ${es:.3f}$",
        f"{run0.returns[-100:].mean().item():.1f}", f"{len(path0) - 1} steps",
    ])
