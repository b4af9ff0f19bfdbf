"""BERTScore (16.06), pass@k (16.09) and MAUVE (16.10) against independent references.

* BERTScore: a float64 brute-force double loop over token pairs (``abs = 1e-12``) and torchmetrics'
  own scoring step ``torchmetrics.functional.text.bert._get_precision_recall_f1`` fed the same
  normalised embeddings (``abs = 1e-12`` in float64); torchmetrics' ``BERTScore`` class itself needs a
  Hugging Face model, so only its scoring step is used, with given embeddings.
* pass@k: exact rational arithmetic with ``math.comb`` and ``fractions.Fraction`` (``abs = 1e-14``),
  the Codex paper's numpy estimator, and Monte Carlo draws of k-subsets (within 4.5 standard errors).
* MAUVE: mauve-text's ``get_divergence_curve_for_multinomials`` and its area (sklearn's ``auc``) on
  histograms with full support (``abs = 1e-12``), and ``mauve.compute_mauve`` end to end (PCA, faiss
  k-means) on features with clear clusters (``abs = 1e-9``).
"""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pytest
import torch

from llmbook.lm import eval_metrics as em
from tests.try_it import assert_states

# --------------------------------------------------------------------------- BERTScore


def _brute(x_hat, x, w_hat=None, w=None):
    """Greedy matching with Python loops in float64."""
    a = [v / v.norm() for v in x_hat.double()]
    b = [v / v.norm() for v in x.double()]
    w_hat = [1.0] * len(a) if w_hat is None else [float(v) for v in w_hat]
    w = [1.0] * len(b) if w is None else [float(v) for v in w]
    P = sum(wi * max(float(ai @ bj) for bj in b) for ai, wi in zip(a, w_hat, strict=True)) / sum(w_hat)
    R = sum(wj * max(float(ai @ bj) for ai in a) for bj, wj in zip(b, w, strict=True)) / sum(w)
    return P, R, 2 * P * R / (P + R)


@pytest.mark.equation("16.06", oracle="float64 brute-force double loop over token pairs")
def test_bertscore_matches_brute_force():
    g = torch.Generator().manual_seed(0)
    for T_hat, T, D in ((1, 1, 3), (5, 7, 8), (9, 4, 16), (6, 6, 2)):
        x_hat = torch.randn(T_hat, D, generator=g, dtype=torch.float64)
        x = torch.randn(T, D, generator=g, dtype=torch.float64)
        w_hat, w = torch.rand(T_hat, generator=g, dtype=torch.float64), torch.rand(T, generator=g, dtype=torch.float64)
        ours = em.bertscore(x_hat, x)
        assert [v.item() for v in ours] == pytest.approx(_brute(x_hat, x), abs=1e-12)
        ours_w = em.bertscore(x_hat, x, w_hat=w_hat, w=w)
        assert [v.item() for v in ours_w] == pytest.approx(_brute(x_hat, x, w_hat, w), abs=1e-12)


@pytest.mark.equation("16.06", oracle="brute force per pair on a padded batch with masks")
def test_bertscore_batch_with_padding_masks():
    g = torch.Generator().manual_seed(1)
    lens_hat, lens = [3, 6, 1], [5, 2, 6]
    x_hat = torch.randn(3, 6, 4, generator=g, dtype=torch.float64)
    x = torch.randn(3, 6, 4, generator=g, dtype=torch.float64)
    mask_hat = torch.arange(6) < torch.tensor(lens_hat)[:, None]
    mask = torch.arange(6) < torch.tensor(lens)[:, None]
    P, R, F = em.bertscore(x_hat, x, mask_hat=mask_hat, mask=mask)
    for b in range(3):
        assert [P[b].item(), R[b].item(), F[b].item()] == pytest.approx(
            _brute(x_hat[b, :lens_hat[b]], x[b, :lens[b]]), abs=1e-12)


