r"""Stretching RoPE past its training length (chapter 4): position interpolation, NTK-aware scaling, YaRN,
and the attention sink.

A RoPE model trained on ``L_train`` tokens has seen each pair ``j`` turn through angles up to
:math:`L_{train}\,\theta_j`. Pairs whose wavelength :math:`2\pi/\theta_j` is longer than ``L_train``
never completed a turn, so at a longer context they meet angles they were never trained on. The
methods here change the frequencies so that ``L_target = s * L_train`` tokens stay in familiar territory:

* position interpolation divides every frequency by ``s`` (all positions squeezed);
* NTK-aware scaling raises the base, leaving high frequencies alone and squeezing low ones by ``alpha``;
* YaRN keeps high frequencies, interpolates low ones fully, ramps in between, and sharpens the softmax.

Every function returns ``(inv_freq, attention_factor)`` like ``transformers``' ``ROPE_INIT_FUNCTIONS``:
``inv_freq`` goes to :func:`llmbook.lm.rope.rope_cos_sin`, and ``cos, sin`` are multiplied by
``attention_factor`` (so scores grow by its square).
"""

from __future__ import annotations

import math

import torch
from jaxtyping import Float
from torch import Tensor

from llmbook._checks import (
    as_tensor,
    check_batch_broadcast,
    check_dim,
    check_int,
    check_nonempty,
    check_nonnegative_int,
    check_positive_int,
    check_range,
    check_same_dtype,
)
from llmbook._precision import restore_half, upcast_half
from llmbook.lm.rope import apply_rope, rope_cos_sin, rope_inv_freq
from llmbook.registry import implements

__all__ = [
    "METHODS",
    "position_interpolation",
    "pi_inv_freq",
    "ntk_inv_freq",
    "dynamic_ntk_alpha",
    "yarn_correction_dim",
    "yarn_ramp",
    "yarn_inv_freq",
    "yarn_attention_factor",
    "scaled_inv_freq",
    "rope_scores_by_distance",
    "unseen_angle_pairs",
    "attention_sink_scores",
    "streaming_mask",
]

#: Context-extension methods understood by :func:`scaled_inv_freq`.
METHODS = ("none", "pi", "ntk", "dynamic", "yarn")


def _check_factor(factor: float, name: str = "factor") -> None:
    check_range(factor, name, 1.0, math.inf)


# --------------------------------------------------------------------------- 04.10 position interpolation


@implements("04.10")
def position_interpolation(positions: Tensor, L_train: int, L_target: int) -> Float[Tensor, "..."]:
    r"""Squeeze positions into the trained range: :math:`m' = m\cdot L_{train}/L_{target}`.

    Position ``L_target - 1`` lands just below ``L_train``: every angle is one the model has seen,
    at the price of neighbouring tokens sitting ``s = L_target / L_train`` times closer together.
    Feeding ``m'`` to :func:`~llmbook.lm.rope.rope_cos_sin` equals using :func:`pi_inv_freq`.
    Same shape as ``positions`` (float32, or float64 for float64 input).

    >>> position_interpolation(torch.tensor([0, 2048, 8191]), 2048, 8192)
    tensor([   0.0000,  512.0000, 2047.7500])
    """
    check_positive_int(L_train, "L_train")
    check_positive_int(L_target, "L_target")
    m = as_tensor(positions, "positions")
    m = m.to(torch.float64 if m.dtype == torch.float64 else torch.float32)
    return m * (L_train / L_target)


def pi_inv_freq(D: int, base: float = 10000.0, factor: float = 1.0) -> tuple[Float[Tensor, " D2"], float]:
    r"""Linear scaling (``transformers`` ``rope_type="linear"``): :math:`\theta_j' = \theta_j / s`.

    Since the angle is :math:`m\theta_j`, dividing the frequencies by ``factor`` :math:`s` is the same
    as dividing the positions. Returns ``(inv_freq (D/2,), 1.0)``.

    >>> pi_inv_freq(4, 100.0, factor=2.0)[0]
    tensor([0.5000, 0.0500])
    """
    _check_factor(factor)
    return rope_inv_freq(D, base) / factor, 1.0


# --------------------------------------------------------------------------- 04.11 NTK-aware


