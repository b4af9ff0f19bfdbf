r"""Dense and learned-sparse retrieval (chapter 22, ids 22.01-22.06): how the vectors are scored and trained.

* **Dual encoder** (22.01, :func:`dual_encoder_score`): a query encoder :math:`f_\theta` and a passage
  encoder :math:`g_\phi` map texts to vectors, scored by the dot product (or the cosine) of chapter 20
  (:mod:`llmbook.rag.similarity`, called here, not copied). Passages are encoded once, offline.
* **DPR loss** (22.02, :func:`dpr_loss`): the softmax cross-entropy of the positive passage among
  in-batch and hard negatives, scores divided by a temperature :math:`\tau` (InfoNCE).
* **ColBERT MaxSim** (22.03, :func:`maxsim`): one vector per token; each query token takes its best
  match among the document's tokens and the matches are summed (late interaction).
* **SPLADE** (22.04-22.06): :func:`splade_weights` turns MLM logits ``(B, T, V)`` into one non-negative
  weight per vocabulary word (log-saturation, max pooling), :func:`splade_score` is their dot product
  and :func:`flops_regularizer` the squared mean activation per word that trains the vectors sparse.

Conventions: batch first; queries ``(B, ...)``, passages ``(N, ...)``, scores ``(B, N)``. Inputs are
finite real tensors sharing one dtype; fp16/bf16 are computed in float32 and returned in their dtype.

>>> q = torch.tensor([[1.0, 0.0], [0.0, 1.0]]); d = torch.tensor([[0.9, 0.1], [0.2, 0.8]])
>>> dual_encoder_score(q, d)
tensor([[0.9000, 0.2000],
        [0.1000, 0.8000]])
"""

from __future__ import annotations

import torch
from torch import Tensor

from llmbook._checks import (
    as_tensor,
    check_choice,
    check_dim,
    check_finite,
    check_range,
    check_same_dtype,
    check_same_last_dim,
    check_shape,
)
from llmbook._precision import restore_half, upcast_half
from llmbook.rag import similarity as sim
from llmbook.registry import implements

__all__ = ["dual_encoder_score", "dpr_loss", "maxsim", "splade_score", "splade_weights", "flops_regularizer"]

SIMILARITIES = ("dot", "cosine")
REDUCTIONS = ("mean", "sum", "none")
_CHUNK = 1 << 22  # elements of the (B, n, T_q, T_d) token-similarity block of maxsim


def _real(x, name: str, contract: str, ndim: int) -> Tensor:
    x = as_tensor(x, name)
    if x.is_complex():
        raise TypeError(f"{name} must be a real tensor, got dtype {x.dtype}")
    check_dim(x, name, contract, min_dim=ndim, max_dim=ndim)
    check_finite(x, name)
    return x


def _similarity(q: Tensor, d: Tensor, kind: str) -> Tensor:
    """Chapter 20's pairwise score of ``(B, D)`` and ``(N, D)`` rows: ``(B, N)``."""
    check_choice(kind, "similarity", SIMILARITIES)
    return sim.dot_product(q, d) if kind == "dot" else sim.cosine_similarity(q, d)


@implements("22.01")
def dual_encoder_score(q, d, *, f=None, g=None, similarity: str = "dot") -> Tensor:
    r"""Dual-encoder (bi-encoder) score :math:`s(q,d)=f_\theta(q)^\top g_\phi(d)` of every query with every passage.

    ``q`` ``(B, D_in)`` query features, ``d`` ``(N, D_in)`` passage features -> ``(B, N)``.
    ``f`` and ``g`` are the two encoders (any callables mapping ``(*, D_in)`` to ``(*, D)``, e.g. an
    ``nn.Linear``); ``None`` is the identity, i.e. ``q`` and ``d`` are already the embeddings
    :math:`f_\theta(q)` and :math:`g_\phi(d)`. DPR uses two encoders; Sentence-BERT and MiniLM share one
    (``g = f``). ``similarity="dot"`` is :func:`llmbook.rag.similarity.dot_product` (DPR),
    ``"cosine"`` :func:`llmbook.rag.similarity.cosine_similarity` (the dot product of unit vectors).

    >>> dual_encoder_score(torch.tensor([[3.0, 4.0]]), torch.tensor([[4.0, 3.0], [8.0, 6.0]]), similarity="cosine")
    tensor([[0.9600, 0.9600]])
    """
    check_choice(similarity, "similarity", SIMILARITIES)
    q = _real(q, "q", "(B, D)", 2)
    d = _real(d, "d", "(N, D)", 2)
    check_same_dtype(q, d, "q", "d")
    check_same_last_dim(q, d, "q", "d", "D_in")
    for enc, name in ((f, "f"), (g, "g")):
        if enc is not None and not callable(enc):
            raise TypeError(f"{name} must be a callable encoder or None, got {type(enc).__name__}")
    fq = q if f is None else f(q)
    gd = d if g is None else g(d)
    return _similarity(fq, gd, similarity)


