r"""Risk and safety: constrained MDPs, the Lagrangian, CVaR, handoff thresholds and a safety classifier.

* **Constrained MDP** (43.01, :func:`cmdp_values`, Altman 1999): maximise the discounted reward
  :math:`J_R(\pi)` subject to a budget on the discounted cost, :math:`J_C(\pi)\le d`, with
  :math:`J_X(\pi)=\sum_s\mu_0(s)V^\pi_X(s)` for a per-step ``X`` of ``R`` or ``C``.
* **Lagrangian** (43.02, :func:`lagrangian_dual_ascent`): :math:`\mathcal L(\pi,\lambda)=J_R(\pi)-\lambda
  (J_C(\pi)-d)`. The dual function :math:`g(\lambda)=\max_\pi\mathcal L` is an ordinary MDP on the reward
  :math:`r-\lambda c` (solved by value iteration, :func:`llmbook.agents.dynamic_programming.value_iteration`);
  it is convex in :math:`\lambda`, with subgradient :math:`d-J_C(\pi_\lambda)`. Projected subgradient descent
  on :math:`\lambda\ge0` reaches :math:`\min_\lambda g=` the CMDP's optimum (strong duality holds for CMDPs).
* **CVaR** (43.03, :func:`cvar`, Rockafellar and Uryasev 2000): the mean of the worst :math:`\alpha` fraction
  of outcomes, *lower* tail (``X`` is a reward or a return): :math:`\mathrm{CVaR}_\alpha(X)=\max_\nu\{\nu-
  \mathbb E[(\nu-X)_+]/\alpha\}=\frac1\alpha\int_0^\alpha F_X^{-1}(u)\,du`.
* **Handoff** (43.04, :func:`handoff`): pass to a human when :math:`P(error\mid x)>\tau_e` or
  :math:`Risk(x)>\tau_r`; :func:`coverage_risk_curve` gives coverage and selective risk over :math:`\tau_e`,
  and :func:`llmbook.agents.selective.risk_controlled_threshold` chooses :math:`\tau_e` with a guarantee.
* **Safety classifier** (43.05, :func:`safety_probability`): :math:`P(unsafe\mid x)=\sigma(w^\top h_x+b)`;
  :func:`fit_safety_classifier` fits ``w, b`` by Newton's method on the L2-penalised log-loss.

>>> x = torch.tensor([-3.0, -1.0, 0.0, 2.0])
>>> round(cvar(x, 0.5).item(), 4)
-2.0
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from llmbook._checks import (
    as_tensor,
    check_choice,
    check_dim,
    check_finite,
    check_nonempty,
    check_positive_int,
    check_range,
    check_real,
    check_same_shape,
)
from llmbook._precision import compute_dtype
from llmbook.agents import dynamic_programming as dp
from llmbook.agents.mdp import _model, _policy
from llmbook.registry import implements

__all__ = ["cmdp_values", "CMDPValues", "lagrangian_dual_ascent", "DualAscentResult", "cvar", "value_at_risk",
           "handoff", "coverage_risk_curve", "safety_probability", "fit_safety_classifier"]


class CMDPValues(NamedTuple):
    """``J_R`` and ``J_C`` (float64 scalars), the ``slack`` :math:`d-J_C` and ``feasible`` (slack >= -1e-9)."""

    J_R: torch.Tensor
    J_C: torch.Tensor
    slack: torch.Tensor
    feasible: bool


def _mu0(mu0, S: int) -> torch.Tensor:
    mu0 = as_tensor(mu0, "mu0")
    if tuple(mu0.shape) != (S,):
        raise ValueError(f"mu0 must be (S,) = ({S},), got {tuple(mu0.shape)}")
    check_finite(mu0, "mu0")
    if mu0.min().item() < 0 or abs(mu0.double().sum().item() - 1) > 1e-6:
        raise ValueError(f"mu0 must be a distribution over the {S} states (>= 0, sum 1)")
    return mu0.double()


def _returns(P: torch.Tensor, r: torch.Tensor, c: torch.Tensor, pi: torch.Tensor, gamma: float, mu0: torch.Tensor):
    """(J_R, J_C) of ``pi`` (S, A) exactly: mu0 . solve(I - gamma P_pi, [r_pi, c_pi])."""
    S = P.shape[0]
    P_pi = torch.einsum("sa,sat->st", pi, P)
    rhs = torch.stack([(pi * r).sum(-1), (pi * c).sum(-1)], -1)
    V = torch.linalg.solve(torch.eye(S, dtype=torch.float64) - gamma * P_pi, rhs)
    return mu0 @ V[:, 0], mu0 @ V[:, 1]


@implements("43.01")
def cmdp_values(P, R, C, pi, gamma: float, mu0, d: float) -> CMDPValues:
    r"""The constrained MDP :math:`\max_\pi J_R(\pi)` s.t. :math:`J_C(\pi)\le d`: the two returns of a policy.

    :math:`J_X(\pi)=\mu_0^\top(I-\gamma P_\pi)^{-1}x_\pi` for ``X`` the reward ``R`` and the cost ``C``
    (discounted sums from the start distribution). Symbols: ``P`` :math:`P` ``(S, A, S')``, ``R`` :math:`R`
    and ``C`` :math:`C` ``(S, A, S')`` or ``(S, A)``, ``pi`` :math:`\pi` ``(S, A)`` probabilities (a stochastic
    policy is allowed: the CMDP's optimum may need one), ``gamma`` in [0, 1) , ``mu0`` ``(S,)``, ``d`` the
    budget. Returns :class:`CMDPValues`; ``feasible`` says whether the constraint holds (to 1e-9).

    >>> P = torch.ones(1, 2, 1); R = torch.tensor([[1.0, 2.0]]); C = torch.tensor([[0.0, 1.0]])
    >>> v = cmdp_values(P, R, C, torch.tensor([[0.5, 0.5]]), 0.5, torch.ones(1), 0.5)
    >>> round(v.J_R.item(), 4), round(v.J_C.item(), 4), v.feasible
    (3.0, 1.0, False)
    """
    P, r, _ = _model(P, R)
    c = _model(P, C)[1]
    S, A = r.shape
    gamma = check_range(gamma, "gamma", 0.0, 1.0, high_open=True)
    pi = _policy(pi, S, A)
    mu0 = _mu0(mu0, S)
    d = check_real(d, "d")
    J_R, J_C = _returns(P, r, c, pi, gamma, mu0)
    slack = d - J_C
    return CMDPValues(J_R, J_C, slack, bool(slack.item() >= -1e-9))


class DualAscentResult(NamedTuple):
    r"""Trajectories of projected subgradient descent on the dual, ``(n_iter,)`` float64 each.

    ``lam`` :math:`\lambda_k`; ``dual`` :math:`g(\lambda_k)=\max_\pi\mathcal L(\pi,\lambda_k)` (an upper bound on
    the CMDP optimum); ``J_R``, ``J_C`` of the greedy policy :math:`\pi_k` for :math:`r-\lambda_kc` (a pure
    policy: these oscillate); ``J_R_avg``, ``J_C_avg`` their running means (the returns of the *mixture* that
    picks one :math:`\pi_k` at random per episode); ``policies`` ``(n_iter, S)`` the greedy actions.
    """

    lam: torch.Tensor
    dual: torch.Tensor
    J_R: torch.Tensor
    J_C: torch.Tensor
    J_R_avg: torch.Tensor
    J_C_avg: torch.Tensor
    policies: torch.Tensor


@implements("43.02")
def lagrangian_dual_ascent(P, R, C, gamma: float, mu0, d: float, *, lr: float = 0.1, n_iter: int = 200,
                           lam0: float = 0.0, schedule: str = "sqrt") -> DualAscentResult:
    r"""Solve the CMDP through its Lagrangian :math:`\mathcal L(\pi,\lambda)=J_R(\pi)-\lambda(J_C(\pi)-d)`.

    Each iteration: the inner problem :math:`\max_\pi\mathcal L(\pi,\lambda_k)` is an MDP on the reward
    :math:`r-\lambda_kc`, solved by :func:`llmbook.agents.dynamic_programming.value_iteration`, giving
    :math:`g(\lambda_k)=\mu_0^\top V^*_{r-\lambda_kc}+\lambda_kd` and a greedy :math:`\pi_k`; the outer step is
    projected subgradient descent on the convex :math:`g`:
    :math:`\lambda_{k+1}=\max(0,\lambda_k+\eta_k(J_C(\pi_k)-d))`, with :math:`\eta_k=` ``lr`` (``schedule=
    "constant"``) or ``lr`` :math:`/\sqrt{k+1}` (``"sqrt"``). Arguments as in :func:`cmdp_values`.
    Returns :class:`DualAscentResult`.

    >>> P = torch.ones(1, 2, 1); R = torch.tensor([[1.0, 2.0]]); C = torch.tensor([[0.0, 1.0]])
    >>> res = lagrangian_dual_ascent(P, R, C, 0.5, torch.ones(1), 1.0, lr=0.5, n_iter=400)
    >>> round(res.J_R_avg[-1].item(), 1), round(res.dual.min().item(), 2)
    (3.0, 3.0)
    """
    P, r, _ = _model(P, R)
    c = _model(P, C)[1]
    S, A = r.shape
    gamma = check_range(gamma, "gamma", 0.0, 1.0, high_open=True)
    mu0 = _mu0(mu0, S)
    d = check_real(d, "d")
    lr = check_range(lr, "lr", 0.0, low_open=True)
    n_iter = check_positive_int(n_iter, "n_iter")
    lam = check_range(lam0, "lam0", 0.0)
    check_choice(schedule, "schedule", ("sqrt", "constant"))
    eye = torch.eye(A, dtype=torch.float64)
    out = {k: [] for k in ("lam", "dual", "J_R", "J_C", "pol")}
    V = None
    for k in range(n_iter):
        vi = dp.value_iteration(P, r - lam * c, gamma, V0=V, tol=1e-12)
        V = vi.V.double()
        J_R, J_C = _returns(P, r, c, eye[vi.policy], gamma, mu0)
        for key, val in zip(out, (lam, (mu0 @ V).item() + lam * d, J_R.item(), J_C.item(), vi.policy), strict=True):
            out[key].append(val)
        eta = lr if schedule == "constant" else lr / (k + 1) ** 0.5
        lam = max(0.0, lam + eta * (J_C.item() - d))
    t = {k: torch.tensor(v, dtype=torch.float64) for k, v in out.items() if k != "pol"}
    n = torch.arange(1, n_iter + 1, dtype=torch.float64)
    return DualAscentResult(t["lam"], t["dual"], t["J_R"], t["J_C"], t["J_R"].cumsum(0) / n,
                            t["J_C"].cumsum(0) / n, torch.stack(out["pol"]))


def _samples(X, alpha) -> tuple[torch.Tensor, float, torch.dtype]:
    X = as_tensor(X, "X")
    check_dim(X, "X", "(..., N)", min_dim=1)
    check_nonempty(X, "X")
    check_finite(X, "X")
    alpha = check_range(alpha, "alpha", 0.0, 1.0, low_open=True)
    return X.to(torch.float64), alpha, X.dtype


def value_at_risk(X, alpha: float) -> torch.Tensor:
    r"""The lower-tail :math:`\mathrm{VaR}_\alpha(X)=\inf\{x: F(x)\ge\alpha\}` of the samples ``X`` ``(..., N)``:
    the :math:`\lceil\alpha N\rceil`-th smallest. Returns ``(...)`` in the dtype of ``X``.

    >>> value_at_risk(torch.tensor([3.0, 1.0, 2.0, 0.0]), 0.5).item()
    1.0
    """
    X, alpha, dtype = _samples(X, alpha)
    N = X.shape[-1]
    k = min(N, max(1, int(torch.tensor(alpha * N, dtype=torch.float64).sub(1e-12).ceil().item())))
    return X.sort(-1).values[..., k - 1].to(compute_dtype(dtype)).to(dtype)


@implements("43.03")
def cvar(X, alpha: float) -> torch.Tensor:
    r"""Conditional value at risk of the lower tail in Rockafellar and Uryasev's form,
    :math:`\mathrm{CVaR}_\alpha(X)=\max_\nu\{\nu-\mathbb E[(\nu-X)_+]/\alpha\}=\tfrac1\alpha\int_0^\alpha
    F_X^{-1}(u)\,du`, of the empirical distribution of ``X`` ``(..., N)`` (each sample weight 1/N).

    ``X`` is a reward (the bad tail is the lower one); for a loss ``L`` use ``-cvar(-L, alpha)``. ``alpha`` in
    (0, 1] is the tail fraction; ``alpha = 1`` gives the mean. The objective is concave and piecewise linear in
    :math:`\nu` with its kinks at the samples, so the maximum is attained at a sample (at
    :math:`\nu=\mathrm{VaR}_\alpha`): with the sorted samples :math:`x_{(1)}\le\dots\le x_{(N)}` it is
    :math:`\max_j\{x_{(j)}-\tfrac{1}{\alpha N}\sum_{i\le j}(x_{(j)}-x_{(i)})\}`, one sort and one cumulative
    sum. The result is the mean of the worst fraction :math:`\alpha` of the mass, the boundary sample counted
    fractionally. It differs from :math:`\mathbb E[X\mid X\le\mathrm{VaR}_\alpha]` when an atom straddles the
    :math:`\alpha`-quantile: for ``(4, 0, 2, 1)`` and ``alpha = 0.375`` that conditional mean is 0.5 (all of the
    sample 1), the CVaR 1/3 (half of it). Returns ``(...)`` in the dtype of ``X`` (computed in float64).

    >>> cvar(torch.tensor([4.0, 0.0, 2.0, 1.0]), 0.25).item(), cvar(torch.tensor([4.0, 0.0, 2.0, 1.0]), 0.375).item()
    (0.0, 0.3333333432674408)
    """
    X, alpha, dtype = _samples(X, alpha)
    N = X.shape[-1]
    x = X.sort(-1).values
    j = torch.arange(1, N + 1, dtype=torch.float64)
    shortfall = (j * x - x.cumsum(-1)) / N  # E[(nu - X)_+] at nu = x_(j)
    return (x - shortfall / alpha).amax(-1).to(compute_dtype(dtype)).to(dtype)


@implements("43.04")
def handoff(p_error, risk, tau_e: float, tau_r: float) -> torch.Tensor:
    r"""Human handoff :math:`\mathbf 1[P(error\mid x)>\tau_e\lor Risk(x)>\tau_r]`, a bool tensor.

    ``p_error`` :math:`P(error\mid x)` in [0, 1] and ``risk`` :math:`Risk(x)` (any real score, e.g. a safety
    classifier's probability), same shape ``(...)``; ``tau_e`` and ``tau_r`` the thresholds (``tau_e >= 1``
    never hands off on uncertainty; ``tau_r = inf`` ignores risk). Strict inequalities.

    >>> handoff(torch.tensor([0.1, 0.6, 0.1]), torch.tensor([0.0, 0.0, 0.9]), 0.5, 0.8).tolist()
    [False, True, True]
    """
    p_error, risk = as_tensor(p_error, "p_error"), as_tensor(risk, "risk")
    check_same_shape(p_error, risk, "p_error", "risk")
    check_finite(p_error, "p_error")
    check_finite(risk, "risk")
    if p_error.numel() and (p_error.min().item() < 0 or p_error.max().item() > 1):
        raise ValueError(f"p_error must hold probabilities in [0, 1], got range [{p_error.min().item():.4g}, "
                         f"{p_error.max().item():.4g}]")
    tau_e = check_real(tau_e, "tau_e")
    tau_r = check_real(tau_r, "tau_r", finite=False)
    return (p_error.double() > tau_e) | (risk.double() > tau_r)


def coverage_risk_curve(p_error, error) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    r"""Coverage and selective risk of :func:`handoff` on uncertainty alone, for every distinct threshold.

    For each threshold :math:`\tau_e` among the sorted distinct values of ``p_error`` ``(N,)``, the agent
    answers the :math:`x` with :math:`P(error\mid x)\le\tau_e`; coverage is their fraction and the selective
    risk their error rate (``error`` ``(N,)`` 0/1: the answer was wrong). Returns ``(tau, coverage, risk)``,
    float64 ``(M,)``, by one sort and a cumulative sum (Geifman and El-Yaniv 2017).

    >>> tau, cov, risk = coverage_risk_curve(torch.tensor([0.1, 0.5, 0.3]), torch.tensor([0.0, 1.0, 0.0]))
    >>> cov.tolist(), [round(x, 4) for x in risk.tolist()]
    ([0.3333333333333333, 0.6666666666666666, 1.0], [0.0, 0.0, 0.3333])
    """
    p_error, error = as_tensor(p_error, "p_error"), as_tensor(error, "error")
    check_dim(p_error, "p_error", "(N,)", min_dim=1, max_dim=1)
    check_same_shape(p_error, error, "p_error", "error")
    check_nonempty(p_error, "p_error")
    order = p_error.double().argsort(stable=True)
    p, e = p_error.double()[order], error.double()[order]
    N = p.shape[0]
    last = torch.cat([p[1:] != p[:-1], torch.tensor([True])])  # the last index of each distinct value
    kept = torch.arange(1, N + 1, dtype=torch.float64)
    return p[last], (kept / N)[last], (e.cumsum(0) / kept)[last]


@implements("43.05")
def safety_probability(h, w, b=0.0) -> torch.Tensor:
    r"""The safety classifier :math:`P(unsafe\mid x)=\sigma(w^\top h_x+b)` (a linear probe on features).

    ``h`` :math:`h_x` ``(..., D)`` features (e.g. a language model's hidden state of the input), ``w``
    :math:`w` ``(D,)``, ``b`` a scalar bias. Returns ``(...)`` probabilities, computed in float32 at least.

    >>> safety_probability(torch.tensor([[1.0, 2.0], [0.0, 0.0]]), torch.tensor([1.0, -0.5])).tolist()
    [0.5, 0.5]
    """
    h, w = as_tensor(h, "h"), as_tensor(w, "w")
    check_dim(h, "h", "(..., D)", min_dim=1)
    check_dim(w, "w", "(D,)", min_dim=1, max_dim=1)
    if w.shape[0] != h.shape[-1]:
        raise ValueError(f"w must be (D,) = ({h.shape[-1]},) to match h (..., D), got {tuple(w.shape)}")
    b = check_real(b, "b")
    ct = compute_dtype(h.dtype)
    return torch.sigmoid(h.to(ct) @ w.to(ct) + b).to(h.dtype)


def fit_safety_classifier(h, y, *, C: float = 1.0, max_iter: int = 50, tol: float = 1e-10):
    r"""Fit :func:`safety_probability`'s ``w, b`` by Newton's method, float64.

    Minimises :math:`\tfrac12\|w\|^2+C\sum_i\ell(y_i,\sigma(w^\top h_i+b))` (log-loss :math:`\ell`, bias not
    penalised): the objective of ``sklearn.linear_model.LogisticRegression(C=C)``. ``h`` ``(N, D)``, ``y``
    ``(N,)`` 0/1 labels (1 = unsafe). Returns ``(w, b)``: ``(D,)`` float64 and a float.
    """
    h, y = as_tensor(h, "h").double(), as_tensor(y, "y").double()
    check_dim(h, "h", "(N, D)", min_dim=2, max_dim=2)
    if tuple(y.shape) != (h.shape[0],):
        raise ValueError(f"y must be (N,) = ({h.shape[0]},), got {tuple(y.shape)}")
    C = check_range(C, "C", 0.0, low_open=True)
    max_iter = check_positive_int(max_iter, "max_iter")
    X = torch.cat([h, torch.ones(h.shape[0], 1, dtype=torch.float64)], 1)
    reg = torch.ones(X.shape[1], dtype=torch.float64)
    reg[-1] = 0.0
    theta = torch.zeros(X.shape[1], dtype=torch.float64)
    for _ in range(max_iter):
        p = torch.sigmoid(X @ theta)
        grad = reg * theta + C * X.T @ (p - y)
        H = torch.diag(reg + 1e-12) + C * (X.T * (p * (1 - p))) @ X
        step = torch.linalg.solve(H, grad)
        theta = theta - step
        if step.abs().max().item() <= tol * max(1.0, theta.abs().max().item()):
            break
    return theta[:-1], theta[-1].item()
