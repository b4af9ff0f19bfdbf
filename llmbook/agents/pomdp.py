r"""Partially observable MDPs: the definition and the Bayes filter over hidden states (the belief update).

* **POMDP** (32.09, :func:`make_pomdp`, Kaelbling, Littman and Cassandra 1998):
  :math:`\mathcal P=(\mathcal S,\mathcal A,T,R,\Omega,O,\gamma)`, an MDP whose state is hidden; after
  action :math:`a` lands in :math:`s'` the agent sees :math:`o\sim O(\cdot|s',a)`.
* **Belief update** (32.10, :func:`belief_update`): the posterior over the hidden state,
  :math:`b'(s')=\eta\,O(o'|s',a)\sum_sT(s'|s,a)b(s)`, with :math:`1/\eta=\Pr(o'|b,a)`
  (:func:`observation_probability`). The belief is a sufficient statistic of the history, so a POMDP is
  an MDP over beliefs.
* **Value over beliefs** (:func:`alpha_backup`, :func:`prune_alpha`, :func:`value_iteration_alpha`,
  :func:`belief_value`; no catalogue id): the optimal :math:`n`-step value of the belief MDP is piecewise
  linear and convex, :math:`V_n(b)=\max_{\alpha\in\Gamma_n}b\cdot\alpha` (Sondik 1971; Kaelbling et al. 1998),
  computed exactly by backing up the set of alpha-vectors :math:`\Gamma_n`.

Conventions: ``T`` ``(S, A, S')``, ``O`` ``(A, S', Omega)`` with ``O[a, s', o]`` :math:`=O(o|s',a)`, ``R``
``(S, A)``; beliefs ``b`` ``(..., S)``. Arithmetic in float64; results in the dtype of ``b``.

>>> from llmbook.agents.envs import tiger_pomdp
>>> tiger = tiger_pomdp()
>>> [round(x, 4) for x in belief_update(tiger.b0, 0, 0, tiger.T, tiger.O).tolist()]   # listen, hear left
[0.85, 0.15]
"""

from __future__ import annotations

import itertools
import math

import torch

from llmbook._checks import as_tensor, check_dim, check_finite, check_int, check_nonnegative_int
from llmbook.agents.envs import TabularPOMDP
from llmbook.agents.mdp import _gamma, _stochastic, _transitions
from llmbook.registry import implements

__all__ = ["make_pomdp", "belief_update", "observation_probability", "alpha_backup", "prune_alpha",
           "value_iteration_alpha", "belief_value"]


def _model(T, R, O):
    """The checked tables ``T``, ``O`` (float64) and rewards ``R`` ``(S, A)``."""
    Td, Od = _tables(T, O)
    S, A, _ = Td.shape
    R = as_tensor(R, "R")
    if tuple(R.shape) != (S, A):
        raise ValueError(f"R must be (S, A) = ({S}, {A}), got {tuple(R.shape)}")
    check_finite(R, "R")
    return Td, Od, R


def _tables(T, O) -> tuple[torch.Tensor, torch.Tensor]:  # noqa: E741
    T = _transitions(T, "T")
    S, A, _ = T.shape
    O = as_tensor(O, "O")  # noqa: E741
    check_dim(O, "O", "(A, S', Omega)", min_dim=3, max_dim=3)
    if tuple(O.shape[:2]) != (A, S) or O.shape[2] == 0:
        raise ValueError(f"O must be (A, S', Omega) = ({A}, {S}, Omega >= 1), got {tuple(O.shape)}")
    check_finite(O, "O")
    _stochastic(O, "O")
    return T.double(), O.double()


def _belief(b, S: int) -> tuple[torch.Tensor, torch.dtype]:
    b = as_tensor(b, "b")
    if b.dim() < 1 or b.shape[-1] != S:
        raise ValueError(f"b must be (..., S) = (..., {S}), got {tuple(b.shape)}")
    check_finite(b, "b")
    _stochastic(b, "b")
    return b.double(), b.dtype


