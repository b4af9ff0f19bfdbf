"""Fuzz cases of chapter 28 (diversity): ``llmbook.rag.diversity``."""

import torch

from .cases import NONNEG_INT, PROB, add

DV = "llmbook.rag.diversity:"


def _kernel(m):
    """A well-conditioned PSD kernel of N = T items, X X^T / D + I / 2, built in the case dtype."""
    X = m.f(m.s.T, m.s.D)
    return X @ X.T / max(m.s.D, 1) + 0.5 * torch.eye(m.s.T, dtype=X.dtype)


def _mmr(m):
    X = m.f(m.s.T, m.s.D)
    return dict(sim_q=m.f(m.s.T), sim_d=X @ X.T, k=min(2, m.s.T), lam=0.5)


def _subset(m):
    L = _kernel(m)
    return dict(L=L, Y=torch.randperm(m.s.T, generator=m.g)[:min(2, m.s.T)])


add(DV + "mmr", _mmr, scalars=dict(k=NONNEG_INT, lam=PROB))
add(DV + "dpp_probability", _subset)
add(DV + "dpp_marginal_kernel", lambda m: dict(L=_kernel(m)))
