"""Tests of llmbook.agents.mcts: the selection scores against math-module formulas, tic-tac-toe's memoised
negamax against plain unmemoised minimax and the known game counts, and MCTS against exact minimax."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from llmbook.agents import mcts as M

T3 = M.TicTacToe


def plain_minimax(board: str, player: str) -> int:
    """Unmemoised minimax from X's point of view (X maximises), with its own win check: the oracle."""
    lines = [(0, 1, 2), (3, 4, 5), (6, 7, 8), (0, 3, 6), (1, 4, 7), (2, 5, 8), (0, 4, 8), (2, 4, 6)]
    for line in lines:
        cells = {board[i] for i in line}
        if cells == {"X"}:
            return 1
        if cells == {"O"}:
            return -1
    free = [i for i in range(9) if board[i] == "."]
    if not free:
        return 0
    vals = [plain_minimax(board[:i] + player + board[i + 1:], "O" if player == "X" else "X") for i in free]
    return max(vals) if player == "X" else min(vals)


def count_games(board: str = ".........") -> tuple[int, int, int]:
    """(X wins, O wins, draws) over all complete games from ``board``."""
    out = T3.outcome(board)
    if out is not None:
        w = T3.winner(board)
        return (int(w == "X"), int(w == "O"), int(w is None))
    tot = [0, 0, 0]
    for a in T3.moves(board):
        for i, c in enumerate(count_games(T3.play(board, a))):
            tot[i] += c
    return tuple(tot)


@pytest.mark.equation("37.04", oracle="Q + c sqrt(ln N(s) / N(s,a)) with the math module, element by element (1e-12)")
def test_uct_score_against_math():
    rng = np.random.default_rng(0)
    Q = rng.uniform(-1, 1, size=(4, 6))
    N = rng.integers(0, 9, size=(4, 6)).astype(float)
    Np = N.sum(-1) + 1
    out = M.uct_score(torch.tensor(Q), torch.tensor(N), torch.tensor(Np), c=1.3).numpy()
    for i in range(4):
        for a in range(6):
            ref = math.inf if N[i, a] == 0 else Q[i, a] + 1.3 * math.sqrt(math.log(Np[i]) / N[i, a])
            assert out[i, a] == ref or abs(out[i, a] - ref) < 1e-12
    with pytest.raises(ValueError, match="N\\(s, a\\) <= N\\(s\\)"):
        M.uct_score(torch.zeros(2), torch.tensor([3.0, 1.0]), 2.0)
    with pytest.raises(ValueError):
        M.uct_score(torch.zeros(2), torch.tensor([-1.0, 1.0]), 2.0)


@pytest.mark.equation("37.05", oracle="Q + c P sqrt(N(s)) / (1 + N(s,a)) with the math module, elementwise (1e-12)")
def test_puct_score_against_math():
    rng = np.random.default_rng(1)
    Q = rng.uniform(-1, 1, size=(3, 5))
    P = rng.dirichlet(np.ones(5), size=3)
    N = rng.integers(0, 7, size=(3, 5)).astype(float)
    Np = N.sum(-1)
    out = M.puct_score(torch.tensor(Q), torch.tensor(P), torch.tensor(N), torch.tensor(Np), c_puct=2.0).numpy()
    for i in range(3):
        for a in range(5):
            assert abs(out[i, a] - (Q[i, a] + 2.0 * P[i, a] * math.sqrt(Np[i]) / (1 + N[i, a]))) < 1e-12
    with pytest.raises(ValueError):
        M.puct_score(torch.zeros(2), torch.tensor([0.7, 0.7]), torch.zeros(2), 1.0)


def test_negamax_against_plain_minimax_and_game_counts():
    assert count_games() == (131184, 77904, 46080)  # the 255,168 games of tic-tac-toe
    assert T3.negamax(".........") == 0 == plain_minimax(".........", "X")
    for b in M.random_positions(25, 3, generator=5, decisive=False):
        sign = 1 if T3.to_move(b) == "X" else -1
        assert T3.negamax(b) == sign * plain_minimax(b, T3.to_move(b))
        for a in T3.moves(b):  # the optimal set: exactly the moves whose successor keeps the value
            nb = T3.play(b, a)
            assert (a in T3.optimal_moves(b)) == (sign * plain_minimax(nb, T3.to_move(nb)) == T3.negamax(b))


