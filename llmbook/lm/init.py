r"""Weight initialisation (chapter 2, ids 02.10-02.11): Xavier/Glorot and He/Kaiming.

Both pick the variance of a layer's weights from its *fans* so that signals neither explode nor vanish
as they pass through many layers. For a weight ``W`` of ``nn.Linear`` layout ``(n_out, n_in)``,
:math:`n_{in}` is the number of inputs each output sums over (``fan_in``) and :math:`n_{out}` the number
of outputs each input feeds (``fan_out``); convolution kernels ``(out, in, *k)`` multiply both by the
receptive field :math:`\prod k`.

* Xavier (Glorot & Bengio, 2010) keeps the variance of activations *and* of gradients for a linear
  (or tanh-like) network: :math:`\mathrm{Var}(W) = 2/(n_{in} + n_{out})`.
* He (He et al., 2015) accounts for ReLU zeroing half of its inputs: :math:`\mathrm{Var}(W) = 2/n_{in}`.

Every initialiser fills ``W`` in place (without recording gradients), returns it, and takes an optional
``generator``; a ``gain`` multiplies the standard deviation (:func:`gain` gives the usual values).
"""

from __future__ import annotations

import math

import torch
from jaxtyping import Float
from torch import Tensor

from llmbook._checks import check_floating, check_positive_int, check_range
from llmbook.registry import implements

__all__ = [
    "fans",
    "gain",
    "xavier_bound",
    "xavier_uniform_",
    "xavier_normal_",
    "he_std",
    "he_normal_",
    "he_uniform_",
    "activation_second_moments",
]


def fans(W: Tensor) -> tuple[int, int]:
    r"""``(fan_in, fan_out)`` of a weight ``(n_out, n_in, *kernel)``: :math:`(n_{in}\prod k,\ n_{out}\prod k)`.

    >>> fans(torch.empty(3, 5))  # nn.Linear(5, 3).weight
    (5, 3)
    >>> fans(torch.empty(8, 4, 3, 3))  # nn.Conv2d(4, 8, 3).weight
    (36, 72)
    """
    if not isinstance(W, Tensor):
        raise TypeError(f"W must be a tensor, got {type(W).__name__}")
    if W.ndim < 2:
        raise ValueError(f"W must have shape (n_out, n_in, *kernel) with at least 2 dims to have fans, "
                         f"got {tuple(W.shape)}")
    receptive = math.prod(W.shape[2:])
    return W.shape[1] * receptive, W.shape[0] * receptive


def gain(nonlinearity: str = "linear", a: float = 0.01) -> float:
    r"""Standard-deviation gain of a non-linearity: 1 (linear, sigmoid), 5/3 (tanh), :math:`\sqrt 2` (relu).

    ``leaky_relu`` with negative slope ``a`` gives :math:`\sqrt{2/(1+a^2)}`, ``selu`` gives 3/4. The gain
    of ReLU is :math:`\sqrt 2` because ReLU keeps half of a symmetric input's second moment.

    >>> round(gain("relu") ** 2, 12)
    2.0
    """
    table = {"linear": 1.0, "identity": 1.0, "sigmoid": 1.0, "tanh": 5.0 / 3, "relu": math.sqrt(2.0),
             "selu": 3.0 / 4}
    if nonlinearity == "leaky_relu":
        check_range(a, "a", 0.0)
        return math.sqrt(2.0 / (1 + a**2))
    if nonlinearity not in table:
        raise ValueError(f"nonlinearity must be one of {sorted(table) + ['leaky_relu']}, got {nonlinearity!r}")
    return table[nonlinearity]


def _gain(g) -> float:
    check_range(g, "gain", 0.0, low_open=True)
    return float(g)


def xavier_bound(n_in: int, n_out: int, gain: float = 1.0) -> float:
    r"""Half-width :math:`a = \mathrm{gain}\sqrt{6/(n_{in}+n_{out})}` of the Xavier range; variance :math:`a^2/3`.

    >>> xavier_bound(2, 4)
    1.0
    """
    n_in, n_out = check_positive_int(n_in, "n_in"), check_positive_int(n_out, "n_out")
    return _gain(gain) * math.sqrt(6.0 / (n_in + n_out))


@implements("02.10")
def xavier_uniform_(W: Float[Tensor, "n_out n_in *k"], gain: float = 1.0,
                    generator: torch.Generator | None = None) -> Tensor:
    r"""Xavier (Glorot) uniform initialisation, in place.

    .. math:: W_{ij} \sim U\Big[-\sqrt{\tfrac{6}{n_{in}+n_{out}}},\ \sqrt{\tfrac{6}{n_{in}+n_{out}}}\Big]

    The variance of :math:`U[-a, a]` is :math:`a^2/3 = 2/(n_{in}+n_{out})`: the average of the value
    :math:`1/n_{in}` that preserves forward activations and :math:`1/n_{out}` that preserves backward
    gradients. ``gain`` scales the bound (:func:`gain`). :math:`n_{in}, n_{out}` come from :func:`fans`.

    >>> W = xavier_uniform_(torch.empty(4, 2), generator=torch.Generator().manual_seed(0))
    >>> bool(W.abs().max() <= 1.0)  # a = sqrt(6 / 6) = 1
    True
    """
    check_floating(W, "W")
    n_in, n_out = fans(W)
    a = xavier_bound(n_in, n_out, gain)
    with torch.no_grad():
        return W.uniform_(-a, a, generator=generator)


