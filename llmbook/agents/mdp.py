r"""Markov decision processes: the definition, returns, value functions and the Bellman operators.

* **MDP** (32.01, :func:`make_mdp`): :math:`\mathcal M=(\mathcal S,\mathcal A,P,R,\gamma)` checked and
  packed into a :class:`~llmbook.agents.envs.TabularMDP`.
* **Transition probability** (32.02, :func:`empirical_transition`): :math:`P(s'|s,a)` as the limit of
  the frequency of :math:`s'` after :math:`(s,a)`; the estimate from observed transitions.
* **Return** (32.03, :func:`discounted_return`): :math:`G_t=\sum_k\gamma^k r_{t+k+1}`, by the backward
  recursion :math:`G_t=r_{t+1}+\gamma G_{t+1}`.
* **State and action values** (32.04 :func:`state_value`, 32.05 :func:`action_value`): the expected
  return, computed as the series :math:`V^\pi=\sum_k\gamma^k P_\pi^k r_\pi` (the expected reward
  :math:`k` steps ahead, summed) and :math:`Q^\pi=r+\gamma P V^\pi`.
* **Bellman operators** (32.06 :func:`bellman_expectation`, 32.07 :func:`bellman_optimality_v`,
  32.08 :func:`bellman_optimality_q`): one application of :math:`T^\pi`, :math:`T^*` on V and on Q.

Conventions: ``P`` ``(S, A, S')`` row-stochastic; ``R`` either ``(S, A, S')`` (reward of the transition)
or ``(S, A)`` (expected reward of the action); ``pi`` ``(S, A)`` action probabilities; ``V`` ``(..., S)``
and ``Q`` ``(..., S, A)`` may carry leading batch axes. Arithmetic runs in float64; results come back in
the floating dtype of the value argument (or of ``P``). Terminal states are absorbing with zero reward
(:mod:`llmbook.agents.envs`), so no special case is needed.

>>> P = torch.tensor([[[0.9, 0.1], [0.0, 1.0]], [[0.0, 1.0], [0.0, 1.0]]])
>>> R = torch.tensor([[1.0, 0.0], [0.0, 0.0]])
>>> [round(v, 4) for v in state_value(P, R, torch.tensor([[1.0, 0.0], [1.0, 0.0]]), 0.5).tolist()]
[1.8182, 0.0]
"""

from __future__ import annotations

import torch

from llmbook._checks import (
    as_tensor,
    check_dim,
    check_finite,
    check_int,
    check_integer_tensor,
    check_positive_int,
    check_range,
)
from llmbook.agents.envs import TabularMDP
from llmbook.registry import implements

__all__ = ["make_mdp", "empirical_transition", "discounted_return", "state_value", "action_value",
           "bellman_expectation", "bellman_optimality_v", "bellman_optimality_q", "expected_reward",
           "policy_matrices", "greedy_policy"]

_EPS = {torch.float16: 2.0**-10, torch.bfloat16: 2.0**-7, torch.float32: 2.0**-23, torch.float64: 2.0**-52}


def _stochastic(x: torch.Tensor, name: str) -> None:
    """Non-negative entries whose last axis sums to 1 (within the rounding of the input dtype)."""
    if x.numel() and x.min().item() < 0:
        raise ValueError(f"{name} must hold probabilities >= 0, got minimum {x.min().item():.4g}")
    tol = max(1e-6, 2 * x.shape[-1] * _EPS.get(x.dtype, 1e-6))
    if x.numel() and (x.double().sum(-1) - 1).abs().max().item() > tol:
        err = (x.double().sum(-1) - 1).abs().max().item()
        raise ValueError(f"{name} must sum to 1 over its last axis, off by {err:.3g}")


def _transitions(P, name: str = "P") -> torch.Tensor:
    """A checked ``(S, A, S')`` transition tensor whose rows are distributions (MDPs and POMDPs share it)."""
    P = as_tensor(P, name)
    check_dim(P, name, "(S, A, S')", min_dim=3, max_dim=3)
    S, A, S2 = P.shape
    if S2 != S or S == 0 or A == 0:
        raise ValueError(f"{name} must be (S, A, S) with S, A >= 1, got {tuple(P.shape)}")
    check_finite(P, name)
    _stochastic(P, name)
    return P


