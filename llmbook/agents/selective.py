r"""Choosing the handoff threshold :math:`\tau_e` with a guarantee: selection with guaranteed risk.

:func:`llmbook.agents.safety.handoff` answers an input when :math:`P(error\mid x)\le\tau_e`. Picking
:math:`\tau_e` by eye on the data that will be reported gives no promise about new inputs. Geifman and
El-Yaniv's *selection with guaranteed risk* (SGR, 2017) picks it on a calibration split instead, so that the
**selective risk** (the error rate among the answered inputs),

.. math:: R(\tau)=\Pr\big(error\mid P(error\mid x)\le\tau\big),

is at most a target :math:`r^*` with probability at least :math:`1-\delta` over the draw of the calibration set
(the calibration and the future inputs drawn i.i.d. from the same distribution).

* :func:`binomial_upper_bound`: the exact (Clopper-Pearson) upper confidence bound on an error rate,
  :math:`B^*(e,n,\delta)=\max\{r: \Pr(\mathrm{Bin}(n,r)\le e)\ge\delta\}`: with probability
  :math:`\ge1-\delta`, the true rate is at most :math:`B^*`.
* :func:`risk_controlled_threshold`: SGR. Binary search over the calibration scores; each of the at most
  :math:`k=\lceil\log_2(m+1)\rceil` thresholds it tests gets the bound :math:`B^*` at level :math:`\delta/k`
  (a union bound), and the threshold answering the most inputs whose bound is below :math:`r^*` is returned.

>>> p = torch.linspace(0, 1, 1000, dtype=torch.float64)
>>> err = ((torch.arange(1000) % 20 == 0) | (p > 0.5)).double()  # 5 % errors up to p = 0.5, then all
>>> res = risk_controlled_threshold(p, err, target_risk=0.2, delta=0.1)
>>> res.risk <= res.bound < 0.2, round(res.tau, 3), res.coverage
(True, 0.566, 0.566)
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np
import torch

from llmbook._checks import as_tensor, check_dim, check_finite, check_nonempty, check_range, check_same_shape

__all__ = ["binomial_upper_bound", "risk_controlled_threshold", "RiskControlledThreshold"]


def _log_binom_cdf(log_comb: np.ndarray, j: np.ndarray, n: int, r: float) -> float:
    r"""``log P(Bin(n, r) <= e)`` by a log-sum-exp over the pmf terms ``j = 0..e`` (``0 < r < 1``)."""
    t = log_comb + j * math.log(r) + (n - j) * math.log1p(-r)
    top = t.max()
    return float(top + math.log(np.exp(t - top).sum()))


def binomial_upper_bound(errors: int, n: int, delta: float) -> float:
    r"""Clopper-Pearson upper bound :math:`B^*(e,n,\delta)=\max\{r\in[0,1]:\Pr(\mathrm{Bin}(n,r)\le e)\ge\delta\}`.

    ``errors`` :math:`e` (int, ``0 <= e <= n``) out of ``n`` (int ``>= 1``) trials; ``delta`` in (0, 1).
    If the true error rate is :math:`r`, then :math:`\Pr(r>B^*(e,n,\delta))\le\delta` over the draw of the
    :math:`n` trials. :math:`\Pr(\mathrm{Bin}(n,r)\le e)` falls with :math:`r`, so the root is found by
    bisection (45 halvings, to about :math:`3\cdot10^{-14}`). Equals ``scipy.stats.beta.ppf(1 - delta, e + 1, n - e)``.

    >>> round(binomial_upper_bound(0, 100, 0.05), 5)  # 1 - 0.05 ** (1 / 100)
    0.02951
    """
    if isinstance(errors, bool) or isinstance(n, bool) or not isinstance(errors, int) or not isinstance(n, int):
        raise TypeError(f"errors and n must be ints, got {type(errors).__name__} and {type(n).__name__}")
    if n < 1 or not 0 <= errors <= n:
        raise ValueError(f"need n >= 1 and 0 <= errors <= n, got errors = {errors}, n = {n}")
    delta = check_range(delta, "delta", 0.0, 1.0, low_open=True, high_open=True)
    if errors == n:
        return 1.0
    j = np.arange(errors + 1, dtype=np.float64)
    log_comb = np.concatenate([[0.0], np.cumsum(np.log((n - j[1:] + 1) / j[1:]))])  # log C(n, j)
    lo, hi, log_delta = 0.0, 1.0, math.log(delta)  # P(Bin <= e) is 1 at r = 0 and 0 at r = 1 (e < n)
    for _ in range(45):
        mid = 0.5 * (lo + hi)
        if _log_binom_cdf(log_comb, j, n, mid) >= log_delta:
            lo = mid
        else:
            hi = mid
    return lo


class RiskControlledThreshold(NamedTuple):
    """``tau`` (answer when ``p_error <= tau``; -1.0 when nothing can be answered), the calibration
    ``coverage`` and selective ``risk`` at ``tau``, its ``bound`` :math:`B^*` (level ``delta / n_tested``),
    and ``n_tested``, the number of thresholds the search tested."""

    tau: float
    coverage: float
    risk: float
    bound: float
    n_tested: int


def risk_controlled_threshold(p_error, error, target_risk: float, delta: float) -> RiskControlledThreshold:
    r"""SGR (Geifman and El-Yaniv 2017): the threshold :math:`\tau_e` with the largest calibration coverage whose
    selective risk bound :math:`B^*(\hat e(\tau),\hat m(\tau),\delta/k)` is below ``target_risk`` :math:`r^*`.

    ``p_error`` ``(m,)``: :math:`P(error\mid x)` of the calibration inputs (any real score, larger = less
    sure); ``error`` ``(m,)``: 1 where the answer was wrong, else 0. :math:`\hat m(\tau)` inputs have
    ``p_error <= tau`` and :math:`\hat e(\tau)` of them are wrong. Binary search over the sorted scores tests
    at most :math:`k=\lceil\log_2(m+1)\rceil` thresholds, each bounded at level :math:`\delta/k`, so that
    with probability :math:`\ge1-\delta` all the bounds hold at once and the returned threshold's true
    selective risk is at most ``bound`` :math:`< r^*` (Geifman and El-Yaniv's Theorem 1).

    >>> res = risk_controlled_threshold(torch.tensor([0.1, 0.2, 0.9]), torch.tensor([0.0, 0.0, 1.0]), 0.5, 0.1)
    >>> res.tau, res.n_tested  # three answers are too few for any guarantee
    (-1.0, 2)
    """
    p_error, error = as_tensor(p_error, "p_error"), as_tensor(error, "error")
    check_dim(p_error, "p_error", "(m,)", min_dim=1, max_dim=1)
    check_same_shape(p_error, error, "p_error", "error")
    check_nonempty(p_error, "p_error")
    check_finite(p_error, "p_error")
    e = error.double()
    if not bool(((e == 0) | (e == 1)).all()):
        raise ValueError("error must hold 0/1 labels (1: the answer was wrong)")
    r_star = check_range(target_risk, "target_risk", 0.0, 1.0, low_open=True, high_open=True)
    delta = check_range(delta, "delta", 0.0, 1.0, low_open=True, high_open=True)
    order = p_error.double().argsort(stable=True)
    p, cum_err = p_error.double()[order], e[order].cumsum(0)
    m = p.shape[0]
    k = math.ceil(math.log2(m + 1))
    best = (-1.0, 0.0, 0.0, 0.0)
    lo, hi, tested = 0, m + 1, 0  # z = lo passes (z = 0: answer nothing); z = hi is taken to fail
    while hi - lo > 1:
        z = (lo + hi) // 2
        tau = p[z - 1].item()
        n_acc = int(torch.searchsorted(p, torch.tensor([tau], dtype=torch.float64), right=True).item())  # ties in
        n_err = int(round(cum_err[n_acc - 1].item()))
        bound = binomial_upper_bound(n_err, n_acc, delta / k)
        tested += 1
        if bound < r_star:
            lo, best = z, (tau, n_acc / m, n_err / n_acc, bound)
        else:
            hi = z
    return RiskControlledThreshold(*best, tested)
