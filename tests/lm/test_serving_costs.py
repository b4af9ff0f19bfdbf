"""Tensor-parallel communication, prefix caching and MBU (chapter 17) against independent computations.

Oracles and tolerances:

* ring all-reduce bytes: a step-by-step numpy simulation of a ring all-reduce (reduce-scatter, then
  all-gather) over ``p`` ranks that counts the bytes each rank sends and checks the reduced result
  (exact counts; the sum to ``atol = 1e-12``);
* tensor-parallel payload: a Megatron-style split forward pass of the trained tiny GPT, whose logits must
  equal the unsplit model's (float32, ``atol = 2e-5``) and whose all-reduces are counted; the backward
  doubling is Shoeybi et al. (2019)'s statement of four all-reduces per layer in forward and backward;
* prefix caching: ``FlopCounterMode`` over token-by-token cached decoding (a causal computation that
  never forms a masked score) with and without a shared prefix (exact integers), and logits against
  the full forward (``atol = 2e-5``); the memory against an enumeration of blocks by their token
  prefixes, itself checked on a hand-counted example;
* MBU: a hand-computed example (the one Databricks' "LLM inference performance engineering" blog, 2023, uses):
  a 7B fp16 model at 14 ms per token on a 2 TB/s GPU runs at 50 % MBU.
"""

from __future__ import annotations

import copy
import math

import numpy as np
import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from llmbook.lm import inference as inf
from llmbook.lm import kv_cache as kc
from llmbook.lm import serving_costs as sc
from llmbook.lm.gpt import GPTConfig, TinyGPT
from llmbook.lm.training import pretrained_tiny


def _counted(fn) -> int:
    with FlopCounterMode(display=False) as counter:
        fn()
    return counter.get_total_flops()


def _ring_allreduce(chunks: list[np.ndarray]) -> tuple[list[np.ndarray], list[int]]:
    """Simulate a ring all-reduce of one array per rank; returns every rank's result and bytes sent."""
    p = len(chunks)
    parts = [list(np.array_split(c.astype(np.float64), p)) for c in chunks]
    sent = [0] * p
    for s in range(p - 1):  # reduce-scatter: rank r passes chunk (r - s) to rank r + 1, which adds it
        msgs = [(r, (r - s) % p, parts[r][(r - s) % p].copy()) for r in range(p)]
        for r, j, m in msgs:
            parts[(r + 1) % p][j] += m
            sent[r] += m.nbytes
    for s in range(p - 1):  # all-gather: rank r passes its finished chunk (r + 1 - s) to rank r + 1
        msgs = [(r, (r + 1 - s) % p, parts[r][(r + 1 - s) % p].copy()) for r in range(p)]
        for r, j, m in msgs:
            parts[(r + 1) % p][j] = m
            sent[r] += m.nbytes
    return [np.concatenate(q) for q in parts], sent


@pytest.mark.parametrize("p", [1, 2, 4, 8])
def test_ring_allreduce_bytes_against_a_simulated_ring(p):
    rng = np.random.default_rng(p)
    x = [rng.standard_normal(64 * 3) for _ in range(p)]
    out, sent = _ring_allreduce(x)
    for o in out:
        np.testing.assert_allclose(o, np.sum(x, axis=0), atol=1e-12)
    assert sent == [sc.ring_allreduce_bytes(x[0].nbytes, p)] * p


@pytest.mark.parametrize("p", [1, 2, 4])
def test_tensor_parallel_forward_needs_two_allreduces_per_layer(p):
    model, _ = pretrained_tiny()
    ids = torch.randint(0, 100, (2, 24), generator=torch.Generator().manual_seed(p))
    with torch.no_grad():
        z, sizes = sc.tensor_parallel_forward(model, ids, p)
        torch.testing.assert_close(z, model(ids), atol=2e-5, rtol=0)
    L, d = model.config.n_layers, model.config.d_model
    assert sizes == [2 * 24 * d] * (2 * L)  # one (B, T, d) tensor after each sublayer
    assert sc.tp_allreduce_bytes(2, 24, d, n_layers=L, bytes_per_elem=4) == 4 * sum(sizes)
    assert sc.tp_allreduce_bytes(2, 24, d, n_layers=L, training=True) == 2 * sc.tp_allreduce_bytes(2, 24, d, n_layers=L)


