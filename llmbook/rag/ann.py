r"""Inverted files and product quantization (chapter 24, ids 24.03, 24.04).

* **IVF** (:class:`IVFIndex`): k-means centroids (``llmbook.rag.kmeans``) cut the space into ``nlist``
  cells; each vector is stored in the inverted list of its nearest centroid (24.02). A query scans only
  the lists of its ``nprobe`` nearest centroids. With ``nprobe = nlist`` it scans everything and equals
  exact search; with fewer lists it misses neighbours that sit just across a cell boundary.
* **PQ** (24.03, 24.04): a ``D``-vector is cut into ``M`` sub-vectors of ``D/M`` coordinates and each
  sub-vector is replaced by the index of its nearest centroid in that subspace's codebook of ``K``
  centroids: ``M log2 K`` bits per vector (``M`` bytes for ``K = 256``, faiss's ``nbits = 8``). The
  *asymmetric* distance (ADC) keeps the query exact and compares it with the reconstructed database
  vector: one ``(M, K)`` table of sub-distances per query, then ``M`` table look-ups per vector.
* **ScaNN** (24.07) chooses PQ codes with a loss that weighs the residual along the datapoint more than
  across it: :mod:`llmbook.rag.scann`.

Shapes: database ``x`` ``(N, D)``, queries ``(B, D)``, ``codebooks`` ``(M, K, D/M)``, ``codes``
``(N, M)`` int64. Squared Euclidean distances, as faiss's ``METRIC_L2`` reports them. One float dtype
per call, finite; fp16/bf16 are computed in float32.
"""

from __future__ import annotations

import torch
from torch import Tensor

from llmbook._checks import (
    as_tensor,
    check_dim,
    check_finite,
    check_int,
    check_integer_tensor,
    check_nonempty,
    check_positive_int,
    check_same_dtype,
)
from llmbook._precision import restore_half, upcast_half
from llmbook.rag.kmeans import _points_centroids, _sqdist, assign, lloyd
from llmbook.registry import implements

__all__ = ["IVFIndex", "exact_search", "pq_adc", "pq_decode", "pq_distance_tables", "pq_encode", "pq_train",
           "rerank_exact"]


def _topk_smallest(d: Tensor, ids: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """The ``k`` smallest of ``d`` ``(n,)`` with their ``ids``, padded with ``inf`` / ``-1`` as faiss pads."""
    kk = min(k, d.shape[0])
    # a stable sort: equal distances keep the order of ids (ascending), so ties resolve as in exact search
    order = torch.sort(d, stable=True).indices[:kk]
    dist = torch.full((k,), float("inf"), dtype=d.dtype)
    out = torch.full((k,), -1, dtype=torch.long)
    dist[:kk], out[:kk] = d[order], ids[order]
    return dist, out


def exact_search(q, x, k: int) -> tuple[Tensor, Tensor]:
    """Brute-force k nearest neighbours: ``(B, k)`` squared distances and ``(B, k)`` ids (the flat index)."""
    q, x, dtype = _points_centroids(q, x)
    k = check_positive_int(k, "k")
    d = _sqdist(q, x)
    ids = torch.arange(x.shape[0])
    res = [_topk_smallest(row, ids, k) for row in d]
    return (torch.stack([r[0] for r in res]) if res else d.new_zeros(0, k),
            torch.stack([r[1] for r in res]) if res else torch.zeros(0, k, dtype=torch.long))


def rerank_exact(q, x, candidates, k: int) -> tuple[Tensor, Tensor]:
    """Re-rank each query's ``candidates`` (ids from a compressed index) by the exact squared distance; keep ``k``.

    The two-stage search of a PQ index with a refinement step (faiss's ``IndexRefineFlat``): the codes pick
    ``R`` candidates cheaply, the full vectors ``x`` ``(N, D)`` order them exactly. ``q`` ``(B, D)``,
    ``candidates`` ``(B, R)`` ids (``-1`` = padding, skipped; repeats count once); returns ``(B, k)`` squared
    distances and ids, ``inf`` / ``-1`` where fewer than ``k`` candidates exist. Recall can only reach what the
    candidates hold.

    >>> x = torch.tensor([[0.0], [1.0], [5.0]])
    >>> rerank_exact(torch.tensor([[0.9]]), x, torch.tensor([[2, 0, 1]]), k=2)[1].tolist()
    [[1, 0]]
    """
    q, x, dtype = _points_centroids(q, x)
    k = check_positive_int(k, "k")
    candidates = torch.as_tensor(candidates)
    if candidates.dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.bool):
        raise TypeError(f"candidates must be integer ids, got dtype {candidates.dtype}")
    if candidates.ndim != 2 or candidates.shape[0] != q.shape[0]:
        raise ValueError(f"candidates must be (B, R) with B = {q.shape[0]} queries, got {tuple(candidates.shape)}")
    if ((candidates < -1) | (candidates >= x.shape[0])).any():
        raise ValueError(f"candidate ids must lie in 0..{x.shape[0] - 1} (or be -1 for padding)")
    res = []
    for row, ids in zip(q, candidates.long(), strict=True):
        ids = torch.unique(ids[ids >= 0])  # a repeated id counts once; ties then resolve by id, as in exact search
        res.append(_topk_smallest(((x[ids] - row) ** 2).sum(-1), ids, k))
    dist = torch.stack([r[0] for r in res]) if res else q.new_zeros(0, k)
    return dist.to(dtype), (torch.stack([r[1] for r in res]) if res else torch.zeros(0, k, dtype=torch.long))


