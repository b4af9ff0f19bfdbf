r"""Games for multi-agent RL: matrix-game equilibria, the minimax value, potential-based shaping.

* **Nash equilibrium** (39.01, :func:`nash_equilibrium`): an exact equilibrium of a two-player matrix
  game by support enumeration (zero-sum when ``B`` is omitted, ``B = -A``); :func:`nash_gap` is the
  best-response check; :func:`multiplicative_weights` the no-regret self-play whose *average* strategies
  converge to the zero-sum equilibrium.
* **Minimax value** (39.02, :func:`minimax_value`): :math:`V^*(s)=\max_a\min_b Q(s,a,b)` over pure
  strategies (Littman's Markov-game backup uses the mixed value, ``mixed=True``).
* VDN, QMIX and MADDPG (39.03-39.05) live in :mod:`llmbook.agents.cooperative`.
* **Potential-based shaping** (39.06, :func:`potential_shaping`): :math:`F=\gamma\Phi(s')-\Phi(s)`.

>>> rps = torch.tensor([[0., -1., 1.], [1., 0., -1.], [-1., 1., 0.]])
>>> eq = nash_equilibrium(rps)
>>> [round(p, 4) for p in eq.x.tolist()], round(eq.value, 6)
([0.3333, 0.3333, 0.3333], 0.0)
"""

from __future__ import annotations

import itertools
from typing import NamedTuple

import torch

from llmbook._checks import as_tensor, check_dim, check_finite, check_positive_int, check_range
from llmbook._precision import compute_dtype
from llmbook.registry import implements

__all__ = ["NashEquilibrium", "nash_equilibrium", "nash_gap", "multiplicative_weights", "minimax_value",
           "potential_shaping"]

MAX_ACTIONS = 10  # support enumeration visits up to (2^m - 1)(2^n - 1) support pairs


class NashEquilibrium(NamedTuple):
    """``x`` ``(m,)`` the row player's mixed strategy, ``y`` ``(n,)`` the column player's; ``value`` the row
    player's expected payoff :math:`x^\\top A y` (``value_B`` the column player's, :math:`x^\\top B y`)."""

    x: torch.Tensor
    y: torch.Tensor
    value: float
    value_B: float


def _matrix(A, name: str) -> torch.Tensor:
    A = as_tensor(A, name)
    check_dim(A, name, "(m, n)", min_dim=2, max_dim=2)
    if A.shape[0] == 0 or A.shape[1] == 0:
        raise ValueError(f"{name} must have at least one action per player, got shape {tuple(A.shape)}")
    check_finite(A, name)
    return A


def _indifferent(M: torch.Tensor, cols: tuple, rows: tuple) -> torch.Tensor | None:
    """Mixed strategy q on ``cols`` making every row of ``rows`` of M q earn the same: None if none exists."""
    k = len(cols)
    sub = M[list(rows)][:, list(cols)]
    # unknowns (q_1..q_k, v): sub q - v 1 = 0 and sum q = 1
    lhs = torch.zeros(len(rows) + 1, k + 1, dtype=torch.float64)
    lhs[: len(rows), :k] = sub
    lhs[: len(rows), k] = -1.0
    lhs[-1, :k] = 1.0
    rhs = torch.zeros(len(rows) + 1, dtype=torch.float64)
    rhs[-1] = 1.0
    sol = torch.linalg.lstsq(lhs, rhs.unsqueeze(-1), driver="gelsd").solution.squeeze(-1)
    if (lhs @ sol - rhs).abs().max() > 1e-9:
        return None
    q = torch.zeros(M.shape[1], dtype=torch.float64)
    q[list(cols)] = sol[:k]
    return q if bool((q >= -1e-12).all()) else None


