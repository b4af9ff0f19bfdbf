r"""Behaviour cloning's compounding error and DAgger (chapter 38), on a small tabular MDP.

Behaviour cloning trains on the *expert's* state distribution and is then run on its *own*. A learner that
errs with probability :math:`\epsilon` per step on the expert's states drifts into states the expert never
shows, where it has no data; if it cannot recover there, every early mistake costs for the rest of the
episode, and the total cost over a horizon :math:`T` can grow like :math:`\epsilon T^2` (Ross and Bagnell,
2010, Theorem 2.1: :math:`J(\hat\pi)\le J(\pi^*)+T^2\epsilon`). DAgger (Ross, Gordon and Bagnell, 2011) runs
the learner, asks the expert to label the states the *learner* visits, aggregates all labelled states and
refits; its cost grows like :math:`uT\epsilon` (:math:`u` bounds the extra cost-to-go of one wrong action).

* :func:`lane_mdp`: a lane-keeping MDP (lateral offset :math:`d\in\{-K,\dots,K\}`, actions LEFT, STRAIGHT,
  RIGHT, cost 1 per step off the centre line) with its expert, who steers back to the centre.
* :func:`majority_policy`: the tabular classifier, the majority label per state; a state without data
  gets the most frequent label of the whole data set (the constant classifier, the best a learner can do
  with no information about that state).
* :func:`slip_policy`: the learner's errors: the classifier's action with probability :math:`1-\epsilon`,
  each other action with :math:`\epsilon/(A-1)`. A stand-in for the classification error of a function
  approximator, so that the :math:`\epsilon` of the bounds is known exactly.
* :func:`expected_cost`: exact :math:`J_T(\pi)=\sum_{t<T}\mathbb E_{s_t\sim d_t^\pi}c(s_t)` for every
  horizon, by propagating the state distribution; :func:`rollout_states` samples trajectories.
* :func:`dagger`: the algorithm (iteration 1 rolls out the expert, so its policy is behaviour cloning);
  :func:`deviation_cost` the constant :math:`u` of DAgger's bound.

Tables are float64 torch tensors: ``P`` ``(S, A, S')``, ``cost`` ``(S,)``, policies ``(S,)`` integer actions or
``(S, A)`` probabilities.

>>> lane = lane_mdp(2)
>>> lane.expert.tolist(), lane.start
([2, 2, 1, 0, 0], 2)
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from llmbook._checks import as_tensor, check_int, check_positive_int, check_range, check_unit_interval

__all__ = ["LaneMDP", "lane_mdp", "majority_policy", "slip_policy", "expected_cost", "rollout_states",
           "deviation_cost", "DaggerResult", "dagger"]


class LaneMDP(NamedTuple):
    """``P`` ``(S, 3, S)``, ``cost`` ``(S,)``, ``expert`` ``(S,)`` actions, ``start`` the centre state ``K``."""

    P: torch.Tensor
    cost: torch.Tensor
    expert: torch.Tensor
    start: int


def lane_mdp(K: int = 3) -> LaneMDP:
    r"""Lane keeping: state :math:`d\in\{-K..K\}` (index :math:`d+K`), actions 0 LEFT (:math:`-1`), 1 STRAIGHT,
    2 RIGHT (:math:`+1`), deterministic moves :math:`d'=\mathrm{clip}(d+a-1,-K,K)`, cost :math:`c(d)=\mathbf 1[d\ne0]`.

    The expert steers towards the centre (RIGHT for :math:`d<0`, STRAIGHT at 0, LEFT for :math:`d>0`); it
    never leaves the centre, so its cost is 0 at every horizon.
    """
    K = check_positive_int(K, "K")
    S = 2 * K + 1
    P = torch.zeros(S, 3, S, dtype=torch.float64)
    for s in range(S):
        for a in range(3):
            P[s, a, min(max(s + a - 1, 0), S - 1)] = 1.0
    d = torch.arange(S) - K
    expert = torch.where(d < 0, 2, torch.where(d > 0, 0, 1))
    return LaneMDP(P, (d != 0).double(), expert, K)


def _check_mdp(P, cost=None) -> tuple[torch.Tensor, torch.Tensor | None]:
    P = as_tensor(P, "P").double()
    if P.dim() != 3 or P.shape[0] != P.shape[2] or P.shape[0] == 0 or P.shape[1] == 0:
        raise ValueError(f"P must be (S, A, S) with S, A >= 1, got shape {tuple(P.shape)}")
    if (P < 0).any() or not torch.allclose(P.sum(-1), torch.ones(()).double(), atol=1e-9):
        raise ValueError("P must hold probabilities: P[s, a] >= 0 summing to 1 over next states")
    if cost is not None:
        cost = as_tensor(cost, "cost").double()
        if cost.shape != (P.shape[0],) or not torch.isfinite(cost).all():
            raise ValueError(f"cost must be finite (S,) = ({P.shape[0]},), got shape {tuple(cost.shape)}")
    return P, cost


def _as_stochastic(pi, S: int, A: int) -> torch.Tensor:
    pi = torch.as_tensor(pi)
    if pi.dtype.is_floating_point:
        pi = pi.double()
        if pi.shape != (S, A) or (pi < 0).any() or not torch.allclose(pi.sum(-1), torch.ones(()).double(), atol=1e-9):
            raise ValueError(f"a stochastic policy must be (S, A) = ({S}, {A}) with rows summing to 1, "
                             f"got shape {tuple(pi.shape)}")
        return pi
    if pi.shape != (S,) or pi.dtype == torch.bool or (pi < 0).any() or (pi >= A).any():
        raise ValueError(f"a deterministic policy must be (S,) = ({S},) integer actions in [0, {A}), "
                         f"got {pi.dtype} {tuple(pi.shape)}")
    return torch.nn.functional.one_hot(pi.long(), A).double()


def majority_policy(s, a, S: int, A: int) -> torch.Tensor:
    r"""The tabular classifier :math:`\hat\pi(s)=\arg\max_a n(s,a)`; unseen states get :math:`\arg\max_a\sum_sn(s,a)`.

    The 0-1-loss minimiser over tables (and the argmax of behaviour cloning's :math:`\hat\mu(a\mid s)`).
    Ties go to the lowest action. ``s``, ``a`` ``(M,)`` integer labelled states and actions, ``M >= 1``.
    Returns ``(S,)`` long.

    >>> majority_policy(torch.tensor([0, 0, 0, 1]), torch.tensor([1, 1, 1, 0]), 3, 2).tolist()
    [1, 0, 1]
    """
    S, A = check_positive_int(S, "S"), check_positive_int(A, "A")
    s, a = torch.as_tensor(s), torch.as_tensor(a)
    if s.dtype.is_floating_point or a.dtype.is_floating_point or s.shape != a.shape or s.dim() != 1:
        raise ValueError(f"s and a must be integer (M,) tensors of one length, got {s.dtype} {tuple(s.shape)} "
                         f"and {a.dtype} {tuple(a.shape)}")
    if s.numel() == 0:
        raise ValueError("majority_policy needs at least one labelled state (M >= 1)")
    if (s < 0).any() or (s >= S).any() or (a < 0).any() or (a >= A).any():
        raise ValueError(f"s must lie in [0, {S}) and a in [0, {A})")
    n = torch.bincount(s.long() * A + a.long(), minlength=S * A).reshape(S, A)
    fallback = n.sum(0).argmax()
    return torch.where(n.sum(-1) > 0, n.argmax(-1), fallback)


def slip_policy(policy, A: int, eps: float) -> torch.Tensor:
    r""":math:`\pi_\epsilon(a\mid s)=(1-\epsilon)\mathbf 1[a=\hat\pi(s)]+\frac{\epsilon}{A-1}\mathbf 1[a\ne\hat\pi(s)]`.

    ``policy`` ``(S,)`` integer actions, ``A >= 2``, ``eps`` in [0, 1]: the per-step error rate. ``(S, A)``.

    >>> slip_policy(torch.tensor([1]), 3, 0.2).tolist()
    [[0.1, 0.8, 0.1]]
    """
    A = check_int(A, "A", low=2)
    eps = check_unit_interval(eps, "eps")
    policy = torch.as_tensor(policy)
    if policy.dim() != 1:
        raise ValueError(f"policy must be (S,) integer actions, got shape {tuple(policy.shape)}")
    onehot = _as_stochastic(policy, policy.shape[0], A)
    return (1 - eps) * onehot + eps / (A - 1) * (1 - onehot)


def expected_cost(P, cost, pi, T: int, start: int) -> torch.Tensor:
    r"""Exact :math:`J_t(\pi)=\sum_{k<t}d_k^\pi\cdot c` for every horizon :math:`t=1..T`, ``(T,)`` float64.

    :math:`d_0=e_{start}`, :math:`d_{k+1}(s')=\sum_{s,a}d_k(s)\pi(a|s)P(s'|s,a)`: the cost of the states
    visited at steps :math:`0..t-1`. ``pi`` ``(S,)`` actions or ``(S, A)`` probabilities.

    >>> lane = lane_mdp(1)
    >>> expected_cost(lane.P, lane.cost, torch.tensor([1, 0, 1]), 3, 0).tolist()  # from d = -1, STRAIGHT
    [1.0, 2.0, 3.0]
    """
    P, cost = _check_mdp(P, cost)
    S, A = P.shape[:2]
    pi = _as_stochastic(pi, S, A)
    T, start = check_positive_int(T, "T"), check_int(start, "start", low=0, high=S - 1)
    P_pi = torch.einsum("sa,sat->st", pi, P)
    d = torch.zeros(S, dtype=torch.float64)
    d[start] = 1.0
    per_step = []
    for _ in range(T):
        per_step.append(d @ cost)
        d = d @ P_pi
    return torch.stack(per_step).cumsum(0)


def rollout_states(P, pi, T: int, n: int, start: int, generator=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample ``n`` trajectories of ``T`` steps: states ``(n, T)`` and actions ``(n, T)`` (long), vectorised."""
    P, _ = _check_mdp(P)
    S, A = P.shape[:2]
    pi = _as_stochastic(pi, S, A)
    T, n = check_positive_int(T, "T"), check_positive_int(n, "n")
    start = check_int(start, "start", low=0, high=S - 1)
    s = torch.full((n,), start, dtype=torch.long)
    states, actions = [], []
    for _ in range(T):
        a = torch.multinomial(pi[s], 1, generator=generator).squeeze(-1)
        states.append(s)
        actions.append(a)
        s = torch.multinomial(P[s, a], 1, generator=generator).squeeze(-1)
    return torch.stack(states, 1), torch.stack(actions, 1)


def deviation_cost(P, cost, expert, T: int) -> float:
    r"""DAgger's :math:`u=\max_{t\le T}\max_{s,a}\,Q^{\pi^*}_t(s,a)-V^{\pi^*}_t(s)`: the most one wrong action can add.

    :math:`V_t(s)=Q_t(s,\pi^*(s))`, :math:`Q_t(s,a)=c(s)+\sum_{s'}P(s'|s,a)V_{t-1}(s')`, :math:`V_0=0`: the
    expert's cost-to-go over the remaining :math:`t` steps.

    >>> lane = lane_mdp(3)
    >>> deviation_cost(lane.P, lane.cost, lane.expert, 10)
    2.0
    """
    P, cost = _check_mdp(P, cost)
    S, A = P.shape[:2]
    pi = _as_stochastic(expert, S, A)
    V, u = torch.zeros(S, dtype=torch.float64), 0.0
    for _ in range(check_positive_int(T, "T")):
        Q = cost[:, None] + P @ V
        V_new = (pi * Q).sum(-1)
        u = max(u, (Q - V_new[:, None]).max().item())
        V = V_new
    return u


class DaggerResult(NamedTuple):
    """``policy`` ``(S,)`` the last fit; ``policies`` ``(iters, S)`` every fit (row 0 is behaviour cloning);
    ``s``, ``a`` the aggregated labelled states and the expert's labels."""

    policy: torch.Tensor
    policies: torch.Tensor
    s: torch.Tensor
    a: torch.Tensor


def dagger(P, expert, T: int, *, eps: float, iters: int = 5, n_rollouts: int = 10, start: int = 0,
           beta_decay: float = 0.0, generator=None) -> DaggerResult:
    r"""DAgger (Ross, Gordon and Bagnell, 2011): :math:`D\leftarrow D\cup\{(s,\pi^*(s)):s\sim d^{\pi_i}\}`, refit.

    Iteration :math:`i=1..` ``iters`` rolls out :math:`\pi_i=\beta_i\pi^*+(1-\beta_i)\hat\pi_{i,\epsilon}` with
    :math:`\beta_i=` ``beta_decay`` :math:`^{i-1}` (so :math:`\beta_1=1`: the expert's own demonstrations,
    and the first fit is behaviour cloning), ``n_rollouts`` episodes of ``T`` steps from ``start``; the
    expert labels every visited state, the data are aggregated and :func:`majority_policy` refits. The
    learner acts through :func:`slip_policy` with error rate ``eps``. ``expert`` ``(S,)`` actions.
    """
    P, _ = _check_mdp(P)
    S, A = P.shape[:2]
    expert_pi = _as_stochastic(expert, S, A)
    expert = torch.as_tensor(expert).long()
    iters = check_positive_int(iters, "iters")
    beta_decay = check_range(beta_decay, "beta_decay", 0.0, 1.0)
    eps = check_unit_interval(eps, "eps")
    data_s, policies, learner = [], [], None
    for i in range(iters):
        beta = beta_decay**i
        pi_i = expert_pi if learner is None else beta * expert_pi + (1 - beta) * slip_policy(learner, A, eps)
        states, _ = rollout_states(P, pi_i, T, n_rollouts, start, generator)
        data_s.append(states.reshape(-1))
        s_all = torch.cat(data_s)
        learner = majority_policy(s_all, expert[s_all], S, A)  # the expert labels every visited state
        policies.append(learner)
    return DaggerResult(learner, torch.stack(policies), s_all, expert[s_all])
