r"""Retrieval metrics (chapter 26): precision, recall and hit rate at k, MRR, AP and MAP, DCG, NDCG, R-precision.

Two ways in, one representation inside:

* **Tensors** ``scores`` and ``labels`` of shape ``(B, N)`` (or ``(N,)`` for one query): row ``b`` holds
  the candidate documents of query ``b``, their retrieval scores and their judged relevance (a grade
  :math:`\ge 0`; binary 0/1 is the special case). A document is *relevant* when its label is above 0.
  The ranking is ``scores`` sorted in descending order; ties keep column order (a stable sort: the
  earlier column ranks first). trec_eval instead breaks ties by document id in descending lexicographic
  order; order the columns by descending id to reproduce it. A score of ``-inf`` means **not retrieved**:
  the document never takes a rank, but it still counts in the number of relevant documents :math:`R` and
  in the ideal ranking of NDCG. That is how a relevant document the system missed lowers recall, AP and NDCG.
* **A run and its qrels** (TREC's words): per query a ranked list of document ids and a mapping
  ``doc id -> grade``. :func:`run_to_tensors` turns them into the tensors above (the retrieved
  documents in rank order, then the judged relevant documents that were not retrieved, with score
  ``-inf``), and :func:`evaluate` computes a set of metrics over them in one call.

Every metric returns float64: a ``(B,)`` tensor of per-query values (a 0-d tensor for one query), and the
two means over queries (:func:`mean_reciprocal_rank`, :func:`mean_average_precision`) a 0-d tensor.
A query without relevant documents scores 0 on every metric (as ``pytrec_eval``).
"""

from __future__ import annotations

import math
import re

import numpy as np
import torch
from torch import Tensor

from llmbook._checks import (
    as_tensor,
    check_choice,
    check_dim,
    check_finite,
    check_positive_int,
    check_same_shape,
    is_real,
)
from llmbook.registry import implements

__all__ = [
    "precision_at_k", "recall_at_k", "hit_rate_at_k", "mean_reciprocal_rank", "average_precision",
    "mean_average_precision", "dcg", "ndcg", "r_precision", "run_to_tensors", "evaluate",
]

GAINS = ("exponential", "linear")
_MAX_EXP_GRADE = 1000.0  # 2**1000 is finite in float64 (a sum of N of them too, for N < 2**23)


def _as_tensor(x, name: str) -> Tensor:
    """A tensor as given; a list or array read in float64 (a list of floats would otherwise become float32)."""
    if not isinstance(x, Tensor) and not isinstance(x, (str, bytes)):
        try:
            x = np.asarray(x)
        except (TypeError, ValueError) as err:
            raise TypeError(f"{name} must be a tensor or a rectangular array-like, got {type(x).__name__}") from err
        if x.dtype == object or x.dtype.kind not in "biuf":
            raise TypeError(f"{name} must hold numbers, got an array of {x.dtype}")
    return as_tensor(x, name, floating=False)


def _rank(scores, labels):
    """Check the pair; return (relevance in rank order, retrieved mask in rank order, labels) in float64, 2-D."""
    scores, labels = _as_tensor(scores, "scores"), _as_tensor(labels, "labels")
    if labels.dtype == torch.bool or scores.dtype == torch.bool:
        name = "labels" if labels.dtype == torch.bool else "scores"
        raise TypeError(f"{name} must be a numeric tensor (int or float), got bool; for binary relevance pass "
                        f"{name}.long()")
    if labels.is_complex() or scores.is_complex():
        raise TypeError("scores and labels must be real tensors")
    check_dim(scores, "scores", "(B, N) or (N,)", min_dim=1, max_dim=2)
    check_same_shape(scores, labels, "scores", "labels")
    scores, labels = scores.double(), labels.double()
    check_finite(scores, "scores", allow_neg_inf=True)
    check_finite(labels, "labels")
    if labels.numel() and labels.min() < 0:
        raise ValueError(f"labels must be relevance grades >= 0, got {labels.min().item():g}")
    one = scores.ndim == 1
    if one:
        scores, labels = scores[None], labels[None]
    order = torch.sort(scores, dim=-1, descending=True, stable=True).indices
    rel = labels.gather(-1, order)
    retrieved = scores.gather(-1, order) > -math.inf
    return rel, retrieved, labels, one


def _out(x: Tensor, one: bool) -> Tensor:
    return x[0] if one else x


