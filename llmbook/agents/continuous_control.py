r"""Continuous control and off-policy actor-critic (chapter 34): DDPG, the deterministic policy gradient,
TD3, SAC (objective, soft value, tanh-Gaussian log-probability) and IMPALA's V-trace.

Batch-first: a batch of ``B`` transitions :math:`(s, a, r, s', d)` gives ``r`` ``(B,)``, ``dones`` ``(B,)``
(optional; True when :math:`s'` is terminal, worth 0) and critic values ``(B,)``; action vectors are
``(B, d_a)``. The functions take the *numbers* the networks produced (critic outputs, Jacobians, samples), so
they are independent of any network library; the notebook shows them inside small torch models. V-trace uses
the rollout layout of :mod:`llmbook.agents.returns`: ``r`` ``(B, T)``, ``V`` ``(B, T + 1)``. fp16 / bf16
inputs are computed in float32 and rounded back once.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from jaxtyping import Float
from torch import Tensor

from llmbook._checks import (
    as_tensor,
    check_dim,
    check_finite,
    check_range,
    check_same_shape,
    check_unit_interval,
)
from llmbook._precision import compute_dtype, restore_half
from llmbook.agents import returns as _ret
from llmbook.registry import implements

__all__ = ["ddpg_critic_loss", "deterministic_policy_gradient", "td3_target", "td3_target_action",
           "sac_objective", "sac_soft_value", "tanh_gaussian_log_prob", "vtrace"]


def _vec(x, name: str) -> Tensor:
    x = as_tensor(x, name)
    check_dim(x, name, "(B,)", min_dim=1, max_dim=1)
    check_finite(x, name)
    return x


def _not_done(dones, like: Tensor, dt: torch.dtype) -> Tensor:
    if dones is None:
        return torch.ones(like.shape, dtype=dt)
    d = as_tensor(dones, "dones", floating=False)
    if tuple(d.shape) != tuple(like.shape):
        raise ValueError(f"dones must have the shape of r {tuple(like.shape)}, got {tuple(d.shape)}")
    if d.dtype != torch.bool and d.numel() and not ((d == 0) | (d == 1)).all():
        raise ValueError("dones must be bool or 0/1 flags")
    return 1 - d.to(dt)


def _bootstrap(r, Q_next, gamma, dones, name: str) -> tuple[Tensor, torch.dtype]:
    r = _vec(r, "r")
    Q_next = _vec(Q_next, name)
    check_same_shape(r, Q_next, "r", name)
    gamma = check_unit_interval(gamma, "gamma")
    out = torch.promote_types(r.dtype, Q_next.dtype)
    dt = compute_dtype(out)
    return r.to(dt) + gamma * _not_done(dones, r, dt) * Q_next.to(dt), out


@implements("34.07")
def ddpg_critic_loss(Q: Float[Tensor, " B"], r: Float[Tensor, " B"], Q_next: Float[Tensor, " B"],
                     gamma: float = 0.99, dones=None) -> Float[Tensor, ""]:
    r"""DDPG's critic loss (Lillicrap et al., 2016): regression on a target computed by *target* networks,

    .. math:: \mathcal L=\mathbb E[(Q_\phi(s,a)-(r+\gamma Q_{\phi'}(s',\mu_{\theta'}(s'))))^2]

    ``Q`` ``(B,)`` :math:`Q_\phi(s,a)` (with its graph), ``Q_next`` ``(B,)`` the target critic at the target
    actor's action :math:`Q_{\phi'}(s',\mu_{\theta'}(s'))` (detached: no gradient flows into the target),
    ``dones`` ``(B,)`` cut the bootstrap. Returns the batch mean (0 for an empty batch).

    >>> ddpg_critic_loss(torch.tensor([1.0, 0.0]), torch.tensor([1.0, 1.0]), torch.tensor([2.0, 0.0]), gamma=0.5)
    tensor(1.)
    """
    y, out = _bootstrap(r, Q_next.detach() if isinstance(Q_next, Tensor) else Q_next, gamma, dones, "Q_next")
    Q = _vec(Q, "Q")
    check_same_shape(Q, y, "Q", "r")
    diff2 = (Q.to(y.dtype) - y.detach()) ** 2
    return restore_half(diff2.mean() if diff2.numel() else diff2.sum(), torch.promote_types(out, Q.dtype))


@implements("34.08")
def deterministic_policy_gradient(dQ_da: Float[Tensor, "B d_a"], dmu_dtheta: Float[Tensor, "B d_a P"]
                                  ) -> Float[Tensor, " P"]:
    r"""The deterministic policy gradient (Silver et al., 2014) by the chain rule, averaged over states:

    .. math:: \nabla_\theta J\approx\mathbb E[\nabla_aQ_\phi(s,a)|_{a=\mu_\theta(s)}\nabla_\theta\mu_\theta(s)]

    ``dQ_da`` ``(B, d_a)`` the critic's action gradient at :math:`a=\mu_\theta(s)`, ``dmu_dtheta``
    ``(B, d_a, P)`` the actor's Jacobian over ``P`` parameters -> ``(P,)``. In practice one calls
    ``(-Q(s, mu(s))).mean().backward()``, which autograd turns into exactly this product (the tests check it).

    >>> deterministic_policy_gradient(torch.tensor([[2.0]]), torch.tensor([[[1.0, 3.0]]]))
    tensor([2., 6.])
    """
    g = as_tensor(dQ_da, "dQ_da")
    check_dim(g, "dQ_da", "(B, d_a)", min_dim=2, max_dim=2)
    J = as_tensor(dmu_dtheta, "dmu_dtheta")
    check_dim(J, "dmu_dtheta", "(B, d_a, P)", min_dim=3, max_dim=3)
    if tuple(J.shape[:2]) != tuple(g.shape):
        raise ValueError(f"dmu_dtheta must be (B, d_a, P) with (B, d_a) = {tuple(g.shape)} like dQ_da, "
                         f"got {tuple(J.shape)}")
    check_finite(g, "dQ_da")
    check_finite(J, "dmu_dtheta")
    out = torch.promote_types(g.dtype, J.dtype)
    dt = compute_dtype(out)
    B = g.shape[0]
    total = torch.einsum("ba,bap->p", g.to(dt), J.to(dt))
    return restore_half(total / B if B else total, out)


def td3_target_action(mu_next: Tensor, eps: Tensor, sigma: float = 0.2, noise_clip: float = 0.5,
                      a_max: float = 1.0, *, a_low=None, a_high=None) -> Tensor:
    r"""TD3's target-policy smoothing (Fujimoto et al., 2018: the noise clip of eq. 15 and Algorithm 1, the box clip
    of the authors' code):

    .. math:: \tilde a=\mathrm{clip}\big(\mu_{\theta'}(s')+\epsilon,\ a_{low},\ a_{high}\big),\qquad
              \epsilon=\mathrm{clip}(\sigma\xi,\,-c,\,c),\quad \xi\sim\mathcal N(0, 1)

    i.e. :math:`\epsilon\sim\mathrm{clip}(\mathcal N(0,\sigma^2),-c,c)`: the noise is clipped first, then the
    noisy action is clipped to the action box (``(actor_target(s') + noise).clamp(-max_action, max_action)`` in
    the authors' TD3.py). ``mu_next`` ``(..., d_a)`` the target
    actor's actions, ``eps`` the standard-normal draws :math:`\xi` of the same shape (passed in: no hidden
    randomness), ``sigma`` and ``noise_clip`` :math:`c` in action units. The box is
    :math:`[-a_{max}, a_{max}]`, or ``[a_low, a_high]`` when given (scalars or ``(d_a,)``, e.g. a gymnasium
    ``Box``'s ``low`` and ``high``). Returns the shape and dtype of ``mu_next``.

    >>> a = td3_target_action(torch.tensor([0.9, 0.0]), torch.tensor([5.0, -1.0]), sigma=0.2, noise_clip=0.5)
    >>> [round(x, 4) for x in a.tolist()]   # 0.9 + 0.5 (the noise 1.0 clipped to c) = 1.4, then the box: 1.0
    [1.0, -0.2]
    """
    mu_next, eps = as_tensor(mu_next, "mu_next"), as_tensor(eps, "eps")
    check_same_shape(mu_next, eps, "mu_next", "eps")
    check_finite(mu_next, "mu_next")
    check_finite(eps, "eps")
    sigma = check_range(sigma, "sigma", 0.0)
    noise_clip = check_range(noise_clip, "noise_clip", 0.0)
    a_max = check_range(a_max, "a_max", 0.0, low_open=True)
    low_t = torch.as_tensor(-a_max if a_low is None else a_low, dtype=mu_next.dtype)
    high_t = torch.as_tensor(a_max if a_high is None else a_high, dtype=mu_next.dtype)
    d_a = mu_next.shape[-1] if mu_next.dim() else 1
    if any(x.dim() > 1 or (x.dim() == 1 and x.shape[0] != d_a) for x in (low_t, high_t)):
        raise ValueError(f"a_low and a_high must be scalars or (d_a,) = ({d_a},), got {tuple(low_t.shape)} and "
                         f"{tuple(high_t.shape)}")
    if not (torch.isfinite(low_t).all() and torch.isfinite(high_t).all() and (low_t <= high_t).all()):
        raise ValueError(f"the action box must be finite with a_low <= a_high, got a_low = {low_t.tolist()}, "
                         f"a_high = {high_t.tolist()}")
    noise = (sigma * eps).clamp(-noise_clip, noise_clip)
    return torch.minimum(torch.maximum(mu_next + noise, low_t), high_t)


@implements("34.09")
def td3_target(r: Float[Tensor, " B"], Q1_next: Float[Tensor, " B"], Q2_next: Float[Tensor, " B"],
               gamma: float = 0.99, dones=None) -> Float[Tensor, " B"]:
    r"""TD3's clipped double-Q target (Fujimoto et al., 2018):

    .. math:: y=r+\gamma\min_{i=1,2}Q_{\phi_i'}(s',\mu_{\theta'}(s')+\epsilon)

    ``Q1_next``, ``Q2_next`` ``(B,)``: the two target critics at the *smoothed* target action
    (:func:`td3_target_action`: clipped Gaussian noise, clipped to the action box). The minimum counters the
    over-estimation a max over noisy critics produces. Returns ``(B,)`` (detached).

    >>> td3_target(torch.tensor([1.0]), torch.tensor([4.0]), torch.tensor([2.0]), gamma=0.5)
    tensor([2.])
    """
    Q1, Q2 = _vec(Q1_next, "Q1_next"), _vec(Q2_next, "Q2_next")
    check_same_shape(Q1, Q2, "Q1_next", "Q2_next")
    y, out = _bootstrap(r, torch.minimum(Q1.detach(), Q2.detach().to(Q1.dtype)), gamma, dones, "Q1_next")
    return restore_half(y, torch.promote_types(out, Q2.dtype))


@implements("34.10")
def sac_objective(r: Float[Tensor, "B T"], H: Float[Tensor, "B T"], alpha: float = 0.2, gamma: float = 0.99
                  ) -> Float[Tensor, " B"]:
    r"""The maximum-entropy objective of SAC (Haarnoja et al., 2018), per trajectory:

    .. math:: J(\pi)=\mathbb E\Big[\sum_t\gamma^t(r(s_t,a_t)+\alpha\mathcal H(\pi(\cdot\mid s_t)))\Big]

    ``r`` ``(B, T)`` rewards, ``H`` ``(B, T)`` the policy's entropy at each visited state (or its one-sample
    estimate :math:`-\log\pi(a_t\mid s_t)`), ``alpha`` :math:`\ge 0` the temperature. Returns ``(B,)``, the
    soft discounted return of each row (its mean estimates :math:`J`); it is
    :func:`llmbook.agents.returns.monte_carlo_return` of the entropy-augmented reward, at :math:`t = 0`.

    >>> sac_objective(torch.tensor([[1.0, 1.0]]), torch.tensor([[1.0, 2.0]]), alpha=0.5, gamma=0.5)
    tensor([2.5000])
    """
    r = _ret._rewards(r)
    H = as_tensor(H, "H")
    check_same_shape(r, H, "r", "H")
    check_finite(H, "H")
    alpha = check_range(alpha, "alpha", 0.0)
    out = torch.promote_types(r.dtype, H.dtype)
    dt = compute_dtype(out)
    if r.shape[1] == 0:
        return torch.zeros(r.shape[0], dtype=out)
    G = _ret.monte_carlo_return(r.to(dt) + alpha * H.to(dt), gamma)
    return restore_half(G[:, 0], out)


@implements("34.11")
def sac_soft_value(Q: Float[Tensor, "B K"], logp: Float[Tensor, "B K"], alpha: float = 0.2) -> Float[Tensor, " B"]:
    r"""SAC's soft state value, estimated from ``K`` actions sampled from the policy in each state:

    .. math:: V(s)=\mathbb E_{a\sim\pi}[Q(s,a)-\alpha\log\pi(a\mid s)]

    ``Q`` ``(B, K)`` the critic at the sampled actions, ``logp`` ``(B, K)`` their log-probabilities (for a
    squashed Gaussian policy: :func:`tanh_gaussian_log_prob`). Returns ``(B,)``, the mean over the samples;
    SAC's critic target is :math:`r+\gamma(1-d)V(s')` with :math:`Q=\min(Q_1,Q_2)` as in TD3.

    >>> sac_soft_value(torch.tensor([[1.0, 3.0]]), torch.tensor([[-1.0, -1.0]]), alpha=0.5)
    tensor([2.5000])
    """
    Q, logp = as_tensor(Q, "Q"), as_tensor(logp, "logp")
    check_dim(Q, "Q", "(B, K)", min_dim=2, max_dim=2)
    check_same_shape(Q, logp, "Q", "logp")
    check_finite(Q, "Q")
    check_finite(logp, "logp")
    alpha = check_range(alpha, "alpha", 0.0)
    if Q.shape[1] == 0:
        raise ValueError("Q must hold K >= 1 sampled actions per state, got K = 0")
    out = torch.promote_types(Q.dtype, logp.dtype)
    dt = compute_dtype(out)
    return restore_half((Q.to(dt) - alpha * logp.to(dt)).mean(-1), out)


def tanh_gaussian_log_prob(u: Tensor, mu: Tensor, log_std: Tensor) -> Tensor:
    r"""Log-density of :math:`a=\tanh(u)`, :math:`u\sim\mathcal N(\mu,\sigma^2)` per dimension, summed over the
    last axis (SAC's squashed Gaussian):
    :math:`\log\pi(a)=\sum_i[\log\mathcal N(u_i;\mu_i,\sigma_i)-\log(1-\tanh^2u_i)]`
    with the stable :math:`\log(1-\tanh^2u)=2(\log2-u-\mathrm{softplus}(-2u))` (no :math:`\log 0` when
    :math:`|u|` is large). Takes the pre-squash ``u`` (inverting tanh loses precision). ``(..., d_a)`` -> ``(...)``."""
    u, mu, log_std = as_tensor(u, "u"), as_tensor(mu, "mu"), as_tensor(log_std, "log_std")
    check_same_shape(u, mu, "u", "mu")
    check_same_shape(u, log_std, "u", "log_std")
    z = (u - mu) * torch.exp(-log_std)
    log_normal = -0.5 * z**2 - log_std - 0.5 * math.log(2 * math.pi)
    log_det = 2 * (math.log(2) - u - F.softplus(-2 * u))
    return (log_normal - log_det).sum(-1)


@implements("34.12")
def vtrace(r: Float[Tensor, "B T"], V: Float[Tensor, "B T+1"], log_rho: Float[Tensor, "B T"], gamma: float = 0.99,
           rho_bar: float = 1.0, c_bar: float = 1.0, dones=None) -> Float[Tensor, "B T"]:
    r"""IMPALA's V-trace targets (Espeholt et al., 2018) for an off-policy segment:

    .. math:: v_s=V(x_s)+\sum_{t=s}^{s+n-1}\gamma^{t-s}\Big(\prod_{i=s}^{t-1}c_i\Big)\delta_tV,\qquad
              \delta_tV=\rho_t(r_{t+1}+\gamma V(x_{t+1})-V(x_t))

    with truncated importance weights :math:`\rho_t=\min(\bar\rho,\pi/\mu)`, :math:`c_i=\min(\bar c,\pi/\mu)`
    (``r[:, t]`` is :math:`r_{t+1}`, the reward after :math:`a_t`; the IMPALA paper writes :math:`r_t` for the
    same number), ``log_rho`` ``(B, T)`` is :math:`\log\pi(a_t\mid x_t)-\log\mu(a_t\mid x_t)`, learner minus
    actor. Computed backwards, :math:`v_s-V(x_s)=\delta_sV+\gamma c_s(v_{s+1}-V(x_{s+1}))`, :math:`n = T - s`
    (to the segment's end, where :math:`v_T=V(x_T)`); ``dones`` set :math:`\gamma=0` across an episode end.
    On-policy with :math:`\bar\rho,\bar c\ge1` (:math:`\rho=c=1`) it is the n-step return of
    :func:`llmbook.agents.policy_gradient.a3c_target`.
    ``r`` ``(B, T)``, ``V`` ``(B, T + 1)`` -> ``(B, T)``.

    >>> vtrace(torch.tensor([[1.0]]), torch.tensor([[0.0, 2.0]]), torch.tensor([[0.0]]), gamma=0.5)
    tensor([[2.]])
    """
    r = _ret._rewards(r)
    V = _ret._values(V, r)
    log_rho = as_tensor(log_rho, "log_rho")
    check_same_shape(r, log_rho, "r", "log_rho")
    check_finite(log_rho, "log_rho", allow_neg_inf=True)
    gamma = check_unit_interval(gamma, "gamma")
    rho_bar = check_range(rho_bar, "rho_bar", 0.0)
    c_bar = check_range(c_bar, "c_bar", 0.0)
    out = torch.promote_types(torch.promote_types(r.dtype, V.dtype), log_rho.dtype)
    dt = compute_dtype(out)
    r, V, ratio = r.to(dt), V.to(dt), torch.exp(log_rho.to(dt))
    disc = gamma * _not_done(dones, r, dt)
    rho, c = ratio.clamp(max=rho_bar), ratio.clamp(max=c_bar)
    delta = rho * (r + disc * V[:, 1:] - V[:, :-1])
    B, T = r.shape
    acc = torch.zeros(B, dtype=dt)
    vs_minus_V = torch.zeros(B, T, dtype=dt)
    for t in range(T - 1, -1, -1):
        acc = delta[:, t] + disc[:, t] * c[:, t] * acc
        vs_minus_V[:, t] = acc
    return restore_half(V[:, :-1] + vs_minus_V, out)
