r"""Graphs for retrieval: adjacency, PageRank, personalised PageRank, modularity and path relevance.

GraphRAG-style retrieval treats the corpus as a graph, of entities that co-occur or of passages
that share entities, and lets relevance flow along its edges. The functions here are the graph
arithmetic of chapter 31; :mod:`llmbook.rag.graph_context` builds the book's own graphs and the
message-passing layer.

* **Adjacency** (31.01, :func:`adjacency`): :math:`A_{ij} = w(e_i, e_j)` from an edge list, repeated
  edges summed, symmetric unless ``directed``.
* **PageRank** (31.02, :func:`pagerank`, Page et al. 1999) and **personalised PageRank** (31.03,
  :func:`personalized_pagerank`, Haveliwala 2002): the stationary distribution of a walk that follows
  an edge with probability :math:`\alpha` (PageRank's :math:`d`) and otherwise restarts from
  :math:`v`, by power iteration.
* **Modularity** (31.04, :func:`modularity`, Newman 2006): how much more weight lies inside the
  communities than a random graph with the same degrees would put there.
* **Path relevance** (31.05, :func:`path_relevance`): the product of the edge weights along a path;
  :func:`best_path` finds the path that maximises it (Dijkstra on :math:`-\log w`).

**Dangling nodes.** A node without out-going weight has no row to follow. Here, as in
``networkx.pagerank`` with ``dangling=None``, the walker at a dangling node jumps according to the
personalisation vector :math:`v` (uniform for plain PageRank): the row of :math:`P` of a dangling
node is :math:`v^\top` (:func:`transition_matrix`). Then :math:`P` is row-stochastic and
:math:`p = (1-\alpha)(I - \alpha P^\top)^{-1} v` exactly.

Conventions: ``A`` is a dense ``(N, N)`` tensor of non-negative weights, ``A[i, j]`` the weight of the
edge from ``i`` to ``j``. Arithmetic runs in float64 (a graph of a few thousand nodes is small);
results come back in the input's floating dtype.

>>> A = adjacency(torch.tensor([0, 1, 2]), torch.tensor([1, 2, 0]), N=3)   # a triangle
>>> [round(x, 4) for x in pagerank(A).tolist()]
[0.3333, 0.3333, 0.3333]
"""

from __future__ import annotations

import heapq
import math

import torch

from llmbook._checks import as_tensor, check_dim, check_finite, check_int, check_integer_tensor, check_range, check_real
from llmbook.registry import implements

__all__ = ["adjacency", "transition_matrix", "pagerank", "personalized_pagerank", "modularity", "path_relevance",
           "best_path"]


def _weights(A, name: str = "A") -> tuple[torch.Tensor, torch.dtype]:
    """``A`` as a finite, non-negative float64 ``(N, N)`` matrix, and its dtype."""
    t = as_tensor(A, name)
    check_dim(t, name, "(N, N)", min_dim=2, max_dim=2)
    if t.shape[0] != t.shape[1]:
        raise ValueError(f"{name} must be a square (N, N) matrix, got shape {tuple(t.shape)}")
    check_finite(t, name)
    if t.numel() and t.min().item() < 0:
        raise ValueError(f"{name} must hold non-negative edge weights, got minimum {t.min().item():.4g}")
    return t.double(), t.dtype


@implements("31.01")
def adjacency(src, dst, weight=None, N: int | None = None, *, directed: bool = False) -> torch.Tensor:
    r"""The dense weighted adjacency matrix of an edge list, :math:`A_{ij} = w(e_i, e_j)`.

    Edge ``k`` runs from ``src[k]`` to ``dst[k]`` with weight ``weight[k]`` (1 when ``weight`` is None);
    repeated edges add up. Undirected (the default): ``A[j, i] = A[i, j]``, and a self-loop ``(i, i)``
    adds its weight once to ``A[i, i]`` (as ``networkx.to_numpy_array``).

    Shapes: ``src``, ``dst`` ``(E,)`` integer, ``weight`` ``(E,)`` floating, ``N`` the number of nodes
    (default ``max index + 1``). Returns ``(N, N)`` in the dtype of ``weight`` (default float).

    >>> adjacency(torch.tensor([0, 0]), torch.tensor([1, 1]), torch.tensor([0.5, 0.25])).tolist()
    [[0.0, 0.75], [0.75, 0.0]]
    """
    i, j = check_integer_tensor(src, "src"), check_integer_tensor(dst, "dst")
    check_dim(i, "src", "(E,)", min_dim=1, max_dim=1)
    if j.shape != i.shape:
        raise ValueError(f"src {tuple(i.shape)} and dst {tuple(j.shape)} must both be (E,)")
    w = torch.ones(i.shape, dtype=torch.get_default_dtype()) if weight is None else as_tensor(weight, "weight")
    if w.shape != i.shape:
        raise ValueError(f"weight must be (E,) = {tuple(i.shape)}, got {tuple(w.shape)}")
    check_finite(w, "weight")
    top = int(max(i.max().item(), j.max().item())) + 1 if i.numel() else 0
    N = top if N is None else check_int(N, "N", low=0)
    if i.numel() and (min(i.min().item(), j.min().item()) < 0 or top > N):
        raise ValueError(f"node indices must lie in [0, N) = [0, {N}), got range "
                         f"[{min(i.min().item(), j.min().item())}, {top - 1}]")
    A = torch.zeros(N, N, dtype=torch.float64)
    A.index_put_((i.long(), j.long()), w.double(), accumulate=True)
    if not directed:
        A = A + A.T - torch.diag(A.diagonal())
    return A.to(w.dtype)


