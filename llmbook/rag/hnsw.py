r"""HNSW: a hierarchical navigable small-world graph (chapter 24, ids 24.05-24.06).

A search in a proximity graph is a walk: from the current vertex :math:`v`, move to the neighbour
closest to the query (the **greedy step**, 24.05, :func:`greedy_step`), and stop when no neighbour is
closer than :math:`v`. HNSW (Malkov & Yashunin 2018) stacks graphs: every vector is in layer 0, and a
vector reaches layer :math:`l` with probability (24.06, :func:`level_probability`)

.. math:: P(\text{level}\ge l)=e^{-l/\lambda},\qquad \lambda=m_L=1/\ln M,

i.e. :math:`M^{-l}`: each layer holds about a fraction :math:`1/M` of the one below, so the top layers
are sparse "express lanes". A query descends greedily through the upper layers (one vertex at a time)
and runs a beam search with a candidate list of size ``ef`` in layer 0.

:class:`HNSW` is a small, readable implementation in numpy (float32, squared Euclidean distance):
levels drawn as :math:`\lfloor -\ln U\cdot m_L\rfloor`, at most ``M`` links per vertex per upper layer
and ``2M`` in layer 0, neighbours chosen by the paper's heuristic (a candidate is kept only if it is
closer to the new vertex than to every neighbour already kept), as hnswlib and faiss do. It is meant
for a few thousand vectors; hnswlib and faiss's ``IndexHNSWFlat`` are the C++ versions of the same algorithm.
"""

from __future__ import annotations

import heapq
import math

import numpy as np
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
    check_range,
    check_same_dtype,
    check_size,
)
from llmbook._precision import upcast_half
from llmbook.registry import implements

__all__ = ["HNSW", "greedy_step", "level_probability", "sample_levels"]


@implements("24.05")
def greedy_step(q, x, neighbors) -> Tensor:
    r"""HNSW greedy step :math:`v_{next}=\arg\min_{u\in N(v)}d(u,q)` (24.05): a 0-d int64 vertex id.

    ``q`` ``(D,)`` the query, ``x`` ``(N, D)`` the vectors of the graph, ``neighbors`` ``(n,)`` the ids
    :math:`N(v)` of the current vertex's neighbours (``n >= 1``). Returns the neighbour nearest to ``q``
    in Euclidean distance (ties: the first in ``neighbors``). The walk moves there only if it is closer
    than :math:`v` itself; otherwise :math:`v` is a local minimum and the greedy search stops.

    >>> greedy_step(torch.tensor([5.0]), torch.tensor([[0.0], [4.0], [9.0]]), torch.tensor([0, 1]))
    tensor(1)
    """
    q, x = as_tensor(q, "q"), as_tensor(x, "x")
    check_same_dtype(q, x, "q", "x")
    check_dim(q, "q", "(D,)", min_dim=1, max_dim=1)
    check_dim(x, "x", "(N, D)", min_dim=2, max_dim=2)
    check_size(x, 1, q.shape[0], "x", "(N, D) with the D of q")
    check_finite(q, "q")
    check_finite(x, "x")
    neighbors = check_integer_tensor(neighbors, "neighbors", "an integer tensor of vertex ids (n,)")
    check_dim(neighbors, "neighbors", "(n,)", min_dim=1, max_dim=1)
    check_nonempty(neighbors, "neighbors")
    if neighbors.min() < 0 or neighbors.max() >= x.shape[0]:
        raise ValueError(f"neighbors must be vertex ids in [0, N) = [0, {x.shape[0]}), got range "
                         f"[{neighbors.min().item()}, {neighbors.max().item()}]")
    neighbors = neighbors.long()
    d = (upcast_half(x)[neighbors] - upcast_half(q)).square().sum(-1)
    return neighbors[d.argmin()]


