"""Fuzz cases of chapter 42 (memory for agents): ``llmbook.agents.memory``."""

import torch

from .cases import NONNEG, POS, POS_INT, Float, add

ME = "llmbook.agents.memory:"

add(ME + "memory_read", lambda m: dict(q=m.f(m.s.B, m.s.D), K=m.f(m.s.B, m.s.T, m.s.D), M=m.f(m.s.B, m.s.T, m.s.C),
                                       scale=1.0),
    scalars=dict(scale=POS), overflow="square",
    nan_reason="q meets K in the product q.k (scale 1, as in memory networks): beyond the square root of the "
               "dtype's range the scores overflow, as in torch's scaled_dot_product_attention")
add(ME + "episodic_score", lambda m: dict(rel=m.f(m.s.B, m.s.K), recency=m.f(m.s.B, m.s.K), salience=m.f(m.s.B, m.s.K),
                                          lambda_r=1.0, lambda_t=0.5, lambda_s=0.25),
    scalars=dict(lambda_r=NONNEG, lambda_t=NONNEG, lambda_s=NONNEG))
add(ME + "exponential_decay", lambda m: dict(t=3.0, t_i=-m.f(m.s.B, m.s.K).abs(), lam=0.2),
    scalars=dict(lam=NONNEG))
add(ME + "write_decision", lambda m: dict(m=m.f(m.s.B, m.s.D), M_mem=m.f(m.s.K, m.s.D), importance=m.f(m.s.B),
                                          tau_n=0.1, tau_i=0.0),
    scalars=dict(tau_n=Float(0, 2), tau_i=Float()))
add(ME + "retrieval_augmented_policy",
    lambda m: dict(scores=m.f(m.s.B, m.s.K), memory=torch.arange(m.s.K) % 3 != 1, k=2, tau=0.5),
    scalars=dict(k=POS_INT, tau=POS))
