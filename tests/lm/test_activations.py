"""Chapter 6 (06.01-06.09) against torch.nn.functional, scipy (float64) and transformers, plus claim C06.

Tolerances, stated once:

* float32 against a torch oracle: ``rtol = atol = 1e-6`` (``F32``), ``1e-5`` after a matrix product;
* float64 against scipy closed forms: ``rtol = atol = 1e-12`` (``F64``);
* SwiGLU against ``transformers``' ``LlamaMLP`` with the same weights: exact equality.
"""

import numpy as np
import pytest
import scipy.special
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaMLP

from llmbook.lm.activations import (
    GLUFFN,
    GeGLU,
    ReGLU,
    SwiGLU,
    geglu,
    gelu,
    gelu_tanh,
    glu,
    mish,
    reglu,
    relu,
    silu,
    softplus,
    swiglu,
    swiglu_hidden_size,
)
from llmbook.lm.blocks import FeedForward

F32 = dict(rtol=1e-6, atol=1e-6)
MM32 = dict(rtol=1e-5, atol=1e-5)
F64 = dict(rtol=1e-12, atol=1e-12)
SETTINGS = settings(max_examples=60, deadline=None, derandomize=True)
X32 = torch.linspace(-12, 12, 2001)
X64 = X32.double()


# ================================================================= pointwise activations


@pytest.mark.equation("06.01", oracle="torch.nn.functional.relu")
def test_relu():
    torch.testing.assert_close(relu(X32), F.relu(X32), rtol=0, atol=0)


@pytest.mark.equation("06.02", oracle="torch.nn.functional.gelu(approximate='none'); scipy.special.erf (float64)")
def test_gelu_exact():
    torch.testing.assert_close(gelu(X32), F.gelu(X32), **F32)
    ref = X64.numpy() * 0.5 * (1 + scipy.special.erf(X64.numpy() / np.sqrt(2)))
    np.testing.assert_allclose(gelu(X64).numpy(), ref, **F64)


@pytest.mark.equation("06.03", oracle="torch.nn.functional.gelu(approximate='tanh')")
def test_gelu_tanh_and_its_distance_from_exact():
    torch.testing.assert_close(gelu_tanh(X32), F.gelu(X32, approximate="tanh"), **F32)
    gap = (gelu_tanh(X64) - gelu(X64)).abs().max().item()
    assert 1e-4 < gap < 1e-3  # a real approximation, good to ~5e-4


@pytest.mark.equation("06.04", oracle="torch.nn.functional.silu; scipy.special.expit (float64)")
def test_silu():
    torch.testing.assert_close(silu(X32), F.silu(X32), **F32)
    np.testing.assert_allclose(silu(X64).numpy(), X64.numpy() * scipy.special.expit(X64.numpy()), **F64)
    big = torch.tensor([-1000.0, 1000.0])
    assert torch.isfinite(silu(big)).all() and silu(big).tolist() == [-0.0, 1000.0]


@pytest.mark.equation("06.05", oracle="torch.nn.functional.mish; numpy log1p/exp closed form (float64)")
def test_mish():
    torch.testing.assert_close(mish(X32), F.mish(X32), **F32)
    x = X64.numpy()
    np.testing.assert_allclose(mish(X64).numpy(), x * np.tanh(np.logaddexp(0.0, x)), **F64)
    torch.testing.assert_close(softplus(X64), F.softplus(X64, threshold=1000.0), **F64)


def test_derivatives_from_autograd_match_closed_forms():
    x = X64.clone().requires_grad_(True)
    (g_silu,) = torch.autograd.grad(silu(x).sum(), x)
    s = scipy.special.expit(X64.numpy())
    np.testing.assert_allclose(g_silu.numpy(), s * (1 + X64.numpy() * (1 - s)), **F64)
    (g_gelu,) = torch.autograd.grad(gelu(x).sum(), x)
    xn = X64.numpy()
    ref = 0.5 * (1 + scipy.special.erf(xn / np.sqrt(2))) + xn * np.exp(-xn ** 2 / 2) / np.sqrt(2 * np.pi)
    np.testing.assert_allclose(g_gelu.numpy(), ref, **F64)


# ================================================================= gated units


def weights(d_in, d_out, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(d_in, d_out, generator=g, dtype=dtype) / d_in ** 0.5,
            torch.randn(d_in, d_out, generator=g, dtype=dtype) / d_in ** 0.5)


