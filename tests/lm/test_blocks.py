"""Chapter 2, transformer blocks (ids 02.05-02.09) against torch, transformers and statistical laws.

Tolerances: float32 against a torch or transformers module with the same weights, ``rtol = atol =
1e-5`` (``F32``); float64 closed forms ``1e-10`` (``F64``). Random masks are judged by exact laws
(every output is ``0`` or ``x / (1 - p)``) and by moments: a binomial test of the keep count
(``scipy.stats.binomtest``, p-value > 1e-4) and the sample mean within 5 standard errors of the
expectation. All generators are seeded, so the statistical tests are deterministic.
"""

import math

import numpy as np
import pytest
import scipy.stats
import torch
import torch.nn.functional as F
import transformers
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from llmbook.lm.attention import MultiHeadAttention
from llmbook.lm.blocks import (
    Dropout,
    FeedForward,
    PostNormBlock,
    PreNormBlock,
    dropout,
    linear_decay_survival,
    stochastic_depth,
)
from llmbook.lm.norms import LayerNorm
from tests.try_it import assert_states

F32 = dict(rtol=1e-5, atol=1e-5)
F64 = dict(rtol=1e-10, atol=1e-10)
SETTINGS = settings(max_examples=60, deadline=None, derandomize=True)
d_model, n_heads, d_ff = 16, 4, 32


class TorchMHA(nn.Module):
    """Adapter: ``nn.MultiheadAttention`` (weights copied from an encoder layer) as a self-attention sublayer."""

    def __init__(self, source: nn.MultiheadAttention):
        super().__init__()
        self.mha = nn.MultiheadAttention(source.embed_dim, source.num_heads, batch_first=True,
                                         dtype=source.in_proj_weight.dtype)
        self.mha.load_state_dict(source.state_dict())

    def forward(self, x, attn_mask=None):
        return self.mha(x, x, x, attn_mask=attn_mask, need_weights=False)[0]


def encoder_layer(norm_first: bool, activation="relu", dtype=torch.float32) -> nn.TransformerEncoderLayer:
    torch.manual_seed(1)
    layer = nn.TransformerEncoderLayer(d_model, n_heads, d_ff, dropout=0.0, activation=activation,
                                       batch_first=True, norm_first=norm_first, dtype=dtype)
    with torch.no_grad():  # non-trivial norms and biases, so that a swapped parameter would show
        for p in layer.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return layer.eval()


def copy_block(layer: nn.TransformerEncoderLayer, cls, attn: str = "adapter", activation: str = "relu"):
    """Our block with the encoder layer's weights: its MHA (through the adapter or llmbook's), FFN and norms."""
    dtype = layer.linear1.weight.dtype
    if attn == "adapter":
        sub = TorchMHA(layer.self_attn)
    else:
        sub = MultiHeadAttention(d_model, n_heads, bias=True).to(dtype)
        W_q, W_k, W_v = layer.self_attn.in_proj_weight.detach().chunk(3)
        b_q, b_k, b_v = layer.self_attn.in_proj_bias.detach().chunk(3)
        sub.load_state_dict({"q_proj.weight": W_q, "q_proj.bias": b_q, "k_proj.weight": W_k, "k_proj.bias": b_k,
                             "v_proj.weight": W_v, "v_proj.bias": b_v,
                             "o_proj.weight": layer.self_attn.out_proj.weight.detach(),
                             "o_proj.bias": layer.self_attn.out_proj.bias.detach()})
    mlp = FeedForward(d_model, d_ff, activation=activation).to(dtype)
    mlp.w1.load_state_dict(layer.linear1.state_dict())
    mlp.w2.load_state_dict(layer.linear2.state_dict())
    block = cls(d_model, sub, mlp, norm=LayerNorm).to(dtype)
    block.norm1.load_state_dict(layer.norm1.state_dict())
    block.norm2.load_state_dict(layer.norm2.state_dict())
    return block.eval()


# ================================================================= 02.05 / 02.06 pre- and post-norm blocks


