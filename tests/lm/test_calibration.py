"""Chapter 19 (ids 19.01-19.06) against torchmetrics, scikit-learn, scipy, numpy and simulation.

Tolerances, stated once:

* ECE / MCE against ``torchmetrics.functional.classification`` (confidences kept >= 1e-6 away from every
  bin edge, since torchmetrics closes its bins on the other side): ``atol = 1e-6``, because torchmetrics
  computes in float32 even for float64 input (ours in float64);
* the Brier score against ``sklearn.metrics.brier_score_loss``: ``atol = 1e-12``;
* temperature scaling against ``torch.nn.functional.softmax`` in float64: ``atol = 1e-15``; the fitted
  temperature against ``scipy.optimize.minimize_scalar`` (bounded, ``xatol = 1e-10``): ``rtol = 1e-6``;
* selective risk and the risk-coverage curve against a brute-force numpy loop: ``atol = 1e-12``;
* the conformal threshold against ``numpy.quantile(method="inverted_cdf")``: exact; coverage by simulation:
  within 4 Monte Carlo standard errors of the exact value ceil((n+1)(1-alpha))/(n+1), which itself lies in
  [1 - alpha, 1 - alpha + 1/(n+1)].
"""

import math

import numpy as np
import pytest
import scipy.optimize
import scipy.special
import sklearn.metrics
import torch
import torchmetrics.functional.classification as tmf

from llmbook.lm import calibration as cal
from tests.try_it import assert_states

NOTEBOOK = "19-calibration.ipynb"


def gen(seed):
    return torch.Generator().manual_seed(seed)


def off_edges(p, n_bins, margin=1e-6):
    """True when no top-label confidence lies within ``margin`` of a bin edge."""
    conf = p.max(-1).values if p.ndim == 2 else p
    d = (conf * n_bins - torch.round(conf * n_bins)).abs() / n_bins
    return bool((d > margin).all())


def random_classifier(n, C, seed, scale=3.0, T_true=1.5):
    """Probabilities softmax(z) and labels drawn from softmax(z / T_true): an over-confident model when T_true > 1."""
    g = gen(seed)
    z = scale * torch.randn(n, C, generator=g, dtype=torch.float64)
    y = torch.multinomial(torch.softmax(z / T_true, -1), 1, generator=g)[:, 0]
    return z, torch.softmax(z, -1), y


# ----------------------------------------------------------------------------- 19.01, 19.02


@pytest.mark.equation("19.01", oracle="torchmetrics.functional.multiclass_calibration_error / binary_calibration_error "
                                       "(norm='l1')")
@pytest.mark.parametrize("seed,C,n_bins", [(0, 5, 15), (1, 10, 10), (2, 3, 7), (3, 100, 20)])
def test_ece_matches_torchmetrics(seed, C, n_bins):
    _, p, y = random_classifier(500, C, seed)
    assert off_edges(p, n_bins)
    ref = tmf.multiclass_calibration_error(p, y, num_classes=C, n_bins=n_bins, norm="l1")
    assert abs(float(cal.expected_calibration_error(p, y, n_bins)) - float(ref)) < 1e-6
    # binary: the probability of class 1 against the label
    pb = torch.rand(400, generator=gen(seed), dtype=torch.float64)
    yb = (torch.rand(400, generator=gen(seed + 100), dtype=torch.float64) < pb ** 1.5).long()
    assert off_edges(pb, n_bins)
    ref_b = tmf.binary_calibration_error(pb, yb, n_bins=n_bins, norm="l1")
    assert abs(float(cal.expected_calibration_error(pb, yb, n_bins)) - float(ref_b)) < 1e-6


@pytest.mark.equation("19.02", oracle="torchmetrics.functional.multiclass_calibration_error / binary_calibration_error "
                                       "(norm='max')")
@pytest.mark.parametrize("seed,C,n_bins", [(0, 5, 15), (1, 10, 10), (4, 2, 5)])
def test_mce_matches_torchmetrics(seed, C, n_bins):
    _, p, y = random_classifier(300, C, seed)
    assert off_edges(p, n_bins)
    ref = tmf.multiclass_calibration_error(p, y, num_classes=C, n_bins=n_bins, norm="max")
    assert abs(float(cal.maximum_calibration_error(p, y, n_bins)) - float(ref)) < 1e-6
    pb = torch.rand(200, generator=gen(seed), dtype=torch.float64)
    yb = (torch.rand(200, generator=gen(seed + 7), dtype=torch.float64) < pb).long()
    assert off_edges(pb, n_bins)
    ref_b = tmf.binary_calibration_error(pb, yb, n_bins=n_bins, norm="max")
    assert abs(float(cal.maximum_calibration_error(pb, yb, n_bins)) - float(ref_b)) < 1e-6


