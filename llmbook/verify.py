"""Printed checks for the chapters: one line saying what matched what, and to which tolerance.

The line names the tolerance, not the measured difference, so the output is the same on every
machine (nbval compares it strictly); a failed check raises, so a broken chapter cannot build.
"""

from __future__ import annotations

import numpy as np
import torch

__all__ = ["check_close", "check_claim"]


def _np(x) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        return x.detach().cpu().to(torch.float64).numpy()
    return np.asarray(x, dtype=np.float64)


def check_close(what: str, ours, reference, *, atol: float = 1e-6, rtol: float = 0.0) -> None:
    """Print ``matches <what> (max abs diff < atol)`` or raise ``AssertionError`` with the numbers.

    >>> check_close("numpy.exp", torch.tensor([1.0]).exp(), np.exp([1.0]))
    ✓ matches numpy.exp (max abs diff < 1e-06)
    """
    a, b = _np(ours), _np(reference)
    if a.shape != b.shape:
        raise AssertionError(f"shape {a.shape} differs from the reference {what} shape {b.shape}")
    same_inf = np.isinf(a) & np.isinf(b) & (np.sign(a) == np.sign(b))
    finite_a, finite_b = np.where(same_inf, 0.0, a), np.where(same_inf, 0.0, b)  # -inf == -inf counts as equal
    diff = np.abs(finite_a - finite_b)
    bound = atol + rtol * np.abs(finite_b)
    if np.isnan(diff).any() or not np.all(diff <= bound):
        raise AssertionError(f"differs from {what}: max abs diff {np.nanmax(diff):.3g} > tolerance")
    if atol == 0 and rtol == 0:
        tol = "exactly equal"
    elif rtol == 0:
        tol = f"max abs diff < {atol:g}"
    else:
        tol = f"within atol {atol:g}, rtol {rtol:g}"
    print(f"✓ matches {what} ({tol})")


def check_claim(claim: str, holds: bool, evidence: str) -> None:
    """Print the verdict of a claim from ``claims.tsv`` with its evidence; raise if it fails.

    >>> check_claim("C02", 2 > 1, "two is more than one")
    ✓ C02 holds: two is more than one
    """
    if not holds:
        raise AssertionError(f"{claim} does not hold: {evidence}")
    print(f"✓ {claim} holds: {evidence}")
