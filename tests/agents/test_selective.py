"""Selection with guaranteed risk: the Clopper-Pearson bound against scipy's beta quantile, and the
guarantee of the chosen handoff threshold checked over many calibration draws of a population whose
selective risk is known in closed form."""

from __future__ import annotations

import math

import numpy as np
import pytest
import scipy.stats as st
import torch

from llmbook.agents import selective


def test_binomial_upper_bound_against_scipy_beta_ppf():
    # Clopper-Pearson: B*(e, n, delta) = Beta(e + 1, n - e).ppf(1 - delta); tolerance 1e-9.
    for n in (1, 7, 100, 2048):
        for e in sorted({0, 1, n // 3, n - 1, n}):
            for delta in (0.001, 0.05, 0.5):
                ours = selective.binomial_upper_bound(e, n, delta)
                ref = 1.0 if e == n else st.beta.ppf(1 - delta, e + 1, n - e)
                assert abs(ours - ref) < 1e-9, (e, n, delta, ours, ref)
    with pytest.raises(ValueError, match="errors"):
        selective.binomial_upper_bound(5, 4, 0.1)
    with pytest.raises(TypeError, match="ints"):
        selective.binomial_upper_bound(1.0, 4, 0.1)
    with pytest.raises(ValueError, match="delta"):
        selective.binomial_upper_bound(1, 4, 1.0)


def _calibration(rng, m):
    # A calibrated model: P(error | x) = p ~ U(0, 1) and the error ~ Bernoulli(p). The population's selective
    # risk at threshold tau (answer p <= tau) is E[p | p <= tau] = tau / 2: the closed-form oracle.
    p = rng.uniform(size=m)
    return p, (rng.uniform(size=m) < p).astype(float)


def test_risk_controlled_threshold_reports_its_own_calibration_numbers():
    # coverage, risk and bound recomputed with numpy and scipy from the returned tau (level delta / n_tested)
    rng = np.random.default_rng(0)
    p, err = _calibration(rng, 1000)
    p = p.round(2)  # ties on purpose
    res = selective.risk_controlled_threshold(torch.tensor(p), torch.tensor(err), 0.2, 0.1)
    keep = p <= res.tau
    k = math.ceil(math.log2(1001))
    assert 1 <= res.n_tested <= k
    assert res.coverage == pytest.approx(keep.mean(), abs=1e-12) and res.risk == pytest.approx(err[keep].mean())
    ref = st.beta.ppf(1 - 0.1 / k, err[keep].sum() + 1, keep.sum() - err[keep].sum())
    assert abs(res.bound - ref) < 1e-9 and res.bound < 0.2
    with pytest.raises(ValueError, match="0/1"):
        selective.risk_controlled_threshold(torch.tensor([0.1, 0.2]), torch.tensor([0.5, 1.0]), 0.2, 0.1)
    with pytest.raises(ValueError, match="target_risk"):
        selective.risk_controlled_threshold(torch.tensor([0.1, 0.2]), torch.tensor([0.0, 1.0]), 0.0, 0.1)


@pytest.mark.parametrize(("m", "target", "delta"), [(500, 0.35, 0.1), (1000, 0.3, 0.2)])
def test_risk_controlled_threshold_guarantee_over_calibration_draws(m, target, delta):
    # Over D independent calibration sets, the true selective risk tau_hat / 2 may exceed the target in at most a
    # fraction delta of them: the count of violations must not be significantly above delta D (one-sided
    # binomial test at level 1e-3). The bound must hold as often, and the rule must not be vacuous: the chosen
    # thresholds reach a sizeable share of the best one allowed (tau = 2 r*).
    rng = np.random.default_rng(m)
    D = 300
    taus, bounds = [], []
    for _ in range(D):
        p, err = _calibration(rng, m)
        res = selective.risk_controlled_threshold(torch.tensor(p), torch.tensor(err), target, delta)
        taus.append(res.tau)
        bounds.append(res.bound)
    true_risk = np.maximum(np.array(taus), 0) / 2
    violations = int((true_risk > target).sum())
    assert st.binom.sf(violations - 1, D, delta) > 1e-3, (violations, D, delta)
    assert st.binom.sf(int((true_risk > np.array(bounds) + 1e-12).sum()) - 1, D, delta) > 1e-3
    assert np.median(true_risk) > 0.7 * target, np.median(true_risk)