def assert_block_matches_encoder_layer(norm_first, block_cls, activation):
    """Our block with the weights of nn.TransformerEncoderLayer(norm_first) copied in, unmasked and causal."""
    layer = encoder_layer(norm_first=norm_first, activation=activation)
    block = copy_block(layer, block_cls, activation=activation)
    x = torch.randn(3, 7, d_model)
    torch.testing.assert_close(block(x), layer(x), **F32)
    causal = nn.Transformer.generate_square_subsequent_mask(7)
    torch.testing.assert_close(block(x, attn_mask=causal), layer(x, src_mask=causal, is_causal=True), **F32)


@pytest.mark.equation("02.05", oracle="torch.nn.TransformerEncoderLayer(norm_first=True) with copied weights")
@pytest.mark.parametrize("activation", ["relu", "gelu"])
def test_pre_norm_block_matches_torch_encoder_layer(activation):
    assert_block_matches_encoder_layer(True, PreNormBlock, activation)


@pytest.mark.equation("02.06", oracle="torch.nn.TransformerEncoderLayer(norm_first=False) with copied weights")
@pytest.mark.parametrize("activation", ["relu", "gelu"])
def test_post_norm_block_matches_torch_encoder_layer(activation):
    assert_block_matches_encoder_layer(False, PostNormBlock, activation)


