r"""Scaling laws: loss against parameters, data and compute; the compute-optimal allocation; emergence.

**The parametric law** (13.01, :func:`parametric_loss`) of Hoffmann et al. (2022, "Chinchilla")

.. math:: L(N, D) = E + \frac{A}{N^{\alpha}} + \frac{B}{D^{\beta}}

with :math:`N` parameters and :math:`D` training tokens. Two constant sets are provided:
:data:`HOFFMANN` (the paper's Approach 3 as printed: ``E=1.69, A=406.4, B=410.7, alpha=0.34,
beta=0.28``) and :data:`BESIROGLU` (the re-fit of Besiroglu et al., 2024, arXiv:2404.10102, to
data reconstructed from the paper's figures: ``E=1.8172, A=482.01, B=2085.43, alpha=0.3478,
beta=0.3658``). Kaplan et al. (2020) wrote the same idea multiplicatively with their own constants:
:func:`kaplan_loss`.

**Compute** (13.02, :func:`training_flops`): :math:`C \approx 6ND` floating-point operations (2 per
parameter and token forward, 4 backward).

**The compute-optimal allocation** (13.03, :func:`chinchilla_optimal`): minimising :math:`L(N, C/(6N))`
over :math:`N` gives, in closed form,

.. math:: N^*(C) = G\left(\frac{C}{6}\right)^{a},\quad D^*(C) = G^{-1}\left(\frac{C}{6}\right)^{b},\quad
          G = \left(\frac{\alpha A}{\beta B}\right)^{\frac{1}{\alpha+\beta}},\quad
          a = \frac{\beta}{\alpha+\beta},\ b = \frac{\alpha}{\alpha+\beta}.

**Loss against compute** (13.04, :func:`loss_vs_compute`): :math:`L(C) = L_\infty + A_C C^{-\alpha_C}`.
Along the compute-optimal frontier the parametric law is exactly of this form
(:func:`optimal_loss_law`).

**Emergence** (13.05, :func:`emergence_probability`): a logistic in :math:`\log C`;
:func:`fit_emergence` fits it, :func:`sequence_metrics` turns a per-token accuracy into exact match
over :math:`L` tokens (the "mirage" of Schaeffer et al., 2023).

:func:`fit_parametric_law` re-estimates :math:`(E, A, B, \alpha, \beta)` as the replication did:
Huber loss (:math:`\delta = 10^{-3}`) between predicted and observed log-loss, L-BFGS from the best
points of a grid of starts.

>>> N, D = chinchilla_optimal(5.76e23, **BESIROGLU)   # Chinchilla's budget, the replication's constants
>>> round(N / 1e9), round(D / 1e12, 2)
(72, 1.33)
"""

from __future__ import annotations

import itertools
import math

import numpy as np
import torch

from llmbook._checks import as_tensor, check_finite, check_range, check_real
from llmbook._precision import restore_half, upcast_half
from llmbook.registry import implements

__all__ = ["HOFFMANN", "BESIROGLU", "KAPLAN", "KAPLAN_JOINT", "parametric_loss", "kaplan_loss", "training_flops",
           "attention_flops",
           "chinchilla_optimal", "loss_vs_compute", "optimal_loss_law", "emergence_probability",
           "fit_emergence", "sequence_metrics", "fit_parametric_law", "ParametricFit"]

#: Hoffmann et al. (2022), Approach 3, as printed in the paper (eq. 10).
HOFFMANN = dict(E=1.69, A=406.4, B=410.7, alpha=0.34, beta=0.28)
#: Besiroglu et al. (2024), "Chinchilla Scaling - A replication attempt", their re-estimate (Table 1).
BESIROGLU = dict(E=1.8172, A=482.01, B=2085.43, alpha=0.3478, beta=0.3658)
#: Kaplan et al. (2020), the single-variable laws L(N), L(D) and L(C_min) of their eqs. 1.1-1.3 (non-embedding
#: parameters, tokens, compute in PF-days, loss in nats per token).
KAPLAN = dict(N_c=8.8e13, alpha_N=0.076, D_c=5.4e13, alpha_D=0.095, C_c=3.1e8, alpha_C=0.050)
#: Kaplan et al. (2020), Table 2, the constants of the joint fit L(N, D) of eq. 1.5 (a separate fit, not
#: the single-variable constants above).
KAPLAN_JOINT = dict(N_c=6.4e13, alpha_N=0.076, D_c=1.8e13, alpha_D=0.103)