@implements("24.06")
def level_probability(l, lam: float) -> Tensor:
    r"""HNSW layer probability :math:`P(\text{level}\ge l)=e^{-l/\lambda}` (24.06), float64.

    ``l`` a level or a tensor of levels :math:`\ge 0`; ``lam`` :math:`\lambda>0` is HNSW's level
    multiplier :math:`m_L`, usually :math:`1/\ln M` so that :math:`P(\text{level}\ge l)=M^{-l}`.
    Levels drawn by :func:`sample_levels` follow this law exactly.

    >>> level_probability(torch.tensor([0, 1, 2]), 1 / math.log(16))
    tensor([1.0000, 0.0625, 0.0039], dtype=torch.float64)
    """
    lam = check_range(lam, "lam", 0.0, low_open=True)
    l = as_tensor(l, "l").double()
    check_finite(l, "l")
    if l.numel() and l.min() < 0:
        raise ValueError(f"levels l must be >= 0, got min {l.min().item()}")
    return torch.exp(-l / lam)


def sample_levels(N: int, lam: float, *, generator: torch.Generator | None = None) -> Tensor:
    r"""``(N,)`` int64 levels :math:`\lfloor-\ln U\cdot\lambda\rfloor`, :math:`U\sim\mathcal U(0,1]` (HNSW's draw)."""
    N = check_int(N, "N", low=0)
    lam = check_range(lam, "lam", 0.0, low_open=True)
    U = 1.0 - torch.rand(N, generator=generator, dtype=torch.float64)  # in (0, 1]: log never sees 0
    return torch.floor(-torch.log(U) * lam).long()


