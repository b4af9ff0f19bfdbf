r"""Similarity and distance between vectors (chapter 20, ids 20.01-20.09): the measures retrieval ranks by.

**One shape contract for every function (batch first, pairwise):** ``x`` of shape ``(B, N, D)`` and
``y`` of shape ``(B, M, D)`` give ``(B, N, M)``, entry ``[b, i, j]`` comparing ``x[b, i]`` with
``y[b, j]``; without the batch axis, ``(N, D)`` and ``(M, D)`` give ``(N, M)`` (``torch.cdist``'s
convention). Both inputs have the same number of axes and the same ``B``; ``D >= 1``; ``N`` or ``M``
may be 0. Float inputs must share one dtype and be finite; fp16/bf16 are computed in float32.

Conventions of the references (scipy.spatial.distance / sklearn.metrics.pairwise), matched by the tests:

* scipy's ``'cosine'`` is the cosine *distance* ``1 - cos``; sklearn's ``cosine_similarity`` gives
  ``cos`` and 0 for a zero vector (so does :func:`cosine_similarity`);
* scipy's ``'hamming'`` is the *fraction* of differing coordinates (:func:`hamming_distance` with
  ``normalized=True``); the catalogue's 20.07 is the count (the default);
* scipy's ``'jaccard'`` is the distance ``1 - J`` on boolean vectors, 0 for two empty sets
  (:func:`jaccard_similarity` returns ``J``, 1 for two empty sets);
* scipy's ``'mahalanobis'`` takes the inverse covariance ``VI``; :func:`mahalanobis_distance` takes
  the covariance ``Sigma`` itself and never inverts it (a Cholesky factor and a triangular solve).

Numerical care: each row is divided by a power of two (exact) so that its largest coordinate lies in
``[1, 2)``; a pair is compared at the larger of its two scales. Norms, squares and ``p``-th powers
then cannot overflow or underflow, whatever the magnitude of the input, and the scale is multiplied
back at the end (a distance too large for the dtype becomes ``inf``, never NaN).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from llmbook._checks import (
    as_tensor,
    check_choice,
    check_dim,
    check_finite,
    check_nonempty,
    check_range,
    check_same_dtype,
    check_same_last_dim,
    check_shape,
)
from llmbook._precision import compute_dtype, restore_half, upcast_half
from llmbook.registry import implements

__all__ = ["angular_distance", "cosine_similarity", "dot_product", "euclidean_distance", "hamming_distance",
           "jaccard_similarity", "mahalanobis_distance", "manhattan_distance", "minkowski_distance"]

_CHUNK = 1 << 22  # elements of the (rows, M, D) difference block materialised at once


def _pair(x, y, kind: str = "float"):
    """Check a pair against the contract; return them (fp16/bf16 upcast) and the caller's dtype."""
    x = as_tensor(x, "x", floating=kind == "float")
    y = as_tensor(y, "y", floating=kind == "float")
    for t, name in ((x, "x"), (y, "y")):
        if kind == "bool" and t.dtype != torch.bool:
            raise TypeError(f"{name} must be a bool tensor (x[i] = True when item i is in the set), got dtype "
                            f"{t.dtype}; pass x != 0 to turn counts into sets")
        if t.is_complex():
            raise TypeError(f"{name} must be a real tensor, got dtype {t.dtype}")
    check_same_dtype(x, y, "x", "y")
    check_dim(x, "x", "(B, N, D) or (N, D)", min_dim=2, max_dim=3)
    check_dim(y, "y", "(B, M, D) or (M, D)", min_dim=2, max_dim=3)
    if x.ndim != y.ndim or x.shape[:-2] != y.shape[:-2]:
        raise ValueError(f"x {tuple(x.shape)} and y {tuple(y.shape)} must be (B, N, D) and (B, M, D) with one B, "
                         "or (N, D) and (M, D)")
    check_same_last_dim(x, y, "x", "y", "D")
    check_nonempty(x, "x")
    if x.is_floating_point():
        check_finite(x, "x")
        check_finite(y, "y")
    return upcast_half(x), upcast_half(y), x.dtype


