r"""Training losses (chapter 7): classification losses, label smoothing and focal loss, and their reduction.

They take ``logits`` with the classes on the **last** axis, ``(..., V)``, and integer ``targets`` of
shape ``(...)`` (``V`` classes or vocabulary entries); positions whose target equals ``ignore_index``
(torch's ``-100``) count for nothing. ``reduction`` is ``"mean"`` (over counted positions), ``"sum"`` or
``"none"`` (:func:`reduce_loss`, shared by every module of the chapter). fp16 and bf16 inputs are
computed in float32 and the result is rounded back once (``llmbook._precision``).

The rest of chapter 7: contrastive and metric losses (InfoNCE, NT-Xent, triplet) in
:mod:`llmbook.lm.contrastive`, the language-modelling objectives (MLM, causal LM, span corruption) in
:mod:`llmbook.lm.objectives`, and distillation in :mod:`llmbook.lm.distillation`.
"""

from __future__ import annotations

import torch
from jaxtyping import Float, Int
from torch import Tensor

from llmbook._checks import (
    as_tensor,
    check_choice,
    check_dim,
    check_finite,
    check_int,
    check_integer_tensor,
    check_nonempty,
    check_positive_int,
    check_range,
    check_same_shape,
    check_shape,
    check_token_ids,
    check_unit_interval,
)
from llmbook._precision import restore_half, upcast_half
from llmbook.lm.probability import cross_entropy_loss, log_softmax, logsumexp
from llmbook.registry import implements

__all__ = [
    "reduce_loss",
    "smoothed_targets",
    "label_smoothing_loss",
    "focal_loss",
    "sigmoid_focal_loss",
    "z_loss",
]

REDUCTIONS = ("mean", "sum", "none")
CONVENTIONS = ("torch", "fairseq")


def reduce_loss(loss: Tensor, keep: Tensor | None, reduction: str, what: str = "counted position") -> Tensor:
    """Apply ``reduction`` to per-position losses that are already zero where ``keep`` is False.

    ``"mean"`` divides by the number of kept positions (all of them when ``keep`` is None) and raises
    ``ValueError`` when there is none, where torch would return NaN. Shared by every loss of chapter 7.

    >>> reduce_loss(torch.tensor([2.0, 0.0, 4.0]), torch.tensor([True, False, True]), "mean")
    tensor(3.)
    """
    check_choice(reduction, "reduction", REDUCTIONS)
    if reduction == "none":
        return loss
    if reduction == "sum":
        return loss.sum()
    n = loss.numel() if keep is None else int(keep.sum())
    if n == 0:
        raise ValueError(f"reduction='mean' over no {what} (empty input, or every target is ignore_index)")
    return loss.sum() / n


def _classification(logits, targets, ignore_index):
    """Checked ``(z, y, keep, ignore_index, dtype)``: logits ``(..., V)`` (fp16/bf16 upcast; ``dtype`` the
    caller's), class ids ``(...)`` or ``ignore_index``, and ``keep`` the counted positions."""
    z = as_tensor(logits, "logits")
    check_dim(z, "logits", "(..., V)")
    check_nonempty(z, "logits")
    check_finite(z, "logits", allow_neg_inf=True)
    y = check_integer_tensor(targets, "targets", "an integer tensor of class ids").long()
    if z.shape[:-1] != y.shape:
        raise ValueError(f"logits (..., V) = {tuple(z.shape)} and targets (...) = {tuple(y.shape)} disagree on (...)")
    if ignore_index is not None:
        ignore_index = check_int(ignore_index, "ignore_index", what="an int or None")
    keep = torch.ones_like(y, dtype=torch.bool) if ignore_index is None else y != ignore_index
    V = z.shape[-1]
    bad = keep & ((y < 0) | (y >= V))
    if bad.any():
        raise ValueError(f"targets must be class ids in [0, V) = [0, {V}) or ignore_index ({ignore_index}), "
                         f"got {y[bad][0].item()}")
    return upcast_half(z), y, keep, ignore_index, z.dtype


# ================================================================= 07.01 label smoothing


