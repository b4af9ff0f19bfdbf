"""Fuzz cases of chapter 33 (TD learning and value-based RL): ``llmbook.agents.td`` and ``llmbook.agents.dqn``.

Tabular tables: ``S`` states from the size symbol ``T``, ``A`` actions from ``K``, a batch of ``B``
transitions. Deep-RL batches: ``(B, K)`` action values.
"""

from __future__ import annotations

from .cases import POS_INT, PROB, Choice, Float, add

TD = "llmbook.agents.td:"
DQ = "llmbook.agents.dqn:"


def _tr(m):
    """A batch of B transitions in a table of S = T states (every third one terminal)."""
    s = m.s
    S = max(s.T, 1)
    return dict(s=m.ids(s.B, high=S), r=m.f(s.B), s_next=m.ids(s.B, high=S), done=m.ids(s.B, high=3) == 2)


def _q(m):
    d = _tr(m)
    return dict(Q=m.f(max(m.s.T, 1), max(m.s.K, 1)), **{k: d[k] for k in ("s",)}, a=m.ids(m.s.B, high=m.s.K),
                **{k: d[k] for k in ("r", "s_next", "done")})


add(TD + "td_error", lambda m: dict(r=m.f(m.s.B, m.s.T), V_s=m.f(m.s.B, m.s.T), V_next=m.f(m.s.B, m.s.T),
                                    gamma=0.9, done=m.ids(m.s.B, m.s.T, high=3) == 2),
    scalars=dict(gamma=PROB))
add(TD + "td0_update", lambda m: dict(V=m.f(max(m.s.T, 1)), **_tr(m), alpha=0.5, gamma=0.9),
    scalars=dict(alpha=PROB, gamma=PROB))
add(TD + "q_learning_update", lambda m: dict(**_q(m), alpha=0.5, gamma=0.9), scalars=dict(alpha=PROB, gamma=PROB))
add(TD + "sarsa_update", lambda m: dict(**_q(m), a_next=m.ids(m.s.B, high=m.s.K), alpha=0.5, gamma=0.9),
    scalars=dict(alpha=PROB, gamma=PROB))
add(TD + "expected_sarsa_update", lambda m: dict(**_q(m), pi_next=m.probs(m.s.B, max(m.s.K, 1)), alpha=0.5,
                                                 gamma=0.9),
    scalars=dict(alpha=PROB, gamma=PROB))

add(DQ + "double_q_target", lambda m: dict(r=m.f(m.s.B), Q_next_online=m.f(m.s.B, m.s.K),
                                           Q_next_target=m.f(m.s.B, m.s.K), gamma=0.9, done=m.ids(m.s.B, high=3) == 2),
    scalars=dict(gamma=PROB))
add(DQ + "dqn_loss", lambda m: dict(Q=m.f(m.s.B, m.s.K), a=m.ids(m.s.B, high=m.s.K), r=m.f(m.s.B),
                                    Q_next_target=m.f(m.s.B, m.s.K), gamma=0.9, done=m.ids(m.s.B, high=3) == 2,
                                    loss="huber", delta=1.0),
    scalars=dict(gamma=PROB, loss=Choice(), delta=Float(0, lo_open=True)), overflow="square",
    nan_reason="the loss squares the TD error: beyond the square root of the dtype's range it overflows, as "
               "F.mse_loss does")
add(DQ + "DuelingHead", lambda m: dict(d_in=m.s.D, n_actions=m.s.K, x=m.f(m.s.B, m.s.D)), init=("d_in", "n_actions"),
    scalars=dict(d_in=POS_INT, n_actions=POS_INT))
