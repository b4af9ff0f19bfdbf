r"""Eligibility traces: the backward view of TD(λ) (chapter 35).

The λ-return (:func:`llmbook.agents.returns.lambda_return`) is the *forward* view: a state's target needs
rewards from the future. The *backward* view gets the same effect online. Every state keeps an
**accumulating trace** :math:`e(s)`, decayed by :math:`\gamma\lambda` each step and raised by 1 when visited;
each TD error :math:`\delta_t` is credited to every state in proportion to its trace:

.. math::
    e_t(s)=\gamma\lambda\,e_{t-1}(s)+\mathbb 1[s=s_t],\qquad
    \delta_t=r_{t+1}+\gamma V(s_{t+1})-V(s_t),\qquad
    V(s)\leftarrow V(s)+\alpha\,\delta_t\,e_t(s).

With the values frozen during an episode and the increments summed at its end (*offline*), the total
increment of the backward view equals that of the forward view, :math:`\alpha\sum_t(G^\lambda_t-V(s_t))
\mathbb 1[s=s_t]` (Sutton and Barto, section 12.4). :func:`td_lambda_step` is one online step,
:func:`offline_td_lambda_increment` the offline sum over one episode, :func:`run_td_lambda` a seeded
prediction run of many learners (seeds, λ) side by side on a :class:`~llmbook.agents.envs.TabularMDP`.

Conventions: ``V``, ``e`` ``(..., S)`` (leading axes: independent learners); ``s``, ``s_next`` long,
``r`` float, ``done`` bool, each ``(...)``; ``gamma``, ``lam``, ``alpha`` in [0, 1]. float64 throughout.

>>> V, e = td_lambda_step(torch.zeros(3), torch.zeros(3), 0, 1.0, 1, False, alpha=0.5, gamma=1.0, lam=0.5)
>>> V.tolist(), e.tolist()
([0.5, 0.0, 0.0], [1.0, 0.0, 0.0])
"""

from __future__ import annotations

import torch

from llmbook._checks import as_tensor, check_int, check_positive_int, check_unit_interval
from llmbook.agents.envs import TabularMDP

__all__ = ["td_lambda_step", "offline_td_lambda_increment", "run_td_lambda"]


def _check(V, e, s, s_next):
    V, e = as_tensor(V, "V").double(), as_tensor(e, "e").double()
    if V.dim() < 1 or V.shape[-1] == 0 or e.shape != V.shape:
        raise ValueError(f"V and e must be (..., S) tables of one shape, got {tuple(V.shape)} and {tuple(e.shape)}")
    S = V.shape[-1]
    s, s_next = torch.as_tensor(s).long(), torch.as_tensor(s_next).long()
    for name, x in (("s", s), ("s_next", s_next)):
        if x.shape != V.shape[:-1]:
            raise ValueError(f"{name} must have shape {tuple(V.shape[:-1])} (one state per learner), "
                             f"got {tuple(x.shape)}")
        if x.numel() and (x.min() < 0 or x.max() >= S):
            raise ValueError(f"{name} must hold states in [0, {S}), got values in [{x.min().item()}, {x.max().item()}]")
    return V, e, s, s_next


def td_lambda_step(V, e, s, r, s_next, done, *, alpha: float, gamma: float, lam: float):
    r"""One online step of TD(λ) with accumulating traces: :math:`e\leftarrow\gamma\lambda e+\mathbb 1[s]`,
    :math:`V\leftarrow V+\alpha\delta e`, :math:`\delta=r+\gamma(1-d)V(s')-V(s)`.

    ``V``, ``e`` ``(..., S)``; ``s``, ``r``, ``s_next``, ``done`` ``(...)``; ``lam`` a number or ``(...)``
    (one per learner). Returns the new
    ``(V, e)``; the returned trace is zero where ``done`` (the next episode starts with no eligibility).

    >>> V, e = td_lambda_step(torch.zeros(2), torch.tensor([1.0, 0.0]), 1, 1.0, 0, True,
    ...                       alpha=1.0, gamma=0.5, lam=1.0)
    >>> V.tolist(), e.tolist()
    ([0.5, 1.0], [0.0, 0.0])
    """
    V, e, s, s_next = _check(V, e, s, s_next)
    alpha, gamma = check_unit_interval(alpha, "alpha"), check_unit_interval(gamma, "gamma")
    lam = torch.as_tensor(lam, dtype=torch.float64)
    if lam.dim() and lam.shape != s.shape:
        raise ValueError(f"lam must be a number or one per learner, shape {tuple(s.shape)}, got {tuple(lam.shape)}")
    if not ((lam >= 0) & (lam <= 1)).all():
        raise ValueError(f"lam must lie in [0, 1], got {lam.tolist()}")
    r = torch.as_tensor(r, dtype=torch.float64)
    d = torch.as_tensor(done, dtype=torch.bool)
    if r.shape != s.shape or d.shape != s.shape:
        raise ValueError(f"r and done must have shape {tuple(s.shape)}, got {tuple(r.shape)} and {tuple(d.shape)}")
    if not torch.isfinite(r).all():
        raise ValueError("r must be finite")
    v_s = V.gather(-1, s.unsqueeze(-1)).squeeze(-1)
    v_next = torch.where(d, 0.0, V.gather(-1, s_next.unsqueeze(-1)).squeeze(-1))
    delta = r + gamma * v_next - v_s
    e = gamma * lam.unsqueeze(-1) * e
    e = e.scatter_add(-1, s.unsqueeze(-1), torch.ones_like(v_s).unsqueeze(-1))
    V = V + alpha * delta.unsqueeze(-1) * e
    return V, torch.where(d.unsqueeze(-1), 0.0, e)


