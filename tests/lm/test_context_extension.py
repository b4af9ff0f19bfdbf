"""Chapter 4, context extension (04.10-04.13) against transformers' RoPE initialisation and torch SDPA.

Oracles: ``transformers.modeling_rope_utils.ROPE_INIT_FUNCTIONS`` (``linear``, ``dynamic``, ``yarn``) with
the same configuration, compared exactly (same float32 recipe) or at ``rtol = 1e-6`` where the order of
operations differs; ``torch.nn.functional.scaled_dot_product_attention`` for attention weights (``1e-6``).
"""

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import LlamaConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from llmbook.lm.context_extension import (
    attention_sink_scores,
    dynamic_ntk_alpha,
    ntk_inv_freq,
    pi_inv_freq,
    position_interpolation,
    rope_scores_by_distance,
    scaled_inv_freq,
    streaming_mask,
    unseen_angle_pairs,
    yarn_inv_freq,
    yarn_ramp,
)
from llmbook.lm.positions import rope_cos_sin, rope_inv_freq


def hf(rope_type, D, base, factor, L_train, seq_len=None, **extra):
    """transformers' inverse frequencies and attention factor for one configuration."""
    params = {"rope_type": rope_type, "rope_theta": base, "factor": factor, **extra}
    max_pos = L_train
    if rope_type == "yarn":
        params["original_max_position_embeddings"] = L_train
        max_pos = int(L_train * factor)
    cfg = LlamaConfig(hidden_size=4 * D, num_attention_heads=4, head_dim=D, max_position_embeddings=max_pos,
                      rope_parameters=params)
    kw = {"seq_len": seq_len} if seq_len is not None else {}
    return ROPE_INIT_FUNCTIONS[rope_type](cfg, "cpu", **kw)


CONFIGS = [(64, 10000.0, 4.0, 2048), (128, 500000.0, 8.0, 8192), (32, 10000.0, 2.0, 512), (128, 10000.0, 16.0, 4096)]


@pytest.mark.equation("04.10", oracle="transformers ROPE_INIT_FUNCTIONS['linear']")
@pytest.mark.parametrize("D, base, factor, L_train", CONFIGS)
def test_position_interpolation_matches_transformers_linear(D, base, factor, L_train):
    inv_ref, a_ref = hf("linear", D, base, factor, L_train)
    inv, a = pi_inv_freq(D, base, factor)
    torch.testing.assert_close(inv, inv_ref, rtol=0, atol=0)
    assert a == a_ref == 1.0
    # dividing the positions is the same as dividing the frequencies
    m = torch.arange(0, int(factor * L_train), 97)
    cos_p, _ = rope_cos_sin(position_interpolation(m, L_train, int(factor * L_train)), D, base)
    cos_f, _ = rope_cos_sin(m, D, inv_freq=inv_ref)
    torch.testing.assert_close(cos_p, cos_f, rtol=1e-4, atol=1e-4)  # float32 angles up to ~3e4 rad


@pytest.mark.equation("04.11", oracle="transformers ROPE_INIT_FUNCTIONS['dynamic'] at seq_len; float64 theta_j * "
                      "alpha^(-2j/(D-2))")
