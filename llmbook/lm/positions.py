r"""Positional encodings (chapter 4): sinusoidal, learned, RoPE (three equivalent forms), xPos, NoPE.

Attention by itself is blind to order: permuting the keys and values permutes nothing in the output.
Every scheme tells the model where a token sits, either by adding a vector to the token embedding
(sinusoidal, learned: here), by rotating queries and keys (RoPE, xPos: here), or by adding a bias to
the attention scores (ALiBi, T5: :mod:`llmbook.lm.position_bias`). NoPE adds nothing at all.

Symbols: ``T`` positions, ``D`` the width that is rotated (a head width, even), ``d`` the model width,
``H`` heads, ``m, n`` query and key positions, ``theta_j = base^{-2j/D}`` the rotation frequencies.

RoPE pairs channels in one of two layouts, and the book keeps both:

* **interleaved** (the paper, Meta's reference code): pair ``j`` is channels ``(2j, 2j+1)``;
  :func:`rope_rotation_matrix` and :func:`apply_rope_complex` use it;
* **half-split** (Hugging Face Llama): pair ``j`` is channels ``(j, j + D/2)``; :func:`rope_cos_sin`,
  :func:`rotate_half` and :func:`apply_rope` use it, so that they match ``transformers`` bit for bit.

The two are the same rotation seen through the permutation :func:`interleaved_to_half`.
"""

from __future__ import annotations

import math

import torch
from jaxtyping import Float
from torch import Tensor, nn

from llmbook._checks import as_tensor, check_dim, check_finite, check_range
from llmbook.registry import implements

__all__ = [
    "sinusoidal_encoding",
    "LearnedPositionEmbedding",
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
    "xpos_scale",
    "apply_xpos",
    "nope_embedding",
]


def _check_even(D: int, name: str = "D") -> None:
    if isinstance(D, bool) or not isinstance(D, int) or D <= 0 or D % 2:
        raise ValueError(f"{name} ({D!r}) must be a positive even integer: RoPE rotates channel pairs")


def _check_base(base: float) -> None:
    check_range(base, "base", 1.0, math.inf, low_open=True)


def _positions(positions) -> Tensor:
    """An int ``T`` means ``arange(T)``; otherwise a 1-D tensor of (possibly fractional) positions."""
    if isinstance(positions, bool):
        raise TypeError("positions must be an int T or a 1-D tensor of positions, got a bool")
    if isinstance(positions, int):
        if positions < 0:
            raise ValueError(f"the number of positions T ({positions}) must be >= 0")
        return torch.arange(positions)
    p = torch.as_tensor(positions)
    if p.ndim != 1:
        raise ValueError(f"positions must be an int T or a 1-D tensor (T,), got shape {tuple(p.shape)}")
    if p.is_floating_point():
        check_finite(p, "positions")
    return p


# --------------------------------------------------------------------------- 04.01 sinusoidal


@implements("04.01")
def sinusoidal_encoding(T: int, d: int, base: float = 10000.0, *, dtype: torch.dtype = torch.float32,
                        layout: str = "interleaved") -> Float[Tensor, "T d"]:
    r"""The fixed sinusoidal table of the original Transformer.

    .. math:: PE_{pos,2i} = \sin\!\left(\frac{pos}{b^{2i/d}}\right),\qquad
              PE_{pos,2i+1} = \cos\!\left(\frac{pos}{b^{2i/d}}\right)

    ``pos`` runs over ``range(T)``, ``i`` over ``range(d/2)``, ``b`` is ``base`` (10000 in the paper).
    ``layout="interleaved"`` (default) is the paper's: sine on even channels, cosine on odd ones.
    ``layout="concatenated"`` puts all sines first and all cosines after (``cat([sin, cos], -1)``, as
    in tensor2tensor); the two hold the same numbers in a different channel order.
    The angles are formed in float64 and cast to ``dtype``. Shape ``(T, d)``.

    >>> sinusoidal_encoding(2, 4)
    tensor([[0.0000, 1.0000, 0.0000, 1.0000],
            [0.8415, 0.5403, 0.0100, 0.9999]])
    """
    _check_even(d, "d")
    _check_base(base)
    if layout not in ("interleaved", "concatenated"):
        raise ValueError(f"layout must be 'interleaved' or 'concatenated', got {layout!r}")
    pos = _positions(T).to(torch.float64)
    inv = base ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)  # 1 / b^{2i/d}, i = 0..d/2-1
    angle = pos[:, None] * inv[None, :]  # (T, d/2)
    if layout == "concatenated":
        pe = torch.cat([angle.sin(), angle.cos()], dim=-1)
    else:
        pe = torch.stack([angle.sin(), angle.cos()], dim=-1).reshape(len(pos), d)
    return pe.to(dtype)