# ----------------------------------------------------------------------------------------------- helpers


def _positive(x, name: str):
    """``x`` as a tensor (Python numbers and arrays in float64), every entry finite and > 0; its dtype; scalar?"""
    scalar = not isinstance(x, torch.Tensor)
    if scalar:
        if isinstance(x, (bool, str, bytes)) or x is None:
            raise TypeError(f"{name} must be a positive number or tensor, got {x!r} ({type(x).__name__})")
        try:
            x = np.asarray(x, dtype=np.float64)
        except (TypeError, ValueError) as err:
            raise TypeError(f"{name} must be a positive number or tensor, got {type(x).__name__}") from err
    t = as_tensor(x, name)
    check_finite(t, name)
    if (t <= 0).any():
        raise ValueError(f"{name} must be positive, got min {t.min().item():.4g}")
    return upcast_half(t), t.dtype, scalar and t.ndim == 0


def _broadcast(names, *ts):
    try:
        shape = torch.broadcast_shapes(*(t.shape for t in ts))
    except RuntimeError as err:
        shapes = ", ".join(f"{n} {tuple(t.shape)}" for n, t in zip(names, ts, strict=True))
        raise ValueError(f"{shapes} must broadcast together") from err
    dtype = ts[0].dtype
    for t in ts[1:]:
        dtype = torch.promote_types(dtype, t.dtype)
    return shape, dtype


def _out(y: torch.Tensor, dtype, scalar: bool):
    return y.item() if scalar else restore_half(y, dtype)


def _law(E, A, B, alpha, beta):
    return (check_range(E, "E", 0.0), check_range(A, "A", 0.0), check_range(B, "B", 0.0),
            check_range(alpha, "alpha", 0.0, low_open=True), check_range(beta, "beta", 0.0, low_open=True))


# ----------------------------------------------------------------------------------------------- 13.01, 13.02


@implements("13.01")
def parametric_loss(N, D, E: float = HOFFMANN["E"], A: float = HOFFMANN["A"], B: float = HOFFMANN["B"],
                    alpha: float = HOFFMANN["alpha"], beta: float = HOFFMANN["beta"]):
    r"""The parametric scaling law :math:`L(N,D) = E + A N^{-\alpha} + B D^{-\beta}` (nats per token).

    ``N`` parameters and ``D`` training tokens: positive numbers or tensors that broadcast together;
    ``E`` (:math:`L_\infty`, the entropy of text no model removes), ``A``, ``B`` :math:`\ge 0`,
    ``alpha``, ``beta`` :math:`> 0`. The defaults are :data:`HOFFMANN`. A Python number in gives a float
    out; a tensor gives a tensor of the broadcast shape (fp16/bf16 computed in float32).

    >>> round(parametric_loss(70e9, 1.4e12), 4)   # Chinchilla, published constants
    1.9367
    >>> round(parametric_loss(70e9, 1.4e12, **BESIROGLU), 4)
    1.9739
    """
    E, A, B, alpha, beta = _law(E, A, B, alpha, beta)
    (N, dN, sN), (D, dD, sD) = _positive(N, "N"), _positive(D, "D")
    _, dtype = _broadcast(("N", "D"), N, D)
    L = E + A * N.to(dtype) ** -alpha + B * D.to(dtype) ** -beta
    return _out(L, torch.promote_types(dN, dD), sN and sD)


