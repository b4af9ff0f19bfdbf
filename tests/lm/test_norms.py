"""Chapter 5 (05.01-05.05) against torch.nn.functional and transformers, plus the RMSNorm half of claim C06.

Tolerances, stated once:

* float32 against a torch oracle: ``rtol = atol = 1e-5`` (``F32``);
* float64 against a torch oracle or a float64 closed form: ``rtol = atol = 1e-12`` (``F64``);
* RMSNorm against ``transformers``' ``LlamaRMSNorm`` (same float32 recipe): exact equality.
"""

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from llmbook.lm.norms import (
    BatchNorm,
    DeepNormResidual,
    GroupNorm,
    LayerNorm,
    RMSNorm,
    batch_norm,
    deepnorm_constants,
    group_norm,
    layer_norm,
    layer_norm_naive,
    rms_norm,
    variance,
    variance_naive,
)
from tests.try_it import assert_states

F32 = dict(rtol=1e-5, atol=1e-5)
F64 = dict(rtol=1e-12, atol=1e-12)
SETTINGS = settings(max_examples=40, deadline=None, derandomize=True)


# ================================================================= 05.01 LayerNorm


@pytest.mark.equation("05.01", oracle="torch.nn.functional.layer_norm")
@pytest.mark.parametrize("dtype, tol", [(torch.float32, F32), (torch.float64, F64)])
def test_layer_norm_matches_torch(dtype, tol):
    x = torch.randn(3, 5, 16, dtype=dtype) * 3 + 2
    w, b = torch.randn(16, dtype=dtype), torch.randn(16, dtype=dtype)
    torch.testing.assert_close(layer_norm(x, w, b, 1e-5), F.layer_norm(x, (16,), w, b, 1e-5), **tol)
    torch.testing.assert_close(layer_norm(x), F.layer_norm(x, (16,)), **tol)
    ln, ref = LayerNorm(16), nn.LayerNorm(16)
    with torch.no_grad():
        ln.weight.copy_(w.float()), ln.bias.copy_(b.float())
        ref.weight.copy_(w.float()), ref.bias.copy_(b.float())
    torch.testing.assert_close(ln(x.float()), ref(x.float()), **F32)


def test_two_pass_variance_survives_a_large_offset_where_the_naive_formula_fails():
    g = torch.Generator().manual_seed(0)
    x64 = 1e4 + 0.1 * torch.randn(8, 256, generator=g, dtype=torch.float64)
    truth = x64.var(-1, unbiased=False)  # float64 reference (~0.01)
    x = x64.float()
    two_pass, naive = variance(x).double(), variance_naive(x).double()
    assert torch.allclose(two_pass, truth, rtol=1e-3)  # float32 two-pass: 3 digits at least
    assert ((naive - truth).abs() / truth).min() >= 0.99  # naive: every row wrong by ~100% or more
    assert (naive < 0).any()  # and some "variances" come out negative
    torch.testing.assert_close(variance(x64, unbiased=True), x64.var(-1, unbiased=True), **F64)
    ours = layer_norm(x, eps=1e-6).double()
    ref = F.layer_norm(x.double(), (256,), eps=1e-6)  # the same float32 data, normalised in float64
    # the float32 mean itself is rounded to ~1e-3 (one ulp at 1e4), i.e. 1e-2 of a std: torch's own
    # float32 layer_norm is off by as much, the naive one is off by everything (or NaN)
    assert (ours - ref).abs().max() < 2e-2
    assert (F.layer_norm(x, (256,), eps=1e-6).double() - ref).abs().max() < 2e-2
    naive = layer_norm_naive(x, eps=1e-6).double()
    assert torch.isnan(naive).any() or (naive - ref).abs().max() > 0.5


# ================================================================= 05.02 RMSNorm


