"""Tests of llmbook.rag.learned_fusion: learned linear fusion (23.04) and its held-out evaluation.

Oracles: sklearn's ``LogisticRegression`` (lbfgs, the same L2-penalised objective, intercept unpenalised) and
``LinearRegression`` fitted on the same features, decision functions and predictions compared, also fold by
fold for the held-out scores; the features against values worked out by hand; the fold selection against a
plain loop over chapter 26's nDCG. Tolerances: 1e-6 absolute for the logistic fit (two optimisers), 1e-9
for least squares, 1e-12 for closed forms.
"""

import math

import numpy as np
import pytest
import torch
from sklearn.linear_model import LinearRegression, LogisticRegression

from llmbook.rag import learned_fusion as lf

NEG = -math.inf


def labelled_problem(seed, B=6, N=40, F=4):
    rng = np.random.default_rng(seed)
    phi = rng.normal(size=(B, N, F))
    signal = phi @ rng.normal(size=F) + rng.normal(size=(B, N))
    labels = np.digitize(signal, [1.0, 2.0]).astype(float)  # grades 0/1/2
    return phi, labels


@pytest.mark.equation("23.04", oracle="sklearn LogisticRegression fitted on the same features")
@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("C", [0.1, 1.0, 10.0])
def test_learned_fusion_matches_sklearn_logistic_regression(seed, C):
    phi, labels = labelled_problem(seed)
    model = lf.fit_linear_fusion(torch.tensor(phi), torch.tensor(labels), C=C)
    ours = lf.linear_fusion(torch.tensor(phi), model.w, model.b)
    ref = LogisticRegression(C=C, tol=1e-12, max_iter=10_000).fit(phi.reshape(-1, 4), labels.reshape(-1) > 0)
    np.testing.assert_allclose(model.w.numpy(), ref.coef_[0], atol=1e-6)
    np.testing.assert_allclose(ours.numpy().reshape(-1), ref.decision_function(phi.reshape(-1, 4)), atol=1e-6)


@pytest.mark.equation("23.04", oracle="sklearn LinearRegression on the grades")
@pytest.mark.parametrize("seed", range(3))
def test_learned_fusion_least_squares_matches_sklearn(seed):
    phi, labels = labelled_problem(seed)
    model = lf.fit_linear_fusion(torch.tensor(phi), torch.tensor(labels), loss="least_squares")
    ref = LinearRegression().fit(phi.reshape(-1, 4), labels.reshape(-1))
    np.testing.assert_allclose(model.w.numpy(), ref.coef_, atol=1e-9)
    np.testing.assert_allclose(lf.linear_fusion(torch.tensor(phi), model.w, model.b).numpy().reshape(-1),
                               ref.predict(phi.reshape(-1, 4)), atol=1e-9)


def test_held_out_scores_come_from_models_fitted_on_other_queries():
    phi, labels = labelled_problem(7, B=8)
    folds = lf.query_folds(8, 4, seed=1)
    assert sorted(torch.bincount(folds).tolist()) == [2, 2, 2, 2]
    ours = lf.held_out_linear_fusion(torch.tensor(phi), torch.tensor(labels), folds)
    for f in range(4):
        test = (folds == f).numpy()
        ref = LogisticRegression(tol=1e-12, max_iter=10_000).fit(phi[~test].reshape(-1, 4),
                                                                  labels[~test].reshape(-1) > 0)
        np.testing.assert_allclose(ours.numpy()[test].reshape(-1), ref.decision_function(phi[test].reshape(-1, 4)),
                                   atol=1e-6)
    # a query's own labels never reach its scores: flipping them changes nothing
    flipped = labels.copy()
    flipped[0] = (labels[0] == 0) * 2.0
    again = lf.held_out_linear_fusion(torch.tensor(phi), torch.tensor(flipped), folds)
    assert torch.equal(again[0], ours[0]) and not torch.equal(again, ours)
    assert sorted(lf.query_folds(5, 5).tolist()) == [0, 1, 2, 3, 4]


def test_fusion_features_columns():
    a = torch.tensor([[3.0, 1.0, NEG]])
    b = torch.tensor([[0.2, 0.4, 0.9]])
    phi = lf.fusion_features([a, b], norm="minmax", k=60)
    assert phi.shape == (1, 3, 4)
    np.testing.assert_allclose(phi[0, :, 0].numpy(), [1.0, 0.0, 0.0])  # missed: the run's floor
    np.testing.assert_allclose(phi[0, :, 2].numpy(), [1.0, 61 / 62, 0.0])
    np.testing.assert_allclose(phi[0, :, 3].numpy(), [61 / 63, 61 / 62, 1.0])


def test_select_on_folds_never_uses_the_fold_it_scores():
    from llmbook.rag.metrics import ndcg

    rng = np.random.default_rng(0)
    labels = torch.tensor(rng.integers(0, 3, (6, 15)), dtype=torch.float64)
    cands = {p: torch.tensor(rng.normal(size=(6, 15))) for p in ("a", "b", "c")}
    folds = torch.tensor([0, 0, 1, 1, 2, 2])
    out, chosen = lf.select_on_folds(cands, labels, folds)
    per = {p: ndcg(s, labels, k=10) for p, s in cands.items()}
    for f in range(3):
        train = folds != f
        best = max(cands, key=lambda p: float(per[p][train].mean()))
        assert chosen[f] == best
        assert torch.equal(out[folds == f], cands[best][folds == f])


@pytest.mark.parametrize("call, err", [
    (lambda: lf.linear_fusion(torch.ones(2, 3), torch.ones(3)), ValueError),           # phi not (B, N, F)
    (lambda: lf.linear_fusion(torch.ones(1, 2, 3), torch.ones(4)), ValueError),        # w of the wrong length
    (lambda: lf.linear_fusion(torch.full((1, 2, 3), math.nan), torch.ones(3)), ValueError),
    (lambda: lf.fit_linear_fusion(torch.ones(1, 2, 3), torch.ones(1, 3)), ValueError),  # labels not (B, N)
    (lambda: lf.fit_linear_fusion(torch.ones(1, 2, 3), torch.ones(1, 2), loss="hinge"), ValueError),
    (lambda: lf.fit_linear_fusion(torch.ones(1, 2, 3), torch.ones(1, 2), C=0.0), ValueError),
    (lambda: lf.query_folds(5, 6), ValueError),                                         # more folds than queries
    (lambda: lf.held_out_linear_fusion(torch.ones(2, 3, 1), torch.ones(2, 3), torch.zeros(2)), ValueError),
    (lambda: lf.held_out_linear_fusion(torch.ones(2, 3, 1), torch.ones(2, 3), torch.zeros(2, dtype=torch.long)),
     ValueError),                                                                       # a single fold
    (lambda: lf.select_on_folds({}, torch.ones(2, 3), torch.tensor([0, 1])), ValueError),
])
def test_learned_fusion_rejects_bad_input(call, err):
    with pytest.raises(err):
        call()
