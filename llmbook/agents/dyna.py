r"""Dyna-Q: Q-learning that also plans with a model it learns from its own experience (Sutton 1990).

Every real step does three things (Sutton and Barto 2018, section 8.2, "Tabular Dyna-Q"):

1. **Direct RL**: the Q-learning update of chapter 33 on the real transition :math:`(s, a, r, s')`,

   .. math:: Q(s,a)\leftarrow Q(s,a)+\alpha\big[r+\gamma\max_{a'}Q(s',a')-Q(s,a)\big]

   (no bootstrap when :math:`s'` is terminal).
2. **Model learning**: remember :math:`\mathrm{Model}(s,a)=(r, s')`, the last outcome seen (exact for a
   deterministic environment).
3. **Planning**: ``n`` times, pick a previously visited state :math:`\tilde s` and an action :math:`\tilde a`
   already taken there, both uniformly at random, read :math:`(\tilde r,\tilde s')=\mathrm{Model}(\tilde s,
   \tilde a)` and apply the same Q-learning update to the simulated transition.

With ``n = 0`` it is plain Q-learning. Planning spends computation instead of real experience: each real
step is replayed through the model ``n`` times, so values propagate back along the path ``n`` times faster.

* :func:`dyna_q`: the seeded training loop on a :class:`~llmbook.agents.envs.TabularMDP` (plain Python floats,
  random numbers drawn in blocks from a ``torch.Generator`` as in :func:`llmbook.agents.td.run_episodes`).
* :func:`dyna_maze`: Sutton and Barto's Dyna maze (Example 8.1), a deterministic 6 x 9 grid.
* :func:`greedy_value`: the exact value :math:`V^{\pi}` of the greedy policy of a table ``Q``, by a linear
  solve on the true model: the learning curve of a planner, free of evaluation noise.

Registers no equation of the catalogue.

>>> maze = dyna_maze()
>>> maze.S, maze.A, int(maze.terminal.sum())
(54, 4, 1)
>>> run = dyna_q(maze, 5, 500, seed=0)
>>> run.Q.shape, len(run.lengths) > 0
(torch.Size([54, 4]), True)
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

from llmbook._checks import as_tensor, check_int, check_nonnegative_int, check_positive_int, check_range
from llmbook.agents.envs import TabularMDP
from llmbook.agents.td import SeededUniforms

__all__ = ["DynaRun", "dyna_q", "dyna_maze", "greedy_value", "MAZE_LAYOUT"]

#: Sutton and Barto's Dyna maze (Example 8.1, Figure 8.2) with "#" walls, start S and goal G
MAZE_LAYOUT = (
    ".......#G",
    "..#....#.",
    "S.#....#.",
    "..#......",
    ".....#...",
    ".........",
)


def dyna_maze(gamma: float = 0.95, layout=MAZE_LAYOUT) -> TabularMDP:
    """A deterministic grid maze as a :class:`~llmbook.agents.envs.TabularMDP`: actions UP, DOWN, RIGHT, LEFT;
    a move into a wall ``#`` or off the grid leaves the agent where it is; reward 1 on entering the goal ``G``,
    0 otherwise; the goal is terminal (absorbing, reward 0 after). Every cell, walls included, is a state
    (walls are unreachable). Default: Sutton and Barto's Dyna maze, ``gamma = 0.95`` as in their Figure 8.2.
    """
    gamma = check_range(gamma, "gamma", 0.0, 1.0)
    rows = [str(r) for r in layout]
    if not rows or len({len(r) for r in rows}) != 1 or set("".join(rows)) - set(".#SG"):
        raise ValueError("layout must be equal-length rows of '.', '#', 'S' and 'G'")
    text = "".join(rows)
    if text.count("S") != 1 or text.count("G") != 1:
        raise ValueError("layout must hold exactly one start 'S' and one goal 'G'")
    nr, nc = len(rows), len(rows[0])
    S, deltas = nr * nc, ((-1, 0), (1, 0), (0, 1), (0, -1))
    P = torch.zeros(S, 4, S, dtype=torch.float64)
    R = torch.zeros(S, 4, S, dtype=torch.float64)
    goal = text.index("G")
    for s in range(S):
        i, j = divmod(s, nc)
        for a, (di, dj) in enumerate(deltas):
            i2, j2 = i + di, j + dj
            ok = s != goal and 0 <= i2 < nr and 0 <= j2 < nc and rows[i2][j2] != "#"
            s2 = i2 * nc + j2 if ok else s
            P[s, a, s2] = 1.0
            R[s, a, s2] = 1.0 if s2 == goal and s != goal else 0.0
    terminal = torch.zeros(S, dtype=torch.bool)
    terminal[goal] = True
    mu0 = torch.zeros(S, dtype=torch.float64)
    mu0[text.index("S")] = 1.0
    return TabularMDP(P=P, R=R, gamma=float(gamma), terminal=terminal, mu0=mu0, name="DynaMaze",
                      action_names=("UP", "DOWN", "RIGHT", "LEFT"), shape=(nr, nc), desc=tuple(rows))


class DynaRun(NamedTuple):
    """The result of :func:`dyna_q`: the final table ``Q`` ``(S, A)`` (float64); ``lengths`` ``(E,)`` the real
    steps of every completed episode; ``history`` ``(n_steps // every + 1, S, A)``, the table before the first
    step and after every ``every`` real steps (empty when ``every`` is 0); with ``record``, the real
    ``transitions`` ``(n_steps, 4)`` long rows (s, a, s', done) and their ``rewards`` ``(n_steps,)``."""

    Q: torch.Tensor
    lengths: torch.Tensor
    history: torch.Tensor
    transitions: torch.Tensor
    rewards: torch.Tensor


def dyna_q(mdp: TabularMDP, n_planning: int, n_steps: int, *, alpha: float = 0.1, epsilon: float = 0.1,
           gamma: float | None = None, seed: int = 0, max_steps: int = 10_000, every: int = 0,
           record: bool = False) -> DynaRun:
    r"""Tabular Dyna-Q for ``n_steps`` real steps with ``n_planning`` simulated updates after each; seeded.

    Real step: from state :math:`s`, act ε-greedily in ``Q`` (``epsilon``; ties broken at random), observe
    :math:`(r, s')` from ``mdp``, apply :math:`Q(s,a)\mathrel{+}=\alpha[r+\gamma(1-d)\max_{a'}Q(s',a')-Q(s,a)]`,
    store :math:`\mathrm{Model}(s,a)=(r,s',d)`, then ``n_planning`` times apply the same update to
    :math:`\mathrm{Model}(\tilde s,\tilde a)` for a uniformly drawn visited state :math:`\tilde s` and a uniformly
    drawn action already taken there. Episodes start from ``mdp.mu0`` and restart at a terminal state or after
    ``max_steps`` steps. ``gamma`` defaults to ``mdp.gamma``. The model keeps the *last* outcome of each
    pair: exact for a deterministic ``mdp``, a one-sample model otherwise. ``n_planning = 0`` is Q-learning.
    Returns :class:`DynaRun`.

    >>> run = dyna_q(dyna_maze(), 0, 200, seed=1, every=100)
    >>> tuple(run.history.shape)
    (3, 54, 4)
    """
    if not isinstance(mdp, TabularMDP):
        raise TypeError(f"mdp must be a TabularMDP, got {type(mdp).__name__}")
    n_planning = check_nonnegative_int(n_planning, "n_planning")
    n_steps, max_steps = check_positive_int(n_steps, "n_steps"), check_positive_int(max_steps, "max_steps")
    alpha = check_range(alpha, "alpha", 0.0, 1.0)
    eps = check_range(epsilon, "epsilon", 0.0, 1.0)
    gamma = mdp.gamma if gamma is None else check_range(gamma, "gamma", 0.0, 1.0)
    seed, every = check_int(seed, "seed"), check_nonnegative_int(every, "every")
    S, A = mdp.S, mdp.A
    nxt, cum, rew = [], [], []  # the true model as Python lists, to sample real steps
    for s in range(S):
        row_n, row_c, row_r = [], [], []
        for a in range(A):
            idx = (mdp.P[s, a] > 0).nonzero().flatten()
            row_n.append(idx.tolist())
            row_c.append(mdp.P[s, a, idx].cumsum(0).tolist())
            row_r.append(mdp.R[s, a, idx].tolist())
        nxt.append(row_n), cum.append(row_c), rew.append(row_r)
    mu_c, term = mdp.mu0.cumsum(0).tolist(), mdp.terminal.tolist()
    Q = [[0.0] * A for _ in range(S)]
    model: list[list[tuple | None]] = [[None] * A for _ in range(S)]  # Model(s, a) = (r, s', done)
    seen: list[int] = []  # visited states, in order of first visit
    taken: list[list[int]] = [[] for _ in range(S)]  # actions taken in each state, in order of first use
    stream = SeededUniforms(seed)
    u, draw = stream.u, stream.draw

    def pick(items: list) -> int:
        return items[min(int(u() * len(items)), len(items) - 1)]

    def act(s: int) -> int:
        q = Q[s]
        if u() < eps:
            return min(int(u() * A), A - 1)
        m = max(q)
        return pick([i for i in range(A) if q[i] == m])

    lengths, log, rlog = [], [], []
    history = [torch.tensor(Q, dtype=torch.float64)] if every else []
    s, t = draw(mu_c), 0
    for step in range(1, n_steps + 1):
        a = act(s)
        j = draw(cum[s][a])
        s2, r = nxt[s][a][j], rew[s][a][j]
        done = term[s2]
        Q[s][a] += alpha * (r + (0.0 if done else gamma * max(Q[s2])) - Q[s][a])  # direct RL
        if not taken[s]:
            seen.append(s)
        if a not in taken[s]:
            taken[s].append(a)
        model[s][a] = (r, s2, done)  # model learning
        n_seen = len(seen)
        for _ in range(n_planning):  # planning: the same update on simulated experience (pick inlined)
            ps = seen[min(int(u() * n_seen), n_seen - 1)]
            acts = taken[ps]
            pa = acts[min(int(u() * len(acts)), len(acts) - 1)]
            pr, ps2, pdone = model[ps][pa]
            qs = Q[ps]
            qs[pa] += alpha * (pr + (0.0 if pdone else gamma * max(Q[ps2])) - qs[pa])
        if record:
            log.append((s, a, s2, int(done)))
            rlog.append(r)
        t += 1
        s = s2
        if done or t >= max_steps:
            lengths.append(t)
            s, t = draw(mu_c), 0
        if every and step % every == 0:
            history.append(torch.tensor(Q, dtype=torch.float64))
    f64 = torch.float64
    return DynaRun(torch.tensor(Q, dtype=f64), torch.tensor(lengths, dtype=torch.long),
                   torch.stack(history) if history else torch.zeros((0, S, A), dtype=f64),
                   torch.tensor(log, dtype=torch.long).reshape(-1, 4), torch.tensor(rlog, dtype=f64))


def greedy_value(mdp: TabularMDP, Q) -> torch.Tensor:
    r"""Exact value of the greedy policy of ``Q`` on the true model: :math:`V^\pi=(I-\gamma P_\pi)^{-1}r_\pi`
    with :math:`\pi(s)=\arg\max_a Q(s,a)` (first maximiser on ties).

    ``Q`` ``(..., S, A)``; returns ``(..., S)`` float64. Needs :math:`\gamma<1` (or a policy that ends every
    episode). For the learning curve of an agent: the expected discounted return its current table would earn
    if it stopped exploring, computed, not sampled.

    >>> maze = dyna_maze()
    >>> float(greedy_value(maze, torch.zeros(maze.S, maze.A))[18])  # all ties: UP everywhere, never the goal
    0.0
    """
    if not isinstance(mdp, TabularMDP):
        raise TypeError(f"mdp must be a TabularMDP, got {type(mdp).__name__}")
    Q = as_tensor(Q, "Q").double()
    if Q.dim() < 2 or tuple(Q.shape[-2:]) != (mdp.S, mdp.A):
        raise ValueError(f"Q must be (..., S, A) = (..., {mdp.S}, {mdp.A}), got {tuple(Q.shape)}")
    if not torch.isfinite(Q).all():
        raise ValueError("Q must be finite")
    if mdp.gamma >= 1.0:
        raise ValueError(f"greedy_value needs gamma < 1 for the linear solve, got {mdp.gamma}")
    P, r = mdp.P.numpy(), mdp.r_sa.numpy()
    q = Q.reshape(-1, mdp.S, mdp.A).numpy()
    pol = q.argmax(-1)  # (B, S): numpy's argmax returns the first maximiser
    rows = np.arange(mdp.S)
    P_pi, r_pi = P[rows, pol], r[rows, pol]  # (B, S, S), (B, S)
    V = np.linalg.solve(np.eye(mdp.S) - mdp.gamma * P_pi, r_pi[..., None])[..., 0]
    return torch.from_numpy(V).reshape(Q.shape[:-1])