# --------------------------------------------------------------------------- 04.02 learned


@implements("04.02")
class LearnedPositionEmbedding(nn.Module):
    r"""A trained table :math:`P\in\mathbb{R}^{n_{max}\times d}` added to the token embeddings (GPT-2, BERT).

    .. math:: h_i^{(0)} = E_{x_i} + P_i

    ``forward(tok_emb)`` takes ``E[x]`` of shape ``(B, T, d)`` and returns ``E[x] + P[:T]`` (``offset``
    shifts the rows used, for decoding with a cache). A position at or beyond ``n_max`` has no row:
    the table cannot extrapolate, and asking raises ``ValueError``.

    >>> pe = LearnedPositionEmbedding(8, 4)
    >>> pe(torch.zeros(2, 3, 4)).shape
    torch.Size([2, 3, 4])
    """

    def __init__(self, n_max: int, d: int):
        super().__init__()
        if n_max <= 0 or d <= 0:
            raise ValueError(f"n_max ({n_max}) and d ({d}) must be positive")
        self.n_max, self.d = n_max, d
        self.weight = nn.Parameter(torch.randn(n_max, d) * 0.02)

    def forward(self, tok_emb: Float[Tensor, "B T d"], offset: int = 0) -> Float[Tensor, "B T d"]:
        check_dim(tok_emb, "tok_emb", "(B, T, d)", min_dim=2)
        T = tok_emb.shape[-2]
        if tok_emb.shape[-1] != self.d:
            raise ValueError(f"tok_emb width ({tok_emb.shape[-1]}) must equal d ({self.d})")
        if offset < 0 or offset + T > self.n_max:
            raise ValueError(f"positions [{offset}, {offset + T}) exceed the learned table: n_max = {self.n_max}")
        return tok_emb + self.weight[offset:offset + T]


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
                 dtype: torch.dtype = torch.float32) -> tuple[Float[Tensor, "T D"], Float[Tensor, "T D"]]:
    r"""The cosines and sines of the angles :math:`m\theta_j`, in the half-split layout.

    ``positions`` is an int ``T`` (meaning ``arange(T)``) or a 1-D tensor of positions ``m`` (they may
    be fractional, as after position interpolation). ``inv_freq`` overrides :func:`rope_inv_freq`
    (scaled frequencies from :mod:`llmbook.lm.context_extension`). The angles are formed in float32
    like Llama's ``LlamaRotaryEmbedding`` (``cat([freqs, freqs], -1)``), then cast to ``dtype``; only
    ``dtype=torch.float64`` forms them in float64 (for checks at large positions).
    Each output has shape ``(T, D)``.

    >>> cos, sin = rope_cos_sin(3, 4)
    >>> cos.shape, sin[0].abs().max().item()
    (torch.Size([3, 4]), 0.0)
    """
    _check_even(D)
    if inv_freq is None:
        inv_freq = rope_inv_freq(D, base)
    else:
        inv_freq = as_tensor(inv_freq, "inv_freq")
        if inv_freq.shape != (D // 2,):
            raise ValueError(f"inv_freq must have shape (D/2,) = ({D // 2},), got {tuple(inv_freq.shape)}")
    m = _positions(positions)
    work = torch.float64 if dtype == torch.float64 else torch.float32
    freqs = m[:, None].to(work) * inv_freq[None, :].to(work)  # (T, D/2)
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
def apply_rope(x: Float[Tensor, "... T D"], cos: Float[Tensor, "T D"], sin: Float[Tensor, "T D"]
               ) -> Float[Tensor, "... T D"]:
    r"""Rotate every half-split pair of ``x`` by its angle: ``x * cos + rotate_half(x) * sin``.

    For pair :math:`j` at position :math:`m` this is the rotation :math:`R_{m\theta_j}` applied to
    :math:`(x_j, x_{j+D/2})`. ``cos, sin`` come from :func:`rope_cos_sin` with shape ``(T, D)`` (or
    anything broadcasting against ``x``, e.g. ``(B, 1, T, D)``). ``x`` is ``(..., T, D)``, typically
    ``(B, H, T, D)``. Same as ``transformers``' ``apply_rotary_pos_emb``.

    >>> cos, sin = rope_cos_sin(1, 2)
    >>> apply_rope(torch.tensor([[1.0, 2.0]]), cos, sin)  # position 0: the identity
    tensor([[1., 2.]])
    """
    check_dim(x, "x", "(..., T, D)", min_dim=2)
    if x.shape[-1] != cos.shape[-1] or cos.shape != sin.shape:
        raise ValueError(f"x (..., T, D) = {tuple(x.shape)} needs cos and sin of width D; got cos "
                         f"{tuple(cos.shape)}, sin {tuple(sin.shape)}")
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


@implements("04.03")
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
    a = _angles(torch.tensor([position], dtype=torch.float64), D, base, inv_freq, dtype)[0]  # (D/2,)
    c, s = a.cos(), a.sin()
    R = torch.zeros(D, D, dtype=dtype)
    j = torch.arange(D // 2)
    R[2 * j, 2 * j], R[2 * j, 2 * j + 1] = c, -s
    R[2 * j + 1, 2 * j], R[2 * j + 1, 2 * j + 1] = s, c
    return R


def apply_rope_matrix(x: Float[Tensor, "... T D"], positions=None, base: float = 10000.0,
                      inv_freq: Tensor | None = None) -> Float[Tensor, "... T D"]:
    r"""Apply :math:`R_{m_t}` (:func:`rope_rotation_matrix`) to the vector at each position, interleaved layout.

    ``positions`` defaults to ``arange(T)``. Shape ``(..., T, D) -> (..., T, D)``, computed in ``x``'s dtype.

    >>> apply_rope_matrix(torch.tensor([[1.0, 0.0]]), torch.tensor([math.pi / 2]), base=2.0).round(decimals=4)
    tensor([[0., 1.]])
    """
    x = as_tensor(x, "x")
    check_dim(x, "x", "(..., T, D)", min_dim=2)
    T, D = x.shape[-2:]
    positions = T if positions is None else positions
    R = torch.stack([rope_rotation_matrix(float(m), D, base, inv_freq, dtype=x.dtype)
                     for m in _positions(positions).tolist()])  # (T, D, D)
    if R.shape[0] != T:
        raise ValueError(f"got {R.shape[0]} positions for T = {T} vectors")
    return torch.einsum("tij,...tj->...ti", R, x)


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
    :math:`n - m` (key position minus query position). Interleaved layout. Shapes ``(..., D) -> (...)``.

    >>> q = torch.tensor([1.0, 0.0], dtype=torch.float64)
    >>> rope_relative_score(q, q, 0).item()  # no rotation: q.q
    1.0
    """
    q, k = as_tensor(q, "q"), as_tensor(k, "k")
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(f"q (..., D) = {tuple(q.shape)} and k (..., D) = {tuple(k.shape)} disagree on D")
    R = rope_rotation_matrix(float(delta), q.shape[-1], base, inv_freq, dtype=q.dtype)
    return (q * (k @ R.T)).sum(-1)


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


# --------------------------------------------------------------------------- 04.08 xPos


def xpos_scale(positions, D: int, gamma: float = 0.4, scale_base: float = 512.0,
               dtype: torch.dtype = torch.float32) -> Float[Tensor, "T D"]:
    r"""xPos's per-channel scales :math:`s_m = \zeta^{m/B}`, :math:`\zeta_j = \frac{2j/D + \gamma}{1 + \gamma}`.

    :math:`\zeta_j \in [\gamma/(1+\gamma), 1)` grows with the pair index, so fast-rotating pairs decay
    fastest with distance. ``scale_base`` is :math:`B`. Half-split layout (``cat([s, s], -1)``), like
    :func:`rope_cos_sin`. Shape ``(T, D)``.

    >>> xpos_scale(1, 4)
    tensor([[1., 1., 1., 1.]])
    """
    _check_even(D)
    check_range(gamma, "gamma", 0.0, math.inf, low_open=True)
    check_range(scale_base, "scale_base", 0.0, math.inf, low_open=True)
    zeta = (torch.arange(0, D, 2, dtype=torch.float64) / D + gamma) / (1 + gamma)  # (D/2,)
    m = _positions(positions).to(torch.float64)
    s = zeta[None, :] ** (m[:, None] / scale_base)
    return torch.cat([s, s], dim=-1).to(dtype)


@implements("04.08")
def apply_xpos(q: Float[Tensor, "... T D"], k: Float[Tensor, "... T D"], positions=None, base: float = 10000.0,
               gamma: float = 0.4, scale_base: float = 512.0) -> tuple[Tensor, Tensor]:
    r"""xPos: RoPE plus a scale that grows on queries and shrinks on keys.

    .. math:: q_m' = R_m q_m \odot s_m,\qquad k_n' = R_n k_n \odot s_n^{-1}

    so the score :math:`q_m'^\top k_n'` carries :math:`\zeta_j^{(m-n)/B}`: still a function of
    :math:`m-n` only, and it decays with distance. Half-split layout; ``positions`` defaults to
    ``arange(T)``. For long sequences the reference implementation centres the positions so that
    :math:`s_m` stays in range; the scores do not change. Shapes ``(..., T, D)`` each.

    >>> q2, k2 = apply_xpos(torch.ones(1, 4), torch.ones(1, 4))
    >>> q2.equal(torch.ones(1, 4)), k2.equal(torch.ones(1, 4))
    (True, True)
    """
    q, k = as_tensor(q, "q"), as_tensor(k, "k")
    check_dim(q, "q", "(..., T, D)", min_dim=2)
    if q.shape[-2:] != k.shape[-2:]:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} must share (T, D)")
    T, D = q.shape[-2:]
    positions = T if positions is None else positions
    cos, sin = rope_cos_sin(positions, D, base, dtype=q.dtype)
    s = xpos_scale(positions, D, gamma, scale_base, dtype=q.dtype)
    return apply_rope(q, cos, sin) * s, apply_rope(k, cos, sin) / s


# --------------------------------------------------------------------------- 04.09 NoPE


@implements("04.09")
def nope_embedding(ids: Tensor, E: Float[Tensor, "V d"]) -> Float[Tensor, "... d"]:
    r"""No positional encoding: the first hidden state is the token embedding alone, :math:`h_i^{(0)} = E_{x_i}`.

    Without a causal mask such a transformer is permutation-equivariant (it cannot tell orders apart);
    with one, a token can still infer its position from how many tokens it attends to. Shape
    ``(...) -> (..., d)``.

    >>> nope_embedding(torch.tensor([1, 0]), torch.tensor([[0.0, 1.0], [2.0, 3.0]]))
    tensor([[2., 3.],
            [0., 1.]])
    """
    ids = torch.as_tensor(ids)
    if ids.is_floating_point():
        raise TypeError(f"ids must be integer token ids, got dtype {ids.dtype}")
    E = as_tensor(E, "E")
    check_dim(E, "E", "(V, d)", min_dim=2, max_dim=2)
    if ids.numel() and (ids.min() < 0 or ids.max() >= E.shape[0]):
        raise ValueError(f"ids must lie in [0, V) = [0, {E.shape[0]}), got range [{ids.min()}, {ids.max()}]")
    return E[ids]
