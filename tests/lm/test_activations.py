"""Chapter 6 (06.01-06.09) against torch.nn.functional, scipy (float64) and transformers, plus claim C06.

Tolerances, stated once:

* float32 against a torch oracle: ``rtol = atol = 1e-6`` (``F32``), ``1e-5`` after a matrix product;
* float64 against scipy closed forms: ``rtol = atol = 1e-12`` (``F64``);
* SwiGLU against ``transformers``' ``LlamaMLP`` with the same weights: exact equality; GLU, ReGLU and GeGLU
  against ``LlamaMLP`` with another ``hidden_act`` and T5's ``T5DenseGatedActDense`` (float64, ``F64``).
"""

import numpy as np
import pytest
import scipy.special
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from transformers import LlamaConfig, T5Config
from transformers.activations import ACT2FN
from transformers.models.llama.modeling_llama import LlamaMLP
from transformers.models.t5.modeling_t5 import T5DenseGatedActDense

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
from tests.try_it import assert_states

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


def _copy_gated(ours, gate, up, down):
    """Load the weights of a transformers gated MLP (gate, up and down ``nn.Linear``) into an llmbook module."""
    with torch.no_grad():
        ours.w_gate.weight.copy_(gate.weight)
        ours.w_up.weight.copy_(up.weight)
        ours.w_down.weight.copy_(down.weight)
    return ours


def _llama_mlp(hidden_act, d=8, d_ff=12, seed=0):
    torch.manual_seed(seed)
    cfg = LlamaConfig(hidden_size=d, intermediate_size=d_ff, num_attention_heads=2, hidden_act=hidden_act,
                      mlp_bias=False)
    return LlamaMLP(cfg).double()


def _t5_gated(feed_forward_proj, d=8, d_ff=12, seed=0):
    """T5 v1.1's gated FFN: ``wo(act(wi_0 x) * wi_1 x)``; "gated-gelu" uses ACT2FN["gelu_new"] (tanh GELU)."""
    torch.manual_seed(seed)
    cfg = T5Config(d_model=d, d_ff=d_ff, feed_forward_proj=feed_forward_proj, dropout_rate=0.0)
    return T5DenseGatedActDense(cfg).double().eval()


@pytest.mark.equation("06.06", oracle="torch.nn.functional.glu on cat([xW_a + b_a, xW_b + b_b]) (second half gates); "
                                      "transformers LlamaMLP(hidden_act='sigmoid')")
def test_glu_matches_torch_glu_and_a_sigmoid_gated_llama_mlp():
    x = torch.randn(4, 5, 8, dtype=torch.float64)
    W_a, W_b = weights(8, 12)  # the math's (d_in, d_out); the functional layers take nn.Linear's transpose
    b_a, b_b = torch.randn(12, dtype=torch.float64), torch.randn(12, dtype=torch.float64)
    ref = F.glu(torch.cat([x @ W_a + b_a, x @ W_b + b_b], -1), dim=-1)
    torch.testing.assert_close(glu(x, W_a.T, W_b.T, b_a, b_b), ref, **F64)
    llama = _llama_mlp("sigmoid", seed=3)  # down(sigmoid(gate(x)) * up(x)): the GLU FFN of Dauphin et al.
    m = _copy_gated(GLUFFN(8, 12).double(), llama.gate_proj, llama.up_proj, llama.down_proj)
    with torch.no_grad():
        torch.testing.assert_close(m(x), llama(x), **F64)
        f = glu(x, llama.up_proj.weight, llama.gate_proj.weight) @ llama.down_proj.weight.T
    torch.testing.assert_close(f, llama(x), **F64)


def _degree(f, x, c):
    """The local degree of homogeneity log2(|f(2cx)| / |f(cx)|): 2 for a quadratic, 1 for a linear map."""
    return float(torch.log2(f(2 * c * x).norm() / f(c * x).norm()))


def test_only_the_sigmoid_free_unit_is_quadratic():
    """The bilinear unit (xW_a)(xW_b) has degree 2 at every scale; the sigmoid GLU has degree 1 at both ends."""
    x = torch.randn(64, 8, dtype=torch.float64)
    W_a, W_b = weights(8, 12, seed=5)
    for c in (1e-3, 1.0, 1e3):
        assert _degree(lambda z: (z @ W_a) * (z @ W_b), x, c) == pytest.approx(2.0, abs=1e-12)
        assert _degree(lambda z: reglu(z, W_a.T, W_b.T), x, c) == pytest.approx(2.0, abs=1e-12)
    for c in (1e-3, 1e3):
        assert _degree(lambda z: glu(z, W_a.T, W_b.T), x, c) == pytest.approx(1.0, abs=2e-3)
    assert 1.05 < _degree(lambda z: glu(z, W_a.T, W_b.T), x, 1.0) < 1.95


@pytest.mark.equation("06.07", oracle="transformers T5DenseGatedActDense(feed_forward_proj='gated-relu') and "
                                      "LlamaMLP(hidden_act='relu') (copied weights); positive homogeneity")
