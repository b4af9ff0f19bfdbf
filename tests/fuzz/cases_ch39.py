"""Fuzz cases of chapter 39 (multi-agent RL: ``llmbook.agents.multi_agent``, ``llmbook.agents.cooperative``).

The matrix games are small (support enumeration visits every pair of supports), so their sizes are K x K
with K the fuzz suite's small size symbol.
"""

from __future__ import annotations

from .cases import Float, Int, add

MA = "llmbook.agents.multi_agent:"
CO = "llmbook.agents.cooperative:"


def _critic(x, a):
    """A quadratic centralised critic Q(x, a) = -|a|^2 + sum(x), fine in every dtype."""
    return -(a**2).sum((-1, -2)) + x.sum(-1)


add(MA + "nash_equilibrium", lambda m: dict(A=m.f(m.s.K, m.s.K), B=m.f(m.s.K, m.s.K)),
    scalars=dict(tol=Float(0, lo_open=True)),
    lowp_skip="the equilibrium is a discrete choice of supports: rounding the payoffs to fp16 can move it")
add(MA + "minimax_value", lambda m: dict(Q=m.f(m.s.B, m.s.K, m.s.K)), scaled="Q",
    lowp_int_reason="the maximin action is an argmax: a near-tie can flip between fp16/bf16 and float64")
add(CO + "vdn", lambda m: dict(Q=m.f(m.s.B, m.s.T, m.s.K)), scaled="Q",
    lowp_int_reason="the greedy actions are argmaxes: a near-tie can flip between fp16/bf16 and float64")
add(CO + "QMixer", lambda m: dict(n_agents=m.s.T, d_s=m.s.D, embed=4, generator=m.gen(), Q=m.f(m.s.B, m.s.T),
                                  s=m.f(m.s.B, m.s.D)),
    init=("n_agents", "d_s", "embed", "generator", "dtype"),
    scalars=dict(n_agents=Int(lo=1), d_s=Int(lo=1), embed=Int(lo=1)))
add(CO + "maddpg_actor_loss", lambda m: dict(critic=_critic, x=m.f(m.s.B, m.s.D), actions=m.f(m.s.B, m.s.T, m.s.K),
                                             a_i=m.f(m.s.B, m.s.K), i=0),
    scalars=dict(i=Int(lo=0)), overflow="square",
    nan_reason="the critic squares the actions: beyond the square root of the dtype's range it overflows to "
               "inf, and -inf + inf (from x) is NaN")
add(MA + "potential_shaping", lambda m: dict(R=m.f(m.s.T, m.s.K, m.s.T), Phi=m.f(m.s.T), gamma=0.9),
    scalars=dict(gamma=Float(0, 1)))
