"""Tests of llmbook.agents.returns (chapter 35) against scipy.signal.lfilter, brute-force loops and closed forms."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.signal import lfilter

from llmbook.agents import returns as ret
from llmbook.lm import rlhf

TOL = 1e-12  # float64 throughout: the recursions and the brute-force sums differ only by rounding


def _rollout(B=5, T=12, p_done=0.2, seed=0):
    """Random rewards (B, T), values (B, T + 1) and dones (B, T), float64 / bool, several episodes per row."""
    g = torch.Generator().manual_seed(seed)
    r = torch.randn(B, T, generator=g, dtype=torch.float64)
    V = torch.randn(B, T + 1, generator=g, dtype=torch.float64)
    d = torch.rand(B, T, generator=g, dtype=torch.float64) < p_done
    return r, V, d


def _segments(d_row, T):
    """[start, end) of each episode piece of a row: a done at step t closes the piece at t + 1."""
    ends = [t + 1 for t in range(T) if d_row[t]]
    if not ends or ends[-1] != T:
        ends.append(T)
    return list(zip([0] + ends[:-1], ends, strict=True))


def _brute_n_step(r, V, d, n, gamma):
    """G_t^(n) by explicit loops: add gamma^i r_{t+i} until n rewards, a done, or the row's end; bootstrap if alive."""
    r, V, d = r.numpy(), V.numpy(), d.numpy()
    B, T = r.shape
    G = np.zeros((B, T))
    for b in range(B):
        for t in range(T):
            total, k, ended = 0.0, 0, False
            while k < n and t + k < T:
                total += gamma**k * r[b, t + k]
                k += 1
                if d[b, t + k - 1]:
                    ended = True
                    break
            if not ended:
                total += gamma**k * V[b, t + k]
            G[b, t] = total
    return G


def _horizon(d, T):
    """N_t: the number of steps from t to the end of its episode piece (a done or the row's end)."""
    B = d.shape[0]
    N = np.zeros((B, T), dtype=int)
    for b in range(B):
        for t in range(T):
            k = 1
            while t + k - 1 < T - 1 and not d[b, t + k - 1]:
                k += 1
            N[b, t] = k
    return N


# ----------------------------------------------------------------------------------------------- 35.01


def _frozenlake_q_v(gamma=0.9):
    """Exact Q^pi (S, A) and V^pi (S,) of a fixed stochastic policy on slippery FrozenLake, by numpy.linalg.solve."""
    gym = pytest.importorskip("gymnasium")
    env = gym.make("FrozenLake-v1", is_slippery=True)
    P = env.unwrapped.P
    S, A = env.observation_space.n, env.action_space.n
    pi = np.random.default_rng(0).dirichlet(np.ones(A), size=S)
    P_sa = np.zeros((S, A, S))
    r_sa = np.zeros((S, A))
    for s in range(S):
        for a in range(A):
            for p, s2, rew, term in P[s][a]:
                r_sa[s, a] += p * rew
                if not term:
                    P_sa[s, a, s2] += p
    P_pi = np.einsum("sa,sat->st", pi, P_sa)
    V = np.linalg.solve(np.eye(S) - gamma * P_pi, (pi * r_sa).sum(1))
    Q = r_sa + gamma * P_sa @ V
    return pi, Q, V


@pytest.mark.equation("35.01", oracle="numpy.linalg.solve (exact Q^pi, V^pi of FrozenLake) and sum_a pi A = 0")
def test_advantage_on_frozenlake_averages_to_zero_under_pi():
    pi, Q, V = _frozenlake_q_v()
    A = ret.advantage(torch.tensor(Q), torch.tensor(V))
    np.testing.assert_allclose(A.numpy(), Q - V[:, None], atol=TOL, rtol=0)
    np.testing.assert_allclose((torch.tensor(pi) * A).sum(-1).numpy(), 0.0, atol=1e-12)
    assert A.abs().max() > 1e-3  # not trivially zero: some actions are better than others
    # per-step layout: Q(s_t, a_t) and V(s_t) of the same shape
    s = torch.tensor([[0, 4, 8], [1, 2, 6]])
    a = torch.tensor([[1, 2, 0], [3, 1, 2]])
    per_step = ret.advantage(torch.tensor(Q)[s, a], torch.tensor(V)[s])
    np.testing.assert_allclose(per_step.numpy(), Q[s.numpy(), a.numpy()] - V[s.numpy()], atol=TOL, rtol=0)


