r"""AdaLoRA (chapter 11, id 11.04): an SVD-form low-rank update whose ranks are allocated by importance.

:math:`\Delta W = \frac{\alpha}{r} P\,\mathrm{diag}(\Lambda)\,Q` per adapted matrix, with ``P`` (``(d_out, r)``),
``Lambda`` (``(r,)``) and ``Q`` (``(r, d_in)``) trained; :class:`AdaLoRAAllocator` scores every triplet
:math:`(p_i, \lambda_i, q_i)` by a smoothed sensitivity and keeps a global budget of them, following
:func:`adalora_budget`'s cubic schedule. The low-rank product itself is :func:`llmbook.lm.lora.lora_linear`.
"""

from __future__ import annotations

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
    check_same_dtype,
)
from llmbook.lm.lora import _linear, freeze, lora_linear, replace_linears
from llmbook.registry import implements

__all__ = ["adalora_linear", "AdaLoRALinear", "AdaLoRAAllocator", "adalora_budget", "add_adalora"]


# --------------------------------------------------------------------------- 11.04 AdaLoRA


@implements("11.04")
def adalora_linear(x: Float[Tensor, "... d_in"], W: Float[Tensor, "d_out d_in"], P: Float[Tensor, "d_out r"],
                   Lambda: Float[Tensor, " r"], Q: Float[Tensor, "r d_in"], alpha: float,
                   bias: Tensor | None = None) -> Float[Tensor, "... d_out"]:
    r"""AdaLoRA's SVD-form update :math:`\Delta W = \frac{\alpha}{r} P\,\mathrm{diag}(\Lambda)\,Q
    = \frac{\alpha}{r}\sum_i \lambda_i p_i q_i^\top`.

    ``P`` (``(d_out, r)``, left "singular vectors"), ``Lambda`` (``(r,)``, the singular values
    :math:`s_i` of the catalogue) and ``Q`` (``(r, d_in)``) are trained; an orthogonality penalty
    (:meth:`AdaLoRALinear.orth_penalty`) keeps ``P`` and ``Q`` near orthonormal, and
    :class:`AdaLoRAAllocator` zeroes the :math:`\lambda_i` of the least important triplets across all
    layers, so that each matrix ends with the rank it needs. ``r`` is the initial rank (``peft`` divides by
    ``r + 1e-5``). Returns :math:`x (W + \Delta W)^\top + b`.

    >>> adalora_linear(torch.ones(1, 2), torch.zeros(2, 2), torch.eye(2), torch.tensor([1.0, 0.0]), torch.eye(2), 2.0)
    tensor([[1., 0.]])
    """
    Lambda, Q = as_tensor(Lambda, "Lambda"), as_tensor(Q, "Q")
    check_dim(Lambda, "Lambda", "(r,)", max_dim=1)
    check_dim(Q, "Q", "(r, d_in)", min_dim=2, max_dim=2)
    if Q.shape[0] != Lambda.shape[0]:
        raise ValueError(f"Lambda {tuple(Lambda.shape)} and Q {tuple(Q.shape)} must share the rank r")
    check_same_dtype(Lambda, Q, "Lambda", "Q")
    return lora_linear(x, W, Lambda[:, None] * Q, P, alpha, bias)


class AdaLoRALinear(nn.Module):
    """An ``nn.Linear`` with AdaLoRA's ``lora_P``, ``lora_Lambda`` (starts at zero) and ``lora_Q``.

    >>> layer = AdaLoRALinear(nn.Linear(4, 3), r=2, alpha=4)
    >>> layer.rank, tuple(layer(torch.ones(1, 4)).shape)
    (0, (1, 3))
    """

    def __init__(self, base: nn.Linear, r: int, alpha: float):
        super().__init__()
        self.base = _linear(base).requires_grad_(False)
        self.r, self.alpha = check_positive_int(r, "r"), check_range(alpha, "alpha")
        W = base.weight
        kw = dict(dtype=W.dtype, device=W.device)
        self.lora_P = nn.Parameter(torch.randn(W.shape[0], r, **kw) * 0.02)
        self.lora_Lambda = nn.Parameter(torch.zeros(r, **kw))
        self.lora_Q = nn.Parameter(torch.randn(r, W.shape[1], **kw) * 0.02)

    @property
    def rank(self) -> int:
        """The number of non-zero :math:`\\lambda_i` (the rank the allocator left this matrix)."""
        return int((self.lora_Lambda != 0).sum())

    def orth_penalty(self) -> Tensor:
        r""":math:`\|P^\top P - I\|_F^2 + \|Q Q^\top - I\|_F^2`, AdaLoRA's regulariser (eq. 4 of the paper)."""
        eye = torch.eye(self.r, dtype=self.lora_P.dtype, device=self.lora_P.device)
        return ((self.lora_P.T @ self.lora_P - eye) ** 2).sum() + ((self.lora_Q @ self.lora_Q.T - eye) ** 2).sum()

    def forward(self, x: Tensor) -> Tensor:
        x = check_module_input(self, x, d=self.base.in_features, symbol="d_in")
        return adalora_linear(x, self.base.weight, self.lora_P, self.lora_Lambda, self.lora_Q, self.alpha,
                              self.base.bias)


