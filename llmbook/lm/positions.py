r"""Positional encodings (chapter 4): sinusoidal, learned, xPos, NoPE; RoPE lives in :mod:`llmbook.lm.rope`.

Attention by itself is blind to order: permuting the keys and values permutes nothing in the output.
Every scheme tells the model where a token sits, either by adding a vector to the token embedding
(sinusoidal, learned: here), by rotating queries and keys (RoPE: :mod:`llmbook.lm.rope`; xPos, RoPE
with a decay: here), or by adding a bias to the attention scores (ALiBi, T5:
:mod:`llmbook.lm.position_bias`). NoPE adds nothing at all.

Symbols: ``T`` positions, ``D`` the width that is rotated (a head width, even), ``d`` the model width,
``m, n`` query and key positions. The RoPE functions are re-exported here, so
``llmbook.lm.positions.apply_rope`` is :func:`llmbook.lm.rope.apply_rope`.
"""

from __future__ import annotations

import math

import torch
from jaxtyping import Float
from torch import Tensor, nn

from llmbook._checks import (
    as_tensor,
    check_dim,
    check_module_input,
    check_nonnegative_int,
    check_positive_int,
    check_range,
    check_token_ids,
)
from llmbook._precision import compute_dtype, restore_half, upcast_half
from llmbook.lm.rope import (  # noqa: F401  (re-exported: chapter 4 reads them from here)
    ROPE_LAYOUTS,
    _check_base,
    _check_even,
    _positions,
    apply_rope,
    apply_rope_complex,
    apply_rope_matrix,
    check_rope_layout,
    half_to_interleaved,
    half_to_interleaved_weight,
    interleaved_to_half,
    interleaved_to_half_weight,
    rope_cos_sin,
    rope_inv_freq,
    rope_pair_energy,
    rope_relative_score,
    rope_rotation_matrix,
    rotate_half,
)
from llmbook.registry import implements

__all__ = [
    "sinusoidal_encoding",
    "LearnedPositionEmbedding",
    "xpos_scale",
    "apply_xpos",
    "nope_embedding",
    # RoPE, from llmbook.lm.rope
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
        self.n_max, self.d = check_positive_int(n_max, "n_max"), check_positive_int(d, "d")
        self.weight = nn.Parameter(torch.randn(n_max, d) * 0.02)

    def forward(self, tok_emb: Float[Tensor, "B T d"], offset: int = 0) -> Float[Tensor, "B T d"]:
        check_module_input(self, tok_emb, "tok_emb", d=self.d, symbol="d", contract="(B, T, d)")
        check_dim(tok_emb, "tok_emb", "(B, T, d)", min_dim=2)
        offset = check_nonnegative_int(offset, "offset")
        T = tok_emb.shape[-2]
        if offset + T > self.n_max:
            raise ValueError(f"positions [{offset}, {offset + T}) exceed the learned table: n_max = {self.n_max}")
        return tok_emb + self.weight[offset:offset + T]


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
               gamma: float = 0.4, scale_base: float = 512.0, center: float | None = None) -> tuple[Tensor, Tensor]:
    r"""xPos: RoPE plus a scale that grows on queries and shrinks on keys.

    .. math:: q_m' = R_m q_m \odot s_m,\qquad k_n' = R_n k_n \odot s_n^{-1}

    so the score :math:`q_m'^\top k_n'` carries :math:`\zeta_j^{(m-n)/B}`: still a function of
    :math:`m-n` only, and it decays with distance. Half-split layout; ``positions`` defaults to
    ``arange(T)``. Like the reference implementation (torchscale's ``XPOS``), the scale uses centred
    positions :math:`s_{m-c}` with :math:`c` = ``center``, by default the midpoint
    :math:`\lfloor(\min m + \max m + 1)/2\rfloor` (``T // 2`` for ``arange(T)``): :math:`s_m` alone
    reaches :math:`\zeta^{-m/B} \approx 10^{27}` at :math:`m = 50000`, while the scores, which carry
    :math:`s_{m-c}/s_{n-c} = \zeta^{(m-n)/B}`, do not change. Pass the same ``center`` to every call
    whose queries and keys meet (a KV cache). fp16 / bf16 inputs are computed in float32 and returned
    in their dtype. Shapes ``(..., T, D)`` each.

    >>> q2, k2 = apply_xpos(torch.ones(1, 4), torch.ones(1, 4))
    >>> q2.equal(torch.ones(1, 4)), k2.equal(torch.ones(1, 4))
    (True, True)
    """
    q, k = as_tensor(q, "q"), as_tensor(k, "k")
    check_dim(q, "q", "(..., T, D)", min_dim=2)
    if q.shape[-2:] != k.shape[-2:]:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} must share (T, D)")
    T, D = q.shape[-2:]
    m = _positions(T if positions is None else positions)
    if center is None:
        center = math.floor((m.min().item() + m.max().item() + 1) / 2) if m.numel() else 0
    else:
        check_range(center, "center", -math.inf, math.inf)
    work = compute_dtype(q.dtype)
    cos, sin = rope_cos_sin(m, D, base, dtype=work)
    s = xpos_scale(m.to(torch.float64) - center, D, gamma, scale_base, dtype=work)
    return (restore_half(apply_rope(upcast_half(q), cos, sin) * s, q.dtype),
            restore_half(apply_rope(upcast_half(k), cos, sin) / s, k.dtype))


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
    E = as_tensor(E, "E")
    check_dim(E, "E", "(V, d)", min_dim=2, max_dim=2)
    return E[check_token_ids(ids, E.shape[0])]
