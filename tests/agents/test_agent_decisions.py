"""Tests of llmbook.agents.agent_decisions.

Oracles: collections.Counter and a Python loop (40.06, 40.07); simulation and the binomial tail (voting accuracy);
a Python loop over candidates (40.08); Python set union (40.09); a loop comparing p V with C (40.10);
scikit-learn LogisticRegression (40.11).
"""

import math
import random
from collections import Counter

import numpy as np
import pytest
import torch

from llmbook.agents import agent_decisions as AD


@pytest.mark.equation("40.06", oracle="collections.Counter (smallest id wins a tie)")
def test_majority_vote_counter():
    g = torch.Generator().manual_seed(1)
    y = torch.randint(0, 4, (50, 7), generator=g)
    ref = [min(c for c, k in Counter(r).items() if k == max(Counter(r).values())) for r in y.tolist()]
    assert AD.majority_vote(y).tolist() == ref


@pytest.mark.equation("40.07", oracle="Python loop summing weights per answer")
def test_weighted_vote_loop():
    g = torch.Generator().manual_seed(2)
    y = torch.randint(0, 4, (50, 7), generator=g)
    w = torch.rand(50, 7, generator=g, dtype=torch.float64)
    ref = []
    for yr, wr in zip(y.tolist(), w.tolist(), strict=True):
        s = {}
        for a, b in zip(yr, wr, strict=True):
            s[a] = s.get(a, 0.0) + b
        ref.append(max(sorted(s), key=lambda k: s[k]))
    assert AD.weighted_vote(y, w, num_classes=4).tolist() == ref
    assert AD.weighted_vote(y, torch.ones_like(w)).tolist() == AD.majority_vote(y).tolist()


def test_majority_vote_accuracy_exact_vs_simulation():
    p = [0.6, 0.3, 0.1]
    exact = AD.majority_vote_accuracy(p, 5)
    rng = np.random.default_rng(0)
    wins = 0.0
    for _ in range(40_000):
        c = np.bincount(rng.choice(3, 5, p=p), minlength=3)
        wins += (c[0] == c.max()) / (c == c.max()).sum()
    assert abs(exact - wins / 40_000) < 0.01
    assert exact > 0.6  # voting helps when the per-sample accuracy exceeds 1/2
    assert AD.majority_vote_accuracy([0.4, 0.6], 9) < 0.4  # and hurts below
    assert abs(AD.majority_vote_accuracy([0.7, 0.3], 1) - 0.7) < 1e-12


@pytest.mark.equation("40.08", oracle="Python loop over candidates")
def test_verifier_guided_choice_loop():
    g = torch.Generator().manual_seed(4)
    lp = torch.log_softmax(torch.randn(20, 6, generator=g, dtype=torch.float64), -1)
    v = (torch.rand(20, 6, generator=g) > 0.5).double()
    for lam in (0.0, 0.5, 3.0):
        ref = [max(range(6), key=lambda k: (lp[b, k] + lam * v[b, k]).item()) for b in range(20)]
        assert AD.verifier_guided_choice(lp, v, lam).tolist() == ref


@pytest.mark.equation("40.09", oracle="Python set union")
def test_reflexion_update_set_union():
    rng = random.Random(0)
    sets = [set(rng.sample(range(6), 2)) for _ in range(8)]
    rho = [rng.randrange(-1, 6) for _ in range(8)]
    M = torch.tensor([[k in s for k in range(6)] for s in sets])
    out = AD.reflexion_update(M, torch.tensor(rho))
    ref = [s | ({r} if r >= 0 else set()) for s, r in zip(sets, rho, strict=True)]
    assert [set(torch.nonzero(row)[:, 0].tolist()) for row in out] == ref


@pytest.mark.equation("40.10", oracle="loop comparing the expected value of a retry with its cost")
def test_retry_decision_loop():
    p = torch.linspace(0, 1, 21, dtype=torch.float64)
    for V, C in ((1.0, 0.3), (5.0, 1.0), (0.0, 0.0)):
        assert AD.retry_decision(p, V, C).tolist() == [pi * V - C > 0 for pi in p.tolist()]


@pytest.mark.equation("40.11", oracle="sklearn.linear_model.LogisticRegression predict_proba and coefficients")
def test_failure_probability_sklearn():
    from sklearn.linear_model import LogisticRegression
    g = torch.Generator().manual_seed(5)
    phi = torch.randn(300, 4, generator=g, dtype=torch.float64)
    w_true = torch.tensor([1.0, -2.0, 0.5, 0.0], dtype=torch.float64)
    y = (torch.rand(300, generator=g, dtype=torch.float64) < torch.sigmoid(phi @ w_true - 0.3)).double()
    clf = LogisticRegression(C=1.0, tol=1e-10, max_iter=1000).fit(phi.numpy(), y.numpy())
    w, b = AD.fit_failure_model(phi, y, l2=1.0)
    np.testing.assert_allclose(w.numpy(), clf.coef_[0], atol=1e-4)
    assert abs(b - clf.intercept_[0]) < 1e-4
    p = AD.failure_probability(phi, torch.as_tensor(clf.coef_[0]), float(clf.intercept_[0]))
    np.testing.assert_allclose(p.numpy(), clf.predict_proba(phi.numpy())[:, 1], atol=1e-12)


def test_try_it_numbers_of_chapter_40():
    from tests.try_it import assert_states

    # exact multinomial enumeration, checked against a simulation in test_majority_vote_accuracy_exact_vs_simulation
    a5, a15 = AD.majority_vote_accuracy([0.6, 0.3, 0.1], 5), AD.majority_vote_accuracy([0.6, 0.3, 0.1], 15)
    bad = AD.majority_vote_accuracy([0.4, 0.6], 15)
    # two answers, 15 samples (odd: no ties): the binomial tail P(Binomial(15, 0.4) >= 8)
    assert abs(bad - sum(math.comb(15, k) * 0.4**k * 0.6 ** (15 - k) for k in range(8, 16))) < 1e-12
    p3 = torch.tensor([0.3], dtype=torch.float64)
    assert AD.retry_decision(p3, 1.0, 0.29).item() and not AD.retry_decision(p3, 1.0, 0.3).item()
    assert AD.verifier_guided_choice(torch.tensor([[-2.0, -9.0]]), torch.tensor([[0.0, 1.0]]), 7.5).item() == 1
    assert AD.verifier_guided_choice(torch.tensor([[-2.0, -9.0]]), torch.tensor([[0.0, 1.0]]), 7.0).item() == 0
    assert_states("40-llm-agents.ipynb", [f"{a5:.4f}", f"{a15:.4f}", f"{bad:.4f}", "= 0.3", "7.5", "$\\lambda > 7$"])