def offline_td_lambda_increment(V, states, r, *, alpha: float, gamma: float, lam: float) -> torch.Tensor:
    r"""The backward view's total increment over one complete episode with ``V`` frozen:
    :math:`\Delta V(s)=\alpha\sum_{t=0}^{T-1}\delta_t\,e_t(s)`.

    ``V`` ``(S,)``; ``states`` ``(T + 1,)`` the states visited, the last one terminal (its value is taken as
    0); ``r`` ``(T,)`` the rewards. Returns :math:`\Delta V` ``(S,)``.

    >>> offline_td_lambda_increment(torch.zeros(3), torch.tensor([0, 1, 2]), torch.tensor([0.0, 1.0]),
    ...                             alpha=1.0, gamma=1.0, lam=1.0).tolist()
    [1.0, 1.0, 0.0]
    """
    V = as_tensor(V, "V").double()
    states, r = torch.as_tensor(states).long(), torch.as_tensor(r, dtype=torch.float64)
    if V.dim() != 1 or states.dim() != 1 or r.shape != (states.shape[0] - 1,):
        raise ValueError(f"V must be (S,), states (T + 1,) and r (T,), got {tuple(V.shape)}, {tuple(states.shape)} "
                         f"and {tuple(r.shape)}")
    T = r.shape[0]
    lam = check_unit_interval(lam, "lam")
    e, total = torch.zeros_like(V), torch.zeros_like(V)
    for t in range(T):
        v_next = 0.0 if t == T - 1 else V[states[t + 1]].item()
        delta = r[t].item() + gamma * v_next - V[states[t]].item()
        e = gamma * lam * e
        e[states[t]] += 1.0
        total = total + alpha * delta * e
    return total


def run_td_lambda(mdp: TabularMDP, pi, n_episodes: int, lams, *, alpha: float = 0.05, n_seeds: int = 10,
                  gamma: float | None = None, seed: int = 0, max_steps: int = 1000) -> torch.Tensor:
    r"""Online TD(λ) prediction of the policy ``pi`` ``(S, A)`` on ``mdp``, ``n_seeds`` learners per λ in ``lams``.

    All ``len(lams) * n_seeds`` learners step in lockstep, each in its own copy of the environment and
    restarting from ``mdp.mu0`` after each of its episodes (a terminal state, or ``max_steps`` steps); values
    start at 0. Random numbers from ``torch.Generator().manual_seed(seed)``. Returns the values after every
    episode, ``(n_episodes + 1, len(lams), n_seeds, S)`` float64 (index 0: before learning).
    """
    lams = [check_unit_interval(x, "lams[i]") for x in lams]
    n_episodes, n_seeds = check_positive_int(n_episodes, "n_episodes"), check_positive_int(n_seeds, "n_seeds")
    alpha = check_unit_interval(alpha, "alpha")
    gamma = mdp.gamma if gamma is None else check_unit_interval(gamma, "gamma")
    pi = as_tensor(pi, "pi").double()
    if pi.shape != (mdp.S, mdp.A):
        raise ValueError(f"pi must be (S, A) = ({mdp.S}, {mdp.A}), got {tuple(pi.shape)}")
    g = torch.Generator().manual_seed(check_int(seed, "seed"))
    L, S = len(lams) * n_seeds, mdp.S
    lam_k = torch.tensor(lams, dtype=torch.float64).repeat_interleave(n_seeds)
    pi_c, cum, mu_c = pi.cumsum(-1), mdp.P.cumsum(-1), mdp.mu0.cumsum(0)

    def draw(c):
        u = torch.rand(*c.shape[:-1], 1, generator=g, dtype=torch.float64) * c[..., -1:]
        return torch.searchsorted(c.contiguous(), u).squeeze(-1).clamp_max(c.shape[-1] - 1)

    V, e = torch.zeros(L, S, dtype=torch.float64), torch.zeros(L, S, dtype=torch.float64)
    s = draw(mu_c.expand(L, -1))
    ep, t = torch.zeros(L, dtype=torch.long), torch.zeros(L, dtype=torch.long)
    hist = torch.zeros(n_episodes + 1, L, S, dtype=torch.float64)
    lanes = torch.arange(L)
    while (ep < n_episodes).any():
        live = ep < n_episodes
        a = draw(pi_c[s])
        s2 = draw(cum[s, a])
        r, done = mdp.R[s, a, s2], mdp.terminal[s2]
        V_new, e = td_lambda_step(V, e, s, r, s2, done, alpha=alpha, gamma=gamma, lam=lam_k)
        V = torch.where(live[:, None], V_new, V)
        t += 1
        end = live & (done | (t >= max_steps))
        if end.any():
            k = lanes[end]
            hist[ep[k] + 1, k] = V[k]
            ep[k] += 1
            e[k], t[k] = 0.0, 0
            s2 = torch.where(end, draw(mu_c.expand(L, -1)), s2)
        s = s2
    return hist.reshape(n_episodes + 1, len(lams), n_seeds, S)
