"""Chapter 25's LambdaMART glue (``llmbook.rag.lambdamart``) against hand-built arrays, LightGBM and scikit-learn.

Oracles and tolerances:

* the flat rows, labels and group sizes against Python loops over the padded lists (exact);
* the held-out scores against LightGBM called directly on hand-built rows and a hand-built ``group`` array
  (exact: the same deterministic booster);
* on a synthetic problem whose grade is a monotone step function of one feature, the mean held-out NDCG by
  ``sklearn.metrics.ndcg_score`` is at least 0.97 (random scores reach about 0.6 there);
* two runs give bitwise identical scores; a fold's scores do not move when that fold's labels change.
"""

import numpy as np
import pytest
import sklearn.metrics
import torch

from llmbook.rag import lambdamart as lm

lightgbm = pytest.importorskip("lightgbm")


def ragged(B, N, d, seed, grades=3):
    g = torch.Generator().manual_seed(seed)
    H = torch.randn(B, N, d, generator=g, dtype=torch.float64)
    y = torch.randint(0, grades, (B, N), generator=g)
    lengths = torch.randint(0, N + 1, (B,), generator=g)
    lengths[0] = 0  # one empty list, which LightGBM must not see as a group
    lengths[1] = N
    mask = torch.arange(N)[None, :] < lengths[:, None]
    return H, y, mask


def monotone_problem(B=40, N=20, seed=0):
    """Grade = a step function of feature 0 (0 below -0.5, 1, 2, 3 above 1); features 1, 2 are noise."""
    g = torch.Generator().manual_seed(seed)
    H = torch.randn(B, N, 3, generator=g, dtype=torch.float64)
    y = torch.bucketize(H[..., 0].contiguous(), torch.tensor([-0.5, 0.3, 1.0], dtype=torch.float64))
    return H, y, torch.ones(B, N, dtype=torch.bool)


def mean_ndcg(scores, y, mask):
    per = [sklearn.metrics.ndcg_score((2.0 ** y[b][mask[b]].numpy() - 1)[None], scores[b][mask[b]].numpy()[None])
           for b in range(len(y)) if mask[b].any() and y[b][mask[b]].max() > 0]
    return float(np.mean(per))


def test_flatten_lists_matches_a_hand_built_loop():
    H, y, mask = ragged(7, 6, 4, seed=1)
    rows, labels, group = lm.flatten_lists(H, y, mask)
    hand_rows, hand_labels, hand_group = [], [], []
    for b in range(7):
        n = 0
        for i in range(6):
            if mask[b, i]:
                hand_rows.append(H[b, i].tolist())
                hand_labels.append(int(y[b, i]))
                n += 1
        if n:
            hand_group.append(n)
    np.testing.assert_array_equal(rows, np.array(hand_rows))
    np.testing.assert_array_equal(labels, np.array(hand_labels))
    np.testing.assert_array_equal(group, np.array(hand_group))
    assert group.sum() == rows.shape[0] == int(mask.sum())


def test_fit_predict_equals_lightgbm_on_a_hand_built_group_array():
    H, y, mask = ragged(12, 8, 3, seed=2)
    test = torch.arange(12) >= 8
    ours = lm.lambdamart_fit_predict(H[~test], y[~test], mask[~test], H[test], mask[test], n_trees=20,
                                     min_rows_in_leaf=3)
    rows = np.array([H[b, i].tolist() for b in range(8) for i in range(8) if mask[b, i]])
    labels = np.array([int(y[b, i]) for b in range(8) for i in range(8) if mask[b, i]])
    group = np.array([int(mask[b].sum()) for b in range(8) if mask[b].sum() > 0])
    params = dict(objective="lambdarank", num_leaves=7, learning_rate=0.05, min_data_in_leaf=3, seed=0,
                  deterministic=True, num_threads=1, force_row_wise=True, verbosity=-1)
    booster = lightgbm.train(params, lightgbm.Dataset(rows, label=labels, group=group), num_boost_round=20)
    expect = torch.full((4, 8), -np.inf, dtype=torch.float64)
    expect[mask[test]] = torch.from_numpy(booster.predict(H[test][mask[test]].numpy()))
    assert torch.equal(ours, expect)
    # the group array matters: one big group gives a different model (so the comparison above can fail)
    lumped = lightgbm.train(params, lightgbm.Dataset(rows, label=labels, group=[len(rows)]), num_boost_round=20)
    assert not np.array_equal(lumped.predict(rows), booster.predict(rows))


