"""Tests of llmbook.agents.bandits.

Oracles: ``scipy.special.softmax`` and ``torch.softmax`` (Boltzmann), Python-float loops written from the
definitions (epsilon-greedy, UCB1, EXP3), ``scipy.stats.beta`` and a grid-normalised Bayes posterior
(Thompson sampling).
"""

import math

import numpy as np
import pytest
import scipy.special
import scipy.stats
import torch

from llmbook.agents import bandits as B
from llmbook.agents import regret as R


@pytest.mark.equation("36.01", oracle="Python loop over arms from the definition")
def test_epsilon_greedy_matches_loop():
    Q = torch.tensor([[0.2, 0.9, 0.9, 0.1], [1.0, -1.0, 0.5, 0.0]], dtype=torch.float64)
    for eps in (0.0, 0.1, 1.0):
        P = B.epsilon_greedy(Q, eps)
        for row, p in zip(Q.tolist(), P.tolist(), strict=True):
            best = [a for a, q in enumerate(row) if q == max(row)]
            ref = [eps / 4 + ((1 - eps) / len(best) if a in best else 0.0) for a in range(4)]
            assert p == pytest.approx(ref, abs=1e-15)
    # sampling: the empirical frequencies of the greedy arm match 1 - eps + eps/K within 4 sigma
    p = B.epsilon_greedy(Q[1], 0.2)
    draws = torch.multinomial(p, 20000, replacement=True, generator=torch.Generator().manual_seed(0))
    freq = (draws == 0).double().mean().item()
    assert abs(freq - 0.85) < 4 * math.sqrt(0.85 * 0.15 / 20000)