def test_tensor_parallel_forward_with_gqa():
    torch.manual_seed(0)
    model = TinyGPT(GPTConfig(vocab_size=50, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=96))
    ids = torch.randint(0, 50, (1, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        z, sizes = sc.tensor_parallel_forward(model, ids, 2)
        torch.testing.assert_close(z, model(ids), atol=2e-5, rtol=0)
    assert len(sizes) == 4
    with pytest.raises(ValueError, match="must divide"):
        sc.tensor_parallel_forward(model, ids, 4)  # 2 key/value heads over 4 GPUs


def test_llama2_70b_tensor_parallel_bytes_per_token():
    payload = sc.tp_allreduce_bytes(1, 1, 8192, n_layers=80)
    assert payload == 2 * 80 * 8192 * 2 == 2_621_440  # 2.5 MiB per token in bf16
    assert sc.ring_allreduce_bytes(payload, 8) == 2 * 7 / 8 * payload


def test_prefix_caching_flops_and_logits_against_cached_decoding():
    model, _ = pretrained_tiny()
    cfg, g = model.config, torch.Generator().manual_seed(5)
    P, n = 10, 3
    prefix = torch.randint(0, 100, (1, P), generator=g)
    suffixes = [torch.randint(0, 100, (1, s), generator=g) for s in (4, 6, 5)]

    def one_by_one(ids, cache):
        return [kc.forward_cached(model, ids[:, t:t + 1], cache) for t in range(ids.shape[1])]

    with torch.no_grad():
        alone = _counted(lambda: [one_by_one(torch.cat([prefix, s], 1), kc.KVCache.for_model(model, 1))
                                  for s in suffixes])
        shared_cache = kc.KVCache.for_model(model, 1)
        logits = []

        def shared():
            one_by_one(prefix, shared_cache)
            for s in suffixes:
                logits.append(one_by_one(s, copy.deepcopy(shared_cache))[-1])

        counted_shared = _counted(shared)
        for s, z in zip(suffixes, logits, strict=True):
            torch.testing.assert_close(z[:, -1], model(torch.cat([prefix, s], 1))[:, -1], atol=2e-5, rtol=0)
    kv_tok = kc.kv_cache_bytes(cfg.n_layers, 1, 1, cfg.kv_heads, cfg.head_dim, 4)
    saved = sc.prefix_cache_savings(n, P, n_params=inf.matmul_params(model), n_layers=cfg.n_layers, d=cfg.d_model,
                                    kv_bytes_per_token=kv_tok)
    assert alone - counted_shared == saved.flops
    assert saved.bytes == (n - 1) * P * kc.kv_cache_bytes(cfg.n_layers, 1, 1, cfg.kv_heads, cfg.head_dim, 4)


def test_shared_prefix_blocks_by_hand():
    # blocks of 2: (1,2) is shared by all three; (3,4) and (3,9) differ; [5] and [7] are partial
    assert sc.shared_prefix_blocks([[1, 2, 3, 4, 5], [1, 2, 3, 9], [1, 2, 7]], 2) == (7, 5)
    assert sc.shared_prefix_blocks([[1, 2, 3], [4, 2, 3]], 1) == (6, 6)  # same tokens after another start: none shared
    assert sc.shared_prefix_blocks([], 4) == (0, 0)


@pytest.mark.parametrize("P,b", [(100, 16), (96, 16), (7, 16), (33, 1)])
def test_prefix_memory_against_block_enumeration(P, b):
    rng = np.random.default_rng(P + b)
    prefix = rng.integers(0, 1000, P).tolist()
    reqs = [prefix + [1000 + i] + rng.integers(0, 1000, int(rng.integers(0, 50))).tolist() for i in range(12)]
    unshared, shared = sc.shared_prefix_blocks(reqs, b)
    s = sc.prefix_cache_savings(12, P, n_params=1.0, n_layers=1, d=1, kv_bytes_per_token=3.0, block_size=b)
    assert (unshared - shared) * b * 3.0 == s.bytes
    assert s.tokens == P // b * b


def test_mbu_published_example_and_the_roofline():
    assert sc.model_bandwidth_utilization(14e9, 14e-3, 2e12) == pytest.approx(0.5, rel=1e-12)
    f, b = inf.decode_step_cost(6.74e9, 1, 1024, n_layers=32, d=4096, kv_bytes_per_token=2**19)
    P, BW = inf.H200.peak_flops, inf.H200.BW
    t_lower = inf.decode_latency(f, b, P, BW, overlap=True)  # bandwidth-bound: streams at the peak
    assert sc.model_bandwidth_utilization(b, t_lower, BW) == pytest.approx(1.0, rel=1e-12)
    t_sum = inf.decode_latency(f, b, P, BW)
    assert math.isclose(sc.model_bandwidth_utilization(b, t_sum, BW), (b / BW) / (b / BW + f / P), rel_tol=1e-12)


def test_bad_input_raises_clear_errors():
    with pytest.raises(ValueError, match="p"):
        sc.ring_allreduce_bytes(10, 0)
    with pytest.raises(ValueError, match="step_time"):
        sc.model_bandwidth_utilization(1e9, 0.0, 1e12)
    with pytest.raises(TypeError, match="training"):
        sc.tp_allreduce_bytes(1, 1, 8, training=1)
    with pytest.raises(ValueError, match="n_requests"):
        sc.prefix_cache_savings(0, 10, n_params=1.0, n_layers=1, d=1, kv_bytes_per_token=1.0)
    with pytest.raises(ValueError, match="block_size"):
        sc.shared_prefix_blocks([[1, 2]], 0)
