"""Chapter 2, initialisation (ids 02.10-02.11) against torch.nn.init and the target distributions.

Oracles: ``torch.nn.init`` fed the same seeded generator must give the *same* tensor (``atol = 0``);
``nn.init.calculate_gain`` the same gains (``rel 1e-12``); a Kolmogorov-Smirnov test
(``scipy.stats.kstest``, p-value > 1e-3) against the exact uniform / normal target; the sample
variance within 3 % of the theoretical ``2 / (n_in + n_out)`` or ``2 / n_in``.
"""

import math

import pytest
import scipy.stats
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from llmbook.lm.init import (
    activation_second_moments,
    fans,
    gain,
    he_normal_,
    he_std,
    he_uniform_,
    xavier_bound,
    xavier_normal_,
    xavier_uniform_,
)

SHAPES = [(64, 32), (30, 200), (16, 8, 3, 3), (12, 4, 5)]


def gen(seed=0):
    return torch.Generator().manual_seed(seed)


def test_fans_and_gains_match_torch():
    for shape in SHAPES:
        assert fans(torch.empty(shape)) == nn.init._calculate_fan_in_and_fan_out(torch.empty(shape))
    for name in ["linear", "sigmoid", "tanh", "relu", "selu"]:
        assert gain(name) == pytest.approx(nn.init.calculate_gain(name), rel=1e-12)
    for a in [0.0, 0.01, 0.2]:
        assert gain("leaky_relu", a) == pytest.approx(nn.init.calculate_gain("leaky_relu", a), rel=1e-12)


@pytest.mark.equation("02.10", oracle="torch.nn.init.xavier_uniform_ (same generator); scipy.stats.kstest vs U[-a, a]")
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("g", [1.0, 5.0 / 3])
def test_xavier_uniform(shape, g):
    W = xavier_uniform_(torch.empty(shape), gain=g, generator=gen(1))
    assert torch.equal(W, nn.init.xavier_uniform_(torch.empty(shape), gain=g, generator=gen(1)))
    n_in, n_out = fans(W)
    a = g * math.sqrt(6 / (n_in + n_out))
    assert W.abs().max() <= a
    assert scipy.stats.kstest(W.flatten().double().numpy(), "uniform", args=(-a, 2 * a)).pvalue > 1e-3
    var_theory = g**2 * 2 / (n_in + n_out)
    assert W.double().var().item() == pytest.approx(var_theory, rel=0.1 if W.numel() < 5000 else 0.03)


@pytest.mark.equation("02.10", oracle="torch.nn.init.xavier_normal_ (same generator); scipy.stats.kstest vs normal")
def test_xavier_normal():
    W = xavier_normal_(torch.empty(300, 100), generator=gen(2))
    assert torch.equal(W, nn.init.xavier_normal_(torch.empty(300, 100), generator=gen(2)))
    std = math.sqrt(2 / 400)
    assert scipy.stats.kstest(W.flatten().double().numpy(), "norm", args=(0, std)).pvalue > 1e-3
    assert W.double().var().item() == pytest.approx(std**2, rel=0.03)


@pytest.mark.equation("02.11", oracle="torch.nn.init.kaiming_normal_ (same generator); scipy.stats.kstest vs normal")
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("mode", ["fan_in", "fan_out"])
def test_he_normal(shape, mode):
    W = he_normal_(torch.empty(shape), mode=mode, generator=gen(3))
    assert torch.equal(W, nn.init.kaiming_normal_(torch.empty(shape), mode=mode, nonlinearity="relu", generator=gen(3)))
    n = fans(W)[0 if mode == "fan_in" else 1]
    std = math.sqrt(2 / n)
    assert scipy.stats.kstest(W.flatten().double().numpy(), "norm", args=(0, std)).pvalue > 1e-3
    assert W.double().var().item() == pytest.approx(std**2, rel=0.1 if W.numel() < 5000 else 0.03)


