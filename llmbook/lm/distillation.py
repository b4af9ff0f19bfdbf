r"""Knowledge distillation (chapter 7): matching a teacher's softened outputs and its hidden states.

A small *student* learns from a large *teacher* through more than the hard labels: the whole output
distribution, softened by a temperature (:func:`distillation_loss`, Hinton et al.; DistilBERT), and
the hidden states of chosen layers, projected to the teacher's width (:func:`hidden_state_distillation_loss`,
FitNets, TinyBERT). Logits carry the classes or vocabulary on the last axis, ``(..., V)``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from jaxtyping import Float
from torch import Tensor

from llmbook._checks import (
    as_tensor,
    check_choice,
    check_dim,
    check_finite,
    check_int,
    check_nonempty,
    check_range,
    check_same_dtype,
    check_same_shape,
    check_shape,
)
from llmbook._precision import restore_half, upcast_half
from llmbook.lm.losses import REDUCTIONS, reduce_loss
from llmbook.lm.probability import log_softmax
from llmbook.registry import implements

__all__ = ["distillation_loss", "hidden_state_distillation_loss", "uniform_layer_map"]


@implements("07.09")
def distillation_loss(student_logits: Float[Tensor, "... V"], teacher_logits: Float[Tensor, "... V"],
                      tau: float = 2.0, reduction: str = "mean") -> Tensor:
    r"""Knowledge distillation :math:`L_{KD}=T^2\,D_{KL}\big(\mathrm{softmax}(z_T/T)\,\|\,\mathrm{softmax}(z_S/T)\big)`.

    Symbols: :math:`z_S` ``student_logits``, :math:`z_T` ``teacher_logits`` (same shape ``(..., V)``), the
    temperature :math:`T` is ``tau`` (the equation's :math:`T`; ``tau`` here because ``T`` names positions).
    A temperature above 1 flattens both distributions, so the teacher's small probabilities (which wrong
    answers it finds plausible, the "dark knowledge") carry weight; the factor :math:`T^2` keeps the
    gradient's size independent of :math:`T`, since the soft-target gradient shrinks as :math:`1/T^2`.
    The KL is a sum over ``V`` with :math:`0 \log 0 = 0`. ``"mean"`` averages over the distributions
    (every leading position): on ``(N, V)`` logits it is
    ``F.kl_div(log_softmax(z_S / T), softmax(z_T / T), reduction="batchmean") * T**2``.
    Shapes ``(..., V), (..., V) -> ()`` (``"none"``: ``(...)``).

    >>> z = torch.tensor([[1.0, 2.0, 3.0]])
    >>> distillation_loss(z, z).item()  # a student equal to its teacher pays nothing
    0.0
    """
    z_S, z_T = as_tensor(student_logits, "student_logits"), as_tensor(teacher_logits, "teacher_logits")
    for z, name in ((z_S, "student_logits"), (z_T, "teacher_logits")):
        check_dim(z, name, "(..., V)")
        check_nonempty(z, name)
        check_finite(z, name, allow_neg_inf=True)
    check_same_shape(z_S, z_T, "student_logits", "teacher_logits")
    check_same_dtype(z_S, z_T, "student_logits", "teacher_logits")
    tau = check_range(tau, "tau", 0.0, low_open=True)
    check_choice(reduction, "reduction", REDUCTIONS)
    dtype = z_S.dtype
    log_p_S, log_p_T = log_softmax(upcast_half(z_S) / tau), log_softmax(upcast_half(z_T) / tau)
    p_T = log_p_T.exp()
    kl = torch.where(p_T > 0, p_T * (log_p_T - log_p_S), torch.zeros_like(p_T)).sum(-1)
    loss = kl * tau * tau  # not tau**2 * kl: tau**2 overflows float32 first for tau > 1.8e19
    return restore_half(reduce_loss(loss, None, reduction, "distribution"), dtype)


def uniform_layer_map(L_S: int, L_T: int) -> list[int]:
    r"""TinyBERT's uniform layer map :math:`m(l) = l\,L_T/L_S`: student layer ``l`` learns from teacher layer ``m(l)``.

    Zero-based: student layer ``l`` (``0 .. L_S - 1``) is mapped to teacher layer
    :math:`\lfloor (l+1)\,L_T/L_S\rfloor - 1`, so the last student layer learns from the last teacher layer.

    >>> uniform_layer_map(4, 12)  # a 4-layer TinyBERT from a 12-layer BERT: every third layer
    [2, 5, 8, 11]
    """
    L_S, L_T = check_int(L_S, "L_S", low=1), check_int(L_T, "L_T", low=1)
    if L_S > L_T:
        raise ValueError(f"a uniform map needs L_S <= L_T (one teacher layer per student layer), got {L_S} > {L_T}")
    return [(l + 1) * L_T // L_S - 1 for l in range(L_S)]


def _states(x, name: str) -> list[Tensor]:
    """A sequence of layer tensors (or one stacked tensor, split on its first axis), checked."""
    if torch.is_tensor(x):
        check_dim(x, name, "(L, ..., d) or a sequence of L tensors (..., d)", min_dim=2)
        x = list(x.unbind(0))
    elif not isinstance(x, Sequence) or isinstance(x, (str, bytes)):
        raise TypeError(f"{name} must be a sequence of tensors or one stacked tensor, got {type(x).__name__}")
    if len(x) == 0:
        raise ValueError(f"{name} must hold at least one layer")
    out = [as_tensor(h, f"{name}[{i}]") for i, h in enumerate(x)]
    for i, h in enumerate(out):
        check_dim(h, f"{name}[{i}]", "(..., d)")
        check_nonempty(h, f"{name}[{i}]")
        check_finite(h, f"{name}[{i}]")
        check_same_dtype(h, out[0], f"{name}[{i}]", f"{name}[0]")
        if h.numel() == 0:
            raise ValueError(f"{name}[{i}] must not be empty, got shape {tuple(h.shape)}")
    return out


@implements("07.10")
def hidden_state_distillation_loss(student_states, teacher_states, W=None, layer_map: Sequence[int] | None = None,
                                   reduction: str = "mean") -> Tensor:
    r"""Hidden-state distillation :math:`L_{hid}=\sum_{l}\|H_{S}^{(l)}W_l-H_T^{(m(l))}\|_2^2`.

    ``student_states``: the :math:`L_S` student hidden states :math:`H_S^{(l)}`, each ``(..., d_S)`` (a
    list, or one tensor ``(L_S, ..., d_S)``); ``teacher_states``: the :math:`L_T` teacher states, each
    ``(..., d_T)`` with the same leading shape. ``W``: the learned projections :math:`W_l`, ``(d_S, d_T)``
    each (a list or ``(L_S, d_S, d_T)``), or None for the identity (then ``d_S == d_T``). ``layer_map``: the
    teacher layer :math:`m(l)` of each student layer (default :func:`uniform_layer_map`).

    ``reduction="sum"`` is the equation (squared error summed over layers and elements); ``"mean"`` (default,
    TinyBERT) sums over layers the *mean* squared error of each layer, ``nn.MSELoss()`` per layer; ``"none"``
    returns those per-layer mean squared errors, shape ``(L_S,)``.

    >>> H_S, H_T = [torch.ones(2, 3)], [torch.zeros(2, 3), torch.full((2, 3), 2.0)]
    >>> loss = hidden_state_distillation_loss
    >>> loss(H_S, H_T).item(), loss(H_S, H_T, reduction="sum").item()  # m(0) = 1: (1 - 2)^2 per element
    (1.0, 6.0)
    """
    H_S, H_T = _states(student_states, "student_states"), _states(teacher_states, "teacher_states")
    check_same_dtype(H_S[0], H_T[0], "student_states", "teacher_states")
    L_S, L_T = len(H_S), len(H_T)
    check_choice(reduction, "reduction", REDUCTIONS)
    m = uniform_layer_map(L_S, L_T) if layer_map is None else [check_int(j, "layer_map[l]", low=0, high=L_T - 1)
                                                               for j in layer_map]
    if len(m) != L_S:
        raise ValueError(f"layer_map must name one teacher layer per student layer: {L_S} entries, got {len(m)}")
    if W is not None:
        W = _states(W, "W")
        if len(W) != L_S:
            raise ValueError(f"W must hold one projection per student layer: {L_S}, got {len(W)}")
        check_same_dtype(W[0], H_S[0], "W", "student_states")
    dtype = H_S[0].dtype
    errors = []
    for l, h in enumerate(H_S):
        target = H_T[m[l]]
        if W is not None:
            check_shape(W[l], (h.shape[-1], target.shape[-1]), f"W[{l}]", "(d_S, d_T) of the paired states")
            h = upcast_half(h) @ upcast_half(W[l])
        if h.shape != target.shape:
            raise ValueError(f"student state {l} (projected: {tuple(h.shape)}) and teacher state {m[l]} "
                             f"{tuple(target.shape)} must have the same shape (pass W to project d_S to d_T)")
        sq = (upcast_half(h) - upcast_half(target)).square()
        errors.append(sq.sum() if reduction == "sum" else sq.mean())
    per_layer = torch.stack(errors)
    return restore_half(per_layer if reduction == "none" else per_layer.sum(), dtype)
