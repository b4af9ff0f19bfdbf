"""The chapters' printed checks: measured difference to one digit, the tolerance, and failures that raise."""

import numpy as np
import pytest
import torch

from llmbook.verify import _one_digit, check_claim, check_close


@pytest.mark.parametrize("d, text", [(0.0, "0"), (3.2e-7, "3e-07"), (2.6e-7, "3e-07"), (0.0234, "0.02"),
                                     (4.4, "4"), (8.9e-16, "9e-16"), (1.2e-5, "1e-05")])
def test_differences_are_rounded_to_one_significant_digit(d, text):
    assert _one_digit(d) == text


def test_the_line_shows_the_measured_difference_and_the_tolerance(capsys):
    check_close("numpy", torch.tensor([1.0, 2.0], dtype=torch.float64), np.array([1.0, 2.0 + 3e-9]), atol=1e-8)
    assert capsys.readouterr().out == "✓ matches numpy (max abs diff 3e-09, tolerance 1e-08)\n"
    check_close("rel", [100.0], [100.001], atol=0, rtol=1e-4)
    assert capsys.readouterr().out == "✓ matches rel (max abs diff 0.001, tolerance atol 0 + rtol 0.0001·|ref|)\n"
    check_close("exact", [-np.inf, 1.0], [-np.inf, 1.0], atol=0)
    assert capsys.readouterr().out == "✓ matches exact (exactly equal)\n"


def test_a_failed_check_raises_with_the_numbers():
    with pytest.raises(AssertionError, match=r"max abs diff 0.1 > tolerance \(atol 0.01"):
        check_close("x", [1.0], [1.1], atol=1e-2)
    with pytest.raises(AssertionError, match="shape"):
        check_close("x", [1.0], [1.0, 2.0])
    with pytest.raises(AssertionError, match="differs"):
        check_close("x", [np.nan], [np.nan])
    with pytest.raises(AssertionError, match="C99 does not hold: evidence"):
        check_claim("C99", False, "evidence")


def test_a_computed_tolerance_is_used_and_printed_at_two_significant_digits(capsys):
    # 4 standard errors of a Monte Carlo mean: 0.0053129[2 or 4] depending on the CPU's last bits
    check_close("mc", [0.9372], [0.9375], atol=0.00531294)
    assert capsys.readouterr().out == "✓ matches mc (max abs diff 0.0003, tolerance 0.0053)\n"
    with pytest.raises(AssertionError, match="atol 0.0053"):  # the rounded tolerance is the one applied
        check_close("mc", [0.0], [0.00532], atol=0.00531294)


def _sanitize(text: str) -> str:
    """Apply tests/nbval_sanitize.cfg as nbval does (every regex, in order, on stored and fresh text)."""
    import configparser
    import re
    from pathlib import Path

    cfg = configparser.ConfigParser()
    cfg.read(Path(__file__).parent / "nbval_sanitize.cfg", encoding="utf-8")
    for section in cfg.sections():
        text = re.sub(cfg[section]["regex"], cfg[section]["replace"], text)
    return text


@pytest.mark.parametrize("stored, fresh, equal", [
    # the measured rounding error differs between CPUs: normalised
    ("✓ matches torch (max abs diff 3e-16, tolerance 1e-12)", "✓ matches torch (max abs diff 7e-16, tolerance 1e-12)",
     True),
    ("✓ matches x (max abs diff 0, tolerance 1e-06)", "✓ matches x (max abs diff 2e-08, tolerance 1e-06)", True),
    ("(max abs diff 0.0003, tolerance 0.0053)", "(max abs diff 0.0004, tolerance 0.0053)", True),
    # everything else is still compared: the tolerance, the claim, any result the text reports
    ("(max abs diff 3e-16, tolerance 1e-12)", "(max abs diff 3e-16, tolerance 1e-10)", False),
    ("✓ matches torch (max abs diff 3e-16, tolerance 1e-12)", "✓ matches numpy (max abs diff 3e-16, tolerance 1e-12)",
     False),
    ("held-out 2.328 nats per character", "held-out 2.327 nats per character", False),
    ("median relative error 2e-08", "median relative error 3e-08", False),
])
def test_nbval_normalises_only_the_measured_difference_of_a_check(stored, fresh, equal):
    assert (_sanitize(stored) == _sanitize(fresh)) is equal


@pytest.mark.parametrize("stored, fresh, equal", [
    ("(+2.36, -0.00, +0.18)", "(+2.36, +0.00, +0.18)", True),
    ("value = -0.0000", "value = 0.0000", True),
    ("silu(±1000) = [-0.0, 1000.0]", "silu(±1000) = [0.0, 1000.0]", True),
    ("(+2.36, -0.01, +0.18)", "(+2.36, +0.01, +0.18)", False),
    ("value = -0.0001", "value = 0.0001", False),
    ("x-0.0", "x+0.0", False),  # not a number on its own
    ("1e-05", "1e+05", False),
])
def test_nbval_normalises_the_sign_of_a_rounded_zero_only(stored, fresh, equal):
    assert (_sanitize(stored) == _sanitize(fresh)) is equal
