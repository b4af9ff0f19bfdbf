"""KV-cache memory (17.03), the MQA/GQA ratio (17.04) and cached decoding with the tiny GPT (claim C11).

Oracles: ``.numel() * .element_size()`` of real cache tensors (ours, from the tiny GPT's cached decoding,
and ``transformers``' ``DynamicCache`` of ``LlamaForCausalLM`` at Llama-2-7B and Llama-2-70B sizes on the
meta device), compared exactly; the full forward pass of the same model for cached logits
(float32: ``atol = 2e-5`` on logits of size about 10; float64: ``atol = 1e-10``); ``transformers``'
own cached decoding of the same weights (float64 model, ``atol = 1e-6``: transformers forms RoPE angles
in float32); ``TinyGPT.generate`` for greedy
tokens (equal). MLA against the DeepSeek-V2 paper's per-token count :math:`(d_c + d_h^R) l`.
"""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from llmbook.lm import kv_cache as kc
from llmbook.lm.gpt import GPTConfig, TinyGPT
from llmbook.lm.training import pretrained_tiny

F32 = dict(atol=2e-5, rtol=0.0)
F64 = dict(atol=1e-10, rtol=0.0)
HF = dict(atol=1e-6, rtol=0.0)  # transformers forms the RoPE angles in float32 even for a float64 model (diff ~5e-8)


def _tiny():
    model, tok = pretrained_tiny()
    return model, tok


def _decode_incrementally(model, ids, cache, prefill: int, chunk: int = 1):
    outs = [kc.forward_cached(model, ids[:, :prefill], cache)]
    for t in range(prefill, ids.shape[1], chunk):
        outs.append(kc.forward_cached(model, ids[:, t:t + chunk], cache))
    return torch.cat(outs, 1)


def _hf_cache_bytes(cache) -> int:
    return sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values))


# ----------------------------------------------------------------------------- cached decoding (C11)


@pytest.mark.parametrize("prefill,chunk", [(1, 1), (20, 1), (10, 7)])
def test_cached_logits_equal_the_full_forward(prefill, chunk):
    model, tok = _tiny()
    ids = torch.as_tensor(tok.encode("The cache keeps every key and value it has seen."), dtype=torch.long)[None]
    with torch.no_grad():
        full = model(ids)
        cache = kc.KVCache.for_model(model, 1)
        inc = _decode_incrementally(model, ids, cache, prefill, chunk)
    torch.testing.assert_close(inc, full, **F32)
    assert cache.length == ids.shape[1]


