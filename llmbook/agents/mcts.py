r"""Monte Carlo tree search with UCT and PUCT selection, and tic-tac-toe with its exact minimax values.

* **UCT** (37.04, :func:`uct_score`, Kocsis and Szepesvari 2006): treat each tree node as a bandit and pick
  :math:`\arg\max_a Q(s,a)+c\sqrt{\ln N(s)/N(s,a)}` (UCB1 applied inside the tree; unvisited moves first).
* **PUCT** (37.05, :func:`puct_score`, Rosin 2011; Silver et al. 2017): a prior :math:`P(s,a)` scales the
  bonus, :math:`Q(s,a)+c_{puct}P(s,a)\sqrt{N(s)}/(1+N(s,a))`; AlphaZero's prior is its policy network.
* :func:`mcts`: the search itself (select, expand, evaluate by a random playout, back up), for any
  two-player zero-sum game with the interface of :class:`TicTacToe`; it records the move it would play after
  each of ``checkpoints`` simulations (a search with fewer simulations is a prefix of a longer one).
* :class:`TicTacToe`: boards are 9-character strings (``"X"``, ``"O"``, ``"."``), X moves first;
  :meth:`TicTacToe.negamax` is the exact game value with memoisation (the oracle MCTS is checked against).

Values are from the point of view of the player to move: +1 a win, 0 a draw, -1 a loss.

>>> TicTacToe.negamax("........."), TicTacToe.optimal_moves("XX.OO....")
(0, [2])
>>> res = mcts(TicTacToe, "XX.OO....", 200, generator=0)
>>> res.move
2
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import numpy as np
import torch

from llmbook._checks import as_tensor, check_choice, check_finite, check_positive_int, check_probability, check_range
from llmbook._precision import compute_dtype
from llmbook.registry import implements

__all__ = ["uct_score", "puct_score", "mcts", "MCTSResult", "TicTacToe", "heuristic_prior", "random_positions"]


def _uct(Q, N, N_parent, c, xp):
    """The UCT score with array module ``xp`` (numpy in the search, torch in :func:`uct_score`); ``N > 0``."""
    return Q + c * xp.sqrt(xp.log(N_parent) / N)


def _puct(Q, P, N, N_parent, c, xp):
    """The PUCT score with array module ``xp``."""
    return Q + c * P * xp.sqrt(N_parent) / (1 + N)


def _counts(Q, N, N_parent):
    """Validated ``Q`` (..., A), counts ``N`` (..., A) and ``N_parent`` broadcast to (..., 1), and the compute dtype."""
    Q = as_tensor(Q, "Q")
    check_finite(Q, "Q")
    N, Np = as_tensor(N, "N"), as_tensor(N_parent, "N_parent")
    check_finite(N, "N")
    check_finite(Np, "N_parent")
    if Q.dim() < 1 or N.shape != Q.shape:
        raise ValueError(f"N {tuple(N.shape)} must have the shape (..., A) of Q {tuple(Q.shape)}")
    try:
        Np = Np.unsqueeze(-1).expand(*Q.shape[:-1], 1) if Np.dim() else Np.expand(*Q.shape[:-1], 1)
    except RuntimeError as err:
        raise ValueError(f"N_parent {tuple(Np.shape)} must broadcast to Q.shape[:-1] = {tuple(Q.shape[:-1])}") from err
    if (N < 0).any() or (N > Np).any():
        raise ValueError("the counts must satisfy 0 <= N(s, a) <= N(s): a move is visited at most as often as its node")
    dt = compute_dtype(torch.promote_types(torch.promote_types(Q.dtype, N.dtype), Np.dtype))
    return Q.to(dt), N.to(dt), Np.to(dt), Q.dtype


@implements("37.04")
def uct_score(Q, N, N_parent, c: float = math.sqrt(2.0)) -> torch.Tensor:
    r"""UCT: the UCB1 score of every move of a tree node (Kocsis and Szepesvari 2006).

    .. math:: \mathrm{UCT}(s,a)=Q(s,a)+c\sqrt{\frac{\ln N(s)}{N(s,a)}}

    Symbols: ``Q`` = :math:`Q(s,a)` the mean outcome of the move for the player at :math:`s` ``(..., A)``;
    ``N`` = :math:`N(s,a)` its visit count (same shape); ``N_parent`` = :math:`N(s)` the node's visits,
    a number or ``(...,)``, with :math:`0\le N(s,a)\le N(s)`; ``c`` = :math:`c\ge 0` (:math:`\sqrt2` for
    outcomes in [0, 1]). A move never tried scores :math:`+\infty`. Returns ``(..., A)``.

    >>> [round(v, 4) for v in uct_score(torch.tensor([0.5, 0.0, 0.2]), torch.tensor([6.0, 1.0, 0.0]), 7.0).tolist()]
    [1.3054, 1.9728, inf]
    """
    Q, N, Np, dtype = _counts(Q, N, N_parent)
    c = check_range(c, "c", 0.0)
    score = _uct(Q, N.clamp_min(1.0), Np.clamp_min(1.0), c, torch)
    return torch.where(N > 0, score, torch.full_like(score, math.inf)).to(dtype)


@implements("37.05")
def puct_score(Q, P, N, N_parent, c_puct: float = 1.5) -> torch.Tensor:
    r"""PUCT: the prior-weighted selection score of AlphaGo Zero and AlphaZero (Rosin 2011; Silver et al. 2017).

    .. math:: \mathrm{PUCT}(s,a)=Q(s,a)+c_{puct}\,P(s,a)\,\frac{\sqrt{N(s)}}{1+N(s,a)}

    Symbols: ``Q`` ``(..., A)`` as in :func:`uct_score` (0 for an unvisited move, as in AlphaZero); ``P`` =
    :math:`P(s,a)` the prior, rows summing to 1 ``(..., A)``; ``N``, ``N_parent`` as in :func:`uct_score`;
    ``c_puct`` :math:`\ge 0`. The bonus is finite for an unvisited move: a move with a small prior may wait
    long before its first visit. Returns ``(..., A)``.

    >>> puct_score(torch.zeros(2), torch.tensor([0.75, 0.25]), torch.zeros(2), 4.0, c_puct=1.0).tolist()
    [1.5, 0.5]
    """
    Q, N, Np, dtype = _counts(Q, N, N_parent)
    P = as_tensor(P, "P")
    if P.shape != Q.shape:
        raise ValueError(f"P {tuple(P.shape)} must have the shape (..., A) of Q {tuple(Q.shape)}")
    check_finite(P, "P")
    check_probability(P, "P")
    c_puct = check_range(c_puct, "c_puct", 0.0)
    return _puct(Q, P.to(Q.dtype), N, Np, c_puct, torch).to(dtype)


# --------------------------------------------------------------------------- tic-tac-toe

_LINES = ((0, 1, 2), (3, 4, 5), (6, 7, 8), (0, 3, 6), (1, 4, 7), (2, 5, 8), (0, 4, 8), (2, 4, 6))


class TicTacToe:
    """Tic-tac-toe on a 9-character string, cells numbered 0..8 row by row; X moves first."""

    @staticmethod
    def to_move(board: str) -> str:
        return "X" if board.count("X") == board.count("O") else "O"

    @staticmethod
    def winner(board: str) -> str | None:
        for i, j, k in _LINES:
            if board[i] != "." and board[i] == board[j] == board[k]:
                return board[i]
        return None

    @staticmethod
    @functools.cache
    def moves(board: str) -> tuple[int, ...]:
        return tuple(i for i, x in enumerate(board) if x == ".")

    @staticmethod
    @functools.cache
    def play(board: str, a: int) -> str:
        if board[a] != ".":
            raise ValueError(f"cell {a} of {board!r} is taken")
        return board[:a] + TicTacToe.to_move(board) + board[a + 1:]

    @staticmethod
    @functools.cache
    def outcome(board: str) -> int | None:
        """The final value for the player to move (-1: the opponent has just won; 0: a draw), None if not over."""
        if TicTacToe.winner(board) is not None:
            return -1
        return 0 if "." not in board else None

    @staticmethod
    @functools.cache
    def negamax(board: str) -> int:
        """The exact value for the player to move, :math:`v(s)=\\max_a -v(\\mathrm{play}(s,a))`, memoised."""
        out = TicTacToe.outcome(board)
        if out is not None:
            return out
        return max(-TicTacToe.negamax(TicTacToe.play(board, a)) for a in TicTacToe.moves(board))

    @staticmethod
    def optimal_moves(board: str) -> list[int]:
        v = TicTacToe.negamax(board)
        return [a for a in TicTacToe.moves(board) if -TicTacToe.negamax(TicTacToe.play(board, a)) == v]

    @staticmethod
    def render(board: str) -> str:
        return "\n".join(" ".join(board[3 * r:3 * r + 3]) for r in range(3))


@functools.cache
def heuristic_prior(board: str, temperature: float = 1.0) -> np.ndarray:
    """A hand-made prior over the legal moves (in ``TicTacToe.moves`` order): softmax of a score that
    is 4 for a move that wins at once, 3 for one that blocks the opponent's win, 1 for the centre, 0.5 for a
    corner, 0 for an edge. A stand-in for AlphaZero's policy network."""
    me = TicTacToe.to_move(board)
    them = "O" if me == "X" else "X"
    score = []
    for a in TicTacToe.moves(board):
        s = 1.0 if a == 4 else 0.5 if a in (0, 2, 6, 8) else 0.0
        if TicTacToe.winner(board[:a] + me + board[a + 1:]) == me:
            s = 4.0
        elif TicTacToe.winner(board[:a] + them + board[a + 1:]) == them:
            s = 3.0
        score.append(s / temperature)
    z = np.exp(np.array(score) - max(score))
    return z / z.sum()