class IVFIndex:
    r"""An inverted-file index over ``x`` ``(N, D)`` with given ``centroids`` ``(nlist, D)`` (IVF-Flat).

    ``lists[j]`` holds the ids of the vectors whose nearest centroid is ``j`` (24.02). ``search``
    ranks the centroids by distance to the query, scans the ``nprobe`` nearest lists exactly and
    returns the ``k`` best as ``(B, k)`` squared distances and ids (``inf`` / ``-1`` when the probed
    lists hold fewer than ``k`` vectors), the layout of faiss's ``IndexIVFFlat.search``.

    >>> idx = IVFIndex(torch.tensor([[0.0], [1.0], [9.0], [10.0]]), torch.tensor([[0.5], [9.5]]))
    >>> [l.tolist() for l in idx.lists], idx.search(torch.tensor([[8.0]]), k=1, nprobe=1)[1].tolist()
    ([[0, 1], [2, 3]], [[2]])
    """

    def __init__(self, x, centroids):
        x, c, _ = _points_centroids(x, centroids)
        self._c = as_tensor(centroids, "centroids")
        self.x, self.centroids = x, c
        self.labels = assign(x, c)
        self.lists = [torch.nonzero(self.labels == j).flatten() for j in range(c.shape[0])]

    @property
    def nlist(self) -> int:
        return self.centroids.shape[0]

    def search(self, q, k: int, nprobe: int = 1) -> tuple[Tensor, Tensor]:
        q, _, _ = _points_centroids(q, self._c)  # the index's dtype, D and finiteness
        k = check_positive_int(k, "k")
        nprobe = check_int(nprobe, "nprobe", low=1, high=self.nlist)
        probe = _sqdist(q, self.centroids).argsort(dim=-1, stable=True)[:, :nprobe]
        dists, ids = [], []
        for b in range(q.shape[0]):
            cand = torch.cat([self.lists[j] for j in probe[b].tolist()]).sort().values
            d, i = _topk_smallest(_sqdist(q[b:b + 1], self.x[cand])[0], cand, k)
            dists.append(d)
            ids.append(i)
        if not dists:
            return q.new_zeros(0, k), torch.zeros(0, k, dtype=torch.long)
        return torch.stack(dists), torch.stack(ids)


def _codebooks(codebooks) -> Tensor:
    codebooks = as_tensor(codebooks, "codebooks")
    check_dim(codebooks, "codebooks", "(M, K, D/M)", min_dim=3, max_dim=3)
    check_nonempty(codebooks, "codebooks", dim=0)
    check_nonempty(codebooks, "codebooks", dim=1)
    check_finite(codebooks, "codebooks")
    return codebooks


def _split(x, codebooks, name: str):
    """Check ``x`` ``(N, D)`` against ``codebooks`` ``(M, K, D/M)``; return x as ``(N, M, D/M)`` and the codebooks."""
    x = as_tensor(x, name)
    check_same_dtype(x, codebooks, name, "codebooks")
    check_dim(x, name, "(N, D)", min_dim=2, max_dim=2)
    check_finite(x, name)
    M, _, Dm = codebooks.shape
    if x.shape[1] != M * Dm:
        raise ValueError(f"{name} has D = {x.shape[1]} coordinates but the codebooks (M, K, D/M) = "
                         f"{tuple(codebooks.shape)} describe D = M * D/M = {M * Dm}")
    return upcast_half(x).reshape(x.shape[0], M, Dm), upcast_half(codebooks)


def pq_train(x, M: int, K: int = 256, *, max_iter: int = 25, seed: int = 0) -> Tensor:
    """Train PQ codebooks ``(M, K, D/M)``: Lloyd's k-means in each subspace from ``K`` random distinct vectors."""
    x = as_tensor(x, "x")
    check_dim(x, "x", "(N, D)", min_dim=2, max_dim=2)
    M, K = check_positive_int(M, "M"), check_positive_int(K, "K")
    if x.shape[1] % M:
        raise ValueError(f"D = {x.shape[1]} must be divisible by the number of sub-vectors M = {M}")
    if x.shape[0] < K:
        raise ValueError(f"training needs at least K = {K} vectors, got N = {x.shape[0]}")
    g = torch.Generator().manual_seed(seed)
    start = torch.randperm(x.shape[0], generator=g)[:K]
    sub = x.reshape(x.shape[0], M, -1)
    return torch.stack([lloyd(sub[:, m], sub[start, m], max_iter=max_iter).centroids for m in range(M)])


