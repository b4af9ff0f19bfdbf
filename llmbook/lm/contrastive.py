r"""Contrastive and metric losses (chapter 7): InfoNCE, NT-Xent and the triplet margin loss.

They take embeddings, batch-first: ``(B, D)`` rows of width ``D``. InfoNCE and NT-Xent are
cross-entropies over *similarity logits*: each query must pick its positive out of a row of candidates,
so they reuse :func:`llmbook.lm.probability.cross_entropy_loss` on logits built here. The triplet loss
compares two distances with a margin. ``reduction`` is ``"mean"``, ``"sum"`` or ``"none"``; fp16 and
bf16 inputs are computed in float32 (``llmbook._precision``).
"""

from __future__ import annotations

import math

import torch
from jaxtyping import Float
from torch import Tensor

from llmbook._checks import (
    as_tensor,
    check_choice,
    check_dim,
    check_finite,
    check_nonempty,
    check_range,
    check_same_dtype,
    check_same_shape,
)
from llmbook._precision import restore_half, upcast_half
from llmbook.lm.losses import REDUCTIONS, reduce_loss
from llmbook.lm.probability import cross_entropy_loss
from llmbook.registry import implements

__all__ = ["info_nce", "nt_xent", "triplet_loss"]

SIMILARITIES = ("cosine", "dot")


# ================================================================= 07.03, 07.04 contrastive losses


def _embeddings(x, name: str, contract: str, ndim: tuple[int, int] = (2, 2)) -> Tensor:
    x = as_tensor(x, name)
    check_dim(x, name, contract, min_dim=ndim[0], max_dim=ndim[1])
    check_nonempty(x, name)
    check_finite(x, name)
    return x


def _unit(x: Tensor, eps: float = 1e-12) -> Tensor:
    """Rows scaled to unit L2 norm, as ``F.normalize`` but first divided by their largest entry (no overflow)."""
    m = x.abs().amax(-1, keepdim=True)
    x = x / torch.where(m > 0, m, torch.ones_like(m))
    return x / torch.linalg.vector_norm(x, dim=-1, keepdim=True).clamp_min(eps)


@implements("07.03")
def info_nce(q: Float[Tensor, "B D"], k: Float[Tensor, "B D"], negatives: Tensor | None = None, tau: float = 0.07,
             similarity: str = "cosine", symmetric: bool = False, reduction: str = "mean") -> Tensor:
    r"""InfoNCE: cross-entropy of picking the positive key among the candidates, over similarity logits.

    .. math:: L_{InfoNCE}=-\log\frac{\exp(s(q,k^+)/\tau)}{\exp(s(q,k^+)/\tau)+\sum_{k^-}\exp(s(q,k^-)/\tau)}

    Row ``b`` of ``q`` is a query, row ``b`` of ``k`` its positive key :math:`k^+`; :math:`s` is the
    cosine (``similarity="cosine"``) or the dot product (``"dot"``), :math:`\tau` is ``tau``.

    * ``negatives=None`` (CLIP, in-batch negatives): the other rows of ``k`` are the negatives; the
      logits are the ``(B, B)`` matrix :math:`s(q_a, k_b)/\tau` and the label of row ``a`` is ``a``.
      ``symmetric=True`` averages both directions (queries pick keys, keys pick queries), as CLIP.
    * ``negatives`` of shape ``(N, D)`` (MoCo's queue, shared) or ``(B, N, D)`` (per query): the
      logits are ``[s(q, k+), s(q, k-_1), ...]/tau`` of shape ``(B, 1 + N)``, label 0.

    Shapes ``(B, D), (B, D) -> ()`` (``"none"``: ``(B,)``).

    >>> q = torch.eye(3)
    >>> round(info_nce(q, q, tau=1.0).item(), 4)  # log(e + 2) - 1: the positive has cosine 1, others 0
    0.5514
    """
    q = _embeddings(q, "q", "(B, D)")
    k = _embeddings(k, "k", "(B, D)")
    check_same_shape(q, k, "q", "k")
    check_same_dtype(q, k, "q", "k")
    tau = check_range(tau, "tau", 0.0, low_open=True)
    check_choice(similarity, "similarity", SIMILARITIES)
    check_choice(reduction, "reduction", REDUCTIONS)
    q_in = q
    q, k = upcast_half(q), upcast_half(k)
    if similarity == "cosine":
        q, k = _unit(q), _unit(k)
    B = q.shape[0]
    if negatives is None:
        logits = q @ k.T / tau
        labels = torch.arange(B)
        loss = cross_entropy_loss(logits, labels, reduction="none", ignore_index=None)
        if symmetric:
            loss = (loss + cross_entropy_loss(logits.T, labels, reduction="none", ignore_index=None)) / 2
    else:
        if symmetric:
            raise ValueError("symmetric=True needs in-batch negatives (negatives=None)")
        neg = _embeddings(negatives, "negatives", "(N, D) or (B, N, D)", (2, 3))
        check_same_dtype(q_in, neg, "q", "negatives")
        if neg.shape[-1] != q.shape[-1] or (neg.ndim == 3 and neg.shape[0] != B):
            raise ValueError(f"negatives must have shape (N, D) or (B, N, D) with B = {B}, D = {q.shape[-1]}, "
                             f"got {tuple(neg.shape)}")
        neg = upcast_half(neg)
        if similarity == "cosine":
            neg = _unit(neg)
        s_neg = q @ neg.T if neg.ndim == 2 else torch.einsum("bd,bnd->bn", q, neg)
        logits = torch.cat([(q * k).sum(-1, keepdim=True), s_neg], dim=-1) / tau
        loss = cross_entropy_loss(logits, torch.zeros(B, dtype=torch.long), reduction="none", ignore_index=None)
    return restore_half(reduce_loss(loss, None, reduction, "query"), q_in.dtype)


