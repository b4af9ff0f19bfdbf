"""Tests of llmbook.agents.safety: the CMDP against scipy's linear program over occupancy measures and brute force
over deterministic policies, CVaR against scipy's minimize_scalar, tail means and the Gaussian closed form, the
handoff curve against a brute-force sweep, and the safety classifier against scikit-learn."""

from __future__ import annotations

import itertools
import math
from collections import Counter
from fractions import Fraction

import numpy as np
import pytest
import torch

from llmbook.agents import dynamic_programming as dp
from llmbook.agents import safety

from ..try_it import assert_states
from .test_mdp import random_mdp

scipy_opt = pytest.importorskip("scipy.optimize")
scipy_stats = pytest.importorskip("scipy.stats")
T_ = lambda x: torch.tensor(x, dtype=torch.float64)  # noqa: E731


def lp_cmdp(P, r, c, gamma, mu0, d):
    """The oracle: max r.x s.t. flow equations, c.x <= d, x >= 0 (scipy HiGHS); value, lambda*, policy."""
    S, A = r.shape
    flow = np.kron(np.eye(S), np.ones((1, A))) - gamma * P.reshape(S * A, S).T
    res = scipy_opt.linprog(-r.ravel(), A_ub=c.ravel()[None], b_ub=[d], A_eq=flow, b_eq=mu0, bounds=(0, None),
                            method="highs")
    assert res.status == 0
    x = res.x.reshape(S, A)
    occ = x.sum(1, keepdims=True)
    pi = np.where(occ > 1e-12, x / np.maximum(occ, 1e-300), 1.0 / A)
    return -res.fun, -res.ineqlin.marginals[0], pi


def cmdp_problem(seed, S=4, A=3):
    P, R, _ = random_mdp(S=S, A=A, seed=seed)
    rng = np.random.default_rng(100 + seed)
    r = (P * R).sum(-1)
    c = rng.uniform(0, 1, (S, A))
    mu0 = rng.dirichlet(np.ones(S))
    return P, r, c, mu0


def brute_force(P, r, c, gamma, mu0):
    """(J_R, J_C) of every deterministic policy, by numpy.linalg.solve."""
    S, A = r.shape
    out = []
    for acts in itertools.product(range(A), repeat=S):
        pi = np.eye(A)[list(acts)]
        M = np.eye(S) - gamma * np.einsum("sa,sat->st", pi, P)
        out.append((mu0 @ np.linalg.solve(M, (pi * r).sum(1)), mu0 @ np.linalg.solve(M, (pi * c).sum(1))))
    return np.array(out)


@pytest.mark.equation("43.01", oracle="scipy.optimize.linprog over occupancy measures (1e-6) and brute force over "
                                      "all deterministic policies; iterative policy evaluation (1e-8)")
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_cmdp_values_against_lp_and_brute_force(seed):
    P, r, c, mu0 = cmdp_problem(seed)
    gamma = 0.9
    JJ = brute_force(P, r, c, gamma, mu0)
    d = float(np.quantile(JJ[:, 1], 0.3))  # a budget that excludes most deterministic policies
    value, lam, pi = lp_cmdp(P, r, c, gamma, mu0, d)
    v = safety.cmdp_values(T_(P), T_(r), T_(c), T_(pi), gamma, T_(mu0), d)
    assert abs(v.J_R.item() - value) < 1e-6 and v.J_C.item() <= d + 1e-6 and v.feasible
    best_det = JJ[JJ[:, 1] <= d + 1e-12, 0].max()
    assert value >= best_det - 1e-9  # a stochastic policy can only do better than the best feasible pure one
    assert value <= JJ[:, 0].max() + 1e-9
    if lam > 1e-6:  # complementary slackness: a priced constraint binds
        assert abs(v.J_C.item() - d) < 1e-6
    # the returns of a random stochastic policy against iterative policy evaluation
    pi_r = np.random.default_rng(seed).dirichlet(np.ones(3), size=4)
    w = safety.cmdp_values(T_(P), T_(r), T_(c), T_(pi_r), gamma, T_(mu0), 0.0)
    V_r = dp.policy_evaluation(T_(P), T_(r), T_(pi_r), gamma).numpy()
    V_c = dp.policy_evaluation(T_(P), T_(c), T_(pi_r), gamma).numpy()
    assert abs(w.J_R.item() - mu0 @ V_r) < 1e-8 and abs(w.J_C.item() - mu0 @ V_c) < 1e-8
    assert w.feasible == (mu0 @ V_c <= 1e-9)


