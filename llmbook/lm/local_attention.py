r"""Local and sparse attention patterns (chapter 3): sliding window and the fixed / strided patterns.

Each pattern is a boolean mask :math:`S` (``True`` = query ``i`` may attend to key ``j``), and the
attention is full attention with every other score set to :math:`-\infty` before the softmax:

.. math:: \mathrm{SparseAttn}(Q, K, V) = \mathrm{softmax}\!\Big(\frac{QK^\top}{\sqrt{d_k}} + M_S\Big) V,
    \qquad (M_S)_{ij} = 0 \text{ if } S_{ij} \text{ else } -\infty

The functions here never build the ``T x T`` score matrix: the sliding window works on blocks of
queries against the keys their window can reach, the sparse patterns gather each query's allowed
keys. Both cost :math:`O(T \cdot w)` for ``w`` allowed keys per query instead of :math:`O(T^2)`.
"""

from __future__ import annotations

import math

import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor

from llmbook._checks import (
    as_tensor,
    check_broadcastable_to,
    check_dim,
    check_int,
    check_integer_tensor,
    check_positive_int,
    check_range,
    check_same_shape,
)
from llmbook._precision import restore_half, upcast_half
from llmbook.lm.attention import (
    attention_scale,
    check_attention_inputs,
    masked_softmax,
    repeat_kv,
    scaled_dot_product_attention,
)
from llmbook.registry import implements

__all__ = [
    "sliding_window_mask",
    "sliding_window_attention",
    "sparse_indices",
    "sparse_mask",
    "sparse_attention",
    "gathered_attention",
]


def sliding_window_mask(T_q: int, T_k: int | None = None, window: int = 1, causal: bool = True,
                        device=None) -> Bool[Tensor, "T_q T_k"]:
    r"""Boolean sliding-window mask: query ``i`` (at position :math:`p_i = i + T_k - T_q`) sees keys ``j`` with

    * ``causal=True``: :math:`p_i - W < j \le p_i` — itself and the :math:`W - 1` keys before it;
    * ``causal=False``: :math:`|p_i - j| < W`.

    ``window`` is :math:`W \ge 1`, the number of keys a causal query sees (Mistral's convention).
    The catalogue's bound :math:`A_{ij} = 0` for :math:`|i - j| > w` is the same mask with :math:`w = W - 1`.

    >>> sliding_window_mask(4, window=2).int()
    tensor([[1, 0, 0, 0],
            [1, 1, 0, 0],
            [0, 1, 1, 0],
            [0, 0, 1, 1]], dtype=torch.int32)
    """
    T_k = T_q if T_k is None else T_k
    T_q, T_k, window = (check_positive_int(v, n) for v, n in ((T_q, "T_q"), (T_k, "T_k"), (window, "window")))
    p = torch.arange(T_q, device=device).unsqueeze(-1) + (T_k - T_q)
    j = torch.arange(T_k, device=device)
    return ((j <= p) & (j > p - window)) if causal else (p - j).abs() < window


@implements("03.07")
def sliding_window_attention(
    q: Float[Tensor, "B *H T_q D"], k: Float[Tensor, "B *H_kv T_k D"], v: Float[Tensor, "B *H_kv T_k D_v"],
    window: int, causal: bool = True, scale: float | None = None, block_q: int | None = None,
) -> Float[Tensor, "B *H T_q D_v"]:
    r"""Attention restricted to a sliding window of ``window`` keys (see :func:`sliding_window_mask`).

    .. math:: A_{ij} = 0 \text{ unless } p_i - W < j \le p_i \quad (\text{causal}), \qquad
        A = \mathrm{softmax}\!\Big(\frac{QK^\top}{\sqrt{d_k}} + M_W\Big)

    Queries are processed in blocks of ``block_q`` (default ``max(W, 64)``); a block only reads the
    ``block_q + W - 1`` keys (``+ 2(W - 1)`` bidirectionally) its window can reach, so memory is
    :math:`O(T \cdot (W + \text{block\_q}))`, never :math:`O(T^2)`. Shapes as
    :func:`~llmbook.lm.attention.scaled_dot_product_attention` (GQA included).

    >>> q = k = v = torch.ones(1, 5, 2)
    >>> sliding_window_attention(q, k, v, window=2).shape
    torch.Size([1, 5, 2])
    """
    q4, k4, v4, squeeze = check_attention_inputs(q, k, v)
    window = check_positive_int(window, "window")
    T_q, T_k = q4.shape[2], k4.shape[2]
    scale = attention_scale(scale, q4.shape[-1])
    block_q = max(window, 64) if block_q is None else check_positive_int(block_q, "block_q")
    off = T_k - T_q
    outs = []
    for a in range(0, T_q, block_q):
        b = min(a + block_q, T_q)
        lo = max(0, a + off - window + 1)
        hi = min(T_k, (b - 1 + off + 1) if causal else (b - 1 + off + window))
        if hi <= lo:  # no key in reach: zero output, as for a fully masked row
            outs.append(q4.new_zeros(*q4.shape[:2], b - a, v4.shape[-1]))
            continue
        p = torch.arange(a, b, device=q4.device).unsqueeze(-1) + off
        j = torch.arange(lo, hi, device=q4.device)
        allowed = ((j <= p) & (j > p - window)) if causal else (p - j).abs() < window
        outs.append(scaled_dot_product_attention(q4[:, :, a:b], k4[:, :, lo:hi], v4[:, :, lo:hi],
                                                 mask=allowed, scale=scale))
    out = torch.cat(outs, dim=2)
    return out.squeeze(1) if squeeze else out


