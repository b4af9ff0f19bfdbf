"""Chapter 12: GPTQ, AWQ, SmoothQuant, LLM.int8 and whole-model quantisation of the tiny GPT.

Oracles: the sequential optimal-brain-surgeon update written with explicit float64 inverses of the
remaining Hessian (GPTQ's Cholesky form must reproduce it), round-to-nearest through
``torch.fake_quantize_per_channel_affine`` (GPTQ with H = I), the AWQ objective evaluated by brute force
over the grid with torch's fake quantiser, the float64 product ``X @ W.T`` (SmoothQuant, LLM.int8 with
every column in float) and ``bitsandbytes.functional.int8_vectorwise_quant`` (LLM.int8's int8 part).
"""

from __future__ import annotations

import pytest
import torch
from torch.ao.quantization import PerChannelMinMaxObserver

from llmbook.lm.gptq import (
    awq_quantize,
    gptq_quantize,
    gptq_quantize_naive,
    llm_int8_matmul,
    quantize_model,
    smooth_quant,
)
from llmbook.lm.quantization import dequantize, per_channel_quantize
from tests.try_it import assert_states


def _rtn_torch(W: torch.Tensor, b: int, symmetric: bool) -> torch.Tensor:
    """Round-to-nearest per output row with torch's observer and fake quantiser."""
    if symmetric:
        Q = 2 ** (b - 1) - 1
        obs = PerChannelMinMaxObserver(ch_axis=0, dtype=torch.qint8, qscheme=torch.per_channel_symmetric,
                                       quant_min=-Q, quant_max=Q)
        lo, hi = -Q, Q
    else:
        obs = PerChannelMinMaxObserver(ch_axis=0, dtype=torch.quint8, qscheme=torch.per_channel_affine,
                                       quant_min=0, quant_max=2**b - 1)
        lo, hi = 0, 2**b - 1
    obs(W)
    s, z = obs.calculate_qparams()
    return torch.fake_quantize_per_channel_affine(W, s, z.int(), 0, lo, hi)


@pytest.fixture(scope="module")
def tiny():
    from llmbook.lm.training import corpus_tokens, get_batch, pretrained_tiny

    model, _ = pretrained_tiny()
    _, train_ids, heldout_ids = corpus_tokens()
    calib, _ = get_batch(train_ids, 8, 64, torch.Generator().manual_seed(0))
    return model, calib, heldout_ids


# ============================================================== 12.05 GPTQ


@pytest.mark.equation("12.05", oracle="torch.fake_quantize_per_channel_affine (round to nearest) when H = c I")
@pytest.mark.parametrize("b, symmetric", [(4, True), (3, False), (8, False)])
def test_gptq_with_identity_hessian_is_round_to_nearest(b, symmetric):
    W = torch.randn(24, 40)
    W_hat = gptq_quantize(W, 3.7 * torch.eye(40), b, symmetric, block_size=16)
    q, s, z = per_channel_quantize(W, b, symmetric)
    assert torch.equal(W_hat, dequantize(q, s, z))  # exactly: nothing moves when H is diagonal-constant
    ref = _rtn_torch(W, b, symmetric)
    near = (W_hat - ref).abs() > 1e-6
    assert near.double().mean() < 0.01  # torch rounds x * (1/s): only float32 near-ties may differ


@pytest.mark.equation("12.05", oracle="sequential OBS update with explicit float64 inverses of H_F")
@pytest.mark.parametrize("block_size", [1, 3, 64])
def test_gptq_equals_the_naive_sequential_obs_update(block_size):
    g = torch.Generator().manual_seed(3)
    d_out, d_in = 6, 12
    W = torch.randn(d_out, d_in, generator=g, dtype=torch.float64)
    X = torch.randn(200, d_in, generator=g, dtype=torch.float64) @ torch.randn(d_in, d_in, generator=g,
                                                                              dtype=torch.float64)
    H = 2 * X.T @ X
    W_hat = gptq_quantize(W, H, b=3, symmetric=True, block_size=block_size, damp=0.0)
    # the oracle: quantise column i, then move the remaining columns F by the OBS formula
    s = W.abs().amax(1) / 3
    Wr, Q = W.clone(), torch.zeros_like(W)
    for i in range(d_in):
        Hinv_F = torch.linalg.inv(H[i:, i:])
        Q[:, i] = torch.clamp(torch.round(Wr[:, i] / s), -3, 3) * s
        Wr[:, i:] -= ((Wr[:, i] - Q[:, i]) / Hinv_F[0, 0])[:, None] * Hinv_F[0][None, :]
    torch.testing.assert_close(W_hat, Q, rtol=0, atol=1e-10)
    # the library's naive version (shown in chapter 12) is this same loop on GPTQ's own grid
    torch.testing.assert_close(gptq_quantize_naive(W, H, b=3, symmetric=True, damp=0.0), Q, rtol=0, atol=1e-10)


