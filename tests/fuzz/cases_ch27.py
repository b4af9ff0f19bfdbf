"""Fuzz cases of chapter 27 (chunking and context packing): ``llmbook.rag.chunking``, ``llmbook.rag.packing``.

``T`` is the sequence length (tokens, sentences or passages), ``D`` the embedding width. The window
functions take integer sizes only; the knapsack takes integer token lengths (``m.ids``) and sums its
utilities in float64, so fp16/bf16 inputs select exactly what their float64 upcast selects.
"""

from __future__ import annotations

from .cases import NONNEG_INT, POS_INT, PROB, Float, add

CK = "llmbook.rag.chunking:"
PK = "llmbook.rag.packing:"

add(CK + "fixed_size_chunks", lambda m: dict(x=m.f(m.s.T), L=3, S=2), scalars=dict(L=POS_INT, S=POS_INT))
add(CK + "window_coverage", lambda m: dict(T=m.s.T, L=3, S=2), scalars=dict(T=NONNEG_INT, L=POS_INT, S=POS_INT))
add(CK + "semantic_boundaries", lambda m: dict(e=m.f(m.s.T, m.s.D), tau=0.5), scalars=dict(tau=Float(0, 2)),
    lowp_int_reason="a distance within rounding of tau may fall on either side of the cut in fp16/bf16")
add(PK + "knapsack", lambda m: dict(u=m.f(m.s.T), l=m.ids(m.s.T, high=5), B=6), scalars=dict(B=NONNEG_INT))
add(PK + "lost_in_middle_weight", lambda m: dict(pos=m.pos(m.s.T), L=4.0, alpha=0.5, beta=0.5),
    scalars=dict(L=Float(0, lo_open=True), alpha=Float(), beta=Float()))
add(PK + "compression_score", lambda m: dict(rel=m.f(m.s.B, m.s.T), length=m.f(m.s.T), lam=0.5),
    scalars=dict(lam=PROB))