@pytest.mark.equation("02.11", oracle="torch.nn.init.kaiming_normal_/kaiming_uniform_ for leaky_relu and tanh")
@pytest.mark.parametrize("nonlinearity, a", [("leaky_relu", 0.2), ("tanh", 0.0), ("linear", 0.0)])
def test_he_other_nonlinearities(nonlinearity, a):
    W = he_normal_(torch.empty(50, 40), nonlinearity=nonlinearity, a=a, generator=gen(4))
    ref = nn.init.kaiming_normal_(torch.empty(50, 40), a=a, nonlinearity=nonlinearity, generator=gen(4))
    assert torch.equal(W, ref)
    U = he_uniform_(torch.empty(50, 40), nonlinearity=nonlinearity, a=a, generator=gen(5))
    ref = nn.init.kaiming_uniform_(torch.empty(50, 40), a=a, nonlinearity=nonlinearity, generator=gen(5))
    torch.testing.assert_close(U, ref, rtol=1e-6, atol=0)  # bound sqrt(3) * gain / sqrt(n): last-bit rounding


@pytest.mark.equation("02.10", "02.11", oracle="closed forms Var(U[-a,a]) = a^2/3 and sqrt(2/n)")
@settings(max_examples=100, deadline=None, derandomize=True)
@given(st.integers(1, 5000), st.integers(1, 5000))
def test_bounds_closed_form(n_in, n_out):
    a = xavier_bound(n_in, n_out)
    assert a**2 / 3 == pytest.approx(2 / (n_in + n_out), rel=1e-12)
    assert he_std(n_in) == pytest.approx(math.sqrt(2 / n_in), rel=1e-12)


def test_signal_propagation_through_depth():
    """He keeps the ReLU signal's scale over 20 layers; Xavier halves it per layer (2^-l), as theory says."""
    he = activation_second_moments("he", L=20, d=128, N=256, generator=gen(6))
    xa = activation_second_moments("xavier", L=20, d=128, N=256, generator=gen(6))
    assert all(0.4 < v < 2.5 for v in he)
    slope = (math.log(xa[-1]) - math.log(xa[4])) / 15
    assert slope == pytest.approx(math.log(0.5), abs=0.15)  # geometric decay, about 2x per layer


def test_init_rejects_bad_input():
    with pytest.raises(ValueError, match="at least 2 dims"):
        xavier_uniform_(torch.empty(5))
    with pytest.raises(ValueError, match="mode must be 'fan_in'"):
        he_normal_(torch.empty(3, 3), mode="fan")
    with pytest.raises(ValueError, match="nonlinearity must be one of"):
        he_normal_(torch.empty(3, 3), nonlinearity="softsign")
    with pytest.raises(ValueError, match=r"gain must lie in \(0.0, inf\), got -1.0"):
        xavier_uniform_(torch.empty(3, 3), gain=-1.0)
    with pytest.raises(ValueError, match="init must be"):
        activation_second_moments("zeros")


def test_gain_and_fans_reject_infinity_and_other_kinds():
    w = torch.empty(4, 3)
    # issue 11: xavier_uniform_(gain=inf) failed deep inside torch
    with pytest.raises(ValueError, match=r"gain must lie in \(0.0, inf\), got inf"):
        xavier_uniform_(w, gain=float("inf"))
    with pytest.raises(ValueError, match=r"gain must be a real number, got nan"):
        xavier_normal_(w, gain=float("nan"))
    with pytest.raises(TypeError, match=r"gain must be a real number, got '1' \(str\)"):
        xavier_uniform_(w, gain="1")
    with pytest.raises(TypeError, match=r"n_in must be a positive int, got 4.0 \(float\)"):
        xavier_bound(4.0, 3)
    with pytest.raises(TypeError, match=r"n \(the fan\) must be a positive int, got True \(bool\)"):
        he_std(True)


@pytest.mark.parametrize("init", [xavier_uniform_, xavier_normal_, he_normal_, he_uniform_])
@pytest.mark.parametrize("dtype", [torch.int64, torch.bool])
def test_initialisers_reject_non_floating_weights(init, dtype):
    """Issue 11: an int or bool W reached W.normal_ / W.uniform_ (NotImplementedError from torch)."""
    with pytest.raises(TypeError, match=rf"W must be a real floating-point tensor, got dtype {dtype}"):
        init(torch.zeros(3, 4, dtype=dtype))
