r"""Partially observable MDPs: the definition and the Bayes filter over hidden states (the belief update).

* **POMDP** (32.09, :func:`make_pomdp`, Kaelbling, Littman and Cassandra 1998):
  :math:`\mathcal P=(\mathcal S,\mathcal A,T,R,\Omega,O,\gamma)`, an MDP whose state is hidden; after
  action :math:`a` lands in :math:`s'` the agent sees :math:`o\sim O(\cdot|s',a)`.
* **Belief update** (32.10, :func:`belief_update`): the posterior over the hidden state,
  :math:`b'(s')=\eta\,O(o'|s',a)\sum_sT(s'|s,a)b(s)`, with :math:`1/\eta=\Pr(o'|b,a)`
  (:func:`observation_probability`). The belief is a sufficient statistic of the history, so a POMDP is
  an MDP over beliefs.

Conventions: ``T`` ``(S, A, S')``, ``O`` ``(A, S', Omega)`` with ``O[a, s', o]`` :math:`=O(o|s',a)`, ``R``
``(S, A)``; beliefs ``b`` ``(..., S)``. Arithmetic in float64; results in the dtype of ``b``.

>>> from llmbook.agents.envs import tiger_pomdp
>>> tiger = tiger_pomdp()
>>> [round(x, 4) for x in belief_update(tiger.b0, 0, 0, tiger.T, tiger.O).tolist()]   # listen, hear left
[0.85, 0.15]
"""

from __future__ import annotations

import torch

from llmbook._checks import as_tensor, check_dim, check_finite, check_int
from llmbook.agents.envs import TabularPOMDP
from llmbook.agents.mdp import _gamma, _stochastic, _transitions
from llmbook.registry import implements

__all__ = ["make_pomdp", "belief_update", "observation_probability"]


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
    Td, Od = _tables(T, O)
    S, A, _ = Td.shape
    R = as_tensor(R, "R")
    if tuple(R.shape) != (S, A):
        raise ValueError(f"R must be (S, A) = ({S}, {A}), got {tuple(R.shape)}")
    check_finite(R, "R")
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
