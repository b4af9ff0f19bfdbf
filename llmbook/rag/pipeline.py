"""Part II's retrieval pipeline over the book's own prose: the data every chapter evaluates on.

:func:`book_data` gathers, once per process, what a chapter needs to measure its piece on the book:
the passages (:func:`llmbook.rag.corpus.load_corpus`), the labelled queries, the ``(B, N)`` matrix of
relevance grades, the analysed terms of both sides (:func:`llmbook.rag.sparse.analyze`) and the cached
MiniLM embeddings (:mod:`llmbook.rag.encoder`). Scores are ``(B, N)`` tensors, one row per query and one
column per passage; :func:`evaluate_scores` turns them into the chapter 26 metrics.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch
from torch import Tensor

from llmbook.rag import chunking, encoder, fusion, metrics, sparse
from llmbook.rag.corpus import Passage, Query, load_corpus, load_queries, passage_text, qrels
from llmbook.rag.sparse import analyze

#: The retrievers :func:`search` offers (:func:`method_scores`); ``"hybrid"`` is the part's pipeline.
METHODS = ("hybrid", "bm25", "dense")
#: What ``python -m llmbook ask`` uses, the method with the best NDCG@10 on the dev queries
#: (:func:`llmbook.rag.collection.dev_winner`; ``tests/rag/test_collection.py`` keeps them equal).
DEFAULT_METHOD = "hybrid"

__all__ = ["CHUNK_STRIDE", "CHUNK_WORDS", "DEFAULT_METHOD", "METHODS", "METRICS", "BookData", "Hit", "book_data",
           "cache_texts", "chunk_texts", "dense_chunk_scores", "dense_scores", "evaluate_scores", "hybrid_scores",
           "labels_matrix", "method_scores", "metrics_table", "search", "section_level", "sparse_scores", "split_rows"]

#: Window length and stride (in words) of the chunks the dense index also embeds (chapter 27's fixed-size
#: chunking): about 200 MiniLM word pieces with the heading, inside the model's 256-token window.
CHUNK_WORDS, CHUNK_STRIDE = 96, 64

#: The metrics every Part II chapter reports on the book (chapter 26's definitions).
METRICS = ("ndcg@10", "recall@10", "mrr", "map")


def labels_matrix(queries: list[Query], passages: list[Passage]) -> Tensor:
    """Relevance grades as a ``(B, N)`` float64 tensor: :func:`llmbook.rag.corpus.qrels` as a matrix.

    >>> from llmbook.rag.corpus import load_corpus, load_queries
    >>> labels_matrix(load_queries()[:2], load_corpus()).shape[0]
    2
    """
    judged = qrels(queries, passages)
    column = {p.id: j for j, p in enumerate(passages)}
    out = torch.zeros(len(queries), len(passages), dtype=torch.float64)
    for i, q in enumerate(queries):
        for pid, g in judged[q.id].items():
            out[i, column[pid]] = g
    return out


@dataclass(frozen=True)
class BookData:
    """The book's corpus and labelled queries in the forms the retrievers take (see the module docstring)."""

    #: The corpus passages, in corpus order (columns of every score matrix).
    passages: tuple[Passage, ...]
    #: The labelled queries (rows of every score matrix).
    queries: tuple[Query, ...]
    #: Relevance grades, shape (B, N).
    labels: Tensor
    #: Analysed terms of each passage (heading and text).
    doc_terms: tuple[tuple[str, ...], ...]
    #: Analysed terms of each query.
    query_terms: tuple[tuple[str, ...], ...]
    #: Unit-length MiniLM embeddings of the passages, shape (N, 384).
    doc_emb: Tensor
    #: Unit-length MiniLM embeddings of the queries, shape (B, 384).
    query_emb: Tensor
    #: Unit-length MiniLM embeddings of the chunks of :func:`chunk_texts`, shape (M, 384).
    chunk_emb: Tensor | None = None
    #: For each chunk, the list of the passages (column indices) its words come from.
    chunk_owners: tuple = ()


def chunk_texts(passages) -> tuple[list[str], list[list[int]]]:
    """The passages cut into windows of :data:`CHUNK_WORDS` words every :data:`CHUNK_STRIDE` words.

    Chapter 27's :func:`llmbook.rag.chunking.chunk_passages` over each passage's text, every window prefixed
    with its passage's heading. MiniLM reads at most 256 word pieces, and the book's passages, dense with
    LaTeX, often run longer: the windows let the dense index see their ends. Returns ``(texts, owners)``.

    >>> from llmbook.rag.corpus import load_corpus
    >>> texts, owners = chunk_texts(load_corpus()[:3])
    >>> len(texts) >= 3 and owners[0] == [0]
    True
    """
    passages = list(passages)
    texts, owners = chunking.chunk_passages(passages, CHUNK_WORDS, CHUNK_STRIDE, text=lambda p: p.text)
    heads = [passages[o[0]].heading for o in owners]
    return [f"{h}. {t}" if h else t for h, t in zip(heads, texts, strict=True)], owners