def test_calibration_bins_match_a_loop():
    conf = torch.rand(200, generator=gen(5), dtype=torch.float64)
    correct = (torch.rand(200, generator=gen(6), dtype=torch.float64) < conf).double()
    b = cal.calibration_bins(conf, correct, 8)
    for m in range(8):
        members = [i for i in range(200) if m / 8 < conf[i] <= (m + 1) / 8]
        assert b.count[m] == len(members)
        if members:
            assert math.isclose(b.confidence[m], conf[members].mean(), abs_tol=1e-14)
            assert math.isclose(b.accuracy[m], correct[members].mean(), abs_tol=1e-14)
    # the right-closed edge: 0.25 belongs to (0.125, 0.25], 0 to the first bin
    edge = cal.calibration_bins(torch.tensor([0.25, 0.0], dtype=torch.float64), torch.tensor([1, 0]), 8)
    assert edge.count.tolist() == [1, 1, 0, 0, 0, 0, 0, 0]


def test_calibrated_model_has_small_ece_overconfident_large():
    """Labels drawn from the predicted distribution: ECE -> 0 with n; drawn from a softer one: a clear gap."""
    _, p, _ = random_classifier(20000, 10, 9)
    y_cal = torch.multinomial(p, 1, generator=gen(10))[:, 0]
    _, _, y_over = random_classifier(20000, 10, 9, T_true=2.0)
    assert cal.expected_calibration_error(p, y_cal) < 0.02 < 0.1 < cal.expected_calibration_error(p, y_over)


# ----------------------------------------------------------------------------- 19.03


@pytest.mark.equation("19.03", oracle="sklearn.metrics.brier_score_loss")
@pytest.mark.parametrize("seed,C", [(0, 2), (1, 5), (2, 30)])
def test_brier_matches_sklearn(seed, C):
    _, p, y = random_classifier(300, C, seed)
    ref = sklearn.metrics.brier_score_loss(y.numpy(), p.numpy(), labels=list(range(C)), scale_by_half=False)
    assert math.isclose(cal.brier_score(p, y).item(), ref, abs_tol=1e-12)
    pb = p[:, 1] / (p[:, 0] + p[:, 1])
    ref_b = sklearn.metrics.brier_score_loss((y == 1).numpy(), pb.numpy())
    assert math.isclose(cal.brier_score(pb, (y == 1).long()).item(), ref_b, abs_tol=1e-12)


def test_brier_is_proper():
    """The expected Brier score under the true distribution q is minimised by reporting q itself."""
    q = torch.tensor([0.6, 0.3, 0.1], dtype=torch.float64)
    labels = torch.arange(3)

    def expected(report):
        return sum(q[c] * cal.brier_score(report[None], labels[c:c + 1]) for c in range(3))

    best = expected(q)
    for other in ([0.7, 0.2, 0.1], [1.0, 0.0, 0.0], [1 / 3] * 3, [0.5, 0.4, 0.1]):
        assert expected(torch.tensor(other, dtype=torch.float64)) > best


# ----------------------------------------------------------------------------- 19.04


@pytest.mark.equation("19.04", oracle="torch.nn.functional.softmax(z / T) in float64; "
                                       "scipy.optimize.minimize_scalar for the fitted T")
def test_temperature_scale_matches_softmax():
    z = torch.randn(6, 11, generator=gen(0), dtype=torch.float64) * 4
    for T in (0.3, 1.0, 2.5, 40.0):
        torch.testing.assert_close(cal.temperature_scale(z, T), torch.nn.functional.softmax(z / T, -1), atol=1e-15,
                                   rtol=0)
        assert torch.equal(cal.temperature_scale(z, T).argmax(-1), z.argmax(-1))  # accuracy unchanged
    torch.testing.assert_close(cal.temperature_scale(z, math.inf), torch.full_like(z, 1 / 11), atol=1e-15, rtol=0)
    tiny = cal.temperature_scale(z, 1e-30)  # T -> 0: one-hot at the arg max, no NaN
    assert torch.equal(tiny, torch.nn.functional.one_hot(z.argmax(-1), 11).double())