def _smoothing_weights(V: int, eps: float, convention: str) -> tuple[float, float]:
    """(weight of the true class, weight of every other class) of the smoothed target distribution."""
    check_choice(convention, "convention", CONVENTIONS)
    if convention == "torch":
        return 1.0 - eps + eps / V, eps / V
    if V < 2:
        raise ValueError(f"convention='fairseq' spreads eps over the V - 1 other classes: needs V >= 2, got V = {V}")
    return 1.0 - eps, eps / (V - 1)


def smoothed_targets(targets: Int[Tensor, "..."], V: int, eps: float = 0.1, convention: str = "torch",
                     dtype: torch.dtype = torch.float32) -> Float[Tensor, "... V"]:
    r"""The label-smoothed target distribution :math:`y^{LS}` of integer ``targets`` over ``V`` classes.

    ``convention="torch"`` (``F.cross_entropy(label_smoothing=eps)``, Szegedy et al.):
    :math:`y^{LS}_i = (1-\epsilon)\,y_i + \epsilon/V`, so the true class keeps :math:`1-\epsilon+\epsilon/V`.
    ``convention="fairseq"`` (fairseq's ``label_smoothed_cross_entropy``): the true class keeps exactly
    :math:`1-\epsilon` and the other :math:`V-1` classes share :math:`\epsilon`, each :math:`\epsilon/(V-1)`.
    Shape ``(...) -> (..., V)``.

    >>> smoothed_targets(torch.tensor([0]), 4, eps=0.2)
    tensor([[0.8500, 0.0500, 0.0500, 0.0500]])
    >>> smoothed_targets(torch.tensor([0]), 4, eps=0.3, convention="fairseq")
    tensor([[0.7000, 0.1000, 0.1000, 0.1000]])
    """
    V = check_positive_int(V, "V")
    y = check_token_ids(targets, V, "targets")
    eps = check_unit_interval(eps, "eps")
    w_on, w_off = _smoothing_weights(V, eps, convention)
    out = torch.full((*y.shape, V), w_off, dtype=dtype)
    return out.scatter_(-1, y.unsqueeze(-1), w_on)


@implements("07.01")
def label_smoothing_loss(logits: Float[Tensor, "... V"], targets: Int[Tensor, "..."], eps: float = 0.1,
                         convention: str = "torch", ignore_index: int | None = -100,
                         reduction: str = "mean") -> Tensor:
    r"""Cross-entropy against label-smoothed targets, :math:`\ell = -\sum_i y^{LS}_i \log p_i`.

    .. math:: y_i^{LS} = (1-\epsilon)\,y_i + \frac{\epsilon}{V} \quad\text{(torch)},\qquad
              y_i^{LS} = (1-\epsilon)\,y_i + \frac{\epsilon}{V-1}(1-y_i) \quad\text{(fairseq)}

    Symbols: :math:`y` the one-hot ``targets``, :math:`\epsilon` ``eps``, :math:`V` the last axis of
    ``logits``, :math:`p = \mathrm{softmax}(z)`. With :math:`w_{on}, w_{off}` the two weights of
    :func:`smoothed_targets`, :math:`\ell = (w_{on}-w_{off})(-\log p_y) + w_{off}\sum_j(-\log p_j)`.
    ``convention="torch"`` equals ``F.cross_entropy(logits, targets, label_smoothing=eps)``;
    ``"fairseq"`` equals fairseq's ``label_smoothed_nll_loss``. The two differ by how much the true
    class keeps: :math:`1-\epsilon+\epsilon/V` against :math:`1-\epsilon`.

    Shapes ``(..., V), (...) -> ()`` (``"none"``: ``(...)``, zero at ignored positions).

    >>> z = torch.tensor([[2.0, 0.0, 0.0]])
    >>> round(label_smoothing_loss(z, torch.tensor([0]), eps=0.0).item(), 4)  # plain cross-entropy
    0.2395
    >>> round(label_smoothing_loss(z, torch.tensor([0]), eps=0.1).item(), 4)
    0.3729
    """
    z, y, keep, ignore_index, dtype = _classification(logits, targets, ignore_index)
    eps = check_unit_interval(eps, "eps")
    w_on, w_off = _smoothing_weights(z.shape[-1], eps, convention)
    check_choice(reduction, "reduction", REDUCTIONS)
    nll_t = cross_entropy_loss(z, y, reduction="none", ignore_index=ignore_index)  # -log p_y, 0 where ignored
    loss = (w_on - w_off) * nll_t
    if w_off > 0:  # skip at eps = 0: 0 * (-inf) would be NaN for a masked logit
        smooth = -log_softmax(z).sum(-1)
        loss = loss + w_off * torch.where(keep, smooth, torch.zeros_like(smooth))
    return restore_half(reduce_loss(loss, keep, reduction), dtype)


