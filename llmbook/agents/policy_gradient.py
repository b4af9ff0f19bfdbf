r"""Policy gradients and actor-critic (chapter 34): the policy-gradient theorem, REINFORCE, baselines,
the actor-critic advantage, A3C's n-step target and TRPO's trust-region step.

Layout as in :mod:`llmbook.agents.returns`: a rollout of ``B`` rows and ``T`` steps, ``logp`` ``(B, T)`` the
log-probabilities :math:`\log\pi_\theta(a_t\mid s_t)` of the actions taken (with their autograd graph),
``r`` ``(B, T)`` the rewards (``r[:, t]`` is :math:`r_{t+1}`, the reward that follows :math:`a_t`, as in
chapters 32 and 35), ``V`` ``(B, T + 1)`` the critic's values (the last column bootstraps),
``dones`` ``(B, T)`` optional termination flags. The *surrogate losses* here are scalars whose gradient is
the (negated) policy-gradient estimate: ``loss.backward()`` then an optimizer step ascends :math:`J`.
Tabular models: ``P`` ``(S, A, S')``, ``R`` ``(S, A)`` or ``(S, A, S')``, softmax logits ``theta`` ``(S, A)``.
fp16 / bf16 inputs are computed in float32 and rounded back once.
"""

from __future__ import annotations

import math

import torch
from jaxtyping import Float
from torch import Tensor

from llmbook._checks import as_tensor, check_dim, check_finite, check_positive_int, check_range, check_same_shape
from llmbook._precision import compute_dtype, restore_half
from llmbook.agents import mdp as _mdp
from llmbook.agents import returns as _ret
from llmbook.registry import implements

__all__ = ["chain_mdp", "policy_gradient_theorem", "discounted_visitation", "reinforce_loss", "baseline_loss",
           "actor_critic_loss", "a3c_target", "conjugate_gradient", "trpo_step"]


def _logp_and(logp, x, name: str) -> tuple[Tensor, Tensor]:
    logp = as_tensor(logp, "logp")
    check_dim(logp, "logp", "(B, T)", min_dim=2, max_dim=2)
    x = as_tensor(x, name)
    check_same_shape(logp, x, "logp", name)
    check_finite(logp, "logp")
    check_finite(x, name)
    return logp, x


def _mean_over_episodes(term: Tensor) -> Tensor:
    """Sum over the steps of an episode, mean over the batch (an empty batch gives 0)."""
    return term.sum(-1).mean() if term.shape[0] else term.sum()


# ----------------------------------------------------------------------------------------------
# the policy-gradient theorem on a tabular MDP


def chain_mdp(n: int = 6, slip: float = 0.2, gamma: float = 0.95):
    r"""A corridor of ``n`` states plus a terminal goal: actions left / right move one cell (the other way with
    probability ``slip``), every step costs -1, the episode starts in cell 0. Dense rewards and long returns
    make it the standard setting in which a baseline visibly reduces the variance of REINFORCE."""
    n = check_positive_int(n, "n")
    slip = check_range(slip, "slip", 0.0, 0.5)
    S = n + 1
    P = torch.zeros(S, 2, S, dtype=torch.float64)
    for s in range(n):
        left, right = max(s - 1, 0), s + 1
        P[s, 0, left] += 1 - slip
        P[s, 0, right] += slip
        P[s, 1, right] += 1 - slip
        P[s, 1, left] += slip
    P[n, :, n] = 1.0
    R = torch.full((S, 2), -1.0, dtype=torch.float64)
    R[n] = 0.0
    terminal = torch.zeros(S, dtype=torch.bool)
    terminal[n] = True
    mu0 = torch.zeros(S, dtype=torch.float64)
    mu0[0] = 1.0
    return _mdp.make_mdp(P, R, gamma, terminal, mu0, name=f"chain-{n}", action_names=("left", "right"))