@pytest.mark.equation("05.02", oracle="torch.nn.functional.rms_norm; transformers LlamaRMSNorm")
def test_rms_norm_matches_torch_and_llama():
    x = torch.randn(2, 7, 32)
    w = torch.randn(32)
    torch.testing.assert_close(rms_norm(x, w, 1e-6), F.rms_norm(x, (32,), w, 1e-6), **F32)
    x64 = x.double()
    torch.testing.assert_close(rms_norm(x64, w.double(), 1e-6), F.rms_norm(x64, (32,), w.double(), 1e-6), **F64)
    ours, ref = RMSNorm(32, eps=1e-6), LlamaRMSNorm(32, eps=1e-6)
    with torch.no_grad():
        ours.weight.copy_(w), ref.weight.copy_(w)
    torch.testing.assert_close(ours(x), ref(x), rtol=0, atol=0)
    xb = x.bfloat16()
    torch.testing.assert_close(ours.bfloat16()(xb), ref.bfloat16()(xb), rtol=0, atol=0)
    assert set(dict(ours.named_parameters())) == {"weight"}


def test_norm_bad_input():
    with pytest.raises(ValueError, match=r"weight must have shape \(8,\)"):
        layer_norm(torch.randn(2, 8), torch.ones(7))
    with pytest.raises(ValueError, match="eps must lie"):
        rms_norm(torch.randn(8), eps=-1.0)
    with pytest.raises(ValueError, match="divisible by the number of groups"):
        group_norm(torch.randn(2, 6), 4)
    with pytest.raises(ValueError, match="more than one value per channel"):
        batch_norm(torch.randn(1, 3))
    with pytest.raises(ValueError, match="needs running_mean"):
        batch_norm(torch.randn(4, 3), training=False)
    with pytest.raises(ValueError, match="the layer count N must be a positive int, got 0"):
        deepnorm_constants(0)


# ================================================================= claim C06 (normalisation half)


@given(seed=st.integers(0, 10_000), scale=st.floats(1e-3, 1e3), shift=st.floats(-1e2, 1e2))
@SETTINGS
def test_claim_C06_rmsnorm_is_scale_invariant_only_layernorm_also_shift(seed, scale, shift):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(4, 64, generator=g, dtype=torch.float64)
    # eps = 0 makes the invariances exact
    torch.testing.assert_close(rms_norm(scale * x, eps=0.0), rms_norm(x, eps=0.0), rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(layer_norm(scale * x + shift, eps=0.0), layer_norm(x, eps=0.0), rtol=1e-9, atol=1e-9)
    if abs(shift) > 0.5:  # a real shift moves RMSNorm's output
        assert (rms_norm(x + shift, eps=0.0) - rms_norm(x, eps=0.0)).abs().max() > 1e-2


# ================================================================= 05.03 BatchNorm


@pytest.mark.equation("05.03", oracle="torch.nn.functional.batch_norm (training and eval, running estimates)")
@pytest.mark.parametrize("shape", [(16, 4), (8, 4, 10), (4, 4, 3, 5)])
def test_batch_norm_matches_torch_including_running_stats(shape):
    x = torch.randn(*shape, dtype=torch.float64) * 2 + 1
    C = shape[1]
    w, b = torch.randn(C, dtype=torch.float64), torch.randn(C, dtype=torch.float64)
    rm, rv = torch.zeros(C, dtype=torch.float64), torch.ones(C, dtype=torch.float64)
    rm_ref, rv_ref = rm.clone(), rv.clone()
    for step in range(3):
        xs = x + step
        y = batch_norm(xs, rm, rv, w, b, training=True, momentum=0.1, eps=1e-5)
        y_ref = F.batch_norm(xs, rm_ref, rv_ref, w, b, training=True, momentum=0.1, eps=1e-5)
        torch.testing.assert_close(y, y_ref, **F64)
        torch.testing.assert_close(rm, rm_ref, **F64)
        torch.testing.assert_close(rv, rv_ref, **F64)  # unbiased N/(N-1) in the running variance
    y = batch_norm(x, rm, rv, w, b, training=False)
    torch.testing.assert_close(y, F.batch_norm(x, rm_ref, rv_ref, w, b, training=False), **F64)


def test_batch_norm_module_matches_nn_batchnorm1d():
    ours, ref = BatchNorm(5), nn.BatchNorm1d(5)
    x = torch.randn(12, 5, 7)
    for _ in range(2):
        torch.testing.assert_close(ours(x), ref(x), **F32)
    torch.testing.assert_close(ours.running_var, ref.running_var, **F32)
    ours.eval(), ref.eval()
    torch.testing.assert_close(ours(x[:1]), ref(x[:1]), **F32)


# ================================================================= 05.04 GroupNorm


@pytest.mark.equation("05.04", oracle="torch.nn.functional.group_norm")
@pytest.mark.parametrize("G", [1, 2, 4, 8])
def test_group_norm_matches_torch(G):
    x = torch.randn(3, 8, 5, 4, dtype=torch.float64)
    w, b = torch.randn(8, dtype=torch.float64), torch.randn(8, dtype=torch.float64)
    torch.testing.assert_close(group_norm(x, G, w, b), F.group_norm(x, G, w, b), **F64)
    gn, ref = GroupNorm(G, 8), nn.GroupNorm(G, 8)
    torch.testing.assert_close(gn(x.float()), ref(x.float()), **F32)


# ================================================================= 05.05 DeepNorm


@pytest.mark.equation("05.05", oracle="torch.nn.functional.layer_norm(alpha * x + G(x)); float64 closed forms "
                      "of DeepNet table 1")
def test_deepnorm_block_and_constants():
    N, M = 6, 18
    # DeepNet (Wang et al. 2022), table 1, typed independently
    assert deepnorm_constants(M) == pytest.approx(((2 * M) ** 0.25, (8 * M) ** -0.25), rel=1e-15)
    enc = deepnorm_constants(N, M, part="encoder")
    dec = deepnorm_constants(N, M, part="decoder")
    assert enc == pytest.approx((0.81 * math.pow(N ** 4 * M, 1 / 16), 0.87 * math.pow(N ** 4 * M, -1 / 16)))
    assert dec == pytest.approx((math.pow(3 * M, 0.25), math.pow(12 * M, -0.25)))
    alpha, beta = deepnorm_constants(M)
    ffn = nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 8))
    before = [m.weight.clone() for m in ffn if isinstance(m, nn.Linear)]
    block = DeepNormResidual(8, ffn, alpha).init_(beta)
    after = [m.weight for m in ffn if isinstance(m, nn.Linear)]
    for w0, w1 in zip(before, after, strict=True):
        torch.testing.assert_close(w1, beta * w0, rtol=0, atol=0)
    x = torch.randn(4, 8)
    torch.testing.assert_close(block(x), F.layer_norm(alpha * x + ffn(x), (8,)), **F32)