@pytest.mark.equation("06.06", oracle="torch.nn.functional.glu on cat([xW_a + b_a, xW_b + b_b]) (second half gates)")
def test_glu_matches_torch_glu():
    x = torch.randn(4, 5, 8, dtype=torch.float64)
    W_a, W_b = weights(8, 12)
    b_a, b_b = torch.randn(12, dtype=torch.float64), torch.randn(12, dtype=torch.float64)
    ref = F.glu(torch.cat([x @ W_a + b_a, x @ W_b + b_b], -1), dim=-1)
    torch.testing.assert_close(glu(x, W_a, W_b, b_a, b_b), ref, **F64)
    m = GLUFFN(8, 12)
    xf = x.float()
    torch.testing.assert_close(m(xf), m.w_down(F.glu(torch.cat([m.w_up(xf), m.w_gate(xf)], -1))), **MM32)


@pytest.mark.equation("06.07", oracle="torch.nn.functional.relu on the gate projection (float64)")
def test_reglu():
    x = torch.randn(6, 8, dtype=torch.float64)
    W_a, W_b = weights(8, 12, seed=1)
    torch.testing.assert_close(reglu(x, W_a, W_b), (x @ W_a) * F.relu(x @ W_b), **F64)
    m = ReGLU(8, 12)
    torch.testing.assert_close(m(x.float()), m.w_down(m.w_up(x.float()) * F.relu(m.w_gate(x.float()))), **MM32)


@pytest.mark.equation("06.08", oracle="torch.nn.functional.gelu (approximate='none' and 'tanh') on the gate")
def test_geglu():
    x = torch.randn(6, 8, dtype=torch.float64)
    W_a, W_b = weights(8, 12, seed=2)
    torch.testing.assert_close(geglu(x, W_a, W_b), (x @ W_a) * F.gelu(x @ W_b), **F64)
    torch.testing.assert_close(geglu(x, W_a, W_b, "tanh"), (x @ W_a) * F.gelu(x @ W_b, approximate="tanh"), **F64)
    m = GeGLU(8, 12)
    torch.testing.assert_close(m(x.float()), m.w_down(m.w_up(x.float()) * F.gelu(m.w_gate(x.float()))), **MM32)


@pytest.mark.equation("06.09", oracle="transformers.models.llama.modeling_llama.LlamaMLP (copied weights)")
def test_swiglu_matches_llama_mlp():
    cfg = LlamaConfig(hidden_size=16, intermediate_size=40, num_attention_heads=2, hidden_act="silu", mlp_bias=False)
    ref = LlamaMLP(cfg)
    ours = SwiGLU(16, 40)
    with torch.no_grad():
        ours.w_gate.weight.copy_(ref.gate_proj.weight)
        ours.w_up.weight.copy_(ref.up_proj.weight)
        ours.w_down.weight.copy_(ref.down_proj.weight)
    x = torch.randn(2, 7, 16)
    torch.testing.assert_close(ours(x), ref(x), rtol=0, atol=1e-7)
    # the functional form, math layout (nn.Linear weights transposed)
    f = swiglu(x, ref.gate_proj.weight.T, ref.up_proj.weight.T, ref.down_proj.weight.T)
    torch.testing.assert_close(f, ref(x), **MM32)


def test_gated_bad_input():
    W_a, W_b = weights(8, 12)
    with pytest.raises(ValueError, match="disagree on d_in"):
        glu(torch.randn(3, 7, dtype=torch.float64), W_a, W_b)
    with pytest.raises(ValueError, match="same width"):
        reglu(torch.randn(3, 8, dtype=torch.float64), W_a, W_b[:, :5])
    with pytest.raises(ValueError, match="approximate"):
        geglu(torch.randn(3, 8, dtype=torch.float64), W_a, W_b, approximate="erf")
    with pytest.raises(ValueError, match=r"x must have shape \(\.\.\., d_model\) with d_model = 8, got \(3, 9\)"):
        SwiGLU(8, 12)(torch.randn(3, 9))
    with pytest.raises(ValueError, match="activation must be one of"):
        FeedForward(8, 32, activation="swish2")


