"""Tabular environments shared by Part III: MDP and POMDP containers, gymnasium's exact tables, sampling.

This module registers no equation. It holds the data that the chapters' equations act on:

* :class:`TabularMDP`: ``P`` ``(S, A, S')`` transition probabilities, ``R`` ``(S, A, S')`` expected
  rewards, a ``terminal`` mask, ``gamma``, the initial distribution ``mu0`` and names, all as float64
  (bool for the mask) torch tensors. ``r_sa`` is the expected one-step reward
  :math:`r(s,a)=\\sum_{s'}P(s'\\mid s,a)R(s,a,s')`.
* :func:`from_gymnasium`: builds a :class:`TabularMDP` from gymnasium's own transition table
  ``env.unwrapped.P[s][a] = [(prob, next_state, reward, terminated), ...]`` (FrozenLake-v1 with
  ``is_slippery`` True or False, CliffWalking-v1, Taxi-v4).
* :class:`TabularPOMDP` and :func:`tiger_pomdp` (Kaelbling, Littman and Cassandra, 1998).
* :func:`sample_episodes`: ``n`` episodes of ``T`` steps under a policy, drawn with a seeded
  ``torch.Generator``, vectorised over episodes.

**Terminal convention.** gymnasium marks *transitions* as terminating. A state is terminal here if some
transition into it terminates (a hole or the goal of FrozenLake, the goal of CliffWalking, a state of Taxi
with the passenger delivered). Every transition from a state reachable from the start into a terminal
state must terminate (checked; Taxi's unreachable states, with the passenger at the destination but the
taxi elsewhere, keep their table). Terminal
states are made **absorbing with zero reward**: ``P[t, a, t] = 1`` and ``R[t, a, :] = 0`` for every action,
so ``V(t) = 0`` and a finite-horizon rollout simply idles after the episode ends. Duplicate entries of the
gymnasium table (FrozenLake's slippery moves into a wall) are summed; ``R(s, a, s')`` is the probability-
weighted mean reward of the entries that reach ``s'`` (gymnasium's rewards are deterministic given
``(s, a, s')`` except slippery CliffWalking, where the mean is what values need).

>>> mdp = from_gymnasium("FrozenLake-v1", is_slippery=False)
>>> mdp.S, mdp.A, int(mdp.terminal.sum()), mdp.action_names[0]
(16, 4, 5, 'LEFT')
"""

from __future__ import annotations

import dataclasses
import importlib

import torch

from .._checks import check_int, check_positive_int, check_range

__all__ = ["TabularMDP", "TabularPOMDP", "from_gymnasium", "tiger_pomdp", "sample_episodes", "Episodes",
           "ACTION_NAMES", "ACTION_DELTAS"]

# gymnasium's action orders, and the (d_row, d_col) move of each grid action (for arrows on heat maps).
ACTION_NAMES = {
    "FrozenLake": ("LEFT", "DOWN", "RIGHT", "UP"),
    "CliffWalking": ("UP", "RIGHT", "DOWN", "LEFT"),
    "Taxi": ("SOUTH", "NORTH", "EAST", "WEST", "PICKUP", "DROPOFF"),
}
ACTION_DELTAS = {
    "FrozenLake": ((0, -1), (1, 0), (0, 1), (-1, 0)),
    "CliffWalking": ((-1, 0), (0, 1), (1, 0), (0, -1)),
}


@dataclasses.dataclass(frozen=True, eq=False)
class TabularMDP:
    """A finite MDP :math:`(\\mathcal S, \\mathcal A, P, R, \\gamma)` as float64 tensors.

    ``P`` ``(S, A, S')`` with rows summing to 1; ``R`` ``(S, A, S')``; ``terminal`` ``(S,)`` bool;
    ``gamma`` in [0, 1]; ``mu0`` ``(S,)`` the start distribution; ``shape`` the grid (rows, cols) or None;
    ``desc`` the grid's letters (FrozenLake) or None.
    """

    P: torch.Tensor
    R: torch.Tensor
    gamma: float
    terminal: torch.Tensor
    mu0: torch.Tensor
    name: str = "mdp"
    action_names: tuple = ()
    shape: tuple | None = None
    desc: tuple | None = None

    @property
    def S(self) -> int:
        return self.P.shape[0]

    @property
    def A(self) -> int:
        return self.P.shape[1]

    @property
    def r_sa(self) -> torch.Tensor:
        """Expected one-step reward :math:`r(s,a)=\\sum_{s'}P(s'|s,a)R(s,a,s')`, shape ``(S, A)``."""
        return (self.P * self.R).sum(-1)

    def replace(self, **changes) -> TabularMDP:
        """A copy with some fields changed (e.g. ``mdp.replace(gamma=0.9)``)."""
        return dataclasses.replace(self, **changes)