def xavier_normal_(W: Float[Tensor, "n_out n_in *k"], gain: float = 1.0,
                   generator: torch.Generator | None = None) -> Tensor:
    r"""Xavier normal: :math:`W_{ij} \sim \mathcal{N}(0, \mathrm{gain}^2 \cdot 2/(n_{in}+n_{out}))`.

    >>> xavier_normal_(torch.empty(3, 3)).shape
    torch.Size([3, 3])
    """
    check_floating(W, "W")
    n_in, n_out = fans(W)
    std = _gain(gain) * math.sqrt(2.0 / (n_in + n_out))
    with torch.no_grad():
        return W.normal_(0.0, std, generator=generator)


def he_std(n: int, nonlinearity: str = "relu", a: float = 0.01) -> float:
    r"""Standard deviation :math:`\mathrm{gain}/\sqrt{n}` of He initialisation; :math:`\sqrt{2/n}` for ReLU.

    >>> he_std(8)
    0.5
    """
    n = check_positive_int(n, "n (the fan)")
    return gain(nonlinearity, a) / math.sqrt(n)


def _fan(W: Tensor, mode: str) -> int:
    if mode not in ("fan_in", "fan_out"):
        raise ValueError(f"mode must be 'fan_in' (preserve activations) or 'fan_out' (preserve gradients), "
                         f"got {mode!r}")
    n_in, n_out = fans(W)
    return n_in if mode == "fan_in" else n_out


@implements("02.11")
def he_normal_(W: Float[Tensor, "n_out n_in *k"], nonlinearity: str = "relu", mode: str = "fan_in",
               a: float = 0.01, generator: torch.Generator | None = None) -> Tensor:
    r"""He (Kaiming) normal initialisation, in place: :math:`W_{ij} \sim \mathcal{N}(0, 2/n_{in})` for ReLU.

    A ReLU layer :math:`y = W\,\mathrm{relu}(x)` with zero-mean symmetric :math:`x` has
    :math:`\mathrm{Var}(y_i) = n_{in}\,\mathrm{Var}(W)\,\tfrac12\mathrm{Var}(x)`; choosing
    :math:`\mathrm{Var}(W) = 2/n_{in}` makes the factor one, so the signal keeps its scale at any depth.
    Other non-linearities use :math:`\mathrm{gain}^2/n` (``nonlinearity``, ``a`` for leaky ReLU);
    ``mode="fan_out"`` uses :math:`n_{out}` to preserve gradients instead.

    >>> W = he_normal_(torch.empty(2000, 50), generator=torch.Generator().manual_seed(0))
    >>> round(W.var().item() * 50, 1)  # Var(W) * n_in = 2
    2.0
    """
    check_floating(W, "W")
    std = he_std(_fan(W, mode), nonlinearity, a)
    with torch.no_grad():
        return W.normal_(0.0, std, generator=generator)


def he_uniform_(W: Float[Tensor, "n_out n_in *k"], nonlinearity: str = "relu", mode: str = "fan_in",
                a: float = 0.01, generator: torch.Generator | None = None) -> Tensor:
    r"""He uniform: :math:`U[-\sqrt3\,\sigma, \sqrt3\,\sigma]`, :math:`\sigma` of :func:`he_normal_`.

    >>> bool(he_uniform_(torch.empty(4, 6)).abs().max() <= 1.0)  # sqrt(3) * sqrt(2 / 6) = 1
    True
    """
    check_floating(W, "W")
    bound = math.sqrt(3.0) * he_std(_fan(W, mode), nonlinearity, a)
    with torch.no_grad():
        return W.uniform_(-bound, bound, generator=generator)


def activation_second_moments(
    init: str, L: int = 20, d: int = 256, N: int = 512, nonlinearity: str = "relu",
    generator: torch.Generator | None = None,
) -> list[float]:
    r"""Mean square :math:`\mathbb{E}[y_l^2]` of the pre-activations of an ``L``-layer MLP of width ``d``.

    Pushes ``N`` standard-normal inputs through :math:`y_l = W_l\,\phi(y_{l-1})` (:math:`y_0 = x`, no bias,
    :math:`\phi` = ``nonlinearity``, ``relu`` or ``tanh`` or ``linear``) with every :math:`W_l` drawn by
    ``init``: ``"xavier"`` (:func:`xavier_uniform_`, gain 1), ``"he"`` (:func:`he_normal_` for
    ``nonlinearity``) or ``"small"`` (:math:`\mathcal{N}(0, 0.01^2)`, the pre-2010 habit). Returns the
    ``L`` values of :math:`\frac{1}{Nd}\sum y_l^2`. He keeps them near one for ReLU; Xavier halves
    them at every ReLU layer.

    >>> m = activation_second_moments("he", L=3, d=64, N=256, generator=torch.Generator().manual_seed(0))
    >>> all(0.8 < v < 1.25 for v in m)
    True
    """
    phis = {"relu": torch.relu, "tanh": torch.tanh, "linear": lambda y: y}
    if nonlinearity not in phis:
        raise ValueError(f"nonlinearity must be one of {sorted(phis)}, got {nonlinearity!r}")
    if init not in ("xavier", "he", "small"):
        raise ValueError(f"init must be 'xavier', 'he' or 'small', got {init!r}")
    L, d, N = (check_positive_int(n, name) for name, n in (("L", L), ("d", d), ("N", N)))
    phi = phis[nonlinearity]
    y = torch.randn(N, d, generator=generator, dtype=torch.float64)
    out = []
    for _ in range(L):
        W = torch.empty(d, d, dtype=torch.float64)
        if init == "xavier":
            xavier_uniform_(W, generator=generator)
        elif init == "he":
            he_normal_(W, nonlinearity, generator=generator)
        else:
            W.normal_(0.0, 0.01, generator=generator)
        y = phi(y) @ W.T
        out.append(y.pow(2).mean().item())
    return out