@implements("32.09")
def make_pomdp(T, R, O, gamma: float, b0=None, *, state_names: tuple = (), action_names: tuple = (),  # noqa: E741
               observation_names: tuple = ()) -> TabularPOMDP:
    r"""The POMDP :math:`\mathcal P=(\mathcal S,\mathcal A,T,R,\Omega,O,\gamma)`, checked and stored as float64.

    ``T`` ``(S, A, S')`` row-stochastic; ``R`` ``(S, A)``; ``O`` ``(A, S', Omega)`` with rows over the
    observations summing to 1; ``gamma`` in [0, 1]; ``b0`` ``(S,)`` the initial belief (default uniform).

    >>> p = make_pomdp(torch.ones(2, 1, 2) / 2, torch.zeros(2, 1), torch.ones(1, 2, 3) / 3, 0.9)
    >>> p.S, p.A, p.n_obs
    (2, 1, 3)
    """
    Td, Od, R = _model(T, R, O)
    S, A, _ = Td.shape
    b = torch.full((S,), 1.0 / S, dtype=torch.float64) if b0 is None else _belief(b0, S)[0]
    if b.dim() != 1:
        raise ValueError(f"b0 must be (S,) = ({S},), got {tuple(b.shape)}")
    return TabularPOMDP(T=Td, R=R.double(), O=Od, gamma=_gamma(gamma), b0=b, state_names=tuple(state_names),
                        action_names=tuple(action_names), observation_names=tuple(observation_names))


def _predict_joint(b, a, o, T, O):  # noqa: E741
    Td, Od = _tables(T, O)
    S, A, _ = Td.shape
    bd, dtype = _belief(b, S)
    a = check_int(a, "a", low=0, high=A - 1)
    o = check_int(o, "o", low=0, high=Od.shape[2] - 1)
    joint = Od[a, :, o] * (bd @ Td[:, a, :])  # Pr(s', o | b, a)
    return joint, dtype


def observation_probability(b, a: int, o: int, T, O) -> torch.Tensor:  # noqa: E741
    r""":math:`\Pr(o|b,a)=\sum_{s'}O(o|s',a)\sum_sT(s'|s,a)b(s)`, the normaliser :math:`1/\eta`; ``(...)``."""
    joint, dtype = _predict_joint(b, a, o, T, O)
    return joint.sum(-1).to(dtype)


@implements("32.10")
def belief_update(b, a: int, o: int, T, O) -> torch.Tensor:  # noqa: E741
    r"""The belief after action ``a`` and observation ``o``: :math:`b'(s')=\eta\,O(o|s',a)\sum_sT(s'|s,a)b(s)`.

    ``b`` ``(..., S)`` beliefs (rows summing to 1), ``a`` and ``o`` ints, ``T`` ``(S, A, S')``, ``O``
    ``(A, S', Omega)``. Returns ``(..., S)`` in the dtype of ``b``. An observation of probability 0 under
    ``b`` and ``a`` has no posterior: ``ValueError``.

    >>> T = torch.eye(2)[:, None, :]; O = torch.tensor([[[0.9, 0.1], [0.2, 0.8]]])
    >>> [round(x, 4) for x in belief_update(torch.tensor([0.5, 0.5]), 0, 1, T, O).tolist()]
    [0.1111, 0.8889]
    """
    joint, dtype = _predict_joint(b, a, o, T, O)
    z = joint.sum(-1, keepdim=True)
    if joint.numel() and (z <= 0).any():
        raise ValueError(f"observation o = {o} has probability 0 after action a = {a} under belief b: "
                         "the belief update is undefined")
    return (joint / z).to(dtype)


# ----------------------------------------------------------------------------------------------
# the value function over beliefs: finite-horizon value iteration on alpha-vectors


def _alphas(Gamma, S: int) -> torch.Tensor:
    Gamma = as_tensor(Gamma, "Gamma")
    if Gamma.dim() != 2 or Gamma.shape[1] != S or Gamma.shape[0] == 0:
        raise ValueError(f"Gamma must be (K, S) = (K >= 1, {S}) alpha-vectors, got {tuple(Gamma.shape)}")
    check_finite(Gamma, "Gamma")
    return Gamma.double()


