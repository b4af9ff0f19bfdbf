r"""The parallel scan behind Mamba (chapter 18), and its matrix form, Mamba-2's state space duality (SSD).

A diagonal linear recurrence :math:`h_t = a_t h_{t-1} + b_t` (elementwise, :math:`h_0 = 0`) looks sequential,
but the pairs :math:`(a, b)` compose with an **associative** operator (:func:`scan_combine`),

.. math:: (a_1, b_1) \circ (a_2, b_2) = (a_1 a_2,\; a_2 b_1 + b_2),

and :math:`h_t` is the second half of :math:`(a_1, b_1) \circ \dots \circ (a_t, b_t)`. An associative product
of :math:`T` factors can be bracketed in any order, so all :math:`T` prefixes are computed in
:math:`\lceil\log_2 T\rceil` rounds of independent combines (:func:`associative_scan`, Hillis-Steele or
Blelloch), which is how Mamba's fused kernel trains on a GPU. :func:`scan_sequential` is the plain loop.

When the decay is one scalar :math:`a_t` per step (shared by every state, as in Mamba-2), unrolling gives
:math:`y_t = \sum_{s \le t} \big(\prod_{r=s+1}^{t} a_r\big)(C_t \cdot B_s)\, x_s`: a masked matrix multiply
:math:`y = (L \odot C B^\top)\, x` with the lower-triangular decay mask :math:`L` of :func:`ssd_mask`
(:func:`ssd`). That is attention-like work for training and a recurrence for generation: the duality.
"""

from __future__ import annotations

import math

import torch
from jaxtyping import Float
from torch import Tensor

from llmbook._checks import as_tensor, check_dim, check_finite, check_shape

__all__ = ["scan_combine", "scan_sequential", "associative_scan", "ssd_mask", "ssd"]

METHODS = ("hillis_steele", "blelloch")


def _pair(a, b) -> tuple[Tensor, Tensor]:
    a, b = as_tensor(a, "a"), as_tensor(b, "b")
    check_dim(a, "a", "(B, T, ...)", min_dim=2)
    check_shape(b, a.shape, "b", "a (B, T, ...): one (a_t, b_t) pair per element")
    dtype = torch.promote_types(a.dtype, b.dtype)
    return a.to(dtype), b.to(dtype)


def scan_combine(first: tuple[Tensor, Tensor], second: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor]:
    r"""The associative operator of a linear recurrence: :math:`(a_1, b_1) \circ (a_2, b_2) = (a_1 a_2, a_2 b_1 + b_2)`.

    ``first`` is the earlier segment, ``second`` the later one: applying ``first`` then ``second`` to a state
    :math:`h` gives :math:`a_2 (a_1 h + b_1) + b_2`, which is the combined pair applied to :math:`h`.
    Elementwise on tensors of any (broadcastable) shape.

    >>> scan_combine((torch.tensor(0.5), torch.tensor(1.0)), (torch.tensor(0.2), torch.tensor(3.0)))
    (tensor(0.1000), tensor(3.2000))
    """
    (a1, b1), (a2, b2) = first, second
    return a1 * a2, a2 * b1 + b2


def scan_sequential(a: Float[Tensor, "B T ..."], b: Float[Tensor, "B T ..."]) -> Float[Tensor, "B T ..."]:
    r"""The recurrence :math:`h_t = a_t h_{t-1} + b_t` from :math:`h_0 = 0`, one step at a time.

    ``a, b (B, T, ...)``: the decay and the input of every step (any trailing shape, elementwise).
    Returns ``h (B, T, ...)``. ``T`` dependent steps: the reference the parallel scans are checked against.

    >>> scan_sequential(torch.tensor([[0.5, 0.5, 0.5]]), torch.tensor([[1.0, 1.0, 1.0]]))
    tensor([[1.0000, 1.5000, 1.7500]])
    """
    a, b = _pair(a, b)
    h = torch.zeros_like(b[:, 0])
    out = []
    for t in range(b.shape[1]):
        h = a[:, t] * h + b[:, t]
        out.append(h)
    return torch.stack(out, 1) if out else b.clone()


