r"""Normalisation layers (chapter 5): LayerNorm, RMSNorm, BatchNorm, GroupNorm and DeepNorm's residual.

Every layer here subtracts (or not) a mean and divides by a root-mean-square taken over some axes,
then applies a learned per-channel affine map. They differ in *which* axes the statistics use:

=============  ============================  ================================
layer          statistics over               used in
=============  ============================  ================================
LayerNorm      the features of one token     the original Transformer, GPT-2
RMSNorm        the features (no mean)        Llama, T5, most recent LLMs
BatchNorm      the batch (and positions)     convolutional vision networks
GroupNorm      groups of channels            vision models with small batches
=============  ============================  ================================

Variances are computed in two passes, :math:`\frac1d\sum_i(x_i-\mu)^2`, never as
:math:`E[x^2]-E[x]^2` (see :func:`variance_naive` for why).
"""

from __future__ import annotations

import math

import torch
from jaxtyping import Float
from torch import Tensor, nn

from llmbook._checks import (
    as_tensor,
    check_axis,
    check_dim,
    check_divisible,
    check_floating,
    check_module_input,
    check_positive_int,
    check_range,
    check_shape,
)
from llmbook._precision import restore_half, upcast_half
from llmbook.registry import implements

__all__ = [
    "variance",
    "variance_naive",
    "layer_norm",
    "layer_norm_naive",
    "LayerNorm",
    "rms_norm",
    "RMSNorm",
    "batch_norm",
    "BatchNorm",
    "group_norm",
    "GroupNorm",
    "deepnorm_constants",
    "DeepNormResidual",
]


def _check_eps(eps: float) -> None:
    check_range(eps, "eps", 0.0, math.inf)


def _like(y: Tensor, x: Tensor) -> Tensor:
    """``y`` back in ``x``'s dtype when ``x`` was fp16 / bf16 (statistics run in float32: 300**2 > 65504)."""
    return restore_half(y, x.dtype)


def _affine(y: Tensor, weight, bias, C: int, where: str) -> Tensor:
    for name, p in (("weight", weight), ("bias", bias)):
        if p is not None:
            check_shape(p, (C,), name, where)
            check_floating(p, name)  # a bool or integer scale would be promoted silently
    return y


def variance(x: Float[Tensor, "... d"], dim=-1, unbiased: bool = False, keepdim: bool = False) -> Tensor:
    r"""Two-pass variance :math:`\frac{1}{d}\sum_i (x_i-\mu)^2` (or :math:`\frac{1}{d-1}` when ``unbiased``).

    The mean is subtracted first, so the squares are of small, centred numbers and no digits cancel.
    fp16 / bf16 input is computed in float32 and returned in its own dtype (as ``torch.var``: a
    variance beyond the dtype's range is ``inf``, but no intermediate square overflows).

    >>> variance(torch.tensor([1.0, 2.0, 3.0]))
    tensor(0.6667)
    """
    x = as_tensor(x, "x")
    n = _count(x, dim)
    if n < (2 if unbiased else 1):
        raise ValueError(f"the {'unbiased ' if unbiased else ''}variance over dim {dim} needs at least "
                         f"{2 if unbiased else 1} value(s), got {n} (x of shape {tuple(x.shape)})")
    h = upcast_half(x)
    mu = h.mean(dim=dim, keepdim=True)
    ss = ((h - mu) ** 2).sum(dim=dim, keepdim=keepdim)
    return _like(ss / (n - 1 if unbiased else n), x)


def _count(x: Tensor, dim) -> int:
    """The number of entries reduced over ``dim`` (an axis or a sequence of axes of ``x``)."""
    dims = (dim,) if isinstance(dim, int) else tuple(dim)
    return math.prod(x.shape[check_axis(x, d, "x")] for d in dims)


def variance_naive(x: Float[Tensor, "... d"], dim=-1, keepdim: bool = False) -> Tensor:
    r"""One-pass :math:`E[x^2]-E[x]^2`: algebraically the variance, numerically a trap.

    When :math:`|\mu| \gg \sigma`, both terms are about :math:`\mu^2` and their difference loses
    every significant digit (it can even come out negative). Kept to show the failure; never used.

    >>> variance_naive(torch.tensor([1e4 + 1, 1e4 - 1]))  # the true variance is 1
    tensor(0.)
    """
    return (x * x).mean(dim=dim, keepdim=keepdim) - x.mean(dim=dim, keepdim=keepdim) ** 2


