"""Tests of llmbook.rag.significance against scipy (bootstrap, permutation test, binomtest's Wilson interval)
and exact enumeration of every sign pattern."""

import itertools

import numpy as np
import pytest
from scipy import stats

from llmbook.rag.significance import compare, rate_interval


def test_permutation_p_matches_exact_enumeration():
    rng = np.random.default_rng(0)
    a, b = rng.integers(0, 2, 12).astype(float), rng.integers(0, 2, 12).astype(float)
    a[:4] = 1.0
    b[:4] = 0.0
    d = a - b
    means = [abs(np.dot(s, d)) / d.size for s in itertools.product((-1, 1), repeat=d.size)]
    exact = np.mean(np.array(means) >= abs(d.mean()) - 1e-12)
    c = compare(a, b, n_perm=40_000, seed=1)
    assert c.p == pytest.approx(exact, abs=0.01)  # Monte-Carlo error sd ~ 0.0025
    ref = stats.permutation_test((a, b), lambda x, y: np.mean(x - y), permutation_type="samples",
                                 n_resamples=np.inf).pvalue
    assert ref == pytest.approx(exact, abs=1e-9)


def test_bootstrap_interval_matches_scipy():
    rng = np.random.default_rng(2)
    a, b = rng.normal(0.6, 0.3, 80), rng.normal(0.5, 0.3, 80)
    c = compare(a, b, n_boot=20_000, seed=3)
    ref = stats.bootstrap((a - b,), np.mean, method="percentile", n_resamples=20_000,
                          random_state=np.random.default_rng(4)).confidence_interval
    assert c.low == pytest.approx(ref.low, abs=0.01) and c.high == pytest.approx(ref.high, abs=0.01)
    assert c.diff == pytest.approx(np.mean(a - b), abs=1e-12)


def test_verdicts_can_go_either_way():
    better = compare([1] * 30 + [0] * 10, [0] * 30 + [0] * 10)
    assert better.verdict == "better" and better.low > 0 and better.p < 0.001
    assert compare([0] * 40, [1] * 30 + [0] * 10).verdict == "worse"
    same = compare([1, 0] * 20, [0, 1] * 20)
    assert same.verdict == "no difference shown" and same.low < 0 < same.high and same.p > 0.5
    assert "paired bootstrap" in str(better)


def test_wilson_against_scipy():
    for k, n in [(0, 10), (3, 10), (10, 10), (161, 200)]:
        ref = stats.binomtest(k, n).proportion_ci(confidence_level=0.95, method="wilson")
        p, lo, hi = rate_interval(k, n)
        assert p == k / n and lo == pytest.approx(ref.low, abs=1e-12) and hi == pytest.approx(ref.high, abs=1e-12)
    assert rate_interval([1, 0, 1, 1]) == rate_interval(3, 4)


def test_bad_input():
    with pytest.raises(ValueError, match="paired"):
        compare([1, 0, 1], [1, 0])
    with pytest.raises(ValueError, match="at least 2"):
        compare([1], [0])
    with pytest.raises(ValueError, match="finite"):
        compare([1, float("nan")], [0, 0])
    with pytest.raises(ValueError, match="0/1"):
        rate_interval([0.5, 1])
    with pytest.raises(ValueError, match="successes"):
        rate_interval(11, 10)