def transition_matrix(A, v=None) -> torch.Tensor:
    r"""The row-stochastic walk matrix :math:`P`: :math:`P_{ij} = A_{ij} / \sum_k A_{ik}`.

    A dangling row (no out-going weight) becomes :math:`v^\top`: the personalisation ``v`` ``(N,)``
    (normalised to sum 1), or uniform when ``v`` is None. Returns ``(N, N)`` float64.

    >>> transition_matrix(torch.tensor([[0.0, 2.0], [0.0, 0.0]])).tolist()
    [[0.0, 1.0], [0.5, 0.5]]
    """
    A, _ = _weights(A)
    N = A.shape[0]
    v = torch.full((N,), 1.0 / max(N, 1), dtype=torch.float64) if v is None else _restart(v, N)[0]
    out = A.sum(1, keepdim=True)
    dangling = out.squeeze(1) == 0
    P = A / torch.where(out > 0, out, torch.ones_like(out))
    P[dangling] = v
    return P


def _restart(v, N: int) -> tuple[torch.Tensor, torch.dtype]:
    """The restart distribution(s) ``v`` ``(N,)`` or ``(B, N)``, non-negative, each normalised to sum 1."""
    t = as_tensor(v, "v")
    check_dim(t, "v", "(N,) or (B, N)", min_dim=1, max_dim=2)
    if t.shape[-1] != N:
        raise ValueError(f"v must have N = {N} entries in its last dim (the nodes of A), got shape {tuple(t.shape)}")
    check_finite(t, "v")
    if t.numel() and t.min().item() < 0:
        raise ValueError(f"v must be non-negative, got minimum {t.min().item():.4g}")
    s = t.double().sum(-1, keepdim=True)
    if N and (s <= 0).any():
        raise ValueError("every restart distribution v must have a positive sum, got an all-zero row")
    return t.double() / s, t.dtype


@implements("31.03")
def personalized_pagerank(A, v, alpha: float = 0.85, *, tol: float = 1e-12, max_iter: int = 10_000) -> torch.Tensor:
    r"""Personalised PageRank by power iteration: the fixed point of :math:`p=(1-\alpha)v+\alpha P^\top p`.

    Symbols: :math:`P` = :func:`transition_matrix` of ``A`` (dangling rows jump by :math:`v`, the
    module docstring's convention, as ``networkx.pagerank(..., dangling=None)``), :math:`v` = ``v``
    normalised to sum 1, :math:`\alpha` = ``alpha``, the probability of following an edge (``1 - alpha``:
    of restarting from :math:`v`). The iteration starts from :math:`v` and stops when the L1 change
    falls below ``N * tol`` (networkx's rule); each step shrinks the error by :math:`\alpha`.

    Shapes: ``A`` ``(N, N)`` non-negative, ``v`` ``(N,)`` or ``(B, N)`` (one walk per row, for a batch of
    queries). Returns ``p`` with the shape of ``v``, each row a distribution over the nodes.

    >>> A = torch.tensor([[0.0, 1.0, 0.0], [1.0, 0.0, 1.0], [0.0, 1.0, 0.0]])   # a path 0 - 1 - 2
    >>> [round(x, 4) for x in personalized_pagerank(A, torch.tensor([1.0, 0.0, 0.0]), 0.5).tolist()]
    [0.5833, 0.3333, 0.0833]
    """
    A, dtype = _weights(A)
    N = A.shape[0]
    alpha = check_range(alpha, "alpha", 0.0, 1.0, high_open=True)
    tol = check_range(tol, "tol", 0.0, math.inf, low_open=True)
    max_iter = check_int(max_iter, "max_iter", low=1)
    v, v_dtype = _restart(v, N)
    out = A.sum(1)
    dangling = (out == 0).double()
    P = A / torch.where(out > 0, out, torch.ones_like(out)).unsqueeze(1)  # dangling rows left at 0, added below
    p = v.clone()
    if p.numel() == 0:
        return p.to(torch.promote_types(dtype, v_dtype))
    for _ in range(max_iter):
        prev = p
        follow = p @ P + (p @ dangling).unsqueeze(-1) * v  # the walk's step, dangling mass jumping by v
        p = (1 - alpha) * v + alpha * follow
        if (p - prev).abs().sum(-1).max().item() < N * tol:
            return p.to(torch.promote_types(dtype, v_dtype))
    raise ValueError(f"personalized_pagerank did not converge to tol = {tol} in max_iter = {max_iter} steps "
                     f"(alpha = {alpha}); raise max_iter or lower alpha")