@implements("39.01")
def nash_equilibrium(A, B=None, *, tol: float = 1e-9) -> NashEquilibrium:
    r"""An exact Nash equilibrium of the bimatrix game (A, B) by support enumeration.

    .. math:: \pi_i^*\in\arg\max_{\pi_i}J_i(\pi_i,\pi_{-i}^*),\qquad J_1=x^\top Ay,\ J_2=x^\top By

    Symbols: ``A`` ``(m, n)`` the row player's payoffs, ``B`` ``(m, n)`` the column player's (default
    :math:`-A`, a zero-sum game, whose equilibrium is the minimax solution of von Neumann 1928). Supports
    :math:`I, J` are visited by increasing size; on each pair the indifference equations (every action of
    the support earns the same) are solved in float64, and the pair is accepted when both strategies are
    non-negative and no action outside the support earns more than ``tol``. By Nash (1951) an equilibrium
    exists; every game has one with such supports (an extreme equilibrium). Sizes up to
    ``MAX_ACTIONS`` = 10 actions per player. Returns :class:`NashEquilibrium` in float64.

    >>> nash_equilibrium(torch.tensor([[3., 0.], [5., 1.]]), torch.tensor([[3., 5.], [0., 1.]])).x.tolist()
    [0.0, 1.0]
    """
    A = _matrix(A, "A")
    B = -A if B is None else _matrix(B, "B")
    if B.shape != A.shape:
        raise ValueError(f"A and B must have the same shape (m, n), got {tuple(A.shape)} and {tuple(B.shape)}")
    tol = check_range(tol, "tol", 0.0, low_open=True)
    m, n = A.shape
    if max(m, n) > MAX_ACTIONS:
        raise ValueError(f"support enumeration is limited to {MAX_ACTIONS} actions per player, got {m} x {n}")
    A64, B64 = A.double(), B.double()
    sizes = sorted(((i, j) for i in range(1, m + 1) for j in range(1, n + 1)), key=lambda ij: (ij[0] + ij[1], ij))
    for ki, kj in sizes:
        for I in itertools.combinations(range(m), ki):
            for J in itertools.combinations(range(n), kj):
                y = _indifferent(A64, J, I)  # makes the row player indifferent on I
                if y is None:
                    continue
                x = _indifferent(B64.T, I, J)  # makes the column player indifferent on J
                if x is None:
                    continue
                x, y = x.clamp_min(0), y.clamp_min(0)
                x, y = x / x.sum(), y / y.sum()
                if nash_gap(A64, B64, x, y) <= tol:
                    return NashEquilibrium(x, y, float(x @ A64 @ y), float(x @ B64 @ y))
    raise ValueError(f"no equilibrium found to tol = {tol:g}; the game may be too degenerate for this tolerance")


def nash_gap(A, B, x, y) -> float:
    r"""The larger of the two players' best deviation gains.

    .. math:: \max\big(\max_i (Ay)_i - x^\top Ay,\ \max_j (x^\top B)_j - x^\top By\big)


    Zero exactly at a Nash equilibrium (a mixed strategy's best deviation is always a pure one). For a
    zero-sum game pass ``B = -A``; then the sum of the two gains is the *exploitability* (duality gap).
    """
    A, B = _matrix(A, "A").double(), _matrix(B, "B").double()
    x, y = as_tensor(x, "x").double(), as_tensor(y, "y").double()
    if x.shape != (A.shape[0],) or y.shape != (A.shape[1],):
        raise ValueError(f"x must be ({A.shape[0]},) and y ({A.shape[1]},), got {tuple(x.shape)} and {tuple(y.shape)}")
    gain_x = (A @ y).max() - x @ A @ y
    gain_y = (x @ B).max() - x @ B @ y
    return float(torch.maximum(gain_x, gain_y))


def multiplicative_weights(A, T: int, eta: float = 0.1, x0=None, y0=None, *, current: bool = False) -> tuple:
    r"""Self-play of the zero-sum game A by multiplicative weights (Hedge) for both players.

    Each round :math:`x_{t+1}\propto x_t e^{\eta Ay_t}`, :math:`y_{t+1}\propto y_t e^{-\eta A^\top x_t}`.
    Neither player's *last* strategy need converge (on rock-paper-scissors they cycle), but the average
    strategies :math:`\bar x_T,\bar y_T` do: their exploitability is at most the two regrets over T,
    :math:`O(\sqrt{\log(m)/T})` for :math:`\eta\propto\sqrt{\log m/T}`. ``x0`` ``(m,)`` and ``y0``
    ``(n,)`` are positive starting strategies (default uniform). Returns the running averages ``(T, m)``
    and ``(T, n)`` in float64; with ``current=True`` also the current strategies :math:`x_t, y_t`
    ``(T, m)``, ``(T, n)`` (computed in log space, so entries near 0 keep their relative precision). With a
    constant step the current strategies of a zero-sum game with an interior equilibrium spiral *away* from
    it: :math:`\mathrm{KL}(x^*\|x_t)+\mathrm{KL}(y^*\|y_t)` grows at every round (Bailey and Piliouras, 2018).

    >>> xbar, ybar, x, y = multiplicative_weights(torch.eye(2), 2, 1.0, current=True)
    >>> [round(v, 4) for v in x[1].tolist()], [round(v, 4) for v in xbar[1].tolist()]
    ([0.5, 0.5], [0.5, 0.5])
    """
    A = _matrix(A, "A").double()
    T = check_positive_int(T, "T")
    eta = check_range(eta, "eta", 0.0, low_open=True)
    m, n = A.shape
    starts = []
    for z, k, name in ((x0, m, "x0"), (y0, n, "y0")):
        z = torch.full((k,), 1.0 / k, dtype=torch.float64) if z is None else as_tensor(z, name).double()
        if z.shape != (k,) or not bool((z > 0).all()):
            raise ValueError(f"{name} must be a positive ({k},) strategy, got {z.tolist()}")
        starts.append(z.log())
    lx, ly = starts
    xs, ys = [], []
    for _ in range(T):
        x, y = torch.softmax(lx, 0), torch.softmax(ly, 0)
        xs.append(x)
        ys.append(y)
        lx, ly = lx + eta * (A @ y), ly - eta * (A.T @ x)
    steps = torch.arange(1, T + 1, dtype=torch.float64).unsqueeze(-1)
    xs, ys = torch.stack(xs), torch.stack(ys)
    if current:
        return xs.cumsum(0) / steps, ys.cumsum(0) / steps, xs, ys
    return xs.cumsum(0) / steps, ys.cumsum(0) / steps