@lru_cache(maxsize=1)
def book_data() -> BookData:
    """The shipped corpus and query set, analysed and embedded (cached: the model is not loaded).

    >>> d = book_data()
    >>> d.labels.shape == (len(d.queries), len(d.passages)), d.doc_emb.shape[1]
    (True, 384)
    """
    passages, queries = load_corpus(), load_queries()
    chunks, owners = chunk_texts(passages)
    return BookData(
        passages=tuple(passages), queries=tuple(queries), labels=labels_matrix(queries, passages),
        doc_terms=tuple(tuple(analyze(passage_text(p))) for p in passages),
        query_terms=tuple(tuple(analyze(q.text)) for q in queries),
        doc_emb=encoder.corpus_embeddings(passages), query_emb=encoder.query_embeddings(queries),
        chunk_emb=encoder.encode(chunks), chunk_owners=tuple(tuple(o) for o in owners))


def dense_scores(data: BookData | None = None) -> Tensor:
    """Cosine similarity of every query with every passage under MiniLM, shape ``(B, N)``, float64."""
    data = book_data() if data is None else data
    return (data.query_emb @ data.doc_emb.T).double()


def dense_chunk_scores(data: BookData | None = None) -> Tensor:
    """MiniLM cosine over the passages' chunks (:func:`chunk_texts`), a passage scoring its best chunk, ``(B, N)``."""
    data = book_data() if data is None else data
    s = (data.query_emb @ data.chunk_emb.T).double()
    return chunking.chunk_scores_to_passages(s, [list(o) for o in data.chunk_owners], len(data.passages))


def split_rows(split: str, queries=None) -> Tensor:
    """Row indices (``int64``) of the book's queries in ``split`` (``"dev"`` or ``"test"``), in query order.

    >>> from llmbook.rag.corpus import load_queries
    >>> len(split_rows("dev")) + len(split_rows("test")) == len(load_queries())
    True
    """
    if split not in ("dev", "test"):
        raise ValueError(f"split must be 'dev' or 'test', got {split!r}")
    queries = book_data().queries if queries is None else queries
    return torch.tensor([i for i, q in enumerate(queries) if q.split == split], dtype=torch.long)


def evaluate_scores(scores: Tensor, labels: Tensor | None = None, metrics_: tuple[str, ...] = METRICS,
                    split: str | None = None) -> dict:
    """The chapter 26 metrics of a ``(B, N)`` score matrix against the book's labels, averaged over queries.

    A score of ``-inf`` means *not retrieved* (chapter 26's convention). With ``split`` (``"dev"`` or
    ``"test"``), only that half of the book's queries counts: the rows are the book's queries, in order.
    """
    labels = book_data().labels if labels is None else labels
    if scores.shape != labels.shape:
        raise ValueError(f"scores {tuple(scores.shape)} and labels {tuple(labels.shape)} must have the same (B, N)")
    if split is not None:
        if scores.shape[0] != len(book_data().queries):
            raise ValueError(f"split={split!r} needs one row per book query ({len(book_data().queries)}), "
                             f"got {scores.shape[0]}")
        rows = split_rows(split)
        scores, labels = scores[rows], labels[rows]
    return metrics.evaluate(scores, labels, metrics=metrics_)


def metrics_table(runs: dict[str, Tensor], labels: Tensor | None = None, metrics_: tuple[str, ...] = METRICS,
                  split: str | None = None) -> str:
    """A fixed-width table of :func:`evaluate_scores` for several named score matrices (3 decimals)."""
    width = max(12, *(len(n) for n in runs))
    lines = [f"{'run':<{width}} " + " ".join(f"{m:>9}" for m in metrics_)]
    for name, s in runs.items():
        r = evaluate_scores(s, labels, metrics_, split)
        lines.append(f"{name:<{width}} " + " ".join(f"{r[m]:>9.3f}" for m in metrics_))
    return "\n".join(lines)


def section_level(scores: Tensor, labels: Tensor, passages) -> tuple[Tensor, Tensor]:
    """Scores and grades per *section*: each web section ranked by its best passage and credited once.

    The questions are graded per section, so every passage of a graded section carries its grade, and a run
    that ranks several passages of one section high is credited several times for one finding. Evaluating
    ``section_level(...)``'s ``(B, S)`` matrices counts it once. ``scores`` and ``labels`` are ``(B, N)``;
    ``passages`` the ``N`` corpus passages, a passage without a section standing for itself. A section's score
    is the maximum over its passages (``-inf`` if none was retrieved), its grade the maximum grade. Sections
    are in order of first appearance.

    >>> from llmbook.rag.corpus import Passage
    >>> ps = [Passage(str(i), 1, sec, "h", "t", "u") for i, sec in enumerate(["a", "a", "b"])]
    >>> s, g = section_level(torch.tensor([[3.0, 5.0, 4.0]]), torch.tensor([[2.0, 2.0, 0.0]]), ps)
    >>> s.tolist(), g.tolist()
    ([[5.0, 4.0]], [[2.0, 0.0]])
    """
    if scores.shape != labels.shape or scores.ndim != 2 or scores.shape[1] != len(passages):
        raise ValueError(f"scores {tuple(scores.shape)} and labels {tuple(labels.shape)} must both be (B, N) with "
                         f"N = {len(passages)} passages")
    column: dict[str, int] = {}
    for p in passages:
        column.setdefault(p.section if p.section is not None else f"passage:{p.id}", len(column))
    index = torch.tensor([column[p.section if p.section is not None else f"passage:{p.id}"] for p in passages])
    B, S = scores.shape[0], len(column)
    idx = index.expand(B, -1)
    out_s = torch.full((B, S), float("-inf"), dtype=scores.dtype).scatter_reduce(1, idx, scores, "amax")
    out_g = torch.zeros((B, S), dtype=labels.dtype).scatter_reduce(1, idx, labels, "amax")
    return out_s, out_g