def random_positions(n: int, n_played: int, generator=0, *, decisive: bool = True) -> list[str]:
    """``n`` distinct non-terminal boards after ``n_played`` random moves (seeded); with ``decisive``, only
    boards where some legal move is not minimax-optimal (so that the choice matters)."""
    rng = np.random.default_rng(generator)
    out: list[str] = []
    for _ in range(100 * n):
        b = "........."
        for _ in range(n_played):
            if TicTacToe.outcome(b) is not None:
                break
            b = TicTacToe.play(b, int(rng.choice(TicTacToe.moves(b))))
        ok = TicTacToe.outcome(b) is None and b not in out
        if ok and (not decisive or len(TicTacToe.optimal_moves(b)) < len(TicTacToe.moves(b))):
            out.append(b)
            if len(out) == n:
                return out
    raise ValueError(f"found only {len(out)} of n = {n} positions after {n_played} moves")


# --------------------------------------------------------------------------- the search


class MCTSResult(NamedTuple):
    """``move`` played (most visits), ``moves`` legal at the root, their visits ``N`` and mean values ``Q``
    (for the player to move), and ``trace``: the move that would be played after each checkpoint."""

    move: int
    moves: list
    N: np.ndarray
    Q: np.ndarray
    trace: list


class _Node:
    __slots__ = ("board", "moves", "N", "W", "P", "children", "out")

    def __init__(self, game, board, prior):
        self.board, self.out = board, game.outcome(board)
        self.moves = [] if self.out is not None else game.moves(board)
        k = len(self.moves)
        self.N, self.W, self.children = np.zeros(k), np.zeros(k), [None] * k
        self.P = None if prior is None or not k else np.asarray(prior(board), dtype=np.float64)


