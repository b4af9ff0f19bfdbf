r"""FlashAttention in pure PyTorch (chapter 3): tiled attention with an online softmax, forward and backward.

The tiled forward visits the keys block by block and keeps, for every query row, a running maximum
:math:`m_i`, a running sum :math:`l_i` and an unnormalised output; the ``T_q x T_k`` matrix of scores
never exists, only one ``block_q x block_k`` tile at a time. The backward recomputes the tiles from
``q, k, v`` and the per-row log-sum-exp :math:`L_i = m_i + \log l_i` saved by the forward.

This is the algorithm of FlashAttention-2 (Dao, 2023) written for clarity on the CPU; the GPU kernel
of :mod:`llmbook.kernels` computes the same thing and falls back to this module.

Shapes: ``q (B, H, T_q, D)``, ``k (B, H, T_k, D)``, ``v (B, H, T_k, D_v)``, or all ``(B, T, D)``.
``causal`` aligns the last query with the last key (bottom-right, as FlashAttention-2): query
``i`` sees keys ``j <= i + T_k - T_q``; a query that sees no key has output 0 and :math:`L_i = -\infty`.
Half-precision inputs are accumulated in float32; ``lse`` is float32 (or float64 for float64 inputs).
"""

from __future__ import annotations

import weakref

import torch
from jaxtyping import Float
from torch import Tensor
from torch.autograd.function import once_differentiable
from torch.utils._python_dispatch import TorchDispatchMode

from llmbook._checks import as_tensor, check_finite, check_positive_int, check_same_dtype, check_same_shape
from llmbook.lm.attention import attention_scale, causal_mask, check_attention_inputs
from llmbook.registry import implements

__all__ = [
    "naive_attention",
    "merge_attention_states",
    "tiled_attention_forward",
    "tiled_attention_backward",
    "TiledAttention",
    "tiled_attention",
    "peak_tensor_bytes",
]

NEG_INF = float("-inf")


def _prepare(q, k, v, scale, block_q=1, block_k=1):
    q4, k4, v4, squeeze = check_attention_inputs(q, k, v, allow_gqa=False)
    check_positive_int(block_q, "block_q"), check_positive_int(block_k, "block_k")
    acc = torch.promote_types(q4.dtype, torch.float32)  # accumulate half precision in float32
    return q4, k4, v4, squeeze, attention_scale(scale, q4.shape[-1]), acc


def naive_attention(
    q: Float[Tensor, "B *H T_q D"], k: Float[Tensor, "B *H T_k D"], v: Float[Tensor, "B *H T_k D_v"],
    causal: bool = False, scale: float | None = None,
) -> tuple[Float[Tensor, "B *H T_q D_v"], Float[Tensor, "B *H T_q"]]:
    r"""Reference attention that materialises the full score matrix; returns ``(o, lse)``.

    .. math:: S = QK^\top/\sqrt{d_k}, \quad L_i = \log\sum_j e^{S_{ij}}, \quad O = e^{S - L}V

    Memory :math:`O(T_q T_k)` per head: what the tiled version avoids.

    >>> o, lse = naive_attention(torch.zeros(1, 2, 4), torch.zeros(1, 3, 4), torch.ones(1, 3, 4))
    >>> round(lse[0, 0].item(), 4)  # log 3: three equal scores of 0
    1.0986
    """
    q4, k4, v4, squeeze, scale, acc = _prepare(q, k, v, scale)
    s = (q4.to(acc) @ k4.to(acc).transpose(-1, -2)) * scale
    if causal:
        s = s.masked_fill(~causal_mask(s.shape[-2], s.shape[-1], device=s.device), NEG_INF)
    lse = torch.logsumexp(s, dim=-1)
    lse_safe = torch.where(torch.isinf(lse), torch.full_like(lse, float("inf")), lse)  # rows with no key: p = 0
    o = ((s - lse_safe.unsqueeze(-1)).exp() @ v4.to(acc)).to(q4.dtype)
    return (o.squeeze(1), lse.squeeze(1)) if squeeze else (o, lse)