def test_advantage_rejects_mismatched_shapes():
    with pytest.raises(ValueError, match="shape of Q"):
        ret.advantage(torch.zeros(3, 4), torch.zeros(4))


# ----------------------------------------------------------------------------------------------- 35.02


@pytest.mark.equation("35.02", oracle="scipy.signal.lfilter discounted sum per episode, and a brute-force loop")
@pytest.mark.parametrize("gamma", [0.0, 0.5, 0.9, 1.0])
def test_monte_carlo_return_matches_lfilter_per_episode(gamma):
    r, _, d = _rollout(B=6, T=15, p_done=0.25, seed=1)
    G = ret.monte_carlo_return(r, gamma, dones=d)
    expected = np.zeros(r.shape)
    for b in range(r.shape[0]):
        for s, e in _segments(d[b].tolist(), r.shape[1]):
            x = r[b, s:e].numpy()
            expected[b, s:e] = lfilter([1.0], [1.0, -gamma], x[::-1])[::-1]  # y_t = x_t + gamma y_{t+1}
    np.testing.assert_allclose(G.numpy(), expected, atol=TOL, rtol=0)
    # brute force: sum_k gamma^(k - t) r_k up to the episode's last step
    N = _horizon(d.numpy(), r.shape[1])
    brute = np.array([[sum(gamma**k * r[b, t + k].item() for k in range(N[b, t])) for t in range(r.shape[1])]
                      for b in range(r.shape[0])])
    np.testing.assert_allclose(G.numpy(), brute, atol=TOL, rtol=0)
    assert d.any() and not d.all()  # the rollout holds several episodes per row


def test_monte_carlo_return_accepts_numeric_dones_and_rejects_other_values():
    r, _, d = _rollout(seed=2)
    torch.testing.assert_close(ret.monte_carlo_return(r, 0.9, dones=d.double()), ret.monte_carlo_return(r, 0.9, d))
    with pytest.raises(ValueError, match="0/1"):
        ret.monte_carlo_return(r, 0.9, dones=d.double() * 2)
    with pytest.raises(ValueError, match="dones must have shape"):
        ret.monte_carlo_return(r, 0.9, dones=d[:, :-1])


# ----------------------------------------------------------------------------------------------- 35.03


@pytest.mark.equation("35.03", oracle="brute-force Python loop over the n rewards, dones and the bootstrap")
@pytest.mark.parametrize("n", [1, 2, 3, 5, 12, 40])
@pytest.mark.parametrize("gamma", [0.0, 0.7, 1.0])
def test_n_step_return_matches_brute_force(n, gamma):
    r, V, d = _rollout(B=4, T=12, p_done=0.2, seed=3)
    G = ret.n_step_return(r, V, n, gamma, dones=d)
    np.testing.assert_allclose(G.numpy(), _brute_n_step(r, V, d, n, gamma), atol=TOL, rtol=0)
    G_nodone = ret.n_step_return(r, V, n, gamma)
    np.testing.assert_allclose(G_nodone.numpy(), _brute_n_step(r, V, torch.zeros_like(d), n, gamma), atol=TOL, rtol=0)


