r"""Hybrid search: fusing a sparse and a dense run into one ranking (chapter 23).

BM25 scores are unbounded sums of idf-weighted term matches (a query of rare words scores 20, a query
of common words 3); cosine scores live in :math:`[-1, 1]` and crowd into a narrow band. Added raw, the
run with the larger spread decides the ranking alone. The fusions here put the runs on one footing:

* **Convex hybrid score** (23.01, :func:`convex_fusion`): :math:`\lambda s_{dense} + (1-\lambda) s_{sparse}`
  after a per-query normalisation (min-max by default, as Weaviate's relative-score fusion and the
  Elasticsearch/OpenSearch linear combiners do; ``norm="none"`` is the raw sum).
* **Weighted normalised fusion** (23.02, :func:`normalized_fusion`): :math:`\sum_m w_m (s_m-\mu_m)/\sigma_m`,
  a z-score per run and per query (population standard deviation, as ``scipy.stats.zscore``), or min-max.
* **Reciprocal rank fusion** (23.03, :func:`reciprocal_rank_fusion`, Cormack, Clarke & Buettcher 2009):
  :math:`\sum_r 1/(k+\mathrm{rank}_r(d))` with :math:`k=60`: only ranks matter, no scores at all.
* **Learned linear fusion** (23.04) fits its weights on labelled queries; it lives in
  :mod:`llmbook.rag.learned_fusion`, with the held-out evaluation that any fitted fusion needs.
* :func:`hybrid_scores` merges a sparse and a dense run by name (``"rrf"`` with :math:`k=60`, the default,
  ``"zscore"`` or ``"convex"``); the part's pipeline (:func:`llmbook.rag.pipeline.hybrid_scores`) uses
  ``"zscore"``. Neither fits anything on the book's labelled queries.

Conventions: every run is a ``(B, N)`` score matrix (query rows, document columns); several runs are a
sequence of them or an ``(M, B, N)`` tensor. ``-inf`` means *not retrieved* (the convention of
:mod:`llmbook.rag.metrics`). Normalisation statistics use only the retrieved documents of a row. A document
missing from one run but retrieved by another gets, from the run that missed it, that run's lowest
normalised score in the row (min-max: 0) in score fusion, and nothing (rank :math:`\infty`) in RRF; a document
retrieved by no run with positive weight stays ``-inf``. Ties in RRF follow ``ties``: ``"ordinal"`` (the
default) ranks equal scores by column order, as chapter 26's stable sort does; ``"min"`` gives them all the
best rank of the group, ``"average"`` the mean rank. Arithmetic is float64 and results are float64.

>>> s_sparse = torch.tensor([[12.0, 3.0, -math.inf]])
>>> s_dense = torch.tensor([[0.2, 0.5, 0.4]])
>>> reciprocal_rank_fusion([s_sparse, s_dense], k=60).mul(1e4).round().tolist()
[[323.0, 325.0, 161.0]]
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

from llmbook._checks import (
    as_tensor,
    check_choice,
    check_dim,
    check_finite,
    check_positive_int,
    check_range,
    check_same_shape,
    check_unit_interval,
)
from llmbook.registry import implements

__all__ = ["NORMS", "TIES", "normalize_scores", "convex_fusion", "normalized_fusion", "reciprocal_rank_fusion",
           "rank_matrix", "hybrid_scores"]

#: Per-query normalisations of a run.
NORMS = ("zscore", "minmax", "none")
#: How RRF ranks equal scores.
TIES = ("ordinal", "min", "average")


# ----------------------------------------------------------------------------------------------- inputs


def _scores(x, name: str) -> Tensor:
    """One run as a float64 ``(B, N)`` tensor; NaN and +inf rejected, -inf (not retrieved) allowed."""
    t = as_tensor(x, name)
    check_dim(t, name, "(B, N)", min_dim=2, max_dim=2)
    check_finite(t, name, allow_neg_inf=True)
    return t.double()


def _runs(runs, name: str = "runs") -> Tensor:
    """Several runs as one float64 ``(M, B, N)`` tensor (from a sequence of ``(B, N)`` or a 3-d tensor)."""
    if isinstance(runs, Tensor):
        check_dim(runs, name, "(M, B, N)", min_dim=3, max_dim=3)
        S = torch.stack([_scores(r, f"{name}[{m}]") for m, r in enumerate(runs)]) if len(runs) else None
    elif isinstance(runs, Sequence) and not isinstance(runs, (str, bytes)):
        S = [_scores(r, f"{name}[{m}]") for m, r in enumerate(runs)]
        for m, r in enumerate(S[1:], 1):
            check_same_shape(S[0], r, f"{name}[0]", f"{name}[{m}]")
        S = torch.stack(S) if S else None
    else:
        raise TypeError(f"{name} must be a sequence of (B, N) score matrices or an (M, B, N) tensor, "
                        f"got {type(runs).__name__}")
    if S is None:
        raise ValueError(f"{name} must hold at least one run, got none")
    return S


def _weights(weights, M: int) -> Tensor:
    if weights is None:
        return torch.ones(M, dtype=torch.float64)
    w = as_tensor(weights, "weights").double()
    check_dim(w, "weights", f"(M,) = ({M},), one per run", min_dim=1, max_dim=1)
    if w.shape[0] != M:
        raise ValueError(f"weights must have one entry per run, M = {M}, got {w.shape[0]}")
    check_finite(w, "weights")
    if (w < 0).any():
        raise ValueError(f"weights must be >= 0, got {w.tolist()}")
    return w


# ----------------------------------------------------------------------------------------------- normalise


def normalize_scores(s, norm: str = "zscore") -> Tensor:
    r"""Normalise each row (query) of a run over its retrieved documents; ``-inf`` stays ``-inf``.

    ``"zscore"``: :math:`(s-\mu)/\sigma` with the population :math:`\sigma` (``scipy.stats.zscore``,
    sklearn's ``StandardScaler``); ``"minmax"``: :math:`(s-\min)/(\max-\min)` in :math:`[0, 1]`
    (``MinMaxScaler``); ``"none"``: unchanged. A row whose retrieved scores are all equal maps to 0 (as
    sklearn's scalers do; scipy would give NaN). Shape ``(B, N)`` in, float64 ``(B, N)`` out.

    >>> normalize_scores(torch.tensor([[1.0, 2.0, 3.0, -math.inf]]), "minmax").tolist()
    [[0.0, 0.5, 1.0, -inf]]
    """
    s = _scores(s, "s")
    check_choice(norm, "norm", NORMS)
    if norm == "none" or s.numel() == 0:
        return s
    ok = torch.isfinite(s)
    x = torch.where(ok, s, 0.0)
    # divide by the row's largest |score| first: z-score and min-max are scale-free, and 1e300 cannot overflow
    scale = x.abs().amax(dim=1, keepdim=True).clamp_min(torch.finfo(torch.float64).tiny)
    x = x / scale
    n = ok.sum(dim=1, keepdim=True)
    if norm == "zscore":
        mu = x.sum(dim=1, keepdim=True) / n.clamp_min(1)
        dev = torch.where(ok, x - mu, 0.0)
        sigma = (dev.square().sum(dim=1, keepdim=True) / n.clamp_min(1)).sqrt()
        flat = sigma <= 16 * torch.finfo(torch.float64).eps  # all equal up to rounding of the mean
        z = dev / torch.where(flat, 1.0, sigma)
        out = torch.where(flat, 0.0, z)
    else:
        lo = torch.where(ok, x, math.inf).amin(dim=1, keepdim=True)
        hi = torch.where(ok, x, -math.inf).amax(dim=1, keepdim=True)
        span = hi - lo
        flat = ~(span > 0)
        out = torch.where(flat, 0.0, (x - torch.where(flat, 0.0, lo)) / torch.where(flat, 1.0, span))
    return torch.where(ok, out, -math.inf)


def _filled(S: Tensor, norm: str) -> tuple[Tensor, Tensor]:
    """Normalise every run of ``(M, B, N)``; fill a run's misses with its row's lowest normalised score."""
    Z = torch.stack([normalize_scores(s, norm) for s in S])
    ok = torch.isfinite(Z)
    if Z.numel() == 0:
        return Z, ok
    floor = torch.where(ok, Z, math.inf).amin(dim=2, keepdim=True)
    floor = torch.where(torch.isfinite(floor), floor, 0.0)  # a run that retrieved nothing in the row
    return torch.where(ok, Z, floor), ok


# ----------------------------------------------------------------------------------------------- 23.01, 23.02


@implements("23.02")
def normalized_fusion(runs, weights=None, norm: str = "zscore") -> Tensor:
    r"""Weighted normalised fusion: :math:`s(q,d)=\sum_m w_m\,(s_m(q,d)-\mu_m)/\sigma_m`.

    ``runs``: the :math:`M` runs :math:`s_m`, each ``(B, N)`` (a sequence, or an ``(M, B, N)`` tensor);
    ``weights``: :math:`w` of shape ``(M,)``, each :math:`\ge 0` (default all 1: CombSUM of z-scores);
    ``norm``: ``"zscore"`` (:math:`\mu_m, \sigma_m` per run and per query over its retrieved documents),
    ``"minmax"`` or ``"none"`` (see :func:`normalize_scores`). A document a run missed takes that run's
    lowest normalised score in the row; one missed by every run with :math:`w_m>0` stays ``-inf``.
    Returns float64 ``(B, N)``.

    >>> bm25 = torch.tensor([[9.0, 1.0, 2.0]]); cos = torch.tensor([[0.30, 0.35, 0.80]])
    >>> normalized_fusion([bm25, cos]).round(decimals=3).tolist()
    [[0.59, -1.436, 0.846]]
    """
    S = _runs(runs)
    w = _weights(weights, S.shape[0])
    check_choice(norm, "norm", NORMS)
    Z, ok = _filled(S, norm)
    use = w > 0
    fused = torch.einsum("m,mbn->bn", w[use], Z[use])
    retrieved = ok[use].any(dim=0)
    return torch.where(retrieved, fused, -math.inf)


@implements("23.01")
def convex_fusion(s_dense, s_sparse, lam: float = 0.5, norm: str = "minmax") -> Tensor:
    r"""Convex hybrid score :math:`s(q,d)=\lambda\,s_{dense}(q,d)+(1-\lambda)\,s_{sparse}(q,d)`.

    ``s_dense``, ``s_sparse``: ``(B, N)`` runs; ``lam``: :math:`\lambda\in[0, 1]` (1: dense only, 0: sparse
    only); ``norm``: each run is first normalised per query, ``"minmax"`` by default (both terms in
    :math:`[0,1]`), ``"zscore"``, or ``"none"`` for the raw sum (BM25's spread then dominates). Misses as in
    :func:`normalized_fusion`, of which this is the two-run case with weights :math:`(\lambda, 1-\lambda)`.
    Returns float64 ``(B, N)``.

    >>> convex_fusion(torch.tensor([[0.2, 0.9]]), torch.tensor([[10.0, 0.0]]), lam=0.5).tolist()
    [[0.5, 0.5]]
    """
    lam = check_unit_interval(lam, "lam")
    return normalized_fusion([_scores(s_dense, "s_dense"), _scores(s_sparse, "s_sparse")],
                             weights=[lam, 1.0 - lam], norm=norm)


# ----------------------------------------------------------------------------------------------- 23.03


def rank_matrix(s, ties: str = "ordinal") -> Tensor:
    """1-based rank of every document in each row of a ``(B, N)`` run (float64); ``inf`` where not retrieved.

    ``ties``: ``"ordinal"`` (equal scores ranked by column order, chapter 26's stable sort), ``"min"`` (the
    group's best rank, as ``scipy.stats.rankdata(method="min")`` on negated scores) or ``"average"``.

    >>> rank_matrix(torch.tensor([[0.5, 0.9, 0.5, -math.inf]]), "min").tolist()
    [[2.0, 1.0, 2.0, inf]]
    """
    s = _scores(s, "s")
    check_choice(ties, "ties", TIES)
    B, N = s.shape
    if ties == "ordinal":
        order = torch.sort(s, dim=1, descending=True, stable=True).indices
        r = torch.empty_like(s).scatter_(1, order, torch.arange(1, N + 1, dtype=s.dtype).expand(B, N).contiguous())
    else:
        asc = torch.sort(s, dim=1).values.contiguous()
        above = N - torch.searchsorted(asc, s.contiguous(), right=True)  # strictly greater scores
        equal = torch.searchsorted(asc, s.contiguous(), right=True) - torch.searchsorted(asc, s.contiguous())
        r = (above + 1).double() + ((equal - 1).double() / 2 if ties == "average" else 0.0)
    return torch.where(torch.isfinite(s), r, math.inf)


@implements("23.03")
def reciprocal_rank_fusion(runs, k: float = 60.0, weights=None, depth: int | None = None,
                           ties: str = "ordinal") -> Tensor:
    r"""Reciprocal rank fusion: :math:`\mathrm{RRF}(d)=\sum_{r\in R} w_r/(k+\mathrm{rank}_r(d))`.

    ``runs``: the runs :math:`R`, each ``(B, N)`` (a sequence or an ``(M, B, N)`` tensor); ``k``: the
    smoothing constant, :math:`k\ge 0` (60 in Cormack et al. 2009, and in Elasticsearch, OpenSearch,
    Vespa and Weaviate); ``weights``: optional :math:`w_r\ge 0` (default 1, plain RRF); ``depth``: count only
    each run's top ``depth`` (Elasticsearch's ``rank_window_size``; None: every retrieved document);
    ``ties``: see :func:`rank_matrix`. A run that did not retrieve :math:`d` (``-inf``) adds nothing; a
    document no run retrieved is ``-inf``. Returns float64 ``(B, N)``.

    >>> reciprocal_rank_fusion([torch.tensor([[3.0, 2.0, 1.0]]), torch.tensor([[1.0, 2.0, 3.0]])], k=0).tolist()
    [[1.3333333333333333, 1.0, 1.3333333333333333]]
    """
    S = _runs(runs)
    k = check_range(k, "k", 0.0)
    w = _weights(weights, S.shape[0])
    depth = None if depth is None else check_positive_int(depth, "depth")
    check_choice(ties, "ties", TIES)
    R = torch.stack([rank_matrix(s, ties) for s in S])
    counted = torch.isfinite(R) & (w > 0).view(-1, 1, 1)
    if depth is not None:
        counted &= R <= depth
    contrib = torch.where(counted, w.view(-1, 1, 1) / (k + torch.where(counted, R, 1.0)), 0.0)
    return torch.where(counted.any(dim=0), contrib.sum(dim=0), -math.inf)


# ----------------------------------------------------------------------------------------------- the part's run


def hybrid_scores(s_sparse, s_dense, method: str = "rrf", k: float = 60.0, lam: float = 0.5) -> Tensor:
    """A hybrid run from a sparse and a dense ``(B, N)`` run, the fusion chosen by name.

    ``method="rrf"`` (the default: :func:`reciprocal_rank_fusion` with ``k = 60``, insensitive to the scale of
    either run); ``"zscore"``: :func:`normalized_fusion` with equal weights (what the part's pipeline,
    :func:`llmbook.rag.pipeline.hybrid_scores`, uses); ``"convex"``: :func:`convex_fusion` with min-max and
    ``lam``. None of them fits a parameter on the book's queries. Returns float64 ``(B, N)``.
    Pass BM25 with ``-inf`` for passages that share no term with the query (what an inverted index returns;
    chapter 23 does ``bm25.masked_fill(bm25 == 0, -math.inf)``): otherwise their tied zeros take ranks by
    column order.

    >>> hybrid_scores(torch.tensor([[5.0, 1.0]]), torch.tensor([[0.1, 0.7]])).argmax(dim=1).tolist()
    [0]
    """
    check_choice(method, "method", ("rrf", "zscore", "convex"))
    if method == "rrf":
        return reciprocal_rank_fusion([s_sparse, s_dense], k=k)
    if method == "zscore":
        return normalized_fusion([s_sparse, s_dense])
    return convex_fusion(s_dense, s_sparse, lam=lam)
