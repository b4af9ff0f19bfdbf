r"""NormalFloat (NF4) and double quantisation (chapter 12), the storage format of QLoRA's frozen weights.

Weights of a trained network are close to normally distributed, so an integer grid (evenly spaced levels)
wastes levels in the tails and has too few near 0. NormalFloat places its :math:`2^b` levels at quantiles of
:math:`\mathcal N(0, 1)` (:func:`nf4_code`), so that normal data uses them far more evenly, and scales each
block of 64 weights by its absmax (:func:`nf4_quantize`, :func:`nf4_dequantize`). :func:`double_quantize`
then quantises the block scales themselves. Names kept stable for chapter 11 (QLoRA): :func:`nf4_code`,
:func:`nf4_quantize`, :func:`nf4_dequantize`, :func:`double_quantize`, :func:`double_dequantize` (also importable
from :mod:`llmbook.lm.quantization`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from llmbook._checks import as_tensor, check_integer_tensor, check_positive_int
from llmbook._precision import compute_dtype, restore_half, upcast_half
from llmbook.lm.quantization import _bits, _x, absmax_quantize
from llmbook.registry import implements

__all__ = ["nf4_code", "nf4_quantize", "nf4_dequantize", "DoubleQuantized", "double_quantize", "double_dequantize"]


# --------------------------------------------------------------------------- 12.09 NF4


def nf4_code(b: int = 4, *, dtype: torch.dtype = torch.float64) -> Tensor:
    r"""The :math:`2^b` NormalFloat levels in ``[-1, 1]``: quantiles of :math:`\mathcal N(0,1)`, rescaled.

    NF4 (QLoRA) takes :math:`2^{b-1}` positive quantiles :math:`\Phi^{-1}(p)` for ``p`` evenly spaced from
    :math:`1-\delta` to :math:`1/2` (exclusive), :math:`2^{b-1}-1` negative ones the same way, and an exact 0,
    then divides by the largest; :math:`\delta=\frac12(\frac1{2\cdot 2^b}+\frac1{2(2^b-1)})` (0.0323 for
    4 bits) keeps the end quantiles finite. ``b = 4`` gives the 16 values of ``bitsandbytes``' NF4
    table; ``b = 3`` an 8-level NF3. Sorted ascending; ``-1``, ``0`` and ``1`` are exact.

    >>> [round(v, 4) for v in nf4_code()[:3].tolist()]
    [-1.0, -0.6962, -0.5251]
    """
    b = _bits(b, high=8)
    n = 2 ** (b - 1)
    offset = 1 - 0.5 * (1 / (2 * 2**b) + 1 / (2 * (2**b - 1)))
    pos = torch.special.ndtri(torch.linspace(offset, 0.5, n + 1, dtype=torch.float64)[:-1])
    neg = -torch.special.ndtri(torch.linspace(offset, 0.5, n, dtype=torch.float64)[:-1])
    code = torch.cat([neg, torch.zeros(1, dtype=torch.float64), pos]).sort().values
    return (code / code.abs().max()).to(dtype)


def _blocks(h: Tensor, block_size: int) -> Tensor:
    flat = h.reshape(-1)
    pad = (-flat.numel()) % block_size
    return torch.cat([flat, flat.new_zeros(pad)]).view(-1, block_size)


@implements("12.09")
def nf4_quantize(x: Tensor, block_size: int = 64, b: int = 4) -> tuple[Tensor, Tensor]:
    r"""NormalFloat quantisation: each block of ``block_size`` values is scaled by its absmax and each value
    is mapped to the nearest level of :func:`nf4_code`.

    .. math:: s=\max_{i\in\text{block}}|x_i|,\qquad q_i=\arg\min_{j}\,\big|x_i/s-c_j\big|,\quad c_j\in C_{NF4}

    Blocks run over ``x`` flattened in row-major order (the last one zero-padded), as in ``bitsandbytes``'
    ``quantize_4bit``. The levels are denser near 0, where normally distributed weights are dense, so the
    16 codes are used far more evenly than those of an evenly spaced grid. Returns ``(q, absmax)``: codes
    in ``[0, 2^b)`` (``int64``, shape of ``x``) and one scale per block, shape ``(ceil(numel / block_size),)``;
    :func:`nf4_dequantize` inverts it.

    >>> q, absmax = nf4_quantize(torch.tensor([0.0, 1.0, -0.5, 0.1]), block_size=4)
    >>> q.tolist(), absmax.tolist()
    ([7, 15, 2, 8], [1.0])
    """
    x = _x(x)
    block_size, b = check_positive_int(block_size, "block_size"), _bits(b, high=8)
    h = upcast_half(x)
    code = nf4_code(b, dtype=h.dtype)
    blocks = _blocks(h, block_size)
    absmax = blocks.abs().amax(-1, keepdim=True) if blocks.numel() else blocks.new_zeros(0, 1)
    scaled = blocks / torch.where(absmax > 0, absmax, torch.ones_like(absmax))
    mid = (code[1:] + code[:-1]) / 2  # nearest level = number of midpoints below (ties go down)
    q = torch.bucketize(scaled, mid, right=False)
    return q.reshape(-1)[:x.numel()].reshape(x.shape), restore_half(absmax.reshape(-1), x.dtype)


def nf4_dequantize(q: Tensor, absmax: Tensor, block_size: int = 64, b: int = 4) -> Tensor:
    r""":math:`\hat x_i = s_{\text{block}(i)}\, c_{q_i}`, the inverse of :func:`nf4_quantize` (shape of ``q``).

    >>> nf4_dequantize(torch.tensor([7, 15, 2, 8]), torch.tensor([1.0]), block_size=4)
    tensor([ 0.0000,  1.0000, -0.5251,  0.0796])
    """
    block_size = check_positive_int(block_size, "block_size")
    absmax = as_tensor(absmax, "absmax")
    q = check_integer_tensor(q, "q", "an integer tensor of NF codes")
    code = nf4_code(b, dtype=compute_dtype(absmax.dtype))
    if q.numel() and (q.min() < 0 or q.max() >= len(code)):
        raise ValueError(f"q must hold codes in [0, {len(code)}), got range [{int(q.min())}, {int(q.max())}]")
    n_blocks = -(-q.numel() // block_size)
    if absmax.shape != (n_blocks,):
        raise ValueError(f"absmax must have shape ({n_blocks},): one scale per block of {block_size}, got "
                         f"{tuple(absmax.shape)}")
    vals = _blocks(code[q.long()], block_size) * upcast_half(absmax)[:, None]
    return restore_half(vals.reshape(-1)[:q.numel()].reshape(q.shape), absmax.dtype)


# --------------------------------------------------------------------------- 12.10 double quantisation


@dataclass(frozen=True)
class DoubleQuantized:
    """What :func:`double_quantize` stores: 4-bit codes ``q``, 8-bit scale codes ``q_s``, the second-level
    scales ``s2`` (one float per ``block_size2`` scales) and the mean ``mu`` subtracted from the scales."""

    q: Tensor
    q_s: Tensor
    s2: Tensor
    mu: Tensor
    block_size: int
    block_size2: int


@implements("12.10")
def double_quantize(x: Tensor, block_size: int = 64, block_size2: int = 256, b2: int = 8) -> DoubleQuantized:
    r"""QLoRA's double quantisation: NF4-quantise ``x``, then quantise its block scales to ``b2`` bits.

    .. math:: q_s=Q(s),\qquad \hat x=\mathrm{dequant}\big(q_x,\ \mathrm{dequant}(q_s)\big)

    One float32 scale per 64 weights costs :math:`32/64 = 0.5` bit per weight. The scales are positive,
    so their mean :math:`\mu` is subtracted first; the centred scales are absmax-quantised
    (:func:`~llmbook.lm.quantization.absmax_quantize`) in blocks of ``block_size2 = 256`` with one float32
    second-level scale each: :math:`8/64 + 32/(64\cdot 256) \approx 0.127` bit per weight.
    (``bitsandbytes`` stores the scales in its 8-bit dynamic float code; here an integer grid, same memory.)
    :func:`double_dequantize` returns :math:`\hat x`.

    >>> dq = double_quantize(torch.randn(4, 128, generator=torch.Generator().manual_seed(0)))
    >>> tuple(dq.q.shape), tuple(dq.q_s.shape), tuple(dq.s2.shape)
    ((4, 128), (8,), (1,))
    """
    block_size, block_size2 = check_positive_int(block_size, "block_size"), check_positive_int(block_size2,
                                                                                                "block_size2")
    b2 = _bits(b2)
    q, absmax = nf4_quantize(x, block_size)
    a = upcast_half(absmax)
    mu = a.mean() if a.numel() else a.new_zeros(())
    q_s, s2 = absmax_quantize(_blocks(a - mu, block_size2), b2, dim=-1)
    return DoubleQuantized(q, q_s.reshape(-1)[:a.numel()], restore_half(s2.reshape(-1), absmax.dtype),
                           restore_half(mu, absmax.dtype), block_size, block_size2)


def double_dequantize(dq: DoubleQuantized) -> Tensor:
    r""":math:`\hat x` from a :class:`DoubleQuantized`: first the scales :math:`\mu + s_2 q_s`, then the NF4 values."""
    s2 = upcast_half(dq.s2)
    n = dq.q_s.numel()
    centred = (_blocks(dq.q_s.to(s2.dtype), dq.block_size2) * s2[:, None]).reshape(-1)[:n]
    return nf4_dequantize(dq.q, centred + upcast_half(dq.mu), dq.block_size).to(dq.s2.dtype)
