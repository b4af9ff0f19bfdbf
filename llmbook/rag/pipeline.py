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

from llmbook.rag import encoder, metrics
from llmbook.rag.corpus import Passage, Query, load_corpus, load_queries, qrels
from llmbook.rag.sparse import analyze

__all__ = ["METRICS", "BookData", "book_data", "dense_scores", "evaluate_scores", "labels_matrix", "metrics_table"]

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


@lru_cache(maxsize=1)
def book_data() -> BookData:
    """The shipped corpus and query set, analysed and embedded (cached: the model is not loaded).

    >>> d = book_data()
    >>> d.labels.shape == (len(d.queries), len(d.passages)), d.doc_emb.shape[1]
    (True, 384)
    """
    passages, queries = load_corpus(), load_queries()
    return BookData(
        passages=tuple(passages), queries=tuple(queries), labels=labels_matrix(queries, passages),
        doc_terms=tuple(tuple(analyze(encoder.passage_text(p))) for p in passages),
        query_terms=tuple(tuple(analyze(q.text)) for q in queries),
        doc_emb=encoder.corpus_embeddings(passages), query_emb=encoder.query_embeddings(queries))


def dense_scores(data: BookData | None = None) -> Tensor:
    """Cosine similarity of every query with every passage under MiniLM, shape ``(B, N)``, float64."""
    data = book_data() if data is None else data
    return (data.query_emb @ data.doc_emb.T).double()


def evaluate_scores(scores: Tensor, labels: Tensor | None = None, metrics_: tuple[str, ...] = METRICS) -> dict:
    """The chapter 26 metrics of a ``(B, N)`` score matrix against the book's labels, averaged over queries.

    A score of ``-inf`` means *not retrieved* (chapter 26's convention).
    """
    labels = book_data().labels if labels is None else labels
    if scores.shape != labels.shape:
        raise ValueError(f"scores {tuple(scores.shape)} and labels {tuple(labels.shape)} must have the same (B, N)")
    return metrics.evaluate(scores, labels, metrics=metrics_)


def metrics_table(runs: dict[str, Tensor], labels: Tensor | None = None, metrics_: tuple[str, ...] = METRICS) -> str:
    """A fixed-width table of :func:`evaluate_scores` for several named score matrices (3 decimals)."""
    width = max(12, *(len(n) for n in runs))
    lines = [f"{'run':<{width}} " + " ".join(f"{m:>9}" for m in metrics_)]
    for name, s in runs.items():
        r = evaluate_scores(s, labels, metrics_)
        lines.append(f"{name:<{width}} " + " ".join(f"{r[m]:>9.3f}" for m in metrics_))
    return "\n".join(lines)