@pytest.mark.equation("12.05", oracle="output error of round-to-nearest (torch fake quantiser), held-out inputs")
@pytest.mark.parametrize("layer", ["blocks.0.mlp.w_down", "blocks.2.attn.q_proj"])
def test_gptq_lowers_the_output_error_of_a_real_tiny_gpt_layer(tiny, layer):
    from llmbook.lm.gptq import linear_inputs

    model, calib, heldout = tiny
    W = dict(model.named_modules())[layer].weight.detach()
    X = linear_inputs(model, calib)[layer].double()
    test_ids = torch.as_tensor(heldout[:8 * 64].astype("int64")).view(8, 64)
    X_test = linear_inputs(model, test_ids)[layer]
    for b in (4, 3):
        W_gptq = gptq_quantize(W, 2 * X.T @ X / len(X), b)
        W_rtn = _rtn_torch(W, b, symmetric=False)
        for inputs in (X.float(), X_test):
            err_gptq = (inputs @ (W - W_gptq).T).norm()
            err_rtn = (inputs @ (W - W_rtn).T).norm()
            assert err_gptq < 0.9 * err_rtn, (layer, b, float(err_gptq), float(err_rtn))


def test_gptq_errors_and_dead_inputs():
    W = torch.randn(3, 4)
    with pytest.raises(ValueError, match=r"H must have shape \(4, 4\)"):
        gptq_quantize(W, torch.eye(3))
    H = torch.diag(torch.tensor([1.0, 0.0, 2.0, 1.0]))  # input 1 is always zero: its column is dropped
    assert (gptq_quantize(W, H)[:, 1] == 0).all()
    with pytest.raises(ValueError, match="not positive definite"):
        gptq_quantize(W, -torch.ones(4, 4) - torch.eye(4), damp=0.0)


# ============================================================== 12.06 AWQ


@pytest.mark.equation("12.06", oracle="brute-force grid evaluation of the AWQ objective with torch's fake quantiser")
def test_awq_picks_the_grid_minimum_of_the_objective(tiny):
    from llmbook.lm.gptq import linear_inputs

    model, calib, _ = tiny
    layer = "blocks.1.mlp.w_up"
    W = dict(model.named_modules())[layer].weight.detach()
    X = linear_inputs(model, calib)[layer]
    r = awq_quantize(W, X, b=3, n_grid=20)
    mean_abs = X.abs().mean(0)
    oracle = []
    for k in range(20):
        s = mean_abs.pow(k / 20).clamp(min=1e-4)
        s = s / (s.max() * s.min()).sqrt()
        W_hat = _rtn_torch(W * s, 3, symmetric=False) / s
        oracle.append(float((X @ W_hat.T - X @ W.T).pow(2).mean()))
    oracle = torch.tensor(oracle, dtype=torch.float64)
    torch.testing.assert_close(r.losses, oracle, rtol=2e-3, atol=0)
    assert oracle[round(r.alpha * 20)] <= oracle.min() * (1 + 2e-3)
    assert r.alpha > 0 and oracle.min() < oracle[0]  # scaling helps (a little, here): alpha = 0 is round-to-nearest
    rtn_loss = float((X @ (_rtn_torch(W, 3, False) - W).T).pow(2).mean())
    assert abs(float(r.losses[0]) - rtn_loss) < 2e-3 * rtn_loss


def test_awq_protects_a_salient_channel():
    g = torch.Generator().manual_seed(0)
    W = torch.randn(16, 32, generator=g)
    X = torch.randn(256, 32, generator=g)
    X[:, 5] *= 30  # one input channel with large activations
    r = awq_quantize(W, X, b=3)
    err_rtn = (X @ (_rtn_torch(W, 3, False) - W).T).pow(2).mean()
    err_awq = (X @ (r.W_hat - W).T).pow(2).mean()
    assert err_awq < 0.5 * err_rtn and r.s[5] == r.s.max()


# ============================================================== 12.07 SmoothQuant