def kaplan_loss(N=None, D=None, *, N_c: float | None = None, alpha_N: float | None = None,
                D_c: float | None = None, alpha_D: float | None = None):
    r"""Kaplan et al.'s joint law :math:`L(N,D)=\big[(N_c/N)^{\alpha_N/\alpha_D} + D_c/D\big]^{\alpha_D}`.

    A variant of 13.01 (eq. 1.5 of Kaplan et al., 2020): ``N`` non-embedding parameters, ``D`` tokens.
    With both, the constants default to the joint fit of their Table 2 (:data:`KAPLAN_JOINT`:
    :math:`N_c = 6.4\times10^{13}, \alpha_N = 0.076, D_c = 1.8\times10^{13}, \alpha_D = 0.103`). With
    ``D=None`` (unlimited data) it is :math:`(N_c/N)^{\alpha_N}` and with ``N=None`` (unlimited model)
    :math:`(D_c/D)^{\alpha_D}`, and the defaults are the separate single-variable fits of their eqs. 1.1
    and 1.2 (:data:`KAPLAN`: :math:`N_c = 8.8\times10^{13}, \alpha_N = 0.076`; :math:`D_c = 5.4\times10^{13},
    \alpha_D = 0.095`). Any constant passed explicitly overrides its default. No constant term: their fits
    did not reach the floor.

    >>> round(kaplan_loss(1.5e9), 3), round(kaplan_loss(None, 1e10), 3), round(kaplan_loss(1.5e9, 1e10), 3)
    (2.304, 2.262, 2.373)
    """
    if N is None and D is None:
        raise ValueError("kaplan_loss needs N, D or both")
    consts = KAPLAN_JOINT if N is not None and D is not None else KAPLAN
    N_c = consts["N_c"] if N_c is None else N_c
    D_c = consts["D_c"] if D_c is None else D_c
    alpha_N = consts["alpha_N"] if alpha_N is None else alpha_N
    alpha_D = consts["alpha_D"] if alpha_D is None else alpha_D
    N_c, D_c = check_range(N_c, "N_c", 0.0, low_open=True), check_range(D_c, "D_c", 0.0, low_open=True)
    alpha_N = check_range(alpha_N, "alpha_N", 0.0, low_open=True)
    alpha_D = check_range(alpha_D, "alpha_D", 0.0, low_open=True)
    terms, dtypes, scalars = [], [], []
    if N is not None:
        N, dN, sN = _positive(N, "N")
        terms.append((N_c / N) ** (alpha_N / alpha_D))
        dtypes.append(dN), scalars.append(sN)
    if D is not None:
        D, dD, sD = _positive(D, "D")
        terms.append(D_c / D)
        dtypes.append(dD), scalars.append(sD)
    _broadcast(("N", "D") if len(terms) == 2 else ("N or D",), *terms)
    L = sum(terms) ** alpha_D
    dtype = dtypes[0] if len(dtypes) == 1 else torch.promote_types(*dtypes)
    return _out(L, dtype, all(scalars))


@implements("13.02")
def training_flops(N, D):
    r"""Training compute :math:`C \approx 6ND` FLOPs for ``N`` parameters and ``D`` tokens.

    Each parameter takes part in one multiply-add (2 FLOPs) per token forward and two backward (the
    gradient of the input and of the weight): :math:`2 + 4 = 6`. Attention's own products (the scores
    :math:`QK^\top` and the weighted values :math:`AV`, which have no weights) are left out; see
    :func:`attention_flops`: counted in full they add :math:`12\, n_{layer} T d` per token in training,
    small next to :math:`6N \approx 72\, n_{layer} d^2` while the context :math:`T` is small next to
    :math:`6 d`. ``N``, ``D``: positive numbers or tensors that broadcast together.

    >>> f"{training_flops(70e9, 1.4e12):.3g}"   # Chinchilla
    '5.88e+23'
    """
    (N, dN, sN), (D, dD, sD) = _positive(N, "N"), _positive(D, "D")
    _, dtype = _broadcast(("N", "D"), N, D)
    return _out(6.0 * N.to(dtype) * D.to(dtype), torch.promote_types(dN, dD), sN and sD)


def attention_flops(n_layers: int, T: int, d_attn: int, D, *, kaplan: bool = False):
    r"""Training FLOPs of attention's weight-free products for ``D`` tokens: :math:`12\, n_{layer} T d_{attn} D`.

    Per token and layer, the forward pass forms one row of scores :math:`q^\top K` (:math:`T d_{attn}`
    multiply-adds, 2 FLOPs each) and the weighted sum of values :math:`a^\top V` (as many): :math:`4 T d_{attn}`;
    the backward pass costs twice the forward, so training costs :math:`3 \times 4 = 12\, T d_{attn}` per token
    and layer. This counts the full :math:`T \times T` score matrix, as ``torch.utils.flop_counter`` does (a
    causal kernel may skip the masked half). ``kaplan=True`` gives the convention of Kaplan et al. (2020,
    Table 1): :math:`2\, n_{layer} n_{ctx} d_{attn}` per token forward, hence :math:`6\, n_{layer} n_{ctx} d_{attn}`
    for training, half of the full count (it equals the scores alone, or both products with the masked
    half skipped). ``n_layers``, ``T`` (the context), ``d_attn`` (all heads together, :math:`H D`) positive
    ints; ``D`` tokens, a positive number or tensor.

    >>> attention_flops(2, 64, 128, 512), attention_flops(2, 64, 128, 512, kaplan=True)
    (100663296.0, 50331648.0)
    """
    from llmbook._checks import check_positive_int

    n_layers, T = check_positive_int(n_layers, "n_layers"), check_positive_int(T, "T (the context)")
    d_attn = check_positive_int(d_attn, "d_attn")
    D, dtype, scalar = _positive(D, "D")
    per_token = (6 if kaplan else 12) * n_layers * T * d_attn
    return _out(per_token * D, dtype, scalar)


