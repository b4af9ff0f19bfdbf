r"""Low-rank adaptation (chapter 11, ids 11.01-11.03): LoRA, rsLoRA, QLoRA and DoRA.

A frozen weight :math:`W` (``(d_out, d_in)``, the ``nn.Linear`` layout) is adapted by a trainable
low-rank update. Symbols: ``A`` (:math:`A`, ``(r, d_in)``), ``B`` (:math:`B`, ``(d_out, r)``), ``r``
the rank, ``alpha`` (:math:`\alpha`) the scale; LoRA's :math:`s = \alpha / r`, rsLoRA's
:math:`s = \alpha / \sqrt r`. Inputs are batch-first ``(..., d_in)``; fp16 / bf16 are computed in float32.

The modules wrap an existing ``nn.Linear`` (the base stays frozen and, until :meth:`LoRALinear.merge`,
bitwise untouched); :func:`add_lora` swaps them into a model such as the book's tiny GPT by name.
AdaLoRA (11.04) lives in :mod:`llmbook.lm.adalora`.
"""

from __future__ import annotations

import math

import torch
from jaxtyping import Float
from torch import Tensor, nn

from llmbook._checks import (
    as_tensor,
    check_choice,
    check_dim,
    check_module_input,
    check_positive_int,
    check_range,
    check_same_dtype,
    check_shape,
)
from llmbook._precision import restore_half, upcast_half
from llmbook.lm.nf4 import nf4_dequantize, nf4_quantize
from llmbook.registry import implements

__all__ = ["lora_scaling", "lora_linear", "LoRALinear",
           "qlora_linear", "QLoRALinear", "dora_linear", "DoRALinear", "replace_linears", "add_lora", "freeze",
           "count_trainable"]


def lora_scaling(alpha: float, r: int, rslora: bool = False) -> float:
    r"""The LoRA scale :math:`s = \alpha / r`, or rsLoRA's :math:`\alpha / \sqrt r` (``rslora=True``).

    >>> lora_scaling(16, 4), lora_scaling(16, 4, rslora=True)
    (4.0, 8.0)
    """
    alpha, r = check_range(alpha, "alpha"), check_positive_int(r, "r")
    return alpha / (math.sqrt(r) if rslora else r)


def _lowrank_args(x, W, A, B, bias):
    """Validate ``x (..., d_in)``, ``W (d_out, d_in)``, ``A (r, d_in)``, ``B (d_out, r)`` and upcast."""
    x, W, A, B = (as_tensor(t, n) for t, n in ((x, "x"), (W, "W"), (A, "A"), (B, "B")))
    for t, n in ((W, "W"), (A, "A"), (B, "B")):
        check_dim(t, n, "a matrix", min_dim=2, max_dim=2)
        check_same_dtype(x, t, "x", n)
    d_out, d_in = W.shape
    check_dim(x, "x", f"(..., d_in) with d_in = {d_in}")
    if x.shape[-1] != d_in:
        raise ValueError(f"x must have shape (..., d_in) with d_in = {d_in} (W is {tuple(W.shape)}), "
                         f"got {tuple(x.shape)}")
    r = A.shape[0]
    if r == 0:
        raise ValueError("A must have shape (r, d_in) with rank r >= 1, got r = 0")
    check_shape(A, (r, d_in), "A", "(r, d_in)")
    check_shape(B, (d_out, r), "B", "(d_out, r)")
    if bias is not None:
        bias = check_shape(as_tensor(bias, "bias"), (d_out,), "bias", "(d_out,)")
        check_same_dtype(x, bias, "x", "bias")
        bias = upcast_half(bias)
    return x.dtype, upcast_half(x), upcast_half(W), upcast_half(A), upcast_half(B), bias, r