@pytest.mark.parametrize("T_true", [0.7, 1.0, 2.0])
def test_fit_temperature_matches_scipy(T_true):
    z, _, y = random_classifier(3000, 8, 11, T_true=T_true)
    ours = cal.fit_temperature(z, y)
    zn, yn = z.numpy(), y.numpy()

    def nll(T):
        return -scipy.special.log_softmax(zn / T, axis=1)[np.arange(len(yn)), yn].mean()

    ref = scipy.optimize.minimize_scalar(nll, bounds=(0.01, 100), method="bounded", options=dict(xatol=1e-10))
    assert math.isclose(ours, ref.x, rel_tol=1e-6)
    assert abs(ours / T_true - 1) < 0.1  # and it recovers the temperature the labels were drawn with


# ----------------------------------------------------------------------------- 19.05


@pytest.mark.equation("19.05", oracle="brute-force numpy: mean loss over the selected examples")
def test_selective_risk_and_curve_match_brute_force():
    rng = np.random.default_rng(0)
    conf = rng.random(300)
    loss = (rng.random(300) > conf).astype(float)  # confident predictions err less
    for t in (0.0, 0.3, 0.7, 0.95):
        g = conf >= t
        ref = loss[g].mean()
        assert math.isclose(cal.selective_risk(torch.tensor(loss), torch.tensor(g, dtype=torch.float64)).item(), ref,
                            abs_tol=1e-12)
    w = rng.random(300)  # a randomised selection: weighted mean
    assert math.isclose(cal.selective_risk(torch.tensor(loss), torch.tensor(w)).item(), (loss * w).sum() / w.sum(),
                        abs_tol=1e-12)
    coverage, risk = cal.risk_coverage_curve(torch.tensor(conf), torch.tensor(loss))
    for k in (1, 10, 150, 300):
        t = np.sort(conf)[::-1][k - 1]  # answer the k most confident (no ties in random floats)
        assert math.isclose(coverage[k - 1].item(), k / 300)
        assert math.isclose(risk[k - 1].item(), loss[conf >= t].mean(), abs_tol=1e-12)
    assert risk[-1].item() == pytest.approx(loss.mean()) and risk[29].item() < risk[-1].item()


@pytest.mark.equation("19.05", oracle="sklearn.metrics.precision_recall_curve: risk = 1 - precision at each threshold")
@pytest.mark.parametrize("seed,decimals", [(0, 2), (1, 6)])
def test_risk_coverage_curve_matches_sklearn_precision(seed, decimals):
    """With ties (confidences rounded): at the end of every tie group the curve equals 1 - sklearn's precision."""
    rng = np.random.default_rng(seed)
    conf = np.round(rng.random(500), decimals)
    correct = (rng.random(500) < conf).astype(float)
    coverage, risk = cal.risk_coverage_curve(torch.tensor(conf), torch.tensor(1 - correct))
    precision, _, thresholds = sklearn.metrics.precision_recall_curve(correct, conf)
    k = (conf[None, :] >= thresholds[:, None]).sum(1)  # answered at each distinct threshold
    np.testing.assert_allclose(risk.numpy()[k - 1], 1 - precision[:-1], atol=1e-12, rtol=0)
    np.testing.assert_allclose(coverage.numpy()[k - 1], k / 500, atol=1e-15)
    order = np.argsort(-conf, kind="stable")  # and the whole curve: sort, then a cumulative mean
    np.testing.assert_allclose(risk.numpy(), np.cumsum(1 - correct[order]) / np.arange(1, 501), atol=1e-12)


# ----------------------------------------------------------------------------- 19.06


def test_conformal_quantile_matches_numpy():
    rng = np.random.default_rng(1)
    for n, alpha in ((9, 0.2), (99, 0.1), (1000, 0.05), (19, 0.01), (5, 0.5)):
        s = rng.random(n)
        k = math.ceil((n + 1) * (1 - alpha) - 1e-12)
        ours = cal.conformal_quantile(torch.tensor(s), alpha)
        if k > n:
            assert ours == math.inf
        else:
            assert ours == np.quantile(s, k / n, method="inverted_cdf")