# ----------------------------------------------------------------------------------------------- 13.03, 13.04


@implements("13.03")
def chinchilla_optimal(C, E: float = HOFFMANN["E"], A: float = HOFFMANN["A"], B: float = HOFFMANN["B"],
                       alpha: float = HOFFMANN["alpha"], beta: float = HOFFMANN["beta"]):
    r"""The compute-optimal :math:`(N^*, D^*)` of the parametric law under :math:`C = 6ND`.

    .. math:: N^* = G\,(C/6)^{\beta/(\alpha+\beta)},\quad D^* = G^{-1}(C/6)^{\alpha/(\alpha+\beta)},\quad
              G = \left(\frac{\alpha A}{\beta B}\right)^{1/(\alpha+\beta)}

    (set :math:`\partial L/\partial N = 0` along :math:`D = C/(6N)`: :math:`\alpha A N^{-\alpha} =
    \beta B D^{-\beta}`). ``C`` FLOPs, positive (number or tensor); ``E`` does not move the optimum and
    is accepted so that ``**HOFFMANN`` can be passed. Returns ``(N_opt, D_opt)`` with
    ``6 * N_opt * D_opt == C``. With :math:`\alpha \approx \beta` both exponents are about 1/2.
    (Requires ``A, B > 0``.)

    >>> N, D = chinchilla_optimal(5.76e23)   # Hoffmann's printed constants at Chinchilla's budget
    >>> round(N / 1e9, 1), round(D / 1e12, 2)
    (32.2, 2.98)
    """
    E, A, B, alpha, beta = _law(E, A, B, alpha, beta)
    if A == 0 or B == 0:
        raise ValueError(f"A and B must be positive for an interior optimum, got A = {A}, B = {B}")
    C, dtype, scalar = _positive(C, "C")
    log_G = (math.log(alpha * A) - math.log(beta * B)) / (alpha + beta)
    a, b = beta / (alpha + beta), alpha / (alpha + beta)
    log_c6 = torch.log(C) - math.log(6.0)
    N_opt, D_opt = torch.exp(log_G + a * log_c6), torch.exp(b * log_c6 - log_G)
    return _out(N_opt, dtype, scalar), _out(D_opt, dtype, scalar)


@implements("13.04")
def loss_vs_compute(C, L_inf: float, A: float, alpha: float):
    r"""Loss against compute, :math:`L(C) = L_\infty + A\,C^{-\alpha}`.

    ``C`` FLOPs (positive number or tensor), ``L_inf`` :math:`\ge 0` the irreducible loss, ``A``
    :math:`\ge 0`, ``alpha`` :math:`> 0`. Kaplan et al.'s compute law is the case ``L_inf = 0``,
    ``A = C_c^alpha_C`` with ``C`` in PF-days; :func:`optimal_loss_law` gives the constants of the
    Chinchilla frontier.

    >>> round(loss_vs_compute(1.0, 0.0, KAPLAN["C_c"] ** KAPLAN["alpha_C"], KAPLAN["alpha_C"]), 3)
    2.658
    """
    L_inf, A = check_range(L_inf, "L_inf", 0.0), check_range(A, "A", 0.0)
    alpha = check_range(alpha, "alpha", 0.0, low_open=True)
    C, dtype, scalar = _positive(C, "C")
    return _out(L_inf + A * torch.exp(-alpha * torch.log(C)), dtype, scalar)


def optimal_loss_law(E: float, A: float, B: float, alpha: float, beta: float) -> tuple[float, float, float]:
    r"""The constants ``(L_inf, A_C, alpha_C)`` of :math:`L(N^*(C), D^*(C)) = L_\infty + A_C C^{-\alpha_C}`.

    Along the frontier both terms of the parametric law fall as :math:`C^{-\alpha\beta/(\alpha+\beta)}`:
    :math:`A N^{*-\alpha} = A G^{-\alpha} 6^{\alpha a} C^{-\alpha a}` and
    :math:`B D^{*-\beta} = B G^{\beta} 6^{\beta b} C^{-\beta b}` with :math:`\alpha a = \beta b =
    \alpha\beta/(\alpha+\beta)`. So :math:`L_\infty = E`, :math:`\alpha_C = \alpha\beta/(\alpha+\beta)`.

    >>> [round(v, 4) for v in optimal_loss_law(**HOFFMANN)]
    [1.69, 1071.3649, 0.1535]
    """
    E, A, B, alpha, beta = _law(E, A, B, alpha, beta)
    G = (alpha * A / (beta * B)) ** (1 / (alpha + beta))
    a, b = beta / (alpha + beta), alpha / (alpha + beta)
    A_C = A * G ** -alpha * 6.0 ** (alpha * a) + B * G ** beta * 6.0 ** (beta * b)
    return E, A_C, alpha * beta / (alpha + beta)


