"""Bad input that a fuzz run of the whole package found (issue 28, section 5): one case each.

Each case was checked to fail before its fix. Oracles are float64 (or high-precision ``mpmath``) evaluations
of the same formula, or the contract the docstring states.
"""

from __future__ import annotations

import copy
import math

import mpmath
import pytest
import torch

from llmbook.lm import activations, efficient_attention, lora, positions, search, text_metrics
from llmbook.lm.attention import MultiHeadAttention
from llmbook.lm.context_extension import attention_sink_scores, yarn_attention_factor
from llmbook.lm.moe_layer import MoELayer
from llmbook.lm.rope import rope_cos_sin, rope_relative_score
from llmbook.rag import chunking, packing

# ---------------------------------------------------------------- fp16 products that overflow where the result fits


def _gen(seed=0):
    return torch.Generator().manual_seed(seed)


def test_swiglu_with_down_projection_in_fp16_at_300():
    x, W = torch.full((2, 4), 300.0), torch.eye(4)
    W_down = torch.eye(4) / 1000  # silu(300) * 300 = 9e4 overflows fp16; after W_down, 90 fits
    ref = activations.swiglu(x.double(), W.double(), W.double(), W_down.double())
    got = activations.swiglu(x.half(), W.half(), W.half(), W_down.half())
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got.double(), ref, rtol=2e-3, atol=0)


@pytest.mark.parametrize("cls", [activations.SwiGLU, activations.ReGLU, activations.GeGLU])
def test_gated_ffn_modules_in_fp16_at_300(cls):
    torch.manual_seed(0)
    m = cls(4, 8)
    with torch.no_grad():
        m.w_gate.weight.fill_(0.5)
        m.w_up.weight.fill_(0.5)
        m.w_down.weight.fill_(1e-4)
    x = torch.full((1, 3, 4), 300.0)
    ref = m.double()(x.double())  # hidden 600 * 600 = 3.6e5 (over fp16's 65504); output about 288
    got = m.half()(x.half())
    assert got.dtype == torch.float16 and torch.isfinite(got).all()
    torch.testing.assert_close(got.double(), ref, rtol=2e-3, atol=0)


def test_moe_layer_in_fp16_at_300():
    m = MoELayer(8, 16, 4, 2, generator=_gen())
    with torch.no_grad():
        m.W_out.mul_(1e-3)
    m16, x16 = m.half(), (torch.randn(1, 3, 8, generator=_gen(1)) * 300).half()
    got, r16 = m16(x16)
    ref, r64 = copy.deepcopy(m16).double()(x16.double())  # the same fp16 weights and input, in float64
    assert ref.abs().max() < 1000  # fits fp16; the experts' hidden products (about 1e5) do not
    assert torch.isfinite(got).all() and r16.probs.dtype == torch.float16
    torch.testing.assert_close(got.double(), ref, rtol=5e-3, atol=0.05)
    assert r16.topk_ids[:, 0].equal(r64.topk_ids[:, 0])


def _linear_attention_mpmath(q, k, v):
    """Causal linear attention with phi = elu + 1, evaluated at 50 significant digits (an independent loop)."""
    mpmath.mp.dps = 50

    def phi(x):
        return mpmath.exp(x) if x < 0 else x + 1

    T, D = q.shape
    out = []
    for t in range(T):
        w = [mpmath.fsum(phi(mpmath.mpf(float(q[t, j]))) * phi(mpmath.mpf(float(k[s, j]))) for j in range(D))
             for s in range(t + 1)]
        den = mpmath.fsum(w)
        out.append([float(mpmath.fsum(w[s] * float(v[s, c]) for s in range(t + 1)) / den)
                    for c in range(v.shape[1])])
    return torch.tensor(out, dtype=torch.float64)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32, torch.float64])
def test_linear_attention_keeps_features_that_underflow(dtype):
    g = _gen(3)
    q, k, v = (torch.randn(5, 3, generator=g) * 150 for _ in range(3))
    q[:2], k[:2] = -q[:2].abs(), -k[:2].abs()  # the first queries and keys: every feature exp(-O(100)) or less
    q, k, v = (t.to(dtype) for t in (q, k, v))
    ref = _linear_attention_mpmath(q.double(), k.double(), v.double())  # exp(-300) is 0 even in float32
    tol = {torch.float16: 2e-3, torch.float32: 1e-5, torch.float64: 1e-10}[dtype]
    rec = efficient_attention.linear_attention_recurrent(q[None], k[None], v[None])[0]
    par = efficient_attention.linear_attention(q[None], k[None], v[None], causal=True)[0]
    scale = ref.abs().max()
    for got in (rec, par):
        assert got.dtype == dtype
        assert (got.double() - ref).abs().max() <= tol * scale