class AdaLoRAAllocator:
    r"""AdaLoRA's importance scores and rank allocation over a set of :class:`AdaLoRALinear` layers.

    After each backward, :meth:`update` smooths the sensitivity :math:`I = |\theta \odot \nabla_\theta|`
    of every entry of ``P``, ``Lambda`` and ``Q``: :math:`\bar I \leftarrow \beta_1 \bar I + (1-\beta_1) I`,
    its uncertainty :math:`\bar U \leftarrow \beta_2 \bar U + (1-\beta_2)|I - \bar I|`, and the entry's
    score is :math:`\bar I \bar U`. A triplet's score (:meth:`scores`) is its :math:`\lambda_i`'s score plus
    the mean scores of :math:`q_i` and :math:`p_i`; :meth:`mask_to_budget` keeps the ``budget`` best
    triplets over *all* layers and zeroes the other :math:`\lambda_i`.
    """

    def __init__(self, beta1: float = 0.85, beta2: float = 0.85):
        self.beta1 = check_range(beta1, "beta1", 0.0, 1.0, low_open=True, high_open=True)
        self.beta2 = check_range(beta2, "beta2", 0.0, 1.0, low_open=True, high_open=True)
        self.I_bar: dict[str, Tensor] = {}
        self.U_bar: dict[str, Tensor] = {}

    @torch.no_grad()
    def update(self, layers: dict[str, AdaLoRALinear]) -> None:
        """Fold the current gradients of every layer's triplets into the smoothed sensitivity and uncertainty."""
        for name, layer in layers.items():
            for part in ("lora_P", "lora_Lambda", "lora_Q"):
                p, key = getattr(layer, part), f"{name}.{part}"
                if p.grad is None:
                    raise ValueError(f"{key} has no gradient: call backward() before update()")
                I = (p * p.grad).abs()
                I_bar = self.beta1 * self.I_bar.get(key, torch.zeros_like(I)) + (1 - self.beta1) * I
                self.U_bar[key] = (self.beta2 * self.U_bar.get(key, torch.zeros_like(I))
                                   + (1 - self.beta2) * (I - I_bar).abs())
                self.I_bar[key] = I_bar

    def scores(self, layers: dict[str, AdaLoRALinear]) -> dict[str, Tensor]:
        """Each layer's per-triplet importance, shape ``(r,)``, from the smoothed statistics."""
        def s(key):
            return self.I_bar[key] * self.U_bar[key]
        return {n: s(f"{n}.lora_Lambda") + s(f"{n}.lora_Q").mean(1) + s(f"{n}.lora_P").mean(0) for n in layers}

    @torch.no_grad()
    def mask_to_budget(self, layers: dict[str, AdaLoRALinear], budget: int) -> dict[str, int]:
        """Zero every :math:`\\lambda_i` whose triplet score is at or below the ``budget``-th best; return the ranks."""
        scores = self.scores(layers)
        total = sum(v.numel() for v in scores.values())
        budget = check_nonnegative_int(budget, "budget")
        if budget < total:
            threshold = torch.cat(list(scores.values())).kthvalue(total - budget).values
            for n, layer in layers.items():
                layer.lora_Lambda.masked_fill_(scores[n] <= threshold, 0.0)
        return {n: layer.rank for n, layer in layers.items()}


def adalora_budget(step: int, b_init: int, b_target: int, t_init: int, t_final: int, total_step: int) -> int:
    r"""AdaLoRA's cubic budget schedule of the number of triplets kept across all layers.

    ``b_init`` (:math:`b_0`) up to step ``t_init`` (:math:`t_i`), then
    :math:`b^{(t)} = b_T + (b_0 - b_T)\big(1 - \frac{t - t_i}{T - t_i - t_f}\big)^3` (rounded down), and
    ``b_target`` (:math:`b_T`) for the last ``t_final`` (:math:`t_f`) of ``total_step`` (:math:`T`) steps.

    >>> [adalora_budget(t, 48, 12, 10, 20, 100) for t in (0, 10, 40, 80, 90)]
    [48, 48, 18, 12, 12]
    """
    step, b_init, b_target, t_init, t_final, total_step = (check_nonnegative_int(v, n) for v, n in (
        (step, "step"), (b_init, "b_init"), (b_target, "b_target"), (t_init, "t_init"), (t_final, "t_final"),
        (total_step, "total_step")))
    if total_step <= t_init + t_final:
        raise ValueError(f"total_step ({total_step}) must exceed t_init + t_final ({t_init} + {t_final})")
    if step <= t_init:
        return b_init
    if step > total_step - t_final:
        return b_target
    return int((b_init - b_target) * (1 - (step - t_init) / (total_step - t_final - t_init)) ** 3 + b_target)


def add_adalora(model: nn.Module, r: int, alpha: float, targets=("q_proj", "v_proj")) -> dict[str, AdaLoRALinear]:
    """Freeze ``model``, wrap its linears named in ``targets`` with :class:`AdaLoRALinear`; returns name -> layer."""
    freeze(model)
    names = replace_linears(model, targets, lambda lin: AdaLoRALinear(lin, r, alpha))
    return {n: model.get_submodule(n) for n in names}