def _model(P, R) -> tuple[torch.Tensor, torch.Tensor, torch.dtype]:
    """``P`` (S, A, S') float64 and the expected reward ``r`` (S, A) float64, and P's dtype."""
    P = _transitions(P, "P")
    S, A, _ = P.shape
    R = as_tensor(R, "R")
    if tuple(R.shape) not in ((S, A, S), (S, A)):
        raise ValueError(f"R must be (S, A, S') = {(S, A, S)} or (S, A) = {(S, A)}, got {tuple(R.shape)}")
    check_finite(R, "R")
    Pd, Rd = P.double(), R.double()
    r = (Pd * Rd).sum(-1) if R.dim() == 3 else Rd
    return Pd, r, P.dtype


def _policy(pi, S: int, A: int) -> torch.Tensor:
    pi = as_tensor(pi, "pi")
    if tuple(pi.shape) != (S, A):
        raise ValueError(f"pi must be (S, A) = {(S, A)} action probabilities, got {tuple(pi.shape)}")
    check_finite(pi, "pi")
    _stochastic(pi, "pi")
    return pi.double()


def _gamma(gamma) -> float:
    return check_range(gamma, "gamma", 0.0, 1.0)


def _values(V, S: int, name: str, trailing: tuple = ()) -> tuple[torch.Tensor, torch.dtype]:
    V = as_tensor(V, name)
    n = 1 + len(trailing)
    if V.dim() < n or tuple(V.shape[V.dim() - n:]) != (S, *trailing):
        raise ValueError(f"{name} must be (..., {', '.join(map(str, (S, *trailing)))}), got {tuple(V.shape)}")
    check_finite(V, name)
    return V.double(), V.dtype


def expected_reward(P, R) -> torch.Tensor:
    r"""The expected one-step reward :math:`r(s,a)=\sum_{s'}P(s'|s,a)R(s,a,s')`, float64 ``(S, A)``."""
    return _model(P, R)[1]


def policy_matrices(P, R, pi) -> tuple[torch.Tensor, torch.Tensor]:
    r"""The Markov chain of a policy: :math:`P_\pi(s'|s)=\sum_a\pi(a|s)P(s'|s,a)`,
    :math:`r_\pi(s)=\sum_a\pi(a|s)r(s,a)`.

    Returns float64 ``(S, S)`` and ``(S,)``: the matrix and vector of ``numpy.linalg.solve(I - gamma P_pi, r_pi)``.
    """
    P, r, _ = _model(P, R)
    pi = _policy(pi, *r.shape)
    return torch.einsum("sa,sat->st", pi, P), (pi * r).sum(-1)


def greedy_policy(Q) -> torch.Tensor:
    """The deterministic greedy policy :math:`\\arg\\max_a Q(s,a)` (first maximiser on ties), ``(..., S)`` long."""
    Q = as_tensor(Q, "Q")
    check_dim(Q, "Q", "(..., S, A)", min_dim=2)
    return Q.argmax(-1)