def test_monotone_feature_is_ranked_almost_perfectly_held_out():
    H, y, mask = monotone_problem()
    s = lm.lambdamart_cross_fit(H, y, mask, torch.arange(40) % 2)
    assert torch.isfinite(s).all()
    assert mean_ndcg(s, y, mask) >= 0.97
    noise = torch.randn(s.shape, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    assert mean_ndcg(noise, y, mask) < 0.8  # the bar is far above chance


def test_two_runs_are_identical_and_padding_is_minus_inf():
    H, y, mask = ragged(16, 10, 3, seed=3)
    fold = torch.arange(16) % 2
    a = lm.lambdamart_cross_fit(H, y, mask, fold, n_trees=30, min_rows_in_leaf=2)
    b = lm.lambdamart_cross_fit(H, y, mask, fold, n_trees=30, min_rows_in_leaf=2)
    assert torch.equal(a, b)
    assert torch.isneginf(a[~mask]).all() and torch.isfinite(a[mask]).all()


def test_scores_are_held_out():
    H, y, mask = monotone_problem(B=20, N=12, seed=4)
    fold = torch.arange(20) % 2
    a = lm.lambdamart_cross_fit(H, y, mask, fold, n_trees=30)
    y2 = y.clone()
    y2[fold == 0] = 3 - y2[fold == 0]  # reverse fold 0's grades: only fold 1's scores may change
    b = lm.lambdamart_cross_fit(H, y2, mask, fold, n_trees=30)
    assert torch.equal(a[fold == 0], b[fold == 0])
    assert not torch.equal(a[fold == 1], b[fold == 1])


def test_bad_input():
    H, y, mask = ragged(4, 5, 2, seed=6)
    fold = torch.arange(4) % 2
    with pytest.raises(ValueError, match="non-negative integer grades"):
        lm.lambdamart_cross_fit(H, y + 0.5, mask, fold)
    with pytest.raises(ValueError, match="non-negative integer grades"):
        lm.lambdamart_cross_fit(H, y - 5, mask, fold)
    with pytest.raises(ValueError, match="mask must be a bool tensor"):
        lm.lambdamart_cross_fit(H, y, mask.long(), fold)
    with pytest.raises(ValueError, match="mask must be a bool tensor"):
        lm.lambdamart_cross_fit(H, y, mask[:, :3], fold)
    with pytest.raises(ValueError, match="at least 2 folds"):
        lm.lambdamart_cross_fit(H, y, mask, torch.zeros(4, dtype=torch.long))
    with pytest.raises(ValueError, match="fold must be an integer tensor"):
        lm.lambdamart_cross_fit(H, y, mask, fold.double())
    with pytest.raises(ValueError, match="H must have shape"):
        lm.lambdamart_cross_fit(H[0], y, mask, fold)
    with pytest.raises(ValueError, match="features"):
        lm.lambdamart_fit_predict(H, y, mask, H[..., :1], mask)
    with pytest.raises(ValueError, match="no real candidate"):
        lm.lambdamart_fit_predict(H, y, torch.zeros_like(mask), H, mask)
    with pytest.raises(ValueError, match="H contains NaN"):
        lm.lambdamart_cross_fit(H.masked_fill(torch.ones_like(H, dtype=torch.bool), float("nan")), y, mask, fold)