def _k(k, N: int) -> int:
    return min(check_positive_int(k, "k"), N)


def _hits(rel: Tensor, retrieved: Tensor) -> Tensor:
    """rel_i in {0, 1} in rank order: relevant and retrieved."""
    return ((rel > 0) & retrieved).double()


def _n_relevant(labels: Tensor) -> Tensor:
    """R per query: relevant documents in the row, retrieved or not."""
    return (labels > 0).double().sum(-1)


def _safe_div(a: Tensor, b: Tensor) -> Tensor:
    return torch.where(b > 0, a / b.clamp_min(1.0), torch.zeros_like(a))


@implements("26.01")
def precision_at_k(scores, labels, k: int) -> Tensor:
    r"""Precision at k: :math:`P@k=\frac{1}{k}\sum_{i=1}^{k}rel_i`, the relevant share of the first page.

    ``scores``, ``labels``: ``(B, N)`` or ``(N,)`` (see the module docstring; ``-inf`` = not retrieved);
    :math:`rel_i = 1` when the document at rank :math:`i` has label :math:`> 0`. ``k`` >= 1; when fewer than
    ``k`` documents are retrieved, the empty slots count as non-relevant (the divisor stays ``k``, as in
    trec_eval's ``P_k``). Returns ``(B,)`` float64.

    >>> precision_at_k(torch.tensor([0.9, 0.8, 0.7, 0.1]), torch.tensor([1, 0, 1, 1]), k=2)
    tensor(0.5000, dtype=torch.float64)
    """
    rel, retrieved, _, one = _rank(scores, labels)
    k_int = check_positive_int(k, "k")
    return _out(_hits(rel, retrieved)[:, :k_int].sum(-1) / k_int, one)


@implements("26.02")
def recall_at_k(scores, labels, k: int) -> Tensor:
    r"""Recall at k: :math:`R@k=\sum_{i=1}^{k}rel_i\,/\,\sum_{j=1}^{N}rel_j`, the share of all relevant documents found.

    The denominator :math:`R` counts every relevant document in the row, retrieved or not (score ``-inf``).
    0 for a query with :math:`R = 0`. Returns ``(B,)`` float64.

    >>> recall_at_k(torch.tensor([0.9, 0.8, 0.7, 0.1]), torch.tensor([1, 0, 1, 1]), k=2)
    tensor(0.3333, dtype=torch.float64)
    """
    rel, retrieved, labels, one = _rank(scores, labels)
    k_int = _k(k, rel.shape[-1])
    return _out(_safe_div(_hits(rel, retrieved)[:, :k_int].sum(-1), _n_relevant(labels)), one)


@implements("26.03")
def hit_rate_at_k(scores, labels, k: int) -> Tensor:
    r"""Hit rate (success) at k: :math:`HR@k=\mathbf{1}\left[\sum_{i=1}^{k}rel_i>0\right]`.

    1 when at least one relevant document is in the top ``k``; average over queries for the hit rate
    (trec_eval's ``success_k``). Returns ``(B,)`` float64 of 0s and 1s.

    >>> hit_rate_at_k(torch.tensor([[0.9, 0.8, 0.1], [0.9, 0.8, 0.1]]), torch.tensor([[0, 0, 1], [0, 1, 0]]), k=2)
    tensor([0., 1.], dtype=torch.float64)
    """
    rel, retrieved, _, one = _rank(scores, labels)
    k_int = _k(k, rel.shape[-1])
    return _out((_hits(rel, retrieved)[:, :k_int].sum(-1) > 0).double(), one)


@implements("26.04")
def mean_reciprocal_rank(scores, labels, k: int | None = None, reduction: str = "mean") -> Tensor:
    r"""Mean reciprocal rank: :math:`MRR=\frac{1}{|Q|}\sum_{q\in Q}\frac{1}{rank_q}`.

    :math:`rank_q` is the rank of the first relevant document of query :math:`q`; a query whose
    relevant documents are all missing (or below rank ``k``, for MRR@k) contributes 0. Only the first
    hit matters: what follows it is ignored. ``reduction="mean"`` returns the 0-d mean over the ``B``
    queries (``B`` >= 1); ``"none"`` the ``(B,)`` reciprocal ranks (trec_eval's ``recip_rank``).

    >>> mean_reciprocal_rank(torch.tensor([[0.9, 0.8, 0.1], [0.9, 0.8, 0.1]]), torch.tensor([[0, 0, 1], [0, 1, 0]]))
    tensor(0.4167, dtype=torch.float64)
    """
    check_choice(reduction, "reduction", ("mean", "none"))
    rel, retrieved, _, one = _rank(scores, labels)
    hits = _hits(rel, retrieved)
    if k is not None:
        hits = hits[:, :_k(k, hits.shape[-1])]
    ranks = torch.arange(1, hits.shape[-1] + 1, dtype=torch.float64)
    # the first hit has the largest hit / rank: 1 / rank_q (0 when there is none)
    rr = (hits / ranks).amax(-1) if hits.shape[-1] else torch.zeros(hits.shape[0], dtype=torch.float64)
    if reduction == "none":
        return _out(rr, one)
    return _mean(rr, "mean_reciprocal_rank")