def discounted_visitation(P, R, pi, gamma: float, mu0) -> Tensor:
    r"""The (unnormalised) discounted state visitation :math:`d^\pi(s)=\sum_t\gamma^t\Pr(s_t=s)`,
    i.e. :math:`d^\pi=\mu_0^\top(I-\gamma P_\pi)^{-1}` by one linear solve, float64 ``(S,)``. Its total is
    :math:`\sum_sd^\pi(s)=1/(1-\gamma)`; the distribution is :math:`\bar d^\pi=(1-\gamma)d^\pi`.

    >>> d = discounted_visitation(torch.ones(1, 1, 1), torch.zeros(1, 1), torch.ones(1, 1), 0.75, torch.ones(1))
    >>> d.tolist()
    [4.0]
    """
    P_pi, _ = _mdp.policy_matrices(P, R, pi)
    mu0 = as_tensor(mu0, "mu0").double()
    S = P_pi.shape[0]
    if tuple(mu0.shape) != (S,):
        raise ValueError(f"mu0 must be (S,) = ({S},), got {tuple(mu0.shape)}")
    check_finite(mu0, "mu0")
    gamma = check_range(gamma, "gamma", 0.0, 1.0, high_open=True)
    return torch.linalg.solve((torch.eye(S, dtype=torch.float64) - gamma * P_pi).T, mu0)


@implements("34.01")
def policy_gradient_theorem(P, R, theta: Float[Tensor, "S A"], gamma: float, mu0) -> Float[Tensor, "S A"]:
    r"""The exact gradient of :math:`J(\theta)=\mu_0^\top V^{\pi_\theta}` for a tabular softmax policy,
    by the policy-gradient theorem (Sutton et al., 2000):

    .. math:: \nabla_\theta J(\theta)=\sum_s d^\pi(s)\sum_a\pi_\theta(a\mid s)\nabla_\theta\log\pi_\theta(a\mid s)
              Q^\pi(s,a)=\frac1{1-\gamma}\,\mathbb E_{s\sim\bar d^\pi,\,a\sim\pi_\theta}[\nabla_\theta
              \log\pi_\theta(a\mid s)Q^\pi(s,a)]

    with :math:`d^\pi` the unnormalised discounted visitation (:func:`discounted_visitation`, total
    :math:`1/(1-\gamma)`), :math:`\bar d^\pi=(1-\gamma)d^\pi` its normalised distribution, and :math:`Q^\pi`
    from a linear solve. For :math:`\pi(\cdot\mid s)=\mathrm{softmax}(\theta_s)`,
    :math:`\nabla_{\theta_{s'}}\log\pi(a\mid s)=[s=s'](e_a-\pi(\cdot\mid s))`; the score sum is written out
    over all :math:`(s, a)`, no derivative of :math:`d^\pi` or :math:`Q^\pi` is taken: that is the theorem's
    content. ``P`` ``(S, A, S')``, ``R`` ``(S, A)`` or ``(S, A, S')``, ``theta`` ``(S, A)`` logits, ``gamma`` in
    [0, 1), ``mu0`` ``(S,)`` -> ``(S, A)`` in the dtype of ``theta`` (computed in float64).

    >>> P = torch.ones(1, 2, 1)
    >>> g = policy_gradient_theorem(P, torch.tensor([[1.0, 0.0]]), torch.zeros(1, 2), 0.5, torch.ones(1))
    >>> [round(v, 4) for v in g[0].tolist()]
    [0.5, -0.5]
    """
    theta = as_tensor(theta, "theta")
    check_dim(theta, "theta", "(S, A)", min_dim=2, max_dim=2)
    check_finite(theta, "theta")
    Pd, r, _ = _mdp._model(P, R)
    if tuple(theta.shape) != tuple(r.shape):
        raise ValueError(f"theta must be (S, A) = {tuple(r.shape)} like R, got {tuple(theta.shape)}")
    gamma = check_range(gamma, "gamma", 0.0, 1.0, high_open=True)
    pi = torch.softmax(theta.double(), -1)
    S, A = pi.shape
    P_pi, r_pi = _mdp.policy_matrices(Pd, r, pi)
    V = torch.linalg.solve(torch.eye(S, dtype=torch.float64) - gamma * P_pi, r_pi)
    Q = r + gamma * Pd @ V
    d = discounted_visitation(Pd, r, pi, gamma, mu0)
    eye = torch.eye(A, dtype=torch.float64)
    score = eye[None, :, :] - pi[:, None, :]  # score[s, a] = grad_{theta_s} log pi(a|s) = e_a - pi(.|s)
    grad = d[:, None] * torch.einsum("sa,sa,sab->sb", pi, Q, score)
    return grad.to(theta.dtype)


