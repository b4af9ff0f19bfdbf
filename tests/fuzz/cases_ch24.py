"""Fuzz cases of chapter 24 (ANN): ``llmbook.rag.kmeans``, ``ann``, ``hnsw`` and ``scann``.

Sizes: ``N = T`` database vectors, ``K`` centroids, ``B`` queries, ``D`` coordinates (PQ: ``M = 2``
sub-vectors of ``D`` coordinates each). Assignments and codes are argmins: in fp16/bf16 two centroids
at nearly equal distance may swap against the float64 computation of the same rounded input.
"""

import torch

from .cases import NONNEG, POS, add

KM, AN, HN, SC = "llmbook.rag.kmeans:", "llmbook.rag.ann:", "llmbook.rag.hnsw:", "llmbook.rag.scann:"
ARGMIN = "an argmin over distances: near-equal distances may order differently in float32 and float64"


def _xc(m):
    return dict(x=m.f(m.s.T, m.s.D), centroids=m.f(m.s.K, m.s.D))


def _adc(m):
    codes = torch.randint(0, max(m.s.K, 1), (m.s.T, 2), generator=m.g)
    return dict(y=m.f(m.s.B, 2 * m.s.D), codes=codes, codebooks=m.f(2, m.s.K, m.s.D))


add(KM + "kmeans_objective", _xc)
add(KM + "assign", _xc, lowp_int_reason=ARGMIN)
add(AN + "pq_encode", lambda m: dict(x=m.f(m.s.T, 2 * m.s.D), codebooks=m.f(2, m.s.K, m.s.D)),
    lowp_int_reason=ARGMIN)
add(AN + "pq_adc", _adc)
add(SC + "anisotropic_loss", lambda m: dict(x=m.f(m.s.T, m.s.D), x_tilde=m.f(m.s.T, m.s.D), h_par=4.0, h_perp=1.0),
    scalars=dict(h_par=NONNEG, h_perp=NONNEG))
add(HN + "greedy_step", lambda m: dict(q=m.f(m.s.D), x=m.f(m.s.T, m.s.D), neighbors=torch.arange(m.s.T)),
    lowp_int_reason=ARGMIN)
add(HN + "level_probability", lambda m: dict(l=m.f(m.s.T).abs(), lam=0.5), scalars=dict(lam=POS))
