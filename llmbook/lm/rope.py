r"""Rotary position embedding, RoPE (chapter 4): the half-split and interleaved layouts, three equal forms.

RoPE rotates each pair of query/key channels by an angle proportional to the position,
:math:`\theta_j m` with :math:`\theta_j = b^{-2j/D}`, so that the score of a query at ``m`` and a key
at ``n`` depends only on ``m - n`` (04.04). Symbols: ``T`` positions, ``D`` the rotated width (a head
width, even), ``H`` heads, ``m, n`` query and key positions.

RoPE pairs channels in one of two layouts, and the book keeps both:

* **interleaved** (the paper, Meta's reference code): pair ``j`` is channels ``(2j, 2j+1)``;
  :func:`rope_rotation_matrix` and :func:`apply_rope_complex` use it;
* **half-split** (Hugging Face Llama): pair ``j`` is channels ``(j, j + D/2)``; :func:`rope_cos_sin`,
  :func:`rotate_half` and :func:`apply_rope` use it, so that they match ``transformers`` bit for bit.

The two are the same rotation seen through the permutation :func:`interleaved_to_half`;
``apply_rope(..., layout="interleaved")`` rotates interleaved pairs with the same ``cos, sin`` tables.
A checkpoint's query/key projection weights carry the layout of the code that trained it; Hugging Face's
``convert_llama_weights_to_hf.py`` permutes Meta's rows per head, which is :func:`interleaved_to_half_weight`
(inverse :func:`half_to_interleaved_weight`). Positions may be shared, ``(T,)``, or per sequence, ``(B, T)``.
The other positional schemes are in :mod:`llmbook.lm.positions`, which re-exports these names.
"""

from __future__ import annotations

import math
from numbers import Real

import torch
from jaxtyping import Float
from torch import Tensor

from llmbook._checks import (
    as_tensor,
    check_batch_broadcast,
    check_dim,
    check_finite,
    check_int,
    check_nonnegative_int,
    check_positive_int,
    check_range,
    check_real,
    check_same_dtype,
)
from llmbook._precision import compute_dtype, restore_half, upcast_half
from llmbook.registry import implements

__all__ = [
    "rope_inv_freq",
    "rope_cos_sin",
    "rotate_half",
    "apply_rope",
    "rope_rotation_matrix",
    "apply_rope_matrix",
    "apply_rope_complex",
    "rope_relative_score",
    "interleaved_to_half",
    "half_to_interleaved",
    "interleaved_to_half_weight",
    "half_to_interleaved_weight",
    "rope_pair_energy",
    "ROPE_LAYOUTS",
    "check_rope_layout",
]


def _check_even(D: int, name: str = "D") -> None:
    what = "a positive even int: RoPE rotates channel pairs"
    if check_int(D, name, low=1, what=what) % 2:
        raise ValueError(f"{name} must be {what}, got {D}")


def _check_base(base: float) -> None:
    check_range(base, "base", 1.0, math.inf, low_open=True)


ROPE_LAYOUTS = ("half", "interleaved")


def check_rope_layout(layout: str) -> str:
    """Return ``layout`` if it names a RoPE channel pairing (``"half"`` or ``"interleaved"``), else raise."""
    if layout not in ROPE_LAYOUTS:
        raise ValueError(f"the RoPE layout must be 'half' (pairs (j, j + D/2), Hugging Face Llama) or "
                         f"'interleaved' (pairs (2j, 2j+1), the RoFormer paper and Meta's code), got {layout!r}")
    return layout