def _row_scale(x: Tensor, zero: float = 1.0) -> Tensor:
    """A power of two per row, ``(..., N)``: ``max_i |x_i| / s`` lies in ``[1, 2)`` (``s = zero`` for a zero row)."""
    peak = x.abs().amax(-1)
    _, e = torch.frexp(peak)  # peak = m 2^e with m in [0.5, 1)
    s = torch.exp2((e - 1).to(torch.float64)).to(x.dtype)  # 2^(e-1) is exact in x's dtype
    return torch.where(peak > 0, s, torch.full_like(s, zero))


def _scaled(x: Tensor, y: Tensor):
    """Rows divided by their own scale, the pair scale ``s = max(s_x, s_y)`` and the ratios ``s_x / s``, ``s_y / s``.

    A zero row takes the scale of the row it is compared with (its own is 0); two zero rows take 1.
    """
    s_x, s_y = _row_scale(x, 0.0), _row_scale(y, 0.0)
    s = torch.maximum(s_x[..., :, None], s_y[..., None, :])  # (..., N, M)
    s = torch.where(s > 0, s, torch.ones_like(s))
    one = torch.ones_like
    return (x / torch.where(s_x > 0, s_x, one(s_x))[..., None], y / torch.where(s_y > 0, s_y, one(s_y))[..., None],
            s_x[..., :, None] / s, s_y[..., None, :] / s, s)