@implements("07.04")
def nt_xent(z_i: Float[Tensor, "N D"], z_j: Float[Tensor, "N D"], tau: float = 0.5,
            reduction: str = "mean") -> Tensor:
    r"""SimCLR's NT-Xent: each of the :math:`2N` views must find its partner among the other :math:`2N-1`.

    .. math:: l_{i,j}=-\log\frac{\exp(\mathrm{sim}(z_i,z_j)/\tau)}{\sum_{k\ne i}\exp(\mathrm{sim}(z_i,z_k)/\tau)}

    ``z_i[n]`` and ``z_j[n]`` are the projections of two augmentations of sample ``n``; :math:`\mathrm{sim}`
    is the cosine and :math:`\tau` is ``tau``. The :math:`2N` views are stacked, the ``(2N, 2N)``
    similarity logits get :math:`-\infty` on the diagonal (a view is not its own candidate), and the
    label of view ``n`` is ``n + N`` (and of ``n + N``, ``n``). ``"mean"`` is SimCLR's
    :math:`\frac{1}{2N}\sum_n (l_{n,n+N} + l_{n+N,n})`.
    Shapes ``(N, D), (N, D) -> ()`` (``"none"``: ``(2N,)``, the ``z_i`` views first).

    >>> z = torch.eye(2)
    >>> round(nt_xent(z, z, tau=1.0).item(), 4)  # log(e + 2) - 1, as info_nce(eye(3), eye(3), tau=1)
    0.5514
    """
    z_i = _embeddings(z_i, "z_i", "(N, D)")
    z_j = _embeddings(z_j, "z_j", "(N, D)")
    check_same_shape(z_i, z_j, "z_i", "z_j")
    check_same_dtype(z_i, z_j, "z_i", "z_j")
    tau = check_range(tau, "tau", 0.0, low_open=True)
    check_choice(reduction, "reduction", REDUCTIONS)
    N = z_i.shape[0]
    if N == 0:
        raise ValueError("nt_xent needs at least one pair of views, got N = 0")
    u = _unit(upcast_half(torch.cat([z_i, z_j])))
    logits = (u @ u.T / tau).masked_fill(torch.eye(2 * N, dtype=torch.bool), -math.inf)
    labels = torch.cat([torch.arange(N, 2 * N), torch.arange(N)])
    loss = cross_entropy_loss(logits, labels, reduction="none", ignore_index=None)
    return restore_half(reduce_loss(loss, None, reduction, "view"), z_i.dtype)


# ================================================================= 07.05 triplet loss


def _distance(x1: Tensor, x2: Tensor, ord: float, eps: float) -> Tensor:
    """``||x1 - x2 + eps||_ord`` over the last axis (torch's ``pairwise_distance``), scaled first: no overflow."""
    d = x1 - x2 + eps
    m = d.abs().amax(-1, keepdim=True)
    m = torch.where(m > 0, m, torch.ones_like(m))
    return m.squeeze(-1) * torch.linalg.vector_norm(d / m, ord=ord, dim=-1)


@implements("07.05")
def triplet_loss(a: Float[Tensor, "... D"], p: Float[Tensor, "... D"], n: Float[Tensor, "... D"],
                 margin: float = 1.0, ord: float = 2.0, eps: float = 1e-6, swap: bool = False,
                 reduction: str = "mean") -> Tensor:
    r"""Triplet margin loss :math:`L=\max(0,\,d(a,p)-d(a,n)+m)`.

    The anchor ``a`` must be closer to the positive ``p`` than to the negative ``n`` by at least the
    margin :math:`m` (``margin > 0``, as torch requires). :math:`d(x, y) = \|x - y + \epsilon\|_{ord}`
    is torch's ``pairwise_distance``: the ``eps`` sits *inside* the norm (pass ``eps=0`` for the plain
    distance); ``ord >= 1`` (a norm; ``inf`` allowed), where torch also takes ``0 < p < 1``.
    ``swap=True`` uses :math:`\min(d(a,n), d(p,n))` as the negative distance (Balntas et al.).
    Equals ``F.triplet_margin_loss(a, p, n, margin, ord, eps, swap)``.
    Shapes ``(..., D)`` three times ``-> ()`` (``"none"``: ``(...)``).

    >>> a, p, n = torch.tensor([[0.0, 0.0]]), torch.tensor([[1.0, 0.0]]), torch.tensor([[0.0, 1.5]])
    >>> triplet_loss(a, p, n, margin=1.0, eps=0.0)  # 1 - 1.5 + 1
    tensor(0.5000)
    """
    names = ("a", "p", "n")
    a, p, n = (as_tensor(t, name) for t, name in zip((a, p, n), names, strict=True))
    for t, name in zip((a, p, n), names, strict=True):
        check_dim(t, name, "(..., D)")
        check_nonempty(t, name)
        check_finite(t, name)
    check_same_shape(a, p, "a", "p")
    check_same_shape(a, n, "a", "n")
    check_same_dtype(a, p, "a", "p")
    check_same_dtype(a, n, "a", "n")
    margin = check_range(margin, "margin", 0.0, low_open=True)
    ord = check_range(ord, "ord", 1.0, finite=False)
    eps = check_range(eps, "eps", 0.0)
    check_choice(reduction, "reduction", REDUCTIONS)
    dtype = a.dtype
    a, p, n = upcast_half(a), upcast_half(p), upcast_half(n)
    d_ap, d_an = _distance(a, p, ord, eps), _distance(a, n, ord, eps)
    if swap:
        d_an = torch.minimum(d_an, _distance(p, n, ord, eps))
    loss = (d_ap - d_an + margin).clamp_min(0)
    return restore_half(reduce_loss(loss, None, reduction, "triplet"), dtype)
