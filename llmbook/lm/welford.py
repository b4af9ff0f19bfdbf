r"""One-pass *and* stable variance (chapter 5): Welford's update and Chan's merge of partial statistics.

The shortcut :math:`E[x^2]-E[x]^2` (:func:`llmbook.lm.norms.variance_naive`) reads the data once but
cancels catastrophically when :math:`|\mu| \gg \sigma`. Reading the data once is not the problem:
Welford (1962) keeps the running mean :math:`\mu_k` and the running sum of squared deviations
:math:`M_k = \sum_{i \le k} (x_i - \mu_k)^2`, and updates both with each new value,

.. math:: \delta_k = x_k - \mu_{k-1},\qquad \mu_k = \mu_{k-1} + \frac{\delta_k}{k},\qquad
          M_k = M_{k-1} + \delta_k\,(x_k - \mu_k),

so every square is of a *deviation*, never of a raw value, and :math:`\sigma^2 = M_n / n`. Two partial
results (counts :math:`n_a, n_b`) combine exactly (Chan, Golub and LeVeque, 1979/1983):

.. math:: n = n_a + n_b,\quad \delta = \mu_b - \mu_a,\quad \mu = \mu_a + \delta\,\frac{n_b}{n},\quad
          M = M_a + M_b + \delta^2\,\frac{n_a n_b}{n},

which is how a GPU reduces one row across many threads: each thread runs Welford on its slice, and
the partial triples :math:`(n, \mu, M)` are merged pairwise (PyTorch's ``var`` and LayerNorm kernels
use this ``WelfordOps`` reduction).
"""

from __future__ import annotations

import torch
from torch import Tensor

from llmbook._checks import as_tensor, check_axis, check_positive_int
from llmbook._precision import restore_half, upcast_half

__all__ = ["shortcut_variance", "welford_variance", "chan_merge", "chunked_variance"]


def _moved(x, dim, name: str = "x") -> tuple[Tensor, int]:
    x = as_tensor(x, name)
    if x.ndim == 0:
        raise ValueError(f"{name} must have at least one axis to reduce over, got a 0-d tensor")
    axis = check_axis(x, dim, name)
    n = x.shape[axis]
    if n == 0:
        raise ValueError(f"the variance over dim {dim} needs at least 1 value, got 0 ({name} of shape "
                         f"{tuple(x.shape)})")
    return x.movedim(axis, -1), n


def shortcut_variance(x: Tensor, dim: int = -1) -> Tensor:
    r"""The *unstable* one-pass variance: running sums :math:`S_1=\sum x_k`, :math:`S_2=\sum x_k^2`, then
    :math:`S_2/n - (S_1/n)^2`.

    The streaming form of :math:`E[x^2]-E[x]^2` (:func:`llmbook.lm.norms.variance_naive` is the vectorised
    one), kept to contrast with :func:`welford_variance`: the same single loop over the entries along
    ``dim``, in ``x``'s dtype, but the squares are of raw values, so when :math:`|\mu| \gg \sigma` the two
    terms agree in their leading digits and the difference is rounding noise, often negative. The loop
    adds in a fixed order with one rounding per operation, so the result is bit-identical on every CPU.
    ``x`` of any shape; returns its shape without ``dim``.

    >>> shortcut_variance(torch.tensor([1e4 + 1, 1e4 - 1]))  # the true variance is 1
    tensor(0.)
    """
    x, n = _moved(x, dim)
    h = upcast_half(x)
    s1 = torch.zeros(h.shape[:-1], dtype=h.dtype)
    s2 = torch.zeros_like(s1)
    for k in range(n):  # one pass, like Welford
        xk = h[..., k]
        s1 = s1 + xk
        s2 = s2 + xk * xk
    return restore_half(s2 / n - (s1 / n) * (s1 / n), x.dtype)


