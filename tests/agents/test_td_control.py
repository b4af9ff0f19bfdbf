"""Tests of llmbook.agents.td_control (chapter 33): Double Q-learning against hand computation and a loop,
its removal of the maximisation bias (statistical bound), and the lockstep runner against the pure updates
of llmbook.agents.td and against value iteration / the epsilon-greedy fixed point."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from llmbook.agents import envs, td
from llmbook.agents import td_control as tc
from llmbook.agents.dynamic_programming import value_iteration


@pytest.fixture(scope="module")
def cliff():
    return envs.from_gymnasium("CliffWalking-v1", gamma=1.0)


def test_double_q_update_by_hand():
    """Two updates computed by hand: Q1 chooses at s', Q2 values; then the roles swap."""
    Q1 = torch.tensor([[0.0, 0.0], [1.0, 3.0]], dtype=torch.float64)
    Q2 = torch.tensor([[0.0, 0.0], [5.0, 2.0]], dtype=torch.float64)
    # Q1's argmax at s'=1 is action 1, Q2 values it at 2: target = 1 + 0.5 * 2 = 2; Q1[0,0] = 0 + 0.5 * 2 = 1
    Q1 = tc.double_q_learning_update(Q1, Q2, 0, 0, 1.0, 1, alpha=0.5, gamma=0.5)
    assert Q1[0, 0].item() == pytest.approx(1.0, abs=1e-15)
    # Q2's argmax at s'=1 is action 0, Q1 values it at 1: target = -1 + 0.5 * 1 = -0.5; Q2[0,1] = 0.5 * -0.5
    Q2 = tc.double_q_learning_update(Q2, Q1, 0, 1, -1.0, 1, alpha=0.5, gamma=0.5)
    assert Q2[0, 1].item() == pytest.approx(-0.25, abs=1e-15)
    # a terminal next state: no bootstrap
    Q1b = tc.double_q_learning_update(Q1, Q2, 0, 1, 2.0, 1, done=True, alpha=1.0, gamma=0.5)
    assert Q1b[0, 1].item() == 2.0
    # the same table for both is Q-learning (td.q_learning_update, an independent implementation)
    Q = torch.randn(4, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    s, a, s2 = torch.tensor([0, 2]), torch.tensor([1, 0]), torch.tensor([3, 1])
    r = torch.tensor([0.5, -1.0], dtype=torch.float64)
    torch.testing.assert_close(tc.double_q_learning_update(Q, Q, s, a, r, s2, alpha=0.3, gamma=0.9),
                               td.q_learning_update(Q, s, a, r, s2, alpha=0.3, gamma=0.9), atol=1e-15, rtol=0)


def test_double_q_update_batch_matches_loop():
    g = torch.Generator().manual_seed(1)
    Q1, Q2 = (torch.randn(5, 4, generator=g, dtype=torch.float64) for _ in range(2))
    s, a = torch.randint(5, (20,), generator=g), torch.randint(4, (20,), generator=g)
    s2 = torch.randint(5, (20,), generator=g)
    r = torch.randn(20, generator=g, dtype=torch.float64)
    d = torch.rand(20, generator=g) < 0.3
    out = tc.double_q_learning_update(Q1, Q2, s, a, r, s2, d, alpha=0.2, gamma=0.9).numpy()
    ref, q1, q2 = Q1.numpy().copy(), Q1.numpy(), Q2.numpy()
    for i in range(20):  # synchronous: targets from the tables before the call, increments add up
        y = r[i].item() + (0.0 if d[i] else 0.9 * q2[s2[i], int(np.argmax(q1[s2[i]]))])
        ref[s[i], a[i]] += 0.2 * (y - q1[s[i], a[i]])
    np.testing.assert_allclose(out, ref, atol=1e-14)


def test_double_q_removes_the_maximisation_bias():
    """Every true action value is 0; each table holds, per action, an independent estimate N(0, 1/5) (the mean
    of five N(0, 1) rewards). One batched call with alpha = 1, gamma = 1, r = 0 writes the target into row i:
    the Q-learning target (Q2 = Q1) has mean E[max of 10 N(0, 1/5)] = 1.5387527 / sqrt(5) (the expected maximum
    of 10 standard normals, a published constant), the Double Q target has mean 0; both within 4 standard
    errors of N = 20000 draws."""
    N, n = 20_000, 10
    g = torch.Generator().manual_seed(0)
    Q1, Q2 = (torch.zeros(2 * N, n, dtype=torch.float64) for _ in range(2))
    Q1[N:], Q2[N:] = (torch.randn(N, n, generator=g, dtype=torch.float64) / math.sqrt(5) for _ in range(2))
    s, s2, a, r = torch.arange(N), torch.arange(N, 2 * N), torch.zeros(N, dtype=torch.long), torch.zeros(N)
    single = tc.double_q_learning_update(Q1, Q1, s, a, r, s2, alpha=1.0, gamma=1.0)[:N, 0]
    double = tc.double_q_learning_update(Q1, Q2, s, a, r, s2, alpha=1.0, gamma=1.0)[:N, 0]
    se_s, se_d = single.std().item() / math.sqrt(N), double.std().item() / math.sqrt(N)
    assert abs(single.mean().item() - 1.5387527 / math.sqrt(5)) < 4 * se_s
    assert abs(double.mean().item()) < 4 * se_d


def test_run_lanes_replays_through_the_pure_updates(cliff):
    """The runner's numpy updates, replayed transition by transition through td.*_update and
    double_q_learning_update (the logged coin says which table), give the runner's final tables."""
    mdp, std = tc.maximisation_bias_mdp()
    for mdp_, kw in ((cliff, {}), (mdp, dict(reward_std=std, n_actions=[2, 10, 10]))):
        methods = list(tc.LANE_METHODS)
        run = tc.run_lanes(mdp_, methods, 3, alpha=[0.5, 0.4, 0.3, 0.2], epsilon=0.2, seed=3, record=True, **kw)
        for k, m in enumerate(methods):
            rows = run.log[run.log[:, 0] == k]
            Q1 = torch.zeros(mdp_.S, mdp_.A, dtype=torch.float64)
            Q2 = Q1.clone()
            al = [0.5, 0.4, 0.3, 0.2][k]
            for _, s, a, r, s2, a2, d, coin in rows.tolist():
                s, a, s2, a2, d = int(s), int(a), int(s2), int(a2), bool(d)
                r = torch.tensor(r, dtype=torch.float64)
                if m == "q_learning" and mdp_ is cliff:
                    Q1 = td.q_learning_update(Q1, s, a, r, s2, d, alpha=al, gamma=1.0)
                elif m == "sarsa":
                    Q1 = td.sarsa_update(Q1, s, a, r, s2, a2, d, alpha=al, gamma=1.0)
                elif m == "expected_sarsa" and mdp_ is cliff:
                    Q1 = td.expected_sarsa_update(Q1, s, a, r, s2, td.epsilon_greedy_probs(Q1[s2], 0.2), d,
                                                  alpha=al, gamma=1.0)
                elif m == "double_q":
                    if coin:
                        Q2 = tc.double_q_learning_update(Q2, Q1, s, a, r, s2, d, alpha=al, gamma=1.0)
                    else:
                        Q1 = tc.double_q_learning_update(Q1, Q2, s, a, r, s2, d, alpha=al, gamma=1.0)
                else:  # q_learning / expected_sarsa with masked actions: no pure counterpart; skip
                    Q1 = None
                    break
            if Q1 is None:
                continue
            Qm = (Q1 + Q2) / 2 if m == "double_q" else Q1
            np.testing.assert_allclose(run.Q[k], Qm.numpy(), atol=1e-12, err_msg=m)
            assert run.lengths[k].sum() == len(rows)


def test_run_lanes_converges(cliff):
    """Off-policy learners reach value iteration's Q* of the still lake from a uniformly random behaviour
    (epsilon = 1, every pair tried often); on the cliff, Expected SARSA with alpha = 0.9 reaches the
    epsilon-greedy fixed point at the start (numpy iteration of Q = r + P[eps mean Q + (1 - eps) max Q])."""
    flat = envs.from_gymnasium("FrozenLake-v1", gamma=0.95, is_slippery=False)
    vi = value_iteration(flat.P, flat.R, flat.gamma)
    run = tc.run_lanes(flat, ["q_learning", "double_q"], 3000, alpha=0.5, epsilon=1.0, seed=0)
    live = ~flat.terminal.numpy()
    for k in range(2):
        np.testing.assert_allclose(run.Q[k][live], vi.Q.numpy()[live], atol=1e-3)
    run = tc.run_lanes(cliff, ["expected_sarsa"], 400, alpha=0.9, epsilon=0.1, seed=0)
    P, r = cliff.P.numpy(), cliff.r_sa.numpy()
    Qe = np.zeros((48, 4))
    for _ in range(2000):
        Qe = r + P @ (0.1 * Qe.mean(1) + 0.9 * Qe.max(1))
    assert abs(run.Q[0, 36].max() - Qe[36].max()) < 0.5


def test_maximisation_bias_example_shape():
    """Sutton and Barto's Example 6.7: Q-learning goes left far more often early; Double Q-learning goes left
    less, and late in the run close to the epsilon-greedy floor epsilon / 2 = 5 %."""
    mdp, std = tc.maximisation_bias_mdp()
    N = 400
    run = tc.run_lanes(mdp, ["q_learning"] * N + ["double_q"] * N, 300, alpha=0.1, epsilon=0.1, seed=1,
                       reward_std=std, n_actions=[2, 10, 10])
    left = run.first_actions == 0
    ql, dq = left[:N].mean(0), left[N:].mean(0)
    assert ql[5:40].mean() > 0.8  # se of a mean of 400 Bernoullis <= 0.025
    assert dq[5:40].mean() < ql[5:40].mean() - 0.3
    assert abs(dq[200:].mean() - 0.05) < 0.03
    assert (ql[200:].mean() - dq[200:].mean()) > 0.02


def test_bad_arguments(cliff):
    with pytest.raises(ValueError, match="methods"):
        tc.run_lanes(cliff, ["watkins"], 1)
    with pytest.raises(ValueError, match="alpha"):
        tc.run_lanes(cliff, ["sarsa", "sarsa"], 1, alpha=[0.1, 1.5])
    with pytest.raises(ValueError, match="at least one"):
        tc.run_lanes(cliff, [], 1)
    with pytest.raises(ValueError, match="reward_std"):
        tc.run_lanes(cliff, ["sarsa"], 1, reward_std=torch.zeros(3, 3))
    with pytest.raises(ValueError, match="one shape"):
        tc.double_q_learning_update(torch.zeros(2, 2), torch.zeros(3, 2), 0, 0, 0.0, 1)
    with pytest.raises(ValueError, match="s_next"):
        tc.double_q_learning_update(torch.zeros(2, 2), torch.zeros(2, 2), 0, 0, 0.0, 5)
    with pytest.raises(ValueError, match="n_b"):
        tc.maximisation_bias_mdp(n_b=1)