def _positions(positions, batched: bool = False) -> Tensor:
    """An int ``T`` means ``arange(T)``; otherwise a ``(T,)`` (or, if ``batched``, ``(B, T)``) tensor of positions."""
    shapes = "a 1-D tensor (T,) or a 2-D tensor (B, T)" if batched else "a 1-D tensor (T,)"
    if isinstance(positions, (Real, str, bytes)) or positions is None:  # a scalar: the number of positions T
        return torch.arange(check_nonnegative_int(positions, f"positions (an int T >= 0 or {shapes})"))
    p = as_tensor(positions, "positions", floating=False)
    if p.dtype == torch.bool or p.is_complex():
        raise TypeError(f"positions must be an int T or {shapes} of real positions, got dtype {p.dtype}")
    if p.ndim not in ((1, 2) if batched else (1,)):
        raise ValueError(f"positions must be an int T or {shapes}, got shape {tuple(p.shape)}")
    if p.is_floating_point():
        check_finite(p, "positions")
    return p


# --------------------------------------------------------------------------- RoPE: half-split (Llama) layout


def rope_inv_freq(D: int, base: float = 10000.0) -> Float[Tensor, " D2"]:
    r"""RoPE frequencies :math:`\theta_j = b^{-2j/D}` for :math:`j = 0,\dots,D/2-1` (float32).

    Computed exactly as ``transformers`` does (``1 / base ** (arange(0, D, 2) / D)`` in float32), so a
    model built from these parts reproduces Llama's numbers. Shape ``(D/2,)``.

    >>> rope_inv_freq(4, base=100.0)
    tensor([1.0000, 0.1000])
    """
    _check_even(D)
    _check_base(base)
    return 1.0 / (base ** (torch.arange(0, D, 2, dtype=torch.int64).float() / D))


