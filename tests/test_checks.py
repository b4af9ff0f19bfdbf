"""The shared argument checks: the kind of a value gives TypeError, its range ValueError.

Oracle: the contracts themselves, stated as explicit accept/reject tables (no arithmetic to compare).
"""

import math

import numpy as np
import pytest
import torch

from llmbook import _checks as C


@pytest.mark.parametrize("value", [1, 7, np.int64(3), np.int32(1), torch.iinfo(torch.int64).max])
def test_positive_int_accepts_integers_including_numpy(value):
    out = C.check_positive_int(value, "n")
    assert type(out) is int and out == int(value)


@pytest.mark.parametrize("value", [True, False, np.bool_(True), 2.5, 2.0, "0.5", "3", None, 1j, torch.tensor(3)])
def test_positive_int_rejects_other_kinds_with_typeerror(value):
    with pytest.raises(TypeError, match=r"^n must be a positive int, got "):
        C.check_positive_int(value, "n")


@pytest.mark.parametrize("value", [0, -1, np.int64(-5)])
def test_positive_int_rejects_small_values_with_valueerror(value):
    with pytest.raises(ValueError, match=rf"^n must be a positive int, got {int(value)}$"):
        C.check_positive_int(value, "n")


def test_nonnegative_and_bounded_int():
    assert C.check_nonnegative_int(0, "k") == 0
    with pytest.raises(ValueError, match=r"k must be a non-negative int, got -1"):
        C.check_nonnegative_int(-1, "k")
    with pytest.raises(TypeError, match=r"k must be a non-negative int, got 0.0 \(float\)"):
        C.check_nonnegative_int(0.0, "k")
    assert C.check_int(-3, "z") == -3
    assert C.check_int(5, "k", low=0, high=5) == 5
    with pytest.raises(ValueError, match=r"k must be an int in \[0, 5\], got 6"):
        C.check_int(6, "k", low=0, high=5)
    with pytest.raises(ValueError, match=r"k must be an int <= 5, got 6"):
        C.check_int(6, "k", high=5)
    with pytest.raises(ValueError, match=r"n_buckets must be an even int >= 2, got 1"):
        C.check_int(1, "n_buckets", low=2, what="an even int >= 2")


@pytest.mark.parametrize("value", [0, 1, -2.5, np.float32(0.25), np.float64(1e300), np.int64(4)])
def test_real_accepts_real_numbers(value):
    out = C.check_real(value, "x")
    assert type(out) is float and out == float(value)


@pytest.mark.parametrize("value", [True, "0.5", None, 1j, torch.tensor(0.5), [0.5]])
def test_real_rejects_other_kinds(value):
    with pytest.raises(TypeError, match=r"^x must be a real number, got "):
        C.check_real(value, "x")


def test_real_rejects_nan_always_and_inf_when_finite():
    with pytest.raises(ValueError, match=r"x must be a real number, got nan"):
        C.check_real(math.nan, "x", finite=False)
    with pytest.raises(ValueError, match=r"x must be a finite real number, got -inf"):
        C.check_real(-math.inf, "x")
    assert C.check_real(math.inf, "x", finite=False) == math.inf


@pytest.mark.parametrize(
    "value, low, high, low_open, high_open, ok",
    [
        (0.0, 0.0, 1.0, False, False, True),
        (0.0, 0.0, 1.0, True, False, False),
        (1.0, 0.0, 1.0, False, True, False),
        (1.0, 0.0, 1.0, False, False, True),
        (1e308, 0.0, math.inf, False, False, True),
        (math.inf, 0.0, math.inf, False, False, False),  # unbounded is not "infinity allowed"
        (-math.inf, -math.inf, 0.0, False, False, False),
        (-1e-12, 0.0, 1.0, False, False, False),
    ],
)
def test_range_table(value, low, high, low_open, high_open, ok):
    if ok:
        assert C.check_range(value, "a", low, high, low_open=low_open, high_open=high_open) == value
    else:
        with pytest.raises(ValueError, match=r"^a must lie in [\[(].*[\])], got "):
            C.check_range(value, "a", low, high, low_open=low_open, high_open=high_open)