def _mean(x: Tensor, what: str) -> Tensor:
    if x.numel() == 0:
        raise ValueError(f"{what} averages over queries and needs B >= 1, got B = 0")
    return x.mean()


@implements("26.05")
def average_precision(scores, labels, k: int | None = None) -> Tensor:
    r"""Average precision: :math:`AP=\frac{1}{R}\sum_{k=1}^{N}P@k\cdot rel_k`.

    The precision at the rank of every relevant document, averaged over **all** :math:`R` relevant
    documents of the query: a relevant document that is never retrieved (score ``-inf``) adds a
    precision of 0. This is trec_eval's ``map``. ``sklearn.metrics.average_precision_score`` scores
    only the items it is given, so its AP equals this one with the missing relevant documents dropped
    from the row (and it averages over tied scores). With ``k``, only the top ``k`` ranks count and the
    divisor stays :math:`R` (trec_eval's ``map_cut_k``). Returns ``(B,)`` float64.

    >>> average_precision(torch.tensor([0.9, 0.8, 0.7, -float("inf")]), torch.tensor([1, 0, 1, 1]))
    tensor(0.5556, dtype=torch.float64)
    """
    rel, retrieved, labels, one = _rank(scores, labels)
    hits = _hits(rel, retrieved)  # rel_i of the retrieved ranks
    if k is not None:
        hits = hits[:, :_k(k, hits.shape[-1])]
    ranks = torch.arange(1, hits.shape[-1] + 1, dtype=torch.float64)
    precision = hits.cumsum(-1) / ranks  # P@i at every rank i
    R = _n_relevant(labels)  # every relevant document, retrieved or not
    return _out(_safe_div((precision * hits).sum(-1), R), one)


@implements("26.06")
def mean_average_precision(scores, labels, k: int | None = None) -> Tensor:
    r"""Mean average precision: :math:`MAP=\frac{1}{|Q|}\sum_{q\in Q}AP(q)`, a 0-d tensor (``B`` >= 1).

    :func:`average_precision` per query (``(B, N)`` inputs, or ``(N,)`` for one query), then the mean.

    >>> mean_average_precision(torch.tensor([[0.9, 0.8, 0.1], [0.9, 0.8, 0.1]]), torch.tensor([[0, 0, 1], [1, 1, 0]]))
    tensor(0.6667, dtype=torch.float64)
    """
    return _mean(average_precision(scores, labels, k).reshape(-1), "mean_average_precision")


def _gain(x: Tensor, gain: str) -> Tensor:
    check_choice(gain, "gain", GAINS)
    if gain == "linear":
        return x
    if x.numel() and x.max() > _MAX_EXP_GRADE:
        raise ValueError(f"gain='exponential' computes 2**label - 1 and needs labels <= {_MAX_EXP_GRADE:g}, got "
                         f"{x.max().item():g} (use gain='linear' for large grades)")
    return torch.expm1(x * math.log(2.0))


def _discount(n: int) -> Tensor:
    return 1.0 / torch.log2(torch.arange(2, n + 2, dtype=torch.float64))


def _dcg(rel: Tensor, retrieved: Tensor, k, gain: str) -> Tensor:
    g = torch.where(retrieved, _gain(rel, gain), 0.0)
    if k is not None:
        g = g[:, :_k(k, g.shape[-1])]
    return (g * _discount(g.shape[-1])).sum(-1)