@dataclasses.dataclass(frozen=True, eq=False)
class TabularPOMDP:
    """A finite POMDP :math:`(\\mathcal S,\\mathcal A,T,R,\\Omega,O,\\gamma)` as float64 tensors.

    ``T`` ``(S, A, S')`` transitions; ``R`` ``(S, A)`` expected rewards; ``O`` ``(A, S', Omega)`` with
    ``O[a, s', o] = O(o | s', a)`` (the observation after taking ``a`` and landing in ``s'``);
    ``gamma``; ``b0`` ``(S,)`` the initial belief; names of states, actions and observations.
    """

    T: torch.Tensor
    R: torch.Tensor
    O: torch.Tensor  # noqa: E741 - the symbol of the equation
    gamma: float
    b0: torch.Tensor
    state_names: tuple = ()
    action_names: tuple = ()
    observation_names: tuple = ()

    @property
    def S(self) -> int:
        return self.T.shape[0]

    @property
    def A(self) -> int:
        return self.T.shape[1]

    @property
    def n_obs(self) -> int:
        return self.O.shape[-1]


def _gymnasium():
    try:
        return importlib.import_module("gymnasium")
    except ImportError as e:  # pragma: no cover - gymnasium is in the book extra
        raise ImportError("from_gymnasium needs gymnasium (pip install 'llmbook[book]' or gymnasium==1.4.0)") from e


def from_gymnasium(name_or_env, gamma: float = 0.99, **kwargs) -> TabularMDP:
    """Build a :class:`TabularMDP` from a gymnasium toy-text environment's exact table ``env.unwrapped.P``.

    ``name_or_env``: an id such as ``"FrozenLake-v1"`` (``kwargs`` go to ``gymnasium.make``, e.g.
    ``is_slippery=False``, ``map_name="8x8"``) or an environment instance. Terminal states become absorbing
    with zero reward (see the module docstring).
    """
    gamma = check_range(gamma, "gamma", 0.0, 1.0)
    if isinstance(name_or_env, str):
        env = _gymnasium().make(name_or_env, **kwargs)
        label = name_or_env
    else:
        env = name_or_env
        label = getattr(getattr(env, "spec", None), "id", None) or type(env.unwrapped).__name__
    u = env.unwrapped
    table = getattr(u, "P", None)
    if not isinstance(table, dict):
        raise ValueError(f"{label} has no tabular transition table env.unwrapped.P")
    S, A = int(u.observation_space.n), int(u.action_space.n)
    P = torch.zeros(S, A, S, dtype=torch.float64)
    PR = torch.zeros(S, A, S, dtype=torch.float64)
    term_into = torch.zeros(S, dtype=torch.bool)
    for s in range(S):
        for a in range(A):
            for p, s2, r, done in table[s][a]:
                P[s, a, s2] += p
                PR[s, a, s2] += p * r
                if done:
                    term_into[s2] = True
    R = torch.where(P > 0, PR / P.clamp_min(1e-300), torch.zeros(()))
    terminal = term_into
    mu0 = torch.as_tensor(getattr(u, "initial_state_distrib", torch.full((S,), 1.0 / S)), dtype=torch.float64)
    # every transition from a reachable non-terminal state into a terminal state must terminate
    reach = (mu0 > 0) & ~terminal
    frontier = reach.clone()
    while frontier.any():
        nxt = (P[frontier] > 0).any(0).any(0) & ~terminal & ~reach
        reach |= nxt
        frontier = nxt
    for s in reach.nonzero().flatten().tolist():
        for a in range(A):
            for _p, s2, _r, done in table[s][a]:
                if terminal[s2] and not done:
                    raise ValueError(f"{label}: transition {s}->{s2} under action {a} enters a terminal state "
                                     "without terminating; the absorbing convention does not apply")
    P[terminal] = 0.0
    idx = terminal.nonzero().flatten()
    P[idx, :, idx] = 1.0
    R[terminal] = 0.0
    base = label.split("-")[0]
    desc = getattr(u, "desc", None)
    if base == "FrozenLake":
        shape = (int(u.nrow), int(u.ncol))
        desc = tuple("".join(c.decode() for c in row) for row in desc)
    elif base == "CliffWalking":
        shape, desc = tuple(int(x) for x in u.shape), None
    else:
        shape, desc = None, None
    return TabularMDP(P=P, R=R, gamma=float(gamma), terminal=terminal, mu0=mu0 / mu0.sum(), name=label,
                      action_names=ACTION_NAMES.get(base, tuple(str(a) for a in range(A))), shape=shape, desc=desc)