def test_cached_logits_in_float64_with_gqa_and_a_batch():
    torch.manual_seed(0)
    model = TinyGPT(GPTConfig(vocab_size=50, d_model=48, n_layers=3, n_heads=6, n_kv_heads=2, d_ff=96)).double()
    ids = torch.randint(0, 50, (3, 30), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        cache = kc.KVCache.for_model(model, 3, 40)
        torch.testing.assert_close(_decode_incrementally(model, ids, cache, 11), model(ids), **F64)
    assert cache.k[0].shape == (3, 2, 40, 8)


def test_cached_decoding_matches_transformers_llama_with_its_cache():
    cfg = LlamaConfig(vocab_size=60, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-6, tie_word_embeddings=False)
    torch.manual_seed(0)
    hf = LlamaForCausalLM(cfg).double().eval()
    ours = TinyGPT.from_llama(hf).eval()
    ids = torch.randint(0, 60, (2, 12), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        out = hf(ids[:, :8], use_cache=True)
        hf_cache = out.cache
        hf_logits = [out.logits] + [hf(ids[:, t:t + 1], cache=hf_cache, use_cache=True).logits
                                    for t in range(8, 12)]
        cache = kc.KVCache.for_model(ours, 2, 12)
        our_logits = _decode_incrementally(ours, ids, cache, 8)
    torch.testing.assert_close(our_logits, torch.cat(hf_logits, 1), **HF)
    assert cache.nbytes() == _hf_cache_bytes(hf_cache)  # both hold 12 tokens: same tensors, same bytes
    for layer in range(2):
        torch.testing.assert_close(cache.k[layer], hf_cache.layers[layer].keys, **HF)


def test_generate_cached_gives_the_same_tokens_as_generate():
    model, tok = _tiny()
    ids = torch.as_tensor(tok.encode("The model "), dtype=torch.long)[None]
    assert torch.equal(kc.generate_cached(model, ids, 40, tau=0), model.generate(ids, 40, tau=0))
    g1, g2 = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
    assert torch.equal(kc.generate_cached(model, ids, 30, g1, tau=0.8), model.generate(ids, 30, g2, tau=0.8))
    with pytest.raises(ValueError, match="S_max"):
        kc.generate_cached(model, ids, 5, cache=kc.KVCache.for_model(model, 1, 8))


# ----------------------------------------------------------------------------- 17.03 KV bytes


@pytest.mark.equation("17.03", oracle="numel() * element_size() of the tiny GPT's real cache tensors")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_kv_cache_bytes_equal_the_real_cache_tensors(dtype):
    model, tok = _tiny()
    model = model.to(dtype)
    cfg = model.config
    ids = torch.as_tensor(tok.encode("Keys and values."), dtype=torch.long)[None].repeat(2, 1)
    cache = kc.KVCache.for_model(model, B=2, S_max=64)
    with torch.no_grad():
        _decode_incrementally(model, ids, cache, 5)
    b = torch.finfo(dtype).bits // 8
    real = sum(t.numel() * t.element_size() for t in cache.k + cache.v)
    assert real == kc.kv_cache_bytes(cfg.n_layers, 2, 64, cfg.kv_heads, cfg.head_dim, b) == cache.nbytes()
    used = sum(t[:, :, :cache.length].numel() * t.element_size() for t in cache.k + cache.v)
    assert used == kc.kv_cache_bytes(cfg.n_layers, 2, ids.shape[1], cfg.kv_heads, cfg.head_dim, b)


@pytest.mark.equation("17.03", oracle="transformers DynamicCache of LlamaForCausalLM at Llama-2-7B size (meta device)")
def test_llama2_7b_holds_512_kib_per_token():
    cfg = LlamaConfig(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                      num_attention_heads=32, num_key_value_heads=32, max_position_embeddings=4096)
    with torch.device("meta"):
        hf = LlamaForCausalLM(cfg).to(torch.float16)
    with torch.no_grad():
        cache = hf(torch.zeros(1, 3, dtype=torch.long, device="meta"), use_cache=True).cache
    assert _hf_cache_bytes(cache) == kc.kv_cache_bytes(32, 1, 3, 32, 128) == 3 * 512 * 1024


# ----------------------------------------------------------------------------- 17.04 the GQA ratio


@pytest.mark.equation("17.04", oracle="ratio of the bytes of real caches of tiny GPTs with H_kv = 4, 2, 1")
def test_kv_memory_ratio_from_real_caches():
    ids = torch.randint(0, 64, (1, 9), generator=torch.Generator().manual_seed(0))
    used = {}
    for H_kv in (4, 2, 1):
        torch.manual_seed(0)
        model = TinyGPT(GPTConfig(n_heads=4, n_kv_heads=H_kv))
        cache = kc.KVCache.for_model(model, 1, 16)
        with torch.no_grad():
            kc.forward_cached(model, ids, cache)
        used[H_kv] = cache.used_nbytes()
    for H_kv in (2, 1):
        assert used[H_kv] / used[4] == kc.kv_memory_ratio(H_kv, 4)
    with pytest.raises(ValueError, match="divide"):
        kc.kv_memory_ratio(3, 4)


@pytest.mark.equation("17.04", oracle="transformers DynamicCache at Llama-2-70B size (meta device), GQA against MHA")
def test_llama2_70b_gqa_ratio_from_transformers():
    sizes = {}
    for H_kv in (64, 8):
        cfg = LlamaConfig(vocab_size=32000, hidden_size=8192, intermediate_size=28672, num_hidden_layers=2,
                          num_attention_heads=64, num_key_value_heads=H_kv)
        with torch.device("meta"):
            hf = LlamaForCausalLM(cfg).to(torch.float16)
        with torch.no_grad():
            sizes[H_kv] = _hf_cache_bytes(hf(torch.zeros(1, 2, dtype=torch.long, device="meta"),
                                              use_cache=True).cache)
    assert sizes[8] / sizes[64] == kc.kv_memory_ratio(8, 64) == 0.125


def test_bytes_per_token_of_mha_gqa_mqa_mla():
    kinds = [kc.kv_bytes_per_token(k, 32, 32, 128, H_kv=8, d_c=512, d_rope=64) for k in kc.ATTENTION_KINDS]
    assert kinds == [512 * 1024, 128 * 1024, 16 * 1024, 36 * 1024]
    # DeepSeek-V2 (60 layers, 128 heads of 128): MLA caches (d_c + d_h^R) l = 4.5 d_h l numbers per token
    mla = kc.kv_bytes_per_token("MLA", 60, 128, 128, d_c=512, d_rope=64)
    assert mla == 4.5 * 128 * 60 * 2 == 69120
    assert kc.kv_bytes_per_token("MHA", 60, 128, 128) / mla == pytest.approx(2 * 128 / 4.5)
    with pytest.raises(ValueError):
        kc.kv_bytes_per_token("MLA", 32, 32, 128)
    with pytest.raises(ValueError):
        kc.kv_bytes_per_token("GQA", 32, 32, 128)


def test_left_padded_batch_matches_each_prompt_alone():
    """Per-row positions and a key mask (the assistant's batched decoding) against each prompt run unpadded."""
    from llmbook.lm.gpt import GPTConfig, TinyGPT
    from llmbook.lm.kv_cache import KVCache, forward_cached

    torch.manual_seed(0)
    model = TinyGPT(GPTConfig(vocab_size=30, d_model=32, n_layers=2, n_heads=4, max_seq_len=32)).double().eval()
    rows = [[3, 4, 5, 6, 7], [8, 9, 10], [11]]
    width = max(map(len, rows))
    ids = torch.tensor([[0] * (width - len(r)) + r for r in rows])
    valid = torch.tensor([[False] * (width - len(r)) + [True] * len(r) for r in rows])
    pos = (valid.long().cumsum(1) - 1).clamp(min=0)
    cache = KVCache.for_model(model, 3, width + 2)
    with torch.no_grad():
        z = forward_cached(model, ids, cache, positions=pos, key_mask=valid)[:, -1]
        nxt = torch.tensor([[1], [2], [3]])
        mask2 = torch.cat([valid, torch.ones(3, 1, dtype=torch.bool)], 1)
        z2 = forward_cached(model, nxt, cache, positions=pos[:, -1:] + 1, key_mask=mask2)[:, -1]
        for b, r in enumerate(rows):
            alone = model(torch.tensor([r + [int(nxt[b])]]))[0]
            torch.testing.assert_close(z[b], alone[-2], atol=1e-12, rtol=0)
            torch.testing.assert_close(z2[b], alone[-1], atol=1e-12, rtol=0)
    with pytest.raises(ValueError, match="key_mask"):
        forward_cached(model, ids, KVCache.for_model(model, 3, 8), positions=pos, key_mask=valid[:, :2])
