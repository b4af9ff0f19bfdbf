r"""Contextual bandits: disjoint LinUCB (Li, Chu, Langford & Schapire 2010).

Each arm :math:`a` has its own linear model of the expected reward, :math:`\mathbb E[r\mid x] =
x^\top\theta_a`, fitted by ridge regression on the contexts in which it was played:
:math:`A_a = I + \sum x x^\top`, :math:`b_a = \sum r\,x`, :math:`\hat\theta_a = A_a^{-1} b_a`.
The score adds the width of a confidence ellipsoid, :math:`\alpha\sqrt{x^\top A_a^{-1}x}`, which is
large in directions the arm has rarely seen. Li et al. evaluated it on Yahoo!'s front-page news module
offline, by replaying a log of traffic served by a uniformly random policy.

* :func:`linucb` (36.06): the scores, the ridge solutions and the widths.
* :func:`linucb_update` adds one observation per run; :func:`simulate_linucb` runs the rule on a
  linear contextual bandit with known parameters, vectorised over runs.

Solves run in float64 (Cholesky of each :math:`A_a`); results return in ``X``'s dtype.

>>> A, b = torch.eye(2).expand(2, 2, 2), torch.tensor([[1.0, 0.0], [0.0, 0.0]])
>>> linucb(torch.tensor([[1.0, 0.0], [0.0, 1.0]]), A, b, alpha=0.5).scores.tolist()
[1.5, 0.5]
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from llmbook._checks import as_tensor, check_dim, check_finite, check_int, check_range
from llmbook.registry import implements

__all__ = ["LinUCBScores", "linucb", "linucb_update", "LinUCBRun", "simulate_linucb"]


class LinUCBScores(NamedTuple):
    scores: torch.Tensor  # (..., K)
    theta: torch.Tensor  # (K, d) ridge solutions
    width: torch.Tensor  # (..., K) sqrt(x^T A^-1 x)


def _finite(x, name, contract, ndim):
    t = as_tensor(x, name)
    check_dim(t, name, contract, min_dim=ndim, max_dim=None if ndim == 2 and name == "X" else ndim)
    check_finite(t, name)
    return t


@implements("36.06")
def linucb(X, A, b, alpha: float) -> LinUCBScores:
    r"""Disjoint LinUCB scores: ridge estimate plus an upper confidence width.

    .. math:: a_t = \arg\max_a \Big[x_{t,a}^\top\hat\theta_a + \alpha\sqrt{x_{t,a}^\top A_a^{-1}x_{t,a}}\Big],
       \qquad \hat\theta_a = A_a^{-1}b_a

    Symbols: ``X`` = :math:`x_{t,a}` ``(..., K, d)`` (one context per arm; share it across arms for a
    single user context), ``A`` = :math:`A_a` ``(K, d, d)`` symmetric positive definite,
    ``b`` = :math:`b_a` ``(K, d)``, ``alpha`` = :math:`\alpha \ge 0`. Returns :class:`LinUCBScores`.
    """
    X = _finite(X, "X", "(..., K, d)", 2)
    A = _finite(A, "A", "(K, d, d)", 3)
    b = _finite(b, "b", "(K, d)", 2)
    alpha = check_range(alpha, "alpha", 0.0)
    K, d = X.shape[-2], X.shape[-1]
    if A.shape != (K, d, d) or b.shape != (K, d):
        raise ValueError(f"A {tuple(A.shape)} and b {tuple(b.shape)} must have shapes (K, d, d) and (K, d) "
                         f"with K = {K}, d = {d} from X {tuple(X.shape)}")
    A64 = A.double()
    asym = (A64 - A64.transpose(-1, -2)).abs().amax().item() if A64.numel() else 0.0
    if asym > 1e-6 * max(A64.abs().amax().item() if A64.numel() else 1.0, 1.0):
        raise ValueError(f"A must be symmetric, got max |A - A^T| = {asym:.3g}")
    L, info = torch.linalg.cholesky_ex(A64)
    if (info != 0).any():
        raise ValueError("A must be positive definite (its Cholesky factorisation failed)")
    theta = torch.cholesky_solve(b.double().unsqueeze(-1), L).squeeze(-1)  # (K, d)
    x = X.double()
    mean = (x * theta).sum(-1)
    Ainv_x = torch.cholesky_solve(x.unsqueeze(-1), L).squeeze(-1)  # broadcasts over the leading axes of X
    width = torch.sqrt((x * Ainv_x).sum(-1).clamp_min(0))
    return LinUCBScores((mean + alpha * width).to(X.dtype), theta.to(X.dtype), width.to(X.dtype))


def linucb_update(A, b, x, a, r) -> tuple[torch.Tensor, torch.Tensor]:
    r"""Add the observations :math:`(x, a, r)` of ``R`` runs: :math:`A_a \mathrel{+}= xx^\top`,
    :math:`b_a \mathrel{+}= r x`.

    ``A`` ``(R, K, d, d)``, ``b`` ``(R, K, d)``, ``x`` ``(R, d)``, ``a``, ``r`` ``(R,)``."""
    rows = torch.arange(A.shape[0])
    A, b = A.clone(), b.clone()
    A[rows, a] += x.unsqueeze(-1) * x.unsqueeze(-2)
    b[rows, a] += r.unsqueeze(-1) * x
    return A, b


class LinUCBRun(NamedTuple):
    regret: torch.Tensor  # (R, T) cumulative regret against the best arm of each round
    theta_hat: torch.Tensor  # (R, K, d) final ridge estimates


def simulate_linucb(theta, T: int, alpha: float, runs: int = 10, sigma: float = 0.1, seed: int = 0) -> LinUCBRun:
    r"""LinUCB on a linear bandit with known :math:`\theta_a` ``(K, d)``: one user context
    :math:`x_t \sim N(0, I/d)` per round shared by the arms, reward :math:`x_t^\top\theta_a + \sigma\varepsilon`;
    the regret compares the known expected rewards of the chosen and the best arm."""
    theta = as_tensor(theta, "theta").double()
    K, d = theta.shape
    T, R = check_int(T, "T", low=1), check_int(runs, "runs", low=1)
    g = torch.Generator().manual_seed(seed)
    xs = torch.randn(R, T, d, generator=g, dtype=torch.float64) / math.sqrt(d)
    noise = sigma * torch.randn(R, T, generator=g, dtype=torch.float64)
    A = torch.eye(d, dtype=torch.float64).expand(R, K, d, d).clone()
    b = torch.zeros(R, K, d, dtype=torch.float64)
    gaps = torch.empty(R, T, dtype=torch.float64)
    rows = torch.arange(R)
    for t in range(T):
        x = xs[:, t]
        L = torch.linalg.cholesky(A)  # (R, K, d, d)
        th = torch.cholesky_solve(b.unsqueeze(-1), L).squeeze(-1)
        w = torch.cholesky_solve(x[:, None, :, None].expand(R, K, d, 1), L).squeeze(-1)
        score = (th * x[:, None]).sum(-1) + alpha * torch.sqrt((w * x[:, None]).sum(-1))
        a = score.argmax(-1)
        means = x @ theta.T  # (R, K) known expected rewards
        gaps[:, t] = means.max(-1).values - means[rows, a]
        A, b = linucb_update(A, b, x, a, means[rows, a] + noise[:, t])
    th = torch.cholesky_solve(b.unsqueeze(-1), torch.linalg.cholesky(A)).squeeze(-1)
    return LinUCBRun(gaps.cumsum(-1), th)