def tiger_pomdp(p_correct: float = 0.85, gamma: float = 0.95) -> TabularPOMDP:
    """The tiger problem (Kaelbling, Littman and Cassandra, 1998).

    States: tiger behind the LEFT or RIGHT door. Actions: LISTEN (reward -1, the tiger stays, the hear
    the correct side with probability ``p_correct``), OPEN-LEFT, OPEN-RIGHT (reward -100 for the tiger's
    door, +10 otherwise; the problem resets: the tiger is placed uniformly, the observation is
    uninformative).

    >>> pomdp = tiger_pomdp()
    >>> [round(x, 4) for x in pomdp.O[0, 0].tolist()], pomdp.R[0].tolist()
    ([0.85, 0.15], [-1.0, -100.0, 10.0])
    """
    p = check_range(p_correct, "p_correct", 0.0, 1.0)
    gamma = check_range(gamma, "gamma", 0.0, 1.0)
    T = torch.zeros(2, 3, 2, dtype=torch.float64)
    T[:, 0] = torch.eye(2, dtype=torch.float64)
    T[:, 1:] = 0.5
    O = torch.full((3, 2, 2), 0.5, dtype=torch.float64)  # noqa: E741
    O[0] = torch.tensor([[p, 1 - p], [1 - p, p]], dtype=torch.float64)
    R = torch.tensor([[-1.0, -100.0, 10.0], [-1.0, 10.0, -100.0]], dtype=torch.float64)
    return TabularPOMDP(T=T, R=R, O=O, gamma=float(gamma), b0=torch.full((2,), 0.5, dtype=torch.float64),
                        state_names=("tiger-left", "tiger-right"),
                        action_names=("listen", "open-left", "open-right"),
                        observation_names=("hear-left", "hear-right"))


@dataclasses.dataclass(frozen=True, eq=False)
class Episodes:
    """``n`` sampled episodes of ``T`` steps: ``states`` ``(n, T+1)``, ``actions`` ``(n, T)``,
    ``rewards`` ``(n, T)`` float64 and ``done`` ``(n, T+1)`` (True once a terminal state is reached)."""

    states: torch.Tensor
    actions: torch.Tensor
    rewards: torch.Tensor
    done: torch.Tensor


def sample_episodes(mdp: TabularMDP, pi, n: int, T: int, generator: torch.Generator, s0=None) -> Episodes:
    """Roll out ``n`` episodes of ``T`` steps of policy ``pi`` in ``mdp`` with a seeded ``generator``.

    ``pi``: ``(S, A)`` action probabilities, or ``(S,)`` integer actions of a deterministic policy.
    ``s0``: an int start state for all episodes, or None to draw from ``mdp.mu0``. The reward of a step is
    ``R[s, a, s']`` (the expected reward of the transition). After a terminal state the episode idles there
    with zero reward (absorbing convention).

    >>> mdp = from_gymnasium("FrozenLake-v1", is_slippery=False)
    >>> ep = sample_episodes(mdp, torch.full((16,), 2), n=1, T=3, generator=torch.Generator().manual_seed(0))
    >>> ep.states.tolist(), ep.rewards.tolist()
    ([[0, 1, 2, 3]], [[0.0, 0.0, 0.0]])
    """
    n, T = check_positive_int(n, "n"), check_int(T, "T", low=0)
    pi = torch.as_tensor(pi)
    if pi.dtype in (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8):
        if pi.shape != (mdp.S,) or (pi < 0).any() or (pi >= mdp.A).any():
            raise ValueError(f"a deterministic pi must be ({mdp.S},) actions in [0, {mdp.A}), got {tuple(pi.shape)}")
        pi = torch.nn.functional.one_hot(pi.long(), mdp.A).double()
    else:
        pi = pi.double()
        if pi.shape != (mdp.S, mdp.A):
            raise ValueError(f"pi must be (S, A) = ({mdp.S}, {mdp.A}) probabilities, got {tuple(pi.shape)}")
        row_err = (pi.sum(-1) - 1).abs().max().item()
        if not torch.isfinite(pi).all() or (pi < 0).any() or row_err > 1e-6:
            raise ValueError(f"pi's rows must be probabilities (non-negative, summing to 1); the worst row is off by "
                             f"{row_err:.3g}")
    if s0 is None:
        s = torch.multinomial(mdp.mu0.expand(n, -1), 1, generator=generator).squeeze(1)
    else:
        s = torch.full((n,), check_int(s0, "s0", low=0, high=mdp.S - 1), dtype=torch.long)
    states, actions, rewards = [s], [], []
    for _ in range(T):
        a = torch.multinomial(pi[s], 1, generator=generator).squeeze(1)
        s2 = torch.multinomial(mdp.P[s, a], 1, generator=generator).squeeze(1)
        rewards.append(mdp.R[s, a, s2])
        actions.append(a)
        states.append(s2)
        s = s2
    st = torch.stack(states, 1)
    empty = torch.zeros(n, 0)
    return Episodes(states=st, actions=torch.stack(actions, 1) if T else empty.long(),
                    rewards=torch.stack(rewards, 1) if T else empty.double(), done=mdp.terminal[st])