@implements("22.02")
def dpr_loss(q, d_pos, d_neg=None, *, tau: float = 1.0, in_batch: bool = True, similarity: str = "dot",
             reduction: str = "mean") -> Tensor:
    r"""DPR's contrastive loss (InfoNCE) with in-batch and hard negatives.

    .. math::
        \mathcal{L}=-\log\frac{\exp(s(q,d^+)/\tau)}{\exp(s(q,d^+)/\tau)+\sum_{d^-}\exp(s(q,d^-)/\tau)}

    ``q`` ``(B, D)`` query embeddings :math:`f(q)`; ``d_pos`` ``(B, D)``, row ``b`` the positive
    passage :math:`g(d^+_b)` of query ``b``; ``d_neg`` ``(B, K, D)`` hard negatives (e.g. BM25 top hits
    that are not relevant), or ``None``. With ``in_batch=True`` (DPR) the candidates of every query are
    all ``B`` positives and all ``B K`` hard negatives of the batch, ``B (1 + K)`` passages, the other
    queries' passages serving as negatives for free; with ``in_batch=False`` only its own positive and
    its own ``K`` negatives (``K >= 1``). ``tau > 0`` the temperature; ``similarity`` ``"dot"`` (DPR)
    or ``"cosine"`` (Sentence-BERT's MultipleNegativesRankingLoss, there with ``tau = 0.05``).
    Returns the mean (``"mean"``), the sum, or the ``(B,)`` losses (``"none"``).

    Equivalent to ``F.cross_entropy(S / tau, target)`` for the ``(B, candidates)`` score matrix; the
    logits are formed and normalised (log-sum-exp) in float64, so a small ``tau`` cannot overflow them.

    >>> q = torch.eye(2); round(float(dpr_loss(q, q, tau=0.5)), 4)  # log(1 + e^-2)
    0.1269
    """
    tau = check_range(tau, "tau", 0.0, low_open=True)
    check_choice(reduction, "reduction", REDUCTIONS)
    check_choice(similarity, "similarity", SIMILARITIES)
    if not isinstance(in_batch, bool):
        raise TypeError(f"in_batch must be a bool, got {type(in_batch).__name__}")
    q = _real(q, "q", "(B, D)", 2)
    d_pos = _real(d_pos, "d_pos", "(B, D)", 2)
    check_same_dtype(q, d_pos, "q", "d_pos")
    check_shape(d_pos, tuple(q.shape), "d_pos", "one positive passage per query, (B, D)")
    B, D = q.shape
    if d_neg is not None:
        d_neg = _real(d_neg, "d_neg", "(B, K, D)", 3)
        check_same_dtype(q, d_neg, "q", "d_neg")
        if d_neg.shape[0] != B or d_neg.shape[2] != D:
            raise ValueError(f"d_neg {tuple(d_neg.shape)} must be (B, K, D) = ({B}, K, {D}): "
                             "K hard negatives per query")
    K = 0 if d_neg is None else d_neg.shape[1]
    if not in_batch and K == 0:
        raise ValueError("in_batch=False needs hard negatives: pass d_neg of shape (B, K, D) with K >= 1")
    dtype = q.dtype
    if in_batch:
        cand = d_pos if K == 0 else torch.cat([d_pos, d_neg.reshape(B * K, D)], 0)  # (B (1 + K), D)
        S = _similarity(q, cand, similarity)  # (B, B (1 + K))
        pos = torch.arange(B, device=q.device)
        s_pos = S[pos, pos]
    else:
        cand = torch.cat([d_pos[:, None], d_neg], 1)  # (B, 1 + K, D): column 0 is the positive
        S = torch.cat([_similarity(q[b:b + 1], cand[b], similarity) for b in range(B)], 0) if B else \
            q.new_zeros(0, 1 + K)
        s_pos = S[:, 0]
    logits = upcast_half(S).double() / tau
    loss = torch.logsumexp(logits, -1) - s_pos.double() / tau
    loss = loss.to(upcast_half(q).dtype)
    if reduction == "mean":
        loss = loss.mean() if B else loss.sum()  # an empty batch has loss 0, not NaN
    elif reduction == "sum":
        loss = loss.sum()
    return restore_half(loss, dtype)


