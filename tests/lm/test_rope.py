"""Chapter 4, llmbook.lm.rope: RoPE (04.03-04.05) in both layouts against independent oracles, plus claim C05.

Tolerances, stated once:

* the half-split RoPE against ``transformers`` (float32, same recipe): exact equality;
* other float32 comparisons: ``rtol = atol = 1e-5`` (``F32``);
* float64 against float64 closed forms: ``rtol = atol = 1e-12`` (``F64``).
"""

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb
from transformers.models.llama.modeling_llama import rotate_half as hf_rotate_half

from llmbook.lm.rope import (
    apply_rope,
    apply_rope_complex,
    apply_rope_matrix,
    half_to_interleaved,
    half_to_interleaved_weight,
    interleaved_to_half,
    interleaved_to_half_weight,
    rope_cos_sin,
    rope_inv_freq,
    rope_pair_energy,
    rope_relative_score,
    rope_rotation_matrix,
    rotate_half,
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


# ================================================================= RoPE (04.03-04.05): the half-split API


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
    with pytest.raises(ValueError, match=r"1-D tensor \(T,\) or a 2-D tensor \(B, T\), got shape \(2, 2, 2\)"):
        rope_cos_sin(torch.zeros(2, 2, 2), 8)
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


# ================================================================= RoPE layouts and per-sequence positions


@pytest.mark.equation("04.03", oracle="transformers LlamaRotaryEmbedding + apply_rotary_pos_emb, position_ids (B, T)")
def test_per_sequence_positions_match_llama_position_ids():
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    B, H, T, D = 3, 2, 6, 16
    position_ids = torch.stack([torch.arange(T), torch.arange(T) + 7, torch.tensor([0, 0, 0, 1, 2, 3])])  # (B, T)
    cfg = LlamaConfig(hidden_size=D * H, num_attention_heads=H, head_dim=D, max_position_embeddings=4096)
    cos_ref, sin_ref = LlamaRotaryEmbedding(cfg)(torch.zeros(B, T, D), position_ids)  # (B, T, D)
    cos, sin = rope_cos_sin(position_ids, D)
    assert cos.shape == (B, T, D)
    torch.testing.assert_close(cos, cos_ref, rtol=0, atol=0)
    torch.testing.assert_close(sin, sin_ref, rtol=0, atol=0)
    q, k = torch.randn(B, H, T, D), torch.randn(B, H, T, D)
    q_ref, k_ref = apply_rotary_pos_emb(q, k, cos_ref, sin_ref)  # unsqueeze_dim=1: one table per sequence
    torch.testing.assert_close(apply_rope(q, cos, sin), q_ref, rtol=0, atol=0)
    torch.testing.assert_close(apply_rope(k, cos, sin), k_ref, rtol=0, atol=0)
    for b in range(B):  # each sequence alone, with its own (T,) positions
        cos_b, sin_b = rope_cos_sin(position_ids[b], D)
        alone = apply_rope(q[b], cos_b, sin_b)
        torch.testing.assert_close(apply_rope(q[b:b + 1], cos[b:b + 1], sin[b:b + 1])[0], alone, rtol=0, atol=0)
        torch.testing.assert_close(apply_rope(q[b, 0], cos[b], sin[b]), q_ref[b, 0], rtol=0, atol=0)  # (T, D) input


@pytest.mark.equation("04.03", oracle="numpy complex128 (x_2j + i x_2j+1) * exp(i m theta_j), per-sequence m")
def test_interleaved_layout_matches_numpy_phasors():
    B, H, T, D = 2, 3, 5, 8
    g = torch.Generator().manual_seed(3)
    x = torch.randn(B, H, T, D, generator=g, dtype=torch.float64)
    m = torch.tensor([[0, 1, 2, 3, 4], [9, 10, 11, 12, 13]])
    theta = 10000.0 ** (-np.arange(0, D, 2) / D)
    z = x.numpy()[..., 0::2] + 1j * x.numpy()[..., 1::2]  # (B, H, T, D/2)
    zr = z * np.exp(1j * m.numpy()[:, None, :, None] * theta)
    ref = np.stack([zr.real, zr.imag], axis=-1).reshape(x.shape)
    cos, sin = rope_cos_sin(m, D, inv_freq=torch.from_numpy(theta), dtype=torch.float64)
    np.testing.assert_allclose(apply_rope(x, cos, sin, layout="interleaved").numpy(), ref, **F64)
    # the default layout pairs (j, j + D/2) instead, so it differs
    assert not np.allclose(apply_rope(x, cos, sin).numpy(), ref, atol=1e-3)


@pytest.mark.parametrize("shape", [(24, 5), (24,)])  # a q/k weight (H D, C) or bias (H D,)
def test_qk_weight_conversion_is_hf_permute_and_round_trips(shape):
    H, D = 3, 8
    W = torch.randn(*shape, dtype=torch.float64)
    C = shape[1] if len(shape) == 2 else 1
    # convert_llama_weights_to_hf.py: permute(w) = w.view(H, D/2, 2, C).transpose(1, 2).reshape(H D, C)
    hf = W.reshape(H, D // 2, 2, C).transpose(1, 2).reshape(shape)
    assert torch.equal(interleaved_to_half_weight(W, H), hf)
    assert torch.equal(half_to_interleaved_weight(interleaved_to_half_weight(W, H), H), W)
    assert torch.equal(interleaved_to_half_weight(half_to_interleaved_weight(W, H), H), W)
    # rows of head h stay in head h: converting one head alone gives the same rows
    assert torch.equal(interleaved_to_half_weight(W, H)[D:2 * D], interleaved_to_half_weight(W[D:2 * D], 1))


def test_rope_layout_and_table_bad_input():
    x = torch.randn(2, 3, 4, 8)
    cos, sin = rope_cos_sin(torch.zeros(2, 4), 8)
    with pytest.raises(ValueError, match="RoPE layout must be 'half'.*got 'paper'"):
        apply_rope(x, cos, sin, layout="paper")
    with pytest.raises(ValueError, match=r"cos and sin \(3, 4, 8\) must be \(T, D\), \(B, T, D\)"):
        apply_rope(x, *rope_cos_sin(torch.zeros(3, 4), 8))  # B = 3 tables for a batch of 2
    with pytest.raises(ValueError, match=r"cos and sin \(5, 8\) must be"):
        apply_rope(x, *rope_cos_sin(5, 8))  # T = 5 tables for T = 4
    with pytest.raises(ValueError, match=r"W has 20 rows: they must split into n_heads \(3\) heads"):
        interleaved_to_half_weight(torch.randn(20, 4), 3)
    with pytest.raises(ValueError, match=r"n_heads \(2\) heads of an even width"):
        half_to_interleaved_weight(torch.randn(6, 4), 2)
    with pytest.raises(ValueError, match="n_heads must be a positive int"):
        interleaved_to_half_weight(torch.randn(8, 4), 0)


# ================================================================= RoPE angles in bf16 (issue 11)


def _rope_interleaved64(x, m, base=10000.0):
    """Interleaved RoPE in float64: pair (2j, 2j+1) rotated by m theta_j (independent closed form)."""
    x = x.double()
    D = x.shape[-1]
    theta = base ** (-torch.arange(0, D, 2, dtype=torch.float64) / D)
    ang = torch.as_tensor(m, dtype=torch.float64)[..., None] * theta
    a, b = x[..., 0::2], x[..., 1::2]
    return torch.stack([a * ang.cos() - b * ang.sin(), a * ang.sin() + b * ang.cos()], -1).flatten(-2)


@pytest.mark.parametrize("dtype, tol", [(torch.bfloat16, 1.6e-2), (torch.float16, 2e-3)])
def test_rope_matrix_and_relative_score_in_low_precision_at_position_1000(dtype, tol):
    # the angles used to be formed in bf16 (1000 * theta_0 rounded to 8 bits: errors up to 4.75)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(4, 16, generator=g).to(dtype)
    pos = torch.tensor([997, 998, 999, 1000])
    out = apply_rope_matrix(x, pos)
    assert out.dtype == dtype
    torch.testing.assert_close(out.double(), _rope_interleaved64(x, pos), rtol=tol, atol=tol)
    q, k = x[0], x[1]
    score = rope_relative_score(q, k, 1000)
    assert score.dtype == dtype
    ref = (q.double() * _rope_interleaved64(k, 1000)).sum()  # q^T R_1000 k
    bound = (q.double().abs() * k.double().abs()).sum() * 2
    assert abs(score.double() - ref) <= tol * bound


def test_rope_matrix_with_no_positions_and_scalar_kinds():
    """Issue 11: T = 0 failed in torch.stack; position True passed, '0.5' failed in torch.tensor; float64 q with
    float32 k failed in the matmul."""
    assert apply_rope_matrix(torch.zeros(2, 0, 4)).shape == (2, 0, 4)
    # all positions at once (oracle: float64 numpy, each interleaved pair rotated by m theta_j, one position at a time)
    x = np.random.default_rng(0).standard_normal((3, 5, 8))
    ref = x.copy()
    for t in range(5):
        for j in range(4):
            a = (t + 0.5) * 10000.0 ** (-2 * j / 8)
            ref[:, t, 2 * j] = x[:, t, 2 * j] * np.cos(a) - x[:, t, 2 * j + 1] * np.sin(a)
            ref[:, t, 2 * j + 1] = x[:, t, 2 * j] * np.sin(a) + x[:, t, 2 * j + 1] * np.cos(a)
    np.testing.assert_allclose(apply_rope_matrix(torch.from_numpy(x), torch.arange(5) + 0.5).numpy(), ref,
                               rtol=1e-12, atol=1e-12)
    with pytest.raises(TypeError, match=r"position must be a real number, got True \(bool\)"):
        rope_rotation_matrix(True, 4)
    with pytest.raises(TypeError, match=r"position must be a real number, got '0.5' \(str\)"):
        rope_rotation_matrix("0.5", 4)
    q = torch.randn(2, 8)
    with pytest.raises(TypeError, match=r"q \(torch.float64\) and k \(torch.float32\) must share one dtype"):
        rope_relative_score(q.double(), q, 3)
    with pytest.raises(TypeError, match=r"delta must be a real number, got '3' \(str\)"):
        rope_relative_score(q, q, "3")
    torch.testing.assert_close(rope_relative_score(q, q, torch.tensor(3)), rope_relative_score(q, q, 3), rtol=0, atol=0)


# ================================================================= per-pair energy (chapter 4's trained-model section)


def test_pair_energy_is_the_squared_length_of_each_pair_and_rotation_keeps_it():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 3, 5, 8, generator=g, dtype=torch.float64)
    ref = np.zeros((2, 3, 5, 4))
    xn = x.numpy()
    for j in range(4):  # brute force: pair j is channels (j, j + D/2) in the half-split layout
        ref[..., j] = xn[..., j] ** 2 + xn[..., j + 4] ** 2
    np.testing.assert_allclose(rope_pair_energy(x).numpy(), ref, **F64)
    # interleaved pairs (2j, 2j + 1)
    inter = np.stack([xn[..., 0::2] ** 2 + xn[..., 1::2] ** 2], 0)[0]
    np.testing.assert_allclose(rope_pair_energy(x, layout="interleaved").numpy(), inter, **F64)
    # rotated by transformers' apply_rotary_pos_emb at positions 0..4: the energies do not change
    cos, sin, _ = hf_cos_sin(5, 8)
    q_rot, _ = apply_rotary_pos_emb(x.float(), x.float(), cos, sin, unsqueeze_dim=0)
    np.testing.assert_allclose(rope_pair_energy(q_rot).numpy(), ref, rtol=1e-5, atol=1e-5)


def test_pair_energy_low_precision_and_bad_input():
    big = torch.full((4,), 300.0, dtype=torch.float16)  # 300**2 + 300**2 = 180000 > fp16's 65504
    out = rope_pair_energy(big)
    assert out.dtype == torch.float32 and out.tolist() == [180000.0, 180000.0]
    with pytest.raises(ValueError, match="the last dim of x \\(D\\) must be a positive even int"):
        rope_pair_energy(torch.zeros(3))
    assert rope_pair_energy([3, 1, 4, 2]).tolist() == [25.0, 5.0]  # integers and lists become float
    with pytest.raises(TypeError, match="x must be"):
        rope_pair_energy(torch.zeros(4, dtype=torch.complex64))
    with pytest.raises(ValueError, match="layout"):
        rope_pair_energy(torch.zeros(4), layout="paired")
