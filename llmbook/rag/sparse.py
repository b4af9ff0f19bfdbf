"""Sparse retrieval: term statistics, TF-IDF and the BM25 family over bags of words (chapter 21).

:func:`analyze` is the one text analyser of Part II: every sparse retriever of the book (and the
pipeline of :mod:`llmbook.rag.pipeline`) turns text into terms with it.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from dataclasses import dataclass

import torch
from torch import Tensor

from llmbook._checks import as_tensor, check_choice, check_finite, check_positive_int, check_range
from llmbook.registry import implements

__all__ = ["IDF_KINDS", "STOPWORDS", "TermStats", "analyze", "bm25_scores", "bm25f_scores", "idf", "log_tf",
           "term_stats", "tfidf_scores"]

#: A short English stopword list (function words only; domain words such as "attention" stay).
STOPWORDS = frozenset("""
a about above after again against all am an and any are as at be because been before being below between both
but by can could did do does doing down during each few for from further had has have having he her here hers
herself him himself his how i if in into is it its itself just me more most my myself no nor not now of off on
once only or other our ours ourselves out over own same she should so some such than that the their theirs them
themselves then there these they this those through to too under until up very was we were what when where which
while who whom why will with would you your yours yourself yourselves
""".split())

_TOKEN = re.compile(r"[a-z0-9]+")


def analyze(text: str) -> list[str]:
    r"""Terms of ``text``: lower-cased runs of letters and digits, stopwords removed, order kept.

    LaTeX commands become words (``\frac`` -> ``frac``), so an equation's symbols are searchable.

    >>> analyze("Why does RoPE rotate the query?  $\\frac{q}{2}$")
    ['rope', 'rotate', 'query', 'frac', 'q', '2']
    """
    if not isinstance(text, str):
        raise TypeError(f"text must be a str, got {type(text).__name__}")
    return [t for t in _TOKEN.findall(text.lower()) if t not in STOPWORDS]


# --------------------------------------------------------------------------- term statistics


def _check_terms(terms, name: str) -> list[list[str]]:
    """``terms`` as a list of lists of str (a list or tuple of analysed documents or queries)."""
    if isinstance(terms, (str, bytes)) or not isinstance(terms, (list, tuple)):
        raise TypeError(f"{name} must be a list of term lists (e.g. [analyze(text), ...]), got {type(terms).__name__}")
    out = []
    for i, row in enumerate(terms):
        if isinstance(row, (str, bytes)) or not isinstance(row, (list, tuple)):
            raise TypeError(f"{name}[{i}] must be a list of str terms, got {type(row).__name__}")
        for t in row:
            if not isinstance(t, str):
                raise TypeError(f"{name}[{i}] must contain only str terms, got {type(t).__name__}")
        out.append(list(row))
    return out


@dataclass(frozen=True)
class TermStats:
    """Counts of the query vocabulary over a collection, the input of every sparse scorer.

    ``vocabulary`` lists the ``V`` distinct query terms (first occurrence order); ``query_counts``
    ``(B, V)`` holds ``count(t, q)``, ``counts`` ``(N, V)`` holds ``tf(t, d) = count(t, d)``,
    ``df`` ``(V,)`` the document frequencies, ``doc_len`` ``(N,)`` the lengths ``|d|`` (all float64);
    ``all_df`` the document frequency of every term of the collection (for collection-wide
    statistics such as rank-bm25's average idf) and ``total_len`` the collection length ``|C|``;
    ``collection_counts`` ``(V,)`` are ``count(t, C)``.
    """

    vocabulary: tuple
    query_counts: Tensor
    counts: Tensor
    df: Tensor
    doc_len: Tensor
    collection_counts: Tensor
    all_df: Tensor
    N: int


@implements("21.01")
def term_stats(query_terms, doc_terms) -> TermStats:
    r"""Term frequencies :math:`tf(t,d) = count(t,d)` of the query terms in every document (21.01).

    Args:
        query_terms: ``B`` analysed queries (lists of str), e.g. ``[analyze(q) for q in queries]``.
        doc_terms: ``N >= 1`` analysed documents (lists of str).

    Returns: a :class:`TermStats` with the ``(N, V)`` count matrix over the ``V`` distinct query terms.
    Only the query vocabulary is materialised, so the matrix stays small for any collection.

    >>> s = term_stats([["cat", "dog"]], [["cat", "cat"], ["dog"]])
    >>> s.counts.tolist(), s.df.tolist(), s.doc_len.tolist()
    ([[2.0, 0.0], [0.0, 1.0]], [1.0, 1.0], [2.0, 1.0])
    """
    Q = _check_terms(query_terms, "query_terms")
    D = _check_terms(doc_terms, "doc_terms")
    if len(D) == 0:
        raise ValueError("doc_terms must hold at least one document (N >= 1), got N = 0")
    vocab: dict[str, int] = {}
    for q in Q:
        for t in q:
            vocab.setdefault(t, len(vocab))
    V = len(vocab)
    qc = torch.zeros(len(Q), V, dtype=torch.float64)
    for i, q in enumerate(Q):
        for t, c in Counter(q).items():
            qc[i, vocab[t]] = c
    rows, cols, vals = [], [], []
    all_df: Counter = Counter()
    for n, d in enumerate(D):
        cnt = Counter(d)
        all_df.update(cnt.keys())
        for t, c in cnt.items():
            j = vocab.get(t)
            if j is not None:
                rows.append(n)
                cols.append(j)
                vals.append(float(c))
    counts = torch.zeros(len(D), V, dtype=torch.float64)
    if vals:
        counts[torch.tensor(rows), torch.tensor(cols)] = torch.tensor(vals, dtype=torch.float64)
    return TermStats(
        vocabulary=tuple(vocab),
        query_counts=qc,
        counts=counts,
        df=(counts > 0).sum(0).to(torch.float64),
        doc_len=torch.tensor([float(len(d)) for d in D], dtype=torch.float64),
        collection_counts=counts.sum(0),
        all_df=torch.tensor(sorted(all_df.values()), dtype=torch.float64),
        N=len(D),
    )


@implements("21.03", "21.04")
def idf(df, N: int, *, kind: str = "log") -> Tensor:
    r"""Inverse document frequency of terms with document frequency ``df`` in ``N`` documents.

    .. math:: idf(t) = \log\frac{N}{df(t)} \ (21.03), \qquad
              idf_{RSJ}(t) = \log\frac{N - df(t) + 0.5}{df(t) + 0.5} \ (21.04)

    ``kind`` picks the variant (natural logs throughout):

    * ``"log"``: :math:`\log(N/df)` (21.03; bm25s ``"atire"``); ``+inf`` where ``df = 0``;
    * ``"rsj"``: the Robertson-Sparck Jones weight (21.04), negative when ``df > N/2``;
    * ``"lucene"``: :math:`\log(1 + (N - df + 0.5)/(df + 0.5))`, always positive (Lucene, bm25s default);
    * ``"bm25l"``: :math:`\log((N + 1)/(df + 0.5))` (rank-bm25's and bm25s's BM25L);
    * ``"bm25plus"``: :math:`\log((N + 1)/df)` (rank-bm25's and bm25s's BM25+);
    * ``"sklearn"``: :math:`\log(N/df) + 1` (scikit-learn's ``TfidfVectorizer(smooth_idf=False)``);
    * ``"sklearn_smooth"``: :math:`\log((1 + N)/(1 + df)) + 1` (its default ``smooth_idf=True``).

    Args: ``df`` tensor of document frequencies in ``[0, N]``, any shape; ``N >= 1``.
    Returns: float64 tensor of ``df``'s shape.

    >>> idf(torch.tensor([1.0, 5.0]), 10, kind="rsj").round(decimals=4).tolist()
    [1.8458, 0.0]
    """
    check_choice(kind, "kind", IDF_KINDS)
    N = check_positive_int(N, "N")
    df = as_tensor(df, "df").to(torch.float64)
    check_finite(df, "df")
    if bool(((df < 0) | (df > N)).any()):
        raise ValueError(f"df must lie in [0, N] = [0, {N}], got values in [{df.min().item()}, {df.max().item()}]")
    if kind == "log":
        return torch.log(N / df)
    if kind == "rsj":
        return torch.log((N - df + 0.5) / (df + 0.5))
    if kind == "lucene":
        return torch.log1p((N - df + 0.5) / (df + 0.5))
    if kind == "bm25l":
        return torch.log((N + 1) / (df + 0.5))
    if kind == "bm25plus":
        return torch.log((N + 1) / df)
    if kind == "sklearn":
        return torch.log(N / df) + 1
    return torch.log((1.0 + N) / (1.0 + df)) + 1


IDF_KINDS = ("log", "rsj", "lucene", "bm25l", "bm25plus", "sklearn", "sklearn_smooth")


def _bm25_idf(s: TermStats, kind: str, epsilon: float) -> Tensor:
    """The idf of the query vocabulary; ``"rsj_floor"`` is rank-bm25's BM25Okapi flooring."""
    if kind == "rsj_floor":
        # rank-bm25 BM25Okapi: negative RSJ weights are replaced by epsilon * (mean RSJ idf over the
        # whole collection vocabulary); a weight of exactly 0 stays 0.
        mean_idf = idf(s.all_df, s.N, kind="rsj").mean() if s.all_df.numel() else torch.tensor(0.0, dtype=torch.float64)
        w = idf(s.df, s.N, kind="rsj")
        return torch.where(w < 0, epsilon * mean_idf, w)
    if kind == "rsj_clip":
        return idf(s.df, s.N, kind="rsj").clamp_min(0.0)  # bm25s "robertson": the inner ratio floored at 1
    return idf(s.df, s.N, kind=kind)


@implements("21.06", "21.07", "21.08")
def bm25_scores(query_terms, doc_terms, *, k1: float = 1.2, b: float = 0.75, variant: str = "okapi",
                delta: float | None = None, idf_kind: str = "lucene", epsilon: float = 0.25) -> Tensor:
    r"""BM25 scores of ``B`` queries against ``N`` documents: Okapi BM25 (21.06), BM25+ (21.07), BM25L (21.08).

    .. math::
        BM25(q,d) = \sum_{t\in q} idf(t)\,\frac{tf(t,d)\,(k_1+1)}{tf(t,d) + k_1\,(1 - b + b\,|d|/avgdl)}

    BM25+ adds :math:`\delta` inside the sum for every query term present in ``d``; BM25L scores
    :math:`(k_1+1)(c+\delta)/(k_1+c+\delta)` with :math:`c = tf/(1-b+b|d|/avgdl)` for present terms.
    The sum runs over the query's terms with repetition (a term twice in ``q`` counts twice); a term
    absent from ``d`` contributes 0 (BM25+/BM25L as in Lv and Zhai). rank-bm25's ``BM25Plus`` and bm25s
    also score absent terms (``delta * idf``, a per-query constant for BM25+; for bm25s's BM25L the
    formula at ``c = 0``, which depends on ``d``): add that back to compare.

    Symbols -> arguments: :math:`k_1` ``k1 >= 0`` (tf saturation), :math:`b` ``b`` in ``[0, 1]``
    (length normalisation), :math:`\delta` ``delta >= 0`` (default 1 for BM25+, 0.5 for BM25L; unused by Okapi),
    :math:`idf` ``idf_kind``: one of :func:`idf`'s kinds, or ``"rsj_floor"`` (rank-bm25's BM25Okapi:
    negative RSJ weights become ``epsilon`` times the mean RSJ weight of the collection vocabulary)
    or ``"rsj_clip"`` (bm25s ``"robertson"``: negative weights become 0). The default ``"lucene"``
    idf is positive, as in Lucene/Elasticsearch (whose defaults are also ``k1=1.2, b=0.75``).

    Shapes: ``query_terms`` ``B`` term lists, ``doc_terms`` ``N >= 1`` term lists -> ``(B, N)`` float64.
    Vectorised: one ``(B, V) @ (V, N)`` product over the query vocabulary.

    >>> bm25_scores([["cat"]], [["cat", "sat"], ["dog", "sat"], ["dog"]], idf_kind="rsj").round(decimals=4).tolist()
    [[0.4722, 0.0, 0.0]]
    """
    k1 = check_range(k1, "k1", 0.0)
    b = check_range(b, "b", 0.0, 1.0)
    check_choice(variant, "variant", ("okapi", "plus", "l"))
    check_choice(idf_kind, "idf_kind", IDF_KINDS + ("rsj_floor", "rsj_clip"))
    epsilon = check_range(epsilon, "epsilon", 0.0)
    if delta is None:
        delta = {"okapi": 0.0, "plus": 1.0, "l": 0.5}[variant]
    delta = check_range(delta, "delta", 0.0)
    s = term_stats(query_terms, doc_terms)
    return _bm25_from_stats(s, k1=k1, b=b, variant=variant, delta=delta, w=_bm25_idf(s, idf_kind, epsilon))


def _bm25_from_stats(s: TermStats, *, k1, b, variant, delta, w) -> Tensor:
    avgdl = s.doc_len.mean()
    if avgdl == 0:
        raise ValueError("every document is empty (avgdl = 0): BM25's length normalisation |d|/avgdl is undefined")
    norm = (1 - b + b * s.doc_len / avgdl)[:, None]  # (N, 1)
    tf = s.counts
    present = tf > 0
    if variant == "l":
        c = tf / norm
        sat = (k1 + 1) * (c + delta) / (k1 + c + delta)
    else:
        den = tf + k1 * norm
        sat = torch.where(present, tf * (k1 + 1) / torch.where(present, den, 1.0), 0.0)
        if variant == "plus":
            sat = sat + delta
    W = torch.where(present, w[None, :] * sat, 0.0)  # (N, V): a term absent from d contributes 0
    return s.query_counts @ W.T


@implements("21.02")
def log_tf(counts) -> Tensor:
    r"""Log-scaled term frequency :math:`1 + \log count(t,d)` where the count is positive, else 0 (21.02).

    One occurrence weighs 1, ten weigh 3.3: repeated words stop dominating (scikit-learn's
    ``sublinear_tf=True``). ``counts`` is any tensor of nonnegative counts; returns float64, same shape.

    >>> log_tf(torch.tensor([0.0, 1.0, 10.0])).round(decimals=4).tolist()
    [0.0, 1.0, 3.3026]
    """
    c = as_tensor(counts, "counts").to(torch.float64)
    check_finite(c, "counts")
    if bool((c < 0).any()):
        raise ValueError(f"counts must be nonnegative, got a minimum of {c.min().item()}")
    return torch.where(c > 0, 1 + torch.log(torch.where(c > 0, c, 1.0)), 0.0)


@implements("21.05")
def tfidf_scores(query_terms, doc_terms, *, sublinear_tf: bool = False, idf_kind: str = "sklearn",
                 normalize: bool = True) -> Tensor:
    r"""TF-IDF scores :math:`\sum_t w(t,q)\,w(t,d)` with :math:`w(t,d) = tf(t,d)\cdot idf(t)` (21.05).

    Queries and documents become tf-idf vectors over the collection's vocabulary (idf from the
    documents only; query terms unseen in the collection are dropped, as scikit-learn's ``transform``
    does); with ``normalize`` both are L2-normalised, so the score is their cosine. ``sublinear_tf``
    uses :func:`log_tf`; ``idf_kind`` is one of :func:`idf`'s kinds (default ``"sklearn"``:
    :math:`\ln(N/df) + 1`, so a term in every document still counts). With the defaults this is
    ``TfidfVectorizer(smooth_idf=False)`` fitted on the documents, then ``X_q @ X_d.T``.

    Shapes: ``B`` and ``N >= 1`` term lists -> ``(B, N)`` float64.

    >>> tfidf_scores([["cat"]], [["cat", "sat"], ["dog"]]).round(decimals=4).tolist()
    [[0.7071, 0.0]]
    """
    check_choice(idf_kind, "idf_kind", IDF_KINDS)
    s = term_stats(query_terms, doc_terms)
    D = _check_terms(doc_terms, "doc_terms")
    df_all = Counter(t for d in D for t in set(d))
    known = torch.tensor([df_all.get(t, 0) > 0 for t in s.vocabulary], dtype=torch.bool)
    w = torch.where(known, idf(torch.where(known, s.df, 1.0), s.N, kind=idf_kind), 0.0)
    tf = log_tf if sublinear_tf else (lambda c: c)
    Wq = tf(s.query_counts) * w
    Wd = tf(s.counts) * w
    scores = Wq @ Wd.T
    if normalize:
        # the document norm runs over its whole vocabulary, not only the query terms
        terms = sorted(df_all)
        w_all = dict(zip(terms, idf(torch.tensor([float(df_all[t]) for t in terms]), s.N, kind=idf_kind).tolist(),
                         strict=True))
        tf1 = (lambda c: 1.0 + math.log(c)) if sublinear_tf else float  # noqa: E731  (c >= 1 here)
        dn = torch.tensor([math.sqrt(sum((tf1(c) * w_all[t]) ** 2 for t, c in Counter(d).items())) for d in D],
                          dtype=torch.float64)
        qn = Wq.norm(dim=1)
        scores = scores / torch.where(qn > 0, qn, 1.0)[:, None] / torch.where(dn > 0, dn, 1.0)[None, :]
    return scores


@implements("21.09")
def bm25f_scores(query_terms, fields, *, k1: float = 1.2, weights=None, b=0.75, idf_kind: str = "lucene") -> Tensor:
    r"""BM25F: per-field length-normalised term frequencies, weighted and summed, then saturated once (21.09).

    .. math:: BM25F(q,d) = \sum_{t\in q} idf(t)\,\frac{w_t(d)}{k_1 + w_t(d)}, \qquad
              w_t(d) = \sum_f \frac{w_f\, tf_{t,f}}{1 - b_f + b_f\,|d_f|/avgdl_f}

    Symbols -> arguments: ``fields`` is a list of ``F`` fields, each a list of the ``N`` documents'
    term lists for that field (e.g. ``[titles, bodies]``); :math:`w_f` ``weights`` (``F`` nonnegative
    numbers, default all 1); :math:`b_f` ``b`` (one number or ``F`` numbers in ``[0, 1]``); :math:`k_1`
    ``k1 >= 0``. The idf counts a document as containing ``t`` if any field does. With one field,
    BM25F is :func:`bm25_scores` divided by :math:`k_1 + 1` (the catalogue's form omits that constant).

    Shapes: ``B`` query term lists; each field ``N >= 1`` term lists -> ``(B, N)`` float64.

    >>> titles, bodies = [["cat"], []], [["cat", "sat"], ["dog", "cat"]]
    >>> bm25f_scores([["cat"]], [titles, bodies], weights=[2.0, 1.0]).round(decimals=4).tolist()
    [[0.1169, 0.0829]]
    """
    k1 = check_range(k1, "k1", 0.0)
    check_choice(idf_kind, "idf_kind", IDF_KINDS)
    if isinstance(fields, (str, bytes)) or not isinstance(fields, (list, tuple)) or len(fields) == 0:
        raise ValueError("fields must be a non-empty list of fields, each a list of the N documents' term lists")
    F = len(fields)
    stats = [term_stats(query_terms, f) for f in fields]
    N = stats[0].N
    if any(s.N != N for s in stats):
        raise ValueError(f"every field must hold the same N documents, got sizes {[s.N for s in stats]}")
    weights = [1.0] * F if weights is None else list(weights)
    bs = [b] * F if not isinstance(b, (list, tuple)) else list(b)
    if len(weights) != F or len(bs) != F:
        raise ValueError(f"weights and b need one value per field (F = {F}), got {len(weights)} and {len(bs)}")
    for f in range(F):
        check_range(weights[f], f"weights[{f}]", 0.0)
        check_range(bs[f], f"b[{f}]", 0.0, 1.0)
    wt = torch.zeros_like(stats[0].counts)
    for f, s in enumerate(stats):
        avgdl = s.doc_len.mean()
        if avgdl == 0:
            raise ValueError(f"field {f} is empty in every document (avgdl_f = 0): its length normalisation is "
                             "undefined")
        norm = (1 - bs[f] + bs[f] * s.doc_len / avgdl)[:, None]
        wt = wt + torch.where(s.counts > 0, weights[f] * s.counts / torch.where(s.counts > 0, norm, 1.0), 0.0)
    present = sum(s.counts for s in stats) > 0
    df = present.sum(0).to(torch.float64)
    w = torch.where(df > 0, idf(torch.where(df > 0, df, 1.0), N, kind=idf_kind), 0.0)
    W = torch.where(wt > 0, w * wt / torch.where(wt > 0, k1 + wt, 1.0), 0.0)
    return stats[0].query_counts @ W.T