# ================================================================= fp16 / bf16: statistics in float32 (issue 11)

# Low-precision tolerances, against torch's own fp16/bf16 kernels (which also compute in float32 and
# round once) and a float64 reference: a few units in the last place of the output dtype.
HALF_TOL = {torch.float16: dict(rtol=2e-3, atol=2e-3), torch.bfloat16: dict(rtol=1.6e-2, atol=1.6e-2)}
HALF = pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])


def test_layer_norm_fp16_large_values_issue_case():
    # (x - mu)^2 = 90000 overflows fp16 (max 65504); torch gives [-1, 1]
    x = torch.tensor([0.0, 600.0], dtype=torch.float16)
    y = layer_norm(x)
    assert y.dtype == torch.float16
    torch.testing.assert_close(y, F.layer_norm(x, (2,)), rtol=0, atol=0)
    torch.testing.assert_close(y, torch.tensor([-1.0, 1.0], dtype=torch.float16), rtol=0, atol=1e-3)


@HALF
def test_norms_in_half_precision_match_torch_and_float64(dtype):
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(4, 8, 4096, generator=g) * 300).to(dtype)  # every output was 0 in fp16 before
    x64 = x.double()
    w, b = torch.randn(4096, generator=g).to(dtype), torch.randn(4096, generator=g).to(dtype)
    tol = HALF_TOL[dtype]
    y = layer_norm(x, w, b)
    assert y.dtype == dtype and torch.isfinite(y).all()
    torch.testing.assert_close(y, F.layer_norm(x, (4096,), w, b), **tol)
    torch.testing.assert_close(y.double(), F.layer_norm(x64, (4096,), w.double(), b.double()), **tol)
    ln = LayerNorm(4096).to(dtype)
    torch.testing.assert_close(ln(x), F.layer_norm(x, (4096,), ln.weight, ln.bias), **tol)
    # GroupNorm over (B, C, S) = (4, 8, 4096), G = 2
    wc, bc = torch.randn(8, generator=g).to(dtype), torch.randn(8, generator=g).to(dtype)
    yg = group_norm(x, 2, wc, bc)
    assert yg.dtype == dtype
    torch.testing.assert_close(yg, F.group_norm(x, 2, wc, bc), **tol)
    torch.testing.assert_close(yg.double(), F.group_norm(x64, 2, wc.double(), bc.double()), **tol)
    gn = GroupNorm(4, 8).to(dtype)
    torch.testing.assert_close(gn(x), F.group_norm(x, 4, gn.weight, gn.bias), **tol)
    # BatchNorm, training (float32 running buffers, as after model.half() on the buffers' copy) and eval
    rm, rv = torch.zeros(8), torch.ones(8)
    rm_ref, rv_ref = torch.zeros(8, dtype=torch.float64), torch.ones(8, dtype=torch.float64)
    yb = batch_norm(x, rm, rv, wc, bc, training=True)
    yb_ref = F.batch_norm(x64, rm_ref, rv_ref, wc.double(), bc.double(), training=True)
    assert yb.dtype == dtype
    torch.testing.assert_close(yb.double(), yb_ref, **tol)
    torch.testing.assert_close(rm.double(), rm_ref, rtol=1e-5, atol=1e-3)
    torch.testing.assert_close(rv.double(), rv_ref, rtol=1e-5, atol=1e-3)
    ye = batch_norm(x, rm, rv, wc, bc, training=False)
    assert ye.dtype == dtype
    torch.testing.assert_close(ye.double(), F.batch_norm(x64, rm_ref, rv_ref, wc.double(), bc.double(),
                                                         training=False), **tol)
    bn = BatchNorm(8).to(dtype)
    torch.testing.assert_close(bn(x).double(), F.batch_norm(x64, None, None, training=True), **tol)
    # DeepNorm's post-LN residual: LN(alpha x + x) with the identity sublayer
    block = DeepNormResidual(4096, nn.Identity(), alpha=2.0).to(dtype)
    torch.testing.assert_close(block(x).double(), F.layer_norm(3 * x64, (4096,)), **tol)


