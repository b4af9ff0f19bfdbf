"""RWKV's WKV, RetNet's retention and Hyena's long convolution (chapter 18) against independent references."""

import math

import numpy as np
import pytest
import scipy.signal
import torch

from llmbook.lm.recurrent import HyenaFilter, long_convolution, retention, wkv, wkv_parallel


def wkv_brute(k, v, w, u=None):
    """Float64 sums of equation 18.05 as written (RWKV-4's bonus u; u = None: the catalogue's form, weight e^{k_t})."""
    k, v, w = (t.double().numpy() for t in (k, v, w))
    Bsz, T, C = k.shape
    out = np.zeros((Bsz, T, C))
    for t in range(T):
        if u is None:
            e = np.stack([np.exp(-(t - i) * w + k[:, i]) for i in range(t + 1)])
        else:
            e = np.stack([np.exp(-(t - 1 - i) * w + k[:, i]) for i in range(t)]
                         + [np.exp(u.double().numpy() + k[:, t])])
        out[:, t] = (e * v[:, : t + 1].transpose(1, 0, 2)).sum(0) / e.sum(0)
    return out


def wkv_inputs(Bsz=2, T=12, C=5, seed=0, k_scale=1.0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return dict(k=k_scale * torch.randn(Bsz, T, C, generator=g, dtype=dtype),
                v=torch.randn(Bsz, T, C, generator=g, dtype=dtype),
                w=torch.exp(torch.randn(C, generator=g, dtype=dtype) - 1),
                u=torch.randn(C, generator=g, dtype=dtype))


# ================================================================= 18.05 RWKV


@pytest.mark.equation("18.05", oracle="float64 brute-force sums of the equation")
@pytest.mark.parametrize("bonus", [True, False])
def test_wkv_recurrent_and_parallel_match_brute_force(bonus):
    kw = wkv_inputs()
    if not bonus:
        kw["u"] = None
    ref = wkv_brute(**kw)
    np.testing.assert_allclose(wkv(**kw).numpy(), ref, atol=1e-12)
    np.testing.assert_allclose(wkv_parallel(**kw).numpy(), ref, atol=1e-12)
    # u = None is u = w: the catalogue's form is RWKV-4's with the bonus equal to the decay
    if not bonus:
        np.testing.assert_allclose(wkv(**{**kw, "u": kw["w"]}).numpy(), ref, atol=1e-12)


@pytest.mark.equation("18.05", oracle="transformers.models.rwkv.modeling_rwkv.rwkv_linear_attention_cpu")
def test_wkv_matches_transformers_rwkv():
    from transformers.models.rwkv.modeling_rwkv import rwkv_linear_attention_cpu

    kw = wkv_inputs(dtype=torch.float32, k_scale=3.0)
    # transformers stores time_decay = log w (it applies -exp), time_first = u
    ref, (num, den, mx) = rwkv_linear_attention_cpu(torch.log(kw["w"]), kw["u"], kw["k"], kw["v"], return_state=True)
    ours, (a, b, p) = wkv(**kw, return_state=True)
    torch.testing.assert_close(ours, ref, atol=1e-5, rtol=0)
    # the states agree up to their reference point e^{p}: compare a e^{p}, b e^{p} relative to each other
    torch.testing.assert_close(a / b, num / den, atol=1e-5, rtol=0)
    torch.testing.assert_close(p, mx, atol=1e-5, rtol=0)


@pytest.mark.equation("18.05", oracle="float64 brute-force sums (keys up to 200, where float32 e^k overflows)")
def test_wkv_is_stable_for_large_keys():
    kw = wkv_inputs(k_scale=60.0, T=16)  # keys of magnitude up to ~200: e^k overflows float32 beyond 88.7
    assert kw["k"].abs().max() > 89
    ref = wkv_brute(**kw)  # float64 holds e^200
    kw32 = {n: t.float() for n, t in kw.items()}
    for f in (wkv, wkv_parallel):
        out = f(**kw32)
        assert torch.isfinite(out).all()
        np.testing.assert_allclose(out.numpy(), ref, atol=1e-4)
    # the naive float32 sums overflow: inf / inf
    e = torch.exp(kw32["k"])
    assert torch.isnan((e * kw32["v"]).cumsum(1) / e.cumsum(1)).any()


@pytest.mark.equation("18.05", oracle="float64 brute-force sums over the whole sequence (a state carried across calls)")
def test_wkv_state_carries_across_calls():
    kw = wkv_inputs(T=10)
    ref = wkv_brute(**kw)
    first, state = wkv(kw["k"][:, :4], kw["v"][:, :4], kw["w"], kw["u"], return_state=True)
    second = wkv(kw["k"][:, 4:], kw["v"][:, 4:], kw["w"], kw["u"], state=state)
    np.testing.assert_allclose(torch.cat([first, second], 1).numpy(), ref, atol=1e-12)


def test_wkv_rejects_bad_input():
    kw = wkv_inputs()
    with pytest.raises(ValueError, match="w must be >= 0"):
        wkv(**{**kw, "w": -kw["w"]})
    with pytest.raises(ValueError, match="channels C = 5"):
        wkv(**{**kw, "u": kw["u"][:3]})
    with pytest.raises(TypeError, match="state"):
        wkv(**kw, state=(1, 2))
    with pytest.raises(ValueError, match="v must have shape"):
        wkv_parallel(**{**kw, "v": kw["v"][:, :3]})


# ================================================================= 18.06 RetNet


def retention_brute(q, k, v, gamma):
    """Float64 double sum: o_n = sum_{m <= n} gamma^{n-m} (q_n . k_m) v_m, head by head."""
    q, k, v = (t.double().numpy() for t in (q, k, v))
    gam = np.broadcast_to(np.asarray(gamma, dtype=np.float64), (q.shape[1],))
    out = np.zeros(q.shape[:-1] + (v.shape[-1],))
    for h in range(q.shape[1]):
        for n in range(q.shape[2]):
            for m in range(n + 1):
                out[:, h, n] += gam[h] ** (n - m) * (q[:, h, n] * k[:, h, m]).sum(-1)[:, None] * v[:, h, m]
    return out


def retention_inputs(Bsz=2, H=3, T=13, D=4, D_v=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(Bsz, H, T, d, generator=g, dtype=torch.float64) for d in (D, D, D_v)]


@pytest.mark.equation("18.06", oracle="float64 brute-force double sum over n >= m")
@pytest.mark.parametrize("form,chunk_size", [("parallel", 64), ("recurrent", 64), ("chunkwise", 1),
                                             ("chunkwise", 4), ("chunkwise", 13), ("chunkwise", 64)])
def test_retention_forms_match_brute_force(form, chunk_size):
    q, k, v = retention_inputs()
    gammas = 1 - 2.0 ** (-5 - torch.arange(3, dtype=torch.float64))  # RetNet's multi-scale decays
    for gamma in (0.9, 1.0, gammas):
        ours = retention(q, k, v, gamma, form=form, chunk_size=chunk_size)
        np.testing.assert_allclose(ours.numpy(), retention_brute(q, k, v, gamma), atol=1e-11)
    # head-less input (B, T, D)
    ours = retention(q[:, 0], k[:, 0], v[:, 0], 0.8, form=form, chunk_size=chunk_size)
    np.testing.assert_allclose(ours.numpy(), retention_brute(q[:, :1], k[:, :1], v[:, :1], 0.8)[:, 0], atol=1e-11)


@pytest.mark.equation("18.06", oracle="torch.cumsum (gamma = 1: unnormalised causal linear attention)")
def test_retention_without_decay_is_a_cumulative_sum():
    q, k, v = retention_inputs()
    cum = torch.cumsum(k[..., :, None] * v[..., None, :], dim=2)  # (B, H, T, D, D_v): sum_{m <= n} k_m v_m^T
    ref = (q[..., None, :] @ cum)[..., 0, :]
    for form in ("parallel", "recurrent", "chunkwise"):
        torch.testing.assert_close(retention(q, k, v, 1.0, form=form, chunk_size=5), ref, atol=1e-11, rtol=0)


def test_retention_rejects_bad_arguments():
    q, k, v = retention_inputs()
    with pytest.raises(ValueError, match="gamma"):
        retention(q, k, v, 1.5)
    with pytest.raises(ValueError, match="gamma"):
        retention(q, k, v, torch.tensor([0.5, 0.0, 0.9], dtype=torch.float64))
    with pytest.raises(ValueError, match="one decay per head"):
        retention(q, k, v, torch.tensor([0.5, 0.9]))
    with pytest.raises(ValueError, match="form"):
        retention(q, k, v, 0.9, form="fast")
    with pytest.raises(ValueError, match="chunk_size"):
        retention(q, k, v, 0.9, form="chunkwise", chunk_size=0)
    with pytest.raises(ValueError, match="k must have shape"):
        retention(q, k[..., :2], v, 0.9)


# ================================================================= 18.07 Hyena


@pytest.mark.equation("18.07", oracle="scipy.signal.fftconvolve and a direct numpy.convolve")
@pytest.mark.parametrize("T_h", [1, 7, 20, 31])
def test_long_convolution_matches_fftconvolve_and_direct(T_h):
    rng = np.random.default_rng(0)
    x, h, D = rng.normal(size=(2, 20, 3)), rng.normal(size=(T_h, 3)), rng.normal(size=3)
    y = long_convolution(torch.as_tensor(x), torch.as_tensor(h), torch.as_tensor(D)).numpy()
    ref = scipy.signal.fftconvolve(x, h[None], axes=1)[:, :20] + x * D
    np.testing.assert_allclose(y, ref, atol=1e-12)
    direct = np.stack([[np.convolve(x[b, :, c], h[:, c])[:20] for c in range(3)] for b in range(2)]).transpose(0, 2, 1)
    np.testing.assert_allclose(y, direct + x * D, atol=1e-12)
    y32 = long_convolution(torch.as_tensor(x).float(), torch.as_tensor(h).float()).numpy()
    np.testing.assert_allclose(y32, direct, atol=1e-5)


@pytest.mark.equation("18.07", oracle="a perturbed future input (outputs before it unchanged up to float64 rounding)")
def test_long_convolution_is_causal():
    g = torch.Generator().manual_seed(1)
    x, h = torch.randn(1, 64, 2, generator=g, dtype=torch.float64), torch.randn(64, 2, generator=g, dtype=torch.float64)
    x2 = x.clone()
    x2[0, 40] += 1e3
    diff = (long_convolution(x2, h) - long_convolution(x, h)).abs()
    # the FFT mixes every position, so rounding (1e3 * 1e-16 * log T) is all that leaks backwards
    assert diff[0, :40].max() < 1e-9
    assert diff[0, 40:].max() > 1.0
    torch.testing.assert_close(diff[0, 40:] / 1e3, h[:24].abs(), atol=1e-12, rtol=0)


def test_hyena_filter():
    torch.manual_seed(0)
    f = HyenaFilter(C=6)
    n_params = sum(p.numel() for p in f.parameters())
    for T in (16, 1024):
        h = f(T)
        assert h.shape == (T, 6)
        t = torch.arange(T)[:, None] / T
        bound = (f.layers[2].weight.abs().sum(1) + f.layers[2].bias.abs()) * torch.exp(-t * f.alpha)
        assert (h.abs() <= bound + 1e-6).all()  # the window: |FFN| <= sum |W| + |b| because |sin| <= 1
    assert n_params == sum(p.numel() for p in HyenaFilter(C=6).parameters())
    # the first channel's window reaches 1 % at 30 % of the sequence, the last at 150 %
    assert math.isclose(math.exp(-0.3 * f.alpha[0].item()), 0.01, rel_tol=1e-6)
    assert math.isclose(math.exp(-1.5 * f.alpha[-1].item()), 0.01, rel_tol=1e-6)
    with pytest.raises(ValueError, match="T"):
        f(0)
    with pytest.raises(ValueError, match="C must have shape|channels C = 3"):
        long_convolution(torch.zeros(1, 4, 3), torch.zeros(4, 2))


# ================================================================= the chapter's Try-it solutions


def test_try_it_solutions_of_chapter_18():
    """Every number of chapter 18's Try-it solutions, computed here; the notebook must state them."""
    import scipy.linalg

    from llmbook.lm import ssm
    from llmbook.lm.training import pretrained_tiny
    from tests.try_it import assert_states

    stated = []
    # 1. KV bytes per token of the tiny GPT (captured K and V) against a Mamba-style state with N = 64
    model, tok = pretrained_tiny()
    captured = []
    hooks = [p.register_forward_hook(lambda m, i, o: captured.append(o))
             for blk in model.blocks for p in (blk.attn.k_proj, blk.attn.v_proj)]
    ids = torch.as_tensor(tok.encode("A state space model reads one token at a time."))[None]
    with torch.no_grad():
        model(ids)
    for h in hooks:
        h.remove()
    kv_per_token = sum(t.numel() * t.element_size() for t in captured) / ids.shape[1]
    assert kv_per_token == 2 * 4 * 128 * 4  # oracle: K and V, 4 layers, width 128, float32
    D, L = 2 * model.config.d_model, model.config.n_layers
    for N in (16, 64):
        _, h = ssm.selective_scan(torch.randn(1, 3, D), torch.ones(1, 3, D), -torch.ones(D, N), torch.randn(1, 3, N),
                                  torch.randn(1, 3, N), return_state=True)
        state = L * h.numel() * h.element_size()
        stated.append(f"{state / kv_per_token:.0f} tokens")
    stated += [f"= {state} bytes", f"({kv_per_token:.0f} bytes per token)"]
    _, st = wkv(torch.randn(1, 3, 128), torch.randn(1, 3, 128), torch.ones(128), return_state=True)
    rwkv_bytes = L * sum(s.numel() * s.element_size() for s in st)
    stated += [f"{rwkv_bytes} bytes, is passed after {rwkv_bytes / kv_per_token:.1f} tokens"]
    # 2. first distance at which gamma^n < 1 %, measured through retention (q = k = 1, v one-hot at 0)
    for gamma in (0.96, 1 - 2**-5, 1 - 2**-12):
        T = 20000
        ones = torch.ones(1, T, 1, dtype=torch.float64)
        v = torch.zeros(1, T, 1, dtype=torch.float64)
        v[0, 0, 0] = 1.0
        weight = retention(ones, ones, v, gamma, form="chunkwise", chunk_size=1024)[0, :, 0]
        n = int((weight < 0.01).nonzero()[0])
        assert n == math.ceil(math.log(0.01) / math.log(gamma))  # oracle: the logarithm
        stated.append(f"{n} tokens" if gamma != 1 - 2**-12 else f"only at {n}")
        if gamma == 0.96:
            stated += [f"{math.log(0.01) / math.log(gamma):.1f}", f"$0.96^{{{n}}} = {weight[n].item():.4f}$"]
    # 3. float64 overflow of e^k, and wkv with keys in [1000, 1100]
    e = torch.exp(torch.tensor([709.78, 709.79], dtype=torch.float64))
    assert torch.isfinite(e[0]) and torch.isinf(e[1])
    stated.append(f"$e^{{709.78}} = {e[0].item() / 1e308:.2f} \\times 10^{{308}}$")
    g = torch.Generator().manual_seed(0)
    k, v = 1000 + 100 * torch.rand(1, 16, 4, generator=g), torch.randn(1, 16, 4, generator=g)
    out32, out64 = wkv(k, v, torch.zeros(4)), wkv(k.double(), v.double(), torch.zeros(4, dtype=torch.float64))
    assert torch.isfinite(out32).all() and (out32.double() - out64).abs().max() < 1e-6
    stated.append("within 1e-6")
    # 4. the step response of the oscillator: ZOH exact, bilinear error at dt = 0.5 and 0.1
    A = np.array([[0.0, 1.0], [-4.0, -1.2]])
    B, C = np.array([[0.0], [1.0]]), np.array([[1.0, 0.0]])
    errors = {}
    for dt in (0.5, 0.1):
        t_k = dt * np.arange(1, int(round(8 / dt)) + 1)
        exact = np.array([(C @ np.linalg.solve(A, (scipy.linalg.expm(A * t) - np.eye(2)) @ B))[0, 0] for t in t_k])
        ones = torch.ones(1, len(t_k), 1, dtype=torch.float64)
        for method in ("zoh", "bilinear"):
            A_bar, B_bar = ssm.discretize(torch.as_tensor(A), torch.as_tensor(B), dt, method)
            y = ssm.ssm_scan(A_bar, B_bar, torch.as_tensor(C), None, ones)[0, :, 0].numpy()
            errors[dt, method] = np.abs(y - exact).max()
    assert max(errors[0.5, "zoh"], errors[0.1, "zoh"]) < 1e-14
    ratio = errors[0.5, "bilinear"] / errors[0.1, "bilinear"]
    assert 15 < ratio < 30  # second order: about 5^2
    stated += [f"from {errors[0.5, 'bilinear']:.4f} at", f"to {errors[0.1, 'bilinear']:.4f} at",
               f"{ratio:.0f} times smaller"]
    assert_states("18-sequence-models.ipynb", stated)
