r"""Attention (chapter 3): scaled dot-product, causal masking, multi-head, cross, MQA and GQA.

Shapes use the book's symbols: ``B`` batch, ``H`` query heads, ``H_kv`` key/value heads, ``T_q``
queries, ``T_k`` keys, ``D`` (or ``d_k``) head width. Tensors are batch-first, heads before time:
``(B, H, T, D)``; a tensor without a head axis, ``(B, T, D)``, is one head.

Masks follow :func:`torch.nn.functional.scaled_dot_product_attention`: a boolean ``True`` means
*may attend*; a floating mask is *added* to the scores (``-inf`` blocks). Note that
:class:`torch.nn.MultiheadAttention` uses the opposite boolean convention (``True`` = blocked).

Causal masking with ``T_q != T_k`` has two conventions, both available as ``alignment`` /
``causal_alignment``:

* ``"bottom_right"`` (the default here, as FlashAttention-2 and a KV cache need): the *last* query is
  aligned with the *last* key; query ``i`` sits at position ``i + T_k - T_q`` and sees keys
  ``j <= i + T_k - T_q`` (``torch.nn.attention.bias.causal_lower_right``);
* ``"top_left"`` (what ``F.scaled_dot_product_attention(is_causal=True)`` does): the *first* query is
  aligned with the first key and query ``i`` sees keys ``j <= i``.

With ``T_q == T_k`` they coincide. A query that may see no key at all gets an all-zero output and
all-zero weights, as PyTorch's reference implementation does.

Sliding-window and sparse patterns live in :mod:`llmbook.lm.local_attention`; kernelised and
approximate attention in :mod:`llmbook.lm.efficient_attention`; the tiled (FlashAttention) form
in :mod:`llmbook.lm.flash`.
"""

from __future__ import annotations

import math

import torch
from jaxtyping import Bool, Float
from torch import Tensor, nn

from llmbook._checks import (
    as_tensor,
    check_broadcastable_to,
    check_divisible,
    check_finite,
    check_floating,
    check_module_input,
    check_positive_int,
    check_range,
    flatten_leading,
)
from llmbook._precision import restore_half, upcast_half
from llmbook.lm.rope import apply_rope, check_rope_layout
from llmbook.registry import implements

__all__ = [
    "check_attention_inputs",
    "attention_scale",
    "causal_mask",
    "masked_softmax",
    "repeat_kv",
    "scaled_dot_product_attention",
    "softmax_jacobian",
    "MultiHeadAttention",
    "CrossAttention",
    "GroupedQueryAttention",
    "MultiQueryAttention",
]

NEG_INF = float("-inf")