def _mask(mask, shape, name: str) -> Tensor | None:
    if mask is None:
        return None
    if not isinstance(mask, Tensor) or mask.dtype != torch.bool:
        raise TypeError(f"{name} must be a bool tensor (True on real tokens, False on padding), got "
                        f"{type(mask).__name__ if not isinstance(mask, Tensor) else mask.dtype}")
    return check_shape(mask, shape, name, "one flag per token")


@implements("22.03")
def maxsim(E_q, E_d, *, q_mask=None, d_mask=None) -> Tensor:
    r"""ColBERT's late-interaction score :math:`s(q,d)=\sum_{i\in q}\max_{j\in d}E_{q_i}^\top E_{d_j}`.

    ``E_q`` ``(B, T_q, D)`` one vector per query token, ``E_d`` ``(N, T_d, D)`` one per document token
    -> ``(B, N)``, every query against every document. ``q_mask`` ``(B, T_q)`` / ``d_mask`` ``(N, T_d)``
    bool, False on padding: a padded query token adds nothing, a padded document token is never the
    max. A document with no (unmasked) token scores ``-inf`` (not retrievable); a query with none
    scores 0. ColBERT normalises the token vectors, so each term is a cosine in ``[-1, 1]``.
    Computed one block of documents at a time (the ``(B, n, T_q, T_d)`` token similarities).

    >>> E_q = torch.tensor([[[1.0, 0.0], [0.0, 1.0]]]); E_d = torch.tensor([[[1.0, 0.0], [0.6, 0.8]]])
    >>> maxsim(E_q, E_d)  # max(1, 0.6) + max(0, 0.8)
    tensor([[1.8000]])
    """
    E_q = _real(E_q, "E_q", "(B, T_q, D)", 3)
    E_d = _real(E_d, "E_d", "(N, T_d, D)", 3)
    check_same_dtype(E_q, E_d, "E_q", "E_d")
    check_same_last_dim(E_q, E_d, "E_q", "E_d", "D")
    q_mask = _mask(q_mask, tuple(E_q.shape[:2]), "q_mask")
    d_mask = _mask(d_mask, tuple(E_d.shape[:2]), "d_mask")
    dtype = E_q.dtype
    E_q, E_d = upcast_half(E_q), upcast_half(E_d)
    B, T_q, _ = E_q.shape
    N, T_d, _ = E_d.shape
    step = max(1, _CHUNK // max(1, B * T_q * T_d))
    out = []
    for n0 in range(0, max(N, 1), step):
        S = torch.einsum("bid,njd->bnij", E_q, E_d[n0:n0 + step])  # (B, n, T_q, T_d)
        if d_mask is not None:
            S = S.masked_fill(~d_mask[None, n0:n0 + step, None, :], -torch.inf)
        best = S.amax(-1) if T_d else S.new_full(S.shape[:-1], -torch.inf)  # (B, n, T_q)
        if q_mask is not None:
            best = best.masked_fill(~q_mask[:, None, :], 0.0)
        out.append(best.sum(-1))
    return restore_half(torch.cat(out, 1)[:, :N], dtype)


@implements("22.04")
def splade_score(w_q, w_d) -> Tensor:
    r"""SPLADE's score, the dot product of vocabulary-sized weight vectors :math:`s(q,d)=\sum_{j=1}^{V}w_{qj}w_{dj}`.

    ``w_q`` ``(B, V)``, ``w_d`` ``(N, V)`` non-negative term weights (:func:`splade_weights`) ->
    ``(B, N)``. Only words active on both sides contribute, so an inverted index over the non-zero
    entries computes it exactly, like BM25; here the vectors are dense and the product is chapter
    20's :func:`llmbook.rag.similarity.dot_product`.

    >>> splade_score(torch.tensor([[0.0, 2.0, 1.0]]), torch.tensor([[5.0, 0.5, 0.0], [0.0, 1.0, 3.0]]))
    tensor([[1., 5.]])
    """
    w_q = _real(w_q, "w_q", "(B, V)", 2)
    w_d = _real(w_d, "w_d", "(N, V)", 2)
    check_same_dtype(w_q, w_d, "w_q", "w_d")
    check_same_last_dim(w_q, w_d, "w_q", "w_d", "V")
    for w, name in ((w_q, "w_q"), (w_d, "w_d")):
        if w.numel() and w.min() < 0:
            raise ValueError(f"{name} must be non-negative SPLADE weights (log(1 + ReLU(z)) >= 0), got a minimum of "
                             f"{w.min().item():g}")
    return sim.dot_product(w_q, w_d)


@implements("22.05")
def splade_weights(z, *, mask=None, pooling: str = "max") -> Tensor:
    r"""SPLADE's term weights from MLM logits, :math:`w_j=\max_i \log(1+\mathrm{ReLU}(z_{ij}))`.

    ``z`` ``(B, T, V)`` the MLM head's logits of every token ``i`` over the vocabulary ``j`` -> ``(B, V)``.
    ReLU keeps positive evidence only; the logarithm saturates it (a logit of 100 weighs 4.6, not
    100), so no single word dominates. ``pooling="max"`` (SPLADE v2 and later) or ``"sum"`` (SPLADE
    v1: :math:`\sum_i`). ``mask`` ``(B, T)`` bool, False on padding (padding contributes 0).
    ``log1p`` keeps the small weights exact.

    >>> splade_weights(torch.tensor([[[-1.0, 0.0, 1.0], [2.0, -3.0, 0.5]]]))
    tensor([[1.0986, 0.0000, 0.6931]])
    """
    check_choice(pooling, "pooling", ("max", "sum"))
    z = _real(z, "z", "(B, T, V)", 3)
    mask = _mask(mask, tuple(z.shape[:2]), "mask")
    dtype = z.dtype
    z = upcast_half(z)
    a = torch.log1p(torch.relu(z))  # (B, T, V), >= 0
    if mask is not None:
        a = a * mask[..., None].to(a.dtype)  # 0 is neutral for both max and sum of non-negative terms
    if pooling == "sum":
        w = a.sum(1)
    else:
        w = a.amax(1) if z.shape[1] else a.new_zeros(z.shape[0], z.shape[2])
    return restore_half(w, dtype)


@implements("22.06")
def flops_regularizer(w) -> Tensor:
    r"""The FLOPS regulariser :math:`\mathcal{L}_{FLOPS}=\sum_j \left(\frac{1}{N}\sum_i |w_{ij}|\right)^2`.

    ``w`` ``(N, V)`` term weights of a batch of ``N`` queries or documents -> a scalar. The mean
    activation :math:`\bar a_j` of word ``j`` estimates how often it is non-zero; for two independent
    vectors the expected number of multiplications in :func:`splade_score` is
    :math:`\sum_j p_j^2`, hence the square. Unlike the L1 norm :math:`\sum_j \bar a_j` it penalises
    frequent words most, which pushes weight onto rare, discriminative words. SPLADE's weights are
    non-negative, so :math:`|w_{ij}| = w_{ij}` (Paria et al. take the absolute value). ``N = 0`` gives 0.

    >>> flops_regularizer(torch.tensor([[1.0, 0.0, 2.0], [3.0, 0.0, 0.0]]))  # 2^2 + 0 + 1^2
    tensor(5.)
    """
    w = _real(w, "w", "(N, V)", 2)
    dtype = w.dtype
    w = upcast_half(w)
    if w.shape[0] == 0:
        return restore_half(w.new_zeros(()), dtype)
    a = w.abs().mean(0)  # (V,)
    return restore_half((a * a).sum(), dtype)