# ----------------------------------------------------------------------------------------------
# sampled estimators: REINFORCE, baseline, actor-critic, A3C


@implements("34.02")
def reinforce_loss(logp: Float[Tensor, "B T"], G: Float[Tensor, "B T"]) -> Float[Tensor, ""]:
    r"""REINFORCE's surrogate loss (Williams, 1992): minus the sampled policy gradient's potential,

    .. math:: \nabla_\theta J(\theta)=\mathbb E\Big[\sum_t\nabla_\theta\log\pi_\theta(a_t\mid s_t)G_t\Big],
              \qquad \mathcal L=-\frac1B\sum_b\sum_t\log\pi_\theta(a_t\mid s_t)\,G_t

    so :math:`-\nabla_\theta\mathcal L` is the REINFORCE estimate. ``G`` (the returns, e.g.
    :func:`llmbook.agents.returns.monte_carlo_return`) is treated as a constant (detached). The gradient of the
    *discounted* :math:`J` weights step :math:`t` by :math:`\gamma^t` too: pass :math:`\gamma^tG_t` for it; common
    practice drops the :math:`\gamma^t` (a biased but useful estimate). Steps after an
    episode's end must carry ``G = 0`` (or ``logp = 0``). ``logp``, ``G`` ``(B, T)`` -> scalar.

    >>> reinforce_loss(torch.tensor([[-1.0, -2.0]]), torch.tensor([[1.0, 0.5]]))
    tensor(2.)
    """
    logp, G = _logp_and(logp, G, "G")
    out = torch.promote_types(logp.dtype, G.dtype)
    dt = compute_dtype(out)
    return restore_half(_mean_over_episodes(-logp.to(dt) * G.detach().to(dt)), out)


@implements("34.03")
def baseline_loss(logp: Float[Tensor, "B T"], G: Float[Tensor, "B T"], b: Float[Tensor, "B T"]) -> Float[Tensor, ""]:
    r"""REINFORCE with a baseline: the same expected gradient, lower variance,

    .. math:: \nabla_\theta J=\mathbb E[\nabla_\theta\log\pi_\theta(a\mid s)(Q(s,a)-b(s))]

    because
    :math:`\mathbb E_{a\sim\pi}[\nabla_\theta\log\pi_\theta(a\mid s)]b(s)=b(s)\nabla_\theta\sum_a\pi_\theta(a\mid s)=0`
    for any :math:`b` that does not depend on the action. Calls :func:`reinforce_loss` with ``G - b``.
    ``b`` ``(B, T)`` (e.g. a learned :math:`V(s_t)`, or a running mean of returns; detached).

    >>> baseline_loss(torch.tensor([[-1.0, -2.0]]), torch.tensor([[1.0, 0.5]]), torch.tensor([[0.5, 0.5]]))
    tensor(0.5000)
    """
    logp, G = _logp_and(logp, G, "G")
    _, b = _logp_and(logp, b, "b")
    return reinforce_loss(logp, G.detach() - b.detach())


