"""FLOPs, latencies, arithmetic intensity and the roofline (17.01, 17.02, 17.05-17.11) against independent oracles.

Oracles: ``torch.utils.flop_counter.FlopCounterMode`` for every FLOP count (compared exactly, ``==``:
both are integers); the real ``nbytes`` of tensors for bytes moved; a brute-force count of the
unmasked pairs of a causal mask; for the latencies and serving metrics a token-emission timeline
built slot by slot in this file (float64, ``rel_tol = 1e-12``) and the roofline identity
``FLOPs / min(P, BW * AI) = max(FLOPs / P, bytes / BW)``. Claim C07 is checked on the book's trained
tiny GPT, forward and backward.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from llmbook.lm import inference as inf
from llmbook.lm.activations import SwiGLU
from llmbook.lm.attention import scaled_dot_product_attention
from llmbook.lm.blocks import FeedForward
from llmbook.lm.gpt import GPTConfig, TinyGPT
from llmbook.lm.norms import RMSNorm
from llmbook.lm.serving import simulate_batching
from llmbook.lm.training import pretrained_tiny

REL = 1e-12


def _counted(fn) -> int:
    with FlopCounterMode(display=False) as counter:
        fn()
    return counter.get_total_flops()


def _fwd_bwd(module, *inputs):
    def run():
        out = module(*inputs)
        out.float().square().sum().backward()
    return run


# ----------------------------------------------------------------------------- 17.01 attention FLOPs


@pytest.mark.equation("17.01", oracle="torch.utils.flop_counter.FlopCounterMode over attention")
@pytest.mark.parametrize("B,H,H_kv,n,n_k,D", [(1, 4, 4, 16, 16, 8), (2, 4, 2, 5, 12, 16), (3, 6, 1, 1, 33, 4)])
def test_attention_flops_match_the_flop_counter(B, H, H_kv, n, n_k, D):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(B, H, n, D, generator=g, requires_grad=True)
    k = torch.randn(B, H_kv, n_k, D, generator=g, requires_grad=True)
    v = torch.randn(B, H_kv, n_k, D, generator=g, requires_grad=True)
    d = H * D
    fwd = _counted(lambda: scaled_dot_product_attention(q, k, v, is_causal=True))  # masks after computing
    assert fwd == inf.attention_flops(n, d, n_k=n_k, B=B)
    kk, vv = k.repeat_interleave(H // H_kv, 1), v.repeat_interleave(H // H_kv, 1)
    with sdpa_kernel(SDPBackend.MATH):  # torch's CPU flash kernel is invisible to the counter; its math path is not
        assert _counted(lambda: F.scaled_dot_product_attention(q, kk, vv)) == fwd
    both = _counted(lambda: scaled_dot_product_attention(q, k, v, is_causal=True).square().sum().backward())
    assert both == inf.attention_flops(n, d, n_k=n_k, B=B, training=True) == 3 * fwd


@pytest.mark.equation("17.01", oracle="brute-force count of the unmasked pairs of a bottom-right causal mask")
@pytest.mark.parametrize("n,n_k", [(1, 1), (7, 7), (3, 10), (1, 64)])
def test_causal_attention_flops_count_the_unmasked_pairs(n, n_k):
    pairs = int(torch.ones(n, n_k).tril(diagonal=n_k - n).sum())
    assert inf.attention_flops(n, 96, n_k=n_k, B=2, n_layers=3, causal=True) == 4 * 96 * pairs * 2 * 3
    assert inf.attention_flops(n, 96, n_k=n_k, causal=True) <= inf.attention_flops(n, 96, n_k=n_k)
    with pytest.raises(ValueError, match="at least as many keys"):
        inf.attention_flops(5, 8, n_k=4, causal=True)


# ----------------------------------------------------------------------------- 17.02 MLP FLOPs


@pytest.mark.equation("17.02", oracle="torch.utils.flop_counter.FlopCounterMode over FeedForward and SwiGLU")
@pytest.mark.parametrize("kind", ["ffn", "swiglu"])
def test_mlp_flops_match_the_flop_counter(kind):
    B, n, d, d_ff = 2, 7, 24, 40
    torch.manual_seed(0)
    mlp = FeedForward(d, d_ff, bias=False) if kind == "ffn" else SwiGLU(d, d_ff)
    x = torch.randn(B, n, d, requires_grad=True)
    m = 2 if kind == "ffn" else 3
    assert _counted(lambda: mlp(x)) == inf.mlp_flops(n, d, d_ff, B=B, n_matrices=m)
    assert _counted(_fwd_bwd(mlp, x)) == inf.mlp_flops(n, d, d_ff, B=B, n_matrices=m, training=True)
    assert inf.mlp_flops(n, d, d_ff, B=B, n_matrices=1) == 2 * B * n * d * d_ff  # the catalogue's 2 n d d_ff


# ----------------------------------------------------------------------------- claim C07: 6ND plus attention


def test_matmul_params_are_the_parameters_less_the_norm_gains():
    model, _ = pretrained_tiny()
    norms = sum(p.numel() for m in model.modules() if isinstance(m, RMSNorm) for p in m.parameters())
    assert inf.matmul_params(model) == model.num_parameters() - norms == 803328
    untied = TinyGPT(GPTConfig(tie_embeddings=False))
    emb = untied.embed.weight.numel()
    norms = sum(p.numel() for m in untied.modules() if isinstance(m, RMSNorm) for p in m.parameters())
    assert inf.matmul_params(untied) == untied.num_parameters() - emb - norms  # the lookup is not a product


@pytest.mark.equation("17.01", oracle="FlopCounterMode over the tiny GPT's forward and backward (claim C07)")
@pytest.mark.parametrize("T", [16, 64, 200])
def test_c07_flop_counter_equals_6ND_plus_the_attention_term(T):
    model, _ = pretrained_tiny()
    cfg = model.config
    ids = torch.randint(0, cfg.vocab_size, (2, T), generator=torch.Generator().manual_seed(T))

    def step():
        z = model(ids)
        F.cross_entropy(z.view(-1, cfg.vocab_size), ids.view(-1)).backward()

    counted = _counted(step)
    model.zero_grad(set_to_none=True)
    parts = inf.transformer_flops(model, T, B=2, training=True)
    N, D = inf.matmul_params(model), 2 * T
    assert parts.param == 6 * N * D
    assert parts.attention == 12 * cfg.n_layers * T * cfg.d_model * D  # 3 x 4 L d per layer per token
    assert counted == parts.total
    assert abs(counted - 6 * model.num_parameters() * D) <= parts.attention  # C07, with all N parameters
    with torch.no_grad():
        assert _counted(lambda: model(ids)) == inf.transformer_flops(model, T, B=2, training=False).total


def test_c07_attention_overtakes_the_parameters_near_6d():
    """Per token and layer: attention 4 L d against 2 (4 d^2 + 2 d d_ff) with d_ff = 4 d; equal at L = 6 d."""
    for d in (128, 768, 4096):
        param = 2 * 4 * d * d + inf.mlp_flops(1, d, 4 * d)
        ratio = [inf.attention_flops(1, d, n_k=L) / param for L in (6 * d - 1, 6 * d, 6 * d + 1)]
        assert ratio[0] < 1 == ratio[1] < ratio[2]


@pytest.mark.equation("17.01", oracle="FlopCounterMode over token-by-token cached decoding (a causal computation)")
def test_causal_prefill_flops_and_the_12d_crossover():
    """A causal computation forms no masked score: decoding one token at a time is one. Its counted FLOPs are
    2NT + attention_flops(T, causal=True); per token the causal term 2(T+1)d meets 24 d^2 at T = 12d - 1
    (Kaplan et al. 2020: n_ctx = 12 d_model)."""
    from llmbook.lm import kv_cache as kc

    model, _ = pretrained_tiny()
    cfg, T = model.config, 40
    ids = torch.randint(0, cfg.vocab_size, (1, T), generator=torch.Generator().manual_seed(3))
    cache = kc.KVCache.for_model(model, 1, T)
    with torch.no_grad():
        counted = _counted(lambda: [kc.forward_cached(model, ids[:, t:t + 1], cache) for t in range(T)])
    N = inf.matmul_params(model)
    assert counted == 2 * N * T + inf.attention_flops(T, cfg.d_model, causal=True, n_layers=cfg.n_layers)
    assert inf.attention_flops(T, cfg.d_model, causal=True) == 2 * T * (T + 1) * cfg.d_model
    for d in (128, 4096):
        per_token = [inf.attention_flops(T, d, causal=True) / T / (2 * 4 * d * d + inf.mlp_flops(1, d, 4 * d))
                     for T in (12 * d - 2, 12 * d - 1, 12 * d)]
        assert per_token[0] < 1 == per_token[1] < per_token[2]


# ----------------------------------------------------------------------------- 17.05-17.09 latencies, serving metrics


@pytest.mark.equation("17.05", oracle="FlopCounterMode FLOPs of a real prefill over the flat roof min(P, BW*inf)")
def test_prefill_latency_is_counted_flops_over_the_peak():
    model, _ = pretrained_tiny()
    cfg = model.config
    ids = torch.randint(0, 100, (1, 48), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        flops = _counted(lambda: model(ids))
    P = inf.H200.peak_flops
    # the estimate the chapter uses for Llama-2-7B: 2N per prompt token plus the attention term
    estimate = 2 * inf.matmul_params(model) * 48 + inf.attention_flops(48, cfg.d_model, n_layers=cfg.n_layers)
    assert math.isclose(inf.prefill_latency(estimate, P), flops / inf.roofline(math.inf, P, inf.H200.BW), rel_tol=REL)
    assert math.isclose(inf.prefill_latency(flops, P, T_overhead=1e-3) - inf.prefill_latency(flops, P), 1e-3,
                        rel_tol=1e-9)
    with pytest.raises(ValueError):
        inf.prefill_latency(1.0, 0.0)


@pytest.mark.equation("17.06", oracle="the roofline identity FLOPs / min(P, BW*AI) = max(FLOPs/P, bytes/BW)")
@pytest.mark.parametrize("B", [1, 8, 64, 512])
def test_decode_latency_against_the_roofline(B):
    flops, nbytes = inf.decode_step_cost(7e9, B, 1024, n_layers=32, d=4096, kv_bytes_per_token=2**19)
    P, BW = inf.H200.peak_flops, inf.H200.BW
    t_roof = flops / inf.roofline(inf.arithmetic_intensity(flops, nbytes), P, BW)
    assert math.isclose(inf.decode_latency(flops, nbytes, P, BW, overlap=True), t_roof, rel_tol=1e-12)
    t_sum = inf.decode_latency(flops, nbytes, P, BW)
    assert t_roof <= t_sum <= 2 * t_roof
    assert math.isclose(t_sum, flops / P + nbytes / BW, rel_tol=REL)
    if B == 1:  # bandwidth-bound: the memory term is more than 100 times the compute term
        assert nbytes / BW > 100 * flops / P


@pytest.mark.equation("17.06", oracle="FlopCounterMode FLOPs and real nbytes (weights, filled cache) of a decode step")
@pytest.mark.parametrize("S", [1, 40])
def test_decode_step_cost_of_a_real_cached_step(S):
    from llmbook.lm import kv_cache as kc

    model, _ = pretrained_tiny()
    cfg = model.config
    ids = torch.randint(0, 100, (1, S + 1), generator=torch.Generator().manual_seed(S))
    cache = kc.KVCache.for_model(model, B=1, S_max=S + 1)
    with torch.no_grad():
        kc.forward_cached(model, ids[:, :S], cache)
        read = sum(p.numel() * p.element_size() for p in model.parameters() if p.dim() == 2) + cache.used_nbytes()
        counted = _counted(lambda: kc.forward_cached(model, ids[:, S:], cache))
    flops, nbytes = inf.decode_step_cost(inf.matmul_params(model), 1, S, n_layers=cfg.n_layers, d=cfg.d_model,
                                         kv_bytes_per_token=kc.kv_cache_bytes(cfg.n_layers, 1, 1, cfg.kv_heads,
                                                                              cfg.head_dim, 4), bytes_per_param=4)
    assert (flops, nbytes) == (counted, read)
    P, BW = inf.H200.peak_flops, inf.H200.BW
    assert math.isclose(inf.decode_latency(flops, nbytes, P, BW), counted / P + read / BW, rel_tol=REL)


def _emission_times(lengths, arrivals, B_max, tau):
    """Brute force: a slot array stepped one step at a time; per request, the times its tokens come out."""
    slots, left, times = [None] * B_max, list(lengths), [[] for _ in lengths]
    waiting, step = sorted(range(len(lengths)), key=lambda i: (arrivals[i], i)), 0
    while waiting or any(s is not None for s in slots):
        for j in range(B_max):
            if slots[j] is None and waiting and arrivals[waiting[0]] <= step:
                slots[j] = waiting.pop(0)
        for j, i in enumerate(slots):
            if i is not None:
                times[i].append((step + 1) * tau)  # a token is out at the end of its step
                left[i] -= 1
                if left[i] == 0:
                    slots[j] = None
        step += 1
    return times, step


@pytest.mark.equation("17.07", oracle="token-emission timeline of a slot-by-slot brute-force schedule")
@pytest.mark.equation("17.08", oracle="token-emission timeline of a slot-by-slot brute-force schedule")
@pytest.mark.equation("17.09", oracle="token-emission timeline of a slot-by-slot brute-force schedule")
def test_ttft_tpot_throughput_against_a_token_timeline():
    g = torch.Generator().manual_seed(3)
    lengths = torch.randint(2, 30, (40,), generator=g).tolist()
    arrivals = torch.randint(0, 120, (40,), generator=g).tolist()
    tau = 0.025  # seconds per decode step
    times, steps = _emission_times(lengths, arrivals, 6, tau)
    run = simulate_batching(lengths, 6, arrivals)
    assert run.steps == steps
    timeline = [[] for _ in lengths]  # the simulator's own token timeline against the brute-force one
    for step, who in enumerate(run.emitted):
        for i in who:
            timeline[i].append((step + 1) * tau)
    assert timeline == times and [len(w) for w in run.emitted] == run.occupancy
    for i in range(40):
        T_queue = (run.admit[i] - arrivals[i]) * tau
        assert math.isclose(inf.ttft(T_queue, tau, 0.0), times[i][0] - arrivals[i] * tau, rel_tol=REL, abs_tol=1e-15)
        gaps = [b - a for a, b in zip(times[i], times[i][1:], strict=False)]
        T_decode_total = (run.finish[i] - run.admit[i] - 1) * tau
        assert math.isclose(inf.tpot(T_decode_total, lengths[i] - 1), sum(gaps) / len(gaps), rel_tol=1e-9)
    n_tokens = sum(len(t) for t in times)
    assert math.isclose(inf.throughput(sum(lengths), run.steps * tau), n_tokens / max(max(t) for t in times),
                        rel_tol=1e-9)
    assert inf.ttft(0.1, 0.2, 0.05) > inf.ttft(0.1, 0.2)
    with pytest.raises(ValueError):
        inf.tpot(1.0, 0)
    with pytest.raises(ValueError):
        inf.throughput(10, 0.0)


# ----------------------------------------------------------------------------- 17.10 / 17.11


@pytest.mark.equation("17.10", oracle="FlopCounterMode FLOPs over the real nbytes of x, W and y")
@pytest.mark.parametrize("m,dtype", [(1, torch.float16), (16, torch.bfloat16), (256, torch.float32)])
def test_arithmetic_intensity_of_a_real_matmul(m, dtype):
    k, n = 512, 384
    x, W = torch.randn(m, k).to(dtype), torch.randn(k, n).to(dtype)
    with FlopCounterMode(display=False) as fc:
        y = x @ W
    moved = sum(t.numel() * t.element_size() for t in (x, W, y))
    b = x.element_size()
    closed = 2 * m * k * n / (b * (m * k + k * n + m * n))  # float64 closed form
    assert math.isclose(inf.arithmetic_intensity(fc.get_total_flops(), moved), closed, rel_tol=REL)
    with pytest.raises(ValueError):
        inf.arithmetic_intensity(1.0, 0)


@pytest.mark.equation("17.11", oracle="a kernel's time max(F/P, M/BW): achieved F/time over a grid, float64")
def test_roofline_is_the_rate_of_the_slower_resource():
    P, BW = inf.H200.peak_flops, inf.H200.BW
    g = torch.Generator().manual_seed(0)
    for F_, M in (torch.rand(50, 2, generator=g, dtype=torch.float64) * 1e12 + 1).tolist():
        achieved = F_ / max(F_ / P, M / BW)
        assert math.isclose(inf.roofline(F_ / M, P, BW), achieved, rel_tol=1e-12)
    ridge = inf.H200.ridge
    assert math.isclose(ridge, 989 / 4.8, rel_tol=REL)
    assert inf.roofline(ridge, P, BW) == pytest.approx(P, rel=1e-12)
    assert inf.roofline(math.inf, P, BW) == P and inf.roofline(0.0, P, BW) == 0.0
    f1, b1 = inf.decode_step_cost(7e9, 1, 0, n_layers=32, d=4096, kv_bytes_per_token=2**19)
    assert inf.arithmetic_intensity(f1, b1) < ridge / 100  # batch-1 decode: far left of the ridge


# ----------------------------------------------------------------------------- the chapter's numbers


def test_try_it_solutions_of_chapter_17():
    """Every number of the chapter's Try-it solutions, computed here; the notebook must state them."""
    from llmbook.lm import kv_cache as kc
    from llmbook.lm import serving as sv
    from tests.try_it import assert_states

    stated = []
    # 1. Llama-2-70B's GQA cache
    tok70, ctx70 = kc.kv_cache_bytes(80, 1, 1, 8, 128), kc.kv_cache_bytes(80, 1, 4096, 8, 128)
    assert (tok70, tok70 // 1024, ctx70 / 2**30) == (327680, 320, 1.25)
    mha_tok, mha_ctx = kc.kv_cache_bytes(80, 1, 1, 64, 128), kc.kv_cache_bytes(80, 1, 4096, 64, 128)
    assert (mha_tok / 2**20, mha_ctx / 2**30) == (2.5, 10.0)
    assert 8 * mha_ctx / 2**30 == 80 and 8 * mha_ctx > 141e9 / 2 and round(2 * 69e9 / 1e9) == 138
    stated += ["327,680 bytes", "320 KiB", "1.25 GiB", "2.5 MiB", "10 GiB", "80 GiB", "138 GB"]
    # 2. where a 7B decode step meets the H200 ridge
    ai = {B: inf.arithmetic_intensity(*inf.decode_step_cost(6.74e9, B, 1024, n_layers=32, d=4096,
                                                              kv_bytes_per_token=2**19)) for B in (1, 1024, 10**9)}
    cap = (2 * 6.74e9 + inf.attention_flops(1, 4096, n_k=1025, n_layers=32)) / (1024 * 2**19)
    assert ai[1] < ai[1024] < ai[10**9] < cap < inf.H200.ridge
    per_seq = 2 * 6.74e9 + inf.attention_flops(1, 4096, n_k=1025, n_layers=32)
    stated += [f"{ai[1]:.2f} at batch 1", f"{ai[1024]:.1f} at batch", f"capped at {cap:.1f}",
               f"{1024 * 2**19 / 1e9:.2f} GB", f"{per_seq / 1e9:.1f} GFLOPs"]
    empty = [inf.arithmetic_intensity(*inf.decode_step_cost(6.74e9, B, 0, n_layers=32, d=4096,
                                                            kv_bytes_per_token=2**19)) for B in (206, 207)]
    assert empty[0] < inf.H200.ridge < empty[1]
    stated += [f"ridge ({inf.H200.ridge:.1f})", "batch 207"]
    # 3. static against continuous batching with 4, 16 and 64 slots
    g = torch.Generator().manual_seed(13)
    wl = torch.randint(5, 200, (64,), generator=g).tolist()
    U = {(Bm, p): sv.batching_utilization(wl, Bm, sv.simulate_batching(wl, Bm, policy=p).steps)
         for Bm in (4, 16, 64) for p in ("static", "continuous")}
    assert U[(64, "static")] == U[(64, "continuous")] < U[(16, "static")] < U[(4, "static")]
    stated += [f"U = {U[(4, 'static')]:.3f}", f"continuous {U[(4, 'continuous')]:.3f}",
               f"{U[(16, 'static')]:.3f} and {U[(16, 'continuous')]:.3f}", f"U = {U[(64, 'static')]:.3f}"]
    assert_states("17-inference.ipynb", stated)


def test_numbers_in_the_prose_of_chapter_17():
    from tests.try_it import assert_states

    model, _ = pretrained_tiny()
    N, d, L = inf.matmul_params(model), model.config.d_model, model.config.n_layers
    assert (model.num_parameters() - N, model.num_parameters()) == (1152, 804480)
    assert N / (2 * L * d) == 784.5 and 6 * d == 768 and 6 * 4096 == 24576
    assert round(inf.mlp_flops(1, 4096, 11008, n_matrices=3) / 1e9, 2) == 0.27
    f, b = inf.decode_step_cost(6.74e9, 1, 1024, n_layers=32, d=4096, kv_bytes_per_token=2**19)
    assert 190 < (b / inf.H200.BW) / (f / inf.H200.peak_flops) < 220  # "about two hundred times"
    assert round(1 / inf.decode_latency(f, b, inf.H200.peak_flops, inf.H200.BW), -1) == 340
    assert round(inf.H200.ridge) == 206 and 512 + 64 == 576 and 2 * 128 * 128 == 32768
    assert_states("17-inference.ipynb", ["1,152", "804,480", "784.5", "$6d = 768$", "24,576", "0.27 GFLOPs",
                                         "about 340 tokens", "206 FLOPs per byte", "576", "32{,}768"], section="all")


def test_numbers_in_the_prose_of_chapter_17_serving_sections():
    """Batch 64 against batch 1, the reader's pace, the causal crossover and the prefix-caching example."""
    from llmbook.lm import kv_cache as kc
    from llmbook.lm import serving_costs as sc
    from tests.try_it import assert_states

    kv_tok, P, BW = kc.kv_cache_bytes(32, 1, 1, 32, 128), inf.H200.peak_flops, inf.H200.BW
    t = {B: inf.decode_latency(*inf.decode_step_cost(6.74e9, B, 1024, n_layers=32, d=4096, kv_bytes_per_token=kv_tok),
                               P, BW) for B in (1, 64)}
    model, _ = pretrained_tiny()
    N, d, L = inf.matmul_params(model), model.config.d_model, model.config.n_layers
    assert N / (L * d) - 1 == 1568 and 12 * d == 1536 and 12 * 4096 == 49152
    assert 140 < 1e3 / (5 * 1.3) < 160  # "one every 150 ms or so"
    full, causal = (inf.attention_flops(8192, 4096, n_layers=32, causal=c) for c in (False, True))
    assert 1 / 9 < (full - causal) / (2 * 6.74e9 * 8192 + full) < 1 / 7  # "an eighth of the full-matrix prefill"
    s = sc.prefix_cache_savings(64, 1000, n_params=6.74e9, n_layers=32, d=4096, kv_bytes_per_token=kv_tok,
                                block_size=16)
    assert s.tokens == 992
    assert_states("17-inference.ipynb", [f"{t[64] / t[1]:.1f} times as long",
                                         f"{64 * t[1] / t[64]:.1f} times the tokens",
                                         f"{64 * 1024 * kv_tok / 1e9:.1f} GB", f"{2 * 6.74e9 / 1e9:.1f} GB of weights",
                                         "$T = N/(Ld) - 1 = 1568$", "$12d = 1536$", "49,152",
                                         f"saves {(full - causal) / 1e12:.1f} TFLOPs"], section="all")