@pytest.mark.equation("19.06", oracle="simulation: coverage over 2000 calibration/test splits against the exact "
                                       "ceil((n+1)(1-alpha))/(n+1)")
@pytest.mark.parametrize("n,alpha", [(50, 0.1), (19, 0.2)])
def test_conformal_sets_cover_at_the_finite_sample_rate(n, alpha):
    g = gen(12)
    trials, n_test, C = 2000, 50, 6
    covered = torch.empty(trials, dtype=torch.float64)
    for t in range(trials):
        z = 2.0 * torch.randn(n + n_test, C, generator=g, dtype=torch.float64)
        p = torch.softmax(z, -1)
        y = torch.multinomial(torch.softmax(z / 2.0, -1), 1, generator=g)[:, 0]  # a miscalibrated model
        q_hat = cal.conformal_quantile(cal.conformal_scores(p[:n], y[:n]), alpha)
        sets = cal.conformal_prediction_set(p[n:], q_hat)
        covered[t] = sets[torch.arange(n_test), y[n:]].double().mean()
    exact = math.ceil((n + 1) * (1 - alpha)) / (n + 1)
    assert 1 - alpha <= exact <= 1 - alpha + 1 / (n + 1)
    se = covered.std() / math.sqrt(trials)
    assert abs(covered.mean().item() - exact) < 4 * se.item(), (covered.mean().item(), exact, se.item())


def test_conformal_set_is_the_score_threshold():
    p = torch.softmax(torch.randn(20, 7, generator=gen(3), dtype=torch.float64), -1)
    for q in (-0.1, 0.3, 0.8, 1.0, math.inf):
        ref = torch.tensor([[1 - p[i, c].item() <= q for c in range(7)] for i in range(20)])
        assert torch.equal(cal.conformal_prediction_set(p, q), ref)


# ----------------------------------------------------------------------------- bad input


def test_bad_input_raises_clear_errors():
    p = torch.softmax(torch.randn(4, 3, generator=gen(0)), -1)
    with pytest.raises(ValueError, match="labels must be token ids"):
        cal.expected_calibration_error(p, torch.tensor([0, 1, 2, 3]))
    with pytest.raises(ValueError, match="must sum to 1"):
        cal.brier_score(p * 2 / 3 + 0.1, torch.tensor([0, 1, 2, 0]))
    with pytest.raises(ValueError, match=r"labels must have shape \(n,\)"):
        cal.maximum_calibration_error(p, torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="T must lie in"):
        cal.temperature_scale(p, 0.0)
    with pytest.raises(ValueError, match="selects nothing"):
        cal.selective_risk(torch.ones(3), torch.zeros(3))
    with pytest.raises(ValueError, match="alpha must lie in"):
        cal.conformal_quantile(torch.rand(5), 1.0)
    with pytest.raises(ValueError, match="must not be empty"):
        cal.expected_calibration_error(torch.zeros(0, 3), torch.zeros(0, dtype=torch.long))


# ----------------------------------------------------------------------------- the chapter's running example


def gpt_predictions():
    """The tiny GPT's held-out predictions exactly as the chapter computes them: logits, labels, calib/test split."""
    from llmbook.lm.training import corpus_tokens, pretrained_tiny

    model, tok = pretrained_tiny()
    _, _, heldout_ids = corpus_tokens()
    windows = torch.as_tensor(heldout_ids[: 160 * 65].astype(np.int64)).view(160, 65)
    with torch.no_grad():
        z = model(windows[:, :64]).reshape(-1, tok.vocab_size).double()
    y = windows[:, 1:].reshape(-1)
    split = torch.randperm(len(y), generator=torch.Generator().manual_seed(0))
    return z, y, split[:5000], split[5000:]