@implements("11.01")
def lora_linear(x: Float[Tensor, "... d_in"], W: Float[Tensor, "d_out d_in"], A: Float[Tensor, "r d_in"],
                B: Float[Tensor, "d_out r"], alpha: float, bias: Tensor | None = None,
                rslora: bool = False) -> Float[Tensor, "... d_out"]:
    r"""LoRA: :math:`y = x W'^\top + b`, :math:`W' = W + \Delta W`, :math:`\Delta W = \frac{\alpha}{r} BA`.

    Computed as :math:`x W^\top + s\,(x A^\top) B^\top`, never forming :math:`\Delta W`: the cost is
    :math:`r (d_{in} + d_{out})` per token. ``rslora=True`` uses :math:`s = \alpha/\sqrt r` (rsLoRA), which
    keeps the update's size stable as ``r`` grows. ``W`` is frozen; ``A`` (``(r, d_in)``) and ``B``
    (``(d_out, r)``, initialised to zero so that training starts from the base model) are trained.

    >>> W, A, B = torch.eye(2), torch.ones(1, 2), torch.ones(2, 1)
    >>> lora_linear(torch.tensor([[1.0, 2.0]]), W, A, B, alpha=2)  # x + 2 * (1 + 2)
    tensor([[7., 8.]])
    """
    dtype, x, W, A, B, bias, r = _lowrank_args(x, W, A, B, bias)
    s = lora_scaling(alpha, r, rslora)
    y = x @ W.T + s * ((x @ A.T) @ B.T)
    return restore_half(y if bias is None else y + bias, dtype)


def _linear(base) -> nn.Linear:
    if not isinstance(base, nn.Linear):
        raise TypeError(f"base must be an nn.Linear, got {type(base).__name__}")
    return base


class LoRALinear(nn.Module):
    r"""An ``nn.Linear`` with a LoRA update (:func:`lora_linear`); the base layer is frozen, not copied.

    ``lora_A`` starts Kaiming-uniform and ``lora_B`` at zero (as in the paper and ``peft``), so the wrapped
    layer first computes exactly what the base did. :meth:`merge` folds :math:`\Delta W` into the base
    weight (no extra cost at inference), :meth:`unmerge` takes it out again (equal up to one rounding of
    :math:`W + \Delta W`).

    >>> layer = LoRALinear(nn.Linear(4, 3), r=2, alpha=4)
    >>> layer(torch.zeros(5, 4)).shape, sum(p.numel() for p in layer.parameters() if p.requires_grad)
    (torch.Size([5, 3]), 14)
    """

    def __init__(self, base: nn.Linear, r: int, alpha: float, rslora: bool = False):
        super().__init__()
        self.base = _linear(base).requires_grad_(False)
        self.r, self.alpha, self.rslora = check_positive_int(r, "r"), check_range(alpha, "alpha"), bool(rslora)
        self.scaling = lora_scaling(alpha, r, rslora)
        W = base.weight
        self.lora_A = nn.Parameter(torch.empty(r, W.shape[1], dtype=W.dtype, device=W.device))
        self.lora_B = nn.Parameter(torch.zeros(W.shape[0], r, dtype=W.dtype, device=W.device))
        nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))
        self.merged = False

    def delta_weight(self) -> Tensor:
        r""":math:`\Delta W = s\, BA`, shape ``(d_out, d_in)``."""
        return self.scaling * (self.lora_B @ self.lora_A)

    def forward(self, x: Tensor) -> Tensor:
        x = check_module_input(self, x, d=self.base.in_features, symbol="d_in")
        if self.merged:
            return self.base(x)
        return lora_linear(x, self.base.weight, self.lora_A, self.lora_B, self.alpha, self.base.bias, self.rslora)

    @torch.no_grad()
    def merge(self) -> None:
        """:math:`W \\leftarrow W + \\Delta W` in place; the forward then runs the base layer alone."""
        if not self.merged:
            self.base.weight += self.delta_weight()
            self.merged = True

    @torch.no_grad()
    def unmerge(self) -> None:
        """:math:`W \\leftarrow W - \\Delta W`: undo :meth:`merge` (the adapter stays trainable)."""
        if self.merged:
            self.base.weight -= self.delta_weight()
            self.merged = False