@HALF
def test_variance_in_half_precision_has_no_intermediate_overflow(dtype):
    # squares 40000 each sum to 160000 > 65504, but the variance itself (40000) is representable
    x = torch.tensor([0.0, 400.0, 0.0, 400.0], dtype=dtype)
    v = variance(x)
    assert v.dtype == dtype
    torch.testing.assert_close(v.double(), torch.tensor(40000.0, dtype=torch.float64), **HALF_TOL[dtype])
    torch.testing.assert_close(variance(x, unbiased=True), x.var(unbiased=True), rtol=0, atol=0)


# ================================================================= norm edge cases (issue 11: crashes -> clear errors)


@pytest.mark.parametrize("S", [(), (5,)])
def test_group_norm_empty_batch_matches_torch(S):
    # oracle: torch.nn.functional.group_norm returns an empty (0, C, *S) tensor for B = 0
    x = torch.zeros(0, 4, *S)
    ref = F.group_norm(x, 2)
    out = group_norm(x, 2)
    assert out.shape == ref.shape == x.shape
    assert GroupNorm(2, 4)(x).shape == x.shape


@pytest.mark.parametrize(
    "call, exc, match",
    [
        (lambda: GroupNorm(0, 4), ValueError, r"G \(the number of groups\) must be a positive int, got 0"),
        (lambda: GroupNorm(3, 4), ValueError,
         r"the number of channels C \(4\) must be divisible by the number of groups G \(3\)"),
        (lambda: GroupNorm(2.0, 4), TypeError, r"G \(the number of groups\) must be a positive int, got 2.0 \(float\)"),
        (lambda: group_norm(torch.randn(2, 4), 0), ValueError, r"G \(the number of groups\) must be a positive int"),
        (lambda: group_norm(torch.randn(2, 4), True), TypeError, r"G \(the number of groups\) must be a positive int"),
        (lambda: batch_norm(torch.randn(4, 3), torch.zeros(4), torch.ones(3)), ValueError,
         r"running_mean must have shape \(3,\) to match the channel dim C of x, got \(4,\)"),
        (lambda: batch_norm(torch.randn(4, 3), torch.zeros(3), torch.ones(2), training=False), ValueError,
         r"running_var must have shape \(3,\) to match the channel dim C of x, got \(2,\)"),
        (lambda: batch_norm(torch.randn(4, 3), [0.0, 0.0, 0.0], torch.ones(3)), TypeError,
         r"running_mean must be a tensor, got list"),
        (lambda: batch_norm(torch.randn(4, 3), torch.zeros(3, dtype=torch.long), torch.ones(3)), TypeError,
         r"running_mean must be a real floating-point tensor, got dtype torch.int64"),
        (lambda: BatchNorm(0), ValueError, r"C must be a positive int, got 0"),
        (lambda: BatchNorm(3, momentum=1.5), ValueError, r"momentum must lie in \[0.0, 1.0\], got 1.5"),
        (lambda: LayerNorm(8, eps=float("inf")), ValueError, r"eps must lie in \[0.0, inf\), got inf"),
        (lambda: RMSNorm(8.0), TypeError, r"d must be a positive int, got 8.0 \(float\)"),
        (lambda: deepnorm_constants(12, 2.5, part="encoder"), TypeError,
         r"the layer count M must be a positive int, got 2.5 \(float\)"),
    ],
)
def test_norm_edge_cases_raise_clear_errors(call, exc, match):
    with pytest.raises(exc, match=match):
        call()


