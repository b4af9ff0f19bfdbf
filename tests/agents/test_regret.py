"""Tests of llmbook.agents.regret.

Oracles: brute-force Python sums over the known means (regret), ``scipy.stats.entropy`` (Bernoulli KL and
the Lai-Robbins constant), the bounds' formulas written out with ``math``; seeded simulations for the orders.
"""

import math

import pytest
import scipy.stats
import torch

from llmbook.agents import regret as R


@pytest.mark.equation("36.04", oracle="brute-force Python sum over the known means")
def test_cumulative_regret_brute_force():
    mu = torch.tensor([0.3, 0.7, 0.5], dtype=torch.float64)
    acts = torch.randint(0, 3, (4, 50), generator=torch.Generator().manual_seed(1))
    Rt = R.cumulative_regret(mu, acts)
    for r in range(4):
        for T in (1, 10, 50):
            ref = T * 0.7 - sum(mu.tolist()[a] for a in acts[r, :T].tolist())
            assert Rt[r, T - 1].item() == pytest.approx(ref, abs=1e-12)
    with pytest.raises(ValueError, match="arm ids"):
        R.cumulative_regret(mu, torch.tensor([0, 3]))


def test_theory_constants():
    kl = R.bernoulli_kl(torch.tensor(0.3, dtype=torch.float64), torch.tensor(0.7, dtype=torch.float64)).item()
    assert kl == pytest.approx(scipy.stats.entropy([0.3, 0.7], [0.7, 0.3]), rel=1e-14)
    mu = torch.tensor([0.8, 0.6, 0.5])
    ref = sum((0.8 - m) / scipy.stats.entropy([m, 1 - m], [0.8, 0.2]) for m in (0.6, 0.5))
    assert R.lai_robbins_constant(mu) == pytest.approx(ref, rel=1e-6)
    assert R.ucb1_regret_bound(mu, torch.tensor(100.0)).item() == pytest.approx(
        8 * math.log(100) * (1 / 0.2 + 1 / 0.3) + (1 + math.pi**2 / 3) * 0.5, rel=1e-6)


def test_simulated_regret_orders():
    """Seeded runs: epsilon-greedy grows linearly, UCB1 and Thompson below Auer's bound, EXP3 below its bound."""
    mu = torch.tensor([0.8, 0.6, 0.5, 0.4, 0.2])
    T = 1000
    runs = {p: R.simulate_bandit(mu, p, T, runs=8, seed=0, **kw).regret.mean(0) for p, kw in
            [("epsilon_greedy", dict(epsilon=0.1)), ("ucb1", {}), ("thompson", {}),
             ("exp3", dict(gamma=R.exp3_gamma(T, 5)))]}
    eg = runs["epsilon_greedy"]
    slope = (eg[-1] - eg[499]).item() / 500  # per-round regret in the second half
    assert 0.5 * 0.1 * 0.3 < slope < 2 * 0.1 * 0.3  # epsilon * mean gap = 0.03 per round: linear
    assert runs["ucb1"][-1] < R.ucb1_regret_bound(mu, torch.tensor(float(T)))
    assert runs["thompson"][-1] < runs["ucb1"][-1]
    assert runs["exp3"][-1] < R.exp3_regret_bound(torch.tensor(float(T)), 5)
    # the regret recorded by the simulator is the brute-force regret of its actions
    r = R.simulate_bandit(mu, "ucb1", 50, runs=2, seed=1)
    ref = [50 * mu.double().max().item() - sum(mu.double().tolist()[a] for a in r.actions[0].tolist())]
    assert r.regret[0, -1].item() == pytest.approx(ref[0], abs=1e-12)


def test_mean_band_against_scipy_sem():
    """Oracle: numpy's mean and ``scipy.stats.sem`` (ddof = 1), times the normal quantile ``scipy.stats.norm``."""
    import numpy as np

    x = np.random.default_rng(0).normal(size=(37, 5, 3))
    m, h = R.mean_band(torch.tensor(x))
    z = scipy.stats.norm.ppf(0.975)
    np.testing.assert_allclose(m.numpy(), x.mean(0), rtol=0, atol=1e-13)
    np.testing.assert_allclose(h.numpy(), z * scipy.stats.sem(x, axis=0), rtol=1e-3, atol=0)  # 1.96 vs 1.95996
    _, h1 = R.mean_band(torch.tensor(x), z=1.0)
    np.testing.assert_allclose(h1.numpy(), scipy.stats.sem(x, axis=0), rtol=1e-13)
    with pytest.raises(ValueError, match="at least 2 runs"):
        R.mean_band(torch.zeros(1, 4))
    with pytest.raises(ValueError, match="finite"):
        R.mean_band(torch.tensor([[1.0], [float("nan")]]))
    with pytest.raises(ValueError, match="z must be"):
        R.mean_band(torch.zeros(3, 2), z=-1.0)