@implements("04.11")
def ntk_inv_freq(D: int, base: float = 10000.0, alpha: float = 1.0) -> tuple[Float[Tensor, " D2"], float]:
    r"""NTK-aware scaling: enlarge the base so that :math:`\theta_j' = \theta_j\,\alpha^{-2j/(D-2)}`.

    The same as RoPE with base :math:`b' = b\,\alpha^{D/(D-2)}`: pair 0 (the fastest) is untouched,
    the slowest pair :math:`j = D/2-1` is slowed by exactly :math:`\alpha`, and everything between is
    scaled geometrically. High frequencies, which carry local order, keep their resolution.
    Computed through :math:`b'` as ``transformers`` does. Returns ``(inv_freq (D/2,), 1.0)``.

    >>> inv, _ = ntk_inv_freq(8, 10000.0, alpha=4.0)
    >>> (rope_inv_freq(8) / inv)[[0, -1]]
    tensor([1., 4.])
    """
    D = check_int(D, "D", low=3, what="an int > 2 (NTK's exponent is D/(D-2))")
    check_range(base, "base", 1.0, math.inf, low_open=True)
    _check_factor(alpha, "alpha")
    return rope_inv_freq(D, base * alpha ** (D / (D - 2))), 1.0


def dynamic_ntk_alpha(seq_len: int, L_train: int, factor: float) -> float:
    r"""Dynamic NTK's :math:`\alpha = s\,\frac{\max(T, L_{train})}{L_{train}} - (s-1)`, for the current length ``T``.

    Within the trained length nothing changes (:math:`\alpha = 1`); beyond it :math:`\alpha` grows
    linearly with ``T`` (slope ``s / L_train``), so short prompts keep the original frequencies.

    >>> dynamic_ntk_alpha(1024, 2048, 4.0), dynamic_ntk_alpha(4096, 2048, 4.0)
    (1.0, 5.0)
    """
    check_positive_int(seq_len, "seq_len")
    check_positive_int(L_train, "L_train")
    _check_factor(factor)
    T = max(seq_len, L_train)
    return factor * T / L_train - (factor - 1)


# --------------------------------------------------------------------------- 04.12 YaRN


def yarn_correction_dim(n_rotations: float, D: int, base: float, L_train: int) -> float:
    r"""The (fractional) pair index whose frequency turns ``n_rotations`` times in ``L_train`` tokens.

    Solving :math:`L_{train}\,\theta_j = 2\pi n` for :math:`j` gives
    :math:`j = \frac{D\,\ln(L_{train}/(2\pi n))}{2\ln b}`.

    ``n_rotations`` > 0, ``base`` > 1 (so that :math:`\ln b > 0`), ``L_train`` a positive int.

    >>> round(yarn_correction_dim(1, 128, 10000.0, 4096), 3)
    45.027
    """
    check_range(n_rotations, "n_rotations", 0.0, math.inf, low_open=True, high_open=True)
    check_range(base, "base", 1.0, math.inf, low_open=True, high_open=True)
    check_positive_int(L_train, "L_train")
    check_positive_int(D, "D")
    return D * math.log(L_train / (n_rotations * 2 * math.pi)) / (2 * math.log(base))