# ================================================================= 07.02 focal loss


@implements("07.02")
def focal_loss(logits: Float[Tensor, "... V"], targets: Int[Tensor, "..."], gamma: float = 2.0,
               alpha: Float[Tensor, " V"] | None = None, ignore_index: int | None = -100,
               reduction: str = "mean") -> Tensor:
    r"""Multi-class focal loss :math:`L_{focal} = -\alpha_t\,(1-p_t)^\gamma \log p_t`.

    :math:`p_t = \mathrm{softmax}(z)_{y}` is the probability of the true class (``targets``), ``gamma``
    the focusing exponent :math:`\gamma \ge 0`, ``alpha`` optional per-class weights (shape ``(V,)``,
    :math:`\alpha_t = \alpha_y`; None for 1). The factor :math:`(1-p_t)^\gamma` shrinks the loss of
    examples that are already right, so the many easy ones stop drowning out the few hard ones.
    :math:`\gamma = 0` gives the :math:`\alpha`-weighted cross-entropy (``F.cross_entropy(weight=alpha,
    reduction="none")``). :math:`1-p_t` is computed from the cross-entropy :math:`\ell_t=-\log p_t` as
    ``-expm1(-l_t)``, with no second cancellation on top of :math:`\ell_t`'s own rounding. ``"mean"``
    averages over counted positions (torch's weighted cross-entropy divides by :math:`\sum\alpha_t`).
    Shapes ``(..., V), (...) -> ()`` (``"none"``: ``(...)``).

    >>> z, y = torch.tensor([[3.0, 0.0], [0.0, 0.0]]), torch.tensor([0, 0])
    >>> focal_loss(z, y, gamma=2.0, reduction="none")  # the easy row (p_t = 0.95) almost vanishes
    tensor([0.0001, 0.1733])
    """
    z, y, keep, ignore_index, dtype = _classification(logits, targets, ignore_index)
    gamma = check_range(gamma, "gamma", 0.0)
    check_choice(reduction, "reduction", REDUCTIONS)
    nll_t = cross_entropy_loss(z, y, reduction="none", ignore_index=ignore_index)  # -log p_t
    loss = (-torch.expm1(-nll_t)).clamp_min(0) ** gamma * nll_t  # (1 - p_t)^gamma (-log p_t); 0^0 = 1
    if alpha is not None:
        alpha = as_tensor(alpha, "alpha")
        check_shape(alpha, (z.shape[-1],), "alpha", "the class axis V of logits")
        check_finite(alpha, "alpha")
        if (alpha < 0).any():
            raise ValueError("alpha must hold non-negative class weights")
        loss = upcast_half(alpha).to(z.dtype)[torch.where(keep, y, torch.zeros_like(y))] * loss
    return restore_half(reduce_loss(loss, keep, reduction), dtype)