@pytest.mark.equation("35.03", oracle="closed forms: n = 1 is the TD(0) target, n >= T the Monte Carlo return")
def test_n_step_return_limits():
    r, V, d = _rollout(B=5, T=10, seed=4)
    gamma = 0.9
    td0 = r + gamma * (~d).double() * V[:, 1:]
    np.testing.assert_allclose(ret.n_step_return(r, V, 1, gamma, d).numpy(), td0.numpy(), atol=TOL, rtol=0)
    d_end = d.clone()
    d_end[:, -1] = True  # every episode ends inside the row
    mc = np.zeros(r.shape)
    for b in range(r.shape[0]):
        for s, e in _segments(d_end[b].tolist(), r.shape[1]):
            mc[b, s:e] = lfilter([1.0], [1.0, -gamma], r[b, s:e].numpy()[::-1])[::-1]
    for n in (10, 11, 100):
        np.testing.assert_allclose(ret.n_step_return(r, V, n, gamma, d_end).numpy(), mc, atol=TOL, rtol=0)


def _frozenlake_table(gamma):
    envs = pytest.importorskip("llmbook.agents.envs")
    pytest.importorskip("gymnasium")
    return envs, envs.from_gymnasium("FrozenLake-v1", gamma=gamma, is_slippery=True)


