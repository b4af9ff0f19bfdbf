"""RWKV's token shift and time mixing against transformers' RwkvSelfAttention; RetNet's rotation against GPT-J's
rotary code and NumPy complex arithmetic."""

import numpy as np
import pytest
import torch
from transformers import RwkvConfig
from transformers.models.gptj.modeling_gptj import apply_rotary_pos_emb
from transformers.models.rwkv.modeling_rwkv import RwkvSelfAttention

from llmbook.lm.rwkv_retnet import retnet_angles, retnet_rotate, rwkv_time_mixing, token_shift


def rwkv_block(C=6, seed=0):
    torch.manual_seed(seed)
    att = RwkvSelfAttention(RwkvConfig(hidden_size=C, attention_hidden_size=C, context_length=32), layer_id=0).double()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in att.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64) * 0.5)
        for name in ("time_mix_key", "time_mix_value", "time_mix_receptance"):
            getattr(att, name).copy_(torch.rand(1, 1, C, generator=g, dtype=torch.float64))
    return att


def test_token_shift_against_transformers_time_shift():
    att = rwkv_block()
    x = torch.randn(2, 5, 6, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    mu = att.time_mix_key[0, 0].detach()
    ref = x * mu + att.time_shift(x) * (1 - mu)  # transformers' ZeroPad2d shift, as in extract_key_value
    torch.testing.assert_close(token_shift(x, mu), ref, rtol=0, atol=1e-15)
    prev = torch.randn(2, 6, dtype=torch.float64)
    torch.testing.assert_close(token_shift(x, mu, prev)[:, 0], mu * x[:, 0] + (1 - mu) * prev, rtol=0, atol=1e-15)
    with pytest.raises(ValueError, match="mu must have shape"):
        token_shift(x, mu[:-1])


def test_time_mixing_against_transformers_rwkv_self_attention():
    att = rwkv_block(seed=2)
    x = torch.randn(2, 7, 6, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    with torch.no_grad():
        ref, _ = att(x)
        ours = rwkv_time_mixing(x, att.receptance.weight, att.key.weight, att.value.weight, att.output.weight,
                                att.time_mix_receptance[0, 0], att.time_mix_key[0, 0], att.time_mix_value[0, 0],
                                torch.exp(att.time_decay), att.time_first)  # transformers stores log w
    torch.testing.assert_close(ours, ref, rtol=0, atol=1e-6)  # transformers keeps the WKV state in float32


def test_retnet_angles_match_the_official_formula():
    np.testing.assert_allclose(retnet_angles(16).numpy(), 1.0 / 10000 ** np.linspace(0, 1, 8), rtol=1e-14)
    with pytest.raises(ValueError, match="even"):
        retnet_angles(5)


def test_rotation_against_gptj_and_complex_numbers():
    g = torch.Generator().manual_seed(4)
    x = torch.randn(2, 3, 9, 8, generator=g, dtype=torch.float64)  # (B, H, T, D)
    theta = retnet_angles(8)
    ours = retnet_rotate(x, theta, offset=2)
    angle = torch.arange(2, 11, dtype=torch.float64)[:, None] * theta  # (T, D/2)
    # GPT-J's rotary code (interleaved pairs) takes (B, T, H, D) and sin/cos of shape (B, T, D/2)
    ref = apply_rotary_pos_emb(x.transpose(1, 2), torch.sin(angle)[None], torch.cos(angle)[None]).transpose(1, 2)
    torch.testing.assert_close(ours, ref, rtol=0, atol=1e-12)
    z = x[..., 0::2].numpy() + 1j * x[..., 1::2].numpy()
    zr = z * np.exp(1j * angle.numpy())
    np.testing.assert_allclose(ours[..., 0::2].numpy(), zr.real, atol=1e-12)
    np.testing.assert_allclose(ours[..., 1::2].numpy(), zr.imag, atol=1e-12)
    back = retnet_rotate(ours, theta, offset=2, conjugate=True)
    torch.testing.assert_close(back, x, rtol=0, atol=1e-12)


def test_rotated_scores_depend_on_the_distance_only():
    """q_n . k_m after rotation = Re(q~ conj(k~) e^{i (n - m) theta}) summed over pairs (NumPy complex)."""
    g = torch.Generator().manual_seed(5)
    q, k = torch.randn(2, 4, generator=g, dtype=torch.float64), torch.randn(2, 4, generator=g, dtype=torch.float64)
    theta = retnet_angles(4)
    for n, m in ((5, 2), (13, 10), (3, 0)):
        qn = retnet_rotate(q[:1], theta, offset=n)
        km = retnet_rotate(k[:1], theta, offset=m)
        zq, zk = q[0, 0::2].numpy() + 1j * q[0, 1::2].numpy(), k[0, 0::2].numpy() + 1j * k[0, 1::2].numpy()
        ref = np.real(np.sum(zq * np.conj(zk) * np.exp(1j * (n - m) * theta.numpy())))
        assert abs(float(qn @ km.T) - ref) < 1e-12
    with pytest.raises(ValueError, match="theta must have shape"):
        retnet_rotate(q, theta[:1])