@pytest.mark.equation("12.07", oracle="float64 matmul X @ W.T (exactness) and per-channel maxima")
def test_smoothquant_keeps_the_product_and_moves_outliers_into_weights():
    g = torch.Generator().manual_seed(1)
    X = torch.randn(4, 50, 64, generator=g, dtype=torch.float64)
    X[..., [3, 17]] *= 40.0  # activation outlier channels
    W = torch.randn(32, 64, generator=g, dtype=torch.float64) * 0.1
    X_hat, W_hat, s = smooth_quant(X, W, alpha=0.5)
    torch.testing.assert_close(X_hat @ W_hat.T, X @ W.T, rtol=0, atol=1e-12)
    ax, aw = X_hat.abs().amax((0, 1)), W_hat.abs().amax(0)
    torch.testing.assert_close(ax, aw, rtol=1e-12, atol=0)  # alpha = 1/2 balances the channel maxima
    spread = lambda a: float(a.max() / a.median())  # noqa: E731
    assert spread(X_hat.abs().amax((0, 1))) < 0.3 * spread(X.abs().amax((0, 1)))
    # W8A8 per-tensor int8: the smoothed pair has a much smaller output error
    def w8a8(A, B):
        fq = lambda t: torch.fake_quantize_per_tensor_affine(t.float(), float(t.abs().max() / 127), 0, -127, 127)  # noqa: E731
        return fq(A).double() @ fq(B).double().T
    err_plain = (w8a8(X.reshape(-1, 64), W) - (X @ W.T).reshape(-1, 32)).norm()
    err_smooth = (w8a8(X_hat.reshape(-1, 64), W_hat) - (X @ W.T).reshape(-1, 32)).norm()
    assert err_smooth < 0.5 * err_plain


def test_smoothquant_alpha_limits():
    X, W = torch.randn(10, 8, dtype=torch.float64) * 5, torch.randn(4, 8, dtype=torch.float64)
    _, W1, s1 = smooth_quant(X, W, alpha=1.0)
    torch.testing.assert_close(s1, X.abs().amax(0))  # all the difficulty moved into the weights
    _, _, s0 = smooth_quant(X, W, alpha=0.0)
    torch.testing.assert_close(s0, 1 / W.abs().amax(0))
    with pytest.raises(ValueError, match=r"alpha must lie in \[0.0, 1.0\]"):
        smooth_quant(X, W, alpha=1.5)


# ============================================================== 12.08 LLM.int8


@pytest.mark.equation("12.08", oracle="float64 matmul X @ W.T with every column an outlier (threshold 0)")
def test_llm_int8_is_the_float_matmul_when_everything_is_an_outlier():
    X = torch.randn(3, 7, 16, dtype=torch.float64)
    W = torch.randn(5, 16, dtype=torch.float64)
    torch.testing.assert_close(llm_int8_matmul(X, W, threshold=0.0), X @ W.T, rtol=0, atol=1e-12)


@pytest.mark.equation("12.08", oracle="bitsandbytes.functional.int8_vectorwise_quant (CPU) for the int8 part")
def test_llm_int8_decomposition_matches_bitsandbytes_quantisation():
    F = pytest.importorskip("bitsandbytes.functional")
    g = torch.Generator().manual_seed(4)
    X = torch.randn(12, 32, generator=g)
    X[:, [4, 20]] *= 15  # outlier columns: |x| >= 6 somewhere
    W = torch.randn(8, 32, generator=g) * 0.1
    _, _, cols = F.int8_vectorwise_quant(X, threshold=6.0)  # bitsandbytes' outlier columns
    out = torch.zeros(32, dtype=torch.bool)
    out[cols.long()] = True
    assert out.nonzero().flatten().tolist() == [4, 20]
    CA, SCA, _ = F.int8_vectorwise_quant(X[:, ~out].contiguous())  # row-wise int8 of X_normal
    CB, SCB, _ = F.int8_vectorwise_quant(W[:, ~out].contiguous())  # row-wise int8 of W's normal columns
    ref = (X[:, out].double() @ W[:, out].double().T
           + (CA.double() @ CB.double().T) * SCA.double()[:, None] * SCB.double()[None, :] / 127**2)
    torch.testing.assert_close(llm_int8_matmul(X, W, 6.0).double(), ref, rtol=1e-5, atol=1e-5)
    # keeping the outliers in float is what makes int8 accurate here
    exact = X.double() @ W.double().T
    err_dec = (llm_int8_matmul(X, W, 6.0).double() - exact).norm()
    err_all_int8 = (llm_int8_matmul(X, W, float("inf")).double() - exact).norm()
    assert err_dec < 0.25 * err_all_int8