# --------------------------------------------------------------------------- 05.01 LayerNorm


@implements("05.01")
def layer_norm(x: Float[Tensor, "... d"], weight: Float[Tensor, " d"] | None = None,
               bias: Float[Tensor, " d"] | None = None, eps: float = 1e-5) -> Float[Tensor, "... d"]:
    r"""Normalise each feature vector to zero mean and unit variance, then scale and shift.

    .. math:: \mathrm{LN}(x) = \gamma\odot\frac{x-\mu}{\sqrt{\sigma^2+\epsilon}}+\beta,\quad
              \mu=\frac1d\sum_i x_i,\quad \sigma^2=\frac1d\sum_i (x_i-\mu)^2

    :math:`\gamma` is ``weight``, :math:`\beta` is ``bias`` (``None`` means 1 and 0), :math:`\epsilon`
    is ``eps``; statistics are over the last axis (the biased :math:`1/d` variance, as in torch).
    fp16 / bf16 input is normalised in float32 and returned in its own dtype, as torch does.
    Shape ``(..., d) -> (..., d)``.

    >>> layer_norm(torch.tensor([1.0, 2.0, 3.0]), eps=0.0)
    tensor([-1.2247,  0.0000,  1.2247])
    """
    x = as_tensor(x, "x")
    check_dim(x, "x", "(..., d)")
    _check_eps(eps)
    d = x.shape[-1]
    _affine(x, weight, bias, d, "the last dim d of x")
    h = upcast_half(x)
    mu = h.mean(-1, keepdim=True)
    var = ((h - mu) ** 2).mean(-1, keepdim=True)  # two-pass
    y = (h - mu) * torch.rsqrt(var + eps)
    if weight is not None:
        y = y * weight
    if bias is not None:
        y = y + bias
    return _like(y, x)


def layer_norm_naive(x: Float[Tensor, "... d"], eps: float = 1e-5) -> Float[Tensor, "... d"]:
    r"""LayerNorm with the one-pass variance :math:`E[x^2]-E[x]^2` (no affine): fails for large offsets.

    >>> layer_norm_naive(torch.tensor([1.0, 2.0, 3.0]), eps=0.0)
    tensor([-1.2247,  0.0000,  1.2247])
    """
    x = as_tensor(x, "x")
    mu = x.mean(-1, keepdim=True)
    var = variance_naive(x, -1, keepdim=True)
    return (x - mu) / torch.sqrt(var + eps)


class LayerNorm(nn.Module):
    """:func:`layer_norm` with learned ``weight`` (ones) and ``bias`` (zeros); same state names as ``nn.LayerNorm``.

    >>> LayerNorm(3)(torch.tensor([[1.0, 2.0, 3.0]])).shape
    torch.Size([1, 3])
    """

    def __init__(self, d: int, eps: float = 1e-5, bias: bool = True):
        super().__init__()
        d = check_positive_int(d, "d")
        _check_eps(eps)
        self.d, self.eps = d, eps
        self.weight = nn.Parameter(torch.ones(d))
        self.bias = nn.Parameter(torch.zeros(d)) if bias else None

    def forward(self, x: Float[Tensor, "... d"]) -> Float[Tensor, "... d"]:
        return layer_norm(x, self.weight, self.bias, self.eps)

    def extra_repr(self) -> str:
        return f"{self.d}, eps={self.eps}"


# --------------------------------------------------------------------------- 05.02 RMSNorm


@implements("05.02")
def rms_norm(x: Float[Tensor, "... d"], weight: Float[Tensor, " d"] | None = None,
             eps: float = 1e-6) -> Float[Tensor, "... d"]:
    r"""Divide each feature vector by its root mean square; no mean subtraction, no bias.

    .. math:: \mathrm{RMSNorm}(x)=\gamma\odot\frac{x}{\sqrt{\frac1d\sum_i x_i^2+\epsilon}}

    :math:`\gamma` is ``weight`` (``None`` means 1), :math:`\epsilon` is ``eps``. Computed like
    Llama's ``LlamaRMSNorm``: half-precision inputs are upcast to float32, ``x * rsqrt(mean(x^2) + eps)``
    is formed there, cast back to the input dtype, then multiplied by ``weight`` (float64 stays
    float64). Shape ``(..., d) -> (..., d)``.

    >>> rms_norm(torch.tensor([3.0, 4.0]), eps=0.0)  # rms = sqrt(12.5)
    tensor([0.8485, 1.1314])
    """
    x = as_tensor(x, "x")
    check_dim(x, "x", "(..., d)")
    _check_eps(eps)
    _affine(x, weight, None, x.shape[-1], "the last dim d of x")
    h = upcast_half(x)
    h = _like(h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps), x)
    return h if weight is None else weight * h


