r"""Context packing: which retrieved chunks fill a token budget, in which order, and what to cut.

The generator reads a context of at most :math:`B` tokens; chapter 27's second half decides what goes in
(:mod:`llmbook.rag.chunking` decides how the documents are cut):

* **The context knapsack** (27.04, :func:`knapsack`): the subset of passages of largest total utility
  whose lengths fit the budget, solved exactly by dynamic programming in :math:`O(NB)`;
  :func:`greedy_pack` is the utility-per-token heuristic it beats.
* **Lost in the middle** (27.05, :func:`lost_in_middle_weight`): a U-shaped weight of the position
  in the context, :math:`w = \alpha + \beta|2\,pos/L - 1|`; :func:`ends_first_order` puts the best
  passages at both ends, which maximises :math:`\sum_k w_k u_{\pi(k)}`.
* **Compression score** (27.06, :func:`compression_score`): :math:`\lambda\,rel - (1-\lambda)\,len`.

>>> knapsack(torch.tensor([6.0, 5.0, 5.0]), torch.tensor([3, 2, 2]), 4).indices.tolist()
[1, 2]
>>> ends_first_order(torch.tensor([0.2, 0.9, 0.5])).tolist()
[1, 0, 2]
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from llmbook._checks import (
    as_tensor,
    check_dim,
    check_finite,
    check_integer_tensor,
    check_nonnegative_int,
    check_real,
    check_same_shape,
    check_unit_interval,
)
from llmbook._precision import restore_half, upcast_half
from llmbook.registry import implements

__all__ = ["Packing", "knapsack", "greedy_pack", "lost_in_middle_weight", "ends_first_order", "compression_score"]


# ----------------------------------------------------------------------------------------------- 27.04


class Packing(NamedTuple):
    """A packed context: the chosen ``indices`` (ascending), their total ``value`` and total ``length``."""

    indices: torch.Tensor
    value: torch.Tensor
    length: int


def _packing_args(u, l, B):
    u_t = as_tensor(u, "u")
    check_dim(u_t, "u", "(N,)", min_dim=1, max_dim=1)
    check_finite(u_t, "u")
    l_t = check_integer_tensor(l, "l", "an integer tensor of token lengths").long()
    check_same_shape(u_t, l_t, "u", "l")
    if l_t.numel() and int(l_t.min()) < 0:
        raise ValueError(f"l must hold non-negative token lengths, got min {int(l_t.min())}")
    B = check_nonnegative_int(B, "B")
    return u_t, l_t, B


@implements("27.04")
def knapsack(u, l, B: int) -> Packing:
    r"""The token-budgeted context knapsack, solved exactly by dynamic programming over the budget.

    .. math::
        \max_{S\subseteq\{1..N\}} \sum_{i\in S} u_i \quad\text{s.t.}\quad \sum_{i\in S} l_i \le B

    Symbols: :math:`u_i` = ``u[i]`` (utility of passage ``i``, e.g. its retrieval score; a passage of
    negative utility is never worth its tokens), :math:`l_i` = ``l[i]`` (its length in tokens, an integer
    ``>= 0``), :math:`B` = ``B`` (the token budget). The table :math:`V_i(b)`, the best value of the first
    :math:`i` passages within :math:`b` tokens, obeys :math:`V_i(b) = \max(V_{i-1}(b),
    V_{i-1}(b-l_i)+u_i)`; one row of length :math:`B+1` is updated per passage (:math:`O(NB)` time) and a
    boolean table of the decisions recovers the set. Sums run in float64, so an fp16 input selects exactly
    what its float64 upcast selects. Ties keep the earlier decision (prefer not taking a passage).

    Shapes: ``u`` ``(N,)`` float, ``l`` ``(N,)`` integer, ``B`` int. Returns ``Packing(indices (k,) long
    ascending, value (scalar, u's dtype), length: int)``.

    >>> knapsack(torch.tensor([3.0, 4.0, 5.0]), torch.tensor([2, 3, 4]), 5).indices.tolist()
    [0, 1]
    """
    u_t, l_t, B = _packing_args(u, l, B)
    N = u_t.shape[0]
    u64 = u_t.double()
    V = torch.zeros(B + 1, dtype=torch.float64)
    take = torch.zeros(N, B + 1, dtype=torch.bool)
    for i in range(N):
        li = int(l_t[i])
        if li > B or u64[i] <= 0:
            continue
        cand = V[: B + 1 - li] + u64[i]
        better = cand > V[li:]
        take[i, li:] = better
        V[li:] = torch.where(better, cand, V[li:])
    chosen, b = [], B
    for i in range(N - 1, -1, -1):
        if take[i, b]:
            chosen.append(i)
            b -= int(l_t[i])
    idx = torch.tensor(sorted(chosen), dtype=torch.long)
    value = u64[idx].sum()
    return Packing(idx, value.to(u_t.dtype), int(l_t[idx].sum()))


def greedy_pack(u, l, B: int) -> Packing:
    """The common heuristic: take passages by utility per token ``u_i / l_i`` (ties: lower index) while they fit.

    Not optimal: a short passage of high density can block a long one that is worth more. Zero-length
    passages of positive utility go first.

    >>> u, l = torch.tensor([2.0, 9.0]), torch.tensor([1, 5])
    >>> greedy_pack(u, l, 5).indices.tolist(), knapsack(u, l, 5).indices.tolist()
    ([0], [1])
    """
    u_t, l_t, B = _packing_args(u, l, B)
    u64 = u_t.double()
    ratio = torch.where(l_t > 0, u64 / l_t.clamp_min(1), torch.full_like(u64, float("inf")))
    order = sorted(range(u_t.shape[0]), key=lambda i: (-float(ratio[i]), i))
    chosen, used = [], 0
    for i in order:
        if u64[i] > 0 and used + int(l_t[i]) <= B:
            chosen.append(i)
            used += int(l_t[i])
    idx = torch.tensor(sorted(chosen), dtype=torch.long)
    return Packing(idx, u64[idx].sum().to(u_t.dtype), used)


# ----------------------------------------------------------------------------------------------- 27.05


@implements("27.05")
def lost_in_middle_weight(pos, L, alpha: float = 0.5, beta: float = 0.5) -> torch.Tensor:
    r"""The U-shaped lost-in-the-middle weight of a position in the context.

    .. math::
        w(pos) = \alpha + \beta\left|2\frac{pos}{L} - 1\right|

    Symbols: :math:`pos` = ``pos`` (a position, any shape; ``0`` is the start, ``L`` the end),
    :math:`L` = ``L`` (the last position, ``> 0``), :math:`\alpha` = ``alpha`` (the weight in the middle),
    :math:`\beta` = ``beta`` (what the ends add; :math:`\beta \ge 0` makes a U). For ``k`` passages at
    slots ``0..k-1`` take ``L = k - 1``. Liu et al. (2024) measured such a U: answers are most accurate
    when the relevant passage is first or last in the context and worst in the middle.

    Shapes: ``pos`` any shape -> the same shape, float (``pos``'s dtype, or the default for integers).

    >>> lost_in_middle_weight(torch.arange(5), 4).tolist()
    [1.0, 0.75, 0.5, 0.75, 1.0]
    """
    pos = as_tensor(pos, "pos")
    check_finite(pos, "pos")
    L = check_real(L, "L")
    if L <= 0:
        raise ValueError(f"L must be a positive position (the end of the context), got {L}")
    if pos.numel() and (float(pos.min()) < 0 or float(pos.max()) > L):
        raise ValueError(f"pos must lie in [0, L] = [0, {L:g}] (the start and the end of the context), "
                         f"got values in [{float(pos.min()):g}, {float(pos.max()):g}]")
    alpha, beta = check_real(alpha, "alpha"), check_real(beta, "beta")
    x = upcast_half(pos)
    w = alpha + beta * (2 * (x / L) - 1).abs()
    return restore_half(w, pos.dtype)


def ends_first_order(u) -> torch.Tensor:
    """An order of ``k`` passages that puts the best at both ends and the worst in the middle.

    Passages sorted by utility (descending, ties by index) go to slots ``0, k-1, 1, k-2, ...``, whose
    :func:`lost_in_middle_weight` is non-increasing along that sequence; by the rearrangement inequality
    this maximises :math:`\\sum_k w_k u_{\\pi(k)}` for every symmetric U-shaped ``w``. Returns ``perm``
    ``(k,)`` long: ``perm[slot]`` is the passage placed at ``slot``.

    >>> ends_first_order(torch.tensor([0.1, 0.9, 0.5, 0.7])).tolist()
    [1, 2, 0, 3]
    """
    u_t = as_tensor(u, "u")
    check_dim(u_t, "u", "(k,)", min_dim=1, max_dim=1)
    check_finite(u_t, "u")
    k = u_t.shape[0]
    best = sorted(range(k), key=lambda i: (-float(u_t[i]), i))
    slots = [s for j in range((k + 1) // 2) for s in ((j, k - 1 - j) if j != k - 1 - j else (j,))]
    perm = torch.empty(k, dtype=torch.long)
    for s, i in zip(slots, best, strict=True):
        perm[s] = i
    return perm


# ----------------------------------------------------------------------------------------------- 27.06


@implements("27.06")
def compression_score(rel, length, lam: float = 0.5) -> torch.Tensor:
    r"""The context compression score: relevance to the query minus a price per token.

    .. math::
        score(c) = \lambda\, rel(q, c) - (1-\lambda)\, len(c)

    Symbols: :math:`rel(q,c)` = ``rel`` (e.g. the cosine of query and chunk), :math:`len(c)` = ``length``
    (tokens; divide by a budget or a typical length first so both terms live on one scale),
    :math:`\lambda` = ``lam`` in ``[0, 1]``. An extractive compressor keeps the pieces of positive score:
    those with :math:`rel > \frac{1-\lambda}{\lambda} len`. fp16/bf16 are computed in float32.

    Shapes: ``rel`` and ``length`` broadcastable -> their broadcast shape, in ``rel``'s floating dtype.

    >>> [round(v, 4) for v in compression_score(torch.tensor([0.8, 0.3]), torch.tensor([0.5, 0.1]), 0.5).tolist()]
    [0.15, 0.1]
    """
    rel = as_tensor(rel, "rel")
    length = as_tensor(length, "length")
    check_finite(rel, "rel")
    check_finite(length, "length")
    try:
        torch.broadcast_shapes(rel.shape, length.shape)
    except RuntimeError as err:
        raise ValueError(f"rel {tuple(rel.shape)} and length {tuple(length.shape)} must broadcast") from err
    lam = check_unit_interval(lam, "lam")
    r, n = upcast_half(rel), upcast_half(length)
    dt = torch.promote_types(r.dtype, n.dtype)
    s = lam * r.to(dt) - (1 - lam) * n.to(dt)
    return restore_half(s, rel.dtype)