@implements("31.02")
def pagerank(A, d: float = 0.85, *, tol: float = 1e-12, max_iter: int = 10_000) -> torch.Tensor:
    r"""PageRank: :math:`PR(v)=\frac{1-d}{N}+d\sum_{u\in In(v)}\frac{PR(u)}{out(u)}`, by power iteration.

    Symbols: :math:`d` = ``d`` (damping, the probability of following a link), :math:`out(u)` the
    out-going weight of :math:`u` (``A[u].sum()``), :math:`In(v)` the nodes with an edge to
    :math:`v`. Dangling nodes (:math:`out(u) = 0`) spread their rank uniformly, so the ranks sum to
    1. It is :func:`personalized_pagerank` with the uniform restart :math:`v = \mathbf 1/N`.

    Shapes: ``A`` ``(N, N)`` non-negative. Returns ``(N,)``.

    >>> A = torch.tensor([[0.0, 1.0], [0.0, 0.0]])        # 0 -> 1, and 1 is dangling
    >>> [round(x, 4) for x in pagerank(A).tolist()]
    [0.3509, 0.6491]
    """
    A, dtype = _weights(A)
    N = A.shape[0]
    return personalized_pagerank(A, torch.ones(N, dtype=torch.float64), d, tol=tol, max_iter=max_iter).to(dtype)


@implements("31.04")
def modularity(A, communities, resolution: float = 1.0) -> torch.Tensor:
    r"""Newman's modularity :math:`Q=\frac{1}{2m}\sum_{ij}\big(A_{ij}-\gamma\frac{k_ik_j}{2m}\big)\mathbf 1[c_i=c_j]`.

    Symbols: :math:`A` = ``A`` (symmetric, non-negative), :math:`k_i=\sum_j A_{ij}` the weighted
    degree, :math:`2m=\sum_{ij}A_{ij}`, :math:`c_i` = ``communities[i]`` (any integer labels),
    :math:`\gamma` = ``resolution`` (1 in Newman's definition). :math:`Q` lies in
    :math:`[-\tfrac12, 1)` for :math:`\gamma = 1`; 0 means no more internal weight than chance.
    Computed as :math:`(\operatorname{tr}S^\top A S-\gamma\lVert S^\top k\rVert^2/2m)/2m` with the
    one-hot membership :math:`S` ``(N, C)``. A self-loop of weight :math:`w` must be entered as
    :math:`A_{ii} = 2w` to match networkx, which counts it twice in the degree.

    Shapes: ``A`` ``(N, N)``, ``communities`` ``(N,)`` integer. Returns a 0-dim tensor.

    >>> A = adjacency(torch.tensor([0, 1, 3, 4, 2]), torch.tensor([1, 2, 4, 5, 3]), N=6)   # a path of 6
    >>> round(modularity(A, torch.tensor([0, 0, 0, 1, 1, 1])).item(), 4)
    0.3
    """
    A, dtype = _weights(A)
    N = A.shape[0]
    c = check_integer_tensor(communities, "communities")
    if c.shape != (N,):
        raise ValueError(f"communities must be (N,) = ({N},), one label per node of A, got {tuple(c.shape)}")
    gamma = check_real(resolution, "resolution")
    scale = max(1.0, A.abs().max().item()) if N else 1.0
    asym = (A - A.T).abs().max().item() if N else 0.0
    if asym > 16 * max(N, 1) * torch.finfo(dtype).eps * scale:
        raise ValueError(f"A must be symmetric (an undirected graph), got max |A - A^T| = {asym:.3g}")
    two_m = A.sum()
    if not two_m.item() > 0:
        raise ValueError("modularity is undefined for a graph without edges (sum of A = 0)")
    _, labels = torch.unique(c, return_inverse=True)
    S = torch.nn.functional.one_hot(labels.long(), int(labels.max().item()) + 1).double()
    k = A.sum(1)
    Q = ((S.T @ A @ S).trace() - gamma * ((S.T @ k) ** 2).sum() / two_m) / two_m
    return Q.to(dtype)