@pytest.mark.equation("35.03", oracle="closed form E[G^(n) | s_0] = sum_i (gamma P_pi)^i r_pi + (gamma P_pi)^n V")
def test_n_step_return_expectation_on_frozenlake():
    """Sampled FrozenLake episodes: the mean n-step return from the start state matches the matrix closed form.

    Any V (here a random table) enters only through E[gamma^n V(s_n)]; 20 000 episodes give a standard error
    near 0.004 and the tolerance is 5 standard errors.
    """
    gamma = 0.9
    envs, mdp = _frozenlake_table(gamma)
    S = mdp.S
    pi = torch.full((S, mdp.A), 0.25, dtype=torch.float64)
    V_tab = torch.rand(S, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    V_tab[mdp.terminal] = 0.0
    T = 30
    ep = envs.sample_episodes(mdp, pi, n=20_000, T=T, generator=torch.Generator().manual_seed(1), s0=0)
    dones = ep.done[:, 1:] & ~ep.done[:, :-1]  # termination happens on this step
    V_steps = V_tab[ep.states]
    P_pi = torch.einsum("sa,sat->st", pi, mdp.P)
    r_pi = (pi * mdp.r_sa).sum(1)
    for n in (1, 3, 8):
        G = ret.n_step_return(ep.rewards, V_steps, n, gamma, dones=dones)[:, 0]
        expected, M = torch.zeros(S, dtype=torch.float64), torch.eye(S, dtype=torch.float64)
        for _ in range(n):
            expected = expected + M @ r_pi
            M = gamma * M @ P_pi
        expected = (expected + M @ V_tab)[0]
        se = G.std() / len(G) ** 0.5
        assert abs(G.mean() - expected) < 5 * se, (n, G.mean().item(), expected.item(), se.item())


# ----------------------------------------------------------------------------------------------- 35.04


def _brute_lambda(r, V, d, lam, gamma):
    """(1 - lam) sum_{n < N} lam^(n-1) G^(n) + lam^(N-1) G^(N), from brute-force n-step returns (float64)."""
    B, T = r.shape
    N = _horizon(d.numpy(), T)
    Gn = {n: _brute_n_step(r, V, d, n, gamma) for n in range(1, T + 1)}
    out = np.zeros((B, T))
    for b in range(B):
        for t in range(T):
            Nt = N[b, t]
            head = sum((1 - lam) * lam ** (n - 1) * Gn[n][b, t] for n in range(1, Nt))
            out[b, t] = head + lam ** (Nt - 1) * Gn[Nt][b, t]
    return out


@pytest.mark.equation("35.04", oracle="weighted sum of brute-force n-step returns (1 - lam) lam^(n-1), float64")
@pytest.mark.parametrize("lam", [0.0, 0.3, 0.95, 1.0])
@pytest.mark.parametrize("gamma", [0.8, 1.0])
def test_lambda_return_is_the_weighted_sum_of_n_step_returns(lam, gamma):
    r, V, d = _rollout(B=4, T=10, p_done=0.2, seed=5)
    G = ret.lambda_return(r, V, lam, gamma, dones=d)
    np.testing.assert_allclose(G.numpy(), _brute_lambda(r, V, d, lam, gamma), atol=1e-12, rtol=0)


@pytest.mark.equation("35.04", oracle="closed forms: lam = 0 is the TD(0) target, lam = 1 the Monte Carlo return")
def test_lambda_return_limits():
    r, V, d = _rollout(B=5, T=12, seed=6)
    gamma = 0.9
    td0 = r + gamma * (~d).double() * V[:, 1:]
    np.testing.assert_allclose(ret.lambda_return(r, V, 0.0, gamma, d).numpy(), td0.numpy(), atol=TOL, rtol=0)
    V0 = V.clone()
    V0[:, -1] = 0.0  # no bootstrap at the row's end: lam = 1 is the plain Monte Carlo return
    mc = np.zeros(r.shape)
    for b in range(r.shape[0]):
        for s, e in _segments(d[b].tolist(), r.shape[1]):
            mc[b, s:e] = lfilter([1.0], [1.0, -gamma], r[b, s:e].numpy()[::-1])[::-1]
    np.testing.assert_allclose(ret.lambda_return(r, V0, 1.0, gamma, d).numpy(), mc, atol=TOL, rtol=0)
    np.testing.assert_allclose(ret.monte_carlo_return(r, gamma, d).numpy(), mc, atol=TOL, rtol=0)


@pytest.mark.equation("35.04", oracle="GAE as a sum of TD errors (chapter 10's rlhf.gae): G^lambda - V = A^GAE")
@pytest.mark.parametrize(("gamma", "lam"), [(1.0, 0.95), (0.99, 0.95), (0.9, 0.0), (0.9, 1.0), (0.5, 0.7)])
def test_lambda_return_minus_v_is_gae(gamma, lam):
    r, V, _ = _rollout(B=3, T=20, seed=7)
    A_gae = rlhf.gae(r, V, gamma=gamma, lam=lam)
    np.testing.assert_allclose((ret.lambda_return(r, V, lam, gamma) - V[:, :-1]).numpy(), A_gae.numpy(),
                               atol=1e-12, rtol=0)


def test_rows_are_independent_and_empty_rollouts_work():
    r, V, d = _rollout(B=3, T=8, seed=8)
    full = ret.lambda_return(r, V, 0.9, 0.9, d)
    for b in range(3):
        torch.testing.assert_close(ret.lambda_return(r[b:b + 1], V[b:b + 1], 0.9, 0.9, d[b:b + 1])[0], full[b])
    assert ret.n_step_return(torch.zeros(2, 0), torch.zeros(2, 1), 3).shape == (2, 0)
    assert ret.lambda_return(torch.zeros(2, 0), torch.zeros(2, 1)).shape == (2, 0)
    assert ret.monte_carlo_return(torch.zeros(2, 0)).shape == (2, 0)


def test_bad_arguments_are_named():
    r, V, _ = _rollout()
    with pytest.raises(ValueError, match=r"V must have shape"):
        ret.n_step_return(r, V[:, :-1], 2)
    with pytest.raises(ValueError, match="n must be a positive int"):
        ret.n_step_return(r, V, 0)
    with pytest.raises(ValueError, match="lam must lie in"):
        ret.lambda_return(r, V, 1.5)
    with pytest.raises(ValueError, match="r contains NaN"):
        ret.monte_carlo_return(torch.full((1, 2), float("nan")))


# ----------------------------------------------------------------------------------------------- data and Try it


def test_gymnasium_rollout_layout_follows_the_exact_table():
    """Every recorded step is a transition of gymnasium's own table; a done is followed by the start state."""
    gym = pytest.importorskip("gymnasium")
    P = gym.make("FrozenLake-v1", is_slippery=True).unwrapped.P
    pi = torch.full((16, 4), 0.25, dtype=torch.float64)
    states, r, d = ret.gymnasium_rollout("FrozenLake-v1", pi, B=6, T=40, seed=3, is_slippery=True)
    assert states.shape == (6, 41) and r.shape == d.shape == (6, 40) and d.any()
    for b in range(6):
        for t in range(40):
            s, s2 = int(states[b, t]), int(states[b, t + 1])
            moves = [(s_next, rew, term) for a in range(4) for _p, s_next, rew, term in P[s][a]]
            if d[b, t]:
                assert s2 == 0  # auto-reset in the same step: the new episode's first state
                assert any(term and rew == r[b, t].item() for _s, rew, term in moves)
            else:
                assert any(s_next == s2 and rew == r[b, t].item() and not term for s_next, rew, term in moves)
    again = ret.gymnasium_rollout("FrozenLake-v1", pi, B=6, T=40, seed=3, is_slippery=True)
    assert all(torch.equal(x, y) for x, y in zip((states, r, d), again, strict=True))  # seeded
    with pytest.raises(ValueError, match="pi must have shape"):
        ret.gymnasium_rollout("FrozenLake-v1", torch.full((15, 4), 0.25), B=1, T=2)


def test_try_it_numbers():
    """The numbers stated in the Try-it solutions of book/35-returns.ipynb."""
    from tests.try_it import assert_states

    # 1. rewards (0, 0, 1), terminating; V = 0.5; gamma = 1
    r = torch.tensor([[0.0, 0.0, 1.0]], dtype=torch.float64)
    V = torch.tensor([[0.5, 0.5, 0.5, 0.0]], dtype=torch.float64)
    d = torch.tensor([[False, False, True]])
    G = [ret.n_step_return(r, V, n, 1.0, d)[0, 0].item() for n in (1, 2, 3)]
    G_lam = ret.lambda_return(r, V, 0.5, 1.0, d)[0, 0].item()
    assert G == [0.5, 0.5, 1.0] and G_lam == pytest.approx(0.625, abs=1e-15)
    # 2. the exact critic: the notebook's rollout and scoring
    envs = pytest.importorskip("llmbook.agents.envs")
    pytest.importorskip("gymnasium")
    gamma = 0.95
    mdp = envs.from_gymnasium("FrozenLake-v1", gamma=gamma, is_slippery=True)
    best = torch.tensor([0, 3, 0, 3, 0, 0, 0, 0, 3, 1, 0, 0, 0, 2, 1, 0])
    pi = torch.full((mdp.S, mdp.A), 0.1, dtype=torch.float64)
    pi[torch.arange(mdp.S), best] += 0.6
    P_pi = torch.einsum("sa,sat->st", pi, mdp.P)
    V_pi = torch.linalg.solve(torch.eye(mdp.S, dtype=torch.float64) - gamma * P_pi, (pi * mdp.r_sa).sum(1))
    states, r, dones = ret.gymnasium_rollout("FrozenLake-v1", pi, B=128, T=100, seed=0, is_slippery=True)
    complete = torch.flip(torch.cummax(torch.flip(dones.int(), [1]), 1).values, [1]).bool()
    target, Vs = V_pi[states[:, :-1]], V_pi[states]
    ns, lams = [1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 64], np.linspace(0.0, 1.0, 21)
    mse_n = [((ret.n_step_return(r, Vs, n, gamma, dones) - target)[complete] ** 2).mean().item() for n in ns]
    mse_l = [((ret.lambda_return(r, Vs, float(x), gamma, dones) - target)[complete] ** 2).mean().item() for x in lams]
    assert ns[int(np.argmin(mse_n))] == 1 and lams[int(np.argmin(mse_l))] == 0.0
    # 3. GAE's horizon in chapter 10
    horizon_99 = 1 / (1 - 0.99 * 0.95)
    assert_states("35-returns.ipynb", [
        "$G^{0.5}_0 = 0.25 + 0.125 + 0.25 = 0.625$",
        f"both at MSE {min(mse_n):.4f}", f"{mse_l[-1]:.4f} for the Monte Carlo return",
        f"$1/(1 - 0.95) = {1 / (1 - 0.95):.0f}$", f"$0.95^{{20}} = {0.95**20:.3f}$",
        f"$1/(1 - 0.9405) = {horizon_99:.1f}$", f"$0.9405^{{20}} = {(0.99 * 0.95) ** 20:.3f}$",
    ])