@implements("32.01")
def make_mdp(P, R, gamma: float, terminal=None, mu0=None, *, name: str = "mdp", action_names: tuple = ()) -> TabularMDP:
    r"""The MDP :math:`\mathcal M=(\mathcal S,\mathcal A,P,R,\gamma)`, checked and stored as float64.

    ``P`` ``(S, A, S')`` row-stochastic, ``R`` ``(S, A, S')`` or ``(S, A)`` (stored as ``(S, A, S')``, the same
    reward for every next state), ``gamma`` in [0, 1], ``terminal`` ``(S,)`` bool (default none; a terminal
    state must be absorbing with zero reward), ``mu0`` ``(S,)`` start distribution (default uniform).

    >>> m = make_mdp(torch.ones(2, 1, 2) / 2, torch.zeros(2, 1), 0.9)
    >>> m.S, m.A, m.gamma
    (2, 1, 0.9)
    """
    Pd, _, _ = _model(P, R)
    S, A, _ = Pd.shape
    Rt = as_tensor(R, "R").double()
    Rd = Rt[..., None].expand(S, A, S).clone() if Rt.dim() == 2 else Rt.clone()
    gamma = _gamma(gamma)
    if terminal is None:
        term = torch.zeros(S, dtype=torch.bool)
    else:
        term = torch.as_tensor(terminal)
        if term.dtype != torch.bool or tuple(term.shape) != (S,):
            raise TypeError(f"terminal must be an (S,) = ({S},) bool tensor, got {term.dtype} {tuple(term.shape)}")
        idx = term.nonzero().flatten()
        if len(idx) and ((Pd[idx, :, idx] != 1).any() or (Rd[idx] != 0).any()):
            raise ValueError("terminal states must be absorbing (P[t, a, t] = 1) with zero reward")
    if mu0 is None:
        mu = torch.full((S,), 1.0 / S, dtype=torch.float64)
    else:
        mu = as_tensor(mu0, "mu0")
        if tuple(mu.shape) != (S,):
            raise ValueError(f"mu0 must be (S,) = ({S},), got {tuple(mu.shape)}")
        check_finite(mu, "mu0")
        _stochastic(mu, "mu0")
        mu = mu.double()
    return TabularMDP(P=Pd.clone(), R=Rd, gamma=gamma, terminal=term, mu0=mu, name=str(name),
                      action_names=tuple(action_names))


@implements("32.02")
def empirical_transition(s, a, s_next, S: int, A: int) -> tuple[torch.Tensor, torch.Tensor]:
    r"""Estimate :math:`P(s'|s,a)=\Pr(S_{t+1}=s'|S_t=s,A_t=a)` by counting observed transitions.

    :math:`\hat P(s'|s,a)=N(s,a,s')/N(s,a)`; rows of pairs never visited are 0 (no data), so check ``N``.
    ``s``, ``a``, ``s_next``: ``(n,)`` integer tensors. Returns ``(P_hat, N)``: float64 ``(S, A, S)`` and the
    visit counts ``(S, A)`` (long). By the law of large numbers ``P_hat`` tends to ``P`` with standard error
    :math:`\sqrt{P(1-P)/N(s,a)}`.

    >>> P_hat, N = empirical_transition(torch.tensor([0, 0, 0]), torch.tensor([1, 1, 1]), torch.tensor([1, 1, 0]), 2, 2)
    >>> [round(x, 4) for x in P_hat[0, 1].tolist()], N[0, 1].item()
    ([0.3333, 0.6667], 3)
    """
    S, A = check_positive_int(S, "S"), check_positive_int(A, "A")
    s, a, s2 = (check_integer_tensor(x, n) for x, n in ((s, "s"), (a, "a"), (s_next, "s_next")))
    for x, n, hi in ((s, "s", S), (a, "a", A), (s2, "s_next", S)):
        check_dim(x, n, "(n,)", min_dim=1, max_dim=1)
        if x.numel() and (x.min().item() < 0 or x.max().item() >= hi):
            raise ValueError(f"{n} must hold indices in [0, {hi}), got range [{x.min().item()}, {x.max().item()}]")
    if not (s.shape == a.shape == s2.shape):
        raise ValueError(f"s, a and s_next must all be (n,), got {tuple(s.shape)}, {tuple(a.shape)}, {tuple(s2.shape)}")
    counts = torch.zeros(S * A * S, dtype=torch.float64)
    counts.index_add_(0, (s.long() * A + a.long()) * S + s2.long(), torch.ones(s.shape, dtype=torch.float64))
    counts = counts.view(S, A, S)
    N = counts.sum(-1)
    return counts / N.clamp_min(1)[..., None], N.long()