@implements("03.14")
def merge_attention_states(
    o_a: Float[Tensor, "... T D_v"], lse_a: Float[Tensor, "... T"],
    o_b: Float[Tensor, "... T D_v"], lse_b: Float[Tensor, "... T"],
) -> tuple[Float[Tensor, "... T D_v"], Float[Tensor, "... T"]]:
    r"""Combine attention over two disjoint key sets from their normalised outputs and log-sum-exps.

    With :math:`l = e^{L}` written relative to :math:`m = \max(m^{old}, m^{block})`, this is the
    catalogue's pair of update rules:

    .. math:: l_i = e^{m_i^{old} - m_i} l_i^{old} + e^{m_i^{block} - m_i} l_i^{block}, \qquad
        o_i = \frac{e^{m_i^{old} - m_i} l_i^{old} o_i^{old} + e^{m_i^{block} - m_i} l_i^{block} o_i^{block}}{l_i}

    i.e. :math:`L = \log(e^{L_a} + e^{L_b})` and :math:`o = (e^{L_a} o_a + e^{L_b} o_b) / e^{L}`. Split-KV
    decoding (flash-decoding) uses exactly this to merge partial results.

    >>> o, lse = merge_attention_states(torch.ones(1, 1), torch.zeros(1), torch.zeros(1, 1), torch.zeros(1))
    >>> o, lse  # two equal halves: the average, and log 2
    (tensor([[0.5000]]), tensor([0.6931]))
    """
    o_a, o_b = as_tensor(o_a, "o_a"), as_tensor(o_b, "o_b")
    lse_a, lse_b = as_tensor(lse_a, "lse_a"), as_tensor(lse_b, "lse_b")
    check_same_shape(o_a, o_b, "o_a", "o_b")
    check_same_shape(lse_a, lse_b, "lse_a", "lse_b")
    if o_a.ndim < 1 or lse_a.shape != o_a.shape[:-1]:
        raise ValueError(f"lse_a {tuple(lse_a.shape)} must be o_a {tuple(o_a.shape)} without its last axis "
                         f"(o is (..., T, D_v), lse is (..., T))")
    check_same_dtype(o_a, o_b, "o_a", "o_b")
    check_same_dtype(lse_a, lse_b, "lse_a", "lse_b")
    for name, o in (("o_a", o_a), ("o_b", o_b)):
        check_finite(o, name)
    for name, lse_x in (("lse_a", lse_a), ("lse_b", lse_b)):
        check_finite(lse_x, name, allow_neg_inf=True)  # -inf: an empty key set
    lse = torch.logaddexp(lse_a, lse_b)
    safe = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    w_a, w_b = (lse_a - safe).exp().unsqueeze(-1), (lse_b - safe).exp().unsqueeze(-1)
    return w_a * o_a + w_b * o_b, lse


