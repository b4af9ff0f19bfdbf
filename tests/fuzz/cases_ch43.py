"""Fuzz cases of chapter 43 (risk and safety: ``llmbook.agents.safety``).

Tabular models as in cases_ch32.py: ``S`` states from the size symbol ``T``, ``A`` actions from ``K``; ``P``
and ``pi`` are softmax rows, rewards and costs N(0, 1); the model arithmetic runs in float64. CVaR takes
``(B, T)`` samples, the handoff rule ``(B, T)`` probabilities and risk scores, the classifier ``(B, T, D)``
features.
"""

from __future__ import annotations

from .cases import Float, Int, add

SF = "llmbook.agents.safety:"
GAMMA_LT1 = Float(0, 1, hi_open=True)


def _cmdp(m):
    s = m.s
    return dict(P=m.probs(s.T, s.K, s.T), R=m.f(s.T, s.K, s.T), C=m.f(s.T, s.K), gamma=0.9, mu0=m.probs(s.T), d=0.5)


add(SF + "cmdp_values", lambda m: dict(**_cmdp(m), pi=m.probs(m.s.T, m.s.K)),
    scalars=dict(gamma=GAMMA_LT1, d=Float()), scaled="R")
add(SF + "lagrangian_dual_ascent", lambda m: dict(**_cmdp(m), lr=0.1, n_iter=3),
    scalars=dict(gamma=GAMMA_LT1, d=Float(), lr=Float(0, lo_open=True), n_iter=Int(lo=1), lam0=Float(0)),
    scaled="R",
    lowp_int_reason="the greedy policies are argmaxes over lookaheads computed from rounded P, R, C: a near-tie "
                    "can flip between fp16/bf16 and float64, and lambda follows the policy's cost")
add(SF + "cvar", lambda m: dict(X=m.f(m.s.B, m.s.T), alpha=0.3), scalars=dict(alpha=Float(0, 1, lo_open=True)))
add(SF + "handoff", lambda m: dict(p_error=m.probs(m.s.B, m.s.T), risk=m.f(m.s.B, m.s.T), tau_e=0.1, tau_r=0.5),
    scalars=dict(tau_e=Float(), tau_r=Float(inf_ok=True)), scaled="risk",
    lowp_int_reason="the decision compares rounded probabilities and scores with the thresholds: a value "
                    "within rounding of a threshold can flip between fp16/bf16 and float64")
add(SF + "safety_probability", lambda m: dict(h=m.f(m.s.B, m.s.T, m.s.D), w=m.f(m.s.D), b=0.1),
    scalars=dict(b=Float()))
