"""Fuzz cases of chapter 41 (reward modelling for agents): ``llmbook.agents.reward_models``.

Rankings are ``(B, K)`` with ``K`` read from the size symbol ``T``; step logits ``(B, T)``; labels are 0/1
floats (soft labels in [0, 1] are valid too).
"""

import torch

from .cases import NONNEG, Choice, add

RM = "llmbook.agents.reward_models:"
REDUCTION = dict(reduction=Choice())


def _perm(m):
    B, K = m.s.B, m.s.T
    if not B:
        return torch.zeros(0, K, dtype=torch.long)
    return torch.stack([torch.randperm(K, generator=m.g) for _ in range(B)])


def _labels(m, *shape):
    return (m.f(*shape) > 0).to(m.dt)


add(RM + "plackett_luce_probability", lambda m: dict(s=m.f(m.s.B, m.s.T), pi=_perm(m)))
add(RM + "pairwise_margin_loss", lambda m: dict(r_w=m.f(m.s.B), r_l=m.f(m.s.B), margin=0.5),
    scalars=dict(margin=NONNEG, **REDUCTION))
add(RM + "process_reward_loss", lambda m: dict(logits=m.f(m.s.B, m.s.T), y=_labels(m, m.s.B, m.s.T),
                                               mask=torch.ones(m.s.B, m.s.T, dtype=torch.bool)),
    scalars=REDUCTION)
add(RM + "outcome_reward_loss", lambda m: dict(logits=m.f(m.s.B), y=_labels(m, m.s.B)), scalars=REDUCTION)
