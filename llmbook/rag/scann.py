r"""ScaNN's anisotropic quantization loss and score-aware PQ encoding (chapter 24, id 24.07).

For maximum inner-product search, a quantized database vector :math:`\tilde x` is only as good as the
inner products :math:`q^\top\tilde x` it returns for the queries that matter, the ones with a large
:math:`q^\top x`. Guo et al. (2020) split the residual :math:`r = x-\tilde x` into its part along the
datapoint, :math:`r_\parallel=\frac{r^\top x}{\|x\|^2}x`, and the rest, :math:`r_\perp=r-r_\parallel`, and
show that the expected squared inner-product error over those queries is a weighted sum of the two,

.. math:: \ell(x,\tilde x)=h_\parallel\|r_\parallel\|^2+h_\perp\|r_\perp\|^2,

with :math:`h_\parallel \ge h_\perp`: a query aligned with :math:`x` sees all of :math:`r_\parallel` and only
a share of :math:`r_\perp`. Their Theorem 3.4 gives the ratio for queries uniform on the sphere whose inner
product with a unit :math:`x` exceeds a threshold :math:`T` (:func:`parallel_cost_ratio`),
:math:`\eta=h_\parallel/h_\perp=(d-1)\frac{T^2/\|x\|^2}{1-T^2/\|x\|^2}`.

* :func:`anisotropic_loss` is the loss (24.07). ``h_par = h_perp`` is the plain squared error of PQ.
* :func:`anisotropic_pq_encode` chooses PQ codes that minimise it for given codebooks: it starts from
  PQ's nearest-centroid codes and changes one sub-vector's code at a time while the loss falls (the
  coordinate descent ScaNN applies to its product-quantized codes; ScaNN also retrains the codebooks with
  the loss, which this module does not).

Shapes: ``x`` and ``x_tilde`` ``(..., D)``; ``codebooks`` ``(M, K, D/M)``; codes ``(N, M)`` int64.
"""

from __future__ import annotations

import torch
from torch import Tensor

from llmbook._checks import as_tensor, check_dim, check_finite, check_positive_int, check_range, check_same_dtype
from llmbook._precision import restore_half, upcast_half
from llmbook.rag.ann import _codebooks, _split, pq_decode, pq_encode
from llmbook.registry import implements

__all__ = ["anisotropic_loss", "anisotropic_pq_encode", "parallel_cost_ratio", "residual_parts"]


def residual_parts(x, x_tilde) -> tuple[Tensor, Tensor]:
    r"""``(||r_par||^2, ||r_perp||^2)``, the parts of :math:`r = x-\tilde x` along ``x`` and across it: ``(...)`` each.

    :math:`\|r_\parallel\|^2=(r^\top x)^2/\|x\|^2`; :math:`\|r_\perp\|^2` is computed from the vector
    :math:`r-r_\parallel` (never as :math:`\|r\|^2-\|r_\parallel\|^2`, which cancels when ``r`` is nearly parallel).
    A zero ``x`` has no direction: all of ``r`` counts as orthogonal.

    >>> residual_parts(torch.tensor([2.0, 0.0]), torch.tensor([1.0, 1.0]))
    (tensor(1.), tensor(1.))
    """
    x, x_tilde = as_tensor(x, "x"), as_tensor(x_tilde, "x_tilde")
    check_same_dtype(x, x_tilde, "x", "x_tilde")
    check_dim(x, "x", "(..., D)", min_dim=1)
    if x.shape != x_tilde.shape:
        raise ValueError(f"x {tuple(x.shape)} and x_tilde {tuple(x_tilde.shape)} must have the same shape (..., D)")
    check_finite(x, "x")
    check_finite(x_tilde, "x_tilde")
    dtype = x.dtype
    x, x_tilde = upcast_half(x), upcast_half(x_tilde)
    # unit direction of x, scaled first so that squares of huge or tiny coordinates neither overflow nor vanish
    peak = x.abs().amax(-1, keepdim=True) if x.shape[-1] else x.new_zeros(*x.shape[:-1], 1)  # D = 0: r is empty
    u = x / torch.where(peak > 0, peak, 1)
    u = u / torch.where(peak > 0, torch.linalg.vector_norm(u, dim=-1, keepdim=True), 1)
    r = x - x_tilde
    along = (r * u).sum(-1, keepdim=True)  # r . x / ||x||, 0 for a zero x
    par = along.squeeze(-1).square()
    perp = (r - along * u).square().sum(-1)
    return restore_half(par, dtype), restore_half(perp, dtype)


@implements("24.07")
def anisotropic_loss(x, x_tilde, h_par: float, h_perp: float = 1.0) -> Tensor:
    r"""ScaNN's anisotropic quantization loss :math:`h_\parallel\|r_\parallel\|^2+h_\perp\|r_\perp\|^2` (24.07).

    .. math:: \ell(x,\tilde x)=h_{\parallel}\|r_{\parallel}\|^2+h_{\perp}\|r_{\perp}\|^2,\quad r=x-\tilde x,
              \quad r_{\parallel}=\frac{r^\top x}{\|x\|^2}x,\quad r_\perp = r - r_\parallel

    ``x`` the datapoint and ``x_tilde`` its quantized version, ``(..., D)`` each; ``h_par`` and ``h_perp``
    :math:`\ge 0` the weights of the residual's parts parallel and orthogonal to ``x`` (only their ratio
    matters for choosing codes: :func:`parallel_cost_ratio`). Returns ``(...)``. ``h_par = h_perp = 1`` is the
    squared reconstruction error :math:`\|x-\tilde x\|^2` that PQ's k-means minimises.

    >>> anisotropic_loss(torch.tensor([[2.0, 0.0], [2.0, 0.0]]), torch.tensor([[1.0, 0.0], [2.0, 1.0]]), h_par=4.0)
    tensor([4., 1.])
    """
    h_par = check_range(h_par, "h_par", 0.0)
    h_perp = check_range(h_perp, "h_perp", 0.0)
    par, perp = residual_parts(x, x_tilde)
    return h_par * par + h_perp * perp


