r"""k-means, the coarse quantizer of every vector index (chapter 24, ids 24.01-24.02).

An inverted-file (IVF) index and a product quantizer both start from the same problem: place
:math:`K` centroids so that every vector is close to one of them. The **objective** (24.01) is the
sum of squared distances to the nearest centroid (scikit-learn calls it *inertia*)

.. math:: J(c_1,\dots,c_K)=\sum_i\min_k\|x_i-c_k\|_2^2,

the **assignment** (24.02) sends a vector to its nearest centroid, :math:`a(x)=\arg\min_k\|x-c_k\|_2`,
and **Lloyd's algorithm** alternates the assignment with moving each centroid to the mean of the
vectors assigned to it. Each half-step can only lower :math:`J`, so :math:`J` decreases monotonically
until the assignment stops changing (a local minimum; which one depends on the initial centroids).

Shape contract: ``x`` ``(N, D)`` vectors, ``centroids`` ``(K, D)``, one float dtype, finite;
fp16/bf16 are computed in float32. Ties in the argmin go to the lowest centroid index (as torch,
numpy, scikit-learn and faiss). Squared distances are computed from the differences, a block of
rows at a time: exact for nearly equal points, where the expansion
:math:`\|x\|^2+\|c\|^2-2x^\top c` would cancel.

An empty cluster keeps its previous centroid here; scikit-learn moves it to a far point and faiss
splits a large cluster. The tests start from centroids for which no cluster empties, where the
three agree.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from llmbook._checks import (
    as_tensor,
    check_dim,
    check_finite,
    check_nonempty,
    check_nonnegative_int,
    check_range,
    check_same_dtype,
    check_same_last_dim,
)
from llmbook._precision import restore_half, upcast_half
from llmbook.registry import implements

__all__ = ["KMeansResult", "assign", "kmeans_objective", "lloyd", "squared_distances"]

_CHUNK = 1 << 22  # elements of the (rows, K, D) difference block materialised at once


def _points_centroids(x, centroids):
    x = as_tensor(x, "x")
    centroids = as_tensor(centroids, "centroids")
    check_same_dtype(x, centroids, "x", "centroids")
    check_dim(x, "x", "(N, D)", min_dim=2, max_dim=2)
    check_dim(centroids, "centroids", "(K, D)", min_dim=2, max_dim=2)
    check_same_last_dim(x, centroids, "x", "centroids", "D")
    check_nonempty(centroids, "centroids", dim=0)
    check_finite(x, "x")
    check_finite(centroids, "centroids")
    return upcast_half(x), upcast_half(centroids), x.dtype


def _sqdist(x: Tensor, c: Tensor) -> Tensor:
    """``(N, K)`` squared distances from the differences, a block of rows at a time (no checks)."""
    rows = max(1, _CHUNK // max(1, c.shape[0] * c.shape[1]))
    out = [(x[i:i + rows, None, :] - c[None]).square().sum(-1) for i in range(0, x.shape[0], rows)]
    return torch.cat(out) if out else x.new_zeros(0, c.shape[0])


def squared_distances(x, centroids) -> Tensor:
    r"""``(N, K)`` squared Euclidean distances :math:`\|x_i-c_k\|_2^2` (from the differences).

    >>> squared_distances(torch.tensor([[0.0, 0.0]]), torch.tensor([[3.0, 4.0], [1.0, 0.0]]))
    tensor([[25.,  1.]])
    """
    x, c, dtype = _points_centroids(x, centroids)
    return restore_half(_sqdist(x, c), dtype)


@implements("24.02")
def assign(x, centroids) -> Tensor:
    r"""IVF / k-means assignment :math:`a(x)=\arg\min_k\|x-c_k\|_2` (24.02): ``(N,)`` int64 list ids.

    ``x`` ``(N, D)`` -> the index in ``[0, K)`` of each vector's nearest centroid (ties: lowest index).
    In an IVF index this is the inverted list a vector is stored in, and the list a query probes first.

    >>> assign(torch.tensor([[0.9, 0.0], [5.0, 5.0]]), torch.tensor([[0.0, 0.0], [4.0, 4.0]]))
    tensor([0, 1])
    """
    x, c, _ = _points_centroids(x, centroids)
    return _sqdist(x, c).argmin(-1) if x.shape[0] else torch.zeros(0, dtype=torch.long)


@implements("24.01")
def kmeans_objective(x, centroids) -> Tensor:
    r"""k-means objective (inertia) :math:`J=\sum_i\min_k\|x_i-c_k\|_2^2` (24.01): a 0-d tensor.

    ``x`` ``(N, D)``, ``centroids`` ``(K, D)``; the sum is accumulated in float64 (returned in the
    dtype of ``x``; fp16/bf16 as float32 would overflow less, but the contract keeps the input dtype).

    >>> kmeans_objective(torch.tensor([[0.0, 1.0], [3.0, 0.0]]), torch.tensor([[0.0, 0.0], [4.0, 0.0]]))
    tensor(2.)
    """
    x, c, dtype = _points_centroids(x, centroids)
    if x.shape[0] == 0:
        return torch.zeros((), dtype=dtype)
    J = _sqdist(x, c).amin(-1).double().sum()
    return restore_half(J.to(x.dtype), dtype)


@dataclass
class KMeansResult:
    """What :func:`lloyd` returns: final ``centroids`` ``(K, D)``, ``labels`` ``(N,)`` (the assignment to
    those centroids), ``inertia`` (the objective at them), ``history`` (the objective after each
    assignment, one float per iteration) and ``n_iter`` (iterations run)."""

    centroids: Tensor
    labels: Tensor
    inertia: float
    history: list[float]
    n_iter: int


def lloyd(x, init, *, max_iter: int = 100, tol: float = 0.0) -> KMeansResult:
    r"""Lloyd's k-means from the initial centroids ``init`` ``(K, D)`` (not registered: it minimises 24.01).

    Each iteration assigns every vector to its nearest centroid (24.02), records the objective (24.01)
    and moves each centroid to the mean of its vectors (an empty cluster keeps its centroid). It stops
    when the labels repeat, when the centroids move by at most ``tol`` in total squared distance, or
    after ``max_iter`` iterations; the returned labels and inertia belong to the returned centroids, as
    in ``sklearn.cluster.KMeans(init=init, n_init=1, algorithm="lloyd")``.

    >>> r = lloyd(torch.tensor([[0.0], [1.0], [10.0], [11.0]]), torch.tensor([[0.0], [1.0]]))
    >>> r.centroids.flatten().tolist(), r.labels.tolist(), r.inertia
    ([0.5, 10.5], [0, 0, 1, 1], 1.0)
    """
    x, c, dtype = _points_centroids(x, init)
    check_nonempty(x, "x", dim=0)
    check_nonnegative_int(max_iter, "max_iter")
    check_range(tol, "tol", 0.0)
    c = c.clone()
    K = c.shape[0]
    history, labels, n_iter = [], None, 0
    for n_iter in range(1, max_iter + 1):  # noqa: B007  (n_iter is returned)
        d = _sqdist(x, c)
        new = d.argmin(-1)
        history.append(float(d.gather(1, new[:, None]).double().sum()))
        if labels is not None and torch.equal(new, labels):
            break
        labels = new
        counts = torch.bincount(labels, minlength=K).to(x.dtype)
        sums = torch.zeros_like(c).index_add_(0, labels, x)
        moved = torch.where(counts[:, None] > 0, sums / counts.clamp_min(1)[:, None], c)
        shift = float((moved - c).double().square().sum())
        c = moved
        if shift <= tol:
            break
    d = _sqdist(x, c)
    labels = d.argmin(-1)
    inertia = float(d.gather(1, labels[:, None]).double().sum())
    return KMeansResult(restore_half(c, dtype), labels, inertia, history, n_iter)
