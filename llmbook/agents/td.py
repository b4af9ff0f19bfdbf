r"""Temporal-difference learning: the TD error, TD(0), Q-learning, SARSA and Expected SARSA.

* **TD error** (33.01, :func:`td_error`): :math:`\delta_t=r_{t+1}+\gamma V(s_{t+1})-V(s_t)`, with
  :math:`V(s_{t+1})` dropped when :math:`s_{t+1}` is terminal (Sutton 1988).
* **TD(0)** (33.02, :func:`td0_update`): :math:`V(s_t)\leftarrow V(s_t)+\alpha\delta_t`.
* **Q-learning** (33.03, :func:`q_learning_update`, Watkins and Dayan 1992): the target
  :math:`r+\gamma\max_aQ(s',a)`, off-policy.
* **SARSA** (33.04, :func:`sarsa_update`, Rummery and Niranjan 1994): the target :math:`r+\gamma Q(s',a')`
  with the action :math:`a'` actually taken next, on-policy.
* **Expected SARSA** (33.05, :func:`expected_sarsa_update`, van Seijen et al. 2009): the target
  :math:`r+\gamma\sum_a\pi(a|s')Q(s',a)`, SARSA with the sampled :math:`a'` averaged out.

The updates are pure functions: they return a new table and leave the argument alone. A batch of
transitions is applied *synchronously*: every target is computed from the table before the call and the
increments of repeated ``(s, a)`` pairs add up (``index_put_(accumulate=True)``); one transition at a time
is the textbook online rule. :func:`run_episodes` is the seeded tabular training loop on a
:class:`~llmbook.agents.envs.TabularMDP` (plain Python floats in the hot loop, random numbers drawn in
blocks from a ``torch.Generator``: no gymnasium call, a few microseconds a step).

Conventions: ``V`` ``(S,)``, ``Q`` ``(S, A)``; ``s, a, s_next, a_next`` integer tensors (or ints) of one
shape ``(...)``; ``r`` float of that shape; ``done`` bool (or 0/1) of that shape, or None (no transition
terminates). Arithmetic in float32 for fp16/bf16 tables, rounded back once.

>>> Q = torch.zeros(2, 2)
>>> q_learning_update(Q, 0, 1, 1.0, 1, alpha=0.5, gamma=0.9).tolist()
[[0.0, 0.5], [0.0, 0.0]]
"""

from __future__ import annotations

import bisect
from typing import NamedTuple

import torch

from llmbook._checks import (
    as_tensor,
    check_choice,
    check_finite,
    check_int,
    check_integer_tensor,
    check_nonnegative_int,
    check_positive_int,
    check_range,
)
from llmbook._precision import restore_half, upcast_half
from llmbook.agents.envs import TabularMDP
from llmbook.registry import implements

__all__ = ["td_error", "td0_update", "q_learning_update", "sarsa_update", "expected_sarsa_update",
           "epsilon_greedy_probs", "run_episodes", "TDRun"]


def _not_done(done, shape, dtype) -> torch.Tensor:
    """``1 - done`` broadcast to ``shape`` in ``dtype`` (ones when ``done`` is None)."""
    if done is None:
        return torch.ones(shape, dtype=dtype)
    d = as_tensor(done, "done", floating=False)
    if d.is_complex():
        raise TypeError(f"done must be a bool (or 0/1) tensor, got dtype {d.dtype}")
    if d.dtype != torch.bool:
        if not ((d == 0) | (d == 1)).all():
            raise ValueError("done must hold only 0/1 (or True/False) flags, got values outside {0, 1}")
        d = d != 0
    try:
        d = torch.broadcast_to(d, shape)
    except RuntimeError as err:
        raise ValueError(f"done {tuple(d.shape)} must broadcast to the transitions' shape {tuple(shape)}") from err
    return (~d).to(dtype)


