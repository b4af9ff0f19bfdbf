"""Chapter 24, ScaNN's anisotropic loss (24.07) and score-aware PQ codes, against float64 loops and identities.

Oracles, all computed independently of the module: the loss against a per-vector float64 numpy loop that
forms r_par = (r.x / x.x) x explicitly (``rtol = 1e-12``); the ratio eta against ScaNN's published
``ComputeParallelCostMultiplier`` value 4.125 at T = 0.2, D = 100; the codes against brute force over every
single-subspace change (a coordinate-wise minimum), against PQ's codes at eta = 1, and against a brute-force
enumeration of all K^M codes (never worse than PQ's on that loss). Tolerances: float64 ``1e-12``; float32 at
magnitude 1e10 against float64 ``rtol = 1e-5``.
"""

import itertools

import numpy as np
import pytest
import torch

from llmbook.rag import ann, scann


def loss_loop(x, xt, h_par, h_perp):
    out = np.zeros(len(x))
    for n, (xn, tn) in enumerate(zip(x, xt, strict=True)):
        r = xn - tn
        xx = float(xn @ xn)
        r_par = (float(r @ xn) / xx) * xn if xx > 0 else np.zeros_like(xn)
        out[n] = h_par * float(r_par @ r_par) + h_perp * float((r - r_par) @ (r - r_par))
    return out


@pytest.mark.equation("24.07", oracle="float64 numpy loop forming r_par = (r.x / x.x) x explicitly")
def test_anisotropic_loss_against_a_float64_loop():
    rng = np.random.default_rng(0)
    x, xt = rng.normal(size=(40, 12)), rng.normal(size=(40, 12))
    x[0] = 0.0  # no direction: all of r is orthogonal
    xt[1] = 0.5 * x[1]  # r parallel to x: only h_par counts
    for h_par, h_perp in [(1.0, 1.0), (4.125, 1.0), (0.0, 2.0), (10.0, 0.0)]:
        got = scann.anisotropic_loss(torch.from_numpy(x), torch.from_numpy(xt), h_par, h_perp).numpy()
        np.testing.assert_allclose(got, loss_loop(x, xt, h_par, h_perp), rtol=1e-12, atol=1e-12)
    # h_par = h_perp = 1 is the squared reconstruction error (Pythagoras)
    np.testing.assert_allclose(scann.anisotropic_loss(torch.from_numpy(x), torch.from_numpy(xt), 1.0).numpy(),
                               ((x - xt) ** 2).sum(1), rtol=1e-12)
    # float32 far from 1: scaled before squaring, no overflow
    big = scann.anisotropic_loss(torch.from_numpy(x * 1e10).float(), torch.from_numpy(xt * 1e10).float(), 4.0)
    np.testing.assert_allclose(big.double().numpy()[1:], loss_loop(x * 1e10, xt * 1e10, 4.0, 1.0)[1:], rtol=1e-5)
    # batch dimensions broadcast like any (..., D) function
    assert scann.anisotropic_loss(torch.ones(2, 3, 4), torch.zeros(2, 3, 4), 2.0).shape == (2, 3)


def test_parallel_cost_ratio_is_scanns():
    assert scann.parallel_cost_ratio(0.2, 1.0, 100).item() == pytest.approx(4.125, rel=1e-12)
    eta = scann.parallel_cost_ratio(0.2, torch.tensor([1.0, 4.0]), 384)
    np.testing.assert_allclose(eta.numpy(), [383 * 0.04 / 0.96, 383 * 0.01 / 0.99], rtol=1e-12)
    with pytest.raises(ValueError, match="below every"):
        scann.parallel_cost_ratio(1.0, 1.0, 10)


def _problem(N=60, M=3, K=4, d=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(N, M * d, generator=g, dtype=torch.float64)
    C = torch.randn(M, K, d, generator=g, dtype=torch.float64)
    return x, C


def test_eta_one_gives_pq_codes_and_larger_eta_never_raises_the_loss():
    x, C = _problem()
    pq = ann.pq_encode(x, C)
    assert torch.equal(scann.anisotropic_pq_encode(x, C, eta=1.0), pq)
    for eta in (2.0, 5.0, 50.0):
        codes = scann.anisotropic_pq_encode(x, C, eta=eta)
        new = scann.anisotropic_loss(x, ann.pq_decode(codes, C), eta)
        old = scann.anisotropic_loss(x, ann.pq_decode(pq, C), eta)
        assert bool((new <= old + 1e-12).all()) and bool((new < old - 1e-9).any())


def test_codes_are_a_coordinate_wise_minimum_by_brute_force():
    x, C = _problem(seed=1)
    eta = torch.linspace(1.0, 20.0, 60, dtype=torch.float64)  # one ratio per vector
    codes = scann.anisotropic_pq_encode(x, C, eta=eta, rounds=50)
    M, K, _ = C.shape
    for n in range(len(x)):
        best = scann.anisotropic_loss(x[n], ann.pq_decode(codes[n:n + 1], C)[0], eta[n].item()).item()
        for m, k in itertools.product(range(M), range(K)):
            trial = codes[n:n + 1].clone()
            trial[0, m] = k
            alt = scann.anisotropic_loss(x[n], ann.pq_decode(trial, C)[0], eta[n].item()).item()
            assert alt >= best - 1e-12, (n, m, k)


def test_codes_are_no_worse_than_pq_against_the_global_minimum_by_enumeration():
    x, C = _problem(N=30, seed=2)
    M, K, _ = C.shape
    every = torch.tensor(list(itertools.product(range(K), repeat=M)))  # all K^M codes
    dec = ann.pq_decode(every, C)  # (K^M, D)
    eta = 8.0
    codes = scann.anisotropic_pq_encode(x, C, eta=eta)
    pq = ann.pq_encode(x, C)
    hits = 0
    for n in range(len(x)):
        all_losses = scann.anisotropic_loss(x[n].expand_as(dec), dec, eta)
        ours = scann.anisotropic_loss(x[n], ann.pq_decode(codes[n:n + 1], C)[0], eta)
        assert ours >= all_losses.min() - 1e-12
        assert ours <= scann.anisotropic_loss(x[n], ann.pq_decode(pq[n:n + 1], C)[0], eta) + 1e-12
        hits += bool(torch.isclose(ours, all_losses.min(), rtol=0, atol=1e-12))
    assert hits >= 0.8 * len(x)  # coordinate descent finds the global minimum for most vectors


def test_errors():
    x, C = _problem()
    with pytest.raises(ValueError, match=">= 1"):
        scann.anisotropic_pq_encode(x, C, eta=0.5)
    with pytest.raises(ValueError, match=r"\(N,\)"):
        scann.anisotropic_pq_encode(x, C, eta=torch.ones(3, dtype=torch.float64))
    with pytest.raises(ValueError, match="same shape"):
        scann.anisotropic_loss(torch.ones(2, 3), torch.ones(3, 3), 2.0)
    with pytest.raises(ValueError, match="h_par"):
        scann.anisotropic_loss(torch.ones(2, 3), torch.ones(2, 3), -1.0)
    with pytest.raises(TypeError):
        scann.anisotropic_loss("ab", torch.ones(2), 1.0)
    assert scann.anisotropic_pq_encode(torch.zeros(0, 6, dtype=torch.float64), C, 2.0).shape == (0, 3)