def _rollout(game, board, rng) -> float:
    """A uniformly random playout; the outcome for the player to move at ``board``."""
    sign, out = 1.0, game.outcome(board)
    while out is None:
        m = game.moves(board)
        board = game.play(board, m[rng.integers(len(m))])
        sign, out = -sign, game.outcome(board)
    return sign * out


def _best(node: _Node) -> int:
    """Most visited root move; ties broken by the mean value, then by order."""
    Q = node.W / np.maximum(node.N, 1)
    return max(range(len(node.moves)), key=lambda i: (node.N[i], Q[i], -i))


def mcts(game, board, n_simulations: int, *, rule: str = "uct", c: float | None = None, prior=None,
         generator=0, checkpoints=()) -> MCTSResult:
    r"""Monte Carlo tree search from ``board`` with ``n_simulations`` simulations.

    Each simulation descends the tree by the selection ``rule`` (``"uct"``: untried moves first, then
    :func:`uct_score`, ``c`` default :math:`\sqrt2`; ``"puct"``: :func:`puct_score` with the ``prior``
    ``board -> (len(moves),)`` probabilities, default uniform, ``c`` default 1.5, unvisited moves at
    :math:`Q=0`), adds one node, evaluates it by a uniformly random playout, and backs the outcome up with
    alternating signs (zero-sum). :math:`N(s)` counts the node's own visits, :math:`1+\sum_a N(s,a)`.
    ``generator``: an int seed or ``numpy.random.Generator`` for the playouts and ties.
    """
    check_choice(rule, "rule", ("uct", "puct"))
    n_simulations = check_positive_int(n_simulations, "n_simulations")
    c = check_range(math.sqrt(2.0) if rule == "uct" and c is None else 1.5 if c is None else c, "c", 0.0)
    if game.outcome(board) is not None:
        raise ValueError(f"the game is over at {board!r}: nothing to search")
    rng = np.random.default_rng(generator)
    if rule == "puct" and prior is None:
        prior = lambda b: np.full(len(game.moves(b)), 1.0 / len(game.moves(b)))  # noqa: E731
    pri = prior if rule == "puct" else None
    root = _Node(game, board, pri)
    checks, trace = set(checkpoints), []
    for sim in range(1, n_simulations + 1):
        node, path = root, []
        while True:
            if node.out is not None:
                value = float(node.out)
                break
            if rule == "uct" and (node.N == 0).any():
                untried = np.flatnonzero(node.N == 0)
                i = int(untried[rng.integers(len(untried))])
            else:
                Np = 1.0 + node.N.sum()
                Q = node.W / np.maximum(node.N, 1.0)
                score = (_uct(Q, node.N, Np, c, np) if rule == "uct" else _puct(Q, node.P, node.N, Np, c, np))
                best = np.flatnonzero(score >= score.max() - 1e-12)
                i = int(best[rng.integers(len(best))]) if len(best) > 1 else int(best[0])
            path.append((node, i))
            if node.children[i] is None:  # expand one node and evaluate it by a playout
                node.children[i] = child = _Node(game, game.play(node.board, node.moves[i]), pri)
                value = float(child.out) if child.out is not None else _rollout(game, child.board, rng)
                break
            node = node.children[i]
        for nd, i in reversed(path):  # back up: each parent sees the negated value of its child
            value = -value
            nd.N[i] += 1.0
            nd.W[i] += value
        if sim in checks:
            trace.append(root.moves[_best(root)])
    Q = root.W / np.maximum(root.N, 1.0)
    return MCTSResult(root.moves[_best(root)], list(root.moves), root.N.copy(), Q, trace)
