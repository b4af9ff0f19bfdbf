r"""Probabilistic retrieval (chapter 21, ids 21.10-21.14): query likelihood, smoothing, the PRP and the BIM.

Two routes from probability to a ranking:

* **Language models** (21.10-21.12): each document is a bag of words from which the query might have
  been drawn; rank by :math:`\log P(q\mid d)`. The maximum-likelihood estimate gives probability 0 to
  every word the document lacks, so it is smoothed with the collection model
  :math:`P(t\mid C) = count(t, C)/|C|` (Dirichlet or Jelinek-Mercer).
* **Relevance models** (21.13, 21.14): the probability ranking principle orders documents by
  :math:`P(R=1\mid d, q)`; the binary independence model turns that into a sum of per-term log odds,
  whose relevance-free form is the RSJ idf of :func:`llmbook.rag.sparse.idf`.

Inputs are analysed term lists (:func:`llmbook.rag.sparse.analyze`), counted by
:func:`llmbook.rag.sparse.term_stats`. Query terms that never occur in the collection are dropped
(their collection probability is 0: every document would score :math:`-\infty`). Scores are float64;
:math:`-\infty` means "cannot generate the query" (unsmoothed models), i.e. "not retrieved".
"""

from __future__ import annotations

import torch
from torch import Tensor

from llmbook._checks import as_tensor, check_dim, check_finite, check_range, check_same_shape, check_size
from llmbook.rag.sparse import term_stats
from llmbook.registry import implements

__all__ = ["bim_scores", "dirichlet_smoothing", "jelinek_mercer_smoothing", "probability_ranking",
           "query_likelihood_scores"]


def _smoothing_inputs(counts, doc_len, p_C):
    counts = as_tensor(counts, "counts").to(torch.float64)
    doc_len = as_tensor(doc_len, "doc_len").to(torch.float64)
    p_C = as_tensor(p_C, "p_C").to(torch.float64)
    check_dim(counts, "counts", "(N, V)", min_dim=2, max_dim=2)
    check_dim(doc_len, "doc_len", "(N,)", min_dim=1, max_dim=1)
    check_dim(p_C, "p_C", "(V,)", min_dim=1, max_dim=1)
    check_size(doc_len, 0, counts.shape[0], "doc_len", "counts (N, V) and doc_len (N,)")
    check_size(p_C, 0, counts.shape[1], "p_C", "counts (N, V) and p_C (V,)")
    for x, n in ((counts, "counts"), (doc_len, "doc_len"), (p_C, "p_C")):
        check_finite(x, n)
        if bool((x < 0).any()):
            raise ValueError(f"{n} must be nonnegative, got a minimum of {x.min().item()}")
    if bool((p_C > 1).any()):
        raise ValueError(f"p_C holds probabilities and must lie in [0, 1], got a maximum of {p_C.max().item()}")
    return counts, doc_len, p_C


@implements("21.11")
def dirichlet_smoothing(counts, doc_len, p_C, *, mu: float = 2000.0) -> Tensor:
    r"""Dirichlet-smoothed term probabilities :math:`\frac{count(t,d) + \mu P(t\mid C)}{|d| + \mu}` (21.11).

    The document is topped up with :math:`\mu` pseudo-words drawn from the collection: a short
    document leans on the collection more than a long one (Zhai and Lafferty's default :math:`\mu=2000`).

    Symbols -> arguments: ``counts`` ``(N, V)`` = :math:`count(t,d)`, ``doc_len`` ``(N,)`` = :math:`|d|`,
    ``p_C`` ``(V,)`` = :math:`P(t\mid C)`, ``mu >= 0``. Returns ``(N, V)`` float64 (``mu = 0`` is the
    maximum-likelihood estimate; an empty document then gets 0).

    >>> counts, doc_len, p_C = torch.tensor([[2.0], [0.0]]), torch.tensor([4.0, 4.0]), torch.tensor([0.1])
    >>> dirichlet_smoothing(counts, doc_len, p_C, mu=6.0).tolist()
    [[0.26], [0.06]]
    """
    mu = check_range(mu, "mu", 0.0)
    counts, doc_len, p_C = _smoothing_inputs(counts, doc_len, p_C)
    den = (doc_len + mu)[:, None]
    return torch.where(den > 0, (counts + mu * p_C) / torch.where(den > 0, den, 1.0), 0.0)


@implements("21.12")
def jelinek_mercer_smoothing(counts, doc_len, p_C, *, lam: float = 0.1) -> Tensor:
    r"""Jelinek-Mercer smoothing :math:`(1-\lambda)\,P_{ML}(t\mid d) + \lambda\,P(t\mid C)` (21.12).

    A fixed mixture with the collection model, whatever the document's length;
    :math:`P_{ML}(t\mid d) = count(t,d)/|d|` (0 for an empty document). Arguments as in
    :func:`dirichlet_smoothing`, with ``lam`` = :math:`\lambda` in ``[0, 1]``. Returns ``(N, V)`` float64.

    >>> counts, doc_len, p_C = torch.tensor([[2.0], [0.0]]), torch.tensor([4.0, 4.0]), torch.tensor([0.1])
    >>> jelinek_mercer_smoothing(counts, doc_len, p_C, lam=0.5).tolist()
    [[0.3], [0.05]]
    """
    lam = check_range(lam, "lam", 0.0, 1.0)
    counts, doc_len, p_C = _smoothing_inputs(counts, doc_len, p_C)
    L = doc_len[:, None]
    p_ml = torch.where(L > 0, counts / torch.where(L > 0, L, 1.0), 0.0)
    return (1 - lam) * p_ml + lam * p_C