@implements("03.13")
def tiled_attention_forward(
    q: Float[Tensor, "B *H T_q D"], k: Float[Tensor, "B *H T_k D"], v: Float[Tensor, "B *H T_k D_v"],
    causal: bool = False, scale: float | None = None, block_q: int = 64, block_k: int = 64,
) -> tuple[Float[Tensor, "B *H T_q D_v"], Float[Tensor, "B *H T_q"]]:
    r"""FlashAttention forward: tiles of queries against tiles of keys with an online softmax.

    For each query tile, over key tiles :math:`j` with scores :math:`S^{(j)} = Q_i K_j^\top/\sqrt{d_k}`:

    .. math:: m_i^{new} = \max(m_i, \mathrm{rowmax}\, S^{(j)}), \quad
        l_i \leftarrow e^{m_i - m_i^{new}} l_i + \mathrm{rowsum}\, e^{S^{(j)} - m_i^{new}}, \quad
        \tilde o_i \leftarrow e^{m_i - m_i^{new}} \tilde o_i + e^{S^{(j)} - m_i^{new}} V_j

    and at the end :math:`o_i = \tilde o_i / l_i`, :math:`L_i = m_i + \log l_i`. This is the online
    softmax update of the catalogue (03.13, 03.14) with the division postponed to the end (the
    form of FlashAttention-2). ``scale``, when given, replaces :math:`1/\sqrt{d_k}`. With ``causal``,
    tiles entirely above the diagonal are skipped and only diagonal tiles are masked. ``T`` need not
    be a multiple of the block sizes. Returns ``(o, lse)``.

    For speed on a CPU the heads form one batch axis (one batched matmul per tile), the tile of scores
    is turned into the tile of weights in place, and :math:`e^{m_i - m_i^{new}} \tilde o_i + P V_j` is
    one ``baddbmm_``; the arithmetic is the same as above up to float rounding.

    >>> q = k = v = torch.eye(3).unsqueeze(0)
    >>> o, lse = tiled_attention_forward(q, k, v, causal=True, block_q=2, block_k=2)
    >>> torch.allclose(o, naive_attention(q, k, v, causal=True)[0])
    True
    """
    q4, k4, v4, squeeze, scale, acc = _prepare(q, k, v, scale, block_q, block_k)
    B, H, T_q, D = q4.shape
    T_k, D_v = k4.shape[2], v4.shape[-1]
    off = T_k - T_q  # query i sits at key position i + off
    no_key_rows = causal and off < 0  # only then can a row have seen no key yet (running max -inf)
    dev = q4.device
    # heads are independent: one batch axis of B * H; K^T once, so that each tile is one batched matmul
    q3, v3 = q4.reshape(B * H, T_q, D), v4.reshape(B * H, T_k, D_v).to(acc)
    k3_t = k4.reshape(B * H, T_k, D).to(acc).transpose(-1, -2)
    o = q4.new_empty(B * H, T_q, D_v)
    lse = torch.empty(B * H, T_q, dtype=acc, device=dev)
    for qs in range(0, T_q, block_q):
        qe = min(qs + block_q, T_q)
        q_i = q3[:, qs:qe].to(acc) * scale
        m_i = torch.full((B * H, qe - qs, 1), NEG_INF, dtype=acc, device=dev)
        l_i = torch.zeros(B * H, qe - qs, 1, dtype=acc, device=dev)
        o_i = torch.zeros(B * H, qe - qs, D_v, dtype=acc, device=dev)
        k_end = min(T_k, qe + off) if causal else T_k  # the tile's last query sees keys < qe + off
        for ks in range(0, max(k_end, 0), block_k):
            ke = min(ks + block_k, k_end)
            s = q_i @ k3_t[:, :, ks:ke]
            if causal and ke - 1 > qs + off:  # the tile crosses the diagonal
                rows = torch.arange(qs, qe, device=dev).unsqueeze(-1) + off
                s.masked_fill_(torch.arange(ks, ke, device=dev) > rows, NEG_INF)
            m_new = torch.maximum(m_i, s.amax(-1, keepdim=True))
            m_safe = m_new.nan_to_num(neginf=0.0) if no_key_rows else m_new  # exp(-inf - 0) = 0
            p = s.sub_(m_safe).exp_()  # in place: the tile of scores becomes the tile of weights
            alpha = (m_i - m_safe).exp_()  # rescales what was accumulated under the old maximum
            l_i.mul_(alpha).add_(p.sum(-1, keepdim=True))
            o_i.mul_(alpha).baddbmm_(p, v3[:, ks:ke])
            m_i = m_new
        lse[:, qs:qe] = (m_i + l_i.log()).squeeze(-1)  # -inf for a row that saw no key
        o[:, qs:qe] = o_i.div_(torch.where(l_i > 0, l_i, 1.0)).to(o.dtype)
    o, lse = o.reshape(B, H, T_q, D_v), lse.reshape(B, H, T_q)
    return (o.squeeze(1), lse.squeeze(1)) if squeeze else (o, lse)