@implements("26.07")
def dcg(scores, labels, k: int | None = None, gain: str = "exponential") -> Tensor:
    r"""Discounted cumulative gain: :math:`DCG@k=\sum_{i=1}^{k}\frac{2^{rel_i}-1}{\log_2(i+1)}`.

    :math:`rel_i` is the graded label at rank :math:`i` (not retrieved: no rank, no gain). ``gain``:
    ``"exponential"`` (:math:`2^{rel}-1`, popularised by Burges et al. 2005, RankNet; the catalogue's form;
    labels <= 1000) or ``"linear"`` (:math:`rel`, the gain of Järvelin & Kekäläinen 2002, who introduced the
    logarithmic discount; ``sklearn.metrics.dcg_score`` and trec_eval's ``ndcg``); the two agree on binary
    labels. ``k=None``: the whole ranking. Ties keep column order;
    sklearn by default averages the gain over tied scores (``ignore_ties=False``), so with ties compare
    against a tie-breaking order instead. Returns ``(B,)`` float64.

    >>> dcg(torch.tensor([0.9, 0.8, 0.7]), torch.tensor([0, 2, 1]), gain="linear")
    tensor(1.7619, dtype=torch.float64)
    """
    rel, retrieved, _, one = _rank(scores, labels)
    return _out(_dcg(rel, retrieved, k, gain), one)


@implements("26.08")
def ndcg(scores, labels, k: int | None = None, gain: str = "exponential") -> Tensor:
    r"""Normalised DCG: :math:`NDCG@k=\frac{DCG@k}{IDCG@k}`, in :math:`[0, 1]`.

    :math:`IDCG@k` is the DCG@k of the ideal ranking: **every** labelled document of the row, retrieved
    or not, sorted by label. So a system that misses a highly relevant document cannot reach 1. 0 for a
    query whose labels are all 0. Arguments as :func:`dcg`. Returns ``(B,)`` float64.

    >>> ndcg(torch.tensor([0.9, 0.8, 0.7]), torch.tensor([0, 2, 1]), gain="linear")
    tensor(0.6697, dtype=torch.float64)
    """
    rel, retrieved, labels, one = _rank(scores, labels)
    ideal = torch.sort(labels, dim=-1, descending=True).values
    idcg = _dcg(ideal, torch.ones_like(ideal, dtype=torch.bool), k, gain)
    return _out(_safe_div(_dcg(rel, retrieved, k, gain), idcg).clamp(0.0, 1.0), one)


@implements("26.09")
def r_precision(scores, labels) -> Tensor:
    r"""R-precision: :math:`R\text{-}Prec=\frac{\#\text{ relevant in top }R}{R}`, precision at rank :math:`R`.

    :math:`R` is the query's number of relevant documents (retrieved or not); at that cut-off precision
    and recall are equal. 0 when :math:`R = 0` (trec_eval's ``Rprec``). Returns ``(B,)`` float64.

    >>> r_precision(torch.tensor([0.9, 0.8, 0.7, 0.1]), torch.tensor([1, 0, 1, 0]))
    tensor(0.5000, dtype=torch.float64)
    """
    rel, retrieved, labels, one = _rank(scores, labels)
    R = _n_relevant(labels)
    in_top_R = torch.arange(rel.shape[-1], dtype=torch.float64) < R[:, None]
    return _out(_safe_div((_hits(rel, retrieved) * in_top_R).sum(-1), R), one)


# --------------------------------------------------------------------------- runs and qrels


