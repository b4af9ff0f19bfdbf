"""Chapter 5: Welford's one-pass variance and Chan's merge against numpy's float64 variance.

Tolerances, stated once:

* float64 data of moderate offset against ``numpy.var`` (float64, two-pass): ``rtol = 1e-12``;
* float32 data against ``numpy.var`` of the *same* float32 numbers in float64: Welford within ``2e-2``
  relative at offset ``1e4`` (its error grows like the condition number ``|mu|/sigma = 1e5`` times the unit
  roundoff ``6e-8``), while the shortcut ``E[x^2] - E[x]^2`` is off by 100 % or more in every row.
"""

import numpy as np
import pytest
import torch

from llmbook.lm.welford import chan_merge, chunked_variance, shortcut_variance, welford_variance

F64 = dict(rtol=1e-12, atol=1e-12)


def _data(offset, rows=16, n=512, seed=0, dtype=np.float64):
    rng = np.random.default_rng(seed)
    return (offset + 0.1 * rng.standard_normal((rows, n))).astype(dtype)


@pytest.mark.parametrize("unbiased", [False, True])
@pytest.mark.parametrize("dim", [0, 1, -1])
def test_welford_matches_numpy_float64(dim, unbiased):
    x = np.random.default_rng(1).standard_normal((6, 7)) * 3 + 2  # numpy oracle: np.var / np.mean, float64
    mean, var = welford_variance(torch.from_numpy(x), dim=dim, unbiased=unbiased)
    np.testing.assert_allclose(mean.numpy(), x.mean(axis=dim), **F64)
    np.testing.assert_allclose(var.numpy(), x.var(axis=dim, ddof=int(unbiased)), **F64)
    assert mean.dtype == var.dtype == torch.float64


def test_welford_is_stable_in_float32_where_the_shortcut_fails():
    x32 = _data(1e4, dtype=np.float32)
    truth = x32.astype(np.float64).var(axis=-1)  # the same float32 numbers, variance in float64 (~0.01)
    _, var = welford_variance(torch.from_numpy(x32))
    assert var.dtype == torch.float32
    rel_welford = np.abs(var.double().numpy() - truth) / truth
    rel_shortcut = np.abs(shortcut_variance(torch.from_numpy(x32)).double().numpy() - truth) / truth
    assert rel_welford.max() < 2e-2  # measured 6.6e-3 with seed 0
    assert rel_shortcut.min() >= 0.99  # every row wrong by 100 % (a zero) or more ...
    assert (shortcut_variance(torch.from_numpy(x32)) < 0).any()  # ... and some "variances" negative
    # in float64 at a small offset the shortcut is fine: it is the offset, not the one pass, that hurts
    x = _data(1.0)
    np.testing.assert_allclose(shortcut_variance(torch.from_numpy(x)).numpy(), x.var(axis=-1), rtol=1e-10)


@pytest.mark.parametrize("n_a", [1, 3, 100])
def test_chan_merge_of_two_parts_is_the_variance_of_the_whole(n_a):
    x = _data(50.0, rows=3, n=257, seed=2)
    a, b = x[:, :n_a], x[:, n_a:]
    n, mean, m2 = chan_merge(n_a, torch.from_numpy(a.mean(-1)), torch.from_numpy(a.var(-1) * n_a),
                             257 - n_a, torch.from_numpy(b.mean(-1)), torch.from_numpy(b.var(-1) * (257 - n_a)))
    assert n == 257
    np.testing.assert_allclose(mean.numpy(), x.mean(-1), **F64)
    np.testing.assert_allclose(m2.numpy() / n, x.var(-1), rtol=1e-10)


@pytest.mark.parametrize("n_chunks", [1, 2, 7, 64, 512])
def test_chunked_variance_matches_numpy(n_chunks):
    x = _data(3.0)
    mean, var = chunked_variance(torch.from_numpy(x), n_chunks)
    np.testing.assert_allclose(mean.numpy(), x.mean(-1), **F64)
    np.testing.assert_allclose(var.numpy(), x.var(-1), rtol=1e-11)
    _, var_u = chunked_variance(torch.from_numpy(x.T), n_chunks, dim=0, unbiased=True)
    np.testing.assert_allclose(var_u.numpy(), x.var(-1, ddof=1), rtol=1e-11)
    x32 = _data(1e4, dtype=np.float32)  # the merge keeps Welford's stability
    truth = x32.astype(np.float64).var(axis=-1)
    _, var32 = chunked_variance(torch.from_numpy(x32), n_chunks)
    assert (np.abs(var32.double().numpy() - truth) / truth).max() < 2e-2


def test_half_precision_is_computed_in_float32():
    x = torch.tensor([0.0, 400.0, 0.0, 400.0], dtype=torch.float16)  # squares overflow fp16
    mean, var = welford_variance(x)
    assert var.dtype == torch.float16 and var.item() == 40000.0 and mean.item() == 200.0


def test_bad_input_raises_clear_errors():
    with pytest.raises(ValueError, match=r"the variance over dim -1 needs at least 1 value, got 0"):
        welford_variance(torch.zeros(2, 0))
    with pytest.raises(ValueError, match=r"the unbiased variance over dim -1 needs at least 2 values, got 1"):
        welford_variance(torch.zeros(3, 1), unbiased=True)
    with pytest.raises(ValueError, match="at least one axis"):
        welford_variance(torch.tensor(1.0))
    with pytest.raises(ValueError, match=r"dim \(2\) must name an axis of x"):
        shortcut_variance(torch.zeros(2, 3), dim=2)
    with pytest.raises(TypeError, match="x must be a real floating-point tensor, got dtype torch.bool"):
        welford_variance(torch.ones(3, dtype=torch.bool))
    with pytest.raises(ValueError, match="n_chunks must be at most the length n = 3"):
        chunked_variance(torch.zeros(3), 4)
    with pytest.raises(ValueError, match="n_a must be a positive int, got 0"):
        chan_merge(0, torch.tensor(0.0), torch.tensor(0.0), 1, torch.tensor(0.0), torch.tensor(0.0))
