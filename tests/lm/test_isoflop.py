"""Chapter 13, section 13.03: the reconstructed Chinchilla runs, Approach 2 (isoFLOP parabolas) and Approach 3 on them.

Oracles and tolerances, stated once:

* the data file: ``D = C / (6N)`` to ``rel 1e-12``; the replication's own Approach-3 fit of these runs (their
  notebook ``data_analysis.ipynb``, Huber sum, L-BFGS from Hoffmann's grid, 240 runs: A = 477.84,
  B = 2143.86, E = 1.81724, alpha = 0.34731, beta = 0.36718) to ``1e-3`` on E, alpha, beta and 1 % on A, B;
  their published Table-1 estimates (``scaling.BESIROGLU``, a likelihood fit) to ``2e-3`` on alpha and beta;
* the grouping: brute-force enumeration with ``math.log10``, exact;
* the parabolas: ``numpy.polyfit`` (degree 2) per group, coefficients and minima to ``rel 1e-8``;
* the line: ``scipy.stats.linregress`` (slope, intercept, standard error) to ``rel 1e-10``;
* a synthetic law with known exponent: noise-free runs of the parametric law on isoFLOP lines recover the
  closed-form N* of ``chinchilla_optimal`` within 1 % and a = beta / (alpha + beta) within 0.005.
"""

import math

import numpy as np
import pytest
import scipy.stats
import torch

from llmbook.lm import isoflop
from llmbook.lm import scaling as sl

REPLICATION_HUBER_FIT = dict(E=1.817235504463726, A=477.84171252965143, B=2143.8637880335505,
                             alpha=0.34731265761033453, beta=0.3671826173946711)


@pytest.fixture(scope="module")
def runs():
    return isoflop.load_chinchilla_runs()


@pytest.fixture(scope="module")
def kept(runs):
    keep = runs["L"] < np.sort(runs["L"])[-5]  # the replication drops the five runs of highest loss
    return {k: v[keep] for k, v in runs.items()}


def test_load_chinchilla_runs(runs):
    assert set(runs) == {"N", "C", "D", "L"}
    assert all(v.shape == (245,) and v.dtype == np.float64 for v in runs.values())
    np.testing.assert_allclose(runs["D"], runs["C"] / (6 * runs["N"]), rtol=1e-12)
    assert 4e7 < runs["N"].min() < runs["N"].max() < 2e10 and 2.0 < runs["L"].min() < runs["L"].max() < 5.1
    assert runs["L"] is not isoflop.load_chinchilla_runs()["L"]  # a fresh copy each call


def test_approach_3_on_the_runs_matches_the_replication(kept):
    assert kept["N"].size == 240
    fit = sl.fit_parametric_law(kept["N"], kept["D"], kept["L"])
    for k in ("E", "alpha", "beta"):
        assert abs(fit[k] - REPLICATION_HUBER_FIT[k]) < 1e-3, (k, fit[k])
        assert k == "E" or abs(fit[k] - sl.BESIROGLU[k]) < 2e-3, (k, fit[k], sl.BESIROGLU[k])
    for k in ("A", "B"):
        assert math.isclose(fit[k], REPLICATION_HUBER_FIT[k], rel_tol=0.01), (k, fit[k])
    assert fit.objective <= 1.0182741e-3  # their best Huber sum was 1.0182740346e-3


def test_isoflop_groups_matches_enumeration(kept):
    budgets = isoflop.HOFFMANN_BUDGETS
    groups = isoflop.isoflop_groups(kept["C"], budgets, tol=0.05)
    for C, g in zip(kept["C"].tolist(), groups.tolist(), strict=True):
        dist = [abs(math.log10(C) - math.log10(b)) for b in budgets]
        best = min(range(len(budgets)), key=dist.__getitem__)
        assert g == (best if dist[best] <= 0.05 else -1)
    assert groups.dtype == np.int64 and set(groups.tolist()) == set(range(-1, 9))