def sparse_scores(data: BookData | None = None) -> Tensor:
    """BM25 (chapter 21, Lucene's defaults k1 = 1.2, b = 0.75) of every query against every passage, ``(B, N)``.

    A passage that shares no term with the query gets ``-inf`` (not retrieved), as from an inverted index.
    """
    data = book_data() if data is None else data
    s = sparse.bm25_scores(data.query_terms, data.doc_terms)
    return s.masked_fill(s == 0, float("-inf"))


def hybrid_scores(data: BookData | None = None) -> Tensor:
    """The part's pipeline: BM25, dense MiniLM over whole passages and over their chunks, z-scored and summed.

    Chapter 23's :func:`llmbook.rag.fusion.normalized_fusion` with equal weights over three runs:
    :func:`sparse_scores`, :func:`dense_scores` and :func:`dense_chunk_scores` (chapter 27's windows, so the
    dense side sees the ends of long passages). No parameter in it is fitted to the book's labelled queries
    (BM25 keeps Lucene's defaults, the runs weigh the same). Two choices were made after looking at the first
    56 questions, before the dev/test split existed (:mod:`llmbook.rag.collection`), and are within their
    noise: z-score rather than reciprocal rank fusion (chapter 23), and adding the chunk run (chapter 27).
    Questions q57-q100 were written after both choices, so on them the choices are untuned.
    """
    data = book_data() if data is None else data
    return fusion.normalized_fusion([sparse_scores(data), dense_scores(data), dense_chunk_scores(data)])


@dataclass(frozen=True)
class Hit:
    """One passage returned by :func:`search`."""

    #: 1 for the best passage.
    rank: int
    #: The retriever's score (a sum of z-scores for ``"hybrid"``, BM25 or cosine otherwise).
    score: float
    #: The passage itself (chapter, heading, text, url).
    passage: Passage


def method_scores(method: str, data: BookData | None = None) -> Tensor:
    """The ``(B, N)`` scores of one of :data:`METHODS`: ``"dense"`` is the better of a passage's whole and chunk
    cosines, ``"hybrid"`` :func:`hybrid_scores`, ``"bm25"`` :func:`sparse_scores`."""
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    data = book_data() if data is None else data
    if method == "dense":
        return torch.maximum(dense_scores(data), dense_chunk_scores(data))
    return hybrid_scores(data) if method == "hybrid" else sparse_scores(data)


def search(question: str, k: int = 5, method: str = DEFAULT_METHOD) -> list[Hit]:
    """The ``k`` best passages of the book for ``question`` (``python -m llmbook ask``).

    ``method`` is one of :data:`METHODS` (by default :data:`DEFAULT_METHOD`, the dev winner). Dense and hybrid
    search embed the question with MiniLM: free for the labelled queries (cached), about 5 s more for a new
    question (the model loads once per process; it needs ``llmbook[rag]``).

    >>> [h.passage.chapter for h in search("why subtract the maximum logit before exponentiating in softmax?", k=1)]
    [1]
    """
    if not isinstance(question, str) or not question.strip():
        raise ValueError(f"question must be a non-empty string, got {question!r}")
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    data = book_data()
    k = min(int(k), len(data.passages))
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    one = BookData(data.passages, (Query("ask", question, "plain", {}),), torch.zeros(1, len(data.passages)),
                   data.doc_terms, (tuple(analyze(question)),), data.doc_emb,
                   encoder.encode([question]) if method != "bm25" else data.query_emb[:0],
                   data.chunk_emb, data.chunk_owners)
    scores = method_scores(method, one)[0]
    top = torch.topk(scores, k)
    pairs = zip(top.values.tolist(), top.indices.tolist(), strict=True)
    return [Hit(r + 1, v, data.passages[j]) for r, (v, j) in enumerate(pairs) if v > float("-inf")]


def cache_texts(passages=None, queries=None) -> list[str]:
    """Every text the cache must hold: passages, their headings and chunks, queries, extra texts (deduplicated)."""
    passages = load_corpus() if passages is None else passages
    queries = load_queries() if queries is None else queries
    texts = ([passage_text(p) for p in passages] + [p.heading for p in passages if p.heading]
             + chunk_texts(passages)[0] + [q.text for q in queries] + encoder.extra_texts())
    return list(dict.fromkeys(texts))
