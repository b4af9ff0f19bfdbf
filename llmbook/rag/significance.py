r"""Verdicts with their uncertainty: a paired comparison of two runs, and an interval for a success rate.

Chapter 26 teaches why "system A scores 0.02 higher" means nothing on its own: the same questions (or tasks)
scored by two systems are *paired*, and the question is whether the mean difference could be luck.
:func:`compare` answers with three numbers, the mean difference :math:`\bar d = \frac1n\sum_i (a_i - b_i)`, a
paired bootstrap percentile interval for it (resample the :math:`n` items with replacement), and a two-sided
paired permutation p-value (flip the sign of each :math:`d_i` at random: under the null hypothesis that the
systems are exchangeable, every sign pattern is equally likely):

.. math:: p = \frac{1 + \#\{\,|\bar d^{(s)}| \ge |\bar d|\,\}}{1 + S}

over :math:`S` random sign patterns (the :math:`+1` keeps a Monte-Carlo p-value valid). :func:`rate_interval`
gives Wilson's score interval for a proportion, such as a success rate on :math:`n` held-out tasks. Every
"better", "worse" or "helps" in the book comes from these. Registers no equation.

>>> c = compare([1, 1, 1, 0, 1, 1, 1, 1], [0, 1, 0, 0, 1, 0, 1, 0])
>>> round(c.diff, 3), c.n
(0.5, 8)
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from scipy.special import ndtri

from llmbook._checks import check_positive_int, check_range

__all__ = ["Comparison", "compare", "rate_interval"]


@dataclass(frozen=True)
class Comparison:
    """A paired comparison: mean difference ``diff``, its interval ``[low, high]``, p-value ``p``, ``n`` items."""

    diff: float
    low: float
    high: float
    p: float
    n: int
    confidence: float = 0.95

    @property
    def verdict(self) -> str:
        """``"better"`` / ``"worse"`` if the interval excludes 0 and p < 1 - confidence, else no difference shown."""
        alpha = 1 - self.confidence
        if self.p < alpha and (self.low > 0 or self.high < 0):
            return "better" if self.diff > 0 else "worse"
        return "no difference shown"

    def __str__(self) -> str:
        return (f"{self.diff:+.3f} [{self.low:+.3f}, {self.high:+.3f}] ({self.confidence:.0%} paired bootstrap), "
                f"permutation p = {self.p:.3g}, n = {self.n}: {self.verdict}")


def _paired(a, b) -> np.ndarray:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    if a.ndim != 1 or a.shape != b.shape:
        raise ValueError(f"a and b must be 1-D per-item scores of one length (paired), got shapes {a.shape} and "
                         f"{b.shape}")
    if a.size < 2:
        raise ValueError(f"a paired comparison needs at least 2 items, got {a.size}")
    if not (np.isfinite(a).all() and np.isfinite(b).all()):
        raise ValueError("a and b must be finite")
    return a - b


def compare(a, b, *, confidence: float = 0.95, n_boot: int = 10_000, n_perm: int = 10_000,
            seed: int = 0) -> Comparison:
    """Paired comparison of per-item scores ``a`` and ``b`` (``a - b``): bootstrap interval and permutation p.

    ``a[i]`` and ``b[i]`` score the same item (question, task). ``n_boot`` bootstrap resamples give the
    percentile interval at ``confidence``; ``n_perm`` random sign flips the two-sided p-value. Seeded:
    the same inputs give the same numbers.
    """
    d = _paired(a, b)
    confidence = check_range(confidence, "confidence", 0.0, 1.0, low_open=True, high_open=True)
    n_boot, n_perm = check_positive_int(n_boot, "n_boot"), check_positive_int(n_perm, "n_perm")
    rng = np.random.default_rng(seed)
    n = d.size
    boot = d[rng.integers(0, n, size=(n_boot, n))].mean(axis=1)
    lo, hi = np.quantile(boot, [(1 - confidence) / 2, (1 + confidence) / 2])
    signs = rng.choice(np.array([-1.0, 1.0]), size=(n_perm, n))
    null = np.abs((signs * d).mean(axis=1))
    observed = abs(d.mean())
    p = (1 + np.count_nonzero(null >= observed - 1e-12 * max(1.0, observed))) / (1 + n_perm)
    return Comparison(float(d.mean()), float(lo), float(hi), float(p), n, confidence)


def rate_interval(successes, n: int | None = None, confidence: float = 0.95) -> tuple[float, float, float]:
    r"""A success rate and Wilson's score interval: ``(rate, low, high)``.

    ``successes`` is a count (then give ``n``) or a sequence of 0/1 outcomes. With :math:`\hat p = k/n` and
    :math:`z` the normal quantile,

    .. math:: \frac{\hat p + z^2/2n \pm z\sqrt{\hat p(1-\hat p)/n + z^2/4n^2}}{1 + z^2/n}

    which stays inside [0, 1] and is sensible at 0 or n successes, unlike the normal approximation.

    >>> [round(x, 3) for x in rate_interval(8, 10)]
    [0.8, 0.49, 0.943]
    """
    if n is None:
        x = np.asarray(successes, dtype=np.float64)
        if x.ndim != 1 or x.size == 0 or not np.isin(x, (0.0, 1.0)).all():
            raise ValueError("successes must be a count with n, or a non-empty sequence of 0/1 outcomes")
        k, n = float(x.sum()), x.size
    else:
        n = check_positive_int(n, "n")
        k = float(successes)
        if not 0 <= k <= n:
            raise ValueError(f"successes ({successes}) must lie in [0, n = {n}]")
    confidence = check_range(confidence, "confidence", 0.0, 1.0, low_open=True, high_open=True)
    z = float(ndtri((1 + confidence) / 2))
    p = k / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return p, max(0.0, centre - half), min(1.0, centre + half)
