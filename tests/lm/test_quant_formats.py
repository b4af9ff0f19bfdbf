"""Storage formats (chapter 12): group-wise grids against torch's fake quantisers, FP8 against torch's float8
casts (exhaustively over the 256 bit patterns), int4 packing against numpy's bit-level packbits."""

import numpy as np
import pytest
import torch
from torch import nn
from torch.ao.quantization import PerChannelMinMaxObserver

from llmbook.lm import quant_formats as qf


def _torch_group_fake(W, b, G, symmetric=False, scales=None, zeros=None):
    """torch.fake_quantize_per_channel_affine on each column block W[:, g*G:(g+1)*G] (its own observer)."""
    out = torch.empty_like(W)
    for k, g0 in enumerate(range(0, W.shape[1], G)):
        Wg = W[:, g0:g0 + G]
        if scales is None:
            if symmetric:
                Q = 2 ** (b - 1) - 1
                obs = PerChannelMinMaxObserver(ch_axis=0, dtype=torch.qint8, qscheme=torch.per_channel_symmetric,
                                               quant_min=-Q, quant_max=Q)
            else:
                obs = PerChannelMinMaxObserver(ch_axis=0, dtype=torch.quint8, qscheme=torch.per_channel_affine,
                                               quant_min=0, quant_max=2**b - 1)
            obs(Wg)
            s, z = obs.calculate_qparams()
        else:
            s, z = scales[:, k].float(), zeros[:, k]
        lo, hi = (-(2 ** (b - 1) - 1), 2 ** (b - 1) - 1) if symmetric else (0, 2**b - 1)
        out[:, g0:g0 + G] = torch.fake_quantize_per_channel_affine(Wg, s, z.int(), 0, lo, hi)
    return out


@pytest.mark.parametrize("d_in,G,b,symmetric", [(256, 128, 4, False), (344, 128, 4, False), (344, 128, 3, False),
                                                 (200, 64, 4, True), (130, 128, 8, False)])
