"""Muon and its Newton–Schulz iteration (chapter 8) against an SVD oracle and ``torch.optim.Muon``.

Tolerances, stated once:

* the cubic Newton–Schulz iteration, 40 steps in float64, against ``U V^T`` from ``torch.linalg.svd``:
  ``atol = 1e-10``;
* the quintic iteration (Muon's) against the SVD-built ``U p^(k)(S / ||G||_F) V^T``, where ``p`` is the
  scalar polynomial iterated on the singular values in numpy: ``atol = 1e-10`` (float64);
* one Muon step against ``U V^T`` (an SVD) in float64: ``atol = 1e-10``; several steps against
  ``torch.optim.Muon``, whose iteration runs in bf16 (8 significant bits): ``atol = 0.05 lr`` per step taken.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from llmbook.lm.muon import CUBIC, QUINTIC, Muon, newton_schulz


def gen(seed):
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("shape", [(8, 8), (6, 10), (12, 5)])
def test_cubic_newton_schulz_converges_to_the_svd_polar_factor(shape):
    G = torch.randn(*shape, generator=gen(0), dtype=torch.float64)
    U, S, Vh = torch.linalg.svd(G, full_matrices=False)
    # a condition number of at most ~30 here; 40 cubic steps bring sigma_min / ||G||_F to 1
    assert (S[-1] / S.norm()).item() > 1e-2
    torch.testing.assert_close(newton_schulz(G, steps=40, coefficients=CUBIC), U @ Vh, rtol=0, atol=1e-10)


@pytest.mark.parametrize("shape", [(16, 16), (8, 24), (30, 10)])
def test_quintic_newton_schulz_maps_singular_values_by_the_iterated_polynomial(shape):
    G = torch.randn(*shape, generator=gen(1), dtype=torch.float64)
    U, S, Vh = torch.linalg.svd(G, full_matrices=False)
    sigma = S.numpy() / (np.linalg.norm(G.numpy()) + 1e-7)
    a, b, c = QUINTIC
    for _ in range(5):
        sigma = a * sigma + b * sigma**3 + c * sigma**5
    oracle = U @ torch.diag(torch.from_numpy(sigma)) @ Vh
    X = newton_schulz(G)
    torch.testing.assert_close(X, oracle, rtol=0, atol=1e-10)
    s_X = torch.linalg.svdvals(X)
    assert 0.6 < s_X.min().item() and s_X.max().item() < 1.25  # "roughly orthogonal", not exactly


def test_newton_schulz_rejects_bad_input():
    with pytest.raises(ValueError, match="matrix"):
        newton_schulz(torch.ones(2, 3, 4))
    with pytest.raises(ValueError, match="coefficients"):
        newton_schulz(torch.ones(2, 2), coefficients=(1.0, 2.0))
    with pytest.raises(ValueError):
        newton_schulz(torch.ones(2, 2), steps=0)
    with pytest.raises(ValueError):
        newton_schulz(torch.tensor([[1.0, float("nan")]]))


def test_one_muon_step_is_the_scaled_polar_factor():
    """Oracle: theta (1 - lr wd) - lr sqrt(max(1, m/n)) U V^T, with U, V from torch.linalg.svd."""
    for shape in ((6, 4), (4, 6)):
        theta0 = torch.randn(*shape, generator=gen(2), dtype=torch.float64)
        g = torch.randn(*shape, generator=gen(3), dtype=torch.float64)
        W = torch.nn.Parameter(theta0.clone())
        W.grad = g.clone()
        Muon([W], lr=0.05, weight_decay=0.1, ns_steps=40, ns_coefficients=CUBIC).step()
        U, _, Vh = torch.linalg.svd(g, full_matrices=False)
        expected = theta0 * (1 - 0.05 * 0.1) - 0.05 * math.sqrt(max(1, shape[0] / shape[1])) * U @ Vh
        torch.testing.assert_close(W.detach(), expected, rtol=0, atol=1e-10)


@pytest.mark.parametrize("nesterov", [True, False])
def test_muon_follows_torch_optim_muon(nesterov):
    """Oracle: torch.optim.Muon (bf16 Newton–Schulz), fed the same gradients for 5 steps."""
    theta0 = torch.randn(12, 8, generator=gen(4))
    ours, ref = torch.nn.Parameter(theta0.clone()), torch.nn.Parameter(theta0.clone())
    lr = 0.02
    opts = [Muon([ours], lr=lr, nesterov=nesterov), torch.optim.Muon([ref], lr=lr, nesterov=nesterov)]
    for step in range(5):
        g = torch.randn(12, 8, generator=gen(10 + step))
        for p, opt in zip((ours, ref), opts, strict=True):
            p.grad = g.clone()
            opt.step()
        torch.testing.assert_close(ours.detach(), ref.detach(), rtol=0, atol=0.05 * lr * (step + 1))
        torch.testing.assert_close(opts[0].state[ours]["momentum_buffer"], opts[1].state[ref]["momentum_buffer"],
                                   rtol=1e-6, atol=1e-7)
    assert (ours.detach() - theta0).abs().max().item() > 5 * lr * 0.5  # the weights did move


def test_muon_rejects_non_matrices_and_bad_settings():
    with pytest.raises(ValueError, match="matrices"):
        Muon([torch.nn.Parameter(torch.zeros(3))])
    with pytest.raises(ValueError):
        Muon([torch.nn.Parameter(torch.zeros(3, 3))], momentum=1.0)
    with pytest.raises(ValueError):
        Muon([torch.nn.Parameter(torch.zeros(3, 3))], lr=-1.0)