@given(seed=st.integers(0, 10_000), c=st.floats(0.01, 100.0))
@SETTINGS
def test_relu_gates_are_positively_homogeneous(seed, c):
    """ReLU(cx) = c ReLU(x) for c > 0, so ReGLU(cx) = c^2 ReGLU(x); SiLU has no such law."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(4, 8, generator=g, dtype=torch.float64)
    W_a, W_b = weights(8, 6, seed=seed)
    torch.testing.assert_close(relu(c * x), c * relu(x), **F64)
    torch.testing.assert_close(reglu(c * x, W_a, W_b), c ** 2 * reglu(x, W_a, W_b), rtol=1e-10, atol=1e-10)


# ================================================================= claim C06 (SwiGLU half)


@pytest.mark.parametrize("d", [96, 768, 1536])
def test_claim_C06_swiglu_8d_over_3_has_the_parameters_of_a_4d_ffn(d):
    d_ff = swiglu_hidden_size(d)
    assert d_ff == 8 * d // 3
    n_swiglu = sum(p.numel() for p in SwiGLU(d, d_ff).parameters())
    n_ffn = sum(p.numel() for p in FeedForward(d, 4 * d, bias=False).parameters())
    assert n_swiglu == n_ffn == 8 * d * d
    assert swiglu_hidden_size(4096, multiple_of=256) == 11008  # Llama-7B's intermediate_size
    assert sum(p.numel() for p in nn.Linear(d, 4 * d, bias=False).parameters()) * 2 == n_ffn


# ================================================================= issue 11: NaN, mixed dtypes, bad sizes


def test_relu_propagates_nan_and_signed_zero_like_torch():
    x = torch.tensor([float("nan"), -0.0, 0.0, -1.0, 3.0, float("-inf"), float("inf")])
    out, ref = relu(x), F.relu(x)  # oracle: torch.nn.functional.relu, bit for bit
    assert torch.equal(out.isnan(), ref.isnan()) and out.isnan()[0]
    assert torch.equal(out[1:], ref[1:]) and torch.equal(out[1:].signbit(), ref[1:].signbit())


@pytest.mark.parametrize("fn", [glu, swiglu])
def test_gated_rejects_mixed_dtypes(fn):
    W_a, W_b = weights(8, 12)  # float64
    with pytest.raises(TypeError, match=r"x \(torch.float32\) and W_\w+ \(torch.float64\) must share one dtype"):
        fn(torch.randn(3, 8), W_a, W_b)
    with pytest.raises(TypeError, match=r"x \(torch.float64\) and W_down \(torch.float32\) must share one dtype"):
        swiglu(torch.randn(3, 8, dtype=torch.float64), W_a, W_b, torch.randn(12, 8))


def test_gated_bias_checks():
    W_a, W_b = weights(8, 12)
    x = torch.randn(3, 8, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"the bias of W_a must have shape \(12,\), got \(8,\)"):
        glu(x, W_a, W_b, b_a=torch.zeros(8, dtype=torch.float64))
    with pytest.raises(TypeError, match=r"the bias of W_b \(torch.float32\) and W_b \(torch.float64\) must share"):
        glu(x, W_a, W_b, b_b=torch.zeros(12))


@pytest.mark.parametrize(
    "call, exc, match",
    [
        (lambda: swiglu_hidden_size(768, ffn_mult=-1), ValueError, r"ffn_mult must lie in \(0.0, inf\), got -1"),
        (lambda: swiglu_hidden_size(768, ffn_mult=float("inf")), ValueError, r"ffn_mult must lie in \(0.0, inf\)"),
        (lambda: swiglu_hidden_size(768, ffn_mult="4"), TypeError, r"ffn_mult must be a real number, got '4'"),
        (lambda: swiglu_hidden_size(1, ffn_mult=0.5), ValueError, r"ffn_mult \* d_model = 0.5 \* 1 is too small"),
        (lambda: swiglu_hidden_size(768.0), TypeError, r"d_model must be a positive int, got 768.0 \(float\)"),
        (lambda: swiglu_hidden_size(768, multiple_of=0), ValueError, r"multiple_of must be a positive int, got 0"),
        (lambda: SwiGLU(8, True), TypeError, r"d_ff must be a positive int, got True \(bool\)"),
        (lambda: SwiGLU(0, 4), ValueError, r"d_model must be a positive int, got 0"),
    ],
)
def test_sizes_reject_bad_values(call, exc, match):
    with pytest.raises(exc, match=match):
        call()


@pytest.mark.parametrize("cls", [GLUFFN, ReGLU, GeGLU, SwiGLU])
def test_gated_modules_check_their_input_before_nn_linear(cls):
    """Issue 11: int/bool x reached nn.Linear (a RuntimeError from torch), a list gave an AttributeError."""
    ffn = cls(8, 12)
    x = torch.randn(2, 3, 8)
    for dt in (torch.int64, torch.bool):
        with pytest.raises(TypeError, match=rf"x must be a real floating-point tensor, got dtype {dt}"):
            ffn(x.to(dt))
    with pytest.raises(TypeError, match="x must be a tensor, got list"):
        ffn(x.tolist())
    with pytest.raises(TypeError, match=r"x \(torch.float64\) must have the dtype of the \w+'s parameters "
                                        r"\(torch.float32\)"):
        ffn(x.double())