@pytest.mark.equation("16.06", oracle="torchmetrics.functional.text.bert._get_precision_recall_f1")
def test_bertscore_matches_torchmetrics_scoring_step():
    from torchmetrics.functional.text.bert import _get_precision_recall_f1

    g = torch.Generator().manual_seed(2)
    B, T_hat, T, D = 4, 7, 5, 16
    x_hat = torch.randn(B, T_hat, D, generator=g, dtype=torch.float64)
    x = torch.randn(B, T, D, generator=g, dtype=torch.float64)
    idf_hat = torch.rand(B, T_hat, generator=g, dtype=torch.float64)
    idf = torch.rand(B, T, generator=g, dtype=torch.float64)
    unit = [v / v.norm(dim=-1, keepdim=True) for v in (x_hat, x)]
    P_t, R_t, F_t = _get_precision_recall_f1(unit[0][:, None], unit[1][:, None], idf_hat / idf_hat.sum(-1, True),
                                             idf / idf.sum(-1, True))
    P, R, F = em.bertscore(x_hat, x, w_hat=idf_hat, w=idf)
    for ours, theirs in ((P, P_t), (R, R_t), (F, F_t)):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-12)


@pytest.mark.equation("16.06", oracle="properties: scale invariance and a perfect self-match")
def test_bertscore_properties():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(6, 8, generator=g)
    P, R, F = em.bertscore(x, x)
    assert min(P.item(), R.item(), F.item()) == pytest.approx(1.0, abs=1e-6)
    y = torch.randn(4, 8, generator=g)
    torch.testing.assert_close(torch.stack(em.bertscore(3.0 * y, 0.5 * x)), torch.stack(em.bertscore(y, x)))
    # a candidate made of a subset of the reference's tokens has precision 1, recall below 1
    P, R, _ = em.bertscore(x[:2], x)
    assert P.item() == pytest.approx(1.0, abs=1e-6) and R.item() < 1


def test_bertscore_rejects_bad_input():
    x = torch.randn(3, 4)
    with pytest.raises(ValueError, match="D"):
        em.bertscore(x, torch.randn(3, 5))
    with pytest.raises(ValueError, match="empty"):
        em.bertscore(torch.randn(0, 4), x)
    with pytest.raises(TypeError, match="bool"):
        em.bertscore(x, x, mask=torch.ones(3))
    with pytest.raises(ValueError, match="positive weight"):
        em.bertscore(x, x, mask=torch.zeros(3, dtype=torch.bool))
    with pytest.raises(ValueError, match="NaN"):
        em.bertscore(x, torch.full((2, 4), math.nan))


# --------------------------------------------------------------------------- pass@k


def _exact(n: int, c: int, k: int) -> Fraction:
    return 1 - Fraction(math.comb(n - c, k), math.comb(n, k))


@pytest.mark.equation("16.09", oracle="exact rational arithmetic with math.comb and fractions.Fraction")
def test_pass_at_k_matches_exact_combinatorics():
    for n in range(1, 31):
        for c in range(n + 1):
            for k in range(1, n + 1):
                assert em.pass_at_k(n, c, k) == pytest.approx(float(_exact(n, c, k)), abs=1e-14)
    for n, c, k in ((200, 3, 100), (1000, 1, 1), (10_000, 17, 50), (100_000, 5, 1000)):  # big binomials
        assert em.pass_at_k(n, c, k) == pytest.approx(float(_exact(n, c, k)), abs=1e-14)


@pytest.mark.equation("16.09", oracle="the Codex paper's numpy estimator, per problem, as a tensor")
def test_pass_at_k_tensor_matches_codex_numpy_estimator():
    def codex(n, c, k):  # Chen et al. 2021, figure 3
        if n - c < k:
            return 1.0
        return 1.0 - np.prod(1.0 - k / np.arange(n - c + 1, n + 1))

    c = torch.tensor([0, 1, 5, 37, 100, 200])
    for k in (1, 10, 100):
        ours = em.pass_at_k(200, c, k)
        assert ours.dtype == torch.float64 and ours.shape == (6,)
        assert ours.tolist() == pytest.approx([codex(200, int(ci), k) for ci in c], abs=1e-12)
    n = torch.tensor([[10], [20]])
    assert em.pass_at_k(n, torch.tensor([1, 2, 3]), 5).shape == (2, 3)


