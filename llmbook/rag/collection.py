r"""The book's test collection as TREC builds one: pooled judgements, judged@k, and a dev/test split (Part II).

The labelled queries (:func:`llmbook.rag.corpus.load_queries`) carry three things this module puts to use:

* **Judged sections.** Every query lists the sections an assessor graded 2 (answers it) or 1 (related), and
  the sections read and judged 0. The judgements were made by *pooling*: for every query, the top 20
  sections of each of the :data:`POOLED` runs over all 43 chapters were read and graded. A run outside the
  pool can retrieve passages nobody judged, and the metrics count those as not relevant. ``judged@k``
  (:func:`judged_at_k`) says how much of a run's top k was judged at all, so a low score with a low
  judged@k reads as *unknown*, not as *bad*.
* **A split.** Half the queries are ``dev``, half ``test`` (a seeded alternation within each kind and part
  of the book). A setting is chosen on dev (:func:`dev_winner`), and the number a chapter reports for it
  is measured on test (:func:`llmbook.rag.pipeline.split_rows`, :func:`evaluate_split`), so that the
  choice cannot flatter it.
* **The default of** ``python -m llmbook ask``, :data:`llmbook.rag.pipeline.DEFAULT_METHOD`, is the dev
  winner among :data:`llmbook.rag.pipeline.METHODS`; a test keeps the two equal.
"""

from __future__ import annotations

import torch
from torch import Tensor

from llmbook._checks import check_positive_int
from llmbook.rag import metrics, pipeline
from llmbook.rag.corpus import Passage, Query

__all__ = ["POOLED", "dev_winner", "evaluate_split", "judged_at_k", "judged_matrix", "pooled_runs"]

#: The runs whose top 20 sections were pooled and judged for every query.
POOLED = ("bm25", "dense", "dense_chunk", "hybrid")


def judged_matrix(queries: list[Query], passages: list[Passage]) -> Tensor:
    """``(B, N)`` bool: passage ``n`` lies in a section judged (at any grade) for query ``b``.

    A passage without a target section is named by its ``page#anchor``, as in :func:`llmbook.rag.corpus.qrels`.

    >>> from llmbook.rag.corpus import load_corpus, load_queries
    >>> J = judged_matrix(load_queries()[:3], load_corpus())
    >>> J.dtype, bool(J.any(1).all())
    (torch.bool, True)
    """
    keys = [p.section or p.id.rpartition("/")[0] for p in passages]
    out = torch.zeros(len(queries), len(passages), dtype=torch.bool)
    for i, q in enumerate(queries):
        judged = q.judged
        out[i] = torch.tensor([k in judged for k in keys], dtype=torch.bool)
    return out


def judged_at_k(scores: Tensor, judged: Tensor, k: int = 10) -> Tensor:
    r"""The share of a run's top ``k`` that was judged: :math:`\frac{1}{k'}\sum_{i \le k'} [d_i \text{ judged}]`.

    ``scores`` ``(B, N)`` or ``(N,)`` rank the passages as chapter 26's metrics do (descending, ties in column
    order, ``-inf`` not retrieved); ``judged`` is a bool mask of the same shape (:func:`judged_matrix`).
    :math:`k' = \min(k, \text{number retrieved})`; a query that retrieved nothing scores 0. Returns float64
    ``(B,)`` (0-d for one query).

    >>> judged_at_k(torch.tensor([3.0, 2.0, 1.0, float("-inf")]), torch.tensor([True, False, True, True]), 4)
    tensor(0.6667, dtype=torch.float64)
    """
    if not isinstance(judged, Tensor) or judged.dtype != torch.bool:
        raise TypeError(f"judged must be a bool tensor, got {type(judged).__name__}"
                        + (f" of {judged.dtype}" if isinstance(judged, Tensor) else ""))
    k = check_positive_int(k, "k")
    rel, retrieved, _, one = metrics._rank(scores, judged.double())
    k = min(k, rel.shape[-1])
    top_judged = ((rel[:, :k] > 0) & retrieved[:, :k]).sum(-1).double()
    n = retrieved[:, :k].sum(-1).double()
    out = torch.where(n > 0, top_judged / n.clamp_min(1), torch.zeros_like(n))
    return out[0] if one else out


def evaluate_split(scores: Tensor, split: str, data=None, metrics_=pipeline.METRICS, k_judged: int = 10) -> dict:
    """Chapter 26's metrics of a ``(B, N)`` score matrix on one split's rows, and ``judged@k_judged``."""
    data = pipeline.book_data() if data is None else data
    rows = pipeline.split_rows(split, data.queries)
    out = pipeline.evaluate_scores(scores[rows], data.labels[rows], metrics_)
    J = judged_matrix([data.queries[i] for i in rows.tolist()], list(data.passages))
    out[f"judged@{k_judged}"] = float(judged_at_k(scores[rows], J, k_judged).mean())
    return out


def pooled_runs(data=None) -> dict[str, Tensor]:
    """The :data:`POOLED` runs' ``(B, N)`` score matrices over the book."""
    data = pipeline.book_data() if data is None else data
    return {"bm25": pipeline.sparse_scores(data), "dense": pipeline.dense_scores(data),
            "dense_chunk": pipeline.dense_chunk_scores(data), "hybrid": pipeline.hybrid_scores(data)}


def dev_winner(metric: str = "ndcg@10", data=None) -> tuple[str, dict[str, float]]:
    """The method of :data:`llmbook.rag.pipeline.METHODS` with the best ``metric`` on the dev queries, and
    every method's dev value (ties go to the earlier method)."""
    data = pipeline.book_data() if data is None else data
    values = {m: evaluate_split(pipeline.method_scores(m, data), "dev", data, (metric,))[metric]
              for m in pipeline.METHODS}
    return max(values, key=lambda m: (values[m], -pipeline.METHODS.index(m))), values