def test_linear_attention_non_causal_keeps_features_that_underflow():
    g = _gen(4)
    q, k, v = (torch.randn(4, 3, generator=g) * 150 for _ in range(3))
    q, k = -q.abs(), -k.abs()  # every feature underflows float32
    # non-causal = the causal answer of the last query, for every query: append each query at the end
    ref = torch.stack([_linear_attention_mpmath(torch.cat([q[:0], q[i:i + 1].expand(4, 3)]), k, v)[-1]
                       for i in range(4)]).double()
    got = efficient_attention.linear_attention(q[None], k[None], v[None])[0]
    assert (got.double() - ref).abs().max() <= 1e-5 * ref.abs().max()


def test_xpos_in_fp16_at_8192_is_finite_wherever_float64_fits():
    # the reported inf did not reproduce: the centred scale reaches zeta^-8 = 2.2e4 at T = 8192, so fp16
    # overflows only where the exact result exceeds 65504 too; this pins that
    g = _gen(5)
    q, k = (torch.rand(2, 8192, 8, generator=g) * 4 - 2 for _ in range(2))
    a, b = positions.apply_xpos(q.half(), k.half())
    A, B = positions.apply_xpos(q.double(), k.double())
    assert A.abs().max() > 30000  # the test does reach the large scales
    assert torch.isfinite(a[A.abs() < 65504]).all() and torch.isfinite(b[B.abs() < 65504]).all()
    A = positions.apply_xpos(q.half().double(), k.half().double())[0]  # the exact answer on the fp16 input
    fits = A.abs().amax(-1, keepdim=True) < 65504  # positions whose whole row fits fp16
    err = ((a.double() - A).abs() / A.abs().amax(-1, keepdim=True).clamp_min(1e-3))[fits.expand_as(A)]
    assert err.max() < 2e-3  # fp16's half-ulp (4.9e-4) of the row's largest entry, with margin


# ---------------------------------------------------------------- out of domain


def test_yarn_attention_factor_rejects_a_non_positive_scale():
    for bad in (0.0, -2.0):
        with pytest.raises(ValueError, match="factor"):
            yarn_attention_factor(bad)
    assert yarn_attention_factor(0.5) == 1.0 and yarn_attention_factor(4.0) == pytest.approx(0.1 * math.log(4) + 1)


def test_semantic_boundaries_rejects_tau_outside_the_cosine_distance_range():
    e = torch.randn(5, 3, generator=_gen())
    for bad in (-0.1, 2.5):
        with pytest.raises(ValueError, match="tau"):
            chunking.semantic_boundaries(e, bad)
    assert chunking.semantic_boundaries(e, 2.0).boundary.sum() == 0  # no cosine distance exceeds 2


def test_lost_in_middle_weight_rejects_positions_outside_the_context():
    for bad in (torch.tensor([-1.0, 2.0]), torch.tensor([0.0, 5.0])):
        with pytest.raises(ValueError, match=r"pos must lie in \[0, L\]"):
            packing.lost_in_middle_weight(bad, 4)
    assert packing.lost_in_middle_weight(torch.tensor([0.0, 4.0]), 4).tolist() == [1.0, 1.0]


def test_brevity_penalty_takes_token_counts():
    for c, r in ((9.5, 10), (9, 10.0), (True, 3)):
        with pytest.raises(TypeError, match="token count"):
            text_metrics.brevity_penalty(c, r)
    bleu = pytest.importorskip("sacrebleu.metrics.bleu")
    for c, r in ((9, 10), (0, 3), (12, 10)):
        ref = bleu.BLEU.compute_bleu([c] * 4, [max(c, 1)] * 4, sys_len=c, ref_len=r).bp
        assert text_metrics.brevity_penalty(c, r) == pytest.approx(ref, abs=1e-15)


# ---------------------------------------------------------------- NaN from DoRA's zero rows


