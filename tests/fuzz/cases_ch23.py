"""Fuzz cases of chapter 23 (hybrid search and fusion): ``llmbook.rag.fusion`` and ``llmbook.rag.learned_fusion``.

Runs are ``(B, N)`` score matrices with ``N`` read from the size symbol ``T``; several runs are passed as an
``(M, B, N)`` tensor (M = 2: a sparse and a dense run). Outputs are float64 in every input dtype: fp16/bf16
scores are upcast before normalising or ranking, so they fuse exactly as their float64 upcast.
"""

from __future__ import annotations

from .cases import NONNEG, PROB, Choice, Float, add

FU = "llmbook.rag.fusion:"

add(FU + "convex_fusion", lambda m: dict(s_dense=m.f(m.s.B, m.s.T), s_sparse=m.f(m.s.B, m.s.T, scale=5.0), lam=0.3,
                                         norm="minmax"),
    scalars=dict(lam=PROB, norm=Choice()))
add(FU + "normalized_fusion", lambda m: dict(runs=m.f(2, m.s.B, m.s.T), norm="zscore"), scalars=dict(norm=Choice()))
add(FU + "reciprocal_rank_fusion", lambda m: dict(runs=m.f(2, m.s.B, m.s.T), k=60.0, ties="min"),
    scalars=dict(k=NONNEG, ties=Choice()))
add("llmbook.rag.learned_fusion:linear_fusion", lambda m: dict(phi=m.f(m.s.B, m.s.T, m.s.F), w=m.f(m.s.F), b=0.5),
    scalars=dict(b=Float()))