@implements("34.04")
def actor_critic_loss(logp: Float[Tensor, "B T"], r: Float[Tensor, "B T"], V: Float[Tensor, "B T+1"],
                      gamma: float = 0.99, dones=None) -> Float[Tensor, ""]:
    r"""The one-step actor-critic's actor loss: the TD error of the critic as the advantage estimate,

    .. math:: \nabla_\theta J\approx\nabla_\theta\log\pi_\theta(a_t\mid s_t)\hat A_t,\qquad
              \hat A_t=r_{t+1}+\gamma(1-d_t)V(s_{t+1})-V(s_t)

    :math:`\hat A_t` is :func:`llmbook.agents.returns.n_step_return` with ``n = 1`` minus ``V[:, :T]``, detached (the
    critic is trained separately, e.g. by :func:`llmbook.lm.rlhf.value_loss`). Returns
    :math:`-\frac1B\sum_b\sum_t\log\pi_\theta(a_t\mid s_t)\hat A_t`. ``logp``, ``r`` ``(B, T)``, ``V`` ``(B, T + 1)``.

    >>> actor_critic_loss(torch.tensor([[-1.0]]), torch.tensor([[1.0]]), torch.tensor([[0.5, 1.0]]), gamma=0.5)
    tensor(1.)
    """
    logp, r = _logp_and(logp, r, "r")
    V = _ret._values(V, r)
    A_hat = _ret.n_step_return(r.detach(), V.detach(), 1, gamma, dones) - V.detach()[:, :-1]
    return reinforce_loss(logp, A_hat)


@implements("34.05")
def a3c_target(r: Float[Tensor, "B T"], V: Float[Tensor, "B T+1"], gamma: float = 0.99, n: int | None = None,
               dones=None) -> Float[Tensor, "B T"]:
    r"""A3C's n-step return targets (Mnih et al., 2016) for a segment of :math:`T = t_{max}` steps:

    .. math:: R_t=\sum_{i=0}^{k-1}\gamma^ir_{t+i+1}+\gamma^kV(s_{t+k})

    (``r[:, t + i]`` is :math:`r_{t+i+1}`; the catalogue writes :math:`r_{t+i}`, indexing each reward by the
    step that emits it, the same number).

    A3C bootstraps every step of a segment from the segment's *last* state, so :math:`k = T - t` varies
    (``n = None``, the default: the last step gets a 1-step target, the first a T-step one); an int ``n`` caps
    :math:`k` at ``n``. This calls :func:`llmbook.agents.returns.n_step_return` (chapter 35), which cuts at
    ``dones`` and bootstraps from ``V[:, T]``. ``r`` ``(B, T)``, ``V`` ``(B, T + 1)`` -> ``(B, T)``.

    >>> a3c_target(torch.tensor([[1.0, 1.0]]), torch.tensor([[0.0, 0.0, 4.0]]), gamma=0.5)
    tensor([[2.5000, 3.0000]])
    """
    r = _ret._rewards(r)
    n = max(r.shape[1], 1) if n is None else check_positive_int(n, "n")
    return _ret.n_step_return(r, V, n, gamma, dones)


# ----------------------------------------------------------------------------------------------
# TRPO


def conjugate_gradient(Avp, b: Tensor, iters: int = 10, tol: float = 1e-10) -> Tensor:
    r"""Solve :math:`Ax=b` for a symmetric positive-definite :math:`A` given only ``Avp(v)`` :math:`=Av`
    (Hestenes-Stiefel CG, the solver TRPO uses on the Fisher-vector product). ``b`` 1-D."""
    x = torch.zeros_like(b)
    r = b.clone()
    p = r.clone()
    rr = r @ r
    for _ in range(check_positive_int(iters, "iters")):
        if rr.item() <= tol**2:
            break
        Ap = Avp(p)
        alpha = rr / (p @ Ap)
        x = x + alpha * p
        r = r - alpha * Ap
        rr_new = r @ r
        p = r + (rr_new / rr) * p
        rr = rr_new
    return x


def _surrogate_and_kl(theta: Tensor, logp_old: Tensor, A: Tensor, w: Tensor) -> tuple[Tensor, Tensor]:
    """L(theta) = sum_s w_s sum_a pi_theta(a|s) A(s, a) (the ratio times pi_old, summed exactly over the
    actions) and the mean KL(pi_old || pi_theta) under w."""
    logp = torch.log_softmax(theta, -1)
    L = (w[:, None] * logp.exp() * A).sum()
    kl = (w[:, None] * logp_old.exp() * (logp_old - logp)).sum()
    return L, kl