@pytest.mark.equation("43.02", oracle="scipy.optimize.linprog value and constraint marginal lambda* (weak duality "
                                      "exact; dual minimum 1e-2 relative; averaged returns 2e-2)")
@pytest.mark.parametrize("seed", [0, 1])
def test_dual_ascent_converges_to_lp(seed):
    P, r, c, mu0 = cmdp_problem(seed)
    gamma = 0.9
    JJ = brute_force(P, r, c, gamma, mu0)
    d = float(np.quantile(JJ[:, 1], 0.3))
    value, lam_star, _ = lp_cmdp(P, r, c, gamma, mu0, d)
    res = safety.lagrangian_dual_ascent(T_(P), T_(r), T_(c), gamma, T_(mu0), d, lr=0.5, n_iter=1000)
    assert (res.dual >= value - 1e-8).all()  # weak duality: g(lambda) bounds the optimum for every lambda >= 0
    scale = max(1.0, abs(value))
    assert res.dual.min().item() - value < 1e-2 * scale
    assert abs(res.J_R_avg[-1].item() - value) < 2e-2 * scale
    assert res.J_C_avg[-1].item() < d + 2e-2 * max(1.0, d)
    assert abs(res.lam[500:].mean().item() - lam_star) < 0.05 * max(1.0, lam_star)
    assert (res.lam >= 0).all()


def test_dual_ascent_on_cliffwalking_matches_lp_lambda():
    envs = pytest.importorskip("llmbook.agents.envs")
    pytest.importorskip("gymnasium")
    m = envs.from_gymnasium("CliffWalking-v1", gamma=0.99)
    C = torch.zeros(m.S, m.A, dtype=torch.float64)
    C[[24 + j for j in range(1, 11)]] = 1.0
    value, lam_star, _ = lp_cmdp(m.P.numpy(), m.r_sa.numpy(), C.numpy(), 0.99, m.mu0.numpy(), 4.0)
    res = safety.lagrangian_dual_ascent(m.P, m.R, C, 0.99, m.mu0, 4.0, lr=0.05, n_iter=300)
    assert abs(res.lam[100:].mean().item() - lam_star) < 0.01
    assert abs(res.J_R_avg[-1].item() - value) < 0.01 and abs(res.J_C_avg[-1].item() - 4.0) < 0.05
    # the pure iterates oscillate between the two deterministic paths
    assert sorted({round(v, 3) for v in res.J_C[100:].tolist()}) == [0.0, 9.372]
    # the Try-it numbers: d = 2
    v2, lam2, _ = lp_cmdp(m.P.numpy(), m.r_sa.numpy(), C.numpy(), 0.99, m.mu0.numpy(), 2.0)
    assert_states("43-safety.ipynb", [f"$J_R^*={v2:.4f}$", f"$\\lambda^*={lam2:.4f}$", f"{value:.4f}"])


@pytest.mark.equation("43.03", oracle="scipy.optimize.minimize_scalar on the Rockafellar-Uryasev objective (1e-7); "
                                      "mean of the alpha N smallest (1e-12); Gaussian closed form (0.03)")