def test_reglu_matches_relu_gated_transformers_mlps():
    x = torch.randn(6, 8, dtype=torch.float64)
    t5 = _t5_gated("gated-relu", seed=1)  # wi_0 is T5's gate, wi_1 its value
    with torch.no_grad():
        ref = t5(x)
        f = reglu(x, t5.wi_1.weight, t5.wi_0.weight) @ t5.wo.weight.T
        torch.testing.assert_close(f, ref, **F64)
        llama = _llama_mlp("relu", seed=2)
        m = _copy_gated(ReGLU(8, 12).double(), llama.gate_proj, llama.up_proj, llama.down_proj)
        torch.testing.assert_close(m(x), llama(x), **F64)
    # a law the definition implies but an implementation can break: ReGLU(c x) = c^2 ReGLU(x) for c > 0
    W_a, W_b = weights(8, 12, seed=1)
    torch.testing.assert_close(reglu(3 * x, W_a.T, W_b.T), 9 * reglu(x, W_a.T, W_b.T), **F64)


@pytest.mark.equation("06.08", oracle="transformers T5DenseGatedActDense(feed_forward_proj='gated-gelu', i.e. "
                                      "ACT2FN['gelu_new']) and LlamaMLP(hidden_act='gelu') (copied weights)")
def test_geglu_matches_gelu_gated_transformers_mlps():
    x = torch.randn(6, 8, dtype=torch.float64)
    t5 = _t5_gated("gated-gelu", seed=3)  # T5 v1.1 / Flan-T5: GeGLU with GPT-2's tanh GELU
    assert t5.act.__class__.__name__ == "NewGELUActivation"
    llama = _llama_mlp("gelu", seed=4)  # ACT2FN["gelu"]: the exact, erf GELU
    m = _copy_gated(GeGLU(8, 12).double(), llama.gate_proj, llama.up_proj, llama.down_proj)
    with torch.no_grad():
        f_tanh = geglu(x, t5.wi_1.weight, t5.wi_0.weight, approximate="tanh") @ t5.wo.weight.T
        torch.testing.assert_close(f_tanh, t5(x), **F64)
        torch.testing.assert_close(m(x), llama(x), **F64)
        f = geglu(x, llama.up_proj.weight, llama.gate_proj.weight) @ llama.down_proj.weight.T
        torch.testing.assert_close(f, llama(x), **F64)
        # the two GELUs differ: the tanh GeGLU is not the exact one (a check that could catch a swapped flag)
        assert (f_tanh - geglu(x, t5.wi_1.weight, t5.wi_0.weight) @ t5.wo.weight.T).abs().max() > 1e-7


def test_activations_match_transformers_act2fn():
    """transformers' own activation table (GPT-2's "gelu_new" is the tanh GELU) as a second oracle."""
    for ours, name in ((relu, "relu"), (gelu, "gelu"), (gelu_tanh, "gelu_new"), (silu, "silu"), (mish, "mish")):
        torch.testing.assert_close(ours(X64), ACT2FN[name](X64), **F64)


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
    # the functional form takes the nn.Linear weights as they are
    f = swiglu(x, ref.gate_proj.weight, ref.up_proj.weight, ref.down_proj.weight)
    torch.testing.assert_close(f, ref(x), **MM32)


def test_gated_bad_input():
    W_a, W_b = (w.T for w in weights(8, 12))  # (d_out, d_in) = (12, 8)
    with pytest.raises(ValueError, match="disagree on d_in"):
        glu(torch.randn(3, 7, dtype=torch.float64), W_a, W_b)
    with pytest.raises(ValueError, match="same width"):
        reglu(torch.randn(3, 8, dtype=torch.float64), W_a, W_b[:5])
    with pytest.raises(ValueError, match="approximate"):
        geglu(torch.randn(3, 8, dtype=torch.float64), W_a, W_b, approximate="erf")
    # the other layout, (d_in, d_out), gets an error that says which layout to pass
    x = torch.randn(3, 8, dtype=torch.float64)
    for f, args in ((glu, (W_a.T, W_b.T)), (swiglu, (W_b.T, W_a.T)), (swiglu, (W_b, W_a, W_a))):
        with pytest.raises(ValueError, match=r"nn.Linear's layout \(d_out, d_in\); pass W_\w+\.T"):
            f(x, *args)
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
    W_a, W_b = (w.T for w in weights(8, 6, seed=seed))
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
    W_a, W_b = (w.T for w in weights(8, 12))
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


# ================================================================= the chapter's Try-it solutions