def test_batch_norm_running_stats_left_untouched_on_bad_shape():
    # the size check comes before the in-place update: a rejected call must not modify the buffers
    rm, rv = torch.zeros(4), torch.ones(4)
    with pytest.raises(ValueError, match="running_mean must have shape"):
        batch_norm(torch.randn(5, 3), rm, rv)
    assert torch.equal(rm, torch.zeros(4)) and torch.equal(rv, torch.ones(4))


def test_deepnorm_residual_sum_beyond_fp16_range():
    # alpha x = 2 * 60000 overflows fp16; the sum is formed in float32 and normalised there
    x = torch.tensor([[60000.0, -60000.0, 30000.0, 0.0]], dtype=torch.float16)
    y = DeepNormResidual(4, nn.Identity(), alpha=2.0).half()(x)
    assert y.dtype == torch.float16
    torch.testing.assert_close(y.double(), F.layer_norm(3 * x.double(), (4,)), **HALF_TOL[torch.float16])


@pytest.mark.parametrize("name", ["weight", "bias"])
def test_norm_affine_parameters_must_be_floating(name):
    """Issue 11: a bool weight or bias was promoted silently (True * y)."""
    x = torch.randn(2, 4, 3)
    bad = {name: torch.ones(4, dtype=torch.bool)}
    text = rf"{name} must be a real floating-point tensor, got dtype torch.bool"
    calls = [lambda: layer_norm(x.transpose(1, 2), **bad), lambda: batch_norm(x, **bad),
             lambda: group_norm(x, 2, **bad)]
    if name == "weight":  # RMSNorm has no bias
        calls.append(lambda: rms_norm(x.transpose(1, 2), **bad))
    for call in calls:
        with pytest.raises(TypeError, match=text):
            call()


def test_variance_input_kinds_and_empty_reductions():
    """Issue 11: int/bool x crashed in mean(), a list in upcast_half, and an empty dim returned NaN."""
    x = torch.tensor([[1, 2, 3], [4, 6, 8]])
    torch.testing.assert_close(variance(x), x.double().var(-1, unbiased=False).float(), **F32)  # oracle: torch.var
    torch.testing.assert_close(variance(x.tolist(), unbiased=True), x.double().var(-1).float(), **F32)
    with pytest.raises(TypeError, match="x must be a real floating-point tensor, got dtype torch.bool"):
        variance(x > 2)
    with pytest.raises(ValueError, match=r"the variance over dim -1 needs at least 1 value\(s\), got 0 "
                                         r"\(x of shape \(2, 0\)\)"):
        variance(torch.zeros(2, 0))
    with pytest.raises(ValueError, match=r"the unbiased variance over dim 0 needs at least 2 value\(s\), got 1"):
        variance(torch.zeros(1, 3), dim=0, unbiased=True)
    with pytest.raises(ValueError, match=r"dim \(2\) must name an axis of x of shape \(2, 3\)"):
        variance(x, dim=2)


