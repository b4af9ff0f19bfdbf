"""Chapter 12: affine, symmetric, asymmetric and per-channel grids, KV-cache quantisation and the STE.

Oracles: ``torch.fake_quantize_per_tensor_affine`` / ``torch.fake_quantize_per_channel_affine`` and
``torch.quantize_per_tensor`` (round half to even, like ``torch.round``), torch's observers
(``torch.ao.quantization.MinMaxObserver`` / ``PerChannelMinMaxObserver``) for the scales and zero points,
and autograd for the straight-through gradient. torch rounds ``x * (1 / s)``, we round ``x / s`` (written
``x * Q / max|x|``): the two can differ by one level only where ``x / s`` lies within float32 rounding of a
half step, so random-data comparisons allow exactly those positions (``_near_tie``) and nothing else.
"""

from __future__ import annotations

import pytest
import torch
from torch.ao.quantization import MinMaxObserver, PerChannelMinMaxObserver

from llmbook.lm.quantization import (
    STEFakeQuantize,
    absmax_quantize,
    affine_quantize,
    asymmetric_quantize,
    dequantize,
    per_channel_quantize,
    quantize_kv,
    ste_fake_quantize,
)


def _near_tie(x: torch.Tensor, s, tol: float = 1e-4) -> torch.Tensor:
    """Where ``x / s`` is within ``tol`` of a half-integer (the only place two roundings may disagree)."""
    r = (x.double() / torch.as_tensor(s).double()).abs()
    return ((r - r.floor()) - 0.5).abs() < tol


def _agree(ours, ref, x, s, atol=1e-6):
    """Equal within ``atol`` except at near-ties; and those exceptions are rare."""
    diff = (ours.double() - ref.double()).abs() > atol
    assert not (diff & ~_near_tie(x, s)).any(), f"{int((diff & ~_near_tie(x, s)).sum())} mismatches off ties"
    assert diff.double().mean() < 0.01


# ============================================================== 12.01 affine


@pytest.mark.equation("12.01", oracle="torch.fake_quantize_per_tensor_affine, torch.quantize_per_tensor")
@pytest.mark.parametrize("q_min, q_max, z", [(0, 255, 128), (0, 15, 3), (-128, 127, 0), (-8, 7, -2)])
def test_affine_matches_torch_fake_quantize_exactly(q_min, q_max, z):
    s = 0.0625  # a power of two: x / s and x * (1 / s) are the same number, so even ties must agree
    x = torch.randn(4000) * 4
    x[:40] = s * (torch.arange(-20, 20) + 0.5)  # exact ties: half to even
    q, x_hat = affine_quantize(x, s, z, q_min, q_max)
    assert torch.equal(x_hat, torch.fake_quantize_per_tensor_affine(x, s, z, q_min, q_max))
    assert torch.equal(q, torch.clamp(torch.round(x / s) + z, q_min, q_max).long())
    if (q_min, q_max) == (0, 255):
        assert torch.equal(q, torch.quantize_per_tensor(x, s, z, torch.quint8).int_repr().long())


@pytest.mark.equation("12.01", oracle="torch.fake_quantize_per_channel_affine")
def test_affine_per_channel_scales_match_torch():
    x = torch.randn(6, 50) * torch.logspace(-2, 1, 6)[:, None]
    s = 2.0 ** torch.randint(-9, -2, (6, 1)).float()
    z = torch.randint(0, 16, (6, 1))
    q, x_hat = affine_quantize(x, s, z, 0, 15)
    ref = torch.fake_quantize_per_channel_affine(x, s.flatten(), z.flatten().int(), 0, 0, 15)
    assert torch.equal(x_hat, ref)
    assert torch.equal(dequantize(q, s, z), ref)


@pytest.mark.equation("12.01", oracle="torch.fake_quantize_per_tensor_affine")
def test_affine_random_scale_agrees_off_ties():
    x = torch.randn(5000)
    s = 0.0371
    _agree(affine_quantize(x, s, 7, 0, 15)[1], torch.fake_quantize_per_tensor_affine(x, s, 7, 0, 15), x, s)


