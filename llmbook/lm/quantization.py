r"""Quantisation (chapter 12): integer grids, their scales, NF4, double quantisation, KV caches and QAT.

A :math:`b`-bit quantiser maps a real tensor :math:`x` onto :math:`2^b` levels. Every function here is
built on the affine map of :func:`affine_quantize`,

.. math:: q=\mathrm{clip}(\mathrm{round}(x/s)+z,\,q_{min},\,q_{max}),\qquad \hat x=s\,(q-z),

and differs in how the scale :math:`s` and zero point :math:`z` are chosen and how many elements
share them: the whole tensor (:func:`absmax_quantize`, :func:`asymmetric_quantize`), one output channel
of a weight matrix (:func:`per_channel_quantize`), a channel or a token of a KV cache (:func:`quantize_kv`).
:func:`ste_fake_quantize` lets gradients pass through the rounding for quantisation-aware training.
NormalFloat (NF4, levels at normal quantiles) and double quantisation are in :mod:`llmbook.lm.nf4`.

``round`` is round-half-to-even everywhere (``torch.round``), as in ``torch.fake_quantize_*``.
Half-precision inputs are computed in float32 (``llmbook._precision``); integer codes are returned
as ``int64`` tensors. Names used by other chapters (QLoRA, chapter 11) and kept stable:
:func:`absmax_quantize`, :func:`dequantize`. The NF4 names are imported from :mod:`llmbook.lm.nf4`, which
builds on this module (never the other way round).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from llmbook._checks import (
    as_tensor,
    check_axis,
    check_broadcastable_to,
    check_dim,
    check_finite,
    check_int,
    check_integer_tensor,
    check_real,
)
from llmbook._precision import compute_dtype, restore_half, upcast_half
from llmbook.registry import implements

__all__ = ["affine_quantize", "dequantize", "absmax_quantize", "asymmetric_quantize", "per_channel_quantize",
           "quantize_kv", "ste_fake_quantize", "STEFakeQuantize"]


def _x(x, name: str = "x") -> Tensor:
    x = as_tensor(x, name)
    check_finite(x, name)
    return x


def _bits(b, high: int = 16) -> int:
    return check_int(b, "b", low=2, high=high, what=f"a bit width, an int in [2, {high}]")


def _dim(x: Tensor, dim) -> int | None:
    return None if dim is None else check_axis(x, dim, "x")


def _amax(h: Tensor, dim: int | None) -> Tensor:
    """max |h| over ``dim`` (all elements when None), kept broadcastable; 0 for an empty reduction."""
    if h.numel() == 0:
        shape = [1] * h.ndim if dim is None else [1 if i == dim % h.ndim else n for i, n in enumerate(h.shape)]
        return h.new_zeros(shape)
    a = h.abs()
    return a.amax().reshape([1] * h.ndim) if dim is None else a.amax(dim, keepdim=True)


@dataclass(frozen=True)
class _Grid:
    """``q = clip(round(x * num / den) + z, lo, hi)``, ``x_hat = s (q - z)``: one grid, shared by every caller.

    ``x * num / den`` is ``x / s`` written so that a value exactly halfway between two levels is a tie in
    every precision (``den`` is the max or the range, ``num`` the number of steps).
    """

    num: int
    den: Tensor
    z: Tensor
    s: Tensor
    lo: int
    hi: int

    def q(self, x: Tensor) -> Tensor:
        return torch.clamp(torch.round(x * self.num / self.den) + self.z, self.lo, self.hi)

    def fake(self, x: Tensor) -> Tensor:
        return self.s * (self.q(x) - self.z)


def _grid(h: Tensor, b: int, symmetric: bool, dim: int | None) -> _Grid:
    """The absmax (symmetric, signed) or min/max (asymmetric, unsigned, range widened to 0) grid of ``h``."""
    if symmetric:
        Q = 2 ** (b - 1) - 1
        den = _amax(h, dim)
        z, lo, hi = torch.zeros_like(den), -Q, Q
    else:
        Q = 2**b - 1
        if h.numel() == 0:
            mn = mx = _amax(h, dim)
        elif dim is None:
            mn, mx = h.amin().reshape([1] * h.ndim), h.amax().reshape([1] * h.ndim)
        else:
            mn, mx = h.amin(dim, keepdim=True), h.amax(dim, keepdim=True)
        mn, mx = torch.clamp(mn, max=0), torch.clamp(mx, min=0)
        den = mx - mn
        lo, hi = 0, Q
    safe = torch.where(den > 0, den, torch.ones_like(den))
    if not symmetric:
        z = torch.clamp(torch.round(-mn * Q / safe), 0, Q)
    s = torch.where(den > 0, den / Q, torch.ones_like(den))
    s = torch.where(s > 0, s, torch.ones_like(s))  # a subnormal max / Q underflows: keep s usable
    return _Grid(Q, safe, z, s, lo, hi)


# --------------------------------------------------------------------------- 12.01 the affine map


@implements("12.01")
def affine_quantize(x: Tensor, s, z, q_min: int, q_max: int) -> tuple[Tensor, Tensor]:
    r"""Quantise ``x`` onto the integer grid ``[q_min, q_max]`` with scale ``s`` and zero point ``z``.

    .. math:: q=\mathrm{clip}(\mathrm{round}(x/s)+z,\,q_{min},\,q_{max}),\qquad \hat x=s\,(q-z)

    ``s`` (positive) and ``z`` (an integer in ``[q_min, q_max]``) are numbers or tensors that broadcast to
    ``x`` (per-channel scales: shape ``(C, 1)`` for a ``(C, d)`` matrix). Returns ``(q, x_hat)``: the
    integer codes (``int64``, shape of ``x``) and the dequantised values (dtype of ``x``). Rounding is
    half to even, like ``torch.fake_quantize_per_tensor_affine``; values beyond the grid are clipped.

    >>> affine_quantize(torch.tensor([-1.0, 0.25, 0.3, 9.0]), s=0.1, z=3, q_min=0, q_max=15)
    (tensor([ 0,  5,  6, 15]), tensor([-0.3000,  0.2000,  0.3000,  1.2000]))
    """
    x = _x(x)
    q_min, q_max = check_int(q_min, "q_min"), check_int(q_max, "q_max")
    if q_min >= q_max:
        raise ValueError(f"q_min must be below q_max, got q_min = {q_min}, q_max = {q_max}")
    h = upcast_half(x)
    if isinstance(s, Tensor) or not isinstance(s, (int, float)):
        s = as_tensor(s, "s").to(h.dtype)
        check_finite(s, "s")
        check_broadcastable_to(s, x.shape, "s", "x")
        if (s <= 0).any():
            raise ValueError("s must be positive (a scale), got a value <= 0")
    elif check_real(s, "s") <= 0:
        raise ValueError(f"s must be positive (a scale), got {s}")
    if isinstance(z, Tensor) or not isinstance(z, (int, float)):
        z = check_integer_tensor(z, "z", "an integer tensor (zero points)")
        check_broadcastable_to(z, x.shape, "z", "x")
        zmin, zmax = (int(z.min()), int(z.max())) if z.numel() else (q_min, q_min)
    else:
        z = zmin = zmax = check_int(z, "z")
    if zmin < q_min or zmax > q_max:
        raise ValueError(f"z must lie in [q_min, q_max] = [{q_min}, {q_max}], got values in [{zmin}, {zmax}]")
    q = torch.clamp(torch.round(h / s) + z, q_min, q_max)
    return q.long(), restore_half(s * (q - z), x.dtype)


def dequantize(q: Tensor, s, z=0) -> Tensor:
    r""":math:`\hat x = s\,(q - z)` in the dtype of ``s`` (a tensor) or the default dtype.

    >>> dequantize(torch.tensor([0, 5]), torch.tensor(0.1), 3)
    tensor([-0.3000,  0.2000])
    """
    s = as_tensor(s, "s")
    return s * (q.to(compute_dtype(s.dtype)) - z)


# --------------------------------------------------------------------------- 12.02-12.04 scales


@implements("12.02")
def absmax_quantize(x: Tensor, b: int = 8, dim: int | None = None) -> tuple[Tensor, Tensor]:
    r"""Symmetric (absmax) quantisation to ``b`` signed bits: one scale per tensor, or per slice along ``dim``.

    .. math:: s=\frac{\max(|x|)}{2^{b-1}-1},\qquad q=\mathrm{round}(x/s)\in[-(2^{b-1}-1),\,2^{b-1}-1]

    The maximum runs over all of ``x`` (``dim=None``) or over axis ``dim`` (kept, so ``s`` broadcasts:
    ``dim=-1`` gives one scale per row). The zero point is 0, so 0 stays exactly 0; the grid is symmetric,
    ``-127..127`` for 8 bits (the code ``-128`` is unused). An all-zero slice gets ``s = 1``. ``q`` is computed
    as ``round(x (2^{b-1}-1) / max|x|)``, the same number, so a value exactly halfway between two levels is
    a tie in every precision. Returns ``(q, s)``; :func:`dequantize` gives ``s q``.

    >>> absmax_quantize(torch.tensor([0.5, -1.0, 0.25]), b=3)
    (tensor([ 2, -3,  1]), tensor(0.3333))
    """
    x, b = _x(x), _bits(b)
    dim = _dim(x, dim)
    g = _grid(upcast_half(x), b, True, dim)
    q = g.q(upcast_half(x))
    return q.long(), restore_half(g.s.reshape(g.s.shape if dim is not None else ()), x.dtype)


@implements("12.03")
def asymmetric_quantize(x: Tensor, b: int = 8, dim: int | None = None) -> tuple[Tensor, Tensor, Tensor]:
    r"""Asymmetric (min/max) quantisation to ``b`` unsigned bits, ``q`` in ``[0, 2^b - 1]``.

    .. math:: s=\frac{x_{max}-x_{min}}{q_{max}-q_{min}},\qquad z=\mathrm{round}\Big(q_{min}-\frac{x_{min}}{s}\Big),
              \qquad q=\mathrm{clip}(\mathrm{round}(x/s)+z,\,q_{min},\,q_{max})

    with :math:`q_{min}=0, q_{max}=2^b-1`. As in ``torch.ao.quantization.MinMaxObserver``, the range is
    widened to contain 0 (:math:`x_{min}\le 0\le x_{max}`), so that 0 (padding, a ReLU's output) is exact
    and :math:`z` lies on the grid. ``dim``: as in :func:`absmax_quantize` (``None``: one scale for all).
    Returns ``(q, s, z)`` (``z`` an ``int64`` tensor shaped like ``s``); ``dequantize(q, s, z)`` gives :math:`\hat x`.

    >>> q, s, z = asymmetric_quantize(torch.tensor([-1.0, 0.0, 2.0, 3.0]), b=2)
    >>> q, s, z  # 2 / s = 1.5 rounds to the even 2
    (tensor([0, 1, 3, 3]), tensor(1.3333), tensor(1))
    """
    x, b = _x(x), _bits(b)
    dim = _dim(x, dim)
    h = upcast_half(x)
    g = _grid(h, b, False, dim)
    shape = g.s.shape if dim is not None else ()
    return g.q(h).long(), restore_half(g.s.reshape(shape), x.dtype), g.z.long().reshape(shape)


@implements("12.04")
def per_channel_quantize(W: Tensor, b: int = 8, symmetric: bool = True) -> tuple[Tensor, Tensor, Tensor]:
    r"""Quantise a weight matrix with one scale per output channel (row) :math:`c`.

    .. math:: s_c=\frac{\max_i |W_{c,i}|}{2^{b-1}-1},\qquad q_{c,i}=\mathrm{round}(W_{c,i}/s_c)

    ``W`` is ``(d_out, d_in)``, as in ``nn.Linear.weight``: one row per output channel. A row with a
    large weight no longer coarsens the grid of all the others, as one scale per tensor does.
    ``symmetric=False`` uses each row's min/max instead (:func:`asymmetric_quantize` with ``dim=-1``).
    Returns ``(q, s, z)`` with ``s`` and ``z`` of shape ``(d_out, 1)`` (``z = 0`` when symmetric).

    >>> q, s, z = per_channel_quantize(torch.tensor([[1.0, -0.5], [0.02, 0.01]]), b=8)
    >>> q.tolist(), (s.flatten() * 127).tolist()
    ([[127, -64], [127, 64]], [1.0, 0.019999999552965164])
    """
    W = _x(W, "W")
    check_dim(W, "W", "(d_out, d_in)", min_dim=2, max_dim=2)
    if not isinstance(symmetric, bool):
        raise TypeError(f"symmetric must be a bool, got {symmetric!r}")
    if symmetric:
        q, s = absmax_quantize(W, b, dim=-1)
        return q, s, torch.zeros(s.shape, dtype=torch.long)
    return asymmetric_quantize(W, b, dim=-1)


# --------------------------------------------------------------------------- 12.11 KV cache


@implements("12.11")
def quantize_kv(K: Tensor, V: Tensor, b: int = 4) -> tuple[Tensor, Tensor]:
    r"""Quantise a KV cache as KIVI does: keys per channel, values per token (asymmetric, ``b`` bits).

    .. math:: \hat K=s_K\,(Q(K)-z_K),\qquad \hat V=s_V\,(Q(V)-z_V)

    ``K`` and ``V`` are ``(..., T, D)`` (e.g. ``(B, H, T, D)``). A few *channels* of the keys carry large values
    in every token, so :math:`s_K, z_K` are taken per channel, over the ``T`` tokens (:func:`asymmetric_quantize`
    with ``dim=-2``); the values have no such channels and are quantised per token, over ``D`` (``dim=-1``).
    Returns the dequantised ``(K_hat, V_hat)``, shapes and dtypes of ``K`` and ``V``.

    >>> K = torch.tensor([[0.1, 8.0], [-0.1, 7.0], [0.0, 9.0]])  # (T=3, D=2): channel 1 is an outlier
    >>> quantize_kv(K, K, b=4)[0]
    tensor([[ 0.0933,  7.8000],
            [-0.1067,  7.2000],
            [ 0.0000,  9.0000]])
    """
    K, V = _x(K, "K"), _x(V, "V")
    check_dim(K, "K", "(..., T, D)", min_dim=2)
    check_dim(V, "V", "(..., T, D)", min_dim=2)
    if K.shape[:-1] != V.shape[:-1]:
        raise ValueError(f"K {tuple(K.shape)} and V {tuple(V.shape)} must agree on (..., T)")
    qk, sk, zk = asymmetric_quantize(K, b, dim=-2)
    qv, sv, zv = asymmetric_quantize(V, b, dim=-1)
    return (restore_half(dequantize(qk, upcast_half(sk), zk), K.dtype),
            restore_half(dequantize(qv, upcast_half(sv), zv), V.dtype))


# --------------------------------------------------------------------------- 12.12 QAT


@implements("12.12")
def ste_fake_quantize(x: Tensor, b: int = 8, dim: int | None = None) -> Tensor:
    r"""Fake-quantise ``x`` (absmax, ``b`` bits) with the straight-through estimator for the gradient.

    Quantisation-aware training minimises the loss of the *quantised* model,

    .. math:: \min_\theta\ \mathbb E_{(x,y)}\,L\big(f_{Q(\theta)}(x),\,y\big),

    but :math:`\partial Q/\partial\theta` is zero almost everywhere. The forward pass returns
    :math:`\hat x = s\,\mathrm{round}(x/s)` (:func:`absmax_quantize` then :func:`dequantize`); the backward pass
    treats :math:`Q` as the identity, :math:`\partial \hat x/\partial x := 1` (Bengio et al., 2013), written
    ``x + (x_hat - x).detach()``. ``dim`` as in :func:`absmax_quantize` (``-1``: per row of a weight).

    >>> x = torch.tensor([0.3, -1.0], requires_grad=True)
    >>> y = ste_fake_quantize(x, b=2); y.sum().backward()
    >>> y.detach(), x.grad
    (tensor([ 0., -1.]), tensor([1., 1.]))
    """
    if not isinstance(x, Tensor) or not x.is_floating_point():
        x = as_tensor(x, "x")
    check_finite(x.detach(), "x")
    q, s = absmax_quantize(x.detach(), b, dim)
    h = upcast_half(x)
    x_hat = upcast_half(s) * q.to(h.dtype)
    if h.requires_grad:
        x_hat = h + (x_hat - h).detach()  # forward: x_hat; backward: the identity
    return restore_half(x_hat, x.dtype)


class STEFakeQuantize(nn.Module):
    """A parametrisation (``torch.nn.utils.parametrize``) that fake-quantises a weight per output channel with
    :func:`ste_fake_quantize` in every forward pass: the model trains with quantised weights in the loop.

    >>> lin = nn.Linear(4, 2)
    >>> _ = torch.nn.utils.parametrize.register_parametrization(lin, "weight", STEFakeQuantize(b=4))
    >>> len(lin.weight.unique()) <= 2 * 15
    True
    """

    def __init__(self, b: int = 8):
        super().__init__()
        self.b = _bits(b)

    def forward(self, W: Tensor) -> Tensor:
        return ste_fake_quantize(W, self.b, dim=-1)