@implements("33.01")
def td_error(r, V_s, V_next, gamma: float = 0.99, done=None) -> torch.Tensor:
    r"""The TD error :math:`\delta_t=r_{t+1}+\gamma(1-d_{t+1})V(s_{t+1})-V(s_t)`.

    ``r`` reward :math:`r_{t+1}`, ``V_s`` :math:`V(s_t)`, ``V_next`` :math:`V(s_{t+1})`, ``done``
    :math:`d_{t+1}` (True where :math:`s_{t+1}` is terminal: its value is 0 whatever ``V_next`` says), all
    broadcast to one shape ``(...)``; ``gamma`` in [0, 1]. Returns :math:`\delta` ``(...)``.

    >>> td_error(torch.tensor([1.0, 1.0]), torch.tensor([0.5, 0.5]), torch.tensor([2.0, 2.0]), 0.5,
    ...          torch.tensor([False, True])).tolist()
    [1.5, 0.5]
    """
    r, V_s, V_next = as_tensor(r, "r"), as_tensor(V_s, "V_s"), as_tensor(V_next, "V_next")
    gamma = check_range(gamma, "gamma", 0.0, 1.0)
    try:
        shape = torch.broadcast_shapes(r.shape, V_s.shape, V_next.shape)
    except RuntimeError as err:
        raise ValueError(f"r {tuple(r.shape)}, V_s {tuple(V_s.shape)} and V_next {tuple(V_next.shape)} "
                         "must broadcast to one shape") from err
    dtype = torch.promote_types(torch.promote_types(r.dtype, V_s.dtype), V_next.dtype)
    c = upcast_half(torch.zeros((), dtype=dtype)).dtype
    alive = _not_done(done, shape, c)
    # alive * V_next, with a terminal's (possibly non-finite) V_next replaced by 0, not multiplied by 0
    boot = torch.where(alive > 0, V_next.to(c), torch.zeros((), dtype=c))
    return restore_half(r.to(c) + gamma * boot - V_s.to(c), dtype)


def _index(x, name: str, n: int) -> torch.Tensor:
    t = check_integer_tensor(x, name)
    if t.numel() and (t.min().item() < 0 or t.max().item() >= n):
        raise ValueError(f"{name} must hold indices in [0, {n}), got values in [{t.min().item()}, {t.max().item()}]")
    return t.long()


def _table(X, name: str, dims: int) -> torch.Tensor:
    X = as_tensor(X, name)
    if X.dim() != dims or 0 in X.shape:
        raise ValueError(f"{name} must be a non-empty {'(S,)' if dims == 1 else '(S, A)'} table, got {tuple(X.shape)}")
    check_finite(X, name)
    return X


def _batch(X, s, r, s_next, others=()):
    """Checked index tensors of one shape, ``r`` as the table's compute dtype, and that shape."""
    S = X.shape[0]
    s, s_next = _index(s, "s", S), _index(s_next, "s_next", S)
    rr = as_tensor(r, "r")
    shape = s.shape
    for name, t in (("s_next", s_next), ("r", rr), *others):
        if t.shape != shape:
            raise ValueError(f"{name} {tuple(t.shape)} must have the shape of s {tuple(shape)} (one per transition)")
    check_finite(rr, "r")
    return s, rr, s_next, shape


def _apply(X: torch.Tensor, idx: tuple, target: torch.Tensor, alpha: float) -> torch.Tensor:
    """``X[idx] += alpha * (target - X[idx])``, synchronous over the batch (repeats accumulate)."""
    Xc = upcast_half(X).clone()
    inc = alpha * (target - Xc[idx])
    Xc.index_put_(tuple(i.reshape(-1) for i in idx), inc.reshape(-1), accumulate=True)
    return restore_half(Xc, X.dtype)


def _scalars(alpha, gamma) -> tuple[float, float]:
    return check_range(alpha, "alpha", 0.0, 1.0), check_range(gamma, "gamma", 0.0, 1.0)


@implements("33.02")
def td0_update(V, s, r, s_next, done=None, alpha: float = 0.1, gamma: float = 0.99) -> torch.Tensor:
    r"""TD(0): :math:`V(s_t)\leftarrow V(s_t)+\alpha\,[r_{t+1}+\gamma V(s_{t+1})-V(s_t)]`.

    ``V`` ``(S,)``; transitions ``s``, ``r``, ``s_next``, ``done`` of one shape; ``alpha`` in [0, 1] the step
    size. Returns the new ``V`` (a copy); a batch is applied synchronously (module docstring).

    >>> td0_update(torch.zeros(3), torch.tensor([0, 1]), torch.tensor([1.0, 0.0]), torch.tensor([1, 2]),
    ...            alpha=0.5, gamma=1.0).tolist()
    [0.5, 0.0, 0.0]
    """
    V = _table(V, "V", 1)
    alpha, gamma = _scalars(alpha, gamma)
    s, r, s_next, _ = _batch(V, s, r, s_next)
    Vc = upcast_half(V)
    delta = td_error(r.to(Vc.dtype), Vc[s], Vc[s_next], gamma, done)
    return _apply(V, (s,), Vc[s] + delta, alpha)