@pytest.mark.parametrize("D, base, factor, L_train", CONFIGS)
def test_ntk_matches_transformers_dynamic_and_the_closed_form(D, base, factor, L_train):
    for seq_len in [L_train // 2, L_train, int(1.5 * L_train), int(factor * L_train)]:
        inv_ref, a_ref = hf("dynamic", D, base, factor, L_train, seq_len=seq_len)
        inv, a = scaled_inv_freq("dynamic", D, base, factor, L_train, seq_len=seq_len)
        torch.testing.assert_close(inv, inv_ref, rtol=1e-6, atol=0)
        assert a == a_ref == 1.0
    alpha = factor
    j = torch.arange(D // 2, dtype=torch.float64)
    closed = base ** (-2 * j / D) * alpha ** (-2 * j / (D - 2))
    torch.testing.assert_close(ntk_inv_freq(D, base, alpha)[0].double(), closed, rtol=1e-6, atol=0)


@pytest.mark.equation("04.12", oracle="transformers ROPE_INIT_FUNCTIONS['yarn']")
@pytest.mark.parametrize("D, base, factor, L_train", CONFIGS)
@pytest.mark.parametrize("beta_fast, beta_slow", [(32, 1), (16, 2)])
def test_yarn_matches_transformers(D, base, factor, L_train, beta_fast, beta_slow):
    inv_ref, a_ref = hf("yarn", D, base, factor, L_train, beta_fast=beta_fast, beta_slow=beta_slow)
    inv, a = yarn_inv_freq(D, base, factor, L_train, beta_fast, beta_slow)
    torch.testing.assert_close(inv, inv_ref, rtol=1e-6, atol=0)
    assert a == pytest.approx(a_ref, rel=1e-12)
    inv_ref, _ = hf("yarn", D, base, factor, L_train, truncate=False)
    torch.testing.assert_close(yarn_inv_freq(D, base, factor, L_train, truncate=False)[0], inv_ref, rtol=1e-6, atol=0)


def test_yarn_keeps_fast_pairs_and_interpolates_slow_ones():
    D, base, factor, L = 128, 10000.0, 8.0, 4096
    ratio = rope_inv_freq(D, base) / yarn_inv_freq(D, base, factor, L)[0]
    r = yarn_ramp(D, base, L)
    assert torch.all(ratio[r == 0] == 1.0) and torch.allclose(ratio[r == 1], torch.tensor(factor))
    assert torch.all(ratio[1:] >= ratio[:-1])


def test_scaling_methods_bring_every_pair_back_in_distribution_except_none():
    D, base, factor, L = 128, 10000.0, 8.0, 4096
    unseen = {m: int(unseen_angle_pairs(scaled_inv_freq(m, D, base, factor, L)[0], L, int(factor * L)).sum())
              for m in ["none", "pi", "ntk", "yarn"]}
    assert unseen["none"] > 0 and unseen["pi"] == 0 and unseen["yarn"] == 0
    assert unseen["ntk"] < unseen["none"]


@given(seed=st.integers(0, 1000), factor=st.sampled_from([2.0, 4.0, 8.0]))
@settings(max_examples=20, deadline=None, derandomize=True)
def test_pi_scores_are_the_trained_curve_stretched(seed, factor):
    g = torch.Generator().manual_seed(seed)
    q, k = torch.randn(32, generator=g), torch.randn(32, generator=g)
    d = torch.arange(0, 512, 8)
    stretched = rope_scores_by_distance(q, k, d * factor, pi_inv_freq(32, factor=factor)[0])
    torch.testing.assert_close(stretched, rope_scores_by_distance(q, k, d), rtol=1e-4, atol=1e-4)


def test_context_extension_bad_input():
    with pytest.raises(ValueError, match="factor must lie"):
        pi_inv_freq(8, factor=0.5)
    with pytest.raises(ValueError, match="method must be one of"):
        scaled_inv_freq("rope2", 8)
    with pytest.raises(ValueError, match=r"D must be an int > 2 \(NTK.s exponent is D/\(D-2\)\), got 2"):
        ntk_inv_freq(2, alpha=2.0)
    with pytest.raises(ValueError, match="L_train"):
        position_interpolation(torch.arange(3), 0, 8)
    assert dynamic_ntk_alpha(100, 2048, 4.0) == 1.0


# ================================================================= 04.13 attention sink


@pytest.mark.equation("04.13", oracle="torch.nn.functional.scaled_dot_product_attention with V = identity")
@pytest.mark.parametrize("causal", [True, False])
def test_attention_weights_match_sdpa(causal):
    B, H, T, D = 2, 3, 10, 16
    q, k = torch.randn(B, H, T, D), torch.randn(B, H, T, D)
    alpha, sink = attention_sink_scores(q, k, n_sink=2, causal=causal)
    eye = torch.eye(T).expand(B, H, T, T)
    ref = F.scaled_dot_product_attention(q, k, eye, is_causal=causal)
    torch.testing.assert_close(alpha, ref, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(sink, ref[..., :2].sum(-1), rtol=1e-6, atol=1e-6)


def test_a_key_aligned_with_every_query_becomes_a_sink():
    g = torch.Generator().manual_seed(0)
    T, D = 64, 32
    u = torch.randn(D, generator=g)
    u = u / u.norm()
    q = torch.randn(T, D, generator=g) + 3 * u  # every query shares a direction ...
    k = torch.randn(T, D, generator=g)
    k[0] = 4 * math.sqrt(D) * u  # ... and the first key points along it
    _, sink = attention_sink_scores(q, k)
    assert sink[-1] > 0.9
    with pytest.raises(ValueError, match="n_sink"):
        attention_sink_scores(q, k, n_sink=T + 1)
    m = streaming_mask(T, n_sink=4, window=8)
    assert m[:, :4].tril().equal(torch.ones(T, 4, dtype=torch.bool).tril()) and m.sum(-1).max() == 12


@pytest.mark.parametrize(
    "call, exc, match",
    [
        # issue 11: streaming_mask(2.5) was accepted
        (lambda: streaming_mask(2.5), TypeError, r"T must be a non-negative int, got 2.5 \(float\)"),
        (lambda: streaming_mask(True), TypeError, r"T must be a non-negative int, got True \(bool\)"),
        (lambda: streaming_mask(8, n_sink=-1), ValueError, r"n_sink must be a non-negative int, got -1"),
        (lambda: streaming_mask(8, window=0), ValueError, r"window must be a positive int, got 0"),
        (lambda: streaming_mask(8, window="4"), TypeError, r"window must be a positive int, got '4' \(str\)"),
        (lambda: attention_sink_scores(torch.zeros(3, 2), torch.zeros(3, 2), n_sink=1.0), TypeError,
         r"n_sink must be an int in \[0, T_k\] = \[0, 3\], got 1.0 \(float\)"),
        (lambda: attention_sink_scores(torch.zeros(3, 2), torch.zeros(3, 2), n_sink=4), ValueError,
         r"n_sink must be an int in \[0, T_k\] = \[0, 3\], got 4"),
        (lambda: position_interpolation(torch.arange(4), 2048.0, 4096), TypeError,
         r"L_train must be a positive int, got 2048.0 \(float\)"),
        (lambda: position_interpolation(torch.arange(4), 2048, 0), ValueError,
         r"L_target must be a positive int, got 0"),
        (lambda: dynamic_ntk_alpha(True, 2048, 2.0), TypeError, r"seq_len must be a positive int, got True \(bool\)"),
    ],
)
def test_integer_arguments_reject_other_kinds(call, exc, match):
    with pytest.raises(exc, match=match):
        call()


def test_streaming_mask_accepts_numpy_integers():
    np = pytest.importorskip("numpy")
    # oracle: the same call with Python ints
    assert torch.equal(streaming_mask(np.int64(6), np.int32(1), np.int64(2)), streaming_mask(6, 1, 2))


# ============================================ YaRN argument contracts, attention sink in fp16 (issue 11)


def test_yarn_rejects_swapped_betas_zero_beta_and_base_at_most_one():
    with pytest.raises(ValueError, match=r"beta_fast \(1\) must be greater than beta_slow \(32\)"):
        yarn_inv_freq(128, 1e4, 4.0, 4096, beta_fast=1, beta_slow=32)
    with pytest.raises(ValueError, match=r"beta_fast \(2\) must be greater than beta_slow \(2\)"):
        yarn_ramp(128, 1e4, 4096, beta_fast=2, beta_slow=2)
    with pytest.raises(ValueError, match="base must lie in"):
        yarn_ramp(8, 1.0, 64)
    with pytest.raises(ValueError, match="base must lie in"):
        yarn_inv_freq(8, 0.5, 2.0, 64)
    with pytest.raises(ValueError, match="beta_slow must lie in"):
        yarn_ramp(8, 1e4, 64, beta_slow=0)
    with pytest.raises(ValueError, match="beta_fast must lie in"):
        yarn_ramp(8, 1e4, 64, beta_fast=math.inf)


@pytest.mark.parametrize("dtype, tol", [(torch.float16, 2e-3), (torch.bfloat16, 1.6e-2)])
def test_attention_sink_scores_in_half_precision_match_float64(dtype, tol):
    g = torch.Generator().manual_seed(0)
    q, k = (torch.randn(2, 5, 64, generator=g) * 40).to(dtype), (torch.randn(2, 7, 64, generator=g) * 40).to(dtype)
    alpha, sink = attention_sink_scores(q, k, n_sink=2)
    assert alpha.dtype == sink.dtype == dtype and torch.isfinite(alpha).all()
    mask = torch.ones(5, 7, dtype=torch.bool).tril(diagonal=2)  # queries are the last 5 of 7 keys
    ref = torch.softmax((q.double() @ k.double().mT / 8).masked_fill(~mask, -math.inf), -1)
    torch.testing.assert_close(alpha.double(), ref, rtol=tol, atol=tol)
    torch.testing.assert_close(sink.double(), ref[..., :2].sum(-1), rtol=tol, atol=tol)


def test_context_extension_scalars_are_checked():
    """Issue 11: YaRN's attention_factor, NTK's base and D took bools, strings, NaN, 0 and inf silently."""
    for bad, err, text in [(True, TypeError, r"attention_factor must be a real number, got True \(bool\)"),
                           ("0.5", TypeError, r"attention_factor must be a real number, got '0.5' \(str\)"),
                           (math.nan, ValueError, "attention_factor must be a real number, got nan"),
                           (0.0, ValueError, r"attention_factor must lie in \(0.0, inf\), got 0.0"),
                           (math.inf, ValueError, r"attention_factor must lie in \(0.0, inf\), got inf")]:
        with pytest.raises(err, match=text):
            yarn_inv_freq(8, 1e4, 4.0, 64, beta_fast=4, beta_slow=1, attention_factor=bad)
        with pytest.raises(err, match=text):
            rope_scores_by_distance(torch.ones(4), torch.ones(4), torch.arange(3), attention_factor=bad)
    assert yarn_inv_freq(8, 1e4, 4.0, 64, beta_fast=4, beta_slow=1, attention_factor=2)[1] == 2.0
    with pytest.raises(TypeError, match=r"base must be a real number, got True \(bool\)"):
        ntk_inv_freq(8, True, 2.0)
    with pytest.raises(ValueError, match=r"base must lie in \(1.0, inf\), got 1"):
        ntk_inv_freq(8, 1, 2.0)  # base * alpha^(D/(D-2)) > 1 would have hidden it
    with pytest.raises(TypeError, match=r"D must be an int > 2 .*, got '0.5' \(str\)"):
        ntk_inv_freq("0.5", 1e4, 2.0)


def test_attention_sink_scores_and_interpolation_reject_bad_kinds():
    """Issue 11: float64 q with float32 k crashed in the matmul, D = 0 gave NaN (0 / sqrt(0)), bool positions passed."""
    q = torch.randn(5, 4)
    with pytest.raises(TypeError, match=r"q \(torch.float64\) and k \(torch.float32\) must share one dtype"):
        attention_sink_scores(q.double(), q)
    with pytest.raises(ValueError, match=r"q must not be empty along dim -1, got shape \(5, 0\)"):
        attention_sink_scores(torch.zeros(5, 0), torch.zeros(5, 0))
    with pytest.raises(TypeError, match="positions must be a real floating-point tensor, got dtype torch.bool"):
        position_interpolation(torch.tensor([True, False]), 2048, 8192)