@pytest.mark.equation("37.04", oracle="exact minimax (plain unmemoised recursion) on 16 random tic-tac-toe positions")
@pytest.mark.equation("37.05", oracle="exact minimax (plain unmemoised recursion) on 16 random tic-tac-toe positions")
def test_mcts_agrees_with_minimax_at_enough_simulations():
    pos = M.random_positions(16, 3, generator=0)
    checks = (1, 1000)
    for rule, prior in (("uct", None), ("puct", None), ("puct", M.heuristic_prior)):
        hits = np.zeros(2)
        for i, b in enumerate(pos):
            sign = 1 if T3.to_move(b) == "X" else -1
            best = sign * plain_minimax(b, T3.to_move(b))
            res = M.mcts(T3, b, 1000, rule=rule, prior=prior, generator=i, checkpoints=checks)
            assert res.N.sum() == 1000
            for j, m in enumerate(res.trace):
                nb = T3.play(b, m)
                hits[j] += sign * plain_minimax(nb, T3.to_move(nb)) == best
        assert hits[1] >= 15, (rule, hits)  # at 1000 simulations at most one miss of 16
        assert hits[1] > hits[0], (rule, hits)


def test_mcts_finds_forced_moves_and_is_anytime():
    assert M.mcts(T3, "XX.OO....", 300, generator=0).move == 2  # win at once
    assert M.mcts(T3, "XX..O....", 300, generator=0).move == 2  # O must block
    assert M.mcts(T3, "XX..O....", 300, rule="puct", generator=0).move == 2
    b = ".O.X....."
    long = M.mcts(T3, b, 60, generator=3, checkpoints=(5, 20, 60))
    assert long.trace == [M.mcts(T3, b, n, generator=3).move for n in (5, 20, 60)]
    with pytest.raises(ValueError):
        M.mcts(T3, "XXXOO....", 10)
    with pytest.raises(ValueError):
        M.mcts(T3, b, 10, rule="ucb")


@pytest.mark.parametrize("rule", ["uct", "puct"])
def test_search_selects_by_the_registered_score(rule):
    """One more simulation visits the root move that the registered score ranks first."""
    b, checked = "..O.X....", 0
    for n in (20, 41, 77):
        res = M.mcts(T3, b, n, rule=rule, generator=1)
        nxt = M.mcts(T3, b, n + 1, rule=rule, generator=1)
        Np = torch.tensor(1.0 + res.N.sum(), dtype=torch.float64)
        Q, N = torch.tensor(res.Q), torch.tensor(res.N)
        score = M.uct_score(Q, N, Np) if rule == "uct" else M.puct_score(Q, torch.full_like(Q, 1 / len(Q)), N, Np)
        if (score == score.max()).sum() == 1 and (N > 0).all():
            assert np.flatnonzero(nxt.N - res.N).tolist() == [int(score.argmax())]
            checked += 1
    assert checked >= 2


def test_heuristic_prior():
    p = M.heuristic_prior("XX..O....")  # O to move: cell 2 blocks
    assert abs(p.sum() - 1) < 1e-12 and T3.moves("XX..O....")[int(p.argmax())] == 2


def test_try_it_numbers():
    from tests.try_it import assert_states

    u = M.uct_score(torch.tensor([0.5, 0.2], dtype=torch.float64), torch.tensor([8.0, 2.0], dtype=torch.float64), 10.0)
    p = M.puct_score(torch.tensor([0.2, 0.5], dtype=torch.float64), torch.tensor([0.9, 0.1], dtype=torch.float64),
                     torch.tensor([3.0, 3.0], dtype=torch.float64), 7.0, c_puct=1.5)
    assert u.argmax() == 1 and p.argmax() == 0
    assert_states("37-planning.ipynb", [f"{v:.4f}" for v in u.tolist() + p.tolist()])