def sparse_indices(T: int, pattern: str, stride: int, n_summary: int = 1
                   ) -> tuple[Int[Tensor, "T n"], Bool[Tensor, "T n"]]:
    r"""The allowed keys of each query for the causal sparse patterns of Child et al. (2019).

    With stride :math:`l` (``stride``) and :math:`c` summary columns (``n_summary``):

    * ``"strided"``: :math:`j \le i` and (:math:`i - j < l` or :math:`(i - j) \bmod l = 0`) — the last
      :math:`l` positions plus every :math:`l`-th one before them;
    * ``"fixed"``: :math:`j \le i` and (:math:`\lfloor j/l \rfloor = \lfloor i/l \rfloor` or
      :math:`j \bmod l \ge l - c`) — the query's own block plus the last :math:`c` columns of every block.

    Returns ``idx (T, n)`` (key indices, padded with 0) and ``valid (T, n)``; each row lists its keys
    once, ``n`` is about :math:`l + T/l` (:math:`O(\sqrt{T})` keys per query for :math:`l \approx \sqrt{T}`).

    >>> idx, valid = sparse_indices(6, "strided", 2)
    >>> sorted(idx[5][valid[5]].tolist())  # 5 and 4 (local), 3 and 1 (5 - j even)
    [1, 3, 4, 5]
    """
    T, stride = check_positive_int(T, "T"), check_positive_int(stride, "stride")
    # c is read by "fixed" only, but its contract holds for both patterns (no silently ignored bad value)
    n_summary = check_int(n_summary, "n_summary (c)", low=1, high=stride, what=f"an int in [1, stride = {stride}]")
    i = torch.arange(T).unsqueeze(-1)
    n_back = (T - 1) // stride  # previous strides / blocks the last query can reach
    if pattern == "strided":
        local = i - torch.arange(stride)
        strided = i - stride * torch.arange(1, n_back + 1)
        j = torch.cat([local, strided], dim=1)
        valid = j >= 0
    elif pattern == "fixed":
        block = i // stride
        own = block * stride + torch.arange(stride)
        cols = (torch.arange(n_back).unsqueeze(-1) * stride + stride - n_summary + torch.arange(n_summary))
        summary = cols.flatten().expand(T, -1)
        prev_block = (torch.arange(n_back).repeat_interleave(n_summary)).expand(T, -1)
        j = torch.cat([own, summary], dim=1)
        valid = torch.cat([own <= i, prev_block < block], dim=1)
    else:
        raise ValueError(f"pattern must be 'strided' or 'fixed', got {pattern!r}")
    return torch.where(valid, j, torch.zeros_like(j)), valid


def sparse_mask(T: int, pattern: str, stride: int, n_summary: int = 1) -> Bool[Tensor, "T T"]:
    """The dense ``(T, T)`` boolean mask of :func:`sparse_indices` (for pictures and small checks).

    >>> sparse_mask(4, "fixed", 2).int()
    tensor([[1, 0, 0, 0],
            [1, 1, 0, 0],
            [0, 1, 1, 0],
            [0, 1, 1, 1]], dtype=torch.int32)
    """
    idx, valid = sparse_indices(T, pattern, stride, n_summary)
    out = torch.zeros(T, T, dtype=torch.int64)
    out.scatter_add_(1, idx, valid.long())
    return out > 0