class HNSW:
    """A hierarchical navigable small-world index over ``x`` ``(N, D)`` (squared Euclidean distance).

    ``M`` links per vertex (``2M`` in layer 0), ``ef_construction`` the beam width while inserting,
    ``lam`` the level multiplier (default ``1/ln M``), ``seed`` the level draw. :meth:`search` returns
    ``(B, k)`` squared distances and ids like faiss and hnswlib (``inf`` / ``-1`` past the end).

    >>> idx = HNSW(torch.arange(40.0).reshape(20, 2), M=4, ef_construction=16)
    >>> idx.search(torch.tensor([[10.0, 11.0]]), k=2, ef=8)[1].tolist()
    [[5, 4]]
    """

    def __init__(self, x, M: int = 16, ef_construction: int = 100, *, lam: float | None = None, seed: int = 0):
        x = as_tensor(x, "x")
        check_dim(x, "x", "(N, D)", min_dim=2, max_dim=2)
        check_finite(x, "x")
        self.M = check_int(M, "M", low=2)
        self.ef_construction = check_positive_int(ef_construction, "ef_construction")
        self.lam = 1.0 / math.log(self.M) if lam is None else check_range(lam, "lam", 0.0, low_open=True)
        self.X = upcast_half(x).detach().to(torch.float32).numpy()
        self.levels = sample_levels(x.shape[0], self.lam, generator=torch.Generator().manual_seed(seed)).numpy()
        self.links: list[dict[int, list[int]]] = []  # links[layer][vertex] -> neighbour ids
        self.entry, self.n_distances = -1, 0
        for i in range(x.shape[0]):
            self._insert(i)

    # ------------------------------------------------------------------ internals
    def _dist(self, q: np.ndarray, ids) -> np.ndarray:
        self.n_distances += len(ids)
        diff = self.X[ids] - q
        return np.einsum("nd,nd->n", diff, diff)

    def _greedy(self, q: np.ndarray, v: int, layer: int) -> int:
        """Repeat the greedy step (24.05) in one layer until no neighbour is closer than ``v``."""
        dv = self._dist(q, [v])[0]
        while True:
            nbrs = self.links[layer][v]
            if not nbrs:
                return v
            d = self._dist(q, nbrs)
            j = int(d.argmin())
            if d[j] >= dv:
                return v
            v, dv = nbrs[j], d[j]

    def _search_layer(self, q: np.ndarray, entry: list[int], ef: int, layer: int) -> list[tuple[float, int]]:
        """Beam search in one layer: the ``ef`` nearest vertices found, as sorted ``(distance, id)``."""
        visited = set(entry)
        d = self._dist(q, entry)
        cand = [(float(di), e) for di, e in zip(d, entry, strict=True)]
        best = [(-di, e) for di, e in cand]
        heapq.heapify(cand)
        heapq.heapify(best)
        while len(best) > ef:
            heapq.heappop(best)
        links = self.links[layer]
        while cand:
            dc, c = heapq.heappop(cand)
            if dc > -best[0][0]:
                break
            new = [u for u in links[c] if u not in visited]
            if not new:
                continue
            visited.update(new)
            for du, u in zip(self._dist(q, new).tolist(), new, strict=True):
                if len(best) < ef or du < -best[0][0]:
                    heapq.heappush(cand, (du, u))
                    heapq.heappush(best, (-du, u))
                    if len(best) > ef:
                        heapq.heappop(best)
        return sorted((-nd, u) for nd, u in best)

    def _select(self, found: list[tuple[float, int]], m: int) -> list[int]:
        """The paper's neighbour heuristic: keep a candidate only if it is closer to the base than to a kept one."""
        kept: list[int] = []
        for d, u in found:
            if len(kept) >= m:
                break
            if not kept or d < self._dist(self.X[u], kept).min():
                kept.append(u)
        return kept

    def _insert(self, i: int) -> None:
        level = int(self.levels[i])
        while len(self.links) <= level:
            self.links.append({})
        for layer in range(level + 1):
            self.links[layer][i] = []
        if self.entry < 0:
            self.entry = i
            return
        q, v, top = self.X[i], self.entry, int(self.levels[self.entry])
        for layer in range(top, level, -1):
            v = self._greedy(q, v, layer)
        entry = [v]
        for layer in range(min(level, top), -1, -1):
            found = self._search_layer(q, entry, self.ef_construction, layer)
            m_max = 2 * self.M if layer == 0 else self.M
            self.links[layer][i] = self._select(found, self.M)
            for u in self.links[layer][i]:
                nbrs = self.links[layer][u]
                nbrs.append(i)
                if len(nbrs) > m_max:  # shrink u's list with the same heuristic
                    self.links[layer][u] = self._select(sorted(zip(self._dist(self.X[u], nbrs).tolist(), nbrs,
                                                                   strict=True)), m_max)
            entry = [u for _, u in found]
        if level > top:
            self.entry = i

    # ------------------------------------------------------------------ public
    def search(self, q, k: int = 10, ef: int = 64) -> tuple[Tensor, Tensor]:
        """``(B, k)`` squared distances and ids of the approximate ``k`` nearest neighbours of ``q`` ``(B, D)``."""
        q = as_tensor(q, "q")
        check_dim(q, "q", "(B, D)", min_dim=2, max_dim=2)
        check_size(q, 1, self.X.shape[1], "q", "(B, D) with the D of the index")
        check_finite(q, "q")
        k, ef = check_positive_int(k, "k"), check_positive_int(ef, "ef")
        Q = upcast_half(q).detach().to(torch.float32).numpy()
        D = np.full((Q.shape[0], k), np.inf, dtype=np.float32)
        ids = np.full((Q.shape[0], k), -1, dtype=np.int64)
        if self.entry < 0:
            return torch.from_numpy(D), torch.from_numpy(ids)
        for b, qb in enumerate(Q):
            v = self.entry
            for layer in range(int(self.levels[v]), 0, -1):
                v = self._greedy(qb, v, layer)
            found = self._search_layer(qb, [v], max(ef, k), 0)[:k]
            D[b, :len(found)] = [d for d, _ in found]
            ids[b, :len(found)] = [u for _, u in found]
        return torch.from_numpy(D), torch.from_numpy(ids)