def try_it_numbers():
    z, y, calib, test = gpt_predictions()
    p = torch.softmax(z, -1)
    T_fit = cal.fit_temperature(z[calib], y[calib])
    Ts = np.round(np.arange(0.8, 1.61, 0.05), 2)
    ece_T = [cal.expected_calibration_error(cal.temperature_scale(z[test], t), y[test]).item() for t in Ts]
    nll_T = [torch.nn.functional.cross_entropy(z[test] / t, y[test]).item() for t in Ts]
    T_ece = float(Ts[int(np.argmin(ece_T))])
    ece_fit = cal.expected_calibration_error(cal.temperature_scale(z[test], T_fit), y[test]).item()
    nll_fit = torch.nn.functional.cross_entropy(z[test] / T_fit, y[test]).item()
    out = dict(T_ece=T_ece, ece_min=min(ece_T), nll_at_T_ece=nll_T[int(np.argmin(ece_T))], T_fit=T_fit, ece_fit=ece_fit,
               nll_fit=nll_fit, T_nll=float(Ts[int(np.argmin(nll_T))]))
    q = cal.conformal_quantile(cal.conformal_scores(p[calib], y[calib]), 0.05)
    sets = cal.conformal_prediction_set(p[test], q)
    out.update(q05=q, cov05=sets[torch.arange(len(test)), y[test]].double().mean().item(),
               size05=sets.sum(-1).double().mean().item(), median05=int(sets.sum(-1).median()))
    conf, correct = cal.confidence_and_correct(p[test], y[test])
    coverage, risk = cal.risk_coverage_curve(conf, 1 - correct)
    ok = torch.nonzero(risk <= 0.10)[:, 0]
    assert (risk[ok.max() + 1:] > 0.10).all()  # "from there on the error rate stays above 10 %"
    out.update(cov_at_10=coverage[ok.max()].item(), risk_at=risk[ok.max()].item())
    return out


def test_try_it_numbers():
    v = try_it_numbers()
    assert_states(NOTEBOOK, [
        f"$T = {v['T_ece']:.2f}$ gives the smallest test ECE, {v['ece_min']:.3f}",
        f"{v['ece_fit']:.3f} at the fitted $T = {v['T_fit']:.2f}$", f"test NLL is {v['nll_at_T_ece']:.3f}",
        f"against {v['nll_fit']:.3f}", f"lowest at $T = {v['T_nll']:.2f}$",
        f"$\\hat q = {v['q05']:.4f}$", f"coverage is {v['cov05']:.3f}", f"{v['size05']:.1f} characters on average",
        f"median {v['median05']}", f"{v['cov_at_10']:.1%}".replace("%", " %"), f"{v['risk_at']:.2%}".replace("%", " %"),
    ])


def test_chapter_prose_numbers():
    """The numbers the chapter's prose and summary table state about the tiny GPT."""
    z, y, calib, test = gpt_predictions()
    p = torch.softmax(z, -1)
    conf, correct = cal.confidence_and_correct(p[test], y[test])
    b = cal.calibration_bins(conf, correct, 10)
    gaps = b.accuracy - b.confidence
    assert (gaps < -0.01).sum() == 9 and gaps.abs().min() < 0.005  # over-confident in 9 of 10 bins, 1 on the diagonal
    assert int(gaps.abs().argmin()) == 6  # the seventh bin, (0.6, 0.7], is the one on the diagonal
    assert 0.3 < b.count[-1] / len(test) < 0.36 and round(b.accuracy[-1].item(), 2) == 0.95  # a third; 95 % right
    assert gaps[:5].abs().min() > gaps[5:].abs().max()  # gaps largest below 0.5
    ece = cal.expected_calibration_error(p[test], y[test]).item()
    T = cal.fit_temperature(z[calib], y[calib])
    _, risk = cal.risk_coverage_curve(conf, 1 - correct)
    q = cal.conformal_quantile(cal.conformal_scores(p[calib], y[calib]), 0.1)
    sets = cal.conformal_prediction_set(p[test], q)
    cov, size = sets[torch.arange(len(test)), y[test]].double().mean().item(), sets.sum(-1).double().mean().item()
    assert round(ece, 2) == 0.05 and round(size) == 8 and 1 / 45 < risk[len(test) // 5 - 1] < 1 / 35
    mce = cal.maximum_calibration_error(p[test], y[test]).item()
    assert_states(NOTEBOOK, ["ECE about 0.05", f"MCE {mce:.2f}", f"$T \\approx {T:.2f}$",
                             f"{risk[round(0.2 * len(test)) - 1].item():.1%} at 20 % coverage".replace("%", " %", 1),
                             f"{risk[-1].item():.0%} at full coverage".replace("%", " %", 1),
                             f"coverage {cov:.2f} with about {size:.0f} characters",
                             "the seventh, confidences 0.6 to 0.7", "(the seventh on the diagonal)"], section="all")