def alpha_backup(Gamma, T, R, O, gamma: float) -> tuple[torch.Tensor, torch.Tensor]:  # noqa: E741
    r"""One exact dynamic-programming backup of a value function held as alpha-vectors (Monahan's enumeration):

    .. math:: \alpha_{a,\kappa}(s)=R(s,a)+\gamma\sum_{s'}T(s'|s,a)\sum_{o}O(o|s',a)\,\alpha^{\kappa(o)}(s')

    for every action :math:`a` and every choice :math:`\kappa` of one vector of :math:`\Gamma` per observation,
    so that :math:`V'(b)=\max_{a,\kappa}b\cdot\alpha_{a,\kappa}=\max_a\big[b\cdot R(\cdot,a)+\gamma\sum_o
    \Pr(o|b,a)\,V(b'_{a,o})\big]` with :math:`V(b)=\max_{\alpha\in\Gamma}b\cdot\alpha`. ``Gamma`` ``(K, S)``,
    ``T`` ``(S, A, S')``, ``R`` ``(S, A)``, ``O`` ``(A, S', Omega)``. Returns ``(A K^Omega, S)`` vectors (not
    pruned: see :func:`prune_alpha`) and ``(A K^Omega,)`` their first actions, float64.

    >>> T = torch.ones(1, 1, 1); O = torch.ones(1, 1, 1)
    >>> alpha_backup(torch.tensor([[2.0]]), T, torch.tensor([[1.0]]), O, 0.5)[0].tolist()
    [[2.0]]
    """
    Td, Od, R = _model(T, R, O)
    S, A, _ = Td.shape
    G = _alphas(Gamma, S)
    gamma = _gamma(gamma)
    K, n_obs = G.shape[0], Od.shape[2]
    # g[a, o, k, s] = sum_s' T(s'|s,a) O(o|s',a) alpha_k(s')
    g = torch.einsum("sat,ato,kt->aoks", Td, Od, G)
    choices = torch.tensor(list(itertools.product(range(K), repeat=n_obs)), dtype=torch.long)  # (K^Omega, Omega)
    picked = g[:, torch.arange(n_obs), choices]  # (A, K^Omega, Omega, S)
    vectors = R.double().T[:, None, :] + gamma * picked.sum(2)  # (A, K^Omega, S)
    actions = torch.arange(A).repeat_interleave(choices.shape[0])
    return vectors.reshape(-1, S), actions


def _cross(slope: list, icpt: list, i: int, k: int) -> float:
    return (icpt[i] - icpt[k]) / (slope[k] - slope[i])  # where line k (steeper) overtakes line i


def prune_alpha(Gamma, actions=None, tol: float = 1e-12) -> tuple[torch.Tensor, torch.Tensor]:
    r"""Keep only the alpha-vectors of ``Gamma`` that attain :math:`\max_\alpha b\cdot\alpha` on some interval
    of beliefs: the exact upper envelope, for **two** hidden states (``Gamma`` ``(K, 2)``; every belief is
    :math:`b=(p, 1-p)`, every vector the line :math:`\alpha(1)+p(\alpha(0)-\alpha(1))` on :math:`p\in[0,1]`).
    The convex hull trick: lines sorted by slope, each kept while some interval has it on top; slopes
    within ``tol`` count as one. Returns the kept vectors in envelope order (increasing
    :math:`p`) and their ``actions`` (default ``-1``). (With more states, exact pruning needs a linear program.)

    >>> Gamma = torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.4, 0.4]])
    >>> prune_alpha(Gamma)[0].tolist()
    [[0.0, 1.0], [1.0, 0.0]]
    """
    G = as_tensor(Gamma, "Gamma")
    if G.dim() != 2 or G.shape[1] != 2 or G.shape[0] == 0:
        raise ValueError(f"prune_alpha is exact for two hidden states: Gamma must be (K >= 1, 2), got {tuple(G.shape)}")
    check_finite(G, "Gamma")
    G = G.double()
    acts = torch.full((G.shape[0],), -1, dtype=torch.long) if actions is None else torch.as_tensor(actions)
    if tuple(acts.shape) != (G.shape[0],):
        raise ValueError(f"actions must be (K,) = ({G.shape[0]},), got {tuple(acts.shape)}")
    slope, icpt = (G[:, 0] - G[:, 1]).tolist(), G[:, 1].tolist()  # the value at p is icpt + p * slope
    hull: list[int] = []  # the upper envelope over all real p, by slope (the convex hull trick)
    for k in sorted(range(len(slope)), key=lambda k: (slope[k], -icpt[k])):
        if hull and slope[k] - slope[hull[-1]] <= tol:
            continue  # the same slope as the last line, and not higher
        while len(hull) >= 2 and _cross(slope, icpt, hull[-2], k) <= _cross(slope, icpt, hull[-2], hull[-1]) + tol:
            hull.pop()  # the last line is never strictly on top
        hull.append(k)
    edges = [-math.inf] + [_cross(slope, icpt, i, k) for i, k in zip(hull[:-1], hull[1:], strict=True)] + [math.inf]
    keep = [k for k, lo, hi in zip(hull, edges[:-1], edges[1:], strict=True)
            if hi > tol and lo < 1.0 - tol]  # on top somewhere within [0, 1]
    idx = torch.tensor(keep)
    return G[idx], acts[idx]