# ============================================================== the whole tiny GPT


def test_quantize_model_returns_a_new_model_and_ranks_the_methods(tiny):
    from llmbook.lm.training import evaluate_loss

    model, calib, heldout = tiny
    before = {k: v.clone() for k, v in model.state_dict().items()}
    data = heldout[:2049]
    fp = evaluate_loss(model, data, T=64)
    losses = {}
    for method, b in [("rtn", 8), ("rtn", 3), ("gptq", 3), ("nf", 4)]:
        q = quantize_model(model, method, b, calib)
        assert q is not model and not q.training
        losses[method, b] = evaluate_loss(q, data, T=64)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())  # the input is untouched
    assert abs(losses["rtn", 8] - fp) < 2e-3
    assert losses["gptq", 3] < losses["rtn", 3]
    assert losses["nf", 4] < losses["rtn", 3]
    with pytest.raises(ValueError, match="needs calib_ids"):
        quantize_model(model, "gptq", 4)
    with pytest.raises(ValueError, match="method must be one of"):
        quantize_model(model, "fp4", 4)


# ============================================================== Try it (book/12-quantization.ipynb)


def test_try_it_numbers_of_chapter_12(tiny):
    from llmbook.lm.gptq import linear_inputs
    from llmbook.lm.quantization import absmax_quantize
    from llmbook.lm.training import corpus_tokens, get_batch

    stated = []
    # 1. absmax 4 bits, with and without the 2.0
    x = torch.tensor([0.1, -0.4, 0.25, 2.0])
    q, s = absmax_quantize(x, 4)
    assert q.tolist() == [0, -1, 1, 7]
    err = (s * q - x).abs()
    assert int(err.argmax()) == 1 and float(s * q[0]) == 0.0
    q3, s3 = absmax_quantize(x[:3], 4)
    assert q3.tolist() == [2, -7, 4]
    stated += ["`q = [0, -1, 1, 7]`", f"{float(s):.4f}", f"{float(err[1]):.3f}", "`q = [2, -7, 4]`",
               f"{float(s3):.4f}", f"({float(s3 * q3[0]):.4f}, {float(s3 * q3[1]):.1f}, {float(s3 * q3[2]):.4f})",
               f"{float((s3 * q3 - x[:3]).abs().max()):.4f}"]
    # 2. memory of a 7 B model
    bits_dq = 4 + 8 / 64 + 32 / (64 * 256)
    gb = {bits: 7e9 * bits / 8 / 1e9 for bits in (16, 8, 4.5, bits_dq)}
    stated += [f"= {gb[16]:.0f} GB", f"int8: {gb[8]:.0f} GB", f"{gb[4.5]:.2f} GB", f"({bits_dq:.3f} bits): "
               f"{gb[bits_dq]:.2f} GB", f"saves\n   {gb[4.5] - gb[bits_dq]:.2f} GB"]
    # 3. GPTQ's damping on blocks.1.mlp.w_down, 3 bits (the notebook's calibration: 16 x 64 training characters)
    model, _, heldout = tiny
    _, train_ids, _ = corpus_tokens()
    calib, _ = get_batch(train_ids, 16, 64, torch.Generator().manual_seed(0))
    test_x = torch.as_tensor(heldout[4096:4096 + 512].astype("int64")).view(8, 64)
    name = "blocks.1.mlp.w_down"
    X, Xt = linear_inputs(model, calib)[name].double(), linear_inputs(model, test_x)[name]
    W = dict(model.named_modules())[name].weight.detach()
    H = 2 * X.T @ X / len(X)
    rel = lambda Wq: float((Xt @ (Wq - W).T).norm() / (Xt @ W.T).norm())  # noqa: E731
    rtn = rel(dequantize(*per_channel_quantize(W, 3, symmetric=False)))
    errs = {d: rel(gptq_quantize(W, H, 3, damp=d)) for d in (0.0, 0.01, 0.1, 1.0, 1e4)}
    assert min(errs, key=errs.get) == 0.1 and errs[1e4] < rtn < errs[1e4] + 1e-3 and errs[0.0] < rtn
    stated += [f"round-to-nearest {rtn:.3f}", f"`damp=0.0` {errs[0.0]:.3f}", f"`0.01`\n   {errs[0.01]:.3f}",
               f"`0.1` {errs[0.1]:.3f}", f"`1.0` {errs[1.0]:.3f}", f"`damp=1e4` {errs[1e4]:.3f} again"]
    assert_states("12-quantization.ipynb", stated)
