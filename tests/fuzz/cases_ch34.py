"""Fuzz cases of chapter 34 (policy gradients and actor-critic): llmbook.agents.policy_gradient and
llmbook.agents.continuous_control.

Tabular models: ``S`` states from the size symbol ``T``, ``A`` actions from ``K``. Rollouts ``(B, T)``; batches of
transitions ``(B,)``; action dimension ``K``, parameter count ``D``.
"""

from __future__ import annotations

import torch

from .cases import NONNEG, POS, POS_INT, PROB, Float, add

PG = "llmbook.agents.policy_gradient:"
CC = "llmbook.agents.continuous_control:"
GAMMA_LT1 = Float(0, 1, hi_open=True)


def _dones(m):
    return (torch.arange(m.s.T) % 3 == 2).expand(m.s.B, m.s.T).clone()


add(PG + "policy_gradient_theorem", lambda m: dict(P=m.probs(m.s.T, m.s.K, m.s.T), R=m.f(m.s.T, m.s.K),
                                                   theta=m.f(m.s.T, m.s.K), gamma=0.9, mu0=m.probs(m.s.T)),
    scalars=dict(gamma=GAMMA_LT1), scaled="R")
add(PG + "reinforce_loss", lambda m: dict(logp=-m.pos(m.s.B, m.s.T), G=m.f(m.s.B, m.s.T)), scaled="G",
    lowp_tol=64.0, reason="a sum over T steps of products, rounded once in fp16/bf16")
add(PG + "baseline_loss", lambda m: dict(logp=-m.pos(m.s.B, m.s.T), G=m.f(m.s.B, m.s.T), b=m.f(m.s.B, m.s.T)),
    scaled="G", lowp_tol=64.0, reason="a sum over T steps of products, rounded once in fp16/bf16")
add(PG + "actor_critic_loss", lambda m: dict(logp=-m.pos(m.s.B, m.s.T), r=m.f(m.s.B, m.s.T), V=m.f(m.s.B, m.s.T + 1),
                                             gamma=0.9, dones=_dones(m)),
    scalars=dict(gamma=PROB), scaled="r", lowp_tol=64.0, reason="a sum over T steps of products")
add(PG + "a3c_target", lambda m: dict(r=m.f(m.s.B, m.s.T), V=m.f(m.s.B, m.s.T + 1), gamma=0.9, n=None, dones=_dones(m)),
    scalars=dict(gamma=PROB))
add(PG + "trpo_step", lambda m: dict(theta_old=m.f(m.s.B, m.s.K), A=m.f(m.s.B, m.s.K), delta=0.01),
    scalars=dict(delta=POS, cg_iters=POS_INT, backtracks=POS_INT), scaled="A",
    lowp_skip="the line search accepts or halves a step by comparing a KL with delta: rounded inputs can "
              "tip a comparison and return a step of a different size")
add(CC + "ddpg_critic_loss", lambda m: dict(Q=m.f(m.s.B), r=m.f(m.s.B), Q_next=m.f(m.s.B), gamma=0.9),
    scalars=dict(gamma=PROB), overflow="square", nan_reason="a squared error: beyond the square root of the "
                                                             "dtype's range it overflows, as in torch.nn.MSELoss")
add(CC + "deterministic_policy_gradient", lambda m: dict(dQ_da=m.f(m.s.B, m.s.K), dmu_dtheta=m.f(m.s.B, m.s.K, m.s.D)),
    overflow="square", nan_reason="dQ/da times dmu/dtheta: two scaled inputs multiply")
add(CC + "td3_target", lambda m: dict(r=m.f(m.s.B), Q1_next=m.f(m.s.B), Q2_next=m.f(m.s.B), gamma=0.9),
    scalars=dict(gamma=PROB))
add(CC + "sac_objective", lambda m: dict(r=m.f(m.s.B, m.s.T), H=m.f(m.s.B, m.s.T), alpha=0.2, gamma=0.9),
    scalars=dict(alpha=NONNEG, gamma=PROB))
add(CC + "sac_soft_value", lambda m: dict(Q=m.f(m.s.B, max(m.s.K, 1)), logp=m.f(m.s.B, max(m.s.K, 1)), alpha=0.2),
    scalars=dict(alpha=NONNEG))
add(CC + "vtrace", lambda m: dict(r=m.f(m.s.B, m.s.T), V=m.f(m.s.B, m.s.T + 1), log_rho=m.f(m.s.B, m.s.T), gamma=0.9,
                                  rho_bar=1.0, c_bar=1.0, dones=_dones(m)),
    scalars=dict(gamma=PROB, rho_bar=NONNEG, c_bar=NONNEG), scaled="r")