def _q_update(Q, s, a, r, s_next, done, alpha, gamma, bootstrap, others=()) -> torch.Tensor:
    Q = _table(Q, "Q", 2)
    alpha, gamma = _scalars(alpha, gamma)
    s, r, s_next, shape = _batch(Q, s, r, s_next, others)
    a = _index(a, "a", Q.shape[1])
    if a.shape != shape:
        raise ValueError(f"a {tuple(a.shape)} must have the shape of s {tuple(shape)}")
    Qc = upcast_half(Q)
    target = r.to(Qc.dtype) + gamma * _not_done(done, shape, Qc.dtype) * bootstrap(Qc, s_next)
    return _apply(Q, (s, a), target, alpha)


@implements("33.03")
def q_learning_update(Q, s, a, r, s_next, done=None, alpha: float = 0.1, gamma: float = 0.99) -> torch.Tensor:
    r"""Q-learning: :math:`Q(s,a)\leftarrow Q(s,a)+\alpha\,[r+\gamma\max_{a'}Q(s',a')-Q(s,a)]`.

    ``Q`` ``(S, A)``; transitions ``s, a, r, s_next, done`` of one shape. The target maximises over the next
    actions whatever the behaviour policy does next: off-policy, it learns :math:`Q^*`. Returns the new ``Q``.

    >>> q_learning_update(torch.tensor([[0.0, 0.0], [1.0, 3.0]]), 0, 0, 0.0, 1, alpha=1.0, gamma=0.5)[0].tolist()
    [1.5, 0.0]
    """
    return _q_update(Q, s, a, r, s_next, done, alpha, gamma, lambda Qc, sn: Qc[sn].max(-1).values)


@implements("33.04")
def sarsa_update(Q, s, a, r, s_next, a_next, done=None, alpha: float = 0.1, gamma: float = 0.99) -> torch.Tensor:
    r"""SARSA: :math:`Q(s,a)\leftarrow Q(s,a)+\alpha\,[r+\gamma Q(s',a')-Q(s,a)]`, :math:`a'` the action taken next.

    On-policy: it learns the values of the policy that chooses :math:`a'` (e.g. ε-greedy). Returns the new ``Q``.

    >>> sarsa_update(torch.tensor([[0.0, 0.0], [1.0, 3.0]]), 0, 0, 0.0, 1, 0, alpha=1.0, gamma=0.5)[0].tolist()
    [0.5, 0.0]
    """
    Q = _table(Q, "Q", 2)
    a_next = _index(a_next, "a_next", Q.shape[1])
    return _q_update(Q, s, a, r, s_next, done, alpha, gamma, lambda Qc, sn: Qc[sn, a_next],
                     others=(("a_next", a_next),))


@implements("33.05")
def expected_sarsa_update(Q, s, a, r, s_next, pi_next, done=None, alpha: float = 0.1,
                          gamma: float = 0.99) -> torch.Tensor:
    r"""Expected SARSA: :math:`Q(s,a)\leftarrow Q(s,a)+\alpha\,[r+\gamma\sum_{a'}\pi(a'|s')Q(s',a')-Q(s,a)]`.

    ``pi_next`` ``(..., A)``: the policy's probabilities at each ``s_next`` (e.g.
    ``epsilon_greedy_probs(Q[s_next], eps)``). A greedy ``pi_next`` gives Q-learning. Returns the new ``Q``.

    >>> expected_sarsa_update(torch.tensor([[0.0, 0.0], [1.0, 3.0]]), 0, 0, 0.0, 1, torch.tensor([0.5, 0.5]),
    ...                       alpha=1.0, gamma=0.5)[0].tolist()
    [1.0, 0.0]
    """
    Q = _table(Q, "Q", 2)
    p = as_tensor(pi_next, "pi_next")
    shape = check_integer_tensor(s, "s").shape
    if p.shape != (*shape, Q.shape[1]):
        raise ValueError(f"pi_next must be (..., A) = {(*shape, Q.shape[1])}: the policy at each s_next, "
                         f"got {tuple(p.shape)}")
    check_finite(p, "pi_next")
    if p.numel() and (p.min().item() < 0 or (p.double().sum(-1) - 1).abs().max().item() > 1e-2):
        raise ValueError("pi_next must hold probabilities >= 0 summing to 1 over the actions")
    return _q_update(Q, s, a, r, s_next, done, alpha, gamma, lambda Qc, sn: (p.to(Qc.dtype) * Qc[sn]).sum(-1))


