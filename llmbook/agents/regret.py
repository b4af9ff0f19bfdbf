r"""Regret of bandit algorithms: the exact cumulative regret, its theoretical orders, and simulation.

* **Cumulative regret** (36.04, :func:`cumulative_regret`): :math:`R_T = T\mu^* - \sum_t \mu_{a_t}`
  from the known means (the pseudo-regret, free of the reward noise).
* Theory: :func:`bernoulli_kl`; :func:`lai_robbins_constant`, the constant of Lai & Robbins' (1985)
  :math:`\Omega(\ln T)` lower bound; :func:`ucb1_regret_bound` (Auer, Cesa-Bianchi & Fischer 2002,
  Theorem 1); :func:`exp3_regret_bound` and :func:`exp3_gamma` (Auer et al. 2002, Corollary 3.2).
* :func:`simulate_bandit` runs any rule of :mod:`llmbook.agents.bandits` on Bernoulli arms, vectorised
  over independent seeded runs; :func:`mean_band` turns the runs into a mean curve with its confidence
  band (the mean over runs estimates the expected regret :math:`\mathbb E[R_T]`).

>>> cumulative_regret(torch.tensor([0.2, 0.7]), torch.tensor([[0, 0, 1]])).tolist()
[[0.5, 1.0, 1.0]]
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np
import torch

from llmbook._checks import as_tensor, check_choice, check_dim, check_int, check_integer_tensor
from llmbook.agents.bandits import (
    _values,
    boltzmann,
    epsilon_greedy,
    exp3_probabilities,
    exp3_update,
    thompson_sampling,
    ucb1,
)
from llmbook.registry import implements

__all__ = ["cumulative_regret", "bernoulli_kl", "lai_robbins_constant", "ucb1_regret_bound", "exp3_regret_bound",
           "exp3_gamma", "BanditRun", "POLICIES", "simulate_bandit", "mean_band"]


@implements("36.04")
def cumulative_regret(mu, actions) -> torch.Tensor:
    r"""Cumulative (pseudo-)regret of a sequence of pulls, from the known arm means.

    .. math:: R_T = T\mu^* - \sum_{t=1}^{T} \mu_{a_t} = \sum_a \Delta_a N_a(T)

    :math:`R_T` is random (the pulls are); its expectation over runs is the expected regret
    :math:`\mathbb E[R_T] = \sum_a \Delta_a\,\mathbb E[N_a(T)]` that the bounds speak of.

    Symbols: ``mu`` = :math:`\mu` ``(K,)``, the true means; ``actions`` = :math:`a_1..a_T` ``(..., T)``
    integer arm ids. Returns ``(..., T)``: :math:`R_1, \dots, R_T`, accumulated in float64 and
    returned in ``mu``'s dtype.

    >>> cumulative_regret(torch.tensor([0.1, 0.5]), torch.tensor([0, 1, 0])).tolist()
    [0.4000000059604645, 0.4000000059604645, 0.800000011920929]
    """
    mu = _values(mu, "mu")
    check_dim(mu, "mu", "(K,)", max_dim=1)
    a = check_integer_tensor(actions, "actions", "an integer tensor of arm ids")
    check_dim(a, "actions", "(..., T)")
    K = mu.shape[0]
    if a.numel() and (a.min() < 0 or a.max() >= K):
        raise ValueError(f"actions must be arm ids in [0, {K - 1}], got values in [{int(a.min())}, {int(a.max())}]")
    m = mu.double()
    gap = m.max() - m[a]
    return torch.cumsum(gap, -1).to(mu.dtype)

# ------------------------------------------------------------------------------------- theory


def bernoulli_kl(p, q) -> torch.Tensor:
    r"""Bernoulli KL divergence in float64:
    :math:`\mathrm{KL}(\mathrm{Ber}(p)\,\|\,\mathrm{Ber}(q)) = p\ln\frac pq + (1-p)\ln\frac{1-p}{1-q}`."""
    p, q = as_tensor(p, "p").double(), as_tensor(q, "q").double()
    return torch.special.xlogy(p, p / q) + torch.special.xlogy(1 - p, (1 - p) / (1 - q))


def lai_robbins_constant(mu) -> float:
    r"""Lai & Robbins' constant :math:`\sum_{a:\Delta_a>0} \Delta_a / \mathrm{KL}(\mu_a, \mu^*)`:
    every consistent policy has :math:`\liminf R_T / \ln T` at least this on Bernoulli arms."""
    mu = _values(mu, "mu").double()
    star = mu.max()
    sub = mu[mu < star]
    return float(((star - sub) / bernoulli_kl(sub, star)).sum())


def ucb1_regret_bound(mu, T) -> torch.Tensor:
    r"""Auer et al.'s Theorem 1 for UCB1 (:math:`c=\sqrt2`):
    :math:`\sum_{\Delta_a>0} 8\ln T/\Delta_a + (1+\pi^2/3)\sum_a \Delta_a`, for each ``T`` (float64)."""
    mu = _values(mu, "mu").double()
    gap = mu.max() - mu
    T = as_tensor(T, "T").double()
    return 8 * torch.log(T) * (1 / gap[gap > 0]).sum() + (1 + math.pi**2 / 3) * gap.sum()


def exp3_regret_bound(T, K: int) -> torch.Tensor:
    r"""Auer et al.'s Corollary 3.2 for EXP3 with the tuned :math:`\gamma`: :math:`2\sqrt{e-1}\sqrt{TK\ln K}`."""
    T = as_tensor(T, "T").double()
    return 2 * math.sqrt(math.e - 1) * torch.sqrt(T * K * math.log(K))


