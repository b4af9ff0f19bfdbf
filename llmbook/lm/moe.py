r"""Mixture of experts (chapter 14): gating, top-k routing, capacity, balancing and the sparse layer.

Symbols: ``N`` tokens (any leading axes are flattened into it), ``C`` model width, ``d_ff`` expert
hidden width, ``E`` experts, ``K`` experts chosen per token. The catalogue writes the number of
experts as :math:`N` and the tokens as :math:`T`; this module follows the design notes (``E`` experts,
``N`` tokens), so the catalogue's :math:`C_e=\lceil T c / N\rceil` reads
:math:`\lceil c\,N K / E\rceil` here (with ``K = 1`` for Switch).

A routing is a pair of ``(N, K)`` tensors, ``topk_ids`` (which experts) and ``topk_weights`` (how much
each contributes), plus an optional ``keep`` mask of the assignments that fit within capacity.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from fractions import Fraction

import torch
import torch.nn.functional as F
from jaxtyping import Bool, Float, Int
from torch import Tensor

from llmbook._checks import (
    as_tensor,
    check_dim,
    check_finite,
    check_integer_tensor,
    check_nonempty,
    check_nonnegative_int,
    check_positive_int,
    check_range,
    check_same_dtype,
    check_same_shape,
)
from llmbook.lm.probability import logsumexp, softmax
from llmbook.registry import implements

__all__ = [
    "router_probs",
    "top_k_routing",
    "switch_routing",
    "moe_output",
    "load_balancing_loss",
    "expert_capacity",
    "capacity_mask",
    "router_z_loss",
    "expert_load",
    "load_imbalance",
    "update_routing_bias",
    "moe_param_count",
    "moe_flops",
]

ACTIVATIONS = ("swiglu", "relu", "gelu")


def _scores(s, name: str = "probs") -> Tensor:
    s = as_tensor(s, name)
    check_dim(s, name, "(..., E)")
    check_nonempty(s, name)
    check_finite(s, name)
    return s


def _ids(topk_ids, E: int, name: str = "topk_ids") -> Tensor:
    ids = check_integer_tensor(topk_ids, name, "an integer tensor of shape (..., K)")
    check_dim(ids, name, "(..., K)")
    if ids.numel() and (ids.min() < 0 or ids.max() >= E):
        raise ValueError(f"{name} must hold expert ids in [0, E) = [0, {E}), got range "
                         f"[{ids.min().item()}, {ids.max().item()}]")
    return ids.long()


def _keep(keep, ids: Tensor) -> Tensor:
    """The capacity mask ``keep``: a bool tensor of the shape of ``topk_ids`` (one flag per assignment)."""
    keep = as_tensor(keep, "keep", floating=False)
    if keep.dtype != torch.bool:
        raise TypeError(f"keep must be a bool mask (True = the assignment fits), got dtype {keep.dtype}")
    check_same_shape(keep, ids, "keep", "topk_ids")
    return keep


# ================================================================= routing: 14.01, 14.02, 14.04


@implements("14.01")
def router_probs(x: Float[Tensor, "... C"], W_g: Float[Tensor, "E C"]) -> Float[Tensor, "... E"]:
    r"""Router gating :math:`g(x) = \mathrm{softmax}(W_g x)`: one probability per expert and token.

    ``x`` holds token vectors (``(..., C)``), ``W_g`` the router weight (``(E, C)``, one row per
    expert, as ``nn.Linear(C, E).weight``). Shape ``(..., C), (E, C) -> (..., E)``.

    >>> router_probs(torch.ones(1, 2), torch.zeros(3, 2))  # a zero router is uniform over E = 3
    tensor([[0.3333, 0.3333, 0.3333]])
    """
    x, W_g = as_tensor(x, "x"), as_tensor(W_g, "W_g")
    check_dim(W_g, "W_g", "(E, C)", min_dim=2, max_dim=2)
    check_dim(x, "x", "(..., C)")
    check_same_dtype(x, W_g, "x", "W_g")
    if x.shape[-1] != W_g.shape[1]:
        raise ValueError(f"x (..., C) = {tuple(x.shape)} and W_g (E, C) = {tuple(W_g.shape)} disagree on C")
    return softmax(x @ W_g.T)


@implements("14.02")
def top_k_routing(probs: Float[Tensor, "... E"], K: int, *, renormalize: bool = True,
                  bias: Float[Tensor, " E"] | None = None) -> tuple[Float[Tensor, "... K"], Int[Tensor, "... K"]]:
    r"""Top-k routing :math:`S(x) = \mathrm{TopK}(g(x), K)` and the combine weights of the chosen experts.

    Returns ``(topk_weights, topk_ids)``, both ``(..., K)``, sorted by decreasing score. With
    ``renormalize`` the weights are :math:`g_e / \sum_{j\in S} g_j` and sum to one: Mixtral's weights, and
    for ``K = 2`` GShard's top-2 gates :math:`g_1 / (g_1 + g_2)`, :math:`g_2 / (g_1 + g_2)`. Without it they
    are the raw :math:`g_e`, as in Switch's top-1 routing (:func:`switch_routing`).

    ``bias`` (``(E,)``) is DeepSeek's auxiliary-loss-free balancing term: the experts are *selected*
    by :math:`g_e + b_e`, but the weights still come from :math:`g_e` alone, so no gradient flows
    through ``bias`` and the loss of the model does not see it. The bias can select experts whose
    :math:`g_e` underflowed to 0 (a saturated softmax): if the chosen experts' scores sum to exactly 0,
    the renormalised weights are uniform, :math:`1/K` (the limit for equal underflowed scores), with no
    gradient, instead of :math:`0/0`.

    >>> w, ids = top_k_routing(torch.tensor([[0.1, 0.6, 0.3]]), 2)
    >>> ids, w
    (tensor([[1, 2]]), tensor([[0.6667, 0.3333]]))
    """
    probs = _scores(probs)
    E = probs.shape[-1]
    K = check_positive_int(K, "K")
    if K > E:
        raise ValueError(f"K ({K}) cannot exceed the number of experts E ({E})")
    select = probs
    if bias is not None:
        bias = as_tensor(bias, "bias")
        if bias.shape != (E,):
            raise ValueError(f"bias must have shape (E,) = ({E},), got {tuple(bias.shape)}")
        check_finite(bias, "bias")
        select = probs.detach() + bias.to(probs.dtype)  # selection only: indices carry no gradient
    topk_ids = torch.topk(select, K, dim=-1).indices
    w = probs.gather(-1, topk_ids)
    if renormalize:
        den = w.sum(-1, keepdim=True)
        ok = den > 0  # guard both branches: a 0/0 would also poison the gradient through torch.where
        w = torch.where(ok, w / torch.where(ok, den, torch.ones_like(den)), torch.full_like(w, 1.0 / K))
    return w, topk_ids


@implements("14.04")
def switch_routing(probs: Float[Tensor, "... E"]) -> tuple[Float[Tensor, "... 1"], Int[Tensor, "... 1"]]:
    r"""Switch routing: :math:`e^\ast = \arg\max_e g_e(x)` and :math:`y = g_{e^\ast}(x)\,E_{e^\ast}(x)`.

    Top-1 routing *without* renormalisation: the gate is the raw probability of the chosen expert,
    so the router still receives a gradient (a renormalised top-1 weight would be the constant 1).
    Returns ``(weights, ids)`` of shape ``(..., 1)``; pass them to :func:`moe_output`.

    >>> switch_routing(torch.tensor([[0.2, 0.5, 0.3]]))
    (tensor([[0.5000]]), tensor([[1]]))
    """
    return top_k_routing(probs, 1, renormalize=False)


# ================================================================= the sparse output: 14.03


@implements("14.03")
def moe_output(x: Float[Tensor, "... C"], experts: Sequence[Callable[[Tensor], Tensor]],
               topk_ids: Int[Tensor, "... K"], topk_weights: Float[Tensor, "... K"],
               keep: Bool[Tensor, "... K"] | None = None, d_out: int | None = None) -> Float[Tensor, "... D"]:
    r"""The sparse MoE output :math:`y = \sum_{e \in S(x)} g_e(x)\, E_e(x)`.

    ``experts[e]`` maps a batch of rows ``(n, C) -> (n, D)``. Tokens are grouped by expert, so each
    expert runs once on all its rows (never on a token that did not choose it), and the weighted
    outputs are added back at their tokens. Assignments with ``keep == False`` (dropped for lack of
    capacity) contribute nothing. ``d_out`` is ``D`` when no assignment is kept (default ``C``).

    Shapes ``(..., C), E experts, (..., K), (..., K) -> (..., D)``.

    >>> experts = [lambda r: r * 10, lambda r: r * 100]
    >>> moe_output(torch.ones(1, 2), experts, torch.tensor([[1, 0]]), torch.tensor([[0.75, 0.25]]))
    tensor([[77.5000, 77.5000]])
    """
    x = as_tensor(x, "x")
    check_dim(x, "x", "(..., C)")
    E = len(experts)
    if E == 0:
        raise ValueError("experts must hold at least one expert")
    ids = _ids(topk_ids, E)
    w = as_tensor(topk_weights, "topk_weights").to(x.dtype)
    if ids.shape != w.shape or ids.shape[:-1] != x.shape[:-1]:
        raise ValueError(f"x (..., C) = {tuple(x.shape)}, topk_ids {tuple(ids.shape)} and topk_weights "
                         f"{tuple(w.shape)} must agree on (...) and ids/weights on K")
    if keep is not None:
        keep = _keep(keep, ids)
    if d_out is not None:
        d_out = check_positive_int(d_out, "d_out")
    lead, C = x.shape[:-1], x.shape[-1]
    K = ids.shape[-1]
    N = math.prod(lead)  # explicit: reshape(-1, 0) cannot infer N when C = 0 or K = 0
    xs, ids, w = x.reshape(N, C), ids.reshape(N, K), w.reshape(N, K)
    if keep is not None:
        keep = keep.reshape(N, K)
        ids = torch.where(keep, ids, torch.full_like(ids, -1))  # dropped assignments match no expert
    y = None
    for e in range(E):
        token, slot = torch.nonzero(ids == e, as_tuple=True)
        if token.numel() == 0:
            continue
        out = experts[e](xs[token]) * w[token, slot].unsqueeze(-1)
        if y is None:
            y = xs.new_zeros(xs.shape[0], out.shape[-1])
        y = y.index_add(0, token, out.to(y.dtype))
    if y is None:
        y = xs.new_zeros(xs.shape[0], C if d_out is None else d_out)
    return y.reshape(*lead, y.shape[-1])


# ================================================================= balancing: 14.05, 14.07 and the bias


def expert_load(topk_ids: Int[Tensor, "... K"], E: int, keep: Bool[Tensor, "... K"] | None = None) -> Tensor:
    r"""Assignments per expert, :math:`\mathrm{load}_e = \#\{(n, k): \mathrm{id}_{nk} = e\}`, shape ``(E,)``.

    >>> expert_load(torch.tensor([[0, 1], [0, 2]]), 4)
    tensor([2, 1, 1, 0])
    """
    E = check_positive_int(E, "E")
    ids = _ids(topk_ids, E)
    if keep is not None:
        ids = ids[_keep(keep, ids)]
    return torch.bincount(ids.flatten(), minlength=E)


@implements("14.05")
def load_balancing_loss(probs: Float[Tensor, "... E"], topk_ids: Int[Tensor, "... K"],
                        alpha: float = 1.0) -> Tensor:
    r"""Switch's auxiliary load-balancing loss :math:`L_{aux} = \alpha\, E \sum_{e=1}^{E} f_e P_e`.

    :math:`f_e` is the fraction of the ``N`` tokens routed to expert ``e`` (counted over all ``K``
    choices, so :math:`\sum_e f_e = K`) and :math:`P_e` the mean router probability of ``e``. Only
    :math:`P` carries a gradient; :math:`f` counts. A uniform routing gives :math:`\alpha K`, the
    minimum; sending everything to one expert (``K = 1``) gives :math:`\alpha E`.

    ``probs`` ``(..., E)`` and ``topk_ids`` ``(..., K)`` share their leading axes, which are pooled.

    >>> round(load_balancing_loss(torch.full((4, 4), 0.25), torch.tensor([[0], [1], [2], [3]])).item(), 4)
    1.0
    """
    probs = _scores(probs)
    check_range(alpha, "alpha", 0.0)
    E = probs.shape[-1]
    ids = _ids(topk_ids, E)
    if ids.shape[:-1] != probs.shape[:-1]:
        raise ValueError(f"probs (..., E) = {tuple(probs.shape)} and topk_ids (..., K) = {tuple(ids.shape)} "
                         "must share their leading axes")
    N = probs[..., 0].numel()
    if N == 0:
        raise ValueError("load_balancing_loss needs at least one token")
    f = expert_load(ids, E).to(probs.dtype) / N
    P = probs.reshape(-1, E).mean(0)
    return alpha * E * (f * P).sum()


@implements("14.07")
def router_z_loss(logits: Float[Tensor, "... E"]) -> Tensor:
    r"""Router z-loss :math:`L_z = \frac{1}{N}\sum_{i=1}^{N} \big(\log\sum_{j=1}^{E} e^{z_{ij}}\big)^2`.

    Penalises large router logits ``z`` (``(..., E)``, leading axes pooled into the ``N`` tokens),
    which keeps the softmax out of its saturated, round-off-prone regime (ST-MoE).

    >>> round(router_z_loss(torch.zeros(3, 4)).item(), 4)  # (log 4)^2
    1.9218
    """
    z = _scores(logits, "logits")
    if z[..., 0].numel() == 0:
        raise ValueError("router_z_loss needs at least one token")
    return (logsumexp(z) ** 2).mean()


def load_imbalance(load: Tensor) -> float:
    r"""Max-to-mean load ratio :math:`\max_e \mathrm{load}_e / \overline{\mathrm{load}}`: 1 is perfectly balanced.

    >>> load_imbalance(torch.tensor([4, 0, 0, 0]))
    4.0
    """
    load = torch.as_tensor(load, dtype=torch.float64)
    if load.ndim != 1 or load.numel() == 0 or load.sum() <= 0:
        raise ValueError(f"load must be a non-empty (E,) tensor with a positive sum, got {load.tolist()}")
    return float(load.max() / load.mean())


def update_routing_bias(bias: Float[Tensor, " E"], load: Tensor, u: float) -> Float[Tensor, " E"]:
    r"""DeepSeek's auxiliary-loss-free bias update.

    .. math:: b_e \leftarrow b_e + u\,\mathrm{sign}(\overline{\mathrm{load}} - \mathrm{load}_e)

    Under-loaded experts gain ``u``, over-loaded ones lose ``u``; an expert exactly at the mean keeps
    its bias. Not a gradient step: ``bias`` only enters the selection of :func:`top_k_routing`.

    >>> update_routing_bias(torch.zeros(3), torch.tensor([6, 2, 1]), 0.1)
    tensor([-0.1000,  0.1000,  0.1000])
    """
    bias = as_tensor(bias, "bias")
    load = as_tensor(load, "load").to(bias.dtype)  # counts (int) or float loads; a bool mask is not a load
    if bias.ndim != 1 or load.shape != bias.shape:
        raise ValueError(f"bias (E,) = {tuple(bias.shape)} and load (E,) = {tuple(load.shape)} must match")
    check_range(u, "u", 0.0)
    return bias + u * torch.sign(load.mean() - load)


# ================================================================= capacity: 14.06


@implements("14.06")
def expert_capacity(N: int, E: int, K: int = 1, capacity_factor: float = 1.0) -> int:
    r"""Expert capacity :math:`C_e = \lceil c \cdot N K / E \rceil` assignments per expert.

    ``N`` tokens each choose ``K`` of ``E`` experts; a perfectly balanced routing gives every expert
    :math:`NK/E`, and the capacity factor ``c`` (``capacity_factor``) is the slack above that.
    The catalogue's :math:`\lceil T c / N\rceil` is the case ``K = 1`` with ``T`` tokens and ``N`` experts.
    Computed in exact rational arithmetic on the decimal value of ``c``, so ``c = 1.1`` with
    ``N K / E = 50`` gives 55, not the 56 that ``ceil(1.1 * 50)`` rounds up to in floating point.

    >>> expert_capacity(N=64, E=8, K=2, capacity_factor=1.25)
    20
    """
    N, E, K = check_positive_int(N, "N"), check_positive_int(E, "E"), check_positive_int(K, "K")
    check_range(capacity_factor, "capacity_factor", 0.0, low_open=True)
    return math.ceil(Fraction(repr(float(capacity_factor))) * N * K / E)


def capacity_mask(topk_ids: Int[Tensor, "N K"], E: int, capacity: int) -> Bool[Tensor, "N K"]:
    r"""Which assignments fit: each expert accepts its first ``capacity`` assignments, the rest are dropped.

    Priority follows GShard: every token's first choice comes before any second choice, and within
    one rank earlier tokens come first (for ``K = 1`` this is Switch's token order). The number
    dropped is :math:`\sum_e \max(0, \mathrm{load}_e - C_e)`.

    >>> capacity_mask(torch.tensor([[0], [0], [0], [1]]), E=2, capacity=2).flatten()
    tensor([ True,  True, False,  True])
    """
    E = check_positive_int(E, "E")
    ids = _ids(topk_ids, E)
    if ids.ndim != 2:
        raise ValueError(f"topk_ids must have shape (N, K), got {tuple(ids.shape)}")
    # no expert can receive more than all N K assignments: a larger capacity (say ceil(1e30 N K / E)) keeps all
    capacity = min(check_nonnegative_int(capacity, "capacity"), ids.numel())
    rank_major = ids.T.reshape(-1)  # (K*N,): all first choices, then all second choices, ...
    one_hot = F.one_hot(rank_major, E)
    position = (one_hot.cumsum(0) * one_hot).sum(-1) - 1  # place of each assignment in its expert's queue
    return (position < capacity).reshape(ids.shape[1], ids.shape[0]).T


# ================================================================= counting


def moe_param_count(C: int, d_ff: int, E: int, activation: str = "swiglu", router: bool = True) -> int:
    r"""Parameters of one MoE layer: :math:`E \cdot m\, C d_{ff} + E C` with :math:`m = 3` (SwiGLU) or 2.

    Grows linearly with ``E``; ``K`` does not appear. The active parameters per token are
    ``moe_param_count(C, d_ff, K, ...)`` (the ``K`` chosen experts) plus the router.

    >>> moe_param_count(4096, 14336, 8)  # one Mixtral 8x7B layer
    1409318912
    """
    m = _matrices(activation)
    C, d_ff, E = check_positive_int(C, "C"), check_positive_int(d_ff, "d_ff"), check_positive_int(E, "E")
    return E * m * C * d_ff + (E * C if router else 0)


def moe_flops(N: int, C: int, d_ff: int, E: int, K: int, activation: str = "swiglu") -> int:
    r"""Matmul FLOPs of one MoE forward pass over ``N`` tokens: :math:`2NEC + 2NK\,m\,C d_{ff}`.

    The router scores all ``E`` experts (:math:`2NEC`); each token then runs through only ``K``
    experts of ``m`` matrices of size ``C x d_ff``. So compute grows with ``K``, and with ``E`` only
    through the tiny router term. Assumes no assignment is dropped.

    >>> moe_flops(N=1, C=4, d_ff=8, E=4, K=2, activation="relu")
    288
    """
    m = _matrices(activation)
    N, C, d_ff, E, K = (check_positive_int(v, n) for v, n in ((N, "N"), (C, "C"), (d_ff, "d_ff"), (E, "E"), (K, "K")))
    return 2 * N * E * C + 2 * N * K * m * C * d_ff


def _matrices(activation: str) -> int:
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
    return 3 if activation == "swiglu" else 2