@implements("32.03")
def discounted_return(r, gamma: float) -> torch.Tensor:
    r"""All discounted returns of a reward sequence, :math:`G_t=\sum_{k\ge0}\gamma^k r_{t+k+1}`.

    ``r`` ``(..., T)``: ``r[..., t]`` is :math:`r_{t+1}`, the reward after the action at step ``t``; the
    episode ends after ``T`` rewards. Returns ``G`` ``(..., T)`` by the backward recursion
    :math:`G_t=r_{t+1}+\gamma G_{t+1}`, :math:`G_T=0` (float64 inside, the dtype of ``r`` out).

    >>> discounted_return(torch.tensor([1.0, 0.0, 2.0]), 0.5).tolist()
    [1.5, 1.0, 2.0]
    """
    r = as_tensor(r, "r")
    check_dim(r, "r", "(..., T)")
    check_finite(r, "r")
    gamma = _gamma(gamma)
    rd = r.double()
    G = torch.empty_like(rd)
    acc = torch.zeros(rd.shape[:-1], dtype=torch.float64)
    for t in range(rd.shape[-1] - 1, -1, -1):
        acc = rd[..., t] + gamma * acc
        G[..., t] = acc
    return G.to(r.dtype)


def _series(P_pi: torch.Tensor, r_pi: torch.Tensor, gamma: float, horizon, tol: float, max_iter: int) -> torch.Tensor:
    """:math:`\\sum_{k<H}\\gamma^k P_\\pi^k r_\\pi`: the expected reward k steps ahead, summed."""
    V = torch.zeros_like(r_pi)
    term = r_pi.clone()  # E[r_{t+k+1} | S_t = s] for k = 0
    steps = max_iter if horizon is None else horizon
    for k in range(steps):
        V = V + term
        term = gamma * (P_pi @ term)
        if horizon is None and term.abs().max().item() <= tol * max(1.0, V.abs().max().item()):
            return V + term
        if horizon is None and k == max_iter - 1:
            raise ValueError(f"the value series did not converge in max_iter = {max_iter} steps (gamma = {gamma}); "
                             "with gamma = 1 every state must reach an absorbing zero-reward state")
    return V


@implements("32.04")
def state_value(P, R, pi, gamma: float, *, horizon: int | None = None, tol: float = 1e-13,
                max_iter: int = 100_000) -> torch.Tensor:
    r"""The state value :math:`V^\pi(s)=\mathbb E_\pi[G_t|S_t=s]` as the series of expected rewards.

    :math:`\mathbb E_\pi[r_{t+k+1}|S_t=s]=(P_\pi^k r_\pi)(s)`, so :math:`V^\pi=\sum_{k\ge0}\gamma^kP_\pi^k r_\pi`,
    summed until a term falls below ``tol`` (relative), or over exactly ``horizon`` steps (the finite-horizon
    value :math:`\mathbb E[\sum_{k<H}\gamma^k r_{t+k+1}]`). Shapes: ``P`` ``(S, A, S')``, ``R`` ``(S, A, S')`` or
    ``(S, A)``, ``pi`` ``(S, A)``. Returns ``(S,)`` in the dtype of ``P``.

    >>> P = torch.ones(1, 1, 1); [round(v, 6) for v in state_value(P, torch.ones(1, 1), torch.ones(1, 1), 0.9).tolist()]
    [10.0]
    """
    P, r, dtype = _model(P, R)
    pi = _policy(pi, *r.shape)
    gamma = _gamma(gamma)
    if horizon is not None:
        horizon = check_int(horizon, "horizon", low=0)
    max_iter = check_positive_int(max_iter, "max_iter")
    tol = check_range(tol, "tol", 0.0, low_open=True)
    P_pi, r_pi = torch.einsum("sa,sat->st", pi, P), (pi * r).sum(-1)
    return _series(P_pi, r_pi, gamma, horizon, tol, max_iter).to(dtype)


