r"""Activations and gated feed-forward blocks (chapter 6): ReLU, GELU, SiLU, Mish, and the GLU family.

Pointwise activations act elementwise on any shape. The gated units multiply a *value* projection
by an activated *gate* projection:

.. math:: \mathrm{XGLU}(x) = (xW_a) \odot \phi(xW_b)

with :math:`\phi` = sigmoid (GLU), ReLU (ReGLU), GELU (GeGLU) or SiLU (SwiGLU). In code the value
projection is ``W_up`` / ``w_up`` and the gate projection ``W_gate`` / ``w_gate``, as in Llama's MLP.

Weights of the functional forms are in ``nn.Linear``'s layout, as in every functional layer of the book
(:func:`~llmbook.lm.embeddings.linear`, :func:`~llmbook.lm.lora.lora_linear`, ...): ``W`` has shape
``(d_out, d_in)`` and the layer computes ``x @ W.T``, so the math's :math:`W_a` is ``W_a.T`` in code and a
module's ``w_up.weight`` is passed as it is. A weight given the other way round, ``(d_in, d_out)`` with
``d_in != d_out``, raises a ``ValueError`` that says so. The modules hold ``nn.Linear`` layers.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
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
from llmbook._precision import HALF, restore_half, upcast_half
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
    "activation_minimum",
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


def activation_minimum(name: str, bracket: tuple[float, float] = (-3.0, 0.0), tol: float = 1e-10
                       ) -> tuple[float, float]:
    r"""Where a smooth activation dips lowest: :math:`x^\ast = \arg\min_{x\in[a,b]} f(x)` and :math:`f(x^\ast)`.

    Golden-section search in float64 on ``ACTIVATIONS[name]`` over ``bracket`` :math:`= [a, b]`, on
    which :math:`f` must be unimodal (true for GELU, its tanh form, SiLU and Mish on the default
    :math:`[-3, 0]`; ReLU is flat there and has no unique minimiser). Each step shrinks the interval
    by :math:`1/\varphi \approx 0.618` until it is shorter than ``tol``. Returns ``(x_star, f_star)``.

    >>> x, f = activation_minimum("silu")  # x* solves x + 1 + e^x = 0: x* = -1 - W(1/e)
    >>> round(x, 4), round(f, 4)
    (-1.2785, -0.2785)
    """
    if name not in ACTIVATIONS or name == "relu":
        choices = sorted(set(ACTIVATIONS) - {"relu"})
        raise ValueError(f"name must be a smooth activation in {choices}, got {name!r}")
    try:
        a, b = (float(v) for v in bracket)
    except (TypeError, ValueError):
        raise TypeError(f"bracket must be two numbers (a, b) with a < b, got {bracket!r}") from None
    if not (math.isfinite(a) and math.isfinite(b) and a < b):
        raise ValueError(f"bracket must be two finite numbers a < b, got ({a}, {b})")
    check_range(tol, "tol", 0.0, low_open=True)
    f = ACTIVATIONS[name]

    def value(x: float) -> float:
        return float(f(torch.tensor(x, dtype=torch.float64)))

    r = (math.sqrt(5.0) - 1.0) / 2.0  # 1/phi
    c, d = b - r * (b - a), a + r * (b - a)
    fc, fd = value(c), value(d)
    while b - a > tol:
        if fc <= fd:  # the minimum lies in [a, d]
            b, d, fd = d, c, fc
            c = b - r * (b - a)
            fc = value(c)
        else:  # in [c, b]
            a, c, fc = c, d, fd
            d = a + r * (b - a)
            fd = value(d)
    x_star = (a + b) / 2.0
    return x_star, value(x_star)


# --------------------------------------------------------------------------- gated units


def _project(x: Tensor, W: Tensor, b: Tensor | None, name: str) -> Tensor:
    """``x @ W.T + b`` (``W`` in ``nn.Linear``'s layout) with the shapes and dtypes checked; fp16/bf16 in float32.

    The result stays in float32 for half inputs (the caller rounds once, at the end): a gated unit's
    product ``a * phi(g)`` overflows fp16 long before the block's output does.
    """
    W = as_tensor(W, name)
    check_dim(W, name, "(d_out, d_in)", min_dim=2, max_dim=2)
    check_same_dtype(x, W, "x", name)
    if x.shape[-1] != W.shape[1]:
        if x.shape[-1] == W.shape[0]:
            raise ValueError(f"{name} has shape {tuple(W.shape)} = (d_in, d_out) for x (..., d_in = {x.shape[-1]}): "
                             f"functional layers take nn.Linear's layout (d_out, d_in); pass {name}.T")
        raise ValueError(f"x (..., d_in) = {tuple(x.shape)} and {name} (d_out, d_in) = {tuple(W.shape)} "
                         f"disagree on d_in")
    y = upcast_half(x) @ upcast_half(W).T
    if b is not None:
        check_shape(b, (W.shape[0],), f"the bias of {name}")
        check_same_dtype(b, W, f"the bias of {name}", name)
        y = y + upcast_half(b)
    return y


def _gated(x, W_a, W_b, phi, b_a=None, b_b=None) -> Tensor:
    """``(x W_a^T + b_a) * phi(x W_b^T + b_b)`` in the caller's dtype; fp16/bf16 computed in float32."""
    x = as_tensor(x, "x")
    check_dim(x, "x", "(..., d_in)")
    a = _project(x, W_a, b_a, "W_a")
    g = _project(x, W_b, b_b, "W_b")
    if a.shape != g.shape:
        raise ValueError(f"W_a and W_b must map to the same width, got {a.shape[-1]} and {g.shape[-1]}")
    return restore_half(a * phi(g), x.dtype)


@implements("06.06")
def glu(x: Float[Tensor, "... d_in"], W_a: Float[Tensor, "d_out d_in"], W_b: Float[Tensor, "d_out d_in"],
        b_a: Float[Tensor, " d_out"] | None = None, b_b: Float[Tensor, " d_out"] | None = None
        ) -> Float[Tensor, "... d_out"]:
    r"""Gated linear unit: :math:`(xW_a+b_a)\odot\sigma(xW_b+b_b)`.

    :math:`W_a` carries the value, :math:`W_b` the gate. ``torch.nn.functional.glu(h)`` is the same
    thing on a pre-computed ``h = cat([xW_a+b_a, xW_b+b_b], -1)``: its *second* half gates the first.
    ``W_a, W_b`` are ``(d_out, d_in)``, ``nn.Linear``'s layout (the math's :math:`W_a^\top`).
    Shapes ``(..., d_in) -> (..., d_out)``.

    >>> glu(torch.ones(1, 2), torch.eye(2), torch.zeros(2, 2))  # gate sigma(0) = 1/2
    tensor([[0.5000, 0.5000]])
    """
    return _gated(x, W_a, W_b, _sigmoid, b_a, b_b)


@implements("06.07")
def reglu(x: Float[Tensor, "... d_in"], W_a: Float[Tensor, "d_out d_in"], W_b: Float[Tensor, "d_out d_in"]
          ) -> Float[Tensor, "... d_out"]:
    r"""ReGLU: :math:`(xW_a)\odot\mathrm{ReLU}(xW_b)`.

    Weights ``(d_out, d_in)``, ``nn.Linear``'s layout. Shapes ``(..., d_in) -> (..., d_out)``.

    >>> reglu(torch.tensor([[1.0, -1.0]]), torch.eye(2), torch.eye(2))
    tensor([[1., -0.]])
    """
    return _gated(x, W_a, W_b, relu)


@implements("06.08")
def geglu(x: Float[Tensor, "... d_in"], W_a: Float[Tensor, "d_out d_in"], W_b: Float[Tensor, "d_out d_in"],
          approximate: str = "none") -> Float[Tensor, "... d_out"]:
    r"""GeGLU: :math:`(xW_a)\odot\mathrm{GELU}(xW_b)` (``approximate="tanh"`` uses :func:`gelu_tanh`).

    Weights ``(d_out, d_in)``, ``nn.Linear``'s layout. Shapes ``(..., d_in) -> (..., d_out)``.

    >>> geglu(torch.tensor([[1.0]]), torch.eye(1), torch.eye(1))
    tensor([[0.8413]])
    """
    if approximate not in ("none", "tanh"):
        raise ValueError(f"approximate must be 'none' or 'tanh', got {approximate!r}")
    return _gated(x, W_a, W_b, gelu if approximate == "none" else gelu_tanh)


@implements("06.09")
def swiglu(x: Float[Tensor, "... d_model"], W_gate: Float[Tensor, "d_ff d_model"], W_up: Float[Tensor, "d_ff d_model"],
           W_down: Float[Tensor, "d_model d_ff"] | None = None) -> Float[Tensor, "... d_model"]:
    r"""SwiGLU: :math:`(xW_a)\odot\mathrm{SiLU}(xW_b)`, followed by the down projection when ``W_down`` is given.

    .. math:: \mathrm{FFN}_{\mathrm{SwiGLU}}(x) = \left(\mathrm{SiLU}(xW_{gate}) \odot xW_{up}\right) W_{down}

    :math:`W_a` is ``W_up`` (value), :math:`W_b` is ``W_gate``. ``nn.Linear``'s layout: ``W_gate, W_up`` are
    ``(d_ff, d_model)`` and ``W_down`` is ``(d_model, d_ff)``, so Llama's ``gate_proj.weight``,
    ``up_proj.weight`` and ``down_proj.weight`` go in as they are. Without ``W_down`` the result is the
    ``(..., d_ff)`` hidden activation.

    >>> swiglu(torch.tensor([[1.0]]), torch.eye(1), torch.eye(1), 2 * torch.eye(1))  # 2 * 1 * silu(1)
    tensor([[1.4621]])
    """
    if W_down is None:
        return _gated(x, W_up, W_gate, silu)
    x = as_tensor(x, "x")
    W_down = as_tensor(W_down, "W_down")
    check_same_dtype(x, W_down, "x", "W_down")
    x32 = upcast_half(x)  # half inputs: the whole block in float32, rounded once at the end
    h = _gated(x32, upcast_half(as_tensor(W_up, "W_up")), upcast_half(as_tensor(W_gate, "W_gate")), silu)
    return restore_half(_project(h, upcast_half(W_down), None, "W_down"), x.dtype)


# --------------------------------------------------------------------------- modules


def _linear32(layer: nn.Linear, x: Tensor) -> Tensor:
    """``layer(x)`` with the layer's weights upcast from fp16/bf16 to float32 (``x`` already float32)."""
    bias = None if layer.bias is None else upcast_half(layer.bias)
    return F.linear(x, upcast_half(layer.weight), bias)


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
        phi = ACTIVATIONS[self.activation]
        if x.dtype not in HALF:
            return self.w_down(phi(self.w_gate(x)) * self.w_up(x))
        # fp16/bf16: the product phi(gate) * up overflows fp16 first; compute in float32, round once
        x32 = upcast_half(x)
        h = phi(_linear32(self.w_gate, x32)) * _linear32(self.w_up, x32)
        return restore_half(_linear32(self.w_down, h), x.dtype)


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