def test_deepnorm_checks_its_input():
    """Issue 11: a list x reached alpha * x (TypeError from a torch call)."""
    block = DeepNormResidual(4, nn.Linear(4, 4), alpha=2.0)
    with pytest.raises(TypeError, match="x must be a tensor, got list"):
        block([[1.0, 2.0, 3.0, 4.0]])
    with pytest.raises(ValueError, match=r"x must have shape \(\.\.\., d\) with d = 4, got \(2, 3\)"):
        block(torch.randn(2, 3))


# ================================================================= the chapter's Try-it solutions


def test_try_it_solutions_of_chapter_5():
    """Every number and outcome of the chapter's Try-it solutions, computed here; the notebook must state them."""
    stated = []
    # 1. a constant vector: LayerNorm gives exact zeros (NaN with eps = 0); RMSNorm gives ones, NaN only for zeros
    c = torch.full((4,), 3.0, dtype=torch.float64)
    assert torch.equal(layer_norm(c), torch.zeros(4, dtype=torch.float64))
    assert torch.isnan(layer_norm(c, eps=0.0)).all()
    assert torch.equal(rms_norm(c, eps=0.0), torch.ones(4, dtype=torch.float64))
    assert torch.isnan(rms_norm(torch.zeros(4, dtype=torch.float64), eps=0.0)).all()
    stated += ["$(3, 3, 3, 3)$", "$(1, 1, 1, 1)$"]
    # 2. BatchNorm refuses one sample; GroupNorm of the same sample works, and is all zeros with G = C
    x = torch.randn(1, 6, dtype=torch.float64)
    message = "batch statistics need more than one value per channel, got N = 1"
    with pytest.raises(ValueError, match=message):
        batch_norm(x, training=True)
    for G in (1, 2, 3):
        y = group_norm(x[..., None], G)
        assert torch.isfinite(y).all() and y.abs().max() > 0.5
    assert torch.equal(group_norm(x[..., None], 6), torch.zeros(1, 6, 1, dtype=torch.float64))
    stated += [message, "`G = C`"]
    # 3. DeepNorm's constants for a 1000-layer decoder
    alpha, beta = deepnorm_constants(1000)
    assert alpha == pytest.approx(2000 ** 0.25, rel=1e-12) and beta == pytest.approx(8000 ** -0.25, rel=1e-12)
    stated += [f"{alpha:.2f}", f"{beta:.3f}", f"{1 / beta:.1f} times smaller", "2000^{1/4}", "8000^{-1/4}"]
    assert_states("05-normalization.ipynb", stated)


# ================================================================= the final norm before the LM head (chapter 5)


def test_final_norm_before_the_lm_head_is_rmsnorm_of_the_last_residual_stream():
    """A pre-norm stack never normalises its residual stream; TinyGPT (as Llama) applies one RMSNorm before the head.

    Oracle: the last block's output captured with a forward hook, ``torch.nn.functional.rms_norm`` with the
    model's final gain, and a plain matrix product with the tied embedding (``F32``)."""
    from llmbook.lm.gpt import GPTConfig, TinyGPT

    torch.manual_seed(0)
    model = TinyGPT(GPTConfig(vocab_size=50, d_model=32, n_layers=3, n_heads=4)).eval()
    with torch.no_grad():
        model.norm.weight.copy_(1 + 0.3 * torch.randn(32))
    captured = []
    hook = model.blocks[-1].register_forward_hook(lambda m, i, o: captured.append(o))
    ids = torch.randint(0, 50, (2, 7), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits = model(ids)
    hook.remove()
    h_L = captured[0]
    ref = F.rms_norm(h_L, (32,), model.norm.weight, model.config.norm_eps) @ model.embed.weight.T
    torch.testing.assert_close(logits, ref, **F32)
    # without it the logits are not those of the model (the stream's scale is not 1)
    assert (h_L @ model.embed.weight.T - logits).abs().max() > 1e-2