def run_to_tensors(run, qrels) -> tuple[Tensor, Tensor]:
    r"""Ranked lists of document ids and relevance judgements -> ``(scores, labels)`` of shape ``(B, N)``.

    ``run``: per query a ranked list of document ids (best first), as a list of lists or a dict
    ``query id -> list``; ``qrels``: per query a dict ``doc id -> grade`` (grades >= 0; unjudged = 0),
    as a list of dicts (same order as ``run``) or a dict ``query id -> dict``. With dicts the queries
    are those of ``qrels`` in its order (a query missing from ``run`` retrieved nothing).
    Row ``b``: the retrieved documents with scores :math:`-1, -2, \dots` (rank order), then the judged
    relevant documents that were not retrieved (score ``-inf``), then padding (``-inf``, label 0).

    >>> s, y = run_to_tensors([["d3", "d1"]], [{"d1": 1, "d7": 2}])
    >>> s.tolist(), y.tolist()
    ([[-1.0, -2.0, -inf]], [[0.0, 1.0, 2.0]])
    """
    if isinstance(qrels, dict):
        if not isinstance(run, dict):
            raise TypeError(f"with qrels as a dict (query id -> judgements), run must be a dict too, got "
                            f"{type(run).__name__}")
        run = [run.get(q, []) for q in qrels]
        qrels = list(qrels.values())
    if not isinstance(run, (list, tuple)) or not isinstance(qrels, (list, tuple)):
        raise TypeError("run and qrels must be lists (one entry per query) or dicts keyed by query id")
    if len(run) != len(qrels):
        raise ValueError(f"run has {len(run)} queries but qrels has {len(qrels)}")
    rows = []
    for b, (ranked, judged) in enumerate(zip(run, qrels, strict=True)):
        if not isinstance(judged, dict):
            raise TypeError(f"qrels[{b}] must be a dict doc id -> grade, got {type(judged).__name__}")
        ranked = list(ranked)
        if len(set(ranked)) != len(ranked):
            raise ValueError(f"run[{b}] ranks a document twice")
        for doc, g in judged.items():
            if not is_real(g) or not g >= 0 or math.isinf(g):
                raise ValueError(f"qrels[{b}][{doc!r}] must be a finite grade >= 0, got {g!r}")
        seen = set(ranked)
        missing = [d for d, g in judged.items() if g > 0 and d not in seen]
        rows.append(([-float(i + 1) for i in range(len(ranked))] + [-math.inf] * len(missing),
                     [float(judged.get(d, 0)) for d in ranked] + [float(judged[d]) for d in missing]))
    N = max((len(s) for s, _ in rows), default=0)
    scores = torch.full((len(rows), N), -math.inf, dtype=torch.float64)
    labels = torch.zeros((len(rows), N), dtype=torch.float64)
    for b, (s, y) in enumerate(rows):
        scores[b, :len(s)] = torch.tensor(s, dtype=torch.float64)
        labels[b, :len(y)] = torch.tensor(y, dtype=torch.float64)
    return scores, labels


_METRICS = {"p": precision_at_k, "recall": recall_at_k, "hit": hit_rate_at_k, "mrr": mean_reciprocal_rank,
            "ap": average_precision, "map": average_precision, "dcg": dcg, "ndcg": ndcg, "rprec": r_precision}
_NAME = re.compile(r"^(p|recall|hit|mrr|ap|map|dcg|ndcg|rprec)(?:@(\d+))?$")


def evaluate(run, qrels, metrics=("p@5", "recall@10", "mrr", "map", "ndcg@10"), reduction: str = "mean",
             gain: str = "exponential") -> dict:
    """Several metrics of a run at once: ``{"ndcg@10": 0.71, ...}`` (floats), or per query with ``reduction="none"``.

    ``run``/``qrels`` as :func:`run_to_tensors`, or a pair of ``(scores, labels)`` tensors passed as
    ``run=scores, qrels=labels``. Metric names: ``p@k``, ``recall@k``, ``hit@k`` (need ``@k``); ``mrr``,
    ``ap``/``map``, ``dcg``, ``ndcg`` (``@k`` optional); ``rprec``. ``gain`` goes to DCG and NDCG.

    >>> evaluate([["a", "b", "c"]], [{"b": 1, "z": 1}], metrics=("p@2", "mrr", "map"))
    {'p@2': 0.5, 'mrr': 0.5, 'map': 0.25}
    """
    check_choice(reduction, "reduction", ("mean", "none"))
    if isinstance(run, Tensor):
        scores, labels = run, qrels
    else:
        scores, labels = run_to_tensors(run, qrels)
    out = {}
    for name in metrics:
        m = _NAME.match(name) if isinstance(name, str) else None
        if m is None:
            raise ValueError(f"unknown metric {name!r}: use p@k, recall@k, hit@k, mrr[@k], map[@k], dcg[@k], "
                             f"ndcg[@k] or rprec")
        base, k = m.group(1), (int(m.group(2)) if m.group(2) else None)
        if base in ("p", "recall", "hit") and k is None:
            raise ValueError(f"metric {name!r} needs a cut-off, e.g. {base}@10")
        if base == "rprec" and k is not None:
            raise ValueError("rprec takes no cut-off (its cut-off is R)")
        kw = {"k": k} if base != "rprec" else {}
        if base in ("dcg", "ndcg"):
            kw["gain"] = gain
        if base == "mrr":
            kw["reduction"] = "none"
        per_query = _METRICS[base](scores, labels, **kw)
        out[name] = per_query if reduction == "none" else float(_mean(per_query.reshape(-1), name))
    return out