# --------------------------------------------------------------------------- 11.02 QLoRA

@implements("11.02")
def qlora_linear(x: Float[Tensor, "... d_in"], codes: Tensor, absmax: Tensor, A: Float[Tensor, "r d_in"],
                 B: Float[Tensor, "d_out r"], alpha: float, block_size: int = 64, bias: Tensor | None = None,
                 rslora: bool = False) -> Float[Tensor, "... d_out"]:
    r"""QLoRA: :math:`y = x\,\mathrm{dequant}(W_q)^\top + \frac{\alpha}{r}\, x A^\top B^\top` with an NF4 base.

    ``codes``/``absmax`` come from chapter 12's :func:`llmbook.lm.nf4.nf4_quantize` (blockwise NF4: each
    block of ``block_size`` weights scaled by its absmax, each value the nearest of 16 normal-quantile
    levels; ``codes`` has the shape ``(d_out, d_in)`` of :math:`W`). The base is dequantised for the
    product (in float32 for fp16 / bf16 input) and never updated; gradients reach only ``A`` and ``B``
    (kept in 16 or 32 bits). QLoRA's double quantisation of ``absmax`` and its paged optimisers save
    memory but do not change this forward.

    >>> codes, absmax = nf4_quantize(torch.eye(4), block_size=4)
    >>> qlora_linear(torch.ones(1, 4), codes, absmax, torch.zeros(1, 4), torch.zeros(4, 1), 1.0, 4)
    tensor([[1., 1., 1., 1.]])
    """
    x, A, B = as_tensor(x, "x"), as_tensor(A, "A"), as_tensor(B, "B")
    for t, n in ((A, "A"), (B, "B")) + (() if bias is None else ((as_tensor(bias, "bias"), "bias"),)):
        check_same_dtype(x, t, "x", n)
    x_c = upcast_half(x)  # fp16 / bf16: dequantise and compute in float32, round once at the end
    W = nf4_dequantize(codes, absmax, block_size).to(x_c.dtype)
    bias = None if bias is None else upcast_half(as_tensor(bias, "bias"))
    return restore_half(lora_linear(x_c, W, upcast_half(A), upcast_half(B), alpha, bias, rslora), x.dtype)


class QLoRALinear(nn.Module):
    """An ``nn.Linear`` stored in NF4 (codes and block scales as buffers) plus trainable LoRA factors.

    The codes are kept one per byte (``uint8``); real kernels pack two 4-bit codes per byte.

    >>> layer = QLoRALinear(nn.Linear(64, 8), r=2, alpha=4)
    >>> layer(torch.ones(3, 64)).shape, layer.codes.dtype
    (torch.Size([3, 8]), torch.uint8)
    """

    def __init__(self, base: nn.Linear, r: int, alpha: float, block_size: int = 64, rslora: bool = False):
        super().__init__()
        base = _linear(base)
        self.in_features, self.r, self.alpha, self.rslora = base.in_features, check_positive_int(r, "r"), alpha, rslora
        self.block_size = check_positive_int(block_size, "block_size")
        codes, absmax = nf4_quantize(base.weight.detach(), block_size)
        self.register_buffer("codes", codes.to(torch.uint8))
        self.register_buffer("absmax", absmax)
        self.bias = None if base.bias is None else nn.Parameter(base.bias.detach().clone(), requires_grad=False)
        lora = LoRALinear(nn.Linear(base.in_features, base.out_features, bias=False), r, alpha, rslora)
        self.lora_A, self.lora_B = lora.lora_A, lora.lora_B

    def forward(self, x: Tensor) -> Tensor:
        x = check_module_input(self, x, d=self.in_features, symbol="d_in")
        return qlora_linear(x, self.codes, self.absmax, self.lora_A, self.lora_B, self.alpha, self.block_size,
                            self.bias, self.rslora)


