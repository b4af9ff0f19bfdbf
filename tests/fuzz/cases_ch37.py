"""Fuzz cases of chapter 37 (planning and tree search: ``llmbook.agents.mcts``, ``llmbook.agents.mpc``).

The dynamic-programming cases of chapter 37 (``llmbook.agents.dynamic_programming``) are in cases_ch32.py.
Visit counts are non-negative integers, the parent's count one more than the sum of its moves' counts.
"""

from __future__ import annotations

from .cases import Float, Int, add

MC = "llmbook.agents.mcts:"
MP = "llmbook.agents.mpc:"


def _counts(m):
    N = m.f(m.s.B, m.s.K).abs().round()
    return N, N.sum(-1) + 1


def _uct(m):
    N, Np = _counts(m)
    return dict(Q=m.f(m.s.B, m.s.K), N=N, N_parent=Np, c=1.4)


def _puct(m):
    N, Np = _counts(m)
    return dict(Q=m.f(m.s.B, m.s.K), P=m.probs(m.s.B, m.s.K), N=N, N_parent=Np, c_puct=1.5)


add(MC + "uct_score", _uct, scalars=dict(c=Float(0)), scaled="Q")
add(MC + "puct_score", _puct, scalars=dict(c_puct=Float(0)), scaled="Q")
add(MP + "mpc_plan", lambda m: dict(P=m.probs(m.s.T, m.s.K, m.s.T), R=m.f(m.s.T, m.s.K, m.s.T),
                                    d0=m.probs(m.s.B, m.s.T), H=2, gamma=0.9),
    scalars=dict(H=Int(lo=1), gamma=Float(0, 1), tie_tol=Float(0)), scaled="R",
    lowp_int_reason="the plan is an argmax over expected returns computed from rounded P, R: a near-tie "
                    "can flip between fp16/bf16 and float64")