def welford_variance(x: Tensor, dim: int = -1, unbiased: bool = False) -> tuple[Tensor, Tensor]:
    r"""The mean and variance of ``x`` along ``dim`` in **one** pass with Welford's update.

    .. math:: \delta_k = x_k - \mu_{k-1},\quad \mu_k = \mu_{k-1} + \delta_k / k,\quad
              M_k = M_{k-1} + \delta_k (x_k - \mu_k),\qquad \sigma^2 = M_n / n

    (:math:`M_n/(n-1)` when ``unbiased``). ``x`` has any shape ``(..., n, ...)``; the loop visits the
    :math:`n` entries along ``dim`` once each, in order, holding only :math:`(k, \mu_k, M_k)` for every
    other index. The arithmetic stays in ``x``'s dtype (float32 in, float32 throughout: the point is that
    it needs no wider type); fp16/bf16 are computed in float32 and returned in their own dtype.
    Returns ``(mean, var)``, each of ``x``'s shape without ``dim``.

    >>> mean, var = welford_variance(torch.tensor([1e4 + 1, 1e4 - 1]))  # the shortcut gives 0 here
    >>> mean.item(), var.item()
    (10000.0, 1.0)
    """
    x, n = _moved(x, dim)
    if unbiased and n < 2:
        raise ValueError(f"the unbiased variance over dim {dim} needs at least 2 values, got {n}")
    h = upcast_half(x)
    mean = torch.zeros(h.shape[:-1], dtype=h.dtype)
    m2 = torch.zeros_like(mean)
    for k in range(1, n + 1):  # one pass: x_k is read once
        xk = h[..., k - 1]
        delta = xk - mean
        mean = mean + delta / k
        m2 = m2 + delta * (xk - mean)
    var = m2 / (n - 1 if unbiased else n)
    return restore_half(mean, x.dtype), restore_half(var, x.dtype)


def chan_merge(n_a, mean_a: Tensor, m2_a: Tensor, n_b, mean_b: Tensor, m2_b: Tensor
               ) -> tuple[int, Tensor, Tensor]:
    r"""Merge the statistics of two disjoint parts: :math:`(n_a, \mu_a, M_a) \oplus (n_b, \mu_b, M_b)`.

    .. math:: n = n_a + n_b,\quad \delta = \mu_b - \mu_a,\quad \mu = \mu_a + \delta\,n_b / n,\quad
              M = M_a + M_b + \delta^2\, n_a n_b / n

    ``n_a``, ``n_b`` positive ints (the counts), ``mean_*`` the parts' means and ``m2_*`` their sums of
    squared deviations :math:`M = \sum (x_i - \mu)^2` (tensors that broadcast). Exact in real
    arithmetic, and like Welford it only ever squares a difference of means. Returns ``(n, mean, m2)``.

    >>> n, mean, m2 = chan_merge(2, torch.tensor(1.0), torch.tensor(2.0), 2, torch.tensor(5.0), torch.tensor(2.0))
    >>> n, mean.item(), m2.item()  # (0, 2) and (4, 6): mean 3, M = 4 + 4 + 1 + 9 = 20
    (4, 3.0, 20.0)
    """
    n_a, n_b = check_positive_int(n_a, "n_a"), check_positive_int(n_b, "n_b")
    mean_a, m2_a = as_tensor(mean_a, "mean_a"), as_tensor(m2_a, "m2_a")
    mean_b, m2_b = as_tensor(mean_b, "mean_b"), as_tensor(m2_b, "m2_b")
    n = n_a + n_b
    delta = mean_b - mean_a
    return n, mean_a + delta * (n_b / n), m2_a + m2_b + delta * delta * (n_a * n_b / n)


def chunked_variance(x: Tensor, n_chunks: int, dim: int = -1, unbiased: bool = False) -> tuple[Tensor, Tensor]:
    r"""The mean and variance along ``dim`` as a parallel reduction: Welford per chunk, then Chan merges.

    ``x`` is split along ``dim`` into ``n_chunks`` contiguous pieces (as ``torch.tensor_split``; each must be
    non-empty, so ``1 <= n_chunks <= n``), each piece is reduced by :func:`welford_variance` (a "thread"),
    and the partial triples :math:`(n_j, \mu_j, M_j)` are combined by :func:`chan_merge` in a pairwise
    tree. Returns ``(mean, var)`` like :func:`welford_variance`.

    >>> [round(v.item(), 4) for v in chunked_variance(torch.arange(10.0), 3)]
    [4.5, 8.25]
    """
    xm, n = _moved(x, dim)
    n_chunks = check_positive_int(n_chunks, "n_chunks")
    if n_chunks > n:
        raise ValueError(f"n_chunks must be at most the length n = {n} of dim {dim}, got {n_chunks}")
    if unbiased and n < 2:
        raise ValueError(f"the unbiased variance over dim {dim} needs at least 2 values, got {n}")
    parts = []
    for piece in torch.tensor_split(xm, n_chunks, dim=-1):
        mean, var = welford_variance(piece, -1)
        m = piece.shape[-1]
        parts.append((m, upcast_half(mean), upcast_half(var) * m))
    while len(parts) > 1:  # pairwise tree, as in a warp / block reduction
        merged = [chan_merge(*parts[i], *parts[i + 1]) for i in range(0, len(parts) - 1, 2)]
        parts = merged + ([parts[-1]] if len(parts) % 2 else [])
    _, mean, m2 = parts[0]
    return restore_half(mean, xm.dtype), restore_half(m2 / (n - 1 if unbiased else n), xm.dtype)