def tiled_attention_backward(
    q: Float[Tensor, "B *H T_q D"], k: Float[Tensor, "B *H T_k D"], v: Float[Tensor, "B *H T_k D_v"],
    o: Float[Tensor, "B *H T_q D_v"], lse: Float[Tensor, "B *H T_q"], do: Float[Tensor, "B *H T_q D_v"],
    causal: bool = False, scale: float | None = None, block_q: int = 64, block_k: int = 64,
) -> tuple[Tensor, Tensor, Tensor]:
    r"""FlashAttention backward: gradients of ``q, k, v`` from tiles recomputed with the saved ``lse``.

    With :math:`P = e^{S - L}` recomputed tile by tile and :math:`\delta_i = \sum_d dO_{id} O_{id}`:

    .. math:: dV_j = \sum_i P_{ij}^\top dO_i, \quad dP = dO\, V^\top, \quad
        dS = P \odot (dP - \delta), \quad dQ = dS\, K/\sqrt{d_k}, \quad dK = dS^\top Q/\sqrt{d_k}

    (``scale``, when given, replaces :math:`1/\sqrt{d_k}`). The outer loop runs over key tiles (their
    ``dK, dV`` stay local), the inner over query tiles (``dQ`` is accumulated). Memory stays
    :math:`O(T)` plus one tile. Returns ``(dq, dk, dv)``.
    """
    q4, k4, v4, squeeze, scale, acc = _prepare(q, k, v, scale, block_q, block_k)
    B, H, T_q, _ = q4.shape
    T_k = k4.shape[2]
    o4, do4, lse4 = (o.unsqueeze(1), do.unsqueeze(1), lse.unsqueeze(1)) if squeeze else (o, do, lse)
    if o4.shape != (B, H, T_q, v4.shape[-1]) or do4.shape != o4.shape or lse4.shape != (B, H, T_q):
        raise ValueError(f"o and do must have shape {tuple(q.shape[:-1]) + (v.shape[-1],)} and lse "
                         f"{tuple(q.shape[:-1])}, got {tuple(o.shape)}, {tuple(do.shape)}, {tuple(lse.shape)}")
    off = T_k - T_q
    delta = (do4.to(acc) * o4.to(acc)).sum(-1)  # (B, H, T_q)
    lse_safe = torch.where(torch.isinf(lse4), torch.full_like(lse4, float("inf")), lse4).to(acc)
    dev = q4.device
    dq = torch.zeros(B, H, T_q, q4.shape[-1], dtype=acc, device=dev)
    dk, dv = torch.zeros(k4.shape, dtype=acc, device=dev), torch.zeros(v4.shape, dtype=acc, device=dev)
    for ks in range(0, T_k, block_k):
        ke = min(ks + block_k, T_k)
        k_j, v_j = k4[:, :, ks:ke].to(acc), v4[:, :, ks:ke].to(acc)
        dk_j, dv_j = torch.zeros_like(k_j), torch.zeros_like(v_j)
        q_start = max(0, ks - off) if causal else 0  # earlier queries cannot see this key tile
        for qs in range(q_start, T_q, block_q):
            qe = min(qs + block_q, T_q)
            q_i, do_i = q4[:, :, qs:qe].to(acc), do4[:, :, qs:qe].to(acc)
            s = (q_i * scale) @ k_j.transpose(-1, -2)
            if causal and ke - 1 > qs + off:
                rows = torch.arange(qs, qe, device=dev).unsqueeze(-1) + off
                s = s.masked_fill(torch.arange(ks, ke, device=dev) > rows, NEG_INF)
            p = (s - lse_safe[:, :, qs:qe].unsqueeze(-1)).exp()
            dv_j += p.transpose(-1, -2) @ do_i
            ds = p * (do_i @ v_j.transpose(-1, -2) - delta[:, :, qs:qe].unsqueeze(-1))
            dq[:, :, qs:qe] += (ds @ k_j) * scale
            dk_j += (ds.transpose(-1, -2) @ q_i) * scale
        dk[:, :, ks:ke], dv[:, :, ks:ke] = dk_j, dv_j
    dq, dk, dv = dq.to(q4.dtype), dk.to(k4.dtype), dv.to(v4.dtype)
    return (dq.squeeze(1), dk.squeeze(1), dv.squeeze(1)) if squeeze else (dq, dk, dv)


