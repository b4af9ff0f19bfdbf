"""Chapter 3, exact attention (ids 03.01-03.06) against independent oracles, plus claim C04.

Oracles: ``torch.nn.functional.scaled_dot_product_attention`` (with ``is_causal``, ``attn_mask`` and
``enable_gqa``), ``torch.nn.attention.bias.causal_lower_right``, ``torch.nn.MultiheadAttention`` with
copied weights, ``transformers``' ``LlamaAttention`` and ``repeat_kv``, ``torch.autograd`` Jacobians.

Tolerances, stated once: float32 against a torch oracle ``rtol = atol = 1e-5`` (``F32``); float64
``rtol = atol = 1e-12`` (``F64``).
"""

import importlib.util
import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.nn.attention.bias import causal_lower_right
from transformers import LlamaConfig
from transformers.models.llama import modeling_llama

from llmbook.lm.attention import (
    CrossAttention,
    GroupedQueryAttention,
    MultiHeadAttention,
    MultiQueryAttention,
    causal_mask,
    masked_softmax,
    repeat_kv,
    scaled_dot_product_attention,
    softmax_jacobian,
)
from tests.try_it import assert_states

F32 = dict(rtol=1e-5, atol=1e-5)
F64 = dict(rtol=1e-12, atol=1e-12)
SETTINGS = settings(max_examples=40, deadline=None, derandomize=True)


def qkv(B=2, H=4, T_q=5, T_k=7, D=8, D_v=None, H_kv=None, dtype=torch.float32):
    H_kv = H if H_kv is None else H_kv
    return (torch.randn(B, H, T_q, D, dtype=dtype), torch.randn(B, H_kv, T_k, D, dtype=dtype),
            torch.randn(B, H_kv, T_k, D if D_v is None else D_v, dtype=dtype))


# ================================================================= 03.01 scaled dot-product


@pytest.mark.equation("03.01", oracle="torch.nn.functional.scaled_dot_product_attention")
@pytest.mark.parametrize("T_q, T_k, D, D_v, scale", [(5, 7, 8, 8, None), (1, 9, 16, 4, None), (6, 6, 4, 4, 0.3)])
def test_sdpa_matches_torch(T_q, T_k, D, D_v, scale):
    q, k, v = qkv(T_q=T_q, T_k=T_k, D=D, D_v=D_v)
    ref = F.scaled_dot_product_attention(q, k, v, scale=scale)
    torch.testing.assert_close(scaled_dot_product_attention(q, k, v, scale=scale), ref, **F32)
    # head-less (B, T, D) inputs
    torch.testing.assert_close(scaled_dot_product_attention(q[:, 0], k[:, 0], v[:, 0], scale=scale), ref[:, 0], **F32)
    # boolean mask, True = attend (every row keeps key 0), and an additive float mask
    allowed = torch.rand(2, 1, T_q, T_k) > 0.4
    allowed[..., 0] = True
    torch.testing.assert_close(scaled_dot_product_attention(q, k, v, mask=allowed, scale=scale),
                               F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=scale), **F32)
    bias = torch.randn(T_q, T_k)
    torch.testing.assert_close(scaled_dot_product_attention(q, k, v, mask=bias, scale=scale),
                               F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=scale), **F32)


@pytest.mark.equation("03.01", oracle="torch.softmax of Q K^T / sqrt(d_k) in float64")
def test_sdpa_weights_float64():
    q, k, v = qkv(dtype=torch.float64)
    out, w = scaled_dot_product_attention(q, k, v, return_weights=True)
    ref_w = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1]), dim=-1)
    torch.testing.assert_close(w, ref_w, **F64)
    torch.testing.assert_close(out, ref_w @ v, **F64)


@pytest.mark.equation("03.01", oracle="convexity: rows of softmax weights are distributions (math.fsum)")
@SETTINGS
@given(st.integers(1, 6), st.integers(1, 6), st.integers(1, 5), st.floats(0.1, 30.0))
def test_sdpa_output_is_a_convex_combination(T_q, T_k, D, spread):
    g = torch.Generator().manual_seed(T_q * 100 + T_k * 10 + D)
    q = torch.randn(1, 2, T_q, D, generator=g, dtype=torch.float64) * spread
    k = torch.randn(1, 2, T_k, D, generator=g, dtype=torch.float64) * spread
    v = torch.randn(1, 2, T_k, 3, generator=g, dtype=torch.float64)
    out, w = scaled_dot_product_attention(q, k, v, return_weights=True)
    assert (w >= 0).all()
    assert all(math.fsum(r) == pytest.approx(1.0, abs=1e-12) for r in w.reshape(-1, T_k).tolist())
    lo, hi = v.amin(-2, keepdim=True), v.amax(-2, keepdim=True)
    assert (out >= lo - 1e-12).all() and (out <= hi + 1e-12).all()


# ================================================================= 03.02 causal masking


@pytest.mark.equation("03.02", oracle="torch.nn.functional.scaled_dot_product_attention(is_causal=True)")
@pytest.mark.parametrize("T", [1, 4, 13])
def test_causal_matches_torch(T):
    q, k, v = qkv(T_q=T, T_k=T)
    ours = scaled_dot_product_attention(q, k, v, is_causal=True)
    torch.testing.assert_close(ours, F.scaled_dot_product_attention(q, k, v, is_causal=True), **F32)
    # the additive form of the catalogue: M_ij = 0 for j <= i, -inf for j > i
    M = torch.zeros(T, T).masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
    torch.testing.assert_close(ours, F.scaled_dot_product_attention(q, k, v, attn_mask=M), **F32)