def gathered_attention(
    q: Float[Tensor, "B H T_q D"], k: Float[Tensor, "B H T_k D"], v: Float[Tensor, "B H T_k D_v"],
    idx: Int[Tensor, "*batch T_q n"], valid: Bool[Tensor, "*batch T_q n"], scale: float,
) -> Float[Tensor, "B H T_q D_v"]:
    r"""Attention of each query over its own list of keys: query ``i`` reads keys ``idx[..., i, :]`` where ``valid``.

    ``idx`` and ``valid`` are ``(T_q, n)`` or ``(B, H, T_q, n)``. Cost :math:`O(T_q\, n\, D)`; a query
    with no valid key gets a zero output. Used by the sparse patterns and by LSH attention.
    fp16 / bf16 inputs are computed in float32 and the output returned in their dtype.
    """
    q, k, v, squeeze = check_attention_inputs(q, k, v, allow_gqa=False)
    if squeeze:
        raise ValueError(f"q, k, v must have shape (B, H, T, D), got {tuple(q.shape[:1] + q.shape[2:])}")
    check_range(scale, "scale", 0.0, low_open=True)
    B, H, T_q, D = q.shape
    idx = check_integer_tensor(idx, "idx")
    valid = as_tensor(valid, "valid", floating=False)
    if valid.dtype != torch.bool:
        raise TypeError(f"valid must be a bool mask (True = the key is read), got dtype {valid.dtype}")
    check_dim(idx, "idx", "(T_q, n) or (B, H, T_q, n)", min_dim=2, max_dim=4)
    check_same_shape(idx, valid, "idx", "valid")
    n = idx.shape[-1]
    check_broadcastable_to(idx, (B, H, T_q, n), "idx", "(B, H, T_q, n)")
    T_k = k.shape[2]
    if idx.numel() and (idx.min() < 0 or idx.max() >= T_k):
        raise ValueError(f"idx must hold key indices in [0, T_k) = [0, {T_k}) (pad invalid slots with 0), "
                         f"got range [{idx.min().item()}, {idx.max().item()}]")
    idx = idx.to(torch.long).expand(B, H, T_q, n).reshape(B, H, T_q * n, 1)
    k_g = k.gather(2, idx.expand(-1, -1, -1, D)).view(B, H, T_q, n, D)
    v_g = v.gather(2, idx.expand(-1, -1, -1, v.shape[-1])).view(B, H, T_q, n, v.shape[-1])
    dtype, q, k_g, v_g = q.dtype, upcast_half(q), upcast_half(k_g), upcast_half(v_g)
    scores = torch.einsum("bhtd,bhtnd->bhtn", q, k_g) * scale
    w = masked_softmax(scores, valid.expand(B, H, T_q, n))
    return restore_half(torch.einsum("bhtn,bhtnd->bhtd", w, v_g), dtype)


@implements("03.08")
def sparse_attention(
    q: Float[Tensor, "B *H T D"], k: Float[Tensor, "B *H_kv T D"], v: Float[Tensor, "B *H_kv T D_v"],
    pattern: str = "strided", stride: int | None = None, n_summary: int = 1, scale: float | None = None,
) -> Float[Tensor, "B *H T D_v"]:
    r"""Causal sparse self-attention with the ``"strided"`` or ``"fixed"`` pattern (:func:`sparse_indices`).

    .. math:: \mathrm{SparseAttn}(Q, K, V) = \mathrm{softmax}\!\Big(\frac{QK^\top}{\sqrt{d_k}} + M_S\Big) V

    Computed by gathering each query's allowed keys (never a ``T x T`` matrix). ``stride`` is
    :math:`l`, by default :math:`\lceil\sqrt{T}\rceil`. Self-attention only: ``T_q == T_k``.

    >>> q = k = v = torch.ones(1, 9, 2)
    >>> sparse_attention(q, k, v, "fixed", stride=3).shape
    torch.Size([1, 9, 2])
    """
    q4, k4, v4, squeeze = check_attention_inputs(q, k, v)
    T = q4.shape[2]
    if k4.shape[2] != T:
        raise ValueError(f"sparse attention is self-attention: T_q ({T}) must equal T_k ({k4.shape[2]})")
    stride = math.isqrt(T - 1) + 1 if stride is None else stride
    idx, valid = sparse_indices(T, pattern, stride, n_summary)
    G = q4.shape[1] // k4.shape[1]
    k4, v4 = repeat_kv(k4, G), repeat_kv(v4, G)
    out = gathered_attention(q4, k4, v4, idx.to(q4.device), valid.to(q4.device), attention_scale(scale, q4.shape[-1]))
    return out.squeeze(1) if squeeze else out