def sigmoid_focal_loss(logits: Float[Tensor, "..."], targets: Float[Tensor, "..."], gamma: float = 2.0,
                       alpha: float | None = 0.25, reduction: str = "mean") -> Tensor:
    r"""RetinaNet's binary focal loss, one sigmoid per entry: :math:`-\alpha_t(1-p_t)^\gamma\log p_t`.

    :math:`p = \sigma(x)` for ``logits`` :math:`x`, ``targets`` :math:`y\in[0,1]` of the same shape,
    :math:`p_t = p\,y + (1-p)(1-y)`, :math:`\alpha_t = \alpha y + (1-\alpha)(1-y)` (``alpha=None``: no
    weighting). The same definition as ``torchvision.ops.sigmoid_focal_loss`` (not a dependency here):
    :math:`-\log p_t` is the binary cross-entropy with logits, computed as
    :math:`\max(x,0) - xy + \log(1+e^{-|x|})`, and :math:`1-p_t = \sigma(x)(1-y) + \sigma(-x)\,y` without
    cancellation. ``"mean"`` averages over all entries. Shapes ``(...), (...) -> ()`` (``"none"``: ``(...)``).

    >>> round(sigmoid_focal_loss(torch.tensor([0.0]), torch.tensor([1.0]), gamma=0.0, alpha=None).item(), 4)
    0.6931
    """
    x, y = as_tensor(logits, "logits"), as_tensor(targets, "targets")
    check_same_shape(x, y, "logits", "targets")
    check_finite(x, "logits")
    check_finite(y, "targets")
    if ((y < 0) | (y > 1)).any():
        raise ValueError("targets must lie in [0, 1] (1 = positive, 0 = negative)")
    gamma = check_range(gamma, "gamma", 0.0)
    if alpha is not None:
        alpha = check_unit_interval(alpha, "alpha")
    check_choice(reduction, "reduction", REDUCTIONS)
    dtype = x.dtype
    x = upcast_half(x)
    y = y.to(x.dtype)
    ce = x.clamp_min(0) - x * y + torch.log1p(torch.exp(-x.abs()))
    loss = ce * (torch.sigmoid(x) * (1 - y) + torch.sigmoid(-x) * y) ** gamma
    if alpha is not None:
        loss = (alpha * y + (1 - alpha) * (1 - y)) * loss
    return restore_half(reduce_loss(loss, None, reduction, "entry"), dtype)


# ================================================================= z-loss (PaLM)


def z_loss(logits: Float[Tensor, "... V"], coef: float = 1e-4, mask: Tensor | None = None,
           reduction: str = "mean") -> Tensor:
    r"""PaLM's auxiliary z-loss :math:`L_z = c\,(\log Z)^2`, :math:`\log Z = \log\sum_{i=1}^{V} e^{z_i}`.

    The softmax ignores a shift of all logits, so cross-entropy leaves :math:`\log Z` (the log of the
    softmax normaliser) free to drift; in bf16 a large :math:`\log Z` costs precision and can set off
    divergence. PaLM (Chowdhery et al.) adds :math:`10^{-4}\log^2 Z` per token to the loss, which pulls
    :math:`\log Z` towards 0, i.e. the logits towards log-probabilities. Symbols: :math:`z` ``logits``
    ``(..., V)``, :math:`c` ``coef`` :math:`\ge 0`; ``mask`` an optional boolean ``(...)`` of counted
    positions (None: all). The gradient is :math:`\partial L_z/\partial z = 2c\log Z\,\mathrm{softmax}(z)`.
    (The router z-loss of mixture-of-experts, :func:`llmbook.lm.moe.router_z_loss`, is the same term on
    router logits.) Shapes ``(..., V) -> ()`` (``"none"``: ``(...)``, zero where ``mask`` is False).

    >>> z_loss(torch.zeros(2, 4), coef=1.0)  # log Z = log 4 at every position: (log 4)^2
    tensor(1.9218)
    >>> z_loss(torch.tensor([[0.0, -50.0]]), coef=1.0).item() < 1e-40  # log-probabilities: log Z ~ 0
    True
    """
    z = as_tensor(logits, "logits")
    check_dim(z, "logits", "(..., V)")
    check_nonempty(z, "logits")
    check_finite(z, "logits", allow_neg_inf=True)
    coef = check_range(coef, "coef", 0.0)
    check_choice(reduction, "reduction", REDUCTIONS)
    keep = None
    if mask is not None:
        keep = as_tensor(mask, "mask", floating=False)
        if keep.dtype != torch.bool:
            raise TypeError(f"mask must be a boolean tensor of counted positions, got dtype {keep.dtype}")
        if keep.shape != z.shape[:-1]:
            raise ValueError(f"mask (...) = {tuple(keep.shape)} must match logits (..., V) = {tuple(z.shape)} on (...)")
    dtype = z.dtype
    log_Z = logsumexp(upcast_half(z), dim=-1)
    loss = coef * log_Z.square()
    if keep is not None:
        loss = torch.where(keep, loss, torch.zeros_like(loss))
    return restore_half(reduce_loss(loss, keep, reduction), dtype)