def test_range_finite_false_admits_infinity_and_kinds_are_typeerrors():
    assert C.check_range(math.inf, "a", 0.0, finite=False) == math.inf
    for bad in (True, "0.5", None, torch.tensor(0.5)):
        with pytest.raises(TypeError, match=r"a must be a real number"):
            C.check_range(bad, "a", 0.0, 1.0)
    with pytest.raises(ValueError, match=r"a must be a real number, got nan"):
        C.check_range(math.nan, "a", finite=False)


def test_unit_interval_names_the_open_end():
    assert C.check_unit_interval(1, "p") == 1
    with pytest.raises(ValueError, match=r"p must lie in \(0.0, 1.0\], got 0"):
        C.check_unit_interval(0, "p", low_open=True)
    with pytest.raises(ValueError, match=r"p must lie in \[0.0, 1.0\), got 1"):
        C.check_unit_interval(1, "p", high_open=True)


def test_divisible_and_choice():
    C.check_divisible(12, 3, "C", "G")
    with pytest.raises(ValueError, match=r"^C \(10\) must be divisible by G \(3\)$"):
        C.check_divisible(10, 3, "C", "G")
    with pytest.raises(ValueError, match=r"mode must be one of 'a', 'b', got 'c'"):
        C.check_choice("c", "mode", ("a", "b"))
    with pytest.raises(ValueError, match=r"mode must be one of 'a', got \[1\]"):
        C.check_choice([1], "mode", {"a"})


def test_as_tensor_conversions():
    assert C.as_tensor([1, 2], "x").dtype == torch.get_default_dtype()
    assert C.as_tensor(np.zeros(2, dtype=np.int32), "x", floating=False).dtype == torch.int32
    for bad in ("ab", b"ab", object()):
        with pytest.raises(TypeError, match=r"x must be a tensor or array-like"):
            C.as_tensor(bad, "x")
    for dtype in (torch.bool, torch.complex64):
        with pytest.raises(TypeError, match=r"x must be a real floating-point tensor"):
            C.as_tensor(torch.zeros(2, dtype=dtype), "x")


def test_dtype_checks():
    C.check_floating(torch.zeros(1, dtype=torch.bfloat16), "x")
    with pytest.raises(TypeError, match=r"x must be a real floating-point tensor, got dtype torch.int32"):
        C.check_floating(torch.zeros(1, dtype=torch.int32), "x")
    with pytest.raises(TypeError, match=r"x must be a tensor, got list"):
        C.check_floating([1.0], "x")
    assert C.check_integer_tensor(np.array([1, 2]), "ids").dtype == torch.int64
    for bad in (torch.zeros(2), torch.zeros(2, dtype=torch.bool), [0.5]):
        with pytest.raises(TypeError, match=r"ids must be an integer tensor"):
            C.check_integer_tensor(bad, "ids")
    C.check_same_dtype(torch.zeros(1), torch.ones(3), "a", "b")
    with pytest.raises(TypeError, match=r"a \(torch.float16\) and b \(torch.float32\) must share one dtype"):
        C.check_same_dtype(torch.zeros(1, dtype=torch.float16), torch.ones(3), "a", "b")


@pytest.mark.parametrize(
    "x_shape, target, ok",
    [
        ((3,), (2, 3), True),
        ((1, 3), (2, 3), True),
        ((), (2, 3), True),
        ((2, 3), (2, 3), True),
        ((3, 1, 3, 3), (1, 2, 3, 3), False),  # broadcasts WITH, not TO
        ((2,), (2, 3), False),
        ((1, 2, 3), (2, 3), False),
    ],
)
def test_broadcastable_to_matches_torch_broadcast_to(x_shape, target, ok):
    # oracle: torch.broadcast_to either succeeds or raises
    try:
        torch.broadcast_to(torch.zeros(x_shape), target)
        torch_ok = True
    except RuntimeError:
        torch_ok = False
    assert torch_ok == ok
    if ok:
        C.check_broadcastable_to(torch.zeros(x_shape), target, "mask", "scores")
    else:
        with pytest.raises(ValueError, match=r"mask .* must broadcast to scores"):
            C.check_broadcastable_to(torch.zeros(x_shape), target, "mask", "scores")


