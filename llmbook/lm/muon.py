r"""Muon (chapter 8): momentum whose update matrix is orthogonalised by a Newton–Schulz iteration.

For a weight *matrix* :math:`W` (``d_out x d_in``), Muon (Jordan et al., 2024) keeps SGD's momentum
:math:`B_t = \mu B_{t-1} + g_t` and replaces the update by the orthogonal matrix nearest to it: with the
singular value decomposition :math:`B = U S V^\top`, the step is along :math:`U V^\top`, every singular
value set to 1. Directions that the gradient barely touches get the same step as the dominant ones. The
SVD is too slow on accelerators, so :func:`newton_schulz` approximates :math:`U V^\top` with five matrix
polynomials. Embeddings, the output head and the gains of the norms are not hidden matrices in this
sense; Muon's authors train them with AdamW, and so does the book (``benchmarks/lr_sweep.py``).

:class:`Muon` follows ``torch.optim.Muon``'s arguments and arithmetic, except that the iteration runs in
the parameter's own dtype (torch's runs in bf16).
"""

from __future__ import annotations

import math

import torch
from jaxtyping import Float
from torch import Tensor
from torch.optim import Optimizer

from llmbook._checks import as_tensor, check_finite, check_nonempty, check_positive_int, check_range

__all__ = ["QUINTIC", "CUBIC", "newton_schulz", "Muon"]

QUINTIC = (3.4445, -4.7750, 2.0315)
"""Keller Jordan's coefficients (also ``torch.optim.Muon``'s): the slope at 0 is 3.4445, so small singular
values grow fast, and after 5 steps every singular value lies in about [0.7, 1.2] instead of at 1."""

CUBIC = (1.5, -0.5, 0.0)
"""The classical Newton–Schulz iteration :math:`X \\leftarrow \\tfrac32 X - \\tfrac12 X X^\\top X`: it
converges to exactly :math:`U V^\\top` (quadratically once near), but needs more steps."""


def newton_schulz(G: Float[Tensor, "m n"], steps: int = 5, coefficients: tuple[float, float, float] = QUINTIC,
                  eps: float = 1e-7) -> Float[Tensor, "m n"]:
    r"""Approximate the orthogonal factor :math:`U V^\top` of :math:`G = U S V^\top` by a Newton–Schulz iteration.

    .. math:: X_0 = \frac{G}{\|G\|_F + \epsilon},\qquad
              X_{k+1} = a X_k + b\,(X_k X_k^\top) X_k + c\,(X_k X_k^\top)^2 X_k

    Symbols: :math:`G` ``G`` (shape ``(m, n)``), :math:`(a, b, c)` ``coefficients``, ``steps`` the number
    of iterations, :math:`\epsilon` ``eps``. Every step maps each singular value :math:`\sigma` of
    :math:`X` to :math:`p(\sigma) = a\sigma + b\sigma^3 + c\sigma^5` and keeps :math:`U` and :math:`V`, so
    :math:`X_k = U\,p^{(k)}(S/\|G\|_F)\,V^\top`; dividing by the Frobenius norm puts every
    :math:`\sigma` in :math:`[0, 1]`. With ``CUBIC`` :math:`p^{(k)} \to 1` and :math:`X_k \to U V^\top`;
    with ``QUINTIC`` (the default, Muon's) five steps bring every :math:`\sigma` to roughly
    :math:`[0.7, 1.2]`. A tall :math:`G` (``m > n``) is iterated as :math:`G^\top` so that the Gram matrix is
    the smaller one. Computed in ``G``'s dtype (float32 or float64).

    >>> G = torch.tensor([[3.0, 0.0], [0.0, 0.5]], dtype=torch.float64)
    >>> newton_schulz(G, steps=30, coefficients=CUBIC).round(decimals=6)  # U V^T of a diagonal matrix: I
    tensor([[1., 0.],
            [0., 1.]], dtype=torch.float64)
    """
    X = as_tensor(G, "G")
    if X.ndim != 2:
        raise ValueError(f"G must be a matrix (m, n), got shape {tuple(X.shape)}")
    check_nonempty(X, "G")
    check_finite(X, "G")
    steps = check_positive_int(steps, "steps")
    if len(coefficients) != 3:
        raise ValueError(f"coefficients must be three numbers (a, b, c), got {coefficients!r}")
    a, b, c = (float(v) for v in coefficients)
    eps = check_range(eps, "eps", 0.0, low_open=True)
    tall = X.shape[0] > X.shape[1]
    if tall:
        X = X.T
    X = X / (torch.linalg.matrix_norm(X) + eps)
    for _ in range(steps):
        A = X @ X.T
        X = a * X + (b * A + c * A @ A) @ X
    return X.T if tall else X


