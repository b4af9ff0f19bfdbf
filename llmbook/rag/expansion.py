r"""Query expansion and relevance feedback: Rocchio, RM3 and HyDE (chapter 30).

A short query misses passages that answer it in other words. Feedback rewrites the query with the
words or the direction of documents judged, or merely assumed, relevant:

* **Rocchio** (30.01, :func:`rocchio`, Rocchio 1971): move the query vector toward the centroid of
  the relevant documents and away from the non-relevant ones,
  :math:`q'=\alpha q+\frac{\beta}{|D_r|}\sum_{d\in D_r}d-\frac{\gamma}{|D_{nr}|}\sum_{d\in D_{nr}}d`.
  It works on any vectors: tf-idf term weights or dense embeddings.
* **Relevance model** (30.02, :func:`relevance_model`, Lavrenko & Croft 2001): the distribution of
  words in the (pseudo-)relevant documents, :math:`P(w\mid R)=\sum_d P(w\mid d)P(d\mid q)`.
* **RM3 interpolation** (30.03, :func:`rm3_interpolate`, Abdul-Jaleel et al. 2004): mix it with the
  original query model, :math:`P'(w\mid q)=\lambda P(w\mid q)+(1-\lambda)P(w\mid R)`.
* **HyDE** (30.04, :func:`hyde`, Gao et al. 2023): embed a *hypothetical answer* written by an LLM
  instead of the question, and retrieve its nearest passage,
  :math:`d^*=\arg\max_{d}\cos(f(h_\theta(q)), g(d))`.

Helpers for the book's corpus: :func:`term_counts` (term lists to a count matrix),
:func:`keep_top_terms` (RM3's ``fbTerms`` pruning), :func:`rm3_query` (the whole RM3 recipe on term
lists, as in Anserini), :func:`weighted_bm25` (BM25 of a weighted query, a sum of per-term BM25
scores) and :func:`dense_prf` (Rocchio on embeddings with the top-k retrieved as relevant).

Conventions: vectors are the last axis; leading axes are a batch of queries. Probability vectors are
checked to lie on the simplex up to the rounding of their dtype; fp16/bf16 inputs are computed in
float32 and rounded once at the end (``llmbook._precision``).

>>> P_w_d = torch.tensor([[0.5, 0.5, 0.0], [0.0, 0.5, 0.5]])   # two feedback documents over 3 words
>>> P_R = relevance_model(P_w_d, torch.tensor([0.75, 0.25]))
>>> P_R.tolist()
[0.375, 0.5, 0.125]
>>> rm3_interpolate(torch.tensor([1.0, 0.0, 0.0]), P_R, lam=0.5).tolist()
[0.6875, 0.25, 0.0625]
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection, Sequence
from importlib import resources
from typing import NamedTuple

import torch
from torch import Tensor

from llmbook._checks import (
    as_tensor,
    check_dim,
    check_finite,
    check_int,
    check_nonempty,
    check_probability,
    check_range,
    check_same_dtype,
    check_same_last_dim,
    check_unit_interval,
)
from llmbook._precision import restore_half, upcast_half
from llmbook.rag.similarity import cosine_similarity
from llmbook.registry import implements

__all__ = ["rocchio", "relevance_model", "rm3_interpolate", "HyDEResult", "hyde", "term_counts",
           "keep_top_terms", "rm3_query", "weighted_bm25", "dense_prf", "load_hypothetical_documents"]

#: Pre-written stand-ins for an LLM's hypothetical answers to the labelled queries (chapter 30).
HYDE_FILE = "hyde_documents.tsv"


def _float(x, name: str, contract: str, min_dim: int = 1) -> Tensor:
    t = as_tensor(x, name)
    check_dim(t, name, contract, min_dim=min_dim)
    check_finite(t, name)
    return t


def _lead(a: Tensor, b: Tensor, name_a: str, name_b: str, contract: str) -> None:
    if a.shape[:-1] != b.shape[:-2]:
        raise ValueError(f"{name_a} {tuple(a.shape)} and {name_b} {tuple(b.shape)} must be {contract} "
                         "with the same leading (batch) axes")


def _simplex(p: Tensor, name: str) -> None:
    """``p`` on the probability simplex along its last axis, up to the rounding of its dtype."""
    eps = torch.finfo(p.dtype).eps
    check_probability(p.double(), name, atol=max(1e-4, 4 * max(p.shape[-1], 1) * eps))


# ----------------------------------------------------------------------------------------------- Rocchio


@implements("30.01")
def rocchio(q, D_r, D_nr=None, *, alpha: float = 1.0, beta: float = 0.75, gamma: float = 0.15,
            clip_negative: bool = False) -> Tensor:
    r"""The Rocchio query update: move ``q`` toward the relevant centroid and away from the non-relevant one.

    .. math::
        q' = \alpha q + \frac{\beta}{|D_r|}\sum_{d\in D_r} d - \frac{\gamma}{|D_{nr}|}\sum_{d\in D_{nr}} d

    Symbols: :math:`q` = ``q``, :math:`D_r` = the rows of ``D_r``, :math:`D_{nr}` = the rows of ``D_nr``
    (``None``: no non-relevant documents, as in pseudo-relevance feedback), :math:`\alpha, \beta,
    \gamma` = ``alpha, beta, gamma`` (defaults 1, 0.75, 0.15, the values of Manning et al.'s textbook).
    An empty set contributes nothing (its centroid is taken as 0). ``clip_negative`` sets negative
    entries of :math:`q'` to 0, the usual rule for term weights; leave it off for embeddings.
    ``alpha = 1, beta = gamma = 0`` returns ``q`` unchanged.

    Shapes: ``q`` ``(*, D)``, ``D_r`` ``(*, R, D)``, ``D_nr`` ``(*, S, D)`` with the same leading axes
    ``*`` -> ``(*, D)``.

    >>> rocchio(torch.tensor([1.0, 0.0]), torch.tensor([[0.0, 1.0], [0.0, 3.0]]), alpha=1, beta=0.5, gamma=0)
    tensor([1., 1.])
    """
    alpha = check_range(alpha, "alpha", 0.0)
    beta = check_range(beta, "beta", 0.0)
    gamma = check_range(gamma, "gamma", 0.0)
    q = _float(q, "q", "(*, D)")
    D_r = _float(D_r, "D_r", "(*, R, D)", min_dim=2)
    check_same_dtype(q, D_r, "q", "D_r")
    check_same_last_dim(q, D_r, "q", "D_r", "D")
    _lead(q, D_r, "q", "D_r", "(*, D) and (*, R, D)")
    dtype = q.dtype
    qc, Dr = upcast_half(q), upcast_half(D_r)
    out = alpha * qc + beta * Dr.sum(-2) / max(Dr.shape[-2], 1)
    if D_nr is not None:
        D_nr = _float(D_nr, "D_nr", "(*, S, D)", min_dim=2)
        check_same_dtype(q, D_nr, "q", "D_nr")
        check_same_last_dim(q, D_nr, "q", "D_nr", "D")
        _lead(q, D_nr, "q", "D_nr", "(*, D) and (*, S, D)")
        Dn = upcast_half(D_nr)
        out = out - gamma * Dn.sum(-2) / max(Dn.shape[-2], 1)
    if clip_negative:
        out = out.clamp_min(0.0)
    return restore_half(out, dtype)


# ----------------------------------------------------------------------------------------------- RM3


@implements("30.02")
def relevance_model(P_w_d, P_d_q) -> Tensor:
    r"""The relevance model RM1: the word distribution of the feedback documents, weighted by their relevance.

    .. math::
        P(w\mid R) = \sum_{d\in D_{PRF}} P(w\mid d)\,P(d\mid q)

    Symbols: :math:`P(w\mid d)` = ``P_w_d[..., d, w]``, the language model of feedback document
    :math:`d` over a vocabulary of :math:`V` words; :math:`P(d\mid q)` = ``P_d_q[..., d]``. Both are
    normalised here: a row of ``P_w_d`` may be raw term counts (its maximum-likelihood model is
    ``counts / |d|``) and ``P_d_q`` any non-negative weights, e.g. query likelihoods
    :math:`P(q\mid d)` (Bayes with a uniform prior, as in Lavrenko & Croft) or, as Anserini does,
    the documents' BM25 scores. Every document needs a non-zero row and the weights a non-zero sum.
    The result lies on the simplex: it is a mixture of distributions.

    Shapes: ``P_w_d`` ``(*, k, V)``, ``P_d_q`` ``(*, k)`` -> ``(*, V)``.

    >>> relevance_model(torch.tensor([[2.0, 0.0], [1.0, 1.0]]), torch.tensor([1.0, 1.0])).tolist()
    [0.75, 0.25]
    """
    P = _float(P_w_d, "P_w_d", "(*, k, V)", min_dim=2)
    w = _float(P_d_q, "P_d_q", "(*, k)")
    check_same_dtype(P, w, "P_w_d", "P_d_q")
    if P.shape[:-1] != w.shape:
        raise ValueError(f"P_w_d {tuple(P.shape)} and P_d_q {tuple(w.shape)} must be (*, k, V) and (*, k) "
                         "with the same k and leading axes")
    check_nonempty(P, "P_w_d", -2)
    if (P < 0).any() or (w < 0).any():
        raise ValueError("P_w_d and P_d_q must be non-negative (probabilities, counts or scores >= 0)")
    dtype = P.dtype
    P, w = upcast_half(P), upcast_half(w)
    rows, total = P.sum(-1), w.sum(-1)
    if P.shape[-1] == 0 or (rows <= 0).any():
        raise ValueError(f"every feedback document needs a non-zero row in P_w_d (shape {tuple(P.shape)})")
    if (total <= 0).any():
        raise ValueError("P_d_q must have a positive sum over the feedback documents")
    P = P / rows[..., None]
    w = w / total[..., None]
    return restore_half((w[..., None] * P).sum(-2), dtype)


@implements("30.03")
def rm3_interpolate(P_w_q, P_w_R, lam: float = 0.5) -> Tensor:
    r"""RM3: interpolate the original query model with the relevance model.

    .. math::
        P'(w\mid q) = \lambda P(w\mid q) + (1-\lambda) P(w\mid R)

    Symbols: :math:`P(w\mid q)` = ``P_w_q`` (the maximum-likelihood query model, term counts over
    query length), :math:`P(w\mid R)` = ``P_w_R`` (from :func:`relevance_model`, usually pruned to
    its top ``fbTerms`` words with :func:`keep_top_terms`), :math:`\lambda` = ``lam`` (Anserini's
    ``originalQueryWeight``, default 0.5). Both must lie on the simplex; so does the result.
    ``lam = 1`` is the original query, ``lam = 0`` the feedback alone.

    Shapes: ``P_w_q`` and ``P_w_R`` ``(*, V)`` -> ``(*, V)``.

    >>> rm3_interpolate(torch.tensor([0.5, 0.5, 0.0], dtype=torch.float64), torch.tensor([0.0, 0.5, 0.5],
    ...                 dtype=torch.float64), lam=0.8).tolist()
    [0.4, 0.5, 0.1]
    """
    lam = check_unit_interval(lam, "lam")
    Pq = _float(P_w_q, "P_w_q", "(*, V)")
    PR = _float(P_w_R, "P_w_R", "(*, V)")
    check_same_dtype(Pq, PR, "P_w_q", "P_w_R")
    if Pq.shape != PR.shape:
        raise ValueError(f"P_w_q {tuple(Pq.shape)} and P_w_R {tuple(PR.shape)} must have the same shape (*, V)")
    check_nonempty(Pq, "P_w_q")
    _simplex(Pq, "P_w_q")
    _simplex(PR, "P_w_R")
    dtype = Pq.dtype
    out = lam * upcast_half(Pq) + (1.0 - lam) * upcast_half(PR)
    return restore_half(out, dtype)


# ----------------------------------------------------------------------------------------------- HyDE


class HyDEResult(NamedTuple):
    """HyDE's search vector, its cosine with every document, and the best document per query."""

    v: Tensor  # (B, D) the mean of the hypothetical documents' (and optionally the query's) embeddings
    scores: Tensor  # (B, N) cos(v, g(d))
    best: Tensor  # (B,) long: argmax over the documents (the lowest index on ties)


@implements("30.04")
def hyde(h, g, *, q=None) -> HyDEResult:
    r"""Hypothetical document embeddings: retrieve with the embedding of a generated answer, not of the question.

    .. math::
        d^* = \arg\max_{d\in D}\ \cos\big(f(h_\theta(q)),\, g(d)\big),
        \qquad \hat v = \frac{1}{M(+1)}\Big(\sum_{m=1}^{M} f(h_m) \,[+ f(q)]\Big)

    Symbols: :math:`f(h_\theta(q))` = ``h``, the embeddings of :math:`M` hypothetical documents an LLM
    wrote for each query (Gao et al. sample :math:`M = 8` and average them); :math:`g(d)` = the rows
    of ``g``, the document embeddings; ``q`` (optional) the query embeddings, averaged in as one more
    vector as in the paper's :math:`\hat v`. The cosine is :func:`llmbook.rag.similarity.cosine_similarity`.

    Shapes: ``h`` ``(B, M, D)`` or ``(B, D)`` (M = 1), ``g`` ``(N, D)`` with ``N >= 1``, ``q`` ``(B, D)``
    -> ``HyDEResult(v (B, D), scores (B, N), best (B,) long)``.

    >>> r = hyde(torch.tensor([[0.0, 1.0]]), torch.tensor([[1.0, 0.0], [0.6, 0.8]]), q=torch.tensor([[1.0, 0.0]]))
    >>> r.v.tolist(), r.best.tolist()
    ([[0.5, 0.5]], [1])
    """
    h = _float(h, "h", "(B, M, D) or (B, D)", min_dim=2)
    check_dim(h, "h", "(B, M, D) or (B, D)", min_dim=2, max_dim=3)
    g = _float(g, "g", "(N, D)", min_dim=2)
    check_dim(g, "g", "(N, D)", min_dim=2, max_dim=2)
    check_same_dtype(h, g, "h", "g")
    check_same_last_dim(h, g, "h", "g", "D")
    if g.shape[0] == 0:
        raise ValueError("g must hold at least one document (N >= 1) to take an argmax over")
    H = h if h.ndim == 3 else h[:, None, :]
    if H.shape[1] == 0 and q is None:
        raise ValueError("h must hold at least one hypothetical document per query (M >= 1) when q is None")
    dtype = h.dtype
    H = upcast_half(H)
    total, count = H.sum(1), H.shape[1]
    if q is not None:
        q = _float(q, "q", "(B, D)", min_dim=2)
        check_dim(q, "q", "(B, D)", min_dim=2, max_dim=2)
        check_same_dtype(q, h, "q", "h")
        if q.shape != total.shape:
            raise ValueError(f"q {tuple(q.shape)} must have shape (B, D) = {tuple(total.shape)} to match h")
        total, count = total + upcast_half(q), count + 1
    v = total / count
    scores = cosine_similarity(v, upcast_half(g))
    return HyDEResult(restore_half(v, dtype), restore_half(scores, dtype), scores.argmax(-1))


# ----------------------------------------------------------------------------------------------- helpers


def term_counts(term_lists: Sequence[Sequence[str]], vocab: Sequence[str]) -> Tensor:
    """Counts of each word of ``vocab`` in each term list: a ``(len(term_lists), V)`` float64 matrix.

    Terms outside ``vocab`` are ignored.

    >>> term_counts([["a", "b", "a"], ["c"]], ["a", "b"]).tolist()
    [[2.0, 1.0], [0.0, 0.0]]
    """
    col = {w: j for j, w in enumerate(vocab)}
    rows = [[0.0] * len(col) for _ in term_lists]
    for row, terms in zip(rows, term_lists, strict=True):
        for t, c in Counter(terms).items():
            if t in col:
                row[col[t]] = float(c)
    return torch.tensor(rows, dtype=torch.float64).reshape(len(term_lists), len(col))


def keep_top_terms(P, n_terms: int) -> Tensor:
    """RM3's ``fbTerms``: keep the ``n_terms`` most probable words of each row, zero the rest, renormalise.

    Ties go to the lower index. Shapes: ``P`` ``(*, V)`` -> ``(*, V)``.

    >>> keep_top_terms(torch.tensor([0.1, 0.6, 0.3]), 2).double().round(decimals=4).tolist()
    [0.0, 0.6667, 0.3333]
    """
    P = _float(P, "P", "(*, V)")
    n_terms = check_int(n_terms, "n_terms", low=1)
    if n_terms >= P.shape[-1]:
        return P / P.sum(-1, keepdim=True)
    order = torch.sort(P, dim=-1, descending=True, stable=True).indices[..., :n_terms]
    kept = torch.zeros_like(P).scatter(-1, order, P.gather(-1, order))
    return kept / kept.sum(-1, keepdim=True)


def rm3_query(query_terms: Sequence[str], feedback_terms: Sequence[Sequence[str]], doc_weights,
              *, fb_terms: int = 10, lam: float = 0.5, min_len: int = 1,
              exclude: Collection[str] = ()) -> dict[str, float]:
    """The RM3 recipe on term lists: the expanded query as ``{term: weight}`` (weights sum to 1).

    The query model is the query's term frequencies; the relevance model (:func:`relevance_model`)
    mixes the maximum-likelihood models of the feedback documents with weights ``doc_weights``
    (``(k,)``, e.g. their BM25 scores), keeps its ``fb_terms`` best words (:func:`keep_top_terms`) and
    is interpolated with the query model (:func:`rm3_interpolate`). Anserini's defaults are
    ``fbDocs = 10`` (the caller's ``k``), ``fbTerms = 10``, ``originalQueryWeight = 0.5``.
    ``min_len`` drops feedback terms shorter than that many characters, and ``exclude`` drops the terms
    it names, from the relevance model (the query's own terms always stay). Anserini filters the same
    way: it drops terms shorter than 2 characters and terms in more than 10% of the collection's
    documents, its stopword heuristic. In prose full of equations the commonest "words" of the feedback
    documents are symbols such as ``p``, ``x`` and ``1``.

    >>> q = rm3_query(["rope"], [["rope", "rotation"], ["rope", "position"]], torch.tensor([1.0, 1.0]), fb_terms=2)
    >>> {t: round(w, 3) for t, w in q.items()}
    {'rope': 0.833, 'position': 0.167}
    """
    if not query_terms:
        raise ValueError("query_terms must not be empty")
    min_len = check_int(min_len, "min_len", low=1)
    exclude = frozenset(exclude)
    feedback_terms = [[t for t in d if len(t) >= min_len and t not in exclude] for d in feedback_terms]
    vocab = sorted(set(query_terms).union(*map(set, feedback_terms)))
    P_w_q = term_counts([query_terms], vocab)[0]
    P_w_q = P_w_q / P_w_q.sum()
    P_w_R = keep_top_terms(relevance_model(term_counts(feedback_terms, vocab), as_tensor(doc_weights, "doc_weights")
                                           .double()), fb_terms)
    P = rm3_interpolate(P_w_q, P_w_R, lam)
    return {vocab[j]: P[j].item() for j in torch.argsort(-P, stable=True).tolist() if P[j] > 0}


def weighted_bm25(queries: Sequence[dict[str, float]], doc_terms: Sequence[Sequence[str]], **bm25_options) -> Tensor:
    r"""BM25 of weighted queries: :math:`s(q, d)=\sum_t w_t\,\mathrm{BM25}(t, d)`, shape ``(B, N)`` float64.

    Each distinct term is scored once with :func:`llmbook.rag.sparse.bm25_scores` as a one-word query
    (Okapi BM25 is a sum over query terms), and the weighted sum is a matrix product. This is how
    Lucene scores a boosted Boolean query, and so how Anserini runs RM3's expanded query.
    """
    from llmbook.rag import sparse

    vocab = sorted({t for q in queries for t in q})
    if not vocab:
        return torch.zeros(len(queries), len(doc_terms), dtype=torch.float64)
    per_term = sparse.bm25_scores([[t] for t in vocab], doc_terms, **bm25_options).double()  # (T, N)
    W = torch.zeros(len(queries), len(vocab), dtype=torch.float64)
    col = {t: j for j, t in enumerate(vocab)}
    for i, q in enumerate(queries):
        for t, w in q.items():
            W[i, col[t]] = w
    return W @ per_term


def dense_prf(q_emb, doc_emb, scores, *, k: int = 3, alpha: float = 1.0, beta: float = 0.75) -> Tensor:
    """Pseudo-relevance feedback on embeddings: Rocchio with the top-``k`` of ``scores`` as ``D_r``, unit rows.

    ``q_emb`` ``(B, D)``, ``doc_emb`` ``(N, D)``, ``scores`` ``(B, N)`` -> ``(B, D)`` unit-length queries.
    No labels are used: the top ``k`` are *assumed* relevant, and there is no non-relevant set.
    """
    q_emb, doc_emb = as_tensor(q_emb, "q_emb"), as_tensor(doc_emb, "doc_emb")
    k = check_int(k, "k", low=1, high=doc_emb.shape[0])
    top = as_tensor(scores, "scores").topk(k, dim=-1).indices  # (B, k)
    q_new = rocchio(q_emb, doc_emb[top], alpha=alpha, beta=beta, gamma=0.0)
    return q_new / q_new.norm(dim=-1, keepdim=True)


def load_hypothetical_documents() -> dict[str, str]:
    """The hypothetical documents of chapter 30, ``{query id: text}``: pre-written stand-ins for an LLM.

    They live in ``llmbook/data/hyde_documents.tsv`` and are registered in ``encoder_texts.txt``, so
    their MiniLM embeddings come from the cache (:func:`llmbook.rag.encoder.encode`).

    >>> docs = load_hypothetical_documents()
    >>> len(docs), docs["q10"].split()[0]
    (56, 'Rotary')
    """
    text = resources.files("llmbook.data").joinpath(HYDE_FILE).read_text(encoding="utf-8")
    rows = [line.split("\t") for line in text.splitlines() if line and not line.startswith("#")]
    return {qid: doc for qid, doc in rows[1:]}
