r"""Dynamic programming on a known model: value iteration, policy evaluation, improvement and iteration.

* **Value iteration** (37.01, :func:`value_iteration`, Bellman 1957): repeat the Bellman optimality operator
  :math:`V_{k+1}=T^*V_k`; :math:`\|V_k-V^*\|_\infty\le\gamma^k\|V_0-V^*\|_\infty`.
* **Iterative policy evaluation** (37.02, :func:`policy_evaluation`): repeat the Bellman expectation
  operator :math:`V_{k+1}=T^\pi V_k` until the change falls below ``tol``.
* **Policy improvement** (37.03, :func:`policy_improvement`, Howard 1960): act greedily with respect to
  :math:`Q^\pi`; the new policy is at least as good in every state (the policy improvement theorem).
* :func:`policy_iteration` alternates the two until the policy is stable: a finite number of steps,
  since there are finitely many deterministic policies and each step improves.

Conventions as in :mod:`llmbook.agents.mdp`: ``P`` ``(S, A, S')``, ``R`` ``(S, A, S')`` or ``(S, A)``,
``pi`` ``(S, A)``; float64 arithmetic; values returned in the dtype of ``P``; policies as ``(S,)`` long
actions (first maximiser on ties, with a ``tie_tol`` so rounding does not flip ties).

>>> P = torch.tensor([[[1.0, 0.0], [0.0, 1.0]], [[0.0, 1.0], [0.0, 1.0]]])
>>> R = torch.tensor([[0.0, 1.0], [2.0, 2.0]])
>>> res = value_iteration(P, R, 0.5)
>>> [round(v, 4) for v in res.V.tolist()], res.policy.tolist()
([3.0, 4.0], [1, 0])
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from llmbook._checks import check_positive_int, check_range
from llmbook.agents.mdp import _gamma, _model, _policy, _values
from llmbook.registry import implements

__all__ = ["value_iteration", "policy_evaluation", "policy_improvement", "policy_iteration", "ValueIterationResult",
           "PolicyIterationResult"]


class ValueIterationResult(NamedTuple):
    """``V`` ``(S,)``, ``Q`` ``(S, A)``, the greedy ``policy`` ``(S,)``, ``n_iter`` and ``history``
    ``(n_iter + 1, S)`` of the iterates :math:`V_0,\\dots,V_n` (float64)."""

    V: torch.Tensor
    Q: torch.Tensor
    policy: torch.Tensor
    n_iter: int
    history: torch.Tensor


class PolicyIterationResult(NamedTuple):
    """``V`` ``(S,)`` of the final policy, ``policy`` ``(S,)``, ``n_iter`` improvement steps and the
    ``policies`` ``(n_iter + 1, S)`` visited."""

    V: torch.Tensor
    policy: torch.Tensor
    n_iter: int
    policies: torch.Tensor


def _greedy(Q: torch.Tensor, tie_tol: float) -> torch.Tensor:
    """First action within ``tie_tol`` (relative) of the maximum: deterministic under rounding."""
    best = Q.max(-1, keepdim=True).values
    near = Q >= best - tie_tol * best.abs().clamp_min(1.0)
    return near.long().argmax(-1)


@implements("37.01")
def value_iteration(P, R, gamma: float, V0=None, *, tol: float = 1e-10, max_iter: int = 10_000,
                    tie_tol: float = 1e-9) -> ValueIterationResult:
    r"""Value iteration :math:`V_{k+1}(s)=\max_a\sum_{s'}P(s'|s,a)[R(s,a,s')+\gamma V_k(s')]`.

    Starts from ``V0`` (default 0) and stops when :math:`\|V_{k+1}-V_k\|_\infty\le` ``tol`` (relative to
    :math:`\max(1,\|V_{k+1}\|_\infty)`; with :math:`\varepsilon` that threshold,
    :math:`\|V_{k+1}-V^*\|_\infty\le\gamma\varepsilon/(1-\gamma)`), or after ``max_iter`` sweeps (``ValueError``
    if it has not converged: with :math:`\gamma=1` a state may never reach an absorbing one).
    Returns :class:`ValueIterationResult`.

    >>> value_iteration(torch.ones(1, 2, 1), torch.tensor([[1.0, 2.0]]), 0.5).V.tolist()
    [4.0]
    """
    P, r, dtype = _model(P, R)
    gamma = _gamma(gamma)
    tol = check_range(tol, "tol", 0.0, low_open=True)
    max_iter = check_positive_int(max_iter, "max_iter")
    tie_tol = check_range(tie_tol, "tie_tol", 0.0)
    V = torch.zeros(r.shape[0], dtype=torch.float64) if V0 is None else _values(V0, r.shape[0], "V0")[0]
    if V.dim() != 1:
        raise ValueError(f"V0 must be (S,) = ({r.shape[0]},), got {tuple(V.shape)}")
    history = [V]
    n_iter = 0
    for n_iter in range(1, max_iter + 1):  # noqa: B007 - n_iter is returned
        Q = r + gamma * P @ V
        V_new = Q.max(-1).values
        history.append(V_new)
        done = (V_new - V).abs().max().item() <= tol * max(1.0, V_new.abs().max().item())
        V = V_new
        if done:
            break
    else:
        raise ValueError(f"value iteration did not converge to tol = {tol:g} in max_iter = {max_iter} sweeps "
                         f"(gamma = {gamma})")
    Q = r + gamma * P @ V
    return ValueIterationResult(V.to(dtype), Q.to(dtype), _greedy(Q, tie_tol), n_iter, torch.stack(history))


@implements("37.02")
def policy_evaluation(P, R, pi, gamma: float, V0=None, *, tol: float = 1e-12, max_iter: int = 100_000) -> torch.Tensor:
    r"""Iterative policy evaluation :math:`V_{k+1}(s)=\sum_a\pi(a|s)\sum_{s'}P(s'|s,a)[R+\gamma V_k(s')]`.

    Synchronous sweeps from ``V0`` (default 0) until :math:`\|V_{k+1}-V_k\|_\infty\le` ``tol`` (relative to
    :math:`\max(1,\|V_{k+1}\|_\infty)`); with :math:`\varepsilon` that threshold,
    :math:`\|V_{k+1}-V^\pi\|_\infty\le\gamma\varepsilon/(1-\gamma)`. ``pi`` ``(S, A)`` probabilities or
    ``(S,)`` integer actions. Returns ``V`` ``(S,)`` in the dtype of ``P``.

    >>> policy_evaluation(torch.ones(1, 1, 1), torch.ones(1, 1), torch.ones(1, 1), 0.5).tolist()
    [2.0]
    """
    P, r, dtype = _model(P, R)
    S, A = r.shape
    pi = _as_policy(pi, S, A)
    gamma = _gamma(gamma)
    tol = check_range(tol, "tol", 0.0, low_open=True)
    max_iter = check_positive_int(max_iter, "max_iter")
    P_pi, r_pi = torch.einsum("sa,sat->st", pi, P), (pi * r).sum(-1)
    V = torch.zeros(S, dtype=torch.float64) if V0 is None else _values(V0, S, "V0")[0]
    if V.dim() != 1:
        raise ValueError(f"V0 must be (S,) = ({S},), got {tuple(V.shape)}")
    for _ in range(max_iter):
        V_new = r_pi + gamma * P_pi @ V
        if (V_new - V).abs().max().item() <= tol * max(1.0, V_new.abs().max().item()):
            return V_new.to(dtype)
        V = V_new
    raise ValueError(f"policy evaluation did not converge to tol = {tol:g} in max_iter = {max_iter} sweeps "
                     f"(gamma = {gamma})")


def _as_policy(pi, S: int, A: int) -> torch.Tensor:
    """``(S, A)`` float64 probabilities from probabilities or ``(S,)`` integer actions."""
    t = torch.as_tensor(pi)
    if not t.is_floating_point() and t.dtype != torch.bool:
        if tuple(t.shape) != (S,) or (t.numel() and (t.min().item() < 0 or t.max().item() >= A)):
            raise ValueError(f"a deterministic pi must be (S,) = ({S},) actions in [0, {A}), got {t.tolist()}")
        return torch.nn.functional.one_hot(t.long(), A).double()
    return _policy(pi, S, A)


@implements("37.03")
def policy_improvement(P, R, V, gamma: float, *, tie_tol: float = 1e-9) -> torch.Tensor:
    r"""The greedy policy :math:`\pi_{new}(s)=\arg\max_a\sum_{s'}P(s'|s,a)[R+\gamma V^\pi(s')]`.

    ``V`` ``(S,)`` (usually :math:`V^\pi` of the current policy). Returns ``(S,)`` long actions: the first
    action whose one-step lookahead is within ``tie_tol`` (relative) of the best. By the policy improvement
    theorem :math:`V^{\pi_{new}}\ge V^\pi` in every state.

    >>> policy_improvement(torch.ones(1, 2, 1), torch.tensor([[1.0, 2.0]]), torch.zeros(1), 0.9).tolist()
    [1]
    """
    P, r, _ = _model(P, R)
    Vd, _ = _values(V, r.shape[0], "V")
    if Vd.dim() != 1:
        raise ValueError(f"V must be (S,) = ({r.shape[0]},), got {tuple(Vd.shape)}")
    tie_tol = check_range(tie_tol, "tie_tol", 0.0)
    return _greedy(r + _gamma(gamma) * P @ Vd, tie_tol)


def policy_iteration(P, R, gamma: float, pi0=None, *, tol: float = 1e-12, max_iter: int = 1000,
                     tie_tol: float = 1e-9) -> PolicyIterationResult:
    r"""Policy iteration (Howard 1960): evaluate (:func:`policy_evaluation`), improve (:func:`policy_improvement`),
    until the greedy policy no longer changes. ``pi0`` ``(S,)`` actions (default all 0).

    >>> policy_iteration(torch.ones(1, 2, 1), torch.tensor([[1.0, 2.0]]), 0.5).policy.tolist()
    [1]
    """
    P, r, dtype = _model(P, R)
    S, A = r.shape
    pi = torch.zeros(S, dtype=torch.long) if pi0 is None else _as_policy(pi0, S, A).argmax(-1)
    max_iter = check_positive_int(max_iter, "max_iter")
    policies = [pi]
    for k in range(1, max_iter + 1):
        V = policy_evaluation(P, r, pi, gamma, tol=tol)
        new = policy_improvement(P, r, V, gamma, tie_tol=tie_tol)
        # keep the current action when it is (near-)optimal: stops cycling between equally good policies
        Q = r + _gamma(gamma) * P @ V
        q_old, q_new = Q.gather(1, pi[:, None]).squeeze(1), Q.gather(1, new[:, None]).squeeze(1)
        keep = q_old >= q_new - tie_tol * Q.abs().max(-1).values.clamp_min(1.0)
        new = torch.where(keep, pi, new)
        if torch.equal(new, pi):
            return PolicyIterationResult(V.to(dtype), pi, k - 1, torch.stack(policies))
        pi = new
        policies.append(pi)
    raise ValueError(f"policy iteration did not stabilise in max_iter = {max_iter} improvements")
