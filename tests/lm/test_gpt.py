"""The tiny GPT of chapter 2 against transformers' LlamaForCausalLM with the same weights.

The Llama model is built from a ``LlamaConfig`` with random weights (no download), eager attention.
Its weights are then spread out (matrices N(0, 0.3^2), norm gains 1 + N(0, 0.1^2)) so the logits are
of order one and a swapped or mis-mapped parameter could not hide below the tolerance. Tolerances:
``rtol = atol = 1e-5`` (``F32``) in float32 and float64 alike (Llama computes its norms and softmax in
float32 whatever the dtype); generated token ids exactly.
"""

import pytest
import torch
import transformers
from hypothesis import given, settings
from hypothesis import strategies as st

from llmbook.lm.gpt import GPTConfig, TinyGPT, llama_key_map

F32 = dict(rtol=1e-5, atol=1e-5)


def tiny_llama(n_kv_heads=2, tie=True, dtype=torch.float32, seed=0):
    cfg = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=n_kv_heads,
        intermediate_size=88, rope_theta=10000.0, max_position_embeddings=128, tie_word_embeddings=tie,
        attn_implementation="eager")
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p) if p.ndim == 1 else 0.3 * torch.randn_like(p))
    return model.to(dtype)


@pytest.fixture(scope="module")
def llama():
    return tiny_llama()


@pytest.mark.equation("02.04", "02.05", oracle="transformers.LlamaForCausalLM logits, same weights (tied, pre-norm)")
@pytest.mark.parametrize("n_kv_heads", [4, 2, 1])  # MHA, GQA, MQA
def test_logits_match_llama(n_kv_heads):
    llama = tiny_llama(n_kv_heads)
    ours = TinyGPT.from_llama(llama).eval()
    assert ours.config.kv_heads == n_kv_heads and ours.config.rope_theta == 10000.0
    assert ours.head.weight is ours.embed.weight
    ids = torch.randint(0, 64, (3, 13))
    with torch.no_grad():
        torch.testing.assert_close(ours(ids), llama(ids).logits, **F32)


def test_untied_and_float64_match_llama():
    # Llama upcasts to float32 *whatever the input dtype* in RMSNorm and the attention softmax, so a
    # float64 Llama is float32-accurate: the comparison keeps the float32 tolerance.
    llama = tiny_llama(tie=False, dtype=torch.float64, seed=1)
    ours = TinyGPT.from_llama(llama).eval()
    assert not ours.config.tie_embeddings and ours.head.weight is not ours.embed.weight
    assert ours.embed.weight.dtype == torch.float64
    ids = torch.randint(0, 64, (2, 9))
    with torch.no_grad():
        torch.testing.assert_close(ours(ids), llama(ids).logits, **F32)
    assert ours.num_parameters() == sum(p.numel() for p in llama.parameters())


def test_positions_move_rope_like_llama_position_ids(llama):
    ours = TinyGPT.from_llama(llama).eval()
    ids = torch.randint(0, 64, (2, 7))
    positions = torch.arange(20, 27)
    with torch.no_grad():
        ref = llama(ids, position_ids=positions.expand(2, -1)).logits
        torch.testing.assert_close(ours(ids, positions=positions), ref, **F32)


def test_greedy_generation_matches_llama_generate(llama):
    ours = TinyGPT.from_llama(llama).eval()
    prompt = torch.randint(0, 64, (2, 4))
    ref = llama.generate(prompt, max_new_tokens=6, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert torch.equal(ours.generate(prompt, 6, tau=0), ref)
    assert torch.equal(ours.generate(prompt, 6, top_k=1), ref)  # one candidate left: sampling is greedy


def test_sampling_is_reproducible_and_valid(llama):
    ours = TinyGPT.from_llama(llama).eval()
    prompt = torch.randint(0, 64, (3, 2))
    a = ours.generate(prompt, 6, generator=torch.Generator().manual_seed(4), tau=0.8, top_p=0.9)
    b = ours.generate(prompt, 6, generator=torch.Generator().manual_seed(4), tau=0.8, top_p=0.9)
    assert torch.equal(a, b) and a.shape == (3, 8) and torch.equal(a[:, :2], prompt)
    assert ((a >= 0) & (a < 64)).all()


@pytest.fixture(scope="module")
def toy():
    torch.manual_seed(0)
    return TinyGPT(GPTConfig()).eval(), torch.randint(0, 64, (1, 10))


@settings(max_examples=10, deadline=None, derandomize=True)
@given(t=st.integers(1, 9), token=st.integers(0, 63))
def test_causal_future_tokens_do_not_change_the_past(toy, t, token):
    model, ids = toy
    changed = ids.clone()
    changed[0, t] = token
    with torch.no_grad():
        torch.testing.assert_close(model(changed)[:, :t], model(ids)[:, :t], rtol=0, atol=0)


def test_key_map_covers_every_parameter():
    for tie in (True, False):
        model = TinyGPT(GPTConfig(tie_embeddings=tie, n_layers=3))
        mapped = set(llama_key_map(3, tie))
        names = set(model.state_dict())
        assert mapped == (names - {"head.weight"} if tie else names)


def test_bad_configs_and_weights_are_rejected(llama):
    with pytest.raises(ValueError, match=r"d_model \(30\) must be divisible by n_heads \(4\)"):
        GPTConfig(d_model=30)
    with pytest.raises(ValueError, match=r"n_heads \(4\) must be divisible by n_kv_heads \(3\)"):
        GPTConfig(n_kv_heads=3)
    with pytest.raises(ValueError, match="must be even for RoPE"):
        GPTConfig(d_model=12, n_heads=4)
    with pytest.raises(ValueError, match="keys with no place in this model"):
        TinyGPT(GPTConfig(n_layers=1)).load_llama_weights(llama)
    with pytest.raises(ValueError, match="lacks 9 keys"):
        TinyGPT(GPTConfig(n_layers=3)).load_llama_weights(llama)
    with pytest.raises(ValueError, match=r"has shape \(16, 32\) but blocks.0.attn.k_proj.weight needs \(32, 32\)"):
        TinyGPT(GPTConfig(n_kv_heads=4)).load_llama_weights(llama)
    state = dict(llama.state_dict())
    state["lm_head.weight"] = state["lm_head.weight"] + 1
    with pytest.raises(ValueError, match="lm_head.weight differs from embed_tokens"):
        TinyGPT(GPTConfig()).load_llama_weights(state)
    model = TinyGPT(GPTConfig())
    with pytest.raises(ValueError, match=r"token ids in \[0, V\) = \[0, 64\)"):
        model(torch.tensor([[1, 64]]))
    with pytest.raises(ValueError, match=r"positions must have shape \(T,\) = \(2,\)"):
        model(torch.tensor([[1, 2]]), positions=torch.arange(3))
    with pytest.raises(ValueError, match="max_new_tokens must be a non-negative int"):
        model.generate(torch.tensor([[1]]), -1)
    bad = transformers.LlamaConfig(hidden_act="gelu", vocab_size=8, hidden_size=8, num_attention_heads=2,
                                   num_key_value_heads=2, intermediate_size=8, num_hidden_layers=1)
    with pytest.raises(ValueError, match="hidden_act must be 'silu'"):
        GPTConfig.from_llama_config(bad)
