r"""Memory for agents: reading by attention, scoring episodes, forgetting, deciding what to write, citing.

An agent that lives longer than one context window keeps a memory :math:`M = \{m_1, \dots, m_N\}` outside the
model and reads a few items back into the prompt. The pieces here are the arithmetic of that loop.

* **Attention over memory** (42.01, :func:`memory_read`): :math:`c = \sum_i \alpha_i m_i` with
  :math:`\alpha = \mathrm{softmax}(q^\top k_i)`, the read of memory networks (Weston et al. 2015; Sukhbaatar
  et al. 2015). It *calls* chapter 3's :func:`llmbook.lm.attention.scaled_dot_product_attention` with
  ``scale = 1``: the softmax and the weighted sum are not written again here.
* **Episodic score** (42.02, :func:`episodic_score`): relevance + recency + salience, each min-max normalised
  to :math:`[0, 1]` over the candidates and weighted, as in Generative Agents (Park et al. 2023).
* **Decay** (42.03, :func:`exponential_decay`): :math:`e^{-\lambda(t - t_i)}` with half-life
  :math:`\ln 2 / \lambda` (:func:`half_life`); Generative Agents' recency :math:`0.995^{\Delta}` is
  :math:`\lambda = -\ln 0.995`.
* **Write decision** (42.04, :func:`write_decision`): write when novelty :math:`1 - \max_j \cos(m, m_j)`
  (chapter 20's :func:`llmbook.rag.similarity.cosine_similarity`) and importance both pass their thresholds;
  :func:`write_stream` applies it to a stream, each written item joining the memory the next one is compared to.
* **Retrieval-augmented policy** (42.05, :func:`retrieval_augmented_policy`):
  :math:`\pi(a \mid s, M) = \pi(a \mid s, \mathrm{Retrieve}(M, s))`, a softmax over the top-k stored items,
  falling back to a fixed prior when the memory holds nothing. The chapter's agent over the book's own passages
  (:func:`llmbook.agents.memory_agent.book_agent`) lives in :mod:`llmbook.agents.memory_agent`.

>>> exponential_decay(10.0, torch.tensor([10.0, 0.0]), math.log(2) / 10).tolist()
[1.0, 0.5]
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import Tensor

from llmbook._checks import (
    as_tensor,
    check_broadcastable_to,
    check_dim,
    check_finite,
    check_int,
    check_range,
    check_same_last_dim,
)
from llmbook._precision import compute_dtype, restore_half, upcast_half
from llmbook.lm import attention
from llmbook.rag import similarity
from llmbook.registry import implements

__all__ = ["WriteDecision", "episodic_score", "exponential_decay", "half_life", "memory_read", "minmax_normalize",
           "novelty", "retrieval_augmented_policy", "write_decision", "write_stream"]


def _finite(x, name: str, contract: str, min_dim: int = 1) -> Tensor:
    t = as_tensor(x, name)
    check_dim(t, name, contract, min_dim=min_dim)
    check_finite(t, name)
    return t


@implements("42.01")
def memory_read(q, K, M, *, scale: float = 1.0, return_weights: bool = False):
    r"""Read a memory by attention: :math:`c = \sum_i \alpha_i m_i`, :math:`\alpha = \mathrm{softmax}(s\, q^\top k_i)`.

    Symbols: ``q`` the query :math:`q` ``(B, D)``; ``K`` the keys :math:`k_i` ``(B, N, D)``; ``M`` the memory
    contents :math:`m_i` ``(B, N, D_v)``; ``scale`` :math:`s` (1 in the memory-network equation; chapter 3's
    transformers use :math:`1/\sqrt{D}`). Returns ``c`` ``(B, D_v)`` and, with ``return_weights``, also
    :math:`\alpha` ``(B, N)``. This is chapter 3's :func:`llmbook.lm.attention.scaled_dot_product_attention`
    with one query position: the function is called, not re-implemented. An empty memory (N = 0) reads zeros.

    >>> q = torch.tensor([[1.0, 0.0]]); K = torch.tensor([[[1.0, 0.0], [0.0, 1.0]]])
    >>> c, a = memory_read(q, K, torch.tensor([[[10.0], [0.0]]]), return_weights=True)
    >>> [round(x, 4) for x in a[0].tolist()], round(c.item(), 3)
    ([0.7311, 0.2689], 7.311)
    """
    q, K, M = as_tensor(q, "q"), as_tensor(K, "K"), as_tensor(M, "M")
    check_dim(q, "q", "(B, D)", min_dim=2, max_dim=2)
    check_dim(K, "K", "(B, N, D)", min_dim=3, max_dim=3)
    check_dim(M, "M", "(B, N, D_v)", min_dim=3, max_dim=3)
    if K.shape[:2] != M.shape[:2] or K.shape[0] != q.shape[0]:
        raise ValueError(f"q {tuple(q.shape)}, K {tuple(K.shape)} and M {tuple(M.shape)} must be (B, D), (B, N, D) "
                         "and (B, N, D_v) with one B and one N")
    check_same_last_dim(q, K, "q", "K", "D")
    scale = check_range(scale, "scale", 0.0, low_open=True)
    c, alpha = attention.scaled_dot_product_attention(q[:, None, :], K, M, scale=scale, return_weights=True)
    c, alpha = c[:, 0, :], alpha[:, 0, :]
    return (c, alpha) if return_weights else c


def minmax_normalize(x) -> Tensor:
    r"""Min-max normalise over the last axis to :math:`[0, 1]`: :math:`(x - \min x) / (\max x - \min x)`.

    A row whose entries are all equal becomes 0.5 everywhere (Generative Agents' convention: the component
    then favours no candidate). Halves are subtracted so that ``max - min`` cannot overflow.

    >>> minmax_normalize(torch.tensor([[2.0, 4.0, 3.0], [1.0, 1.0, 1.0]])).tolist()
    [[0.0, 1.0, 0.5], [0.5, 0.5, 0.5]]
    """
    x = _finite(x, "x", "(..., N)")
    dtype, x = x.dtype, upcast_half(x)
    if x.shape[-1] == 0:
        return restore_half(x.clone(), dtype)
    lo, hi = x.amin(-1, keepdim=True), x.amax(-1, keepdim=True)
    span = hi / 2 - lo / 2
    flat = span == 0
    out = (x / 2 - lo / 2) / torch.where(flat, torch.ones_like(span), span)
    out = torch.where(flat, torch.full_like(out, 0.5), out.clamp(0.0, 1.0))
    return restore_half(out, dtype)


@implements("42.02")
def episodic_score(rel, recency, salience, *, lambda_r: float = 1.0, lambda_t: float = 1.0,
                   lambda_s: float = 1.0, normalize: bool = True) -> Tensor:
    r"""Generative Agents' retrieval score, a weighted sum of relevance, recency and salience.

    .. math:: \mathrm{score}(m_i) = \lambda_r\,\widetilde{\mathrm{rel}}_i + \lambda_t\,\widetilde{\mathrm{recency}}_i
       + \lambda_s\,\widetilde{\mathrm{salience}}_i

    Symbols: ``rel`` the relevance of each memory to the query (a cosine, a BM25 score: any scale),
    ``recency`` (e.g. :func:`exponential_decay`), ``salience`` (importance, e.g. an LLM's 1-10 rating); all
    ``(..., N)`` and broadcastable to one shape; weights :math:`\lambda \ge 0`. With ``normalize`` (default, as
    in Park et al. 2023) each component is first min-max normalised to :math:`[0, 1]` over the N candidates
    (:func:`minmax_normalize`; a constant component becomes 0.5), so no component wins by its units alone and the
    score lies in :math:`[0, \lambda_r + \lambda_t + \lambda_s]`. Returns ``(..., N)``.

    >>> episodic_score(torch.tensor([0.2, 0.9]), torch.tensor([1.0, 0.1]), torch.tensor([3.0, 3.0])).tolist()
    [1.5, 1.5]
    """
    rel, recency, salience = (_finite(x, n, "(..., N)") for x, n in ((rel, "rel"), (recency, "recency"),
                                                                      (salience, "salience")))
    lam = [check_range(v, n, 0.0) for v, n in ((lambda_r, "lambda_r"), (lambda_t, "lambda_t"),
                                               (lambda_s, "lambda_s"))]
    try:
        shape = torch.broadcast_shapes(rel.shape, recency.shape, salience.shape)
    except RuntimeError as e:
        raise ValueError(f"rel {tuple(rel.shape)}, recency {tuple(recency.shape)} and salience "
                         f"{tuple(salience.shape)} must broadcast to one (..., N)") from e
    dtype = torch.promote_types(torch.promote_types(rel.dtype, recency.dtype), salience.dtype)
    comps = [upcast_half(x.to(dtype)).expand(shape) for x in (rel, recency, salience)]
    if normalize:
        comps = [minmax_normalize(x) for x in comps]
    score = sum(w * x for w, x in zip(lam, comps, strict=True))
    return restore_half(score, dtype)


@implements("42.03")
def exponential_decay(t, t_i, lam: float) -> Tensor:
    r"""Memory strength after a delay: :math:`\mathrm{decay}(m_i) = e^{-\lambda (t - t_i)}`, in :math:`(0, 1]`.

    Symbols: ``t`` the present time (a number or a tensor), ``t_i`` the times the memories were written (or
    last read), broadcastable with ``t``; ``lam`` the rate :math:`\lambda \ge 0` per time unit. A memory from the
    future (:math:`t_i > t`) is an error. Strength halves every :func:`half_life` :math:`= \ln 2/\lambda`
    (Ebbinghaus's forgetting curve in its simplest form). Computed in float32 or wider.

    >>> round(exponential_decay(24.0, torch.tensor([0.0]), -math.log(0.995)).item(), 4)  # Generative Agents: 0.995^24
    0.8867
    """
    t_i = _finite(t_i, "t_i", "(...)", min_dim=0)
    t = as_tensor(t, "t") if isinstance(t, Tensor) else torch.tensor(float(_real(t, "t")), dtype=t_i.dtype)
    check_finite(t, "t")
    lam = check_range(lam, "lam", 0.0)
    dtype = torch.promote_types(t.dtype, t_i.dtype)
    dt = upcast_half(t.to(dtype)) - upcast_half(t_i.to(dtype))
    if (dt < 0).any():
        raise ValueError(f"every t_i must be <= t (a memory cannot come from the future); got t - t_i down to "
                         f"{dt.min().item():.4g}")
    return restore_half(torch.exp(-lam * dt), dtype)


def _real(x, name: str) -> float:
    from llmbook._checks import check_real
    return check_real(x, name)


def half_life(lam: float) -> float:
    r"""The time after which :func:`exponential_decay` has halved: :math:`t_{1/2} = \ln 2 / \lambda` (inf at 0).

    >>> round(half_life(-math.log(0.995)), 1)  # Generative Agents' decay, in hours
    138.3
    """
    lam = check_range(lam, "lam", 0.0)
    return math.inf if lam == 0 else math.log(2.0) / lam


def novelty(m, M_mem) -> Tensor:
    r"""Novelty of candidates against the memory: :math:`1 - \max_j \cos(m, m_j)`, in :math:`[0, 2]`.

    ``m`` ``(B, D)`` candidates, ``M_mem`` ``(N, D)`` stored items -> ``(B,)``. The cosine is chapter 20's
    :func:`llmbook.rag.similarity.cosine_similarity` (a zero vector has cosine 0). An empty memory makes every
    candidate fully novel (1).

    >>> novelty(torch.tensor([[1.0, 0.0], [0.0, 1.0]]), torch.tensor([[1.0, 1.0]])).tolist()
    [0.29289323091506958, 0.29289323091506958]
    """
    m, M_mem = as_tensor(m, "m"), as_tensor(M_mem, "M_mem")
    check_dim(m, "m", "(B, D)", min_dim=2, max_dim=2)
    check_dim(M_mem, "M_mem", "(N, D)", min_dim=2, max_dim=2)
    check_same_last_dim(m, M_mem, "m", "M_mem", "D")
    if M_mem.shape[0] == 0 or m.shape[0] == 0:
        return torch.ones(m.shape[0], dtype=m.dtype)
    cos = similarity.cosine_similarity(m, M_mem.to(m.dtype))
    return 1 - cos.amax(-1)


class WriteDecision(NamedTuple):
    """What :func:`write_decision` returns."""

    #: ``(B,)`` bool: write the candidate.
    write: Tensor
    #: ``(B,)`` novelty :math:`1 - \max_j \cos`.
    novelty: Tensor


@implements("42.04")
def write_decision(m, M_mem, importance, *, tau_n: float = 0.1, tau_i: float = 0.5) -> WriteDecision:
    r"""Write a memory only if it is new and it matters.

    .. math:: \mathrm{write} = \mathbf 1[\mathrm{novelty}(m) > \tau_n \land \mathrm{importance}(m) > \tau_i]

    Symbols: ``m`` ``(B, D)`` candidate embeddings; ``M_mem`` ``(N, D)`` the stored embeddings; ``importance``
    ``(B,)`` (any scale the threshold ``tau_i`` is on); ``tau_n`` the novelty threshold in :math:`[0, 2]`.
    Each candidate is judged against ``M_mem`` alone (a batch decision); :func:`write_stream` judges a stream in
    order. Returns :class:`WriteDecision` ``(write, novelty)``.

    >>> d = write_decision(torch.tensor([[1.0, 0.0], [0.0, 1.0]]), torch.tensor([[1.0, 0.1]]), torch.tensor([0.9, 0.9]))
    >>> d.write.tolist()
    [False, True]
    """
    importance = _finite(importance, "importance", "(B,)")
    tau_n = check_range(tau_n, "tau_n", 0.0, 2.0)
    tau_i = check_range(tau_i, "tau_i")
    nov = novelty(m, M_mem)
    check_dim(importance, "importance", "(B,)", max_dim=1)
    if importance.shape[0] != nov.shape[0]:
        raise ValueError(f"importance has {importance.shape[0]} entries for {nov.shape[0]} candidates")
    return WriteDecision((nov > tau_n) & (upcast_half(importance) > tau_i), nov)


def write_stream(E, importance, *, tau_n: float = 0.1, tau_i: float = 0.5) -> Tensor:
    r"""Apply :func:`write_decision` to a stream in order: item ``t`` is compared with the items written before it.

    ``E`` ``(T, D)`` embeddings in arrival order, ``importance`` ``(T,)``. Returns the ``(T,)`` bool mask of the
    items written. The first item passing the importance threshold is always written (the memory is empty). The
    cosines come from one call of chapter 20's :func:`llmbook.rag.similarity.cosine_similarity` over all pairs.

    >>> write_stream(torch.tensor([[1.0, 0.0], [1.0, 0.01], [0.0, 1.0]]), torch.ones(3)).tolist()
    [True, False, True]
    """
    E = _finite(E, "E", "(T, D)", min_dim=2)
    importance = _finite(importance, "importance", "(T,)")
    if importance.shape != E.shape[:1]:
        raise ValueError(f"importance {tuple(importance.shape)} must have one entry per item of E {tuple(E.shape)}")
    tau_n, tau_i = check_range(tau_n, "tau_n", 0.0, 2.0), check_range(tau_i, "tau_i")
    # the (T, T) cosines once (chapter 20's function), then the rule of write_decision item by item
    C = similarity.cosine_similarity(E, E).tolist() if E.shape[0] else []
    imp = importance.tolist()
    kept: list[int] = []
    for t in range(E.shape[0]):
        nov = 1.0 - max((C[t][j] for j in kept), default=0.0)
        if nov > tau_n and imp[t] > tau_i:
            kept.append(t)
    out = torch.zeros(E.shape[0], dtype=torch.bool)
    out[kept] = True
    return out


@implements("42.05")
def retrieval_augmented_policy(scores, memory=None, *, k: int = 5, tau: float = 1.0, prior=None) -> Tensor:
    r"""A policy that acts on what it retrieves: :math:`\pi(a \mid s, M) = \pi(a \mid s, \mathrm{Retrieve}(M, s))`.

    Symbols: ``scores`` ``(B, N)`` a retriever's score of each item (action :math:`a`, e.g. a passage to cite)
    for each state :math:`s` (e.g. a question); ``memory`` a bool mask broadcastable to ``(B, N)`` of the items
    the memory :math:`M` holds (default: all); :math:`\mathrm{Retrieve}(M, s)` the ``k`` best-scoring stored items
    with a finite score; :math:`\pi` a softmax of ``scores / tau`` over them (chapter 3's
    :func:`llmbook.lm.attention.masked_softmax`), zero elsewhere. A state whose retrieval comes back empty acts by
    ``prior`` ``(N,)`` (default uniform): the policy without memory. Returns ``(B, N)``, rows summing to 1.

    >>> retrieval_augmented_policy(torch.tensor([[3.0, 1.0, 2.0]]), k=1).tolist()
    [[1.0, 0.0, 0.0]]
    """
    scores = as_tensor(scores, "scores")
    check_dim(scores, "scores", "(B, N)", min_dim=2, max_dim=2)
    if torch.isnan(scores).any() or torch.isposinf(scores).any():
        raise ValueError("scores must not contain NaN or +inf (-inf means not retrievable)")
    B, N = scores.shape
    k = check_int(k, "k", low=1)
    tau = check_range(tau, "tau", 0.0, low_open=True)
    if memory is None:
        memory = torch.ones(N, dtype=torch.bool)
    if not isinstance(memory, Tensor) or memory.dtype != torch.bool:
        raise TypeError("memory must be a bool tensor (True = stored)")
    check_broadcastable_to(memory, (B, N), "memory", "the scores (B, N) =")
    dtype, s = scores.dtype, scores.to(compute_dtype(scores.dtype))
    if prior is None:
        prior = torch.full((N,), 1.0 / max(N, 1), dtype=s.dtype)
    prior = as_tensor(prior, "prior")
    if prior.shape != (N,) or (prior < 0).any() or not torch.isfinite(prior).all() or \
            (N > 0 and abs(prior.double().sum().item() - 1) > 1e-3):
        raise ValueError(f"prior must be a probability vector of shape ({N},), got shape {tuple(prior.shape)}")
    allowed = memory.expand(B, N) & torch.isfinite(s)
    if N == 0:
        return restore_half(s.clone(), dtype)
    masked = s.masked_fill(~allowed, -math.inf)
    kk = min(k, N)
    top = masked.topk(kk, dim=-1).indices
    chosen = torch.zeros_like(allowed).scatter(-1, top, True) & allowed
    pi = attention.masked_softmax(masked / tau, chosen)
    empty = ~chosen.any(-1, keepdim=True)
    pi = torch.where(empty, prior.to(pi.dtype).expand(B, N), pi)
    return restore_half(pi, dtype)
