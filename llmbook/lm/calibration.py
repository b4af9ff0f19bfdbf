r"""Calibration and uncertainty: ECE, MCE, the Brier score, temperature scaling, selective risk, conformal sets.

A classifier (a language model predicting the next token is one, with :math:`V` classes) is
*calibrated* when its confidence is its accuracy: of all the predictions made with probability 0.8,
80 % are right.

* **Binned calibration error** (19.01, 19.02): sort the predictions into :math:`M` equal-width bins
  of confidence, :math:`B_m = \{i: (m-1)/M < \hat p_i \le m/M\}`, and compare each bin's accuracy
  with its mean confidence: :func:`expected_calibration_error` (the average gap, weighted by the
  bin's share of predictions), :func:`maximum_calibration_error` (the worst bin's gap);
  :func:`calibration_bins` gives the bins themselves (a reliability diagram).
* **Brier score** (19.03, :func:`brier_score`): the squared distance between the predicted
  distribution and the one-hot truth, a proper scoring rule.
* **Temperature scaling** (19.04, :func:`temperature_scale`, :func:`fit_temperature`): divide the
  logits by one scalar :math:`T` fitted on held-out data by minimising the NLL.
* **Selective prediction** (19.05, :func:`selective_risk`, :func:`risk_coverage_curve`): answer
  only when confident; the risk of the answered ones against the fraction answered.
* **Split conformal prediction** (19.06, :func:`conformal_quantile`,
  :func:`conformal_prediction_set`): a set of labels that contains the truth with probability at
  least :math:`1-\alpha`, from exchangeability alone.

Input conventions: ``probs`` is ``(n, C)`` (rows are distributions) with ``labels`` ``(n,)`` integer
classes; for a binary problem ``probs`` may be ``(n,)``, the probability of class 1, with labels
in {0, 1} (as ``torchmetrics.functional.binary_calibration_error`` and scikit-learn's
``brier_score_loss`` take them). Arithmetic runs in float64 (bin membership then cannot depend on the
input's precision); results come back in the input's floating dtype.

>>> probs = torch.tensor([[0.9, 0.1], [0.75, 0.25], [0.35, 0.65], [0.55, 0.45]]); labels = torch.tensor([0, 1, 1, 0])
>>> round(float(expected_calibration_error(probs, labels, n_bins=5)), 4)   # bins (0.4, 0.6], (0.6, 0.8], (0.8, 1]
0.2375
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from llmbook._checks import (
    as_tensor,
    check_dim,
    check_finite,
    check_nonempty,
    check_positive_int,
    check_probability,
    check_range,
    check_same_shape,
    check_token_ids,
    check_unit_interval,
)
from llmbook._precision import HALF
from llmbook.registry import implements

__all__ = ["CalibrationBins", "confidence_and_correct", "calibration_bins", "expected_calibration_error",
           "maximum_calibration_error", "brier_score", "temperature_scale", "fit_temperature", "selective_risk",
           "risk_coverage_curve", "conformal_scores", "conformal_quantile", "conformal_prediction_set"]


# ----------------------------------------------------------------------------------------------- inputs


def _probs(probs, name: str = "probs") -> tuple[torch.Tensor, torch.dtype]:
    """``probs`` as float64 ``(n,)`` or ``(n, C)`` with entries in [0, 1] and rows summing to 1; its dtype."""
    p = as_tensor(probs, name)
    check_dim(p, name, "(n,) or (n, C)", min_dim=1, max_dim=2)
    check_nonempty(p, name, dim=0)
    check_nonempty(p, name, dim=-1)
    check_finite(p, name)
    dtype = p.dtype
    p = p.double()
    if ((p < 0) | (p > 1)).any():
        raise ValueError(f"{name} must lie in [0, 1], got range [{p.min().item():.4g}, {p.max().item():.4g}]")
    if p.ndim == 2:  # fp16 rounds each entry by up to 2^-11: the row sums may miss 1 by C times that
        check_probability(p, name, atol=1e-4 if dtype not in HALF else 1e-2 + p.shape[-1] * 2.0**-8)
    return p, dtype


def _labels(labels, p: torch.Tensor) -> torch.Tensor:
    C = 2 if p.ndim == 1 else p.shape[-1]
    y = check_token_ids(labels, C, "labels")
    if y.shape != p.shape[:1]:
        raise ValueError(f"labels must have shape (n,) = {tuple(p.shape[:1])} to match probs {tuple(p.shape)}, "
                         f"got {tuple(y.shape)}")
    return y


def _result(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return x.to(dtype)


def confidence_and_correct(probs, labels) -> tuple[torch.Tensor, torch.Tensor]:
    r"""The confidence :math:`\hat p_i` and the correctness of each prediction, both ``(n,)`` float64.

    ``(n, C)`` probabilities: :math:`\hat p_i = \max_c p_{ic}` and correct when
    :math:`\arg\max_c p_{ic} = y_i` (top-label calibration; ties go to the lowest class, as
    ``torch.argmax``). ``(n,)`` binary probabilities of class 1: :math:`\hat p_i = p_i` and the
    "correctness" is :math:`y_i` itself (the calibration of :math:`P(y = 1)`).

    >>> confidence_and_correct(torch.tensor([[0.7, 0.3], [0.4, 0.6]]), torch.tensor([0, 0]))
    (tensor([0.7000, 0.6000], dtype=torch.float64), tensor([1., 0.], dtype=torch.float64))
    """
    p, _ = _probs(probs)
    y = _labels(labels, p)
    if p.ndim == 1:
        return p, y.double()
    conf, pred = p.max(-1)
    return conf, (pred == y).double()


# ----------------------------------------------------------------------------------------------- 19.01, 19.02


@dataclass(frozen=True)
class CalibrationBins:
    """Per-bin ``count``, mean ``confidence`` and ``accuracy`` (0 where a bin is empty), and the ``edges``."""

    count: torch.Tensor
    confidence: torch.Tensor
    accuracy: torch.Tensor
    edges: torch.Tensor


def calibration_bins(confidence, correct, n_bins: int = 15) -> CalibrationBins:
    r"""Equal-width bins :math:`B_m = \{i: (m-1)/M < \hat p_i \le m/M\}` (:math:`\hat p = 0` joins the first).

    ``confidence`` :math:`\hat p_i \in [0, 1]` and ``correct`` (0/1 or bool), both ``(n,)``; ``n_bins``
    :math:`M \ge 1`. torchmetrics closes its bins on the left instead (:math:`[(m-1)/M, m/M)`, and
    :math:`\hat p = 1` in a bin of its own); the two agree unless a confidence sits exactly on an edge.

    >>> b = calibration_bins(torch.tensor([0.15, 0.25, 0.85]), torch.tensor([1, 0, 1]), n_bins=5)
    >>> b.count.tolist(), b.accuracy.tolist()
    ([1.0, 1.0, 0.0, 0.0, 1.0], [1.0, 0.0, 0.0, 0.0, 1.0])
    """
    M = check_positive_int(n_bins, "n_bins")
    conf = as_tensor(confidence, "confidence")
    check_dim(conf, "confidence", "(n,)", max_dim=1)
    check_nonempty(conf, "confidence", dim=0)
    check_finite(conf, "confidence")
    conf = conf.double()
    if ((conf < 0) | (conf > 1)).any():
        raise ValueError(f"confidence must lie in [0, 1], got range [{conf.min().item():.4g}, {conf.max().item():.4g}]")
    acc = as_tensor(correct.to(torch.float64) if isinstance(correct, torch.Tensor) and correct.dtype == torch.bool
                    else correct, "correct").double()
    check_same_shape(conf, acc, "confidence", "correct")
    if ((acc != 0) & (acc != 1)).any():
        raise ValueError("correct must hold 0 or 1 (or bools)")
    idx = (torch.ceil(conf * M).long() - 1).clamp(0, M - 1)
    count = torch.zeros(M, dtype=torch.float64).index_add_(0, idx, torch.ones_like(conf))
    safe = count.clamp(min=1)
    mean_conf = torch.zeros(M, dtype=torch.float64).index_add_(0, idx, conf) / safe
    accuracy = torch.zeros(M, dtype=torch.float64).index_add_(0, idx, acc) / safe
    return CalibrationBins(count, mean_conf, accuracy, torch.linspace(0, 1, M + 1, dtype=torch.float64))


@implements("19.01")
def expected_calibration_error(probs, labels, n_bins: int = 15) -> torch.Tensor:
    r"""Expected calibration error, the bins' accuracy gaps weighted by their share of the predictions.

    .. math:: \mathrm{ECE}=\sum_{m=1}^{M}\frac{|B_m|}{n}\left|\mathrm{acc}(B_m)-\mathrm{conf}(B_m)\right|

    ``probs`` ``(n, C)`` (or ``(n,)`` binary, see the module), ``labels`` ``(n,)``, ``n_bins`` :math:`M`
    (15 in Guo et al., 2017); bins as in :func:`calibration_bins`. A 0-d tensor in ``probs``' dtype.
    Equals ``torchmetrics.functional.multiclass_calibration_error(..., norm="l1")`` (and the binary
    one) when no confidence lies on a bin edge.

    >>> round(float(expected_calibration_error(torch.tensor([0.9, 0.9, 0.9, 0.9]), torch.tensor([1, 1, 1, 0]))), 4)
    0.15
    """
    p, dtype = _probs(probs)
    b = calibration_bins(*confidence_and_correct(p, labels), n_bins)
    return _result((b.count / b.count.sum() * (b.accuracy - b.confidence).abs()).sum(), dtype)


@implements("19.02")
def maximum_calibration_error(probs, labels, n_bins: int = 15) -> torch.Tensor:
    r"""Maximum calibration error: :math:`\mathrm{MCE}=\max_m\left|\mathrm{acc}(B_m)-\mathrm{conf}(B_m)\right|`.

    The worst gap over the non-empty bins (an empty bin has no gap), whatever their size: a bin of one
    prediction counts as much as a bin of thousands, so MCE is noisy on small samples. Arguments as in
    :func:`expected_calibration_error`; the reference is torchmetrics with ``norm="max"``.

    >>> float(maximum_calibration_error(torch.tensor([0.15, 0.85, 0.85]), torch.tensor([0, 1, 0]), n_bins=5))
    0.35
    """
    p, dtype = _probs(probs)
    b = calibration_bins(*confidence_and_correct(p, labels), n_bins)
    return _result(((b.accuracy - b.confidence).abs() * (b.count > 0)).max(), dtype)


# ----------------------------------------------------------------------------------------------- 19.03


@implements("19.03")
def brier_score(probs, labels) -> torch.Tensor:
    r"""Brier score :math:`\mathrm{BS}=\frac{1}{n}\sum_{i=1}^{n}\sum_{c=1}^{C}(p_{ic}-y_{ic})^2` (:math:`y` one-hot).

    ``(n, C)`` probabilities: the sum over classes, in :math:`[0, 2]` (scikit-learn's
    ``brier_score_loss(..., labels=range(C))`` for multiclass). ``(n,)`` binary probabilities of class 1:
    :math:`\frac1n\sum_i (p_i - y_i)^2`, in :math:`[0, 1]`, half the two-class sum (scikit-learn's binary
    convention). A proper scoring rule: in expectation it is minimised only by the true probabilities.

    >>> float(brier_score(torch.tensor([[0.5, 0.5], [1.0, 0.0]]), torch.tensor([0, 0])))
    0.25
    """
    p, dtype = _probs(probs)
    y = _labels(labels, p)
    if p.ndim == 1:
        return _result(((p - y.double()) ** 2).mean(), dtype)
    onehot = torch.nn.functional.one_hot(y, p.shape[-1]).double()
    return _result(((p - onehot) ** 2).sum(-1).mean(), dtype)


# ----------------------------------------------------------------------------------------------- 19.04


@implements("19.04")
def temperature_scale(logits, T: float) -> torch.Tensor:
    r"""Temperature scaling :math:`p_i=\mathrm{softmax}(z_i/T)` over the last axis.

    ``logits`` :math:`z` ``(..., C)``, ``T`` :math:`> 0` (``inf`` gives the uniform distribution).
    :math:`T > 1` softens an over-confident model, :math:`T < 1` sharpens; the arg max, hence the
    accuracy, never changes. fp16/bf16 are computed in float32.

    >>> temperature_scale(torch.tensor([2.0, 0.0]), 2.0)
    tensor([0.7311, 0.2689])
    """
    T = check_range(T, "T", 0.0, low_open=True, finite=False)
    z = as_tensor(logits, "logits")
    check_dim(z, "logits", "(..., C)")
    check_nonempty(z, "logits")
    check_finite(z, "logits", allow_neg_inf=True)
    if (z == -math.inf).all(-1).any():
        raise ValueError("logits: a row of all -inf has no distribution")
    dtype = z.dtype
    zc = z.float() if dtype in HALF else z
    if math.isinf(T):
        p = torch.isfinite(zc).to(zc.dtype)
        return (p / p.sum(-1, keepdim=True)).to(dtype)
    # subtract the row max first: (z - max) / T is <= 0, so a tiny T gives -inf, never inf - inf = NaN
    return torch.softmax((zc - zc.amax(-1, keepdim=True)) / T, -1).to(dtype)


def fit_temperature(logits, labels, *, T_max: float = 100.0) -> float:
    r"""The temperature that minimises the held-out NLL :math:`-\frac1n\sum_i \log\mathrm{softmax}(z_i/T)_{y_i}`.

    L-BFGS (torch, float64, strong-Wolfe line search) over :math:`\log T`, started at :math:`T = 1`,
    the result clipped to :math:`[1/T_{max}, T_{max}]`. The NLL is convex in :math:`1/T`, so the optimum is
    unique. Fit on data the model was not trained on (a calibration split), then apply
    :func:`temperature_scale` to new predictions. ``logits`` ``(n, C)``, ``labels`` ``(n,)``.

    >>> z = torch.tensor([[4.0, 0.0], [4.0, 0.0], [0.0, 4.0], [4.0, 0.0]]); y = torch.tensor([0, 1, 1, 0])
    >>> round(fit_temperature(z, y), 3)
    3.641
    """
    z = as_tensor(logits, "logits")
    check_dim(z, "logits", "(n, C)", min_dim=2, max_dim=2)
    check_nonempty(z, "logits", dim=0)
    check_finite(z, "logits")
    T_max = check_range(T_max, "T_max", 1.0, low_open=True)
    z = z.double()
    y = check_token_ids(labels, z.shape[-1], "labels")
    if y.shape != z.shape[:1]:
        raise ValueError(f"labels must have shape ({z.shape[0]},), got {tuple(y.shape)}")
    log_T = torch.zeros((), dtype=torch.float64, requires_grad=True)
    opt = torch.optim.LBFGS([log_T], lr=1.0, max_iter=200, tolerance_grad=1e-12, tolerance_change=1e-14,
                            line_search_fn="strong_wolfe")

    def closure():
        opt.zero_grad()
        nll = torch.nn.functional.cross_entropy(z / log_T.clamp(-math.log(T_max), math.log(T_max)).exp(), y)
        nll.backward()
        return nll

    opt.step(closure)
    return float(log_T.detach().clamp(-math.log(T_max), math.log(T_max)).exp())


# ----------------------------------------------------------------------------------------------- 19.05


@implements("19.05")
def selective_risk(loss, g) -> torch.Tensor:
    r"""Selective risk :math:`R(f,g)=\frac{\mathbb{E}[\ell(f(x),y)\,g(x)]}{\mathbb{E}[g(x)]}`, with empirical means.

    ``loss`` :math:`\ell_i \ge 0` ``(n,)`` (0/1 errors for the error rate), ``g`` ``(n,)`` the selection
    in :math:`[0, 1]` (1: answer, 0: abstain; fractions for a randomised rule), broadcastable to ``loss``.
    The *coverage* is :math:`\mathbb{E}[g]`; it must be positive. A 0-d tensor in the promoted dtype.

    >>> float(selective_risk(torch.tensor([0.0, 1.0, 1.0, 0.0]), torch.tensor([1.0, 1.0, 0.0, 1.0])))
    0.3333333432674408
    """
    ell, gg = as_tensor(loss, "loss"), as_tensor(g, "g")
    check_dim(ell, "loss", "(n,)", max_dim=1)
    check_nonempty(ell, "loss", dim=0)
    for t, name in ((ell, "loss"), (gg, "g")):
        check_finite(t, name)
    if (ell < 0).any():
        raise ValueError("loss must be non-negative")
    if ((gg < 0) | (gg > 1)).any():
        raise ValueError("g must lie in [0, 1]")
    if gg.ndim > 1 or (gg.ndim == 1 and gg.shape[0] not in (1, ell.shape[0])):
        raise ValueError(f"g {tuple(gg.shape)} must broadcast to loss {tuple(ell.shape)}")
    dtype = torch.promote_types(ell.dtype, gg.dtype)
    ell64, g64 = ell.double(), gg.double().expand_as(ell)
    if g64.sum() == 0:
        raise ValueError("g selects nothing: the coverage E[g] is 0, the selective risk undefined")
    return ((ell64 * g64).sum() / g64.sum()).to(dtype)


def risk_coverage_curve(confidence, loss) -> tuple[torch.Tensor, torch.Tensor]:
    r"""Coverage :math:`k/n` and selective risk of answering the :math:`k` most confident, :math:`k = 1..n`.

    Sorted by decreasing ``confidence`` (ties in their original order); the risk at coverage
    :math:`k/n` is the mean ``loss`` of those :math:`k`, :func:`selective_risk` with :math:`g` the
    indicator of the top :math:`k`. A confidence that ranks errors last gives a curve that rises late; the
    area under it (AURC) summarises the ranking. Both outputs ``(n,)`` float64.

    >>> cov, risk = risk_coverage_curve(torch.tensor([0.9, 0.2, 0.6]), torch.tensor([0.0, 1.0, 0.0]))
    >>> cov.tolist(), risk.tolist()
    ([0.3333333333333333, 0.6666666666666666, 1.0], [0.0, 0.0, 0.3333333333333333])
    """
    conf, ell = as_tensor(confidence, "confidence").double(), as_tensor(loss, "loss").double()
    check_dim(conf, "confidence", "(n,)", max_dim=1)
    check_nonempty(conf, "confidence", dim=0)
    check_same_shape(conf, ell, "confidence", "loss")
    check_finite(conf, "confidence"), check_finite(ell, "loss")
    order = torch.argsort(conf, descending=True, stable=True)
    k = torch.arange(1, conf.numel() + 1, dtype=torch.float64)
    return k / conf.numel(), ell[order].cumsum(0) / k


# ----------------------------------------------------------------------------------------------- 19.06


def conformal_scores(probs, labels) -> torch.Tensor:
    r"""The nonconformity score of the true label, :math:`s_i = 1 - p_{i,y_i}` ("LAC"), ``(n,)`` float64."""
    p, _ = _probs(probs)
    if p.ndim != 2:
        raise ValueError(f"probs must have shape (n, C), got {tuple(p.shape)}")
    y = _labels(labels, p)
    return 1.0 - p.gather(-1, y[:, None])[:, 0]


def conformal_quantile(scores, alpha: float) -> float:
    r"""The split-conformal threshold :math:`\hat q`: the :math:`\lceil (n+1)(1-\alpha)\rceil`-th smallest score.

    ``scores`` ``(n,)`` of a calibration set exchangeable with the test point, ``alpha`` in (0, 1).
    Then :math:`P(s_{test} \le \hat q) \ge 1-\alpha`, and :math:`\le 1-\alpha+\frac{1}{n+1}` when the
    scores have no ties (Vovk et al., 2005; Angelopoulos & Bates, 2021). When
    :math:`\lceil (n+1)(1-\alpha)\rceil > n` the guarantee needs every label: :math:`\hat q = +\infty`.
    Equals ``numpy.quantile(scores, ceil((n+1)(1-alpha))/n, method="inverted_cdf")`` (``method="higher"``, seen in
    tutorials, interpolates on :math:`(n-1)q` and returns the next larger score: slightly conservative).

    >>> conformal_quantile(torch.arange(1.0, 10.0), 0.2)   # n = 9: the 8th smallest
    8.0
    """
    alpha = check_unit_interval(alpha, "alpha", low_open=True, high_open=True)
    s = as_tensor(scores, "scores").double()
    check_dim(s, "scores", "(n,)", max_dim=1)
    check_nonempty(s, "scores", dim=0)
    check_finite(s, "scores")
    n = s.numel()
    k = math.ceil((n + 1) * (1 - alpha) - 1e-12)  # the tolerance keeps e.g. (99 + 1) * 0.9 = 90.00000000000001 at 90
    if k > n:
        return math.inf
    return float(torch.sort(s).values[k - 1])


@implements("19.06")
def conformal_prediction_set(probs, q_hat: float) -> torch.Tensor:
    r"""The conformal prediction set :math:`C(x)=\{y: s(x,y)\le \hat q\}` with :math:`s(x, y) = 1 - p(y\mid x)`.

    ``probs`` ``(n, C)``; ``q_hat`` from :func:`conformal_quantile` on a calibration split (``inf``:
    every label). Returns a bool mask ``(n, C)``: label :math:`c` is in the set of row :math:`i`. Sets
    are large where the model is unsure and a single label where it is sure; they may be empty when
    :math:`\hat q < 1 - \max_c p_c`.

    >>> conformal_prediction_set(torch.tensor([[0.7, 0.2, 0.1], [0.4, 0.35, 0.25]]), 0.7)
    tensor([[ True, False, False],
            [ True,  True, False]])
    """
    q_hat = check_range(q_hat, "q_hat", finite=False)
    p, _ = _probs(probs)
    if p.ndim != 2:
        raise ValueError(f"probs must have shape (n, C), got {tuple(p.shape)}")
    return (1.0 - p) <= q_hat
