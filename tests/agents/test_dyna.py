"""Tests of llmbook.agents.dyna.

Oracles: ``td.run_episodes`` (chapter 33's Q-learning loop, written separately) on the same random stream and
``td.q_learning_update`` replayed over the recorded transitions (n = 0 is Q-learning, exactly); value
iteration (``dynamic_programming``) for Q* on the deterministic maze; a breadth-first search over the layout
for the shortest path; ``dynamic_programming.policy_evaluation`` for the greedy policy's value.
"""

from __future__ import annotations

from collections import deque

import numpy as np
import pytest
import torch

from llmbook.agents import dyna, envs, td
from llmbook.agents import dynamic_programming as dp


def _no_self_loop_mdp(seed=0, S=7, A=3, gamma=0.9):
    """A random stochastic MDP whose non-terminal states never step to themselves; state S-1 is terminal."""
    rng = np.random.default_rng(seed)
    P = rng.random((S, A, S)) * (rng.random((S, A, S)) < 0.6)
    for s in range(S - 1):
        P[s, :, s] = 0.0
        P[s, :, S - 1] += 0.05  # every action can end the episode
    P[S - 1] = 0.0
    P[S - 1, :, S - 1] = 1.0
    P /= P.sum(-1, keepdims=True)
    R = rng.normal(size=(S, A, S)) * (P > 0)
    R[S - 1] = 0.0
    terminal = torch.zeros(S, dtype=torch.bool)
    terminal[S - 1] = True
    mu0 = torch.full((S,), 1.0 / (S - 1), dtype=torch.float64)
    mu0[S - 1] = 0.0
    return envs.TabularMDP(P=torch.tensor(P), R=torch.tensor(R), gamma=gamma, terminal=terminal, mu0=mu0)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_n0_equals_q_learning_of_run_episodes_on_the_same_stream(seed):
    """With no planning, Dyna-Q draws the same random numbers in the same order as chapter 33's loop, so on an
    MDP without self-loops (where acting before or after the update sees the same row) the tables agree."""
    mdp = _no_self_loop_mdp(seed)
    ref = td.run_episodes(mdp, "q_learning", 60, alpha=0.3, epsilon=0.2, seed=seed)
    ours = dyna.dyna_q(mdp, 0, int(ref.lengths.sum()), alpha=0.3, epsilon=0.2, seed=seed)
    torch.testing.assert_close(ours.lengths, ref.lengths)
    torch.testing.assert_close(ours.Q, ref.values, rtol=0, atol=1e-13)


@pytest.mark.parametrize("name", ["maze", "slippery"])
def test_n0_replays_as_q_learning_updates(name):
    """n = 0: the table is exactly td.q_learning_update applied to the real transitions, one at a time."""
    mdp = dyna.dyna_maze() if name == "maze" else envs.from_gymnasium("FrozenLake-v1", is_slippery=True, gamma=0.95)
    run = dyna.dyna_q(mdp, 0, 2000, alpha=0.5, epsilon=0.3, seed=3, record=True)
    Q = torch.zeros(mdp.S, mdp.A, dtype=torch.float64)
    for (s, a, s2, done), r in zip(run.transitions.tolist(), run.rewards.tolist(), strict=True):
        Q = td.q_learning_update(Q, s, a, r, s2, bool(done), alpha=0.5, gamma=mdp.gamma)
    assert run.rewards.sum() > 0  # the goal was reached: the updates are not all zero
    torch.testing.assert_close(run.Q, Q, rtol=0, atol=1e-12)


