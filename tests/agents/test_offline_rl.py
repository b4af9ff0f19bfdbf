"""Tests of llmbook.agents.offline_rl (chapter 38) against torch.nn.functional, scipy, numpy.linalg.solve,
exact enumeration of trajectories, float64 closed forms and autograd."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from scipy.optimize import brentq, minimize_scalar
from scipy.special import logsumexp

from llmbook.agents import offline_rl as orl

TOL = 1e-12  # float64 against float64 closed forms: only rounding differs


def _logits(N=9, A=4, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(N, A, generator=g, dtype=dtype), torch.randint(0, A, (N,), generator=g)


# ------------------------------------------------------------------------------- 38.01 behaviour cloning
@pytest.mark.equation("38.01", oracle="torch.nn.functional.cross_entropy and nll_loss")
@pytest.mark.parametrize("dtype,tol", [(torch.float64, TOL), (torch.float32, 1e-6)])
def test_bc_matches_cross_entropy(dtype, tol):
    logits, a = _logits(dtype=dtype)
    for red in ("mean", "sum", "none"):
        ours = orl.behavior_cloning_loss(logits, a, reduction=red)
        torch.testing.assert_close(ours, F.cross_entropy(logits, a, reduction=red), atol=tol, rtol=tol)
        torch.testing.assert_close(ours, F.nll_loss(F.log_softmax(logits, -1), a, reduction=red), atol=tol, rtol=tol)


@pytest.mark.equation("38.01", oracle="autograd: the gradient vanishes at the empirical policy (numpy bincount)")
def test_bc_tabular_minimiser_is_empirical_policy():
    g = torch.Generator().manual_seed(1)
    S, A, N = 5, 3, 400
    s = torch.randint(0, S, (N,), generator=g)
    a = torch.randint(0, A, (N,), generator=g)
    counts = np.bincount((s * A + a).numpy(), minlength=S * A).reshape(S, A).astype(float)
    mu_hat = counts / counts.sum(1, keepdims=True)
    fit = orl.fit_tabular("bc", s, a, torch.zeros(N), s, torch.zeros(N, dtype=torch.bool), S, A, 0.9)
    np.testing.assert_allclose(fit["pi"].numpy(), mu_hat, atol=TOL)
    logits = torch.tensor(np.log(mu_hat), requires_grad=True)
    orl.behavior_cloning_loss(logits[s], a).backward()
    assert logits.grad.abs().max().item() < 1e-15
    other = torch.tensor(np.log(mu_hat) + 0.1 * np.eye(S, A))  # any other table has a higher loss
    assert orl.behavior_cloning_loss(other[s], a) > orl.behavior_cloning_loss(logits.detach()[s], a)


# ------------------------------------------------------------------------------- 38.02 / 38.03 importance sampling
def _layered(T=3, seed=0):
    """An episodic MDP with 2 states per step t < T and an absorbing terminal state 2T: every episode ends
    after exactly T steps. Returns P (S, A, S), r (S, A), pi, mu (S, A), gamma, all numpy float64."""
    rng = np.random.default_rng(seed)
    S, A = 2 * T + 1, 2
    P = np.zeros((S, A, S))
    for t in range(T):
        for i in range(2):
            for a in range(A):
                if t < T - 1:
                    P[2 * t + i, a, 2 * t + 2: 2 * t + 4] = rng.dirichlet([1, 1])
                else:
                    P[2 * t + i, a, S - 1] = 1.0
    P[S - 1, :, S - 1] = 1.0
    r = rng.random((S, A))  # rewards in [0, 1), as in FrozenLake
    r[S - 1] = 0.0
    pi, mu = rng.dirichlet([0.5, 0.5], size=S), rng.dirichlet([4, 4], size=S)  # a peaked target, a broad logger
    return P, r, pi, mu, 0.9


def _enumerate(P, r, pi, mu, gamma, T, s0=0):
    """Every trajectory from s0 with its probability under mu, pi_a, mu_a (1, T) and its return."""
    for acts_next in itertools.product(range(2), range(2), repeat=T):
        s, p, pa, ma, G = s0, 1.0, [], [], 0.0
        for t in range(T):
            a, nxt = acts_next[2 * t], acts_next[2 * t + 1]
            if t == T - 1 and nxt == 1:  # the last step has a single successor (the terminal state)
                p = 0.0
            s2 = 2 * t + 2 + nxt if t < T - 1 else P.shape[0] - 1
            p *= mu[s, a] * P[s, a, s2]
            pa.append(pi[s, a])
            ma.append(mu[s, a])
            G += gamma**t * r[s, a]
            s = s2
        if p > 0:
            yield p, torch.tensor([pa]), torch.tensor([ma]), torch.tensor([G])


def _v_exact(P, r, pol, gamma, s0=0):
    S = P.shape[0]
    P_pi, r_pi = np.einsum("sa,sat->st", pol, P), (pol * r).sum(1)
    return np.linalg.solve(np.eye(S) - gamma * P_pi, r_pi)[s0]


@pytest.mark.equation("38.02", oracle="enumeration of every trajectory vs numpy.linalg.solve(I - gamma P_pi, r_pi)")
def test_ordinary_is_is_unbiased_by_enumeration():
    T = 3
    P, r, pi, mu, gamma = _layered(T)
    trajectories = list(_enumerate(P, r, pi, mu, gamma, T))
    assert len(trajectories) == 2 * 4 ** (T - 1) and abs(sum(t[0] for t in trajectories) - 1) < TOL
    expect_is = sum(p * orl.ordinary_importance_sampling(pa, ma, G).item() for p, pa, ma, G in trajectories)
    V_pi, V_mu = _v_exact(P, r, pi, gamma), _v_exact(P, r, mu, gamma)
    assert abs(expect_is - V_pi) < TOL
    # weighted IS is biased: with one episode it returns G, so its expectation is V^mu, not V^pi
    expect_wis = sum(p * orl.weighted_importance_sampling(pa, ma, G).item() for p, pa, ma, G in trajectories)
    assert abs(expect_wis - V_mu) < TOL and abs(V_mu - V_pi) > 0.05


@pytest.mark.equation("38.02", oracle="float64 closed form with numpy.prod")
@pytest.mark.equation("38.03", oracle="float64 closed form with numpy.prod")
def test_is_and_wis_closed_form():
    g = torch.Generator().manual_seed(2)
    pi_a = torch.rand(6, 5, generator=g, dtype=torch.float64)
    mu_a = torch.rand(6, 5, generator=g, dtype=torch.float64) * 0.9 + 0.1
    G = torch.randn(6, generator=g, dtype=torch.float64)
    rho = np.prod(pi_a.numpy() / mu_a.numpy(), axis=1)
    assert abs(orl.ordinary_importance_sampling(pi_a, mu_a, G).item() - np.mean(rho * G.numpy())) < TOL
    assert abs(orl.weighted_importance_sampling(pi_a, mu_a, G).item() - (rho * G.numpy()).sum() / rho.sum()) < TOL
    np.testing.assert_allclose(orl.importance_weights(pi_a, mu_a).numpy(), rho, rtol=TOL)
    mask = torch.arange(5).expand(6, 5) < torch.tensor([5, 3, 1, 4, 2, 5])[:, None]
    rho_m = np.array([np.prod((pi_a[i] / mu_a[i]).numpy()[: int(mask[i].sum())]) for i in range(6)])
    assert abs(orl.ordinary_importance_sampling(pi_a, mu_a, G, mask).item() - np.mean(rho_m * G.numpy())) < TOL
    # 2000 steps of ratio 2 overflow a plain product (2^2000); the log-space softmax does not
    long_pi, long_mu = torch.full((2, 2000), 0.5, dtype=torch.float64), torch.full((2, 2000), 0.25, dtype=torch.float64)
    long_mu[1, 0] = 0.5  # episode 1 has half the weight of episode 0
    assert abs(orl.weighted_importance_sampling(long_pi, long_mu, torch.tensor([1.0, 4.0])).item() - 2.0) < TOL


def _sample_layered(P, r, mu, gamma, n, seed):
    """n episodes of the layered MDP under mu (numpy, seeded): states, actions (n, T), returns (n,)."""
    rng = np.random.default_rng(seed)
    S, T = P.shape[0], (P.shape[0] - 1) // 2
    s = np.zeros(n, dtype=int)
    ss, aa, G = [], [], np.zeros(n)
    for t in range(T):
        a = (rng.random(n) > mu[s, 0]).astype(int)
        ss.append(s)
        aa.append(a)
        G += gamma**t * r[s, a]
        cdf = P[s, a].cumsum(1)
        s = np.minimum((rng.random(n)[:, None] > cdf).sum(1), S - 1)
    return np.stack(ss, 1), np.stack(aa, 1), G


@pytest.mark.equation("38.03", oracle="Monte Carlo over seeded datasets against the exact V^pi (numpy.linalg.solve)")
def test_wis_has_lower_variance_and_is_consistent():
    T = 3
    P, r, pi, mu, gamma = _layered(T, seed=3)
    V_pi = _v_exact(P, r, pi, gamma)
    s, a, G = _sample_layered(P, r, mu, gamma, 400 * 50, seed=0)
    pi_a, mu_a, G = torch.tensor(pi[s, a]), torch.tensor(mu[s, a]), torch.tensor(G)
    bias, se = {}, {}
    for n in (5, 50):
        ois = np.array([orl.ordinary_importance_sampling(pi_a[i * n:(i + 1) * n], mu_a[i * n:(i + 1) * n],
                                                         G[i * n:(i + 1) * n]).item() for i in range(400)])
        wis = np.array([orl.weighted_importance_sampling(pi_a[i * n:(i + 1) * n], mu_a[i * n:(i + 1) * n],
                                                         G[i * n:(i + 1) * n]).item() for i in range(400)])
        assert wis.var() < 0.2 * ois.var()  # measured: about 0.03 at both sizes
        assert abs(ois.mean() - V_pi) < 4 * ois.std() / math.sqrt(400)  # unbiased within 4 standard errors
        bias[n], se[n] = wis.mean() - V_pi, wis.std() / math.sqrt(400)
    assert bias[5] > 8 * se[5] and abs(bias[50]) < bias[5] / 3  # WIS is biased, and the bias shrinks with n
    big = orl.weighted_importance_sampling(pi_a, mu_a, G).item()  # 20000 episodes: consistent
    assert abs(big - V_pi) < 0.05


def test_is_rejects_bad_probabilities():
    with pytest.raises(ValueError, match="mu_a must be > 0"):
        orl.ordinary_importance_sampling(torch.ones(1, 2), torch.tensor([[1.0, 0.0]]), torch.ones(1))
    with pytest.raises(ValueError, match="probabilities"):
        orl.weighted_importance_sampling(torch.full((1, 2), 2.0), torch.ones(1, 2), torch.ones(1))
    assert orl.weighted_importance_sampling(torch.zeros(2, 2), torch.ones(2, 2), torch.ones(2)).item() == 0.0


# ------------------------------------------------------------------------------- 38.04 CQL
@pytest.mark.equation("38.04", oracle="scipy.special.logsumexp float64 closed form and torch.logsumexp")
def test_cql_penalty_closed_form():
    Q, a = _logits(N=7, A=5, seed=4)
    y = torch.randn(7, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    Qn = Q.numpy()
    pen = np.mean(logsumexp(Qn, axis=1) - Qn[np.arange(7), a.numpy()])
    assert abs(orl.cql_loss(Q, a, alpha=2.5).item() - 2.5 * pen) < TOL
    assert abs(orl.cql_loss(Q, a, alpha=2.5).item()
               - 2.5 * (torch.logsumexp(Q, -1) - Q[torch.arange(7), a]).mean().item()) < TOL
    bell = 0.5 * np.mean((Qn[np.arange(7), a.numpy()] - y.numpy()) ** 2)
    assert abs(orl.cql_loss(Q, a, alpha=0.3, target=y).item() - (0.3 * pen + bell)) < TOL


@pytest.mark.equation("38.04", oracle="autograd against the closed-form gradient alpha (softmax(Q) - onehot(a)) / N")
def test_cql_pushes_down_unseen_actions():
    Q, a = _logits(N=8, A=4, seed=6)
    a = a % 2  # the log holds actions 0 and 1 only
    Q.requires_grad_(True)
    orl.cql_loss(Q, a, alpha=1.5).backward()
    expect = 1.5 * (torch.softmax(Q.detach(), -1) - F.one_hot(a, 4)) / 8
    torch.testing.assert_close(Q.grad, expect, atol=TOL, rtol=0)
    assert (Q.grad[:, 2:] > 0).all()  # gradient descent lowers every unseen action
    # on one state, descent on the penalty alone drives the unseen actions down and the logged ones up
    q = torch.zeros(1, 4, dtype=torch.float64, requires_grad=True)
    opt = torch.optim.SGD([q], lr=1.0)
    for _ in range(50):
        opt.zero_grad()
        orl.cql_loss(q.expand(4, 4), torch.tensor([0, 0, 0, 1])).backward()
        opt.step()
    assert (q[0, 2:] < -1).all() and (q[0, :2] > 0).all()


# ------------------------------------------------------------------------------- 38.05 IQL
@pytest.mark.equation("38.05", oracle="0.5 * torch.nn.functional.mse_loss (tau = 0.5) and a numpy closed form")
def test_iql_loss_half_squared_error_and_asymmetry():
    g = torch.Generator().manual_seed(7)
    Q, V = torch.randn(50, generator=g, dtype=torch.float64), torch.randn(50, generator=g, dtype=torch.float64)
    torch.testing.assert_close(orl.iql_value_loss(Q, V, tau=0.5), 0.5 * F.mse_loss(V, Q), atol=TOL, rtol=0)
    u = (Q - V).numpy()
    for tau in (0.1, 0.7, 0.99):
        ref = np.abs(tau - (u < 0)) * u**2
        np.testing.assert_allclose(orl.iql_value_loss(Q, V, tau=tau, reduction="none").numpy(), ref, atol=TOL)


@pytest.mark.equation("38.05", oracle="scipy.optimize.brentq on the first-order condition and minimize_scalar")
@pytest.mark.parametrize("tau", [0.1, 0.5, 0.8, 0.95])
def test_expectile_is_the_minimiser(tau):
    rng = np.random.default_rng(8)
    x, w = rng.normal(size=11), rng.random(11)

    def foc(m):
        return tau * (w * np.clip(x - m, 0, None)).sum() - (1 - tau) * (w * np.clip(m - x, 0, None)).sum()

    def loss(m):
        return (w * np.abs(tau - (x - m < 0)) * (x - m) ** 2).sum()

    e = orl.expectile(torch.tensor(x), tau, torch.tensor(w)).item()
    assert abs(e - brentq(foc, x.min(), x.max(), xtol=1e-15)) < 1e-12
    ref = minimize_scalar(loss, bounds=(x.min(), x.max()), method="bounded", options=dict(xatol=1e-10)).x
    assert abs(e - ref) < 1e-7  # the bounded golden-section search stops at about 1e-8
    # the registered loss's gradient in V vanishes at the (unweighted) expectile
    V = orl.expectile(torch.tensor(x), tau).expand(11).clone().requires_grad_(True)
    orl.iql_value_loss(torch.tensor(x), V, tau=tau, reduction="sum").backward()
    assert abs(V.grad.sum().item()) < 1e-12


@pytest.mark.equation("38.05", oracle="the sample mean and maximum")
def test_expectile_limits():
    x = torch.tensor([0.3, -1.0, 2.5, 1.0], dtype=torch.float64)
    assert abs(orl.expectile(x, 0.5).item() - x.mean().item()) < TOL
    taus = [0.5, 0.9, 0.99, 0.999, 1.0]
    e = [orl.expectile(x, t).item() for t in taus]
    assert all(b > a for a, b in itertools.pairwise(e)) and e[-1] == 2.5 and 2.5 - e[-2] < 0.01


# ------------------------------------------------------------------------------- 38.06 AWR
@pytest.mark.equation("38.06", oracle="float64 numpy closed form with the clip at w_max")
def test_awr_closed_form():
    logits, a = _logits(N=10, A=3, seed=9)
    A = torch.linspace(-2, 3, 10, dtype=torch.float64)
    ln = logits.numpy()
    logp = (ln - logsumexp(ln, axis=1, keepdims=True))[np.arange(10), a.numpy()]
    for beta, w_max in ((1.0, 20.0), (0.5, 5.0), (2.0, 1e9)):
        w = np.minimum(np.exp(A.numpy() / beta), w_max)
        assert abs(orl.awr_loss(logits, a, A, beta=beta, w_max=w_max).item() - np.mean(-w * logp)) < TOL
    # huge advantages give w_max, not inf, and no gradient flows into A
    A2 = torch.full((10,), 1e6, dtype=torch.float64, requires_grad=True)
    out = orl.awr_loss(logits, a, A2, w_max=20.0)
    assert abs(out.item() - np.mean(-20.0 * logp)) < 1e-10 and not out.requires_grad


@pytest.mark.equation("38.06", oracle="autograd: zero gradient of awr_loss at the closed-form tabular policy")
def test_awr_tabular_minimiser():
    g = torch.Generator().manual_seed(10)
    S, A, N = 4, 3, 300
    s, a = torch.randint(0, S, (N,), generator=g), torch.randint(0, A, (N,), generator=g)
    adv = torch.randn(S, A, generator=g, dtype=torch.float64)[s, a]
    beta, w_max = 0.5, 3.0
    n_w = np.zeros((S, A))
    np.add.at(n_w, (s.numpy(), a.numpy()), np.minimum(np.exp(adv.numpy() / beta), w_max))
    logits = torch.tensor(np.log(n_w / n_w.sum(1, keepdims=True)), requires_grad=True)
    orl.awr_loss(logits[s], a, adv, beta=beta, w_max=w_max).backward()
    assert logits.grad.abs().max().item() < 1e-15


# ------------------------------------------------------------------------------- FrozenLake
def _frozenlake_log(n=1000):
    from llmbook.agents import dynamic_programming as dp
    from llmbook.agents import envs

    mdp = envs.from_gymnasium("FrozenLake-v1", is_slippery=True)
    pi_star = F.one_hot(dp.value_iteration(mdp.P, mdp.R, mdp.gamma).policy, 4).double()
    mu = 0.3 * pi_star + 0.7 / 4
    ep = envs.sample_episodes(mdp, mu, n=n, T=100, generator=torch.Generator().manual_seed(0))
    keep = ~ep.done[:, :-1]
    log = (ep.states[:, :-1][keep], ep.actions[keep], ep.rewards[keep], ep.states[:, 1:][keep], ep.done[:, 1:][keep])
    return mdp, pi_star, mu, log


@pytest.mark.equation("38.05", oracle="exact policy evaluation (numpy.linalg.solve) on FrozenLake")
def test_frozenlake_iql_beats_behaviour_and_bc():
    mdp, pi_star, mu, log = _frozenlake_log()
    P, R = mdp.P.numpy(), mdp.r_sa.numpy()

    def value(pol):
        return _v_exact(P, R, pol.numpy(), mdp.gamma)

    bc = orl.fit_tabular("bc", *log, 16, 4, mdp.gamma)
    iql = orl.fit_tabular("iql", *log, 16, 4, mdp.gamma, tau=0.9, beta=0.03)
    v_mu, v_bc, v_iql, v_star = value(mu), value(bc["pi"]), value(iql["pi"]), value(pi_star)
    assert abs(v_bc - v_mu) < 0.01 < 0.2 < v_iql - v_mu and v_iql < v_star
    # IQL's V is an in-sample expectile: it never exceeds the best logged action's Q
    seen = iql["n"] > 0
    Qmax = torch.where(seen, iql["Q"], -torch.inf).amax(-1)
    rows = seen.any(-1)
    assert (iql["V"][rows] <= Qmax[rows] + TOL).all()


def test_awr_optimum_inverts_to_the_advantage_claim_c14():
    """Claim C14 in offline form (book/38, sec-38-06): the AWR optimum found by L-BFGS (not the closed form)
    gives beta log(pi / mu_hat) = A(s, a) + a state-only term, and DPO's loss on pairs of logged actions of one
    state equals the Bradley-Terry loss of A (chapter 10's functions). Tolerance 1e-5: L-BFGS on the summed
    loss (~1e4) stalls near 1e-7 in float64."""
    from llmbook.lm import preference

    mdp, _, _, (s, a, r, s_next, done) = _frozenlake_log()
    iql = orl.fit_tabular("iql", s, a, r, s_next, done, 16, 4, mdp.gamma, tau=0.9, beta=0.03)
    logged, beta = iql["n"] > 0, 0.5
    A_table = iql["Q"] - iql["V"][:, None]
    theta = torch.zeros(16, 4, dtype=torch.float64, requires_grad=True)
    opt = torch.optim.LBFGS([theta], lr=1, max_iter=200, tolerance_grad=1e-10, tolerance_change=0,
                            line_search_fn="strong_wolfe")
    mask = torch.tensor(-1e4, dtype=torch.float64)

    def closure():
        opt.zero_grad()
        loss = len(s) * orl.awr_loss(torch.where(logged, theta, mask)[s], a, A_table[s, a], beta=beta, w_max=1e12)
        loss.backward()
        return loss

    opt.step(closure)
    log_pi = torch.log_softmax(torch.where(logged, theta, mask), -1).detach()
    log_mu = torch.log(iql["n"] / iql["n"].sum(-1, keepdim=True).clamp(min=1))
    resid = beta * (log_pi - log_mu) - A_table
    rows = [k for k in range(16) if logged[k].any()]
    assert max((resid[k][logged[k]].max() - resid[k][logged[k]].min()).item() for k in rows) < 1e-5
    # the same residual is NOT constant for the behaviour policy itself (the check can fail)
    assert max((A_table[k][logged[k]].max() - A_table[k][logged[k]].min()).item() for k in rows) > 0.1
    pairs = [(k, i, j) for k in rows for i in range(4) for j in range(4)
             if logged[k, i] and logged[k, j] and A_table[k, i] > A_table[k, j]]
    ps, pw, pl = (torch.tensor(c) for c in zip(*pairs, strict=True))
    dpo = preference.dpo_loss(log_pi[ps, pw], log_pi[ps, pl], log_mu[ps, pw], log_mu[ps, pl], beta=beta)
    bt = preference.reward_model_loss(A_table[ps, pw], A_table[ps, pl])
    assert len(pairs) > 20 and abs(dpo - bt).item() < 1e-5


def test_try_it_numbers():
    from tests.try_it import assert_states

    is1 = orl.ordinary_importance_sampling(torch.tensor([[0.9, 0.9]]), torch.tensor([[0.3, 0.5]]), torch.tensor([1.0]))
    wis1 = orl.weighted_importance_sampling(torch.tensor([[0.9, 0.9]]), torch.tensor([[0.3, 0.5]]), torch.tensor([1.0]))
    assert abs(is1.item() - 5.4) < 1e-5 and wis1.item() == 1.0
    e = orl.expectile(torch.tensor([0.0, 1.0, 5.0]), 0.9).item()
    assert abs(e - 46 / 11) < 1e-12 and orl.expectile(torch.tensor([0.0, 1.0, 5.0]), 0.5).item() == 2.0
    # AWR: a single logged action with A = 0.2, beta = 0.05 gets weight min(e^4, 20) = 20
    w = orl.awr_loss(torch.zeros(1, 2), torch.tensor([0]), torch.tensor([0.2]), beta=0.05) / math.log(2)
    assert abs(w.item() - 20.0) < 1e-4 and math.exp(0.2 / 0.05) > 54.5
    # beta = 1 on the lake: advantages in [-0.2662, 0.0219], weights near 1, AWR close to BC
    mdp, pi_star, mu, log = _frozenlake_log()
    fit = {b: orl.fit_tabular("iql", *log, 16, 4, mdp.gamma, tau=0.9, beta=b) for b in (1.0, 0.03)}
    adv = (fit[1.0]["Q"] - fit[1.0]["V"][:, None])[fit[1.0]["n"] > 0]
    P, R = mdp.P.numpy(), mdp.r_sa.numpy()
    v = {b: _v_exact(P, R, f["pi"].numpy(), mdp.gamma) for b, f in fit.items()}
    v_mu = _v_exact(P, R, mu.numpy(), mdp.gamma)
    assert v_mu < v[1.0] < v_mu + 0.01 < v[0.03]
    assert_states("38-offline-rl.ipynb", ["$\\rho = 0.81/0.15 = 5.4$", "exactly 1", f"{e:.4f}", "$m = 46/11$",
                                          "$e^{0.2/0.05} = e^4 = 54.6$, clipped to 20",
                                          f"between {adv.min():.4f} and\n   {adv.max():.4f}",
                                          f"between {math.exp(adv.min()):.2f} and {math.exp(adv.max()):.2f}",
                                          f"worth {v[1.0]:.4f} from the start", f"$V^\\mu = {v_mu:.4f}$",
                                          f"({v[0.03]:.4f} at"])