@pytest.mark.equation("03.02", oracle="torch.nn.attention.bias.causal_lower_right with F.scaled_dot_product_attention")
@pytest.mark.parametrize("T_q, T_k", [(1, 9), (3, 8), (7, 4)])
def test_causal_is_bottom_right_aligned(T_q, T_k):
    q, k, v = qkv(T_q=T_q, T_k=T_k)
    ref_mask = torch.ones(T_q, T_k, dtype=torch.bool).tril(T_k - T_q)
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=ref_mask)  # rows with no key: zeros
    torch.testing.assert_close(scaled_dot_product_attention(q, k, v, is_causal=True), ref, **F32)
    assert torch.equal(causal_mask(T_q, T_k), ref_mask)
    if T_q <= T_k:
        ref2 = F.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(T_q, T_k))
        torch.testing.assert_close(scaled_dot_product_attention(q, k, v, is_causal=True), ref2, **F32)
    else:  # the first T_q - T_k queries see nothing: zero output and zero weights
        out, w = scaled_dot_product_attention(q, k, v, is_causal=True, return_weights=True)
        assert (out[:, :, : T_q - T_k] == 0).all() and (w[:, :, : T_q - T_k] == 0).all()


@pytest.mark.equation("03.02", oracle="F.scaled_dot_product_attention with the AND of causal and padding masks")
def test_causal_combines_with_padding_mask():
    q, k, v = qkv(T_q=6, T_k=6)
    pad = torch.ones(2, 1, 1, 6, dtype=torch.bool)
    pad[1, ..., 4:] = False  # second sequence has two padding positions
    both = pad & torch.ones(6, 6, dtype=torch.bool).tril()
    torch.testing.assert_close(scaled_dot_product_attention(q, k, v, mask=pad, is_causal=True),
                               F.scaled_dot_product_attention(q, k, v, attn_mask=both), **F32)


@pytest.mark.equation("03.02", oracle="invariance: outputs before t do not change when tokens after t change")
def test_causal_no_peeking():
    q, k, v = qkv(T_q=8, T_k=8, dtype=torch.float64)
    out = scaled_dot_product_attention(q, k, v, is_causal=True)
    k2, v2 = k.clone(), v.clone()
    k2[:, :, 5:] += 10 * torch.randn_like(k2[:, :, 5:])
    v2[:, :, 5:] -= 3.0
    out2 = scaled_dot_product_attention(q, k2, v2, is_causal=True)
    torch.testing.assert_close(out[:, :, :5], out2[:, :, :5], **F64)
    assert not torch.allclose(out[:, :, 5:], out2[:, :, 5:])


def test_masked_softmax_fully_masked_row_is_zero():
    w = masked_softmax(torch.randn(2, 3), torch.tensor([[True, False, True], [False, False, False]]))
    assert w[1].eq(0).all() and w[0, 1] == 0
    assert w[0].sum().item() == pytest.approx(1.0, abs=1e-6)


# ================================================================= 03.03-03.06 multi-head family


def copy_to_torch_mha(mha: MultiHeadAttention) -> nn.MultiheadAttention:
    bias = mha.q_proj.bias is not None
    ref = nn.MultiheadAttention(mha.d_model, mha.n_heads, bias=bias, batch_first=True)
    with torch.no_grad():
        ref.in_proj_weight.copy_(torch.cat([mha.q_proj.weight, mha.k_proj.weight, mha.v_proj.weight]))
        ref.out_proj.weight.copy_(mha.o_proj.weight)
        if bias:
            ref.in_proj_bias.copy_(torch.cat([mha.q_proj.bias, mha.k_proj.bias, mha.v_proj.bias]))
            ref.out_proj.bias.copy_(mha.o_proj.bias)
    return ref.eval()


@pytest.mark.equation("03.03", oracle="torch.nn.MultiheadAttention with copied weights")
@pytest.mark.parametrize("bias", [False, True])
def test_mha_matches_torch_module(bias):
    mha = MultiHeadAttention(d_model=32, n_heads=4, bias=bias).eval()
    for p in mha.parameters():  # non-zero biases too
        nn.init.normal_(p, std=0.3)
    ref = copy_to_torch_mha(mha)
    x = torch.randn(3, 9, 32)
    with torch.no_grad():
        torch.testing.assert_close(mha(x), ref(x, x, x, need_weights=False)[0], **F32)
        # causal: nn.MultiheadAttention's boolean mask means BLOCKED, ours (like SDPA's) means ATTEND
        attend = torch.ones(9, 9, dtype=torch.bool).tril()
        expected = ref(x, x, x, attn_mask=~attend, need_weights=False)[0]
        torch.testing.assert_close(mha(x, is_causal=True), expected, **F32)
        torch.testing.assert_close(mha(x, mask=attend), expected, **F32)


@pytest.mark.equation("03.04", oracle="torch.nn.MultiheadAttention(query=x, key=value=context), copied weights")
def test_cross_attention_matches_torch_module():
    xattn = CrossAttention(d_model=16, n_heads=2).eval()
    ref = copy_to_torch_mha(xattn)
    x, context = torch.randn(2, 5, 16), torch.randn(2, 11, 16)
    keep = torch.ones(2, 11, dtype=torch.bool)
    keep[0, 8:] = False  # padded context positions
    with torch.no_grad():
        torch.testing.assert_close(xattn(x, context), ref(x, context, context, need_weights=False)[0], **F32)
        ours = xattn(x, context, mask=keep[:, None, None, :])
        theirs = ref(x, context, context, key_padding_mask=~keep, need_weights=False)[0]
        torch.testing.assert_close(ours, theirs, **F32)
        # the base class reaches the same result through context=
        torch.testing.assert_close(MultiHeadAttention.forward(xattn, x, context=context), xattn(x, context), **F32)