def parallel_cost_ratio(T: float, x_sq_norm, D: int) -> Tensor:
    r"""Guo et al.'s weight ratio :math:`\eta=h_\parallel/h_\perp=(D-1)\,\frac{T^2/\|x\|^2}{1-T^2/\|x\|^2}`.

    ``T`` the inner-product threshold above which a query counts (ScaNN's
    ``anisotropic_quantization_threshold``, 0.2 by default for unit vectors), ``x_sq_norm`` :math:`\|x\|^2`
    (a number or a tensor), ``D`` the dimension. It needs :math:`T^2 < \|x\|^2`. ScaNN's
    ``ComputeParallelCostMultiplier``.

    >>> round(parallel_cost_ratio(0.2, 1.0, 100).item(), 4)   # (100 - 1) 0.04 / 0.96
    4.125
    """
    T = check_range(T, "T", 0.0)
    D = check_positive_int(D, "D")
    s = as_tensor(x_sq_norm, "x_sq_norm").to(torch.float64)
    check_finite(s, "x_sq_norm")
    t2 = T * T / s
    if s.numel() and not bool((t2 < 1).all()):
        raise ValueError(f"T^2 = {T * T:g} must be below every ||x||^2 (smallest {s.min().item():g}): "
                         "no query with q.x >= T exists for a shorter x")
    return (D - 1) * t2 / (1 - t2)


def anisotropic_pq_encode(x, codebooks, eta, *, rounds: int = 10) -> Tensor:
    r"""PQ codes ``(N, M)`` that minimise :func:`anisotropic_loss` with :math:`h_\parallel = \eta, h_\perp = 1`.

    ``x`` ``(N, D)``, ``codebooks`` ``(M, K, D/M)`` (trained as for PQ), ``eta`` :math:`\ge 1` a number or an
    ``(N,)`` tensor (one ratio per vector, as :func:`parallel_cost_ratio` gives for unequal norms). Starting
    from :func:`llmbook.rag.ann.pq_encode`'s nearest-centroid codes, each round visits the subspaces in
    order and gives every vector the code of subspace ``m`` that minimises its loss with the other codes
    fixed; rounds repeat until no code changes (at most ``rounds``). With the residual
    :math:`r=x-\tilde x` kept up to date, the candidates of one subspace cost
    :math:`\|r'\|^2+(\eta-1)(r'^\top x)^2/\|x\|^2` each, an ``(N, K)`` computation. The loss never rises, and
    ``eta = 1`` returns PQ's codes. Ties go to the lowest code.

    >>> C = torch.tensor([[[0.0], [1.0]], [[0.0], [1.0]]])   # M = 2 subspaces of one coordinate, K = 2
    >>> x = torch.tensor([[0.6, 0.6]])
    >>> pq_encode(x, C), anisotropic_pq_encode(x, C, eta=1.0), anisotropic_pq_encode(x, C, eta=10.0)
    (tensor([[1, 1]]), tensor([[1, 1]]), tensor([[0, 1]]))
    """
    codebooks = _codebooks(codebooks)
    xs, C = _split(x, codebooks, "x")
    rounds = check_positive_int(rounds, "rounds")
    N, M, _ = xs.shape
    eta_t = as_tensor(eta, "eta").to(xs.dtype)
    check_finite(eta_t, "eta")
    if eta_t.dim() > 1 or (eta_t.dim() == 1 and eta_t.shape[0] != N):
        raise ValueError(f"eta must be a number or an (N,) = ({N},) tensor, got shape {tuple(eta_t.shape)}")
    if eta_t.numel() and bool((eta_t < 1).any()):
        raise ValueError(f"eta = h_par / h_perp must be >= 1 (parallel error costs at least as much), "
                         f"got min {eta_t.min().item():g}")
    eta_t = eta_t.expand(N)[:, None]
    codes = pq_encode(x, codebooks)
    if N == 0:
        return codes
    xf = xs.reshape(N, -1)
    x_sq = xf.square().sum(-1, keepdim=True)
    inv = torch.where(x_sq > 0, 1 / torch.where(x_sq > 0, x_sq, 1), 0)  # 1/||x||^2, 0 for a zero x
    r = xf - upcast_half(pq_decode(codes, codebooks))  # (N, D)
    rs = r.view(N, M, -1)
    for _ in range(rounds):
        changed = False
        for m in range(M):
            cand = xs[:, m, None, :] - C[m][None]  # (N, K, D/M): the residual of sub-vector m for each code
            r_dot = (r * xf).sum(-1, keepdim=True) - (rs[:, m] * xs[:, m]).sum(-1, keepdim=True) \
                + (cand * xs[:, m, None, :]).sum(-1)  # (N, K): r'.x
            r_sq = r.square().sum(-1, keepdim=True) - rs[:, m].square().sum(-1, keepdim=True) \
                + cand.square().sum(-1)  # (N, K): ||r'||^2
            loss = r_sq + (eta_t - 1) * r_dot.square() * inv
            cur = loss.gather(1, codes[:, m, None])
            best = loss.argmin(-1)
            move = loss.gather(1, best[:, None]) < cur  # strictly better: no cycling between equal losses
            if bool(move.any()):
                changed = True
                rows = move[:, 0]
                codes[rows, m] = best[rows]
                rs[rows, m] = cand[rows, best[rows]]
        if not changed:
            break
    return codes
