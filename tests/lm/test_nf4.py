"""Chapter 12: NormalFloat (NF4) and double quantisation.

Oracles: the 16 NF4 values published with QLoRA (appendix / ``bitsandbytes``' ``create_normal_map``),
``bitsandbytes``' own table and its CPU ``quantize_4bit`` / ``dequantize_4bit``, ``scipy.stats.norm.ppf``
for the quantiles, and a float64 brute-force argmin / two-stage reconstruction.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.stats import norm

from llmbook.lm.nf4 import double_dequantize, double_quantize, nf4_code, nf4_dequantize, nf4_quantize

# QLoRA (Dettmers et al. 2023), appendix E / bitsandbytes' NF4 table, as published.
NF4_PUBLISHED = [-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
                 -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
                 0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
                 0.7229568362236023, 1.0]


def _bnb():
    return pytest.importorskip("bitsandbytes.functional")


@pytest.mark.equation("12.09", oracle="the 16 NF4 values published with QLoRA (float32)")
def test_nf4_code_matches_the_published_table():
    code = nf4_code()
    assert code.dtype == torch.float64 and code.shape == (16,)
    # the published table was computed from float32 probabilities (torch.linspace): 2e-7 apart from float64
    np.testing.assert_allclose(code.numpy(), NF4_PUBLISHED, rtol=0, atol=3e-7)


@pytest.mark.equation("12.09", oracle="bitsandbytes.functional.get_4bit_type('nf4')")
def test_nf4_code_matches_bitsandbytes_table():
    F = _bnb()
    ref = F.get_4bit_type("nf4", device="cpu")
    np.testing.assert_allclose(nf4_code().numpy(), ref.double().numpy(), rtol=0, atol=3e-7)


@pytest.mark.equation("12.09", oracle="scipy.stats.norm.ppf")
@pytest.mark.parametrize("b", [2, 3, 4, 5])
def test_nf_code_is_normal_quantiles(b):
    n = 2 ** (b - 1)
    offset = 1 - 0.5 * (1 / (2 * 2**b) + 1 / (2 * (2**b - 1)))
    pos = norm.ppf(np.linspace(offset, 0.5, n + 1)[:-1])
    neg = -norm.ppf(np.linspace(offset, 0.5, n)[:-1])
    ref = np.sort(np.concatenate([neg, [0.0], pos]))
    ref = ref / np.abs(ref).max()
    np.testing.assert_allclose(nf4_code(b).numpy(), ref, rtol=0, atol=1e-12)
    assert len(nf4_code(b)) == 2**b


@pytest.mark.equation("12.09", oracle="bitsandbytes.functional.quantize_4bit / dequantize_4bit (nf4, CPU)")
@pytest.mark.parametrize("shape, block_size", [((8, 344), 64), ((3, 128), 64), ((1000,), 128)])
def test_nf4_quantize_matches_bitsandbytes(shape, block_size):
    F = _bnb()
    x = torch.randn(shape)
    packed, state = F.quantize_4bit(x, blocksize=block_size, quant_type="nf4")
    ref = F.dequantize_4bit(packed, state).reshape(shape)
    q, absmax = nf4_quantize(x, block_size)
    torch.testing.assert_close(absmax, state.absmax, rtol=0, atol=0)
    torch.testing.assert_close(nf4_dequantize(q, absmax, block_size), ref, rtol=0, atol=2e-6)


@pytest.mark.equation("12.09", oracle="numpy brute-force argmin over the code (float64)")
def test_nf4_quantize_is_nearest_code_brute_force():
    x = torch.randn(5, 100, dtype=torch.float64) * 0.02
    q, absmax = nf4_quantize(x, 50)
    code = nf4_code().numpy()  # checked against the published table above
    blocks = x.numpy().reshape(-1, 50)
    scaled = blocks / np.abs(blocks).max(1, keepdims=True)
    dist = np.abs(scaled[..., None] - code)
    best = dist.min(-1)
    ours = dist.reshape(-1, 16)[np.arange(500), q.numpy().reshape(-1)].reshape(best.shape)
    np.testing.assert_allclose(ours, best, rtol=0, atol=1e-7)  # the chosen code is a nearest one
    np.testing.assert_allclose(absmax.numpy(), np.abs(blocks).max(1), rtol=0, atol=0)


def test_nf4_spreads_normal_data_over_its_codes_and_beats_int4():
    x = torch.randn(64 * 500, generator=torch.Generator().manual_seed(1))
    q, absmax = nf4_quantize(x, 64)
    blocks = x.view(-1, 64)
    s = blocks.abs().amax(-1, keepdim=True) / 7
    q_int4 = torch.clamp(torch.round(blocks / s), -7, 7)

    def entropy(codes):
        p = torch.bincount(codes.reshape(-1).long()).double() / codes.numel()
        return float(-(p[p > 0] * p[p > 0].log2()).sum())

    assert entropy(q) > 3.85 and entropy(q_int4 + 7) < 3.55  # of 4 bits: NF4 uses its 16 codes more evenly
    err_nf4 = (nf4_dequantize(q, absmax, 64) - x).pow(2).mean()
    err_int4 = (q_int4 * s - blocks).pow(2).mean()
    assert err_nf4 < 0.8 * err_int4


def test_nf4_errors():
    with pytest.raises(ValueError, match="absmax must have shape"):
        nf4_dequantize(torch.zeros(128, dtype=torch.long), torch.ones(3), 64)
    with pytest.raises(ValueError, match=r"codes in \[0, 16\)"):
        nf4_dequantize(torch.full((64,), 16), torch.ones(1), 64)
    with pytest.raises(ValueError, match="NaN"):
        nf4_quantize(torch.tensor([1.0, float("nan")]))


# ============================================================== 12.10 double quantisation


@pytest.mark.equation("12.10", oracle="float64 two-stage reconstruction written out with numpy")
def test_double_quantisation_reconstruction_brute_force():
    x = torch.randn(64 * 600, dtype=torch.float64)
    dq = double_quantize(x, 64, 256)
    absmax = np.abs(x.numpy().reshape(-1, 64)).max(1)
    mu = absmax.mean()
    centred = np.concatenate([absmax - mu, np.zeros((-len(absmax)) % 256)]).reshape(-1, 256)
    s2 = np.abs(centred).max(1) / 127
    q_s = np.round(centred / s2[:, None])
    np.testing.assert_array_equal(dq.q_s.numpy(), q_s.reshape(-1)[:len(absmax)])
    np.testing.assert_allclose(dq.s2.numpy(), s2, rtol=1e-14)
    scales = (q_s * s2[:, None]).reshape(-1)[:len(absmax)] + mu
    ref = nf4_code().numpy()[dq.q.numpy()].reshape(-1, 64) * scales[:, None]
    np.testing.assert_allclose(double_dequantize(dq).numpy(), ref.reshape(-1), rtol=0, atol=1e-7)


def test_double_quantisation_saves_memory_and_costs_little_error():
    x = torch.randn(64 * 256 * 4, generator=torch.Generator().manual_seed(2))
    dq = double_quantize(x)
    n = x.numel()
    bits_single = (4 * n + 32 * (n // 64)) / n
    bits_double = (4 * n + 8 * dq.q_s.numel() + 32 * dq.s2.numel() + 32) / n
    assert bits_single == 4.5 and abs(bits_double - (4 + 8 / 64 + 32 / (64 * 256))) < 1e-3
    q, absmax = nf4_quantize(x)
    err_single = (nf4_dequantize(q, absmax) - x).pow(2).mean()
    err_double = (double_dequantize(dq) - x).pow(2).mean()
    assert err_single <= err_double < 1.01 * err_single