@pytest.mark.equation("16.09", oracle="Monte Carlo: random k-subsets of the n samples")
def test_pass_at_k_matches_monte_carlo():
    rng = np.random.default_rng(0)
    draws = 20_000
    for n, c, k in ((20, 2, 5), (50, 1, 10), (10, 4, 3), (100, 10, 1)):
        passed = np.zeros(n, dtype=bool)
        passed[:c] = True
        subsets = rng.random((draws, n)).argsort(axis=1)[:, :k]  # uniform k-subsets without replacement
        hits = passed[subsets].any(axis=1).mean()
        p = em.pass_at_k(n, c, k)
        assert abs(hits - p) < 4.5 * math.sqrt(p * (1 - p) / draws) + 1e-12, (n, c, k, hits, p)
    # the naive plug-in 1 - (1 - c/n)^k is biased: for n = 20, c = 2, k = 5 it is 0.4095, the estimator 0.4474
    assert 1 - (1 - 2 / 20) ** 5 < em.pass_at_k(20, 2, 5) - 0.03


def test_pass_at_k_rejects_bad_input():
    with pytest.raises(ValueError, match="k"):
        em.pass_at_k(5, 1, 6)
    with pytest.raises(ValueError, match="c"):
        em.pass_at_k(5, 6, 1)
    with pytest.raises(TypeError):
        em.pass_at_k(5.0, 1, 1)
    with pytest.raises(ValueError, match="every problem"):
        em.pass_at_k(torch.tensor([5]), torch.tensor([6]), 1)
    with pytest.raises(TypeError):
        em.pass_at_k(5, torch.tensor([1.0]), 1)


# --------------------------------------------------------------------------- MAUVE


def _mauve_reference(p, q, c=5.0, m=25):
    from mauve.compute_mauve import get_divergence_curve_for_multinomials
    from sklearn.metrics import auc

    curve = get_divergence_curve_for_multinomials(np.asarray(p), np.asarray(q), np.linspace(1e-6, 1 - 1e-6, m), c)
    x, y = curve.T
    i, j = np.argsort(x), np.argsort(y)
    return curve, 0.5 * (auc(x[i], y[i]) + auc(y[j], x[j]))


@pytest.mark.equation("16.10", oracle="mauve-text's get_divergence_curve_for_multinomials and sklearn auc")
def test_mauve_matches_mauve_text_on_histograms():
    rng = np.random.default_rng(0)
    for K in (2, 5, 50):
        for c, m in ((5.0, 25), (1.0, 10), (5.0, 100)):
            p, q = rng.dirichlet(np.ones(K)), rng.dirichlet(np.ones(K) * 0.5)
            curve, area = _mauve_reference(p, q, c, m)
            np.testing.assert_allclose(em.divergence_curve(p, q, c, m).numpy(), curve, rtol=0, atol=1e-12)
            assert em.mauve(torch.tensor(p), torch.tensor(q), c, m) == pytest.approx(area, abs=1e-12)
    # identical histograms tie on the curve: the area is 1. mauve-text orders the tied points with numpy's
    # unstable sort, whose order of equal keys depends on the CPU's sort kernel (AVX-512, AVX2 or scalar), so it
    # reports 0.75 on some machines and 1 on others; ours does not depend on that order.
    assert em.mauve([0.2, 0.8], [0.2, 0.8]) == pytest.approx(1.0, abs=1e-12)
    assert em.mauve([0.5, 0.5], [0.5, 0.5]) == 1.0
    assert _mauve_reference(np.array([0.5, 0.5]), np.array([0.5, 0.5]))[1] in (pytest.approx(0.75), pytest.approx(1.0))