def exp3_gamma(T: int, K: int) -> float:
    r"""The tuned exploration rate :math:`\min\{1, \sqrt{K\ln K/((e-1)T)}\}` of Corollary 3.2."""
    return min(1.0, math.sqrt(K * math.log(K) / ((math.e - 1) * T)))


# ------------------------------------------------------------------------------------- simulation


class BanditRun(NamedTuple):
    actions: torch.Tensor  # (R, T) int64
    rewards: torch.Tensor  # (R, T) float64 in {0, 1}
    regret: torch.Tensor  # (R, T) cumulative pseudo-regret


POLICIES = ("epsilon_greedy", "boltzmann", "ucb1", "thompson", "exp3")


def simulate_bandit(mu, policy: str, T: int, runs: int = 20, seed: int = 0, **param) -> BanditRun:
    """Run ``policy`` for ``T`` rounds on Bernoulli arms with means ``mu``, ``runs`` independent runs at once.

    ``param``: ``epsilon`` (epsilon_greedy), ``tau`` (boltzmann), ``c`` (ucb1), ``gamma`` (exp3).
    The estimates start at 0 with no pulls; rewards are drawn from one seeded generator, so two
    policies with the same ``seed`` see the same reward table ``(T, K)`` per run.
    """
    check_choice(policy, "policy", POLICIES)
    mu = _values(mu, "mu").double()
    T, R = check_int(T, "T", low=1), check_int(runs, "runs", low=1)
    K = mu.shape[0]
    g = torch.Generator().manual_seed(seed)
    table = (torch.rand(R, T, K, generator=g, dtype=torch.float64) < mu).double()  # reward of every arm, every round
    u = torch.rand(T, R, 1, generator=g, dtype=torch.float64)  # the policy's own randomness
    rng = np.random.default_rng(seed)  # Thompson's Beta draws
    S, N = torch.zeros(R, K, dtype=torch.float64), torch.zeros(R, K, dtype=torch.float64)
    log_w = torch.zeros(R, K, dtype=torch.float64)
    actions = torch.empty(R, T, dtype=torch.int64)
    rows = torch.arange(R)
    for t in range(T):
        Q = S / N.clamp_min(1)
        if policy == "ucb1":
            a = ucb1(Q, N, t + 1, param.get("c", math.sqrt(2.0))).argmax(-1)
        elif policy == "thompson":
            a = thompson_sampling(S, N - S, generator=rng).action
        else:
            if policy == "epsilon_greedy":
                p = epsilon_greedy(Q, param.get("epsilon", 0.1))
            elif policy == "boltzmann":
                p = boltzmann(Q, param.get("tau", 0.1))
            else:
                p = exp3_probabilities(log_w, param["gamma"])
            a = torch.searchsorted(p.cumsum(-1), u[t]).squeeze(-1).clamp_max(K - 1)
        x = table[rows, t, a]
        if policy == "exp3":
            log_w = exp3_update(log_w, p, a, x, param["gamma"])
        S[rows, a] += x
        N[rows, a] += 1
        actions[:, t] = a
    rewards = table[rows[:, None], torch.arange(T), actions]
    return BanditRun(actions, rewards, cumulative_regret(mu, actions))


def mean_band(values, z: float = 1.96) -> tuple[torch.Tensor, torch.Tensor]:
    r"""Mean over runs and the half-width of its normal confidence band.

    .. math:: \bar R_t = \frac1n\sum_{i=1}^n R_t^{(i)}, \qquad
       h_t = z\,\frac{s_t}{\sqrt n},\quad s_t^2 = \frac{1}{n-1}\sum_i (R_t^{(i)} - \bar R_t)^2

    Symbols: ``values`` = :math:`R^{(i)}_t` ``(n, ...)`` with the runs on axis 0 (``n >= 2``); ``z`` the normal
    quantile (1.96: a 95 % interval for the mean; 1: one standard error). Returns ``(mean, half)``, each
    ``values.shape[1:]`` in float64: the band is ``mean - half .. mean + half``.

    >>> m, h = mean_band(torch.tensor([[1.0, 2.0], [3.0, 6.0]]), z=1.0)
    >>> m.tolist(), h.tolist()
    ([2.0, 4.0], [1.0, 2.0])
    """
    x = as_tensor(values, "values").double()
    if x.dim() < 1 or x.shape[0] < 2:
        raise ValueError(f"values must hold at least 2 runs on axis 0, got shape {tuple(x.shape)}")
    if not torch.isfinite(x).all():
        raise ValueError("values must be finite")
    z = float(z)
    if not (math.isfinite(z) and z > 0):
        raise ValueError(f"z must be a positive finite normal quantile, got {z}")
    return x.mean(0), z * x.std(0, correction=1) / math.sqrt(x.shape[0])