def test_dora_zero_row_with_a_large_magnitude_gives_zero_not_nan():
    W = torch.tensor([[0.0, 0.0], [3.0, 4.0]])
    m = torch.tensor([10.0, 10.0], requires_grad=True)  # m / tiny overflowed to inf above m of about 4
    y = lora.dora_linear(torch.ones(1, 2), W, torch.zeros(1, 2), torch.zeros(2, 1), m, 1.0)
    y.sum().backward()
    assert y.tolist() == [[0.0, 14.0]]  # the zero row stays zero; row 2: 10 * (3 + 4) / 5
    assert torch.isfinite(m.grad).all() and m.grad.tolist() == pytest.approx([0.0, 1.4])
    layer = lora.DoRALinear(torch.nn.Linear(2, 2), r=1, alpha=1.0)
    with torch.no_grad():
        layer.base.weight[0] = 0.0
        layer.magnitude.fill_(10.0)
    assert torch.isfinite(layer(torch.ones(1, 2))).all() and torch.isfinite(layer.merged_weight()).all()
    assert layer.merged_weight()[0].abs().sum() == 0


# ---------------------------------------------------------------- crashes from torch instead of a clear error


def test_rope_relative_score_with_batches_that_do_not_broadcast():
    with pytest.raises(ValueError, match="batch axes"):
        rope_relative_score(torch.zeros(0, 4), torch.zeros(2, 4), 1)
    assert rope_relative_score(torch.zeros(0, 4), torch.zeros(0, 4), 1).shape == (0,)  # an empty batch is fine


def test_attention_sink_scores_with_mismatched_batches_and_an_empty_batch():
    with pytest.raises(ValueError, match="batch axes"):
        attention_sink_scores(torch.zeros(2, 3, 4), torch.zeros(3, 3, 4))
    alpha, sink = attention_sink_scores(torch.zeros(0, 3, 4), torch.zeros(0, 5, 4), n_sink=2)
    assert alpha.shape == (0, 3, 5) and sink.shape == (0, 3)


def test_favor_features_and_performer_with_no_directions():
    with pytest.raises(ValueError, match="at least one direction"):
        efficient_attention.favor_features(torch.zeros(2, 4), torch.zeros(0, 4))
    q = torch.zeros(1, 3, 4)
    with pytest.raises(ValueError, match="at least one direction"):
        efficient_attention.performer_attention(q, q, q, omega=torch.zeros(0, 4))


def test_multi_head_attention_takes_rope_tables_as_lists_and_broadcast_shapes():
    mha = MultiHeadAttention(8, 2, 1)
    x = torch.randn(2, 3, 8, generator=_gen())
    cos, sin = rope_cos_sin(3, 4)
    ref = mha(x, rope=(cos, sin))
    for c, s in ((cos.tolist(), sin.tolist()), (cos[None], sin[None]), (cos[None, None], sin[None, None]),
                 (cos.expand(2, 1, 3, 4), sin.expand(2, 1, 3, 4))):
        torch.testing.assert_close(mha(x, rope=(c, s)), ref, rtol=0, atol=0)
    with pytest.raises(ValueError, match="rope"):  # a per-head table cannot serve GQA's single key head
        mha(x, rope=(cos.expand(2, 2, 3, 4), sin.expand(2, 2, 3, 4)))
    with pytest.raises(TypeError, match="pair"):
        mha(x, rope=cos)


# ---------------------------------------------------------------- a valid input refused


def test_speculative_sampling_accepts_a_bf16_softmax():
    g = _gen(0)
    p = torch.softmax(torch.randn(2000, 5, generator=g) * 2, -1).bfloat16()
    q = torch.softmax(torch.randn(2000, 5, generator=g) * 2, -1).bfloat16()
    assert (p.double().sum(-1) - 1).abs().max() > 1e-3  # a bf16 softmax sums to 1 only within bf16's rounding
    res = search.residual_distribution(p, q)
    torch.testing.assert_close(res.double().sum(-1), torch.ones(2000, dtype=torch.float64), rtol=0, atol=1e-2)
    tokens, _ = search.speculative_sample(p, q, generator=g)
    assert tokens.shape == (2000,)
    with pytest.raises(ValueError, match="sum to 1"):  # a distribution off by more than bf16's rounding
        search.residual_distribution(p * 1.05, q)
