r"""Tabular control, many runs side by side: Double Q-learning and the maximisation-bias example (chapter 33).

* **Double Q-learning** (:func:`double_q_learning_update`, van Hasselt 2010): two tables; a coin picks the
  one to update, say :math:`Q_1`, and its target takes the action from :math:`Q_1` and the value from
  :math:`Q_2`:

  .. math:: Q_1(s,a)\leftarrow Q_1(s,a)+\alpha\big[r+\gamma\,Q_2\big(s',\arg\max_{a'}Q_1(s',a')\big)-Q_1(s,a)\big].

  The noise that makes an action look best in :math:`Q_1` is not the noise that values it, so the target
  does not inherit the upward bias of :math:`\max_{a'}Q(s',a')` (:math:`\mathbb E\max\ge\max\mathbb E`).
* :func:`maximisation_bias_mdp`: Sutton and Barto's Example 6.7. From ``A`` (the start) ``right`` ends the
  episode with reward 0 and ``left`` moves to ``B`` with reward 0; from ``B`` each of ``n_b`` actions ends
  the episode with a reward drawn from :math:`\mathcal N(-0.1, 1)`. Going left is worth -0.1: wrong.
* :func:`run_lanes`: ``K`` independent ε-greedy learners ("lanes": seeds, step sizes, methods) stepped in
  lockstep with numpy, each with its own table, environment copy and episode counter. Methods
  ``"q_learning"``, ``"sarsa"``, ``"expected_sarsa"`` (the rules of :mod:`llmbook.agents.td`) and
  ``"double_q"`` (ε-greedy in :math:`Q_1+Q_2`, a fair coin per update). Rewards are ``R[s, a, s']`` plus
  optional Gaussian noise of standard deviation ``reward_std[s, a]``.

Conventions: ``Q`` ``(S, A)``; transitions ``s, a, r, s_next, done`` of one shape ``(...)`` (a batch is
applied synchronously, as in :mod:`llmbook.agents.td`).

>>> Q1, Q2 = torch.zeros(2, 2), torch.tensor([[0.0, 0.0], [5.0, 1.0]])
>>> Q1[1] = torch.tensor([0.0, 2.0])  # Q1 picks action 1 at s' = 1, Q2 values it at 1.0
>>> double_q_learning_update(Q1, Q2, 0, 0, 0.0, 1, alpha=1.0, gamma=1.0)[0].tolist()
[1.0, 0.0]
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

from llmbook._checks import as_tensor, check_choice, check_int, check_positive_int, check_range
from llmbook.agents.envs import TabularMDP
from llmbook.agents.td import _apply, _batch, _index, _not_done, _scalars, _table

__all__ = ["double_q_learning_update", "maximisation_bias_mdp", "run_lanes", "LaneRun", "LANE_METHODS"]

LANE_METHODS = ("q_learning", "sarsa", "expected_sarsa", "double_q")


def double_q_learning_update(Q1, Q2, s, a, r, s_next, done=None, alpha: float = 0.1,
                             gamma: float = 0.99) -> torch.Tensor:
    r"""One Double Q-learning update of ``Q1``: target :math:`r+\gamma(1-d)\,Q_2(s',\arg\max_{a'}Q_1(s',a'))`.

    ``Q1``, ``Q2`` ``(S, A)``: the table updated (it chooses the next action, first maximiser on ties) and
    the other table (it values that action). Transitions ``s, a, r, s_next, done`` of one shape. Returns the
    new ``Q1`` (a copy); swap the arguments to update ``Q2``. With ``Q2 is Q1`` it is Q-learning.

    >>> double_q_learning_update(torch.zeros(2, 2), torch.ones(2, 2), 0, 1, 1.0, 1, alpha=0.5, gamma=0.5).tolist()
    [[0.0, 0.75], [0.0, 0.0]]
    """
    Q1, Q2 = _table(Q1, "Q1", 2), _table(Q2, "Q2", 2)
    if Q1.shape != Q2.shape:
        raise ValueError(f"Q1 {tuple(Q1.shape)} and Q2 {tuple(Q2.shape)} must be tables of one shape (S, A)")
    alpha, gamma = _scalars(alpha, gamma)
    s, r, s_next, shape = _batch(Q1, s, r, s_next)
    a = _index(a, "a", Q1.shape[1])
    if a.shape != shape:
        raise ValueError(f"a {tuple(a.shape)} must have the shape of s {tuple(shape)}")
    c = torch.promote_types(Q1.dtype, torch.float32)
    a_star = Q1[s_next].argmax(-1, keepdim=True)
    value = Q2.to(c)[s_next].gather(-1, a_star).squeeze(-1)
    target = r.to(c) + gamma * _not_done(done, shape, c) * value
    return _apply(Q1, (s, a), target, alpha)


def maximisation_bias_mdp(n_b: int = 10, mean_b: float = -0.1) -> tuple[TabularMDP, torch.Tensor]:
    r"""Sutton and Barto's Example 6.7 as a :class:`~llmbook.agents.envs.TabularMDP`, and its reward noise
    ``reward_std`` ``(S, A)``.

    States ``A`` = 0 (start), ``B`` = 1, and the terminal state 2. Actions 0 = ``left`` and 1 = ``right`` in
    ``A`` (``A`` has ``n_b`` actions like ``B``: actions 2 and up act as ``right``, so give them no weight by
    reading only actions 0 and 1 there; :func:`run_lanes` masks them with ``n_actions``). ``gamma`` is 1.
    The reward of each of ``B``'s actions is :math:`\mathcal N(` ``mean_b`` :math:`, 1)`: ``R`` holds the mean,
    ``reward_std`` the 1. Returns ``(mdp, reward_std)``.

    >>> mdp, std = maximisation_bias_mdp()
    >>> mdp.S, mdp.A, mdp.P[0, 0].tolist(), std[1].tolist()[:2]
    (3, 10, [0.0, 1.0, 0.0], [1.0, 1.0])
    """
    n_b = check_int(n_b, "n_b", low=2)
    mean_b = check_range(mean_b, "mean_b")
    P = torch.zeros(3, n_b, 3, dtype=torch.float64)
    R = torch.zeros(3, n_b, 3, dtype=torch.float64)
    P[0, 0, 1] = 1.0  # left: to B
    P[0, 1:, 2] = 1.0  # right (and the padding actions): the end, reward 0
    P[1, :, 2] = 1.0
    R[1, :, 2] = mean_b
    P[2, :, 2] = 1.0
    std = torch.zeros(3, n_b, dtype=torch.float64)
    std[1] = 1.0
    mdp = TabularMDP(P=P, R=R, gamma=1.0, terminal=torch.tensor([False, False, True]),
                     mu0=torch.tensor([1.0, 0.0, 0.0], dtype=torch.float64), name="maximisation-bias",
                     action_names=("left", "right", *(str(i) for i in range(2, n_b))))
    return mdp, std


class LaneRun(NamedTuple):
    """The result of :func:`run_lanes`: ``Q`` ``(K, S, A)`` (for ``double_q`` the mean of the two tables),
    ``Q2`` ``(K, S, A)`` the second table (equal to ``Q`` for single-table methods), ``returns``,
    ``lengths`` and ``first_actions`` ``(K, n_episodes)`` (the undiscounted online return, the number of steps
    and the first action of every episode), and ``log``: when ``record``, ``(N, 8)`` float64 rows
    (lane, s, a, r, s', a', done, table updated: 0 or 1), else empty."""

    Q: np.ndarray
    Q2: np.ndarray
    returns: np.ndarray
    lengths: np.ndarray
    first_actions: np.ndarray
    log: np.ndarray


def _per_lane(x, K: int, name: str, low: float, high: float) -> np.ndarray:
    v = np.broadcast_to(np.asarray(x, dtype=np.float64), (K,)).copy()
    if not np.isfinite(v).all() or (v < low).any() or (v > high).any():
        raise ValueError(f"{name} must be a number or K = {K} numbers in [{low}, {high}], got {x!r}")
    return v


def run_lanes(mdp: TabularMDP, methods, n_episodes: int, *, alpha=0.1, epsilon=0.1, gamma: float | None = None,
              seed: int = 0, reward_std=None, n_actions=None, max_steps: int = 10_000, record: bool = False) -> LaneRun:
    r"""``K`` independent online learners on ``mdp``, in lockstep; each runs ``n_episodes`` episodes.

    ``methods``: a sequence of ``K`` names from ``LANE_METHODS`` (one learner each). ``alpha``, ``epsilon``:
    one number or ``K`` numbers. The behaviour is ε-greedy in ``Q`` (``Q1 + Q2`` for ``double_q``), ties
    broken uniformly at random; SARSA's :math:`a'` is the action then taken, Expected SARSA averages over the
    ε-greedy policy. ``reward_std`` ``(S, A)``: Gaussian reward noise; ``n_actions`` ``(S,)``: how many of
    the actions (the first ones) are available in each state (default all). Tables start at 0; an episode
    ends at a terminal state or after ``max_steps`` steps. Random numbers from
    ``numpy.random.default_rng(seed)``. Returns :class:`LaneRun`.

    >>> mdp, std = maximisation_bias_mdp()
    >>> run = run_lanes(mdp, ["q_learning", "double_q"], 5, seed=0, reward_std=std, n_actions=[2, 10, 10])
    >>> run.first_actions.shape, run.Q.shape
    ((2, 5), (2, 3, 10))
    """
    methods = list(methods)
    K = len(methods)
    if K == 0:
        raise ValueError("methods must name at least one learner (lane)")
    for m in methods:
        check_choice(m, "methods[k]", LANE_METHODS)
    n_episodes, max_steps = check_positive_int(n_episodes, "n_episodes"), check_positive_int(max_steps, "max_steps")
    alpha = _per_lane(alpha, K, "alpha", 0.0, 1.0)
    eps = _per_lane(epsilon, K, "epsilon", 0.0, 1.0)
    gamma = mdp.gamma if gamma is None else check_range(gamma, "gamma", 0.0, 1.0)
    rng = np.random.default_rng(check_int(seed, "seed", low=0))
    S, A = mdp.S, mdp.A
    cum = mdp.P.numpy().cumsum(-1)
    R = mdp.R.numpy()
    std = np.zeros((S, A)) if reward_std is None else as_tensor(reward_std, "reward_std").double().numpy()
    if std.shape != (S, A) or (std < 0).any():
        raise ValueError(f"reward_std must be ({S}, {A}) non-negative standard deviations, got {std.shape}")
    n_act = np.full(S, A) if n_actions is None else np.asarray(n_actions)
    if n_act.shape != (S,) or (n_act < 1).any() or (n_act > A).any():
        raise ValueError(f"n_actions must be ({S},) counts in [1, {A}], got {n_actions!r}")
    avail = np.arange(A)[None, :] < n_act[:, None]  # (S, A)
    mu_c, term = mdp.mu0.numpy().cumsum(), mdp.terminal.numpy()
    kind = np.array([LANE_METHODS.index(m) for m in methods])
    dbl = kind == 3
    Q1, Q2 = np.zeros((K, S, A)), np.zeros((K, S, A))
    lanes = np.arange(K)

    def act(s, k=lanes):
        """ε-greedy actions of lanes ``k`` in their states ``s``, ties broken uniformly at random."""
        n, ok = len(k), avail[s]
        q = np.where(ok, Q1[k, s] + np.where(dbl[k, None], Q2[k, s], 0.0), -np.inf)
        ties = (q == q.max(1, keepdims=True)) * rng.random((n, A)) + 1e-12 * ok  # a random maximiser
        explore = rng.random((n, A)) * ok  # a random available action
        return np.where(rng.random(n) < eps[k], explore.argmax(1), ties.argmax(1))

    def start(n=K):
        return np.minimum((rng.random(n)[:, None] > mu_c[None]).sum(1), S - 1)

    s = start()
    a = act(s)
    ep = np.zeros(K, dtype=np.int64)
    t = np.zeros(K, dtype=np.int64)
    G = np.zeros(K)
    returns, lengths = np.zeros((K, n_episodes)), np.zeros((K, n_episodes), dtype=np.int64)
    first = np.zeros((K, n_episodes), dtype=np.int64)
    first[:, 0] = a
    log = []
    while (ep < n_episodes).any():
        live = ep < n_episodes
        s2 = np.minimum((rng.random(K)[:, None] > cum[s, a]).sum(1), S - 1)
        r = R[s, a, s2] + std[s, a] * rng.standard_normal(K)
        done = term[s2]
        a2 = act(s2)
        coin = dbl & (rng.random(K) < 0.5)  # double_q: update Q2 (valued by Q1) instead of Q1
        q1_next, q2_next = Q1[lanes, s2], Q2[lanes, s2]  # (K, A): the tables at s'
        qu_next = np.where(coin[:, None], q2_next, q1_next)  # the table being updated
        qv_next = np.where(coin[:, None], q1_next, q2_next)  # the other one (double_q's valuer)
        qu_sa = np.where(coin, Q2[lanes, s, a], Q1[lanes, s, a])
        q2 = np.where(avail[s2], qu_next, -np.inf)
        qmax = q2.max(1)
        pi_mean = np.where(avail[s2], qu_next, 0.0).sum(1) / n_act[s2]
        boot = np.select([kind == 0, kind == 1, kind == 2],
                         [qmax, qu_next[lanes, a2], eps * pi_mean + (1 - eps) * qmax],
                         qv_next[lanes, q2.argmax(1)])
        target = r + gamma * np.where(done, 0.0, boot)
        new = qu_sa + alpha * (target - qu_sa)
        upd1, upd2 = live & ~coin, live & coin
        Q1[lanes[upd1], s[upd1], a[upd1]] = new[upd1]
        Q2[lanes[upd2], s[upd2], a[upd2]] = new[upd2]
        if record:
            log.append(np.stack([lanes, s, a, r, s2, a2, done, coin], 1)[live])
        G += r
        t += 1
        end = live & (done | (t >= max_steps))
        if end.any():
            k = lanes[end]
            returns[k, ep[k]], lengths[k, ep[k]] = G[k], t[k]
            ep[k] += 1
            G[k], t[k] = 0.0, 0
            s2, a2 = s2.copy(), a2.copy()
            s2[k] = start(len(k))
            a2[k] = act(s2[k], k)
            more = k[ep[k] < n_episodes]
            first[more, ep[more]] = a2[more]
        s, a = s2, a2
    Q2 = np.where(dbl[:, None, None], Q2, Q1)
    Qm = np.where(dbl[:, None, None], (Q1 + Q2) / 2, Q1)
    return LaneRun(Qm, Q2, returns, lengths, first, np.concatenate(log) if log else np.zeros((0, 8)))
