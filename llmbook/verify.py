"""Printed checks for the chapters: one line saying what matched what, how closely, and to which tolerance.

The line shows the measured difference rounded to one significant digit (``3e-07``), beside the
tolerance, so the reader sees the real error; a failed check raises, so a broken chapter cannot build.

The measured difference is rounding noise whose last digits depend on the CPU (Intel or AMD, AVX2
or AVX-512, MKL's code path): nbval's sanitize file (``tests/nbval_sanitize.cfg``) replaces the
number after ``max abs diff`` before it compares a notebook's outputs, so the stored page keeps the
recording machine's value and a reader's machine is held to the tolerance, which is what the check
promises. The tolerance is printed as it is used, rounded to two significant digits (a tolerance
computed from a standard error would otherwise print digits that differ from machine to machine).
"""

from __future__ import annotations

import numpy as np
import torch

__all__ = ["check_close", "check_claim", "below_or"]

#: A list while the perturbation audit (llmbook.audit) runs a section, else None. Each check then appends
#: ``(what, passed)`` and prints its verdict instead of raising, so one run sees every check of a section.
AUDIT_RECORD: list | None = None


def _np(x) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        return x.detach().cpu().to(torch.float64).numpy()
    return np.asarray(x, dtype=np.float64)


def _two_digits(x: float) -> float:
    """``x`` rounded to two significant digits: ``0.00531294`` -> ``0.0053``, ``1e-06`` stays ``1e-06``."""
    return float(f"{x:.1e}")


def _one_digit(d: float) -> str:
    """A non-negative difference rounded to one significant digit: ``0``, ``3e-07``, ``0.02``, ``4``."""
    return "0" if d == 0 else f"{float(f'{d:.0e}'):g}"


def _fail(name: str, message: str) -> None:
    """A failed check: raise, or under the audit record it and print ``✗ message``."""
    if AUDIT_RECORD is None:
        raise AssertionError(message)
    AUDIT_RECORD.append((name, False))
    print(f"✗ {message}")


def check_close(what: str, ours, reference, *, atol: float = 1e-6, rtol: float = 0.0) -> None:
    """Print ``✓ matches <what> (max abs diff <d>, tolerance <tol>)`` or raise ``AssertionError``.

    ``d`` is the largest absolute difference, rounded to one significant digit; infinities of the same
    sign count as equal. ``atol`` and ``rtol`` are rounded to two significant digits before they are
    used, so the printed tolerance is exactly the one applied.

    >>> check_close("0.1 in float64", torch.tensor([0.1]), np.array([0.1]))  # float32's rounding of 0.1
    ✓ matches 0.1 in float64 (max abs diff 1e-09, tolerance 1e-06)
    >>> check_close("itself", torch.ones(2), torch.ones(2), atol=0)
    ✓ matches itself (exactly equal)
    >>> check_close("a Monte Carlo mean (4 standard errors)", 0.9372, 0.9375, atol=4 * 0.001328235)
    ✓ matches a Monte Carlo mean (4 standard errors) (max abs diff 0.0003, tolerance 0.0053)
    """
    atol, rtol = _two_digits(atol), _two_digits(rtol)
    a, b = _np(ours), _np(reference)
    if a.shape != b.shape:
        return _fail(f"matches {what}", f"shape {a.shape} differs from the reference {what} shape {b.shape}")
    same_inf = np.isinf(a) & np.isinf(b) & (np.sign(a) == np.sign(b))
    finite_a, finite_b = np.where(same_inf, 0.0, a), np.where(same_inf, 0.0, b)  # -inf == -inf counts as equal
    diff = np.abs(finite_a - finite_b)
    bound = atol + rtol * np.abs(finite_b)
    worst = float(np.nanmax(diff)) if diff.size else 0.0
    if np.isnan(diff).any() or not np.all(diff <= bound):
        return _fail(f"matches {what}",
                     f"differs from {what}: max abs diff {worst:.3g} > tolerance (atol {atol:g}, rtol {rtol:g})")
    if AUDIT_RECORD is not None:
        AUDIT_RECORD.append((f"matches {what}", True))
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
        return _fail(f"{claim} holds", f"{claim} does not hold: {evidence}")
    if AUDIT_RECORD is not None:
        AUDIT_RECORD.append((f"{claim} holds", True))
    print(f"✓ {claim} holds: {evidence}")


def below_or(x: float, floor: float, spec: str = ".1e") -> str:
    """``x`` formatted with ``spec``, or ``< floor`` when ``|x|`` is below ``floor``.

    For a printed quantity that is rounding noise on one side of a comparison and a real number on the
    other (how far LayerNorm's output moves when its input is shifted: 1e-15 against 3.8). The digits of
    the noise depend on the CPU, so the page states the bound it is under; the real values keep theirs.

    >>> below_or(8.9e-16, 1e-12), below_or(3.8, 1e-12), below_or(-2e-17, 1e-12, ".4f")
    ('< 1e-12', '3.8e+00', '< 1e-12')
    """
    return f"< {floor:g}" if abs(x) < floor else format(x, spec)
