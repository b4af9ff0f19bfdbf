"""Tests of llmbook.agents.policy_gradient (chapter 34) against autograd of the exact return, brute-force
loops, measured Monte Carlo variance and scipy.sparse.linalg.cg."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.sparse.linalg import cg

from llmbook.agents import envs
from llmbook.agents import policy_gradient as pg
from llmbook.agents import returns as ret


def _random_mdp(S=5, A=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    P = torch.softmax(2 * torch.randn(S, A, S, generator=g, dtype=torch.float64), -1)
    R = torch.randn(S, A, generator=g, dtype=torch.float64)
    mu0 = torch.softmax(torch.randn(S, generator=g, dtype=torch.float64), -1)
    theta = torch.randn(S, A, generator=g, dtype=torch.float64)
    return P, R, mu0, theta


def _exact_J(P, R, mu0, theta, gamma):
    """J(theta) = mu0^T V^pi with V^pi = (I - gamma P_pi)^{-1} r_pi, all in torch so autograd differentiates it."""
    pi = torch.softmax(theta, -1)
    P_pi = torch.einsum("sa,sat->st", pi, P)
    r_pi = (pi * R).sum(-1)
    V = torch.linalg.solve(torch.eye(P.shape[0], dtype=torch.float64) - gamma * P_pi, r_pi)
    return mu0 @ V


@pytest.mark.equation("34.01", oracle="autograd of the exact return J = mu0^T (I - gamma P_pi)^-1 r_pi (torch solve)")
@pytest.mark.parametrize("seed,gamma", [(0, 0.9), (1, 0.5), (2, 0.99)])
def test_policy_gradient_theorem_matches_autograd(seed, gamma):
    P, R, mu0, theta = _random_mdp(seed=seed)
    th = theta.clone().requires_grad_(True)
    (grad_auto,) = torch.autograd.grad(_exact_J(P, R, mu0, th, gamma), th)
    grad_thm = pg.policy_gradient_theorem(P, R, theta, gamma, mu0)
    assert torch.allclose(grad_thm, grad_auto, atol=1e-10, rtol=0)


@pytest.mark.equation("34.01", oracle="autograd of the exact return on gymnasium FrozenLake")
def test_policy_gradient_theorem_frozenlake():
    mdp = envs.from_gymnasium("FrozenLake-v1", gamma=0.95, is_slippery=True)
    theta = torch.randn(mdp.S, mdp.A, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    th = theta.clone().requires_grad_(True)
    (grad_auto,) = torch.autograd.grad(_exact_J(mdp.P, mdp.r_sa, mdp.mu0, th, 0.95), th)
    grad_thm = pg.policy_gradient_theorem(mdp.P, mdp.R, theta, 0.95, mdp.mu0)
    assert grad_auto.abs().max() > 1e-4  # not a trivially zero gradient
    assert torch.allclose(grad_thm, grad_auto, atol=1e-10, rtol=0)


def test_discounted_visitation_sums_to_horizon():
    P, R, mu0, theta = _random_mdp()
    d = pg.discounted_visitation(P, R, torch.softmax(theta, -1), 0.9, mu0)
    assert abs(d.sum().item() - 10.0) < 1e-10  # sum_t gamma^t = 1 / (1 - gamma)



def test_policy_gradient_theorem_normalised_form_has_the_factor_one_over_one_minus_gamma():
    # oracle: autograd of the exact J; the states are *sampled* from the normalised visitation (1 - gamma) d^pi by
    # the geometric-stopping recipe (start from mu0, stop each step with probability 1 - gamma), independent of
    # the linear solve inside discounted_visitation
    P, R, mu0, theta = _random_mdp(seed=4)
    gamma = 0.5
    th = theta.clone().requires_grad_(True)
    (grad_auto,) = torch.autograd.grad(_exact_J(P, R, mu0, th, gamma), th)
    pi = torch.softmax(theta, -1).numpy()
    P_pi = np.einsum("sa,sat->st", pi, P.numpy())
    V = np.linalg.solve(np.eye(5) - gamma * P_pi, (pi * R.numpy()).sum(-1))
    Q = R.numpy() + gamma * P.numpy() @ V
    rng = np.random.default_rng(0)
    n = 40_000
    s = rng.choice(5, size=n, p=mu0.numpy())
    alive = np.ones(n, dtype=bool)
    while alive.any():
        alive &= rng.random(n) < gamma
        nxt = np.array([rng.choice(5, p=P_pi[k]) for k in s[alive]])
        if alive.any():
            s[alive] = nxt
    d_bar = np.bincount(s, minlength=5) / n
    d = pg.discounted_visitation(P, R, torch.tensor(pi), gamma, mu0).numpy()
    assert np.all(np.abs(d_bar - (1 - gamma) * d) < 5 * np.sqrt(d_bar * (1 - d_bar) / n) + 1e-12)
    # per sampled state, the exact expectation over actions: E_a[grad log pi(a|s) Q(s,a)] in row s
    inner = pi * (Q - (pi * Q).sum(-1, keepdims=True))  # sum_a pi (e_a - pi) Q, (S, A)
    samples = np.zeros((n, 5, 3))
    samples[np.arange(n), s] = inner[s]
    est, se = samples.mean(0) / (1 - gamma), samples.std(0) / np.sqrt(n) / (1 - gamma)
    assert np.all(np.abs(est - grad_auto.numpy()) <= 5 * se + 1e-12)
    assert np.all(np.abs(est - pg.policy_gradient_theorem(P, R, theta, gamma, mu0).numpy()) <= 5 * se + 1e-12)
    assert np.abs(est * (1 - gamma) - grad_auto.numpy()).max() > 10 * se.max()  # without the factor: wrong

def _chain_batch(mdp, n, seed, theta):
    """n episodes of the softmax policy on the chain MDP with their REINFORCE data (gamma^t G_t, gamma^t)."""
    pi = torch.softmax(theta, -1).detach()
    ep = envs.sample_episodes(mdp, pi, n=n, T=80, generator=torch.Generator().manual_seed(seed))
    alive = ~ep.done[:, :-1]
    logp = torch.log_softmax(theta, -1)[ep.states[:, :-1], ep.actions] * alive
    G = ret.monte_carlo_return(ep.rewards, mdp.gamma, dones=ep.done[:, 1:] & alive)
    disc = mdp.gamma ** torch.arange(G.shape[1], dtype=torch.float64)
    return ep, logp, G * disc, alive * disc  # gamma^t G_t: the gradient of the discounted J


THETA0 = torch.tensor([[0.0, 0.5]] * 7, dtype=torch.float64)


@pytest.mark.equation("34.02", oracle="the exact gradient (autograd of J by a linear solve) within 5 standard errors")
def test_reinforce_is_unbiased():
    mdp = pg.chain_mdp()
    th = THETA0.clone().requires_grad_(True)
    ep, logp, G, w = _chain_batch(mdp, 3000, 0, th)
    per_ep = torch.stack([torch.autograd.grad(-pg.reinforce_loss(logp[i:i + 1], G[i:i + 1]), th, retain_graph=True)[0]
                          for i in range(0, 3000, 10)])
    (g_batch,) = torch.autograd.grad(-pg.reinforce_loss(logp, G), th)
    exact = torch.autograd.grad(_exact_J(mdp.P, mdp.r_sa, mdp.mu0, th, mdp.gamma), th)[0]
    se = per_ep.std(0) / np.sqrt(3000)  # the spread of one episode's gradient, from 300 of them
    z = ((g_batch - exact) / se)[se > 1e-8]  # coordinates of the non-terminal states
    assert len(z) == 12 and z.abs().max() < 5
    assert exact.abs().max() > 0.5


@pytest.mark.equation("34.03", oracle="60 seeded batches: same mean within 4 paired s.e.; variance < 0.2x")
def test_baseline_same_mean_lower_variance():
    mdp = pg.chain_mdp()
    th = THETA0.clone().requires_grad_(True)
    pi = torch.softmax(THETA0, -1)
    V = torch.linalg.solve(torch.eye(7, dtype=torch.float64) - mdp.gamma * torch.einsum("sa,sat->st", pi, mdp.P),
                           (pi * mdp.r_sa).sum(-1))
    plain, based = [], []
    for seed in range(60):
        ep, logp, G, w = _chain_batch(mdp, 20, seed, th)
        b = V[ep.states[:, :-1]] * w  # gamma^t V(s_t), zero after the end
        plain.append(torch.autograd.grad(pg.reinforce_loss(logp, G), th, retain_graph=True)[0].flatten())
        based.append(torch.autograd.grad(pg.baseline_loss(logp, G, b), th)[0].flatten())
    plain, based = torch.stack(plain), torch.stack(based)
    se = (plain - based).std(0) / 60**0.5  # paired: both estimators see the same batches
    assert ((plain.mean(0) - based.mean(0)).abs() <= 4 * se + 1e-12).all()
    assert based.var(0).sum() < 0.2 * plain.var(0).sum()


def test_baseline_zero_is_reinforce_and_constant_shift():
    g = torch.Generator().manual_seed(0)
    logp, G = torch.randn(3, 4, generator=g, dtype=torch.float64), torch.randn(3, 4, generator=g, dtype=torch.float64)
    b = torch.randn(3, 4, generator=g, dtype=torch.float64)
    expected = -(logp * (G - b)).sum() / 3  # the closed form
    assert torch.allclose(pg.baseline_loss(logp, G, b), expected, atol=1e-14)
    assert torch.allclose(pg.reinforce_loss(logp, G), -(logp * G).sum() / 3, atol=1e-14)


@pytest.mark.equation("34.04", oracle="brute-force loop of the TD error r + gamma (1 - d) V' - V")
def test_actor_critic_loss_matches_loop():
    g = torch.Generator().manual_seed(1)
    B, T, gamma = 4, 6, 0.9
    logp = torch.randn(B, T, generator=g, dtype=torch.float64, requires_grad=True)
    r = torch.randn(B, T, generator=g, dtype=torch.float64)
    V = torch.randn(B, T + 1, generator=g, dtype=torch.float64, requires_grad=True)
    d = torch.rand(B, T, generator=g) < 0.3
    loss = pg.actor_critic_loss(logp, r, V, gamma, d)
    total = 0.0
    for b in range(B):
        for t in range(T):
            A = r[b, t].item() + (0.0 if d[b, t] else gamma * V[b, t + 1].item()) - V[b, t].item()
            total -= logp[b, t].item() * A
    assert abs(loss.item() - total / B) < 1e-12
    loss.backward()
    assert V.grad is None or V.grad.abs().max() == 0  # the advantage is a constant for the actor


@pytest.mark.equation("34.05", oracle="brute-force loop: sum of discounted rewards to the segment end + gamma^k V(s_T)")
def test_a3c_target_loop():
    g = torch.Generator().manual_seed(2)
    B, T, gamma = 3, 5, 0.9
    r = torch.randn(B, T, generator=g, dtype=torch.float64)
    V = torch.randn(B, T + 1, generator=g, dtype=torch.float64)
    R = pg.a3c_target(r, V, gamma)
    for b in range(B):
        acc = V[b, T].item()  # A3C's backward loop: R <- r_t + gamma R from the bootstrap
        for t in range(T - 1, -1, -1):
            acc = r[b, t].item() + gamma * acc
            assert abs(R[b, t].item() - acc) < 1e-12
    R2 = pg.a3c_target(r, V, gamma, n=2)
    assert abs(R2[0, 0].item() - (r[0, 0] + gamma * r[0, 1] + gamma**2 * V[0, 2]).item()) < 1e-12


def _fisher_matrix(theta, w):
    """The explicit Fisher of the mean KL for softmax logits: block diagonal, w_s (diag(p_s) - p_s p_s^T)."""
    p = torch.softmax(theta, -1)
    N, A = p.shape
    F = torch.zeros(N * A, N * A, dtype=torch.float64)
    for s in range(N):
        F[s * A:(s + 1) * A, s * A:(s + 1) * A] = w[s] * (torch.diag(p[s]) - torch.outer(p[s], p[s]))
    return F


@pytest.mark.equation("34.06", oracle="scipy.sparse.linalg.cg on the explicit Fisher matrix; exact KL after the step")
def test_trpo_step_against_scipy_cg():
    g = torch.Generator().manual_seed(4)
    N, A, delta = 6, 3, 0.02
    theta = torch.randn(N, A, generator=g, dtype=torch.float64)
    Adv = torch.randn(N, A, generator=g, dtype=torch.float64)
    w = torch.full((N,), 1 / N, dtype=torch.float64)
    Fm = _fisher_matrix(theta, w) + 1e-10 * torch.eye(N * A, dtype=torch.float64)
    p = torch.softmax(theta, -1)
    grad = (w[:, None] * p * (Adv - (p * Adv).sum(-1, keepdim=True))).flatten()  # d/dtheta sum pi A, closed form
    x_ours = pg.conjugate_gradient(lambda v: Fm @ v, grad, iters=50)
    # F is singular along each state's constant shift; cg from 0 stays in its range space, like ours
    x_scipy, info = cg(Fm.numpy(), grad.numpy(), rtol=1e-12, maxiter=200)
    assert info == 0
    assert np.allclose(x_ours.numpy(), x_scipy, atol=1e-6)
    theta_new = pg.trpo_step(theta, Adv, w, delta=delta, cg_iters=50)
    kl = (w * torch.distributions.kl_divergence(torch.distributions.Categorical(logits=theta),
                                                torch.distributions.Categorical(logits=theta_new))).sum().item()
    assert 0 < kl <= delta
    assert kl > 0.2 * delta  # the step uses the trust region, not a tiny fraction of it
    L_old = (w[:, None] * p * Adv).sum()
    L_new = (w[:, None] * torch.softmax(theta_new, -1) * Adv).sum()
    assert L_new > L_old
    # the direction is the natural gradient F^+ g from scipy (up to the line-search scale)
    d = (theta_new - theta).flatten().numpy()
    cos = d @ x_scipy / np.linalg.norm(d) / np.linalg.norm(x_scipy)
    assert cos > 1 - 1e-6


def test_trpo_rejects_bad_delta():
    with pytest.raises(ValueError, match="delta"):
        pg.trpo_step(torch.zeros(2, 2), torch.ones(2, 2), delta=0.0)


def test_try_it_numbers():
    """The numbers stated in the Try-it solutions of book/34-policy-gradients.ipynb."""
    from llmbook.agents import continuous_control as cc
    from tests.try_it import assert_states

    # 1. one state, pi = (0.25, 0.75), Q = (1, 3): gamma = 0 makes Q = R and d = 1
    theta = torch.log(torch.tensor([[0.25, 0.75]], dtype=torch.float64))
    f64 = dict(dtype=torch.float64)
    g1 = pg.policy_gradient_theorem(torch.ones(1, 2, 1, **f64), torch.tensor([[1.0, 3.0]], **f64), theta, 0.0,
                                    torch.ones(1, **f64))[0]
    assert torch.allclose(g1, torch.tensor([-0.375, 0.375], dtype=torch.float64), atol=1e-15)
    # 2. V-trace by hand
    args = (torch.tensor([[1.0]]), torch.tensor([[0.0, 2.0]]), torch.tensor([[float(np.log(3.0))]]), 0.5)
    v1, v5 = cc.vtrace(*args)[0, 0].item(), cc.vtrace(*args, rho_bar=5.0)[0, 0].item()
    assert abs(v1 - 2) < 1e-6 and abs(v5 - 6) < 1e-5
    # 3. where the naive log(1 - tanh^2 u) becomes -inf
    first = {}
    for name, dt in (("64", torch.float64), ("32", torch.float32)):
        u = torch.arange(0, 40, 0.01, dtype=torch.float64).to(dt)
        first[name] = round(u[torch.isinf(torch.log(1 - torch.tanh(u) ** 2))][0].item(), 2)
    assert_states("34-policy-gradients.ipynb", [
        f"$({2 * g1[0].item():.2f}, {2 * g1[1].item():.2f})$", f"$v_0 = {v1:.0f}$ with $\\bar\\rho=1$",
        f"$v_0 = {v5:.0f}$ with $\\bar\\rho=5$", f"$u = {first['64']:.2f}$ in float64",
        f"$u = {first['32']:.2f}$ in float32",
    ])