def test_planning_reaches_q_star_of_value_iteration():
    """Deterministic maze, behaviour uniformly random (epsilon = 1) so every reachable pair is tried: with 50
    planning steps per real step the table is Q* (value iteration) within 1e-6 on every reachable pair, while
    Q-learning alone, after the same 3000 real steps, is still far from it."""
    maze = dyna.dyna_maze()
    Q_star = dp.value_iteration(maze.P, maze.R, maze.gamma, tol=1e-13).Q
    plan = dyna.dyna_q(maze, 50, 3000, alpha=0.5, epsilon=1.0, seed=0, record=True)
    alone = dyna.dyna_q(maze, 0, 3000, alpha=0.5, epsilon=1.0, seed=0)
    tried = torch.zeros(maze.S, maze.A, dtype=torch.bool)
    tried[plan.transitions[:, 0], plan.transitions[:, 1]] = True
    reachable = [s for s in range(maze.S) if maze.desc[s // 9][s % 9] != "#" and not maze.terminal[s]]
    assert tried[reachable].all(), "every reachable pair must have been tried"
    err = (plan.Q - Q_star)[reachable].abs().max().item()
    assert err < 1e-6, err
    assert (alone.Q - Q_star)[reachable].abs().max().item() > 0.1
    # the greedy policy of the planned table is optimal from the start
    assert dyna.greedy_value(maze, plan.Q)[18].item() == pytest.approx(maze.gamma**13, abs=1e-9)


def test_maze_is_sutton_and_bartos():
    """Breadth-first search over the layout (its own neighbours): the shortest path from S to G is 14 moves,
    and value iteration on the built MDP gives V*(start) = gamma^13 (the reward comes with the 14th move)."""
    rows = dyna.MAZE_LAYOUT
    start = next((i, j) for i, r in enumerate(rows) for j, c in enumerate(r) if c == "S")
    dist, queue = {start: 0}, deque([start])
    while queue:
        i, j = queue.popleft()
        for di, dj in ((1, 0), (-1, 0), (0, 1), (0, -1)):
            n = (i + di, j + dj)
            if 0 <= n[0] < 6 and 0 <= n[1] < 9 and rows[n[0]][n[1]] != "#" and n not in dist:
                dist[n] = dist[(i, j)] + 1
                queue.append(n)
    assert dist[(0, 8)] == 14
    maze = dyna.dyna_maze()
    torch.testing.assert_close(maze.P.sum(-1), torch.ones(54, 4, dtype=torch.float64))
    V = dp.value_iteration(maze.P, maze.R, 0.95, tol=1e-13).V
    assert V[18].item() == pytest.approx(0.95**13, abs=1e-10)
    assert int(maze.mu0.argmax()) == 18 and bool(maze.terminal[8])


def test_greedy_value_against_policy_evaluation():
    mdp = envs.from_gymnasium("FrozenLake-v1", is_slippery=True, gamma=0.9)
    Q = torch.randn(3, mdp.S, mdp.A, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    V = dyna.greedy_value(mdp, Q)
    for b in range(3):
        ref = dp.policy_evaluation(mdp.P, mdp.R, Q[b].argmax(-1), mdp.gamma, tol=1e-14)
        torch.testing.assert_close(V[b], ref, rtol=0, atol=1e-10)


def test_bad_input():
    maze = dyna.dyna_maze()
    with pytest.raises(TypeError, match="TabularMDP"):
        dyna.dyna_q("maze", 1, 10)
    with pytest.raises(ValueError, match="n_planning"):
        dyna.dyna_q(maze, -1, 10)
    with pytest.raises(ValueError, match="n_steps"):
        dyna.dyna_q(maze, 1, 0)
    with pytest.raises(ValueError, match="epsilon"):
        dyna.dyna_q(maze, 1, 10, epsilon=1.5)
    with pytest.raises(ValueError, match="one start"):
        dyna.dyna_maze(layout=("S.G", "S.."))
    with pytest.raises(ValueError, match="equal-length"):
        dyna.dyna_maze(layout=("S.G", "."))
    with pytest.raises(ValueError, match=r"\(\.\.\., S, A\)"):
        dyna.greedy_value(maze, torch.zeros(54, 3))
    with pytest.raises(ValueError, match="gamma < 1"):
        dyna.greedy_value(dyna.dyna_maze(gamma=1.0), torch.zeros(54, 4))
