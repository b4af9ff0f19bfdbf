"""Fuzz cases of chapter 32 (MDPs and POMDPs: ``llmbook.agents.mdp``, ``llmbook.agents.pomdp``) and of the
dynamic programming of chapter 37 (``llmbook.agents.dynamic_programming``), written together.

Tabular models: ``S`` states from the size symbol ``T``, ``A`` actions from ``K``, observations from ``E``.
``P``, ``pi``, ``O`` and beliefs are softmax rows; rewards are N(0, 1) and are the tensor the NaN-free check
rescales. Arithmetic runs in float64, so low-precision results are the float64 results rounded once.
"""

from __future__ import annotations

from .cases import Choice, Float, Int, add  # noqa: F401

MD = "llmbook.agents.mdp:"
PO = "llmbook.agents.pomdp:"
DP = "llmbook.agents.dynamic_programming:"
GAMMA = Float(0, 1)
GAMMA_LT1 = Float(0, 1)
TOL = Float(0, lo_open=True)
TIES = dict(lowp_int_reason="the greedy action is an argmax over lookaheads computed from rounded P, R: "
                            "a near-tie can flip between fp16/bf16 and float64")


def _m(m):
    s = m.s
    return dict(P=m.probs(s.T, s.K, s.T), R=m.f(s.T, s.K, s.T))


add(MD + "make_mdp", lambda m: dict(**_m(m), gamma=0.9), scalars=dict(gamma=GAMMA), scaled="R")
add(MD + "empirical_transition", lambda m: dict(s=m.ids(m.s.B * 4, high=m.s.T), a=m.ids(m.s.B * 4, high=m.s.K),
                                                s_next=m.ids(m.s.B * 4, high=m.s.T), S=max(m.s.T, 1), A=max(m.s.K, 1)),
    scalars=dict(S=Int(lo=1), A=Int(lo=1)))
add(MD + "discounted_return", lambda m: dict(r=m.f(m.s.B, m.s.T), gamma=0.9), scalars=dict(gamma=GAMMA))
add(MD + "state_value", lambda m: dict(**_m(m), pi=m.probs(m.s.T, m.s.K), gamma=0.9),
    scalars=dict(gamma=GAMMA, horizon=Int(lo=0), tol=TOL, max_iter=Int(lo=1)), scaled="R")
add(MD + "action_value", lambda m: dict(**_m(m), pi=m.probs(m.s.T, m.s.K), gamma=0.9),
    scalars=dict(gamma=GAMMA, tol=TOL, max_iter=Int(lo=1)), scaled="R")
add(MD + "bellman_expectation", lambda m: dict(V=m.f(m.s.B, m.s.T), **_m(m), pi=m.probs(m.s.T, m.s.K), gamma=0.9),
    scalars=dict(gamma=GAMMA))
add(MD + "bellman_optimality_v", lambda m: dict(V=m.f(m.s.B, m.s.T), **_m(m), gamma=0.9), scalars=dict(gamma=GAMMA))
add(MD + "bellman_optimality_q", lambda m: dict(Q=m.f(m.s.B, m.s.T, m.s.K), **_m(m), gamma=0.9),
    scalars=dict(gamma=GAMMA))

add(PO + "make_pomdp", lambda m: dict(T=m.probs(m.s.T, m.s.K, m.s.T), R=m.f(m.s.T, m.s.K),
                                      O=m.probs(m.s.K, m.s.T, m.s.E), gamma=0.9, b0=m.probs(m.s.T)),
    scalars=dict(gamma=GAMMA), scaled="R")
add(PO + "belief_update", lambda m: dict(b=m.probs(m.s.B, m.s.T), a=max(m.s.K - 1, 0), o=max(m.s.E - 1, 0),
                                         T=m.probs(m.s.T, m.s.K, m.s.T), O=m.probs(m.s.K, m.s.T, m.s.E)),
    scalars=dict(a=Int(lo=0), o=Int(lo=0)))

add(DP + "value_iteration", lambda m: dict(**_m(m), gamma=0.9),
    scalars=dict(gamma=GAMMA_LT1, tol=TOL, max_iter=Int(lo=1), tie_tol=Float(0)), scaled="R", **TIES)
add(DP + "policy_evaluation", lambda m: dict(**_m(m), pi=m.probs(m.s.T, m.s.K), gamma=0.9),
    scalars=dict(gamma=GAMMA_LT1, tol=TOL, max_iter=Int(lo=1)), scaled="R")
add(DP + "policy_improvement", lambda m: dict(**_m(m), V=m.f(m.s.T), gamma=0.9),
    scalars=dict(gamma=GAMMA, tie_tol=Float(0)), **TIES)
