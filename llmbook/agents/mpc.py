r"""Model-predictive control on a known model: plan H steps ahead, apply the first action, replan.

* :func:`mpc_plan` (37.06): the open-loop plan
  :math:`a_{t:t+H-1}=\arg\max\,\mathbb E[\sum_{k=0}^{H-1}\gamma^k r_{t+k}+\gamma^H V_{term}(s_{t+H})]` on a
  tabular model, by exhaustive search over all :math:`A^H` action sequences (the expectation is exact: the
  state distribution is pushed through ``P`` once per prefix, so the sequences share their prefixes).
* :func:`mpc_policy`: the receding-horizon policy, the first action of the plan from every state; a
  stationary deterministic policy, so its exact value comes from policy evaluation.
* :func:`lq_mpc_gain`: the same receding-horizon idea for a linear system :math:`x_{k+1}=Ax_k+Bu_k` with the
  quadratic cost :math:`\sum_k x_k^\top Qx_k+u_k^\top Ru_k+x_H^\top P_f x_H`: the plan is a least-squares
  problem in the stacked actions, and its first action is linear in the state, :math:`u_0=-K_H x_0`.
  With :math:`P_f` the solution of the discrete algebraic Riccati equation, :math:`K_H` is the
  infinite-horizon LQR gain for every ``H``.

Conventions as in :mod:`llmbook.agents.dynamic_programming`: ``P`` ``(S, A, S')``, ``R`` ``(S, A, S')`` or
``(S, A)``; float64 arithmetic; rewards (maximised) for the tabular plan, costs (minimised) for the
linear-quadratic one.

>>> P = torch.tensor([[[1.0, 0.0], [0.0, 1.0]], [[0.0, 1.0], [0.0, 1.0]]])
>>> R = torch.tensor([[0.0, -1.0], [1.0, 1.0]])
>>> plan = mpc_plan(P, R, torch.tensor([1.0, 0.0]), 3, 0.9)
>>> plan.actions.tolist(), round(plan.value.item(), 4)
([1, 0, 0], 0.71)
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from llmbook._checks import as_tensor, check_finite, check_positive_int, check_probability, check_range
from llmbook.agents.dynamic_programming import _greedy
from llmbook.agents.mdp import _gamma, _model, _values
from llmbook.registry import implements

__all__ = ["mpc_plan", "mpc_policy", "lq_mpc_gain", "MPCPlan"]

MAX_SEQUENCES = 2**22


class MPCPlan(NamedTuple):
    """``actions`` ``(..., H)`` long, the best sequence; ``value`` ``(...,)`` its expected return; ``returns``
    ``(..., A**H)`` the expected return of every sequence, in lexicographic order (first action slowest)."""

    actions: torch.Tensor
    value: torch.Tensor
    returns: torch.Tensor


@implements("37.06")
def mpc_plan(P, R, d0, H: int, gamma: float, V_terminal=None, *, tie_tol: float = 1e-9) -> MPCPlan:
    r"""Exhaustive model-predictive planning: the best open-loop action sequence of length ``H``.

    .. math:: a^*_{t:t+H-1}=\arg\max_{a_{t:t+H-1}}\mathbb E\Big[\sum_{k=0}^{H-1}\gamma^k r_{t+k}
              +\gamma^H V_{term}(s_{t+H})\,\Big|\,s_t, a_{t:t+H-1}\Big],\qquad\text{execute } a_t=a^*_t

    Symbols: ``P`` ``(S, A, S')``, ``R`` ``(S, A, S')`` or ``(S, A)`` the known model; ``d0`` ``(..., S)`` the
    distribution of the current state :math:`s_t` (one-hot for a known state); ``H`` :math:`\ge 1`;
    ``gamma`` in [0, 1]; ``V_terminal`` ``(S,)`` the value credited after the horizon (default 0).
    The expectation is exact: :math:`d_{k+1}=d_k P_{a_k}` and :math:`\mathbb E[r_k]=d_k\cdot r(\cdot,a_k)`.
    Cost :math:`O(A^H S^2)`; at most 2**22 sequences. Ties go to the lexicographically first sequence
    (within ``tie_tol``, relative). Returns :class:`MPCPlan` (values in the dtype of ``P``).

    >>> mpc_plan(torch.ones(1, 2, 1), torch.tensor([[1.0, 2.0]]), torch.ones(1), 2, 0.5).actions.tolist()
    [1, 1]
    """
    P, r, dtype = _model(P, R)
    S, A = r.shape
    d = as_tensor(d0, "d0")
    if d.dim() < 1 or d.shape[-1] != S:
        raise ValueError(f"d0 must be (..., S) = (..., {S}) state probabilities, got {tuple(d.shape)}")
    check_finite(d, "d0")
    check_probability(d, "d0")
    d = d.double()
    H = check_positive_int(H, "H")
    gamma = _gamma(gamma)
    tie_tol = check_range(tie_tol, "tie_tol", 0.0)
    if H * torch.log2(torch.tensor(float(A))).item() > 22:
        raise ValueError(f"A**H = {A}**{H} action sequences exceed the limit of {MAX_SEQUENCES}")
    if V_terminal is None:
        Vt = torch.zeros(S, dtype=torch.float64)
    else:
        Vt, _ = _values(V_terminal, S, "V_terminal")
        if Vt.dim() != 1:
            raise ValueError(f"V_terminal must be (S,) = ({S},), got {tuple(Vt.shape)}")
    batch = d.shape[:-1]
    d = d.reshape(-1, 1, S)  # (B, n, S): the state distribution after each of the n = A**k prefixes
    ret = torch.zeros(d.shape[0], 1, dtype=torch.float64)
    for k in range(H):
        ret = (ret[..., None] + gamma**k * d @ r).flatten(1)  # (B, n * A): extend every prefix by every action
        d = torch.einsum("bns,sat->bnat", d, P).flatten(1, 2)
    ret = ret + gamma**H * d @ Vt
    best = _greedy(ret, tie_tol)
    digits = A ** torch.arange(H - 1, -1, -1)
    actions = (best[:, None] // digits) % A
    value = ret.gather(1, best[:, None]).squeeze(1)
    return MPCPlan(actions.reshape(*batch, H), value.reshape(batch).to(dtype),
                   ret.reshape(*batch, ret.shape[-1]).to(dtype))


def mpc_policy(P, R, H: int, gamma: float, V_terminal=None) -> torch.Tensor:
    """The receding-horizon policy ``(S,)``: from every state, the first action of :func:`mpc_plan`."""
    S = as_tensor(P, "P").shape[0]
    return mpc_plan(P, R, torch.eye(S, dtype=torch.float64), H, gamma, V_terminal).actions[:, 0]


def lq_mpc_gain(A, B, Q, R, H: int, P_f=None) -> torch.Tensor:
    r"""The receding-horizon gain :math:`K_H` of linear-quadratic MPC: :math:`u_0=-K_H x_0`.

    Minimises :math:`\sum_{k=0}^{H-1}(x_k^\top Qx_k+u_k^\top Ru_k)+x_H^\top P_f x_H` subject to
    :math:`x_{k+1}=Ax_k+Bu_k` by stacking :math:`x=\Phi x_0+\Gamma u` (``n`` states, ``m`` inputs) and solving
    the normal equations :math:`(\Gamma^\top\bar Q\Gamma+\bar R)u=-\Gamma^\top\bar Q\Phi x_0`; returns the
    first ``m`` rows of the solution operator, ``(m, n)`` float64. ``Q``, ``P_f`` (default 0) positive
    semi-definite, ``R`` positive definite.

    >>> lq_mpc_gain(torch.eye(1), torch.eye(1), torch.eye(1), torch.eye(1), 1).tolist()
    [[0.0]]
    """
    A, B, Q, R = (as_tensor(x, name).double() for x, name in ((A, "A"), (B, "B"), (Q, "Q"), (R, "R")))
    for x, name in ((A, "A"), (B, "B"), (Q, "Q"), (R, "R")):
        check_finite(x, name)
    n = A.shape[0] if A.dim() == 2 else -1
    m = B.shape[1] if B.dim() == 2 else -1
    P_f = torch.zeros(max(n, 0), max(n, 0), dtype=torch.float64) if P_f is None else as_tensor(P_f, "P_f").double()
    check_finite(P_f, "P_f")
    if n < 1 or m < 1 or A.shape != (n, n) or B.shape != (n, m) or Q.shape != (n, n) or R.shape != (m, m) \
            or P_f.shape != (n, n):
        raise ValueError(f"need A (n, n), B (n, m), Q (n, n), R (m, m), P_f (n, n) with n, m >= 1; got "
                         f"{tuple(A.shape)}, {tuple(B.shape)}, {tuple(Q.shape)}, {tuple(R.shape)}, {tuple(P_f.shape)}")
    H = check_positive_int(H, "H")
    powers = [torch.eye(n, dtype=torch.float64)]
    for _ in range(H):
        powers.append(A @ powers[-1])
    Phi = torch.cat(powers)  # ((H + 1) n, n): x_k = A^k x_0 + ...
    Gam = torch.zeros((H + 1) * n, H * m, dtype=torch.float64)
    for k in range(1, H + 1):
        for j in range(k):
            Gam[k * n:(k + 1) * n, j * m:(j + 1) * m] = powers[k - 1 - j] @ B
    Qbar = torch.block_diag(*([Q] * H), P_f)
    Rbar = torch.block_diag(*([R] * H))
    try:
        K_all = torch.linalg.solve(Gam.T @ Qbar @ Gam + Rbar, Gam.T @ Qbar @ Phi)
    except RuntimeError as err:
        raise ValueError("the stacked LQ problem is singular: R must be positive definite") from err
    return K_all[:m]