def yarn_ramp(D: int, base: float, L_train: int, beta_fast: float = 32.0, beta_slow: float = 1.0,
              truncate: bool = True) -> Float[Tensor, " D2"]:
    r"""YaRN's ramp :math:`r_j\in[0,1]` over the pairs: 0 where a pair turns more than ``beta_fast`` times
    in ``L_train`` (keep it), 1 where it turns fewer than ``beta_slow`` times (interpolate it), linear between.

    ``truncate`` rounds the two boundaries outwards to whole pairs (the ``transformers`` default).
    Contract: ``beta_fast > beta_slow > 0`` (the fast boundary sits at a lower pair index than the slow
    one; swapped values would invert the ramp) and ``base > 1``.

    >>> yarn_ramp(8, 10000.0, 64, beta_fast=4, beta_slow=1)
    tensor([0.0000, 0.5000, 1.0000, 1.0000])
    """
    check_range(beta_slow, "beta_slow", 0.0, math.inf, low_open=True, high_open=True)
    check_range(beta_fast, "beta_fast", 0.0, math.inf, low_open=True, high_open=True)
    if not beta_fast > beta_slow:
        raise ValueError(f"beta_fast ({beta_fast}) must be greater than beta_slow ({beta_slow}): pairs turning more "
                         f"than beta_fast times in L_train are kept, fewer than beta_slow times interpolated")
    lo = yarn_correction_dim(beta_fast, D, base, L_train)
    hi = yarn_correction_dim(beta_slow, D, base, L_train)
    if truncate:
        lo, hi = math.floor(lo), math.ceil(hi)
    lo, hi = max(lo, 0), min(hi, D - 1)
    if lo == hi:
        hi += 0.001  # one-pair ramp: avoid 0/0
    return ((torch.arange(D // 2, dtype=torch.float32) - lo) / (hi - lo)).clamp(0, 1)


def yarn_attention_factor(factor: float) -> float:
    r"""YaRN's temperature fix :math:`\sqrt{1/t} = 0.1\ln s + 1` (1 for :math:`s\le 1`), applied to ``cos`` and ``sin``.

    >>> round(yarn_attention_factor(4.0), 4)
    1.1386
    """
    factor = check_range(factor, "factor", 0.0, low_open=True)  # the scale s of the context, > 0
    return 1.0 if factor <= 1 else 0.1 * math.log(factor) + 1.0


@implements("04.12")
def yarn_inv_freq(D: int, base: float = 10000.0, factor: float = 1.0, L_train: int = 4096, beta_fast: float = 32.0,
                  beta_slow: float = 1.0, truncate: bool = True,
                  attention_factor: float | None = None) -> tuple[Float[Tensor, " D2"], float]:
    r"""YaRN ("NTK-by-parts" plus temperature): interpolate low frequencies, keep high ones, ramp between.

    .. math:: \theta_j' = (1-r_j)\,\theta_j + r_j\,\frac{\theta_j}{s} = \frac{\theta_j}{s_j},\qquad
              \frac{1}{s_j} = (1-r_j)\cdot 1 + r_j\cdot\frac1s

    with the ramp :math:`r_j` of :func:`yarn_ramp` and :math:`s` = ``factor``; the scale per pair
    runs from :math:`s_{low}=1` (fast pairs) to :math:`s_{high}=s` (slow pairs). ``attention_factor``
    defaults to :func:`yarn_attention_factor`. Matches ``transformers`` ``rope_type="yarn"`` with
    ``original_max_position_embeddings = L_train``. Returns ``(inv_freq (D/2,), attention_factor)``.

    >>> inv, a = yarn_inv_freq(8, 10000.0, factor=4.0, L_train=64, beta_fast=4, beta_slow=1)
    >>> (rope_inv_freq(8) / inv), round(a, 4)
    (tensor([1.0000, 1.6000, 4.0000, 4.0000]), 1.1386)
    """
    _check_factor(factor)
    check_positive_int(L_train, "L_train")
    if attention_factor is not None:
        check_range(attention_factor, "attention_factor", 0.0, math.inf, low_open=True)
    theta = rope_inv_freq(D, base)
    r = yarn_ramp(D, base, L_train, beta_fast, beta_slow, truncate)
    inv_freq = (theta / factor) * r + theta * (1 - r)
    return inv_freq, yarn_attention_factor(factor) if attention_factor is None else float(attention_factor)


def scaled_inv_freq(method: str, D: int, base: float = 10000.0, factor: float = 1.0, L_train: int = 4096,
                    seq_len: int | None = None) -> tuple[Float[Tensor, " D2"], float]:
    """One entry point for the methods in :data:`METHODS`: ``(inv_freq, attention_factor)``.

    ``"ntk"`` is static NTK with ``alpha = factor``; ``"dynamic"`` uses :func:`dynamic_ntk_alpha` at
    ``seq_len`` (default ``factor * L_train``).

    >>> scaled_inv_freq("pi", 4, 100.0, factor=2.0)[0]
    tensor([0.5000, 0.0500])
    """
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    if method == "none":
        return rope_inv_freq(D, base), 1.0
    if method == "pi":
        return pi_inv_freq(D, base, factor)
    if method == "ntk":
        return ntk_inv_freq(D, base, factor)
    if method == "dynamic":
        seq_len = seq_len if seq_len is not None else int(round(factor * L_train))
        return ntk_inv_freq(D, base, dynamic_ntk_alpha(seq_len, L_train, factor))
    return yarn_inv_freq(D, base, factor, L_train)


# --------------------------------------------------------------------------- diagnostics used by the chapter


def rope_scores_by_distance(q: Float[Tensor, " D"], k: Float[Tensor, " D"], distances: Tensor,
                            inv_freq: Tensor | None = None, attention_factor: float = 1.0,
                            base: float = 10000.0) -> Float[Tensor, " N"]:
    r"""The RoPE score :math:`a^2\,(R_0 q)^\top (R_\Delta k)` of one query and key at each distance :math:`\Delta`.

    Half-split layout (:func:`~llmbook.lm.rope.apply_rope`); ``a`` is ``attention_factor``, which
    multiplies both ``cos`` and ``sin`` and so the score by :math:`a^2`. Shape ``(D,), (D,), (N,) -> (N,)``.

    >>> rope_scores_by_distance(torch.ones(4), torch.ones(4), torch.tensor([0])).item()
    4.0
    """
    q, k = as_tensor(q, "q"), as_tensor(k, "k")
    check_range(attention_factor, "attention_factor", 0.0, math.inf, low_open=True)
    check_dim(q, "q", "(D,)", max_dim=1)
    if q.shape != k.shape:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} must both be (D,)")
    D = q.shape[0]
    cos, sin = rope_cos_sin(torch.as_tensor(distances), D, base, inv_freq=inv_freq)
    k_rot = apply_rope(k.float().expand(cos.shape[0], D), cos, sin)  # q stays at position 0
    return attention_factor ** 2 * (k_rot @ q.float())


def unseen_angle_pairs(inv_freq: Tensor, L_train: int, L_target: int, base: float = 10000.0) -> Tensor:
    r"""Which pairs reach, within ``L_target`` tokens, an angle the unscaled model never saw in ``L_train``.

    Training showed pair ``j`` the angles :math:`[0, L_{train}\theta_j]` (all of :math:`[0,2\pi)` once
    :math:`L_{train}\theta_j\ge 2\pi`). A scaled pair with frequency :math:`\theta_j'` is out of
    distribution when :math:`L_{target}\theta_j'` exceeds that range. Returns a bool ``(D/2,)`` mask.

    >>> unseen_angle_pairs(rope_inv_freq(8), 2048, 8192)  # only the slowest pair never finished a turn
    tensor([False, False, False,  True])
    """
    check_positive_int(L_train, "L_train")
    check_positive_int(L_target, "L_target")
    D = 2 * inv_freq.shape[-1]
    theta = rope_inv_freq(D, base).double()
    seen = torch.clamp(L_train * theta, max=2 * math.pi)
    reached = (L_target - 1) * inv_freq.double()
    return (reached > seen * (1 + 1e-6)) & (L_train * theta < 2 * math.pi)


# --------------------------------------------------------------------------- 04.13 attention sink


@implements("04.13")
def attention_sink_scores(q: Float[Tensor, "... T D"], k: Float[Tensor, "... T_k D"], n_sink: int = 1,
                          causal: bool = True) -> tuple[Float[Tensor, "... T T_k"], Float[Tensor, "... T"]]:
    r"""Attention weights and the share of each query's attention that lands on the first ``n_sink`` keys.

    .. math:: \alpha_{ij} = \frac{\exp(q_i^\top k_j/\sqrt{d})}{\sum_t \exp(q_i^\top k_t/\sqrt{d})},\qquad
              \text{sink}_i = \sum_{j<n_{sink}} \alpha_{ij}

    The softmax must put its unit of mass somewhere; trained models park the surplus on the first
    tokens, which every query can see. Dropping those keys (a plain sliding window) moves that mass
    onto the others and breaks the model; StreamingLLM keeps them (:func:`streaming_mask`).
    ``causal`` masks keys after each query (queries are the last ``T`` of ``T_k``). Returns
    ``(alpha (..., T, T_k), sink (..., T))``; fp16 / bf16 inputs are computed in float32 and the
    results returned in their dtype.

    >>> a, s = attention_sink_scores(torch.zeros(3, 2), torch.zeros(3, 2))
    >>> s
    tensor([1.0000, 0.5000, 0.3333])
    """
    q, k = as_tensor(q, "q"), as_tensor(k, "k")
    check_dim(q, "q", "(..., T, D)", min_dim=2)
    check_dim(k, "k", "(..., T_k, D)", min_dim=2)
    check_same_dtype(q, k, "q", "k")
    check_nonempty(q, "q")  # D = 0: the scores 0 / sqrt(0) are undefined
    T, D = q.shape[-2:]
    T_k = k.shape[-2]
    if k.shape[-1] != D or T_k < T:
        raise ValueError(f"q (..., T, D) = {tuple(q.shape)} and k (..., T_k, D) = {tuple(k.shape)} need the same D "
                         f"and T_k >= T")
    check_batch_broadcast(q, k, 2, "q (..., T, D)", "k (..., T_k, D)")
    n_sink = check_int(n_sink, "n_sink", low=0, high=T_k, what=f"an int in [0, T_k] = [0, {T_k}]")
    z = upcast_half(q) @ upcast_half(k).transpose(-1, -2) / math.sqrt(D)
    if causal:
        i = torch.arange(T_k - T, T_k)[:, None]
        z = z.masked_fill(torch.arange(T_k)[None, :] > i, float("-inf"))
    alpha = torch.softmax(z, dim=-1)
    return restore_half(alpha, q.dtype), restore_half(alpha[..., :n_sink].sum(-1), q.dtype)


def streaming_mask(T: int, n_sink: int = 4, window: int = 256) -> torch.Tensor:
    """StreamingLLM's attention pattern: query ``i`` sees the first ``n_sink`` keys and the last ``window``.

    Bool ``(T, T)``, True where attention is allowed (causal).

    >>> streaming_mask(5, n_sink=1, window=2).int()
    tensor([[1, 0, 0, 0, 0],
            [1, 1, 0, 0, 0],
            [1, 1, 1, 0, 0],
            [1, 0, 1, 1, 0],
            [1, 0, 0, 1, 1]], dtype=torch.int32)
    """
    T, n_sink = check_nonnegative_int(T, "T"), check_nonnegative_int(n_sink, "n_sink")
    window = check_positive_int(window, "window")
    i = torch.arange(T)[:, None]
    j = torch.arange(T)[None, :]
    return (j <= i) & ((j < n_sink) | (j > i - window))
