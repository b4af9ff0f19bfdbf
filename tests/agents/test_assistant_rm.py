"""Tests of llmbook.agents.assistant_rm.

Oracles: brute-force enumeration of every subset of n samples with exact uniform tie-breaking (best-of-N), the
pass@k closed form 1 - C(N - c, n) / C(N, n) (the oracle pick), ``sklearn.metrics.roc_auc_score`` per prompt
(within-prompt AUC), ``scipy.optimize.minimize`` on a numpy Bradley-Terry objective (the reward head), one
unpadded forward pass per episode (pooled features), a numpy loop over resamples (bootstrap).
"""

import itertools
import math

import numpy as np
import pytest
import torch
from scipy.optimize import minimize
from sklearn.metrics import roc_auc_score

from llmbook.agents import assistant_rm as arm


def _brute_best_of_n(s, y, n):
    out = []
    for srow, yrow in zip(s, y, strict=True):
        vals = []
        for sub in itertools.combinations(range(len(srow)), n):
            top = max(srow[i] for i in sub)
            vals.append(np.mean([yrow[i] for i in sub if srow[i] == top]))
        out.append(np.mean(vals))
    return np.array(out)


def test_best_of_n_matches_subset_enumeration_with_ties():
    rng = np.random.default_rng(0)
    for N in (1, 3, 6, 8):
        s = rng.integers(0, 4, size=(5, N)).astype(float)  # many ties
        s[0] = rng.normal(size=N)  # and one row without
        y = rng.random((5, N))
        y[1] = (y[1] > 0.5)
        for n in range(1, N + 1):
            np.testing.assert_allclose(arm.best_of_n(s, y, n).numpy(), _brute_best_of_n(s, y, n), rtol=0, atol=1e-12)


def test_best_of_n_oracle_is_pass_at_k_and_n1_is_the_mean():
    rng = np.random.default_rng(1)
    y = (rng.random((20, 10)) < 0.4).astype(float)
    c = y.sum(1)
    for n in (1, 2, 5, 10):
        ref = [1 - math.comb(10 - int(k), n) / math.comb(10, n) for k in c]
        np.testing.assert_allclose(arm.best_of_n(y, y, n).numpy(), ref, atol=1e-12)
    s = rng.normal(size=(20, 10))
    np.testing.assert_allclose(arm.best_of_n(s, y, 1).numpy(), y.mean(1), atol=1e-12)
    np.testing.assert_allclose(arm.best_of_n(s, y, 10).numpy(), y[np.arange(20), s.argmax(1)], atol=1e-12)


def test_best_of_n_rejects_bad_input():
    with pytest.raises(ValueError, match="at most"):
        arm.best_of_n([[0.0, 1.0]], [[0.0, 1.0]], 3)
    with pytest.raises(ValueError, match="one shape"):
        arm.best_of_n([[0.0, 1.0]], [[0.0, 1.0, 1.0]], 1)
    with pytest.raises(ValueError, match="finite"):
        arm.best_of_n([[float("nan"), 1.0]], [[0.0, 1.0]], 1)
    with pytest.raises(ValueError, match="shape"):
        arm.best_of_n([0.0, 1.0], [0.0, 1.0], 1)