# --------------------------------------------------------------------------- 11.03 DoRA


def _dora_scale(V: Tensor, m: Tensor) -> Tensor:
    """``m / ||V||_c`` per output row, with the norm detached; 0 for a zero row (so a zero row stays zero).

    The norm is replaced by 1 where it is 0 *before* dividing, so neither the value nor the gradient of ``m``
    meets ``m / 0`` (``m / tiny`` would overflow to inf for ``m`` above about 4, and ``0 * inf`` is NaN).
    """
    norm = torch.linalg.vector_norm(V, dim=1).detach()
    zero = norm == 0
    return torch.where(zero, torch.zeros_like(m), m / torch.where(zero, torch.ones_like(norm), norm))


@implements("11.03")
def dora_linear(x: Float[Tensor, "... d_in"], W: Float[Tensor, "d_out d_in"], A: Float[Tensor, "r d_in"],
                B: Float[Tensor, "d_out r"], m: Float[Tensor, " d_out"], alpha: float, bias: Tensor | None = None,
                rslora: bool = False) -> Float[Tensor, "... d_out"]:
    r"""DoRA: :math:`W' = m \odot \frac{W + \Delta W}{\|W + \Delta W\|_c}`, :math:`y = x W'^\top + b`.

    The weight splits into a direction (each output row of :math:`W + \Delta W`, LoRA's update
    :math:`\Delta W = s BA`, scaled to unit length) and a magnitude ``m`` (``(d_out,)``, initialised to the
    row norms of ``W``, so that :math:`W' = W` at the start). The norm is *detached* (DoRA section 4.3,
    as in ``peft``): it is used in the forward but passes no gradient, which saves memory and barely
    changes training. :math:`\|\cdot\|_c` is the paper's column norm of :math:`W \in \mathbb{R}^{d_{in}\times d_{out}}`,
    i.e. one norm per output feature, a row of the ``nn.Linear`` weight. A zero row stays zero.

    >>> W = torch.tensor([[3.0, 4.0]])
    >>> dora_linear(torch.tensor([[1.0, 1.0]]), W, torch.zeros(1, 2), torch.zeros(1, 1), torch.tensor([10.0]), 1.0)
    tensor([[14.]])
    """
    m = as_tensor(m, "m")
    check_same_dtype(as_tensor(x, "x"), m, "x", "m")
    dtype, x, W, A, B, bias, r = _lowrank_args(x, W, A, B, bias)
    m = upcast_half(check_shape(m, (W.shape[0],), "m", "(d_out,), one magnitude per output row"))
    V = W + lora_scaling(alpha, r, rslora) * (B @ A)
    W_prime = V * _dora_scale(V, m)[:, None]
    y = x @ W_prime.T
    return restore_half(y if bias is None else y + bias, dtype)