def _blocks(x: Tensor, y: Tensor, fn, *extra: Tensor) -> Tensor:
    """``fn(x_rows[..., :, None, :], y[..., None, :, :], *extra_rows)`` over blocks of rows of ``x``; cat on N."""
    N, M, D = x.shape[-2], y.shape[-2], x.shape[-1]
    batch = x.shape[0] if x.ndim == 3 else 1
    step = max(1, _CHUNK // max(1, batch * M * D))
    out = [fn(x[..., i:i + step, None, :], y[..., None, :, :], *(e[..., i:i + step, :] for e in extra))
           for i in range(0, max(N, 1), step)]
    return torch.cat(out, -2)


def _diff_reduce(x: Tensor, y: Tensor, reduce) -> Tensor:
    """``s * reduce(x_i / s - y_j / s)`` for every pair, with the pair scale ``s`` of :func:`_scaled`."""
    xt, yt, r, t, s = _scaled(x, y)
    return _blocks(xt, yt, lambda a, b, r_, t_: reduce(a * r_[..., None] - b * t_[..., None]), r, t) * s


def _unit(x: Tensor, eps: float) -> Tensor:
    """Rows scaled to unit norm: exact power-of-two rescaling first, so a non-zero row's norm is >= 1."""
    xs = x / _row_scale(x)[..., None]
    return xs / torch.linalg.vector_norm(xs, dim=-1, keepdim=True).clamp_min(eps)


@implements("20.01")
def cosine_similarity(x, y, *, eps: float = 1e-8) -> Tensor:
    r"""Pairwise cosine similarity :math:`\cos(x,y)=\frac{x^\top y}{\|x\|_2\|y\|_2}`, in ``[-1, 1]``.

    ``x`` ``(B, N, D)`` or ``(N, D)``, ``y`` ``(B, M, D)`` or ``(M, D)`` -> ``(B, N, M)`` or ``(N, M)``.
    Each row is first divided by a power of two (exact, and it leaves the cosine unchanged) so that its
    largest coordinate lies in ``[1, 2)``; its norm is then at least 1 and cannot overflow. The
    denominator is ``max(norm, eps)``, so it is never zero: a zero vector has cosine 0 with everything
    (scikit-learn's convention), and ``eps`` in ``(0, 1]`` changes no other value. Rounding is clamped
    to ``[-1, 1]``. scipy's ``cdist(..., 'cosine')`` is ``1 - cos``.

    >>> cosine_similarity(torch.tensor([[3.0, 4.0]]), torch.tensor([[4.0, 3.0], [0.0, 0.0], [-3.0, -4.0]]))
    tensor([[ 0.9600,  0.0000, -1.0000]])
    """
    eps = check_range(eps, "eps", 0.0, 1.0, low_open=True)
    x, y, dtype = _pair(x, y)
    cos = (_unit(x, eps) @ _unit(y, eps).mT).clamp(-1.0, 1.0)
    return restore_half(cos, dtype)


@implements("20.02")
def dot_product(x, y) -> Tensor:
    r"""Pairwise dot product :math:`s(x,y)=x^\top y` (maximum inner product search ranks by it).

    ``x`` ``(B, N, D)`` or ``(N, D)``, ``y`` ``(B, M, D)`` or ``(M, D)`` -> ``(B, N, M)`` or ``(N, M)``;
    ``x @ y.mT``, fp16/bf16 accumulated in float32. Unlike the cosine it grows with the norms: a long
    or "popular" vector scores high against everything. For unit vectors it equals the cosine.

    >>> dot_product(torch.tensor([[3.0, 4.0]]), torch.tensor([[4.0, 3.0], [8.0, 6.0]]))
    tensor([[24., 48.]])
    """
    x, y, dtype = _pair(x, y)
    return restore_half(x @ y.mT, dtype)


def _euclidean(x: Tensor, y: Tensor, method: str) -> Tensor:
    if method == "difference":
        return _diff_reduce(x, y, lambda d: torch.linalg.vector_norm(d, dim=-1))
    xt, yt, r, t, s = _scaled(x, y)
    a2, b2 = (xt * xt).sum(-1)[..., :, None], (yt * yt).sum(-1)[..., None, :]
    d2 = a2 * r * r + b2 * t * t - 2.0 * (r * t) * (xt @ yt.mT)  # ||x||^2 + ||y||^2 - 2 x.y, all over s^2
    return d2.clamp_min(0.0).sqrt() * s  # rounding can make d2 slightly negative: clamp before the root


@implements("20.03")
def euclidean_distance(x, y, *, method: str = "expansion") -> Tensor:
    r"""Pairwise Euclidean distance :math:`d_2(x,y)=\sqrt{\sum_i(x_i-y_i)^2}`.

    ``x`` ``(B, N, D)`` or ``(N, D)``, ``y`` ``(B, M, D)`` or ``(M, D)`` -> ``(B, N, M)`` or ``(N, M)``.

    * ``method="expansion"`` (default, what scikit-learn and faiss do): :math:`\|x\|^2+\|y\|^2-2x^\top y`,
      one matrix product, clamped at 0 before the square root. For nearly equal points it subtracts
      nearly equal numbers: its absolute error is about :math:`\sqrt{\epsilon}\,\|x\|`, not
      :math:`\epsilon\,\|x\|`.
    * ``method="difference"``: the definition, :math:`\|x-y\|_2` from the differences (a ``(rows, M, D)``
      block at a time): accurate for close points, ``D`` times more memory traffic.

    >>> euclidean_distance(torch.tensor([[0.0, 0.0]]), torch.tensor([[3.0, 4.0], [1.0, 0.0]]))
    tensor([[5., 1.]])
    """
    check_choice(method, "method", ("expansion", "difference"))
    x, y, dtype = _pair(x, y)
    return restore_half(_euclidean(x, y, method), dtype)


@implements("20.04")
def manhattan_distance(x, y) -> Tensor:
    r"""Pairwise Manhattan (city-block, :math:`\ell_1`) distance :math:`d_1(x,y)=\sum_i|x_i-y_i|`.

    ``x`` ``(B, N, D)`` or ``(N, D)``, ``y`` ``(B, M, D)`` or ``(M, D)`` -> ``(B, N, M)`` or ``(N, M)``
    (scipy's ``'cityblock'``, sklearn's ``manhattan_distances``).

    >>> manhattan_distance(torch.tensor([[0.0, 0.0]]), torch.tensor([[3.0, -4.0]]))
    tensor([[7.]])
    """
    x, y, dtype = _pair(x, y)
    return restore_half(_diff_reduce(x, y, lambda d: d.abs().sum(-1)), dtype)


def _lp(d: Tensor, p: float) -> Tensor:
    a = d.abs()
    if p == math.inf:
        return a.amax(-1)
    m = a.amax(-1, keepdim=True)
    m = torch.where(m > 0, m, torch.ones_like(m))  # (a / m) <= 1: the p-th powers neither overflow nor all vanish
    return (a / m).pow(p).sum(-1).pow(1.0 / p) * m[..., 0]


@implements("20.05")
def minkowski_distance(x, y, p: float = 2.0) -> Tensor:
    r"""Pairwise Minkowski distance :math:`d_p(x,y)=\left(\sum_i|x_i-y_i|^p\right)^{1/p}`, ``p`` in ``[1, inf]``.

    ``x`` ``(B, N, D)`` or ``(N, D)``, ``y`` ``(B, M, D)`` or ``(M, D)`` -> ``(B, N, M)`` or ``(N, M)``.
    ``p = 1`` is Manhattan, ``p = 2`` Euclidean, ``p = inf`` the largest coordinate difference
    (Chebyshev). Below 1 the triangle inequality fails, so ``p < 1`` is rejected. Each difference
    vector is divided by its largest entry before the ``p``-th powers, which therefore lie in
    ``[0, 1]``: no overflow for ``p = 100``, and no underflow of every term to 0.

    >>> minkowski_distance(torch.tensor([[0.0, 0.0]]), torch.tensor([[3.0, 4.0]]), p=float("inf"))
    tensor([[4.]])
    """
    p = check_range(p, "p", 1.0, math.inf, finite=False)
    x, y, dtype = _pair(x, y)
    return restore_half(_diff_reduce(x, y, lambda d: _lp(d, p)), dtype)


@implements("20.06")
def jaccard_similarity(x, y) -> Tensor:
    r"""Pairwise Jaccard similarity :math:`J(A,B)=\frac{|A\cap B|}{|A\cup B|}` of sets given as bool vectors.

    ``x`` ``(B, N, D)`` or ``(N, D)`` and ``y`` ``(B, M, D)`` or ``(M, D)`` are bool tensors,
    ``x[..., i, k]`` True when item ``k`` is in set ``i``; returns ``(B, N, M)`` or ``(N, M)`` in the
    default float dtype. Counts are exact (float64 matrix products). Two empty sets have ``J = 1``,
    as scipy's ``cdist(..., 'jaccard')`` (the distance ``1 - J``) gives them distance 0.

    >>> A = torch.tensor([[True, True, False, False]])
    >>> jaccard_similarity(A, torch.tensor([[True, False, True, False], [False, False, False, False]]))
    tensor([[0.3333, 0.0000]])
    """
    x, y, _ = _pair(x, y, kind="bool")
    xf, yf = x.double(), y.double()
    inter = xf @ yf.mT
    union = xf.sum(-1)[..., :, None] + yf.sum(-1)[..., None, :] - inter
    J = torch.where(union > 0, inter / union.clamp_min(1.0), torch.ones_like(inter))
    return J.to(torch.get_default_dtype())


@implements("20.07")
def hamming_distance(x, y, *, normalized: bool = False) -> Tensor:
    r"""Pairwise Hamming distance :math:`d_H(x,y)=\sum_i\mathbf{1}[x_i\ne y_i]`: how many coordinates differ.

    ``x`` ``(B, N, D)`` or ``(N, D)``, ``y`` ``(B, M, D)`` or ``(M, D)`` of one dtype (bool codes,
    integers or finite floats) -> ``(B, N, M)`` or ``(N, M)``: ``int64`` counts, or with
    ``normalized=True`` the fraction ``d_H / D`` (scipy's ``'hamming'``), in ``x``'s float dtype
    (the default float dtype for bool and integer input).

    >>> x = torch.tensor([[1, 0, 1, 1]])
    >>> hamming_distance(x, torch.tensor([[1, 1, 0, 1]])), hamming_distance(x, x, normalized=True)
    (tensor([[2]]), tensor([[0.]]))
    """
    if not isinstance(normalized, bool):
        raise TypeError(f"normalized must be a bool, got {normalized!r} ({type(normalized).__name__})")
    x, y, dtype = _pair(x, y, kind="any")
    count = _blocks(x, y, lambda a, b: (a != b).sum(-1))
    if not normalized:
        return count
    out = dtype if dtype.is_floating_point else torch.get_default_dtype()
    return restore_half(count.to(compute_dtype(out)) / x.shape[-1], out)


@implements("20.08")
def mahalanobis_distance(x, y, Sigma, *, method: str = "expansion") -> Tensor:
    r"""Pairwise Mahalanobis distance :math:`d_M(x,y)=\sqrt{(x-y)^\top\Sigma^{-1}(x-y)}`.

    ``x`` ``(B, N, D)`` or ``(N, D)``, ``y`` ``(B, M, D)`` or ``(M, D)``, the covariance ``Sigma``
    ``(D, D)``, symmetric positive definite, in the dtype of ``x`` -> ``(B, N, M)`` or ``(N, M)``.
    :math:`\Sigma^{-1}` is never formed: with the Cholesky factor :math:`\Sigma = LL^\top`,
    :math:`d_M(x,y) = \|L^{-1}x - L^{-1}y\|_2`, so both sets are whitened by one triangular solve and
    compared with :func:`euclidean_distance` (``method`` as there). scipy's ``'mahalanobis'`` takes
    ``VI`` = :math:`\Sigma^{-1}` instead.

    >>> Sigma = torch.tensor([[4.0, 0.0], [0.0, 1.0]])  # twice the spread along the first axis
    >>> mahalanobis_distance(torch.zeros(1, 2), torch.tensor([[2.0, 0.0], [0.0, 2.0]]), Sigma)
    tensor([[1., 2.]])
    """
    check_choice(method, "method", ("expansion", "difference"))
    x_in = as_tensor(x, "x")
    x, y, dtype = _pair(x, y)
    Sigma = as_tensor(Sigma, "Sigma")
    check_same_dtype(x_in, Sigma, "x", "Sigma")
    D = x.shape[-1]
    check_shape(Sigma, (D, D), "Sigma", "the last axis D of x")
    check_finite(Sigma, "Sigma")
    Sigma = upcast_half(Sigma)
    asym = (Sigma - Sigma.mT).abs().max().item()
    if asym > 64 * torch.finfo(Sigma.dtype).eps * Sigma.abs().max().item():
        raise ValueError(f"Sigma must be symmetric (a covariance matrix), got max |Sigma - Sigma^T| = {asym:.3g}")
    L, info = torch.linalg.cholesky_ex((Sigma + Sigma.mT) / 2)
    if info.item() != 0:
        raise ValueError(f"Sigma must be positive definite (a full-rank covariance): its Cholesky factorisation "
                         f"fails at column {info.item()}; add a ridge lam * I to it")
    whiten = lambda v: torch.linalg.solve_triangular(L.mT, v, upper=True, left=False)  # noqa: E731  v L^-T
    return restore_half(_euclidean(whiten(x), whiten(y), method), dtype)


@implements("20.09")
def angular_distance(x, y, *, method: str = "atan2") -> Tensor:
    r"""Pairwise angular distance :math:`d_{ang}(x,y)=\frac{\arccos(\cos(x,y))}{\pi}`, in ``[0, 1]``.

    ``x`` ``(B, N, D)`` or ``(N, D)``, ``y`` ``(B, M, D)`` or ``(M, D)`` -> ``(B, N, M)`` or ``(N, M)``.
    Unlike ``1 - cos`` it is a metric (the triangle inequality holds). The arccosine is ill-conditioned
    where it matters most, near 0 and 1: its slope is infinite at :math:`\cos = \pm 1`, so a cosine
    rounded to :math:`1-\epsilon` gives an angle of :math:`\sqrt{2\epsilon}` and every angle below
    :math:`\sim\!\sqrt{\epsilon}` rounds to 0.

    * ``method="atan2"`` (default, stable): for unit vectors :math:`\hat x,\hat y`,
      :math:`\theta = 2\,\mathrm{atan2}(\|\hat x-\hat y\|, \|\hat x+\hat y\|)`, accurate to a few ulps
      at every angle (Kahan's formula; a ``(rows, M, D)`` block at a time);
    * ``method="acos"``: :math:`\arccos` of the cosine of :func:`cosine_similarity`, clamped to
      ``[-1, 1]``; one matrix product, accurate only away from 0 and 1.

    A zero vector is at distance 1/2 from everything (its cosine is 0).

    >>> angular_distance(torch.tensor([[1.0, 0.0]]), torch.tensor([[0.0, 2.0], [-1.0, 0.0], [1.0, 1.0]]))
    tensor([[0.5000, 1.0000, 0.2500]])
    """
    check_choice(method, "method", ("atan2", "acos"))
    x, y, dtype = _pair(x, y)
    if method == "acos":
        theta = torch.acos((_unit(x, 1e-8) @ _unit(y, 1e-8).mT).clamp(-1.0, 1.0))
    else:
        def kahan(a, b):
            return 2.0 * torch.atan2(torch.linalg.vector_norm(a - b, dim=-1), torch.linalg.vector_norm(a + b, dim=-1))

        theta = _blocks(_unit(x, 1e-8), _unit(y, 1e-8), kahan)
        zero = (x.abs().amax(-1) == 0)[..., :, None] | (y.abs().amax(-1) == 0)[..., None, :]
        theta = torch.where(zero, torch.full_like(theta, math.pi / 2), theta)
    return restore_half(theta / math.pi, dtype)