def epsilon_greedy_probs(Q, epsilon: float) -> torch.Tensor:
    r"""The ε-greedy policy :math:`\pi(a|s)=\varepsilon/|\mathcal A|+(1-\varepsilon)[a\in\arg\max Q(s,\cdot)]/n_{ties}`.

    ``Q`` ``(..., A)``; tied maxima share the greedy mass (the training loop breaks ties uniformly at random).
    Returns ``(..., A)`` float64 probabilities.

    >>> epsilon_greedy_probs(torch.tensor([1.0, 3.0, 3.0, 0.0]), 0.2).tolist()
    [0.05, 0.45, 0.45, 0.05]
    """
    Q = as_tensor(Q, "Q").double()
    eps = check_range(epsilon, "epsilon", 0.0, 1.0)
    best = (Q == Q.max(-1, keepdim=True).values).double()
    return eps / Q.shape[-1] + (1 - eps) * best / best.sum(-1, keepdim=True)


class TDRun(NamedTuple):
    """The result of :func:`run_episodes`: ``values`` (``V`` ``(S,)`` for TD(0), else ``Q`` ``(S, A)``, float64),
    undiscounted ``returns`` and ``lengths`` per episode ``(n_episodes,)``, ``visits`` ``(S, A)`` update counts,
    ``transitions`` ``(N, 6)`` long rows (s, a, s', a', done, step) with rewards ``rewards`` ``(N,)`` when
    ``record`` (else empty), and ``history`` ``(n_episodes // every + 1, *values.shape)``: the table before the
    first episode and after every ``every`` episodes (empty when ``every`` is 0)."""

    values: torch.Tensor
    returns: torch.Tensor
    lengths: torch.Tensor
    visits: torch.Tensor
    transitions: torch.Tensor
    rewards: torch.Tensor
    history: torch.Tensor


METHODS = ("td0", "q_learning", "sarsa", "expected_sarsa")


class SeededUniforms:
    """The uniform random numbers of the tabular learners: ``torch.rand`` in blocks of 8192 from ``seed``, used one
    at a time (``u()``), and ``draw(c)``, an index drawn from a cumulative weight list ``c``. Learners that share
    this stream from the same seed take the same random decisions (Dyna-Q with no planning is Q-learning)."""

    def __init__(self, seed: int):
        self._g = torch.Generator().manual_seed(seed)
        self._buf: list[float] = []

    def u(self) -> float:
        if not self._buf:
            self._buf = torch.rand(8192, generator=self._g, dtype=torch.float64).tolist()
        return self._buf.pop()

    def draw(self, c: list) -> int:
        return min(bisect.bisect_right(c, self.u() * c[-1]), len(c) - 1)