def rope_cos_sin(positions, D: int, base: float = 10000.0, inv_freq: Tensor | None = None,
                 dtype: torch.dtype = torch.float32) -> tuple[Float[Tensor, "*B T D"], Float[Tensor, "*B T D"]]:
    r"""The cosines and sines of the angles :math:`m\theta_j`, in the half-split layout.

    ``positions`` is an int ``T`` (meaning ``arange(T)``), a ``(T,)`` tensor of positions ``m`` shared by
    every sequence, or a ``(B, T)`` tensor with one row of positions per sequence (left padding, packed
    sequences; Llama's ``position_ids``). Positions may be fractional, as after position interpolation.
    ``inv_freq`` overrides :func:`rope_inv_freq` (scaled frequencies from
    :mod:`llmbook.lm.context_extension`). The angles are formed in float32 like Llama's
    ``LlamaRotaryEmbedding`` (``cat([freqs, freqs], -1)``), then cast to ``dtype``; only
    ``dtype=torch.float64`` forms them in float64 (for checks at large positions).
    Each output has shape ``(T, D)``, or ``(B, T, D)`` for ``(B, T)`` positions. The same tables serve
    both layouts: :func:`apply_rope` reads them according to its ``layout``.

    >>> cos, sin = rope_cos_sin(3, 4)
    >>> cos.shape, sin[0].abs().max().item()
    (torch.Size([3, 4]), 0.0)
    >>> rope_cos_sin(torch.tensor([[0, 1, 2], [5, 6, 7]]), 4)[0].shape  # per-sequence positions
    torch.Size([2, 3, 4])
    """
    _check_even(D)
    if inv_freq is None:
        inv_freq = rope_inv_freq(D, base)
    else:
        inv_freq = as_tensor(inv_freq, "inv_freq")
        if inv_freq.shape != (D // 2,):
            raise ValueError(f"inv_freq must have shape (D/2,) = ({D // 2},), got {tuple(inv_freq.shape)}")
    m = _positions(positions, batched=True)
    work = torch.float64 if dtype == torch.float64 else torch.float32
    freqs = m[..., None].to(work) * inv_freq.to(work)  # (*B, T, D/2)
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def rotate_half(x: Float[Tensor, "... D"]) -> Float[Tensor, "... D"]:
    r"""``cat([-x2, x1])`` for ``x = cat([x1, x2])``: the 90° turn of every half-split pair :math:`(x_j, x_{j+D/2})`.

    >>> rotate_half(torch.tensor([1.0, 2.0, 3.0, 4.0]))
    tensor([-3., -4.,  1.,  2.])
    """
    if x.shape[-1] % 2:
        raise ValueError(f"the last dim of x ({x.shape[-1]}) must be even to split into halves")
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return torch.cat([-x2, x1], dim=-1)


@implements("04.03")
def apply_rope(x: Float[Tensor, "... T D"], cos: Float[Tensor, "*B T D"], sin: Float[Tensor, "*B T D"],
               layout: str = "half") -> Float[Tensor, "... T D"]:
    r"""Rotate every channel pair of ``x`` by its angle: ``x * cos + rotate_half(x) * sin`` (half-split).

    For pair :math:`j` at position :math:`m` this is the rotation :math:`R_{m\theta_j}` applied to
    :math:`(x_j, x_{j+D/2})` (``layout="half"``, Hugging Face Llama, the default) or to
    :math:`(x_{2j}, x_{2j+1})` (``layout="interleaved"``, the paper and Meta's code; computed by
    permuting the channels with :func:`interleaved_to_half` and back, so both layouts share one formula
    and the ``cos, sin`` tables of :func:`rope_cos_sin`). ``x`` is ``(..., T, D)``, typically
    ``(B, H, T, D)``. ``cos, sin`` are ``(T, D)`` (positions shared by the batch) or ``(B, T, D)``
    (positions per sequence; for a 4-D ``x`` a head axis is inserted, as ``apply_rotary_pos_emb``'s
    ``unsqueeze_dim=1``), or any shape with ``x``'s number of axes that broadcasts to it, e.g.
    ``(B, 1, T, D)``. With the half layout this is ``transformers``' ``apply_rotary_pos_emb``.

    >>> cos, sin = rope_cos_sin(1, 2)
    >>> apply_rope(torch.tensor([[1.0, 2.0]]), cos, sin)  # position 0: the identity
    tensor([[1., 2.]])
    """
    x, cos, sin = as_tensor(x, "x"), as_tensor(cos, "cos"), as_tensor(sin, "sin")
    check_dim(x, "x", "(..., T, D)", min_dim=2)
    check_rope_layout(layout)
    if x.shape[-1] != cos.shape[-1] or cos.shape != sin.shape:
        raise ValueError(f"x (..., T, D) = {tuple(x.shape)} needs cos and sin of width D; got cos "
                         f"{tuple(cos.shape)}, sin {tuple(sin.shape)}")
    given = tuple(cos.shape)
    if cos.ndim == 3 and x.ndim == 4:  # per-sequence tables (B, T, D) for (B, H, T, D): one per head too
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    try:
        fits = cos.ndim <= x.ndim and torch.broadcast_shapes(cos.shape, x.shape) == x.shape
    except RuntimeError:
        fits = False
    if not fits:
        raise ValueError(f"cos and sin {given} must be (T, D), (B, T, D) or broadcast to x "
                         f"{tuple(x.shape)} (batch, heads, T = {x.shape[-2]}, D = {x.shape[-1]})")
    if layout == "interleaved":
        return half_to_interleaved(apply_rope(interleaved_to_half(x), cos, sin))
    return x * cos + rotate_half(x) * sin


# --------------------------------------------------------------------------- RoPE: interleaved (paper) layout


def _angles(positions, D: int, base: float, inv_freq: Tensor | None, dtype: torch.dtype) -> Tensor:
    """``m * theta_j`` as a ``(T, D/2)`` tensor in ``dtype`` (float64 unless asked otherwise)."""
    _check_even(D)
    if inv_freq is None:
        _check_base(base)
        inv_freq = base ** (-torch.arange(0, D, 2, dtype=torch.float64) / D)
    elif tuple(inv_freq.shape) != (D // 2,):
        raise ValueError(f"inv_freq must have shape (D/2,) = ({D // 2},), got {tuple(inv_freq.shape)}")
    m = _positions(positions)
    return m.to(dtype)[:, None] * inv_freq.to(dtype)[None, :]


def rope_rotation_matrix(position: float, D: int, base: float = 10000.0, inv_freq: Tensor | None = None,
                         dtype: torch.dtype = torch.float64) -> Float[Tensor, "D D"]:
    r"""The block-diagonal RoPE matrix :math:`R_m` of the paper (interleaved pairs :math:`(2j, 2j+1)`).

    .. math:: R_m = \mathrm{diag}\big(R_{m\theta_0},\dots,R_{m\theta_{D/2-1}}\big),\qquad
              R_{m\theta_j} = \begin{pmatrix}\cos m\theta_j & -\sin m\theta_j\\
                                              \sin m\theta_j & \cos m\theta_j\end{pmatrix}

    ``position`` is :math:`m`, :math:`\theta_j = b^{-2j/D}` with ``base`` :math:`b` (or ``inv_freq``).
    Explicit and :math:`O(D^2)`: meant for reading and checking, not for models. Shape ``(D, D)``.

    >>> rope_rotation_matrix(0, 4).equal(torch.eye(4, dtype=torch.float64))
    True
    """
    position = check_real(position, "position")
    return _rotation_matrices(torch.tensor([position], dtype=torch.float64), D, base, inv_freq, dtype)[0]


def _rotation_matrices(positions, D: int, base: float, inv_freq: Tensor | None, dtype: torch.dtype) -> Tensor:
    """:math:`R_m` of every position, ``(T, D, D)`` in ``dtype`` (``T = 0`` gives an empty stack)."""
    a = _angles(positions, D, base, inv_freq, dtype)  # (T, D/2)
    c, s = a.cos(), a.sin()
    R = torch.zeros(a.shape[0], D, D, dtype=dtype)
    j = torch.arange(D // 2)
    R[:, 2 * j, 2 * j], R[:, 2 * j, 2 * j + 1] = c, -s
    R[:, 2 * j + 1, 2 * j], R[:, 2 * j + 1, 2 * j + 1] = s, c
    return R


def apply_rope_matrix(x: Float[Tensor, "... T D"], positions=None, base: float = 10000.0,
                      inv_freq: Tensor | None = None) -> Float[Tensor, "... T D"]:
    r"""Apply :math:`R_{m_t}` (:func:`rope_rotation_matrix`) to the vector at each position, interleaved layout.

    ``positions`` defaults to ``arange(T)``. Shape ``(..., T, D) -> (..., T, D)``. The angles and the
    product are formed in float32 for fp16 / bf16 / float32 ``x`` (float64 for float64), as in
    :func:`apply_rope_complex`, and the result is returned in ``x``'s dtype.

    >>> apply_rope_matrix(torch.tensor([[1.0, 0.0]]), torch.tensor([math.pi / 2]), base=2.0).round(decimals=4)
    tensor([[0., 1.]])
    """
    x = as_tensor(x, "x")
    check_dim(x, "x", "(..., T, D)", min_dim=2)
    T, D = x.shape[-2:]
    positions = T if positions is None else positions
    R = _rotation_matrices(positions, D, base, inv_freq, compute_dtype(x.dtype))  # (T, D, D)
    if R.shape[0] != T:
        raise ValueError(f"got {R.shape[0]} positions for T = {T} vectors")
    return restore_half(torch.einsum("tij,...tj->...ti", R, upcast_half(x)), x.dtype)


@implements("04.05")
def apply_rope_complex(x: Float[Tensor, "... T D"], positions=None, base: float = 10000.0,
                       inv_freq: Tensor | None = None) -> Float[Tensor, "... T D"]:
    r"""RoPE as complex multiplication (Meta's reference code), interleaved layout.

    .. math:: \tilde x_{2j} + i\,\tilde x_{2j+1} = (x_{2j} + i\,x_{2j+1})\,e^{i m\theta_j}

    Each pair becomes one complex number and the rotation one multiplication by a unit phasor,
    :math:`O(D)` instead of the matrix's :math:`O(D^2)`. ``positions`` defaults to ``arange(T)``.
    float32 input uses complex64, float64 uses complex128. Shape ``(..., T, D) -> (..., T, D)``.

    >>> apply_rope_complex(torch.tensor([[1.0, 0.0]]), torch.tensor([math.pi / 2]), base=2.0).round(decimals=4)
    tensor([[0., 1.]])
    """
    x = as_tensor(x, "x")
    check_dim(x, "x", "(..., T, D)", min_dim=2)
    T, D = x.shape[-2:]
    real = torch.float64 if x.dtype == torch.float64 else torch.float32
    a = _angles(T if positions is None else positions, D, base, inv_freq, real)  # (T, D/2)
    if a.shape[0] != T:
        raise ValueError(f"got {a.shape[0]} positions for T = {T} vectors")
    z = torch.view_as_complex(x.to(real).reshape(*x.shape[:-1], D // 2, 2).contiguous())
    phasor = torch.polar(torch.ones_like(a), a)
    out = torch.view_as_real(z * phasor).reshape(x.shape)
    return out.to(x.dtype)


@implements("04.04")
def rope_relative_score(q: Float[Tensor, "... D"], k: Float[Tensor, "... D"], delta, base: float = 10000.0,
                        inv_freq: Tensor | None = None) -> Float[Tensor, "..."]:
    r"""The RoPE score written with the relative rotation only: :math:`q^\top R_{n-m}\,k`.

    .. math:: (R_m q)^\top (R_n k) = q^\top R_m^\top R_n k = q^\top R_{n-m}\, k

    because rotations compose by adding angles and :math:`R_m^\top = R_{-m}`. ``delta`` is
    :math:`n - m` (key position minus query position). Interleaved layout. Shapes ``(..., D) -> (...)``;
    fp16 / bf16 inputs are computed in float32 (angles included) and the score returned in their dtype.

    >>> q = torch.tensor([1.0, 0.0], dtype=torch.float64)
    >>> rope_relative_score(q, q, 0).item()  # no rotation: q.q
    1.0
    """
    q, k = as_tensor(q, "q"), as_tensor(k, "k")
    check_same_dtype(q, k, "q", "k")
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(f"q (..., D) = {tuple(q.shape)} and k (..., D) = {tuple(k.shape)} disagree on D")
    check_batch_broadcast(q, k, 1, "q (..., D)", "k (..., D)")
    delta = check_real(delta.item() if isinstance(delta, Tensor) and delta.numel() == 1 else delta, "delta")
    R = rope_rotation_matrix(delta, q.shape[-1], base, inv_freq, dtype=compute_dtype(q.dtype))
    return restore_half((upcast_half(q) * (upcast_half(k) @ R.T)).sum(-1), q.dtype)


def interleaved_to_half(x: Float[Tensor, "... D"]) -> Float[Tensor, "... D"]:
    """Reorder channels from pairs ``(2j, 2j+1)`` to pairs ``(j, j+D/2)``: evens first, then odds.

    >>> interleaved_to_half(torch.tensor([0, 1, 2, 3, 4, 5]))
    tensor([0, 2, 4, 1, 3, 5])
    """
    if x.shape[-1] % 2:
        raise ValueError(f"the last dim of x ({x.shape[-1]}) must be even")
    return torch.cat([x[..., 0::2], x[..., 1::2]], dim=-1)


def half_to_interleaved(x: Float[Tensor, "... D"]) -> Float[Tensor, "... D"]:
    """The inverse of :func:`interleaved_to_half`.

    >>> half_to_interleaved(torch.tensor([0, 2, 4, 1, 3, 5]))
    tensor([0, 1, 2, 3, 4, 5])
    """
    if x.shape[-1] % 2:
        raise ValueError(f"the last dim of x ({x.shape[-1]}) must be even")
    h = x.shape[-1] // 2
    return torch.stack([x[..., :h], x[..., h:]], dim=-1).reshape(x.shape)


def rope_pair_energy(x: Float[Tensor, "... D"], layout: str = "half") -> Float[Tensor, "... D2"]:
    r"""The squared length of every RoPE pair of ``x``: how much of a query's or key's energy each frequency holds.

    Pair :math:`j` is :math:`(x_j, x_{j+D/2})` (``layout="half"``) or :math:`(x_{2j}, x_{2j+1})`
    (``"interleaved"``), and its energy :math:`x_j^2 + x_{j+D/2}^2` is unchanged by the rotation, so
    it is the same before and after :func:`apply_rope` at any position. Averaged over a trained model's
    queries and keys it shows which frequencies the model uses (chapter 4). Shape ``(..., D) -> (..., D/2)``;
    fp16 / bf16 input gives float32 (squares overflow fp16).

    >>> rope_pair_energy(torch.tensor([3.0, 1.0, 4.0, 2.0]))  # pairs (3, 4) and (1, 2)
    tensor([25.,  5.])
    >>> rope_pair_energy(torch.tensor([3.0, 4.0, 1.0, 2.0]), layout="interleaved")
    tensor([25.,  5.])
    """
    x = as_tensor(x, "x")
    check_dim(x, "x", "(..., D)", min_dim=1)
    check_rope_layout(layout)
    _check_even(x.shape[-1], "the last dim of x (D)")
    x = upcast_half(x)
    if layout == "interleaved":
        x = interleaved_to_half(x)
    h = x.shape[-1] // 2
    return x[..., :h] ** 2 + x[..., h:] ** 2


def _permute_heads(W: Tensor, n_heads: int, name: str, vector_permutation) -> Tensor:
    """Apply a channel permutation to each head's ``D`` rows of ``W`` ``(H D, C)`` (or a bias ``(H D,)``)."""
    W = as_tensor(W, name)
    check_dim(W, name, "(n_heads * D, C) or (n_heads * D,)", min_dim=1, max_dim=2)
    n_heads = check_positive_int(n_heads, "n_heads")
    rows = W.shape[0]
    if rows % n_heads or (rows // n_heads) % 2:
        raise ValueError(f"{name} has {rows} rows: they must split into n_heads ({n_heads}) heads of an even "
                         f"width D (the rows of W are n_heads * D output channels)")
    D = rows // n_heads
    per_head = W.reshape(n_heads, D, -1).transpose(1, 2)  # (H, C, D): channels last for the vector helper
    return vector_permutation(per_head).transpose(1, 2).reshape(W.shape)


def interleaved_to_half_weight(W: Float[Tensor, "HD ..."], n_heads: int) -> Float[Tensor, "HD ..."]:
    r"""Convert a query or key projection from the interleaved RoPE layout to the half-split one.

    Rows ``h D .. (h+1) D`` of ``W`` (``nn.Linear`` layout ``(n_heads * D, C)``; a bias ``(n_heads * D,)``
    works too) are head ``h``'s output channels; within each head they are reordered by
    :func:`interleaved_to_half`. This is the ``permute`` of Hugging Face's
    ``convert_llama_weights_to_hf.py``, ``w.view(H, D/2, 2, C).transpose(1, 2).reshape(H D, C)``.
    Since :math:`q^	op k` is unchanged when ``q`` and ``k`` are permuted alike, a model with
    ``layout="interleaved"`` and weights ``W_q, W_k`` computes the same attention as one with
    ``layout="half"`` and the converted weights. Pass ``n_heads = H_kv`` for a grouped key projection.
    Values and the output projection are not rotated and need no conversion. Exact (a permutation).

    >>> interleaved_to_half_weight(torch.arange(8.0).view(8, 1), n_heads=2).flatten()
    tensor([0., 2., 1., 3., 4., 6., 5., 7.])
    """
    return _permute_heads(W, n_heads, "W", interleaved_to_half)


def half_to_interleaved_weight(W: Float[Tensor, "HD ..."], n_heads: int) -> Float[Tensor, "HD ..."]:
    """The inverse of :func:`interleaved_to_half_weight`: Hugging Face Llama q/k rows to Meta's layout.

    >>> half_to_interleaved_weight(torch.tensor([0.0, 2.0, 1.0, 3.0]), n_heads=1)
    tensor([0., 1., 2., 3.])
    """
    return _permute_heads(W, n_heads, "W", half_to_interleaved)
