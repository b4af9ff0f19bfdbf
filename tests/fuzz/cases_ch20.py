"""Fuzz cases of chapter 20 (similarity and distance): ``llmbook.rag.similarity``.

Every function takes ``x`` ``(B, N, D)`` and ``y`` ``(B, M, D)``; here ``N = T`` and ``M = E`` so that
the degenerate-size mutations reach B, N, M and D. Jaccard and Hamming take bool codes (the sets and
binary codes they are for); a bool tensor gets no dtype mutations from the harness, only sizes.
"""

import torch

from .cases import Choice, Float, add

SI = "llmbook.rag.similarity:"


def _xy(m):
    return dict(x=m.f(m.s.B, m.s.T, m.s.D), y=m.f(m.s.B, m.s.E, m.s.D))


def _codes(m):
    return dict(x=m.f(m.s.B, m.s.T, m.s.D) > 0, y=m.f(m.s.B, m.s.E, m.s.D) > 0)


def _sigma(m):
    A = m.f(m.s.D, m.s.D).double()
    Sigma = A @ A.T / max(m.s.D, 1) + torch.eye(m.s.D, dtype=torch.float64)
    return dict(**_xy(m), Sigma=((Sigma + Sigma.T) / 2).to(m.dt))


add(SI + "cosine_similarity", _xy, scalars=dict(eps=Float(0, 1, lo_open=True)))
add(SI + "dot_product", _xy)
add(SI + "euclidean_distance", _xy, scalars=dict(method=Choice()))
add(SI + "manhattan_distance", _xy)
add(SI + "minkowski_distance", lambda m: dict(**_xy(m), p=3.0), scalars=dict(p=Float(1, inf_ok=True)))
add(SI + "jaccard_similarity", _codes)
add(SI + "hamming_distance", _codes)
add(SI + "mahalanobis_distance", _sigma, scalars=dict(method=Choice()))
add(SI + "angular_distance", _xy, scalars=dict(method=Choice()))
