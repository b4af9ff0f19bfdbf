"""Chapter 4, score biases (04.06 ALiBi, 04.07 T5) against transformers' BLOOM and T5 code.

Tolerances: float32 ``rtol = atol = 1e-6`` for slopes and softmax outputs; bucket ids exactly.
"""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import T5Config
from transformers.models.bloom.modeling_bloom import build_alibi_tensor
from transformers.models.t5.modeling_t5 import T5Attention

from llmbook.lm.position_bias import T5RelativeBias, alibi_bias, alibi_slopes, t5_relative_position_bucket

F32 = dict(rtol=1e-6, atol=1e-6)


# ================================================================= 04.06 ALiBi


@pytest.mark.equation("04.06", oracle="transformers.models.bloom.modeling_bloom.build_alibi_tensor")
@pytest.mark.parametrize("H", [1, 2, 4, 5, 6, 8, 12, 16, 20, 24, 32])
def test_alibi_slopes_match_bloom_for_any_head_count(H):
    bloom = build_alibi_tensor(torch.ones(1, 3, dtype=torch.long), H, torch.float32)  # (H, 1, 3): slope * key_pos
    torch.testing.assert_close(alibi_slopes(H), bloom[:, 0, 1], **F32)
    if H & (H - 1) == 0:  # a power of two: exactly 2^(-8h/H)
        torch.testing.assert_close(alibi_slopes(H), torch.tensor([2.0 ** (-8 * h / H) for h in range(1, H + 1)]),
                                   **F32)


@pytest.mark.equation("04.06", oracle="softmax with transformers' BLOOM alibi tensor under a causal mask")
def test_alibi_attention_equals_bloom_after_softmax():
    H, T, D = 6, 9, 8
    q, k = torch.randn(H, T, D), torch.randn(H, T, D)
    scores = q @ k.transpose(-1, -2) / math.sqrt(D)
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    ours = torch.softmax((scores + alibi_bias(T, H)).masked_fill(~causal, -math.inf), -1)
    # BLOOM adds m_h * j (key position only): it differs from -m_h (i - j) by m_h * i, constant along a row
    bloom = build_alibi_tensor(torch.ones(1, T, dtype=torch.long), H, torch.float32)  # (H, 1, T)
    ref = torch.softmax((scores + bloom).masked_fill(~causal, -math.inf), -1)
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-6)
    # decoding with a cache: the last query row of the full bias
    torch.testing.assert_close(alibi_bias(1, H, T_k=T), alibi_bias(T, H)[:, -1:], rtol=0, atol=0)


def test_alibi_bad_input():
    with pytest.raises(ValueError, match=r"H \(the number of heads\) must be a positive int, got 0"):
        alibi_slopes(0)
    with pytest.raises(ValueError, match=r"slopes must have shape \(H,\)"):
        alibi_bias(4, 3, torch.ones(2))
    with pytest.raises(ValueError, match="T_k"):
        alibi_bias(5, 2, T_k=3)


# ================================================================= 04.07 T5


@pytest.mark.equation("04.07", oracle="transformers T5Attention._relative_position_bucket")
@pytest.mark.parametrize("bidirectional", [True, False])
@pytest.mark.parametrize("num_buckets, max_distance", [(32, 128), (8, 16), (64, 512), (6, 20)])
def test_t5_buckets_match_transformers(bidirectional, num_buckets, max_distance):
    rel = torch.arange(-1000, 1001)
    ref = T5Attention._relative_position_bucket(rel, bidirectional, num_buckets, max_distance)
    assert torch.equal(t5_relative_position_bucket(rel, bidirectional, num_buckets, max_distance), ref)


