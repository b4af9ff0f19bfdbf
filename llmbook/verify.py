"""Printed checks for the chapters: one line saying what matched what, how closely, and to which tolerance.

The line shows the measured difference rounded to one significant digit (``3e-07``), beside the
tolerance, so the reader sees the real error while the output stays stable from run to run (nbval
compares it strictly, and the notebooks are recorded on one pinned CPU build); a failed check
raises, so a broken chapter cannot build.
"""

from __future__ import annotations

import numpy as np
import torch

__all__ = ["check_close", "check_claim"]


def _np(x) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        return x.detach().cpu().to(torch.float64).numpy()
    return np.asarray(x, dtype=np.float64)


def _one_digit(d: float) -> str:
    """A non-negative difference rounded to one significant digit: ``0``, ``3e-07``, ``0.02``, ``4``."""
    return "0" if d == 0 else f"{float(f'{d:.0e}'):g}"


def check_close(what: str, ours, reference, *, atol: float = 1e-6, rtol: float = 0.0) -> None:
    """Print ``✓ matches <what> (max abs diff <d>, tolerance <tol>)`` or raise ``AssertionError``.

    ``d`` is the largest absolute difference, rounded to one significant digit; infinities of the same
    sign count as equal.

    >>> check_close("numpy.exp", torch.tensor([1.0]).exp(), np.exp([1.0]))
    ✓ matches numpy.exp (max abs diff 8e-08, tolerance 1e-06)
    >>> check_close("itself", torch.ones(2), torch.ones(2), atol=0)
    ✓ matches itself (exactly equal)
    """
    a, b = _np(ours), _np(reference)
    if a.shape != b.shape:
        raise AssertionError(f"shape {a.shape} differs from the reference {what} shape {b.shape}")
    same_inf = np.isinf(a) & np.isinf(b) & (np.sign(a) == np.sign(b))
    finite_a, finite_b = np.where(same_inf, 0.0, a), np.where(same_inf, 0.0, b)  # -inf == -inf counts as equal
    diff = np.abs(finite_a - finite_b)
    bound = atol + rtol * np.abs(finite_b)
    worst = float(np.nanmax(diff)) if diff.size else 0.0
    if np.isnan(diff).any() or not np.all(diff <= bound):
        raise AssertionError(f"differs from {what}: max abs diff {worst:.3g} > tolerance "
                             f"(atol {atol:g}, rtol {rtol:g})")
    if atol == 0 and rtol == 0:
        print(f"✓ matches {what} (exactly equal)")
        return
    tol = f"{atol:g}" if rtol == 0 else f"atol {atol:g} + rtol {rtol:g}·|ref|"
    print(f"✓ matches {what} (max abs diff {_one_digit(worst)}, tolerance {tol})")


def check_claim(claim: str, holds: bool, evidence: str) -> None:
    """Print the verdict of a claim from ``claims.tsv`` with its evidence; raise if it fails.

    >>> check_claim("C02", 2 > 1, "two is more than one")
    ✓ C02 holds: two is more than one
    """
    if not holds:
        raise AssertionError(f"{claim} does not hold: {evidence}")
    print(f"✓ {claim} holds: {evidence}")
