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