def test_affine_rejects_bad_arguments():
    x = torch.randn(4)
    with pytest.raises(ValueError, match="s must be positive"):
        affine_quantize(x, 0.0, 0, 0, 15)
    with pytest.raises(ValueError, match="s must be positive"):
        affine_quantize(x, torch.tensor([0.1, -0.1, 0.1, 0.1]), 0, 0, 15)
    with pytest.raises(ValueError, match=r"z must lie in \[q_min, q_max\]"):
        affine_quantize(x, 0.1, 16, 0, 15)
    with pytest.raises(ValueError, match="q_min must be below q_max"):
        affine_quantize(x, 0.1, 0, 5, 5)
    with pytest.raises(ValueError, match="NaN"):
        affine_quantize(torch.tensor([float("nan")]), 0.1, 0, 0, 15)
    with pytest.raises(TypeError, match="z must be"):
        affine_quantize(x, 0.1, torch.zeros(4), 0, 15)


# ============================================================== 12.02 symmetric


@pytest.mark.equation("12.02", oracle="torch MinMaxObserver(per_tensor_symmetric) + fake_quantize_per_tensor_affine")
@pytest.mark.parametrize("b", [8, 4, 3])
def test_absmax_scale_and_codes_match_torch(b):
    Q = 2 ** (b - 1) - 1
    x = torch.randn(3000) * 2.5
    q, s = absmax_quantize(x, b)
    obs = MinMaxObserver(dtype=torch.qint8, qscheme=torch.per_tensor_symmetric, quant_min=-Q, quant_max=Q)
    obs(x)
    s_ref, z_ref = obs.calculate_qparams()
    assert int(z_ref) == 0
    torch.testing.assert_close(s, s_ref[0], rtol=1e-6, atol=0)
    assert q.abs().max() == Q and q.dtype == torch.int64
    _agree(s * q, torch.fake_quantize_per_tensor_affine(x, float(s), 0, -Q, Q), x, s)


def test_absmax_tie_rounds_half_to_even_and_zero_stays_zero():
    q, s = absmax_quantize(torch.tensor([1.0, 0.5, -0.5, 0.0]), b=3)  # 0.5 * 3 = 1.5 -> 2
    assert q.tolist() == [3, 2, -2, 0]
    q, s = absmax_quantize(torch.zeros(5), b=4)
    assert q.abs().sum() == 0 and float(s) == 1.0


def test_absmax_per_row_dim():
    x = torch.randn(5, 40) * torch.arange(1, 6)[:, None]
    q, s = absmax_quantize(x, 8, dim=-1)
    assert s.shape == (5, 1)
    torch.testing.assert_close(s, x.abs().amax(-1, keepdim=True) / 127, rtol=1e-6, atol=0)
    assert (q.abs().amax(-1) == 127).all()


# ============================================================== 12.03 asymmetric


@pytest.mark.equation("12.03", oracle="torch MinMaxObserver(per_tensor_affine) + fake_quantize_per_tensor_affine")
@pytest.mark.parametrize("b, shift", [(8, 0.0), (8, 3.0), (4, -1.0), (3, 0.5)])
def test_asymmetric_qparams_match_torch_observer(b, shift):
    x = torch.rand(3000) * 5 - 1 + shift
    q, s, z = asymmetric_quantize(x, b)
    obs = MinMaxObserver(dtype=torch.quint8, qscheme=torch.per_tensor_affine, quant_min=0, quant_max=2**b - 1)
    obs(x)
    s_ref, z_ref = obs.calculate_qparams()
    torch.testing.assert_close(s, s_ref[0], rtol=1e-6, atol=0)
    assert int(z) == int(z_ref)
    x_hat = dequantize(q, s, z)
    _agree(x_hat, torch.fake_quantize_per_tensor_affine(x, float(s), int(z), 0, 2**b - 1), x, s, atol=1e-5)
    assert q.min() >= 0 and q.max() <= 2**b - 1