@implements("21.10")
def query_likelihood_scores(query_terms, doc_terms, *, smoothing: str = "dirichlet", mu: float = 2000.0,
                            lam: float = 0.1) -> Tensor:
    r"""Query likelihood :math:`\log P(q\mid d) = \sum_{t\in q} count(t,q)\log P(t\mid d)` (21.10).

    ``smoothing`` is ``"dirichlet"`` (:func:`dirichlet_smoothing`, ``mu``), ``"jm"``
    (:func:`jelinek_mercer_smoothing`, ``lam``) or ``"none"`` (maximum likelihood: a document missing
    a query term scores :math:`-\infty`). Query terms absent from the whole collection are dropped.

    Shapes: ``B`` query term lists, ``N >= 1`` document term lists -> ``(B, N)`` float64 (natural log).

    >>> query_likelihood_scores([["cat"]], [["cat", "sat"], ["dog", "sat"]], mu=2.0).round(decimals=4).tolist()
    [[-0.9808, -2.0794]]
    """
    if smoothing not in ("dirichlet", "jm", "none"):
        raise ValueError(f"smoothing must be one of 'dirichlet', 'jm', 'none', got {smoothing!r}")
    mu = check_range(mu, "mu", 0.0)
    lam = check_range(lam, "lam", 0.0, 1.0)
    s = term_stats(query_terms, doc_terms)
    total = s.doc_len.sum()
    if total == 0:
        raise ValueError("every document is empty (|C| = 0): the collection model P(t|C) is undefined")
    p_C = s.collection_counts / total
    if smoothing == "dirichlet":
        P = dirichlet_smoothing(s.counts, s.doc_len, p_C, mu=mu)
    elif smoothing == "jm":
        P = jelinek_mercer_smoothing(s.counts, s.doc_len, p_C, lam=lam)
    else:
        P = jelinek_mercer_smoothing(s.counts, s.doc_len, p_C, lam=0.0)
    seen = s.collection_counts > 0
    qc = s.query_counts[:, seen]
    logP = torch.log(P[:, seen])  # (N, V'); -inf where P = 0
    # sum_t count(t, q) log P(t|d), with 0 * log 0 = 0 for terms the query lacks
    terms = torch.where(qc[:, None, :] > 0, qc[:, None, :] * logP[None, :, :], 0.0)
    return terms.sum(-1)


@implements("21.13")
def probability_ranking(p_rel) -> Tensor:
    r"""The probability ranking principle: order documents by :math:`P(R=1\mid d, q)`, highest first (21.13).

    .. math:: d_i \succ d_j \iff P(R=1\mid d_i,q) > P(R=1\mid d_j,q)

    Under independent relevance this order maximises the expected number of relevant documents in
    every prefix, hence expected precision@k for all k and expected DCG (Robertson, 1977).

    Args: ``p_rel`` ``(..., N)`` probabilities in ``[0, 1]``. Returns ``(..., N)`` int64 document
    indices, best first; ties keep the lower index first (a stable sort).

    >>> probability_ranking(torch.tensor([0.2, 0.9, 0.5, 0.9])).tolist()
    [1, 3, 2, 0]
    """
    p = as_tensor(p_rel, "p_rel")
    check_dim(p, "p_rel", "(..., N)", min_dim=1)
    check_finite(p, "p_rel")
    if p.numel() and bool(((p < 0) | (p > 1)).any()):
        raise ValueError(f"p_rel holds probabilities and must lie in [0, 1], got [{p.min().item()}, {p.max().item()}]")
    return torch.sort(p.to(torch.float64), dim=-1, descending=True, stable=True).indices


@implements("21.14")
def bim_scores(query_terms, doc_terms, *, relevant=None) -> Tensor:
    r"""Binary independence model: :math:`\sum_{t\in q\cap d}\log\frac{p_t(1-u_t)}{u_t(1-p_t)}` (21.14).

    :math:`p_t = P(t\in d\mid R=1)` and :math:`u_t = P(t\in d\mid R=0)` are estimated with the
    Robertson-Sparck Jones half-counts from ``relevant`` (``(B, N)`` booleans: the known relevant
    documents of each query), :math:`p_t = (r_t + 0.5)/(R + 1)` and
    :math:`u_t = (df_t - r_t + 0.5)/(N - R + 1)`. Without relevance information (``None``) this is
    :math:`p_t = 1/2` and the weight is exactly the RSJ idf (21.04). Terms count once (binary).

    Shapes: ``B`` query term lists, ``N >= 1`` document term lists -> ``(B, N)`` float64.

    >>> bim_scores([["cat"]], [["cat", "sat"], ["dog", "sat"], ["dog"]]).round(decimals=4).tolist()
    [[0.5108, 0.0, 0.0]]
    """
    s = term_stats(query_terms, doc_terms)
    B, N = s.query_counts.shape[0], s.N
    if relevant is None:
        rel = torch.zeros(B, N, dtype=torch.float64)
    else:
        rel = as_tensor(relevant, "relevant", floating=False)
        if rel.dtype != torch.bool:
            raise TypeError(f"relevant must be a bool tensor of shape (B, N), got dtype {rel.dtype}")
        check_same_shape(rel, torch.empty(B, N), "relevant", "(B, N) = (queries, documents)")
        rel = rel.to(torch.float64)
    present = (s.counts > 0).to(torch.float64)  # (N, V)
    r = rel @ present  # (B, V): relevant documents containing t
    R = rel.sum(1, keepdim=True)  # (B, 1)
    p = (r + 0.5) / (R + 1)
    u = (s.df - r + 0.5) / (N - R + 1)
    c = torch.log(p) + torch.log1p(-u) - torch.log(u) - torch.log1p(-p)  # (B, V)
    c = torch.where(s.query_counts > 0, c, 0.0)
    return c @ present.T