# ----------------------------------------------------------------------------------------------- 13.05


@implements("13.05")
def emergence_probability(C, a: float, b: float):
    r"""An emergence-style logistic: :math:`P(\text{success}\mid C)=\frac{1}{1+\exp[-a(\log C-b)]}`.

    ``C`` compute (or parameters), positive; ``a`` the slope per unit of natural-log compute (its
    sharpness: 10 % to 90 % takes :math:`2\ln 9/a` nats of :math:`\log C`), ``b`` the log-compute of
    the midpoint :math:`P = 1/2`. Computed as ``sigmoid``, so no overflow for any finite input.

    >>> round(emergence_probability(math.exp(50.0), a=2.0, b=50.0), 3), round(emergence_probability(1e20, 0.5, 40.0), 4)
    (0.5, 0.9537)
    """
    a, b = check_real(a, "a"), check_real(b, "b")
    C, dtype, scalar = _positive(C, "C")
    return _out(torch.sigmoid(a * (torch.log(C) - b)), dtype, scalar)


def fit_emergence(C, P, *, iters: int = 100) -> tuple[float, float]:
    r"""Least-squares fit of :func:`emergence_probability` to observed success rates ``P`` at computes ``C``.

    Start from the straight-line fit of :math:`\mathrm{logit}(P)` against :math:`\log C` (clipped to
    :math:`[10^{-3}, 1-10^{-3}]`), then Levenberg-Marquardt on :math:`\sum (P_i - \sigma(a(\log C_i - b)))^2`
    with the analytic Jacobian. ``C`` positive, ``P`` in :math:`[0, 1]`, 1-D of one length :math:`\ge 2`.
    Returns ``(a, b)``.

    >>> C = np.exp(np.linspace(40, 60, 9)); P = 1 / (1 + np.exp(-0.7 * (np.log(C) - 52)))
    >>> [round(v, 4) for v in fit_emergence(C, P)]
    [0.7, 52.0]
    """
    x = np.log(np.asarray(C, dtype=np.float64))
    P = np.asarray(P, dtype=np.float64)
    if x.ndim != 1 or x.shape != P.shape or x.size < 2 or not np.isfinite(x).all():
        raise ValueError(f"C and P must be 1-D of one length >= 2 with C > 0, got {x.shape} and {P.shape}")
    if not ((P >= 0) & (P <= 1)).all():
        raise ValueError("P must lie in [0, 1]")
    q = np.clip(P, 1e-3, 1 - 1e-3)
    slope, icept = np.polyfit(x, np.log(q / (1 - q)), 1)
    theta = np.array([slope, -icept / slope if slope != 0 else x.mean()])

    def resid(th):
        s = 1 / (1 + np.exp(-th[0] * (x - th[1])))
        J = np.stack([s * (1 - s) * (x - th[1]), -s * (1 - s) * th[0]], 1)
        return s - P, J

    lam = 1e-3
    r, J = resid(theta)
    for _ in range(iters):
        step = np.linalg.solve(J.T @ J + lam * np.diag(np.diag(J.T @ J) + 1e-12), -J.T @ r)
        r_new, J_new = resid(theta + step)
        if r_new @ r_new < r @ r:
            theta, r, J, lam = theta + step, r_new, J_new, lam / 3
            if np.abs(step).max() < 1e-12 * (1 + np.abs(theta).max()):
                break
        else:
            lam *= 4
    return float(theta[0]), float(theta[1])