@implements("39.02")
def minimax_value(Q, *, mixed: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    r"""Minimax value of a two-player zero-sum stage game per state.

    .. math:: V^*(s)=\max_a\min_b Q(s,a,b)

    Symbols: ``Q`` ``(..., A, B)`` the maximiser's payoff for its action a against the minimiser's b.
    Pure (default): returns ``(V, a*)`` with ``V`` ``(...)`` and the maximin action ``a*`` ``(...)``;
    the minimiser answers a, so :math:`V` is the *lower* value (below the mixed value unless the game has a
    saddle point). ``mixed=True``: the value of the mixed game :math:`\max_x\min_y x^\top Q y` per state
    (Littman's 1994 minimax-Q backup) via :func:`nash_equilibrium`, and ``None`` as the action.

    >>> minimax_value(torch.tensor([[3., 1.], [4., 2.]]))[0].item()
    2.0
    """
    Q = as_tensor(Q, "Q")
    check_dim(Q, "Q", "(..., A, B)", min_dim=2)
    if Q.shape[-1] == 0 or Q.shape[-2] == 0:
        raise ValueError(f"Q must have at least one action per player, got shape {tuple(Q.shape)}")
    check_finite(Q, "Q")
    if not mixed:
        worst = Q.min(-1).values  # (..., A): the minimiser's best answer to each a
        V, a = worst.max(-1)
        return V, a
    flat = Q.reshape(-1, *Q.shape[-2:])
    V = torch.tensor([nash_equilibrium(q).value for q in flat], dtype=torch.float64)
    return V.reshape(Q.shape[:-2]).to(Q.dtype), None


@implements("39.06")
def potential_shaping(R, Phi, gamma: float) -> torch.Tensor:
    r"""Potential-based reward shaping (Ng, Harada & Russell 1999): :math:`R'=R+F`,

    .. math:: F(s,a,s')=\gamma\Phi(s')-\Phi(s)

    Symbols: ``R`` ``(S, A, S')`` the reward table (as :class:`llmbook.agents.envs.TabularMDP` holds it),
    ``Phi`` ``(S,)`` the potential, ``gamma`` :math:`\gamma\in[0,1]`. Returns the shaped table ``(S, A, S')``.
    Along any trajectory the shaping telescopes to :math:`\gamma^T\Phi(s_T)-\Phi(s_0)`, so with the shaping
    applied on every transition (absorbing states included) :math:`Q'^*(s,a)=Q^*(s,a)-\Phi(s)` exactly and
    the greedy policy is unchanged; any F that is not of this form can change it.

    >>> potential_shaping(torch.zeros(2, 1, 2), torch.tensor([0., 1.]), 0.5)[:, 0].tolist()
    [[0.0, 0.5], [-1.0, -0.5]]
    """
    R, Phi = as_tensor(R, "R"), as_tensor(Phi, "Phi")
    check_dim(R, "R", "(S, A, S')", min_dim=3, max_dim=3)
    check_dim(Phi, "Phi", "(S,)", min_dim=1, max_dim=1)
    gamma = check_range(gamma, "gamma", 0.0, 1.0)
    S = R.shape[0]
    if R.shape[2] != S or Phi.shape[0] != S:
        raise ValueError(f"R must be (S, A, S) and Phi (S,) with one S, got {tuple(R.shape)} and {tuple(Phi.shape)}")
    dt = compute_dtype(torch.promote_types(R.dtype, Phi.dtype))
    P64 = Phi.to(dt)
    F = gamma * P64.reshape(1, 1, S) - P64.reshape(S, 1, 1)
    return (R.to(dt) + F).to(torch.promote_types(R.dtype, Phi.dtype))