class DoRALinear(LoRALinear):
    """A :class:`LoRALinear` with DoRA's magnitude vector ``magnitude`` (``(d_out,)``, starts at the row norms).

    >>> layer = DoRALinear(nn.Linear(4, 3), r=2, alpha=4)
    >>> torch.allclose(layer(torch.ones(1, 4)), layer.base(torch.ones(1, 4)))
    True
    """

    def __init__(self, base: nn.Linear, r: int, alpha: float, rslora: bool = False):
        super().__init__(base, r, alpha, rslora)
        self.magnitude = nn.Parameter(torch.linalg.vector_norm(self.base.weight.detach(), dim=1))

    def merged_weight(self) -> Tensor:
        r""":math:`W'`, the weight :meth:`~llmbook.lm.lora.DoRALinear.merge` writes into the base layer."""
        V = self.base.weight + self.delta_weight()
        return V * _dora_scale(V, self.magnitude)[:, None]

    def forward(self, x: Tensor) -> Tensor:
        x = check_module_input(self, x, d=self.base.in_features, symbol="d_in")
        if self.merged:
            return self.base(x)
        return dora_linear(x, self.base.weight, self.lora_A, self.lora_B, self.magnitude, self.alpha,
                           self.base.bias, self.rslora)

    @torch.no_grad()
    def merge(self) -> None:
        r""":math:`W \leftarrow W'` in place, keeping only the ``d_out`` row norms :math:`\|W + \Delta W\|_c`
        (as ``peft``)."""
        if not self.merged:
            V = self.base.weight + self.delta_weight()
            self._weight_norm = torch.linalg.vector_norm(V, dim=1)  # (d_out,): all that unmerge needs
            self.base.weight.copy_(V * _dora_scale(V, self.magnitude)[:, None])
            self.merged = True

    @torch.no_grad()
    def unmerge(self) -> None:
        r""":math:`W = W' \odot \frac{\|W + \Delta W\|_c}{m} - \Delta W`: the row norms kept by ``merge`` and the
        adapter are enough (no copy of :math:`W`); exact up to float rounding. A row with :math:`m = 0` was
        merged to zero and cannot be restored (as in ``peft``): it comes back as :math:`-\Delta W`."""
        if self.merged:
            scale = _dora_scale(self._weight_norm[:, None], self.magnitude)  # m / ||V|| per row (0 if either is 0)
            zero = scale == 0
            inv = torch.where(zero, torch.zeros_like(scale), 1 / torch.where(zero, torch.ones_like(scale), scale))
            self.base.weight.copy_(self.base.weight * inv[:, None] - self.delta_weight())
            del self._weight_norm
            self.merged = False


# --------------------------------------------------------------------------- applying adapters to a model


def freeze(model: nn.Module) -> nn.Module:
    """Set ``requires_grad=False`` on every parameter of ``model``; returns it."""
    return model.requires_grad_(False)


def count_trainable(model: nn.Module) -> int:
    """The number of trainable scalars of ``model`` (a shared tensor counted once)."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def replace_linears(model: nn.Module, targets, factory) -> list[str]:
    """Replace each ``nn.Linear`` whose attribute name is in ``targets`` by ``factory(linear)``, in place.

    Returns the dotted names replaced; ``ValueError`` if none matched (a typo in ``targets``).

    >>> net = nn.Sequential(nn.Linear(2, 2))
    >>> replace_linears(net, ["0"], lambda lin: LoRALinear(lin, 1, 1.0))
    ['0']
    """
    targets = set(targets)
    hits = [(n, mod) for n, mod in model.named_modules()
            if isinstance(mod, nn.Linear) and n.rsplit(".", 1)[-1] in targets]
    if not hits:
        raise ValueError(f"no nn.Linear named one of {sorted(targets)} in the model")
    for n, mod in hits:
        parent = model.get_submodule(n.rsplit(".", 1)[0]) if "." in n else model
        setattr(parent, n.rsplit(".", 1)[-1], factory(mod))
    return [n for n, _ in hits]


ADAPTERS = {"lora": LoRALinear, "dora": DoRALinear, "qlora": QLoRALinear}


def add_lora(model: nn.Module, r: int, alpha: float, targets=("q_proj", "v_proj"), kind: str = "lora",
             **kwargs) -> list[str]:
    """Freeze ``model`` and wrap its linears named in ``targets`` with a ``kind`` adapter; returns their names.

    ``kind`` is ``"lora"`` (:class:`LoRALinear`, ``rslora=True`` for rsLoRA), ``"dora"`` or ``"qlora"``
    (NF4 base, ``block_size``); :func:`llmbook.lm.adalora.add_adalora` does the same for AdaLoRA. The
    model's own forward is unchanged: only its ``nn.Linear`` children are swapped, so the base model's
    numerics stay exactly those of the book.
    """
    check_choice(kind, "kind", tuple(ADAPTERS))
    freeze(model)
    return replace_linears(model, targets, lambda lin: ADAPTERS[kind](lin, r, alpha, **kwargs))