def test_shape_checks():
    C.check_same_shape(torch.zeros(2, 3), torch.ones(2, 3), "a", "b")
    with pytest.raises(ValueError, match=r"a \(2, 3\) and b \(3,\) must have the same shape"):
        C.check_same_shape(torch.zeros(2, 3), torch.ones(3), "a", "b")
    C.check_size(torch.zeros(2, 5), 1, 5, "w", "(N, 5)")
    with pytest.raises(ValueError, match=r"w must have shape \(N, 5\), got \(2, 4\)"):
        C.check_size(torch.zeros(2, 4), 1, 5, "w", "(N, 5)")
    with pytest.raises(ValueError, match=r"w must have shape \(N, 5\), got \(\)"):
        C.check_size(torch.tensor(5.0), -1, 5, "w", "(N, 5)")
    C.check_same_last_dim(torch.zeros(2, 4), torch.zeros(7, 4), "x", "W")
    with pytest.raises(ValueError, match=r"x \(2, 4\) and W \(3,\) disagree on d: 4 != 3"):
        C.check_same_last_dim(torch.zeros(2, 4), torch.zeros(3), "x", "W", "d")
    with pytest.raises(ValueError, match=r"must have shape \(B, T\), got \(3,\)"):
        C.check_dim(torch.zeros(3), "ids", "(B, T)", min_dim=2, max_dim=2)
    with pytest.raises(ValueError, match=r"must not be empty along dim 0"):
        C.check_nonempty(torch.zeros(0, 3), "z", dim=0)


def test_value_checks():
    C.check_finite(torch.tensor([-math.inf, 0.0]), "s", allow_neg_inf=True)
    with pytest.raises(ValueError, match=r"s contains \+inf"):
        C.check_finite(torch.tensor([math.inf]), "s", allow_neg_inf=True)
    with pytest.raises(ValueError, match=r"s contains inf"):
        C.check_finite(torch.tensor([-math.inf]), "s")
    C.check_probability(torch.tensor([[0.25, 0.75]]), "p")
    with pytest.raises(ValueError, match=r"p must be non-negative"):
        C.check_probability(torch.tensor([1.5, -0.5]), "p")


def test_check_shape_exact():
    x = torch.zeros(3)
    assert C.check_shape(x, (3,), "w") is x
    with pytest.raises(ValueError, match=r"^w must have shape \(3,\) to match C, got \(3, 1\)$"):
        C.check_shape(torch.zeros(3, 1), (3,), "w", "C")
    with pytest.raises(ValueError, match=r"^w must have shape \(3,\), got \(\)$"):
        C.check_shape(torch.tensor(1.0), (3,), "w")
    with pytest.raises(TypeError, match=r"w must be a tensor, got list"):
        C.check_shape([0.0, 0.0, 0.0], (3,), "w")


def test_tensor_checks_reject_non_tensors_with_typeerror():
    for call in (lambda: C.check_dim([1.0], "x", "(T,)"), lambda: C.check_nonempty([1.0], "x"),
                 lambda: C.check_finite([1.0], "x")):
        with pytest.raises(TypeError, match=r"x must be a tensor, got list"):
            call()


def test_module_input_checks_kind_dtype_and_width():
    lin = torch.nn.Linear(4, 2)
    x = torch.zeros(3, 4)
    assert C.check_module_input(lin, x, d=4) is x
    with pytest.raises(TypeError, match=r"^x must be a tensor, got list$"):
        C.check_module_input(lin, x.tolist())
    for dt in (torch.int64, torch.bool):
        with pytest.raises(TypeError, match=rf"^x must be a real floating-point tensor, got dtype {dt}$"):
            C.check_module_input(lin, x.to(dt))
    with pytest.raises(TypeError, match=r"^h \(torch.float64\) must have the dtype of the Linear's parameters "
                                        r"\(torch.float32\)"):
        C.check_module_input(lin, x.double(), "h")
    assert C.check_module_input(torch.nn.Linear(4, 2).double(), x.double()).dtype == torch.float64
    with pytest.raises(ValueError, match=r"^x must have shape \(B, T, d_in\) with d_in = 4, got \(3, 4\)$"):
        C.check_module_input(lin, x, d=4, symbol="d_in", ndim=3, contract="(B, T, d_in)")
    with pytest.raises(ValueError, match=r"^x must have shape \(\.\.\., d_model\) with d_model = 5, got \(3, 4\)$"):
        C.check_module_input(lin, x, d=5)
    # a module without floating state (nn.Identity) has no dtype to match; under autocast none is required
    assert C.check_module_input(torch.nn.Identity(), x.double()).dtype == torch.float64
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert C.check_module_input(lin, x.bfloat16()).dtype == torch.bfloat16