def test_cvar_against_oracles():
    g = torch.Generator().manual_seed(0)
    X = 1.0 + 2.0 * torch.randn(200_000, generator=g, dtype=torch.float64)
    for alpha in (0.01, 0.05, 0.2):
        ru = scipy_opt.minimize_scalar(lambda t, a=alpha: -(t - np.maximum(t - X.numpy(), 0).mean() / a),
                                       bounds=(X.min().item(), X.max().item()), method="bounded",
                                       options={"xatol": 1e-10})
        assert abs(safety.cvar(X, alpha).item() + ru.fun) < 1e-7
        tail = X.sort().values[: round(alpha * len(X))].mean().item()
        assert abs(safety.cvar(X, alpha).item() - tail) < 1e-12
        closed = 1.0 - 2.0 * scipy_stats.norm.pdf(scipy_stats.norm.ppf(alpha)) / alpha
        assert abs(safety.cvar(X, alpha).item() - closed) < 0.03 * (1 + 5 * (alpha < 0.05))
        var = safety.value_at_risk(X, alpha).item()
        assert abs(var - np.quantile(X.numpy(), alpha, method="inverted_cdf")) < 1e-12


def test_cvar_fractional_boundary_and_batch():
    # alpha N not an integer: replicating every sample 8 times makes alpha * 8N an integer (independent count)
    rng = np.random.default_rng(1)
    x = rng.normal(size=(3, 5))
    for alpha in (0.125, 0.375, 0.7, 1.0):
        rep = np.sort(np.repeat(x, 8, axis=1), axis=1)[:, : round(alpha * 40)].mean(1)
        np.testing.assert_allclose(safety.cvar(T_(x), alpha).numpy(), rep, atol=1e-12)
    np.testing.assert_allclose(safety.cvar(T_(x), 1.0).numpy(), x.mean(1), atol=1e-12)
    assert safety.cvar(torch.tensor([2.0] * 9 + [-5.0]), 0.1).item() == -5.0
    assert safety.cvar(torch.tensor([4.0, 0.0, 2.0, 1.0]), 0.375).dtype == torch.float32
    with pytest.raises(ValueError, match="alpha"):
        safety.cvar(torch.ones(3), 0.0)


def _quantile_average(values, alpha):
    """Brute-force oracle: (1/alpha) * integral over [0, alpha] of the quantile function F^-1(u) of the
    equally weighted ``values``, integrated exactly with fractions (F^-1 is a step function)."""
    atoms = sorted(Counter(values).items())
    N, total, cum = len(values), Fraction(0), Fraction(0)
    for v, m in atoms:  # F^-1(u) = v on (cum, cum + m/N]
        take = min(Fraction(m, N), alpha - cum)
        if take <= 0:
            break
        total, cum = total + take * v, cum + take
    return total / alpha


def test_cvar_against_quantile_average_on_discrete_distributions():
    # Discrete distributions with ties and atoms that straddle the alpha-quantile: the Rockafellar-Uryasev
    # maximum must equal the exact quantile average (1e-12); E[X | X <= VaR] must not, in general.
    rng = np.random.default_rng(7)
    straddle = 0
    for _ in range(300):
        support = rng.choice(np.arange(-6, 7), size=rng.integers(1, 6), replace=False)
        values = [int(v) for v, m in zip(support, rng.integers(1, 5, size=len(support)), strict=True)
                  for _ in range(m)]
        N = len(values)
        for alpha in {Fraction(int(rng.integers(1, 2 * N + 1)), 2 * N), Fraction(int(rng.integers(1, 8)), 7),
                      Fraction(1)}:
            exact = _quantile_average(values, alpha)
            x = torch.tensor(rng.permutation(values), dtype=torch.float64)
            assert abs(safety.cvar(x, float(alpha)).item() - float(exact)) < 1e-12, (values, alpha)
            var = safety.value_at_risk(x, float(alpha)).item()
            cond = np.mean([v for v in values if v <= var])
            straddle += abs(cond - float(exact)) > 1e-9
    assert straddle > 50  # the conditional-mean form is wrong for many of these cases
    x = torch.tensor([4.0, 0.0, 2.0, 1.0], dtype=torch.float64)  # Try it 1
    assert abs(safety.cvar(x, 0.375).item() - 1 / 3) < 1e-15
    assert float(_quantile_average([4, 0, 2, 1], Fraction(3, 8))) == pytest.approx(1 / 3, abs=1e-15)
    assert np.mean([v for v in (4, 0, 2, 1) if v <= safety.value_at_risk(x, 0.375).item()]) == 0.5