def test_group_quantize_matches_torch_per_group_fake_quantiser(d_in, G, b, symmetric):
    g = torch.Generator().manual_seed(d_in + G + b)
    W = torch.randn(24, d_in, generator=g) * torch.rand(24, 1, generator=g)
    q, s, z = qf.group_quantize(W, b, G, symmetric=symmetric)
    assert q.shape == W.shape and s.shape == z.shape == (24, -(-d_in // G))
    W_hat = qf.group_dequantize(q, s, z, G)
    torch.testing.assert_close(W_hat, _torch_group_fake(W, b, G, symmetric), atol=1e-6, rtol=0)


def test_group_quantize_is_per_channel_when_the_group_is_a_row():
    from llmbook.lm.quantization import dequantize, per_channel_quantize
    W = torch.randn(8, 40, generator=torch.Generator().manual_seed(1))
    q, s, z = qf.group_quantize(W, 4, group_size=40)
    q2, s2, z2 = per_channel_quantize(W, 4, symmetric=False)
    assert torch.equal(q, q2)
    torch.testing.assert_close(qf.group_dequantize(q, s, z, 40), dequantize(q2, s2, z2), atol=0, rtol=0)


@pytest.mark.parametrize("fmt,dtype", [("e4m3", torch.float8_e4m3fn), ("e5m2", torch.float8_e5m2)])
def test_fp8_round_matches_torch_cast_on_every_value_and_midpoint(fmt, dtype):
    values = torch.arange(256, dtype=torch.uint8).view(dtype).float()
    finite = values[torch.isfinite(values)].unique()  # every representable number, sorted
    assert torch.equal(qf.fp8_round(finite, fmt), finite)  # representable numbers are kept
    mid = (finite[:-1] + finite[1:]) / 2  # exact ties: must go to the even mantissa, as torch's cast does
    near = torch.cat([mid, torch.nextafter(mid, finite[1:]), torch.nextafter(mid, finite[:-1])])
    torch.testing.assert_close(qf.fp8_round(near, fmt), near.to(dtype).float(), atol=0, rtol=0)
    x = torch.randn(20000, generator=torch.Generator().manual_seed(0)) * torch.exp2(
        torch.randint(-20, 14, (20000,), generator=torch.Generator().manual_seed(1)).float())
    x = x[x.abs() <= finite.max()]
    torch.testing.assert_close(qf.fp8_round(x, fmt), x.to(dtype).float(), atol=0, rtol=0)


def test_fp8_e4m3_saturates_like_torch_and_quantize_scales_rows():
    x = torch.tensor([447.0, 449.0, 470.0, 1000.0, -1e6])
    torch.testing.assert_close(qf.fp8_round(x, "e4m3"), x.to(torch.float8_e4m3fn).float(), atol=0, rtol=0)
    W = torch.randn(16, 64, generator=torch.Generator().manual_seed(2))
    for fmt, dtype in (("e4m3", torch.float8_e4m3fn), ("e5m2", torch.float8_e5m2)):
        W_hat, s = qf.fp8_quantize(W, fmt)
        x_max = torch.finfo(dtype).max
        torch.testing.assert_close(s, W.abs().amax(1, keepdim=True) / x_max, atol=0, rtol=1e-7)
        torch.testing.assert_close(W_hat, (W / s).to(dtype).float() * s, atol=0, rtol=0)


def _numpy_pack(q):
    """Bit-level reference: the 4 low bits of each code, least significant first, packed by numpy."""
    q = np.asarray(q, dtype=np.uint8)
    if q.shape[-1] % 2:
        q = np.concatenate([q, np.zeros(q.shape[:-1] + (1,), np.uint8)], -1)
    bits = np.unpackbits(q[..., None], axis=-1, bitorder="little")[..., :4]  # (..., n, 4)
    return np.packbits(bits.reshape(*q.shape[:-1], -1), axis=-1, bitorder="little")


@pytest.mark.parametrize("shape", [(7,), (3, 10), (2, 5, 9)])
def test_pack_int4_matches_numpy_bits_and_round_trips(shape):
    q = torch.randint(0, 16, shape, generator=torch.Generator().manual_seed(len(shape)))
    packed = qf.pack_int4(q)
    assert packed.dtype == torch.uint8 and packed.shape == (*shape[:-1], -(-shape[-1] // 2))
    np.testing.assert_array_equal(packed.numpy(), _numpy_pack(q.numpy()))
    assert torch.equal(qf.unpack_int4(packed, shape[-1]), q)


def test_packed_groupwise_bytes_and_values():
    W = torch.randn(12, 344, generator=torch.Generator().manual_seed(3))
    p = qf.pack_int4_groupwise(W, 128)
    assert p.nbytes == 12 * 172 + 12 * 2 + 12 * 3 * 2  # codes, zeros (3 groups -> 2 bytes), float16 scales
    z = qf.unpack_int4(p.zeros, 3)
    torch.testing.assert_close(p.dequantize(), _torch_group_fake(W, 4, 128, scales=p.scales, zeros=z), atol=1e-6,
                               rtol=0)
    q, s, _ = qf.group_quantize(W, 4, 128)
    # the float16 scale moves a few values across a rounding boundary: one code, at most one step, and rarely
    changed = qf.unpack_int4(p.codes, 344) != q
    assert changed.float().mean() < 0.01
    assert (p.dequantize() - qf.group_dequantize(q, s, z, 128)).abs().max() <= 1.01 * s.max()


def test_bits_per_weight_and_model_copy():
    assert qf.bits_per_weight(4, 128, 16, 4) == 4 + 20 / 128
    assert qf.bits_per_weight(4, 64, 32) == 4.5
    two = nn.Sequential(nn.Linear(344, 128), nn.Linear(128, 344))  # hand count: groups 3 and 1 per row
    n = 344 * 128 * 2
    assert qf.model_bits_per_weight(two, 3, 128, 16, 3) == (3 * n + (128 * 3 + 344 * 1) * 19) / n
    assert qf.model_bits_per_weight(two, 8, None, 16) == (8 * n + (128 + 344) * 16) / n
    model = nn.Sequential(nn.Linear(256, 8), nn.ReLU(), nn.Linear(8, 3))
    q = qf.quantize_model_format(model, "group", 4, 128)
    torch.testing.assert_close(q[0].weight, _torch_group_fake(model[0].weight.detach(), 4, 128), atol=1e-6, rtol=0)
    f = qf.quantize_model_format(model, "e5m2")
    W = model[2].weight.detach()
    s = W.abs().amax(1, keepdim=True) / 57344.0
    torch.testing.assert_close(f[2].weight, (W / s).to(torch.float8_e5m2).float() * s, atol=0, rtol=0)
    assert not torch.equal(q[0].weight, model[0].weight)  # a copy: the original is untouched


def test_bad_inputs():
    with pytest.raises(ValueError, match="4-bit codes"):
        qf.pack_int4(torch.tensor([3, 16]))
    with pytest.raises(TypeError, match="uint8"):
        qf.unpack_int4(torch.tensor([1, 2]), 4)
    with pytest.raises(ValueError, match="ceil"):
        qf.unpack_int4(torch.tensor([1, 2], dtype=torch.uint8), 5)
    with pytest.raises(ValueError):
        qf.group_quantize(torch.ones(4), 4, 2)
    with pytest.raises(ValueError):
        qf.fp8_round(torch.ones(3), "e3m4")
    with pytest.raises(ValueError):
        qf.fp8_round(torch.tensor([float("nan")]))
    with pytest.raises(TypeError):
        qf.quantize_model_format("not a model", "e4m3")