@pytest.mark.equation("36.02", oracle="scipy.special.softmax and torch.softmax in float64")
def test_boltzmann_matches_softmax():
    Q = torch.randn(5, 6, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    for tau in (0.05, 0.5, 1.0, 7.0):
        P = B.boltzmann(Q, tau)
        np.testing.assert_allclose(P.numpy(), scipy.special.softmax(Q.numpy() / tau, axis=-1), rtol=1e-12, atol=1e-15)
        torch.testing.assert_close(P, torch.softmax(Q / tau, -1), rtol=1e-12, atol=1e-15)
    # tau -> 0 is greedy (claim C17's rule), tau -> inf is uniform; no overflow at huge Q / tau
    assert torch.equal(B.boltzmann(Q, 0.0), B.epsilon_greedy(Q, 0.0))
    torch.testing.assert_close(B.boltzmann(Q, 1e-6), torch.nn.functional.one_hot(Q.argmax(-1), 6).double())
    torch.testing.assert_close(B.boltzmann(Q, 1e9), torch.full_like(Q, 1 / 6), rtol=1e-8, atol=0)
    assert torch.isfinite(B.boltzmann(torch.tensor([1e30, -1e30, 0.0]), 1e-3)).all()


@pytest.mark.equation("36.03", oracle="Python math loop from Auer et al.'s definition")
def test_ucb1_matches_loop():
    mu = [0.5, 0.6, 0.1, 0.3]
    N = [4.0, 1.0, 0.0, 9.0]
    for t, c in ((1, math.sqrt(2)), (13, math.sqrt(2)), (13, 0.5)):
        got = B.ucb1(torch.tensor(mu, dtype=torch.float64), torch.tensor(N, dtype=torch.float64), t, c).tolist()
        ref = [m + c * math.sqrt(math.log(t) / n) if n > 0 else math.inf for m, n in zip(mu, N, strict=True)]
        assert got == pytest.approx(ref, rel=1e-14)
    with pytest.raises(ValueError, match="non-negative"):
        B.ucb1(torch.zeros(2), torch.tensor([1.0, -1.0]), 3)


@pytest.mark.equation("36.05", oracle="scipy.stats.beta (posterior pdf on a grid vs Bayes' rule; KS test of draws)")
def test_thompson_posterior_matches_scipy():
    S, F = torch.tensor([3.0, 10.0, 0.0]), torch.tensor([5.0, 2.0, 1.0])
    d = B.thompson_sampling(S, F, 2.0, 1.0, generator=torch.Generator().manual_seed(0))
    grid = np.linspace(1e-4, 1 - 1e-4, 20001)
    for a in range(3):
        # Bayes: prior Beta(2, 1) times the Bernoulli likelihood, normalised numerically on the grid
        post = scipy.stats.beta.pdf(grid, 2, 1) * grid ** S[a].item() * (1 - grid) ** F[a].item()
        post /= np.trapezoid(post, grid)
        ref = scipy.stats.beta.pdf(grid, d.alpha[a].item(), d.beta[a].item())
        np.testing.assert_allclose(post, ref, rtol=1e-5, atol=1e-5)
    # the draws follow Beta(alpha, beta): 4000 independent draws of arm 0, Kolmogorov-Smirnov p > 1e-3
    g = np.random.default_rng(3)
    draws = np.array([B.thompson_sampling(S, F, generator=g).theta[0].item() for _ in range(4000)])
    assert scipy.stats.kstest(draws, scipy.stats.beta(4.0, 6.0).cdf).pvalue > 1e-3
    assert int(d.action) == int(d.theta.argmax())


def _exp3_closed_form(w, gamma):
    K = len(w)
    return [(1 - gamma) * wi / sum(w) + gamma / K for wi in w]


@pytest.mark.equation("36.07", oracle="float64 closed form with explicit weights w = exp(log w)")
def test_exp3_probabilities_and_update():
    log_w = [0.0, 1.5, -0.3, 0.2]
    for gamma in (0.0, 0.1, 1.0):
        got = B.exp3_probabilities(torch.tensor(log_w, dtype=torch.float64), gamma).tolist()
        assert got == pytest.approx(_exp3_closed_form([math.exp(v) for v in log_w], gamma), rel=1e-13)
    p = B.exp3_probabilities(torch.tensor(log_w, dtype=torch.float64), 0.1)
    one = torch.tensor(1.0, dtype=torch.float64)
    new = B.exp3_update(torch.tensor(log_w, dtype=torch.float64), p, torch.tensor(2), one, 0.1)
    w_ref = [math.exp(v) for v in log_w]
    w_ref[2] *= math.exp(0.1 * (1.0 / p[2].item()) / 4)  # Auer et al.: w_i exp(gamma x_hat / K)
    assert torch.exp(new).tolist() == pytest.approx(w_ref, rel=1e-13)
    # the importance-weighted estimate is unbiased: E_a[x_hat_i] = x_i, by enumeration over a
    x = [0.2, 0.9, 0.4, 0.6]
    est = [sum(p[a].item() * (x[a] / p[a].item() if a == i else 0.0) for a in range(4)) for i in range(4)]
    assert est == pytest.approx(x, rel=1e-14)
    with pytest.raises(ValueError, match="arm ids"):
        B.exp3_update(torch.tensor(log_w, dtype=torch.float64), p, torch.tensor(4), one, 0.1)
    with pytest.raises(ValueError, match="shape of log_w"):
        B.exp3_update(torch.tensor(log_w, dtype=torch.float64), p[:3], torch.tensor(2), one, 0.1)


def test_try_it_numbers():
    from tests.try_it import assert_states

    u = B.ucb1(torch.tensor([0.6, 0.5]), torch.tensor([10.0, 2.0]), 12).tolist()
    p = B.boltzmann(torch.tensor([0.6, 0.5]), 0.05).tolist()
    e = B.exp3_probabilities(torch.tensor([0.0, 0.0, math.log(4.0)]), 0.3).tolist()
    mu = torch.tensor([0.8, 0.6, 0.5, 0.4, 0.2], dtype=torch.float64)  # the chapter's arms
    gap = mu.max() - mu[1:]
    ucb_const = (2 / gap).sum().item()  # UCB1: about 2 ln T / gap^2 pulls per arm, each costing gap
    assert round(ucb_const) == 25 and round(ucb_const / R.lai_robbins_constant(mu)) == 5
    assert_states("36-bandits.ipynb", ["\\approx 25$ per unit of $\\ln T$ here, five times the Lai-Robbins"],
                  section="all")
    near_tie = torch.tensor([0.8, 0.79, 0.5, 0.4, 0.2], dtype=torch.float64)
    lr = [R.lai_robbins_constant(mu), R.lai_robbins_constant(near_tie)]
    assert 6 < lr[1] / lr[0] < 8  # "sevenfold"
    assert_states("36-bandits.ipynb", [f"{u[0]:.4f}", f"{u[1]:.4f}", f"{p[0]:.4f}", f"{e[2]:.4f}", f"{e[0]:.4f}",
                                       f"from {lr[0]:.2f} to {lr[1]:.2f}"])
