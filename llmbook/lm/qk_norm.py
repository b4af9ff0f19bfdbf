r"""QK-norm (chapter 5): normalise queries and keys per head before their dot product.

Attention scores :math:`q^\top k/\sqrt{D}` grow with the *product* of the query and key scales. When
training lets :math:`W_Q` and :math:`W_K` grow, the scores grow quadratically, the softmax saturates
to one-hot rows (its entropy collapses) and its gradient vanishes; at large scale this shows up as loss
spikes and divergence (Dehghani et al., 2023, ViT-22B; Wortsman et al., 2023). QK-norm applies a norm
to every query and key vector of every head, over its :math:`D` features, before the product:

.. math:: \hat q = g_Q \odot \mathrm{Norm}(q),\qquad \hat k = g_K \odot \mathrm{Norm}(k),\qquad
          s_{ij} = \frac{\hat q_i^\top \hat k_j}{\sqrt D}

with :math:`\mathrm{Norm}` an RMSNorm (Qwen3, Gemma 3, OLMo 2) or a LayerNorm without bias (ViT-22B)
and learned gains :math:`g_Q, g_K \in \mathbb{R}^D` shared by the heads. The normalised vectors have
length at most :math:`\sqrt D`, so by Cauchy-Schwarz every score obeys
:math:`|s_{ij}| \le \sqrt D \max|g_Q| \max|g_K|` (:func:`qk_logit_bound`) whatever the weights do.
(OLMo 2 normalises the whole projection of width :math:`H D` instead of each head; the bound is then
per token, not per head.)
"""

from __future__ import annotations

import math

import torch  # noqa: F401 (the doctests use it)
from torch import Tensor

from llmbook._checks import as_tensor, check_choice, check_dim, check_positive_int, check_same_last_dim
from llmbook.lm.norms import layer_norm, rms_norm

__all__ = ["qk_norm", "qk_logit_bound"]


def qk_norm(q: Tensor, k: Tensor, weight_q: Tensor | None = None, weight_k: Tensor | None = None,
            eps: float = 1e-6, kind: str = "rms") -> tuple[Tensor, Tensor]:
    r"""Normalise each query and key vector over its head width :math:`D`: :math:`(\hat q, \hat k)`.

    .. math:: \hat q = g_Q \odot \mathrm{Norm}(q),\qquad \hat k = g_K \odot \mathrm{Norm}(k)

    ``q`` is ``(B, H, T, D)`` and ``k`` ``(B, H_kv, S, D)`` (any leading axes; only the last, :math:`D`,
    is normalised, so each head and position is normalised on its own); ``weight_q`` / ``weight_k`` are
    :math:`g_Q, g_K` of shape ``(D,)`` (``None`` means ones); ``kind`` is ``"rms"``
    (:func:`~llmbook.lm.norms.rms_norm`) or ``"layer"`` (:func:`~llmbook.lm.norms.layer_norm` without
    bias); ``eps`` as in those. Returns the two tensors in the shapes of ``q`` and ``k``; the attention
    then uses :math:`\hat q \hat k^\top / \sqrt D` unchanged. Apply it before RoPE, as Qwen3 and Gemma 3 do.

    >>> q_hat, k_hat = qk_norm(torch.tensor([[3.0, 4.0]]), torch.tensor([[100.0, 0.0]]), eps=0.0)
    >>> q_hat, k_hat  # each vector now has root mean square 1 (length sqrt(D))
    (tensor([[0.8485, 1.1314]]), tensor([[1.4142, 0.0000]]))
    """
    check_choice(kind, "kind", ("rms", "layer"))
    q, k = as_tensor(q, "q"), as_tensor(k, "k")
    check_dim(q, "q", "(..., T, D)", min_dim=2)
    check_dim(k, "k", "(..., S, D)", min_dim=2)
    check_same_last_dim(q, k, "q", "k", "the head width D")
    if kind == "rms":
        return rms_norm(q, weight_q, eps), rms_norm(k, weight_k, eps)
    return layer_norm(q, weight_q, None, eps), layer_norm(k, weight_k, None, eps)


def qk_logit_bound(D: int, weight_q: Tensor | None = None, weight_k: Tensor | None = None) -> float:
    r"""The largest attention score QK-norm allows: :math:`\sqrt D\,\max_i|g_{Q,i}|\,\max_i|g_{K,i}|`.

    After RMSNorm (or LayerNorm), :math:`\lVert \mathrm{Norm}(q) \rVert_2 \le \sqrt D` (equality when
    :math:`\epsilon = 0`), so :math:`|\hat q^\top \hat k| \le \lVert \hat q\rVert \lVert \hat k\rVert \le
    D \max|g_Q| \max|g_K|` and the score, divided by :math:`\sqrt D`, is at most this bound, for any
    queries and keys. ``D`` the head width, ``weight_q`` / ``weight_k`` the gains (``None`` = ones).

    >>> qk_logit_bound(64)  # unit gains: scores lie in [-8, 8]
    8.0
    """
    D = check_positive_int(D, "D (the head width)")
    scale = math.sqrt(D)
    for name, w in (("weight_q", weight_q), ("weight_k", weight_k)):
        if w is not None:
            w = as_tensor(w, name)
            if w.shape != (D,):
                raise ValueError(f"{name} must have shape (D,) = ({D},), got {tuple(w.shape)}")
            scale *= float(w.abs().max())
    return scale