@implements("24.03")
def pq_encode(x, codebooks) -> Tensor:
    r"""Product quantization :math:`q(x)=[q_1(x^{(1)}),\dots,q_M(x^{(M)})]` (24.03): ``(N, M)`` int64 codes.

    ``x`` ``(N, D)``, ``codebooks`` ``(M, K, D/M)``: sub-vector ``x^{(m)} = x[:, m D/M:(m+1) D/M]`` gets the
    index of its nearest centroid among ``codebooks[m]`` (ties: the lowest index). faiss stores the codes
    of ``K = 2**nbits`` centroids packed in ``ceil(M nbits / 8)`` bytes; for ``nbits = 8`` they are these
    integers as ``uint8``.

    >>> C = torch.tensor([[[0.0], [1.0]], [[0.0], [10.0]]])
    >>> pq_encode(torch.tensor([[0.9, 2.0], [0.1, 8.0]]), C)
    tensor([[1, 0],
            [0, 1]])
    """
    codebooks = _codebooks(codebooks)
    xs, C = _split(x, codebooks, "x")
    codes = [_sqdist(xs[:, m], C[m]).argmin(-1) if xs.shape[0] else torch.zeros(0, dtype=torch.long)
             for m in range(C.shape[0])]
    return torch.stack(codes, 1)


def _codes(codes, codebooks: Tensor) -> Tensor:
    codes = check_integer_tensor(codes, "codes", "an integer tensor of PQ codes (N, M)")
    check_dim(codes, "codes", "(N, M)", min_dim=2, max_dim=2)
    M, K, _ = codebooks.shape
    if codes.shape[1] != M:
        raise ValueError(f"codes (N, M) = {tuple(codes.shape)} must have M = {M} columns, one per codebook")
    if codes.numel() and (codes.min() < 0 or codes.max() >= K):
        raise ValueError(f"codes must lie in [0, K) = [0, {K}), got range [{codes.min().item()}, {codes.max().item()}]")
    return codes.long()


def pq_decode(codes, codebooks) -> Tensor:
    """Reconstruct ``(N, D)`` vectors from ``codes`` ``(N, M)``: the concatenated chosen centroids."""
    codebooks = _codebooks(codebooks)
    codes = _codes(codes, codebooks)
    M = codebooks.shape[0]
    return torch.cat([codebooks[m][codes[:, m]] for m in range(M)], 1) if codes.shape[0] else \
        codebooks.new_zeros(0, M * codebooks.shape[2])


def pq_distance_tables(y, codebooks) -> Tensor:
    r"""``(B, M, K)`` tables :math:`T[b, m, k]=\|c_{m,k}-y_b^{(m)}\|^2` (faiss's ``compute_distance_tables``)."""
    codebooks = _codebooks(codebooks)
    ys, C = _split(y, codebooks, "y")
    return torch.stack([_sqdist(ys[:, m], C[m]) for m in range(C.shape[0])], 1)


@implements("24.04")
def pq_adc(y, codes, codebooks) -> Tensor:
    r"""Asymmetric PQ distance :math:`\|x-y\|^2\approx\sum_{m=1}^{M}\|c_{m,k_m}-y^{(m)}\|^2` (24.04): ``(B, N)``.

    ``y`` ``(B, D)`` exact queries, ``codes`` ``(N, M)`` the database vectors' codes :math:`k_m`,
    ``codebooks`` ``(M, K, D/M)``. Equal to the exact squared distance from ``y`` to the *reconstructed*
    vector (:func:`pq_decode`); computed as faiss computes it, by summing ``M`` look-ups in
    :func:`pq_distance_tables`.

    >>> C = torch.tensor([[[0.0], [1.0]], [[0.0], [10.0]]])
    >>> pq_adc(torch.tensor([[1.0, 9.0]]), torch.tensor([[1, 1], [0, 0]]), C)
    tensor([[ 1., 82.]])
    """
    codebooks = _codebooks(codebooks)
    codes = _codes(codes, codebooks)
    T = pq_distance_tables(y, codebooks)  # (B, M, K), float32 for half input
    B, M, _ = T.shape
    idx = codes.T[None].expand(B, M, codes.shape[0])  # (B, M, N)
    return restore_half(T.gather(2, idx).sum(1), codebooks.dtype)
