"""Fuzz cases of chapter 35 (returns and advantage estimation): llmbook.agents.returns."""

from __future__ import annotations

import torch

from .cases import POS_INT, PROB, add

RT = "llmbook.agents.returns:"


def _dones(m):
    """Termination flags (B, T): every third step ends an episode (so rows hold several episodes)."""
    return (torch.arange(m.s.T) % 3 == 2).expand(m.s.B, m.s.T).clone()


add(RT + "advantage", lambda m: dict(Q=m.f(m.s.B, m.s.T), V=m.f(m.s.B, m.s.T)))
add(RT + "monte_carlo_return", lambda m: dict(r=m.f(m.s.B, m.s.T), gamma=0.9, dones=_dones(m)),
    scalars=dict(gamma=PROB))
add(RT + "n_step_return", lambda m: dict(r=m.f(m.s.B, m.s.T), V=m.f(m.s.B, m.s.T + 1), n=2, gamma=0.9,
                                         dones=_dones(m)),
    scalars=dict(n=POS_INT, gamma=PROB))
add(RT + "lambda_return", lambda m: dict(r=m.f(m.s.B, m.s.T), V=m.f(m.s.B, m.s.T + 1), lam=0.95, gamma=0.9,
                                         dones=_dones(m)),
    scalars=dict(lam=PROB, gamma=PROB))
