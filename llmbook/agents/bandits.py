r"""Multi-armed bandits: exploration rules, Thompson sampling and EXP3.

A bandit is a one-state MDP: at every round :math:`t` the agent pulls one of :math:`K` arms and sees
only that arm's reward. The rules here turn the agent's estimates into a choice.

* **Epsilon-greedy** (36.01, :func:`epsilon_greedy`): the greedy arm with probability
  :math:`1-\epsilon`, a uniform arm otherwise; returned as the action distribution.
* **Boltzmann** (36.02, :func:`boltzmann`): :math:`\mathrm{softmax}(Q/\tau)`, the sampling
  temperature of chapter 9; :math:`\tau = 0` is the greedy rule, not a division by zero.
* **UCB1** (36.03, :func:`ucb1`, Auer, Cesa-Bianchi & Fischer 2002): the mean plus
  :math:`c\sqrt{\ln t / N_a}`; an arm never pulled scores :math:`+\infty`.
* **Thompson sampling** (36.05, :func:`thompson_sampling`, Thompson 1933): one draw from each arm's
  Beta posterior, then the argmax.
* **EXP3** (36.07, :func:`exp3_probabilities` and :func:`exp3_update`, Auer et al. 2002): exponential
  weights mixed with :math:`\gamma/K` uniform exploration, with an importance-weighted update.

The cumulative regret (36.04), the theoretical bounds and a vectorised simulator of these rules on
Bernoulli arms live in :mod:`llmbook.agents.regret`.

Shapes: values ``(..., K)`` (any batch of runs in front); results keep the input's floating dtype and
are computed in float32 or wider.

>>> Q = torch.tensor([0.2, 0.5, 0.1])
>>> epsilon_greedy(Q, 0.3).tolist()
[0.10000000149011612, 0.800000011920929, 0.10000000149011612]
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np
import torch

from llmbook._checks import (
    as_tensor,
    check_dim,
    check_finite,
    check_int,
    check_integer_tensor,
    check_nonempty,
    check_range,
    check_unit_interval,
)
from llmbook._precision import compute_dtype
from llmbook.registry import implements

__all__ = ["epsilon_greedy", "boltzmann", "ucb1", "ThompsonDraw", "thompson_sampling", "exp3_probabilities",
           "exp3_update"]


def _values(Q, name: str = "Q") -> torch.Tensor:
    """``Q`` as a finite ``(..., K)`` floating tensor with K >= 1."""
    t = as_tensor(Q, name)
    check_dim(t, name, "(..., K)")
    check_nonempty(t, name)
    check_finite(t, name)
    return t


def _greedy(Q: torch.Tensor) -> torch.Tensor:
    """The uniform distribution over the maximisers of ``Q`` along the last axis (ties share)."""
    top = (Q == Q.amax(-1, keepdim=True)).to(compute_dtype(Q.dtype))
    return top / top.sum(-1, keepdim=True)


@implements("36.01")
def epsilon_greedy(Q, epsilon: float) -> torch.Tensor:
    r"""The epsilon-greedy action distribution over K arms.

    .. math:: P(a) = (1-\epsilon)\,\frac{\mathbb 1[a \in \arg\max_b Q(b)]}{|\arg\max_b Q(b)|} + \frac{\epsilon}{K}

    Symbols: ``Q`` = :math:`Q(s,\cdot)` ``(..., K)``, ``epsilon`` = :math:`\epsilon\in[0,1]`. Tied
    maxima share the greedy mass. Returns ``(..., K)`` probabilities in ``Q``'s dtype.

    >>> epsilon_greedy(torch.tensor([1.0, 3.0, 3.0]), 0.0).tolist()
    [0.0, 0.5, 0.5]
    """
    Q = _values(Q)
    epsilon = check_unit_interval(epsilon, "epsilon")
    K = Q.shape[-1]
    return ((1 - epsilon) * _greedy(Q) + epsilon / K).to(Q.dtype)


@implements("36.02")
def boltzmann(Q, tau: float) -> torch.Tensor:
    r"""Boltzmann (softmax) exploration with temperature :math:`\tau`.

    .. math:: P(a) = \frac{\exp(Q(a)/\tau)}{\sum_b \exp(Q(b)/\tau)}

    Symbols: ``Q`` ``(..., K)``, ``tau`` = :math:`\tau \ge 0`. The maximum is subtracted before the
    division, so no logit overflows; ``tau = 0`` returns the greedy limit (uniform over the maxima),
    as chapter 9's sampler treats temperature 0. Returns ``(..., K)`` in ``Q``'s dtype.

    >>> [round(p, 4) for p in boltzmann(torch.tensor([0.0, 1.0]), 1.0).tolist()]
    [0.2689, 0.7311]
    """
    Q = _values(Q)
    tau = check_range(tau, "tau", 0.0)
    Qc = Q.to(compute_dtype(Q.dtype))
    if tau == 0.0:
        return _greedy(Qc).to(Q.dtype)
    z = (Qc - Qc.amax(-1, keepdim=True)) / tau
    return torch.softmax(z, -1).to(Q.dtype)


@implements("36.03")
def ucb1(mu_hat, N, t: int, c: float = math.sqrt(2.0)) -> torch.Tensor:
    r"""UCB1 scores: the empirical mean plus an exploration bonus that shrinks as an arm is pulled.

    .. math:: \mathrm{UCB}_a = \hat\mu_a + c\sqrt{\frac{\ln t}{N_a}}

    Symbols: ``mu_hat`` = :math:`\hat\mu_a` ``(..., K)``, ``N`` = pull counts :math:`N_a \ge 0`
    (same shape), ``t`` = the round (:math:`t\ge 1`), ``c`` = :math:`c \ge 0` (Auer et al.: :math:`\sqrt2`).
    An arm with :math:`N_a = 0` scores :math:`+\infty`, so every arm is tried once first. The
    agent plays :math:`\arg\max_a \mathrm{UCB}_a`. Returns ``(..., K)``.

    >>> [round(v, 4) for v in ucb1(torch.tensor([0.5, 0.6]), torch.tensor([4.0, 1.0]), 5).tolist()]
    [1.3971, 2.3941]
    """
    mu_hat = _values(mu_hat, "mu_hat")
    N = as_tensor(N, "N")
    check_finite(N, "N")
    if N.shape != mu_hat.shape:
        raise ValueError(f"N {tuple(N.shape)} must have the shape of mu_hat {tuple(mu_hat.shape)}")
    if (N < 0).any():
        raise ValueError("N must hold non-negative pull counts")
    t = check_int(t, "t", low=1)
    c = check_range(c, "c", 0.0)
    dt = compute_dtype(torch.promote_types(mu_hat.dtype, N.dtype))
    Nd = N.to(dt)
    bonus = c * torch.sqrt(math.log(t) / Nd.clamp_min(torch.finfo(dt).tiny))
    bonus = torch.where(Nd > 0, bonus, torch.full_like(bonus, math.inf))
    return (mu_hat.to(dt) + bonus).to(mu_hat.dtype)


class ThompsonDraw(NamedTuple):
    action: torch.Tensor  # (...,) the arm with the largest draw
    theta: torch.Tensor  # (..., K) the posterior draws
    alpha: torch.Tensor  # (..., K) posterior Beta parameters
    beta: torch.Tensor


def _seed_from(generator) -> np.random.Generator:
    if generator is None:
        return np.random.default_rng()
    if isinstance(generator, np.random.Generator):
        return generator
    if isinstance(generator, torch.Generator):
        return np.random.default_rng(int(torch.randint(2**62, (1,), generator=generator)))
    raise TypeError(f"generator must be a torch.Generator, a numpy Generator or None, got {type(generator).__name__}")


@implements("36.05")
def thompson_sampling(successes, failures, alpha0: float = 1.0, beta0: float = 1.0, generator=None) -> ThompsonDraw:
    r"""Thompson sampling for Bernoulli arms with a conjugate Beta prior.

    .. math:: \tilde\mu_a \sim \mathrm{Beta}(\alpha_0 + S_a,\ \beta_0 + F_a), \qquad a_t = \arg\max_a \tilde\mu_a

    Symbols: ``successes`` = :math:`S_a`, ``failures`` = :math:`F_a` (non-negative counts, ``(..., K)``),
    ``alpha0, beta0`` = the prior (1, 1: uniform). The draw uses numpy's Beta sampler, seeded from
    ``generator`` (a ``torch.Generator`` or ``numpy.random.Generator``). Returns
    :class:`ThompsonDraw` ``(action, theta, alpha, beta)``; ``action`` is int64 ``(...,)``.

    >>> g = torch.Generator().manual_seed(0)
    >>> d = thompson_sampling(torch.tensor([3.0, 0.0]), torch.tensor([1.0, 2.0]), generator=g)
    >>> d.alpha.tolist(), d.beta.tolist()
    ([4.0, 1.0], [2.0, 3.0])
    """
    S, F = _values(successes, "successes"), _values(failures, "failures")
    if S.shape != F.shape:
        raise ValueError(f"successes {tuple(S.shape)} and failures {tuple(F.shape)} must have the same shape")
    if (S < 0).any() or (F < 0).any():
        raise ValueError("successes and failures must be non-negative counts")
    alpha0 = check_range(alpha0, "alpha0", 0.0, low_open=True)
    beta0 = check_range(beta0, "beta0", 0.0, low_open=True)
    rng = _seed_from(generator)
    dt = compute_dtype(torch.promote_types(S.dtype, F.dtype))
    alpha, beta = alpha0 + S.to(dt), beta0 + F.to(dt)
    theta = torch.from_numpy(rng.beta(alpha.double().numpy(), beta.double().numpy()).reshape(alpha.shape))
    return ThompsonDraw(theta.argmax(-1), theta.to(S.dtype), alpha.to(S.dtype), beta.to(S.dtype))


@implements("36.07")
def exp3_probabilities(log_w, gamma: float) -> torch.Tensor:
    r"""EXP3's sampling distribution: exponential weights mixed with uniform exploration.

    .. math:: p_{t,i} = (1-\gamma)\frac{w_{t,i}}{\sum_j w_{t,j}} + \frac{\gamma}{K}

    Symbols: ``log_w`` = :math:`\ln w_{t,i}` ``(..., K)`` (weights kept in log space, so that they never
    overflow), ``gamma`` = :math:`\gamma \in [0, 1]`. Returns ``(..., K)``. See :func:`exp3_update`.

    >>> [round(p, 4) for p in exp3_probabilities(torch.tensor([0.0, 0.0, 1.0]), 0.3).tolist()]
    [0.2484, 0.2484, 0.5033]
    """
    log_w = _values(log_w, "log_w")
    gamma = check_unit_interval(gamma, "gamma")
    lw = log_w.to(compute_dtype(log_w.dtype))
    return ((1 - gamma) * torch.softmax(lw, -1) + gamma / lw.shape[-1]).to(log_w.dtype)


def exp3_update(log_w, p, action, reward, gamma: float) -> torch.Tensor:
    r"""EXP3's importance-weighted update of the pulled arm's log-weight.

    .. math:: \hat x_{t,i} = \frac{x_t}{p_{t,i}}\mathbb 1[i = a_t], \qquad
       \ln w_{t+1,i} = \ln w_{t,i} + \frac{\gamma\,\hat x_{t,i}}{K}

    ``log_w``, ``p`` ``(..., K)``; ``action`` ``(...,)`` int; ``reward`` ``(...,)`` in :math:`[0,1]`.
    Returns the new ``log_w``; the unbiased estimate :math:`\hat x` has expectation :math:`x` for every arm.
    """
    log_w, p = _values(log_w, "log_w"), _values(p, "p")
    a = check_integer_tensor(action, "action")
    x = as_tensor(reward, "reward").to(log_w.dtype)
    gamma = check_unit_interval(gamma, "gamma")
    K = log_w.shape[-1]
    if p.shape != log_w.shape:
        raise ValueError(f"p {tuple(p.shape)} must have the shape of log_w {tuple(log_w.shape)}")
    if a.shape != log_w.shape[:-1] or x.shape != a.shape:
        raise ValueError(f"action {tuple(a.shape)} and reward {tuple(x.shape)} must both be {tuple(log_w.shape[:-1])}")
    if a.numel() and (a.min() < 0 or a.max() >= K):
        raise ValueError(f"action must hold arm ids in [0, {K - 1}], got values in [{int(a.min())}, {int(a.max())}]")
    check_finite(x, "reward")
    onehot = torch.nn.functional.one_hot(a, K).to(log_w.dtype)
    p_a = (p * onehot).sum(-1)
    if (p_a <= 0).any():
        raise ValueError("the pulled arm's probability p[action] must be > 0 (EXP3 divides by it)")
    return log_w + onehot * (gamma * x / p_a / K).unsqueeze(-1)