@pytest.mark.equation("12.03", oracle="torch PerChannelMinMaxObserver(per_channel_affine)")
def test_asymmetric_along_dim_matches_per_channel_observer():
    x = torch.randn(7, 60) * torch.linspace(0.1, 3, 7)[:, None] + torch.linspace(-1, 1, 7)[:, None]
    q, s, z = asymmetric_quantize(x, 4, dim=1)
    obs = PerChannelMinMaxObserver(ch_axis=0, dtype=torch.quint8, qscheme=torch.per_channel_affine,
                                   quant_min=0, quant_max=15)
    obs(x)
    s_ref, z_ref = obs.calculate_qparams()
    torch.testing.assert_close(s.flatten(), s_ref, rtol=1e-6, atol=0)
    assert torch.equal(z.flatten(), z_ref.long())


def test_asymmetric_beats_symmetric_on_one_sided_data():
    x = torch.rand(2000)  # ReLU-like: all positive; the symmetric grid wastes its negative half
    err_asym = (dequantize(*asymmetric_quantize(x, 4)) - x).abs().mean()
    q, s = absmax_quantize(x, 4)
    assert err_asym < 0.6 * (s * q - x).abs().mean()


# ============================================================== 12.04 per channel


@pytest.mark.equation("12.04", oracle="torch PerChannelMinMaxObserver(per_channel_symmetric) + "
                                      "fake_quantize_per_channel_affine")
@pytest.mark.parametrize("b", [8, 4])
def test_per_channel_matches_torch(b):
    Q = 2 ** (b - 1) - 1
    W = torch.randn(16, 64) * torch.logspace(-2, 0, 16)[:, None]
    q, s, z = per_channel_quantize(W, b)
    obs = PerChannelMinMaxObserver(ch_axis=0, dtype=torch.qint8, qscheme=torch.per_channel_symmetric,
                                   quant_min=-Q, quant_max=Q)
    obs(W)
    s_ref, z_ref = obs.calculate_qparams()
    torch.testing.assert_close(s.flatten(), s_ref, rtol=1e-6, atol=0)
    assert (z == 0).all() and (z_ref == 0).all()
    ref = torch.fake_quantize_per_channel_affine(W, s.flatten(), z_ref.int(), 0, -Q, Q)
    _agree(dequantize(q, s), ref, W, s, atol=1e-7)


def test_per_channel_error_is_far_below_per_tensor_when_rows_differ():
    W = torch.randn(16, 64) * torch.logspace(-3, 0, 16)[:, None]
    q, s, z = per_channel_quantize(W, 4)
    qt, st = absmax_quantize(W, 4)
    err_row = ((dequantize(q, s) - W).norm(dim=1) / W.norm(dim=1)).mean()
    err_tensor = ((st * qt - W).norm(dim=1) / W.norm(dim=1)).mean()
    assert err_row < 0.2 and err_tensor > 0.5


def test_per_channel_asymmetric_option_and_errors():
    W = torch.rand(4, 10)
    q, s, z = per_channel_quantize(W, 4, symmetric=False)
    assert s.shape == z.shape == (4, 1) and (z == 0).all()  # all positive: x_min widened to 0
    with pytest.raises(ValueError, match=r"\(d_out, d_in\)"):
        per_channel_quantize(torch.randn(3), 4)
    with pytest.raises(ValueError, match="bit width"):
        per_channel_quantize(W, 1)
    with pytest.raises(TypeError, match="symmetric must be a bool"):
        per_channel_quantize(W, 4, symmetric="yes")


# ============================================================== 12.11 KV cache