def run_episodes(mdp: TabularMDP, method: str, n_episodes: int, *, pi=None, alpha: float = 0.1,
                 alpha_power: float = 0.0, epsilon: float = 0.1, gamma: float | None = None, seed: int = 0,
                 max_steps: int = 10_000, init=None, record: bool = False, every: int = 0) -> TDRun:
    r"""Run ``n_episodes`` of a TD method on ``mdp``, online, one transition at a time; seeded.

    ``method``: ``"td0"`` (evaluates the fixed policy ``pi`` ``(S, A)``), ``"q_learning"``, ``"sarsa"`` or
    ``"expected_sarsa"`` (control; behaviour ε-greedy in the current ``Q``, ties broken at random, and the
    Expected SARSA target averages over that ε-greedy policy: :math:`\varepsilon\,\overline{Q}(s')+
    (1-\varepsilon)\max Q(s')`). The step size of the ``n``-th update of a pair is ``alpha * n**-alpha_power``; the
    Robbins-Monro conditions :math:`\sum_n\alpha_n=\infty`, :math:`\sum_n\alpha_n^2<\infty` hold for
    ``alpha_power`` in (1/2, 1] (not for 1/2: :math:`\sum 1/n` diverges).
    Episodes start from ``mdp.mu0`` and end at a terminal state or after ``max_steps`` steps (no bootstrap
    cut: the table is updated as usual). ``gamma`` defaults to ``mdp.gamma``; ``init`` the initial table (0).
    The online ``returns`` are the undiscounted sums of the rewards collected while learning (exploration
    included), as in Sutton and Barto's Example 6.6. Returns :class:`TDRun`.

    >>> from llmbook.agents.envs import from_gymnasium
    >>> mdp = from_gymnasium("CliffWalking-v1", gamma=1.0)
    >>> run = run_episodes(mdp, "q_learning", 200, alpha=0.5, epsilon=0.1, seed=0)
    >>> run.values.shape, round(run.values[36].max().item(), 3)
    (torch.Size([48, 4]), -13.0)
    """
    check_choice(method, "method", METHODS)
    n_episodes, max_steps = check_nonnegative_int(n_episodes, "n_episodes"), check_positive_int(max_steps, "max_steps")
    alpha = check_range(alpha, "alpha", 0.0, 1.0)
    alpha_power = check_range(alpha_power, "alpha_power", 0.0, 1.0)
    eps = check_range(epsilon, "epsilon", 0.0, 1.0)
    gamma = mdp.gamma if gamma is None else check_range(gamma, "gamma", 0.0, 1.0)
    seed = check_int(seed, "seed")
    every = check_nonnegative_int(every, "every")
    S, A = mdp.S, mdp.A
    # the model as Python lists: cumulative next-state probabilities, next states, rewards
    nxt, cum, rew = [], [], []
    for s in range(S):
        row_n, row_c, row_r = [], [], []
        for a in range(A):
            idx = (mdp.P[s, a] > 0).nonzero().flatten()
            row_n.append(idx.tolist())
            row_c.append(mdp.P[s, a, idx].cumsum(0).tolist())
            row_r.append(mdp.R[s, a, idx].tolist())
        nxt.append(row_n), cum.append(row_c), rew.append(row_r)
    mu_c = mdp.mu0.cumsum(0).tolist()
    term = mdp.terminal.tolist()
    td0 = method == "td0"
    if td0:
        if pi is None:
            raise ValueError("method 'td0' evaluates a fixed policy: pass pi (S, A)")
        pi_t = as_tensor(pi, "pi").double()
        if pi_t.shape != (S, A):
            raise ValueError(f"pi must be (S, A) = ({S}, {A}) probabilities, got {tuple(pi_t.shape)}")
        pi_c = pi_t.cumsum(1).tolist()
    shape = (S,) if td0 else (S, A)
    X = torch.zeros(shape, dtype=torch.float64) if init is None else as_tensor(init, "init").double()
    if X.shape != shape:
        raise ValueError(f"init must be {shape}, got {tuple(X.shape)}")
    X = X.tolist()
    counts = [[0] * A for _ in range(S)]
    stream = SeededUniforms(seed)
    u, draw = stream.u, stream.draw

    def act(s: int) -> int:
        if td0:
            return draw(pi_c[s])
        q = X[s]
        if u() < eps:
            return min(int(u() * A), A - 1)
        m = max(q)
        ties = [i for i in range(A) if q[i] == m]
        return ties[min(int(u() * len(ties)), len(ties) - 1)]

    returns, lengths, log, rlog = [], [], [], []
    history = [torch.tensor(X, dtype=torch.float64)] if every else []
    for ep in range(n_episodes):
        s = draw(mu_c)
        a = act(s)
        G, t = 0.0, 0
        while not term[s] and t < max_steps:
            j = draw(cum[s][a])
            s2, r = nxt[s][a][j], rew[s][a][j]
            done = term[s2]
            a2 = act(s2) if not done else 0
            counts[s][a] += 1
            step = alpha * counts[s][a] ** -alpha_power if alpha_power else alpha
            if td0:
                X[s] += step * (r + (0.0 if done else gamma * X[s2]) - X[s])
            else:
                q2 = X[s2]
                if done:
                    boot = 0.0
                elif method == "q_learning":
                    boot = max(q2)
                elif method == "sarsa":
                    boot = q2[a2]
                else:
                    boot = eps * sum(q2) / A + (1 - eps) * max(q2)
                X[s][a] += step * (r + gamma * boot - X[s][a])
            if record:
                log.append((s, a, s2, a2, int(done), t))
                rlog.append(r)
            G += r
            t += 1
            s, a = s2, a2
        returns.append(G)
        lengths.append(t)
        if every and (ep + 1) % every == 0:
            history.append(torch.tensor(X, dtype=torch.float64))
    f64 = torch.float64
    return TDRun(torch.tensor(X, dtype=f64), torch.tensor(returns, dtype=f64), torch.tensor(lengths),
                 torch.tensor(counts), torch.tensor(log, dtype=torch.long).reshape(-1, 6),
                 torch.tensor(rlog, dtype=f64),
                 torch.stack(history) if history else torch.zeros((0, *shape), dtype=f64))