@pytest.mark.equation("02.05", "02.06", oracle="torch.nn.TransformerEncoderLayer in float64, outputs and autograd")
@pytest.mark.parametrize("cls, norm_first", [(PreNormBlock, True), (PostNormBlock, False)])
def test_blocks_with_llmbook_attention_match_torch_float64(cls, norm_first):
    layer = encoder_layer(norm_first=norm_first, dtype=torch.float64)
    block = copy_block(layer, cls, attn="llmbook")
    x = torch.randn(2, 6, d_model, dtype=torch.float64, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_(True)
    causal = nn.Transformer.generate_square_subsequent_mask(6, dtype=torch.float64)
    ours, ref = block(x, is_causal=True), layer(x_ref, src_mask=causal, is_causal=True)
    torch.testing.assert_close(ours, ref, **F64)
    g = torch.randn_like(ours)
    (ours * g).sum().backward()
    (ref * g).sum().backward()
    torch.testing.assert_close(x.grad, x_ref.grad, **F64)


class Zero(nn.Module):
    def forward(self, x, **kwargs):
        return torch.zeros_like(x)


@pytest.mark.equation("02.05", "02.06", oracle="closed forms: zero branches pass h on; post-norm rows: mean 0, var 1")
@SETTINGS
@given(st.floats(0.01, 100.0), st.integers(0, 10_000))
def test_block_laws(scale, seed):
    g = torch.Generator().manual_seed(seed)
    h = scale * torch.randn(2, 5, 8, generator=g, dtype=torch.float64)
    # pre-norm: when both sublayers output zero the stream passes through untouched, at any scale
    assert torch.equal(PreNormBlock(8, Zero(), Zero()).double()(h), h)
    # post-norm: every output row is normalised (LN with unit weight and zero bias), whatever the input scale
    with torch.no_grad():
        out = PostNormBlock(8, nn.Identity(), FeedForward(8, 16)).double()(h)
    np.testing.assert_allclose(out.mean(-1).numpy(), 0.0, atol=1e-10)
    np.testing.assert_allclose(out.var(-1, unbiased=False).numpy(), 1.0, atol=1e-4)  # 1 - eps/var


def test_blocks_reject_bad_input():
    blk = PreNormBlock(8, nn.Identity(), FeedForward(8, 16))
    with pytest.raises(ValueError, match=r"h must have shape \(\.\.\., T, d_model\) with d_model = 8, got \(2, 5, 7\)"):
        blk(torch.randn(2, 5, 7))
    with pytest.raises(ValueError, match="d_model must be a positive int"):
        PostNormBlock(0, nn.Identity(), nn.Identity())
    with pytest.raises(TypeError, match="norm must be a factory"):
        PreNormBlock(8, nn.Identity(), nn.Identity(), norm=3)
    with pytest.raises(ValueError, match=r"p_survive must lie in \(0.0, 1.0\]"):
        PreNormBlock(8, nn.Identity(), nn.Identity(), p_survive=0.0)


# ================================================================= 02.07 feed-forward network


@pytest.mark.equation("02.07", oracle="transformers GPT2MLP (Conv1D weights = W_1, W_2; gelu_new)")
def test_ffn_matches_gpt2_mlp():
    from transformers.models.gpt2.modeling_gpt2 import GPT2MLP

    cfg = transformers.GPT2Config(n_embd=d_model, resid_pdrop=0.0, activation_function="gelu_new")
    ref = GPT2MLP(d_ff, cfg).eval()
    with torch.no_grad():
        for p in ref.parameters():
            p.normal_(0, 0.3)
    ffn = FeedForward(d_model, d_ff, activation="gelu_tanh")
    ffn.load_state_dict({"w1.weight": ref.c_fc.weight.T, "w1.bias": ref.c_fc.bias,  # Conv1D stores W_1 (d, d_ff)
                         "w2.weight": ref.c_proj.weight.T, "w2.bias": ref.c_proj.bias})
    x = torch.randn(2, 5, d_model)
    with torch.no_grad():
        torch.testing.assert_close(ffn(x), ref(x), **F32)


@pytest.mark.equation("02.07", oracle="float64 closed form max(0, x W_1 + b_1) W_2 + b_2 with torch.clamp_min")
@pytest.mark.parametrize("bias", [True, False])
def test_ffn_closed_form(bias):
    ffn = FeedForward(6, 24, activation="relu", bias=bias).double()
    W_1, W_2 = ffn.w1.weight.detach().T, ffn.w2.weight.detach().T
    b_1 = ffn.w1.bias.detach() if bias else 0.0
    b_2 = ffn.w2.bias.detach() if bias else 0.0
    x = torch.randn(3, 4, 6, dtype=torch.float64)
    with torch.no_grad():
        torch.testing.assert_close(ffn(x), (x @ W_1 + b_1).clamp_min(0) @ W_2 + b_2, **F64)
    custom = FeedForward(6, 24, activation=torch.tanh, bias=bias).double()
    custom.load_state_dict(ffn.state_dict())
    with torch.no_grad():
        torch.testing.assert_close(custom(x), torch.tanh(x @ W_1 + b_1) @ W_2 + b_2, **F64)


def test_ffn_rejects_bad_input():
    with pytest.raises(ValueError, match="activation must be one of"):
        FeedForward(4, 8, activation="swish-ish")
    with pytest.raises(TypeError, match="activation must be a name or a callable"):
        FeedForward(4, 8, activation=3)
    with pytest.raises(ValueError, match="d_ff must be a positive int"):
        FeedForward(4, 0)
    with pytest.raises(ValueError, match=r"x must have shape \(\.\.\., d_model\) with d_model = 4, got \(3, 5\)"):
        FeedForward(4, 8)(torch.randn(3, 5))


# ================================================================= 02.08 dropout


def assert_binomial(kept: int, n: int, prob: float):
    p_value = scipy.stats.binomtest(kept, n, prob).pvalue
    assert p_value > 1e-4, f"{kept}/{n} kept, expected rate {prob}: binomial p-value {p_value:.2g}"


@pytest.mark.equation("02.08", oracle="moments: scipy.stats.binomtest on the keep count; E[Dropout(x)] = x; "
                                      "Var = c^2 p/(1-p); torch.nn.functional.dropout obeys the same law")
@pytest.mark.parametrize("p", [0.1, 0.5, 0.8])
def test_dropout_moments(p):
    c, n = 3.0, 100_000
    x = torch.full((n,), c, dtype=torch.float64)
    y = dropout(x, p, generator=torch.Generator().manual_seed(7))
    torch.manual_seed(7)
    y_ref = F.dropout(x, p, training=True)
    for out in (y, y_ref):
        kept = out != 0
        torch.testing.assert_close(out[kept], torch.full_like(out[kept], c / (1 - p)), rtol=1e-12, atol=0)
        assert_binomial(int(kept.sum()), n, 1 - p)
        se = c * math.sqrt(p / (1 - p) / n)  # standard error of the mean
        assert abs(out.mean().item() - c) < 5 * se, "inverted scaling keeps the expectation"
        assert out.var().item() == pytest.approx(c**2 * p / (1 - p), rel=0.03)


@pytest.mark.equation("02.08", oracle="torch.nn.Dropout / F.dropout in eval mode (identity), and at p = 0 and 1")
def test_dropout_eval_identity_and_limits():
    x = torch.randn(4, 6)
    assert torch.equal(dropout(x, 0.4, training=False), F.dropout(x, 0.4, training=False))
    m = Dropout(0.4).eval()
    assert torch.equal(m(x), nn.Dropout(0.4).eval()(x)) and torch.equal(m(x), x)
    assert torch.equal(dropout(x, 0.0), x)
    assert torch.equal(dropout(x, 1.0), F.dropout(x, 1.0, training=True))  # all zeros, no NaN


@pytest.mark.equation("02.08", oracle="torch.autograd: the gradient is m / (1 - p)")
@SETTINGS
@given(st.floats(0.0, 0.95), st.integers(0, 10_000))
def test_dropout_values_and_gradient(p, seed):
    x = torch.randn(50, dtype=torch.float64, requires_grad=True)
    y = dropout(x, p, generator=torch.Generator().manual_seed(seed))
    kept = y.detach() != 0
    torch.testing.assert_close(y[kept], x[kept] / (1 - p), rtol=1e-12, atol=0)
    y.sum().backward()
    torch.testing.assert_close(x.grad, kept.double() / (1 - p), rtol=1e-12, atol=0)


def test_dropout_rejects_bad_input():
    with pytest.raises(ValueError, match=r"p must lie in \[0.0, 1.0\], got 1.5"):
        dropout(torch.ones(3), 1.5)
    with pytest.raises(ValueError, match="p must be a real number, got nan"):
        Dropout(float("nan"))
    with pytest.raises(TypeError, match="p must be a real number, got '0.5'"):
        Dropout("0.5")


# ================================================================= 02.09 stochastic depth


@pytest.mark.equation("02.09", oracle="moments: scipy.stats.binomtest on the survival count; E[out] = h + f(h) "
                                      "(inverted), h + p_l f(h) (paper form)")
@pytest.mark.parametrize("inverted", [True, False])
def test_stochastic_depth_rows(inverted):
    p_l, N = 0.7, 20_000
    h = torch.randn(N, 3, 4, dtype=torch.float64)
    f_h = torch.randn(N, 3, 4, dtype=torch.float64)
    out = stochastic_depth(h, f_h, p_l, inverted=inverted, generator=torch.Generator().manual_seed(3))
    b = ((out - h) / f_h).reshape(N, -1)  # the per-row multiplier of the branch
    scale = 1 / p_l if inverted else 1.0
    assert torch.allclose(b, b[:, :1], rtol=0, atol=1e-9), "a whole example's branch is kept or dropped"
    kept = b[:, 0] > 0.5 * scale
    torch.testing.assert_close(b[kept, 0], torch.full_like(b[kept, 0], scale), rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(b[~kept, 0], torch.zeros_like(b[~kept, 0]), rtol=0, atol=1e-9)
    assert_binomial(int(kept.sum()), N, p_l)
    mean_b, se = b[:, 0].mean().item(), scale * math.sqrt(p_l * (1 - p_l) / N)
    expected = 1.0 if inverted else p_l  # the multiplier that eval mode applies
    assert abs(mean_b - expected) < 5 * se
    ev = stochastic_depth(h, f_h, p_l, training=False, inverted=inverted)
    torch.testing.assert_close(ev, h + expected * f_h, rtol=0, atol=0)


@pytest.mark.equation("02.09", oracle="moments: scipy.stats.binomtest on whole-batch survival over 4000 draws")
def test_stochastic_depth_batch_mode():
    g = torch.Generator().manual_seed(5)
    h, f_h = torch.zeros(8, 2), torch.ones(8, 2)
    kept = 0
    for _ in range(4000):
        out = stochastic_depth(h, f_h, 0.6, mode="batch", generator=g)
        assert out.unique().numel() == 1  # one draw for the whole batch
        kept += int(out[0, 0] > 0)
    assert_binomial(kept, 4000, 0.6)


@pytest.mark.equation("02.09", oracle="numpy.linspace(1, p_L, L + 1)[1:] (Huang et al. 2016 linear rule)")
@pytest.mark.parametrize("L, p_L", [(1, 0.5), (12, 0.5), (54, 0.8)])
def test_linear_decay_survival(L, p_L):
    np.testing.assert_allclose(linear_decay_survival(L, p_L), np.linspace(1, p_L, L + 1)[1:], rtol=0, atol=1e-12)


@pytest.mark.equation("02.09", oracle="eval-mode identity: a block with p_survive < 1 equals the plain block")
def test_block_stochastic_depth_is_off_in_eval():
    torch.manual_seed(2)
    plain = PreNormBlock(8, nn.Linear(8, 8), FeedForward(8, 16))
    torch.manual_seed(2)
    dropped = PreNormBlock(8, nn.Linear(8, 8), FeedForward(8, 16), p_survive=0.5)
    x = torch.randn(4, 3, 8)
    assert torch.equal(dropped.eval()(x), plain.eval()(x))
    dropped.train()
    torch.manual_seed(0)
    outs = dropped(torch.randn(64, 3, 8))
    assert outs.shape == (64, 3, 8)


def test_stochastic_depth_rejects_bad_input():
    with pytest.raises(ValueError, match=r"p_l must lie in \(0.0, 1.0\]"):
        stochastic_depth(torch.zeros(2, 3), torch.zeros(2, 3), 0.0)
    with pytest.raises(ValueError, match="must have the same shape"):
        stochastic_depth(torch.zeros(2, 3), torch.zeros(2, 4), 0.5)
    with pytest.raises(ValueError, match="mode must be 'row'"):
        stochastic_depth(torch.zeros(2, 3), torch.zeros(2, 3), 0.5, mode="col")
    with pytest.raises(ValueError, match="L must be a positive int"):
        linear_decay_survival(0)


# ================================================================= fp16 / bf16 (issue 11)


@pytest.mark.parametrize("dtype, tol", [(torch.float16, 2e-2), (torch.bfloat16, 1e-1)])
def test_post_norm_block_in_half_precision_matches_float64(dtype, tol):
    # residual stream of size ~300: the attention scores and the norms' variances overflow fp16
    # unless computed in float32. Oracle: the same weights run in float64 on the same (rounded) input.
    torch.manual_seed(0)
    blk = PostNormBlock(64, attn=MultiHeadAttention(64, 4), mlp=FeedForward(64, 128)).eval()
    x = (torch.randn(2, 6, 64) * 300).to(dtype)
    y = blk.to(dtype)(x, is_causal=True)
    y64 = blk.double()(x.double(), is_causal=True)
    assert y.dtype == dtype and torch.isfinite(y).all()
    torch.testing.assert_close(y.double(), y64, rtol=tol, atol=tol)  # outputs are normalised: O(1)


def test_ffn_and_blocks_check_their_input_before_nn_linear():
    """Issue 11: int/bool x reached nn.Linear (a RuntimeError from torch), a list gave an AttributeError."""
    ffn = FeedForward(4, 8)
    blk = PreNormBlock(4, nn.Identity(), FeedForward(4, 8))
    x = torch.randn(2, 3, 4)
    for dt in (torch.int64, torch.bool):
        with pytest.raises(TypeError, match=rf"x must be a real floating-point tensor, got dtype {dt}"):
            ffn(x.to(dt))
        with pytest.raises(TypeError, match=rf"h must be a real floating-point tensor, got dtype {dt}"):
            blk(x.to(dt))
    with pytest.raises(TypeError, match="x must be a tensor, got list"):
        ffn(x.tolist())
    with pytest.raises(TypeError, match=r"h \(torch.float64\) must have the dtype of the PreNormBlock's parameters "
                                        r"\(torch.float32\)"):
        blk(x.double())


# ================================================================= the chapter's Try-it solutions, its warm-up sentence


class _ZeroBranch(nn.Module):
    def forward(self, x, **kwargs):
        return torch.zeros_like(x)


def _stochastic_depth_gap(attn, mlp, N=100_000):
    """(|exact mean - eval output|, |Monte-Carlo mean - exact mean|) of a p_survive = 0.5 pre-norm block."""
    torch.manual_seed(0)
    blk = PreNormBlock(16, attn(), mlp(), p_survive=0.5)
    h = 0.1 * torch.randn(1, 5, 16, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        y_eval = blk.eval()(h, is_causal=True)
        A = blk.attn(blk.norm1(h), is_causal=True)
        exact = h + A + 0.5 * (blk.mlp(blk.norm2(h)) + blk.mlp(blk.norm2(h + 2 * A)))  # the 4 branch patterns
        mean = blk.train()(h.expand(N, 5, 16), is_causal=True).mean(0, keepdim=True)
    return (exact - y_eval).abs().max().item(), (mean - exact).abs().max().item()


def test_try_it_solutions_of_chapter_2():
    """Every number of the chapter's Try-it solutions, computed here; the notebook must state them."""
    from llmbook.lm import init
    from llmbook.lm.training import TINY_GPT

    stated = []
    # 1. untying GPT-2 small; a Llama-3-70B-shaped model
    with torch.device("meta"):
        tied = sum(p.numel() for p in transformers.GPT2LMHeadModel(transformers.GPT2Config()).parameters())
        untied = sum(p.numel() for p in transformers.GPT2LMHeadModel(
            transformers.GPT2Config(tie_word_embeddings=False)).parameters())
    assert untied - tied == 50_257 * 768
    blocks_70b, head = 12 * 8192 ** 2 * 80, 128_256 * 8192
    stated += [f"{untied - tied:,}", f"{untied:,}", f"{tied:,}", f"{100 * (untied - tied) / tied:.1f} %",
               f"{blocks_70b / 1e9:.1f} B", f"{head / 1e9:.2f} B", f"{100 * head / blocks_70b:.1f} %"]
    # 2. stochastic depth: the training-mode mean is not the eval output; zero attention removes the gap,
    #    a linear MLP does not (it reads the stream through LayerNorm)
    gap, mc_error = _stochastic_depth_gap(lambda: MultiHeadAttention(16, 4), lambda: FeedForward(16, 64))
    assert round(gap, 2) == 0.17 and mc_error < 0.005
    linear_gap, _ = _stochastic_depth_gap(lambda: MultiHeadAttention(16, 4),
                                          lambda: FeedForward(16, 64, activation=lambda t: t), N=2)
    zero_gap, _ = _stochastic_depth_gap(_ZeroBranch, lambda: FeedForward(16, 64), N=2)
    assert linear_gap > 1e-2 and zero_gap < 1e-6
    stated += [f"{gap:.2f}", "within 0.005"]
    # 3. the tanh depth experiment
    m2 = {rule: init.activation_second_moments(rule, L=30, d=256, N=256, nonlinearity="tanh",
                                               generator=torch.Generator().manual_seed(11))
          for rule in ("he", "xavier", "small")}
    assert init.gain("tanh") == pytest.approx(5 / 3)
    assert max(m2["small"]) < 0.011 and m2["small"][-1] < 1e-40
    stated += [f"{min(m2['he']):.2f}", f"{max(m2['he']):.2f}", f"{m2['he'][-1]:.2f}", f"{m2['xavier'][0]:.2f}",
               f"{m2['xavier'][-1]:.3f}"]
    # the warm-up sentence of the pre-norm section: the book's tiny GPT warms up over 80 of 800 steps
    train_config = TINY_GPT[1]
    assert (train_config.T_warm, train_config.steps) == (80, 800)
    assert_states("02-blocks.ipynb", stated)
    assert_states("02-blocks.ipynb", ["80 of its 800 steps"], section="all")