@pytest.mark.equation("16.10", oracle="mauve.compute_mauve(p_features, q_features) end to end")
def test_mauve_from_features_matches_compute_mauve():
    import mauve

    rng = np.random.default_rng(1)
    K, D = 5, 12
    centers = 10 * np.eye(D)[:K]

    def draw(w, n):
        return centers[rng.choice(K, size=n, p=w)] + 0.3 * rng.standard_normal((n, D))

    P = draw([0.3, 0.3, 0.2, 0.1, 0.1], 150)
    Q = draw([0.1, 0.2, 0.2, 0.25, 0.25], 150)
    theirs = mauve.compute_mauve(p_features=P, q_features=Q, num_buckets=K, kmeans_num_redo=2)
    p_hist, q_hist = em.quantize(torch.tensor(P), torch.tensor(Q), K)
    # the same clusters (up to their numbering)
    ours_bins = sorted(zip(p_hist.tolist(), q_hist.tolist(), strict=True))
    their_bins = sorted(zip(theirs.p_hist.tolist(), theirs.q_hist.tolist(), strict=True))
    np.testing.assert_allclose(np.array(ours_bins), np.array(their_bins), rtol=0, atol=1e-12)
    assert em.mauve(p_hist, q_hist) == pytest.approx(theirs.mauve, abs=1e-9)


@pytest.mark.equation("16.10", oracle="properties: MAUVE falls as Q drifts from P")
def test_mauve_decreases_with_divergence():
    p = torch.tensor([0.25, 0.25, 0.25, 0.25], dtype=torch.float64)
    scores = []
    for t in (0.0, 0.2, 0.5, 0.9):
        q = (1 - t) * p + t * torch.tensor([1.0, 0.0, 0.0, 0.0], dtype=torch.float64)
        scores.append(em.mauve(p, q))
    assert scores[0] == 1.0 and all(a > b for a, b in zip(scores, scores[1:], strict=False))
    # disjoint supports: the curve ((1 - lam)^c, lam^c), whose area tends to 1 / C(2c, c) = 1/252 for c = 5
    # (25 points of the trapezoid rule overshoot it by 3 %)
    assert em.mauve([1.0, 0.0], [0.0, 1.0]) == pytest.approx(1 / 252, rel=0.03)
    assert em.mauve([1.0, 0.0], [0.0, 1.0], num_lambdas=2000) == pytest.approx(1 / 252, rel=1e-4)


def test_mauve_rejects_bad_input():
    with pytest.raises(ValueError, match="non-negative"):
        em.mauve([0.5, -0.5], [0.5, 0.5])
    with pytest.raises(ValueError, match="K"):
        em.mauve([0.5, 0.5], [1.0])
    with pytest.raises(ValueError, match="c must"):
        em.mauve([0.5, 0.5], [0.5, 0.5], c=0.0)
    with pytest.raises(ValueError, match="K"):
        em.quantize(torch.randn(2, 3), torch.randn(2, 3), K=5)


def test_try_it_solutions_of_chapter_16_pass_at_k_and_mauve():
    n, c = 200, 5
    stated = []
    for k in (1, 10, 100):
        p = em.pass_at_k(n, c, k)
        assert p == pytest.approx(float(_exact(n, c, k)), abs=1e-14)  # oracle: exact binomials
        stated.append(f"pass@{k} = {p:.3f}")
    biased = [1 - (1 - c / n) ** k for k in (10, 100)]
    stated += [f"against a biased {biased[0]:.3f}", f"against {biased[1]:.3f}"]
    scores = []
    for scale in (1, 5, 10):
        score = em.mauve([0.5, 0.5], [0.9, 0.1], c=scale)
        # oracle: mauve-text's curve and sklearn's auc
        assert score == pytest.approx(_mauve_reference(np.array([0.5, 0.5]), np.array([0.9, 0.1]), scale)[1],
                                      abs=1e-12)
        scores.append(score)
    stated.append(f"{scores[0]:.3f}, {scores[1]:.3f} and {scores[2]:.3f}")
    assert_states("16-evaluation.ipynb", stated)