class Muon(Optimizer):
    r"""Muon for 2-D weights: Nesterov momentum, orthogonalised by :func:`newton_schulz`, decoupled decay.

    .. math:: B_t = \mu B_{t-1} + (1-\mu) g_t,\quad
              M_t = \begin{cases}(1-\mu) g_t + \mu B_t & \text{nesterov}\\ B_t\end{cases},\quad
              \theta_{t+1} = \theta_t(1-\eta\lambda) - \eta\sqrt{\max(1, d_{out}/d_{in})}\;\mathrm{NS}(M_t)

    :math:`\mu` ``momentum``, :math:`\eta` ``lr``, :math:`\lambda` ``weight_decay``; ``ns_steps`` and
    ``ns_coefficients`` go to :func:`newton_schulz`. The momentum is an exponential average (torch's
    ``lerp``), which is a rescaled :math:`\mu B + g` that the orthogonalisation cannot see. Defaults and state
    key (``momentum_buffer``) are those of ``torch.optim.Muon``; every parameter must be a matrix.

    >>> W = torch.nn.Parameter(torch.zeros(2, 2, dtype=torch.float64))
    >>> W.grad = torch.tensor([[4.0, 0.0], [0.0, 0.1]], dtype=torch.float64)
    >>> Muon([W], lr=0.1, weight_decay=0.0, ns_steps=30, ns_coefficients=CUBIC).step()
    >>> W.detach().round(decimals=4).tolist()  # both directions step by lr, however small the gradient
    [[-0.1, 0.0], [0.0, -0.1]]
    """

    def __init__(self, params, lr: float = 1e-3, weight_decay: float = 0.1, momentum: float = 0.95,
                 nesterov: bool = True, ns_coefficients: tuple[float, float, float] = QUINTIC, eps: float = 1e-7,
                 ns_steps: int = 5):
        check_range(lr, "lr", 0.0)
        check_range(weight_decay, "weight_decay", 0.0)
        check_range(momentum, "momentum", 0.0, 1.0, high_open=True)
        super().__init__(params, dict(lr=lr, weight_decay=weight_decay, momentum=momentum, nesterov=bool(nesterov),
                                      ns_coefficients=tuple(ns_coefficients), eps=eps, ns_steps=ns_steps))
        for group in self.param_groups:
            for p in group["params"]:
                if p.ndim != 2:
                    raise ValueError(f"Muon updates matrices only; got a parameter of shape {tuple(p.shape)} "
                                     "(give embeddings, norms and biases to AdamW)")

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr, mu = group["lr"], group["momentum"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                g = p.grad
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(p)
                B = state["momentum_buffer"]
                B.lerp_(g, 1 - mu)
                M = g.lerp(B, mu) if group["nesterov"] else B
                O = newton_schulz(M, group["ns_steps"], group["ns_coefficients"], group["eps"])
                d_out, d_in = p.shape
                p.mul_(1 - lr * group["weight_decay"])
                p.add_(O, alpha=-lr * math.sqrt(max(1.0, d_out / d_in)))
        return loss