@implements("32.05")
def action_value(P, R, pi, gamma: float, *, tol: float = 1e-13, max_iter: int = 100_000) -> torch.Tensor:
    r"""The action value :math:`Q^\pi(s,a)=\mathbb E_\pi[G_t|S_t=s,A_t=a]=r(s,a)+\gamma\sum_{s'}P(s'|s,a)V^\pi(s')`.

    The first action is fixed, then ``pi`` is followed: one step of the model on top of :func:`state_value`.
    Returns ``(S, A)`` in the dtype of ``P``; :math:`V^\pi(s)=\sum_a\pi(a|s)Q^\pi(s,a)`.

    >>> P = torch.ones(1, 2, 1); action_value(P, torch.tensor([[1.0, 0.0]]), torch.tensor([[1.0, 0.0]]), 0.5).tolist()
    [[2.0, 1.0]]
    """
    P_, r, dtype = _model(P, R)
    V = state_value(P_, r, pi, gamma, tol=tol, max_iter=max_iter)
    return (r + _gamma(gamma) * P_ @ V).to(dtype)


@implements("32.06")
def bellman_expectation(V, P, R, pi, gamma: float) -> torch.Tensor:
    r"""One application of the Bellman expectation operator,
    :math:`(T^\pi V)(s)=\sum_a\pi(a|s)\sum_{s'}P(s'|s,a)[R(s,a,s')+\gamma V(s')]`.

    ``V`` ``(..., S)``; returns ``(..., S)`` in the dtype of ``V``. :math:`V^\pi` is its unique fixed point for
    :math:`\gamma<1` (the solution of :math:`(I-\gamma P_\pi)V=r_\pi`), and :math:`T^\pi` is a
    :math:`\gamma`-contraction in the max norm.

    >>> bellman_expectation(torch.zeros(1), torch.ones(1, 1, 1), torch.ones(1, 1), torch.ones(1, 1), 0.9).tolist()
    [1.0]
    """
    P, r, _ = _model(P, R)
    S, A = r.shape
    pi = _policy(pi, S, A)
    Vd, dtype = _values(V, S, "V")
    Q = r + _gamma(gamma) * torch.einsum("sat,...t->...sa", P, Vd)
    return (pi * Q).sum(-1).to(dtype)


@implements("32.07")
def bellman_optimality_v(V, P, R, gamma: float) -> torch.Tensor:
    r"""One application of the Bellman optimality operator on V,
    :math:`(T^*V)(s)=\max_a\sum_{s'}P(s'|s,a)[R(s,a,s')+\gamma V(s')]`.

    ``V`` ``(..., S)``; returns ``(..., S)`` in the dtype of ``V``. :math:`V^*` is its fixed point (value
    iteration, :func:`llmbook.agents.dynamic_programming.value_iteration`, repeats it).

    >>> bellman_optimality_v(torch.zeros(1), torch.ones(1, 2, 1), torch.tensor([[1.0, 3.0]]), 0.9).tolist()
    [3.0]
    """
    P, r, _ = _model(P, R)
    Vd, dtype = _values(V, r.shape[0], "V")
    Q = r + _gamma(gamma) * torch.einsum("sat,...t->...sa", P, Vd)
    return Q.max(-1).values.to(dtype)


@implements("32.08")
def bellman_optimality_q(Q, P, R, gamma: float) -> torch.Tensor:
    r"""One application of the Bellman optimality operator on Q,
    :math:`(T^*Q)(s,a)=\sum_{s'}P(s'|s,a)[R(s,a,s')+\gamma\max_{a'}Q(s',a')]`.

    ``Q`` ``(..., S, A)``; returns ``(..., S, A)`` in the dtype of ``Q``. :math:`Q^*` is its fixed point and
    :math:`V^*(s)=\max_aQ^*(s,a)`; Q-learning (chapter 33) is its sampled version.

    >>> bellman_optimality_q(torch.zeros(1, 2), torch.ones(1, 2, 1), torch.tensor([[1.0, 3.0]]), 0.5).tolist()
    [[1.0, 3.0]]
    """
    P, r, _ = _model(P, R)
    Qd, dtype = _values(Q, r.shape[0], "Q", (r.shape[1],))
    return (r + _gamma(gamma) * torch.einsum("sat,...t->...sa", P, Qd.max(-1).values)).to(dtype)
