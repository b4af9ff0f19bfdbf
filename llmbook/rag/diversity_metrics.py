r"""Metrics of diversity for a ranking (chapter 28): subtopic recall and :math:`\alpha`-nDCG.

A query may have several *subtopics* (aspects, intents, information nuggets), and a document covers some
of them. The judgements are a 0/1 tensor ``subtopics`` of shape ``(B, N, S)``: entry ``[b, i, s]`` is 1
when document ``i`` of query ``b`` covers subtopic ``s`` (pad a query with fewer subtopics with all-zero
columns). ``scores`` ``(B, N)`` rank the documents as in chapter 26 (:mod:`llmbook.rag.metrics`): descending,
ties in column order, ``-inf`` = not retrieved.

* **Subtopic recall** (S-recall, Zhai, Cohen & Lafferty 2003): the share of the query's subtopics that the
  top :math:`k` cover at least once,

  .. math:: \mathrm{S\text{-}recall}@k = \frac{\big|\bigcup_{i=1}^{k} \mathrm{subtopics}(d_i)\big|}{n_S},

  with :math:`n_S` the number of subtopics covered by any document of the query.
* :math:`\alpha`-**nDCG** (Clarke et al. 2008): DCG where a document's gain for a subtopic decays by
  :math:`1-\alpha` each time a higher-ranked document has already covered it,

  .. math:: G_i = \sum_{s} J(d_i, s)\,(1-\alpha)^{r_{s,i-1}}, \qquad r_{s,i-1} = \sum_{j<i} J(d_j, s), \qquad
            \alpha\text{-}DCG@k = \sum_{i=1}^{k} \frac{G_i}{\log_2(i+1)},

  normalised by the :math:`\alpha`-DCG@k of an ideal ranking. Finding the ideal ranking is NP-hard; as
  Clarke et al. and TREC's ``ndeval`` do, the ideal is built greedily (at each rank the document with the
  largest gain given those above it), over all judged documents of the query, retrieved or not. At
  :math:`\alpha = 0` it is chapter 26's NDCG with the linear gain "number of subtopics covered".

S-recall only asks whether a subtopic is covered; :math:`\alpha`-nDCG also rewards covering it early
and, for :math:`\alpha < 1`, covering it again (a second source is worth :math:`1-\alpha` of the first).
Registers no catalogue equation.

>>> J = torch.tensor([[[1, 1, 0], [1, 0, 0], [0, 0, 1]]])       # d0 covers subtopics 0 and 1, d1 0, d2 2
>>> s = torch.tensor([[3.0, 2.0, 1.0]])                          # ranking d0, d1, d2
>>> subtopic_recall(s, J, k=2).tolist(), round(alpha_ndcg(s, J, k=3, alpha=0.5).item(), 4)
([0.6666666666666666], 0.9773)
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from llmbook._checks import as_tensor, check_finite, check_range

__all__ = ["alpha_dcg", "alpha_ndcg", "subtopic_recall"]


def _prepare(scores, subtopics, k):
    """Check the pair; return judgements in rank order (B, N, S) float64, the retrieved mask (B, N), J, k."""
    scores = as_tensor(scores, "scores").double()
    J = as_tensor(subtopics, "subtopics", floating=False)
    if J.dtype == torch.bool:
        J = J.long()
    if scores.ndim != 2 or J.ndim != 3 or J.shape[:2] != scores.shape:
        raise ValueError(f"scores must be (B, N) and subtopics (B, N, S) with the same B and N, got "
                         f"{tuple(scores.shape)} and {tuple(J.shape)}")
    check_finite(scores, "scores", allow_neg_inf=True)
    J = J.double()
    if not torch.isin(J, torch.tensor([0.0, 1.0], dtype=torch.float64)).all():
        raise ValueError("subtopics must hold 0/1 judgements (document i covers subtopic s or not)")
    N = scores.shape[1]
    if k is None:
        k = N
    elif isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"k must be a positive int (the cut-off) or None, got {k!r}")
    order = torch.sort(scores, dim=-1, descending=True, stable=True).indices  # ties: the earlier column first
    retrieved = scores.gather(1, order) > -math.inf
    ranked = J.gather(1, order[..., None].expand_as(J)) * retrieved[..., None]
    return ranked[:, :k], J, min(k, N)


def _discount(n: int) -> Tensor:
    return 1.0 / torch.log2(torch.arange(2, n + 2, dtype=torch.float64))


def _gains(ranked: Tensor, alpha: float) -> Tensor:
    """(B, K, S) judgements in rank order -> (B, K) gains G_i = sum_s J (1 - alpha)^(times s was seen above)."""
    seen = ranked.cumsum(1) - ranked  # r_{s, i-1}
    return (ranked * torch.pow(torch.tensor(1.0 - alpha, dtype=torch.float64), seen)).sum(-1)


def alpha_dcg(scores, subtopics, k: int | None = None, alpha: float = 0.5) -> Tensor:
    r""":math:`\alpha\text{-}DCG@k=\sum_{i\le k} G_i/\log_2(i+1)`, :math:`G_i=\sum_s J(d_i,s)(1-\alpha)^{r_{s,i-1}}`.

    ``scores`` ``(B, N)``, ``subtopics`` ``(B, N, S)`` 0/1 (see the module), ``k`` the cut-off (``None``: all),
    ``alpha`` in ``[0, 1]`` the redundancy penalty. Returns ``(B,)`` float64.

    >>> round(alpha_dcg(torch.tensor([[2.0, 1.0]]), torch.tensor([[[1], [1]]]), alpha=0.5).item(), 4)  # 1 + 0.5/log2 3
    1.3155
    """
    alpha = check_range(alpha, "alpha", 0.0, 1.0)
    ranked, _, kk = _prepare(scores, subtopics, k)
    return (_gains(ranked, alpha) * _discount(kk)).sum(-1)


def _ideal_dcg(J: Tensor, k: int, alpha: float) -> Tensor:
    """Greedy ideal alpha-DCG@k over all documents of each row (Clarke et al.; TREC's ndeval)."""
    B, N, S = J.shape
    w = 1.0 - alpha
    seen = torch.zeros(B, S, dtype=torch.float64)
    free = torch.ones(B, N, dtype=torch.bool)
    total = torch.zeros(B, dtype=torch.float64)
    rows = torch.arange(B)
    for i in range(k):
        g = (J * torch.pow(torch.tensor(w, dtype=torch.float64), seen)[:, None, :]).sum(-1)  # (B, N)
        g = g.masked_fill(~free, -1.0)
        j = torch.argmax(g, dim=1)  # the first of equal gains
        total += g[rows, j].clamp_min(0.0) / math.log2(i + 2)
        seen += J[rows, j]
        free[rows, j] = False
    return total


def alpha_ndcg(scores, subtopics, k: int | None = None, alpha: float = 0.5) -> Tensor:
    r""":math:`\alpha`-nDCG@k (Clarke et al. 2008): :func:`alpha_dcg` over the greedy ideal ranking's, in ``[0, 1]``.

    Arguments as :func:`alpha_dcg`. The ideal is built greedily over every document of the row (retrieved or
    not), as in Clarke et al. and TREC's ``ndeval``; a query whose documents cover no subtopic scores 0.
    Returns ``(B,)`` float64.

    >>> J = torch.tensor([[[1, 0], [1, 0], [0, 1]]])
    >>> round(alpha_ndcg(torch.tensor([[3.0, 2.0, 1.0]]), J, k=2, alpha=0.5).item(), 4)  # d0, d1 vs ideal d0, d2
    0.8066
    """
    alpha = check_range(alpha, "alpha", 0.0, 1.0)
    ranked, J, kk = _prepare(scores, subtopics, k)
    dcg = (_gains(ranked, alpha) * _discount(kk)).sum(-1)
    ideal = _ideal_dcg(J, kk, alpha)
    return torch.where(ideal > 0, dcg / ideal.clamp_min(1e-300), torch.zeros_like(dcg)).clamp(0.0, 1.0)


def subtopic_recall(scores, subtopics, k: int) -> Tensor:
    r"""Subtopic recall (S-recall@k, Zhai et al. 2003): share of the query's subtopics covered by the top ``k``.

    The denominator :math:`n_S` counts the subtopics that some document of the row covers (all-zero padding
    columns do not count); a query with none scores 0. ``scores`` ``(B, N)``, ``subtopics`` ``(B, N, S)`` 0/1,
    ``k >= 1``. Returns ``(B,)`` float64.

    >>> subtopic_recall(torch.tensor([[2.0, 1.0, 0.5]]), torch.tensor([[[1, 0], [1, 0], [0, 1]]]), k=2).tolist()
    [0.5]
    """
    if k is None:
        raise ValueError("subtopic_recall needs a cut-off k >= 1")
    ranked, J, _ = _prepare(scores, subtopics, k)
    covered = (ranked.sum(1) > 0).sum(-1).double()
    n_s = (J.sum(1) > 0).sum(-1).double()
    return torch.where(n_s > 0, covered / n_s.clamp_min(1.0), torch.zeros_like(covered))
