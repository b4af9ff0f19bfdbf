r"""State space models (chapter 18): the continuous SSM, its discretisation, the convolution kernel, Mamba.

A linear state space model reads a sequence through a hidden state :math:`x \in \mathbb{R}^N`:

* :func:`continuous_ssm` is the ODE :math:`x' = Ax + Bu,\ y = Cx + Du` (18.01);
* :func:`discretize` turns it into a recurrence with step :math:`\Delta` (zero-order hold or bilinear),
  and :func:`ssm_scan` runs that recurrence token by token (18.02);
* :func:`ssm_convolution` computes the same outputs at once, as a causal convolution with the kernel
  :math:`K_i = C\bar{A}^i\bar{B}` of :func:`ssm_kernel` (18.03, S4's training path);
* :func:`selective_scan` is Mamba's recurrence, whose :math:`\Delta, B, C` change with every token (18.04).

:func:`hippo_legs` builds the HiPPO-LegS matrix that S4 initialises :math:`A` with. Matrices follow
``scipy.signal``: ``A (N, N)``, ``B (N, P)``, ``C (Q, N)``, ``D (Q, P)``; sequences are batch-first ``(B, T, P)``.
A 1-D ``A`` of shape ``(N,)`` means the diagonal matrix ``diag(A)`` (S4D, Mamba).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from jaxtyping import Float
from torch import Tensor

from llmbook._checks import (
    as_tensor,
    check_dim,
    check_finite,
    check_nonnegative_int,
    check_positive_int,
    check_range,
    check_shape,
)
from llmbook._precision import restore_half, upcast_half
from llmbook.lm.recurrent import long_convolution
from llmbook.registry import implements

__all__ = ["continuous_ssm", "discretize", "hippo_legs", "ssm_scan", "ssm_kernel", "ssm_convolution",
           "selective_scan"]

METHODS = ("zoh", "bilinear")


def _matrices(A, B, C=None, D=None):
    """Validated ``A (N, N) | (N,)``, ``B (N, P)``, ``C (Q, N)``, ``D (Q, P)`` in one dtype (fp16/bf16 upcast)."""
    A = as_tensor(A, "A")
    check_dim(A, "A", "(N, N) or (N,) (diagonal)", min_dim=1, max_dim=2)
    N = A.shape[0]
    if A.ndim == 2:
        check_shape(A, (N, N), "A", "a square state matrix")
    B = as_tensor(B, "B")
    check_dim(B, "B", f"(N, P) with N = {N}", min_dim=2, max_dim=2)
    check_shape(B, (N, B.shape[1]), "B", f"the state size N = {N} of A")
    out = [A, B]
    if C is not None:
        C = as_tensor(C, "C")
        check_dim(C, "C", f"(Q, N) with N = {N}", min_dim=2, max_dim=2)
        check_shape(C, (C.shape[0], N), "C", f"the state size N = {N} of A")
        out.append(C)
        D = torch.zeros(C.shape[0], B.shape[1], dtype=C.dtype) if D is None else as_tensor(D, "D")
        check_shape(D, (C.shape[0], B.shape[1]), "D", "(Q, P): the outputs of C and the inputs of B")
        out.append(D)
    dtype = torch.promote_types(torch.promote_types(out[0].dtype, out[1].dtype), out[-1].dtype)
    for name, t in zip("ABCD", out, strict=False):
        check_finite(t, name)
    return [upcast_half(t.to(dtype)) for t in out], dtype


def _sequence(u, P: int, name: str = "u") -> Tensor:
    u = as_tensor(u, name)
    check_dim(u, name, f"(B, T, P) with P = {P}", min_dim=3, max_dim=3)
    if u.shape[-1] != P:
        raise ValueError(f"{name} must have shape (B, T, P) with P = {P} (the inputs of B), got {tuple(u.shape)}")
    return u


@implements("18.01")
def continuous_ssm(
    A: Float[Tensor, "N N"], B: Float[Tensor, "N P"], C: Float[Tensor, "Q N"], D: Float[Tensor, "Q P"] | None,
    x: Float[Tensor, "*batch N"], u: Float[Tensor, "*batch P"],
) -> tuple[Float[Tensor, "*batch N"], Float[Tensor, "*batch Q"]]:
    r"""The continuous-time state space model: the state's velocity and the output at one instant.

    .. math:: x'(t) = A x(t) + B u(t), \qquad y(t) = C x(t) + D u(t)

    Symbols: ``A`` the state matrix (``(N, N)``, or ``(N,)`` for a diagonal one), ``B`` the input
    matrix ``(N, P)``, ``C`` the output matrix ``(Q, N)``, ``D`` the feed-through ``(Q, P)`` (``None``:
    zero), ``x`` the state ``(..., N)``, ``u`` the input ``(..., P)``. Returns ``(x_dot, y)``. Hand it to
    an ODE solver (``scipy.integrate.solve_ivp``) to follow the state through time.

    >>> continuous_ssm(torch.tensor([[-1.0]]), torch.ones(1, 1), torch.ones(1, 1), None,
    ...                torch.tensor([0.5]), torch.tensor([1.0]))
    (tensor([0.5000]), tensor([0.5000]))
    """
    (A, B, C, D), dtype = _matrices(A, B, C, D)
    N, P = B.shape
    x, u = as_tensor(x, "x"), as_tensor(u, "u")
    check_dim(x, "x", f"(..., N) with N = {N}")
    check_dim(u, "u", f"(..., P) with P = {P}")
    if x.shape[-1] != N or u.shape[-1] != P or x.shape[:-1] != u.shape[:-1]:
        raise ValueError(f"x (..., N = {N}) and u (..., P = {P}) must share their leading axes, "
                         f"got {tuple(x.shape)} and {tuple(u.shape)}")
    out_dtype = torch.promote_types(torch.promote_types(x.dtype, u.dtype), dtype)
    x, u = upcast_half(x.to(out_dtype)), upcast_half(u.to(out_dtype))
    A, B, C, D = (t.to(x.dtype) for t in (A, B, C, D))
    Ax = x * A if A.ndim == 1 else x @ A.T
    x_dot = Ax + u @ B.T
    y = x @ C.T + u @ D.T
    return restore_half(x_dot, out_dtype), restore_half(y, out_dtype)


def discretize(A: Float[Tensor, "N N"], B: Float[Tensor, "N P"], dt: float,
               method: str = "zoh") -> tuple[Float[Tensor, "N N"], Float[Tensor, "N P"]]:
    r"""The discrete matrices :math:`(\bar{A}, \bar{B})` of step :math:`\Delta` (``dt``), for :func:`ssm_scan`.

    .. math::
        \text{zoh:}\quad \bar{A} = e^{\Delta A},\quad \bar{B} = \int_0^\Delta e^{sA}\,ds\,B
        \qquad\qquad \text{bilinear:}\quad \bar{A} = (I - \tfrac{\Delta}{2}A)^{-1}(I + \tfrac{\Delta}{2}A),\quad
        \bar{B} = (I - \tfrac{\Delta}{2}A)^{-1}\Delta B

    Zero-order hold (Mamba, S4D) is exact when the input is constant over each step; it reads both
    matrices off one matrix exponential, :math:`\exp(\Delta[\begin{smallmatrix}A & B\\ 0 & 0\end{smallmatrix}])`,
    so a singular :math:`A` needs no inverse. The bilinear (Tustin) rule is S4's. A diagonal ``A``
    ``(N,)`` returns a diagonal ``A_bar`` ``(N,)``. ``dt > 0``.

    >>> A_bar, B_bar = discretize(torch.tensor([[0.0]]), torch.ones(1, 1), 0.5)
    >>> A_bar.item(), B_bar.item()
    (1.0, 0.5)
    """
    (A, B), dtype = _matrices(A, B)
    dt = check_range(dt, "dt", 0.0, low_open=True)
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    N, P = B.shape
    if A.ndim == 1:  # diagonal: elementwise, with expm1 for accuracy as dt A -> 0
        dA = dt * A
        if method == "zoh":
            safe = torch.where(dA == 0, torch.ones_like(dA), dA)
            ratio = torch.where(dA == 0, torch.ones_like(dA), torch.expm1(safe) / safe)  # (e^{dA} - 1) / dA
            A_bar, B_bar = torch.exp(dA), (dt * ratio)[:, None] * B
        else:
            A_bar, B_bar = (1 + dA / 2) / (1 - dA / 2), (dt / (1 - dA / 2))[:, None] * B
    elif method == "zoh":
        M = torch.zeros(N + P, N + P, dtype=A.dtype)
        M[:N, :N], M[:N, N:] = A, B
        E = torch.linalg.matrix_exp(dt * M)
        A_bar, B_bar = E[:N, :N], E[:N, N:]
    else:
        eye = torch.eye(N, dtype=A.dtype)
        lhs = eye - dt / 2 * A
        A_bar = torch.linalg.solve(lhs, eye + dt / 2 * A)
        B_bar = torch.linalg.solve(lhs, dt * B)
    return restore_half(A_bar, dtype), restore_half(B_bar, dtype)


def hippo_legs(N: int, dtype: torch.dtype = torch.float64) -> tuple[Float[Tensor, "N N"], Float[Tensor, "N 1"]]:
    r"""The HiPPO-LegS matrices :math:`(A, B)` that S4 initialises its state with (Gu et al., 2020).

    .. math:: A_{nk} = -\begin{cases}\sqrt{(2n+1)(2k+1)} & n > k\\ n + 1 & n = k\\ 0 & n < k\end{cases},\qquad
        B_n = \sqrt{2n + 1}

    With them the state holds the coefficients of the input's history in a basis of Legendre
    polynomials: a compressed memory of everything seen so far.

    >>> A, B = hippo_legs(2)
    >>> A.tolist()
    [[-1.0, 0.0], [-1.7320508075688772, -2.0]]
    """
    N = check_positive_int(N, "N")
    n = torch.arange(N, dtype=dtype)
    r = torch.sqrt(2 * n + 1)
    A = -torch.tril(r[:, None] * r[None, :], -1) - torch.diag(n + 1)
    return A, r[:, None].clone()


@implements("18.02")
def ssm_scan(
    A_bar: Float[Tensor, "N N"], B_bar: Float[Tensor, "N P"], C: Float[Tensor, "Q N"], D: Float[Tensor, "Q P"] | None,
    u: Float[Tensor, "B T P"], x0: Float[Tensor, "B N"] | None = None, return_state: bool = False,
):
    r"""The discrete SSM as a recurrence: one state update per step (how an SSM generates).

    .. math:: x_k = \bar{A} x_{k-1} + \bar{B} u_k, \qquad y_k = C x_k + D u_k

    Symbols: ``A_bar``, ``B_bar`` from :func:`discretize` (``A_bar (N,)`` for a diagonal one), ``C``, ``D``
    (``None``: zero) as in :func:`continuous_ssm`, ``u`` the inputs ``(B, T, P)``, ``x0`` the state before
    the first step ``(B, N)`` (default zero). Returns ``y (B, T, Q)``, and the last state ``(B, N)`` too
    with ``return_state``. The state has ``N`` numbers whatever ``T``: each step costs :math:`O(N^2)`.

    >>> ssm_scan(torch.tensor([[0.5]]), torch.ones(1, 1), torch.ones(1, 1), None, torch.ones(1, 3, 1))
    tensor([[[1.0000],
             [1.5000],
             [1.7500]]])
    """
    (A_bar, B_bar, C, D), dtype = _matrices(A_bar, B_bar, C, D)
    u = _sequence(u, B_bar.shape[1])
    out_dtype = torch.promote_types(u.dtype, dtype)
    u = upcast_half(u.to(out_dtype))
    A_bar, B_bar, C, D = (t.to(u.dtype) for t in (A_bar, B_bar, C, D))
    Bsz, T, _ = u.shape
    N = B_bar.shape[0]
    x = torch.zeros(Bsz, N, dtype=u.dtype) if x0 is None else check_shape(as_tensor(x0, "x0"), (Bsz, N), "x0",
                                                                          "(B, N)").to(u.dtype)
    Bu = u @ B_bar.T  # (B, T, N): the inputs' pushes, computed at once
    xs = []
    for k in range(T):
        x = (x * A_bar if A_bar.ndim == 1 else x @ A_bar.T) + Bu[:, k]
        xs.append(x)
    X = torch.stack(xs, 1) if xs else torch.zeros(Bsz, 0, N, dtype=u.dtype)
    y = restore_half(X @ C.T + u @ D.T, out_dtype)
    return (y, restore_half(x, out_dtype)) if return_state else y


def ssm_kernel(A_bar: Float[Tensor, "N N"], B_bar: Float[Tensor, "N P"], C: Float[Tensor, "Q N"],
               L: int) -> Float[Tensor, "L Q P"]:
    r"""The SSM convolution kernel :math:`K_i = C\bar{A}^{i}\bar{B}`, for :math:`i = 0, \dots, L-1`.

    ``K[i]`` is how strongly the input of ``i`` steps ago still moves the output; :math:`\bar{A}`'s
    eigenvalues below 1 in modulus make it fade. Computed by repeated products, :math:`O(L N^2 P)`
    (S4 evaluates it in :math:`O((N + L)\log)` through a Cauchy kernel; the numbers are the same).

    >>> ssm_kernel(torch.tensor([[0.5]]), torch.ones(1, 1), torch.ones(1, 1), 3).flatten()
    tensor([1.0000, 0.5000, 0.2500])
    """
    (A_bar, B_bar, C, _), dtype = _matrices(A_bar, B_bar, C)
    L = check_nonnegative_int(L, "L")
    AiB, K = B_bar, []
    for _ in range(L):
        K.append(C @ AiB)
        AiB = A_bar[:, None] * AiB if A_bar.ndim == 1 else A_bar @ AiB
    out = torch.stack(K) if K else torch.zeros(0, C.shape[0], B_bar.shape[1], dtype=C.dtype)
    return restore_half(out, dtype)


@implements("18.03")
def ssm_convolution(
    A_bar: Float[Tensor, "N N"], B_bar: Float[Tensor, "N P"], C: Float[Tensor, "Q N"], D: Float[Tensor, "Q P"] | None,
    u: Float[Tensor, "B T P"],
) -> Float[Tensor, "B T Q"]:
    r"""The discrete SSM as one causal convolution (how S4 trains: all positions at once).

    .. math:: y_k = \sum_{i=0}^{k} K_i u_{k-i} + D u_k,\qquad K_i = C\bar{A}^{i}\bar{B}

    Unrolling :func:`ssm_scan` from a zero state gives exactly this sum; :func:`ssm_kernel` builds
    ``K (T, Q, P)`` and :func:`llmbook.lm.recurrent.long_convolution` applies it by FFT in
    :math:`O(T\log T)`. Same arguments and result as :func:`ssm_scan` (zero initial state).

    >>> ssm_convolution(torch.tensor([[0.5]]), torch.ones(1, 1), torch.ones(1, 1), None, torch.ones(1, 3, 1))
    tensor([[[1.0000],
             [1.5000],
             [1.7500]]])
    """
    (A_bar, B_bar, C, D), dtype = _matrices(A_bar, B_bar, C, D)
    u = _sequence(u, B_bar.shape[1])
    out_dtype = torch.promote_types(u.dtype, dtype)
    u = upcast_half(u.to(out_dtype))
    Bsz, T, P = u.shape
    Q = C.shape[0]
    K = ssm_kernel(A_bar, B_bar, C, T).to(u.dtype)  # (T, Q, P)
    # every (q, p) pair is one channel of a depthwise long convolution; the p channels then add up
    u_rep = u[:, :, None, :].expand(Bsz, T, Q, P).reshape(Bsz, T, Q * P)
    y = long_convolution(u_rep, K.reshape(T, Q * P)).reshape(Bsz, T, Q, P).sum(-1)
    return restore_half(y + u @ D.to(u.dtype).T, out_dtype)


@implements("18.04")
def selective_scan(
    x: Float[Tensor, "B T D"], delta: Float[Tensor, "B T D"], A: Float[Tensor, "D N"],
    B: Float[Tensor, "B T N"], C: Float[Tensor, "B T N"], D: Float[Tensor, " D"] | None = None,
    z: Float[Tensor, "B T D"] | None = None, return_state: bool = False,
):
    r"""Mamba's selective scan: an SSM whose step, input and output matrices depend on the token.

    .. math:: h_t = \bar{A}_t h_{t-1} + \bar{B}_t x_t,\quad y_t = C_t h_t + D x_t,\qquad
        \bar{A}_t = e^{\Delta_t A},\quad \bar{B}_t = \Delta_t B_t

    Each of the ``D`` channels runs its own diagonal SSM of ``N`` states, discretised per token with
    its own step :math:`\Delta_t`: a large step resets the state towards the current token, a step
    near 0 lets the token pass unnoticed. :math:`\bar{B}_t = \Delta_t B_t` is Mamba's simplified
    (Euler) rule for the input. Symbols: ``x`` the inputs ``(B, T, D)``, ``delta`` the steps
    :math:`\Delta \ge 0` ``(B, T, D)`` (after Mamba's softplus), ``A`` ``(D, N)`` with entries
    :math:`\le 0` (Mamba: ``-exp(A_log)``), ``B``, ``C`` ``(B, T, N)`` shared by the channels, ``D``
    ``(D,)`` the skip, ``z`` ``(B, T, D)`` an optional gate: the output is multiplied by
    :math:`\mathrm{silu}(z)`. Returns ``y (B, T, D)`` (and the last state ``(B, D, N)`` with
    ``return_state``). No kernel ``K`` exists: it would change with every token, so this is a scan.

    >>> y = selective_scan(torch.ones(1, 2, 1), torch.ones(1, 2, 1), -torch.ones(1, 1),
    ...                    torch.ones(1, 2, 1), torch.ones(1, 2, 1))
    >>> round(y[0, 1, 0].item(), 4)  # e^{-1} * 1 + 1
    1.3679
    """
    x = as_tensor(x, "x")
    check_dim(x, "x", "(B, T, D)", min_dim=3, max_dim=3)
    Bsz, T, Dch = x.shape
    delta, A, B, C = (as_tensor(t, n) for t, n in ((delta, "delta"), (A, "A"), (B, "B"), (C, "C")))
    check_shape(delta, x.shape, "delta", "x (B, T, D)")
    check_dim(A, "A", f"(D, N) with D = {Dch}", min_dim=2, max_dim=2)
    check_shape(A, (Dch, A.shape[1]), "A", f"the channels D = {Dch} of x")
    N = A.shape[1]
    check_shape(B, (Bsz, T, N), "B", "(B, T, N): the batch and length of x, the state size of A")
    check_shape(C, (Bsz, T, N), "C", "(B, T, N): the batch and length of x, the state size of A")
    extra = {}
    if D is not None:
        extra["D"] = check_shape(as_tensor(D, "D"), (Dch,), "D", f"the channels D = {Dch} of x")
    if z is not None:
        extra["z"] = check_shape(as_tensor(z, "z"), x.shape, "z", "x (B, T, D)")
    check_finite(delta, "delta")
    check_finite(A, "A")
    if (delta < 0).any():
        raise ValueError("delta must be >= 0 (a step size; Mamba takes softplus of a projection)")
    if (A > 0).any():
        raise ValueError("A must be <= 0 (a stable, decaying state; Mamba uses A = -exp(A_log))")
    out_dtype = x.dtype
    for t in (delta, A, B, C, *extra.values()):
        out_dtype = torch.promote_types(out_dtype, t.dtype)
    x, delta, A, B, C = (upcast_half(t.to(out_dtype)) for t in (x, delta, A, B, C))
    extra = {k: upcast_half(v.to(out_dtype)) for k, v in extra.items()}
    dA = torch.exp(delta[..., None] * A)  # (B, T, D, N): the decay of each state over this step
    dBx = (delta * x)[..., None] * B[:, :, None, :]  # (B, T, D, N): Delta_t B_t x_t, finite for finite input
    h = torch.zeros(Bsz, Dch, N, dtype=x.dtype)
    ys = []
    for t in range(T):
        h = dA[:, t] * h + dBx[:, t]
        ys.append((h * C[:, t, None, :]).sum(-1))  # y_t = C_t h_t, per channel
    y = torch.stack(ys, 1) if ys else torch.zeros_like(x)
    if "D" in extra:
        y = y + x * extra["D"]
    if "z" in extra:
        y = y * F.silu(extra["z"])
    y = restore_half(y, out_dtype)
    return (y, restore_half(h, out_dtype)) if return_state else y