class RMSNorm(nn.Module):
    """:func:`rms_norm` with a learned ``weight`` initialised to ones (same state name as Llama's).

    >>> RMSNorm(2)(torch.tensor([3.0, 4.0])).shape
    torch.Size([2])
    """

    def __init__(self, d: int, eps: float = 1e-6):
        super().__init__()
        d = check_positive_int(d, "d")
        _check_eps(eps)
        self.d, self.eps = d, eps
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x: Float[Tensor, "... d"]) -> Float[Tensor, "... d"]:
        return rms_norm(x, self.weight, self.eps)

    def extra_repr(self) -> str:
        return f"{self.d}, eps={self.eps}"


# --------------------------------------------------------------------------- 05.03 BatchNorm


def _channel_affine(y: Tensor, weight: Tensor | None, bias: Tensor | None, shape: list[int]) -> Tensor:
    """The per-channel scale and shift shared by BatchNorm and GroupNorm (``weight``/``bias`` viewed as ``shape``)."""
    if weight is not None:
        y = y * weight.view(shape)
    if bias is not None:
        y = y + bias.view(shape)
    return y


@implements("05.03")
def batch_norm(x: Float[Tensor, "B C *S"], running_mean: Tensor | None = None, running_var: Tensor | None = None,
               weight: Tensor | None = None, bias: Tensor | None = None, training: bool = True,
               momentum: float = 0.1, eps: float = 1e-5) -> Float[Tensor, "B C *S"]:
    r"""Normalise each channel with statistics over the batch (and any spatial / time axes).

    .. math:: \mathrm{BN}(x)=\gamma\,\frac{x-\mu_B}{\sqrt{\sigma_B^2+\epsilon}}+\beta

    ``x`` is ``(B, C)`` or ``(B, C, *S)``; :math:`\mu_B, \sigma_B^2` are per channel over the ``N = B * prod(S)``
    entries. In training the *biased* :math:`\sigma_B^2` normalises, and the running estimates are
    updated in place with the *unbiased* one:

    .. math:: \hat\mu \leftarrow (1-\rho)\hat\mu + \rho\,\mu_B,\qquad
              \hat\sigma^2 \leftarrow (1-\rho)\hat\sigma^2 + \rho\,\tfrac{N}{N-1}\sigma_B^2

    (:math:`\rho` is ``momentum``). In evaluation (``training=False``) the running estimates replace
    :math:`\mu_B, \sigma_B^2`, so the output no longer depends on the rest of the batch. Same
    argument order as ``torch.nn.functional.batch_norm``; fp16 / bf16 input is normalised in float32
    and returned in its own dtype.

    >>> batch_norm(torch.tensor([[1.0], [3.0]]), eps=0.0)
    tensor([[-1.],
            [ 1.]])
    """
    x = as_tensor(x, "x")
    check_dim(x, "x", "(B, C, *S)", min_dim=2)
    _check_eps(eps)
    check_range(momentum, "momentum", 0.0, 1.0)
    C = x.shape[1]
    _affine(x, weight, bias, C, "the channel dim C of x")
    for name, r in (("running_mean", running_mean), ("running_var", running_var)):
        if r is not None:
            check_shape(r, (C,), name, "the channel dim C of x")
            check_floating(r, name)
    dims = [0] + list(range(2, x.ndim))
    shape = [1, C] + [1] * (x.ndim - 2)
    h = upcast_half(x)
    if training:
        N = _count(x, dims)
        if N < 2:
            raise ValueError(f"batch statistics need more than one value per channel, got N = {N} "
                             f"for x of shape {tuple(x.shape)}")
        mu = h.mean(dim=dims)
        var = ((h - mu.view(shape)) ** 2).mean(dim=dims)  # biased: used to normalise
        if running_mean is not None and running_var is not None:
            with torch.no_grad():
                running_mean.mul_(1 - momentum).add_(momentum * mu)
                running_var.mul_(1 - momentum).add_(momentum * var * N / (N - 1))  # unbiased estimate
    else:
        if running_mean is None or running_var is None:
            raise ValueError("evaluation mode (training=False) needs running_mean and running_var")
        mu, var = upcast_half(running_mean), upcast_half(running_var)
    y = (h - mu.view(shape)) * torch.rsqrt(var.view(shape) + eps)
    return _like(_channel_affine(y, weight, bias, shape), x)


