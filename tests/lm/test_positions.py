"""Chapter 4, positions (04.01-04.05, 04.08, 04.09) against independent oracles, plus claim C05.

Tolerances, stated once:

* the half-split RoPE against ``transformers`` (float32, same recipe): exact equality;
* other float32 comparisons: ``rtol = atol = 1e-5`` (``F32``);
* float64 against float64 closed forms: ``rtol = atol = 1e-12`` (``F64``).
"""

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb
from transformers.models.llama.modeling_llama import rotate_half as hf_rotate_half

from llmbook.lm.positions import (
    LearnedPositionEmbedding,
    apply_rope,
    apply_rope_complex,
    apply_rope_matrix,
    apply_xpos,
    half_to_interleaved,
    interleaved_to_half,
    nope_embedding,
    rope_cos_sin,
    rope_inv_freq,
    rope_relative_score,
    rope_rotation_matrix,
    rotate_half,
    sinusoidal_encoding,
    xpos_scale,
)

F32 = dict(rtol=1e-5, atol=1e-5)
F64 = dict(rtol=1e-12, atol=1e-12)
SETTINGS = settings(max_examples=60, deadline=None, derandomize=True)


def hf_cos_sin(T, D, base=10000.0, position_ids=None):
    """cos/sin from transformers' own LlamaRotaryEmbedding (default rope)."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    cfg = LlamaConfig(hidden_size=D * 2, num_attention_heads=2, head_dim=D, rope_theta=base,
                      max_position_embeddings=4096)
    rot = LlamaRotaryEmbedding(cfg)
    pos = torch.arange(T)[None] if position_ids is None else position_ids[None]
    cos, sin = rot(torch.zeros(1, T, D), pos)
    return cos[0], sin[0], rot.inv_freq


# ================================================================= 04.01 sinusoidal


@pytest.mark.equation("04.01", oracle="float64 closed form sin(pos / 10000^(2i/d)), cos(...) by explicit loops")
def test_sinusoidal_matches_the_paper_closed_form_interleaved():
    T, d = 50, 16
    pe = sinusoidal_encoding(T, d, dtype=torch.float64)
    ref = np.zeros((T, d))
    for pos in range(T):
        for i in range(d // 2):
            ref[pos, 2 * i] = math.sin(pos / 10000 ** (2 * i / d))
            ref[pos, 2 * i + 1] = math.cos(pos / 10000 ** (2 * i / d))
    np.testing.assert_allclose(pe.numpy(), ref, **F64)
    # the concatenated layout holds the same numbers: all sines, then all cosines
    cat = sinusoidal_encoding(T, d, dtype=torch.float64, layout="concatenated")
    np.testing.assert_allclose(cat.numpy(), np.concatenate([ref[:, 0::2], ref[:, 1::2]], 1), **F64)
    assert sinusoidal_encoding(T, d).dtype == torch.float32


def test_sinusoidal_bad_input():
    with pytest.raises(ValueError, match="positive even"):
        sinusoidal_encoding(4, 5)
    with pytest.raises(ValueError, match="layout"):
        sinusoidal_encoding(4, 4, layout="zigzag")
    with pytest.raises(ValueError, match=">= 0"):
        sinusoidal_encoding(-1, 4)


# ================================================================= 04.02 learned


@pytest.mark.equation("04.02", oracle="torch.nn.functional.embedding of arange(T) with the copied table")
def test_learned_positions_add_table_rows():
    pe = LearnedPositionEmbedding(16, 8)
    tok = torch.randn(2, 5, 8)
    ref = tok + F.embedding(torch.arange(3, 8), pe.weight)[None]
    torch.testing.assert_close(pe(tok, offset=3), ref, rtol=0, atol=0)
    with pytest.raises(ValueError, match="exceed the learned table"):
        pe(torch.randn(1, 17, 8))
    with pytest.raises(ValueError, match="must equal d"):
        pe(torch.randn(1, 3, 7))


# ================================================================= RoPE (04.03-04.05): the fixed half-split API


def test_rope_inv_freq_and_cos_sin_equal_transformers():
    for D, base in [(8, 10000.0), (64, 10000.0), (128, 500000.0)]:
        cos_ref, sin_ref, inv_ref = hf_cos_sin(37, D, base)
        torch.testing.assert_close(rope_inv_freq(D, base), inv_ref, rtol=0, atol=0)
        cos, sin = rope_cos_sin(37, D, base)
        torch.testing.assert_close(cos, cos_ref, rtol=0, atol=0)
        torch.testing.assert_close(sin, sin_ref, rtol=0, atol=0)
    # explicit positions (a slice from the middle of a cache)
    pos = torch.arange(100, 120)
    cos_ref, sin_ref, _ = hf_cos_sin(20, 16, position_ids=pos)
    cos, sin = rope_cos_sin(pos, 16)
    torch.testing.assert_close(cos, cos_ref, rtol=0, atol=0)
    assert rope_cos_sin(3, 4, dtype=torch.bfloat16)[0].dtype == torch.bfloat16


@pytest.mark.equation("04.03", oracle="transformers.models.llama.modeling_llama.apply_rotary_pos_emb")
def test_apply_rope_equals_transformers_apply_rotary_pos_emb():
    B, H, T, D = 2, 3, 11, 16
    q, k = torch.randn(B, H, T, D), torch.randn(B, H, T, D)
    cos, sin = rope_cos_sin(T, D)
    q_ref, k_ref = apply_rotary_pos_emb(q, k, cos[None], sin[None])  # (1, T, D) unsqueezed on the head axis
    torch.testing.assert_close(apply_rope(q, cos, sin), q_ref, rtol=0, atol=0)
    torch.testing.assert_close(apply_rope(k, cos, sin), k_ref, rtol=0, atol=0)
    torch.testing.assert_close(rotate_half(q), hf_rotate_half(q), rtol=0, atol=0)


@pytest.mark.equation("04.03", oracle="float64 closed form: explicit 2x2 rotation of each interleaved pair")
def test_rotation_matrix_rotates_each_pair_by_m_theta():
    D, m, base = 8, 7.0, 100.0
    R = rope_rotation_matrix(m, D, base).numpy()
    x = np.random.default_rng(0).standard_normal(D)
    ref = np.empty(D)
    for j in range(D // 2):
        a = m * base ** (-2 * j / D)
        ref[2 * j] = math.cos(a) * x[2 * j] - math.sin(a) * x[2 * j + 1]
        ref[2 * j + 1] = math.sin(a) * x[2 * j] + math.cos(a) * x[2 * j + 1]
    np.testing.assert_allclose(R @ x, ref, **F64)
    np.testing.assert_allclose(R.T @ R, np.eye(D), **F64)  # orthogonal


@pytest.mark.equation("04.05", oracle="numpy complex128 multiplication by exp(1j * m * theta_j)")
def test_complex_form_matches_numpy_phasors_and_the_matrix():
    T, D = 9, 12
    x = torch.randn(2, T, D, dtype=torch.float64)
    ours = apply_rope_complex(x)
    z = x.numpy()[..., 0::2] + 1j * x.numpy()[..., 1::2]
    theta = 10000.0 ** (-np.arange(0, D, 2) / D)
    zr = z * np.exp(1j * np.arange(T)[:, None] * theta[None, :])
    ref = np.stack([zr.real, zr.imag], -1).reshape(x.shape)
    np.testing.assert_allclose(ours.numpy(), ref, **F64)
    np.testing.assert_allclose(apply_rope_matrix(x).numpy(), ref, **F64)


@pytest.mark.equation("04.03", "04.05", oracle="transformers.models.llama.modeling_llama.apply_rotary_pos_emb "
                      "(half-split layout, channels permuted)")
def test_three_forms_agree_through_the_channel_permutation():
    T, D = 13, 16
    x = torch.randn(3, T, D)
    half = interleaved_to_half(x)
    cos, sin = rope_cos_sin(T, D)
    ref, _ = apply_rotary_pos_emb(half, half, cos, sin, unsqueeze_dim=0)
    torch.testing.assert_close(interleaved_to_half(apply_rope_matrix(x)), ref, **F32)
    torch.testing.assert_close(interleaved_to_half(apply_rope_complex(x)), ref, **F32)
    torch.testing.assert_close(half_to_interleaved(interleaved_to_half(x)), x, rtol=0, atol=0)


@pytest.mark.equation("04.04", oracle="transformers apply_rotary_pos_emb at positions m and n, then the dot product")
def test_relative_score_equals_the_score_of_rotated_vectors():
    D = 16
    q, k = torch.randn(D, dtype=torch.float64), torch.randn(D, dtype=torch.float64)
    for m, n in [(0, 0), (3, 10), (10, 3), (250, 260)]:
        cos, sin = rope_cos_sin(torch.tensor([m, n]), D, dtype=torch.float64)
        qh, kh = interleaved_to_half(q), interleaved_to_half(k)
        qm, _ = apply_rotary_pos_emb(qh[None].expand(2, D), qh[None].expand(2, D), cos, sin, unsqueeze_dim=0)
        kn, _ = apply_rotary_pos_emb(kh[None].expand(2, D), kh[None].expand(2, D), cos, sin, unsqueeze_dim=0)
        lhs = (qm[0, 0] * kn[0, 1]).sum()  # float32 angles inside cos/sin: compare at 1e-5
        torch.testing.assert_close(rope_relative_score(q, k, n - m), lhs, **F32)


# ================================================================= claim C05


@given(seed=st.integers(0, 10_000), t=st.integers(0, 5000), s=st.integers(0, 5000), shift=st.integers(0, 5000))
@SETTINGS
def test_claim_C05_norm_relative_and_identity(seed, t, s, shift):
    g = torch.Generator().manual_seed(seed)
    D = 32
    q, k = torch.randn(D, generator=g, dtype=torch.float64), torch.randn(D, generator=g, dtype=torch.float64)
    Rt, Rs = rope_rotation_matrix(t, D), rope_rotation_matrix(s, D)
    assert math.isclose(float((Rt @ q).norm()), float(q.norm()), rel_tol=1e-12)
    score = float((Rt @ q) @ (Rs @ k))
    shifted = float((rope_rotation_matrix(t + shift, D) @ q) @ (rope_rotation_matrix(s + shift, D) @ k))
    assert math.isclose(score, shifted, rel_tol=1e-9, abs_tol=1e-9)  # angles up to 1e4 rad: 1e-9 in float64
    assert torch.equal(rope_rotation_matrix(0, D) @ q, q)


def test_position_zero_is_the_identity_in_every_form():
    x = torch.randn(1, 16)
    cos, sin = rope_cos_sin(1, 16)
    assert torch.equal(apply_rope(x, cos, sin), x)
    assert torch.equal(apply_rope_complex(x), x)
    assert torch.equal(apply_rope_matrix(x), x)


def test_rope_bad_input():
    with pytest.raises(ValueError, match="positive even"):
        rope_inv_freq(7)
    with pytest.raises(ValueError, match="base must lie"):
        rope_inv_freq(8, base=1.0)
    with pytest.raises(ValueError, match="1-D"):
        rope_cos_sin(torch.zeros(2, 2), 8)
    with pytest.raises(ValueError, match="inv_freq must have shape"):
        rope_cos_sin(4, 8, inv_freq=torch.ones(3))
    cos, sin = rope_cos_sin(4, 8)
    with pytest.raises(ValueError, match="width D"):
        apply_rope(torch.randn(4, 6), cos, sin)
    with pytest.raises(ValueError, match="must be even"):
        rotate_half(torch.randn(3))
    with pytest.raises(ValueError, match="positions for T"):
        apply_rope_complex(torch.randn(4, 8), torch.arange(3))
    with pytest.raises(ValueError, match="NaN"):
        rope_cos_sin(torch.tensor([0.0, float("nan")]), 8)


# ================================================================= 04.08 xPos


@pytest.mark.equation("04.08", oracle="float64 closed form Re sum_j zeta_j^((m-n)/B) q~_j conj(k~_j) e^(i(m-n)theta_j)")
def test_xpos_score_matches_closed_form_and_is_relative():
    T, D, B, gamma = 40, 16, 512.0, 0.4
    q, k = torch.randn(T, D, dtype=torch.float64), torch.randn(T, D, dtype=torch.float64)
    qx, kx = apply_xpos(q, k, gamma=gamma, scale_base=B)
    ours = (qx @ kx.T).numpy()
    h = D // 2
    zq = q.numpy()[:, :h] + 1j * q.numpy()[:, h:]  # half-split pairs (j, j + D/2)
    zk = k.numpy()[:, :h] + 1j * k.numpy()[:, h:]
    theta = 10000.0 ** (-np.arange(0, D, 2) / D)
    zeta = (np.arange(0, D, 2) / D + gamma) / (1 + gamma)
    ref = np.empty((T, T))
    for m in range(T):
        for n in range(T):
            ref[m, n] = np.real(np.sum(zeta ** ((m - n) / B) * zq[m] * np.conj(zk[n]) * np.exp(1j * (m - n) * theta)))
    # rope_cos_sin forms its angles in float32 (as Llama does): 1e-5
    np.testing.assert_allclose(ours, ref, rtol=1e-5, atol=1e-5)
    # shifting both positions leaves the score alone
    qs, ks = apply_xpos(q, k, positions=torch.arange(T) + 300, gamma=gamma, scale_base=B)
    np.testing.assert_allclose((qs @ ks.T).numpy(), ours, rtol=1e-4, atol=1e-4)
    assert torch.equal(xpos_scale(1, 8), torch.ones(1, 8))


# ================================================================= 04.09 NoPE


@pytest.mark.equation("04.09", oracle="torch.nn.functional.embedding")
def test_nope_is_the_token_embedding_and_attention_is_permutation_equivariant():
    E = torch.randn(20, 8)
    ids = torch.tensor([[3, 1, 4, 1, 5]])
    h = nope_embedding(ids, E)
    torch.testing.assert_close(h, F.embedding(ids, E), rtol=0, atol=0)
    perm = torch.tensor([4, 2, 0, 1, 3])
    out = F.scaled_dot_product_attention(h, h, h)  # no mask, no positions
    out_p = F.scaled_dot_product_attention(h[:, perm], h[:, perm], h[:, perm])
    torch.testing.assert_close(out_p, out[:, perm], **F32)
    with pytest.raises(ValueError, match=r"ids must lie in \[0, V\)"):
        nope_embedding(torch.tensor([20]), E)
    with pytest.raises(TypeError, match="integer"):
        nope_embedding(torch.tensor([1.0]), E)