@pytest.mark.equation("12.11", oracle="torch PerChannelMinMaxObserver + fake_quantize_per_channel_affine")
@pytest.mark.parametrize("b", [8, 4, 2])
def test_kv_quantisation_matches_torch_per_channel_and_per_token(b):
    B, H, T, D = 2, 3, 20, 8
    K, V = torch.randn(B, H, T, D), torch.randn(B, H, T, D)
    K[..., 2] += 6.0  # an outlier channel, as in real keys
    K_hat, V_hat = quantize_kv(K, V, b)

    def ref(rows):  # rows (N, n): one affine grid per row, from torch's observer
        obs = PerChannelMinMaxObserver(ch_axis=0, dtype=torch.quint8, qscheme=torch.per_channel_affine,
                                       quant_min=0, quant_max=2**b - 1)
        obs(rows)
        s, z = obs.calculate_qparams()
        return torch.fake_quantize_per_channel_affine(rows, s, z.int(), 0, 0, 2**b - 1), s[:, None]

    k_rows = K.transpose(-1, -2).reshape(-1, T)  # (B*H*D, T): per channel, over the tokens
    k_ref, s_k = ref(k_rows)
    _agree(K_hat.transpose(-1, -2).reshape(-1, T), k_ref, k_rows, s_k, atol=1e-5)
    v_rows = V.reshape(-1, D)  # (B*H*T, D): per token
    v_ref, s_v = ref(v_rows)
    _agree(V_hat.reshape(-1, D), v_ref, v_rows, s_v, atol=1e-5)


def test_keys_per_channel_beat_per_token_with_outlier_channels():
    K = torch.randn(1, 2, 64, 16)
    K[..., [3, 9]] = K[..., [3, 9]] * 0.3 + torch.tensor([8.0, -6.0])  # two channels large in every token
    per_channel, per_token = quantize_kv(K, K, 2)  # the same tensor as keys (per channel) and values (per token)
    assert (per_channel - K).pow(2).mean() < 0.5 * (per_token - K).pow(2).mean()


def test_kv_shape_errors():
    with pytest.raises(ValueError, match=r"must agree on \(\.\.\., T\)"):
        quantize_kv(torch.randn(2, 5, 4), torch.randn(2, 6, 4))


# ============================================================== 12.12 STE / QAT


@pytest.mark.equation("12.12", oracle="autograd of the identity; torch.fake_quantize_per_tensor_affine and its grad")
@pytest.mark.parametrize("b", [8, 4, 2])
def test_ste_forward_is_fake_quant_and_gradient_is_identity(b):
    Q = 2 ** (b - 1) - 1
    x = (torch.randn(500) * 3).requires_grad_()
    g = torch.randn(500)
    y = ste_fake_quantize(x, b)
    (y * g).sum().backward()
    x_id = x.detach().clone().requires_grad_()
    (x_id * g).sum().backward()  # the identity's gradient
    assert torch.equal(x.grad, x_id.grad)
    s = float(x.detach().abs().max() / Q)
    x_t = x.detach().clone().requires_grad_()
    ref = torch.fake_quantize_per_tensor_affine(x_t, s, 0, -Q, Q)
    (ref * g).sum().backward()
    _agree(y.detach(), ref.detach(), x.detach(), s, atol=1e-6)
    assert torch.equal(x.grad, x_t.grad)  # nothing is clipped with an absmax scale: torch's STE passes all


def test_qat_parametrisation_trains_through_the_rounding():
    torch.manual_seed(0)
    lin = torch.nn.Linear(8, 1, bias=False)
    torch.nn.utils.parametrize.register_parametrization(lin, "weight", STEFakeQuantize(b=3))
    X = torch.randn(256, 8)
    y = X @ torch.linspace(-1, 1, 8)
    opt = torch.optim.SGD(lin.parameters(), lr=0.05)
    first = None
    for _ in range(200):
        loss = (lin(X).squeeze(-1) - y).pow(2).mean()
        first = float(loss) if first is None else first
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert len(lin.weight.unique()) <= 7  # the effective weights live on the 3-bit grid
    assert float(loss) < 0.05 * first