def test_isoflop_minima_match_polyfit(kept):
    groups = isoflop.isoflop_groups(kept["C"], tol=0.05)
    out = isoflop.isoflop_minima(kept["N"], kept["C"], kept["L"], groups)
    assert out["coef"].shape == (9, 3) and out["n"].sum() == (groups >= 0).sum()
    for j, k in enumerate(out["group"]):
        m = groups == k
        p = np.polyfit(np.log(kept["N"][m]), kept["L"][m], 2)
        np.testing.assert_allclose(out["coef"][j], p, rtol=1e-8)
        assert math.isclose(out["N_opt"][j], math.exp(-p[1] / (2 * p[0])), rel_tol=1e-8)
        assert math.isclose(out["L_opt"][j], np.polyval(p, -p[1] / (2 * p[0])), rel_tol=1e-8)
        assert math.isclose(out["C"][j], scipy.stats.gmean(kept["C"][m]), rel_tol=1e-12)


def test_fit_allocation_exponent_matches_linregress(kept):
    out = isoflop.isoflop_minima(kept["N"], kept["C"], kept["L"], isoflop.isoflop_groups(kept["C"]))
    fit = isoflop.fit_allocation_exponent(out["C"], out["N_opt"])
    ref = scipy.stats.linregress(np.log(out["C"]), np.log(out["N_opt"]))
    assert math.isclose(fit["a"], ref.slope, rel_tol=1e-10)
    assert math.isclose(fit["log_k"], ref.intercept, rel_tol=1e-10)
    assert math.isclose(fit["se_a"], ref.stderr, rel_tol=1e-10)
    assert 0.4 < fit["a"] < 0.6  # Hoffmann et al.'s Approach 2: 0.49


@pytest.mark.parametrize("law", ["HOFFMANN", "BESIROGLU"])
def test_approach_2_recovers_a_known_law(law):
    consts = getattr(sl, law)
    budgets = np.array([1e19, 1e20, 1e21, 1e22])
    N_star = np.array([sl.chinchilla_optimal(float(C), **consts)[0] for C in budgets])
    N = (N_star[:, None] * np.exp(np.linspace(-1.0, 1.0, 9))[None, :]).ravel()  # 9 sizes, e^-1 .. e^1 around N*
    C = np.repeat(budgets, 9)
    L = sl.parametric_loss(torch.tensor(N), torch.tensor(C / (6 * N)), **consts).numpy()
    out = isoflop.isoflop_minima(N, C, L, isoflop.isoflop_groups(C, budgets))
    np.testing.assert_allclose(out["N_opt"], N_star, rtol=0.01)
    fit = isoflop.fit_allocation_exponent(out["C"], out["N_opt"])
    assert abs(fit["a"] - consts["beta"] / (consts["alpha"] + consts["beta"])) < 0.005


def test_bad_input_raises_clear_errors():
    with pytest.raises(ValueError, match="tol must be a positive"):
        isoflop.isoflop_groups([1e19], [1e19], tol=0)
    with pytest.raises(ValueError, match="C must be finite and positive"):
        isoflop.isoflop_groups([-1.0], [1e19])
    with pytest.raises(ValueError, match="one shape"):
        isoflop.isoflop_minima([1e8, 2e8], [1e19] * 2, [2.0] * 2, [0])
    with pytest.raises(TypeError, match="groups must be integers"):
        isoflop.isoflop_minima([1e8, 2e8, 4e8], [1e19] * 3, [2.0] * 3, [0.0] * 3)
    with pytest.raises(ValueError, match="at least 3"):
        isoflop.isoflop_minima([1e8, 2e8], [1e19] * 2, [2.0, 2.1], [0, 0])
    with pytest.raises(ValueError, match="opens downwards"):
        isoflop.isoflop_minima([1e8, 2e8, 4e8], [1e19] * 3, [2.0, 2.1, 2.0], [0, 0, 0])
    with pytest.raises(ValueError, match="all groups are -1"):
        isoflop.isoflop_minima([1e8, 2e8, 4e8], [1e19] * 3, [2.0, 2.1, 2.0], [-1, -1, -1])
    with pytest.raises(ValueError, match="at least 3 budgets"):
        isoflop.fit_allocation_exponent([1e19, 1e20], [1e8, 1e9])
    with pytest.raises(ValueError, match="two distinct"):
        isoflop.fit_allocation_exponent([1e19] * 3, [1e8, 2e8, 3e8])