def test_try_it_solutions_of_chapter_6():
    """Every number of the chapter's Try-it solutions, computed here; the notebook must state them."""
    stated = []
    # 1. ReGLU and SwiGLU hold the same weights; at a gate projection of -1 ReLU is 0 with slope 0, SiLU is not
    n_reglu, n_swiglu = (sum(p.numel() for p in cls(12, 32).parameters()) for cls in (ReGLU, SwiGLU))
    assert n_reglu == n_swiglu == 1152
    u = torch.tensor([-1.0], dtype=torch.float64, requires_grad=True)
    (d_relu,) = torch.autograd.grad(relu(u).sum(), u)
    assert relu(u).item() == 0 and d_relu.item() == 0
    (d_silu,) = torch.autograd.grad(silu(u).sum(), u)
    s = scipy.special.expit(-1.0)
    assert silu(u).item() == pytest.approx(-s, abs=1e-15)
    assert d_silu.item() == pytest.approx(s * (1 + (-1) * (1 - s)), abs=1e-15)  # SiLU' = σ(x)(1 + x(1 − σ(x)))
    stated += ["1,152", f"{silu(u).item():.4f}", f"{d_silu.item():.4f}"]
    # 2. autograd at exactly 0: llmbook's relu takes the x branch (1), torch's relu reports 0
    for f, expected in ((relu, 1.0), (F.relu, 0.0)):
        z = torch.zeros(1, requires_grad=True)
        (dz,) = torch.autograd.grad(f(z).sum(), z)
        assert dz.item() == expected
    stated += ["**1**", "**0**"]
    # 3. the tanh GELU's largest gap on the chapter's grid, where, and relative to |GELU| on both sides
    x = torch.linspace(-8, 8, 4001, dtype=torch.float64)
    gap = (gelu_tanh(x) - gelu(x)).abs()
    torch.testing.assert_close(gap, gap.flip(0), rtol=0, atol=1e-14)  # even: both satisfy f(x) - f(-x) = x
    at = abs(x[int(gap.argmax())].item())
    g_pos, g_neg = gelu(torch.tensor([at, -at], dtype=torch.float64)).tolist()
    stated += [f"{gap.max().item() * 1e4:.2f}", f"{at:.2f}", f"{g_pos:.4f}", f"{abs(g_neg):.4f}",
               f"{100 * gap.max().item() / g_pos:.3f}", f"{100 * gap.max().item() / abs(g_neg):.1f}"]
    assert_states("06-activations.ipynb", stated)


# ================================================================= where the smooth activations dip lowest

# numpy closed forms, independent of the torch code under test
_NUMPY_FORMS = {
    "gelu": lambda x: x / 2 * (1 + scipy.special.erf(x / np.sqrt(2))),
    "gelu_tanh": lambda x: 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x**3))),
    "silu": lambda x: x * scipy.special.expit(x),
    "mish": lambda x: x * np.tanh(np.logaddexp(0.0, x)),
}


@pytest.mark.parametrize("name", sorted(_NUMPY_FORMS))
def test_activation_minimum_matches_scipy_brent(name):
    """Golden-section search against scipy.optimize.minimize_scalar (bounded Brent) on numpy closed forms.

    Tolerances: the minimiser to 1e-6 (near a minimum f is flat, so x is the ill-conditioned part), the
    minimum value to 1e-12.
    """
    import scipy.optimize

    from llmbook.lm.activations import activation_minimum

    ref = scipy.optimize.minimize_scalar(_NUMPY_FORMS[name], bounds=(-3, 0), method="bounded",
                                         options={"xatol": 1e-12})
    x_star, f_star = activation_minimum(name)
    assert abs(x_star - ref.x) < 1e-6
    assert abs(f_star - ref.fun) < 1e-12


def test_activation_minimum_of_silu_has_a_closed_form():
    """SiLU'(x) = 0 at x + 1 + e^x = 0, so x* = -1 - W(1/e) (Lambert W, scipy) and SiLU(x*) = x* + 1."""
    from llmbook.lm.activations import activation_minimum

    w = float(scipy.special.lambertw(np.exp(-1.0)).real)
    x_star, f_star = activation_minimum("silu")
    assert abs(x_star - (-1 - w)) < 1e-6  # f is flat at a minimum: float64 pins x* only to about sqrt(eps)
    # e^x* = -(1 + x*) gives sigma(x*) = (1 + x*) / x*, so SiLU(x*) = 1 + x* = -W(1/e)
    assert abs(f_star - (-w)) < 1e-12


def test_activation_minimum_rejects_bad_input():
    from llmbook.lm.activations import activation_minimum

    with pytest.raises(ValueError, match="smooth activation"):
        activation_minimum("relu")
    with pytest.raises(ValueError, match="smooth activation"):
        activation_minimum("tanh")
    with pytest.raises(ValueError, match="a < b"):
        activation_minimum("gelu", bracket=(0.0, -3.0))
    with pytest.raises(ValueError, match="a < b"):
        activation_minimum("gelu", bracket=(float("nan"), 0.0))
    with pytest.raises(TypeError, match="bracket"):
        activation_minimum("gelu", bracket=None)
    with pytest.raises(ValueError, match="tol"):
        activation_minimum("gelu", tol=0.0)
