"""The parallel scans and Mamba-2's SSD against brute-force closed forms and the selective scan's loop."""

import math

import numpy as np
import pytest
import torch

from llmbook.lm.scan import associative_scan, scan_combine, scan_sequential, ssd, ssd_mask
from llmbook.lm.ssm import selective_scan


def closed_form(a, b):
    """h_t = sum_{s <= t} (prod_{r=s+1}^{t} a_r) b_s, by enumeration in float64 NumPy."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    h = np.zeros_like(b)
    for t in range(b.shape[1]):
        for s in range(t + 1):
            h[:, t] += np.prod(a[:, s + 1:t + 1], axis=1) * b[:, s]
    return h


def draws(T, shape=(3,), seed=0):
    g = torch.Generator().manual_seed(seed)
    a = torch.rand(2, T, *shape, generator=g, dtype=torch.float64) * 1.2 - 0.1  # some negative, some > 1
    b = torch.randn(2, T, *shape, generator=g, dtype=torch.float64)
    return a, b


def test_combine_is_associative_and_composes_steps():
    """(p ∘ q) ∘ r = p ∘ (q ∘ r), and a pair applied to h is a h + b (checked on numbers)."""
    g = torch.Generator().manual_seed(1)
    p, q, r = ((torch.randn(5, generator=g, dtype=torch.float64), torch.randn(5, generator=g, dtype=torch.float64))
               for _ in range(3))
    left, right = scan_combine(scan_combine(p, q), r), scan_combine(p, scan_combine(q, r))
    for x, y in zip(left, right, strict=True):
        torch.testing.assert_close(x, y, rtol=0, atol=1e-12)
    h = torch.randn(5, generator=g, dtype=torch.float64)
    a, b = scan_combine(p, q)
    torch.testing.assert_close(a * h + b, q[0] * (p[0] * h + p[1]) + q[1], rtol=0, atol=1e-12)


@pytest.mark.parametrize("T", [1, 2, 3, 5, 8, 13, 32])
@pytest.mark.parametrize("method", ["hillis_steele", "blelloch", "sequential"])
def test_scans_match_the_closed_form(T, method):
    a, b = draws(T)
    h = scan_sequential(a, b) if method == "sequential" else associative_scan(a, b, method)
    np.testing.assert_allclose(h.numpy(), closed_form(a.numpy(), b.numpy()), rtol=0, atol=1e-12)


def test_scan_on_trailing_dims_and_rounds():
    a, b = draws(20, shape=(4, 3), seed=2)
    ref = closed_form(a.numpy(), b.numpy())
    h_hs, r_hs = associative_scan(a, b, "hillis_steele", return_rounds=True)
    h_bl, r_bl = associative_scan(a, b, "blelloch", return_rounds=True)
    np.testing.assert_allclose(h_hs.numpy(), ref, atol=1e-12)
    np.testing.assert_allclose(h_bl.numpy(), ref, atol=1e-12)
    assert r_hs == math.ceil(math.log2(20)) == 5 and r_bl == 2 * 5  # up-sweep and down-sweep over 32


def test_scan_bad_input():
    with pytest.raises(ValueError, match="method"):
        associative_scan(torch.ones(1, 3), torch.ones(1, 3), "bogus")
    with pytest.raises(ValueError, match="b must have shape"):
        associative_scan(torch.ones(1, 3), torch.ones(1, 4))
    with pytest.raises(ValueError, match=r"\(B, T, \.\.\.\)"):
        scan_sequential(torch.ones(3), torch.ones(3))


def test_ssd_mask_against_products():
    g = torch.Generator().manual_seed(3)
    a = torch.rand(2, 7, generator=g, dtype=torch.float64) * 0.9 + 0.1
    L = ssd_mask(a).numpy()
    an = a.numpy()
    ref = np.zeros((2, 7, 7))
    for t in range(7):
        for s in range(t + 1):
            ref[:, t, s] = np.prod(an[:, s + 1:t + 1], axis=1)
    np.testing.assert_allclose(L, ref, rtol=1e-12, atol=0)
    with pytest.raises(ValueError, match=r"\(0, 1\]"):
        ssd_mask(torch.tensor([[0.5, 0.0]]))


def test_ssd_against_the_state_recurrence_and_the_selective_scan():
    """y = (L ∘ C Bᵀ) x equals the (N, P) state recurrence, and Mamba's selective scan with a scalar A."""
    g = torch.Generator().manual_seed(4)
    Bsz, T, P, N = 2, 9, 3, 4
    x = torch.randn(Bsz, T, P, generator=g, dtype=torch.float64)
    delta = torch.rand(Bsz, T, generator=g, dtype=torch.float64) + 0.05
    a = torch.exp(-delta)  # A = -1
    B = torch.randn(Bsz, T, N, generator=g, dtype=torch.float64)
    C = torch.randn(Bsz, T, N, generator=g, dtype=torch.float64)
    y = ssd(x, a, B, C)
    xn, an, Bn, Cn = x.numpy(), a.numpy(), B.numpy(), C.numpy()
    ref = np.zeros((Bsz, T, P))
    for i in range(Bsz):
        h = np.zeros((N, P))
        for t in range(T):
            h = an[i, t] * h + np.outer(Bn[i, t], xn[i, t])
            ref[i, t] = Cn[i, t] @ h
    np.testing.assert_allclose(y.numpy(), ref, rtol=0, atol=1e-12)
    # Mamba's selective scan with every state decaying at the same rate: x_t / delta_t undoes its delta_t B_t
    y_mamba = selective_scan(x / delta[..., None], delta[..., None].expand(Bsz, T, P), -torch.ones(P, N,
                             dtype=torch.float64), B, C)
    torch.testing.assert_close(y, y_mamba, rtol=0, atol=1e-12)
    with pytest.raises(ValueError, match="a must have shape"):
        ssd(x, a[:, :-1], B, C)