@pytest.mark.equation("43.04", oracle="numpy logical or of the two comparisons; brute-force threshold sweep (exact)")
def test_handoff_and_coverage_risk_curve():
    rng = np.random.default_rng(0)
    p = rng.uniform(size=500).round(2)  # ties on purpose
    risk = rng.normal(size=500)
    err = (rng.uniform(size=500) < p).astype(float)
    for te, tr in ((0.3, 0.5), (0.9, math.inf), (-1.0, 10.0)):
        h = safety.handoff(T_(p), T_(risk), te, tr).numpy()
        np.testing.assert_array_equal(h, (p > te) | (risk > tr))
    tau, cov, sel = safety.coverage_risk_curve(T_(p), T_(err))
    assert len(tau) == len(np.unique(p))
    for t, cv, sr in zip(tau.tolist(), cov.tolist(), sel.tolist(), strict=True):
        keep = p <= t
        assert cv == pytest.approx(keep.mean(), abs=1e-12) and sr == pytest.approx(err[keep].mean(), abs=1e-12)
    with pytest.raises(ValueError, match="p_error"):
        safety.handoff(torch.tensor([1.5]), torch.tensor([0.0]), 0.5, 0.5)


@pytest.mark.equation("43.05", oracle="sklearn.linear_model.LogisticRegression coef_ (1e-4) and predict_proba (1e-6)")
def test_safety_classifier_against_sklearn():
    sklm = pytest.importorskip("sklearn.linear_model")
    skd = pytest.importorskip("sklearn.datasets")
    h, y = skd.make_classification(n_samples=300, n_features=12, n_informative=5, random_state=0)
    for C in (0.1, 1.0, 10.0):
        w, b = safety.fit_safety_classifier(T_(h), T_(y), C=C)
        sk = sklm.LogisticRegression(C=C, tol=1e-12, max_iter=10_000).fit(h, y)
        np.testing.assert_allclose(w.numpy(), sk.coef_[0], atol=1e-4)
        assert abs(b - sk.intercept_[0]) < 1e-4
        p = safety.safety_probability(T_(h), w, b).numpy()
        np.testing.assert_allclose(p, sk.predict_proba(h)[:, 1], atol=1e-6)
    with pytest.raises(ValueError, match="w must be"):
        safety.safety_probability(torch.ones(2, 3), torch.ones(4))


def test_try_it_numbers():
    a = safety.cvar(torch.tensor([4.0, 0.0, 2.0, 1.0], dtype=torch.float64), 0.375).item()
    h = bool(safety.handoff(torch.tensor(0.3), torch.tensor(0.9), 0.5, 0.8))
    b = safety.cvar(torch.tensor([2.0] * 9 + [-5.0]), 0.1).item()
    assert h and b == -5.0
    x = np.array([4.0, 0.0, 2.0, 1.0])  # Try it 1 by its Rockafellar-Uryasev objective at nu = VaR = 1 (numpy)
    shortfall = np.maximum(1.0 - x, 0).mean()
    ru = 1.0 - shortfall / 0.375
    assert abs(ru - a) < 1e-12 and x[x <= 1.0].mean() == 0.5
    assert_states("43-safety.ipynb", [f"{a:.4f}", "is `True`", "is $-5$", f"1-{shortfall:.2f}/0.375={ru:.4f}",
                                      r"\mathbb E[X\mid X\le1]=0.5"])