@pytest.mark.equation("04.07", oracle="transformers T5Attention.compute_bias (copied embedding)")
@pytest.mark.parametrize("is_decoder", [False, True])
def test_t5_bias_matches_transformers_compute_bias(is_decoder):
    cfg = T5Config(d_model=16, d_kv=4, num_heads=4, relative_attention_num_buckets=32,
                   relative_attention_max_distance=128, is_decoder=is_decoder)
    ref = T5Attention(cfg, has_relative_attention_bias=True)
    ours = T5RelativeBias(4, 32, 128, bidirectional=not is_decoder)
    with torch.no_grad():
        ours.relative_attention_bias.weight.copy_(ref.relative_attention_bias.weight)
    torch.testing.assert_close(ours(7, 300), ref.compute_bias(7, 300), rtol=0, atol=0)
    torch.testing.assert_close(ours(1, 300, offset=299), ref.compute_bias(1, 300, past_seen_tokens=299),
                               rtol=0, atol=0)


@given(rel=st.lists(st.integers(-10_000, 10_000), min_size=1, max_size=50), bidirectional=st.booleans())
@settings(max_examples=60, deadline=None, derandomize=True)
def test_t5_buckets_are_in_range_and_monotone_in_distance(rel, bidirectional):
    r = torch.tensor(sorted(rel))
    b = t5_relative_position_bucket(r, bidirectional, 32, 128)
    assert b.min() >= 0 and b.max() < 32
    past = r <= 0  # farther into the past never maps to a smaller bucket
    bp = b[past].flip(0)
    assert torch.all(bp[1:] >= bp[:-1])


def test_t5_bad_input():
    with pytest.raises(TypeError, match="integer"):
        t5_relative_position_bucket(torch.tensor([1.0]))
    with pytest.raises(ValueError, match="max_distance"):
        t5_relative_position_bucket(torch.tensor([1]), num_buckets=32, max_distance=4)
    with pytest.raises(TypeError, match=r"relative_position must be an integer tensor, got dtype torch.bool"):
        t5_relative_position_bucket(torch.tensor([True]))
    with pytest.raises(TypeError, match=r"num_buckets must be a positive int, got 8.0 \(float\)"):
        t5_relative_position_bucket(torch.tensor([1]), num_buckets=8.0)


@pytest.mark.parametrize(
    "call, exc, match",
    [
        # issue 11: T5RelativeBias with T_q = -1 failed inside torch
        (lambda: T5RelativeBias(H=2)(-1, 3), ValueError, r"T_q must be a non-negative int, got -1"),
        (lambda: T5RelativeBias(H=2)(3, 2.5), TypeError, r"T_k must be a non-negative int, got 2.5 \(float\)"),
        (lambda: T5RelativeBias(H=2)(3, 3, offset=-2), ValueError, r"offset must be a non-negative int, got -2"),
        (lambda: T5RelativeBias(H=0), ValueError, r"H must be a positive int, got 0"),
        (lambda: T5RelativeBias(H=2, num_buckets=32, max_distance=4), ValueError, r"max_distance \(4\) must exceed"),
    ],
)
def test_t5_module_bad_input(call, exc, match):
    with pytest.raises(exc, match=match):
        call()


@pytest.mark.parametrize(
    "call, exc, match",
    [
        # issue 11: alibi_bias(2.5, ...) was accepted
        (lambda: alibi_bias(2.5, 2), TypeError, r"T must be a non-negative int, got 2.5 \(float\)"),
        (lambda: alibi_bias(True, 2), TypeError, r"T must be a non-negative int, got True \(bool\)"),
        (lambda: alibi_bias("3", 2), TypeError, r"T must be a non-negative int, got '3' \(str\)"),
        (lambda: alibi_bias(3, 2.0), TypeError, r"H must be a positive int, got 2.0 \(float\)"),
        (lambda: alibi_bias(3, 2, T_k=4.0), TypeError, r"T_k must be a non-negative int, got 4.0 \(float\)"),
        (lambda: alibi_bias(-1, 2), ValueError, r"T must be a non-negative int, got -1"),
        (lambda: alibi_slopes(True), TypeError, r"H \(the number of heads\) must be a positive int, got True"),
    ],
)
def test_alibi_rejects_non_integer_sizes(call, exc, match):
    with pytest.raises(exc, match=match):
        call()