@implements("31.05")
def path_relevance(W, path, *, log: bool = False) -> torch.Tensor:
    r"""The relevance of a path as the product of its edge weights, :math:`\prod_{(i,j)\in path} w_{ij}`.

    With ``W`` the :func:`transition_matrix` of a graph it is the probability that a random walk from
    the path's first node follows exactly this path; an edge of weight 0 makes the path irrelevant.
    ``log=True`` returns :math:`\sum\log w_{ij}` instead (no underflow on long paths; ``-inf`` for a
    missing edge). A path of one node has relevance 1.

    Shapes: ``W`` ``(N, N)`` non-negative, ``path`` ``(..., L+1)`` integer node indices (a batch of paths
    of ``L`` edges each). Returns ``(...)``.

    >>> W = torch.tensor([[0.0, 0.5, 0.5], [0.2, 0.0, 0.8], [1.0, 0.0, 0.0]])
    >>> path_relevance(W, torch.tensor([[0, 1, 2], [0, 2, 0]])).tolist()
    [0.4, 0.5]
    """
    W, dtype = _weights(W, "W")
    N = W.shape[0]
    idx = check_integer_tensor(path, "path")
    check_dim(idx, "path", "(..., L+1)", min_dim=1)
    if idx.shape[-1] < 1:
        raise ValueError(f"a path must hold at least one node, got shape {tuple(idx.shape)}")
    if idx.numel() and (idx.min().item() < 0 or idx.max().item() >= N):
        raise ValueError(f"path nodes must lie in [0, N) = [0, {N}), "
                         f"got range [{idx.min().item()}, {idx.max().item()}]")
    w = W[idx[..., :-1].long(), idx[..., 1:].long()]
    out = torch.log(w).sum(-1) if log else w.prod(-1)
    return out.to(dtype)


def best_path(W, source: int, target: int) -> tuple[list[int], float]:
    r"""The path from ``source`` to ``target`` of largest :func:`path_relevance`, and that relevance.

    With every weight in :math:`(0, 1]`, maximising :math:`\prod w_{ij}` is minimising
    :math:`\sum -\log w_{ij} \ge 0`, a shortest-path problem that Dijkstra's algorithm solves in
    :math:`O(N^2)` on a dense matrix (the best walk is then a simple path). Weights above 1 raise
    ``ValueError``. Returns ``([], 0.0)`` when ``target`` cannot be reached.

    >>> best_path(torch.tensor([[0.0, 0.5, 0.2], [0.0, 0.0, 0.8], [0.0, 0.0, 0.0]]), 0, 2)
    ([0, 1, 2], 0.4)
    """
    W, _ = _weights(W, "W")
    N = W.shape[0]
    source, target = check_int(source, "source", low=0, high=N - 1), check_int(target, "target", low=0, high=N - 1)
    if W.numel() and W.max().item() > 1:
        raise ValueError(f"best_path needs weights in [0, 1] (e.g. a transition matrix), "
                         f"got maximum {W.max().item():.4g}")
    cost = (-torch.log(W)).tolist()
    dist, prev, done = {source: 0.0}, {}, set()
    heap = [(0.0, source)]
    while heap:
        d_u, u = heapq.heappop(heap)
        if u in done:
            continue
        done.add(u)
        if u == target:
            break
        for x in range(N):
            c = cost[u][x]
            if x not in done and c < math.inf and d_u + c < dist.get(x, math.inf):
                dist[x], prev[x] = d_u + c, u
                heapq.heappush(heap, (d_u + c, x))
    if target not in done:
        return [], 0.0
    path = [target]
    while path[-1] != source:
        path.append(prev[path[-1]])
    return path[::-1], math.exp(-dist[target])