def sdpa_from_weights(mod, x, is_causal):
    """Project with F.linear and the module's weights, then torch's SDPA with enable_gqa."""
    B, T, _ = x.shape
    D = mod.head_dim
    q = F.linear(x, mod.q_proj.weight).view(B, T, -1, D).transpose(1, 2)
    k = F.linear(x, mod.k_proj.weight).view(B, T, -1, D).transpose(1, 2)
    v = F.linear(x, mod.v_proj.weight).view(B, T, -1, D).transpose(1, 2)
    o = F.scaled_dot_product_attention(q, k, v, is_causal=is_causal, enable_gqa=True)
    return F.linear(o.transpose(1, 2).reshape(B, T, -1), mod.o_proj.weight)


def llama_reference(mod, n_kv_heads):
    config = LlamaConfig(hidden_size=mod.d_model, num_attention_heads=mod.n_heads, num_key_value_heads=n_kv_heads,
                         head_dim=mod.head_dim, attention_bias=False)
    config._attn_implementation = "eager"
    ref = modeling_llama.LlamaAttention(config, layer_idx=0).eval()
    ref.load_state_dict({k: v for k, v in mod.state_dict().items()})
    return ref, config


def run_llama(ref, x, cos, sin):
    T = x.shape[1]
    causal = torch.zeros(T, T).masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
    return ref(x, position_embeddings=(cos.unsqueeze(0), sin.unsqueeze(0)), attention_mask=causal[None, None])[0]


@pytest.mark.equation("03.05", oracle="F.scaled_dot_product_attention(enable_gqa=True); transformers LlamaAttention")
def test_mqa_matches_torch_and_llama():
    mqa = MultiQueryAttention(d_model=32, n_heads=4).eval()
    assert mqa.n_kv_heads == 1 and mqa.k_proj.weight.shape == (8, 32)
    x = torch.randn(2, 7, 32)
    with torch.no_grad():
        torch.testing.assert_close(mqa(x, is_causal=True), sdpa_from_weights(mqa, x, True), **F32)
        ref, _ = llama_reference(mqa, 1)
        ones, zeros = torch.ones(7, mqa.head_dim), torch.zeros(7, mqa.head_dim)  # RoPE at angle 0: identity
        torch.testing.assert_close(mqa(x, is_causal=True), run_llama(ref, x, ones, zeros), **F32)


@pytest.mark.equation("03.06", oracle="F.scaled_dot_product_attention(enable_gqa=True); transformers LlamaAttention")
@pytest.mark.parametrize("n_heads, n_kv_heads", [(4, 2), (6, 3), (4, 4)])
def test_gqa_matches_torch_and_llama(n_heads, n_kv_heads):
    gqa = GroupedQueryAttention(d_model=8 * n_heads, n_heads=n_heads, n_kv_heads=n_kv_heads).eval()
    x = torch.randn(2, 6, 8 * n_heads)
    with torch.no_grad():
        for causal in (False, True):
            torch.testing.assert_close(gqa(x, is_causal=causal), sdpa_from_weights(gqa, x, causal), **F32)
        ref, _ = llama_reference(gqa, n_kv_heads)
        ones, zeros = torch.ones(6, 8), torch.zeros(6, 8)
        torch.testing.assert_close(gqa(x, is_causal=True), run_llama(ref, x, ones, zeros), **F32)


@pytest.mark.equation("03.06", oracle="F.scaled_dot_product_attention(enable_gqa=True) on raw q, k, v")
def test_sdpa_grouped_heads_match_torch():
    q, k, v = qkv(H=6, H_kv=2, T_q=5, T_k=5)
    for causal in (False, True):
        torch.testing.assert_close(scaled_dot_product_attention(q, k, v, is_causal=causal),
                                   F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True), **F32)


def test_repeat_kv_matches_transformers():
    x = torch.randn(2, 3, 5, 4)
    assert torch.equal(repeat_kv(x, 4), modeling_llama.repeat_kv(x, 4))


@pytest.mark.skipif(importlib.util.find_spec("llmbook.lm.positions") is None,
                    reason="llmbook.lm.positions (apply_rope) is not written yet")
@pytest.mark.equation("03.06", oracle="transformers LlamaAttention with LlamaRotaryEmbedding (RoPE)")
def test_gqa_with_rope_matches_llama():
    gqa = GroupedQueryAttention(d_model=32, n_heads=4, n_kv_heads=2).eval()
    ref, config = llama_reference(gqa, 2)
    x = torch.randn(2, 6, 32)
    cos, sin = modeling_llama.LlamaRotaryEmbedding(config)(x, torch.arange(6)[None])
    with torch.no_grad():
        torch.testing.assert_close(gqa(x, is_causal=True, rope=(cos[0], sin[0])), run_llama(ref, x, cos[0], sin[0]),
                                   **F32)


def test_dropout_only_in_training():
    mha = MultiHeadAttention(16, 2, dropout=0.5)
    x = torch.randn(1, 6, 16)
    with torch.no_grad():
        mha.eval()
        a, b = mha(x), mha(x)
        mha.train()
        c = mha(x)
    assert torch.equal(a, b) and not torch.allclose(a, c)