def check_attention_inputs(q, k, v, *, allow_gqa: bool = True) -> tuple[Tensor, Tensor, Tensor, bool]:
    """Validate ``q, k, v`` and return them as ``(B, H, T, D)`` tensors plus whether a head axis was added.

    Contract: ``q (B, H, T_q, D)``, ``k (B, H_kv, T_k, D)``, ``v (B, H_kv, T_k, D_v)`` with ``H`` a
    multiple of ``H_kv`` (``H_kv == H`` when ``allow_gqa`` is false); or all three ``(B, T, D)``.
    Same floating dtype, no empty axis, no NaN or infinity.
    """
    q, k, v = (as_tensor(x, n) for x, n in ((q, "q"), (k, "k"), (v, "v")))
    if not q.ndim == k.ndim == v.ndim or q.ndim not in (3, 4):
        raise ValueError(f"q, k, v must all have shape (B, H, T, D) or all (B, T, D), got "
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if not q.dtype == k.dtype == v.dtype:
        raise TypeError(f"q, k, v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    for x, n in ((q, "q"), (k, "k"), (v, "v")):
        if x.numel() == 0:
            raise ValueError(f"{n} must not be empty, got shape {tuple(x.shape)}")
        if not torch.isfinite(x.sum()):  # one fast pass: a NaN or inf makes the sum NaN or inf
            check_finite(x, n)  # the exact test and its message (a finite sum that overflowed passes)
    squeeze = q.ndim == 3
    if squeeze:
        q, k, v = q.unsqueeze(1), k.unsqueeze(1), v.unsqueeze(1)
    (B, H, _, D), (Bk, H_kv, T_k, Dk), (Bv, H_v, T_v, _) = q.shape, k.shape, v.shape
    if not B == Bk == Bv:
        raise ValueError(f"q, k, v must share the batch size B, got {B}, {Bk}, {Bv}")
    if D != Dk:
        raise ValueError(f"q and k must share the head width D (d_k), got {D} and {Dk}")
    if (H_kv, T_k) != (H_v, T_v):
        raise ValueError(f"k (B, H_kv, T_k, D) {tuple(k.shape)} and v (B, H_kv, T_k, D_v) {tuple(v.shape)} "
                         "must agree on H_kv and T_k")
    if H % H_kv or (not allow_gqa and H != H_kv):
        need = "equal H" if not allow_gqa else "divide H"
        raise ValueError(f"the key/value heads H_kv ({H_kv}) must {need} (the query heads, H = {H})")
    return q, k, v, squeeze


def attention_scale(scale, D: int) -> float:
    """The score scale: ``1/sqrt(D)`` when ``scale`` is None, else ``scale`` (a positive finite number)."""
    if scale is None:
        return 1.0 / math.sqrt(D)
    return float(check_range(scale, "scale", 0.0, low_open=True))


CAUSAL_ALIGNMENTS = ("bottom_right", "top_left")


def _check_alignment(alignment: str) -> None:
    if alignment not in CAUSAL_ALIGNMENTS:
        raise ValueError(f"the causal alignment must be 'bottom_right' (last query sees the last key, "
                         f"FlashAttention-2) or 'top_left' (query i sees keys j <= i, torch's is_causal), "
                         f"got {alignment!r}")


def causal_mask(T_q: int, T_k: int | None = None, device=None, alignment: str = "bottom_right"
                ) -> Bool[Tensor, "T_q T_k"]:
    r"""Boolean causal mask, ``True`` where query ``i`` may attend to key ``j``: :math:`j \le i + T_k - T_q`.

    The catalogue writes it additively, :math:`M_{ij} = 0` for :math:`j \le i` and :math:`-\infty`
    otherwise. When ``T_q != T_k`` the ``alignment`` decides which query and key share a position:
    ``"bottom_right"`` (default; FlashAttention-2, a KV cache) aligns the last query with the last key,
    :math:`j \le i + T_k - T_q`; ``"top_left"`` (``F.scaled_dot_product_attention(is_causal=True)``)
    aligns the first ones, :math:`j \le i`. The two agree when ``T_q == T_k``.

    >>> causal_mask(3).int()
    tensor([[1, 0, 0],
            [1, 1, 0],
            [1, 1, 1]], dtype=torch.int32)
    >>> causal_mask(1, 3).int()  # one new token sees the whole cache
    tensor([[1, 1, 1]], dtype=torch.int32)
    >>> causal_mask(1, 3, alignment="top_left").int()  # the first query sees the first key only
    tensor([[1, 0, 0]], dtype=torch.int32)
    """
    T_k = T_q if T_k is None else T_k
    T_q, T_k = check_positive_int(T_q, "T_q"), check_positive_int(T_k, "T_k")
    _check_alignment(alignment)
    i = torch.arange(T_q, device=device).unsqueeze(-1)
    j = torch.arange(T_k, device=device)
    return j <= i + (T_k - T_q if alignment == "bottom_right" else 0)


def masked_softmax(scores: Float[Tensor, "... T_k"], allowed: Bool[Tensor, "... T_k"] | None = None
                   ) -> Float[Tensor, "... T_k"]:
    r"""Softmax over the last axis restricted to ``allowed`` entries; a row with none allowed is all zeros.

    Masking happens *before* the softmax (blocked scores become :math:`-\infty`), so blocked keys get
    exactly zero weight and the rest are renormalised among themselves. ``scores`` is a floating
    tensor ``(..., T_k)``; ``allowed`` a bool tensor that broadcasts *to* its shape (``True`` = keep).
    fp16 / bf16 scores are exponentiated and summed in float32 and the weights returned in their dtype.

    >>> masked_softmax(torch.tensor([[0.0, 0.0, 5.0]]), torch.tensor([[True, True, False]]))
    tensor([[0.5000, 0.5000, 0.0000]])
    """
    check_floating(scores, "scores")
    if scores.ndim < 1:
        raise ValueError("scores must have shape (..., T_k), got a 0-d tensor")
    dtype, scores = scores.dtype, upcast_half(scores)
    if allowed is not None:
        if not isinstance(allowed, Tensor) or allowed.dtype != torch.bool:
            raise TypeError(f"allowed must be a bool tensor (True = may attend), got "
                            f"{allowed.dtype if isinstance(allowed, Tensor) else type(allowed).__name__}")
        check_broadcastable_to(allowed, scores.shape, "allowed", "the scores")
        scores = scores.masked_fill(~allowed, NEG_INF)
    if scores.shape[-1] == 0:  # T_k = 0: no key to weight, each row is empty (as torch.softmax gives)
        return restore_half(torch.zeros_like(scores), dtype)
    m = scores.amax(-1, keepdim=True)
    m = torch.where(torch.isinf(m), torch.zeros_like(m), m)  # fully masked row: avoid -inf - -inf
    e = (scores - m).exp()
    den = e.sum(-1, keepdim=True)
    return restore_half(e / torch.where(den > 0, den, torch.ones_like(den)), dtype)


def repeat_kv(x: Float[Tensor, "B H_kv T D"], n_rep: int) -> Float[Tensor, "B H T D"]:
    """Repeat each key/value head ``n_rep`` times: head ``h`` of the result is head ``h // n_rep`` of ``x``.

    This is the group map :math:`g(h) = \\lfloor h / (H / H_kv) \\rfloor` of grouped-query attention.

    >>> repeat_kv(torch.tensor([[[[1.0]], [[2.0]]]]), 2).flatten().tolist()
    [1.0, 1.0, 2.0, 2.0]
    """
    x = as_tensor(x, "x")
    n_rep = check_positive_int(n_rep, "n_rep")
    if x.ndim != 4:
        raise ValueError(f"x must have shape (B, H_kv, T, D), got {tuple(x.shape)}")
    return x.repeat_interleave(n_rep, dim=1)


def _mask_tensor(mask, shape: tuple[int, ...], squeeze: bool) -> Tensor:
    """A user mask as a 4-D tensor broadcastable to ``shape = (B, H, T_q, T_k)``."""
    if not isinstance(mask, Tensor):
        raise TypeError(f"mask must be a tensor (bool: True = attend, or float: added to the scores), "
                        f"got {type(mask).__name__}")
    if mask.dtype != torch.bool and not mask.is_floating_point():
        raise TypeError(f"mask must be bool (True = attend) or floating (additive), got dtype {mask.dtype}")
    if squeeze and mask.ndim == 3:  # (B, T_q, T_k) for head-less inputs
        mask = mask.unsqueeze(1)
    check_broadcastable_to(mask, shape, "mask", "the scores (B, H, T_q, T_k) =")
    if mask.is_floating_point() and (torch.isnan(mask).any() or torch.isposinf(mask).any()):
        raise ValueError("a floating mask must not contain NaN or +inf (use -inf to block)")
    return mask


@implements("03.01", "03.02")
def scaled_dot_product_attention(
    q: Float[Tensor, "B *H T_q D"],
    k: Float[Tensor, "B *H_kv T_k D"],
    v: Float[Tensor, "B *H_kv T_k D_v"],
    mask: Tensor | None = None,
    is_causal: bool = False,
    scale: float | None = None,
    return_weights: bool = False,
    dropout_p: float = 0.0,
    generator: torch.Generator | None = None,
    causal_alignment: str = "bottom_right",
):
    r"""Scaled dot-product attention, optionally causal.

    .. math:: \mathrm{Attention}(Q, K, V) = \mathrm{softmax}\!\Big(\frac{QK^\top}{\sqrt{d_k}} + M\Big) V

    ``q, k, v`` are :math:`Q, K, V`; ``scale`` is :math:`1/\sqrt{d_k}` by default. :math:`M` collects
    the masks: ``mask`` (bool, ``True`` = attend; or float, added) and, with ``is_causal``, the causal
    mask :math:`M_{ij} = -\infty` for :math:`j > i` (both masks may be given, and a key must pass both).
    When ``T_q != T_k``, ``causal_alignment`` places the causal diagonal: ``"bottom_right"`` (default,
    FlashAttention-2, decoding with a KV cache: query ``i`` sees keys ``j <= i + T_k - T_q``) or
    ``"top_left"`` (``F.scaled_dot_product_attention(is_causal=True)``: ``j <= i``); see
    :func:`causal_mask`. Masking happens before the softmax.

    Shapes: ``q (B, H, T_q, D)``, ``k (B, H_kv, T_k, D)``, ``v (B, H_kv, T_k, D_v) -> (B, H, T_q, D_v)``;
    with ``H_kv < H`` query head ``h`` uses key/value head ``h // (H / H_kv)`` (grouped-query
    attention), computed without copying ``k`` and ``v``. fp16 / bf16 inputs are computed in float32
    (scores, softmax and the weighted sum: :math:`QK^\top` overflows fp16 once :math:`|q||k| > 65504`)
    and the output is returned in their dtype, as torch does. Head-less ``(B, T, D)`` inputs work too.
    ``return_weights=True`` also returns the weights ``(B, H, T_q, T_k)``. ``dropout_p`` drops weights
    (training only; the kept ones are scaled by ``1/(1 - dropout_p)``).

    >>> q = k = torch.eye(2).unsqueeze(0)  # (B, T, D) = (1, 2, 2)
    >>> v = torch.tensor([[[1.0, 0.0], [0.0, 1.0]]])
    >>> scaled_dot_product_attention(q, k, v, is_causal=True)
    tensor([[[1.0000, 0.0000],
             [0.3302, 0.6698]]])
    """
    q, k, v, squeeze = check_attention_inputs(q, k, v)
    B, H, T_q, D = q.shape
    scale = attention_scale(scale, D)
    check_range(dropout_p, "dropout_p", 0.0, 1.0, high_open=True)
    _check_alignment(causal_alignment)
    if mask is not None:
        mask = _mask_tensor(mask, (B, H, T_q, k.shape[2]), squeeze)
    out, weights = attend(q, k, v, mask, is_causal, scale, dropout_p, generator, causal_alignment)
    if squeeze:
        out, weights = out.squeeze(1), weights.squeeze(1)
    return (out, weights) if return_weights else out


def attend(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, is_causal: bool, scale: float,
           dropout_p: float = 0.0, generator: torch.Generator | None = None,
           causal_alignment: str = "bottom_right") -> tuple[Tensor, Tensor]:
    """The computation of :func:`scaled_dot_product_attention` on inputs it has already validated.

    ``q (B, H, T_q, D)``, ``k, v (B, H_kv, T_k, D)``, ``mask`` a 4-D bool or additive mask (or ``None``);
    returns ``(out, weights)``. No checks: for inner loops (the KV-cache decoder) whose inputs the model
    produced, where scanning every cached key for NaN at every step would cost more than the attention.
    """
    B, H, T_q, D = q.shape
    H_kv, T_k = k.shape[1], k.shape[2]
    G = H // H_kv  # query heads per key/value head
    dtype = q.dtype
    q, k, v = upcast_half(q), upcast_half(k), upcast_half(v)
    # (B, H_kv, G, T_q, D) @ (B, H_kv, 1, D, T_k): each group shares its key head, no copy
    scores = (q.view(B, H_kv, G, T_q, D) @ k.unsqueeze(2).transpose(-1, -2) * scale).view(B, H, T_q, T_k)
    allowed = None
    if mask is not None:
        if mask.dtype == torch.bool:
            allowed = mask
        else:
            scores = scores + mask.to(scores.dtype)
    if is_causal:
        c = causal_mask(T_q, T_k, device=q.device, alignment=causal_alignment)
        allowed = c if allowed is None else allowed & c
    weights = masked_softmax(scores, allowed)
    used = weights
    if dropout_p > 0:
        keep = torch.rand(weights.shape, generator=generator, dtype=weights.dtype, device=weights.device) >= dropout_p
        used = weights * keep / (1.0 - dropout_p)
    out = (used.view(B, H_kv, G, T_q, T_k) @ v.unsqueeze(2)).view(B, H, T_q, v.shape[-1])
    return restore_half(out, dtype), restore_half(weights, dtype)


def softmax_jacobian(a: Float[Tensor, "... N"]) -> Float[Tensor, "... N N"]:
    r"""Softmax Jacobian at probabilities ``a``: :math:`J = \partial a / \partial z = \mathrm{diag}(a) - a a^\top`.

    Symmetric, with :math:`J\mathbf{1} = 0` (shifting every score changes nothing). When ``a`` is
    one-hot (a saturated softmax) it is the zero matrix: no gradient flows back to the scores.

    >>> softmax_jacobian(torch.tensor([0.5, 0.5]))
    tensor([[ 0.2500, -0.2500],
            [-0.2500,  0.2500]])
    """
    a = as_tensor(a, "a")
    if a.ndim < 1 or a.shape[-1] == 0:
        raise ValueError(f"a must have shape (..., N) with N > 0, got {tuple(a.shape)}")
    return torch.diag_embed(a) - a.unsqueeze(-1) * a.unsqueeze(-2)


@implements("03.03")
class MultiHeadAttention(nn.Module):
    r"""Multi-head attention with optional grouped key/value heads, cross-attention and RoPE.

    .. math:: \mathrm{MHA}(X) = \mathrm{Concat}(\mathrm{head}_1, \dots, \mathrm{head}_H) W^O, \quad
        \mathrm{head}_h = \mathrm{Attention}(X W_h^Q, X W_{g(h)}^K, X W_{g(h)}^V)

    ``d_model`` is :math:`C`, ``n_heads`` :math:`H`, ``n_kv_heads`` :math:`H_{kv}` (default ``H``:
    :math:`g(h) = h`). Each head has width :math:`D = C / H`. The projections ``q_proj (C -> H D)``,
    ``k_proj, v_proj (C -> H_kv D)`` and ``o_proj (H D -> C)`` are named as in Llama so that weights
    copy over from ``transformers``. ``W_h^Q`` is rows ``h D .. (h+1) D`` of ``q_proj.weight``.

    ``forward(x, context=None, mask=None, is_causal=False, rope=None, causal_alignment="bottom_right")``:
    ``x (B, T, C) -> (B, T, C)``, or any leading axes, ``(..., T, C) -> (..., T, C)`` (none, as in
    ``(T, C)``, or several: they are flattened into one batch axis ``B`` for the computation, and a
    per-sequence ``mask`` or RoPE table refers to that ``B``). ``context (B, S, C)`` (the leading axes of
    ``x``) makes it cross-attention (keys and values from
    ``context``). ``mask`` is broadcastable to ``(B, H, T, S)`` with ``True`` = attend;
    ``causal_alignment`` places the causal diagonal when ``T != S`` (see :func:`causal_mask`).
    ``rope = (cos, sin)`` from :func:`llmbook.lm.rope.rope_cos_sin`, each ``(T, D)`` or ``(1, T, D)``
    (positions shared by the batch), ``(B, T, D)`` (one row of positions per sequence), or the same with a
    head axis of 1, ``(B | 1, 1, T, D)``; lists are accepted. It rotates queries and keys after the head
    split with :func:`llmbook.lm.rope.apply_rope`. ``rope_layout`` says which
    channels of a head form a rotated pair: ``"half"`` (default; ``(j, j + D/2)``, Hugging Face Llama) or
    ``"interleaved"`` (``(2j, 2j+1)``, the RoFormer paper and Meta's Llama code). It must match the
    checkpoint's ``q_proj``/``k_proj`` rows; :func:`llmbook.lm.rope.interleaved_to_half_weight`
    converts them.

    >>> mha = MultiHeadAttention(d_model=8, n_heads=2)
    >>> mha(torch.zeros(3, 5, 8), is_causal=True).shape
    torch.Size([3, 5, 8])
    """

    def __init__(self, d_model: int, n_heads: int, n_kv_heads: int | None = None, bias: bool = False,
                 dropout: float = 0.0, rope_layout: str = "half"):
        super().__init__()
        self.rope_layout = check_rope_layout(rope_layout)
        n_kv_heads = n_heads if n_kv_heads is None else n_kv_heads
        d_model, n_heads, n_kv_heads = (check_positive_int(x, name) for name, x in
                                        (("d_model", d_model), ("n_heads", n_heads), ("n_kv_heads", n_kv_heads)))
        check_divisible(d_model, n_heads, "d_model", "n_heads")
        check_divisible(n_heads, n_kv_heads, "n_heads", "n_kv_heads")
        check_range(dropout, "dropout", 0.0, 1.0, high_open=True)
        self.d_model, self.n_heads, self.n_kv_heads = d_model, n_heads, n_kv_heads
        self.head_dim = d_model // n_heads
        self.dropout = dropout
        self.q_proj = nn.Linear(d_model, n_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(d_model, n_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(d_model, n_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(n_heads * self.head_dim, d_model, bias=bias)

    def _heads(self, x: Tensor, n: int) -> Tensor:
        B, T, _ = x.shape
        return x.view(B, T, n, self.head_dim).transpose(1, 2)  # (B, n, T, D)

    def _rope_tables(self, rope, B: int, T: int) -> tuple[Tensor, Tensor]:
        """``rope = (cos, sin)`` as tensors, each broadcastable to the heads ``(B, H, T, D)``.

        Accepted, as :func:`~llmbook.lm.rope.apply_rope` broadcasts them: ``(T, D)``, ``(B | 1, T, D)`` and
        ``(B | 1, 1, T, D)`` (one table for every head, so it also fits GQA's fewer key heads).
        """
        if not isinstance(rope, (tuple, list)) or len(rope) != 2:
            raise TypeError(f"rope must be a pair (cos, sin), got {type(rope).__name__}")
        cos, sin = as_tensor(rope[0], "rope's cos"), as_tensor(rope[1], "rope's sin")
        D, s = self.head_dim, tuple(cos.shape)
        ok = (sin.shape == cos.shape and 2 <= cos.ndim <= 4 and s[-2:] == (T, D)
              and (cos.ndim < 3 or s[0] in (1, B)) and (cos.ndim < 4 or s[1] == 1))
        if not ok:
            raise ValueError(f"rope (cos, sin) must each have shape (T, D) = ({T}, {D}), (B, T, D) = ({B}, {T}, {D}) "
                             f"or (B, 1, T, D), with B = {B} or 1; got {tuple(cos.shape)} and {tuple(sin.shape)}")
        return cos, sin

    def _batched(self, x: Tensor, context: Tensor | None) -> tuple[Tensor, Tensor | None, tuple[int, ...]]:
        """``x (..., T, C)`` and ``context (..., S, C)`` (the same leading axes) as 3-D ``(B, T, C)`` tensors."""
        x = check_module_input(self, x, d=self.d_model, contract="(..., T, d_model)")
        if x.ndim < 2:
            raise ValueError(f"x must have shape (..., T, d_model), got {tuple(x.shape)}")
        if context is not None:
            check_module_input(self, context, "context", d=self.d_model, contract="(..., S, d_model)")
            if context.shape[:-2] != x.shape[:-2] or context.ndim != x.ndim:
                raise ValueError(f"context must have shape (..., S, d_model) with the leading axes of x "
                                 f"{tuple(x.shape[:-2])}, got {tuple(context.shape)}")
            context = flatten_leading(context, 2)[0]
        x, lead = flatten_leading(x, 2)
        return x, context, lead

    def _qkv(self, x: Tensor, context: Tensor | None, rope) -> tuple[Tensor, Tensor, Tensor]:
        """Validated 3-D inputs -> per-head ``q (B, H, T, D)``, ``k, v (B, H_kv, S, D)``, RoPE applied."""
        src = x if context is None else context
        q = self._heads(self.q_proj(x), self.n_heads)
        k = self._heads(self.k_proj(src), self.n_kv_heads)
        v = self._heads(self.v_proj(src), self.n_kv_heads)
        if rope is not None:
            if context is not None:
                raise ValueError("rope applies to self-attention only (queries and keys share positions); "
                                 "got rope together with a cross-attention context")
            cos, sin = self._rope_tables(rope, x.shape[0], x.shape[1])
            q, k = apply_rope(q, cos, sin, self.rope_layout), apply_rope(k, cos, sin, self.rope_layout)
        return q, k, v

    def attention_weights(self, x: Float[Tensor, "B T C"], context: Float[Tensor, "B S C"] | None = None,
                          mask: Tensor | None = None, is_causal: bool = False, rope=None,
                          causal_alignment: str = "bottom_right") -> Float[Tensor, "B H T S"]:
        """The attention weights :math:`A = \\mathrm{softmax}(QK^\\top/\\sqrt{D})` that ``forward`` uses.

        Same arguments as ``forward``; returns ``(B, H, T, S)`` (no dropout), for looking inside a model.

        >>> mha = MultiHeadAttention(8, n_heads=2)
        >>> mha.attention_weights(torch.zeros(1, 3, 8), is_causal=True)[0, 0]
        tensor([[1.0000, 0.0000, 0.0000],
                [0.5000, 0.5000, 0.0000],
                [0.3333, 0.3333, 0.3333]], grad_fn=<SelectBackward0>)
        """
        x, context, lead = self._batched(x, context)
        q, k, v = self._qkv(x, context, rope)
        _, w = scaled_dot_product_attention(q, k, v, mask=mask, is_causal=is_causal, return_weights=True,
                                            causal_alignment=causal_alignment)
        return w.reshape(*lead, *w.shape[1:]) if lead else w.squeeze(0)

    def forward(self, x: Float[Tensor, "B T C"], context: Float[Tensor, "B S C"] | None = None,
                mask: Tensor | None = None, is_causal: bool = False, rope=None,
                causal_alignment: str = "bottom_right") -> Float[Tensor, "B T C"]:
        x, context, lead = self._batched(x, context)
        q, k, v = self._qkv(x, context, rope)
        o = scaled_dot_product_attention(q, k, v, mask=mask, is_causal=is_causal,
                                         dropout_p=self.dropout if self.training else 0.0,
                                         causal_alignment=causal_alignment)
        B, _, T, _ = o.shape
        y = self.o_proj(o.transpose(1, 2).reshape(B, T, self.n_heads * self.head_dim))
        return y.reshape(*lead, T, self.d_model) if lead else y.squeeze(0)


@implements("03.04")
class CrossAttention(MultiHeadAttention):
    r"""Cross-attention: queries from ``x``, keys and values from another sequence ``context``.

    .. math:: \mathrm{CrossAttn}(Q_x, K_y, V_y) = \mathrm{softmax}\!\Big(\frac{Q_x K_y^\top}{\sqrt{d_k}}\Big) V_y

    ``forward(x (B, T, C), context (B, S, C), mask=None) -> (B, T, C)``. No causal mask: every query
    may read the whole context (an encoder's output, an image's patches, retrieved passages).

    >>> CrossAttention(8, 2)(torch.zeros(1, 3, 8), torch.zeros(1, 7, 8)).shape
    torch.Size([1, 3, 8])
    """

    def forward(self, x: Float[Tensor, "B T C"], context: Float[Tensor, "B S C"],  # type: ignore[override]
                mask: Tensor | None = None) -> Float[Tensor, "B T C"]:
        if context is None:
            raise ValueError("cross-attention needs a context (B, S, d_model) to attend to")
        return super().forward(x, context=context, mask=mask)


@implements("03.06")
class GroupedQueryAttention(MultiHeadAttention):
    r"""Grouped-query attention: ``n_heads`` query heads share ``n_kv_heads`` key/value heads in groups.

    .. math:: \mathrm{head}_h = \mathrm{Attention}(X W_h^Q, X W_{g(h)}^K, X W_{g(h)}^V), \quad
        g(h) = \lfloor h / (H / H_{kv}) \rfloor

    The KV cache shrinks by :math:`H / H_{kv}`; ``n_kv_heads = n_heads`` is multi-head attention,
    ``n_kv_heads = 1`` multi-query attention.

    >>> GroupedQueryAttention(16, n_heads=4, n_kv_heads=2).k_proj.weight.shape  # (H_kv D, C)
    torch.Size([8, 16])
    """

    def __init__(self, d_model: int, n_heads: int, n_kv_heads: int, bias: bool = False, dropout: float = 0.0,
                 rope_layout: str = "half"):
        super().__init__(d_model, n_heads, n_kv_heads, bias=bias, dropout=dropout, rope_layout=rope_layout)


@implements("03.05")
class MultiQueryAttention(GroupedQueryAttention):
    r"""Multi-query attention: every query head shares one key head and one value head.

    .. math:: \mathrm{head}_h = \mathrm{Attention}(X W_h^Q, X W^K, X W^V)

    >>> MultiQueryAttention(16, n_heads=4).v_proj.weight.shape  # one head of width D = 4
    torch.Size([4, 16])
    """

    def __init__(self, d_model: int, n_heads: int, bias: bool = False, dropout: float = 0.0,
                 rope_layout: str = "half"):
        super().__init__(d_model, n_heads, 1, bias=bias, dropout=dropout, rope_layout=rope_layout)