class TiledAttention(torch.autograd.Function):
    """Differentiable tiled attention: saves ``q, k, v``, the output and the per-row log-sum-exp only.

    ``TiledAttention.apply(q, k, v, causal, scale, block_q, block_k) -> o``. No ``T x T`` tensor is
    kept for the backward pass, which recomputes the tiles (:func:`tiled_attention_backward`).
    """

    @staticmethod
    def forward(ctx, q, k, v, causal=False, scale=None, block_q=64, block_k=64):
        o, lse = tiled_attention_forward(q, k, v, causal, scale, block_q, block_k)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.config = (causal, scale, block_q, block_k)
        return o

    @staticmethod
    @once_differentiable
    def backward(ctx, do):
        q, k, v, o, lse = ctx.saved_tensors
        dq, dk, dv = tiled_attention_backward(q, k, v, o, lse, do.contiguous(), *ctx.config)
        return dq, dk, dv, None, None, None, None


def tiled_attention(
    q: Float[Tensor, "B *H T_q D"], k: Float[Tensor, "B *H T_k D"], v: Float[Tensor, "B *H T_k D_v"],
    causal: bool = False, scale: float | None = None, block_q: int = 64, block_k: int = 64,
) -> Float[Tensor, "B *H T_q D_v"]:
    """Tiled (FlashAttention) attention output, differentiable through :class:`TiledAttention`.

    >>> q = torch.randn(1, 2, 70, 8, requires_grad=True)
    >>> tiled_attention(q, q, q, causal=True).sum().backward()
    >>> q.grad.shape
    torch.Size([1, 2, 70, 8])
    """
    return TiledAttention.apply(q, k, v, causal, scale, block_q, block_k)


def _tensors(x):
    """The tensors in an operator's arguments or results (nested lists, tuples and dicts)."""
    if isinstance(x, Tensor):
        yield x
    elif isinstance(x, (list, tuple)):
        for y in x:
            yield from _tensors(y)
    elif isinstance(x, dict):
        for y in x.values():
            yield from _tensors(y)


class _LiveTensorBytes(TorchDispatchMode):
    """Counts the bytes of every tensor storage an ATen op allocates, until it is freed."""

    def __init__(self):
        super().__init__()
        self.live = self.peak = 0

    def _free(self, nbytes: int) -> None:
        self.live -= nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {id(t.untyped_storage()) for t in _tensors((args, kwargs))}
        for t in _tensors(out):
            st = t.untyped_storage()
            if id(st) not in inputs and not getattr(st, "_llmbook_counted", False):
                st._llmbook_counted = True
                self.live += st.nbytes()
                self.peak = max(self.peak, self.live)
                weakref.finalize(st, self._free, st.nbytes())
        return out


def peak_tensor_bytes(fn, *args, **kwargs) -> tuple[object, int]:
    """Run ``fn(*args, **kwargs)`` and return ``(result, peak bytes of tensors it allocated)``.

    The accounting is PyTorch's own dispatcher: every tensor an operator returns is counted from its
    allocation until its storage is freed, so the number is exact and the same on every machine.
    Scratch memory inside a kernel (never a tensor) and tensors allocated before the call are not
    counted. ``tracemalloc`` cannot see these allocations: they bypass Python's allocator.

    >>> _, peak = peak_tensor_bytes(lambda: torch.zeros(1000, dtype=torch.float32).sum())
    >>> peak  # the 4000-byte buffer and the 4-byte sum
    4004
    """
    mode = _LiveTensorBytes()
    with mode:
        result = fn(*args, **kwargs)
    return result, mode.peak