# ================================================================= bad input


def test_bad_inputs_are_rejected():
    q, k, v = qkv()
    with pytest.raises(ValueError, match="must divide H"):
        scaled_dot_product_attention(q, k[:, :3], v[:, :3])
    with pytest.raises(ValueError, match="head width"):
        scaled_dot_product_attention(q, k[..., :4], v)
    with pytest.raises(ValueError, match="agree on H_kv and T_k"):
        scaled_dot_product_attention(q, k, v[:, :, :3])
    with pytest.raises(ValueError, match="all have shape"):
        scaled_dot_product_attention(q[0], k, v)
    with pytest.raises(ValueError, match="contains NaN"):
        scaled_dot_product_attention(q.masked_fill(q > 1, float("nan")), k, v)
    with pytest.raises(ValueError, match="must not be empty"):
        scaled_dot_product_attention(q[:0], k[:0], v[:0])
    with pytest.raises(TypeError, match="share one dtype"):
        scaled_dot_product_attention(q.double(), k, v)
    with pytest.raises(ValueError, match="must broadcast"):
        scaled_dot_product_attention(q, k, v, mask=torch.ones(3, 3, dtype=torch.bool))
    with pytest.raises(TypeError, match="bool"):
        scaled_dot_product_attention(q, k, v, mask=torch.ones(5, 7, dtype=torch.long))
    with pytest.raises(ValueError, match=r"scale must lie in \(0.0, inf\), got -1.0"):
        scaled_dot_product_attention(q, k, v, scale=-1.0)
    with pytest.raises(TypeError, match=r"scale must be a real number, got '0.5' \(str\)"):
        scaled_dot_product_attention(q, k, v, scale="0.5")
    with pytest.raises(ValueError, match=r"scale must lie in \(0.0, inf\), got inf"):
        scaled_dot_product_attention(q, k, v, scale=float("inf"))
    with pytest.raises(ValueError, match=r"d_model \(30\) must be divisible by n_heads \(4\)"):
        MultiHeadAttention(30, 4)
    with pytest.raises(ValueError, match=r"n_heads \(4\) must be divisible by n_kv_heads \(3\)"):
        MultiHeadAttention(32, 4, n_kv_heads=3)
    with pytest.raises(ValueError, match="x must have shape"):
        MultiHeadAttention(32, 4)(torch.randn(2, 5, 16))
    with pytest.raises(ValueError, match="context must have shape"):
        MultiHeadAttention(32, 4)(torch.randn(2, 5, 32), context=torch.randn(3, 5, 32))
    with pytest.raises(ValueError, match="needs a context"):
        CrossAttention(32, 4)(torch.randn(2, 5, 32), None)
    with pytest.raises(ValueError, match="positive int"):
        causal_mask(0)


# ================================================================= claim C04: the 1/sqrt(d_k) scale


@pytest.mark.equation("03.01", oracle="torch.autograd.functional.jacobian of torch.softmax")
def test_softmax_jacobian_matches_autograd():
    z = torch.randn(6, dtype=torch.float64)
    a = torch.softmax(z, -1)
    J = softmax_jacobian(a)
    torch.testing.assert_close(J, torch.autograd.functional.jacobian(lambda t: torch.softmax(t, -1), z), **F64)
    torch.testing.assert_close(J, J.T, **F64)  # symmetric
    torch.testing.assert_close(J @ torch.ones(6, dtype=torch.float64), torch.zeros(6, dtype=torch.float64), **F64)
    # the null space is exactly the ones vector: rank N - 1 for a softmax with full support
    assert torch.linalg.matrix_rank(J).item() == 5


def test_claim_c04_variance_of_dot_product_is_d_k():
    """Var(q.k) = d_k for unit-variance q, k. N = 20000 samples: relative standard error of the sample
    variance is sqrt((2 + 6/d_k)/N) < 0.012, so a 6 % band is a 5-sigma test."""
    g = torch.Generator().manual_seed(4)
    for d_k in (16, 64, 256):
        q = torch.randn(20_000, d_k, generator=g, dtype=torch.float64)
        k = torch.randn(20_000, d_k, generator=g, dtype=torch.float64)
        var = (q * k).sum(-1).var().item()
        assert var / d_k == pytest.approx(1.0, rel=0.06), (d_k, var)
        assert ((q * k).sum(-1) / math.sqrt(d_k)).var().item() == pytest.approx(1.0, rel=0.06)


def test_claim_c04_unscaled_softmax_saturates_and_its_jacobian_collapses():
    """Median Frobenius norm of the softmax Jacobian over 64 keys: unscaled scores saturate as d_k grows
    (the median query puts > 99 % of its weight on one key at d_k = 1024), scaled scores keep the same
    distribution (Var = 1) whatever d_k. The median, because rare near-ties keep the mean up."""
    g = torch.Generator().manual_seed(5)
    norms = {}
    for d_k in (64, 256, 1024):
        q = torch.randn(100, 1, d_k, generator=g, dtype=torch.float64)
        k = torch.randn(100, 64, d_k, generator=g, dtype=torch.float64)
        s = (q @ k.transpose(-1, -2)).squeeze(1)  # (100, 64) raw scores
        for name, scores in (("raw", s), ("scaled", s / math.sqrt(d_k))):
            a = torch.softmax(scores, -1)
            norms[name, d_k] = torch.linalg.matrix_norm(softmax_jacobian(a)).median().item()
            if name == "raw" and d_k == 1024:
                assert a.amax(-1).median().item() > 0.99  # nearly one-hot
    assert norms["raw", 64] > norms["raw", 256] > norms["raw", 1024]
    assert norms["raw", 1024] < 0.01 * norms["scaled", 1024]
    scaled = [norms["scaled", d] for d in (64, 256, 1024)]
    assert max(scaled) / min(scaled) < 1.25