@implements("34.06")
def trpo_step(theta_old: Float[Tensor, "N A"], A: Float[Tensor, "N A"], w=None, delta: float = 0.01,
              cg_iters: int = 10, backtracks: int = 10) -> Float[Tensor, "N A"]:
    r"""One TRPO update (Schulman et al., 2015) of a softmax policy with logits ``theta_old`` over ``N`` states:

    .. math:: \max_\theta\mathbb E\Big[\frac{\pi_\theta(a\mid s)}{\pi_{old}(a\mid s)}A_{old}(s,a)\Big]
              \ \text{s.t.}\ \mathbb E[D_{KL}(\pi_{old}\Vert\pi_\theta)]\le\delta

    The expectation is over states weighted by ``w`` ``(N,)`` (default uniform) and exactly over actions
    (:math:`\mathbb E_{a\sim\pi_{old}}[\frac{\pi_\theta}{\pi_{old}}A]=\sum_a\pi_\theta(a\mid s)A(s,a)`). Steps: the
    surrogate's gradient :math:`g`; :math:`x\approx F^{-1}g` by :func:`conjugate_gradient` on the Fisher-vector
    product :math:`Fv=\nabla_\theta(\nabla_\theta\bar D_{KL}\cdot v)` (double backward, never forming
    :math:`F`); the largest step of the quadratic model, :math:`\beta=\sqrt{2\delta/x^\top Fx}`; then a line
    search halving :math:`\beta x` until the exact KL is :math:`\le\delta` and the surrogate improves (else the
    old logits are returned). ``A`` ``(N, A)`` advantages -> new logits ``(N, A)`` (computed in float64).

    >>> th = trpo_step(torch.zeros(1, 2), torch.tensor([[1.0, -1.0]]), delta=0.01)
    >>> bool(th[0, 0] > th[0, 1])
    True
    """
    theta_old = as_tensor(theta_old, "theta_old")
    check_dim(theta_old, "theta_old", "(N, A)", min_dim=2, max_dim=2)
    check_finite(theta_old, "theta_old")
    A = as_tensor(A, "A")
    check_same_shape(theta_old, A, "theta_old", "A")
    check_finite(A, "A")
    delta = check_range(delta, "delta", 0.0, low_open=True)
    cg_iters = check_positive_int(cg_iters, "cg_iters")
    backtracks = check_positive_int(backtracks, "backtracks")
    N, nA = theta_old.shape
    if w is None:
        w = torch.full((N,), 1.0 / max(N, 1), dtype=torch.float64)
    else:
        w = as_tensor(w, "w").double()
        if tuple(w.shape) != (N,):
            raise ValueError(f"w must be (N,) = ({N},) state weights, got {tuple(w.shape)}")
        check_finite(w, "w")
    th0 = theta_old.detach().double()
    Ad = A.detach().double()
    if th0.numel() == 0:
        return theta_old.detach().clone()
    logp_old = torch.log_softmax(th0, -1)
    th = th0.clone().requires_grad_(True)
    L, kl = _surrogate_and_kl(th, logp_old, Ad, w)
    g = torch.autograd.grad(L, th, retain_graph=True)[0].flatten()
    grad_kl = torch.autograd.grad(kl, th, create_graph=True)[0].flatten()

    def Fvp(v: Tensor) -> Tensor:
        return torch.autograd.grad(grad_kl @ v, th, retain_graph=True)[0].flatten() + 1e-10 * v

    x = conjugate_gradient(Fvp, g, cg_iters)
    xFx = (x @ Fvp(x)).item()
    if not math.isfinite(xFx) or xFx <= 0 or not torch.isfinite(x).all():
        return theta_old.detach().clone()
    step = math.sqrt(2 * delta / xFx) * x.reshape(N, nA)
    with torch.no_grad():
        for _ in range(backtracks):
            L_new, kl_new = _surrogate_and_kl(th0 + step, logp_old, Ad, w)
            if kl_new.item() <= delta and L_new.item() > L.item():
                return (th0 + step).to(theta_old.dtype)
            step = step / 2
    return theta_old.detach().clone()