class BatchNorm(nn.Module):
    """:func:`batch_norm` with learned affine and running buffers (same state names as ``nn.BatchNorm1d``).

    >>> bn = BatchNorm(3)
    >>> _ = bn(torch.randn(8, 3))
    >>> bn.running_mean.shape
    torch.Size([3])
    """

    def __init__(self, C: int, eps: float = 1e-5, momentum: float = 0.1):
        super().__init__()
        C = check_positive_int(C, "C")
        _check_eps(eps)
        check_range(momentum, "momentum", 0.0, 1.0)
        self.C, self.eps, self.momentum = C, eps, momentum
        self.weight = nn.Parameter(torch.ones(C))
        self.bias = nn.Parameter(torch.zeros(C))
        self.register_buffer("running_mean", torch.zeros(C))
        self.register_buffer("running_var", torch.ones(C))

    def forward(self, x: Float[Tensor, "B C *S"]) -> Float[Tensor, "B C *S"]:
        return batch_norm(x, self.running_mean, self.running_var, self.weight, self.bias, self.training,
                          self.momentum, self.eps)


# --------------------------------------------------------------------------- 05.04 GroupNorm


@implements("05.04")
def group_norm(x: Float[Tensor, "B C *S"], G: int, weight: Tensor | None = None, bias: Tensor | None = None,
               eps: float = 1e-5) -> Float[Tensor, "B C *S"]:
    r"""Normalise each sample over groups of ``C/G`` channels (and all spatial positions).

    .. math:: \mathrm{GN}(x)=\gamma\,\frac{x-\mu_G}{\sqrt{\sigma_G^2+\epsilon}}+\beta

    Independent of the batch, like LayerNorm; ``G = 1`` is LayerNorm over ``(C, *S)``, ``G = C`` is
    InstanceNorm. ``weight`` / ``bias`` are per channel. fp16 / bf16 input is normalised in float32
    and returned in its own dtype. Shape ``(B, C, *S) -> (B, C, *S)``.

    >>> group_norm(torch.tensor([[1.0, 3.0, 5.0, 9.0]]), G=2, eps=0.0)
    tensor([[-1.,  1., -1.,  1.]])
    """
    x = as_tensor(x, "x")
    check_dim(x, "x", "(B, C, *S)", min_dim=2)
    _check_eps(eps)
    B, C = x.shape[:2]
    G = check_positive_int(G, "G (the number of groups)")
    check_divisible(C, G, "the number of channels C", "the number of groups G")
    _affine(x, weight, bias, C, "the channel dim C of x")
    g = upcast_half(x).reshape(B, G, math.prod(x.shape[1:]) // G)  # explicit: B = 0 leaves -1 undetermined
    mu = g.mean(-1, keepdim=True)
    var = ((g - mu) ** 2).mean(-1, keepdim=True)
    y = ((g - mu) * torch.rsqrt(var + eps)).reshape(x.shape)
    shape = [1, C] + [1] * (x.ndim - 2)
    return _like(_channel_affine(y, weight, bias, shape), x)


class GroupNorm(nn.Module):
    """:func:`group_norm` with learned per-channel ``weight`` and ``bias`` (as ``nn.GroupNorm``).

    >>> GroupNorm(2, 4)(torch.randn(3, 4, 5)).shape
    torch.Size([3, 4, 5])
    """

    def __init__(self, G: int, C: int, eps: float = 1e-5):
        super().__init__()
        G, C = check_positive_int(G, "G (the number of groups)"), check_positive_int(C, "C")
        check_divisible(C, G, "the number of channels C", "the number of groups G")
        _check_eps(eps)
        self.G, self.C, self.eps = G, C, eps
        self.weight = nn.Parameter(torch.ones(C))
        self.bias = nn.Parameter(torch.zeros(C))

    def forward(self, x: Float[Tensor, "B C *S"]) -> Float[Tensor, "B C *S"]:
        return group_norm(x, self.G, self.weight, self.bias, self.eps)


# --------------------------------------------------------------------------- 05.05 DeepNorm


def deepnorm_constants(N: int, M: int | None = None, *, part: str = "decoder") -> tuple[float, float]:
    r"""DeepNet's residual up-weighting :math:`\alpha` and initialisation down-scaling :math:`\beta`.

    ``N`` encoder layers, ``M`` decoder layers (Wang et al., 2022, table 1):

    ======================  ===========================  ==============================
    architecture            :math:`\alpha`               :math:`\beta`
    ======================  ===========================  ==============================
    decoder-only (``M``)    :math:`(2M)^{1/4}`           :math:`(8M)^{-1/4}`
    encoder-only (``N``)    :math:`(2N)^{1/4}`           :math:`(8N)^{-1/4}`
    enc-dec, encoder        :math:`0.81(N^4M)^{1/16}`    :math:`0.87(N^4M)^{-1/16}`
    enc-dec, decoder        :math:`(3M)^{1/4}`           :math:`(12M)^{-1/4}`
    ======================  ===========================  ==============================

    Call ``deepnorm_constants(L)`` for a decoder-only (or encoder-only) stack of ``L`` layers, and
    ``deepnorm_constants(N, M, part="encoder" | "decoder")`` for an encoder-decoder model.

    >>> [round(v, 4) for v in deepnorm_constants(12)]
    [2.2134, 0.3195]
    """
    for name, v in (("N", N), ("M", M)):
        if v is not None:
            check_positive_int(v, f"the layer count {name}")
    if part not in ("encoder", "decoder"):
        raise ValueError(f"part must be 'encoder' or 'decoder', got {part!r}")
    if M is None:  # a single stack of N layers
        return (2 * N) ** 0.25, (8 * N) ** -0.25
    if part == "encoder":
        return 0.81 * (N ** 4 * M) ** (1 / 16), 0.87 * (N ** 4 * M) ** (-1 / 16)
    return (3 * M) ** 0.25, (12 * M) ** -0.25


@implements("05.05")
class DeepNormResidual(nn.Module):
    r"""Post-LN residual with the skip branch up-weighted: :math:`x_{l+1} = \mathrm{LN}(\alpha x_l + G_l(x_l))`.

    ``sublayer`` is :math:`G_l` (attention or FFN), ``alpha`` is :math:`\alpha` (see
    :func:`deepnorm_constants`). :meth:`init_` scales the sublayer's weight matrices by ``beta``
    (DeepNet applies it to the FFN, value and output projections), keeping each update small so that
    a 1000-layer post-LN stack still trains. Shape ``(..., d) -> (..., d)``.

    >>> block = DeepNormResidual(4, nn.Identity(), alpha=1.0)
    >>> block(torch.tensor([1.0, 2.0, 3.0, 4.0])).shape
    torch.Size([4])
    """

    def __init__(self, d: int, sublayer: nn.Module, alpha: float, eps: float = 1e-5):
        super().__init__()
        check_range(alpha, "alpha", 0.0, math.inf, low_open=True)
        self.alpha = float(alpha)
        self.sublayer = sublayer
        self.norm = LayerNorm(d, eps)

    @torch.no_grad()
    def init_(self, beta: float, skip: tuple[str, ...] = ("q_proj", "k_proj")) -> DeepNormResidual:
        """Multiply the ``nn.Linear`` weights inside the sublayer by ``beta``, except those whose name ends
        in one of ``skip`` (queries and keys keep their scale in DeepNet); returns ``self``."""
        check_range(beta, "beta", 0.0, math.inf, low_open=True)
        for name, m in self.sublayer.named_modules():
            if isinstance(m, nn.Linear) and not name.endswith(skip):
                m.weight.mul_(beta)
        return self

    def forward(self, x: Float[Tensor, "... d"]) -> Float[Tensor, "... d"]:
        x = check_module_input(self, x, d=self.norm.d, symbol="d", contract="(..., d)")
        # fp16 / bf16: the up-weighted sum alpha x + G(x) is formed in float32 (it can exceed 65504)
        return _like(self.norm(self.alpha * upcast_half(x) + upcast_half(self.sublayer(x))), x)