# ================================================================= causal alignment, RoPE layout, per-sequence RoPE


@pytest.mark.equation("03.02", oracle="F.scaled_dot_product_attention(is_causal=True) (top-left); "
                      "explicit torch.tril(ones, diagonal=T_k - T_q) mask (bottom-right)")
@pytest.mark.parametrize("T_q, T_k", [(3, 8), (7, 4), (5, 5), (1, 6)])
def test_causal_alignment_options(T_q, T_k):
    q, k, v = qkv(T_q=T_q, T_k=T_k)
    top_left = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    bottom = F.scaled_dot_product_attention(q, k, v, attn_mask=torch.ones(T_q, T_k, dtype=torch.bool).tril(T_k - T_q))
    torch.testing.assert_close(scaled_dot_product_attention(q, k, v, is_causal=True, causal_alignment="top_left"),
                               top_left, **F32)
    torch.testing.assert_close(scaled_dot_product_attention(q, k, v, is_causal=True, causal_alignment="bottom_right"),
                               bottom, **F32)
    torch.testing.assert_close(scaled_dot_product_attention(q, k, v, is_causal=True), bottom, **F32)  # the default
    assert torch.equal(causal_mask(T_q, T_k, alignment="top_left"), torch.ones(T_q, T_k, dtype=torch.bool).tril())
    if T_q != T_k:  # the two conventions really differ here
        assert not torch.equal(causal_mask(T_q, T_k, alignment="top_left"), causal_mask(T_q, T_k))


def test_mha_passes_causal_alignment_through():
    torch.manual_seed(0)
    mha = MultiHeadAttention(16, 2).double().eval()
    x, context = torch.randn(2, 3, 16, dtype=torch.float64), torch.randn(2, 7, 16, dtype=torch.float64)
    D = mha.head_dim
    q = F.linear(x, mha.q_proj.weight).view(2, 3, 2, D).transpose(1, 2)
    k = F.linear(context, mha.k_proj.weight).view(2, 7, 2, D).transpose(1, 2)
    v = F.linear(context, mha.v_proj.weight).view(2, 7, 2, D).transpose(1, 2)
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # top-left
    ref = F.linear(ref.transpose(1, 2).reshape(2, 3, 16), mha.o_proj.weight)
    with torch.no_grad():
        ours = mha(x, context=context, is_causal=True, causal_alignment="top_left")
    torch.testing.assert_close(ours, ref, **F64)