def associative_scan(a: Float[Tensor, "B T ..."], b: Float[Tensor, "B T ..."], method: str = "blelloch",
                     return_rounds: bool = False):
    r"""All prefixes of :math:`h_t = a_t h_{t-1} + b_t` (:math:`h_0 = 0`) in :math:`O(\log T)` parallel rounds.

    Each round applies :func:`scan_combine` to many pairs at once (one vectorised call per round):

    * ``"hillis_steele"``: round :math:`k` replaces pair :math:`t` by pair :math:`t - 2^k` composed with it,
      for every :math:`t \ge 2^k`; after :math:`\lceil\log_2 T\rceil` rounds pair :math:`t` covers steps
      :math:`1..t`. :math:`O(T \log T)` combines.
    * ``"blelloch"``: an up-sweep builds a tree of segment products (:math:`\log_2 T` rounds), a down-sweep
      pushes prefixes back down (:math:`\log_2 T` rounds), for :math:`O(T)` combines in all (work-efficient);
      ``T`` is padded to a power of two with the identity pair :math:`(1, 0)`.

    ``a, b (B, T, ...)`` elementwise; returns ``h (B, T, ...)``, and with ``return_rounds`` also the number
    of rounds of parallel combines. Equal to :func:`scan_sequential` up to rounding (the products are
    bracketed differently).

    >>> a, b = torch.full((1, 5), 0.5), torch.ones(1, 5)
    >>> h, rounds = associative_scan(a, b, "hillis_steele", return_rounds=True)
    >>> h, rounds
    (tensor([[1.0000, 1.5000, 1.7500, 1.8750, 1.9375]]), 3)
    """
    a, b = _pair(a, b)
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    T = a.shape[1]
    rounds = 0
    if method == "hillis_steele":
        A, Bv = a.clone(), b.clone()
        d = 1
        while d < T:
            A_new, B_new = scan_combine((A[:, :-d], Bv[:, :-d]), (A[:, d:], Bv[:, d:]))
            A = torch.cat([A[:, :d], A_new], 1)
            Bv = torch.cat([Bv[:, :d], B_new], 1)
            d *= 2
            rounds += 1
        return (Bv, rounds) if return_rounds else Bv
    P = 1 << max(0, math.ceil(math.log2(max(T, 1))))
    pad = [a.shape[0], P - T, *a.shape[2:]]
    A = torch.cat([a, torch.ones(pad, dtype=a.dtype)], 1)
    Bv = torch.cat([b, torch.zeros(pad, dtype=b.dtype)], 1)
    d = 1
    while d < P:  # up-sweep: element i (counting from 1) with i % 2d == 0 holds the product of its 2d-segment
        right = torch.arange(2 * d - 1, P, 2 * d)
        A[:, right], Bv[:, right] = scan_combine((A[:, right - d], Bv[:, right - d]), (A[:, right], Bv[:, right]))
        d *= 2
        rounds += 1
    A[:, P - 1], Bv[:, P - 1] = 1.0, 0.0  # exclusive scan: the root gets the identity
    d = P // 2
    while d >= 1:  # down-sweep: the left child gets the parent's prefix, the right one prefix ∘ left segment
        right = torch.arange(2 * d - 1, P, 2 * d)
        left_A, left_B = A[:, right - d].clone(), Bv[:, right - d].clone()
        A[:, right - d], Bv[:, right - d] = A[:, right], Bv[:, right]
        A[:, right], Bv[:, right] = scan_combine((A[:, right], Bv[:, right]), (left_A, left_B))
        d //= 2
        rounds += 1
    # exclusive prefix ∘ own pair = inclusive prefix; its b half is h_t (h_0 = 0)
    _, h = scan_combine((A[:, :T], Bv[:, :T]), (a, b))
    return (h, rounds) if return_rounds else h


def ssd_mask(a: Float[Tensor, "B T"]) -> Float[Tensor, "B T T"]:
    r"""Mamba-2's decay mask :math:`L_{ts} = \prod_{r=s+1}^{t} a_r` for :math:`t \ge s`, 0 above the diagonal.

    ``a (B, T)`` in :math:`(0, 1]`, one scalar decay per step. Computed in log space from cumulative sums
    of :math:`\log a` (Mamba-2's ``segsum``), so no product of many small factors underflows early.

    >>> ssd_mask(torch.tensor([[0.5, 0.5, 0.5]]))
    tensor([[[1.0000, 0.0000, 0.0000],
             [0.5000, 1.0000, 0.0000],
             [0.2500, 0.5000, 1.0000]]])
    """
    a = as_tensor(a, "a")
    check_dim(a, "a", "(B, T)", min_dim=2, max_dim=2)
    check_finite(a, "a")
    if ((a <= 0) | (a > 1)).any():
        raise ValueError("a must lie in (0, 1] (a decay per step, exp(Δ_t A) with A < 0)")
    cum = torch.cumsum(torch.log(a), -1)  # (B, T): sum of log a_1..a_t
    T = a.shape[-1]
    seg = cum[:, :, None] - cum[:, None, :]  # (B, t, s): sum of log a_{s+1}..a_t
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    return torch.where(causal, torch.exp(seg.masked_fill(~causal, 0.0)), torch.zeros((), dtype=a.dtype))


def ssd(x: Float[Tensor, "B T P"], a: Float[Tensor, "B T"], B: Float[Tensor, "B T N"],
        C: Float[Tensor, "B T N"]) -> Float[Tensor, "B T P"]:
    r"""Scalar-decay SSM as one masked matrix multiply (Mamba-2's SSD): :math:`y = (L \odot C B^\top)\, x`.

    The recurrence :math:`h_t = a_t h_{t-1} + B_t x_t^\top` (state ``(N, P)``), :math:`y_t = h_t^\top C_t`
    unrolls to :math:`y_t = \sum_{s \le t} L_{ts}\,(C_t \cdot B_s)\, x_s` with :math:`L` = :func:`ssd_mask`.
    Symbols: ``x (B, T, P)`` the inputs of one head (Mamba-2 feeds :math:`\Delta_t x_t`), ``a (B, T)`` the
    decay :math:`e^{\Delta_t A}` of each step, ``B, C (B, T, N)``. Returns ``y (B, T, P)``. Quadratic in
    ``T``, like attention with the causal mask replaced by :math:`L`.

    >>> y = ssd(torch.ones(1, 3, 1), torch.full((1, 3), 0.5), torch.ones(1, 3, 1), torch.ones(1, 3, 1))
    >>> y[0, :, 0]
    tensor([1.0000, 1.5000, 1.7500])
    """
    x, B, C = as_tensor(x, "x"), as_tensor(B, "B"), as_tensor(C, "C")
    check_dim(x, "x", "(B, T, P)", min_dim=3, max_dim=3)
    a = check_shape(as_tensor(a, "a"), x.shape[:2], "a", "(B, T): one decay per step of x")
    check_dim(B, "B", "(B, T, N)", min_dim=3, max_dim=3)
    check_shape(B, (*x.shape[:2], B.shape[-1]), "B", "(B, T, N) with the batch and length of x")
    check_shape(C, B.shape, "C", "B (B, T, N)")
    L = ssd_mask(a)
    return (L * (C @ B.transpose(1, 2))) @ x
