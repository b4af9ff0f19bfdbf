r"""Storage formats of quantised weights (chapter 12): group-wise grids, FP8, packed int4 and their true size.

Chapter 12's methods choose *values*; this module says how they are *stored* and what that costs:

* :func:`group_quantize` / :func:`group_dequantize`: one min/max (or absmax) grid per group of ``group_size``
  consecutive weights of a row, the "g128" of GPTQ and AWQ checkpoints;
* :func:`fp8_round` / :func:`fp8_quantize`: rounding to the 8-bit floating-point formats E4M3 and E5M2;
* :func:`pack_int4` / :func:`unpack_int4`: two 4-bit codes per byte, and :func:`pack_int4_groupwise`, a real
  packed g128 weight (:class:`PackedInt4`) whose ``nbytes`` are the bytes actually stored;
* :func:`bits_per_weight`: the effective bits per weight, scales and zero points included.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from llmbook._checks import check_choice, check_dim, check_int, check_integer_tensor
from llmbook.lm.quantization import _bits, _grid, _x

__all__ = ["group_quantize", "group_dequantize", "FP8_FORMATS", "fp8_round", "fp8_quantize", "pack_int4",
           "unpack_int4", "PackedInt4", "pack_int4_groupwise", "bits_per_weight", "model_bits_per_weight",
           "quantize_model_format"]


def _groups(W: Tensor, group_size: int) -> Tensor:
    """``W (d_out, d_in)`` as ``(d_out, n_groups, group_size)``, the last group padded with zeros."""
    d_out, d_in = W.shape
    n_groups = -(-d_in // group_size)
    pad = n_groups * group_size - d_in
    return torch.nn.functional.pad(W, (0, pad)).view(d_out, n_groups, group_size)


def group_quantize(W: Tensor, b: int = 4, group_size: int = 128,
                   symmetric: bool = False) -> tuple[Tensor, Tensor, Tensor]:
    r"""Quantise each group :math:`g` of ``group_size`` consecutive weights of a row on its own grid.

    .. math:: s_{c,g}=\frac{\max_{i\in g} W_{c,i}-\min_{i\in g} W_{c,i}}{2^b-1},\qquad
              q_{c,i}=\mathrm{clip}\big(\mathrm{round}(W_{c,i}/s_{c,g})+z_{c,g},\,0,\,2^b-1\big)

    (the min/max grid of :func:`~llmbook.lm.quantization.asymmetric_quantize`, its range widened to 0;
    ``symmetric=True``: the absmax grid, :math:`z = 0`). Per-channel quantisation is the case
    ``group_size = d_in``. ``W`` is ``(d_out, d_in)``; a last group shorter than ``group_size`` is padded with
    zeros, which changes neither grid since both contain 0. Returns ``(q, s, z)``: ``q`` ``(d_out, d_in)``
    int64, ``s`` and ``z`` ``(d_out, n_groups)``.

    >>> q, s, z = group_quantize(torch.tensor([[0.0, 1.0, -2.0, 2.0]]), b=2, group_size=2)
    >>> q.tolist(), s.tolist(), z.tolist()
    ([[0, 3, 0, 3]], [[0.3333333432674408, 1.3333333730697632]], [[0, 2]])
    """
    W = _x(W, "W")
    check_dim(W, "W", "(d_out, d_in)", min_dim=2, max_dim=2)
    b, group_size = _bits(b), check_int(group_size, "group_size", low=1)
    if not isinstance(symmetric, bool):
        raise TypeError(f"symmetric must be a bool, got {symmetric!r}")
    Wg = _groups(W.float() if W.dtype in (torch.float16, torch.bfloat16) else W, group_size)
    grid = _grid(Wg, b, symmetric, -1)
    q = grid.q(Wg).flatten(1)[:, :W.shape[1]].long()
    return q, grid.s.squeeze(-1), grid.z.squeeze(-1).long()


def group_dequantize(q: Tensor, s: Tensor, z: Tensor, group_size: int = 128) -> Tensor:
    r"""Dequantise groups: :math:`\hat W_{c,i} = s_{c,g(i)}\,(q_{c,i} - z_{c,g(i)})`, :math:`g(i) = \lfloor i/G\rfloor`.

    :math:`G` is ``group_size``.
    ``q`` ``(d_out, d_in)``, ``s`` and ``z`` ``(d_out, n_groups)`` as :func:`group_quantize` returns them.

    >>> group_dequantize(torch.tensor([[0, 3, 0, 3]]), torch.tensor([[0.5, 1.0]]), torch.tensor([[0, 2]]), 2)
    tensor([[ 0.0000,  1.5000, -2.0000,  1.0000]])
    """
    q = check_integer_tensor(q, "q", "(d_out, d_in) integer codes")
    group_size = check_int(group_size, "group_size", low=1)
    if q.ndim != 2 or s.shape != (q.shape[0], -(-q.shape[1] // group_size)) or z.shape != s.shape:
        raise ValueError(f"q must be (d_out, d_in) and s, z (d_out, ceil(d_in / group_size)), got {tuple(q.shape)}, "
                         f"{tuple(s.shape)}, {tuple(z.shape)} with group_size = {group_size}")
    idx = torch.arange(q.shape[1]) // group_size
    return s[:, idx] * (q - z[:, idx]).to(s.dtype)


# --------------------------------------------------------------------------- FP8

#: ``(exponent bits, mantissa bits, exponent bias, largest finite value)`` of the OCP FP8 formats. E4M3 has no
#: infinities and one NaN pattern, which frees the top binade up to 448; E5M2 is IEEE-like (max 57344).
FP8_FORMATS = {"e4m3": (4, 3, 7, 448.0), "e5m2": (5, 2, 15, 57344.0)}


def fp8_round(x: Tensor, fmt: str = "e4m3") -> Tensor:
    r"""Round ``x`` to the nearest value of an FP8 format (ties to even), saturating at its largest value.

    A normal FP8 number is :math:`(-1)^{\mathrm{sign}}\,2^{e}\,(1 + f/2^{M})` with :math:`M` mantissa bits, so
    in the binade :math:`[2^e, 2^{e+1})` the step is :math:`2^{e-M}`; below the smallest normal
    :math:`2^{1-\mathrm{bias}}` the step stays :math:`2^{1-\mathrm{bias}-M}` (subnormals). Hence

    .. math:: \mathrm{fp8}(x) = \mathrm{sign}(x)\,\min\Big(x_{max},\ 2^{e-M}\,\mathrm{round}\big(|x|/2^{e-M}\big)\Big),
              \qquad e=\max\big(\lfloor\log_2|x|\rfloor,\ 1-\mathrm{bias}\big)

    ``fmt`` is ``"e4m3"`` (:math:`M = 3`, bias 7, :math:`x_{max} = 448`) or ``"e5m2"`` (:math:`M = 2`, bias 15,
    :math:`x_{max} = 57344`). Returns the rounded values in ``x``'s dtype (float32 or float64), shape of ``x``.
    It computes what ``x.to(torch.float8_e4m3fn)`` stores, with arithmetic instead of bit patterns; beyond
    :math:`x_{max}` it saturates (E5M2's cast gives inf there).

    >>> fp8_round(torch.tensor([0.3, 1.0625, 500.0]), "e4m3").tolist()
    [0.3125, 1.0, 448.0]
    """
    x = _x(x)
    check_choice(fmt, "fmt", tuple(FP8_FORMATS))
    _, M, bias, x_max = FP8_FORMATS[fmt]
    h = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x
    a = h.abs()
    _, exp = torch.frexp(torch.where(a > 0, a, torch.ones_like(a)))  # a = m 2^exp, m in [0.5, 1)
    e = torch.clamp(exp - 1, min=1 - bias)
    step = torch.ldexp(torch.ones_like(h), e - M)
    return torch.sign(h) * torch.clamp(torch.round(a / step) * step, max=x_max)


def fp8_quantize(W: Tensor, fmt: str = "e4m3") -> tuple[Tensor, Tensor]:
    r"""FP8 weights with one scale per output row: :math:`s_c = \max_i |W_{c,i}| / x_{max}`,
    :math:`\hat W_{c,i} = s_c\,\mathrm{fp8}(W_{c,i}/s_c)` (:func:`fp8_round`).

    ``W`` is ``(d_out, d_in)``. Returns ``(W_hat, s)``, ``s`` of shape ``(d_out, 1)`` (1 for an all-zero row).

    >>> W_hat, s = fp8_quantize(torch.tensor([[448.0, 1.0]]))
    >>> W_hat.tolist(), s.tolist()
    ([[448.0, 1.0]], [[1.0]])
    """
    W = _x(W, "W")
    check_dim(W, "W", "(d_out, d_in)", min_dim=2, max_dim=2)
    check_choice(fmt, "fmt", tuple(FP8_FORMATS))
    x_max = FP8_FORMATS[fmt][3]
    amax = W.abs().amax(1, keepdim=True) if W.numel() else W.new_ones(W.shape[0], 1)
    s = torch.where(amax > 0, amax / x_max, torch.ones_like(amax))
    return s * fp8_round(W / s, fmt), s


# --------------------------------------------------------------------------- packed int4


def pack_int4(q: Tensor) -> Tensor:
    r"""Two 4-bit codes per byte along the last axis: byte :math:`j` holds :math:`q_{2j} + 16\,q_{2j+1}`.

    ``q`` holds integers in :math:`[0, 15]` (the unsigned codes of a 4-bit min/max grid), shape ``(..., n)``;
    an odd ``n`` is padded with a zero code. Returns ``uint8`` of shape ``(..., ceil(n / 2))``.

    >>> pack_int4(torch.tensor([1, 2, 15])).tolist()
    [33, 15]
    """
    q = check_integer_tensor(q, "q", "integer codes in [0, 15]")
    if q.ndim == 0:
        raise ValueError("q must have at least one axis (codes are packed along the last one)")
    if q.numel() and (q.min() < 0 or q.max() > 15):
        raise ValueError(f"q must hold 4-bit codes in [0, 15], got values from {int(q.min())} to {int(q.max())}")
    if q.shape[-1] % 2:
        q = torch.nn.functional.pad(q, (0, 1))
    q = q.to(torch.uint8)
    return q[..., 0::2] | (q[..., 1::2] << 4)


def unpack_int4(packed: Tensor, n: int) -> Tensor:
    """The inverse of :func:`pack_int4`: ``uint8`` ``(..., ceil(n / 2))`` to int64 codes ``(..., n)``.

    >>> unpack_int4(torch.tensor([33, 15], dtype=torch.uint8), 3).tolist()
    [1, 2, 15]
    """
    if not isinstance(packed, Tensor) or packed.dtype != torch.uint8:
        raise TypeError(f"packed must be a uint8 tensor from pack_int4, got {type(packed).__name__} "
                        f"{getattr(packed, 'dtype', '')}")
    n = check_int(n, "n", low=0)
    if packed.ndim == 0 or packed.shape[-1] != -(-n // 2):
        raise ValueError(f"packed must have ceil(n / 2) = {-(-n // 2)} bytes on its last axis, got shape "
                         f"{tuple(packed.shape)}")
    both = torch.stack([packed & 0x0F, packed >> 4], dim=-1).flatten(-2)
    return both[..., :n].long()


@dataclass(frozen=True)
class PackedInt4:
    """A 4-bit group-wise weight as stored: ``codes`` and ``zeros`` packed two per byte, ``scales`` in float16."""

    codes: Tensor   # uint8 (d_out, ceil(d_in / 2))
    zeros: Tensor   # uint8 (d_out, ceil(n_groups / 2))
    scales: Tensor  # float16 (d_out, n_groups)
    d_in: int
    group_size: int

    @property
    def nbytes(self) -> int:
        """Bytes of the three stored tensors (exact, deterministic)."""
        return sum(t.numel() * t.element_size() for t in (self.codes, self.zeros, self.scales))

    def dequantize(self) -> Tensor:
        r""":math:`\hat W = s\,(q - z)` in float32, ``(d_out, d_in)``, with the float16 scales."""
        q = unpack_int4(self.codes, self.d_in)
        z = unpack_int4(self.zeros, self.scales.shape[1])
        return group_dequantize(q, self.scales.float(), z, self.group_size)


def pack_int4_groupwise(W: Tensor, group_size: int = 128) -> PackedInt4:
    r"""Quantise ``W (d_out, d_in)`` to 4 bits per group (:func:`group_quantize`, min/max grid) and pack it.

    The codes are computed with the scale rounded to float16 first (the scale that is stored), so that
    :meth:`PackedInt4.dequantize` is exactly :math:`s_{16}(q - z)` on the grid the codes were rounded to.

    >>> p = pack_int4_groupwise(torch.ones(4, 256))
    >>> p.codes.shape, p.zeros.shape, p.scales.dtype, p.nbytes
    (torch.Size([4, 128]), torch.Size([4, 1]), torch.float16, 532)
    """
    W = _x(W, "W")
    check_dim(W, "W", "(d_out, d_in)", min_dim=2, max_dim=2)
    group_size = check_int(group_size, "group_size", low=1)
    Wg = _groups(W.float(), group_size)
    _, s, z = group_quantize(W.float(), 4, group_size)
    s16 = s.half()
    q = torch.clamp(torch.round(Wg / s16.float()[..., None]) + z[..., None], 0, 15).flatten(1)[:, :W.shape[1]]
    return PackedInt4(pack_int4(q.long()), pack_int4(z), s16, W.shape[1], group_size)


def bits_per_weight(b: int, group_size: int, scale_bits: int = 16, zero_bits: int = 0) -> float:
    r"""Effective storage per weight: :math:`b + (\text{scale bits} + \text{zero-point bits}) / \text{group size}`.

    Per-channel quantisation of a ``(d_out, d_in)`` matrix is ``group_size = d_in``; NF4 with a float32 absmax
    per 64 weights is ``bits_per_weight(4, 64, 32)`` = 4.5.

    >>> bits_per_weight(4, 128, 16, 4), bits_per_weight(4, 64, 32)
    (4.15625, 4.5)
    """
    b = check_int(b, "b", low=1, high=32)
    group_size = check_int(group_size, "group_size", low=1)
    scale_bits, zero_bits = check_int(scale_bits, "scale_bits", low=0), check_int(zero_bits, "zero_bits", low=0)
    return b + (scale_bits + zero_bits) / group_size


def model_bits_per_weight(model: nn.Module, b: int, group_size: int | None = None, scale_bits: int = 16,
                          zero_bits: int = 0) -> float:
    r"""Effective bits per weight over every ``nn.Linear`` of ``model``, scales and zero points included:

    .. math:: \frac{\sum_\ell d_{out}^\ell d_{in}^\ell\, b + d_{out}^\ell \lceil d_{in}^\ell / G\rceil
              (\text{scale bits} + \text{zero bits})}{\sum_\ell d_{out}^\ell d_{in}^\ell}

    with groups of :math:`G` = ``group_size`` along each row (``None``: one group per row, per-channel).

    >>> model_bits_per_weight(nn.Sequential(nn.Linear(256, 2)), 4, 128, 16, 4)
    4.15625
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    b = check_int(b, "b", low=1, high=32)
    scale_bits, zero_bits = check_int(scale_bits, "scale_bits", low=0), check_int(zero_bits, "zero_bits", low=0)
    n = bits = 0
    for lin in model.modules():
        if isinstance(lin, nn.Linear):
            d_out, d_in = lin.weight.shape
            G = d_in if group_size is None else check_int(group_size, "group_size", low=1)
            n += d_out * d_in
            bits += d_out * d_in * b + d_out * -(-d_in // G) * (scale_bits + zero_bits)
    if n == 0:
        raise ValueError("model has no nn.Linear layer")
    return bits / n


@torch.no_grad()
def quantize_model_format(model: nn.Module, fmt: str, b: int = 4, group_size: int = 128) -> nn.Module:
    r"""A copy of ``model`` with every ``nn.Linear`` weight stored dequantised in format ``fmt``.

    ``fmt``: ``"group"`` (:func:`group_quantize`, min/max grid, ``b`` bits, groups of ``group_size``),
    ``"e4m3"`` or ``"e5m2"`` (:func:`fp8_quantize`, one scale per row). Embeddings, norms and a tied head stay
    in float, as in :func:`llmbook.lm.gptq.quantize_model`; ``model`` is not modified.

    >>> lin = nn.Sequential(nn.Linear(4, 2))
    >>> m8 = quantize_model_format(lin, "e4m3")
    >>> bool((m8[0].weight - lin[0].weight).abs().max() < 0.05 * lin[0].weight.abs().max())
    True
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    check_choice(fmt, "fmt", ("group", *FP8_FORMATS))
    new = copy.deepcopy(model).eval()
    for lin in new.modules():
        if isinstance(lin, nn.Linear):
            W = lin.weight.detach()
            if fmt == "group":
                W_hat = group_dequantize(*group_quantize(W, b, group_size), group_size=group_size)
            else:
                W_hat = fp8_quantize(W, fmt)[0]
            lin.weight.copy_(W_hat.to(W.dtype))
    return new