@pytest.mark.equation("03.03", oracle="half-layout MultiHeadAttention with q/k rows permuted by HF's permute formula")
@pytest.mark.parametrize("n_kv_heads", [4, 2])
def test_mha_interleaved_layout_equals_half_layout_with_converted_weights(n_kv_heads):
    from llmbook.lm.positions import rope_cos_sin

    C, H, T = 32, 4, 6
    D = C // H
    torch.manual_seed(1)
    inter = MultiHeadAttention(C, H, n_kv_heads, rope_layout="interleaved").double().eval()
    half = MultiHeadAttention(C, H, n_kv_heads, rope_layout="half").double().eval()

    def hf_permute(w, n):  # convert_llama_weights_to_hf.py, written out independently of llmbook
        return w.view(n, D // 2, 2, C).transpose(1, 2).reshape(n * D, C)

    state = inter.state_dict()
    half.load_state_dict({**state, "q_proj.weight": hf_permute(state["q_proj.weight"], H),
                          "k_proj.weight": hf_permute(state["k_proj.weight"], n_kv_heads)})
    x = torch.randn(2, T, C, dtype=torch.float64)
    positions = torch.tensor([[0, 1, 2, 3, 4, 5], [3, 4, 5, 6, 7, 8]])
    for rope in (rope_cos_sin(T, D, dtype=torch.float64), rope_cos_sin(positions, D, dtype=torch.float64)):
        with torch.no_grad():
            a, b = inter(x, is_causal=True, rope=rope), half(x, is_causal=True, rope=rope)
        torch.testing.assert_close(a, b, **F64)
    half.load_state_dict(state)  # the layout matters: unconverted weights under the half layout differ
    with torch.no_grad():
        assert not torch.allclose(inter(x, rope=rope), half(x, rope=rope), atol=1e-3)


@pytest.mark.equation("03.06", oracle="transformers LlamaAttention with LlamaRotaryEmbedding, position_ids (B, T)")
def test_mha_per_sequence_rope_matches_llama_position_ids():
    from llmbook.lm.positions import rope_cos_sin

    gqa = GroupedQueryAttention(d_model=32, n_heads=4, n_kv_heads=2).eval()
    ref, config = llama_reference(gqa, 2)
    x = torch.randn(2, 6, 32)
    position_ids = torch.tensor([[0, 1, 2, 3, 4, 5], [10, 11, 12, 13, 14, 15]])
    cos_ref, sin_ref = modeling_llama.LlamaRotaryEmbedding(config)(x, position_ids)  # (B, T, D)
    causal = torch.zeros(6, 6).masked_fill(torch.ones(6, 6, dtype=torch.bool).triu(1), float("-inf"))
    with torch.no_grad():
        expected = ref(x, position_embeddings=(cos_ref, sin_ref), attention_mask=causal[None, None])[0]
        ours = gqa(x, is_causal=True, rope=rope_cos_sin(position_ids, gqa.head_dim))
        torch.testing.assert_close(ours, expected, **F32)
        for b in range(2):  # each sequence alone with its own (T,) positions
            alone = gqa(x[b:b + 1], is_causal=True, rope=rope_cos_sin(position_ids[b], gqa.head_dim))
            torch.testing.assert_close(ours[b:b + 1], alone, **F32)


def test_layout_alignment_and_rope_table_errors():
    q, k, v = qkv()
    with pytest.raises(ValueError, match="causal alignment must be 'bottom_right'.*got 'lower_right'"):
        scaled_dot_product_attention(q, k, v, is_causal=True, causal_alignment="lower_right")
    with pytest.raises(ValueError, match="causal alignment must be"):
        causal_mask(3, 4, alignment="left")
    with pytest.raises(ValueError, match="RoPE layout must be 'half'"):
        MultiHeadAttention(32, 4, rope_layout="meta")
    cos = torch.ones(3, 5, 8)
    with pytest.raises(ValueError, match=r"rope \(cos, sin\) must each have shape \(T, D\) = \(5, 8\), "
                                         r"\(B, T, D\) = \(2, 5, 8\) or \(B, 1, T, D\), with B = 2 or 1; "
                                         r"got \(3, 5, 8\)"):
        MultiHeadAttention(32, 4)(torch.randn(2, 5, 32), rope=(cos, cos))


# ================================================================= fp16 / bf16 and mask contracts (issue 11)

# Low-precision outputs against torch on the float64 upcast: the output rounds once to the dtype, so a
# few units in its last place (fp16: 2^-11, bf16: 2^-8) times |v| ~ 1.
HALF_TOL = {torch.float16: dict(rtol=2e-3, atol=2e-3), torch.bfloat16: dict(rtol=1.6e-2, atol=1.6e-2)}


def test_sdpa_fp16_large_scores_issue_case():
    # q k^T = 64 * 1600 = 102400 overflows fp16 (max 65504) unless scaled or accumulated in float32
    q = torch.full((1, 1, 2, 64), 40.0, dtype=torch.float16)
    out = scaled_dot_product_attention(q, q, q)
    assert out.dtype == torch.float16
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, q, q), rtol=0, atol=0)
    torch.testing.assert_close(out, torch.full_like(q, 40.0), rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("scale", [1.0, 300.0])
def test_sdpa_and_modules_in_half_precision_match_float64(dtype, scale):
    g = torch.Generator().manual_seed(0)
    q = (torch.randn(2, 4, 5, 16, generator=g) * scale).to(dtype)
    k = (torch.randn(2, 2, 7, 16, generator=g) * scale).to(dtype)
    v = torch.randn(2, 2, 7, 16, generator=g).to(dtype)
    mask = torch.rand(5, 7, generator=g) > 0.3
    mask[:, 0] = True
    out, w = scaled_dot_product_attention(q, k, v, mask=mask, return_weights=True)
    assert out.dtype == w.dtype == dtype
    k64, v64 = (x.double().repeat_interleave(2, dim=1) for x in (k, v))
    ref = F.scaled_dot_product_attention(q.double(), k64, v64, attn_mask=mask)
    torch.testing.assert_close(out.double(), ref, **HALF_TOL[dtype])
    ref_c = F.scaled_dot_product_attention(q.double(), k64, v64, attn_mask=causal_lower_right(5, 7))
    torch.testing.assert_close(scaled_dot_product_attention(q, k, v, is_causal=True).double(), ref_c,
                               **HALF_TOL[dtype])
    # the modules: the same weights in float64 are the oracle
    torch.manual_seed(0)
    mha = GroupedQueryAttention(32, 4, 2)
    with torch.no_grad():
        for p in mha.parameters():
            p.mul_(scale ** 0.5)
    x = torch.randn(2, 6, 32, generator=g)
    y = mha.to(dtype)(x.to(dtype), is_causal=True)
    y64 = mha.double()(x.to(dtype).double(), is_causal=True)
    assert y.dtype == dtype and torch.isfinite(y).all()
    scale_y = y64.abs().max().item()
    torch.testing.assert_close(y.double() / scale_y, y64 / scale_y, rtol=0, atol=HALF_TOL[dtype]["atol"] * 8)


def test_float_mask_broadcasting_with_but_not_to_the_scores_is_a_clear_error():
    q = k = v = torch.randn(1, 2, 3, 4)
    for mask in (torch.ones(3, 1, 3, 3, dtype=torch.bool), torch.zeros(3, 1, 3, 3)):
        with pytest.raises(ValueError, match=r"mask \(3, 1, 3, 3\) must broadcast to .*\(1, 2, 3, 3\)"):
            scaled_dot_product_attention(q, k, v, mask=mask)


def test_masked_softmax_validates_and_matches_torch():
    s = torch.randn(2, 3, 5, dtype=torch.float64)
    allowed = torch.rand(3, 5) > 0.4
    allowed[:, 0] = True
    torch.testing.assert_close(masked_softmax(s, allowed), torch.softmax(s.masked_fill(~allowed, -math.inf), -1),
                               **F64)
    with pytest.raises(TypeError, match="scores must be a real floating-point tensor, got dtype torch.int64"):
        masked_softmax(torch.tensor([[1, 2]]))
    with pytest.raises(TypeError, match="scores must be a tensor, got list"):
        masked_softmax([[1.0, 2.0]])
    with pytest.raises(TypeError, match="allowed must be a bool tensor"):
        masked_softmax(s, allowed.float())
    with pytest.raises(TypeError, match="allowed must be a bool tensor"):
        masked_softmax(s, [True] * 5)
    with pytest.raises(ValueError, match=r"allowed \(4, 5\) must broadcast to the scores \(2, 3, 5\)"):
        masked_softmax(s, torch.ones(4, 5, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"allowed \(2, 2, 3, 5\) must broadcast to the scores \(2, 3, 5\)"):
        masked_softmax(s, torch.ones(2, 2, 3, 5, dtype=torch.bool))
    # fp16 scores: softmax in float32, weights back in fp16
    s16 = (s * 1000).half()
    w = masked_softmax(s16, allowed)
    assert w.dtype == torch.float16
    torch.testing.assert_close(w.double(), torch.softmax(s16.double().masked_fill(~allowed, -math.inf), -1),
                               **HALF_TOL[torch.float16])


@pytest.mark.parametrize("cls", [MultiHeadAttention, MultiQueryAttention, GroupedQueryAttention])
def test_attention_modules_check_their_input_before_nn_linear(cls):
    """Issue 11: int/bool x reached the projections (a RuntimeError from torch)."""
    attn = cls(8, 2, n_kv_heads=1) if cls is GroupedQueryAttention else cls(8, 2)
    x = torch.randn(2, 3, 8)
    for dt in (torch.int64, torch.bool):
        with pytest.raises(TypeError, match=rf"x must be a real floating-point tensor, got dtype {dt}"):
            attn(x.to(dt))
    with pytest.raises(TypeError, match="x must be a tensor, got list"):
        attn(x.tolist())
    with pytest.raises(TypeError, match=r"x \(torch.float64\) must have the dtype of the \w+'s parameters "
                                        r"\(torch.float32\)"):
        attn(x.double())
    cross = CrossAttention(8, 2)
    with pytest.raises(TypeError, match=r"context must be a real floating-point tensor, got dtype torch.int64"):
        cross(x, torch.zeros(2, 4, 8, dtype=torch.int64))
    with pytest.raises(ValueError, match=r"context must have shape \(\.\.\., S, d_model\) with d_model = 8, "
                                         r"got \(2, 4, 7\)"):
        cross(x, torch.randn(2, 4, 7))


def test_masked_softmax_with_no_keys_and_repeat_kv_kinds():
    """Issue 11: masked_softmax over T_k = 0 raised an IndexError; repeat_kv took bool and crashed on lists."""
    out = masked_softmax(torch.zeros(2, 3, 0), torch.zeros(3, 0, dtype=torch.bool))
    assert out.shape == (2, 3, 0)
    torch.testing.assert_close(out, torch.softmax(torch.zeros(2, 3, 0), -1), rtol=0, atol=0)  # torch: also empty
    assert masked_softmax(torch.zeros(2, 0, dtype=torch.float16)).dtype == torch.float16
    x = torch.randn(1, 2, 3, 4)
    with pytest.raises(TypeError, match="x must be a real floating-point tensor, got dtype torch.bool"):
        repeat_kv(x > 0, 2)
    torch.testing.assert_close(repeat_kv(x.tolist(), 2), x.repeat_interleave(2, dim=1), rtol=0, atol=0)


@pytest.mark.parametrize("bad, err, text", [("0.5", TypeError, r"dropout_p must be a real number, got '0.5' \(str\)"),
                                            (True, TypeError, r"dropout_p must be a real number, got True \(bool\)"),
                                            (1.0, ValueError, r"dropout_p must lie in \[0.0, 1.0\), got 1.0"),
                                            (math.nan, ValueError, "dropout_p must be a real number, got nan")])
def test_sdpa_checks_dropout_p(bad, err, text):
    q = torch.randn(1, 2, 3, 4)
    with pytest.raises(err, match=text):
        scaled_dot_product_attention(q, q, q, dropout_p=bad)


# ================================================================= the chapter's prose and Try-it solutions





def test_try_it_solutions_of_chapter_3():
    """Every number of the chapter's Try-it solutions, computed here; the notebook must state them."""
    from llmbook.lm.efficient_attention import performer_attention
    from llmbook.lm.flash import tiled_attention_forward
    from llmbook.lm.local_attention import sliding_window_mask

    stated = []
    # 1. four sliding-window layers, W = 5, T = 40: the last position hears from j >= 39 - 4 * 4 = 23
    T, W, L = 40, 5, 4
    reach = torch.linalg.matrix_power(sliding_window_mask(T, window=W).double(), L)[-1] > 0
    heard = {T - 1}
    for _ in range(L):  # brute force: who can send to a position of `heard` through one layer
        heard |= {j for i in heard for j in range(T) if i - W < j <= i}
    assert set(torch.nonzero(reach).flatten().tolist()) == heard == set(range(23, 40))
    stated += ["$4 \\cdot 4 = 16$", "39 - 16 = 23"]
    # 2. unscaled scores at d_k = 512 over 64 keys: the top key takes almost everything
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2000, 1, 512, generator=g, dtype=torch.float64)
    k = torch.randn(2000, 64, 512, generator=g, dtype=torch.float64)
    _, w = scaled_dot_product_attention(q, k, torch.zeros(2000, 64, 1, dtype=torch.float64), scale=1.0,
                                        return_weights=True)
    torch.testing.assert_close(w, torch.softmax(q @ k.transpose(-1, -2), -1), **F64)  # oracle: torch.softmax
    top = w.amax(-1).flatten()
    assert f"{top.median().item():.3f}" == "0.998" and (top > 0.99).double().mean().item() > 0.5
    assert f"{math.sqrt(512):.1f}" == "22.6"
    stated += ["22.6", "0.998 of the weight", "more than half of\n   the rows give it over 0.99"]
    # 3. tiles of one query and one key: the streaming softmax, the same function
    qq, kk, vv = (torch.randn(1, 2, 23, 8, generator=g, dtype=torch.float64) for _ in range(3))
    o, _ = tiled_attention_forward(qq, kk, vv, causal=True, block_q=1, block_k=1)
    torch.testing.assert_close(o, F.scaled_dot_product_attention(qq, kk, vv, is_causal=True), **F64)
    # 4. Performer with q, k scaled by 0.5 and by 1.5: the error falls with m only for short vectors
    errors = {}
    for s in (0.5, 1.5):
        g = torch.Generator().manual_seed(20)
        qa = torch.randn(1, 2, 16, 8, generator=torch.Generator().manual_seed(21), dtype=torch.float64) * s
        ka = torch.randn(1, 2, 16, 8, generator=torch.Generator().manual_seed(22), dtype=torch.float64) * s
        va = torch.randn(1, 2, 16, 8, generator=torch.Generator().manual_seed(23), dtype=torch.float64)
        exact = F.scaled_dot_product_attention(qa, ka, va)
        errors[s] = [torch.stack([(performer_attention(qa, ka, va, n_features=m, generator=g) - exact).pow(2).mean()
                                  for _ in range(10)]).mean().sqrt().item() for m in (4, 16, 64, 256, 1024)]
    assert errors[0.5][0] / errors[0.5][-1] > 5 and errors[1.5][0] / errors[1.5][-1] < 1.6
    stated += [f"falls from {errors[0.5][0]:.2f} to {errors[0.5][-1]:.3f} at scale 0.5",
               f"only from {errors[1.5][0]:.2f} to {errors[1.5][-1]:.2f} at scale 1.5"]
    # 5. the causal kernel's tiles at T = 4096 with 128 x 64 tiles: count them from the mask itself
    T, bm, bn = 4096, 128, 64
    visible = causal_mask(T).view(T // bm, bm, T // bn, bn).sum((1, 3))
    visited, masked = int((visible > 0).sum()), int(((visible > 0) & (visible < bm * bn)).sum())
    assert (visited, masked) == (sum(2 * r + 2 for r in range(T // bm)), 2 * (T // bm)) == (1056, 64)
    stated += [f"{T // bm} \\times {T // bn} = {(T // bm) * (T // bn)}$ tiles", f"= {visited}",
               f"{100 * visited / visible.numel():.1f} %", f"only {masked} need the mask"]
    assert_states("03-attention.ipynb", stated)


def test_chapter_3_describes_the_trained_heads_as_measured():
    """The prose about the trained tiny GPT's heads states what the model does (recomputed here)."""
    import numpy as np

    from llmbook.data import corpus
    from llmbook.lm.training import pretrained_tiny

    gpt, tok = pretrained_tiny()
    text = corpus()
    T = gpt.config.max_seq_len
    windows = torch.as_tensor(np.stack([tok.encode(text[s:s + T]) for s in np.linspace(0, len(text) - T, 16)
                                        .astype(int)]), dtype=torch.long)
    with torch.no_grad():
        A = gpt.attention_maps(windows).double()  # (L, B, H, T, T)
    i = torch.arange(1, T)
    torch.testing.assert_close(A.sum(-1), torch.ones_like(A.sum(-1)), **F32)  # rows are distributions
    assert (A.triu(1) == 0).all()  # causal
    first, prev = A[..., 1:, 0].mean((1, 3)), A[..., i, i - 1].mean((1, 3))
    space = (A[..., 1:, :] * torch.tensor([c == " " for c in tok.chars])[windows].double()[None, :, None, None]
             ).sum(-1).mean((1, 3))
    is_nl = torch.tensor([c == "\n" for c in tok.chars])[windows].double()
    newline = (A[..., 1:, :] * is_nl[None, :, None, None]).sum(-1).mean((1, 3))
    visible = torch.arange(2, T + 1).double()
    uniform = (1 / visible).mean().item()
    uniform_nl = (is_nl.cumsum(-1)[:, 1:] / visible).mean().item()
    strong = prev[prev > 0.395]  # the previous-character heads
    assert len(strong) == 4 and 6.5 < strong.min().item() / uniform and strong.max().item() / uniform < 9
    assert first.max().item() < uniform  # no attention sink
    assert 6.5 < newline.max().item() / uniform_nl < 7  # "almost seven times"
    assert space.argmax().item() == 3 and newline.argmax().item() == 2 * 4 + 3  # layer 0 head 3; layer 2 head 3
    stated = [f"{round(100 * strong.min().item())}–{round(100 * strong.max().item())} %",
              f"{round(100 * first.min().item())}–{round(100 * first.max().item())} %",
              f"({round(100 * uniform)} %)", f"Layer 0, head 3 puts {round(100 * space.max().item())} %",
              f"Layer 2, head 3 puts {round(100 * newline.max().item())} %"]
    assert_states("03-attention.ipynb", stated, after="### What the heads of a trained model attend to")