def value_iteration_alpha(T, R, O, gamma: float, horizon: int) -> list[tuple[torch.Tensor, torch.Tensor]]:  # noqa: E741
    r"""Exact finite-horizon value iteration over beliefs for a two-state POMDP: :math:`\Gamma_0=\{0\}`,
    :math:`\Gamma_{n+1}=\mathrm{prune}(\mathrm{backup}(\Gamma_n))` (:func:`alpha_backup`, :func:`prune_alpha`),
    so that :math:`V_n(b)=\max_{\alpha\in\Gamma_n}b\cdot\alpha` is the best expected discounted reward of
    :math:`n` steps from belief :math:`b`. Returns ``[(Gamma_n, actions_n) for n = 1..horizon]``, ``Gamma_n``
    ``(K_n, 2)`` float64 and ``actions_n`` ``(K_n,)`` the first action of each vector's policy tree.

    >>> from llmbook.agents.envs import tiger_pomdp
    >>> t = tiger_pomdp(gamma=1.0)
    >>> [round(belief_value(G, torch.tensor([0.5, 0.5]))[0].item(), 4)
    ...  for G, _ in value_iteration_alpha(t.T, t.R, t.O, t.gamma, 2)]
    [-1.0, -2.0]
    """
    horizon = check_nonnegative_int(horizon, "horizon")
    Td, _ = _tables(T, O)
    if Td.shape[0] != 2:
        raise ValueError(f"value_iteration_alpha prunes exactly for two hidden states, got S = {Td.shape[0]}")
    _, Od = _tables(T, O)
    R = as_tensor(R, "R")
    if tuple(R.shape) != tuple(Td.shape[:2]):
        raise ValueError(f"R must be (S, A) = {tuple(Td.shape[:2])}, got {tuple(R.shape)}")
    check_finite(R, "R")
    gamma = _gamma(gamma)
    G = torch.zeros(1, 2, dtype=torch.float64)
    out = []
    for _ in range(horizon):
        # the backup of alpha_backup, pruned after each observation's cross-sum (incremental pruning,
        # Cassandra et al. 1997): the same envelope, without the A K^Omega intermediate vectors
        g = torch.einsum("sat,ato,kt->aoks", Td, Od, G)
        per_action = []
        for a in range(Td.shape[1]):
            acc = prune_alpha(g[a, 0])[0]
            for o in range(1, Od.shape[2]):
                acc = prune_alpha((acc[:, None, :] + prune_alpha(g[a, o])[0][None]).reshape(-1, 2))[0]
            per_action.append(R.double()[:, a] + gamma * acc)
        acts = torch.cat([torch.full((v.shape[0],), a, dtype=torch.long) for a, v in enumerate(per_action)])
        G, acts = prune_alpha(torch.cat(per_action), acts)
        out.append((G, acts))
    return out


def belief_value(Gamma, b, actions=None) -> tuple[torch.Tensor, torch.Tensor]:
    r""":math:`V(b)=\max_{\alpha\in\Gamma}b\cdot\alpha` and the maximising vector's action (its index if
    ``actions`` is None). ``Gamma`` ``(K, S)``, ``b`` ``(..., S)`` -> ``(...)`` float64 and ``(...)`` long.

    >>> belief_value(torch.tensor([[1.0, 0.0], [0.0, 1.0]]), torch.tensor([0.3, 0.7]))[0].item()
    0.7
    """
    b = as_tensor(b, "b")
    G = _alphas(Gamma, b.shape[-1] if b.dim() else 0)
    bd, _ = _belief(b, G.shape[1])
    v, k = (bd @ G.T).max(-1)
    return v, (k if actions is None else torch.as_tensor(actions)[k])
