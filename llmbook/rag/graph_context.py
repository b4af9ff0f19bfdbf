r"""Graph context: one message-passing layer, and the book's own entity and passage graphs (chapter 31).

* **Graph context aggregation** (31.06, :func:`aggregate`): a node's new representation mixes its
  own features with a weighted sum of its neighbours',
  :math:`h_v' = \sigma\big(W_{self}h_v + \sum_{u\in N(v)}\alpha_{uv}W_{neigh}h_u\big)`, the layer
  of GraphSAGE (mean weights) and GAT (attention weights, :func:`attention_weights`).
* **The book's index as a graph.** :func:`index_terms` takes the *index* of the book to be the words
  that name its equations (the registry's catalogue: "attention", "softmax", "rope", "pagerank"...),
  kept when at least ``min_df`` passages use them. :func:`entity_graph` links two index terms by
  the number of passages in which both occur; :func:`passage_graph` links two passages by the
  index terms they share, each weighted by its idf, so that a shared rare term ("rope") counts more
  than a shared common one ("loss").
* **GraphRAG-style re-ranking** (:func:`graph_rerank`): seed personalised PageRank with a
  retriever's top hits and let the relevance flow over the passage graph, HippoRAG's recipe on a
  passage graph.

Everything here is cheap: the index has a few hundred terms, the corpus a few hundred passages,
and the graphs are dense float64 matrices built in one matrix product.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import torch
import torch.nn.functional as F

from llmbook._checks import as_tensor, check_choice, check_dim, check_finite, check_int, check_range, check_same_dtype
from llmbook._precision import restore_half, upcast_half
from llmbook.rag.graph import personalized_pagerank
from llmbook.registry import catalogue, implements

__all__ = ["aggregate", "attention_weights", "index_terms", "EntityGraph", "entity_graph", "passage_graph",
           "graph_rerank"]

_ACTIVATIONS = {"relu": torch.relu, "tanh": torch.tanh, "identity": lambda x: x}


def _graph_input(h, A, name_A: str = "A") -> tuple[torch.Tensor, torch.Tensor]:
    h = as_tensor(h, "h")
    check_dim(h, "h", "(..., N, D_in)", min_dim=2)
    check_finite(h, "h")
    A = as_tensor(A, name_A)
    check_dim(A, name_A, "(..., N, N)", min_dim=2)
    N = h.shape[-2]
    if A.shape[-2:] != (N, N):
        raise ValueError(f"{name_A} must be (..., N, N) with N = {N} (the nodes of h), got {tuple(A.shape)}")
    check_finite(A, name_A)
    if A.numel() and A.min().item() < 0:
        raise ValueError(f"{name_A} must hold non-negative edge weights, got minimum {A.min().item():.4g}")
    return h, A


@implements("31.06")
def aggregate(h, A, W_self, W_neigh, alpha=None, *, activation: str = "relu") -> torch.Tensor:
    r"""One message-passing layer: :math:`h_v'=\sigma\big(W_{self}h_v+\sum_{u\in N(v)}\alpha_{uv}W_{neigh}h_u\big)`.

    Symbols: :math:`h_v` = ``h[..., v, :]``, :math:`N(v)` = the nodes :math:`u` with ``A[..., v, u] > 0``
    (row :math:`v` lists the neighbours it receives from), :math:`\alpha_{uv}` = ``alpha[..., v, u]``
    (ignored where there is no edge), :math:`W_{self}` = ``W_self``, :math:`W_{neigh}` = ``W_neigh``
    (``nn.Linear`` layout: ``(D_out, D_in)``), :math:`\sigma` = ``activation`` (``"relu"``, ``"tanh"``
    or ``"identity"``). Without ``alpha`` the weights are the row-normalised edge weights,
    :math:`\alpha_{uv} = A_{vu}/\sum_{u'}A_{vu'}` (GraphSAGE's mean for a 0/1 graph; 0 for an isolated
    node); GAT's attention weights come from :func:`attention_weights`.

    Shapes: ``h`` ``(..., N, D_in)``, ``A`` and ``alpha`` ``(..., N, N)`` broadcastable with ``h``'s
    batch dims. Returns ``(..., N, D_out)``. fp16/bf16 are computed in float32.

    >>> h = torch.tensor([[1.0], [2.0], [4.0]]); A = torch.tensor([[0.0, 1, 1], [1, 0, 0], [1, 0, 0]])
    >>> aggregate(h, A, torch.eye(1), torch.eye(1)).squeeze(-1).tolist()     # own value + neighbours' mean
    [4.0, 3.0, 5.0]
    """
    h, A = _graph_input(h, A)
    check_choice(activation, "activation", tuple(_ACTIVATIONS))
    D_in = h.shape[-1]
    Ws, Wn = as_tensor(W_self, "W_self"), as_tensor(W_neigh, "W_neigh")
    for name, W in (("W_self", Ws), ("W_neigh", Wn)):
        check_dim(W, name, "(D_out, D_in)", min_dim=2, max_dim=2)
        if W.shape[1] != D_in:
            raise ValueError(f"{name} must be (D_out, D_in) with D_in = {D_in} (the last dim of h), "
                             f"got {tuple(W.shape)}")
        check_finite(W, name)
    if Ws.shape != Wn.shape:
        raise ValueError(f"W_self {tuple(Ws.shape)} and W_neigh {tuple(Wn.shape)} must both be (D_out, D_in)")
    check_same_dtype(h, Ws, "h", "W_self")
    check_same_dtype(h, Wn, "h", "W_neigh")
    dtype = h.dtype
    h, A, Ws, Wn = upcast_half(h), upcast_half(A).to(upcast_half(h).dtype), upcast_half(Ws), upcast_half(Wn)
    edge = A > 0
    if alpha is None:
        deg = A.sum(-1, keepdim=True)
        a = A / torch.where(deg > 0, deg, torch.ones_like(deg))
    else:
        a = as_tensor(alpha, "alpha")
        if a.shape != A.shape:
            raise ValueError(f"alpha must have the shape of A, {tuple(A.shape)}, got {tuple(a.shape)}")
        check_finite(a, "alpha")
        a = torch.where(edge, upcast_half(a).to(h.dtype), torch.zeros((), dtype=h.dtype))
    out = h @ Ws.T + a @ (h @ Wn.T)
    return restore_half(_ACTIVATIONS[activation](out), dtype)


def attention_weights(h, A, W, a, *, negative_slope: float = 0.2) -> torch.Tensor:
    r"""GAT's attention weights, :math:`\alpha_{uv}=\mathrm{softmax}_{u\in N(v)}\,e_{vu}`.

    :math:`e_{vu}=\mathrm{LeakyReLU}(a^\top[Wh_v\,\Vert\,Wh_u])` with slope ``negative_slope`` below 0.

    ``W`` ``(D_out, D_in)``, ``a`` ``(2 D_out,)``; the softmax runs over the neighbours of each
    :math:`v` (``A[..., v, u] > 0``), so each row of the result sums to 1, or is all 0 for an isolated
    node. Returns ``alpha`` ``(..., N, N)`` in :func:`aggregate`'s layout (row :math:`v`, column
    :math:`u`).
    """
    h, A = _graph_input(h, A)
    W, a = as_tensor(W, "W"), as_tensor(a, "a")
    check_dim(W, "W", "(D_out, D_in)", min_dim=2, max_dim=2)
    if W.shape[1] != h.shape[-1] or a.shape != (2 * W.shape[0],):
        raise ValueError(f"W must be (D_out, D_in = {h.shape[-1]}) and a (2 D_out,), "
                         f"got {tuple(W.shape)} and {tuple(a.shape)}")
    slope = check_range(negative_slope, "negative_slope", 0.0, math.inf)
    dtype = h.dtype
    z = upcast_half(h) @ upcast_half(W).T
    D_out = W.shape[0]
    a = upcast_half(a).to(z.dtype)
    e = F.leaky_relu((z @ a[:D_out]).unsqueeze(-1) + (z @ a[D_out:]).unsqueeze(-2), slope)
    edge = A > 0
    e = e.masked_fill(~edge, -math.inf)
    alpha = torch.softmax(e, dim=-1).nan_to_num(0.0)  # a row without neighbours: 0 / 0 -> 0
    return restore_half(alpha, dtype)


# ----------------------------------------------------------------------------------------------- the book's graphs


@lru_cache(maxsize=4)
def index_terms(min_df: int = 3, max_share: float = 0.05) -> tuple[str, ...]:
    """The book's index: analysed words of the equation names in the registry, in alphabetical order.

    A word is kept when at least ``min_df`` passages and at most a share ``max_share`` of all passages
    use it: rarer words link nothing, commoner ones ("one", "model") link everything. Numbers and
    words of fewer than three letters are left out.
    """
    from llmbook.rag.pipeline import book_data
    from llmbook.rag.sparse import analyze

    min_df = check_int(min_df, "min_df", low=1)
    max_share = check_range(max_share, "max_share", 0.0, 1.0, low_open=True)
    words = {t for e in catalogue().values() for t in analyze(e.name) if len(t) >= 3 and not t.isdigit()}
    df: dict[str, int] = {}
    for terms in book_data().doc_terms:
        for t in set(terms) & words:
            df[t] = df.get(t, 0) + 1
    N = len(book_data().doc_terms)
    return tuple(sorted(t for t, n in df.items() if min_df <= n <= max_share * N))


def _incidence(doc_terms, terms) -> torch.Tensor:
    """``(N, T)`` 0/1 float64: whether passage ``n`` uses index term ``t``."""
    col = {t: j for j, t in enumerate(terms)}
    X = torch.zeros(len(doc_terms), len(terms), dtype=torch.float64)
    for n, ts in enumerate(doc_terms):
        for t in set(ts):
            if t in col:
                X[n, col[t]] = 1.0
    return X


@dataclass(frozen=True)
class EntityGraph:
    """Index terms as nodes, co-occurrence in passages as edge weights."""

    #: The index terms, one per node.
    terms: tuple[str, ...]
    #: Co-occurrence counts, (T, T) float64 with a zero diagonal.
    A: torch.Tensor
    #: Passage-by-term incidence, (N, T) float64 0/1.
    X: torch.Tensor
    #: Each term's home chapter, the chapter whose passages use it most often, (T,) long.
    chapter: torch.Tensor


def entity_graph(data=None, terms: tuple[str, ...] | None = None, *, exclude: tuple[int, ...] = ()) -> EntityGraph:
    r"""The co-occurrence graph of the index terms: :math:`A = X^\top X` with the diagonal zeroed.

    ``X`` ``(N, T)`` marks which of the ``T`` index terms (default :func:`index_terms`) each of the
    ``N`` passages of ``data`` (default :func:`llmbook.rag.pipeline.book_data`) uses, so
    :math:`A_{st}` is the number of passages that use both :math:`s` and :math:`t`. The passages of
    the chapters in ``exclude`` are left out, and with them the terms that only they use (chapter 31
    leaves out its own passages, whose prose names the very examples it prints).
    """
    from llmbook.rag.pipeline import book_data

    data = book_data() if data is None else data
    terms = index_terms() if terms is None else tuple(terms)
    keep = [n for n, p in enumerate(data.passages) if p.chapter not in set(exclude)]
    X = _incidence([data.doc_terms[n] for n in keep], terms)
    if exclude:  # terms that only the excluded chapters use would be isolated nodes: drop them
        used = (X.sum(0) > 0).nonzero().flatten().tolist()
        terms, X = tuple(terms[j] for j in used), X[:, used]
    A = X.T @ X
    A.fill_diagonal_(0.0)
    chapters = torch.tensor([data.passages[n].chapter for n in keep], dtype=torch.long)
    C = int(chapters.max().item()) + 1 if len(chapters) else 1
    per_chapter = F.one_hot(chapters, C).double().T @ X  # (C, T) passages of each chapter using each term
    return EntityGraph(terms, A, X, per_chapter.argmax(0))


def passage_graph(data=None, terms: tuple[str, ...] | None = None) -> torch.Tensor:
    r"""Passages linked by shared index terms: :math:`W = X\,\mathrm{diag}(\mathrm{idf})\,X^\top`, diagonal zeroed.

    :math:`\mathrm{idf}_t = \log(N / \mathrm{df}_t)`: two passages that share a term few passages
    use are linked more strongly than two that share a common one. Returns ``(N, N)`` float64.
    """
    from llmbook.rag.pipeline import book_data

    data = book_data() if data is None else data
    terms = index_terms() if terms is None else tuple(terms)
    X = _incidence(data.doc_terms, terms)
    idf = torch.log(X.shape[0] / X.sum(0).clamp_min(1.0))
    W = (X * idf) @ X.T
    W.fill_diagonal_(0.0)
    return W


def graph_rerank(scores, W, *, k: int = 10, alpha: float = 0.5) -> torch.Tensor:
    r"""GraphRAG-style scores: personalised PageRank on ``W`` seeded by each query's top ``k`` hits.

    The restart distribution of query :math:`b` puts weight :math:`1/\mathrm{rank}` on its ``k``
    best-scored passages (rank 1 the best) and 0 elsewhere; the result is
    :func:`llmbook.rag.graph.personalized_pagerank` with ``alpha``, the probability of following an
    edge. A passage the walk never reaches scores 0. ``scores`` ``(B, N)``, ``W`` ``(N, N)``; returns
    ``(B, N)`` float64.
    """
    s = as_tensor(scores, "scores")
    check_dim(s, "scores", "(B, N)", min_dim=2, max_dim=2)
    k = check_int(k, "k", low=1, high=s.shape[1])
    top = s.topk(k, dim=1).indices
    v = torch.zeros(s.shape, dtype=torch.float64)
    v.scatter_(1, top, (1.0 / torch.arange(1, k + 1, dtype=torch.float64)).expand(s.shape[0], k))
    return personalized_pagerank(W, v, alpha)
