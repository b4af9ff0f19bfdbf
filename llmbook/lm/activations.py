r"""Activations and gated feed-forward blocks (chapter 6): ReLU, GELU, SiLU, Mish, and the GLU family.

Pointwise activations act elementwise on any shape. The gated units multiply a *value* projection
by an activated *gate* projection:

.. math:: \mathrm{XGLU}(x) = (xW_a) \odot \phi(xW_b)

with :math:`\phi` = sigmoid (GLU), ReLU (ReGLU), GELU (GeGLU) or SiLU (SwiGLU). In code the value
projection is ``W_up`` / ``w_up`` and the gate projection ``W_gate`` / ``w_gate``, as in Llama's MLP.

Weights of the functional forms are in the math layout, ``x @ W`` with ``W`` of shape
``(d_in, d_out)`` (that is, ``nn.Linear.weight.T``). The modules hold ``nn.Linear`` layers.
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
    check_positive_int,
    check_range,
    check_same_dtype,
    check_shape,
)
from llmbook.registry import implements

__all__ = [
    "relu",
    "gelu",
    "gelu_tanh",
    "silu",
    "mish",
    "softplus",
    "glu",
    "reglu",
    "geglu",
    "swiglu",
    "ACTIVATIONS",
    "GatedFFN",
    "GLUFFN",
    "ReGLU",
    "GeGLU",
    "SwiGLU",
    "swiglu_hidden_size",
]


# --------------------------------------------------------------------------- pointwise


@implements("06.01")
def relu(x: Float[Tensor, "..."]) -> Float[Tensor, "..."]:
    r""":math:`\mathrm{ReLU}(x)=\max(0,x)`, elementwise.

    >>> relu(torch.tensor([-1.0, 0.0, 2.0]))
    tensor([0., 0., 2.])
    """
    x = as_tensor(x, "x")
    return torch.where(x < 0, torch.zeros_like(x), x)  # NaN (and -0.0) pass through, as in torch.relu


@implements("06.02")
def gelu(x: Float[Tensor, "..."]) -> Float[Tensor, "..."]:
    r"""Exact GELU, :math:`x\,\Phi(x)` with :math:`\Phi(x)=\tfrac12\left(1+\mathrm{erf}(x/\sqrt2)\right)`.

    :math:`\Phi` is the standard normal CDF: the input is kept with the probability that a standard
    normal falls below it. Elementwise.

    >>> gelu(torch.tensor([-1.0, 0.0, 1.0]))
    tensor([-0.1587,  0.0000,  0.8413])
    """
    x = as_tensor(x, "x")
    return x * 0.5 * (1.0 + torch.erf(x / math.sqrt(2.0)))


@implements("06.03")
def gelu_tanh(x: Float[Tensor, "..."]) -> Float[Tensor, "..."]:
    r"""The tanh approximation of GELU used by GPT-2 and BERT.

    .. math:: \mathrm{GELU}(x)\approx \tfrac12 x\left(1+\tanh\!\left(\sqrt{2/\pi}\,(x+0.044715\,x^3)\right)\right)

    >>> gelu_tanh(torch.tensor([1.0]))
    tensor([0.8412])
    """
    x = as_tensor(x, "x")
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x.pow(3))))


def _sigmoid(x: Tensor) -> Tensor:
    # 1 / (1 + e^{-x}) with the exponent never positive: e^{-|x|} cannot overflow
    e = torch.exp(-x.abs())
    return torch.where(x >= 0, 1.0 / (1.0 + e), e / (1.0 + e))


@implements("06.04")
def silu(x: Float[Tensor, "..."]) -> Float[Tensor, "..."]:
    r"""SiLU / Swish-1, :math:`x\,\sigma(x) = \dfrac{x}{1+e^{-x}}`, elementwise.

    The sigmoid is evaluated without overflow for large :math:`|x|`.

    >>> silu(torch.tensor([-1.0, 0.0, 1.0]))
    tensor([-0.2689,  0.0000,  0.7311])
    """
    x = as_tensor(x, "x")
    return x * _sigmoid(x)


def softplus(x: Float[Tensor, "..."]) -> Float[Tensor, "..."]:
    r"""Stable :math:`\log(1+e^x) = \max(x,0) + \log(1+e^{-|x|})`.

    >>> [round(v, 4) for v in softplus(torch.tensor([0.0, 1000.0])).tolist()]
    [0.6931, 1000.0]
    """
    x = as_tensor(x, "x")
    return x.clamp(min=0) + torch.log1p(torch.exp(-x.abs()))


@implements("06.05")
def mish(x: Float[Tensor, "..."]) -> Float[Tensor, "..."]:
    r"""Mish, :math:`x\tanh(\log(1+e^x))`, elementwise (the softplus is the stable one).

    >>> mish(torch.tensor([-1.0, 0.0, 1.0]))
    tensor([-0.3034,  0.0000,  0.8651])
    """
    x = as_tensor(x, "x")
    return x * torch.tanh(softplus(x))


ACTIVATIONS = {"relu": relu, "gelu": gelu, "gelu_tanh": gelu_tanh, "silu": silu, "mish": mish, "sigmoid": _sigmoid}


# --------------------------------------------------------------------------- gated units


def _project(x: Tensor, W: Tensor, b: Tensor | None, name: str) -> Tensor:
    W = as_tensor(W, name)
    check_dim(W, name, "(d_in, d_out)", min_dim=2, max_dim=2)
    check_same_dtype(x, W, "x", name)
    if x.shape[-1] != W.shape[0]:
        raise ValueError(f"x (..., d_in) = {tuple(x.shape)} and {name} (d_in, d_out) = {tuple(W.shape)} "
                         f"disagree on d_in")
    y = x @ W
    if b is not None:
        check_shape(b, (W.shape[1],), f"the bias of {name}")
        check_same_dtype(b, W, f"the bias of {name}", name)
        y = y + b
    return y


def _gated(x, W_a, W_b, phi, b_a=None, b_b=None) -> Tensor:
    x = as_tensor(x, "x")
    check_dim(x, "x", "(..., d_in)")
    a = _project(x, W_a, b_a, "W_a")
    g = _project(x, W_b, b_b, "W_b")
    if a.shape != g.shape:
        raise ValueError(f"W_a and W_b must map to the same width, got {a.shape[-1]} and {g.shape[-1]}")
    return a * phi(g)


@implements("06.06")
def glu(x: Float[Tensor, "... d_in"], W_a: Float[Tensor, "d_in d_out"], W_b: Float[Tensor, "d_in d_out"],
        b_a: Float[Tensor, " d_out"] | None = None, b_b: Float[Tensor, " d_out"] | None = None
        ) -> Float[Tensor, "... d_out"]:
    r"""Gated linear unit: :math:`(xW_a+b_a)\odot\sigma(xW_b+b_b)`.

    :math:`W_a` carries the value, :math:`W_b` the gate. ``torch.nn.functional.glu(h)`` is the same
    thing on a pre-computed ``h = cat([xW_a+b_a, xW_b+b_b], -1)``: its *second* half gates the first.
    Shapes ``(..., d_in) -> (..., d_out)``.

    >>> glu(torch.ones(1, 2), torch.eye(2), torch.zeros(2, 2))  # gate sigma(0) = 1/2
    tensor([[0.5000, 0.5000]])
    """
    return _gated(x, W_a, W_b, _sigmoid, b_a, b_b)


@implements("06.07")
def reglu(x: Float[Tensor, "... d_in"], W_a: Float[Tensor, "d_in d_out"], W_b: Float[Tensor, "d_in d_out"]
          ) -> Float[Tensor, "... d_out"]:
    r"""ReGLU: :math:`(xW_a)\odot\mathrm{ReLU}(xW_b)`. Shapes ``(..., d_in) -> (..., d_out)``.

    >>> reglu(torch.tensor([[1.0, -1.0]]), torch.eye(2), torch.eye(2))
    tensor([[1., -0.]])
    """
    return _gated(x, W_a, W_b, relu)


@implements("06.08")
def geglu(x: Float[Tensor, "... d_in"], W_a: Float[Tensor, "d_in d_out"], W_b: Float[Tensor, "d_in d_out"],
          approximate: str = "none") -> Float[Tensor, "... d_out"]:
    r"""GeGLU: :math:`(xW_a)\odot\mathrm{GELU}(xW_b)` (``approximate="tanh"`` uses :func:`gelu_tanh`).

    >>> geglu(torch.tensor([[1.0]]), torch.eye(1), torch.eye(1))
    tensor([[0.8413]])
    """
    if approximate not in ("none", "tanh"):
        raise ValueError(f"approximate must be 'none' or 'tanh', got {approximate!r}")
    return _gated(x, W_a, W_b, gelu if approximate == "none" else gelu_tanh)


@implements("06.09")
def swiglu(x: Float[Tensor, "... d_model"], W_gate: Float[Tensor, "d_model d_ff"], W_up: Float[Tensor, "d_model d_ff"],
           W_down: Float[Tensor, "d_ff d_model"] | None = None) -> Float[Tensor, "... d_model"]:
    r"""SwiGLU: :math:`(xW_a)\odot\mathrm{SiLU}(xW_b)`, followed by the down projection when ``W_down`` is given.

    .. math:: \mathrm{FFN}_{\mathrm{SwiGLU}}(x) = \left(\mathrm{SiLU}(xW_{gate}) \odot xW_{up}\right) W_{down}

    :math:`W_a` is ``W_up`` (value), :math:`W_b` is ``W_gate``. Math layout: ``W_gate, W_up`` are
    ``(d_model, d_ff)`` and ``W_down`` is ``(d_ff, d_model)`` (the transposes of ``nn.Linear``
    weights). Without ``W_down`` the result is the ``(..., d_ff)`` hidden activation.

    >>> swiglu(torch.tensor([[1.0]]), torch.eye(1), torch.eye(1), 2 * torch.eye(1))  # 2 * 1 * silu(1)
    tensor([[1.4621]])
    """
    h = _gated(x, W_up, W_gate, silu)
    if W_down is None:
        return h
    return _project(h, W_down, None, "W_down")


# --------------------------------------------------------------------------- modules


class GatedFFN(nn.Module):
    r"""A gated feed-forward block with three matrices: ``w_down(phi(w_gate(x)) * w_up(x))``.

    Subclasses fix ``phi`` (:class:`GLUFFN`, :class:`ReGLU`, :class:`GeGLU`, :class:`SwiGLU`).
    ``w_gate, w_up``: ``nn.Linear(d_model, d_ff)``; ``w_down``: ``nn.Linear(d_ff, d_model)``.
    """

    activation = "silu"

    def __init__(self, d_model: int, d_ff: int, bias: bool = False):
        super().__init__()
        d_model, d_ff = check_positive_int(d_model, "d_model"), check_positive_int(d_ff, "d_ff")
        self.d_model, self.d_ff = d_model, d_ff
        self.w_gate = nn.Linear(d_model, d_ff, bias=bias)
        self.w_up = nn.Linear(d_model, d_ff, bias=bias)
        self.w_down = nn.Linear(d_ff, d_model, bias=bias)

    def forward(self, x: Float[Tensor, "... d_model"]) -> Float[Tensor, "... d_model"]:
        x = check_module_input(self, x, d=self.d_model)
        return self.w_down(ACTIVATIONS[self.activation](self.w_gate(x)) * self.w_up(x))


class GLUFFN(GatedFFN):
    """:class:`GatedFFN` with a sigmoid gate (the original GLU)."""

    activation = "sigmoid"


class ReGLU(GatedFFN):
    """:class:`GatedFFN` with a ReLU gate."""

    activation = "relu"


class GeGLU(GatedFFN):
    """:class:`GatedFFN` with an exact-GELU gate."""

    activation = "gelu"


class SwiGLU(GatedFFN):
    r"""Llama's MLP: ``w_down(silu(w_gate(x)) * w_up(x))`` (``gate_proj``, ``up_proj``, ``down_proj``).

    >>> m = SwiGLU(6, 16)
    >>> m(torch.zeros(2, 6)).shape, sum(p.numel() for p in m.parameters())
    (torch.Size([2, 6]), 288)
    """

    activation = "silu"


def swiglu_hidden_size(d_model: int, multiple_of: int = 1, ffn_mult: float = 4.0) -> int:
    r"""The SwiGLU width that keeps a ``ffn_mult * d_model`` two-matrix FFN's parameters: :math:`\tfrac23\cdot 4d`.

    Three matrices of ``d * d_ff`` against two of ``d * 4d`` give ``d_ff = 8d/3``; Llama then rounds up to
    a multiple of ``multiple_of``.

    >>> swiglu_hidden_size(768), swiglu_hidden_size(4096, multiple_of=256)
    (2048, 11008)
    """
    d_model, multiple_of = check_positive_int(d_model, "d_model"), check_positive_int(multiple_of, "multiple_of")
    check_range(ffn_mult, "ffn_mult", 0.0, low_open=True)
    d_ff = int(2 * ffn_mult * d_model / 3)
    if d_ff < 1:
        raise ValueError(f"ffn_mult * d_model = {ffn_mult} * {d_model} is too small for a hidden width >= 1")
    return multiple_of * ((d_ff + multiple_of - 1) // multiple_of)