def test_within_prompt_auc_matches_sklearn_per_prompt():
    rng = np.random.default_rng(2)
    y = (rng.random((30, 8)) < 0.5).astype(float)
    s = np.round(rng.normal(size=(30, 8)) + y, 1)  # ties included
    num = den = 0.0
    for p in range(30):
        k = y[p].sum()
        if 0 < k < 8:
            m = k * (8 - k)
            num += roc_auc_score(y[p], s[p]) * m
            den += m
    assert arm.within_prompt_auc(s, y) == pytest.approx(num / den, abs=1e-12)
    win, lose = arm.within_prompt_pairs(y)
    assert len(win) == den
    assert (torch.tensor(y).flatten()[win] == 1).all() and (torch.tensor(y).flatten()[lose] == 0).all()
    assert ((win // 8) == (lose // 8)).all()
    with pytest.raises(ValueError, match="no prompt"):
        arm.within_prompt_auc([[0.0, 1.0]], [[1.0, 1.0]])


def test_fit_reward_head_matches_scipy_bradley_terry():
    g = torch.Generator().manual_seed(3)
    phi = torch.randn(200, 5, generator=g, dtype=torch.float64) * torch.tensor([1.0, 2.0, 0.5, 1.0, 3.0]) + 1.0
    w_star = torch.tensor([1.0, -1.0, 0.5, 0.0, 0.3], dtype=torch.float64)
    y = (phi @ w_star + torch.randn(200, generator=g, dtype=torch.float64) > 1.0).double().view(40, 5)
    win, lose = arm.within_prompt_pairs(y)
    lam = 0.01
    head = arm.fit_reward_head(phi, win, lose, weight_decay=lam)
    x = phi.numpy()
    z = (x - x.mean(0)) / (x.std(0, ddof=1) + 1e-6)
    dz = z[win.numpy()] - z[lose.numpy()]

    def f(w):
        m = dz @ w
        return np.logaddexp(0.0, -m).mean() + lam * w @ w

    def grad(w):
        m = dz @ w
        return -(dz * (1 / (1 + np.exp(m)))[:, None]).mean(0) + 2 * lam * w

    ref = minimize(f, np.zeros(5), jac=grad, method="BFGS", options={"gtol": 1e-12}).x
    np.testing.assert_allclose(head.w.numpy(), ref, atol=1e-6)
    np.testing.assert_allclose(head(phi).numpy(), z @ ref, atol=1e-5)
    again = arm.RewardHead.from_dict(head.to_dict())
    assert torch.equal(again(phi), head(phi))
    with pytest.raises(ValueError, match="weight_decay"):
        arm.fit_reward_head(phi, win, lose, weight_decay=-1.0)
    with pytest.raises(ValueError, match="one length"):
        arm.fit_reward_head(phi, win, lose[:-1])


class _Episode:
    def __init__(self, text):
        self._text = text

    def text(self):
        return self._text


def test_episode_features_match_one_unpadded_pass_per_episode():
    from llmbook.agents.assistant_tasks import demonstration, make_tasks, render
    from llmbook.lm.assistant import encode_transcript, load_assistant

    a = load_assistant()
    eps = [_Episode(render(t, demonstration(t))) for t in make_tasks(5, seed=0, split="rl")]
    for pool in ("mean", "last"):
        phi = arm.episode_features(a, eps, pool=pool, batch_size=3)
        for b, e in enumerate(eps):
            ids, mine = encode_transcript(a.tok, e.text())
            with torch.no_grad():
                h = a.model.hidden_states(torch.tensor(ids))
            ref = h[-1] if pool == "last" else h[torch.tensor(mine)].mean(0)
            torch.testing.assert_close(phi[b], ref, atol=1e-10, rtol=0)
    with pytest.raises(ValueError, match="pool"):
        arm.episode_features(a, eps, pool="max")


def test_prompt_bootstrap_matches_a_numpy_loop():
    x = np.array([0.0, 1.0, 0.5, 0.25, 1.0])
    m = np.array([1.0, 2.0, 0.0, 3.0, 1.0])
    mean, lo, hi = arm.prompt_bootstrap(x, m, n_boot=500, seed=7)
    rng = np.random.default_rng(7)
    idx = rng.integers(0, 5, size=(500, 5))
    boot = [(x[i] * m[i]).sum() / (m[i].sum()) if m[i].sum() > 0 else 0.0 for i in idx]
    assert mean == pytest.approx((x * m).sum() / m.sum(), abs=1e-15)
    assert (lo, hi) == pytest.approx(tuple(np.quantile(boot, [0.025, 0.975])), abs=1e-12)
    with pytest.raises(ValueError, match="weights"):
        arm.prompt_bootstrap(x, -m)


def test_try_it_numbers_of_chapter_41():
    s, y = [[0.1, 0.9, 0.5, 0.3]], [[0.0, 0.0, 1.0, 1.0]]
    assert round(arm.best_of_n(s, y, 2).item(), 4) == 0.5  # = (1 + 2) / 6, from the 6 pairs by hand
    assert round(arm.best_of_n(s, y, 1).item(), 4) == 0.5
    assert round(arm.best_of_n(y, y, 2).item(), 4) == round(5 / 6, 4) == 0.8333
