"""Fuzz cases of chapter 31 (GraphRAG): ``llmbook.rag.graph`` and ``llmbook.rag.graph_context``.

Graphs are dense ``(N, N)`` matrices of non-negative weights with ``N`` read from the size symbol ``T``;
modularity's matrix is symmetrised. Arithmetic runs in float64 (graph) or float32 (the layer, for
fp16/bf16), so low-precision results are the float64 results rounded once.
"""

from __future__ import annotations

from .cases import Choice, Float, add

GR = "llmbook.rag.graph:"
GC = "llmbook.rag.graph_context:"
ALPHA = Float(0, 1, hi_open=True)  # the probability of following an edge: 1 would never restart


def _sym(m):
    X = m.pos(m.s.T, m.s.T)
    return X + X.T


add(GR + "adjacency", lambda m: dict(src=m.ids(m.s.E, high=max(m.s.T, 1)), dst=m.ids(m.s.E, high=max(m.s.T, 1)),
                                      weight=m.pos(m.s.E), N=max(m.s.T, 1)))
add(GR + "pagerank", lambda m: dict(A=m.pos(m.s.T, m.s.T), d=0.85), scalars=dict(d=ALPHA))
add(GR + "personalized_pagerank", lambda m: dict(A=m.pos(m.s.T, m.s.T), v=m.pos(m.s.B, m.s.T), alpha=0.5),
    scalars=dict(alpha=ALPHA))
add(GR + "modularity", lambda m: dict(A=_sym(m), communities=m.ids(m.s.T, high=2), resolution=1.0),
    scalars=dict(resolution=Float()))
add(GR + "path_relevance", lambda m: dict(W=m.probs(m.s.T, m.s.T), path=m.ids(m.s.B, 3, high=max(m.s.T, 1))))
add(GC + "aggregate", lambda m: dict(h=m.f(m.s.B, m.s.T, m.s.D), A=m.pos(m.s.T, m.s.T), W_self=m.f(m.s.E, m.s.D),
                                     W_neigh=m.f(m.s.E, m.s.D), activation="tanh"),
    scalars=dict(activation=Choice()))