def sequence_metrics(p, L: int) -> dict[str, torch.Tensor]:
    r"""Three scores of one model whose tokens are each right with probability ``p``, on answers of ``L`` tokens.

    ``exact_match`` :math:`p^L` (the whole answer right: discontinuous in the number of right tokens),
    ``token_accuracy`` :math:`p` and ``edit_distance`` :math:`L(1-p)` (the expected number of wrong
    tokens: linear in them). Tokens independent, as in Schaeffer et al. (2023).

    >>> {k: round(float(v), 4) for k, v in sequence_metrics(torch.tensor(0.9), 10).items()}
    {'exact_match': 0.3487, 'token_accuracy': 0.9, 'edit_distance': 1.0}
    """
    from llmbook._checks import check_positive_int

    L = check_positive_int(L, "L")
    p = as_tensor(p, "p")
    check_finite(p, "p")
    if ((p < 0) | (p > 1)).any():
        raise ValueError("p must lie in [0, 1]")
    return dict(exact_match=p ** L, token_accuracy=p, edit_distance=L * (1 - p))


# ----------------------------------------------------------------------------------------------- fitting


class ParametricFit(dict):
    """The fitted ``E, A, B, alpha, beta`` (a dict, so ``**fit`` passes them on) plus ``objective``."""

    objective: float


def fit_parametric_law(N, D, L, *, delta: float = 1e-3, n_starts: int = 4) -> ParametricFit:
    r"""Fit :math:`(E, A, B, \alpha, \beta)` to observed losses as Besiroglu et al. (2024) did.

    Minimise :math:`\sum_i \mathrm{Huber}_\delta\big(\mathrm{LSE}(a - \alpha\log N_i,\ b - \beta\log D_i,\ e)
    - \log L_i\big)` over :math:`(a, b, e, \alpha, \beta)` with :math:`A = e^a, B = e^b, E = e^e`
    (log-sum-exp keeps it finite). The objective is evaluated on Hoffmann's grid of starts
    (:math:`\alpha,\beta \in \{0, 0.5, \dots, 2\}`, :math:`e \in \{-1, -0.5, \dots, 1\}`,
    :math:`a, b \in \{0, 5, \dots, 25\}`: 4500 points); L-BFGS (torch, float64, strong Wolfe line
    search) runs from the ``n_starts`` best, and the lowest optimum wins. ``delta`` :math:`10^{-3}` and a
    *sum* over points, as in the replication (the original used a mean, which stopped its optimiser early).
    """
    N, D, L = (torch.as_tensor(np.asarray(v, dtype=np.float64)) for v in (N, D, L))
    if not (N.shape == D.shape == L.shape and N.ndim == 1 and N.numel() >= 5):
        raise ValueError(f"N, D, L must be 1-D of one length >= 5, got {tuple(N.shape)}, {tuple(D.shape)}, "
                         f"{tuple(L.shape)}")
    if not all(torch.isfinite(v).all() and (v > 0).all() for v in (N, D, L)):
        raise ValueError("N, D and L must be finite and positive")
    delta = check_range(delta, "delta", 0.0, low_open=True)
    logN, logD, logL = N.log(), D.log(), L.log()

    def objective(theta):  # theta (..., 5) = (a, b, e, alpha, beta)
        a, b, e, al, be = theta.unbind(-1)
        pred = torch.logsumexp(torch.stack([a[..., None] - al[..., None] * logN, b[..., None] - be[..., None] * logD,
                                            e[..., None].expand(*e.shape, logN.numel())]), 0)
        return torch.nn.functional.huber_loss(pred, logL.expand_as(pred), delta=delta, reduction="none").sum(-1)

    grid = torch.tensor(list(itertools.product(np.arange(0, 30, 5), np.arange(0, 30, 5), np.arange(-1, 1.5, 0.5),
                                               np.arange(0, 2.5, 0.5), np.arange(0, 2.5, 0.5))), dtype=torch.float64)
    starts = grid[objective(grid).argsort()[:n_starts]]
    best, best_val = None, math.inf
    for start in starts:
        theta = start.clone().requires_grad_(True)
        opt = torch.optim.LBFGS([theta], lr=1.0, max_iter=2000, tolerance_grad=1e-12, tolerance_change=1e-15,
                                history_size=50, line_search_fn="strong_wolfe")

        def closure(opt=opt, theta=theta):
            opt.zero_grad()
            val = objective(theta)
            val.backward()
            return val

        opt.step(closure)
        with torch.no_grad():
            val = objective(theta).item()
        if val < best_val:
            best, best_val = theta.detach(), val
    a, b, e, alpha, beta = best.tolist()
    fit = ParametricFit(E=math.exp(e), A=math.exp(a), B=math.exp(b), alpha=alpha, beta=beta)
    fit.objective = best_val
    return fit
